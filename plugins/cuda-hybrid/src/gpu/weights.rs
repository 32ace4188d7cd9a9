//! Model weights on the device: matrices copied byte for byte from the GGUF file (the kernels
//! decode the GGUF block formats themselves), norm vectors as f32.

use std::collections::HashMap;

use specula_engine::model::weights::{ExpertsRef, MatrixRef};
use specula_gguf::{GgmlType, GgufFile};
use specula_kernels::WeightType;
use specula_plugin_api::PluginError;

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

/// Owns the device copies of weights; tensors used twice (a tied LM head, the MTP head's
/// shared output) are uploaded once.
#[derive(Debug, Default)]
pub struct WeightStore {
    tensors: HashMap<String, DevBuf<u8>>,
    vectors: Vec<DevBuf<f32>>,
    bytes: u64,
}

impl WeightStore {
    /// Bytes of device memory held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn tensor(&mut self, gpu: &Gpu, file: &GgufFile, name: &str) -> Result<u64, PluginError> {
        if let Some(buf) = self.tensors.get(name) {
            return Ok(buf.ptr());
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
        self.bytes += buf.bytes();
        let ptr = buf.ptr();
        self.tensors.insert(name.to_string(), buf);
        Ok(ptr)
    }

    /// The device copy of matrix `m`.
    pub fn matrix(
        &mut self,
        gpu: &Gpu,
        file: &GgufFile,
        m: &MatrixRef,
    ) -> Result<DevMatrix, PluginError> {
        let ty = m.ty.ggml();
        Ok(DevMatrix {
            ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes: m.row_bytes() as usize,
            ptr: self.tensor(gpu, file, &m.name)?,
        })
    }

    /// The device copy of an expert stack.
    pub fn experts(
        &mut self,
        gpu: &Gpu,
        file: &GgufFile,
        e: &ExpertsRef,
    ) -> Result<DevExperts, PluginError> {
        let ty = e.ty.ggml();
        let row_bytes = ty.row_bytes(e.cols).unwrap_or(0);
        Ok(DevExperts {
            ty,
            rows: e.rows,
            cols: e.cols,
            n_expert: e.n_expert,
            row_bytes,
            matrix_bytes: row_bytes * e.rows,
            ptr: self.tensor(gpu, file, &e.name)?,
        })
    }

    /// A device copy of `values`.
    pub fn vector(&mut self, gpu: &Gpu, values: &[f32]) -> Result<DevVec, PluginError> {
        let buf = gpu.upload(values)?;
        self.bytes += buf.bytes();
        let v = DevVec {
            len: values.len(),
            ptr: buf.ptr(),
        };
        self.vectors.push(buf);
        Ok(v)
    }
}
