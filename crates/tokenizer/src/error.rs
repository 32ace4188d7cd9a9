//! Errors of building a tokenizer from GGUF metadata. Every variant names the file and the key.

use std::path::PathBuf;

/// Why a GGUF file's tokenizer metadata cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required key is absent (e.g. `tokenizer.ggml.model` in a file without a tokenizer).
    #[error("{path}: missing metadata key '{key}', which a tokenizer needs")]
    MissingKey { path: PathBuf, key: &'static str },

    /// `tokenizer.ggml.model` names a tokenizer family Specula does not implement.
    #[error("{path}: metadata key '{key}' is '{model}', an unsupported tokenizer model (Specula reads 'llama' and 'gpt2')")]
    UnknownModel {
        path: PathBuf,
        key: &'static str,
        model: String,
    },

    /// `tokenizer.ggml.pre` names a pre-tokenizer (regex set) Specula does not know.
    #[error("{path}: metadata key '{key}' is '{pre}', an unknown pre-tokenizer (known: {known})")]
    UnknownPreTokenizer {
        path: PathBuf,
        key: &'static str,
        pre: String,
        known: String,
    },

    /// A key is present but its content is unusable.
    #[error("{path}: metadata key '{key}': {what}")]
    Invalid {
        path: PathBuf,
        key: String,
        what: String,
    },

    /// A key has the wrong GGUF type (the error names the file and key).
    #[error(transparent)]
    Gguf(#[from] specula_gguf::GgufError),
}
