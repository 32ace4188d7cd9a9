//! Grouped-query attention: the shape of an attention layer, and the gated full-attention
//! block of the hybrid models (qwen35, qwen3next and their MTP heads) as a graph.
//!
//! The gated block ([`gated_attention`]) projects query and output gate together (`attn_q`
//! gives, per head, `head_dim` query values then `head_dim` gate values), normalises queries
//! and keys per head, applies the model's RoPE (partial NeoX or multi-section), attends over
//! the layer's cache, multiplies the attention output by `sigmoid(gate)` and projects it with
//! `attn_output`.

use specula_gguf::GgufFile;
use specula_plugin_api::PluginError;

use crate::graph::{Act, KvSlot, LayerOps, QkNorms, Query, Rows};
use crate::model::weights::{load_vector, MatrixRef, Vector};
use crate::model::LoadError;

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
    pub q_norm: Vector,
    /// Per-head RMSNorm of keys, `head_dim` values.
    pub k_norm: Vector,
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

/// The gated attention block over the normalised rows in [`Act::Xn`], keys and values kept in
/// `kv`, into [`Act::Proj`].
pub fn gated_attention(
    ops: &mut impl LayerOps,
    w: &GatedAttentionWeights,
    kv: KvSlot,
    rows: &Rows,
) -> Result<(), PluginError> {
    let projections = [
        (&w.attn_q, Act::QGate),
        (&w.attn_k, Act::K),
        (&w.attn_v, Act::V),
    ];
    ops.matmul_many(Act::Xn, &projections, rows)?;
    let norms = QkNorms {
        q: &w.q_norm,
        k: &w.k_norm,
    };
    let query = Query::Gated {
        from: Act::QGate,
        into: Act::Q,
    };
    ops.qk_norm_rope(query, Act::K, Some(norms), kv, rows)?;
    ops.store_kv(kv, Act::K, Act::V, rows)?;
    ops.attend(kv, Act::Q, Some(Act::QGate), Act::Attn, rows)?;
    ops.matmul(&w.attn_output, Act::Attn, Act::Proj, rows)
}
