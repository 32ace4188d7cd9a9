//! The dense decoder shared by `llama`, `qwen2` and `qwen3`: its weights (token embedding,
//! one block of grouped-query attention and a SwiGLU FFN per layer, final norm, LM head) and
//! how they are loaded. The architecture files hold the graphs and choose what differs in
//! loading ([`DenseVariant`]): RoPE, per-head q/k norms, q/k/v biases.

use specula_gguf::{ArchKeys, GgufFile, HParams, RopeScaling};
use specula_kernels::{Rope, RopeMode};

use crate::blocks::attention::AttentionShape;
use crate::blocks::ffn::SwiGlu;
use crate::graph::KvSlot;
use crate::model::weights::{load_optional_vector, load_vector, MatrixRef, Vector};
use crate::model::LoadError;

/// A dense decoder: its block configuration and weights.
#[derive(Debug, Clone)]
pub struct DenseModel {
    pub config: DenseConfig,
    pub weights: DenseWeights,
}

/// The dimensions and settings of a dense decoder.
#[derive(Debug, Clone)]
pub struct DenseConfig {
    pub n_embd: usize,
    pub n_ff: usize,
    pub attention: AttentionShape,
    pub rms_eps: f32,
    pub rope: Rope,
}

/// What an architecture file chooses for loading a dense decoder.
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
) -> Result<DenseModel, LoadError> {
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
    let weights = DenseWeights::load(
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
            freq_factors: weights.rope_freqs.as_ref().map(|f| f.values.clone()),
        },
    };
    Ok(DenseModel { config, weights })
}

/// The weights of one dense decoder block.
#[derive(Debug, Clone)]
pub struct DenseLayer {
    /// The layer's attention cache.
    pub kv: KvSlot,
    pub attn_norm: Vector,
    pub attn_q: MatrixRef,
    pub attn_k: MatrixRef,
    pub attn_v: MatrixRef,
    pub attn_output: MatrixRef,
    /// Per-head RMSNorm of queries (qwen3), `key_length` values.
    pub attn_q_norm: Option<Vector>,
    /// Per-head RMSNorm of keys (qwen3), `key_length` values.
    pub attn_k_norm: Option<Vector>,
    /// Biases of the q, k and v projections (qwen2).
    pub qkv_bias: Option<QkvBias>,
    pub ffn_norm: Vector,
    pub ffn: SwiGlu,
}

impl DenseLayer {
    /// Every weight matrix of the block.
    pub fn matrices(&self) -> [&MatrixRef; 7] {
        [
            &self.attn_q,
            &self.attn_k,
            &self.attn_v,
            &self.attn_output,
            &self.ffn.gate,
            &self.ffn.up,
            &self.ffn.down,
        ]
    }

    /// Every weight matrix of the block, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> [&mut MatrixRef; 7] {
        [
            &mut self.attn_q,
            &mut self.attn_k,
            &mut self.attn_v,
            &mut self.attn_output,
            &mut self.ffn.gate,
            &mut self.ffn.up,
            &mut self.ffn.down,
        ]
    }

    /// Bytes of weights the block reads per token (matrices and norm vectors).
    pub fn bytes_per_token(&self) -> u64 {
        let vectors = self.attn_norm.len()
            + self.ffn_norm.len()
            + self.attn_q_norm.as_ref().map_or(0, |v| v.len())
            + self.attn_k_norm.as_ref().map_or(0, |v| v.len())
            + self
                .qkv_bias
                .as_ref()
                .map_or(0, |b| b.q.len() + b.k.len() + b.v.len());
        self.matrices().iter().map(|m| m.n_bytes()).sum::<u64>() + 4 * vectors as u64
    }
}

/// Biases added to the query, key and value projections' outputs (one value per output).
#[derive(Debug, Clone)]
pub struct QkvBias {
    pub q: Vector,
    pub k: Vector,
    pub v: Vector,
}

/// Dimensions a dense decoder block's tensors are checked against.
#[derive(Debug, Clone, Copy)]
pub struct DenseDims {
    pub n_embd: usize,
    pub n_ff: usize,
    pub q_width: usize,
    pub k_width: usize,
    pub v_width: usize,
    /// Output width of the attention heads (`H * value_length`), the input of `attn_output`.
    pub attn_out_width: usize,
    pub head_dim: usize,
}

/// Loads block `layer` of a dense model; `variant` says whether the per-head q/k norms and
/// the q/k/v biases are part of the architecture (then they are required).
pub fn load_dense_layer(
    file: &GgufFile,
    layer: usize,
    d: &DenseDims,
    variant: DenseVariant,
) -> Result<DenseLayer, LoadError> {
    let qk_norm = variant.qk_norm;
    let name = |t: &str| format!("blk.{layer}.{t}.weight");
    let bias = |t: &str, len| load_vector(file, &format!("blk.{layer}.{t}.bias"), len);
    let qkv_bias = if variant.qkv_bias {
        Some(QkvBias {
            q: bias("attn_q", d.q_width)?,
            k: bias("attn_k", d.k_width)?,
            v: bias("attn_v", d.v_width)?,
        })
    } else {
        None
    };
    let matrix = |t: &str, rows, cols| MatrixRef::load(file, &name(t), rows, cols);
    let head_norm = |t: &str| -> Result<Option<Vector>, LoadError> {
        if qk_norm {
            load_vector(file, &name(t), d.head_dim).map(Some)
        } else {
            Ok(None)
        }
    };
    Ok(DenseLayer {
        kv: KvSlot::trunk(layer),
        attn_norm: load_vector(file, &name("attn_norm"), d.n_embd)?,
        attn_q: matrix("attn_q", d.q_width, d.n_embd)?,
        attn_k: matrix("attn_k", d.k_width, d.n_embd)?,
        attn_v: matrix("attn_v", d.v_width, d.n_embd)?,
        attn_output: matrix("attn_output", d.n_embd, d.attn_out_width)?,
        attn_q_norm: head_norm("attn_q_norm")?,
        attn_k_norm: head_norm("attn_k_norm")?,
        qkv_bias,
        ffn_norm: load_vector(file, &name("ffn_norm"), d.n_embd)?,
        ffn: SwiGlu::load(file, layer, d.n_embd, d.n_ff)?,
    })
}

/// All weights of a dense model.
#[derive(Debug, Clone)]
pub struct DenseWeights {
    /// `token_embd.weight`: `vocab` rows of `n_embd`.
    pub token_embd: MatrixRef,
    pub output_norm: Vector,
    /// `output.weight`, or `token_embd.weight` again when the file has none (tied embeddings).
    pub output: MatrixRef,
    pub tied_output: bool,
    /// `rope_freqs.weight` (per-pair frequency divisors), when present.
    pub rope_freqs: Option<Vector>,
    pub layers: Vec<DenseLayer>,
}

impl DenseWeights {
    /// Loads the embedding, output and every block.
    pub fn load(
        file: &GgufFile,
        n_layers: usize,
        n_vocab: usize,
        n_rot: usize,
        dims: &DenseDims,
        variant: DenseVariant,
    ) -> Result<Self, LoadError> {
        let token_embd = MatrixRef::load(file, "token_embd.weight", n_vocab, dims.n_embd)?;
        let (output, tied_output) = match file.tensor_info("output.weight") {
            Some(_) => (
                MatrixRef::load(file, "output.weight", n_vocab, dims.n_embd)?,
                false,
            ),
            None => (token_embd.clone(), true),
        };
        let layers = (0..n_layers)
            .map(|i| load_dense_layer(file, i, dims, variant))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            output_norm: load_vector(file, "output_norm.weight", dims.n_embd)?,
            rope_freqs: load_optional_vector(file, "rope_freqs.weight", n_rot / 2)?,
            token_embd,
            output,
            tied_output,
            layers,
        })
    }

    /// Bytes of weights read per evaluated token: every block, the final norm, the output
    /// matrix, and one row of the embedding (all of it when tied, counted once as output).
    pub fn bytes_per_token(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(DenseLayer::bytes_per_token).sum();
        let embedding_row = if self.tied_output {
            0
        } else {
            self.token_embd.row_bytes()
        };
        layers + 4 * self.output_norm.len() as u64 + self.output.n_bytes() + embedding_row
    }
}
