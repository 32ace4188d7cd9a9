//! Grouped-query softmax attention of one row over the KV cache.
//!
//! Query head `h` reads key/value head `h / (n_head / n_head_kv)` (ggml's broadcast). For each
//! head the scores of positions `0 ..= pos` are computed with the kernels' f32 dot product (one
//! multi-row call; each score bit-identical to a single dot), scaled by `1 / sqrt(head_dim)`,
//! soft-maxed, and the value rows are accumulated in position order (`weighted_sum`). Heads may
//! run on different threads; each head's arithmetic is fixed, so the result does not depend on
//! threads or on which batch the row came in.

use rayon::prelude::*;
use specula_kernels::{f32 as kf32, ops, Rows};

use crate::arch::DenseConfig;

/// Below this many multiply-adds per row, heads run on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 14;

/// Head counts and sizes of an attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Size of a query/key head (`key_length`).
    pub head_dim: usize,
    /// Size of a value head (`value_length`).
    pub value_dim: usize,
}

impl AttentionShape {
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn k_width(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn v_width(&self) -> usize {
        self.n_head_kv * self.value_dim
    }

    /// Width of the attention output (all heads' values).
    pub fn out_width(&self) -> usize {
        self.n_head * self.value_dim
    }

    /// Softmax scale `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Applies the optional per-head q/k RMSNorm and then RoPE for position `pos` to one row's
/// query (`q_width`) and key (`k_width`) in place. `cos`/`sin` are scratch of `n_rot / 2`.
#[allow(clippy::too_many_arguments)]
pub fn prepare_query_key(
    config: &DenseConfig,
    q_norm: Option<&[f32]>,
    k_norm: Option<&[f32]>,
    pos: usize,
    q: &mut [f32],
    k: &mut [f32],
    cos: &mut [f32],
    sin: &mut [f32],
) {
    let rope = &config.rope;
    let hd = config.attention.head_dim;
    rope.angles(pos, cos, sin);
    for (heads, norm) in [(q, q_norm), (k, k_norm)] {
        for head in heads.chunks_exact_mut(hd) {
            if let Some(weight) = norm {
                ops::rms_norm_in_place(head, weight, config.rms_eps);
            }
            rope.apply(head, cos, sin);
        }
    }
}

/// Attention of one query row over `keys`/`values` (`n_keys` cached rows of `k_width` /
/// `v_width`, positions `0 .. n_keys`), written to `out` (`out_width`).
///
/// `scores` is scratch of at least `n_head` chunks of `scores.len() / n_head >= n_keys`.
pub fn attend(
    shape: &AttentionShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (hd, vd) = (shape.head_dim, shape.value_dim);
    let (kw, vw) = (shape.k_width(), shape.v_width());
    let n_keys = keys.len() / kw;
    assert_eq!(
        values.len(),
        n_keys * vw,
        "attention: keys and values differ in length"
    );
    let stride = scores.len() / shape.n_head;
    assert!(stride >= n_keys, "attention: score scratch too small");
    let group = shape.n_head / shape.n_head_kv;
    let scale = shape.scale();

    let head = |(h, (out_h, scores_h)): (usize, (&mut [f32], &mut [f32]))| {
        let kv_head = h / group;
        let q_h = &q[h * hd..(h + 1) * hd];
        let scores_h = &mut scores_h[..n_keys];
        // Key / value head `kv_head` of every cached position (rows `kw` / `vw` apart).
        let k_rows = Rows::new(&keys[kv_head * hd..], kw, hd, n_keys);
        let v_rows = Rows::new(&values[kv_head * vd..], vw, vd, n_keys);
        kf32::dot_f32_rows(q_h, k_rows, scores_h);
        for score in scores_h.iter_mut() {
            *score *= scale;
        }
        ops::softmax_in_place(scores_h);
        out_h.fill(0.0);
        kf32::weighted_sum(scores_h, v_rows, out_h);
    };
    if shape.n_head * n_keys * (hd + vd) < PARALLEL_MIN_WORK {
        out.chunks_exact_mut(vd)
            .zip(scores.chunks_exact_mut(stride))
            .enumerate()
            .for_each(head);
    } else {
        out.par_chunks_exact_mut(vd)
            .zip(scores.par_chunks_exact_mut(stride))
            .enumerate()
            .for_each(head);
    }
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
        let mut scores = vec![0.0; 4 * 8];
        let mut out = vec![0.0; shape.out_width()];
        attend(&shape, &q, &keys, &values, &mut scores, &mut out);
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
        let mut scores = vec![0.0; 3];
        let mut out = vec![0.0; 1];
        attend(
            &shape,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0, 4.0],
            &[2.0, 4.0],
            &mut scores,
            &mut out,
        );
        assert!((out[0] - 3.0).abs() < 1e-6);
    }
}
