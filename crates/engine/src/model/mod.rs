//! Loading a model: open the GGUF file, dispatch on `general.architecture`, read the
//! hyper-parameters and check every weight.

pub mod weights;

use std::path::Path;
use std::sync::Arc;

use specula_gguf::{GgmlType, GgufError, GgufFile, HParams};
use specula_kernels::{InterleavedMatrix, WeightType};
use specula_plugin_api::{ErrorKind, ModelInfo, PluginError};

use crate::arch::dense::DenseModel;
use crate::arch::hybrid::HybridModel;
use crate::arch::nextn::MtpWeights;
use crate::arch::Architecture;
use crate::blocks::ffn::FfnShape;
use crate::graph::Dims;
use weights::{MatrixRef, Vector};

/// Why a model could not be loaded. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The GGUF reader's error (it names the file and the key or tensor).
    #[error("{0}")]
    Gguf(GgufError),
    #[error(
        "{path}: tensor '{tensor}' has type {ty}, which is not supported (supported: {})",
        WeightType::list()
    )]
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
    #[error("{path}: unknown architecture '{arch}' (supported: {supported})")]
    UnknownArchitecture {
        path: String,
        arch: String,
        supported: &'static str,
    },
    #[error("{path}: {what} is not supported yet")]
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

/// The weights of a model, by family (the graphs are the architectures', [`crate::arch`]).
#[derive(Debug, Clone)]
pub enum Graph {
    /// llama, qwen2, qwen3.
    Dense(Box<DenseModel>),
    /// qwen35, qwen3next: Gated DeltaNet hybrids.
    Hybrid(Box<HybridModel>),
}

impl Graph {
    /// The hidden size.
    pub fn n_embd(&self) -> usize {
        match self {
            Graph::Dense(d) => d.config.n_embd,
            Graph::Hybrid(h) => h.config.n_embd,
        }
    }

    pub fn rms_eps(&self) -> f32 {
        match self {
            Graph::Dense(d) => d.config.rms_eps,
            Graph::Hybrid(h) => h.config.rms_eps,
        }
    }

    /// `token_embd.weight`.
    pub fn token_embd(&self) -> &MatrixRef {
        match self {
            Graph::Dense(d) => &d.weights.token_embd,
            Graph::Hybrid(h) => &h.weights.token_embd,
        }
    }

    /// The output projection (LM head).
    pub fn output(&self) -> &MatrixRef {
        match self {
            Graph::Dense(d) => &d.weights.output,
            Graph::Hybrid(h) => &h.weights.output,
        }
    }

    /// The final norm before the LM head.
    pub fn output_norm(&self) -> &Vector {
        match self {
            Graph::Dense(d) => &d.weights.output_norm,
            Graph::Hybrid(h) => &h.weights.output_norm,
        }
    }

    /// Bytes of weights read per evaluated token.
    pub fn bytes_per_token(&self) -> u64 {
        match self {
            Graph::Dense(d) => d.weights.bytes_per_token(),
            Graph::Hybrid(h) => h.weights.bytes_per_token(&h.config),
        }
    }

    /// Every matrix the forward passes multiply (not the embedding tables, which are looked
    /// up by rows), mutably, with where it sits: what [`Model::interleave_weights`] repacks.
    pub fn matrices_mut(&mut self) -> Vec<(MatrixSite, &mut MatrixRef)> {
        let mut out = Vec::new();
        match self {
            Graph::Dense(d) => {
                let w = &mut d.weights;
                out.push((MatrixSite::Head, &mut w.output));
                for (i, layer) in w.layers.iter_mut().enumerate() {
                    out.extend(layer.matrices_mut().map(|m| (MatrixSite::Layer(i), m)));
                }
            }
            Graph::Hybrid(h) => {
                let w = &mut h.weights;
                out.push((MatrixSite::Head, &mut w.output));
                for (i, layer) in w.layers.iter_mut().enumerate() {
                    let site = MatrixSite::Layer(i);
                    out.extend(layer.matrices_mut().into_iter().map(|m| (site, m)));
                }
                if let Some(mtp) = &mut w.mtp {
                    out.extend(
                        mtp.matrices_mut()
                            .into_iter()
                            .map(|m| (MatrixSite::Head, m)),
                    );
                }
            }
        }
        out
    }

    /// The embedding tables the passes look rows up in (`token_embd`, and the MTP head's
    /// `embed`), mutably: what [`Model::interleave_weights`] points at a repacked copy of the
    /// same tensor when one exists (a tied output).
    pub fn embedding_tables_mut(&mut self) -> Vec<&mut MatrixRef> {
        match self {
            Graph::Dense(d) => vec![&mut d.weights.token_embd],
            Graph::Hybrid(h) => {
                let w = &mut h.weights;
                let mut out = vec![&mut w.token_embd];
                out.extend(w.mtp.as_mut().map(|mtp| &mut mtp.embed));
                out
            }
        }
    }

    /// The MTP / NextN head, when the model has one.
    pub fn mtp(&self) -> Option<&MtpWeights> {
        match self {
            Graph::Dense(_) => None,
            Graph::Hybrid(h) => h.weights.mtp.as_ref(),
        }
    }

    /// The dimensions that shape a pass over this model.
    pub fn dims(&self) -> Dims {
        match self {
            Graph::Dense(d) => {
                let c = &d.config;
                Dims {
                    n_embd: c.n_embd,
                    n_vocab: d.weights.output.rows,
                    rms_eps: c.rms_eps,
                    attention: c.attention,
                    gated_attention: false,
                    rope: c.rope.clone(),
                    gdn: None,
                    ffn: FfnShape::Dense {
                        n_embd: c.n_embd,
                        n_ff: c.n_ff,
                    },
                    mtp: false,
                }
            }
            Graph::Hybrid(h) => {
                let c = &h.config;
                Dims {
                    n_embd: c.n_embd,
                    n_vocab: c.n_vocab,
                    rms_eps: c.rms_eps,
                    attention: c.attention,
                    gated_attention: true,
                    rope: c.rope.clone(),
                    gdn: Some(c.gdn),
                    ffn: c.ffn,
                    mtp: h.weights.mtp.is_some(),
                }
            }
        }
    }

    /// Trunk blocks the forward pass runs (without appended MTP blocks).
    pub fn n_trunk_layers(&self) -> usize {
        match self {
            Graph::Dense(d) => d.weights.layers.len(),
            Graph::Hybrid(h) => h.weights.layers.len(),
        }
    }
}

/// Where a weight matrix sits in the graph (for backends that place parts elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixSite {
    /// Trunk block `i`.
    Layer(usize),
    /// The LM head and, on hybrid models, the MTP block.
    Head,
}

/// A loaded model: the mapped file, its hyper-parameters and its checked weights.
pub struct Model {
    pub file: GgufFile,
    pub arch: Architecture,
    pub hparams: HParams,
    pub graph: Graph,
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
    /// The context size in effect for a request of `asked` tokens: the trained length for 0,
    /// and at most the trained length otherwise.
    pub fn context_size(&self, asked: u32) -> u32 {
        let trained = self.hparams.context_length;
        if asked == 0 {
            trained
        } else {
            asked.min(trained)
        }
    }

    /// Whether the model has an MTP / NextN head.
    pub fn has_mtp_head(&self) -> bool {
        self.graph.mtp().is_some()
    }

    /// What the host is told about the model, with `n_ctx` the context size in effect.
    pub fn info(&self, n_ctx: u32) -> ModelInfo {
        let hp = &self.hparams;
        ModelInfo {
            architecture: self.arch.name().into(),
            name: self.name.as_str().into(),
            vocab_size: hp.vocab_size,
            context_size: n_ctx,
            train_context_length: hp.context_length,
            hidden_size: hp.embedding_length,
            n_layers: hp.block_count,
            bos_token: self.bos_token.into(),
            eos_token: self.eos_token.into(),
            has_mtp_head: self.has_mtp_head(),
            n_params: self.n_params,
            weight_bytes: self.graph.bytes_per_token(),
        }
    }

    /// Repacks the weight matrices at the sites `select` picks into the interleaved layout the
    /// multi-row kernels read fastest, where the SIMD level and the weight type have one
    /// ([`weights::interleave_matrices`], run on the current rayon pool); an embedding table
    /// that is one of them (a tied output) is then looked up in the copy too. Returns the bytes
    /// of the repacked copies.
    pub fn interleave_weights(
        &mut self,
        select: impl Fn(MatrixSite) -> bool,
    ) -> Result<u64, PluginError> {
        let matrices = self.graph.matrices_mut().into_iter();
        let selected = matrices.filter(|(site, _)| select(*site)).map(|(_, m)| m);
        let bytes = weights::interleave_matrices(&self.file, selected)?;
        let copies: Vec<(String, Arc<InterleavedMatrix>)> = self
            .graph
            .matrices_mut()
            .into_iter()
            .filter_map(|(_, m)| Some((m.name.clone(), m.interleaved.clone()?)))
            .collect();
        for table in self.graph.embedding_tables_mut() {
            if let Some((_, copy)) = copies.iter().find(|(name, _)| *name == table.name) {
                table.interleaved = Some(Arc::clone(copy));
            }
        }
        Ok(bytes)
    }

    /// Opens and checks the model at `path`.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let file = GgufFile::open(path)?;
        let arch = Architecture::from_name(file.architecture()?, path)?;
        let hparams = HParams::from_gguf(&file)?;
        let graph = arch.load(&file, &hparams)?;
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
            graph,
            name,
            bos_token,
            eos_token,
            n_params,
        })
    }
}
