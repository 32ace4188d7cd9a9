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

/// A checked weight matrix of the file: `rows` rows of `cols` values of type `ty`
/// (GGUF shape `{cols, rows}`).
#[derive(Debug, Clone)]
pub struct MatrixRef {
    pub name: String,
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    /// The matrix repacked into interleaved row groups ([`interleave_matrices`]); when present,
    /// forward passes multiply it (or look rows up in it) instead of the file's bytes.
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
/// The file's bytes stay mapped but their pages are handed back to the OS once copied
/// ([`GgufFile::release`]), so the copies replace them in the resident set rather than
/// doubling it (a tied embedding table is then looked up in its copy:
/// [`crate::model::Model::interleave_weights`]).
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
            // The copy replaces the file's bytes in every pass and lookup: their pages need
            // not stay resident beside it.
            file.release(view.bytes());
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

/// A vector of the file (a norm's weights, a bias, a per-head constant), decoded to f32 at
/// load and named by its tensor, so an executor that keeps its own copy (a GPU) finds it by
/// name, as it finds a [`MatrixRef`]'s: `name` is always the tensor's, and two vectors of one
/// name hold the same values.
#[derive(Debug, Clone, PartialEq)]
pub struct Vector {
    pub name: String,
    pub values: Vec<f32>,
}

impl std::ops::Deref for Vector {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.values
    }
}

/// Reads the vector tensor `name` of `len` values (any supported type) as f32.
pub fn load_vector(file: &GgufFile, name: &str, len: usize) -> Result<Vector, LoadError> {
    Ok(Vector {
        name: name.to_string(),
        values: load_f32(file, name, &[len as u64])?,
    })
}

/// [`load_vector`] for a tensor that may be absent.
pub fn load_optional_vector(
    file: &GgufFile,
    name: &str,
    len: usize,
) -> Result<Option<Vector>, LoadError> {
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
