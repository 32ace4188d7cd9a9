//! AVX2 + FMA + F16C kernels.
//!
//! Every entry point is a multi-input kernel: it reads a weight row (or a column tile of it)
//! once per pass and dots it with up to [`super::MAX_ROWS_PER_PASS`] activation rows (fewer for
//! the float family, whose per-row accumulators fill the 16 ymm registers sooner). Each
//! activation row has its own accumulator ([`Accumulator`], loaded into registers at the start
//! and stored back at the end), updated by the same instruction sequence whatever the number of
//! rows in the pass, so a row's result does not depend on its neighbours: the single-row `dot`
//! of every type is this kernel with one row.
//!
//! Callers (the type modules' `dot_rows`) have checked that the CPU supports AVX2, FMA and F16C
//! and that the weight row and every activation row have matching, whole-block sizes; the
//! kernels rely on that for their unchecked loads.

use std::arch::x86_64::*;

use super::{in_passes, with_row_count, Accumulator, Rows};
use crate::{k_quants, q4_0, q4_k, q5_k, q6_k, q8_0, q8_k};

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Float-family weight encodings (const-generic tags, so each kernel is monomorphised).
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;

/// Bytes of one weight element of a float-family encoding.
pub(crate) const fn float_size(kind: u8) -> usize {
    match kind {
        F32 => 4,
        _ => 2,
    }
}

/// Loads 8 weights of encoding `KIND` from `p` and widens them to f32 (exactly).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load8<const KIND: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 elements (8 * float_size(KIND) bytes) are readable at `p`.
    unsafe {
        match KIND {
            F32 => _mm256_loadu_ps(p.cast()),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
        }
    }
}

/// Lanes `first .. first + 8` of an accumulator.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_lanes8(acc: &Accumulator, first: usize) -> __m256 {
    let lanes = &acc.0[first..first + 8];
    // SAFETY: `lanes` is 8 readable f32.
    unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
}

/// Stores `v` to lanes `first .. first + 8` of an accumulator.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn store_lanes8(acc: &mut Accumulator, first: usize, v: __m256) {
    let lanes = &mut acc.0[first..first + 8];
    // SAFETY: `lanes` is 8 writable f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) }
}

/// The f32 value of the little-endian binary16 at `p` (hardware conversion, exact).
///
/// The half is broadcast before converting: inserting it into a register instead lets the
/// compiler merge into a live register (a false dependency that serialised whole loops).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load_f16(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
}

/// The binary16 at `p` as f32 in all 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn splat_f16(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees two readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

/// The little-endian f32 at `p`.
#[inline(always)]
pub(crate) unsafe fn load_f32(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees four readable bytes at `p`.
    unsafe { p.cast::<f32>().read_unaligned() }
}

/// Pointers to the first element of each of the `N` rows.
#[inline(always)]
pub(crate) fn row_ptrs<T, const N: usize>(rows: &Rows<'_, T>) -> [*const T; N] {
    std::array::from_fn(|r| rows.ptr(r))
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16 weights × f32 activations
// ---------------------------------------------------------------------------------------------

/// Rows per pass of the float kernels: two ymm accumulators per row, so four rows (8 registers)
/// leave room for the weights and loads.
const FLOAT_ROWS_PER_PASS: usize = 4;

/// Adds `w[i] · x_b[i]` for a float-family weight row into each row's accumulator: 16 lanes
/// per row (element `i` in lane `i % 16`, two ymm registers), fused multiply-adds.
///
/// # Safety
///
/// AVX2, FMA and F16C must be available; `w` must hold `rows.len()` elements of `KIND`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn float_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, f32>,
    acc: &mut [Accumulator],
) {
    debug_assert_eq!(w.len(), rows.len() * float_size(KIND));
    for (g, group_acc) in acc.chunks_mut(FLOAT_ROWS_PER_PASS).enumerate() {
        let group = rows.sub(g * FLOAT_ROWS_PER_PASS, group_acc.len());
        // SAFETY: forwarded contract; `group` rows are checked views of `rows`.
        unsafe {
            match group_acc.len() {
                1 => float_pass::<KIND, 1>(w, group, group_acc),
                2 => float_pass::<KIND, 2>(w, group, group_acc),
                3 => float_pass::<KIND, 3>(w, group, group_acc),
                _ => float_pass::<KIND, 4>(w, group, group_acc),
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, f32>,
    state: &mut [Accumulator],
) {
    let size = float_size(KIND);
    let len = rows.len();
    let full = len / 16;
    let wp = w.as_ptr();
    let xp = row_ptrs::<f32, N>(&rows);
    let mut acc: [[__m256; 2]; N] =
        std::array::from_fn(|r| [load_lanes8(&state[r], 0), load_lanes8(&state[r], 8)]);
    for c in 0..full {
        // SAFETY: chunk `c` (16 elements) lies inside the weight row and every activation row.
        unsafe {
            let w0 = load8::<KIND>(wp.add(c * 16 * size));
            let w1 = load8::<KIND>(wp.add((c * 16 + 8) * size));
            for r in 0..N {
                let x = xp[r].add(c * 16);
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), acc[r][1]);
            }
        }
    }
    let rest = len - full * 16;
    if rest > 0 {
        // The tail runs as one more zero-padded chunk: 0 · 0 adds nothing to a lane.
        let mut w_tail = [0u8; 16 * 4];
        w_tail[..rest * size].copy_from_slice(&w[full * 16 * size..]);
        // SAFETY: `w_tail` holds 16 elements of any float encoding.
        let (w0, w1) = unsafe {
            (
                load8::<KIND>(w_tail.as_ptr()),
                load8::<KIND>(w_tail.as_ptr().add(8 * size)),
            )
        };
        for (r, a) in acc.iter_mut().enumerate() {
            let mut x_tail = [0.0f32; 16];
            x_tail[..rest].copy_from_slice(&rows.row(r)[full * 16..]);
            // SAFETY: `x_tail` holds 16 f32.
            unsafe {
                a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x_tail.as_ptr()), a[0]);
                a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x_tail.as_ptr().add(8)), a[1]);
            }
        }
    }
    for (s, a) in state.iter_mut().zip(acc) {
        store_lanes8(s, 0, a[0]);
        store_lanes8(s, 8, a[1]);
    }
}

/// `y += a · x` with one fused multiply-add per element (the same rounding in every lane and in
/// the scalar tail, so the result does not depend on the length or alignment).
///
/// # Safety
///
/// AVX2 and FMA must be available; `x.len() == y.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    let av = _mm256_set1_ps(a);
    let full = x.len() / 8;
    for c in 0..full {
        // SAFETY: elements `8c .. 8c + 8` exist in both slices.
        unsafe {
            let yp = y.as_mut_ptr().add(c * 8);
            let v = _mm256_fmadd_ps(
                av,
                _mm256_loadu_ps(x.as_ptr().add(c * 8)),
                _mm256_loadu_ps(yp),
            );
            _mm256_storeu_ps(yp, v);
        }
    }
    for (yv, xv) in y[full * 8..].iter_mut().zip(&x[full * 8..]) {
        *yv = a.mul_add(*xv, *yv);
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

/// Attention scores ([`crate::attention::scores`]) over cached keys stored as `KIND` (rows of
/// bytes): per (query, key) an 8-lane dot product (two accumulators, a zero-padded f32 copy
/// of a ragged tail), reduced by [`reduce8`].
///
/// # Safety
///
/// AVX2 and FMA must be available; every key row holds `queries.len()` values of `KIND`; every
/// limit is at most the key count and `q * stride + limit <= out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn attention_scores<const KIND: u8>(
    queries: Rows<'_, f32>,
    keys: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
) {
    let dim = queries.len();
    let size = float_size(KIND);
    let full = dim / 8;
    let rest = dim - 8 * full;
    for (q, &limit) in limits.iter().enumerate() {
        let query = queries.row(q);
        let mut query_tail = [0.0f32; 8];
        query_tail[..rest].copy_from_slice(&query[8 * full..]);
        for j in 0..limit {
            let key = keys.row(j);
            // SAFETY: chunks `c < full` lie inside both rows; the tail goes through buffers.
            unsafe {
                let mut acc = [_mm256_setzero_ps(); 2];
                for c in 0..full {
                    acc[c % 2] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(query.as_ptr().add(8 * c)),
                        load8::<KIND>(key.as_ptr().add(8 * c * size)),
                        acc[c % 2],
                    );
                }
                if rest > 0 {
                    let key_tail = widen_tail::<KIND>(&key[8 * full * size..]);
                    acc[full % 2] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(query_tail.as_ptr()),
                        _mm256_loadu_ps(key_tail.as_ptr()),
                        acc[full % 2],
                    );
                }
                out[q * stride + j] = reduce8(_mm256_add_ps(acc[0], acc[1]));
            }
        }
    }
}

/// The last `bytes.len() / size` (< 8) values of a `KIND` row as f32, zero-padded to 8.
fn widen_tail<const KIND: u8>(bytes: &[u8]) -> [f32; 8] {
    let mut tail = [0.0f32; 8];
    for (t, v) in tail.iter_mut().zip(bytes.chunks_exact(float_size(KIND))) {
        *t = match KIND {
            F32 => f32::from_le_bytes([v[0], v[1], v[2], v[3]]),
            _ => crate::f16::to_f32(u16::from_le_bytes([v[0], v[1]])),
        };
    }
    tail
}

/// Attention weighted sums ([`crate::attention::weighted_sums`]) over cached values stored as
/// `KIND`: per query and output element `y = fma(p_j, v_j, y)` for keys `j` in order from
/// zero, the output row kept in memory (a ragged tail through a zero-padded buffer).
///
/// # Safety
///
/// AVX2 and FMA must be available; `out` holds one row of the values' length per query; every
/// limit is at most the value count and the probability row length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn attention_weighted_sums<const KIND: u8>(
    probs: Rows<'_, f32>,
    values: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
) {
    let size = float_size(KIND);
    let dim = values.len() / size;
    let full = dim / 8;
    for (q, (o, &limit)) in out.chunks_exact_mut(dim.max(1)).zip(limits).enumerate() {
        o.fill(0.0);
        let mut tail = [0.0f32; 8];
        for j in 0..limit {
            let value = values.row(j);
            // SAFETY: chunks `c < full` lie inside the value row and `o`; the tail goes
            // through buffers.
            unsafe {
                let p = _mm256_set1_ps(probs.row(q)[j]);
                for c in 0..full {
                    let y = o.as_mut_ptr().add(8 * c);
                    let v = load8::<KIND>(value.as_ptr().add(8 * c * size));
                    _mm256_storeu_ps(y, _mm256_fmadd_ps(p, v, _mm256_loadu_ps(y)));
                }
                if dim > 8 * full {
                    let v = widen_tail::<KIND>(&value[8 * full * size..]);
                    let y = _mm256_fmadd_ps(
                        p,
                        _mm256_loadu_ps(v.as_ptr()),
                        _mm256_loadu_ps(tail.as_ptr()),
                    );
                    _mm256_storeu_ps(tail.as_mut_ptr(), y);
                }
            }
        }
        let rest = dim - 8 * full;
        o[8 * full..].copy_from_slice(&tail[..rest]);
    }
}

/// The sum of 8 lanes by the pairwise tree (lanes `i` and `i + 4`, then `i + 2`, then `i + 1`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn reduce8(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

/// `y[i] = fma(w_j, v_j[i], y[i])` for `j = 0, 1, …` in order — exactly [`axpy`] once per row,
/// but each chunk of `y` stays in registers across all rows.
///
/// # Safety
///
/// AVX2 and FMA must be available; `weights.len() == rows.count()` and
/// `rows.len() == y.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn weighted_sum(weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
    debug_assert!(weights.len() == rows.count() && rows.len() == y.len());
    /// Registers of `y` kept live per sweep over the rows.
    const REGS: usize = 8;
    let len = y.len();
    let full = len / 8;
    let mut chunk = 0;
    while chunk < full {
        let used = (full - chunk).min(REGS);
        // SAFETY: registers cover elements `8 · chunk .. 8 · (chunk + used)`, inside `y` and
        // every row.
        unsafe {
            let yp = y.as_mut_ptr().add(8 * chunk);
            let mut acc: [__m256; REGS] = std::array::from_fn(|k| {
                if k < used {
                    _mm256_loadu_ps(yp.add(8 * k))
                } else {
                    _mm256_setzero_ps()
                }
            });
            for (j, &wj) in weights.iter().enumerate() {
                let wv = _mm256_set1_ps(wj);
                let vp = rows.ptr(j).add(8 * chunk);
                for (k, a) in acc.iter_mut().enumerate().take(used) {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vp.add(8 * k)), *a);
                }
            }
            for (k, a) in acc.iter().enumerate().take(used) {
                _mm256_storeu_ps(yp.add(8 * k), *a);
            }
        }
        chunk += used;
    }
    for (i, yv) in y.iter_mut().enumerate().skip(8 * full) {
        for (j, &wj) in weights.iter().enumerate() {
            *yv = wj.mul_add(rows.row(j)[i], *yv);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Q8_0 / Q4_0 weights × Q8_0 activations (blocks of 32)
// ---------------------------------------------------------------------------------------------

/// 32-value block weight encodings.
pub(crate) const Q8_0: u8 = 0;
pub(crate) const Q4_0: u8 = 1;

/// Decodes weight block `b` of encoding `KIND`: its 32 signed quants and its scale (in every
/// lane).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn decode_block32<const KIND: u8>(w: *const u8, b: usize) -> (__m256i, __m256) {
    // SAFETY: the caller guarantees block `b` lies inside the weight row.
    unsafe {
        match KIND {
            Q8_0 => {
                let block = w.add(b * q8_0::BLOCK_BYTES);
                (_mm256_loadu_si256(block.add(2).cast()), splat_f16(block))
            }
            _ => {
                let block = w.add(b * q4_0::BLOCK_BYTES);
                let packed = _mm_loadu_si128(block.add(2).cast());
                let nibble = _mm_set1_epi8(0x0f);
                let low = _mm_and_si128(packed, nibble);
                let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), nibble);
                let q = _mm256_set_m128i(high, low);
                (_mm256_sub_epi8(q, _mm256_set1_epi8(8)), splat_f16(block))
            }
        }
    }
}

/// Q8_0 / Q4_0 weight row × Q8_0 activation rows. Per row and block: the exact integer dot of
/// the 32 quant pairs in 8 i32 lanes, converted to f32 and multiplied by `d_w · d_x`; two
/// consecutive blocks are summed (`fma(s1, f1, s0 · f0)`) and then added to the row's 8
/// accumulator lanes (an odd last block is fused in alone).
///
/// Activation rows are widened Q8_0 blocks ([`q8_0::widen_row`]: f32 scale, 32 quants).
///
/// # Safety
///
/// AVX2, FMA and F16C must be available; `w` and every row must be the same whole number of
/// blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block32_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    acc: &mut [Accumulator],
) {
    in_passes(rows, acc, |group, group_acc| {
        // SAFETY: forwarded contract.
        unsafe { with_row_count!(group_acc.len(), block32_pass::<KIND>(w, group, group_acc)) }
    });
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block32_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, u8>,
    state: &mut [Accumulator],
) {
    let blocks = rows.len() / q8_0::AVX2_WIDE_BLOCK_BYTES;
    let xp = row_ptrs::<u8, N>(&rows);
    let ones = _mm256_set1_epi16(1);
    // Block `b` of row `r`: (scale d_w · d_x, exact integer dot as f32), 8 lanes each.
    let term = |wq: __m256i, w_abs: __m256i, dw: __m256, xb: *const u8| {
        // SAFETY: `xb` is a whole widened Q8_0 block of an activation row.
        unsafe {
            let xq = _mm256_loadu_si256(xb.add(4).cast());
            // |w| · (x with w's sign) = w · x; pair sums stay below 2 · 128 · 127.
            let pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xq, wq));
            let sums = _mm256_madd_epi16(pairs, ones);
            let dx = _mm256_set1_ps(load_f32(xb));
            (_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sums))
        }
    };
    let mut acc: [__m256; N] = std::array::from_fn(|r| load_lanes8(&state[r], 0));
    // Blocks go in pairs, summed before they meet the accumulator (half the dependency chain);
    // an odd last block is fused alone. Callers tile rows at even blocks, so pairs never
    // straddle a tile boundary.
    let mut b = 0;
    while b + 1 < blocks {
        // SAFETY: blocks `b`, `b + 1` lie inside the weight row and every activation row.
        unsafe {
            let (wq0, dw0) = decode_block32::<KIND>(w.as_ptr(), b);
            let (wq1, dw1) = decode_block32::<KIND>(w.as_ptr(), b + 1);
            let (abs0, abs1) = (_mm256_sign_epi8(wq0, wq0), _mm256_sign_epi8(wq1, wq1));
            for r in 0..N {
                let xb = xp[r].add(b * q8_0::AVX2_WIDE_BLOCK_BYTES);
                let (s0, f0) = term(wq0, abs0, dw0, xb);
                let (s1, f1) = term(wq1, abs1, dw1, xb.add(q8_0::AVX2_WIDE_BLOCK_BYTES));
                let pair = _mm256_fmadd_ps(s1, f1, _mm256_mul_ps(s0, f0));
                acc[r] = _mm256_add_ps(acc[r], pair);
            }
        }
        b += 2;
    }
    if b < blocks {
        // SAFETY: block `b` lies inside the weight row and every activation row.
        unsafe {
            let (wq, dw) = decode_block32::<KIND>(w.as_ptr(), b);
            let w_abs = _mm256_sign_epi8(wq, wq);
            for r in 0..N {
                let (s, f) = term(wq, w_abs, dw, xp[r].add(b * q8_0::AVX2_WIDE_BLOCK_BYTES));
                acc[r] = _mm256_fmadd_ps(s, f, acc[r]);
            }
        }
    }
    for (s, a) in state.iter_mut().zip(acc) {
        store_lanes8(s, 0, a);
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants (super-blocks of 256) × Q8_K activations
// ---------------------------------------------------------------------------------------------

/// One K-quant weight super-block decoded for the integer dot products: 256 unsigned quants
/// in value order (8 registers of 32), the i16 multiplier pattern of each register, the mins
/// as i16 pairs (for the bsums), and the two f32 scales.
pub(crate) struct DecodedSuperBlock {
    pub(crate) quants: [__m256i; 8],
    /// Per 32 values: the i16 multipliers of the 16 `maddubs` pair sums.
    pub(crate) multipliers: [__m256i; 8],
    /// K-quants with mins (Q4_K, Q5_K): `m_j` in i16 lanes `2j, 2j + 1`, to `madd` with the 16
    /// bsums. Q6_K: the 16 signed scales, to `madd` with the bsums for the `-32` offset.
    pub(crate) bsum_multipliers: __m256i,
    pub(crate) d: f32,
    /// `dmin` of Q4_K / Q5_K; `-32 · d` (the offset's factor) is folded in for Q6_K instead.
    pub(crate) dmin: f32,
}

/// K-quant encodings.
pub(crate) const Q4_K: u8 = 0;
pub(crate) const Q5_K: u8 = 1;
pub(crate) const Q6_K: u8 = 2;

/// Bytes of one super-block of encoding `KIND`.
pub(crate) const fn k_block_bytes(kind: u8) -> usize {
    match kind {
        Q4_K => q4_k::BLOCK_BYTES,
        Q5_K => q5_k::BLOCK_BYTES,
        _ => q6_k::BLOCK_BYTES,
    }
}

/// Broadcasts the i16 `v` to all 16 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn splat16(v: i16) -> __m256i {
    _mm256_set1_epi16(v)
}

/// Decodes the Q4_K / Q5_K super-block at `block`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn decode_k_with_mins<const KIND: u8>(block: *const u8) -> DecodedSuperBlock {
    // SAFETY: the caller guarantees a whole super-block at `block`.
    unsafe {
        let header = std::slice::from_raw_parts(block, 16);
        let (scales, mins) = k_quants::unpack_scales_mins(header[4..16].try_into().unwrap());
        let (qs, qh) = match KIND {
            Q4_K => (block.add(16), None),
            _ => (
                block.add(48),
                Some(_mm256_loadu_si256(block.add(16).cast())),
            ),
        };
        let nibble = _mm256_set1_epi8(0x0f);
        let mut quants = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            let packed = _mm256_loadu_si256(qs.add(32 * c).cast());
            let mut low = _mm256_and_si256(packed, nibble);
            let mut high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble);
            if let Some(qh) = qh {
                // Bit 2c of qh[l] is the fifth bit of value l of sub-block 2c, bit 2c + 1 of
                // sub-block 2c + 1.
                let bit_low = _mm256_set1_epi8(1 << (2 * c));
                let bit_high = _mm256_set1_epi8(1 << (2 * c + 1));
                let sixteen = _mm256_set1_epi8(16);
                let has_low = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_low), bit_low);
                let has_high = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_high), bit_high);
                low = _mm256_or_si256(low, _mm256_and_si256(has_low, sixteen));
                high = _mm256_or_si256(high, _mm256_and_si256(has_high, sixteen));
            }
            quants[2 * c] = low;
            quants[2 * c + 1] = high;
        }
        let multipliers = std::array::from_fn(|j| splat16(i16::from(scales[j])));
        // m_j in i16 lanes 2j and 2j + 1.
        let mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr().cast()));
        let bsum_multipliers = _mm256_set_m128i(
            _mm_unpackhi_epi16(mins16, mins16),
            _mm_unpacklo_epi16(mins16, mins16),
        );
        DecodedSuperBlock {
            quants,
            multipliers,
            bsum_multipliers,
            d: load_f16(block),
            dmin: load_f16(block.add(2)),
        }
    }
}

/// Decodes the Q6_K super-block at `block`; quants stay unsigned (`q + 32`), the offset is
/// applied through the bsums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn decode_q6_k(block: *const u8) -> DecodedSuperBlock {
    // SAFETY: the caller guarantees a whole super-block at `block`.
    unsafe {
        let ql = block;
        let qh = block.add(128);
        let scales = std::slice::from_raw_parts(block.add(192).cast::<i8>(), 16);
        let nibble = _mm256_set1_epi8(0x0f);
        let two_bits = _mm256_set1_epi8(0x30);
        let mut quants = [_mm256_setzero_si256(); 8];
        for half in 0..2 {
            let low_a = _mm256_loadu_si256(ql.add(64 * half).cast()); // values 0..32, 64..96
            let low_b = _mm256_loadu_si256(ql.add(64 * half + 32).cast()); // 32..64, 96..128
            let high = _mm256_loadu_si256(qh.add(32 * half).cast());
            // Bits 2k, 2k + 1 of qh[l] are bits 4, 5 of value l + 32k.
            let h0 = _mm256_and_si256(_mm256_slli_epi16::<4>(high), two_bits);
            let h1 = _mm256_and_si256(_mm256_slli_epi16::<2>(high), two_bits);
            let h2 = _mm256_and_si256(high, two_bits);
            let h3 = _mm256_and_si256(_mm256_srli_epi16::<2>(high), two_bits);
            quants[4 * half] = _mm256_or_si256(_mm256_and_si256(low_a, nibble), h0);
            quants[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(low_b, nibble), h1);
            quants[4 * half + 2] =
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(low_a), nibble), h2);
            quants[4 * half + 3] =
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(low_b), nibble), h3);
        }
        // Register k covers groups 2k, 2k + 1 of 16 values: 8 pair sums each, so its
        // multipliers are scale 2k in the low 128-bit lane and scale 2k + 1 in the high one.
        let spread = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, //
            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
        );
        let multipliers = std::array::from_fn(|k| {
            let pair = (u32::from(scales[2 * k] as i16 as u16))
                | (u32::from(scales[2 * k + 1] as i16 as u16) << 16);
            _mm256_shuffle_epi8(_mm256_set1_epi32(pair as i32), spread)
        });
        let bsum_multipliers = _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(192).cast()));
        let d = load_f16(block.add(208));
        DecodedSuperBlock {
            quants,
            multipliers,
            bsum_multipliers,
            d,
            dmin: 0.0,
        }
    }
}

/// K-quant weight row × Q8_K activation rows. Per row and super-block: the exact integer sums
/// `Σ scale · Σ q_w · q_x` (8 i32 lanes) and the bsum term (mins for Q4_K / Q5_K, the `-32`
/// offset for Q6_K), converted to f32 and fused into 8 f32 lanes with `d_x · d` and
/// `d_x · dmin`, into the row's accumulator lanes.
///
/// # Safety
///
/// AVX2, FMA and F16C must be available; `w` must be whole super-blocks of `KIND` and every
/// row the same number of Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn k_quant_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    acc: &mut [Accumulator],
) {
    in_passes(rows, acc, |group, group_acc| {
        // SAFETY: forwarded contract.
        unsafe { with_row_count!(group_acc.len(), k_quant_pass::<KIND>(w, group, group_acc)) }
    });
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_quant_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, u8>,
    state: &mut [Accumulator],
) {
    let blocks = rows.len() / q8_k::BLOCK_BYTES;
    let xp = row_ptrs::<u8, N>(&rows);
    let mut acc: [__m256; N] = std::array::from_fn(|r| load_lanes8(&state[r], 0));
    for b in 0..blocks {
        // SAFETY: super-block `b` lies inside the weight row and every activation row.
        unsafe {
            let block = w.as_ptr().add(b * k_block_bytes(KIND));
            let decoded = match KIND {
                Q6_K => decode_q6_k(block),
                _ => decode_k_with_mins::<KIND>(block),
            };
            for r in 0..N {
                let xb = xp[r].add(b * q8_k::BLOCK_BYTES);
                let dx = load_f32(xb);
                let xq = xb.add(4);
                let mut sums = _mm256_setzero_si256();
                for k in 0..8 {
                    let x = _mm256_loadu_si256(xq.add(32 * k).cast());
                    let pairs = _mm256_maddubs_epi16(decoded.quants[k], x);
                    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, decoded.multipliers[k]));
                }
                let bsums = _mm256_loadu_si256(xb.add(260).cast());
                let bsum_term = _mm256_madd_epi16(bsums, decoded.bsum_multipliers);
                match KIND {
                    Q6_K => {
                        // Σ scale · (q - 32) · x = Σ scale · q · x - 32 · Σ scale · bsum.
                        let exact = _mm256_sub_epi32(sums, _mm256_slli_epi32::<5>(bsum_term));
                        let scale = _mm256_set1_ps(dx * decoded.d);
                        acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(exact), acc[r]);
                    }
                    _ => {
                        let scale = _mm256_set1_ps(dx * decoded.d);
                        let min_scale = _mm256_set1_ps(dx * decoded.dmin);
                        acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[r]);
                        acc[r] = _mm256_fnmadd_ps(min_scale, _mm256_cvtepi32_ps(bsum_term), acc[r]);
                    }
                }
            }
        }
    }
    for (s, a) in state.iter_mut().zip(acc) {
        store_lanes8(s, 0, a);
    }
}

// ---------------------------------------------------------------------------------------------
// Activations (bit-identical to the scalar references in `crate::activations`)
// ---------------------------------------------------------------------------------------------

/// `e^x` per lane: the operations of [`crate::activations::exp`], in its order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn exp_ps(x: __m256) -> __m256 {
    use crate::activations::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E};
    // `max` returns its second operand for a NaN lane, as `f32::max` returns the non-NaN one.
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
        _mm256_set1_ps(EXP_MAX),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2_E),
    ));
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
}

/// `x / (1 + e^-x)` per lane, as [`crate::activations::silu`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn silu_ps(x: __m256) -> __m256 {
    let negated = _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), exp_ps(negated)))
}

/// `1 / (1 + e^-x)` per lane, as [`crate::activations::sigmoid`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn sigmoid_ps(x: __m256) -> __m256 {
    let negated = _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
    let one = _mm256_set1_ps(1.0);
    _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(negated)))
}

/// The largest value of `x` (whole chunks of 16) or -∞, for [`super::softmax_exp_sum`].
///
/// # Safety
///
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn max_of_chunks(x: &[f32]) -> f32 {
    let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
    for half in x.chunks_exact(8) {
        // SAFETY: the half chunk holds 8 values.
        max = _mm256_max_ps(max, unsafe { _mm256_loadu_ps(half.as_ptr()) });
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 values.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), max) };
    lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// `x[i] = exp(x[i] - max)` over whole chunks of 16 (two registers of lanes, 0–7 and 8–15),
/// returning the sums of lanes 0–15, for [`super::softmax_exp_sum`].
///
/// # Safety
///
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp_sum_chunks(x: &mut [f32], max: f32) -> [f32; 16] {
    let shift = _mm256_set1_ps(max);
    let mut sums = [_mm256_setzero_ps(); 2];
    for chunk in x.chunks_exact_mut(16) {
        for (half, sum) in chunk.chunks_exact_mut(8).zip(&mut sums) {
            // SAFETY: the half chunk holds 8 values.
            unsafe {
                let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(half.as_ptr()), shift));
                _mm256_storeu_ps(half.as_mut_ptr(), e);
                *sum = _mm256_add_ps(*sum, e);
            }
        }
    }
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds 16 values.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), sums[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), sums[1]);
    }
    lanes
}

/// `out[i] = f(gate[i]) · other[i]` (without `other`: `f(gate[i])`), `f` SiLU or (`SIGMOID`)
/// the sigmoid, for the whole registers of 8 among `len` values; returns how many it did
/// (the caller finishes the tail).
///
/// AVX2 and FMA must be available; `gate` and `other` readable and `out` writable for `len`
/// values. `out` may be `gate` or `other`: each value is read before it is written.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gate_mul<const SIGMOID: bool>(
    gate: *const f32,
    other: Option<*const f32>,
    out: *mut f32,
    len: usize,
) -> usize {
    let full = len / 8;
    for c in 0..full {
        // SAFETY: values `8c .. 8c + 8` exist behind every pointer (caller's contract).
        unsafe {
            let g = _mm256_loadu_ps(gate.add(8 * c));
            let mut v = if SIGMOID { sigmoid_ps(g) } else { silu_ps(g) };
            if let Some(other) = other {
                v = _mm256_mul_ps(v, _mm256_loadu_ps(other.add(8 * c)));
            }
            _mm256_storeu_ps(out.add(8 * c), v);
        }
    }
    8 * full
}

// ---------------------------------------------------------------------------------------------
// RMSNorm and RoPE
// ---------------------------------------------------------------------------------------------

/// [`super::avx512::sum_squares_f64`] with AVX2: lanes 0-3 and 4-7 in two registers.
///
/// # Safety
///
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sum_squares_f64(x: &[f32]) -> ([f64; 8], usize) {
    let chunks = x.len() / 8;
    let (mut low, mut high) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    for c in 0..chunks {
        // SAFETY: values `8c .. 8c + 8` lie inside `x`.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * c)) };
        let squares = _mm256_mul_ps(v, v);
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(squares)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(squares)));
    }
    let mut lanes = [0.0; 8];
    // SAFETY: `lanes` holds 8 f64.
    unsafe {
        _mm256_storeu_pd(lanes.as_mut_ptr(), low);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), high);
    }
    (lanes, 8 * chunks)
}

/// [`super::avx512::scale_mul`] with AVX2 (whole registers of 8).
///
/// # Safety
///
/// As the AVX-512 kernel, with AVX2 and FMA available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scale_mul(
    x: *const f32,
    scale: f32,
    weight: *const f32,
    out: *mut f32,
    len: usize,
) -> usize {
    let full = len / 8;
    let s = _mm256_set1_ps(scale);
    for c in 0..full {
        // SAFETY: values `8c .. 8c + 8` exist behind every pointer (caller's contract).
        unsafe {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(8 * c)), s);
            let v = _mm256_mul_ps(v, _mm256_loadu_ps(weight.add(8 * c)));
            _mm256_storeu_ps(out.add(8 * c), v);
        }
    }
    8 * full
}

/// [`super::avx512::rotate_pairs`] with AVX2 (whole registers of 8).
///
/// # Safety
///
/// As the AVX-512 kernel, with AVX2 and FMA available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rotate_pairs(
    x0: *mut f32,
    x1: *mut f32,
    cos: *const f32,
    sin: *const f32,
    len: usize,
) -> usize {
    let full = len / 8;
    for i in 0..full {
        // SAFETY: values `8i .. 8i + 8` exist behind every pointer (caller's contract).
        unsafe {
            let (a, b) = (
                _mm256_loadu_ps(x0.add(8 * i)),
                _mm256_loadu_ps(x1.add(8 * i)),
            );
            let (c, s) = (
                _mm256_loadu_ps(cos.add(8 * i)),
                _mm256_loadu_ps(sin.add(8 * i)),
            );
            let first = _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s));
            let second = _mm256_add_ps(_mm256_mul_ps(a, s), _mm256_mul_ps(b, c));
            _mm256_storeu_ps(x0.add(8 * i), first);
            _mm256_storeu_ps(x1.add(8 * i), second);
        }
    }
    8 * full
}
