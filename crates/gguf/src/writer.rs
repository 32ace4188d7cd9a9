//! Writing GGUF v3 files (for `specula gen-model`, tests and benchmark models).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::reader::{DEFAULT_ALIGNMENT, MAGIC};
use crate::types::GgmlType;
use crate::value::{Value, ValueType};

#[derive(Debug)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes a GGUF v3 file.
///
/// Tensor data is given already encoded in its type (see `specula_kernels` for quantisers).
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (replacing an earlier value).
    pub fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        let key = key.into();
        self.metadata.retain(|(k, _)| *k != key);
        self.metadata.push((key, value));
        self
    }

    pub fn set_str(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.set(key, Value::String(value.into()))
    }

    pub fn set_u32(&mut self, key: impl Into<String>, value: u32) -> &mut Self {
        self.set(key, Value::U32(value))
    }

    pub fn set_f32(&mut self, key: impl Into<String>, value: f32) -> &mut Self {
        self.set(key, Value::F32(value))
    }

    pub fn set_bool(&mut self, key: impl Into<String>, value: bool) -> &mut Self {
        self.set(key, Value::Bool(value))
    }

    pub fn set_str_array<S: Into<String>>(
        &mut self,
        key: impl Into<String>,
        items: impl IntoIterator<Item = S>,
    ) -> &mut Self {
        let items = items.into_iter().map(|s| Value::String(s.into())).collect();
        self.set(key, Value::Array(ValueType::String, items))
    }

    pub fn set_f32_array(
        &mut self,
        key: impl Into<String>,
        items: impl IntoIterator<Item = f32>,
    ) -> &mut Self {
        let items = items.into_iter().map(Value::F32).collect();
        self.set(key, Value::Array(ValueType::F32, items))
    }

    pub fn set_i32_array(
        &mut self,
        key: impl Into<String>,
        items: impl IntoIterator<Item = i32>,
    ) -> &mut Self {
        let items = items.into_iter().map(Value::I32).collect();
        self.set(key, Value::Array(ValueType::I32, items))
    }

    /// Adds a tensor with dimensions `dims` (ggml order) whose data is already encoded as `ty`.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let n: u64 = dims.iter().product();
        let expected = ty
            .row_bytes(dims[0] as usize)
            .map(|row| row as u64 * (n / dims[0].max(1)));
        if expected != Some(data.len() as u64) {
            return Err(GgufError::Write(format!(
                "tensor '{name}' of type {ty} and shape {dims:?} needs {expected:?} bytes, got {}",
                data.len()
            )));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::Write(format!("tensor '{name}' added twice")));
        }
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(self)
    }

    /// Adds an F32 tensor.
    pub fn add_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
    ) -> Result<&mut Self> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, dims, GgmlType::F32, data)
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut out = BufWriter::new(File::create(path).map_err(io)?);
        self.write_to(&mut out).map_err(io)?;
        out.flush().map_err(io)
    }

    /// Writes the file to any writer.
    pub fn write_to(&self, out: &mut impl Write) -> std::io::Result<()> {
        let align = DEFAULT_ALIGNMENT;
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut header, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(align) * align;
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&off.to_le_bytes());
        }
        let padded = (header.len() as u64).div_ceil(align) * align;
        header.resize(padded as usize, 0);
        out.write_all(&header)?;
        let mut written = 0u64;
        for (t, off) in self.tensors.iter().zip(&offsets) {
            out.write_all(&vec![0u8; (off - written) as usize])?;
            out.write_all(&t.data)?;
            written = off + t.data.len() as u64;
        }
        Ok(())
    }
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => buf.push(*v),
        Value::I8(v) => buf.push(*v as u8),
        Value::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => buf.push(u8::from(*v)),
        Value::String(s) => put_string(buf, s),
        Value::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::Array(elem, items) => {
            buf.extend_from_slice(&(*elem as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(buf, item);
            }
        }
    }
}
