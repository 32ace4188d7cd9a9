//! Writing GGUF models of given shapes and tensor types, in the layout llama.cpp reads:
//! dense `llama` / `qwen3`, hybrid `qwen35` (Gated DeltaNet + gated attention, dense FFN) and
//! `qwen3next` (the same trunk with a MoE FFN), optionally with an MTP / NextN block.
//!
//! Used by `specula gen-model` (benchmark presets, the built-in demo model) and by tests.
//! [`ModelSpec`] says the shape, a [`WeightSource`] fills each tensor (random by default),
//! and a [`Vocab`] supplies the tokenizer metadata.

mod mix;
mod spec;
mod vocab;
mod weights;
mod writer;

pub use mix::{more_bits, TypeMix};
pub use spec::{Arch, HybridSpec, ModelSpec, MoeSpec};
pub use vocab::{SpmVocab, Vocab};
pub use weights::{RandomWeights, WeightSource};
pub use writer::write_model;

/// Why a model could not be written.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error("invalid model shape: {0}")]
    Shape(String),
    #[error(transparent)]
    Gguf(#[from] specula_gguf::GgufError),
    #[error("cannot create {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}
