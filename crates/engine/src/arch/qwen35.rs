//! `qwen35` (Qwen3.5 / 3.6): the hybrid decoder with a dense SwiGLU FFN in every layer,
//! interleaved multi-section RoPE (IMROPE, `rope.dimension_sections`) over the first
//! `rope.dimension_count` dimensions of each head, value heads stored tiled (value head `h`
//! reads key head `h % Hk`), separate `ssm_beta` / `ssm_alpha` projections, and an optional
//! NextN / MTP block.

use specula_gguf::{GgufFile, HParams};

use super::hybrid::{load_hybrid, HybridModel, HybridRope, HybridVariant};
use crate::blocks::gdn::{BetaAlphaLayout, HeadMap};
use crate::model::LoadError;

/// The qwen35 variant of the hybrid decoder.
pub const VARIANT: HybridVariant = HybridVariant {
    rope: HybridRope::MultiSection { interleaved: true },
    head_map: HeadMap::Tiled,
    beta_alpha: BetaAlphaLayout::Separate,
    moe: false,
};

/// Loads a `qwen35` model.
pub fn load(file: &GgufFile, hp: &HParams) -> Result<HybridModel, LoadError> {
    load_hybrid(file, hp, VARIANT)
}
