//! Grouped-query softmax attention over the KV cache on the CPU, and the per-row query/key
//! preparation (q/k norms and RoPE) before it.
//!
//! Query head `h` reads key/value head `h / (n_head / n_head_kv)` (ggml's broadcast). The query
//! heads that share a key/value head, for every row of a batch, go through the kernels'
//! multi-query attention together ([`attend_rows`]): each cached row is read once for all of
//! them. A query's scores over positions `0 ..= pos` are scaled by `1 / sqrt(head_dim)`,
//! soft-maxed, and the value rows accumulated in position order. Key/value heads may run on
//! different threads; each query's arithmetic is fixed, so the result does not depend on
//! threads or on which batch the row came in.

use rayon::prelude::*;
use specula_kernels::activations;
use specula_kernels::attention::{self as kattention, Cached};
use specula_kernels::{ops, Rope, Rows};

use crate::blocks::attention::AttentionShape;
use crate::kv_cache::CachedHeads;

/// Below this many multiply-adds per row, heads run on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 14;

/// Applies the optional per-head q/k RMSNorm (epsilon `eps`) and then `rope` by the angles of
/// the row's position (`cos`/`sin`, [`Rope::angles`]) to one row's query (`n_head × head_dim`)
/// and key (`n_head_kv × head_dim`) in place.
#[allow(clippy::too_many_arguments)]
pub fn prepare_query_key(
    rope: &Rope,
    head_dim: usize,
    eps: f32,
    q_norm: Option<&[f32]>,
    k_norm: Option<&[f32]>,
    (cos, sin): (&[f32], &[f32]),
    q: &mut [f32],
    k: &mut [f32],
) {
    for (heads, norm) in [(q, q_norm), (k, k_norm)] {
        for head in heads.chunks_exact_mut(head_dim) {
            if let Some(weight) = norm {
                ops::rms_norm_in_place(head, weight, eps);
            }
            rope.apply(head, cos, sin);
        }
    }
}

/// Rows attended together per call of the attention kernels: a verify batch at once; longer
/// batches (prefill) in pieces of this many rows.
pub const ATTENTION_ROWS: usize = 8;

/// One key/value head's queries, scores, outputs and limits in [`AttentionScratch`].
type HeadBuffers<'a> = (
    ((&'a mut [f32], &'a mut [f32]), &'a mut [f32]),
    &'a mut [usize],
);

/// Buffers of [`attend_rows`] over a context of up to `n_ctx` positions.
#[derive(Debug, Default, Clone)]
pub struct AttentionScratch {
    /// Per key/value head: the queries of its query heads for every row.
    queries: Vec<f32>,
    /// Per key/value head: one score row of `n_ctx` per query.
    scores: Vec<f32>,
    /// Per key/value head: one output row per query.
    outputs: Vec<f32>,
    /// Per key/value head: how many keys each query sees.
    limits: Vec<usize>,
    n_ctx: usize,
}

impl AttentionScratch {
    pub fn new(shape: &AttentionShape, n_ctx: usize) -> Self {
        let queries = ATTENTION_ROWS * shape.n_head;
        Self {
            queries: vec![0.0; queries * shape.head_dim],
            scores: vec![0.0; queries * n_ctx],
            outputs: vec![0.0; queries * shape.value_dim],
            limits: vec![0; queries],
            n_ctx,
        }
    }
}

/// Attention of `m` query rows (`queries`, `m × q_width`) over `keys`/`values` (cached rows of
/// `k_width` / `v_width`, f32 or f16): row `i` sees positions `0 .. first_len + i`. Writes
/// `m × out_width` values to `out`.
///
/// Per key/value head, the rows' query heads that share it are multiplied together
/// ([`specula_kernels::attention`]), so each cached row is read once per call rather than once
/// per query head and row; key/value heads may run on different threads. A query's arithmetic
/// does not depend on the others, so row `i` gets the bits of a single-row call.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows(
    shape: &AttentionShape,
    queries: &[f32],
    first_len: usize,
    keys: CachedHeads<'_>,
    values: CachedHeads<'_>,
    s: &mut AttentionScratch,
    out: &mut [f32],
) {
    let (hd, vd, qw, ow) = (
        shape.head_dim,
        shape.value_dim,
        shape.q_width(),
        shape.out_width(),
    );
    let m = queries.len() / qw;
    assert_eq!(out.len(), m * ow, "attention: output size");
    let n_cached = keys.count();
    assert_eq!(
        values.count(),
        n_cached,
        "attention: keys and values differ in length"
    );
    assert!(
        m == 0 || first_len + m - 1 <= n_cached.min(s.n_ctx),
        "attention: rows see more positions than are cached"
    );
    let group = shape.n_head / shape.n_head_kv;
    let scale = shape.scale();
    let per_head = ATTENTION_ROWS * group;
    let n_ctx = s.n_ctx;
    for first in (0..m).step_by(ATTENTION_ROWS) {
        let rows = ATTENTION_ROWS.min(m - first);
        let n_queries = rows * group;
        let n_keys = first_len + first + rows - 1;
        let head = |(g, (((q_buf, s_buf), o_buf), l_buf)): (usize, HeadBuffers<'_>)| {
            for i in 0..rows {
                let row = &queries[(first + i) * qw..(first + i + 1) * qw];
                for h in 0..group {
                    let query = i * group + h;
                    let head = g * group + h;
                    q_buf[query * hd..(query + 1) * hd]
                        .copy_from_slice(&row[head * hd..(head + 1) * hd]);
                    l_buf[query] = first_len + first + i;
                }
            }
            let limits = &l_buf[..n_queries];
            let query_rows = Rows::new(&q_buf[..n_queries * hd], hd, hd, n_queries);
            let key_rows = keys.head(g, n_keys);
            let value_rows = values.head(g, n_keys);
            let s_buf = &mut s_buf[..n_queries * n_keys];
            kattention::scores(query_rows, key_rows, limits, s_buf, n_keys);
            for (row, &limit) in s_buf.chunks_exact_mut(n_keys).zip(limits) {
                let row = &mut row[..limit];
                for score in row.iter_mut() {
                    *score *= scale;
                }
                activations::softmax_in_place(row);
            }
            let probs = Rows::new(s_buf, n_keys, n_keys, n_queries);
            kattention::weighted_sums(probs, value_rows, limits, &mut o_buf[..n_queries * vd]);
        };
        let buffers = (
            s.queries.chunks_mut(per_head * hd),
            s.scores.chunks_mut(per_head * n_ctx),
            s.outputs.chunks_mut(per_head * vd),
            s.limits.chunks_mut(per_head),
        );
        if rows * shape.n_head * n_keys * (hd + vd) < PARALLEL_MIN_WORK {
            buffers
                .0
                .zip(buffers.1)
                .zip(buffers.2)
                .zip(buffers.3)
                .take(shape.n_head_kv)
                .enumerate()
                .for_each(head);
        } else {
            s.queries
                .par_chunks_mut(per_head * hd)
                .zip(s.scores.par_chunks_mut(per_head * n_ctx))
                .zip(s.outputs.par_chunks_mut(per_head * vd))
                .zip(s.limits.par_chunks_mut(per_head))
                .take(shape.n_head_kv)
                .enumerate()
                .for_each(head);
        }
        for g in 0..shape.n_head_kv {
            let o_buf = &s.outputs[g * per_head * vd..];
            for i in 0..rows {
                for h in 0..group {
                    let query = i * group + h;
                    let head = g * group + h;
                    out[(first + i) * ow + head * vd..][..vd]
                        .copy_from_slice(&o_buf[query * vd..(query + 1) * vd]);
                }
            }
        }
    }
}

/// Attention of one query row over `keys`/`values` (`n_keys` cached rows of `k_width` /
/// `v_width`, positions `0 .. n_keys`), written to `out` (`out_width`): [`attend_rows`] for a
/// single row, with its own buffers.
pub fn attend(shape: &AttentionShape, q: &[f32], keys: &[f32], values: &[f32], out: &mut [f32]) {
    let n_keys = keys.len() / shape.k_width();
    let mut scratch = AttentionScratch::new(shape, n_keys);
    let keys = CachedHeads::position_major(Cached::F32(keys), shape.head_dim, shape.n_head_kv);
    let values = CachedHeads::position_major(Cached::F32(values), shape.value_dim, shape.n_head_kv);
    attend_rows(shape, q, n_keys, keys, values, &mut scratch, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_groups_share_kv_heads() {
        let shape = AttentionShape {
            n_head: 4,
            n_head_kv: 2,
            head_dim: 2,
            value_dim: 3,
        };
        let q = vec![1.0; shape.q_width()];
        let keys = vec![0.5; shape.k_width()];
        let values = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = vec![0.0; shape.out_width()];
        attend(&shape, &q, &keys, &values, &mut out);
        assert_eq!(
            out,
            vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 4.0, 5.0, 6.0]
        );
    }

    #[test]
    fn equal_scores_average_the_values() {
        let shape = AttentionShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 2,
            value_dim: 1,
        };
        let mut out = vec![0.0; 1];
        attend(
            &shape,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0, 4.0],
            &[2.0, 4.0],
            &mut out,
        );
        assert!((out[0] - 3.0).abs() < 1e-6);
    }
}
