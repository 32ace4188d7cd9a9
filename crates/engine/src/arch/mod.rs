//! The architectures the backends run, and the dense decoder block the dense ones share.
//!
//! Each architecture file says what is specific to it (RoPE variant, extra tensors, FFN kind).
//! The dense pre-norm residual layout `x += attn(norm(x)); x += ffn(norm(x))` and the loading
//! of its common tensors live here; the hybrid Gated DeltaNet decoder lives in [`hybrid`].

pub mod hybrid;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;
pub mod qwen3next;

use std::path::Path;

use rayon::prelude::*;
use specula_gguf::{ArchKeys, GgufFile, HParams, RopeScaling};
use specula_kernels::{matmul, matmul_many, ops, MatmulScratch, Rope, RopeAngles, RopeMode};
use specula_plugin_api::PluginError;

use crate::blocks::attention::{self, AttentionShape};
use crate::blocks::ffn;
use crate::kv_cache::KvCache;
use crate::model::weights::{DenseDims, ModelWeights};
use crate::model::{DenseModel, Graph, LoadError};

/// Architectures whose `general.architecture` the backends accept.
pub const SUPPORTED: &str = "llama, qwen2, qwen3, qwen35, qwen3next";

/// A supported architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    /// Qwen2 / Qwen2.5: llama with q/k/v biases and NeoX RoPE.
    Qwen2,
    Qwen3,
    /// Qwen3.5 / 3.6: Gated DeltaNet hybrid, dense FFN, multi-section RoPE.
    Qwen35,
    /// Qwen3-Next: Gated DeltaNet hybrid, mixture-of-experts FFN, partial NeoX RoPE.
    Qwen3Next,
}

impl Architecture {
    /// The architecture named `name` in the file at `path`, or a clear refusal.
    pub fn from_name(name: &str, path: &Path) -> Result<Self, LoadError> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "qwen35" => Ok(Architecture::Qwen35),
            "qwen3next" => Ok(Architecture::Qwen3Next),
            other => Err(LoadError::UnknownArchitecture {
                path: path.display().to_string(),
                arch: other.to_string(),
                supported: SUPPORTED,
            }),
        }
    }

    /// The `general.architecture` name.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen35 => "qwen35",
            Architecture::Qwen3Next => "qwen3next",
        }
    }

    /// Loads the architecture's weights and block configuration.
    pub fn load(self, file: &GgufFile, hp: &HParams) -> Result<Graph, LoadError> {
        let dense = |(config, weights)| Graph::Dense(Box::new(DenseModel { config, weights }));
        match self {
            Architecture::Llama => llama::load(file, hp).map(dense),
            Architecture::Qwen2 => qwen2::load(file, hp).map(dense),
            Architecture::Qwen3 => qwen3::load(file, hp).map(dense),
            Architecture::Qwen35 => qwen35::load(file, hp).map(|m| Graph::Hybrid(Box::new(m))),
            Architecture::Qwen3Next => {
                qwen3next::load(file, hp).map(|m| Graph::Hybrid(Box::new(m)))
            }
        }
    }
}

/// How the dense decoder blocks of a model compute.
#[derive(Debug, Clone)]
pub struct DenseConfig {
    pub n_embd: usize,
    pub n_ff: usize,
    pub attention: AttentionShape,
    pub rms_eps: f32,
    pub rope: Rope,
    /// Per-head RMSNorm of queries and keys before RoPE (qwen3).
    pub qk_norm: bool,
    /// Biases added to the query, key and value projections (qwen2).
    pub qkv_bias: bool,
}

/// The per-architecture choices of a dense decoder.
#[derive(Debug, Clone, Copy)]
pub struct DenseVariant {
    pub rope_mode: RopeMode,
    pub qk_norm: bool,
    /// `attn_q.bias`, `attn_k.bias` and `attn_v.bias` (required then, refused otherwise).
    pub qkv_bias: bool,
}

/// Loads a dense decoder-only model (llama layout, plus the variant's extras), refusing
/// what the dense path does not implement rather than computing something else.
pub fn load_dense(
    file: &GgufFile,
    hp: &HParams,
    variant: DenseVariant,
) -> Result<(DenseConfig, ModelWeights), LoadError> {
    let path = file.path().display().to_string();
    let unsupported = |what: String| LoadError::Unsupported {
        path: path.clone(),
        what,
    };
    let keys = ArchKeys::new(file)?;
    if let Some(n) = keys.get_u32("expert_count")?.filter(|&n| n > 0) {
        return Err(unsupported(format!(
            "a mixture-of-experts FFN ('{}' = {n})",
            keys.key("expert_count")
        )));
    }
    let allowed_bias = |name: &str| {
        variant.qkv_bias
            && [".attn_q.bias", ".attn_k.bias", ".attn_v.bias"]
                .iter()
                .any(|suffix| name.ends_with(suffix))
    };
    if let Some(t) = file
        .tensors()
        .iter()
        .find(|t| t.name.starts_with("blk.") && t.name.ends_with(".bias") && !allowed_bias(&t.name))
    {
        return Err(unsupported(format!("bias tensor '{}'", t.name)));
    }
    let freq_scale = match &hp.rope_scaling {
        RopeScaling::None => 1.0,
        RopeScaling::Linear { factor } => 1.0 / factor,
        RopeScaling::Other { kind, .. } => {
            return Err(unsupported(format!("RoPE scaling '{kind}'")));
        }
    };
    let u = |v: u32| v as usize;
    let attention = AttentionShape {
        n_head: u(hp.head_count),
        n_head_kv: u(hp.head_count_kv),
        head_dim: u(hp.key_length),
        value_dim: u(hp.value_length),
    };
    let dims = DenseDims {
        n_embd: u(hp.embedding_length),
        n_ff: u(hp.feed_forward_length),
        q_width: u(hp.q_width()),
        k_width: u(hp.k_width()),
        v_width: u(hp.v_width()),
        attn_out_width: attention.n_head * attention.value_dim,
        head_dim: attention.head_dim,
    };
    let n_rot = u(hp.rope_dimension_count);
    let weights = ModelWeights::load_dense(
        file,
        u(hp.block_count),
        u(hp.vocab_size),
        n_rot,
        &dims,
        variant,
    )?;
    let config = DenseConfig {
        n_embd: dims.n_embd,
        n_ff: dims.n_ff,
        attention,
        rms_eps: hp.rms_norm_eps,
        rope: Rope {
            mode: variant.rope_mode,
            n_rot,
            freq_base: hp.rope_freq_base,
            freq_scale,
            freq_factors: weights.rope_freqs.clone(),
        },
        qk_norm: variant.qk_norm,
        qkv_bias: variant.qkv_bias,
    };
    Ok((config, weights))
}

/// Preallocated buffers of a forward pass, sized for `batch_rows` rows.
#[derive(Debug)]
pub struct Scratch {
    /// Residual stream, `rows × n_embd`.
    pub x: Vec<f32>,
    /// Normalised rows, `rows × n_embd`.
    pub xn: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Attention output, `rows × n_head × value_dim`.
    pub attn: Vec<f32>,
    /// Output of a projection back to `n_embd` (attention output, FFN down), `rows × n_embd`.
    pub proj: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// Attention buffers.
    pub attention: attention::AttentionScratch,
    /// RoPE angles of the rows' positions, shared by every layer.
    pub rope_angles: RopeAngles,
    pub matmul: MatmulScratch,
}

impl Scratch {
    pub fn new(config: &DenseConfig, rows: usize, n_ctx: usize) -> Self {
        let shape = &config.attention;
        Self {
            x: vec![0.0; rows * config.n_embd],
            xn: vec![0.0; rows * config.n_embd],
            q: vec![0.0; rows * shape.q_width()],
            k: vec![0.0; rows * shape.k_width()],
            v: vec![0.0; rows * shape.v_width()],
            attn: vec![0.0; rows * shape.out_width()],
            proj: vec![0.0; rows * config.n_embd],
            gate: vec![0.0; rows * config.n_ff],
            up: vec![0.0; rows * config.n_ff],
            attention: attention::AttentionScratch::new(shape, n_ctx),
            rope_angles: RopeAngles::new(&config.rope, rows),
            matmul: MatmulScratch::new(),
        }
    }
}

/// Runs dense block `layer_index` of `model` (weights in `file`) over the `n` rows in `scratch.x` (tokens at positions
/// `pos0 ..`), updating the residual stream in place and writing the rows' keys and values
/// into the cache.
///
/// Every row goes through exactly the computation a single-row call would do: the mat-vecs
/// compute each output independently of the batch, and row `i` attends to positions
/// `0 ..= pos0 + i` in order.
pub fn forward_dense_layer(
    file: &GgufFile,
    model: &DenseModel,
    layer_index: usize,
    n: usize,
    pos0: usize,
    scratch: &mut Scratch,
    kv: &mut KvCache,
) -> Result<(), PluginError> {
    let config = &model.config;
    let layer = &model.weights.layers[layer_index];
    let e = config.n_embd;
    let shape = &config.attention;
    let (qw, kw, vw) = (shape.q_width(), shape.k_width(), shape.v_width());
    let ow = shape.out_width();
    let s = scratch;

    // Attention: norm, projections, per-row q/k norm + RoPE, cache write, then attention.
    for (x, xn) in s.x[..n * e].chunks_exact(e).zip(s.xn.chunks_exact_mut(e)) {
        ops::rms_norm(x, &layer.attn_norm, config.rms_eps, xn);
    }
    matmul_many(
        &[
            &layer.attn_q.view(file)?,
            &layer.attn_k.view(file)?,
            &layer.attn_v.view(file)?,
        ],
        &s.xn[..n * e],
        &mut [&mut s.q[..n * qw], &mut s.k[..n * kw], &mut s.v[..n * vw]],
        &mut s.matmul,
    );
    if let Some(bias) = &layer.qkv_bias {
        add_row_bias(&mut s.q[..n * qw], &bias.q);
        add_row_bias(&mut s.k[..n * kw], &bias.k);
        add_row_bias(&mut s.v[..n * vw], &bias.v);
    }
    s.rope_angles.cover(&config.rope, pos0, n);
    let angles = &s.rope_angles;
    let prepare = |(i, (q, k)): (usize, (&mut [f32], &mut [f32]))| {
        attention::prepare_query_key(
            &config.rope,
            shape.head_dim,
            config.rms_eps,
            layer.attn_q_norm.as_deref(),
            layer.attn_k_norm.as_deref(),
            angles.row(i),
            q,
            k,
        );
    };
    // Rows on the pool's threads (a single row stays on this one).
    s.q[..n * qw]
        .par_chunks_mut(qw)
        .zip(s.k[..n * kw].par_chunks_mut(kw))
        .enumerate()
        .for_each(prepare);
    kv.store(layer_index, pos0, &s.k[..n * kw], &s.v[..n * vw]);
    attention::attend_rows(
        shape,
        &s.q[..n * qw],
        pos0 + 1,
        kv.keys(layer_index, pos0 + n),
        kv.values(layer_index, pos0 + n),
        &mut s.attention,
        &mut s.attn[..n * ow],
    );
    matmul(
        &layer.attn_output.view(file)?,
        &s.attn[..n * ow],
        &mut s.proj[..n * e],
        &mut s.matmul,
    );
    ops::add_in_place(&mut s.x[..n * e], &s.proj[..n * e]);

    // Feed-forward.
    for (x, xn) in s.x[..n * e].chunks_exact(e).zip(s.xn.chunks_exact_mut(e)) {
        ops::rms_norm(x, &layer.ffn_norm, config.rms_eps, xn);
    }
    ffn::swiglu(
        &ffn::FfnWeights {
            gate: layer.ffn_gate.view(file)?,
            up: layer.ffn_up.view(file)?,
            down: layer.ffn_down.view(file)?,
        },
        &s.xn[..n * e],
        &mut s.gate[..n * config.n_ff],
        &mut s.up[..n * config.n_ff],
        &mut s.proj[..n * e],
        &mut s.matmul,
    );
    ops::add_in_place(&mut s.x[..n * e], &s.proj[..n * e]);
    Ok(())
}

/// Adds `bias` to every row of `rows` (rows of `bias.len()` values).
fn add_row_bias(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_exact_mut(bias.len()) {
        ops::add_in_place(row, bias);
    }
}
