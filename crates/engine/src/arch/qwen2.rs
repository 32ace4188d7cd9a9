//! `qwen2` (Qwen2, Qwen2.5): the llama block with biases on the query, key and value
//! projections (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`, added before RoPE) and NeoX
//! (halves) RoPE. No other bias: `attn_output` and the FFN have none.

use specula_gguf::{GgufFile, HParams};
use specula_kernels::RopeMode;

use super::{load_dense, DenseConfig, DenseVariant};
use crate::model::weights::ModelWeights;
use crate::model::LoadError;

/// The qwen2 variant of the dense decoder.
pub const VARIANT: DenseVariant = DenseVariant {
    rope_mode: RopeMode::NeoX,
    qk_norm: false,
    qkv_bias: true,
};

/// Loads a `qwen2` model.
pub fn load(file: &GgufFile, hp: &HParams) -> Result<(DenseConfig, ModelWeights), LoadError> {
    load_dense(file, hp, VARIANT)
}
