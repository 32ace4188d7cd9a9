//! Typed, zero-copy views of the weights inside the memory-mapped GGUF file.
//!
//! Loading checks every tensor once (present, exact shape via `tensor_shaped`, supported
//! type) and records it as a [`MatrixRef`]; a forward pass binds the refs to the file's bytes
//! ([`MatrixRef::view`]) without copying. Norm vectors are small and are decoded to owned f32
//! once at load.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;
use specula_gguf::GgufFile;
use specula_kernels::{interleaved, simd, InterleavedMatrix, WeightMatrix, WeightType};
use specula_plugin_api::PluginError;

use super::LoadError;
use crate::arch::DenseVariant;

/// A checked weight matrix of the file: `rows` rows of `cols` values of type `ty`
/// (GGUF shape `{cols, rows}`).
#[derive(Debug, Clone)]
pub struct MatrixRef {
    pub name: String,
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    /// The matrix repacked into interleaved row groups ([`interleave_matrices`]); when present,
    /// forward passes multiply it instead of the file's bytes.
    pub interleaved: Option<Arc<InterleavedMatrix>>,
}

/// Two refs are equal when they name the same checked tensor (whatever its layout in memory).
impl PartialEq for MatrixRef {
    fn eq(&self, other: &Self) -> bool {
        (&self.name, self.ty, self.rows, self.cols)
            == (&other.name, other.ty, other.rows, other.cols)
    }
}

impl MatrixRef {
    /// Finds tensor `name` with shape `{cols, rows}` and a supported type.
    pub fn load(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Self, LoadError> {
        let view = file.tensor_shaped(name, &[cols as u64, rows as u64])?;
        let ty = supported_type(file, name, view.info.ty)?;
        // The reader guarantees the byte size; this also checks whole blocks per row.
        WeightMatrix::new(ty, rows, cols, view.data).map_err(|e| LoadError::BadTensor {
            path: file.path().display().to_string(),
            tensor: name.to_string(),
            why: e.to_string(),
        })?;
        Ok(Self {
            name: name.to_string(),
            ty,
            rows,
            cols,
            interleaved: None,
        })
    }

    /// The matrix to multiply: the interleaved copy when there is one, else the file's bytes.
    pub fn view<'a>(&'a self, file: &'a GgufFile) -> Result<WeightMatrix<'a>, PluginError> {
        if let Some(repacked) = &self.interleaved {
            return Ok(repacked.view());
        }
        let tensor = file.tensor(&self.name).map_err(|e| {
            PluginError::new(specula_plugin_api::ErrorKind::Internal, e.to_string())
        })?;
        WeightMatrix::new(self.ty, self.rows, self.cols, tensor.data).map_err(|e| {
            PluginError::new(
                specula_plugin_api::ErrorKind::Internal,
                format!("tensor '{}': {e}", self.name),
            )
        })
    }

    /// Bytes of the encoded matrix.
    pub fn n_bytes(&self) -> u64 {
        (self.ty.row_bytes(self.cols).unwrap_or(0) * self.rows) as u64
    }

    /// Bytes of one encoded row.
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.cols).unwrap_or(0) as u64
    }
}

impl MatrixRef {
    /// Finds the 1-D tensor `name` of `cols` values and views it as a one-row matrix: a
    /// projection to a single value per input row (e.g. the shared-expert gate
    /// `ffn_gate_inp_shexp`, stored as `{n_embd}`).
    pub fn load_row(file: &GgufFile, name: &str, cols: usize) -> Result<Self, LoadError> {
        let view = file.tensor_shaped(name, &[cols as u64])?;
        let ty = supported_type(file, name, view.info.ty)?;
        WeightMatrix::new(ty, 1, cols, view.data).map_err(|e| LoadError::BadTensor {
            path: file.path().display().to_string(),
            tensor: name.to_string(),
            why: e.to_string(),
        })?;
        Ok(Self {
            name: name.to_string(),
            ty,
            rows: 1,
            cols,
            interleaved: None,
        })
    }
}

/// Repacks every matrix of `matrices` whose type the multi-row kernels multiply faster
/// interleaved at the process's SIMD level ([`interleaved::pays_off`]), in parallel on the
/// current rayon pool; refs naming the same tensor (a tied output, an MTP head falling back
/// to the trunk's) share one copy. Returns the bytes of the copies.
///
/// The file's bytes stay mapped (the embedding lookup reads them); the repacked matrices cost
/// that much memory again for the matrices they replace.
pub fn interleave_matrices<'m>(
    file: &GgufFile,
    matrices: impl IntoIterator<Item = &'m mut MatrixRef>,
) -> Result<u64, PluginError> {
    let level = simd::level();
    let mut targets: Vec<&mut MatrixRef> = matrices
        .into_iter()
        .filter(|m| m.interleaved.is_none() && interleaved::pays_off(m.ty, level))
        .collect();
    let mut unique: Vec<&MatrixRef> = Vec::new();
    for m in &targets {
        if !unique.iter().any(|u| u.name == m.name) {
            unique.push(m);
        }
    }
    let repacked = unique
        .par_iter()
        .map(|m| {
            let view = m.view(file)?;
            let packed = InterleavedMatrix::repack(&view).ok_or_else(|| {
                PluginError::new(
                    specula_plugin_api::ErrorKind::Internal,
                    format!(
                        "tensor '{}' ({}) cannot be interleaved",
                        m.name,
                        m.ty.ggml()
                    ),
                )
            })?;
            Ok((m.name.clone(), Arc::new(packed)))
        })
        .collect::<Result<HashMap<_, _>, PluginError>>()?;
    for m in &mut targets {
        m.interleaved = repacked.get(&m.name).cloned();
    }
    Ok(repacked.values().map(|m| m.n_bytes() as u64).sum())
}

/// A checked stack of per-expert weight matrices: tensor `{cols, rows, n_expert}`, expert `e`
/// being the contiguous `rows × cols` matrix at index `e`.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertsRef {
    pub name: String,
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    pub n_expert: usize,
}

impl ExpertsRef {
    /// Finds tensor `name` with shape `{cols, rows, n_expert}` and a supported type.
    pub fn load(
        file: &GgufFile,
        name: &str,
        rows: usize,
        cols: usize,
        n_expert: usize,
    ) -> Result<Self, LoadError> {
        let view = file.tensor_shaped(name, &[cols as u64, rows as u64, n_expert as u64])?;
        let ty = supported_type(file, name, view.info.ty)?;
        WeightMatrix::new(ty, rows * n_expert, cols, view.data).map_err(|e| {
            LoadError::BadTensor {
                path: file.path().display().to_string(),
                tensor: name.to_string(),
                why: e.to_string(),
            }
        })?;
        Ok(Self {
            name: name.to_string(),
            ty,
            rows,
            cols,
            n_expert,
        })
    }

    /// Expert `e`'s matrix over the file's bytes.
    pub fn view<'f>(&self, file: &'f GgufFile, e: usize) -> Result<WeightMatrix<'f>, PluginError> {
        let internal = |why: String| PluginError::new(specula_plugin_api::ErrorKind::Internal, why);
        let tensor = file
            .tensor(&self.name)
            .map_err(|e| internal(e.to_string()))?;
        let bytes = self.expert_bytes() as usize;
        let data = tensor
            .data
            .get(e * bytes..(e + 1) * bytes)
            .ok_or_else(|| internal(format!("tensor '{}': no expert {e}", self.name)))?;
        WeightMatrix::new(self.ty, self.rows, self.cols, data)
            .map_err(|err| internal(format!("tensor '{}': {err}", self.name)))
    }

    /// Bytes of one expert's matrix.
    pub fn expert_bytes(&self) -> u64 {
        (self.ty.row_bytes(self.cols).unwrap_or(0) * self.rows) as u64
    }
}

/// Reads tensor `name` of shape `dims` (ggml order, any supported type) as f32 values in
/// storage order (small tensors such as convolution kernels).
pub fn load_f32(file: &GgufFile, name: &str, dims: &[u64]) -> Result<Vec<f32>, LoadError> {
    let view = file.tensor_shaped(name, dims)?;
    let ty = supported_type(file, name, view.info.ty)?;
    let n = dims.iter().product::<u64>() as usize;
    specula_kernels::try_dequantize(ty.ggml(), view.data, n).map_err(|e| LoadError::BadTensor {
        path: file.path().display().to_string(),
        tensor: name.to_string(),
        why: e.to_string(),
    })
}

/// Reads the vector tensor `name` of `len` values (any supported type) as f32.
pub fn load_vector(file: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    let view = file.tensor_shaped(name, &[len as u64])?;
    let ty = supported_type(file, name, view.info.ty)?;
    specula_kernels::try_dequantize(ty.ggml(), view.data, len).map_err(|e| LoadError::BadTensor {
        path: file.path().display().to_string(),
        tensor: name.to_string(),
        why: e.to_string(),
    })
}

/// [`load_vector`] for a tensor that may be absent.
pub fn load_optional_vector(
    file: &GgufFile,
    name: &str,
    len: usize,
) -> Result<Option<Vec<f32>>, LoadError> {
    match file.tensor_info(name) {
        None => Ok(None),
        Some(_) => load_vector(file, name, len).map(Some),
    }
}

fn supported_type(
    file: &GgufFile,
    name: &str,
    ty: specula_gguf::GgmlType,
) -> Result<WeightType, LoadError> {
    WeightType::from_ggml(ty).ok_or_else(|| LoadError::UnsupportedTensorType {
        path: file.path().display().to_string(),
        tensor: name.to_string(),
        ty,
    })
}

/// The weights of one dense decoder block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub attn_q: MatrixRef,
    pub attn_k: MatrixRef,
    pub attn_v: MatrixRef,
    pub attn_output: MatrixRef,
    /// Per-head RMSNorm of queries (qwen3), `key_length` values.
    pub attn_q_norm: Option<Vec<f32>>,
    /// Per-head RMSNorm of keys (qwen3), `key_length` values.
    pub attn_k_norm: Option<Vec<f32>>,
    /// Biases of the q, k and v projections (qwen2).
    pub qkv_bias: Option<QkvBias>,
    pub ffn_norm: Vec<f32>,
    pub ffn_gate: MatrixRef,
    pub ffn_up: MatrixRef,
    pub ffn_down: MatrixRef,
}

impl LayerWeights {
    /// Every weight matrix of the block.
    pub fn matrices(&self) -> [&MatrixRef; 7] {
        [
            &self.attn_q,
            &self.attn_k,
            &self.attn_v,
            &self.attn_output,
            &self.ffn_gate,
            &self.ffn_up,
            &self.ffn_down,
        ]
    }

    /// Every weight matrix of the block, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> [&mut MatrixRef; 7] {
        [
            &mut self.attn_q,
            &mut self.attn_k,
            &mut self.attn_v,
            &mut self.attn_output,
            &mut self.ffn_gate,
            &mut self.ffn_up,
            &mut self.ffn_down,
        ]
    }

    /// Bytes of weights the block reads per token (matrices and norm vectors).
    pub fn bytes_per_token(&self) -> u64 {
        let vectors = self.attn_norm.len()
            + self.ffn_norm.len()
            + self.attn_q_norm.as_ref().map_or(0, Vec::len)
            + self.attn_k_norm.as_ref().map_or(0, Vec::len)
            + self
                .qkv_bias
                .as_ref()
                .map_or(0, |b| b.q.len() + b.k.len() + b.v.len());
        self.matrices().iter().map(|m| m.n_bytes()).sum::<u64>() + 4 * vectors as u64
    }
}

/// Biases added to the query, key and value projections' outputs (one value per output).
#[derive(Debug, Clone)]
pub struct QkvBias {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Dimensions a dense decoder block's tensors are checked against.
#[derive(Debug, Clone, Copy)]
pub struct DenseDims {
    pub n_embd: usize,
    pub n_ff: usize,
    pub q_width: usize,
    pub k_width: usize,
    pub v_width: usize,
    /// Output width of the attention heads (`H * value_length`), the input of `attn_output`.
    pub attn_out_width: usize,
    pub head_dim: usize,
}

/// Loads block `layer` of a dense model; `variant` says whether the per-head q/k norms and
/// the q/k/v biases are part of the architecture (then they are required).
pub fn load_dense_layer(
    file: &GgufFile,
    layer: usize,
    d: &DenseDims,
    variant: DenseVariant,
) -> Result<LayerWeights, LoadError> {
    let qk_norm = variant.qk_norm;
    let name = |t: &str| format!("blk.{layer}.{t}.weight");
    let bias = |t: &str, len| load_vector(file, &format!("blk.{layer}.{t}.bias"), len);
    let qkv_bias = if variant.qkv_bias {
        Some(QkvBias {
            q: bias("attn_q", d.q_width)?,
            k: bias("attn_k", d.k_width)?,
            v: bias("attn_v", d.v_width)?,
        })
    } else {
        None
    };
    let matrix = |t: &str, rows, cols| MatrixRef::load(file, &name(t), rows, cols);
    let head_norm = |t: &str| -> Result<Option<Vec<f32>>, LoadError> {
        if qk_norm {
            load_vector(file, &name(t), d.head_dim).map(Some)
        } else {
            Ok(None)
        }
    };
    Ok(LayerWeights {
        attn_norm: load_vector(file, &name("attn_norm"), d.n_embd)?,
        attn_q: matrix("attn_q", d.q_width, d.n_embd)?,
        attn_k: matrix("attn_k", d.k_width, d.n_embd)?,
        attn_v: matrix("attn_v", d.v_width, d.n_embd)?,
        attn_output: matrix("attn_output", d.n_embd, d.attn_out_width)?,
        attn_q_norm: head_norm("attn_q_norm")?,
        attn_k_norm: head_norm("attn_k_norm")?,
        qkv_bias,
        ffn_norm: load_vector(file, &name("ffn_norm"), d.n_embd)?,
        ffn_gate: matrix("ffn_gate", d.n_ff, d.n_embd)?,
        ffn_up: matrix("ffn_up", d.n_ff, d.n_embd)?,
        ffn_down: matrix("ffn_down", d.n_embd, d.n_ff)?,
    })
}

/// All weights of a dense model.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `token_embd.weight`: `vocab` rows of `n_embd`.
    pub token_embd: MatrixRef,
    pub output_norm: Vec<f32>,
    /// `output.weight`, or `token_embd.weight` again when the file has none (tied embeddings).
    pub output: MatrixRef,
    pub tied_output: bool,
    /// `rope_freqs.weight` (per-pair frequency divisors), when present.
    pub rope_freqs: Option<Vec<f32>>,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Loads the embedding, output and every block.
    pub fn load_dense(
        file: &GgufFile,
        n_layers: usize,
        n_vocab: usize,
        n_rot: usize,
        dims: &DenseDims,
        variant: DenseVariant,
    ) -> Result<Self, LoadError> {
        let token_embd = MatrixRef::load(file, "token_embd.weight", n_vocab, dims.n_embd)?;
        let (output, tied_output) = match file.tensor_info("output.weight") {
            Some(_) => (
                MatrixRef::load(file, "output.weight", n_vocab, dims.n_embd)?,
                false,
            ),
            None => (token_embd.clone(), true),
        };
        let layers = (0..n_layers)
            .map(|i| load_dense_layer(file, i, dims, variant))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            output_norm: load_vector(file, "output_norm.weight", dims.n_embd)?,
            rope_freqs: load_optional_vector(file, "rope_freqs.weight", n_rot / 2)?,
            token_embd,
            output,
            tied_output,
            layers,
        })
    }

    /// Bytes of weights read per evaluated token: every block, the final norm, the output
    /// matrix, and one row of the embedding (all of it when tied, counted once as output).
    pub fn bytes_per_token(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(LayerWeights::bytes_per_token).sum();
        let embedding_row = if self.tied_output {
            0
        } else {
            self.token_embd.row_bytes()
        };
        layers + 4 * self.output_norm.len() as u64 + self.output.n_bytes() + embedding_row
    }
}
