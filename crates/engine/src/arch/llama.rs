//! `llama`: pre-norm dense decoder with grouped-query attention, adjacent-pair ("normal")
//! RoPE, SwiGLU FFN; optional `rope_freqs.weight` (Llama 3.1 frequency factors) and linear
//! RoPE scaling. Also covers llama2.c conversions (stories260K, llama2xs) whose `wq`/`wk` are
//! stored unpermuted, which is exactly what adjacent-pair rotation expects.

use specula_kernels::RopeMode;
use specula_plugin_api::PluginError;

use super::dense::{DenseLayer, DenseVariant};
use crate::blocks::ffn::swiglu;
use crate::graph::{Act, LayerOps, Query, Rows};

/// What a llama file holds besides the dense decoder's common tensors: nothing.
pub const VARIANT: DenseVariant = DenseVariant {
    rope_mode: RopeMode::Normal,
    qk_norm: false,
    qkv_bias: false,
};

/// One llama layer: `x += attention(attn_norm(x)); x += ffn(ffn_norm(x))`.
pub fn layer(ops: &mut impl LayerOps, l: &DenseLayer, rows: &Rows) -> Result<(), PluginError> {
    ops.rms_norm(Act::X.into(), &l.attn_norm, Act::Xn.into(), rows)?;
    let projections = [
        (&l.attn_q, Act::Q),
        (&l.attn_k, Act::K),
        (&l.attn_v, Act::V),
    ];
    ops.matmul_many(Act::Xn, &projections, rows)?;
    ops.qk_norm_rope(Query::Plain(Act::Q), Act::K, None, l.kv, rows)?;
    ops.store_kv(l.kv, Act::K, Act::V, rows)?;
    ops.attend(l.kv, Act::Q, None, Act::Attn, rows)?;
    ops.matmul(&l.attn_output, Act::Attn, Act::Proj, rows)?;
    ops.add(Act::X, Act::Proj, rows)?;

    ops.rms_norm(Act::X.into(), &l.ffn_norm, Act::Xn.into(), rows)?;
    swiglu(ops, &l.ffn, rows)?;
    ops.add(Act::X, Act::Proj, rows)
}
