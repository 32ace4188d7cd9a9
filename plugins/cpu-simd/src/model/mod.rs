//! Loading a model: open the GGUF file, dispatch on `general.architecture`, read the
//! hyper-parameters and check every weight.

pub mod weights;

use std::path::Path;

use specula_gguf::{GgmlType, GgufError, GgufFile, HParams};
use specula_plugin_api::{ErrorKind, PluginError};

use crate::arch::{Architecture, DenseConfig};
use weights::ModelWeights;

/// Why a model could not be loaded. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The GGUF reader's error (it names the file and the key or tensor).
    #[error("{0}")]
    Gguf(GgufError),
    #[error("{path}: tensor '{tensor}' has type {ty}, which cpu-simd does not support (supported: f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K)")]
    UnsupportedTensorType {
        path: String,
        tensor: String,
        ty: GgmlType,
    },
    #[error("{path}: tensor '{tensor}': {why}")]
    BadTensor {
        path: String,
        tensor: String,
        why: String,
    },
    #[error("cpu-simd: architecture '{arch}' ({description}) is not supported yet ({path})")]
    ArchitectureNotYetSupported {
        path: String,
        arch: String,
        description: &'static str,
    },
    #[error("cpu-simd: {path}: unknown architecture '{arch}' (supported: {supported})")]
    UnknownArchitecture {
        path: String,
        arch: String,
        supported: &'static str,
    },
    #[error("cpu-simd: {path}: {what} is not supported yet")]
    Unsupported { path: String, what: String },
}

impl From<LoadError> for PluginError {
    fn from(e: LoadError) -> Self {
        let kind = match &e {
            LoadError::Gguf(GgufError::Io { .. }) => ErrorKind::Io,
            _ => ErrorKind::Model,
        };
        PluginError::new(kind, e.to_string())
    }
}

impl From<GgufError> for LoadError {
    fn from(e: GgufError) -> Self {
        LoadError::Gguf(e)
    }
}

/// A loaded model: the mapped file, its hyper-parameters and its checked weights.
pub struct Model {
    pub file: GgufFile,
    pub arch: Architecture,
    pub hparams: HParams,
    pub config: DenseConfig,
    pub weights: ModelWeights,
    /// `general.name`, else the file stem.
    pub name: String,
    pub bos_token: Option<u32>,
    pub eos_token: Option<u32>,
    /// Elements of every tensor in the file.
    pub n_params: u64,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.file.path())
            .field("arch", &self.arch)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Opens and checks the model at `path`.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let file = GgufFile::open(path)?;
        let arch = Architecture::from_name(file.architecture()?, path)?;
        let hparams = HParams::from_gguf(&file)?;
        let (config, weights) = arch.load(&file, &hparams)?;
        let name = match file.get_str("general.name")? {
            Some(name) if !name.is_empty() => name.to_string(),
            _ => path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        let special = |key: &str| -> Result<Option<u32>, LoadError> {
            Ok(file
                .get_u32(key)?
                .filter(|&id| id != u32::MAX && id < hparams.vocab_size))
        };
        let bos_token = special("tokenizer.ggml.bos_token_id")?;
        let eos_token = special("tokenizer.ggml.eos_token_id")?;
        let n_params = file.tensors().iter().map(|t| t.n_elements()).sum();
        Ok(Self {
            file,
            arch,
            hparams,
            config,
            weights,
            name,
            bos_token,
            eos_token,
            n_params,
        })
    }
}
