//! `qwen3next` (Qwen3-Next): the hybrid decoder with a mixture-of-experts FFN (softmax
//! routing, normalised top-k weights, a shared expert behind a sigmoid gate), NeoX RoPE over
//! the first `rope.dimension_count` dimensions of each head (partial rotary), value heads
//! repeated interleaved (value head `h` reads key head `h / (Hv / Hk)`), beta and alpha fused
//! in `ssm_ba` grouped per key head, and an optional NextN / MTP block.

use specula_gguf::{GgufFile, HParams};

use super::hybrid::{load_hybrid, HybridModel, HybridRope, HybridVariant};
use crate::blocks::gdn::{BetaAlphaLayout, HeadMap};
use crate::model::LoadError;

/// The qwen3next variant of the hybrid decoder.
pub const VARIANT: HybridVariant = HybridVariant {
    rope: HybridRope::NeoX,
    head_map: HeadMap::Interleaved,
    beta_alpha: BetaAlphaLayout::Grouped,
    moe: true,
};

/// Loads a `qwen3next` model.
pub fn load(file: &GgufFile, hp: &HParams) -> Result<HybridModel, LoadError> {
    load_hybrid(file, hp, VARIANT)
}
