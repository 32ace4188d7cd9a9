//! Attention of several queries over one key/value head: the scores and the probability-weighted
//! sums of the values, with each cached row read once for all the queries.
//!
//! The queries are the query heads that share a key/value head (grouped-query attention) for
//! every row of a batch; query `q` sees the first `limits[q]` keys (causal attention: a verify
//! row sees its own position and the ones before). Each (query, key) score and each output
//! element is computed by one fixed sequence of operations, whatever the other queries of the
//! call, so a verify row gets exactly the bits of a single-token pass.

use crate::q8_0;
use crate::simd::{self, Rows, SimdLevel};

/// A run of cached key or value rows as a KV cache stores them: f32, f16 (half the memory
/// and the memory traffic; values rounded to nearest-even when stored, as llama.cpp's default
/// cache does), or Q8_0 blocks (about a quarter).
#[derive(Debug, Clone, Copy)]
pub enum Cached<'a> {
    F32(&'a [f32]),
    /// IEEE binary16 bit patterns.
    F16(&'a [u16]),
    /// Q8_0 blocks as GGUF stores them (an f16 scale `d`, then 32 signed quants `q`): value
    /// `q · d`, the bits [`crate::q8_0::dequantize_row`] gives, which the kernels compute as
    /// they read each block rather than from a dequantised copy.
    Q8_0(&'a [u8]),
}

impl<'a> Cached<'a> {
    /// Number of stored units: values for f32 and f16, bytes for Q8_0.
    pub fn len(self) -> usize {
        match self {
            Cached::F32(v) => v.len(),
            Cached::F16(v) => v.len(),
            Cached::Q8_0(v) => v.len(),
        }
    }

    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// `count` rows of `len` stored units, `stride` units apart, the first starting at unit
    /// `first` (e.g. one head of every cached position). Units are values for f32 and f16,
    /// bytes for Q8_0, whose rows are whole blocks.
    ///
    /// # Panics
    ///
    /// If the rows do not fit, or a Q8_0 row is not a whole number of blocks.
    pub fn rows(self, first: usize, stride: usize, len: usize, count: usize) -> CachedRows<'a> {
        let (kind, bytes, size) = match self {
            Cached::F32(v) => (CacheKind::F32, simd::f32_bytes(v), 4),
            Cached::F16(v) => (CacheKind::F16, simd::u16_bytes(v), 2),
            Cached::Q8_0(v) => {
                assert!(
                    len.is_multiple_of(q8_0::BLOCK_BYTES),
                    "attention: a Q8_0 row of {len} bytes is not whole {}-byte blocks",
                    q8_0::BLOCK_BYTES
                );
                (CacheKind::Q8_0, v, 1)
            }
        };
        CachedRows {
            kind,
            rows: Rows::new(&bytes[first * size..], stride * size, len * size, count),
            next: None,
        }
    }
}

/// How cached rows are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheKind {
    F32,
    F16,
    Q8_0,
}

impl CacheKind {
    /// Values in a row of `bytes` bytes.
    pub(crate) const fn values(self, bytes: usize) -> usize {
        match self {
            CacheKind::F32 => bytes / 4,
            CacheKind::F16 => bytes / 2,
            CacheKind::Q8_0 => bytes / q8_0::BLOCK_BYTES * q8_0::BLOCK_VALUES,
        }
    }

    /// Value `i` of a stored `row`, as f32 (exact: f32 and f16 widen without rounding; Q8_0
    /// is `q · d`, one rounding, as [`crate::q8_0::dequantize_row`]).
    pub(crate) fn value(self, row: &[u8], i: usize) -> f32 {
        match self {
            CacheKind::F32 => f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap()),
            CacheKind::F16 => crate::f16::to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])),
            CacheKind::Q8_0 => {
                let block = &row[i / q8_0::BLOCK_VALUES * q8_0::BLOCK_BYTES..];
                f32::from(block[2 + i % q8_0::BLOCK_VALUES] as i8) * q8_0::scale(block)
            }
        }
    }
}

/// Cached rows ([`Cached::rows`]): their storage and a byte view of them.
#[derive(Debug, Clone, Copy)]
pub struct CachedRows<'a> {
    pub(crate) kind: CacheKind,
    /// Rows of `len · size` bytes.
    pub(crate) rows: Rows<'a, u8>,
    /// Rows the caller reads next, prefetched while these are read ([`Self::followed_by`]; only
    /// the x86-64 kernels prefetch).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) next: Option<Rows<'a, u8>>,
}

impl<'a> CachedRows<'a> {
    /// These rows, with the rows the caller will read right after them (a paged cache's next
    /// block): the SIMD kernels fetch row `j` of `next` into L2 as they reach row `j` of these
    /// (AVX-512 for head sizes of 16 · C, C ≤ 8, and AVX2), so the next block arrives a whole
    /// block ahead of its use, wherever in memory it lies. (The near prefetch of a few rows
    /// ahead cannot cross into another block, and a block's first rows would otherwise wait on
    /// memory; on one key/value head of 4,096 f16 positions from DRAM,
    /// `cargo bench -p specula-kernels -- attention/cold/2q`, a decode step's attention ran
    /// about twice as fast.) Only a hint: no result depends on it.
    pub fn followed_by(self, next: CachedRows<'a>) -> Self {
        Self {
            next: Some(next.rows),
            ..self
        }
    }
}

impl CachedRows<'_> {
    /// Starts loading these rows into L2 (a hint: no result depends on it), for rows the
    /// caller reads soon but not yet: e.g. the first cache block of the next head it attends
    /// over, which no kernel prefetches (they prefetch a block ahead of the one they read).
    pub fn prefetch_l2(&self) {
        let rows = &self.rows;
        if rows.count() == 0 {
            return;
        }
        if rows.stride() == rows.len() {
            simd::prefetch_lines(rows.ptr(0), rows.count() * rows.len(), true);
        } else {
            for j in 0..rows.count() {
                simd::prefetch_lines(rows.ptr(j), rows.len(), true);
            }
        }
    }

    /// Number of rows.
    pub fn count(&self) -> usize {
        self.rows.count()
    }

    /// Values per row.
    pub fn len(&self) -> usize {
        self.kind.values(self.rows.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `j` as f32 values (the values every kernel reads: a Q8_0 row's as `q · d`) into `out`
    /// (`len()` values).
    pub fn row_f32(&self, j: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.len(), "attention: one row of values");
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.value(j, i);
        }
    }

    /// Value `i` of row `j`, as f32 (the scalar references read through this).
    fn value(&self, j: usize, i: usize) -> f32 {
        self.kind.value(self.rows.row(j), i)
    }
}

/// `scores[q * stride + j] = queries[q] · keys[j]` for every query `q` and key `j <
/// limits[q]`, at the process's [`simd::level`].
pub fn scores(
    queries: Rows<'_, f32>,
    keys: CachedRows<'_>,
    limits: &[usize],
    scores: &mut [f32],
    stride: usize,
) {
    scores_with(simd::level(), queries, keys, limits, scores, stride);
}

/// [`scores`] at `level` (which must be supported).
pub fn scores_with(
    level: SimdLevel,
    queries: Rows<'_, f32>,
    keys: CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
) {
    check(queries.count(), keys.count(), limits, out.len(), stride);
    assert_eq!(
        queries.len(),
        keys.len(),
        "attention: query and key sizes differ"
    );
    match level {
        SimdLevel::Scalar => {
            for (q, &limit) in limits.iter().enumerate() {
                for j in 0..limit {
                    out[q * stride + j] = queries
                        .row(q)
                        .iter()
                        .enumerate()
                        .fold(0.0f32, |acc, (i, a)| acc + a * keys.value(j, i));
                }
            }
        }
        _ => simd::attention_scores(level, queries, keys, limits, out, stride),
    }
}

/// `out[q] = Σ_{j < limits[q]} probs[q][j] · values[j]` (`out` is `probs.count()` rows of
/// `values.len()`), summed in key order, at the process's [`simd::level`].
pub fn weighted_sums(
    probs: Rows<'_, f32>,
    values: CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
) {
    weighted_sums_with(simd::level(), probs, values, limits, out, false);
}

/// `out[q] += Σ_{j < limits[q]} probs[q][j] · values[j]`, continuing [`weighted_sums`] of the
/// keys before these: each output element's chain of multiply-adds goes on from the value in
/// `out`, so summing a paged cache block by block gives the bits of one call over all keys.
pub fn weighted_sums_onto(
    probs: Rows<'_, f32>,
    values: CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
) {
    weighted_sums_with(simd::level(), probs, values, limits, out, true);
}

/// [`weighted_sums`] at `level` (which must be supported); onto `out` when `onto`
/// ([`weighted_sums_onto`]).
pub fn weighted_sums_with(
    level: SimdLevel,
    probs: Rows<'_, f32>,
    values: CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
    onto: bool,
) {
    let dim = values.len();
    assert_eq!(
        out.len(),
        probs.count() * dim,
        "attention: one output row per query"
    );
    check(
        probs.count(),
        values.count(),
        limits,
        probs.count() * probs.len(),
        probs.len(),
    );
    match level {
        SimdLevel::Scalar => {
            for (q, (o, &limit)) in out.chunks_exact_mut(dim.max(1)).zip(limits).enumerate() {
                if !onto {
                    o.fill(0.0);
                }
                for j in 0..limit {
                    let p = probs.row(q)[j];
                    for (i, y) in o.iter_mut().enumerate() {
                        *y += p * values.value(j, i);
                    }
                }
            }
        }
        _ => simd::attention_weighted_sums(level, probs, values, limits, out, onto),
    }
}

/// Panics unless there is one limit per query, every limit is within the keys, and an output
/// of `out_len` with rows `stride` apart holds them.
fn check(queries: usize, keys: usize, limits: &[usize], out_len: usize, stride: usize) {
    assert_eq!(limits.len(), queries, "attention: one limit per query");
    assert!(
        limits.iter().all(|&l| l <= keys && l <= stride),
        "attention: a query sees more keys than there are"
    );
    assert!(
        limits
            .iter()
            .enumerate()
            .all(|(q, &l)| q * stride + l <= out_len),
        "attention: score rows do not fit"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    /// `values` stored both ways: as f32, and as f16 bits (with the f32 values they stand for).
    fn stored(values: &[f32]) -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = values.iter().map(|&v| crate::f16::from_f32(v)).collect();
        let rounded = bits.iter().map(|&b| crate::f16::to_f32(b)).collect();
        (bits, rounded)
    }

    /// Every level, for f32 and f16 caches, against an f64 reference, at awkward head sizes
    /// (ragged chunks, the register-resident sizes 64 and 128, and larger), with uneven limits.
    #[test]
    fn every_level_matches_the_f64_reference() {
        for dim in [1, 5, 16, 40, 64, 128, 160] {
            // Whole blocks of 16 keys and a ragged one, limits inside and at their ends.
            let n_keys = 37;
            let n_queries = 7;
            let queries = random_vec(n_queries * dim, 1.0, dim as u64);
            let keys = random_vec(n_keys * dim, 1.0, dim as u64 + 1);
            let values = random_vec(n_keys * dim, 1.0, dim as u64 + 2);
            let (key_bits, keys_f16) = stored(&keys);
            let (value_bits, values_f16) = stored(&values);
            let limits: Vec<usize> = (0..n_queries).map(|q| 1 + (q * 15) % n_keys).collect();
            let q_rows = Rows::new(&queries, dim, dim, n_queries);
            let caches = [
                (Cached::F32(&keys), Cached::F32(&values), &keys, &values),
                (
                    Cached::F16(&key_bits),
                    Cached::F16(&value_bits),
                    &keys_f16,
                    &values_f16,
                ),
            ];
            for (k_cache, v_cache, k_exact, v_exact) in caches {
                let k_rows = k_cache.rows(0, dim, dim, n_keys);
                let v_rows = v_cache.rows(0, dim, dim, n_keys);
                for level in SimdLevel::supported() {
                    let mut s = vec![f32::NAN; n_queries * n_keys];
                    scores_with(level, q_rows, k_rows, &limits, &mut s, n_keys);
                    let probs: Vec<f32> = s
                        .iter()
                        .map(|v| if v.is_nan() { 0.0 } else { v * 0.01 })
                        .collect();
                    let mut out = vec![f32::NAN; n_queries * dim];
                    let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
                    weighted_sums_with(level, p_rows, v_rows, &limits, &mut out, false);
                    let bound = 1e-5 * (dim as f64 + 1.0);
                    for (q, &limit) in limits.iter().enumerate() {
                        for j in 0..limit {
                            let want: f64 = q_rows
                                .row(q)
                                .iter()
                                .zip(&k_exact[j * dim..(j + 1) * dim])
                                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                .sum();
                            let got = s[q * n_keys + j];
                            assert!(
                                (f64::from(got) - want).abs() <= bound,
                                "{level} dim {dim} {k_cache:?}: {got} vs {want}"
                            );
                        }
                        assert!(
                            s[q * n_keys + limit..(q + 1) * n_keys]
                                .iter()
                                .all(|v| v.is_nan()),
                            "{level}: wrote past the limit"
                        );
                        for i in 0..dim {
                            let want: f64 = (0..limit)
                                .map(|j| {
                                    f64::from(probs[q * n_keys + j])
                                        * f64::from(v_exact[j * dim + i])
                                })
                                .sum();
                            let got = out[q * dim + i];
                            assert!(
                                (f64::from(got) - want).abs() <= bound,
                                "{level} dim {dim}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A paged cache's blocks summed one after another ([`weighted_sums_onto`] after a first
    /// [`weighted_sums`]) give the bits of one call over every key, at every level, for head
    /// sizes on and off the tiled paths, tiles of 1..16 queries and ragged limits.
    #[test]
    fn block_by_block_sums_are_bit_identical_to_one_call() {
        for dim in [1, 7, 16, 40, 64, 128, 144] {
            let (n_keys, n_queries) = (70, 19);
            let values = random_vec(n_keys * dim, 1.0, dim as u64 + 9);
            let (value_bits, _) = stored(&values);
            let probs = random_vec(n_queries * n_keys, 0.1, dim as u64 + 10);
            let limits: Vec<usize> = (0..n_queries).map(|q| n_keys - 3 * q).collect();
            let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
            for v_cache in [Cached::F32(&values), Cached::F16(&value_bits)] {
                for level in SimdLevel::supported() {
                    let all = v_cache.rows(0, dim, dim, n_keys);
                    let mut whole = vec![0.0; n_queries * dim];
                    weighted_sums_with(level, p_rows, all, &limits, &mut whole, false);
                    for block in [1, 16, 32, 33] {
                        let mut paged = vec![f32::NAN; n_queries * dim];
                        for first in (0..n_keys).step_by(block) {
                            let count = block.min(n_keys - first);
                            let keys = v_cache.rows(first * dim, dim, dim, count);
                            let probs_here = Rows::new(&probs[first..], n_keys, count, n_queries);
                            let here: Vec<usize> = limits
                                .iter()
                                .map(|&l| l.saturating_sub(first).min(count))
                                .collect();
                            weighted_sums_with(
                                level,
                                probs_here,
                                keys,
                                &here,
                                &mut paged,
                                first > 0,
                            );
                        }
                        assert_eq!(
                            paged.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{level} dim {dim} blocks of {block} {v_cache:?}"
                        );
                    }
                }
            }
        }
    }

    /// Handing the kernels the rows read next to prefetch ([`CachedRows::followed_by`]: more
    /// rows, fewer, or the other cache) changes no score and no sum, at every level, on the
    /// tiled head sizes and off them.
    #[test]
    fn prefetching_the_next_rows_changes_no_bits() {
        for dim in [40, 128] {
            let (n_keys, n_queries) = (37, 5);
            let queries = random_vec(n_queries * dim, 1.0, 21);
            let keys = random_vec(2 * n_keys * dim, 1.0, 22);
            let probs = random_vec(n_queries * n_keys, 0.1, 23);
            let (key_bits, _) = stored(&keys);
            let limits: Vec<usize> = (0..n_queries).map(|q| n_keys - 3 * q).collect();
            let q_rows = Rows::new(&queries, dim, dim, n_queries);
            let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
            for cache in [Cached::F32(&keys), Cached::F16(&key_bits)] {
                let rows = cache.rows(0, dim, dim, n_keys);
                let nexts = [
                    cache.rows(n_keys * dim, dim, dim, n_keys),
                    cache.rows(n_keys * dim, dim, dim, 3),
                    cache.rows(0, dim, dim, n_keys),
                ];
                for level in SimdLevel::supported() {
                    let mut plain = vec![0.0; n_queries * n_keys];
                    scores_with(level, q_rows, rows, &limits, &mut plain, n_keys);
                    let mut sums = vec![0.0; n_queries * dim];
                    weighted_sums_with(level, p_rows, rows, &limits, &mut sums, false);
                    for next in nexts {
                        let chained = rows.followed_by(next);
                        let mut got = vec![0.0; n_queries * n_keys];
                        scores_with(level, q_rows, chained, &limits, &mut got, n_keys);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&plain), "{level} dim {dim} scores");
                        let mut got = vec![0.0; n_queries * dim];
                        weighted_sums_with(level, p_rows, chained, &limits, &mut got, false);
                        assert_eq!(bits(&got), bits(&sums), "{level} dim {dim} sums");
                    }
                }
            }
        }
    }

    /// Q8_0 rows, read block by block as the kernels widen them, give the bits of the same
    /// rows dequantised first ([`crate::q8_0::dequantize_row_scalar`]) and read as f32, at
    /// every level: scores and weighted sums (fresh and onto earlier sums), on the tiled head
    /// sizes and off them (256), every query tile, ragged limits, rows with a stride.
    #[test]
    fn q8_0_rows_give_the_bits_of_their_dequantised_copy() {
        for dim in [32, 64, 96, 128, 256] {
            let (n_keys, n_queries) = (70, 19);
            let row_bytes = dim / q8_0::BLOCK_VALUES * q8_0::BLOCK_BYTES;
            // Two heads per position, of which the test reads the second.
            let stored = random_vec(n_keys * 2 * dim, 1.0, dim as u64 + 31);
            let mut bytes = vec![0u8; n_keys * 2 * row_bytes];
            q8_0::quantize_row(&stored, &mut bytes);
            let mut widened = vec![0.0f32; n_keys * 2 * dim];
            q8_0::dequantize_row_scalar(&bytes, &mut widened);
            let q8_rows = Cached::Q8_0(&bytes).rows(row_bytes, 2 * row_bytes, row_bytes, n_keys);
            let f32_rows = Cached::F32(&widened).rows(dim, 2 * dim, dim, n_keys);
            assert_eq!(q8_rows.len(), dim);
            let queries = random_vec(n_queries * dim, 1.0, dim as u64 + 32);
            let probs = random_vec(n_queries * n_keys, 0.1, dim as u64 + 33);
            let start = random_vec(n_queries * dim, 1.0, dim as u64 + 34);
            let limits: Vec<usize> = (0..n_queries).map(|q| n_keys - 3 * q).collect();
            let q_rows = Rows::new(&queries, dim, dim, n_queries);
            let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for level in SimdLevel::supported() {
                let [mut q8, mut f32s] = [(); 2].map(|_| vec![0.0; n_queries * n_keys]);
                scores_with(level, q_rows, q8_rows, &limits, &mut q8, n_keys);
                scores_with(level, q_rows, f32_rows, &limits, &mut f32s, n_keys);
                assert_eq!(bits(&q8), bits(&f32s), "{level} dim {dim} scores");
                for onto in [false, true] {
                    let [mut q8, mut f32s] = [(); 2].map(|_| start.clone());
                    weighted_sums_with(level, p_rows, q8_rows, &limits, &mut q8, onto);
                    weighted_sums_with(level, p_rows, f32_rows, &limits, &mut f32s, onto);
                    assert_eq!(bits(&q8), bits(&f32s), "{level} dim {dim} sums onto {onto}");
                }
            }
        }
    }

    /// Every SIMD level's weighted sums are, per output element, one chain of fused
    /// multiply-adds over the keys in order (`y = fma(p_j, v_j, y)` from zero, or onto the
    /// output): the bits of `f32::mul_add` in a loop, whatever the tiles of queries and chunks
    /// the kernels choose — query counts across every tile size, head sizes whose chunk counts
    /// divide by 8, 4, 2 or only 1, ragged ones, causal limits.
    #[test]
    fn weighted_sums_are_one_fused_chain_per_element() {
        let n_keys = 70;
        for dim in [8, 24, 40, 48, 64, 72, 128, 136, 13] {
            let values = random_vec(n_keys * dim, 1.0, dim as u64 + 7);
            let (value_bits, values_f16) = stored(&values);
            for n_queries in [1, 2, 3, 5, 7, 8, 13, 19] {
                let probs = random_vec(n_queries * n_keys, 0.1, n_queries as u64);
                let start = random_vec(n_queries * dim, 1.0, 9);
                let limits: Vec<usize> = (0..n_queries).map(|q| n_keys - (5 * q) % 23).collect();
                let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
                for (cache, exact) in [
                    (Cached::F32(&values), &values),
                    (Cached::F16(&value_bits), &values_f16),
                ] {
                    let v_rows = cache.rows(0, dim, dim, n_keys);
                    for onto in [false, true] {
                        let mut want = if onto {
                            start.clone()
                        } else {
                            vec![0.0; start.len()]
                        };
                        for (q, row) in want.chunks_exact_mut(dim).enumerate() {
                            for j in 0..limits[q] {
                                let p = probs[q * n_keys + j];
                                for (i, y) in row.iter_mut().enumerate() {
                                    *y = p.mul_add(exact[j * dim + i], *y);
                                }
                            }
                        }
                        for level in SimdLevel::supported().filter(|&l| l != SimdLevel::Scalar) {
                            let mut got = start.clone();
                            weighted_sums_with(level, p_rows, v_rows, &limits, &mut got, onto);
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{level} dim {dim} {n_queries} queries {cache:?} onto {onto}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A query's results do not depend on the other queries of the call: each query alone
    /// gives the same bits as in a batch (what a verify row relies on), at every level.
    #[test]
    fn a_query_alone_gets_the_bits_it_gets_in_a_batch() {
        // 19 queries: score tiles of 4, 4, 4, 4, 2 and 1, and at head size 128 sum tiles of 16,
        // 2 and 1; 12: sum tiles of 8 and 4 (head size 40 runs the sums query by query). 150
        // keys: three spans of the sums' transposed probabilities, the last one short, and
        // limits 7 apart, so that a 16-key block of a span ends inside it.
        for (dim, n_queries) in [(40, 19), (128, 19), (128, 12)] {
            let n_keys = 150;
            let queries = random_vec(n_queries * dim, 1.0, 3);
            let keys = random_vec(n_keys * dim, 1.0, 4);
            let values = random_vec(n_keys * dim, 1.0, 5);
            let (key_bits, _) = stored(&keys);
            let (value_bits, _) = stored(&values);
            let probs = random_vec(n_queries * n_keys, 0.1, 6);
            let limits: Vec<usize> = (0..n_queries).map(|q| n_keys - 7 * q).collect();
            for (k_cache, v_cache) in [
                (Cached::F32(&keys), Cached::F32(&values)),
                (Cached::F16(&key_bits), Cached::F16(&value_bits)),
            ] {
                let k_rows = k_cache.rows(0, dim, dim, n_keys);
                let v_rows = v_cache.rows(0, dim, dim, n_keys);
                for level in SimdLevel::supported() {
                    let mut batch_scores = vec![0.0; n_queries * n_keys];
                    let q_rows = Rows::new(&queries, dim, dim, n_queries);
                    scores_with(level, q_rows, k_rows, &limits, &mut batch_scores, n_keys);
                    let mut batch_out = vec![0.0; n_queries * dim];
                    let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
                    weighted_sums_with(level, p_rows, v_rows, &limits, &mut batch_out, false);
                    for q in 0..n_queries {
                        let limit = &limits[q..q + 1];
                        let mut one = vec![0.0; n_keys];
                        let query = Rows::single(&queries[q * dim..(q + 1) * dim]);
                        scores_with(level, query, k_rows, limit, &mut one, n_keys);
                        let row = &batch_scores[q * n_keys..q * n_keys + limits[q]];
                        assert_eq!(one[..limits[q]], *row, "{level} dim {dim} query {q}");
                        let mut out = vec![0.0; dim];
                        let prob = Rows::single(&probs[q * n_keys..(q + 1) * n_keys]);
                        weighted_sums_with(level, prob, v_rows, limit, &mut out, false);
                        assert_eq!(
                            out,
                            batch_out[q * dim..(q + 1) * dim],
                            "{level} dim {dim} query {q}"
                        );
                    }
                }
            }
        }
    }
}
