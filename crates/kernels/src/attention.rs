//! Attention of several queries over one key/value head: the scores and the probability-weighted
//! sums of the values, with each cached row read once for all the queries.
//!
//! The queries are the query heads that share a key/value head (grouped-query attention) for
//! every row of a batch; query `q` sees the first `limits[q]` keys (causal attention: a verify
//! row sees its own position and the ones before). Each (query, key) score and each output
//! element is computed by one fixed sequence of operations, whatever the other queries of the
//! call, so a verify row gets exactly the bits of a single-token pass.

use crate::simd::{self, Rows, SimdLevel};

/// `scores[q * stride + j] = queries[q] · keys[j]` for every query `q` and key `j <
/// limits[q]`, at the process's [`simd::level`].
pub fn scores(
    queries: Rows<'_, f32>,
    keys: Rows<'_, f32>,
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
    keys: Rows<'_, f32>,
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
                        .zip(keys.row(j))
                        .fold(0.0f32, |acc, (a, b)| acc + a * b);
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
    values: Rows<'_, f32>,
    limits: &[usize],
    out: &mut [f32],
) {
    weighted_sums_with(simd::level(), probs, values, limits, out);
}

/// [`weighted_sums`] at `level` (which must be supported).
pub fn weighted_sums_with(
    level: SimdLevel,
    probs: Rows<'_, f32>,
    values: Rows<'_, f32>,
    limits: &[usize],
    out: &mut [f32],
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
                o.fill(0.0);
                for j in 0..limit {
                    let p = probs.row(q)[j];
                    for (y, v) in o.iter_mut().zip(values.row(j)) {
                        *y += p * v;
                    }
                }
            }
        }
        _ => simd::attention_weighted_sums(level, probs, values, limits, out),
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

    /// Every level against an f64 reference, at awkward head sizes (ragged chunks, the
    /// register-resident sizes 64 and 128, and larger), with uneven limits.
    #[test]
    fn every_level_matches_the_f64_reference() {
        for dim in [1, 5, 16, 40, 64, 128, 160] {
            let n_keys = 13;
            let n_queries = 7;
            let queries = random_vec(n_queries * dim, 1.0, dim as u64);
            let keys = random_vec(n_keys * dim, 1.0, dim as u64 + 1);
            let values = random_vec(n_keys * dim, 1.0, dim as u64 + 2);
            let limits: Vec<usize> = (0..n_queries).map(|q| 1 + (q * 5) % n_keys).collect();
            let q_rows = Rows::new(&queries, dim, dim, n_queries);
            let k_rows = Rows::new(&keys, dim, dim, n_keys);
            let v_rows = Rows::new(&values, dim, dim, n_keys);
            for level in SimdLevel::supported() {
                let mut s = vec![f32::NAN; n_queries * n_keys];
                scores_with(level, q_rows, k_rows, &limits, &mut s, n_keys);
                let probs: Vec<f32> = s
                    .iter()
                    .map(|v| if v.is_nan() { 0.0 } else { v * 0.01 })
                    .collect();
                let mut out = vec![f32::NAN; n_queries * dim];
                let p_rows = Rows::new(&probs, n_keys, n_keys, n_queries);
                weighted_sums_with(level, p_rows, v_rows, &limits, &mut out);
                for (q, &limit) in limits.iter().enumerate() {
                    for j in 0..limit {
                        let want: f64 = q_rows
                            .row(q)
                            .iter()
                            .zip(k_rows.row(j))
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum();
                        let got = s[q * n_keys + j];
                        let bound = 1e-5 * (dim as f64 + 1.0);
                        assert!(
                            (f64::from(got) - want).abs() <= bound,
                            "{level} dim {dim}: {got} vs {want}"
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
                            .map(|j| f64::from(probs[q * n_keys + j]) * f64::from(v_rows.row(j)[i]))
                            .sum();
                        let got = out[q * dim + i];
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-5 * (dim as f64 + 1.0),
                            "{level} dim {dim}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A query's results do not depend on the other queries of the call: each query alone
    /// gives the same bits as in a batch (what a verify row relies on).
    #[test]
    fn a_query_alone_gets_the_bits_it_gets_in_a_batch() {
        for dim in [40, 128] {
            let (n_keys, n_queries) = (11, 9);
            let queries = random_vec(n_queries * dim, 1.0, 3);
            let keys = random_vec(n_keys * dim, 1.0, 4);
            let values = random_vec(n_keys * dim, 1.0, 5);
            let probs = random_vec(n_queries * n_keys, 0.1, 6);
            let limits: Vec<usize> = (0..n_queries).map(|q| n_keys - q).collect();
            let k_rows = Rows::new(&keys, dim, dim, n_keys);
            let v_rows = Rows::new(&values, dim, dim, n_keys);
            let mut batch_scores = vec![0.0; n_queries * n_keys];
            scores(
                Rows::new(&queries, dim, dim, n_queries),
                k_rows,
                &limits,
                &mut batch_scores,
                n_keys,
            );
            let mut batch_out = vec![0.0; n_queries * dim];
            weighted_sums(
                Rows::new(&probs, n_keys, n_keys, n_queries),
                v_rows,
                &limits,
                &mut batch_out,
            );
            for q in 0..n_queries {
                let mut one = vec![0.0; n_keys];
                scores(
                    Rows::single(&queries[q * dim..(q + 1) * dim]),
                    k_rows,
                    &limits[q..q + 1],
                    &mut one,
                    n_keys,
                );
                assert_eq!(
                    one[..limits[q]],
                    batch_scores[q * n_keys..q * n_keys + limits[q]]
                );
                let mut out = vec![0.0; dim];
                weighted_sums(
                    Rows::single(&probs[q * n_keys..(q + 1) * n_keys]),
                    v_rows,
                    &limits[q..q + 1],
                    &mut out,
                );
                assert_eq!(out, batch_out[q * dim..(q + 1) * dim]);
            }
        }
    }
}
