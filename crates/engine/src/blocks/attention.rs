//! Grouped-query softmax attention of one row over the KV cache, and the gated full-attention
//! block of the hybrid models.
//!
//! Query head `h` reads key/value head `h / (n_head / n_head_kv)` (ggml's broadcast). The query
//! heads that share a key/value head, for every row of a batch, go through the kernels'
//! multi-query attention together ([`attend_rows`]): each cached row is read once for all of
//! them. A query's scores over positions `0 ..= pos` are scaled by `1 / sqrt(head_dim)`,
//! soft-maxed, and the value rows accumulated in position order. Key/value heads may run on
//! different threads; each query's arithmetic is fixed, so the result does not depend on
//! threads or on which batch the row came in.
//!
//! The gated block ([`forward_gated`], qwen35 / qwen3next and their MTP heads) projects query
//! and output gate together (`attn_q` gives, per head, `head_dim` query values then `head_dim`
//! gate values), normalises queries and keys per head, applies the model's RoPE (partial NeoX
//! or multi-section), attends, and multiplies the attention output by `sigmoid(gate)` before
//! `attn_output`.

use rayon::prelude::*;
use specula_gguf::GgufFile;
use specula_kernels::activations::{self, Gate};
use specula_kernels::attention::{self as kattention, Cached};
use specula_kernels::{matmul, matmul_many, ops, MatmulScratch, Rope, RopeAngles, Rows};
use specula_plugin_api::PluginError;

use crate::kv_cache::{CachedHeads, KvCache};
use crate::model::weights::{load_vector, MatrixRef};
use crate::model::LoadError;

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

/// The weights of a gated full-attention block (`blk.N.attn_*`).
#[derive(Debug, Clone)]
pub struct GatedAttentionWeights {
    /// `{n_embd, 2 × n_head × head_dim}`: per head, the query then the output gate.
    pub attn_q: MatrixRef,
    pub attn_k: MatrixRef,
    pub attn_v: MatrixRef,
    /// `{n_head × value_dim, n_embd}`.
    pub attn_output: MatrixRef,
    /// Per-head RMSNorm of queries, `head_dim` values.
    pub q_norm: Vec<f32>,
    /// Per-head RMSNorm of keys, `head_dim` values.
    pub k_norm: Vec<f32>,
}

impl GatedAttentionWeights {
    /// Loads the attention tensors of block `layer`.
    pub fn load(
        file: &GgufFile,
        layer: usize,
        shape: &AttentionShape,
        n_embd: usize,
    ) -> Result<Self, LoadError> {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let matrix = |t: &str, rows, cols| MatrixRef::load(file, &name(t), rows, cols);
        Ok(Self {
            attn_q: matrix("attn_q", 2 * shape.q_width(), n_embd)?,
            attn_k: matrix("attn_k", shape.k_width(), n_embd)?,
            attn_v: matrix("attn_v", shape.v_width(), n_embd)?,
            attn_output: matrix("attn_output", n_embd, shape.out_width())?,
            q_norm: load_vector(file, &name("attn_q_norm"), shape.head_dim)?,
            k_norm: load_vector(file, &name("attn_k_norm"), shape.head_dim)?,
        })
    }

    /// Every weight matrix of the block.
    pub fn matrices(&self) -> [&MatrixRef; 4] {
        [&self.attn_q, &self.attn_k, &self.attn_v, &self.attn_output]
    }

    /// Every weight matrix of the block, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> [&mut MatrixRef; 4] {
        [
            &mut self.attn_q,
            &mut self.attn_k,
            &mut self.attn_v,
            &mut self.attn_output,
        ]
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self) -> u64 {
        let vectors = (self.q_norm.len() + self.k_norm.len()) as u64;
        self.matrices().iter().map(|m| m.n_bytes()).sum::<u64>() + 4 * vectors
    }
}

/// Buffers of [`forward_gated`] for up to `rows` rows over a context of `n_ctx`.
#[derive(Debug, Default)]
pub struct GatedScratch {
    q_full: Vec<f32>,
    q: Vec<f32>,
    gate: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    attention: AttentionScratch,
    angles: RopeAngles,
}

impl GatedScratch {
    pub fn new(shape: &AttentionShape, rope: &Rope, rows: usize, n_ctx: usize) -> Self {
        Self {
            q_full: vec![0.0; rows * 2 * shape.q_width()],
            q: vec![0.0; rows * shape.q_width()],
            gate: vec![0.0; rows * shape.q_width()],
            k: vec![0.0; rows * shape.k_width()],
            v: vec![0.0; rows * shape.v_width()],
            attn: vec![0.0; rows * shape.out_width()],
            attention: AttentionScratch::new(shape, n_ctx),
            angles: RopeAngles::new(rope, rows),
        }
    }
}

/// One row's query, gate and key buffers and its projected query-and-gate row.
type RowParts<'a> = (((&'a mut [f32], &'a mut [f32]), &'a mut [f32]), &'a [f32]);

/// Where a gated-attention call keeps its keys and values.
#[derive(Debug, Clone, Copy)]
pub struct KvSlot {
    /// Layer of the cache.
    pub layer: usize,
    /// Cache index of the first row; row `i` is stored at `pos0 + i` and attends to `0 ..= pos0 + i`.
    pub pos0: usize,
    /// RoPE position minus cache index (0 in the trunk; 1 for an MTP head, whose entry `p`
    /// holds the token of position `p + 1`).
    pub rope_offset: usize,
}

/// Runs gated attention over the `m` normalised rows `xn` (`m × n_embd`), storing the rows'
/// keys and values in `kv` at `slot`, and writes the projected output to `out` (`m × n_embd`).
///
/// Projections and attention are batched across rows; the per-row part (split, norms, RoPE,
/// gate) runs row by row (rows on the pool's threads), so row `i` gets exactly the bits of a
/// single-row call.
#[allow(clippy::too_many_arguments)]
pub fn forward_gated(
    shape: &AttentionShape,
    rope: &Rope,
    eps: f32,
    w: &GatedAttentionWeights,
    file: &GgufFile,
    xn: &[f32],
    m: usize,
    kv: &mut KvCache,
    slot: KvSlot,
    s: &mut GatedScratch,
    mm: &mut MatmulScratch,
    out: &mut [f32],
) -> Result<(), PluginError> {
    let (hd, qw, kw, vw, ow) = (
        shape.head_dim,
        shape.q_width(),
        shape.k_width(),
        shape.v_width(),
        shape.out_width(),
    );
    matmul_many(
        &[
            &w.attn_q.view(file)?,
            &w.attn_k.view(file)?,
            &w.attn_v.view(file)?,
        ],
        xn,
        &mut [
            &mut s.q_full[..m * 2 * qw],
            &mut s.k[..m * kw],
            &mut s.v[..m * vw],
        ],
        mm,
    );
    s.angles.cover(rope, slot.pos0 + slot.rope_offset, m);
    let angles = &s.angles;
    let prepare = |(i, (((q, gate), k), full)): (usize, RowParts<'_>)| {
        for ((pair, qh), gh) in full
            .chunks_exact(2 * hd)
            .zip(q.chunks_exact_mut(hd))
            .zip(gate.chunks_exact_mut(hd))
        {
            qh.copy_from_slice(&pair[..hd]);
            gh.copy_from_slice(&pair[hd..]);
        }
        let (norm_q, norm_k) = (Some(&w.q_norm[..]), Some(&w.k_norm[..]));
        prepare_query_key(rope, hd, eps, norm_q, norm_k, angles.row(i), q, k);
    };
    // Rows on the pool's threads (a single row stays on this one).
    s.q[..m * qw]
        .par_chunks_mut(qw)
        .zip(s.gate[..m * qw].par_chunks_mut(qw))
        .zip(s.k[..m * kw].par_chunks_mut(kw))
        .zip(s.q_full[..m * 2 * qw].par_chunks(2 * qw))
        .enumerate()
        .for_each(prepare);
    kv.store(slot.layer, slot.pos0, &s.k[..m * kw], &s.v[..m * vw]);
    let last = slot.pos0 + m;
    attend_rows(
        shape,
        &s.q[..m * qw],
        slot.pos0 + 1,
        kv.keys(slot.layer, last),
        kv.values(slot.layer, last),
        &mut s.attention,
        &mut s.attn[..m * ow],
    );
    activations::gate_in_place(Gate::Sigmoid, &mut s.attn[..m * ow], &s.gate[..m * ow]);
    matmul(&w.attn_output.view(file)?, &s.attn[..m * ow], out, mm);
    Ok(())
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
