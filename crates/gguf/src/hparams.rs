//! Model hyper-parameters, read from the `{arch}.`-prefixed GGUF keys.
//!
//! [`HParams::from_gguf`] reads what every decoder-only transformer has (the llama / qwen3
//! key set). Keys are read through [`ArchKeys`], which adds the architecture prefix and makes
//! every error name the file and the full key, so architecture-specific groups (the hybrid
//! `ssm.*`, `full_attention_interval`, `nextn_predict_layers`, `expert_*` keys) can be read the
//! same way into their own structs next to this one.

use crate::error::{GgufError, Result};
use crate::reader::GgufFile;

/// Reads `{arch}.{suffix}` keys of one file.
#[derive(Debug, Clone, Copy)]
pub struct ArchKeys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl<'a> ArchKeys<'a> {
    /// Keys of `file` under its own `general.architecture`.
    pub fn new(file: &'a GgufFile) -> Result<Self> {
        Ok(Self {
            file,
            arch: file.architecture()?,
        })
    }

    /// The architecture prefix.
    pub fn arch(&self) -> &'a str {
        self.arch
    }

    /// The file the keys come from.
    pub fn file(&self) -> &'a GgufFile {
        self.file
    }

    /// The full key name `{arch}.{suffix}`.
    pub fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub fn get_u32(&self, suffix: &str) -> Result<Option<u32>> {
        self.file.get_u32(&self.key(suffix))
    }

    pub fn req_u32(&self, suffix: &str) -> Result<u32> {
        self.file.req_u32(&self.key(suffix))
    }

    pub fn get_f32(&self, suffix: &str) -> Result<Option<f32>> {
        self.file.get_f32(&self.key(suffix))
    }

    pub fn req_f32(&self, suffix: &str) -> Result<f32> {
        self.file.req_f32(&self.key(suffix))
    }

    pub fn get_str(&self, suffix: &str) -> Result<Option<&'a str>> {
        self.file.get_str(&self.key(suffix))
    }

    pub fn get_bool(&self, suffix: &str) -> Result<Option<bool>> {
        self.file.get_bool(&self.key(suffix))
    }

    /// An error saying that key `{arch}.{suffix}` has an unusable value.
    pub fn invalid(&self, suffix: &str, why: impl std::fmt::Display) -> GgufError {
        GgufError::Corrupt {
            path: self.file.path().to_path_buf(),
            what: format!("metadata key '{}' {why}", self.key(suffix)),
        }
    }
}

/// How positions are scaled before RoPE (`{arch}.rope.scaling.*`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No scaling (absent, or type `none`).
    None,
    /// Positions divided by `factor` (type `linear`).
    Linear { factor: f32 },
    /// A scheme named by `rope.scaling.type` that callers must support or refuse
    /// (`yarn`, `longrope`, ...).
    Other { kind: String, factor: f32 },
}

/// The hyper-parameters every decoder-only transformer in a GGUF file has.
#[derive(Debug, Clone, PartialEq)]
pub struct HParams {
    /// `general.architecture`.
    pub architecture: String,
    /// `{arch}.context_length`: the context the model was trained for.
    pub context_length: u32,
    /// `{arch}.embedding_length` (E, the hidden size).
    pub embedding_length: u32,
    /// `{arch}.block_count`: number of blocks, including any appended MTP/NextN blocks.
    pub block_count: u32,
    /// `{arch}.feed_forward_length`.
    pub feed_forward_length: u32,
    /// `{arch}.attention.head_count` (H).
    pub head_count: u32,
    /// `{arch}.attention.head_count_kv`; defaults to H (no grouped-query attention).
    pub head_count_kv: u32,
    /// `{arch}.attention.key_length`: size of a query/key head; defaults to E / H.
    pub key_length: u32,
    /// `{arch}.attention.value_length`: size of a value head; defaults to E / H.
    pub value_length: u32,
    /// `{arch}.attention.layer_norm_rms_epsilon`.
    pub rms_norm_eps: f32,
    /// `{arch}.rope.dimension_count`: rotated dimensions per head; defaults to `key_length`.
    pub rope_dimension_count: u32,
    /// `{arch}.rope.freq_base`; defaults to 10000.
    pub rope_freq_base: f32,
    /// `{arch}.rope.scaling.type` / `.factor` (or the older `rope.scale_linear`).
    pub rope_scaling: RopeScaling,
    /// Number of tokens: the length of `tokenizer.ggml.tokens`, else the rows of
    /// `token_embd.weight`, else `{arch}.vocab_size`.
    pub vocab_size: u32,
}

/// Default of `{arch}.rope.freq_base` (llama.cpp's).
pub const DEFAULT_ROPE_FREQ_BASE: f32 = 10_000.0;

impl HParams {
    /// Reads and checks the hyper-parameters of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let keys = ArchKeys::new(file)?;
        let positive = |suffix: &str, value: u32| {
            if value == 0 {
                Err(keys.invalid(suffix, "is 0"))
            } else {
                Ok(value)
            }
        };
        let context_length = positive("context_length", keys.req_u32("context_length")?)?;
        let embedding_length = positive("embedding_length", keys.req_u32("embedding_length")?)?;
        let block_count = positive("block_count", keys.req_u32("block_count")?)?;
        let feed_forward_length = keys.req_u32("feed_forward_length")?;
        let head_count = positive(
            "attention.head_count",
            keys.req_u32("attention.head_count")?,
        )?;
        let head_count_kv = match keys.get_u32("attention.head_count_kv")? {
            Some(n) => positive("attention.head_count_kv", n)?,
            None => head_count,
        };
        if !head_count.is_multiple_of(head_count_kv) {
            return Err(keys.invalid(
                "attention.head_count_kv",
                format!(
                    "is {head_count_kv}, which does not divide attention.head_count {head_count}"
                ),
            ));
        }
        // E / H when it divides evenly: the default size of a query/key and of a value head.
        let default_head = embedding_length
            .is_multiple_of(head_count)
            .then_some(embedding_length / head_count);
        let head_size = |suffix: &str| -> Result<u32> {
            match keys.get_u32(suffix)? {
                Some(n) => positive(suffix, n),
                None => default_head.ok_or_else(|| {
                    keys.invalid(
                        "attention.head_count",
                        format!(
                            "is {head_count}, which does not divide embedding_length {embedding_length} (and '{}' is absent)",
                            keys.key(suffix)
                        ),
                    )
                }),
            }
        };
        let key_length = head_size("attention.key_length")?;
        let value_length = head_size("attention.value_length")?;
        let rms_norm_eps = keys.req_f32("attention.layer_norm_rms_epsilon")?;
        if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
            return Err(keys.invalid(
                "attention.layer_norm_rms_epsilon",
                format!("is {rms_norm_eps}, expected a small non-negative number"),
            ));
        }
        let rope_dimension_count = keys.get_u32("rope.dimension_count")?.unwrap_or(key_length);
        if !rope_dimension_count.is_multiple_of(2) || rope_dimension_count > key_length {
            return Err(keys.invalid(
                "rope.dimension_count",
                format!("is {rope_dimension_count}, expected an even number of at most the head size {key_length}"),
            ));
        }
        let rope_freq_base = keys
            .get_f32("rope.freq_base")?
            .unwrap_or(DEFAULT_ROPE_FREQ_BASE);
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(keys.invalid(
                "rope.freq_base",
                format!("is {rope_freq_base}, expected a positive number"),
            ));
        }
        let rope_scaling = read_rope_scaling(&keys)?;
        let vocab_size = read_vocab_size(&keys)?;
        Ok(Self {
            architecture: keys.arch().to_string(),
            context_length,
            embedding_length,
            block_count,
            feed_forward_length,
            head_count,
            head_count_kv,
            key_length,
            value_length,
            rms_norm_eps,
            rope_dimension_count,
            rope_freq_base,
            rope_scaling,
            vocab_size,
        })
    }

    /// Query heads per key/value head.
    pub fn gqa_group(&self) -> u32 {
        self.head_count / self.head_count_kv
    }

    /// Width of all query heads (`H * key_length`).
    pub fn q_width(&self) -> u32 {
        self.head_count * self.key_length
    }

    /// Width of all key heads (`Hkv * key_length`).
    pub fn k_width(&self) -> u32 {
        self.head_count_kv * self.key_length
    }

    /// Width of all value heads (`Hkv * value_length`).
    pub fn v_width(&self) -> u32 {
        self.head_count_kv * self.value_length
    }
}

fn read_rope_scaling(keys: &ArchKeys<'_>) -> Result<RopeScaling> {
    let factor = keys.get_f32("rope.scaling.factor")?;
    let kind = keys.get_str("rope.scaling.type")?;
    let check = |factor: f32, suffix: &str| {
        if factor.is_finite() && factor > 0.0 {
            Ok(factor)
        } else {
            Err(keys.invalid(suffix, format!("is {factor}, expected a positive number")))
        }
    };
    match kind {
        None | Some("none") => match keys.get_f32("rope.scale_linear")? {
            Some(f) if f != 1.0 => Ok(RopeScaling::Linear {
                factor: check(f, "rope.scale_linear")?,
            }),
            _ => Ok(RopeScaling::None),
        },
        Some("linear") => match factor {
            Some(f) if f != 1.0 => Ok(RopeScaling::Linear {
                factor: check(f, "rope.scaling.factor")?,
            }),
            _ => Ok(RopeScaling::None),
        },
        Some(other) => Ok(RopeScaling::Other {
            kind: other.to_string(),
            factor: factor.unwrap_or(1.0),
        }),
    }
}

fn read_vocab_size(keys: &ArchKeys<'_>) -> Result<u32> {
    let file = keys.file();
    let to_u32 = |n: usize, what: &str| {
        u32::try_from(n).map_err(|_| GgufError::Corrupt {
            path: file.path().to_path_buf(),
            what: format!("{what} has {n} entries, more than Specula supports"),
        })
    };
    if let Some(tokens) = file.get("tokenizer.ggml.tokens") {
        let n = tokens.as_array().ok_or_else(|| GgufError::WrongType {
            path: file.path().to_path_buf(),
            key: "tokenizer.ggml.tokens".to_string(),
            found: tokens.type_name(),
            expected: "an array of strings",
        })?;
        if !n.is_empty() {
            return to_u32(n.len(), "tokenizer.ggml.tokens");
        }
    }
    if let Some(info) = file.tensor_info("token_embd.weight") {
        if info.dims.len() == 2 {
            return to_u32(info.dims[1] as usize, "token_embd.weight");
        }
    }
    match keys.get_u32("vocab_size")? {
        Some(n) if n > 0 => Ok(n),
        _ => Err(GgufError::MissingKey {
            path: file.path().to_path_buf(),
            key: "tokenizer.ggml.tokens (or a token_embd.weight tensor, or {arch}.vocab_size)"
                .replace("{arch}", keys.arch()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgufWriter;
    use std::path::Path;

    fn write(build: impl FnOnce(&mut GgufWriter)) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", "llama");
        w.set_u32("llama.context_length", 128)
            .set_u32("llama.embedding_length", 64)
            .set_u32("llama.block_count", 2)
            .set_u32("llama.feed_forward_length", 96)
            .set_u32("llama.attention.head_count", 8)
            .set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
        w.set_str_array("tokenizer.ggml.tokens", ["a", "b", "c"]);
        build(&mut w);
        w.write(&path).unwrap();
        (dir, path)
    }

    #[test]
    fn defaults_follow_llama_cpp() {
        let (_dir, path) = write(|_| {});
        let hp = HParams::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(hp.architecture, "llama");
        assert_eq!(hp.head_count_kv, 8);
        assert_eq!((hp.key_length, hp.value_length), (8, 8));
        assert_eq!(hp.rope_dimension_count, 8);
        assert_eq!(hp.rope_freq_base, 10_000.0);
        assert_eq!(hp.rope_scaling, RopeScaling::None);
        assert_eq!(hp.vocab_size, 3);
        assert_eq!((hp.gqa_group(), hp.q_width(), hp.k_width()), (1, 64, 64));
    }

    #[test]
    fn explicit_keys_win() {
        let (_dir, path) = write(|w| {
            w.set_u32("llama.attention.head_count_kv", 2)
                .set_u32("llama.attention.key_length", 32)
                .set_u32("llama.attention.value_length", 16)
                .set_u32("llama.rope.dimension_count", 16)
                .set_f32("llama.rope.freq_base", 1e6)
                .set_str("llama.rope.scaling.type", "linear")
                .set_f32("llama.rope.scaling.factor", 4.0);
        });
        let hp = HParams::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(
            (hp.head_count_kv, hp.key_length, hp.value_length),
            (2, 32, 16)
        );
        assert_eq!((hp.q_width(), hp.k_width(), hp.v_width()), (256, 64, 32));
        assert_eq!(hp.rope_dimension_count, 16);
        assert_eq!(hp.rope_freq_base, 1e6);
        assert_eq!(hp.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let (_dir, path) = write(|w| {
            w.set(
                "llama.attention.head_count",
                crate::Value::String("8".into()),
            );
        });
        let err = HParams::from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.gguf") && err.contains("'llama.attention.head_count'"),
            "{err}"
        );

        let (_dir, path) = write(|w| {
            w.set_u32("llama.attention.head_count_kv", 3);
        });
        let err = HParams::from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.gguf") && err.contains("'llama.attention.head_count_kv'"),
            "{err}"
        );

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bare.gguf");
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", "qwen3")
            .set_u32("qwen3.context_length", 8);
        w.write(&path).unwrap();
        let err = HParams::from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bare.gguf") && err.contains("'qwen3.embedding_length'"),
            "{err}"
        );
    }

    #[test]
    fn reads_stories260k() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf");
        if !path.exists() {
            eprintln!("skipping: {} not found", path.display());
            return;
        }
        let hp = HParams::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(
            (
                hp.context_length,
                hp.embedding_length,
                hp.block_count,
                hp.feed_forward_length
            ),
            (2048, 64, 5, 172)
        );
        assert_eq!(
            (
                hp.head_count,
                hp.head_count_kv,
                hp.key_length,
                hp.rope_dimension_count
            ),
            (8, 4, 8, 8)
        );
        assert_eq!(
            (hp.rms_norm_eps, hp.rope_freq_base, hp.vocab_size),
            (1e-5, 10_000.0, 512)
        );
    }
}
