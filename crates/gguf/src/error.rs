//! Errors of GGUF reading and writing.

use std::path::PathBuf;

/// Everything that can be wrong with a GGUF file. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a regular file (a directory, device or pipe); expected a GGUF file")]
    NotAFile { path: PathBuf },
    #[error("{path} is empty (0 bytes); expected a GGUF file")]
    Empty { path: PathBuf },
    #[error("{path} is not a GGUF file: it starts with \"{}\", not \"GGUF\"", found.escape_ascii())]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (Specula reads versions 2 and 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path} is truncated or corrupt: {what} at byte {offset} runs past the end of the file ({file_len} bytes)")]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        file_len: u64,
    },
    #[error("{path} is corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{path}: tensor '{tensor}' has unknown or unsupported tensor type id {type_id}")]
    UnknownTensorType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
    },
    #[error("{path}: missing metadata key '{key}'")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key '{key}' is {found}, expected {expected}")]
    WrongType {
        path: PathBuf,
        key: String,
        found: String,
        expected: &'static str,
    },
    #[error("{path}: missing tensor '{tensor}'")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path} holds no tensors, so no '{tensor}' (a vocabulary-only GGUF?); expected a model's weights")]
    NoTensors { path: PathBuf, tensor: String },
    #[error("{path}: tensor '{tensor}' has shape {found:?}, expected {expected:?}")]
    WrongShape {
        path: PathBuf,
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("cannot write GGUF: {0}")]
    Write(String),
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;
