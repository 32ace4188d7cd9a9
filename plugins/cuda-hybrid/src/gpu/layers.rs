//! The part of the model placed on the GPU: trunk layers `first_gpu_layer ..`, the head (final
//! norm, LM head) and the MTP block, with their KV caches, the device half of the snapshot
//! ring and the activation scratch — and the forward pass over them.
//!
//! The arithmetic follows the CPU layer code of `specula-engine` step for step (same
//! residual layout, same norms, same RoPE angles, same routing rules); see each kernel's
//! comment in `kernels/*.cu` for its exact order of operations. Results are close to the CPU's
//! but not bit-identical (different reduction orders); what is bit-identical is a row of a
//! k-row evaluation and a one-row evaluation at the same position on the GPU.

use specula_engine::arch::hybrid::{HybridConfig, HybridModel, Mixer};
use specula_engine::arch::DenseConfig;
use specula_engine::blocks::attention::{AttentionShape, GatedAttentionWeights};
use specula_engine::blocks::ffn::{FfnBlock, FfnShape};
use specula_engine::blocks::gdn::{BetaAlpha, GdnShape, GdnWeights, HeadMap};
use specula_engine::blocks::moe::MoeShape;
use specula_engine::blocks::mtp::MtpWeights;
use specula_engine::model::weights::LayerWeights;
use specula_engine::model::{DenseModel, Graph};
use specula_engine::recurrent::{RingIndex, StateLayout};
use specula_gguf::GgufFile;
use specula_kernels::Rope;
use specula_plugin_api::PluginError;

use super::ops::{
    self, AttentionDims, DevRope, Gate, GdnDims, GdnInputs, Heads, Q8Scratch, RingSlot,
    ATTENTION_ROWS,
};
use super::weights::{DevExperts, DevMatrix, DevVec, WeightStore};
use super::{DevBuf, Gpu};

/// The attention projections of a layer (dense: plain; hybrid and MTP: gated).
#[derive(Debug, Clone)]
pub struct GpuAttention {
    pub q: DevMatrix,
    pub k: DevMatrix,
    pub v: DevMatrix,
    pub o: DevMatrix,
    pub q_norm: Option<DevVec>,
    pub k_norm: Option<DevVec>,
    /// `attn_q` holds query and output gate per head (qwen35 / qwen3next / MTP).
    pub gated: bool,
    /// Biases of the q, k and v projections (qwen2; never with `gated`).
    pub qkv_bias: Option<[DevVec; 3]>,
}

#[derive(Debug, Clone)]
pub enum GpuBetaAlpha {
    Separate { beta: DevMatrix, alpha: DevMatrix },
    Grouped(DevMatrix),
}

/// The weights of a Gated DeltaNet mixer.
#[derive(Debug, Clone)]
pub struct GpuGdn {
    pub qkv: DevMatrix,
    pub gate: DevMatrix,
    pub beta_alpha: GpuBetaAlpha,
    pub conv: DevVec,
    pub dt_bias: DevVec,
    pub a: DevVec,
    pub norm: DevVec,
    pub out: DevMatrix,
}

#[derive(Debug, Clone)]
pub struct GpuShared {
    pub gate_inp: DevMatrix,
    pub gate: DevMatrix,
    pub up: DevMatrix,
    pub down: DevMatrix,
}

#[derive(Debug, Clone)]
pub struct GpuMoe {
    pub router: DevMatrix,
    pub gate: DevExperts,
    pub up: DevExperts,
    pub down: DevExperts,
    pub shared: Option<GpuShared>,
}

#[derive(Debug, Clone)]
pub enum GpuFfn {
    Dense {
        gate: DevMatrix,
        up: DevMatrix,
        down: DevMatrix,
    },
    Moe(Box<GpuMoe>),
}

/// The token mixer of a GPU layer with its slot in the device KV cache / ring.
#[derive(Debug, Clone)]
pub enum GpuMixer {
    Attention { kv: usize, w: GpuAttention },
    Gdn { slot: usize, w: GpuGdn },
}

/// One trunk layer on the GPU: `x += mixer(attn_norm(x)); x += ffn(ffn_norm(x))` (the hybrid
/// post-attention norm is `ffn_norm` here).
#[derive(Debug, Clone)]
pub struct GpuLayer {
    pub attn_norm: DevVec,
    pub ffn_norm: DevVec,
    pub mixer: GpuMixer,
    pub ffn: GpuFfn,
}

/// The head on the GPU.
#[derive(Debug, Clone)]
pub struct GpuHead {
    pub output_norm: DevVec,
    pub output: DevMatrix,
}

/// The MTP block on the GPU.
#[derive(Debug, Clone)]
pub struct GpuMtp {
    pub eh_proj: DevMatrix,
    pub enorm: DevVec,
    pub hnorm: DevVec,
    pub attn_norm: DevVec,
    pub post_attention_norm: DevVec,
    pub attention: GpuAttention,
    pub ffn: GpuFfn,
    pub head_norm: DevVec,
    pub head: DevMatrix,
}

/// Attention keys and values on the device, `n_ctx` rows per layer.
#[derive(Debug)]
pub struct DeviceKv {
    pub k: Vec<DevBuf<f32>>,
    pub v: Vec<DevBuf<f32>>,
    pub k_width: usize,
    pub v_width: usize,
}

impl DeviceKv {
    pub fn new(
        gpu: &Gpu,
        layers: usize,
        n_ctx: usize,
        k_width: usize,
        v_width: usize,
    ) -> Result<Self, PluginError> {
        let mut kv = Self {
            k: Vec::with_capacity(layers),
            v: Vec::with_capacity(layers),
            k_width,
            v_width,
        };
        for _ in 0..layers {
            kv.k.push(gpu.zeros(n_ctx * k_width)?);
            kv.v.push(gpu.zeros(n_ctx * v_width)?);
        }
        Ok(kv)
    }

    /// Bytes for `layers` layers of `n_ctx` positions.
    pub fn bytes(layers: usize, n_ctx: usize, k_width: usize, v_width: usize) -> u64 {
        4 * (layers * n_ctx * (k_width + v_width)) as u64
    }
}

/// The device half of the snapshot ring: the states of the GPU's Gated DeltaNet layers, with
/// the same bookkeeping as the host ring (they advance and restore together).
#[derive(Debug)]
pub struct DeviceRing {
    pub planes: DevBuf<f32>,
    pub layout: StateLayout,
    pub index: RingIndex,
}

impl DeviceRing {
    pub fn new(gpu: &Gpu, layout: StateLayout, n_planes: usize) -> Result<Self, PluginError> {
        Ok(Self {
            planes: gpu.zeros(layout.plane_len() * n_planes)?,
            layout,
            index: RingIndex::new(n_planes),
        })
    }

    fn slot(&self, layer: usize) -> RingSlot {
        RingSlot {
            planes: self.planes.ptr(),
            plane_len: self.layout.plane_len(),
            n_planes: self.index.n_planes(),
            layer_offset: layer * self.layout.layer_len(),
            conv_len: self.layout.conv_len,
        }
    }

    /// Back to the empty sequence: the live plane zeroed, every snapshot forgotten.
    pub fn reset(&mut self, gpu: &Gpu) -> Result<(), PluginError> {
        let plane = self.layout.plane_len();
        let live = self.index.live_plane();
        gpu.zero_range(&mut self.planes, live * plane, plane)?;
        self.index.reset();
        Ok(())
    }
}

/// Model dimensions the GPU pass needs, for either family.
#[derive(Debug, Clone)]
pub struct Shapes {
    pub n_embd: usize,
    pub n_vocab: usize,
    pub eps: f32,
    pub attention: AttentionShape,
    pub rope: Rope,
    pub gdn: Option<GdnShape>,
    pub ffn: FfnShape,
}

impl Shapes {
    pub fn dense(config: &DenseConfig, n_vocab: usize) -> Self {
        Self {
            n_embd: config.n_embd,
            n_vocab,
            eps: config.rms_eps,
            attention: config.attention,
            rope: config.rope.clone(),
            gdn: None,
            ffn: FfnShape::Dense {
                n_embd: config.n_embd,
                n_ff: config.n_ff,
            },
        }
    }

    pub fn hybrid(config: &HybridConfig) -> Self {
        Self {
            n_embd: config.n_embd,
            n_vocab: config.n_vocab,
            eps: config.rms_eps,
            attention: config.attention,
            rope: config.rope.clone(),
            gdn: Some(config.gdn),
            ffn: config.ffn,
        }
    }

    /// Widest hidden layer of an FFN per input row (for MoE: all routed experts of a row).
    fn ffn_width(&self) -> usize {
        match &self.ffn {
            FfnShape::Dense { n_ff, .. } => *n_ff,
            FfnShape::Moe(m) => (m.n_used * m.n_ff_expert).max(m.n_ff_shared),
        }
    }

    fn moe(&self) -> Option<&MoeShape> {
        match &self.ffn {
            FfnShape::Moe(m) => Some(m),
            FfnShape::Dense { .. } => None,
        }
    }

    /// Floats of activation scratch for `rows` rows over a context of `n_ctx`, by buffer
    /// (the order of [`GpuScratch::new`]).
    fn scratch_lens(&self, rows: usize, n_ctx: usize) -> [usize; 21] {
        let e = self.n_embd;
        let a = &self.attention;
        let (channels, vd, hv) = self
            .gdn
            .map_or((0, 0, 0), |g| (g.channels(), g.value_dim(), g.n_v_heads));
        let (n_expert, k) = self.moe().map_or((0, 0), |m| (m.n_expert, m.n_used));
        [
            rows * e,                          // x
            rows * e,                          // xn
            rows * e,                          // proj
            rows * 2 * e,                      // concat
            rows * 2 * a.q_width(),            // q_full
            rows * a.q_width(),                // q
            rows * a.out_width(),              // attn
            ATTENTION_ROWS * a.n_head * n_ctx, // scores
            rows * self.ffn_width(),           // gate
            rows * self.ffn_width(),           // up
            rows * channels,                   // mixed
            rows * channels,                   // conv_out
            rows * vd,                         // z
            rows * 2 * hv,                     // beta (or ba)
            rows * hv,                         // alpha
            rows * vd,                         // gdn_out
            rows * n_expert,                   // router
            rows * k * e,                      // expert_out
            rows * e,                          // shared_out
            rows,                              // shared_gate
            rows * e,                          // hidden
        ]
    }

    /// Largest activation row a matmul reads, times the rows (for the quantisation scratch).
    fn q8_values(&self, rows: usize) -> usize {
        let a = &self.attention;
        let vd = self.gdn.map_or(0, |g| g.value_dim());
        let widest = [2 * self.n_embd, a.out_width(), self.ffn_width(), vd]
            .into_iter()
            .max()
            .unwrap_or(0);
        (rows * widest).next_multiple_of(32)
    }

    /// Bytes of [`GpuScratch`] (including the logits rows and the index buffers).
    pub fn scratch_bytes(&self, rows: usize, n_ctx: usize) -> u64 {
        let floats: usize = self.scratch_lens(rows, n_ctx).iter().sum::<usize>()
            + rows * self.n_vocab
            + 2 * rows * self.moe().map_or(0, |m| m.n_used);
        4 * floats as u64 + Q8Scratch::bytes(self.q8_values(rows))
    }
}

/// Activation buffers of the GPU pass, for up to `rows` rows.
#[derive(Debug)]
pub struct GpuScratch {
    pub rows: usize,
    pub x: DevBuf<f32>,
    pub xn: DevBuf<f32>,
    pub proj: DevBuf<f32>,
    pub concat: DevBuf<f32>,
    pub q_full: DevBuf<f32>,
    pub q: DevBuf<f32>,
    pub attn: DevBuf<f32>,
    pub scores: DevBuf<f32>,
    pub gate: DevBuf<f32>,
    pub up: DevBuf<f32>,
    pub mixed: DevBuf<f32>,
    pub conv_out: DevBuf<f32>,
    pub z: DevBuf<f32>,
    pub beta: DevBuf<f32>,
    pub alpha: DevBuf<f32>,
    pub gdn_out: DevBuf<f32>,
    pub router: DevBuf<f32>,
    pub expert_out: DevBuf<f32>,
    pub shared_out: DevBuf<f32>,
    pub shared_gate: DevBuf<f32>,
    pub hidden: DevBuf<f32>,
    pub logits: DevBuf<f32>,
    pub ids: DevBuf<i32>,
    pub route_weights: DevBuf<f32>,
    pub q8: Q8Scratch,
    /// Context positions the score scratch covers.
    pub n_ctx: usize,
}

impl GpuScratch {
    pub fn new(gpu: &Gpu, shapes: &Shapes, rows: usize, n_ctx: usize) -> Result<Self, PluginError> {
        let l = shapes.scratch_lens(rows, n_ctx);
        let k = shapes.moe().map_or(0, |m| m.n_used);
        Ok(Self {
            rows,
            x: gpu.zeros(l[0])?,
            xn: gpu.zeros(l[1])?,
            proj: gpu.zeros(l[2])?,
            concat: gpu.zeros(l[3])?,
            q_full: gpu.zeros(l[4])?,
            q: gpu.zeros(l[5])?,
            attn: gpu.zeros(l[6])?,
            scores: gpu.zeros(l[7])?,
            gate: gpu.zeros(l[8])?,
            up: gpu.zeros(l[9])?,
            mixed: gpu.zeros(l[10])?,
            conv_out: gpu.zeros(l[11])?,
            z: gpu.zeros(l[12])?,
            beta: gpu.zeros(l[13])?,
            alpha: gpu.zeros(l[14])?,
            gdn_out: gpu.zeros(l[15])?,
            router: gpu.zeros(l[16])?,
            expert_out: gpu.zeros(l[17])?,
            shared_out: gpu.zeros(l[18])?,
            shared_gate: gpu.zeros(l[19])?,
            hidden: gpu.zeros(l[20])?,
            logits: gpu.zeros(rows * shapes.n_vocab)?,
            ids: gpu.zeros(rows * k)?,
            route_weights: gpu.zeros(rows * k)?,
            q8: Q8Scratch::new(gpu, shapes.q8_values(rows))?,
            n_ctx,
        })
    }
}

// ---- uploading ----------------------------------------------------------------------------

fn upload_attention(
    gpu: &Gpu,
    file: &GgufFile,
    store: &mut WeightStore,
    w: &GatedAttentionWeights,
) -> Result<GpuAttention, PluginError> {
    Ok(GpuAttention {
        q: store.matrix(gpu, file, &w.attn_q)?,
        k: store.matrix(gpu, file, &w.attn_k)?,
        v: store.matrix(gpu, file, &w.attn_v)?,
        o: store.matrix(gpu, file, &w.attn_output)?,
        q_norm: Some(store.vector(gpu, &w.q_norm)?),
        k_norm: Some(store.vector(gpu, &w.k_norm)?),
        gated: true,
        qkv_bias: None,
    })
}

fn upload_gdn(
    gpu: &Gpu,
    file: &GgufFile,
    store: &mut WeightStore,
    w: &GdnWeights,
) -> Result<GpuGdn, PluginError> {
    Ok(GpuGdn {
        qkv: store.matrix(gpu, file, &w.attn_qkv)?,
        gate: store.matrix(gpu, file, &w.attn_gate)?,
        beta_alpha: match &w.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => GpuBetaAlpha::Separate {
                beta: store.matrix(gpu, file, beta)?,
                alpha: store.matrix(gpu, file, alpha)?,
            },
            BetaAlpha::Grouped(ba) => GpuBetaAlpha::Grouped(store.matrix(gpu, file, ba)?),
        },
        conv: store.vector(gpu, &w.conv_by_channel())?,
        dt_bias: store.vector(gpu, &w.dt_bias)?,
        a: store.vector(gpu, &w.a)?,
        norm: store.vector(gpu, &w.norm)?,
        out: store.matrix(gpu, file, &w.ssm_out)?,
    })
}

fn upload_ffn(
    gpu: &Gpu,
    file: &GgufFile,
    store: &mut WeightStore,
    ffn: &FfnBlock,
) -> Result<GpuFfn, PluginError> {
    Ok(match ffn {
        FfnBlock::Dense { gate, up, down } => GpuFfn::Dense {
            gate: store.matrix(gpu, file, gate)?,
            up: store.matrix(gpu, file, up)?,
            down: store.matrix(gpu, file, down)?,
        },
        FfnBlock::Moe(w) => GpuFfn::Moe(Box::new(GpuMoe {
            router: store.matrix(gpu, file, &w.gate_inp)?,
            gate: store.experts(gpu, file, &w.gate_exps)?,
            up: store.experts(gpu, file, &w.up_exps)?,
            down: store.experts(gpu, file, &w.down_exps)?,
            shared: match &w.shared {
                None => None,
                Some(s) => Some(GpuShared {
                    gate_inp: store.matrix(gpu, file, &s.gate_inp)?,
                    gate: store.matrix(gpu, file, &s.gate)?,
                    up: store.matrix(gpu, file, &s.up)?,
                    down: store.matrix(gpu, file, &s.down)?,
                }),
            },
        })),
    })
}

fn upload_dense_layer(
    gpu: &Gpu,
    file: &GgufFile,
    store: &mut WeightStore,
    w: &LayerWeights,
    kv: usize,
) -> Result<GpuLayer, PluginError> {
    let vector = |store: &mut WeightStore, v: &Option<Vec<f32>>| -> Result<_, PluginError> {
        v.as_deref().map(|v| store.vector(gpu, v)).transpose()
    };
    Ok(GpuLayer {
        attn_norm: store.vector(gpu, &w.attn_norm)?,
        ffn_norm: store.vector(gpu, &w.ffn_norm)?,
        mixer: GpuMixer::Attention {
            kv,
            w: GpuAttention {
                q: store.matrix(gpu, file, &w.attn_q)?,
                k: store.matrix(gpu, file, &w.attn_k)?,
                v: store.matrix(gpu, file, &w.attn_v)?,
                o: store.matrix(gpu, file, &w.attn_output)?,
                q_norm: vector(store, &w.attn_q_norm)?,
                k_norm: vector(store, &w.attn_k_norm)?,
                gated: false,
                qkv_bias: match &w.qkv_bias {
                    Some(b) => Some([
                        store.vector(gpu, &b.q)?,
                        store.vector(gpu, &b.k)?,
                        store.vector(gpu, &b.v)?,
                    ]),
                    None => None,
                },
            },
        },
        ffn: GpuFfn::Dense {
            gate: store.matrix(gpu, file, &w.ffn_gate)?,
            up: store.matrix(gpu, file, &w.ffn_up)?,
            down: store.matrix(gpu, file, &w.ffn_down)?,
        },
    })
}

fn upload_mtp(
    gpu: &Gpu,
    file: &GgufFile,
    store: &mut WeightStore,
    w: &MtpWeights,
) -> Result<GpuMtp, PluginError> {
    Ok(GpuMtp {
        eh_proj: store.matrix(gpu, file, &w.eh_proj)?,
        enorm: store.vector(gpu, &w.enorm)?,
        hnorm: store.vector(gpu, &w.hnorm)?,
        attn_norm: store.vector(gpu, &w.attn_norm)?,
        post_attention_norm: store.vector(gpu, &w.post_attention_norm)?,
        attention: upload_attention(gpu, file, store, &w.attention)?,
        ffn: upload_ffn(gpu, file, store, &w.ffn)?,
        head_norm: store.vector(gpu, &w.head_norm)?,
        head: store.matrix(gpu, file, &w.head)?,
    })
}

/// The GPU part of a model.
pub struct GpuModel {
    pub gpu: Gpu,
    pub store: WeightStore,
    pub shapes: Shapes,
    rope: DevRope,
    /// Trunk layer `first_layer + i` is `layers[i]`.
    pub first_layer: usize,
    pub layers: Vec<GpuLayer>,
    pub head: Option<GpuHead>,
    pub mtp: Option<GpuMtp>,
    pub kv: DeviceKv,
    pub mtp_kv: Option<DeviceKv>,
    pub ring: Option<DeviceRing>,
    pub scratch: GpuScratch,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("gpu", &self.gpu)
            .field("first_layer", &self.first_layer)
            .field("layers", &self.layers.len())
            .field("head", &self.head.is_some())
            .field("weight_bytes", &self.store.bytes())
            .finish_non_exhaustive()
    }
}

/// What to put on the GPU.
#[derive(Debug, Clone, Copy)]
pub struct GpuPlan {
    pub first_layer: usize,
    pub head: bool,
    pub n_ctx: usize,
    /// Planes of the snapshot ring (depth + 1).
    pub n_planes: usize,
    /// Rows per pass (scratch size).
    pub rows: usize,
}

impl GpuModel {
    /// Uploads the placed part of `graph` and allocates its state and scratch.
    pub fn build(
        gpu: Gpu,
        file: &GgufFile,
        graph: &Graph,
        plan: GpuPlan,
    ) -> Result<Self, PluginError> {
        let mut store = WeightStore::default();
        let mut layers = Vec::new();
        let (shapes, head, mtp, rope_factors) = match graph {
            Graph::Dense(d) => {
                let DenseModel { config, weights } = &**d;
                for (i, w) in weights.layers.iter().enumerate().skip(plan.first_layer) {
                    layers.push(upload_dense_layer(
                        &gpu,
                        file,
                        &mut store,
                        w,
                        i - plan.first_layer,
                    )?);
                }
                let head = if plan.head {
                    Some(GpuHead {
                        output_norm: store.vector(&gpu, &weights.output_norm)?,
                        output: store.matrix(&gpu, file, &weights.output)?,
                    })
                } else {
                    None
                };
                let factors = match &config.rope.freq_factors {
                    Some(f) => Some(store.vector(&gpu, f)?),
                    None => None,
                };
                (
                    Shapes::dense(config, weights.token_embd.rows),
                    head,
                    None,
                    factors,
                )
            }
            Graph::Hybrid(h) => {
                let HybridModel {
                    config, weights, ..
                } = &**h;
                let (mut n_attn, mut n_gdn) = (0, 0);
                for layer in weights.layers.iter().skip(plan.first_layer) {
                    let mixer = match &layer.mixer {
                        Mixer::Attention { weights: w, .. } => {
                            n_attn += 1;
                            GpuMixer::Attention {
                                kv: n_attn - 1,
                                w: upload_attention(&gpu, file, &mut store, w)?,
                            }
                        }
                        Mixer::Gdn { weights: w, .. } => {
                            n_gdn += 1;
                            GpuMixer::Gdn {
                                slot: n_gdn - 1,
                                w: upload_gdn(&gpu, file, &mut store, w)?,
                            }
                        }
                    };
                    layers.push(GpuLayer {
                        attn_norm: store.vector(&gpu, &layer.attn_norm)?,
                        ffn_norm: store.vector(&gpu, &layer.post_attention_norm)?,
                        mixer,
                        ffn: upload_ffn(&gpu, file, &mut store, &layer.ffn)?,
                    });
                }
                let (head, mtp) = if plan.head {
                    let head = GpuHead {
                        output_norm: store.vector(&gpu, &weights.output_norm)?,
                        output: store.matrix(&gpu, file, &weights.output)?,
                    };
                    let mtp = match &weights.mtp {
                        Some(w) => Some(upload_mtp(&gpu, file, &mut store, w)?),
                        None => None,
                    };
                    (Some(head), mtp)
                } else {
                    (None, None)
                };
                (Shapes::hybrid(config), head, mtp, None)
            }
        };
        let rope = DevRope::new(&shapes.rope, rope_factors.as_ref());
        let a = &shapes.attention;
        let n_attention = layers
            .iter()
            .filter(|l| matches!(l.mixer, GpuMixer::Attention { .. }))
            .count();
        let n_gdn = layers.len() - n_attention;
        let kv = DeviceKv::new(&gpu, n_attention, plan.n_ctx, a.k_width(), a.v_width())?;
        let mtp_kv = match &mtp {
            Some(_) => Some(DeviceKv::new(
                &gpu,
                1,
                plan.n_ctx,
                a.k_width(),
                a.v_width(),
            )?),
            None => None,
        };
        let ring = match (&shapes.gdn, n_gdn) {
            (Some(g), n) if n > 0 => Some(DeviceRing::new(&gpu, g.state_layout(n), plan.n_planes)?),
            _ => None,
        };
        let scratch = GpuScratch::new(&gpu, &shapes, plan.rows, plan.n_ctx)?;
        gpu.sync()?;
        Ok(Self {
            gpu,
            store,
            shapes,
            rope,
            first_layer: plan.first_layer,
            layers,
            head,
            mtp,
            kv,
            mtp_kv,
            ring,
            scratch,
        })
    }

    fn attention_dims(&self) -> AttentionDims {
        let a = &self.shapes.attention;
        AttentionDims {
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: a.head_dim,
            value_dim: a.value_dim,
            scale: a.scale(),
        }
    }

    /// Runs the GPU trunk layers over the `m` rows in `scratch.x` (tokens at positions
    /// `pos0 ..`, the `step0`-th .. tokens after the ring's live state).
    pub fn forward_layers(&self, m: usize, pos0: usize, step0: usize) -> Result<(), PluginError> {
        for layer in &self.layers {
            self.forward_layer(layer, m, pos0, step0)?;
        }
        Ok(())
    }

    fn forward_layer(
        &self,
        layer: &GpuLayer,
        m: usize,
        pos0: usize,
        step0: usize,
    ) -> Result<(), PluginError> {
        let gpu = &self.gpu;
        let s = &self.scratch;
        let e = self.shapes.n_embd;
        let eps = self.shapes.eps;
        ops::rms_norm(
            gpu,
            s.x.ptr(),
            e,
            &layer.attn_norm,
            eps,
            e,
            m,
            s.xn.ptr(),
            e,
        )?;
        match &layer.mixer {
            GpuMixer::Attention { kv, w } => self.attention(
                w,
                &self.kv.k[*kv],
                &self.kv.v[*kv],
                m,
                pos0,
                0,
                s.proj.ptr(),
            )?,
            GpuMixer::Gdn { slot, w } => self.gdn(w, *slot, m, step0, s.proj.ptr())?,
        }
        ops::add_in_place(gpu, s.x.ptr(), s.proj.ptr(), m * e)?;
        ops::rms_norm(gpu, s.x.ptr(), e, &layer.ffn_norm, eps, e, m, s.xn.ptr(), e)?;
        self.ffn(&layer.ffn, m, s.proj.ptr())?;
        ops::add_in_place(gpu, s.x.ptr(), s.proj.ptr(), m * e)
    }

    /// Attention of the `m` normalised rows in `scratch.xn` (cache rows `pos0 ..`, RoPE
    /// positions `pos0 + pos_offset ..`) into `out` (`m × n_embd`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        w: &GpuAttention,
        k_cache: &DevBuf<f32>,
        v_cache: &DevBuf<f32>,
        m: usize,
        pos0: usize,
        pos_offset: usize,
        out: u64,
    ) -> Result<(), PluginError> {
        let gpu = &self.gpu;
        let s = &self.scratch;
        let a = &self.shapes.attention;
        let (hd, qw, kw, vw) = (a.head_dim, a.q_width(), a.k_width(), a.v_width());
        let q8 = &s.q8;
        let projections = [
            (&w.q, s.q_full.ptr()),
            (&w.k, k_cache.at(pos0 * kw)),
            (&w.v, v_cache.at(pos0 * vw)),
        ];
        ops::matmul_many(gpu, s.xn.ptr(), m, &projections, q8)?;
        if let Some([q_bias, k_bias, v_bias]) = &w.qkv_bias {
            ops::add_row_bias(gpu, s.q_full.ptr(), q_bias, m)?;
            ops::add_row_bias(gpu, k_cache.at(pos0 * kw), k_bias, m)?;
            ops::add_row_bias(gpu, v_cache.at(pos0 * vw), v_bias, m)?;
        }
        let q_in = if w.gated {
            Heads {
                ptr: s.q_full.ptr(),
                row_stride: 2 * qw,
                head_stride: 2 * hd,
            }
        } else {
            Heads {
                ptr: s.q_full.ptr(),
                row_stride: qw,
                head_stride: hd,
            }
        };
        let q = Heads {
            ptr: s.q.ptr(),
            row_stride: qw,
            head_stride: hd,
        };
        let eps = self.shapes.eps;
        ops::qk_norm_rope(
            gpu,
            q_in,
            q,
            a.n_head,
            m,
            hd,
            w.q_norm.as_ref(),
            eps,
            pos0,
            pos_offset,
            &self.rope,
        )?;
        let k = Heads {
            ptr: k_cache.at(pos0 * kw),
            row_stride: kw,
            head_stride: hd,
        };
        ops::qk_norm_rope(
            gpu,
            k,
            k,
            a.n_head_kv,
            m,
            hd,
            w.k_norm.as_ref(),
            eps,
            pos0,
            pos_offset,
            &self.rope,
        )?;
        let gate = w.gated.then(|| Gate {
            ptr: s.q_full.at(hd),
            row_stride: 2 * qw,
            head_stride: 2 * hd,
        });
        ops::attention(
            gpu,
            &self.attention_dims(),
            q,
            k_cache.ptr(),
            v_cache.ptr(),
            pos0,
            m,
            &s.scores,
            s.n_ctx,
            gate,
            s.attn.ptr(),
        )?;
        ops::matmul(gpu, &w.o, s.attn.ptr(), m, out, q8)
    }

    /// The Gated DeltaNet mixer of GPU ring slot `slot` over the `m` rows in `scratch.xn`.
    fn gdn(
        &self,
        w: &GpuGdn,
        slot: usize,
        m: usize,
        step0: usize,
        out: u64,
    ) -> Result<(), PluginError> {
        let gpu = &self.gpu;
        let s = &self.scratch;
        let (Some(shape), Some(ring)) = (&self.shapes.gdn, &self.ring) else {
            return Err(PluginError::new(
                specula_plugin_api::ErrorKind::Internal,
                "cuda-hybrid: a Gated DeltaNet layer without a device ring",
            ));
        };
        let (c, vd, hv, sd) = (
            shape.channels(),
            shape.value_dim(),
            shape.n_v_heads,
            shape.head_dim,
        );
        let q8 = &s.q8;
        let mut projections = vec![(&w.qkv, s.mixed.ptr()), (&w.gate, s.z.ptr())];
        let (beta, alpha, grouped, per_row) = match &w.beta_alpha {
            GpuBetaAlpha::Separate { beta, alpha } => {
                projections.extend([(beta, s.beta.ptr()), (alpha, s.alpha.ptr())]);
                (&s.beta, &s.alpha, false, hv)
            }
            GpuBetaAlpha::Grouped(ba) => {
                projections.push((ba, s.beta.ptr()));
                (&s.beta, &s.beta, true, 2 * hv)
            }
        };
        ops::matmul_many(gpu, s.xn.ptr(), m, &projections, q8)?;
        let ring_slot = ring.slot(slot);
        let dims = GdnDims {
            channels: c,
            head_dim: sd,
            n_k_heads: shape.n_k_heads,
            n_v_heads: hv,
            head_map: match shape.head_map {
                HeadMap::Tiled => 0,
                HeadMap::Interleaved => 1,
            },
            eps: shape.eps,
        };
        let q_scale = 1.0 / (sd as f32).sqrt();
        // At most depth tokens per launch, so no token overwrites the plane the launch starts
        // from (the convolution reads it for every token).
        let depth = ring.index.depth();
        let mut first = 0;
        while first < m {
            let rows = depth.min(m - first);
            let (start, _) = ring.index.step_planes(step0 + first);
            ops::gdn_conv(
                gpu,
                s.mixed.at(first * c),
                &w.conv,
                &ring_slot,
                start,
                rows,
                shape.conv_kernel,
                c,
                s.conv_out.at(first * c),
            )?;
            ops::gdn_qk_l2norm(
                gpu,
                s.conv_out.at(first * c),
                rows,
                c,
                shape.n_k_heads,
                sd,
                shape.eps,
                q_scale,
            )?;
            let inputs = GdnInputs {
                conv_out: s.conv_out.at(first * c),
                z: s.z.at(first * vd),
                beta: beta.at(first * per_row),
                alpha: alpha.at(first * per_row),
                grouped,
                dt_bias: w.dt_bias.ptr,
                ssm_a: w.a.ptr,
                norm: w.norm.ptr,
            };
            ops::gdn_recurrence(
                gpu,
                &inputs,
                &dims,
                &ring_slot,
                start,
                rows,
                s.gdn_out.at(first * vd),
            )?;
            first += rows;
        }
        ops::matmul(gpu, &w.out, s.gdn_out.ptr(), m, out, q8)
    }

    /// The FFN over the `m` normalised rows in `scratch.xn` into `out` (`m × n_embd`).
    fn ffn(&self, ffn: &GpuFfn, m: usize, out: u64) -> Result<(), PluginError> {
        let gpu = &self.gpu;
        let s = &self.scratch;
        let e = self.shapes.n_embd;
        let q8 = &s.q8;
        let xn = s.xn.ptr();
        match ffn {
            GpuFfn::Dense { gate, up, down } => {
                ops::matmul_many(gpu, xn, m, &[(gate, s.gate.ptr()), (up, s.up.ptr())], q8)?;
                ops::swiglu(gpu, s.gate.ptr(), s.up.ptr(), m * gate.rows)?;
                ops::matmul(gpu, down, s.gate.ptr(), m, out, q8)
            }
            GpuFfn::Moe(w) => {
                let Some(shape) = self.shapes.moe() else {
                    return Err(PluginError::new(
                        specula_plugin_api::ErrorKind::Internal,
                        "cuda-hybrid: MoE weights without an MoE shape",
                    ));
                };
                let k = shape.n_used;
                let pairs = m * k;
                ops::matmul(gpu, &w.router, xn, m, s.router.ptr(), q8)?;
                ops::moe_route(
                    gpu,
                    s.router.ptr(),
                    m,
                    shape.n_expert,
                    k,
                    shape.weights_scale,
                    s.ids.ptr(),
                    s.route_weights.ptr(),
                )?;
                ops::matmul_ids(gpu, &w.gate, s.ids.ptr(), pairs, xn, m, k, s.gate.ptr(), q8)?;
                ops::matmul_ids(gpu, &w.up, s.ids.ptr(), pairs, xn, m, k, s.up.ptr(), q8)?;
                ops::swiglu(gpu, s.gate.ptr(), s.up.ptr(), pairs * w.gate.rows)?;
                ops::matmul_ids(
                    gpu,
                    &w.down,
                    s.ids.ptr(),
                    pairs,
                    s.gate.ptr(),
                    pairs,
                    1,
                    s.expert_out.ptr(),
                    q8,
                )?;
                ops::moe_combine(gpu, s.expert_out.ptr(), s.route_weights.ptr(), m, k, e, out)?;
                if let Some(sh) = &w.shared {
                    let jobs = [(&sh.gate, s.gate.ptr()), (&sh.up, s.up.ptr())];
                    ops::matmul_many(gpu, xn, m, &jobs, q8)?;
                    ops::swiglu(gpu, s.gate.ptr(), s.up.ptr(), m * sh.gate.rows)?;
                    ops::matmul(gpu, &sh.down, s.gate.ptr(), m, s.shared_out.ptr(), q8)?;
                    ops::matmul(gpu, &sh.gate_inp, xn, m, s.shared_gate.ptr(), q8)?;
                    ops::add_gated(gpu, out, s.shared_out.ptr(), s.shared_gate.ptr(), m, e)?;
                }
                Ok(())
            }
        }
    }

    /// The head over the `m` rows in `scratch.x`: final norm into `scratch.hidden`, and the
    /// logits of rows `first_logit ..` (`m - first_logit` rows) into `scratch.logits`.
    pub fn head(&self, m: usize, first_logit: usize) -> Result<(), PluginError> {
        let Some(head) = &self.head else {
            return Err(PluginError::new(
                specula_plugin_api::ErrorKind::Internal,
                "cuda-hybrid: the head is not on the GPU",
            ));
        };
        let gpu = &self.gpu;
        let s = &self.scratch;
        let e = self.shapes.n_embd;
        ops::rms_norm(
            gpu,
            s.x.ptr(),
            e,
            &head.output_norm,
            self.shapes.eps,
            e,
            m,
            s.hidden.ptr(),
            e,
        )?;
        if first_logit < m {
            ops::matmul(
                gpu,
                &head.output,
                s.hidden.at(first_logit * e),
                m - first_logit,
                s.logits.ptr(),
                &s.q8,
            )?;
        }
        Ok(())
    }

    /// The MTP block over `m` rows whose raw inputs `[embedding | trunk hidden]` are in
    /// `scratch.concat` (`m × 2·n_embd`), cache rows `position ..`: the head's final-norm
    /// hidden states into `scratch.hidden`, and the logits of rows `first_logit ..` into
    /// `scratch.logits`.
    pub fn mtp(&self, m: usize, position: usize, first_logit: usize) -> Result<(), PluginError> {
        let (Some(w), Some(kv)) = (&self.mtp, &self.mtp_kv) else {
            return Err(PluginError::unsupported(
                "cuda-hybrid: no MTP head on the GPU",
            ));
        };
        let gpu = &self.gpu;
        let s = &self.scratch;
        let e = self.shapes.n_embd;
        let eps = self.shapes.eps;
        ops::rms_norm(
            gpu,
            s.concat.ptr(),
            2 * e,
            &w.enorm,
            eps,
            e,
            m,
            s.concat.ptr(),
            2 * e,
        )?;
        ops::rms_norm(
            gpu,
            s.concat.at(e),
            2 * e,
            &w.hnorm,
            eps,
            e,
            m,
            s.concat.at(e),
            2 * e,
        )?;
        ops::matmul(gpu, &w.eh_proj, s.concat.ptr(), m, s.x.ptr(), &s.q8)?;
        ops::rms_norm(gpu, s.x.ptr(), e, &w.attn_norm, eps, e, m, s.xn.ptr(), e)?;
        self.attention(
            &w.attention,
            &kv.k[0],
            &kv.v[0],
            m,
            position,
            1,
            s.proj.ptr(),
        )?;
        ops::add_in_place(gpu, s.x.ptr(), s.proj.ptr(), m * e)?;
        ops::rms_norm(
            gpu,
            s.x.ptr(),
            e,
            &w.post_attention_norm,
            eps,
            e,
            m,
            s.xn.ptr(),
            e,
        )?;
        self.ffn(&w.ffn, m, s.proj.ptr())?;
        ops::add_in_place(gpu, s.x.ptr(), s.proj.ptr(), m * e)?;
        ops::rms_norm(
            gpu,
            s.x.ptr(),
            e,
            &w.head_norm,
            eps,
            e,
            m,
            s.hidden.ptr(),
            e,
        )?;
        if first_logit < m {
            ops::matmul(
                gpu,
                &w.head,
                s.hidden.at(first_logit * e),
                m - first_logit,
                s.logits.ptr(),
                &s.q8,
            )?;
        }
        Ok(())
    }
}
