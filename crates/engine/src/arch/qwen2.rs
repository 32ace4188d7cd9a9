//! `qwen2` (Qwen2, Qwen2.5): the llama layer with biases on the query, key and value
//! projections (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`, added before RoPE) and NeoX
//! (halves) RoPE. No other bias: `attn_output` and the FFN have none.

use specula_kernels::RopeMode;
use specula_plugin_api::PluginError;

use super::dense::{DenseLayer, DenseVariant};
use crate::blocks::ffn::swiglu;
use crate::graph::{graph_error, Act, LayerOps, Query, Rows};

/// What a qwen2 file holds besides the dense decoder's common tensors: the q/k/v biases.
pub const VARIANT: DenseVariant = DenseVariant {
    rope_mode: RopeMode::NeoX,
    qk_norm: false,
    qkv_bias: true,
};

/// One qwen2 layer: `x += attention(attn_norm(x)); x += ffn(ffn_norm(x))`, the attention's
/// projections biased.
pub fn layer(ops: &mut impl LayerOps, l: &DenseLayer, rows: &Rows) -> Result<(), PluginError> {
    let bias = l
        .qkv_bias
        .as_ref()
        .ok_or_else(|| graph_error("a qwen2 layer without its q/k/v biases"))?;
    ops.rms_norm(Act::X.into(), &l.attn_norm, Act::Xn.into(), rows)?;
    let projections = [
        (&l.attn_q, Act::Q),
        (&l.attn_k, Act::K),
        (&l.attn_v, Act::V),
    ];
    ops.matmul_many(Act::Xn, &projections, rows)?;
    ops.add_bias(Act::Q, &bias.q, rows)?;
    ops.add_bias(Act::K, &bias.k, rows)?;
    ops.add_bias(Act::V, &bias.v, rows)?;
    ops.qk_norm_rope(Query::Plain(Act::Q), Act::K, None, l.kv, rows)?;
    ops.store_kv(l.kv, Act::K, Act::V, rows)?;
    ops.attend(l.kv, Act::Q, None, Act::Attn, rows)?;
    ops.matmul(&l.attn_output, Act::Attn, Act::Proj, rows)?;
    ops.add(Act::X, Act::Proj, rows)?;

    ops.rms_norm(Act::X.into(), &l.ffn_norm, Act::Xn.into(), rows)?;
    swiglu(ops, &l.ffn, rows)?;
    ops.add(Act::X, Act::Proj, rows)
}
