//! How cuda-hybrid opens a model and its executor: one model, one sequence, split between the
//! host and one GPU (the engine's `Backend` does the sequence bookkeeping).
//!
//! **One graph.** Both halves run the architectures' graphs of `specula-engine`
//! (`specula_engine::arch`): the host half through the engine's CPU executor (the code cpu-simd
//! runs, on a private rayon pool), the device half through [`crate::gpu::graph_ops`], the same
//! operations on the GPU.
//!
//! **Placement** (see [`crate::placement`]): trunk layers `0 .. first_gpu_layer` run on the
//! host, layers `first_gpu_layer ..` and the head (final norm, LM head, MTP block) on the
//! GPU. A pass embeds its tokens on the host, runs the host layers, hands the residual rows to
//! the GPU through a pinned buffer, runs the GPU layers and head, and copies the final hidden
//! states and the requested logits back through pinned buffers.
//!
//! **Sequence state** lives where its layer runs: the KV cache of host attention layers in
//! host memory, of GPU attention layers (and the MTP head) in device memory; the recurrent
//! state of Gated DeltaNet layers in a **snapshot ring** of `depth + 1` planes, split the same
//! way — a host [`SnapshotRing`](specula_engine::recurrent::SnapshotRing) for the host GDN layers and a device ring for the GPU ones.
//! Both halves share one bookkeeping rule ([`specula_engine::recurrent::RingIndex`]) and
//! are advanced and restored together, so rollback inside the window is O(1) on both sides:
//! no state is copied, the plane of the kept length becomes the live one. Beyond the window
//! the backend re-decodes the kept prefix (option `deep_rollback = "redecode"`, the default)
//! or refuses (`"refuse"`), as cpu-simd does.
//!
//! The sequence bookkeeping, validation, chunking and rollback policy are the engine's
//! [`Backend`]; this module is the [`CudaExecutor`] it runs: a host [`CpuExecutor`] for the
//! first layers and the device layers after them.
//!
//! **Parity.** Every kernel computes a row of a k-row evaluation exactly as a one-row
//! evaluation at the same position (see `kernels/*.cu`), and the host layers are cpu-simd's;
//! so a verify row is bit-identical to the single-token forward, which the host's speculative
//! loop relies on. GPU results are close to, not bit-identical with, cpu-simd's.

use std::path::Path;
use std::sync::Arc;

use rayon::ThreadPool;
use specula_engine::arch::hybrid::{self, HybridModel, Mixer};
use specula_engine::arch::nextn::MtpWeights;
use specula_engine::backend::opening::{self, Opening};
use specula_engine::backend::{Backend, Chunk, Executor, KeptPath, MtpRows};
use specula_engine::blocks::ffn::FfnBlock;
use specula_engine::cpu::{CpuExecutor, CpuPart};
use specula_engine::graph::{Act, Rows};
use specula_engine::kv_cache::{KvPool, KvType, BLOCK_TOKENS};
use specula_engine::model::weights::MatrixRef;
use specula_engine::model::{Graph, MatrixSite, Model};
use specula_plugin_api::{BackendParams, ErrorKind, KvUsage, ModelInfo, PluginError};

use crate::driver;
use crate::gpu::emulator::Emulator;
use crate::gpu::model::{scratch_bytes, DeviceKv, DeviceRing, GpuModel, GpuPlan};
use crate::gpu::{Gpu, HostBuf};
use crate::options::Options;
use crate::placement::{self, Costs, LayerCost, Placement};
use crate::PLUGIN_NAME as PLUGIN;

/// A model opened on the GPU (and the host) with its sequence state.
pub type CudaBackend = Backend<CudaExecutor>;

/// Device memory kept free by default: this share of the device's memory, at least
/// [`MIN_RESERVE`].
const RESERVE_SHARE: f64 = 0.05;
const MIN_RESERVE: u64 = 256 << 20;
/// Charged on top of the scratch buffers for kernel modules and allocator slack.
const FIXED_SLACK: u64 = 32 << 20;

fn internal(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, format!("{PLUGIN}: {what}"))
}

/// The device half: the placed layers and the pinned hand-off buffers.
struct DeviceState {
    model: GpuModel,
    /// Host → device: residual rows (`rows × n_embd`) or MTP inputs (`rows × 2·n_embd`).
    pinned_in: HostBuf,
    /// Device → host: final hidden states, `rows × n_embd`.
    pinned_hidden: HostBuf,
    /// Device → host: logits, `rows × vocab`.
    pinned_logits: HostBuf,
}

/// Runs the first layers of a model on the host and the others (and, where placed, the head)
/// on the GPU; holds the caches of each where its layers run.
pub struct CudaExecutor {
    placement: Placement,
    /// Layers `0 .. first_gpu_layer` (and the head when it stays on the host).
    host: CpuExecutor,
    device: Option<DeviceState>,
    device_description: String,
}

impl CudaExecutor {
    /// Where the layers run.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The GPU in use, in words.
    pub fn device_description(&self) -> &str {
        &self.device_description
    }

    /// How the passes went as CUDA graphs (option `cuda_graphs`), where the GPU is in use
    /// with them.
    pub fn replay_stats(&self) -> Option<crate::gpu::replay::ReplayStats> {
        self.device
            .as_ref()
            .and_then(|d| d.model.gpu.replay_stats())
    }
}

/// Bytes of the weights of one hybrid layer (all experts of an MoE FFN).
fn hybrid_layer_bytes(layer: &hybrid::HybridLayer) -> u64 {
    let norms = 4 * (layer.attn_norm.len() + layer.post_attention_norm.len()) as u64;
    layer.mixer.bytes_per_token() + ffn_bytes(&layer.ffn) + norms
}

fn ffn_bytes(ffn: &FfnBlock) -> u64 {
    match ffn {
        FfnBlock::Dense(w) => w.bytes_per_token(),
        FfnBlock::Moe(w) => w.bytes_per_token(w.gate_exps.n_expert),
    }
}

fn mtp_bytes(w: &MtpWeights, output: &MatrixRef) -> u64 {
    let vectors = w.enorm.len() + w.hnorm.len() + w.head_norm.len();
    let head = if w.head.name == output.name {
        0
    } else {
        w.head.n_bytes()
    };
    w.eh_proj.n_bytes() + hybrid_layer_bytes(&w.block) + 4 * vectors as u64 + head
}

/// What every placeable part of `graph` costs on the device, with attention caches (of
/// `kv_type`) for a pool of `kv_tokens` positions and rings (and MTP caches) for `sequences`
/// sequence slots.
fn costs(
    graph: &Graph,
    n_ctx: usize,
    n_planes: usize,
    rows: usize,
    (sequences, kv_tokens): (usize, usize),
    kv_type: KvType,
) -> Costs {
    let sequences = sequences.max(1) as u64;
    let pool_rows = KvPool::blocks_for(kv_tokens.max(1)) * BLOCK_TOKENS;
    let head_rows = n_ctx.div_ceil(BLOCK_TOKENS) * BLOCK_TOKENS;
    match graph {
        Graph::Dense(d) => {
            let a = &d.config.attention;
            let state = DeviceKv::bytes(1, pool_rows, (a.k_width(), a.v_width()), kv_type);
            let w = &d.weights;
            Costs {
                layers: w
                    .layers
                    .iter()
                    .map(|l| LayerCost {
                        weights: l.bytes_per_token(),
                        state,
                    })
                    .collect(),
                head: w.output.n_bytes() + 4 * w.output_norm.len() as u64,
                fixed: scratch_bytes(&graph.dims(), rows, n_ctx) + FIXED_SLACK,
            }
        }
        Graph::Hybrid(h) => {
            let HybridModel {
                config, weights, ..
            } = &**h;
            let a = &config.attention;
            let widths = (a.k_width(), a.v_width());
            let kv = DeviceKv::bytes(1, pool_rows, widths, kv_type);
            let head_kv = sequences * DeviceKv::bytes(1, head_rows, widths, kv_type);
            let ring = sequences * config.gdn.state_layout(1).plane_bytes() * n_planes as u64;
            let mtp = weights
                .mtp
                .as_ref()
                .map_or(0, |m| mtp_bytes(m, &weights.output) + head_kv);
            Costs {
                layers: weights
                    .layers
                    .iter()
                    .map(|l| LayerCost {
                        weights: hybrid_layer_bytes(l),
                        state: match l.mixer {
                            Mixer::Gdn { .. } => ring,
                            Mixer::Attention { .. } => kv,
                        },
                    })
                    .collect(),
                head: weights.output.n_bytes() + 4 * weights.output_norm.len() as u64 + mtp,
                fixed: scratch_bytes(&graph.dims(), rows, n_ctx) + FIXED_SLACK,
            }
        }
    }
}

/// Whether [`open_with`] may use a GPU.
#[derive(Debug, Clone)]
enum Mode {
    Gpu,
    HostOnly,
    /// The host emulator of the kernels, pretending to have this much device memory.
    Emulated(Arc<Emulator>, u64),
}

/// Opens the model named by `params` on the GPU (and, for what does not fit, the host).
///
/// Fails with a clear error, before touching cudarc, when the CUDA driver or NVRTC cannot be
/// loaded.
pub fn open(params: &BackendParams) -> Result<CudaBackend, PluginError> {
    let options = Options::parse(params)?;
    driver::probe_driver()?;
    driver::ensure_nvrtc(options.nvrtc_path.as_deref())?;
    open_with(params, &options, Mode::Gpu)
}

/// Checks `params` as [`open`] does — the options, that the CUDA driver loads, and the model
/// file's header, tensor records and shapes — without touching the GPU, reading weights or
/// allocating caches.
pub fn probe(params: &BackendParams) -> Result<ModelInfo, PluginError> {
    Options::parse(params)?;
    driver::probe_driver()?;
    let (model, n_ctx) = opening::load_model(PLUGIN, params)?;
    Ok(model.info(n_ctx as u32))
}

/// Opens the model with every layer on the host, without looking for a GPU: the host-side
/// machinery of this backend (placement suffix of zero, host ring, rollback, the MTP step) on
/// machines without CUDA. For tests; profiles always get [`open`].
#[doc(hidden)]
pub fn open_host_only(params: &BackendParams) -> Result<CudaBackend, PluginError> {
    let options = Options::parse(params)?;
    open_with(params, &options, Mode::HostOnly)
}

/// Opens the model with the host emulator of the kernels standing in for the GPU
/// ([`crate::gpu::emulator`]), which pretends to have `memory` bytes of device memory: the
/// whole device path on machines without CUDA, slowly. For tests.
#[doc(hidden)]
pub fn open_emulated(
    params: &BackendParams,
    emulator: Arc<Emulator>,
    memory: u64,
) -> Result<CudaBackend, PluginError> {
    let options = Options::parse(params)?;
    open_with(params, &options, Mode::Emulated(emulator, memory))
}

fn open_with(
    params: &BackendParams,
    options: &Options,
    mode: Mode,
) -> Result<CudaBackend, PluginError> {
    let path = Path::new(params.model_path.as_str());
    let mut opening = Opening::start(PLUGIN, params, options.common)?;
    let (n_ctx, requested_verify) = (opening.n_ctx, opening.requested_verify);

    // The ring depth comes first: it sizes the device ring the placement charges for.
    let (capabilities, ring_depth) = opening.capabilities()?;
    let (kv_tokens, max_sequences) = (opening.kv_tokens, opening.max_sequences);
    let Opening { model, pool, .. } = &mut opening;
    let (depth, n_planes) = match &model.graph {
        Graph::Dense(_) => (requested_verify, 2),
        Graph::Hybrid(_) => (ring_depth, ring_depth + 1),
    };
    let batch_rows = Opening::batch_rows(&capabilities);
    let n_layers = model.graph.n_trunk_layers();

    // Open the device and decide the placement.
    let (gpu, placement) = match mode {
        Mode::HostOnly => (None, Placement::cpu_only(n_layers)),
        Mode::Gpu | Mode::Emulated(..) => {
            let gpu = match mode {
                Mode::Emulated(emulator, memory) => {
                    Gpu::emulated(emulator, memory, options.cuda_graphs)
                }
                _ => Gpu::open(
                    options.device,
                    options.kernel_cache.as_deref(),
                    options.cuda_graphs,
                )?,
            };
            let budget = options.vram_budget.unwrap_or_else(|| {
                let reserve =
                    ((gpu.info.total_memory as f64 * RESERVE_SHARE) as u64).max(MIN_RESERVE);
                gpu.info.free_memory.saturating_sub(reserve)
            });
            let costs = costs(
                &model.graph,
                n_ctx,
                n_planes,
                batch_rows,
                (max_sequences, kv_tokens),
                options.common.kv_type,
            );
            let placement = placement::place(&costs, options.gpu_layers, budget).map_err(|e| {
                PluginError::new(
                    ErrorKind::OutOfMemory,
                    format!(
                        "{PLUGIN}: gpu_layers = {} (and the head) need {} MiB of GPU memory, but the budget is {} MiB (option vram_budget, else the free memory of {} minus a reserve); lower gpu_layers or the context size",
                        e.asked,
                        e.needed >> 20,
                        e.budget >> 20,
                        gpu.info.name
                    ),
                )
            })?;
            if !placement.uses_gpu() {
                tracing::warn!(
                    "{PLUGIN}: nothing fits in the GPU memory budget of {} MiB; every layer runs on the CPU",
                    budget >> 20
                );
            }
            (Some(gpu), placement)
        }
    };
    let first_gpu = placement.first_gpu_layer;
    // The host layers (and a host-kept head) multiply their matrices with cpu-simd's
    // kernels, in the same interleaved layout cpu-simd uses (so host results stay cpu-simd's
    // bit for bit); GPU-resident matrices are uploaded from the file as stored.
    let head_on_gpu = placement.head_on_gpu;
    pool.install(|| {
        model.interleave_weights(|site| match site {
            MatrixSite::Layer(i) => i < first_gpu,
            MatrixSite::Head => !head_on_gpu,
        })
    })
    .map_err(|e| specula_engine::backend::attribute(PLUGIN, e))?;

    // The host half.
    let mut host = CpuExecutor::new(
        model,
        CpuPart {
            layers: first_gpu,
            head: !head_on_gpu,
            batch_rows,
            kv_type: options.common.kv_type,
            kv_tokens,
            ring_depth: depth,
            max_sequences,
            // The device's attention caches are stored in the host pool's blocks, so its prefix
            // cache serves them too.
            prefix_cache: true,
            prefix_state_bytes: options.common.prefix_state_bytes,
        },
    )
    .map_err(|e| specula_engine::backend::attribute(PLUGIN, e))?;
    if matches!(model.graph, Graph::Hybrid(_)) && host.ring_depth() < depth {
        return Err(PluginError::new(
            ErrorKind::OutOfMemory,
            format!("{PLUGIN}: cannot allocate {depth} host snapshots of the recurrent state"),
        ));
    }

    // The device half.
    let mut device_description = "none (every layer on the CPU)".to_string();
    let device = match gpu {
        Some(gpu) if placement.uses_gpu() => {
            device_description = format!(
                "{} (device {}, compute capability {}.{}, kernels for compute_{}{})",
                gpu.info.name,
                gpu.info.ordinal,
                gpu.info.compute_capability.0,
                gpu.info.compute_capability.1,
                gpu.info.kernel_arch.0,
                gpu.info.kernel_arch.1
            );
            let e = model.graph.n_embd();
            let vocab = model.hparams.vocab_size as usize;
            let pinned_in = gpu.pinned(batch_rows * 2 * e)?;
            let pinned_hidden = gpu.pinned(batch_rows * e)?;
            let pinned_logits = gpu.pinned(batch_rows * vocab)?;
            let plan = GpuPlan {
                first_layer: first_gpu,
                head: placement.head_on_gpu,
                n_ctx,
                n_planes,
                rows: batch_rows,
                sequences: max_sequences,
                kv_blocks: host.kv_blocks(),
                kv_type: options.common.kv_type,
            };
            let gpu_model = GpuModel::build(gpu, model, plan)?;
            Some(DeviceState {
                model: gpu_model,
                pinned_in,
                pinned_hidden,
                pinned_logits,
            })
        }
        _ => None,
    };

    tracing::info!(
        "{PLUGIN}: {}: {} of {n_layers} layers on the GPU{} ({} MiB of device memory), the rest on {} CPU threads; GPU: {device_description}",
        path.display(),
        placement.gpu_layers(),
        if placement.head_on_gpu { " with the head" } else { "" },
        placement.bytes >> 20,
        pool.current_num_threads(),
    );
    if device.is_some() {
        // The device stores its attention layers in the pool's blocks: it copies what the
        // pool copies.
        host.mirror_blocks();
    }
    let executor = CudaExecutor {
        placement,
        host,
        device,
        device_description,
    };
    Ok(opening.finish(executor, capabilities, batch_rows))
}

/// The hand-off buffer's contents (after a [`Gpu::sync`]).
fn pinned(buffer: &HostBuf) -> Result<&[f32], PluginError> {
    buffer.as_slice()
}

impl Executor for CudaExecutor {
    fn add_sequence(&mut self, seq: usize) -> Result<(), PluginError> {
        self.host.add_sequence(seq)?;
        self.reset_device(seq)
    }

    fn fork_sequence(&mut self, from: usize, to: usize, len: usize) -> Result<(), PluginError> {
        self.host.fork_sequence(from, to, len)?;
        if let Some(d) = &mut self.device {
            let seqs = &mut d.model.seqs;
            if from == to || from.max(to) >= seqs.len() {
                return Err(internal("forking a sequence slot the device does not hold"));
            }
            let (low, high) = seqs.split_at_mut(from.max(to));
            let (src, dst) = if from < to {
                (&low[from], &mut high[0])
            } else {
                (&high[0], &mut low[to])
            };
            dst.copy_from(&d.model.gpu, src, len)?;
        }
        Ok(())
    }

    fn remove_sequence(&mut self, seq: usize) {
        self.host.remove_sequence(seq);
    }

    fn reserve(&mut self, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
        self.host.begin_evaluation(chunks);
        let reserved = self.host.reserve(chunks);
        // Copies the pool made before a failure are harmless to mirror.
        self.mirror_block_copies()?;
        reserved
    }

    /// The host part's pool accounts every sequence's positions in blocks; the device's
    /// attention caches are stored in the same blocks.
    fn kv_usage(&self) -> KvUsage {
        self.host.kv_usage()
    }

    /// The host pool's prefix cache: its blocks hold the device layers' keys and values too.
    /// (A hybrid reuses a prefix only where the host runs every recurrent layer and the MTP
    /// head, if any: it keeps their states.)
    fn reuse_prefix(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        seq: usize,
        tokens: &[u32],
    ) -> Result<usize, PluginError> {
        self.host.reuse_prefix(model, pool, seq, tokens)
    }

    fn forward(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunks: &[Chunk<'_>],
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError> {
        let Self {
            placement,
            host,
            device,
            ..
        } = self;
        let e = model.graph.n_embd();
        let vocab = model.hparams.vocab_size as usize;
        let spans = Chunk::spans(chunks);
        let rows = Rows::new(&spans);
        let m = rows.n;
        let n_logits = rows.logit_rows();
        pool.install(|| host.run_layers(model, chunks))?;
        let Some(d) = device.as_mut().filter(|_| placement.uses_gpu()) else {
            return pool.install(|| host.head(model, &rows, hidden, logits));
        };
        d.model.gpu.begin_pass(longest_span(&spans))?;
        let passed = (|| {
            sync_block_tables(host, &mut d.model, chunks)?;
            d.pinned_in.as_mut_slice()?[..m * e].copy_from_slice(&host.residual()[..m * e]);
            let gpu_model = &mut d.model;
            let x = gpu_model.scratch.act_mut(Act::X);
            gpu_model.gpu.copy_to_device(&d.pinned_in, m * e, x, 0)?;
            gpu_model.forward_layers(model, &rows)?;
            if placement.head_on_gpu {
                gpu_model.head(model, &rows)?;
                hand_back(d, m * e, n_logits * vocab, hidden, logits)
            } else {
                let (gpu, scratch) = (&gpu_model.gpu, &gpu_model.scratch);
                gpu.copy_to_host(scratch.act(Act::X), 0, m * e, &mut d.pinned_hidden)?;
                gpu.sync()?;
                host.residual()[..m * e].copy_from_slice(&pinned(&d.pinned_hidden)?[..m * e]);
                pool.install(|| host.head(model, &rows, hidden, logits))
            }
        })();
        if passed.is_err() {
            d.model.gpu.abandon_pass();
        }
        passed
    }

    fn commit(&mut self, seq: usize, start: usize, n: usize, tokens: &[u32]) {
        self.host.commit(seq, start, n, tokens);
        if let Some(ring) = self.device_ring(seq) {
            ring.index.advance(n);
        }
    }

    fn rollback(&mut self, seq: usize, len: usize) -> Result<bool, PluginError> {
        if !self.host.rollback(seq, len)? {
            return Ok(false);
        }
        if let Some(ring) = self.device_ring(seq) {
            if !ring.index.restore(len) {
                return Err(internal("the host and device snapshot rings disagree"));
            }
        }
        Ok(true)
    }

    /// The host part keeps the path in its layers' caches (and the pool's blocks); the
    /// device's attention caches, stored in the same blocks, move the same rows, and its
    /// snapshot ring keeps the path's states as the host's does.
    fn keep_path(&mut self, seq: usize, kept: KeptPath<'_>) -> Result<(), PluginError> {
        let (base, path) = (kept.base, kept.path);
        let n =
            self.host.positions(seq).ok_or_else(|| {
                internal("keeping a tree path of a sequence the host does not hold")
            })? - base;
        if let Some(d) = self.device.as_mut().filter(|_| self.placement.uses_gpu()) {
            if let Some(ring) = d.model.seqs.get_mut(seq).and_then(|s| s.ring.as_mut()) {
                ring.keep_path(&d.model.gpu, n, path)?;
            }
            let table = self.host.block_table(seq).ok_or_else(|| {
                internal("keeping a tree path of a sequence the host does not hold")
            })?;
            let row = |pos: usize| {
                table
                    .get(pos / BLOCK_TOKENS)
                    .map(|&b| b as usize * BLOCK_TOKENS + pos % BLOCK_TOKENS)
                    .ok_or_else(|| internal("a tree row beyond the sequence's blocks"))
            };
            for (k, &node) in path.iter().enumerate() {
                let (from, to) = (base + node as usize, base + k);
                if from != to {
                    d.model.kv.copy_row(&d.model.gpu, row(from)?, row(to)?)?;
                }
            }
        }
        self.host.keep_path(seq, kept)
    }

    fn window(&self, seq: usize, seq_len: usize) -> std::ops::RangeInclusive<usize> {
        self.host.window(seq, seq_len)
    }

    fn reset(&mut self, seq: usize) -> Result<(), PluginError> {
        self.host.reset(seq)?;
        self.reset_device(seq)
    }

    fn mtp(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunks: &[MtpRows<'_>],
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError> {
        let Some(d) = self.device.as_mut().filter(|_| self.placement.head_on_gpu) else {
            return self.host.mtp(model, pool, chunks, logits, hidden_out);
        };
        let weights = model
            .graph
            .mtp()
            .ok_or_else(|| internal("MTP step on a model without the head"))?;
        let e = model.graph.n_embd();
        let vocab = model.hparams.vocab_size as usize;
        let spans = MtpRows::spans(chunks);
        let rows = Rows::new(&spans);
        let m = rows.n;
        let n_logits = rows.logit_rows();
        d.model.gpu.begin_pass(longest_span(&spans))?;
        let passed = (|| {
            MtpRows::write_all_inputs(
                chunks,
                &weights.embed.view(&model.file)?,
                d.pinned_in.as_mut_slice()?,
            );
            let gpu_model = &mut d.model;
            let input = gpu_model.scratch.act_mut(Act::MtpIn);
            gpu_model
                .gpu
                .copy_to_device(&d.pinned_in, m * 2 * e, input, 0)?;
            gpu_model.mtp(model, &rows)?;
            hand_back(d, m * e, n_logits * vocab, hidden_out, logits)
        })();
        if passed.is_err() {
            d.model.gpu.abandon_pass();
        }
        passed
    }
}

/// Ends a pass whose head ran on the GPU: its final-norm hidden states (`hidden_values`
/// floats) and logits (`logit_values`) copied back through the pinned buffers.
fn hand_back(
    d: &mut DeviceState,
    hidden_values: usize,
    logit_values: usize,
    hidden: &mut [f32],
    logits: &mut [f32],
) -> Result<(), PluginError> {
    let (gpu, scratch) = (&d.model.gpu, &d.model.scratch);
    gpu.copy_to_host(
        scratch.act(Act::Hidden),
        0,
        hidden_values,
        &mut d.pinned_hidden,
    )?;
    gpu.copy_to_host(
        &scratch.extras.logits,
        0,
        logit_values,
        &mut d.pinned_logits,
    )?;
    gpu.sync()?;
    hidden.copy_from_slice(&pinned(&d.pinned_hidden)?[..hidden_values]);
    logits.copy_from_slice(&pinned(&d.pinned_logits)?[..logit_values]);
    Ok(())
}

/// Makes the host pool's copy-on-write copies in the device's trunk caches; the ones a
/// failure left unmade go back to the pool, first in line for the next try.
fn mirror_copies(host: &mut CpuExecutor, m: &mut GpuModel) -> Result<(), PluginError> {
    let copies = host.take_block_copies();
    for (i, &(from, to)) in copies.iter().enumerate() {
        if let Err(e) = m.kv.copy_block(&m.gpu, from as usize, to as usize) {
            host.return_block_copies(copies[i..].to_vec());
            return Err(e);
        }
    }
    Ok(())
}

/// Makes the device's trunk caches follow the host pool before a pass: the pool's
/// copy-on-write copies, and the block tables of the pass's sequences.
fn sync_block_tables(
    host: &mut CpuExecutor,
    m: &mut GpuModel,
    chunks: &[Chunk<'_>],
) -> Result<(), PluginError> {
    mirror_copies(host, m)?;
    for chunk in chunks {
        let table = host
            .block_table(chunk.seq)
            .ok_or_else(|| internal("a pass over a sequence slot the host does not hold"))?;
        if table.len() > m.table_len || table.len() * BLOCK_TOKENS < chunk.pos0 + chunk.rows() {
            return Err(internal(
                "a sequence's block table does not fit its positions or the device's table",
            ));
        }
        // The whole row of the device's table, the same copy whatever the sequence's length
        // (with CUDA graphs a pass's copies are part of its graph's key: a table growing a
        // block would otherwise make a new graph).
        let mut row = table.to_vec();
        row.resize(m.table_len, 0);
        m.gpu.write(&row, &mut m.tables, chunk.seq * m.table_len)?;
    }
    Ok(())
}

impl CudaExecutor {
    /// Copies the host pool's copy-on-write copies into the device's trunk caches.
    fn mirror_block_copies(&mut self) -> Result<(), PluginError> {
        match &mut self.device {
            Some(d) => mirror_copies(&mut self.host, &mut d.model),
            None => Ok(()),
        }
    }

    /// The device half of sequence slot `seq`'s ring, where the GPU runs GDN layers.
    fn device_ring(&mut self, seq: usize) -> Option<&mut DeviceRing> {
        self.device
            .as_mut()
            .and_then(|d| d.model.seqs.get_mut(seq))
            .and_then(|s| s.ring.as_mut())
    }

    /// Sequence slot `seq`'s device state back to empty (its ring; the caches are cut by
    /// length).
    fn reset_device(&mut self, seq: usize) -> Result<(), PluginError> {
        if let Some(d) = &mut self.device {
            if let Some(ring) = d.model.seqs.get_mut(seq).and_then(|s| s.ring.as_mut()) {
                ring.reset(&d.model.gpu)?;
            }
        }
        Ok(())
    }
}

/// The most rows any one sequence has in a pass (a prompt's prefill chunk, or a verify pass's
/// drafts): what decides whether the pass is recorded for CUDA graphs.
fn longest_span(spans: &[specula_engine::graph::Span<'_>]) -> usize {
    spans.iter().map(|span| span.n).max().unwrap_or(0)
}
