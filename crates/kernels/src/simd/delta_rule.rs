//! The gated delta-rule step ([`crate::delta_rule::step`]): AVX2 and AVX-512 kernels and their
//! safe entry point. Per state row, one pass scales the row by the decay and dots it with `k`,
//! a second adds `d_j · k` and dots with `q`; two accumulators per dot (even / odd chunks) and
//! the same reduction for every row.

use super::SimdLevel;

/// One gated delta-rule step ([`crate::delta_rule::step`]) at a SIMD `level`.
pub(crate) fn delta_rule_step(
    level: SimdLevel,
    x: crate::delta_rule::DeltaInputs<'_>,
    state_in: &[f32],
    state_out: &mut [f32],
    out: &mut [f32],
) {
    let dim = x.k.len();
    assert!(
        x.q.len() == dim
            && out.len() == x.v.len()
            && state_in.len() == x.v.len() * dim
            && state_out.len() == state_in.len(),
        "delta rule: sizes"
    );
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the sizes match (checked above).
    unsafe {
        match level {
            SimdLevel::Avx2 => avx2::delta_rule_step(x, state_in, state_out, out),
            _ => avx512::delta_rule_step(x, state_in, state_out, out),
        }
    }
}

/// The chain kernel `$module::$kernel::<C>` for `C = $chunks`, one of the listed register counts a
/// state row takes (the caller has checked it is one of them).
#[cfg(target_arch = "x86_64")]
macro_rules! by_chunks {
    ($module:ident :: $kernel:ident, $chunks:expr, $($c:literal)+) => {
        match $chunks {
            $($c => $module::$kernel::<$c>,)+
            n => unreachable!("a chain of {n} registers a row"),
        }
    };
}

/// [`crate::delta_rule::chain`] with each state row in registers, where `level` has a kernel
/// for the head size (AVX-512: `k.len()` a multiple of 16 up to 128; AVX2: a multiple of 8 up
/// to 128); returns whether it ran. The caller has checked the shapes and plane indices.
pub(crate) fn delta_rule_chain(
    level: SimdLevel,
    xs: &[crate::delta_rule::DeltaInputs<'_>],
    planes: &mut [f32],
    read: usize,
    writes: &[Option<usize>],
    out: &mut [f32],
    recording: Option<crate::delta_rule::Recording<'_, '_>>,
) -> bool {
    let Some(first) = xs.first() else {
        return true;
    };
    let (dim, values) = (first.k.len(), first.v.len());
    let state_len = values * dim;
    assert!(
        xs.iter()
            .all(|x| x.k.len() == dim && x.q.len() == dim && x.v.len() == values)
            && out.len() == xs.len() * values
            && writes.len() == xs.len()
            && recording
                .as_ref()
                .is_none_or(|r| r.deltas.len() == out.len()
                    && r.prefix
                        .iter()
                        .all(|s| s.k.len() == dim && s.delta.len() == values))
            && (read + 1) * state_len <= planes.len()
            && writes
                .iter()
                .flatten()
                .all(|&p| (p + 1) * state_len <= planes.len()),
        "delta rule chain: sizes"
    );
    level.assert_supported();
    if level == SimdLevel::Avx2 {
        let chunks = dim / 8;
        if !dim.is_multiple_of(8) || !(1..=16).contains(&chunks) {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: AVX2 is supported; the shapes and every plane the chain touches are
            // checked above; `dim` is `8 · CHUNKS`.
            unsafe {
                let run = by_chunks!(avx2::delta_rule_chain, chunks, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
                run(xs, planes, read, writes, out, recording);
            }
            return true;
        }
    }
    let chunks = dim / 16;
    if level < SimdLevel::Avx512 || !dim.is_multiple_of(16) || !(1..=8).contains(&chunks) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512 is supported; the shapes and every plane the chain touches are
        // checked above; `dim` is `16 · CHUNKS`.
        unsafe {
            let run = by_chunks!(avx512::delta_rule_chain, chunks, 1 2 3 4 5 6 7 8);
            run(xs, planes, read, writes, out, recording);
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`crate::delta_rule::replay`] at `level`: `false` (nothing done) where there is no kernel
/// for the shape (below AVX-512, or keys not a multiple of 16).
pub(crate) fn delta_rule_replay(
    level: SimdLevel,
    steps: &[crate::delta_rule::RankOne<'_>],
    state_in: &[f32],
    state_out: &mut [f32],
) -> bool {
    let Some(first) = steps.first() else {
        return false;
    };
    let dim = first.k.len();
    if level < SimdLevel::Avx512 || dim == 0 || !dim.is_multiple_of(16) {
        return false;
    }
    assert!(
        state_out.len() == state_in.len()
            && steps
                .iter()
                .all(|s| s.k.len() == dim && s.delta.len() * dim == state_in.len()),
        "delta rule replay: sizes"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512 is supported; every step has `dim` keys (a multiple of 16) and a
        // delta per state row of `dim` values, and both states hold those rows (checked above).
        unsafe { avx512::delta_rule_replay(steps, state_in, state_out) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::simd::x86::avx2::reduce8;

    /// [`super::delta_rule_chain`] for heads of exactly `8 · CHUNKS` key values: per state row,
    /// the row loaded once, taken through the recorded prefix (the replay's multiply and fused
    /// multiply-add) and then through every step with the instructions of [`delta_rule_step`]
    /// (so the same bits), each step's `δ` recorded when asked, each kept state row stored
    /// once — non-temporally when the planes' rows sit on cache lines (a multiple of 16 values
    /// in a snapshot ring's aligned planes), then one `sfence`. A row of 128 values fills
    /// AVX2's 16 registers, so part of it lives in L1 between steps, where the one-step kernel
    /// read and wrote it once a step through a call.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA are supported; every step has `8 · CHUNKS` keys and queries and as many
    /// values as the first; `out` holds a value per step and state row; plane `read` and every
    /// written plane (of `values · 8 · CHUNKS` values each) lie inside `planes`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn delta_rule_chain<const CHUNKS: usize>(
        xs: &[crate::delta_rule::DeltaInputs<'_>],
        planes: &mut [f32],
        read: usize,
        writes: &[Option<usize>],
        out: &mut [f32],
        recording: Option<crate::delta_rule::Recording<'_, '_>>,
    ) {
        let dim = 8 * CHUNKS;
        let (mut deltas, prefix) = match recording {
            Some(r) => (Some(r.deltas), r.prefix),
            None => (None, &[][..]),
        };
        let values = xs[0].v.len();
        let state_len = values * dim;
        let base = planes.as_mut_ptr();
        // Rows of a multiple of 16 values keep a line-aligned plane's rows on lines.
        let stream = (base as usize).is_multiple_of(64) && dim.is_multiple_of(16);
        for j in 0..values {
            // SAFETY: row `j` of every plane named holds `dim` values (the caller's contract);
            // the read plane's row is loaded before any step stores to it.
            unsafe {
                let row_at = |plane: usize| base.add(plane * state_len + j * dim);
                let mut row: [__m256; CHUNKS] =
                    std::array::from_fn(|c| _mm256_loadu_ps(row_at(read).add(8 * c)));
                for step in prefix {
                    let (decay, delta) =
                        (_mm256_set1_ps(step.decay), _mm256_set1_ps(step.delta[j]));
                    for (c, value) in row.iter_mut().enumerate() {
                        let k = _mm256_loadu_ps(step.k.as_ptr().add(8 * c));
                        *value = _mm256_fmadd_ps(delta, k, _mm256_mul_ps(*value, decay));
                    }
                }
                for (i, x) in xs.iter().enumerate() {
                    let (kp, qp) = (x.k.as_ptr(), x.q.as_ptr());
                    let decay = _mm256_set1_ps(x.decay);
                    let mut acc = [_mm256_setzero_ps(); 2];
                    for c in 0..CHUNKS {
                        row[c] = _mm256_mul_ps(row[c], decay);
                        acc[c % 2] =
                            _mm256_fmadd_ps(row[c], _mm256_loadu_ps(kp.add(8 * c)), acc[c % 2]);
                    }
                    let predicted = reduce8(_mm256_add_ps(acc[0], acc[1]));
                    let d = (x.v[j] - predicted) * x.beta;
                    if let Some(deltas) = deltas.as_deref_mut() {
                        deltas[i * values + j] = d;
                    }
                    let delta = _mm256_set1_ps(d);
                    let dst = writes[i].map(row_at);
                    let mut acc = [_mm256_setzero_ps(); 2];
                    for c in 0..CHUNKS {
                        row[c] = _mm256_fmadd_ps(delta, _mm256_loadu_ps(kp.add(8 * c)), row[c]);
                        match dst {
                            Some(dst) if stream => _mm256_stream_ps(dst.add(8 * c), row[c]),
                            Some(dst) => _mm256_storeu_ps(dst.add(8 * c), row[c]),
                            None => {}
                        }
                        acc[c % 2] =
                            _mm256_fmadd_ps(row[c], _mm256_loadu_ps(qp.add(8 * c)), acc[c % 2]);
                    }
                    out[i * values + j] = reduce8(_mm256_add_ps(acc[0], acc[1]));
                }
            }
        }
        if stream {
            // The non-temporal stores ordered before whatever the caller does next (another
            // thread reads the planes after a join).
            _mm_sfence();
        }
    }

    /// One gated delta-rule step ([`crate::delta_rule::step`]), as the AVX-512 version with
    /// 8-lane chunks (a scalar-padded copy of a ragged tail).
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; `q.len() == k.len()`, `out.len() == v.len()` and both
    /// states hold `v.len() · k.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn delta_rule_step(
        x: crate::delta_rule::DeltaInputs<'_>,
        state_in: &[f32],
        state_out: &mut [f32],
        out: &mut [f32],
    ) {
        let dim = x.k.len();
        let full = dim / 8;
        let rest = dim - 8 * full;
        // The tail through 8-value buffers padded with zeros (zero lanes add nothing).
        let padded = |src: &[f32]| -> [f32; 8] {
            let mut buf = [0.0f32; 8];
            buf[..rest].copy_from_slice(&src[8 * full..]);
            buf
        };
        let (k_tail, q_tail) = (padded(x.k), padded(x.q));
        let decay = _mm256_set1_ps(x.decay);
        for (j, o) in out.iter_mut().enumerate() {
            let row_in = &state_in[j * dim..(j + 1) * dim];
            let row_out = &mut state_out[j * dim..(j + 1) * dim];
            // SAFETY: chunk `c < full` covers values `8c .. 8c + 8` of the rows, `k` and `q`; the
            // tail goes through the 8-value buffers.
            unsafe {
                let src = row_in.as_ptr();
                let dst = row_out.as_mut_ptr();
                let (kp, qp) = (x.k.as_ptr(), x.q.as_ptr());
                let mut acc = [_mm256_setzero_ps(); 2];
                for c in 0..full {
                    let row = _mm256_mul_ps(_mm256_loadu_ps(src.add(8 * c)), decay);
                    _mm256_storeu_ps(dst.add(8 * c), row);
                    acc[c % 2] = _mm256_fmadd_ps(row, _mm256_loadu_ps(kp.add(8 * c)), acc[c % 2]);
                }
                let mut tail = [0.0f32; 8];
                if rest > 0 {
                    let row = _mm256_mul_ps(_mm256_loadu_ps(padded(row_in).as_ptr()), decay);
                    _mm256_storeu_ps(tail.as_mut_ptr(), row);
                    acc[full % 2] =
                        _mm256_fmadd_ps(row, _mm256_loadu_ps(k_tail.as_ptr()), acc[full % 2]);
                }
                let predicted = reduce8(_mm256_add_ps(acc[0], acc[1]));
                let delta = _mm256_set1_ps((x.v[j] - predicted) * x.beta);
                let mut acc = [_mm256_setzero_ps(); 2];
                for c in 0..full {
                    let k = _mm256_loadu_ps(kp.add(8 * c));
                    let row = _mm256_fmadd_ps(delta, k, _mm256_loadu_ps(dst.add(8 * c)));
                    _mm256_storeu_ps(dst.add(8 * c), row);
                    acc[c % 2] = _mm256_fmadd_ps(row, _mm256_loadu_ps(qp.add(8 * c)), acc[c % 2]);
                }
                if rest > 0 {
                    let k = _mm256_loadu_ps(k_tail.as_ptr());
                    let row = _mm256_fmadd_ps(delta, k, _mm256_loadu_ps(tail.as_ptr()));
                    _mm256_storeu_ps(tail.as_mut_ptr(), row);
                    acc[full % 2] =
                        _mm256_fmadd_ps(row, _mm256_loadu_ps(q_tail.as_ptr()), acc[full % 2]);
                }
                row_out[8 * full..].copy_from_slice(&tail[..rest]);
                *o = reduce8(_mm256_add_ps(acc[0], acc[1]));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// One gated delta-rule step ([`crate::delta_rule::step`]): per state row, one pass that
    /// scales the row by the decay, stores it and dots it with `k`; then one that adds `d_j · k`,
    /// stores and dots with `q`. Two accumulators per dot (even / odd 16-lane chunks), a masked
    /// tail, and the same reduction for every row.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `q.len() == k.len()`, `out.len() == v.len()` and both
    /// states hold `v.len() · k.len()` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn delta_rule_step(
        x: crate::delta_rule::DeltaInputs<'_>,
        state_in: &[f32],
        state_out: &mut [f32],
        out: &mut [f32],
    ) {
        let dim = x.k.len();
        // Common head sizes keep k, q and the row in registers (one load and one store per
        // chunk of the row).
        if dim.is_multiple_of(16) && (1..=8).contains(&(dim / 16)) {
            // SAFETY: forwarded contract; `dim` is `16 · CHUNKS`.
            unsafe {
                match dim / 16 {
                    1 => delta_rule_rows::<1>(x, state_in, state_out, out),
                    2 => delta_rule_rows::<2>(x, state_in, state_out, out),
                    3 => delta_rule_rows::<3>(x, state_in, state_out, out),
                    4 => delta_rule_rows::<4>(x, state_in, state_out, out),
                    5 => delta_rule_rows::<5>(x, state_in, state_out, out),
                    6 => delta_rule_rows::<6>(x, state_in, state_out, out),
                    7 => delta_rule_rows::<7>(x, state_in, state_out, out),
                    _ => delta_rule_rows::<8>(x, state_in, state_out, out),
                }
            }
            return;
        }
        let chunks = dim.div_ceil(16);
        let mask_of = |c: usize| -> u16 {
            let lanes = (dim - 16 * c).min(16);
            if lanes == 16 {
                0xffff
            } else {
                (1u16 << lanes) - 1
            }
        };
        let decay = _mm512_set1_ps(x.decay);
        for (j, o) in out.iter_mut().enumerate() {
            // SAFETY: row `j` of both states holds `dim` values; chunk `c` covers values
            // `16c ..` of the row and of `k` / `q`, masked to the ones that exist.
            unsafe {
                let src = state_in.as_ptr().add(j * dim);
                let dst = state_out.as_mut_ptr().add(j * dim);
                let kp = x.k.as_ptr();
                let qp = x.q.as_ptr();
                let mut acc = [_mm512_setzero_ps(); 2];
                for c in 0..chunks {
                    let mask = mask_of(c);
                    let row = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src.add(16 * c)), decay);
                    _mm512_mask_storeu_ps(dst.add(16 * c), mask, row);
                    let k = _mm512_maskz_loadu_ps(mask, kp.add(16 * c));
                    acc[c % 2] = _mm512_fmadd_ps(row, k, acc[c % 2]);
                }
                let predicted = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                let delta = _mm512_set1_ps((x.v[j] - predicted) * x.beta);
                let mut acc = [_mm512_setzero_ps(); 2];
                for c in 0..chunks {
                    let mask = mask_of(c);
                    let k = _mm512_maskz_loadu_ps(mask, kp.add(16 * c));
                    let row =
                        _mm512_fmadd_ps(delta, k, _mm512_maskz_loadu_ps(mask, dst.add(16 * c)));
                    _mm512_mask_storeu_ps(dst.add(16 * c), mask, row);
                    let q = _mm512_maskz_loadu_ps(mask, qp.add(16 * c));
                    acc[c % 2] = _mm512_fmadd_ps(row, q, acc[c % 2]);
                }
                *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            }
        }
    }

    /// [`super::delta_rule_chain`] for heads of exactly `16 · CHUNKS` key values: per state
    /// row, the row loaded once into registers and taken through every step with the
    /// instructions of [`delta_rule_rows`], each kept state row stored once — non-temporally
    /// when the planes sit on cache lines (they do in a snapshot ring), then one `sfence`.
    ///
    /// # Safety
    ///
    /// AVX-512 is supported; every step has `16 · CHUNKS` keys and queries and as many values
    /// as the first; `out` holds a value per step and state row; plane `read` and every
    /// written plane (of `values · 16 · CHUNKS` values each) lie inside `planes`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn delta_rule_chain<const CHUNKS: usize>(
        xs: &[crate::delta_rule::DeltaInputs<'_>],
        planes: &mut [f32],
        read: usize,
        writes: &[Option<usize>],
        out: &mut [f32],
        recording: Option<crate::delta_rule::Recording<'_, '_>>,
    ) {
        let values = xs[0].v.len();
        let base = planes.as_mut_ptr();
        let (mut deltas, prefix) = match recording {
            Some(r) => (Some(r.deltas), r.prefix),
            None => (None, &[][..]),
        };
        // Rows of a multiple of 16 values keep a line-aligned plane's rows on lines.
        let stream = (base as usize).is_multiple_of(64);
        let target = ChainPlanes {
            base,
            read,
            writes,
            stream,
            prefix,
            rows_ahead: crate::simd::tuning::tuning().state_rows_ahead,
        };
        // Two state rows at a time: a row's steps form one dependency chain (each step needs
        // the last one's dot products), which two independent chains keep the core busy on.
        let pairs = values / 2;
        for pair in 0..pairs {
            // SAFETY: forwarded contract; rows `2 · pair` and `2 · pair + 1` exist.
            unsafe { chain_rows::<CHUNKS, 2>(xs, &target, out, deltas.as_deref_mut(), 2 * pair) };
        }
        if values % 2 == 1 {
            // SAFETY: as above, for the last row.
            unsafe { chain_rows::<CHUNKS, 1>(xs, &target, out, deltas, values - 1) };
        }
        if stream {
            // The non-temporal stores ordered before whatever the caller does next (another
            // thread reads the planes after a join).
            _mm_sfence();
        }
    }

    /// Where a chain's states are: the planes' first value, the plane it reads, the plane (if
    /// any) each step writes, whether those stores bypass the caches, and the recorded steps
    /// the read state is taken through first.
    #[derive(Clone, Copy)]
    struct ChainPlanes<'a> {
        base: *mut f32,
        read: usize,
        writes: &'a [Option<usize>],
        stream: bool,
        /// Recorded steps from the read state to the chain's start.
        prefix: &'a [crate::delta_rule::RankOne<'a>],
        /// How many rows ahead of the ones it runs the chain prefetches the read plane's rows.
        rows_ahead: usize,
    }

    /// State rows `first .. first + ROWS` of [`delta_rule_chain`]: each loaded once into
    /// registers and taken through every step with the instructions of [`delta_rule_rows`],
    /// each kept state row stored once (non-temporally when `stream`: the planes sit on cache
    /// lines), and each step's `δ` recorded in `deltas` when given; the read plane's rows
    /// `target.rows_ahead` further on prefetched meanwhile.
    ///
    /// # Safety
    ///
    /// As [`delta_rule_chain`], with `target.base` its planes' first value, rows
    /// `first .. first + ROWS` existing, and `target.stream` only when the planes are 64-byte
    /// aligned.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn chain_rows<const CHUNKS: usize, const ROWS: usize>(
        xs: &[crate::delta_rule::DeltaInputs<'_>],
        target: &ChainPlanes<'_>,
        out: &mut [f32],
        mut deltas: Option<&mut [f32]>,
        first: usize,
    ) {
        let ChainPlanes {
            base: planes,
            read,
            writes,
            stream,
            prefix,
            rows_ahead,
        } = *target;
        const { assert!(ROWS == 1 || ROWS == 2, "chains run one or two state rows") };
        let dim = 16 * CHUNKS;
        let values = xs[0].v.len();
        let state_len = values * dim;
        // SAFETY: row `first + r` of every plane named holds `dim` values (the caller's
        // contract), and the read plane's rows `rows_ahead` further on are addressed only where
        // they exist; the read plane's rows are loaded before any step stores to them.
        unsafe {
            let row_at = |plane: usize, r: usize| planes.add(plane * state_len + (first + r) * dim);
            if rows_ahead > 0 && first + rows_ahead + ROWS <= values {
                let ahead = row_at(read, rows_ahead).cast::<u8>();
                crate::simd::x86::avx512::prefetch_block(ahead, ROWS * dim * 4, false);
            }
            let mut rows: [[__m512; CHUNKS]; ROWS] = std::array::from_fn(|r| {
                std::array::from_fn(|c| _mm512_loadu_ps(row_at(read, r).add(16 * c)))
            });
            // The recorded steps to the chain's start: `delta_rule_replay`'s instructions.
            for step in prefix {
                let decay = _mm512_set1_ps(step.decay);
                macro_rules! replay {
                    ($r:expr) => {{
                        let r: usize = $r;
                        let delta = _mm512_set1_ps(step.delta[first + r]);
                        for (c, value) in rows[r].iter_mut().enumerate() {
                            *value = _mm512_mul_ps(*value, decay);
                            let k = _mm512_loadu_ps(step.k.as_ptr().add(16 * c));
                            *value = _mm512_fmadd_ps(delta, k, *value);
                        }
                    }};
                }
                replay!(0);
                if ROWS == 2 {
                    replay!(1);
                }
            }
            for (i, x) in xs.iter().enumerate() {
                let (kp, qp) = (x.k.as_ptr(), x.q.as_ptr());
                let decay = _mm512_set1_ps(x.decay);
                // Each row's step written out for a constant row index: a loop over the rows
                // (by reference or index) kept them in memory, every step storing each row
                // and reloading it — a store-to-load round trip in every step's chain.
                macro_rules! step {
                    ($r:expr) => {{
                        let r: usize = $r;
                        let row = &mut rows[r];
                        let mut acc = [_mm512_setzero_ps(); 2];
                        for c in 0..CHUNKS {
                            row[c] = _mm512_mul_ps(row[c], decay);
                            acc[c % 2] = _mm512_fmadd_ps(
                                row[c],
                                _mm512_loadu_ps(kp.add(16 * c)),
                                acc[c % 2],
                            );
                        }
                        let predicted = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                        let d = (x.v[first + r] - predicted) * x.beta;
                        if let Some(deltas) = deltas.as_deref_mut() {
                            deltas[i * values + first + r] = d;
                        }
                        let delta = _mm512_set1_ps(d);
                        let dst = writes[i].map(|p| row_at(p, r));
                        let mut acc = [_mm512_setzero_ps(); 2];
                        for c in 0..CHUNKS {
                            row[c] =
                                _mm512_fmadd_ps(delta, _mm512_loadu_ps(kp.add(16 * c)), row[c]);
                            match dst {
                                Some(dst) if stream => _mm512_stream_ps(dst.add(16 * c), row[c]),
                                Some(dst) => _mm512_storeu_ps(dst.add(16 * c), row[c]),
                                None => {}
                            }
                            acc[c % 2] = _mm512_fmadd_ps(
                                row[c],
                                _mm512_loadu_ps(qp.add(16 * c)),
                                acc[c % 2],
                            );
                        }
                        out[i * values + first + r] =
                            _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                    }};
                }
                step!(0);
                if ROWS == 2 {
                    step!(1);
                }
            }
        }
    }

    /// [`super::delta_rule_replay`]: each 16-value chunk of a state row loaded once, taken
    /// through every step (`decay` multiply, then `δ · k` fused in), stored once.
    ///
    /// # Safety
    ///
    /// AVX-512 is supported; every step's keys are `dim` values, `dim` a multiple of 16, and
    /// its deltas one per `dim`-value row of `state_in` and `state_out` (the same length).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn delta_rule_replay(
        steps: &[crate::delta_rule::RankOne<'_>],
        state_in: &[f32],
        state_out: &mut [f32],
    ) {
        let dim = steps[0].k.len();
        for (j, (src, dst)) in state_in
            .chunks_exact(dim)
            .zip(state_out.chunks_exact_mut(dim))
            .enumerate()
        {
            for c in (0..dim).step_by(16) {
                // SAFETY: `c + 16 <= dim`: values `c .. c + 16` of the row and of every key.
                unsafe {
                    let mut row = _mm512_loadu_ps(src.as_ptr().add(c));
                    for step in steps {
                        row = _mm512_mul_ps(row, _mm512_set1_ps(step.decay));
                        let k = _mm512_loadu_ps(step.k.as_ptr().add(c));
                        row = _mm512_fmadd_ps(_mm512_set1_ps(step.delta[j]), k, row);
                    }
                    _mm512_storeu_ps(dst.as_mut_ptr().add(c), row);
                }
            }
        }
    }

    /// [`delta_rule_step`] for rows of exactly `16 · CHUNKS` values, with `k`, `q` and the row
    /// in registers.
    ///
    /// # Safety
    ///
    /// As [`delta_rule_step`], and `k.len() == 16 · CHUNKS`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn delta_rule_rows<const CHUNKS: usize>(
        x: crate::delta_rule::DeltaInputs<'_>,
        state_in: &[f32],
        state_out: &mut [f32],
        out: &mut [f32],
    ) {
        let dim = 16 * CHUNKS;
        // SAFETY: `k` and `q` hold `dim` values; row `j` of both states holds `dim` values.
        unsafe {
            let k: [__m512; CHUNKS] =
                std::array::from_fn(|c| _mm512_loadu_ps(x.k.as_ptr().add(16 * c)));
            let q: [__m512; CHUNKS] =
                std::array::from_fn(|c| _mm512_loadu_ps(x.q.as_ptr().add(16 * c)));
            let decay = _mm512_set1_ps(x.decay);
            for (j, o) in out.iter_mut().enumerate() {
                let src = state_in.as_ptr().add(j * dim);
                let dst = state_out.as_mut_ptr().add(j * dim);
                let mut row = [_mm512_setzero_ps(); CHUNKS];
                let mut acc = [_mm512_setzero_ps(); 2];
                for c in 0..CHUNKS {
                    row[c] = _mm512_mul_ps(_mm512_loadu_ps(src.add(16 * c)), decay);
                    acc[c % 2] = _mm512_fmadd_ps(row[c], k[c], acc[c % 2]);
                }
                let predicted = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                let delta = _mm512_set1_ps((x.v[j] - predicted) * x.beta);
                let mut acc = [_mm512_setzero_ps(); 2];
                for c in 0..CHUNKS {
                    row[c] = _mm512_fmadd_ps(delta, k[c], row[c]);
                    _mm512_storeu_ps(dst.add(16 * c), row[c]);
                    acc[c % 2] = _mm512_fmadd_ps(row[c], q[c], acc[c % 2]);
                }
                *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            }
        }
    }
}
