//! Model weights on the device: matrices copied byte for byte from the GGUF file (the kernels
//! decode the GGUF block formats themselves), norm vectors as f32.

use std::collections::HashMap;

use specula_engine::model::weights::{ExpertsRef, MatrixRef, Vector};
use specula_gguf::{GgmlType, GgufFile};
use specula_kernels::WeightType;
use specula_plugin_api::{ErrorKind, PluginError};

use super::{DevBuf, Gpu};

/// The suffix of the GPU kernels for weights of type `ty` (`matmul_<suffix>`): every type
/// of the kernels' table ([`WeightType`]) has one.
pub fn kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    WeightType::from_ggml(ty).map(WeightType::kernel_name)
}

/// A weight matrix on the device: `rows` rows of `cols` values of `ty`.
#[derive(Debug, Clone, Copy)]
pub struct DevMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub ptr: u64,
}

/// A stack of `n_expert` matrices of `rows × cols` (`ffn_*_exps`).
#[derive(Debug, Clone, Copy)]
pub struct DevExperts {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n_expert: usize,
    pub row_bytes: usize,
    pub matrix_bytes: usize,
    pub ptr: u64,
}

/// An f32 vector on the device.
#[derive(Debug, Clone, Copy)]
pub struct DevVec {
    pub len: usize,
    pub ptr: u64,
}

/// Owns the device copies of weights, by tensor name: a tensor used twice (a tied LM head, the
/// MTP head's shared output and norm) is uploaded once, and the operations find the device copy
/// of a weight of the model by its name.
#[derive(Debug, Default)]
pub struct WeightStore {
    /// Matrices and expert stacks, as stored in the file.
    tensors: HashMap<String, DevBuf<u8>>,
    /// Vectors, as f32.
    vectors: HashMap<String, DevBuf<f32>>,
    /// Vectors that are not a tensor of the file (RoPE frequency factors as computed).
    values: Vec<DevBuf<f32>>,
    bytes: u64,
}

fn not_uploaded(name: &str) -> PluginError {
    PluginError::new(
        ErrorKind::Internal,
        format!("cuda-hybrid: weight '{name}' is not on the GPU"),
    )
}

impl WeightStore {
    /// Bytes of device memory held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn upload_tensor(&mut self, gpu: &Gpu, file: &GgufFile, name: &str) -> Result<(), PluginError> {
        if self.tensors.contains_key(name) {
            return Ok(());
        }
        let view = file
            .tensor(name)
            .map_err(|e| PluginError::model(format!("cuda-hybrid: {e}")))?;
        if kernel_suffix(view.info.ty).is_none() {
            return Err(PluginError::model(format!(
                "cuda-hybrid: {}: tensor '{name}' has type {}, which the GPU kernels do not support (supported: {})",
                file.path().display(),
                view.info.ty.name(),
                WeightType::list()
            )));
        }
        let buf = gpu.upload(view.data)?;
        // The device copy is what the passes read: the file's pages need not stay resident
        // (anything on the host that reads them, such as a tied embedding's lookups, faults
        // them back in).
        file.release(view.data);
        self.bytes += buf.bytes();
        self.tensors.insert(name.to_string(), buf);
        Ok(())
    }

    fn tensor_ptr(&self, name: &str) -> Result<u64, PluginError> {
        self.tensors
            .get(name)
            .map(DevBuf::ptr)
            .ok_or_else(|| not_uploaded(name))
    }

    /// Uploads matrix `m` (once).
    pub fn upload_matrix(
        &mut self,
        gpu: &Gpu,
        file: &GgufFile,
        m: &MatrixRef,
    ) -> Result<(), PluginError> {
        self.upload_tensor(gpu, file, &m.name)
    }

    /// The device copy of matrix `m`.
    pub fn matrix(&self, m: &MatrixRef) -> Result<DevMatrix, PluginError> {
        Ok(DevMatrix {
            ty: m.ty.ggml(),
            rows: m.rows,
            cols: m.cols,
            row_bytes: m.row_bytes() as usize,
            ptr: self.tensor_ptr(&m.name)?,
        })
    }

    /// Uploads an expert stack (once).
    pub fn upload_experts(
        &mut self,
        gpu: &Gpu,
        file: &GgufFile,
        e: &ExpertsRef,
    ) -> Result<(), PluginError> {
        self.upload_tensor(gpu, file, &e.name)
    }

    /// The device copy of an expert stack.
    pub fn experts(&self, e: &ExpertsRef) -> Result<DevExperts, PluginError> {
        let ty = e.ty.ggml();
        let row_bytes = ty.row_bytes(e.cols).unwrap_or(0);
        Ok(DevExperts {
            ty,
            rows: e.rows,
            cols: e.cols,
            n_expert: e.n_expert,
            row_bytes,
            matrix_bytes: row_bytes * e.rows,
            ptr: self.tensor_ptr(&e.name)?,
        })
    }

    /// Uploads vector `v` (once).
    pub fn upload_vector(&mut self, gpu: &Gpu, v: &Vector) -> Result<(), PluginError> {
        if !self.vectors.contains_key(&v.name) {
            let buf = gpu.upload(&v.values)?;
            self.bytes += buf.bytes();
            self.vectors.insert(v.name.clone(), buf);
        }
        Ok(())
    }

    /// The device copy of vector `v`.
    pub fn vector(&self, v: &Vector) -> Result<DevVec, PluginError> {
        let buf = self
            .vectors
            .get(&v.name)
            .ok_or_else(|| not_uploaded(&v.name))?;
        Ok(DevVec {
            len: v.len(),
            ptr: buf.ptr(),
        })
    }

    /// A device copy of `values`, which are no tensor of the file.
    pub fn values(&mut self, gpu: &Gpu, values: &[f32]) -> Result<DevVec, PluginError> {
        let buf = gpu.upload(values)?;
        self.bytes += buf.bytes();
        let v = DevVec {
            len: values.len(),
            ptr: buf.ptr(),
        };
        self.values.push(buf);
        Ok(v)
    }
}
