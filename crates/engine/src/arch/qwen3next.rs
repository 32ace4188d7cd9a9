//! `qwen3next` (Qwen3-Next): the hybrid decoder with a mixture-of-experts FFN (softmax
//! routing, normalised top-k weights, a shared expert behind a sigmoid gate), NeoX RoPE over
//! the first `rope.dimension_count` dimensions of each head (partial rotary), value heads
//! repeated interleaved (value head `h` reads key head `h / (Hv / Hk)`), beta and alpha fused
//! in `ssm_ba` grouped per key head, and an optional NextN / MTP block.

use specula_plugin_api::PluginError;

use super::hybrid::{HybridLayer, HybridRope, HybridVariant, Mixer};
use super::nextn::{self, MtpWeights};
use crate::blocks::attention::gated_attention;
use crate::blocks::ffn::FfnBlock;
use crate::blocks::gdn::{gated_delta_net, BetaAlphaLayout, HeadMap};
use crate::graph::{graph_error, Act, LayerOps, Rows};

/// What a qwen3next file holds and how its recurrence reads it.
pub const VARIANT: HybridVariant = HybridVariant {
    rope: HybridRope::NeoX,
    head_map: HeadMap::Interleaved,
    beta_alpha: BetaAlphaLayout::Grouped,
    moe: true,
};

/// One qwen3next layer: `x += mixer(attn_norm(x)); x += moe(post_attention_norm(x))`, the mixer
/// a Gated DeltaNet or a gated full attention as the file schedules them.
pub fn layer(ops: &mut impl LayerOps, l: &HybridLayer, rows: &Rows) -> Result<(), PluginError> {
    let FfnBlock::Moe(moe) = &l.ffn else {
        return Err(graph_error(
            "a qwen3next layer without a mixture-of-experts FFN",
        ));
    };
    ops.rms_norm(Act::X.into(), &l.attn_norm, Act::Xn.into(), rows)?;
    match &l.mixer {
        Mixer::Gdn { ring, weights } => gated_delta_net(ops, weights, *ring, rows)?,
        Mixer::Attention { kv, weights } => gated_attention(ops, weights, *kv, rows)?,
    }
    ops.add(Act::X, Act::Proj, rows)?;

    ops.rms_norm(Act::X.into(), &l.post_attention_norm, Act::Xn.into(), rows)?;
    ops.moe(moe, Act::Xn, Act::Proj, rows)?;
    ops.add(Act::X, Act::Proj, rows)
}

/// The MTP head: its decoder block is a qwen3next layer.
pub fn mtp<O: LayerOps>(ops: &mut O, w: &MtpWeights, rows: &Rows) -> Result<(), PluginError> {
    nextn::forward(ops, w, rows, |ops, block, rows| layer(ops, block, rows))
}
