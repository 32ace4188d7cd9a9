//! GGUF v3 files: zero-copy reading over a memory map, writing, and the ggml tensor types.
//!
//! Shared by the host (tokenizer metadata, `gen-model`) and every backend plugin (weights).
//! Errors always name the file and what was expected.

mod error;
pub mod hparams;
mod reader;
mod types;
mod value;
mod writer;

pub use error::{GgufError, Result};
pub use hparams::{ArchKeys, HParams, HybridParams, MoeParams, RopeScaling};
pub use reader::{GgufFile, TensorInfo, TensorView, DEFAULT_ALIGNMENT, MAGIC};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::GgufWriter;
