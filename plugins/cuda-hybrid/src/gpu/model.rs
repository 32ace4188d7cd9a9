//! The part of the model placed on the GPU: trunk layers `first_layer ..`, and the head
//! (final norm, LM head) and the MTP block where placed, with their KV caches, the device
//! half of the snapshot ring and the activation buffers — and the passes over them, which run
//! the architectures' graphs with the device's operations ([`super::graph_ops`]).
//!
//! Weights are uploaded by running the same graphs once with an operations implementation
//! that uploads every weight an operation names ([`super::graph_ops::Uploader`]): what is on
//! the device is exactly what the graphs read.
//!
//! Results are close to the CPU's but not bit-identical (different reduction orders); what is
//! bit-identical is a row of a k-row evaluation and a one-row evaluation at the same position
//! on the GPU.

use specula_engine::arch::{self, hybrid::Mixer};
use specula_engine::blocks::ffn::FfnShape;
use specula_engine::graph::{Act, Dims, Rows};
use specula_engine::kv_cache::{KvType, BLOCK_TOKENS};
use specula_engine::model::{Graph, Model};
use specula_engine::recurrent::{RingIndex, StateLayout};
use specula_plugin_api::PluginError;

use super::graph_ops::{GpuOps, Uploader};
use super::ops::{DevRope, KvLayer, Q8Scratch, RingSlot, ATTENTION_ROWS, GDN_RUN, ROW_INFO};
use super::weights::WeightStore;
use super::{DevBuf, Gpu};

/// Attention keys and values on the device, `rows` cache rows per layer, stored as `ty` (the
/// buffers count 16-bit units: two per f32 value, one per f16 value, 17 per 32 Q8_0 values). The trunk's cache is
/// paged: its rows are the host pool's blocks, which every sequence's block table indexes
/// (so the sequences together hold at most the pool, not sequences × context); the MTP
/// head's cache is one per sequence, read through the identity table.
#[derive(Debug)]
pub struct DeviceKv {
    pub k: Vec<DevBuf<u16>>,
    pub v: Vec<DevBuf<u16>>,
    pub k_width: usize,
    pub v_width: usize,
    pub ty: KvType,
    /// Cache rows per layer.
    pub rows: usize,
}

impl DeviceKv {
    pub fn new(
        gpu: &Gpu,
        layers: usize,
        rows: usize,
        (k_width, v_width): (usize, usize),
        ty: KvType,
    ) -> Result<Self, PluginError> {
        let mut kv = Self {
            k: Vec::with_capacity(layers),
            v: Vec::with_capacity(layers),
            k_width,
            v_width,
            ty,
            rows,
        };
        for _ in 0..layers {
            kv.k.push(gpu.zeros(kv.units(rows * k_width))?);
            kv.v.push(gpu.zeros(kv.units(rows * v_width))?);
        }
        Ok(kv)
    }

    /// Layer `layer` as the kernels read it, through the block table at `table`.
    pub fn layer(&self, layer: usize, table: u64) -> KvLayer {
        KvLayer {
            ty: self.ty,
            keys: self.k[layer].ptr(),
            values: self.v[layer].ptr(),
            table,
        }
    }

    /// Copies block `from` (cache rows `64 from ..`) to block `to` in every layer: a
    /// copy-on-write of the host pool, mirrored.
    pub fn copy_block(&mut self, gpu: &Gpu, from: usize, to: usize) -> Result<(), PluginError> {
        self.copy_rows(gpu, from * BLOCK_TOKENS, to * BLOCK_TOKENS, BLOCK_TOKENS)
    }

    /// Copies the keys and values of cache row `from` onto cache row `to` in every layer (a
    /// kept tree path's row moving to its position).
    pub fn copy_row(&mut self, gpu: &Gpu, from: usize, to: usize) -> Result<(), PluginError> {
        self.copy_rows(gpu, from, to, 1)
    }

    /// Copies `n` cache rows from row `from` onto the rows from `to`, in every layer.
    fn copy_rows(
        &mut self,
        gpu: &Gpu,
        from: usize,
        to: usize,
        n: usize,
    ) -> Result<(), PluginError> {
        let (kr, vr) = (self.units(self.k_width), self.units(self.v_width));
        for (bufs, unit) in [(&mut self.k, kr), (&mut self.v, vr)] {
            for buf in bufs.iter_mut() {
                if (from.max(to) + n) * unit > buf.len() {
                    return Err(PluginError::new(
                        specula_plugin_api::ErrorKind::Internal,
                        format!(
                            "cuda-hybrid: KV rows {}.. are outside the device cache",
                            from.max(to)
                        ),
                    ));
                }
                gpu.copy_within(buf, from * unit, to * unit, n * unit)?;
            }
        }
        Ok(())
    }

    /// The 16-bit units of `values` cache values (whole cache rows: a Q8_0 row's 34 bytes per
    /// 32 values).
    pub fn units(&self, values: usize) -> usize {
        self.ty.row_bytes(values) / 2
    }

    /// Bytes for `layers` layers of `n_ctx` positions.
    pub fn bytes(
        layers: usize,
        n_ctx: usize,
        (k_width, v_width): (usize, usize),
        ty: KvType,
    ) -> u64 {
        (layers * n_ctx * (ty.row_bytes(k_width) + ty.row_bytes(v_width))) as u64
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

    /// Where GPU GDN layer `layer` keeps its state.
    pub fn slot(&self, layer: usize) -> RingSlot {
        RingSlot {
            planes: self.planes.ptr(),
            plane_len: self.layout.plane_len(),
            n_planes: self.index.n_planes(),
            layer_offset: layer * self.layout.layer_len(),
            conv_len: self.layout.conv_len,
        }
    }

    /// Makes this ring hold what `other` holds (a forked sequence's state and window).
    pub fn copy_from(&mut self, gpu: &Gpu, other: &DeviceRing) -> Result<(), PluginError> {
        let len = self.layout.plane_len() * self.index.n_planes();
        gpu.copy_device(&other.planes, 0, &mut self.planes, 0, len)?;
        self.index = other.index;
        Ok(())
    }

    /// After a tree of `n` rows was evaluated and the ring advanced past it: the states of the
    /// tree rows `path` become the states after the tree's start, in order, the last one live
    /// (the device half of [`specula_engine::recurrent::SnapshotRing::keep_path`]).
    pub fn keep_path(&mut self, gpu: &Gpu, n: usize, path: &[u32]) -> Result<(), PluginError> {
        let base = self.index.len() - n;
        if n > self.index.depth() || !self.index.restore(base) {
            return Err(PluginError::new(
                specula_plugin_api::ErrorKind::Internal,
                format!(
                    "cuda-hybrid: a tree of {n} rows does not fit a device ring of depth {}",
                    self.index.depth()
                ),
            ));
        }
        let plane = self.layout.plane_len();
        for (k, &row) in path.iter().enumerate() {
            let (from, to) = (
                self.index.plane_of(row as usize + 1),
                self.index.plane_of(k + 1),
            );
            if from != to {
                gpu.copy_within(&mut self.planes, from * plane, to * plane, plane)?;
            }
        }
        self.index.advance(path.len());
        Ok(())
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

/// Widest hidden layer of an FFN per input row (for MoE: all routed experts of a row, or
/// the shared expert).
fn ffn_width(dims: &Dims) -> usize {
    match &dims.ffn {
        FfnShape::Dense { n_ff, .. } => *n_ff,
        FfnShape::Moe(m) => (m.n_used * m.n_ff_expert).max(m.n_ff_shared),
    }
}

/// Largest activation row a matmul reads, times the rows (for the quantisation scratch).
fn q8_values(dims: &Dims, rows: usize) -> usize {
    let a = &dims.attention;
    let vd = dims.gdn.map_or(0, |g| g.value_dim());
    let widest = [2 * dims.n_embd, a.out_width(), ffn_width(dims), vd]
        .into_iter()
        .max()
        .unwrap_or(0);
    (rows * widest).next_multiple_of(32)
}

/// Floats of the buffers besides the [`Act`] roles for `rows` rows over a context of `n_ctx`
/// (the order of [`Extras`]' fields).
fn extra_lens(dims: &Dims, rows: usize, n_ctx: usize) -> [usize; 9] {
    let e = dims.n_embd;
    let channels = dims.gdn.map_or(0, |g| g.channels());
    let (n_expert, k) = dims.moe().map_or((0, 0), |m| (m.n_expert, m.n_used));
    let moe_ffn = if dims.moe().is_some() {
        rows * ffn_width(dims)
    } else {
        0
    };
    [
        ATTENTION_ROWS * dims.attention.n_head * n_ctx, // scores
        rows * channels,                                // conv_out
        rows * n_expert,                                // router
        moe_ffn,                                        // moe_gate
        moe_ffn,                                        // moe_up
        rows * k * e,                                   // expert_out
        rows * e,                                       // shared_out
        rows,                                           // shared_gate
        rows * dims.n_vocab,                            // logits
    ]
}

/// Bytes of the activation buffers ([`GpuScratch`]) for passes of `rows` rows over a context
/// of `n_ctx` positions of a model of `dims`.
pub fn scratch_bytes(dims: &Dims, rows: usize, n_ctx: usize) -> u64 {
    let acts: usize = Act::ALL.iter().map(|a| rows * a.width(dims)).sum();
    let extras: usize = extra_lens(dims, rows, n_ctx).iter().sum();
    let indices =
        2 * rows * dims.moe().map_or(0, |m| m.n_used) + tree_path_values(rows) + ROW_INFO * rows;
    4 * (acts + extras + indices) as u64
        + (8 * GDN_RUN * rows) as u64
        + Q8Scratch::bytes(q8_values(dims, rows))
}

/// Device buffers the operations use besides the graph's [`Act`] roles.
#[derive(Debug)]
pub struct Extras {
    /// Attention scores, [`ATTENTION_ROWS`] rows of every head over `n_ctx` positions.
    pub scores: DevBuf<f32>,
    /// Gated DeltaNet: the convolved `[q | k | v]`.
    pub conv_out: DevBuf<f32>,
    /// MoE: router logits, then probabilities.
    pub router: DevBuf<f32>,
    /// MoE: the routed experts' (and then the shared expert's) gate and up projections.
    pub moe_gate: DevBuf<f32>,
    pub moe_up: DevBuf<f32>,
    /// MoE: each (row, rank)'s expert output.
    pub expert_out: DevBuf<f32>,
    pub shared_out: DevBuf<f32>,
    pub shared_gate: DevBuf<f32>,
    /// The LM head's output rows.
    pub logits: DevBuf<f32>,
    /// MoE: each (row, rank)'s expert and weight.
    pub ids: DevBuf<i32>,
    pub route_weights: DevBuf<f32>,
    /// Attention of a tree's rows: each row's path ([`tree_path_values`] ints).
    pub tree_paths: DevBuf<i32>,
    /// Each row's sequence, positions and tree path ([`super::ops::AttentionRows`]).
    pub row_info: DevBuf<i32>,
    /// The pass's Gated DeltaNet runs ([`super::ops::GdnRun`]; at most one per row).
    pub gdn_runs: DevBuf<i64>,
}

/// Ints the paths of a pass's tree rows take at most: per row its path's length and nodes
/// (a tree is at most the pass's rows).
pub fn tree_path_values(rows: usize) -> usize {
    rows * (rows + 1)
}

/// Activation buffers of the GPU pass, for up to `rows` rows.
#[derive(Debug)]
pub struct GpuScratch {
    pub rows: usize,
    /// One buffer per [`Act`] role, `rows × width` ([`Act::index`]).
    acts: Vec<DevBuf<f32>>,
    pub extras: Extras,
    pub q8: Q8Scratch,
    /// Context positions the score scratch covers.
    pub n_ctx: usize,
}

impl GpuScratch {
    pub fn new(gpu: &Gpu, dims: &Dims, rows: usize, n_ctx: usize) -> Result<Self, PluginError> {
        let acts = Act::ALL
            .iter()
            .map(|a| gpu.zeros(rows * a.width(dims)))
            .collect::<Result<Vec<_>, _>>()?;
        let l = extra_lens(dims, rows, n_ctx);
        let k = dims.moe().map_or(0, |m| m.n_used);
        Ok(Self {
            rows,
            acts,
            extras: Extras {
                scores: gpu.zeros(l[0])?,
                conv_out: gpu.zeros(l[1])?,
                router: gpu.zeros(l[2])?,
                moe_gate: gpu.zeros(l[3])?,
                moe_up: gpu.zeros(l[4])?,
                expert_out: gpu.zeros(l[5])?,
                shared_out: gpu.zeros(l[6])?,
                shared_gate: gpu.zeros(l[7])?,
                logits: gpu.zeros(l[8])?,
                ids: gpu.zeros(rows * k)?,
                route_weights: gpu.zeros(rows * k)?,
                tree_paths: gpu.zeros(tree_path_values(rows))?,
                row_info: gpu.zeros(ROW_INFO * rows)?,
                gdn_runs: gpu.zeros(GDN_RUN * rows)?,
            },
            q8: Q8Scratch::new(gpu, q8_values(dims, rows))?,
            n_ctx,
        })
    }

    /// Buffer `act`.
    pub fn act(&self, act: Act) -> &DevBuf<f32> {
        &self.acts[act.index()]
    }

    /// Buffer `act`, mutably (to copy into it).
    pub fn act_mut(&mut self, act: Act) -> &mut DevBuf<f32> {
        &mut self.acts[act.index()]
    }
}

/// One sequence slot's state on the device: the MTP head's cache and the device half of its
/// snapshot ring (its trunk attention rows are in [`GpuModel::kv`]'s blocks).
#[derive(Debug)]
pub struct DeviceSeq {
    pub mtp_kv: Option<DeviceKv>,
    /// The model's GDN layer `first_gdn + i` is ring layer `i`.
    pub ring: Option<DeviceRing>,
}

impl DeviceSeq {
    /// Makes this slot hold what slot `other` holds for a sequence of `len` positions.
    pub fn copy_from(
        &mut self,
        gpu: &Gpu,
        other: &DeviceSeq,
        len: usize,
    ) -> Result<(), PluginError> {
        // The trunk's blocks are shared through the host pool's block tables.
        if let Some((dst, src)) = self.mtp_kv.as_mut().zip(other.mtp_kv.as_ref()) {
            let (kw, vw) = (src.units(len * src.k_width), src.units(len * src.v_width));
            for (d, s) in dst.k.iter_mut().zip(&src.k) {
                gpu.copy_device(s, 0, d, 0, kw)?;
            }
            for (d, s) in dst.v.iter_mut().zip(&src.v) {
                gpu.copy_device(s, 0, d, 0, vw)?;
            }
        }
        if let (Some(ring), Some(src)) = (&mut self.ring, &other.ring) {
            ring.copy_from(gpu, src)?;
        }
        Ok(())
    }
}

/// The GPU part of a model.
pub struct GpuModel {
    pub gpu: Gpu,
    pub store: WeightStore,
    pub dims: Dims,
    pub rope: DevRope,
    /// The first trunk layer on the GPU (the ones before it run on the host).
    pub first_layer: usize,
    /// Trunk layers of the model.
    pub n_layers: usize,
    /// Whether the head (and the MTP block) run here.
    pub head: bool,
    /// Per sequence slot: its caches and ring state.
    pub seqs: Vec<DeviceSeq>,
    /// The trunk's attention caches (the model's attention layer `first_attention + i` is
    /// layer `i`), in the host pool's blocks.
    pub kv: DeviceKv,
    /// Every sequence slot's block table, `table_len` entries each (uploaded before a pass).
    pub tables: DevBuf<u32>,
    pub table_len: usize,
    /// The identity table (`0, 1, 2, …`): how an unpaged cache is read.
    pub identity: DevBuf<u32>,
    /// The first of the model's attention layers on the GPU.
    pub first_attention: usize,
    /// The first of the model's GDN layers on the GPU.
    pub first_gdn: usize,
    pub scratch: GpuScratch,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("gpu", &self.gpu)
            .field("first_layer", &self.first_layer)
            .field("n_layers", &self.n_layers)
            .field("head", &self.head)
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
    /// Sequence slots (each with its caches and ring).
    pub sequences: usize,
    /// Blocks of the trunk's attention cache (the host pool's).
    pub kv_blocks: usize,
    /// How the attention caches store keys and values.
    pub kv_type: KvType,
}

/// Attention and GDN layers among trunk layers `0 .. first_layer` of `graph`.
fn layers_before(graph: &Graph, first_layer: usize) -> (usize, usize) {
    match graph {
        Graph::Dense(_) => (first_layer, 0),
        Graph::Hybrid(h) => {
            let before = &h.weights.layers[..first_layer];
            let gdn = before
                .iter()
                .filter(|l| matches!(l.mixer, Mixer::Gdn { .. }))
                .count();
            (first_layer - gdn, gdn)
        }
    }
}

impl GpuModel {
    /// Uploads the placed part of `model` and allocates its state and scratch.
    pub fn build(gpu: Gpu, model: &Model, plan: GpuPlan) -> Result<Self, PluginError> {
        let graph = &model.graph;
        let dims = graph.dims();
        let n_layers = graph.n_trunk_layers();
        let mut store = WeightStore::default();
        {
            let mut uploader = Uploader::new(&gpu, &model.file, &mut store);
            let rows = Rows::new(&[]);
            for layer in plan.first_layer..n_layers {
                arch::layer(model, &mut uploader, layer, &rows)?;
            }
            if plan.head {
                arch::head(model, &mut uploader, &rows)?;
                if dims.mtp {
                    arch::mtp(model, &mut uploader, &rows)?;
                }
            }
        }
        let rope_factors = match &dims.rope.freq_factors {
            Some(f) => Some(store.values(&gpu, f)?),
            None => None,
        };
        let rope = DevRope::new(&dims.rope, rope_factors.as_ref());
        let a = &dims.attention;
        let (first_attention, first_gdn) = layers_before(graph, plan.first_layer);
        let (n_attention, n_gdn) = layers_before(graph, n_layers);
        let widths = (a.k_width(), a.v_width());
        let table_len = plan.n_ctx.div_ceil(BLOCK_TOKENS);
        let mut seqs = Vec::with_capacity(plan.sequences.max(1));
        for _ in 0..plan.sequences.max(1) {
            seqs.push(DeviceSeq {
                mtp_kv: match plan.head && dims.mtp {
                    true => Some(DeviceKv::new(
                        &gpu,
                        1,
                        table_len * BLOCK_TOKENS,
                        widths,
                        plan.kv_type,
                    )?),
                    false => None,
                },
                ring: match (&dims.gdn, n_gdn - first_gdn) {
                    (Some(g), n) if n > 0 => {
                        Some(DeviceRing::new(&gpu, g.state_layout(n), plan.n_planes)?)
                    }
                    _ => None,
                },
            });
        }
        let kv = DeviceKv::new(
            &gpu,
            n_attention - first_attention,
            plan.kv_blocks * BLOCK_TOKENS,
            widths,
            plan.kv_type,
        )?;
        let tables = gpu.zeros(seqs.len() * table_len)?;
        let identity = gpu.upload(&(0..table_len as u32).collect::<Vec<u32>>())?;
        let scratch = GpuScratch::new(&gpu, &dims, plan.rows, plan.n_ctx)?;
        gpu.sync()?;
        Ok(Self {
            kv,
            tables,
            table_len,
            identity,
            gpu,
            store,
            dims,
            rope,
            first_layer: plan.first_layer,
            n_layers,
            head: plan.head,
            seqs,
            first_attention,
            first_gdn,
            scratch,
        })
    }

    /// Checks that `rows` fit the activation buffers.
    fn check_rows(&self, rows: &Rows) -> Result<(), PluginError> {
        if rows.n > self.scratch.rows {
            return Err(PluginError::new(
                specula_plugin_api::ErrorKind::Internal,
                format!(
                    "cuda-hybrid: a pass of {} rows, but the device buffers hold {}",
                    rows.n, self.scratch.rows
                ),
            ));
        }
        Ok(())
    }

    /// Runs the GPU trunk layers over the rows in [`Act::X`].
    pub fn forward_layers(&mut self, model: &Model, rows: &Rows) -> Result<(), PluginError> {
        self.check_rows(rows)?;
        let layers = self.first_layer..self.n_layers;
        let mut ops = GpuOps::new(self);
        // Before the first launch: a copy from pageable memory behind queued kernels would
        // wait for them.
        ops.write_rows(rows)?;
        ops.write_gdn_runs(rows)?;
        for layer in layers {
            arch::layer(model, &mut ops, layer, rows)?;
        }
        Ok(())
    }

    /// The head over the rows in [`Act::X`]: final norm into [`Act::Hidden`], and the logits
    /// of the rows that get them into the logits buffer.
    pub fn head(&mut self, model: &Model, rows: &Rows) -> Result<(), PluginError> {
        if !self.head {
            return Err(PluginError::new(
                specula_plugin_api::ErrorKind::Internal,
                "cuda-hybrid: the head is not on the GPU",
            ));
        }
        self.check_rows(rows)?;
        arch::head(model, &mut GpuOps::new(self), rows)
    }

    /// The MTP block over rows whose raw inputs `[embedding | trunk hidden]` are in
    /// [`Act::MtpIn`] (cache rows from the span's `pos0`): the head's final-norm hidden states
    /// into [`Act::Hidden`], and the logits of the rows that get them into the logits buffer.
    pub fn mtp(&mut self, model: &Model, rows: &Rows) -> Result<(), PluginError> {
        if !self.head || self.seqs.iter().any(|s| s.mtp_kv.is_none()) {
            return Err(PluginError::unsupported(
                "cuda-hybrid: no MTP head on the GPU",
            ));
        }
        self.check_rows(rows)?;
        let mut ops = GpuOps::new(self);
        ops.write_rows(rows)?;
        arch::mtp(model, &mut ops, rows)
    }
}
