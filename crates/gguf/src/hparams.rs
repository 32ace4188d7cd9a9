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

/// Default of `{arch}.full_attention_interval` (llama.cpp's): every fourth trunk layer is full
/// attention.
pub const DEFAULT_FULL_ATTENTION_INTERVAL: u32 = 4;

/// The hyper-parameters of a hybrid Gated DeltaNet model (`qwen35`, `qwen3next`): the SSM
/// (`ssm.*`) dimensions, which trunk layers are recurrent, the appended NextN / MTP blocks and
/// the multi-section RoPE split.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridParams {
    /// `{arch}.ssm.conv_kernel`: width of the causal depthwise convolution.
    pub conv_kernel: u32,
    /// `{arch}.ssm.state_size` (S): the size of a key head and of a value head.
    pub state_size: u32,
    /// `{arch}.ssm.group_count` (Hk): number of key heads.
    pub group_count: u32,
    /// `{arch}.ssm.time_step_rank` (Hv): number of value heads, each with an S×S state.
    pub time_step_rank: u32,
    /// `{arch}.ssm.inner_size`: width of all value heads (S × Hv).
    pub inner_size: u32,
    /// `{arch}.nextn_predict_layers`: NextN / MTP blocks appended after the trunk (0 if absent).
    pub nextn_predict_layers: u32,
    /// Trunk layers: `block_count - nextn_predict_layers`.
    pub n_trunk: u32,
    /// Per trunk layer, whether it is Gated DeltaNet (`true`) or full attention. From
    /// `{arch}.attention.recurrent_layers` when present, else layer `i` is recurrent iff
    /// `(i + 1) % full_attention_interval != 0`.
    pub recurrent: Vec<bool>,
    /// `{arch}.rope.dimension_sections`: the four multi-section RoPE sections (qwen35), in
    /// rotated pairs.
    pub rope_sections: Option<[u32; 4]>,
}

impl HybridParams {
    /// Reads and checks the hybrid keys of `file`, whose generic hyper-parameters are `hp`.
    pub fn from_gguf(file: &GgufFile, hp: &HParams) -> Result<Self> {
        let keys = ArchKeys::new(file)?;
        let positive = |suffix: &str| -> Result<u32> {
            match keys.req_u32(suffix)? {
                0 => Err(keys.invalid(suffix, "is 0")),
                n => Ok(n),
            }
        };
        let conv_kernel = positive("ssm.conv_kernel")?;
        let state_size = positive("ssm.state_size")?;
        let group_count = positive("ssm.group_count")?;
        let time_step_rank = positive("ssm.time_step_rank")?;
        let inner_size = positive("ssm.inner_size")?;
        if !time_step_rank.is_multiple_of(group_count) {
            return Err(keys.invalid(
                "ssm.time_step_rank",
                format!(
                    "is {time_step_rank}, which is not a multiple of ssm.group_count {group_count}"
                ),
            ));
        }
        if u64::from(inner_size) != u64::from(state_size) * u64::from(time_step_rank) {
            return Err(keys.invalid(
                "ssm.inner_size",
                format!("is {inner_size}, expected ssm.state_size {state_size} × ssm.time_step_rank {time_step_rank}"),
            ));
        }
        let nextn_predict_layers = keys.get_u32("nextn_predict_layers")?.unwrap_or(0);
        if nextn_predict_layers >= hp.block_count {
            return Err(keys.invalid(
                "nextn_predict_layers",
                format!(
                    "is {nextn_predict_layers}, expected fewer than block_count {}",
                    hp.block_count
                ),
            ));
        }
        let n_trunk = hp.block_count - nextn_predict_layers;
        let recurrent = read_recurrent_layers(&keys, hp.block_count, n_trunk)?;
        let rope_sections = match file.get_i64_array(&keys.key("rope.dimension_sections"))? {
            None => None,
            Some(values) => {
                let sections: Option<Vec<u32>> =
                    values.iter().map(|&v| u32::try_from(v).ok()).collect();
                match sections.as_deref() {
                    Some(&[a, b, c, d]) if a + b + c + d > 0 => Some([a, b, c, d]),
                    _ => {
                        return Err(keys.invalid(
                            "rope.dimension_sections",
                            format!(
                            "is {values:?}, expected four non-negative section sizes, not all 0"
                        ),
                        ))
                    }
                }
            }
        };
        Ok(Self {
            conv_kernel,
            state_size,
            group_count,
            time_step_rank,
            inner_size,
            nextn_predict_layers,
            n_trunk,
            recurrent,
            rope_sections,
        })
    }

    /// Width of all key heads (`S × Hk`); the query width is the same.
    pub fn key_dim(&self) -> u32 {
        self.state_size * self.group_count
    }

    /// Width of all value heads (`S × Hv`).
    pub fn value_dim(&self) -> u32 {
        self.inner_size
    }

    /// Channels of the convolution: the mixed query, key and value (`2 × key_dim + value_dim`).
    pub fn conv_channels(&self) -> u32 {
        2 * self.key_dim() + self.value_dim()
    }
}

fn read_recurrent_layers(keys: &ArchKeys<'_>, block_count: u32, n_trunk: u32) -> Result<Vec<bool>> {
    let suffix = "attention.recurrent_layers";
    if let Some(value) = keys.file().get(&keys.key(suffix)) {
        let flags: Option<Vec<bool>> = value.as_array().and_then(|items| {
            items
                .iter()
                .map(|v| v.as_bool().or_else(|| v.as_i128().map(|i| i != 0)))
                .collect()
        });
        return match flags {
            Some(flags) if flags.len() == block_count as usize || flags.len() == n_trunk as usize => {
                // Appended NextN blocks are attention blocks whatever the array says.
                Ok(flags[..n_trunk as usize].to_vec())
            }
            Some(flags) => Err(keys.invalid(
                suffix,
                format!("has {} entries, expected block_count {block_count} (or the {n_trunk} trunk layers)", flags.len()),
            )),
            None => Err(keys.invalid(suffix, "is not an array of booleans")),
        };
    }
    let interval = keys
        .get_u32("full_attention_interval")?
        .unwrap_or(DEFAULT_FULL_ATTENTION_INTERVAL);
    if interval == 0 {
        return Err(keys.invalid("full_attention_interval", "is 0"));
    }
    Ok((0..n_trunk).map(|i| (i + 1) % interval != 0).collect())
}

/// The mixture-of-experts FFN hyper-parameters (`qwen3next`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeParams {
    /// `{arch}.expert_count`.
    pub expert_count: u32,
    /// `{arch}.expert_used_count`: experts each token is routed to.
    pub expert_used_count: u32,
    /// `{arch}.expert_feed_forward_length`; defaults to `feed_forward_length / expert_used_count`.
    pub expert_feed_forward_length: u32,
    /// `{arch}.expert_shared_feed_forward_length`: the shared expert; defaults to
    /// `feed_forward_length`.
    pub expert_shared_feed_forward_length: u32,
    /// `{arch}.expert_weights_scale`: factor on the routing weights (0 or 1: none).
    pub expert_weights_scale: f32,
}

impl MoeParams {
    /// Reads and checks the MoE keys of `file`, whose generic hyper-parameters are `hp`.
    pub fn from_gguf(file: &GgufFile, hp: &HParams) -> Result<Self> {
        let keys = ArchKeys::new(file)?;
        let expert_count = keys.req_u32("expert_count")?;
        if expert_count == 0 {
            return Err(keys.invalid("expert_count", "is 0"));
        }
        let expert_used_count = keys.req_u32("expert_used_count")?;
        if expert_used_count == 0 || expert_used_count > expert_count {
            return Err(keys.invalid(
                "expert_used_count",
                format!("is {expert_used_count}, expected 1 ..= expert_count {expert_count}"),
            ));
        }
        let expert_feed_forward_length = match keys.get_u32("expert_feed_forward_length")? {
            Some(n) if n > 0 => n,
            _ => hp.feed_forward_length / expert_used_count,
        };
        if expert_feed_forward_length == 0 {
            return Err(keys.invalid("expert_feed_forward_length", "is 0"));
        }
        let expert_shared_feed_forward_length =
            match keys.get_u32("expert_shared_feed_forward_length")? {
                Some(n) if n > 0 => n,
                _ => hp.feed_forward_length,
            };
        let expert_weights_scale = keys.get_f32("expert_weights_scale")?.unwrap_or(0.0);
        if !expert_weights_scale.is_finite() {
            return Err(keys.invalid(
                "expert_weights_scale",
                format!("is {expert_weights_scale}, expected a finite number"),
            ));
        }
        Ok(Self {
            expert_count,
            expert_used_count,
            expert_feed_forward_length,
            expert_shared_feed_forward_length,
            expert_weights_scale,
        })
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

    fn write_hybrid(build: impl FnOnce(&mut GgufWriter)) -> (tempfile::TempDir, HParams, GgufFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hybrid.gguf");
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", "qwen35");
        w.set_u32("qwen35.context_length", 128)
            .set_u32("qwen35.embedding_length", 64)
            .set_u32("qwen35.block_count", 5)
            .set_u32("qwen35.feed_forward_length", 96)
            .set_u32("qwen35.attention.head_count", 4)
            .set_f32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
            .set_u32("qwen35.ssm.conv_kernel", 4)
            .set_u32("qwen35.ssm.state_size", 16)
            .set_u32("qwen35.ssm.group_count", 2)
            .set_u32("qwen35.ssm.time_step_rank", 4)
            .set_u32("qwen35.ssm.inner_size", 64)
            .set_u32("qwen35.nextn_predict_layers", 1)
            .set_i32_array("qwen35.rope.dimension_sections", [2, 1, 1, 0]);
        w.set_str_array("tokenizer.ggml.tokens", ["a", "b"]);
        build(&mut w);
        w.write(&path).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let hp = HParams::from_gguf(&file).unwrap();
        (dir, hp, file)
    }

    #[test]
    fn hybrid_keys_and_layer_schedule() {
        let (_dir, hp, file) = write_hybrid(|_| {});
        let h = HybridParams::from_gguf(&file, &hp).unwrap();
        assert_eq!(
            (h.conv_kernel, h.state_size, h.group_count, h.time_step_rank),
            (4, 16, 2, 4)
        );
        assert_eq!(
            (h.key_dim(), h.value_dim(), h.conv_channels()),
            (32, 64, 128)
        );
        assert_eq!((h.nextn_predict_layers, h.n_trunk), (1, 4));
        // Default interval 4: layers 0-2 recurrent, layer 3 full attention.
        assert_eq!(h.recurrent, vec![true, true, true, false]);
        assert_eq!(h.rope_sections, Some([2, 1, 1, 0]));

        let (_dir, hp, file) = write_hybrid(|w| {
            w.set_u32("qwen35.full_attention_interval", 2);
        });
        let h = HybridParams::from_gguf(&file, &hp).unwrap();
        assert_eq!(h.recurrent, vec![true, false, true, false]);

        let (_dir, hp, file) = write_hybrid(|w| {
            w.set(
                "qwen35.attention.recurrent_layers",
                crate::Value::Array(
                    crate::ValueType::Bool,
                    [true, false, false, true, true]
                        .into_iter()
                        .map(crate::Value::Bool)
                        .collect(),
                ),
            );
        });
        let h = HybridParams::from_gguf(&file, &hp).unwrap();
        assert_eq!(h.recurrent, vec![true, false, false, true]);
    }

    #[test]
    fn hybrid_errors_name_the_key() {
        for (key, value) in [
            ("qwen35.ssm.inner_size", 60u32),
            ("qwen35.ssm.time_step_rank", 3),
            ("qwen35.nextn_predict_layers", 5),
            ("qwen35.full_attention_interval", 0),
        ] {
            let (_dir, hp, file) = write_hybrid(|w| {
                w.set_u32(key, value);
            });
            let err = HybridParams::from_gguf(&file, &hp).unwrap_err().to_string();
            assert!(err.contains(&format!("'{key}'")), "{key}: {err}");
        }
        let (_dir, hp, file) = write_hybrid(|_| {});
        let err = MoeParams::from_gguf(&file, &hp).unwrap_err().to_string();
        assert!(err.contains("'qwen35.expert_count'"), "{err}");
    }

    #[test]
    fn moe_keys_and_defaults() {
        let (_dir, hp, file) = write_hybrid(|w| {
            w.set_u32("qwen35.expert_count", 8)
                .set_u32("qwen35.expert_used_count", 2);
        });
        let m = MoeParams::from_gguf(&file, &hp).unwrap();
        assert_eq!((m.expert_count, m.expert_used_count), (8, 2));
        assert_eq!(
            (
                m.expert_feed_forward_length,
                m.expert_shared_feed_forward_length
            ),
            (48, 96)
        );
        assert_eq!(m.expert_weights_scale, 0.0);
        let (_dir, hp, file) = write_hybrid(|w| {
            w.set_u32("qwen35.expert_count", 2)
                .set_u32("qwen35.expert_used_count", 3);
        });
        let err = MoeParams::from_gguf(&file, &hp).unwrap_err().to_string();
        assert!(err.contains("'qwen35.expert_used_count'"), "{err}");
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
