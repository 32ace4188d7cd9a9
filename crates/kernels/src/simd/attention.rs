//! Attention over one key / value head ([`crate::attention`]): the scores and the weighted sums
//! of the values, AVX2 and AVX-512 kernels (cached rows stored as f32, f16 or Q8_0 blocks,
//! widened to f32 as they are read) and their safe entry points.
//!
//! AVX2 scores one query at a time, 8-lane chunks, and keeps tiles of queries' outputs in
//! registers for the weighted sums of head sizes of 8 · C; AVX-512 keeps a tile of queries in
//! registers for head sizes of 16 · C (C ≤ 8) and loads each cached row once for the tile,
//! other sizes one query at a time with masked chunks. Per (query, key) score and per output
//! element the sequence of operations is fixed, whatever the other queries of the call.

#[cfg(target_arch = "x86_64")]
use super::x86::{F16, F32};
use super::{Rows, SimdLevel};
#[cfg(target_arch = "x86_64")]
use crate::attention::CacheKind;

/// [`CacheKind::Q8_0`] as the kernels' `KIND` parameter, beside [`F32`] and [`F16`].
#[cfg(target_arch = "x86_64")]
const Q8_0_ROWS: u8 = 3;

/// The storage a kernel's `KIND` parameter stands for.
#[cfg(target_arch = "x86_64")]
const fn cache_kind(kind: u8) -> CacheKind {
    match kind {
        F32 => CacheKind::F32,
        F16 => CacheKind::F16,
        Q8_0_ROWS => CacheKind::Q8_0,
        _ => panic!("attention: not a cache kind"),
    }
}

/// [`crate::attention::scores`] at a SIMD `level` (sizes checked by the caller).
pub(crate) fn attention_scores(
    level: SimdLevel,
    queries: Rows<'_, f32>,
    keys: crate::attention::CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
) {
    assert!(
        queries.len() == keys.len()
            && limits.len() == queries.count()
            && limits
                .iter()
                .enumerate()
                .all(|(q, &l)| l <= keys.count() && l <= stride && q * stride + l <= out.len()),
        "attention scores: sizes"
    );
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and every (query, key) pair written lies inside `out`
    // (checked above); `Rows` views are checked.
    unsafe {
        let stream = Stream {
            rows: keys.rows,
            next: keys.next,
        };
        match (level, keys.kind) {
            (SimdLevel::Avx2, CacheKind::F32) => {
                avx2::attention_scores::<F32>(queries, stream, limits, out, stride)
            }
            (SimdLevel::Avx2, CacheKind::F16) => {
                avx2::attention_scores::<F16>(queries, stream, limits, out, stride)
            }
            (SimdLevel::Avx2, CacheKind::Q8_0) => {
                avx2::attention_scores::<Q8_0_ROWS>(queries, stream, limits, out, stride)
            }
            (_, CacheKind::F32) => {
                avx512::attention_scores::<F32>(queries, stream, limits, out, stride)
            }
            (_, CacheKind::F16) => {
                avx512::attention_scores::<F16>(queries, stream, limits, out, stride)
            }
            (_, CacheKind::Q8_0) => {
                avx512::attention_scores::<Q8_0_ROWS>(queries, stream, limits, out, stride)
            }
        }
    }
}

/// [`crate::attention::weighted_sums`] at a SIMD `level` (sizes checked by the caller).
pub(crate) fn attention_weighted_sums(
    level: SimdLevel,
    probs: Rows<'_, f32>,
    values: crate::attention::CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
    onto: bool,
) {
    assert!(
        out.len() == probs.count() * values.len()
            && limits.len() == probs.count()
            && limits
                .iter()
                .all(|&l| l <= values.count() && l <= probs.len()),
        "attention weighted sums: sizes"
    );
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the sizes match (checked above).
    unsafe {
        let stream = Stream {
            rows: values.rows,
            next: values.next,
        };
        match (level, values.kind) {
            (SimdLevel::Avx2, CacheKind::F32) => {
                avx2::attention_weighted_sums::<F32>(probs, stream, limits, out, onto)
            }
            (SimdLevel::Avx2, CacheKind::F16) => {
                avx2::attention_weighted_sums::<F16>(probs, stream, limits, out, onto)
            }
            (SimdLevel::Avx2, CacheKind::Q8_0) => {
                avx2::attention_weighted_sums::<Q8_0_ROWS>(probs, stream, limits, out, onto)
            }
            (_, CacheKind::F32) => {
                avx512::attention_weighted_sums::<F32>(probs, stream, limits, out, onto)
            }
            (_, CacheKind::F16) => {
                avx512::attention_weighted_sums::<F16>(probs, stream, limits, out, onto)
            }
            (_, CacheKind::Q8_0) => {
                avx512::attention_weighted_sums::<Q8_0_ROWS>(probs, stream, limits, out, onto)
            }
        }
    }
}

/// Cached rows ahead of the current one whose lines the attention kernels prefetch into L1: a
/// head's rows are contiguous, but each row is only a few lines, too few for the hardware
/// prefetchers to run ahead of a pass that starts from memory.
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 4;

/// Cached rows as the kernels stream them: the rows, and the rows the caller reads next
/// ([`crate::attention::CachedRows::followed_by`]).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Stream<'a> {
    rows: Rows<'a, u8>,
    next: Option<Rows<'a, u8>>,
}

#[cfg(target_arch = "x86_64")]
impl Stream<'_> {
    fn count(&self) -> usize {
        self.rows.count()
    }

    fn len(&self) -> usize {
        self.rows.len()
    }

    fn ptr(&self, j: usize) -> *const u8 {
        self.rows.ptr(j)
    }

    /// Prefetches, as the kernel reaches row `j`: row `j + PREFETCH_ROWS` into L1 when there
    /// is one, and row `j` of the next rows into L2 (a block ahead: into L2 rather than L1,
    /// whose few miss buffers the far stream would hold up — measured 1.8× as fast on one
    /// head's decode attention from DRAM as the same prefetches into L1).
    #[inline]
    fn prefetch_ahead(&self, j: usize) {
        if j + PREFETCH_ROWS < self.count() {
            super::prefetch_lines(self.ptr(j + PREFETCH_ROWS), self.len(), false);
        }
        self.prefetch_next(j);
    }

    /// Prefetches row `j` of the next rows into L2, when there is one.
    #[inline]
    fn prefetch_next(&self, j: usize) {
        if let Some(next) = self.next.filter(|next| j < next.count()) {
            super::prefetch_lines(next.ptr(j), next.len(), true);
        }
    }

    /// The same rows without the next ones: for the tiles after the first over these rows,
    /// whose prefetches the first tile already issued.
    fn alone(self) -> Self {
        Self { next: None, ..self }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{cache_kind, Stream, Q8_0_ROWS};
    use crate::q8_0::{BLOCK_BYTES, BLOCK_VALUES};
    use crate::simd::x86::avx2::{load8, reduce8, splat_f16};
    use crate::simd::x86::float_size;
    use crate::simd::Rows;

    /// Values `i .. i + 8` (`i` a multiple of 8) of the cached row of `KIND` at `row`, as f32.
    ///
    /// # Safety
    ///
    /// AVX2 is available; the row holds values `i .. i + 8`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_values<const KIND: u8>(row: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller's contract: the values (a Q8_0 row: their block's scale and
        // quants) are readable.
        unsafe {
            if KIND == Q8_0_ROWS {
                let block = row.add(i / BLOCK_VALUES * BLOCK_BYTES);
                let quants = _mm_loadl_epi64(block.add(2 + i % BLOCK_VALUES).cast());
                let wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(quants));
                return _mm256_mul_ps(wide, splat_f16(block));
            }
            load8::<KIND>(row.add(i * float_size(KIND)))
        }
    }

    /// Attention scores ([`crate::attention::scores`]) over cached keys stored as `KIND` (rows of
    /// bytes; the next rows prefetched as the first query reaches each row): per (query, key)
    /// an 8-lane dot product (two accumulators, a zero-padded f32 copy of a ragged tail),
    /// reduced by [`reduce8`].
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; every key row holds `queries.len()` values of `KIND`; every
    /// limit is at most the key count and `q * stride + limit <= out.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn attention_scores<const KIND: u8>(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        stride: usize,
    ) {
        let dim = queries.len();
        let full = dim / 8;
        let rest = dim - 8 * full;
        for (q, &limit) in limits.iter().enumerate() {
            let query = queries.row(q);
            let mut query_tail = [0.0f32; 8];
            query_tail[..rest].copy_from_slice(&query[8 * full..]);
            for j in 0..limit {
                if q == 0 {
                    keys.prefetch_next(j);
                }
                let key = keys.rows.row(j);
                // SAFETY: chunks `c < full` lie inside both rows; the tail goes through buffers.
                unsafe {
                    let mut acc = [_mm256_setzero_ps(); 2];
                    for c in 0..full {
                        acc[c % 2] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(query.as_ptr().add(8 * c)),
                            load_values::<KIND>(key.as_ptr(), 8 * c),
                            acc[c % 2],
                        );
                    }
                    if rest > 0 {
                        let key_tail = widen_tail::<KIND>(key, 8 * full, rest);
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

    /// Values `from .. from + count` (`count` < 8) of a `KIND` row as f32, zero-padded to 8.
    fn widen_tail<const KIND: u8>(row: &[u8], from: usize, count: usize) -> [f32; 8] {
        let mut tail = [0.0f32; 8];
        for (t, v) in tail[..count].iter_mut().enumerate() {
            *v = cache_kind(KIND).value(row, from + t);
        }
        tail
    }

    /// Attention weighted sums ([`crate::attention::weighted_sums`]) over cached values stored as
    /// `KIND`: per query and output element `y = fma(p_j, v_j, y)` for keys `j` in order from
    /// zero. Head sizes of a multiple of 8 run in tiles of queries whose outputs stay in
    /// registers while the value rows stream past ([`sums_tile`]); other sizes one query at a
    /// time, the output row kept in memory (a ragged tail through a zero-padded buffer). The
    /// same sequence per output element either way.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; `out` holds one row of the values' length per query; every
    /// limit is at most the value count and the probability row length.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn attention_weighted_sums<const KIND: u8>(
        probs: Rows<'_, f32>,
        values: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        onto: bool,
    ) {
        let dim = cache_kind(KIND).values(values.len());
        if dim > 0 && dim.is_multiple_of(8) {
            // SAFETY: forwarded contract.
            unsafe { sums_tiled::<KIND>(probs, values, limits, out, onto) };
            return;
        }
        let full = dim / 8;
        for (q, (o, &limit)) in out.chunks_exact_mut(dim.max(1)).zip(limits).enumerate() {
            let mut tail = [0.0f32; 8];
            if onto {
                tail[..dim - 8 * full].copy_from_slice(&o[8 * full..]);
            } else {
                o.fill(0.0);
            }
            for j in 0..limit {
                if q == 0 {
                    values.prefetch_next(j);
                }
                let value = values.rows.row(j);
                // SAFETY: chunks `c < full` lie inside the value row and `o`; the tail goes
                // through buffers.
                unsafe {
                    let p = _mm256_set1_ps(probs.row(q)[j]);
                    for c in 0..full {
                        let y = o.as_mut_ptr().add(8 * c);
                        let v = load_values::<KIND>(value.as_ptr(), 8 * c);
                        _mm256_storeu_ps(y, _mm256_fmadd_ps(p, v, _mm256_loadu_ps(y)));
                    }
                    if dim > 8 * full {
                        let v = widen_tail::<KIND>(value, 8 * full, dim - 8 * full);
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

    /// [`attention_weighted_sums`] for head sizes of `8 · chunks`: the queries in tiles of `T`,
    /// each tile's outputs `G` chunks at a time in registers (8–12 independent multiply-add
    /// chains: 6 × 2 where the head's chunk count is even, else 8 × 1, then 4, 2 and 1 query
    /// with as many chunks as divide it), so a value chunk is widened once per tile rather than
    /// once per query and no output goes through memory per key. On Zen 4 at AVX2 (criterion
    /// `weighted-sums/f16/hot`, one value head of 4,096 positions, head size 128) 16 queries
    /// took 732 µs one at a time through memory, 315 µs in tiles of 8 × 1, 205 in 4 × 2 and
    /// 187 in 6 × 2.
    ///
    /// # Safety
    ///
    /// As [`attention_weighted_sums`], with values of a multiple of 8 elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sums_tiled<const KIND: u8>(
        probs: Rows<'_, f32>,
        values: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        onto: bool,
    ) {
        let chunks = cache_kind(KIND).values(values.len()) / 8;
        let mut first = 0;
        while first < limits.len() {
            // The first tile prefetches the next rows; the others read the same values.
            let values = if first == 0 { values } else { values.alone() };
            let args = (probs, values, limits, &mut *out, first, onto);
            // SAFETY: forwarded contract; the tile's queries are `first .. first + T`.
            unsafe {
                first += match (limits.len() - first, chunks) {
                    (6.., c) if c % 2 == 0 => sums_tile::<KIND, 6, 2>(args),
                    (8.., _) => sums_tile::<KIND, 8, 1>(args),
                    (4.., c) if c % 2 == 0 => sums_tile::<KIND, 4, 2>(args),
                    (4.., _) => sums_tile::<KIND, 4, 1>(args),
                    (2.., c) if c % 4 == 0 => sums_tile::<KIND, 2, 4>(args),
                    (2.., c) if c % 2 == 0 => sums_tile::<KIND, 2, 2>(args),
                    (2.., _) => sums_tile::<KIND, 2, 1>(args),
                    (_, c) if c % 8 == 0 => sums_tile::<KIND, 1, 8>(args),
                    (_, c) if c % 4 == 0 => sums_tile::<KIND, 1, 4>(args),
                    (_, c) if c % 2 == 0 => sums_tile::<KIND, 1, 2>(args),
                    _ => sums_tile::<KIND, 1, 1>(args),
                };
            }
        }
    }

    /// One tile of `T` queries from `first` for [`sums_tiled`], `G` output chunks of each at
    /// a time (the head's chunk count a multiple of `G`): the values every query of the tile
    /// sees, then the causal tail checked per query. Returns `T`.
    ///
    /// # Safety
    ///
    /// As [`sums_tiled`], with queries `first .. first + T` present.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sums_tile<const KIND: u8, const T: usize, const G: usize>(
        (probs, values, limits, out, first, onto): (
            Rows<'_, f32>,
            Stream<'_>,
            &[usize],
            &mut [f32],
            usize,
            bool,
        ),
    ) -> usize {
        let dim = cache_kind(KIND).values(values.len());
        let tile_limits = &limits[first..first + T];
        let longest = tile_limits.iter().copied().max().unwrap_or(0);
        let shortest = tile_limits.iter().copied().min().unwrap_or(0);
        // SAFETY: value rows `j < longest` exist and hold `dim` values; probability rows
        // `first .. first + T` hold at least their limits; output rows `first + t` lie inside
        // `out` (the caller's contract).
        unsafe {
            let p: [*const f32; T] = std::array::from_fn(|t| probs.ptr(first + t));
            let out = out.as_mut_ptr();
            for c0 in (0..dim / 8).step_by(G) {
                let at = |t: usize, g: usize| out.add((first + t) * dim + 8 * (c0 + g));
                let mut acc: [[__m256; G]; T] = std::array::from_fn(|t| {
                    std::array::from_fn(|g| match onto {
                        true => _mm256_loadu_ps(at(t, g)),
                        false => _mm256_setzero_ps(),
                    })
                });
                for j in 0..shortest {
                    if c0 == 0 {
                        values.prefetch_ahead(j);
                    }
                    let vp = values.ptr(j);
                    let v: [__m256; G] =
                        std::array::from_fn(|g| load_values::<KIND>(vp, 8 * (c0 + g)));
                    for (row, &pt) in acc.iter_mut().zip(&p) {
                        let pj = _mm256_broadcast_ss(&*pt.add(j));
                        for (y, &v) in row.iter_mut().zip(&v) {
                            *y = _mm256_fmadd_ps(pj, v, *y);
                        }
                    }
                }
                for j in shortest..longest {
                    let vp = values.ptr(j);
                    let v: [__m256; G] =
                        std::array::from_fn(|g| load_values::<KIND>(vp, 8 * (c0 + g)));
                    for ((row, &pt), &limit) in acc.iter_mut().zip(&p).zip(tile_limits) {
                        if j < limit {
                            let pj = _mm256_broadcast_ss(&*pt.add(j));
                            for (y, &v) in row.iter_mut().zip(&v) {
                                *y = _mm256_fmadd_ps(pj, v, *y);
                            }
                        }
                    }
                }
                for (t, row) in acc.iter().enumerate() {
                    for (g, y) in row.iter().enumerate() {
                        _mm256_storeu_ps(at(t, g), *y);
                    }
                }
            }
        }
        T
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{cache_kind, Stream, Q8_0_ROWS};
    use crate::q8_0::{BLOCK_BYTES, BLOCK_VALUES};
    use crate::simd::x86::avx512::splat_f16;
    use crate::simd::x86::avx512::{load16, load16_f32};
    use crate::simd::x86::float_size;
    use crate::simd::Rows;

    /// Values `i .. i + count` (`count` ≤ 16, `i` a multiple of 16) of the cached row of
    /// `KIND` at `row`, as f32, zero past `count`. (A Q8_0 row is whole blocks of 32, so its
    /// chunks are whole.)
    ///
    /// # Safety
    ///
    /// AVX-512 is available; the row holds values `i .. i + count`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn load_values<const KIND: u8>(row: *const u8, i: usize, count: usize) -> __m512 {
        // SAFETY: the caller's contract: the values (a Q8_0 row: their block's scale and
        // quants) are readable.
        unsafe {
            if KIND == Q8_0_ROWS {
                debug_assert_eq!(count, 16, "a Q8_0 row's chunks are whole");
                let block = row.add(i / BLOCK_VALUES * BLOCK_BYTES);
                let quants = _mm_loadu_si128(block.add(2 + i % BLOCK_VALUES).cast());
                let wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(quants));
                return _mm512_mul_ps(wide, splat_f16(block));
            }
            load16::<KIND>(row.add(i * float_size(KIND)), count)
        }
    }

    /// The most queries of one tile of [`attention_scores`], multiplied with each key as it
    /// streams past (then tiles of 2 and 1). Four queries' chunks outnumber the registers, so
    /// some are read from L1 as they are multiplied, but each key chunk is widened once for
    /// four: an 8-row verify pass's 16 queries × 4,096 f16 keys took 396 µs in tiles of 4 (392
    /// in tiles of 8) against 455 µs in tiles of 2
    /// (`cargo bench -p specula-kernels -- attention/hot/16q`).
    const SCORE_TILE: usize = 4;

    /// Keys per span of [`sums_tile`]'s transposed probabilities (at 16 queries, 4 KiB on the
    /// stack): a paged cache's whole block. Whole blocks of 16 keys, which
    /// [`transpose_span`] writes.
    const SUM_SPAN: usize = 64;
    const _: () = assert!(SUM_SPAN.is_multiple_of(16));

    /// Attention scores ([`crate::attention::scores`]) over cached keys stored as `KIND` (F32,
    /// F16 or Q8_0; `keys` are rows of bytes). Head sizes of 16 · C (C ≤ 8) keep a tile of queries in
    /// registers and load each key once for the tile; other sizes run one query at a time with
    /// masked chunks. Per (query, key): two accumulators over the chunks (even / odd), then one
    /// horizontal sum — whatever the other queries.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; every key row holds `queries.len()` values of `KIND`;
    /// every limit is at most the key count and `q * stride + limit <= out.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn attention_scores<const KIND: u8>(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        stride: usize,
    ) {
        let dim = queries.len();
        // SAFETY: forwarded contract.
        unsafe {
            if dim.is_multiple_of(16) && (1..=8).contains(&(dim / 16)) {
                match dim / 16 {
                    1 => scores_tiled::<KIND, 1>(queries, keys, limits, out, stride),
                    2 => scores_tiled::<KIND, 2>(queries, keys, limits, out, stride),
                    3 => scores_tiled::<KIND, 3>(queries, keys, limits, out, stride),
                    4 => scores_tiled::<KIND, 4>(queries, keys, limits, out, stride),
                    5 => scores_tiled::<KIND, 5>(queries, keys, limits, out, stride),
                    6 => scores_tiled::<KIND, 6>(queries, keys, limits, out, stride),
                    7 => scores_tiled::<KIND, 7>(queries, keys, limits, out, stride),
                    _ => scores_tiled::<KIND, 8>(queries, keys, limits, out, stride),
                }
                return;
            }
            let chunks = dim.div_ceil(16);
            for (q, &limit) in limits.iter().enumerate() {
                let qp = queries.ptr(q);
                for j in 0..limit {
                    let kp = keys.ptr(j);
                    let mut acc = [_mm512_setzero_ps(); 2];
                    for c in 0..chunks {
                        let lanes = (dim - 16 * c).min(16);
                        acc[c % 2] = _mm512_fmadd_ps(
                            load16_f32(qp.add(16 * c), lanes),
                            load_values::<KIND>(kp, 16 * c, lanes),
                            acc[c % 2],
                        );
                    }
                    out[q * stride + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                }
            }
        }
    }

    /// [`attention_scores`] for head size `16 · C`: queries in tiles of [`SCORE_TILE`] (then
    /// 2, then one) multiplied with each key as the keys stream past, keys in blocks of 16
    /// whose dot products with a query are summed across lanes together ([`sum_lanes_16`])
    /// rather than one horizontal sum per key. A key's arithmetic is the same wherever it falls
    /// in a block and whatever the other keys and queries: two accumulators over the chunks
    /// (even / odd), their sum, then the lane tree of [`sum_lanes_16`].
    ///
    /// # Safety
    ///
    /// As [`attention_scores`], with `queries.len() == 16 · C`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scores_tiled<const KIND: u8, const C: usize>(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        stride: usize,
    ) {
        let mut first = 0;
        while first < limits.len() {
            // The first tile prefetches the next rows; the others read the same keys.
            let keys = if first == 0 { keys } else { keys.alone() };
            // SAFETY: forwarded contract; the tile's queries are `first .. first + T`.
            unsafe {
                first += match limits.len() - first {
                    SCORE_TILE.. => scores_tile::<KIND, C, SCORE_TILE>(
                        queries, keys, limits, out, stride, first,
                    ),
                    2.. => scores_tile::<KIND, C, 2>(queries, keys, limits, out, stride, first),
                    _ => scores_tile::<KIND, C, 1>(queries, keys, limits, out, stride, first),
                };
            }
        }
    }

    /// One tile of `T` queries from `first` for [`scores_tiled`]; returns `T`.
    ///
    /// # Safety
    ///
    /// As [`scores_tiled`], with queries `first .. first + T` present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scores_tile<const KIND: u8, const C: usize, const T: usize>(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        stride: usize,
        first: usize,
    ) -> usize {
        let tile_limits = &limits[first..first + T];
        let longest = tile_limits.iter().copied().max().unwrap_or(0);
        let shortest = tile_limits.iter().copied().min().unwrap_or(0);
        // SAFETY: rows `first .. first + T` exist; key `j < longest` exists; the written scores
        // lie inside `out` (the caller's contract).
        unsafe {
            let q: [[__m512; C]; T] = std::array::from_fn(|t| {
                let qp = queries.ptr(first + t);
                std::array::from_fn(|c| _mm512_loadu_ps(qp.add(16 * c)))
            });
            // Per query, one vector of lane products per key of a block. Slots of keys past the
            // block's end or a query's limit keep what they held (zeros, or an earlier block's
            // products): each lane of a lane sum depends on its own slot only, and those lanes
            // are never stored.
            let mut products = [[_mm512_setzero_ps(); 16]; T];
            for block in (0..longest).step_by(16) {
                let in_block = 16.min(longest - block);
                for (j, key) in (block..block + in_block).enumerate() {
                    keys.prefetch_ahead(key);
                    let kp = keys.ptr(key);
                    let k: [__m512; C] =
                        std::array::from_fn(|c| load_values::<KIND>(kp, 16 * c, 16));
                    let every = key < shortest;
                    for t in 0..T {
                        if !every && key >= tile_limits[t] {
                            continue;
                        }
                        let mut acc = [_mm512_setzero_ps(); 2];
                        for c in 0..C {
                            acc[c % 2] = _mm512_fmadd_ps(q[t][c], k[c], acc[c % 2]);
                        }
                        products[t][j] = _mm512_add_ps(acc[0], acc[1]);
                    }
                }
                for (t, &limit) in tile_limits.iter().enumerate() {
                    if block >= limit {
                        continue;
                    }
                    let keep = (limit - block).min(16);
                    let mask = if keep == 16 {
                        0xffff
                    } else {
                        (1u16 << keep) - 1
                    };
                    let sums = sum_lanes_16(&products[t]);
                    let dst = out.as_mut_ptr().add((first + t) * stride + block);
                    _mm512_mask_storeu_ps(dst, mask, sums);
                }
            }
        }
        T
    }

    /// The lane sums of 16 vectors, in order: lane `j` of the result is the sum of the 16 lanes of
    /// `v[j]`, always by the same tree (lanes `i` and `i + 8`, then `+ 4`, then `+ 2`, then
    /// `+ 1`), whatever the other vectors hold.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn sum_lanes_16(v: &[__m512; 16]) -> __m512 {
        // Each step adds the two halves of every vector's partial sums and packs two vectors'
        // halved partials into one.
        // Lanes 0..8 of `w[i]`: v[2i] lanes i + lanes i + 8; lanes 8..16: the same for v[2i + 1].
        let w: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        // 128-bit quarter `r` of `x[i]`: the four partial sums of v[4i + r].
        let x: [__m512; 4] = std::array::from_fn(|i| {
            let (a, b) = (w[2 * i], w[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        // Quarter `r` of `y[i]`: two partials of v[8i + r], then two of v[8i + 4 + r].
        let y: [__m512; 2] = std::array::from_fn(|i| {
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        // Lane `4r + m`: the sum of v[4m + r].
        let sums = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, sums)
    }

    /// Attention weighted sums ([`crate::attention::weighted_sums`]) over cached values stored as
    /// `KIND`: per output element `y = fma(p_j, v_j, y)` for keys `j` in order from zero. Head
    /// sizes of 16 · C (C ≤ 8) keep a tile of outputs in registers and load each value row once
    /// for the tile; other sizes run one query at a time with masked chunks through memory (the
    /// same per-element sequence).
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `out` holds one row of the values' length per query;
    /// every limit is at most the value count and the probability row length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn attention_weighted_sums<const KIND: u8>(
        probs: Rows<'_, f32>,
        values: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        onto: bool,
    ) {
        let dim = cache_kind(KIND).values(values.len());
        // SAFETY: forwarded contract.
        unsafe {
            if dim.is_multiple_of(16) && (1..=8).contains(&(dim / 16)) {
                match dim / 16 {
                    1 => sums_tiled::<KIND, 1>(probs, values, limits, out, onto),
                    2 => sums_tiled::<KIND, 2>(probs, values, limits, out, onto),
                    3 => sums_tiled::<KIND, 3>(probs, values, limits, out, onto),
                    4 => sums_tiled::<KIND, 4>(probs, values, limits, out, onto),
                    5 => sums_tiled::<KIND, 5>(probs, values, limits, out, onto),
                    6 => sums_tiled::<KIND, 6>(probs, values, limits, out, onto),
                    7 => sums_tiled::<KIND, 7>(probs, values, limits, out, onto),
                    _ => sums_tiled::<KIND, 8>(probs, values, limits, out, onto),
                }
                return;
            }
            let chunks = dim.div_ceil(16);
            for (q, (o, &limit)) in out.chunks_exact_mut(dim.max(1)).zip(limits).enumerate() {
                if !onto {
                    o.fill(0.0);
                }
                let op = o.as_mut_ptr();
                for j in 0..limit {
                    let p = _mm512_set1_ps(*probs.ptr(q).add(j));
                    let vp = values.ptr(j);
                    for c in 0..chunks {
                        let lanes = (dim - 16 * c).min(16);
                        let mask = if lanes == 16 {
                            0xffff
                        } else {
                            (1u16 << lanes) - 1
                        };
                        let y = _mm512_fmadd_ps(
                            p,
                            load_values::<KIND>(vp, 16 * c, lanes),
                            _mm512_maskz_loadu_ps(mask, op.add(16 * c)),
                        );
                        _mm512_mask_storeu_ps(op.add(16 * c), mask, y);
                    }
                }
            }
        }
    }

    /// [`attention_weighted_sums`] for head size `16 · C`: queries in tiles of 16, 8, 4, 2 and
    /// 1 whose outputs stay in registers while the value rows stream past — all their chunks
    /// for a decode step's few queries, else one 16-value chunk at a time —, so each value row
    /// (and a Q8_0 row's widening) is read once per chunk for a whole tile rather than once
    /// per query.
    ///
    /// # Safety
    ///
    /// As [`attention_weighted_sums`], with values of `16 · C` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn sums_tiled<const KIND: u8, const C: usize>(
        probs: Rows<'_, f32>,
        values: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        onto: bool,
    ) {
        let mut first = 0;
        while first < limits.len() {
            let left = limits.len() - first;
            // The first tile prefetches the next rows; the others read the same values.
            let values = if first == 0 { values } else { values.alone() };
            // SAFETY: forwarded contract; the tile's queries are `first .. first + T`.
            unsafe {
                first += match left {
                    16.. => sums_tile::<KIND, C, 16>(probs, values, limits, out, first, onto),
                    8.. => sums_tile::<KIND, C, 8>(probs, values, limits, out, first, onto),
                    4..=7 => sums_tile::<KIND, C, 4>(probs, values, limits, out, first, onto),
                    2 | 3 => sums_tile::<KIND, C, 2>(probs, values, limits, out, first, onto),
                    _ => sums_tile::<KIND, C, 1>(probs, values, limits, out, first, onto),
                };
            }
        }
    }

    /// Writes probabilities `span .. end` of the `T` (8 or 16) rows `p` (row `t` read below
    /// `limits[t]`, zero past it) transposed to `dst`: probability `j` of row `t` at `dst[T ·
    /// (j − span) + t]`, in blocks of 16 keys through registers (8 rows as 16 with zeros).
    /// Copied one element at a time, the transposition took a sixth of a 16-query tile's time:
    /// sums over 4,096 f16 values (one thread, from cache) of 16 queries 181 µs that way, 165
    /// this way, 152 with none; of 8 queries 86 → 84 µs. Tiles of 4 queries gained nothing
    /// this way and keep the element-by-element copy.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `limits` holds at least `T` limits and each `p[t]`
    /// is readable below `limits[t]`; `end − span ≤ SUM_SPAN` (a multiple of 16, so the last
    /// block of 16 columns ends inside it too); `dst` has room for `T · SUM_SPAN` floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn transpose_span<const T: usize>(
        p: &[*const f32; T],
        limits: &[usize],
        span: usize,
        end: usize,
        dst: *mut f32,
    ) {
        for first in (span..end).step_by(16) {
            let rows: [__m512; 16] = std::array::from_fn(|t| {
                if t >= T {
                    return _mm512_setzero_ps();
                }
                let valid = limits[t].min(end).saturating_sub(first).min(16);
                // SAFETY: only the row's elements below its limit are read; a masked-off lane
                // never faults.
                unsafe {
                    _mm512_maskz_loadu_ps(((1u32 << valid) - 1) as u16, p[t].wrapping_add(first))
                }
            });
            // Pairs of rows interleaved, then pairs of pairs: register `4i + m` holds, in its
            // 128-bit lane `k`, column `4k + m` of rows `4i .. 4i + 4`.
            let pairs: [__m512; 16] = std::array::from_fn(|i| match i % 2 {
                0 => _mm512_unpacklo_ps(rows[i], rows[i + 1]),
                _ => _mm512_unpackhi_ps(rows[i - 1], rows[i]),
            });
            let quads: [__m512; 16] = std::array::from_fn(|i| {
                let (a, b) = (
                    pairs[4 * (i / 4) + (i % 4) / 2],
                    pairs[4 * (i / 4) + (i % 4) / 2 + 2],
                );
                let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
                _mm512_castpd_ps(match i % 2 {
                    0 => _mm512_unpacklo_pd(a, b),
                    _ => _mm512_unpackhi_pd(a, b),
                })
            });
            for m in 0..4 {
                // Lanes 0, 2 (then 1, 3) of rows 0–3 and 4–7, of rows 8–11 and 12–15.
                let even_low = _mm512_shuffle_f32x4::<0x88>(quads[m], quads[4 + m]);
                let odd_low = _mm512_shuffle_f32x4::<0xdd>(quads[m], quads[4 + m]);
                let even_high = _mm512_shuffle_f32x4::<0x88>(quads[8 + m], quads[12 + m]);
                let odd_high = _mm512_shuffle_f32x4::<0xdd>(quads[8 + m], quads[12 + m]);
                let columns = [
                    _mm512_shuffle_f32x4::<0x88>(even_low, even_high),
                    _mm512_shuffle_f32x4::<0x88>(odd_low, odd_high),
                    _mm512_shuffle_f32x4::<0xdd>(even_low, even_high),
                    _mm512_shuffle_f32x4::<0xdd>(odd_low, odd_high),
                ];
                for (k, column) in columns.into_iter().enumerate() {
                    // SAFETY: column `first − span + 4k + m < SUM_SPAN` of `dst` (the caller's
                    // contract; columns past `end` hold zeros, never read), its first `T` lanes.
                    unsafe {
                        let at = dst.add(T * (first - span + 4 * k + m));
                        match T {
                            16 => _mm512_storeu_ps(at, column),
                            8 => _mm256_storeu_ps(at, _mm512_castps512_ps256(column)),
                            _ => unreachable!("tiles of 8 or 16 queries"),
                        }
                    }
                }
            }
        }
    }

    /// One tile of `T` queries from `first` for [`sums_tiled`]; returns `T`.
    ///
    /// # Safety
    ///
    /// As [`sums_tiled`], with queries `first .. first + T` present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn sums_tile<const KIND: u8, const C: usize, const T: usize>(
        probs: Rows<'_, f32>,
        values: Stream<'_>,
        limits: &[usize],
        out: &mut [f32],
        first: usize,
        onto: bool,
    ) -> usize {
        let dim = 16 * C;
        let tile_limits = &limits[first..first + T];
        let longest = tile_limits.iter().copied().max().unwrap_or(0);
        let shortest = tile_limits.iter().copied().min().unwrap_or(0);
        // SAFETY: value rows `j < longest` exist; probability rows `first .. first + T` hold at
        // least their limits; output rows `first + t` lie inside `out`.
        unsafe {
            let p: [*const f32; T] = std::array::from_fn(|t| probs.ptr(first + t));
            if (T + 1) * C <= 24 {
                // Few queries × chunks (a decode step's, or short heads): every chunk's outputs in
                // registers at once, so
                // the key loop carries T · C independent multiply-add chains instead of T (one
                // chunk at a time, each chain waits on the latency of the last). The same
                // sequence per output element.
                let mut acc: [[__m512; C]; T] = std::array::from_fn(|t| {
                    std::array::from_fn(|c| {
                        if onto {
                            _mm512_loadu_ps(out.as_ptr().add((first + t) * dim + 16 * c))
                        } else {
                            _mm512_setzero_ps()
                        }
                    })
                });
                for j in 0..longest {
                    values.prefetch_ahead(j);
                    let vp = values.ptr(j);
                    let v: [__m512; C] =
                        std::array::from_fn(|c| load_values::<KIND>(vp, 16 * c, 16));
                    for t in 0..T {
                        if j < tile_limits[t] {
                            let pj = _mm512_set1_ps(*p[t].add(j));
                            for c in 0..C {
                                acc[t][c] = _mm512_fmadd_ps(pj, v[c], acc[t][c]);
                            }
                        }
                    }
                }
                for (t, row) in acc.iter().enumerate() {
                    for (c, y) in row.iter().enumerate() {
                        _mm512_storeu_ps(out.as_mut_ptr().add((first + t) * dim + 16 * c), *y);
                    }
                }
                return T;
            }
            // The tile's probabilities span by span, transposed (probability `j` of query `t`
            // at `[j - span][t]`): one pointer and fixed offsets, where `T` row pointers
            // outnumber the registers at 16 queries and would be reloaded for every product.
            let out = out.as_mut_ptr();
            let mut span_probs = [[0.0f32; T]; SUM_SPAN];
            // (At least one span, so that a tile with no keys still writes its outputs.)
            for span in (0..longest.max(1)).step_by(SUM_SPAN) {
                let end = (span + SUM_SPAN).min(longest);
                if matches!(T, 8 | 16) {
                    transpose_span(&p, tile_limits, span, end, span_probs.as_mut_ptr().cast());
                } else {
                    for (j, row) in (span..end).zip(span_probs.iter_mut()) {
                        for (t, prob) in row.iter_mut().enumerate() {
                            // Past its limit a query's probability is never read below (and may
                            // lie past its row).
                            *prob = if j < tile_limits[t] {
                                *p[t].add(j)
                            } else {
                                0.0
                            };
                        }
                    }
                }
                let every = shortest.clamp(span, end);
                for c in 0..C {
                    let dst = |t: usize| out.add((first + t) * dim + 16 * c);
                    let mut acc: [__m512; T] = std::array::from_fn(|t| {
                        if onto || span > 0 {
                            _mm512_loadu_ps(dst(t))
                        } else {
                            _mm512_setzero_ps()
                        }
                    });
                    // Values every query of the tile sees, then the causal tail checked per
                    // query.
                    for j in span..every {
                        if c == 0 {
                            values.prefetch_ahead(j);
                        }
                        let v = load_values::<KIND>(values.ptr(j), 16 * c, 16);
                        let row = &span_probs[j - span];
                        for (y, &pj) in acc.iter_mut().zip(row) {
                            *y = _mm512_fmadd_ps(_mm512_set1_ps(pj), v, *y);
                        }
                    }
                    for j in every..end {
                        let v = load_values::<KIND>(values.ptr(j), 16 * c, 16);
                        let row = &span_probs[j - span];
                        for ((y, &pj), &limit) in acc.iter_mut().zip(row).zip(tile_limits) {
                            if j < limit {
                                *y = _mm512_fmadd_ps(_mm512_set1_ps(pj), v, *y);
                            }
                        }
                    }
                    for (t, y) in acc.iter().enumerate() {
                        _mm512_storeu_ps(dst(t), *y);
                    }
                }
            }
        }
        T
    }
}
