//! `qwen3`: the llama block with NeoX (halves) RoPE and a per-head RMSNorm of queries and keys
//! (`attn_q_norm`, `attn_k_norm`, `key_length` values each) applied before RoPE. Head size
//! comes from `attention.key_length`, which need not equal `embedding_length / head_count`.

use specula_gguf::{GgufFile, HParams};
use specula_kernels::RopeMode;

use super::{load_dense, DenseConfig, DenseVariant};
use crate::model::weights::ModelWeights;
use crate::model::LoadError;

/// The qwen3 variant of the dense decoder.
pub const VARIANT: DenseVariant = DenseVariant {
    rope_mode: RopeMode::NeoX,
    qk_norm: true,
    qkv_bias: false,
};

/// Loads a `qwen3` model.
pub fn load(file: &GgufFile, hp: &HParams) -> Result<(DenseConfig, ModelWeights), LoadError> {
    load_dense(file, hp, VARIANT)
}
