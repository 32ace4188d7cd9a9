//! The weights of the hybrid family (`qwen35`, `qwen3next`): Gated DeltaNet layers and gated
//! full-attention layers in the schedule of the file, each followed by an FFN, and an optional
//! NextN / MTP block after the trunk — and how they are loaded.
//!
//! The architecture files hold the graphs and choose what differs in loading
//! ([`HybridVariant`]): RoPE, how value heads map to key heads, how beta/alpha are stored, and
//! the FFN kind.

use specula_gguf::{GgufFile, HParams, HybridParams, MoeParams, RopeScaling};
use specula_kernels::{Rope, RopeMode, RopeSections};

use super::nextn::MtpWeights;
use crate::blocks::attention::{AttentionShape, GatedAttentionWeights};
use crate::blocks::ffn::{FfnBlock, FfnShape};
use crate::blocks::gdn::{BetaAlphaLayout, GdnShape, GdnWeights, HeadMap};
use crate::blocks::moe::MoeShape;
use crate::graph::KvSlot;
use crate::model::weights::{load_vector, MatrixRef, Vector};
use crate::model::LoadError;

/// The RoPE of a hybrid architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HybridRope {
    /// Multi-section RoPE from `rope.dimension_sections` (required key); `interleaved` selects
    /// IMROPE.
    MultiSection { interleaved: bool },
    /// NeoX rotation of the first `rope.dimension_count` dimensions of each head.
    NeoX,
}

/// What an architecture file chooses for the hybrid decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HybridVariant {
    pub rope: HybridRope,
    pub head_map: HeadMap,
    pub beta_alpha: BetaAlphaLayout,
    /// Mixture-of-experts FFN (with `expert_*` keys) instead of dense SwiGLU.
    pub moe: bool,
}

/// Dimensions and settings of a hybrid model.
#[derive(Debug, Clone)]
pub struct HybridConfig {
    pub n_embd: usize,
    pub n_vocab: usize,
    pub rms_eps: f32,
    /// The full-attention layers (and the MTP block).
    pub attention: AttentionShape,
    pub rope: Rope,
    pub gdn: GdnShape,
    pub ffn: FfnShape,
    /// Trunk layers that are GDN.
    pub n_gdn_layers: usize,
    /// Trunk layers that are full attention.
    pub n_attention_layers: usize,
}

/// The token mixer of a layer, with where it keeps its state.
#[derive(Debug, Clone)]
pub enum Mixer {
    /// A Gated DeltaNet layer; `ring` is its index among the model's GDN layers (its section
    /// of the snapshot ring).
    Gdn { ring: usize, weights: GdnWeights },
    /// A gated full-attention layer and its cache.
    Attention {
        kv: KvSlot,
        weights: GatedAttentionWeights,
    },
}

impl Mixer {
    /// Every weight matrix of the mixer, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        match self {
            Mixer::Gdn { weights, .. } => weights.matrices_mut(),
            Mixer::Attention { weights, .. } => weights.matrices_mut().into(),
        }
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self) -> u64 {
        match self {
            Mixer::Gdn { weights, .. } => weights.bytes_per_token(),
            Mixer::Attention { weights, .. } => weights.bytes_per_token(),
        }
    }
}

/// One layer of the hybrid decoder (a trunk layer, or the MTP head's decoder block).
#[derive(Debug, Clone)]
pub struct HybridLayer {
    pub attn_norm: Vector,
    pub post_attention_norm: Vector,
    pub mixer: Mixer,
    pub ffn: FfnBlock,
}

impl HybridLayer {
    /// Every weight matrix of the layer, mutably (to interleave them); not the stacked MoE
    /// experts.
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        let mut out = self.mixer.matrices_mut();
        out.extend(self.ffn.matrices_mut());
        out
    }

    /// Bytes of weights read per token (with `n_used` experts of an MoE FFN).
    pub fn bytes_per_token(&self, ffn: &FfnShape) -> u64 {
        let norms = 4 * (self.attn_norm.len() + self.post_attention_norm.len()) as u64;
        self.mixer.bytes_per_token() + self.ffn.bytes_per_token(ffn) + norms
    }
}

/// All weights of a hybrid model.
#[derive(Debug, Clone)]
pub struct HybridWeights {
    pub token_embd: MatrixRef,
    pub output_norm: Vector,
    /// `output.weight`, or `token_embd.weight` when absent (tied).
    pub output: MatrixRef,
    pub tied_output: bool,
    pub layers: Vec<HybridLayer>,
    /// The NextN / MTP block, when the file has one.
    pub mtp: Option<MtpWeights>,
}

impl HybridWeights {
    /// Bytes of weights read per evaluated trunk token (as the dense count: every block, the
    /// final norm, the output matrix and one embedding row).
    pub fn bytes_per_token(&self, config: &HybridConfig) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| l.bytes_per_token(&config.ffn))
            .sum();
        let embedding_row = if self.tied_output {
            0
        } else {
            self.token_embd.row_bytes()
        };
        layers + 4 * self.output_norm.len() as u64 + self.output.n_bytes() + embedding_row
    }
}

/// A loaded hybrid model.
#[derive(Debug, Clone)]
pub struct HybridModel {
    pub config: HybridConfig,
    pub params: HybridParams,
    pub weights: HybridWeights,
}

/// Loads a hybrid model in the layout of `variant`, refusing what is not implemented.
pub fn load_hybrid(
    file: &GgufFile,
    hp: &HParams,
    variant: HybridVariant,
) -> Result<HybridModel, LoadError> {
    let path = file.path().display().to_string();
    let unsupported = |what: String| LoadError::Unsupported {
        path: path.clone(),
        what,
    };
    let params = HybridParams::from_gguf(file, hp)?;
    if params.nextn_predict_layers > 1 {
        return Err(unsupported(format!(
            "{} NextN / MTP blocks (nextn_predict_layers; one is supported)",
            params.nextn_predict_layers
        )));
    }
    if hp.key_length != hp.value_length {
        return Err(unsupported(format!(
            "attention key_length {} different from value_length {}",
            hp.key_length, hp.value_length
        )));
    }
    let freq_scale = match &hp.rope_scaling {
        RopeScaling::None => 1.0,
        RopeScaling::Linear { factor } => 1.0 / factor,
        RopeScaling::Other { kind, .. } => {
            return Err(unsupported(format!("RoPE scaling '{kind}'")));
        }
    };
    let u = |v: u32| v as usize;
    let n_embd = u(hp.embedding_length);
    let mode = match variant.rope {
        HybridRope::NeoX => RopeMode::NeoX,
        HybridRope::MultiSection { interleaved } => {
            let sections = params.rope_sections.ok_or_else(|| {
                LoadError::Gguf(specula_gguf::GgufError::MissingKey {
                    path: file.path().to_path_buf(),
                    key: format!("{}.rope.dimension_sections", hp.architecture),
                })
            })?;
            RopeMode::MultiSection(RopeSections {
                sections,
                interleaved,
            })
        }
    };
    let rope = Rope {
        mode,
        n_rot: u(hp.rope_dimension_count),
        freq_base: hp.rope_freq_base,
        freq_scale,
        freq_factors: None,
    };
    let attention = AttentionShape {
        n_head: u(hp.head_count),
        n_head_kv: u(hp.head_count_kv),
        head_dim: u(hp.key_length),
        value_dim: u(hp.value_length),
    };
    let gdn_shape = GdnShape {
        n_embd,
        conv_kernel: u(params.conv_kernel),
        head_dim: u(params.state_size),
        n_k_heads: u(params.group_count),
        n_v_heads: u(params.time_step_rank),
        head_map: variant.head_map,
        beta_alpha: variant.beta_alpha,
        eps: hp.rms_norm_eps,
    };
    let ffn_shape = if variant.moe {
        let moe = MoeParams::from_gguf(file, hp)?;
        FfnShape::Moe(MoeShape {
            n_embd,
            n_expert: u(moe.expert_count),
            n_used: u(moe.expert_used_count),
            n_ff_expert: u(moe.expert_feed_forward_length),
            n_ff_shared: u(moe.expert_shared_feed_forward_length),
            weights_scale: moe.expert_weights_scale,
        })
    } else {
        FfnShape::Dense {
            n_embd,
            n_ff: u(hp.feed_forward_length),
        }
    };

    let token_embd = MatrixRef::load(file, "token_embd.weight", u(hp.vocab_size), n_embd)?;
    let (output, tied_output) = match file.tensor_info("output.weight") {
        Some(_) => (
            MatrixRef::load(file, "output.weight", u(hp.vocab_size), n_embd)?,
            false,
        ),
        None => (token_embd.clone(), true),
    };
    let output_norm = load_vector(file, "output_norm.weight", n_embd)?;
    let (mut n_gdn, mut n_attn) = (0, 0);
    let mut layers = Vec::with_capacity(params.recurrent.len());
    for (i, &recurrent) in params.recurrent.iter().enumerate() {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let mixer = if recurrent {
            n_gdn += 1;
            Mixer::Gdn {
                ring: n_gdn - 1,
                weights: GdnWeights::load(file, i, &gdn_shape)?,
            }
        } else {
            n_attn += 1;
            Mixer::Attention {
                kv: KvSlot::trunk(n_attn - 1),
                weights: GatedAttentionWeights::load(file, i, &attention, n_embd)?,
            }
        };
        layers.push(HybridLayer {
            attn_norm: load_vector(file, &name("attn_norm"), n_embd)?,
            post_attention_norm: load_vector(file, &name("post_attention_norm"), n_embd)?,
            mixer,
            ffn: FfnBlock::load(file, i, &ffn_shape)?,
        });
    }
    let config = HybridConfig {
        n_embd,
        n_vocab: u(hp.vocab_size),
        rms_eps: hp.rms_norm_eps,
        attention,
        rope,
        gdn: gdn_shape,
        ffn: ffn_shape,
        n_gdn_layers: n_gdn,
        n_attention_layers: n_attn,
    };
    let mtp = match params.nextn_predict_layers {
        0 => None,
        _ => Some(MtpWeights::load(
            file,
            u(params.n_trunk),
            &config,
            &token_embd,
            &output,
            &output_norm,
        )?),
    };
    Ok(HybridModel {
        config,
        params,
        weights: HybridWeights {
            token_embd,
            output_norm,
            output,
            tied_output,
            layers,
            mtp,
        },
    })
}
