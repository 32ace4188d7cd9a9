//! `llama`: pre-norm dense decoder with grouped-query attention, adjacent-pair ("normal")
//! RoPE, SwiGLU FFN; optional `rope_freqs.weight` (Llama 3.1 frequency factors) and linear
//! RoPE scaling. Also covers llama2.c conversions (stories260K, llama2xs) whose `wq`/`wk` are
//! stored unpermuted, which is exactly what adjacent-pair rotation expects.

use specula_gguf::{GgufFile, HParams};
use specula_kernels::RopeMode;

use super::{load_dense, DenseConfig, DenseVariant};
use crate::model::weights::ModelWeights;
use crate::model::LoadError;

/// The llama variant of the dense decoder.
pub const VARIANT: DenseVariant = DenseVariant {
    rope_mode: RopeMode::Normal,
    qk_norm: false,
    qkv_bias: false,
};

/// Loads a `llama` model.
pub fn load(file: &GgufFile, hp: &HParams) -> Result<(DenseConfig, ModelWeights), LoadError> {
    load_dense(file, hp, VARIANT)
}
