//! Writing GGUF models of given shapes (`specula gen-model`, the built-in default model, tests,
//! benchmark models).
//!
//! [`ModelSpec`] describes a dense `llama` or `qwen3` model; [`write_model`] fills it with
//! weights from a [`WeightSource`] (random by default) and a vocabulary, and writes it in the
//! layout llama.cpp reads. Hybrid architectures add their tensors to the same writer.

mod demo;
mod vocab;

use std::path::Path;

use anyhow::{bail, Context};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use specula_gguf::{GgmlType, GgufWriter};

pub use demo::{default_model_path, write_demo_model, CORPUS as DEFAULT_CORPUS, DEMO_DESCRIPTION};
pub use vocab::SpmVocab;

/// A dense architecture the writer can produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    Llama,
    Qwen3,
}

impl Arch {
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// The shape and storage of a dense model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub name: String,
    pub hidden: u32,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u32,
    pub context: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Storage type of the matrices (norm weights are always F32).
    pub weight_type: GgmlType,
    /// Share `token_embd` as the output projection (no `output.weight`).
    pub tied_output: bool,
    /// Vocabulary size for presets with a synthetic vocabulary (`None`: the caller's).
    pub vocab: Option<u32>,
}

/// Named shapes for `specula gen-model --preset`.
pub const PRESETS: &[(&str, &str)] = &[
    (
        "tiny-llama",
        "llama, dim 64, 2 layers, 4 heads, FFN 128 (tests)",
    ),
    (
        "tiny-qwen3",
        "qwen3, dim 64, 2 layers, 4 heads / 2 kv heads, head dim 32, FFN 128 (tests)",
    ),
    (
        "small-llama",
        "llama, dim 512, 8 layers, 8 heads / 4 kv heads, FFN 1536",
    ),
    (
        "demo",
        "the built-in default: a word-bigram model of an embedded public-domain text",
    ),
];

impl ModelSpec {
    /// A preset shape (see [`PRESETS`]); `demo` is written by [`write_demo_model`] instead.
    pub fn preset(name: &str) -> anyhow::Result<Self> {
        let base = |arch, hidden, layers, heads, kv_heads, head_dim, ffn| ModelSpec {
            arch,
            name: name.to_string(),
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn,
            context: 4096,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            weight_type: GgmlType::F32,
            tied_output: false,
            vocab: None,
        };
        Ok(match name {
            "tiny-llama" => base(Arch::Llama, 64, 2, 4, 4, 16, 128),
            "tiny-qwen3" => ModelSpec {
                rope_base: 1e6,
                rms_eps: 1e-6,
                ..base(Arch::Qwen3, 64, 2, 4, 2, 32, 128)
            },
            "small-llama" => base(Arch::Llama, 512, 8, 8, 4, 64, 1536),
            // Qwen3-0.6B's published config: hidden 1024, 28 layers, 16 query / 8 KV heads of
            // 128, intermediate 3072, vocab 151936, rope theta 1e6, rms eps 1e-6, tied.
            "qwen3-0.6b" => ModelSpec {
                context: 40960,
                rope_base: 1e6,
                rms_eps: 1e-6,
                weight_type: GgmlType::Q8_0,
                tied_output: true,
                vocab: Some(151936),
                ..base(Arch::Qwen3, 1024, 28, 16, 8, 128, 3072)
            },
            other => bail!(
                "unknown preset '{other}' (known: {})",
                PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            ),
        })
    }

    fn validate(&self) -> anyhow::Result<()> {
        let blocks = self.weight_type.block_size() as u32;
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            bail!(
                "heads ({}) must be a positive multiple of kv heads ({})",
                self.heads,
                self.kv_heads
            );
        }
        if self.arch == Arch::Llama && self.head_dim * self.heads != self.hidden {
            bail!(
                "llama needs head_dim × heads = hidden ({} × {} ≠ {})",
                self.head_dim,
                self.heads,
                self.hidden
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("head_dim ({}) must be even for RoPE", self.head_dim);
        }
        for (what, n) in [
            ("hidden", self.hidden),
            ("ffn", self.ffn),
            ("heads × head_dim", self.heads * self.head_dim),
        ] {
            if n % blocks != 0 {
                bail!(
                    "{what} ({n}) must be a multiple of {blocks} for {} weights",
                    self.weight_type
                );
            }
        }
        if !matches!(
            self.weight_type,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
        ) {
            bail!(
                "gen-model writes f32, f16, bf16 and q8_0 weights, not {}",
                self.weight_type
            );
        }
        Ok(())
    }
}

/// Where the writer gets each tensor's values: `(name, n_in, n_out)` → `n_in × n_out` values,
/// `n_out` rows of `n_in`. Norm weights are 1-D (`n_out` = 1).
pub trait WeightSource {
    fn tensor(&mut self, name: &str, n_in: usize, n_out: usize) -> Vec<f32>;
}

/// Random weights: matrices ~ N(0, 1/n_in), norm weights ~ 1 ± 0.02, a seeded generator.
pub struct RandomWeights {
    rng: ChaCha8Rng,
    /// Multiplies the output projection (peakier logits).
    pub output_scale: f32,
}

impl RandomWeights {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            output_scale: 4.0,
        }
    }

    fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        let dist = Normal::new(0.0f32, std).expect("finite std");
        (0..n).map(|_| dist.sample(&mut self.rng)).collect()
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&mut self, name: &str, n_in: usize, n_out: usize) -> Vec<f32> {
        if name.ends_with("norm.weight") {
            return self
                .normal(n_in * n_out, 0.02)
                .into_iter()
                .map(|v| 1.0 + v)
                .collect();
        }
        let mut values = self.normal(n_in * n_out, 1.0 / (n_in as f32).sqrt());
        if name == "output.weight" {
            values.iter_mut().for_each(|v| *v *= self.output_scale);
        }
        values
    }
}

/// Writes `spec` with weights from `weights` and the tokenizer `vocab` to `path`.
pub fn write_model(
    spec: &ModelSpec,
    vocab: &SpmVocab,
    weights: &mut dyn WeightSource,
    path: &Path,
) -> anyhow::Result<()> {
    spec.validate()?;
    let arch = spec.arch.gguf_name();
    let key = |k: &str| format!("{arch}.{k}");
    let (e, v) = (spec.hidden as usize, vocab.len());
    let (q_dim, kv_dim) = (
        (spec.heads * spec.head_dim) as usize,
        (spec.kv_heads * spec.head_dim) as usize,
    );

    let mut w = GgufWriter::new();
    w.set_str("general.architecture", arch)
        .set_str("general.name", &spec.name)
        .set_u32(key("context_length"), spec.context)
        .set_u32(key("embedding_length"), spec.hidden)
        .set_u32(key("block_count"), spec.layers)
        .set_u32(key("feed_forward_length"), spec.ffn)
        .set_u32(key("attention.head_count"), spec.heads)
        .set_u32(key("attention.head_count_kv"), spec.kv_heads)
        .set_u32(key("attention.key_length"), spec.head_dim)
        .set_u32(key("attention.value_length"), spec.head_dim)
        .set_f32(key("attention.layer_norm_rms_epsilon"), spec.rms_eps)
        .set_u32(key("rope.dimension_count"), spec.head_dim)
        .set_f32(key("rope.freq_base"), spec.rope_base)
        .set_u32(key("vocab_size"), v as u32);
    vocab.write_metadata(&mut w);

    let mut add = |w: &mut GgufWriter,
                   name: &str,
                   n_in: usize,
                   n_out: usize,
                   ty: GgmlType|
     -> anyhow::Result<()> {
        let values = weights.tensor(name, n_in, n_out);
        let dims: Vec<u64> = if n_out == 1 {
            vec![n_in as u64]
        } else {
            vec![n_in as u64, n_out as u64]
        };
        let data = specula_kernels::quantize(ty, &values);
        w.add_tensor(name, &dims, ty, data)?;
        Ok(())
    };
    let wt = spec.weight_type;
    add(&mut w, "token_embd.weight", e, v, wt)?;
    add(&mut w, "output_norm.weight", e, 1, GgmlType::F32)?;
    if !spec.tied_output {
        add(&mut w, "output.weight", e, v, wt)?;
    }
    for l in 0..spec.layers {
        let t = |n: &str| format!("blk.{l}.{n}.weight");
        add(&mut w, &t("attn_norm"), e, 1, GgmlType::F32)?;
        add(&mut w, &t("attn_q"), e, q_dim, wt)?;
        add(&mut w, &t("attn_k"), e, kv_dim, wt)?;
        add(&mut w, &t("attn_v"), e, kv_dim, wt)?;
        add(&mut w, &t("attn_output"), q_dim, e, wt)?;
        if spec.arch == Arch::Qwen3 {
            add(
                &mut w,
                &t("attn_q_norm"),
                spec.head_dim as usize,
                1,
                GgmlType::F32,
            )?;
            add(
                &mut w,
                &t("attn_k_norm"),
                spec.head_dim as usize,
                1,
                GgmlType::F32,
            )?;
        }
        add(&mut w, &t("ffn_norm"), e, 1, GgmlType::F32)?;
        add(&mut w, &t("ffn_gate"), e, spec.ffn as usize, wt)?;
        add(&mut w, &t("ffn_up"), e, spec.ffn as usize, wt)?;
        add(&mut w, &t("ffn_down"), spec.ffn as usize, e, wt)?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    w.write(path)?;
    Ok(())
}
