//! The hybrid decoder shared by `qwen35` and `qwen3next`: Gated DeltaNet layers and gated
//! full-attention layers in the schedule of the file, each followed by an FFN, with the layout
//! `x += mixer(attn_norm(x)); x += ffn(post_attention_norm(x))`, and an optional NextN / MTP
//! block after the trunk.
//!
//! The architecture files choose what differs ([`HybridVariant`]): RoPE, how value heads map
//! to key heads, how beta/alpha are stored, and the FFN kind.

use specula_gguf::{GgufFile, HParams, HybridParams, MoeParams, RopeScaling};
use specula_kernels::{ops, MatmulScratch, Rope, RopeMode, RopeSections};
use specula_plugin_api::PluginError;

use crate::blocks::attention::{self, AttentionShape, GatedAttentionWeights, GatedScratch, KvSlot};
use crate::blocks::ffn::{self, FfnBlock, FfnScratch, FfnShape};
use crate::blocks::gdn::{self, BetaAlphaLayout, GdnScratch, GdnShape, GdnWeights, HeadMap};
use crate::blocks::moe::MoeShape;
use crate::blocks::mtp::MtpWeights;
use crate::kv_cache::KvCache;
use crate::model::weights::{load_vector, MatrixRef};
use crate::model::LoadError;
use crate::recurrent::SnapshotRing;

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

/// The token mixer of a trunk layer, with its index among the layers of its kind (the ring
/// section of a GDN layer, the KV-cache layer of an attention layer).
#[derive(Debug, Clone)]
pub enum Mixer {
    Gdn {
        slot: usize,
        weights: GdnWeights,
    },
    Attention {
        slot: usize,
        weights: GatedAttentionWeights,
    },
}

/// One trunk layer.
#[derive(Debug, Clone)]
pub struct HybridLayer {
    pub attn_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub mixer: Mixer,
    pub ffn: FfnBlock,
}

/// All weights of a hybrid model.
#[derive(Debug, Clone)]
pub struct HybridWeights {
    pub token_embd: MatrixRef,
    pub output_norm: Vec<f32>,
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
            .map(|l| {
                let mixer = match &l.mixer {
                    Mixer::Gdn { weights, .. } => weights.bytes_per_token(),
                    Mixer::Attention { weights, .. } => weights.bytes_per_token(),
                };
                let norms = 4 * (l.attn_norm.len() + l.post_attention_norm.len()) as u64;
                mixer + l.ffn.bytes_per_token(&config.ffn) + norms
            })
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
                slot: n_gdn - 1,
                weights: GdnWeights::load(file, i, &gdn_shape)?,
            }
        } else {
            n_attn += 1;
            Mixer::Attention {
                slot: n_attn - 1,
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

/// Preallocated buffers of a hybrid forward pass (trunk and MTP head) for `rows` rows.
#[derive(Debug)]
pub struct HybridScratch {
    /// Residual stream, `rows × n_embd`.
    pub x: Vec<f32>,
    /// Normalised rows, `rows × n_embd`.
    pub xn: Vec<f32>,
    /// Mixer / FFN output, `rows × n_embd`.
    pub proj: Vec<f32>,
    /// MTP input rows `[enorm(embedding) | hnorm(hidden)]`, `rows × 2 × n_embd`.
    pub concat: Vec<f32>,
    pub attention: GatedScratch,
    pub gdn: GdnScratch,
    pub ffn: FfnScratch,
    pub matmul: MatmulScratch,
}

impl HybridScratch {
    pub fn new(config: &HybridConfig, rows: usize, n_ctx: usize) -> Self {
        let e = config.n_embd;
        Self {
            x: vec![0.0; rows * e],
            xn: vec![0.0; rows * e],
            proj: vec![0.0; rows * e],
            concat: vec![0.0; rows * 2 * e],
            attention: GatedScratch::new(&config.attention, &config.rope, rows, n_ctx),
            gdn: GdnScratch::new(&config.gdn, rows),
            ffn: FfnScratch::new(&config.ffn, rows),
            matmul: MatmulScratch::new(),
        }
    }
}

/// Where a trunk pass keeps its sequence state.
#[derive(Debug)]
pub struct TrunkState<'a> {
    /// One cache layer per full-attention layer.
    pub kv: &'a mut KvCache,
    /// Recurrent state of the GDN layers.
    pub ring: &'a mut SnapshotRing,
}

/// Runs trunk layer `layer_index` over the `m` rows in `s.x` (tokens at positions `pos0 ..`,
/// the `step0`-th .. tokens after the ring's live state), updating the residual stream in place.
#[allow(clippy::too_many_arguments)]
pub fn forward_layer(
    model: &HybridModel,
    file: &GgufFile,
    layer_index: usize,
    m: usize,
    pos0: usize,
    step0: usize,
    s: &mut HybridScratch,
    state: &mut TrunkState<'_>,
) -> Result<(), PluginError> {
    let config = &model.config;
    let layer = &model.weights.layers[layer_index];
    let e = config.n_embd;
    let rows = ..m * e;

    for (x, xn) in s.x[rows].chunks_exact(e).zip(s.xn.chunks_exact_mut(e)) {
        ops::rms_norm(x, &layer.attn_norm, config.rms_eps, xn);
    }
    match &layer.mixer {
        Mixer::Gdn { slot, weights } => gdn::forward(
            &config.gdn,
            weights,
            file,
            &s.xn[rows],
            m,
            state.ring,
            *slot,
            step0,
            &mut s.gdn,
            &mut s.matmul,
            &mut s.proj[rows],
        )?,
        Mixer::Attention { slot, weights } => attention::forward_gated(
            &config.attention,
            &config.rope,
            config.rms_eps,
            weights,
            file,
            &s.xn[rows],
            m,
            state.kv,
            KvSlot {
                layer: *slot,
                pos0,
                rope_offset: 0,
            },
            &mut s.attention,
            &mut s.matmul,
            &mut s.proj[rows],
        )?,
    }
    ops::add_in_place(&mut s.x[rows], &s.proj[rows]);

    for (x, xn) in s.x[rows].chunks_exact(e).zip(s.xn.chunks_exact_mut(e)) {
        ops::rms_norm(x, &layer.post_attention_norm, config.rms_eps, xn);
    }
    ffn::forward_block(
        &config.ffn,
        &layer.ffn,
        file,
        &s.xn[rows],
        m,
        &mut s.ffn,
        &mut s.matmul,
        &mut s.proj[rows],
    )?;
    ops::add_in_place(&mut s.x[rows], &s.proj[rows]);
    Ok(())
}
