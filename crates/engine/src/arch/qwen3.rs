//! `qwen3`: the llama layer with NeoX (halves) RoPE and a per-head RMSNorm of queries and keys
//! (`attn_q_norm`, `attn_k_norm`, `key_length` values each) applied before RoPE. Head size
//! comes from `attention.key_length`, which need not equal `embedding_length / head_count`.

use specula_kernels::RopeMode;
use specula_plugin_api::PluginError;

use super::dense::{DenseLayer, DenseVariant};
use crate::blocks::ffn::swiglu;
use crate::graph::{graph_error, Act, LayerOps, QkNorms, Query, Rows};

/// What a qwen3 file holds besides the dense decoder's common tensors: the q/k norms.
pub const VARIANT: DenseVariant = DenseVariant {
    rope_mode: RopeMode::NeoX,
    qk_norm: true,
    qkv_bias: false,
};

/// One qwen3 layer: `x += attention(attn_norm(x)); x += ffn(ffn_norm(x))`, queries and keys
/// normalised per head before RoPE.
pub fn layer(ops: &mut impl LayerOps, l: &DenseLayer, rows: &Rows) -> Result<(), PluginError> {
    let (Some(q), Some(k)) = (&l.attn_q_norm, &l.attn_k_norm) else {
        return Err(graph_error("a qwen3 layer without its q/k norms"));
    };
    ops.rms_norm(Act::X.into(), &l.attn_norm, Act::Xn.into(), rows)?;
    let projections = [
        (&l.attn_q, Act::Q),
        (&l.attn_k, Act::K),
        (&l.attn_v, Act::V),
    ];
    ops.matmul_many(Act::Xn, &projections, rows)?;
    let norms = QkNorms { q, k };
    ops.qk_norm_rope(Query::Plain(Act::Q), Act::K, Some(norms), l.kv, rows)?;
    ops.store_kv(l.kv, Act::K, Act::V, rows)?;
    ops.attend(l.kv, Act::Q, None, Act::Attn, rows)?;
    ops.matmul(&l.attn_output, Act::Attn, Act::Proj, rows)?;
    ops.add(Act::X, Act::Proj, rows)?;

    ops.rms_norm(Act::X.into(), &l.ffn_norm, Act::Xn.into(), rows)?;
    swiglu(ops, &l.ffn, rows)?;
    ops.add(Act::X, Act::Proj, rows)
}
