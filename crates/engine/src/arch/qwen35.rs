//! `qwen35` (Qwen3.5 / 3.6): the hybrid decoder with a dense SwiGLU FFN in every layer,
//! interleaved multi-section RoPE (IMROPE, `rope.dimension_sections`) over the first
//! `rope.dimension_count` dimensions of each head, value heads stored tiled (value head `h`
//! reads key head `h % Hk`), separate `ssm_beta` / `ssm_alpha` projections, and an optional
//! NextN / MTP block.

use specula_plugin_api::PluginError;

use super::hybrid::{HybridLayer, HybridRope, HybridVariant, Mixer};
use super::nextn::{self, MtpWeights};
use crate::blocks::attention::gated_attention;
use crate::blocks::ffn::{swiglu, FfnBlock};
use crate::blocks::gdn::{gated_delta_net, BetaAlphaLayout, HeadMap};
use crate::graph::{graph_error, Act, LayerOps, Rows};

/// What a qwen35 file holds and how its recurrence reads it.
pub const VARIANT: HybridVariant = HybridVariant {
    rope: HybridRope::MultiSection { interleaved: true },
    head_map: HeadMap::Tiled,
    beta_alpha: BetaAlphaLayout::Separate,
    moe: false,
};

/// One qwen35 layer: `x += mixer(attn_norm(x)); x += ffn(post_attention_norm(x))`, the mixer a
/// Gated DeltaNet or a gated full attention as the file schedules them.
pub fn layer(ops: &mut impl LayerOps, l: &HybridLayer, rows: &Rows) -> Result<(), PluginError> {
    let FfnBlock::Dense(ffn) = &l.ffn else {
        return Err(graph_error("a qwen35 layer with a mixture-of-experts FFN"));
    };
    ops.rms_norm(Act::X.into(), &l.attn_norm, Act::Xn.into(), rows)?;
    match &l.mixer {
        Mixer::Gdn { ring, weights } => gated_delta_net(ops, weights, *ring, rows)?,
        Mixer::Attention { kv, weights } => gated_attention(ops, weights, *kv, rows)?,
    }
    ops.add(Act::X, Act::Proj, rows)?;

    ops.rms_norm(Act::X.into(), &l.post_attention_norm, Act::Xn.into(), rows)?;
    swiglu(ops, ffn, rows)?;
    ops.add(Act::X, Act::Proj, rows)
}

/// The MTP head: its decoder block is a qwen35 layer.
pub fn mtp<O: LayerOps>(ops: &mut O, w: &MtpWeights, rows: &Rows) -> Result<(), PluginError> {
    nextn::forward(ops, w, rows, |ops, block, rows| layer(ops, block, rows))
}
