//! Zero-copy GGUF reading over a memory map.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::types::GgmlType;
use crate::value::{Value, ValueType};

/// GGUF magic: the bytes "GGUF".
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// One tensor's header record.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Size of the data in bytes.
    pub fn n_bytes(&self) -> u64 {
        self.n_elements() / self.ty.block_size() as u64 * self.ty.block_bytes() as u64
    }
}

/// A tensor's header and its bytes, borrowed from the memory map.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

/// The bytes of a file: memory-mapped from disk, or owned (a file image parsed from memory).
enum Bytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(map) => map,
            Bytes::Owned(bytes) => bytes,
        }
    }
}

/// An opened GGUF file: parsed metadata and tensor records, with tensor data left in the map.
pub struct GgufFile {
    path: PathBuf,
    map: Bytes,
    version: u32,
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The OS's page size (4096 where it cannot be asked).
fn page_size() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a configuration value.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if let Ok(size) = usize::try_from(size) {
            if size.is_power_of_two() {
                return size;
            }
        }
    }
    4096
}

impl GgufFile {
    /// Opens and validates `path`: header, metadata, tensor records, and that every tensor's
    /// data lies inside the file's data section, aligned, sized by its type and shape, and
    /// overlapping no other tensor. Tensor data is not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // A device or pipe (`/dev/zero`, a FIFO) has no length to map and may never end.
        if !file.metadata().map_err(io)?.is_file() {
            return Err(GgufError::NotAFile { path });
        }
        // SAFETY: a read-only shared mapping (memmap2 maps `PROT_READ`, `MAP_SHARED`) this
        // process never writes; we accept that another process truncating or rewriting the file
        // under us is undefined behaviour, as every mmap user does.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Bytes::Map(map))
    }

    /// Hands back to the OS the resident pages of this file's mapping under `data` (bytes this
    /// file lent out, such as a tensor's): they leave the process's resident set — the page
    /// cache keeps them — and are read from the file again if touched. For weights a backend
    /// has copied into another layout, so that the file's pages and the copy are not both
    /// resident. Returns the bytes released: whole pages inside `data`, none for an image held
    /// in memory, bytes that are not this file's, or where the OS refuses.
    pub fn release(&self, data: &[u8]) -> usize {
        let Bytes::Map(map) = &self.map else {
            return 0;
        };
        let page = page_size();
        let base = map.as_ptr() as usize;
        let start = data.as_ptr() as usize;
        if start < base || start + data.len() > base + map.len() {
            return 0;
        }
        let first = (start - base).next_multiple_of(page);
        let end = (start - base + data.len()) / page * page;
        if end <= first {
            return 0;
        }
        #[cfg(unix)]
        {
            // SAFETY: the map is a read-only shared mapping of a file this process never
            // writes, so MADV_DONTNEED discards nothing: a later read of the range faults the
            // same bytes back in from the page cache or the file (every slice into it stays
            // valid). The range is whole pages, so no neighbouring bytes are touched.
            let advised = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first)
            };
            if advised.is_ok() {
                return end - first;
            }
        }
        0
    }

    /// Parses a GGUF image held in memory, with the checks of [`GgufFile::open`]; `label`
    /// names it in errors (a path, or any description).
    pub fn from_bytes(label: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(label.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, map: Bytes) -> Result<Self> {
        let mut cur = Cursor {
            bytes: &map,
            pos: 0,
            path: &path,
        };
        if map.is_empty() {
            return Err(GgufError::Empty { path });
        }
        let magic: [u8; 4] = cur.take(4, "magic")?.try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = cur.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion {
                path: path.clone(),
                version,
            });
        }
        let n_tensors = cur.u64("tensor count")?;
        let n_kv = cur.u64("metadata count")?;
        // Each record takes at least 8 bytes: never pre-allocate for more than the file holds
        // (a corrupt count then fails on the first record past the end).
        let limit = map.len() as u64 / 8;
        let mut metadata = Vec::with_capacity(n_kv.min(limit) as usize);
        let mut index = HashMap::new();
        for i in 0..n_kv {
            let key = cur.string(&format!("key of metadata entry {i}"))?;
            let ty = cur.u32(&format!("type of metadata '{key}'"))?;
            let value = cur.value(ty, &key)?;
            index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let mut tensors = Vec::with_capacity(n_tensors.min(limit) as usize);
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let name = cur.string(&format!("name of tensor {i}"))?;
            let n_dims = cur.u32(&format!("rank of tensor '{name}'"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::Corrupt {
                    path: path.clone(),
                    what: format!("tensor '{name}' has {n_dims} dimensions (expected 1 to 4)"),
                });
            }
            let dims = (0..n_dims)
                .map(|_| cur.u64(&format!("shape of tensor '{name}'")))
                .collect::<Result<Vec<_>>>()?;
            let type_id = cur.u32(&format!("type of tensor '{name}'"))?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                path: path.clone(),
                tensor: name.clone(),
                type_id,
            })?;
            let offset = cur.u64(&format!("offset of tensor '{name}'"))?;
            if dims.contains(&0) {
                return Err(GgufError::Corrupt {
                    path: path.clone(),
                    what: format!("tensor '{name}' has a dimension of 0 in its shape {dims:?}"),
                });
            }
            // The element count must not overflow (the byte size is checked against the file
            // once the data section's start is known).
            if dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .is_none()
            {
                return Err(GgufError::Corrupt {
                    path: path.clone(),
                    what: format!("tensor '{name}' has an impossible shape {dims:?}"),
                });
            }
            if dims[0] % ty.block_size() as u64 != 0 {
                return Err(GgufError::Corrupt {
                    path: path.clone(),
                    what: format!(
                        "tensor '{name}' of type {ty} has rows of {} elements, not a multiple of its block size {}",
                        dims[0],
                        ty.block_size()
                    ),
                });
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Corrupt {
                    path: path.clone(),
                    what: format!("tensor '{name}' appears twice"),
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }

        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i128() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
                _ => {
                    return Err(GgufError::Corrupt {
                        path: path.clone(),
                        what: format!("general.alignment is {v}, expected a power of two"),
                    })
                }
            },
        };
        let file_len = map.len() as u64;
        let data_offset = (cur.pos as u64).div_ceil(alignment) * alignment;
        check_tensor_ranges(&path, &tensors, data_offset, alignment, file_len)?;

        Ok(Self {
            path,
            map,
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            data_offset,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Where the data section starts: the byte every tensor offset is relative to.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// All tensor records, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.req_str("general.architecture")
    }

    fn wrong_type(&self, key: &str, value: &Value, expected: &'static str) -> GgufError {
        GgufError::WrongType {
            path: self.path.clone(),
            key: key.to_string(),
            found: value.type_name(),
            expected,
        }
    }

    fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        }
    }

    /// An unsigned integer key that fits in `u32`, accepting any integer type.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get(key)
            .map(|v| {
                v.as_i128()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| self.wrong_type(key, v, "an unsigned 32-bit integer"))
            })
            .transpose()
    }

    pub fn req_u32(&self, key: &str) -> Result<u32> {
        self.get_u32(key)?.ok_or_else(|| self.missing(key))
    }

    /// A float key, accepting float and integer types.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| self.wrong_type(key, v, "a number"))
            })
            .transpose()
    }

    pub fn req_f32(&self, key: &str) -> Result<f32> {
        self.get_f32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, v, "a bool")))
            .transpose()
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.wrong_type(key, v, "a string"))
            })
            .transpose()
    }

    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .and_then(|items| items.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
                    .ok_or_else(|| self.wrong_type(key, v, "an array of strings"))
            })
            .transpose()
    }

    /// An array of numbers as `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .and_then(|items| {
                        items
                            .iter()
                            .map(|x| x.as_f64().map(|f| f as f32))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| self.wrong_type(key, v, "an array of numbers"))
            })
            .transpose()
    }

    /// An array of integers as `i64`.
    pub fn get_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .and_then(|items| {
                        items
                            .iter()
                            .map(|x| x.as_i128().and_then(|i| i64::try_from(i).ok()))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| self.wrong_type(key, v, "an array of integers"))
            })
            .transpose()
    }

    /// The record of tensor `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Tensor `name` and its bytes, if present.
    pub fn get_tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensor_info(name).map(|info| {
            let start = (self.data_offset + info.offset) as usize;
            TensorView {
                info,
                data: &self.map[start..start + info.n_bytes() as usize],
            }
        })
    }

    /// Tensor `name`, or an error naming the file and tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.get_tensor(name).ok_or_else(|| {
            let (path, tensor) = (self.path.clone(), name.to_string());
            if self.tensors.is_empty() {
                GgufError::NoTensors { path, tensor }
            } else {
                GgufError::MissingTensor { path, tensor }
            }
        })
    }

    /// Tensor `name`, checked to have exactly the shape `dims` (ggml order).
    pub fn tensor_shaped(&self, name: &str, dims: &[u64]) -> Result<TensorView<'_>> {
        let view = self.tensor(name)?;
        if view.info.dims != dims {
            return Err(GgufError::WrongShape {
                path: self.path.clone(),
                tensor: name.to_string(),
                found: view.info.dims.clone(),
                expected: dims.to_vec(),
            });
        }
        Ok(view)
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::n_bytes).sum()
    }
}

/// Checks that every tensor's bytes lie inside the data section `[data_offset, file_len)`, at
/// an aligned offset, with a byte size its type and shape give, and that no two tensors
/// overlap. All arithmetic is checked: an offset near 2^64 is an error, never a wrap-around.
fn check_tensor_ranges(
    path: &Path,
    tensors: &[TensorInfo],
    data_offset: u64,
    alignment: u64,
    file_len: u64,
) -> Result<()> {
    let corrupt = |what: String| GgufError::Corrupt {
        path: path.to_path_buf(),
        what,
    };
    let mut ranges = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if t.offset % alignment != 0 {
            return Err(corrupt(format!(
                "tensor '{}' data offset {} is not aligned to {alignment}",
                t.name, t.offset
            )));
        }
        // Rows are whole blocks (checked when the record was read), so this division is exact.
        let n_bytes = t
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .map(|n| n / t.ty.block_size() as u64)
            .and_then(|blocks| blocks.checked_mul(t.ty.block_bytes() as u64));
        let Some(n_bytes) = n_bytes else {
            return Err(corrupt(format!(
                "tensor '{}' of type {} and shape {:?} has a byte size beyond 2^64",
                t.name, t.ty, t.dims
            )));
        };
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|start| start.checked_add(n_bytes));
        match end {
            Some(end) if end <= file_len => ranges.push((t.offset, t.offset + n_bytes, i)),
            _ => {
                return Err(GgufError::Truncated {
                    path: path.to_path_buf(),
                    what: format!(
                        "data of tensor '{}' ({n_bytes} bytes at data offset {})",
                        t.name, t.offset
                    ),
                    offset: data_offset.saturating_add(t.offset),
                    file_len,
                })
            }
        }
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((a_start, a_end, a), (b_start, b_end, b)) = (pair[0], pair[1]);
        if b_start < a_end {
            return Err(corrupt(format!(
                "tensors '{}' (data bytes {a_start}..{a_end}) and '{}' (data bytes {b_start}..{b_end}) overlap",
                tensors[a].name, tensors[b].name
            )));
        }
    }
    Ok(())
}

/// A bounds-checked little-endian reader over the header.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.bytes.len() => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
                file_len: self.bytes.len() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("exact length"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Corrupt {
            path: self.path.to_path_buf(),
            what: format!("{what} is not valid UTF-8"),
        })
    }

    fn value(&mut self, type_id: u32, key: &str) -> Result<Value> {
        let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::Corrupt {
            path: self.path.to_path_buf(),
            what: format!("metadata '{key}' has unknown value type {type_id}"),
        })?;
        let what = format!("value of metadata '{key}'");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(self.u32(&what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => Value::Bool(self.array::<1>(&what)?[0] != 0),
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::U64 => Value::U64(self.u64(&what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Array => {
                let elem_id = self.u32(&what)?;
                let elem = ValueType::from_id(elem_id)
                    .filter(|t| *t != ValueType::Array)
                    .ok_or_else(|| GgufError::Corrupt {
                        path: self.path.to_path_buf(),
                        what: format!("metadata '{key}' is an array of unknown type {elem_id}"),
                    })?;
                let n = self.u64(&what)?;
                if n > (self.bytes.len() - self.pos) as u64 {
                    return Err(GgufError::Truncated {
                        path: self.path.to_path_buf(),
                        what: format!("{what} ({n} elements)"),
                        offset: self.pos as u64,
                        file_len: self.bytes.len() as u64,
                    });
                }
                let items = (0..n)
                    .map(|_| self.value(elem_id, key))
                    .collect::<Result<Vec<_>>>()?;
                Value::Array(elem, items)
            }
        })
    }
}
