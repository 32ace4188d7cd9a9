//! The [`ForwardPass`] of cuda-hybrid: one model, one sequence, split between the host and
//! one GPU.
//!
//! **Placement** (see [`crate::placement`]): trunk layers `0 .. first_gpu_layer` run on the
//! host through the layer code of `specula-cpu-engine` (the code cpu-simd runs, on a private
//! rayon pool), layers `first_gpu_layer ..` and the head (final norm, LM head, MTP block) on
//! the GPU. A pass embeds its tokens on the host, runs the host layers, hands the residual
//! rows to the GPU through a pinned buffer, runs the GPU layers and head, and copies the final
//! hidden states and the requested logits back through pinned buffers.
//!
//! **Sequence state** lives where its layer runs: the KV cache of host attention layers in
//! host memory, of GPU attention layers (and the MTP head) in device memory; the recurrent
//! state of Gated DeltaNet layers in a **snapshot ring** of `depth + 1` planes, split the same
//! way — a host [`SnapshotRing`] for the host GDN layers and a device ring for the GPU ones.
//! Both halves share one bookkeeping rule ([`specula_cpu_engine::recurrent::RingIndex`]) and
//! are advanced and restored together, so rollback inside the window is O(1) on both sides:
//! no state is copied, the plane of the kept length becomes the live one. Beyond the window
//! the backend re-decodes the kept prefix (option `deep_rollback = "redecode"`, the default)
//! or refuses (`"refuse"`), as cpu-simd does.
//!
//! **Parity.** Every kernel computes a row of a k-row evaluation exactly as a one-row
//! evaluation at the same position (see `kernels/*.cu`), and the host layers are cpu-simd's;
//! so a verify row is bit-identical to the single-token forward, which the host's speculative
//! loop relies on. GPU results are close to, not bit-identical with, cpu-simd's.

use std::path::Path;

use abi_stable::std_types::{RSlice, RVec};
use std::sync::Arc;

use rayon::{ThreadPool, ThreadPoolBuilder};
use specula_cpu_engine::arch::hybrid::{self, HybridModel, HybridScratch, Mixer, TrunkState};
use specula_cpu_engine::arch::{forward_dense_layer, Scratch};
use specula_cpu_engine::blocks::ffn::FfnBlock;
use specula_cpu_engine::blocks::mtp::{self, MtpWeights};
use specula_cpu_engine::kv_cache::{KvCache, KvType};
use specula_cpu_engine::model::weights::MatrixRef;
use specula_cpu_engine::model::{Graph, MatrixSite, Model};
use specula_cpu_engine::recurrent::SnapshotRing;
use specula_kernels::{matmul, ops, MatmulScratch, WeightMatrix};
use specula_plugin_api::{
    guard, BackendParams, Capabilities, ErrorKind, ForwardPass, LogitRows, ModelInfo, PanicFence,
    PluginError, PluginResult,
};

/// The plugin's name in error messages.
const PLUGIN: &str = "cuda-hybrid";

use crate::driver;
use crate::gpu::emulator::Emulator;
use crate::gpu::layers::{DeviceKv, GpuModel, GpuPlan, Shapes};
use crate::gpu::{Gpu, HostBuf};
use crate::options::{DeepRollback, Options, OPTION_DEEP_ROLLBACK};
use crate::placement::{self, Costs, LayerCost, Placement};

/// `max_verify_tokens` advertised when the host passes 0.
pub const DEFAULT_MAX_VERIFY_TOKENS: u32 = 8;

/// Rows pushed through the layers together; longer evaluations run in chunks (no result
/// depends on the chunking).
const MIN_BATCH_ROWS: usize = 64;

/// Device memory kept free by default: this share of the device's memory, at least
/// [`MIN_RESERVE`].
const RESERVE_SHARE: f64 = 0.05;
const MIN_RESERVE: u64 = 256 << 20;
/// Charged on top of the scratch buffers for kernel modules and allocator slack.
const FIXED_SLACK: u64 = 32 << 20;

fn internal(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, format!("cuda-hybrid: {what}"))
}

/// Errors of the shared model loader name cpu-simd; here they are cuda-hybrid's.
fn rebrand(e: PluginError) -> PluginError {
    PluginError::new(
        e.kind,
        e.message.as_str().replace("cpu-simd", "cuda-hybrid"),
    )
}

/// The host half's scratch, by model family.
enum HostScratch {
    Dense(Box<Scratch>),
    Hybrid(Box<HybridScratch>),
}

impl HostScratch {
    fn x(&mut self) -> &mut [f32] {
        match self {
            HostScratch::Dense(s) => &mut s.x,
            HostScratch::Hybrid(s) => &mut s.x,
        }
    }

    fn matmul(&mut self) -> &mut MatmulScratch {
        match self {
            HostScratch::Dense(s) => &mut s.matmul,
            HostScratch::Hybrid(s) => &mut s.matmul,
        }
    }
}

/// The host half of the sequence state.
struct HostState {
    /// KV cache of the host attention layers (the first ones of the model).
    kv: KvCache,
    /// Snapshot ring of the host GDN layers (hybrid models; possibly of zero layers, it then
    /// only keeps the bookkeeping).
    ring: Option<SnapshotRing>,
    /// The MTP head's cache when the head runs on the host.
    mtp_kv: Option<KvCache>,
    scratch: HostScratch,
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

/// A model opened on the GPU (and the host) with its sequence state.
pub struct CudaBackend {
    pool: ThreadPool,
    model: Model,
    info: ModelInfo,
    capabilities: Capabilities,
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
    placement: Placement,
    host: HostState,
    device: Option<DeviceState>,
    batch_rows: usize,
    n_ctx: usize,
    /// Tokens in the sequence.
    seq_len: usize,
    /// Every token of the sequence (the slow rollback path replays them).
    tokens: Vec<u32>,
    /// Final-norm hidden states of the rows of the last eval.
    hidden: Vec<f32>,
    hidden_rows: usize,
    /// Entries in the MTP head's cache (`None` without a head).
    mtp_len: Option<usize>,
    /// Gated DeltaNet layers in the whole model.
    n_gdn_layers: usize,
    deep_rollback: DeepRollback,
    slow_rollbacks: u64,
    device_description: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("model", &self.model)
            .field("placement", &self.placement)
            .field("device", &self.device_description)
            .field("seq_len", &self.seq_len)
            .finish_non_exhaustive()
    }
}

/// Bytes of the weights of one hybrid layer (all experts of an MoE FFN).
fn hybrid_layer_bytes(layer: &hybrid::HybridLayer) -> u64 {
    let mixer = match &layer.mixer {
        Mixer::Gdn { weights, .. } => weights.bytes_per_token(),
        Mixer::Attention { weights, .. } => weights.bytes_per_token(),
    };
    let norms = 4 * (layer.attn_norm.len() + layer.post_attention_norm.len()) as u64;
    mixer + ffn_bytes(&layer.ffn) + norms
}

fn ffn_bytes(ffn: &FfnBlock) -> u64 {
    match ffn {
        FfnBlock::Dense { gate, up, down } => gate.n_bytes() + up.n_bytes() + down.n_bytes(),
        FfnBlock::Moe(w) => w.bytes_per_token(w.gate_exps.n_expert),
    }
}

fn mtp_bytes(w: &MtpWeights, output: &MatrixRef) -> u64 {
    let vectors = w.enorm.len()
        + w.hnorm.len()
        + w.attn_norm.len()
        + w.post_attention_norm.len()
        + w.head_norm.len();
    let head = if w.head.name == output.name {
        0
    } else {
        w.head.n_bytes()
    };
    w.eh_proj.n_bytes()
        + w.attention.bytes_per_token()
        + ffn_bytes(&w.ffn)
        + 4 * vectors as u64
        + head
}

/// What every placeable part of `graph` costs on the device.
fn costs(graph: &Graph, n_ctx: usize, n_planes: usize, rows: usize) -> Costs {
    match graph {
        Graph::Dense(d) => {
            let a = &d.config.attention;
            let state = DeviceKv::bytes(1, n_ctx, a.k_width(), a.v_width());
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
                fixed: Shapes::dense(&d.config, w.output.rows).scratch_bytes(rows, n_ctx)
                    + FIXED_SLACK,
            }
        }
        Graph::Hybrid(h) => {
            let HybridModel {
                config, weights, ..
            } = &**h;
            let a = &config.attention;
            let kv = DeviceKv::bytes(1, n_ctx, a.k_width(), a.v_width());
            let ring = config.gdn.state_layout(1).plane_bytes() * n_planes as u64;
            let mtp = weights
                .mtp
                .as_ref()
                .map_or(0, |m| mtp_bytes(m, &weights.output) + kv);
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
                fixed: Shapes::hybrid(config).scratch_bytes(rows, n_ctx) + FIXED_SLACK,
            }
        }
    }
}

/// Whether [`CudaBackend::open_with`] may use a GPU.
#[derive(Debug, Clone)]
enum Mode {
    Gpu,
    HostOnly,
    /// The host emulator of the kernels, pretending to have this much device memory.
    Emulated(Arc<Emulator>, u64),
}

impl CudaBackend {
    /// Opens the model named by `params` on the GPU (and, for what does not fit, the host).
    ///
    /// Fails with a clear error, before touching cudarc, when the CUDA driver or NVRTC cannot
    /// be loaded.
    pub fn open(params: &BackendParams) -> Result<Self, PluginError> {
        let options = Options::parse(params)?;
        driver::probe_driver()?;
        driver::ensure_nvrtc(options.nvrtc_path.as_deref())?;
        Self::open_with(params, &options, Mode::Gpu)
    }

    /// Checks `params` as [`open`](Self::open) does — the options, that the CUDA driver
    /// loads, and the model file's header, tensor records and shapes — without touching the
    /// GPU, reading weights or allocating caches.
    pub fn probe(params: &BackendParams) -> Result<ModelInfo, PluginError> {
        Options::parse(params)?;
        driver::probe_driver()?;
        let path = Path::new(params.model_path.as_str());
        let model = Model::load(path).map_err(|e| rebrand(e.into()))?;
        Ok(model.info(model.context_size(params.context_size)))
    }

    /// Opens the model with every layer on the host, without looking for a GPU: the
    /// host-side machinery of this backend (placement suffix of zero, host ring, rollback,
    /// the MTP step) on machines without CUDA. For tests; profiles always get [`open`].
    ///
    /// [`open`]: CudaBackend::open
    #[doc(hidden)]
    pub fn open_host_only(params: &BackendParams) -> Result<Self, PluginError> {
        let options = Options::parse(params)?;
        Self::open_with(params, &options, Mode::HostOnly)
    }

    /// Opens the model with the host emulator of the kernels standing in for the GPU
    /// ([`crate::gpu::emulator`]), which pretends to have `memory` bytes of device memory: the
    /// whole device path on machines without CUDA, slowly. For tests.
    #[doc(hidden)]
    pub fn open_emulated(
        params: &BackendParams,
        emulator: Arc<Emulator>,
        memory: u64,
    ) -> Result<Self, PluginError> {
        let options = Options::parse(params)?;
        Self::open_with(params, &options, Mode::Emulated(emulator, memory))
    }

    fn open_with(
        params: &BackendParams,
        options: &Options,
        mode: Mode,
    ) -> Result<Self, PluginError> {
        let path = Path::new(params.model_path.as_str());
        let mut model = Model::load(path).map_err(|e| rebrand(e.into()))?;
        let hp = model.hparams.clone();
        let n_ctx = model.context_size(params.context_size);
        if params.context_size > n_ctx {
            tracing::warn!(
                "cuda-hybrid: context size {} exceeds the {n_ctx} tokens {} was trained for; using {n_ctx}",
                params.context_size,
                path.display()
            );
        }
        let n_ctx = n_ctx as usize;
        let threads = match params.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n as usize,
        };
        let pool = ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cuda-hybrid-cpu-{i}"))
            .build()
            .map_err(|e| internal(&format!("cannot start {threads} worker threads: {e}")))?;
        let requested_verify = match params.max_verify_tokens {
            0 => DEFAULT_MAX_VERIFY_TOKENS,
            n => n,
        } as usize;

        // The ring depth comes first: it sizes the device ring the placement charges for.
        let (n_gdn_layers, n_planes) = match &model.graph {
            Graph::Dense(_) => (0, 2),
            Graph::Hybrid(h) => {
                let n_gdn = h.config.n_gdn_layers;
                let plane = h.config.gdn.state_layout(n_gdn).plane_bytes().max(1);
                let mut n_planes = requested_verify + 1;
                if let Some(budget) = options.ring_budget_bytes {
                    n_planes = n_planes.min(usize::try_from(budget / plane).unwrap_or(usize::MAX));
                }
                if n_planes < 2 {
                    return Err(PluginError::new(
                        ErrorKind::OutOfMemory,
                        format!(
                            "cuda-hybrid: the recurrent-state ring needs at least 2 slots of {plane} bytes; the budget {} = {} holds {n_planes}",
                            crate::options::OPTION_RING_BUDGET_BYTES,
                            options.ring_budget_bytes.unwrap_or(0)
                        ),
                    ));
                }
                if n_planes < requested_verify + 1 {
                    tracing::warn!(
                        "cuda-hybrid: the recurrent-state ring of {} holds {} snapshots of {plane} bytes instead of the {requested_verify} asked for; verify batches and rollback are limited to {} tokens",
                        path.display(),
                        n_planes - 1,
                        n_planes - 1
                    );
                }
                (n_gdn, n_planes)
            }
        };
        let depth = n_planes - 1;
        let batch_rows = MIN_BATCH_ROWS.max(depth);
        let n_layers = model.graph.n_trunk_layers();

        // Open the device and decide the placement.
        let (gpu, placement) = match mode {
            Mode::HostOnly => (None, Placement::cpu_only(n_layers)),
            Mode::Gpu | Mode::Emulated(..) => {
                let gpu = match mode {
                    Mode::Emulated(emulator, memory) => Gpu::emulated(emulator, memory),
                    _ => Gpu::open(options.device, options.kernel_cache.as_deref())?,
                };
                let budget = options.vram_budget.unwrap_or_else(|| {
                    let reserve =
                        ((gpu.info.total_memory as f64 * RESERVE_SHARE) as u64).max(MIN_RESERVE);
                    gpu.info.free_memory.saturating_sub(reserve)
                });
                let costs = costs(&model.graph, n_ctx, n_planes, batch_rows);
                let placement =
                    placement::place(&costs, options.gpu_layers, budget).map_err(|e| {
                        PluginError::new(
                            ErrorKind::OutOfMemory,
                            format!(
                                "cuda-hybrid: gpu_layers = {} (and the head) need {} MiB of GPU memory, but the budget is {} MiB (option vram_budget, else the free memory of {} minus a reserve); lower gpu_layers or the context size",
                                e.asked,
                                e.needed >> 20,
                                e.budget >> 20,
                                gpu.info.name
                            ),
                        )
                    })?;
                if !placement.uses_gpu() {
                    tracing::warn!(
                        "cuda-hybrid: nothing fits in the GPU memory budget of {} MiB; every layer runs on the CPU",
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
        .map_err(rebrand)?;

        // The host half.
        let host = match &model.graph {
            Graph::Dense(d) => HostState {
                kv: KvCache::new(first_gpu, n_ctx, &d.config.attention, KvType::F32),
                ring: None,
                mtp_kv: None,
                scratch: HostScratch::Dense(Box::new(Scratch::new(&d.config, batch_rows, n_ctx))),
            },
            Graph::Hybrid(h) => {
                let config = &h.config;
                let host_layers = &h.weights.layers[..first_gpu];
                let host_gdn = host_layers
                    .iter()
                    .filter(|l| matches!(l.mixer, Mixer::Gdn { .. }))
                    .count();
                let host_attention = host_layers.len() - host_gdn;
                let layout = config.gdn.state_layout(host_gdn);
                let (ring, size) = SnapshotRing::allocate(layout, depth, None).map_err(rebrand)?;
                if size.depth < depth {
                    return Err(PluginError::new(
                        ErrorKind::OutOfMemory,
                        format!(
                            "cuda-hybrid: cannot allocate {depth} host snapshots of {} bytes",
                            layout.plane_bytes()
                        ),
                    ));
                }
                let a = &config.attention;
                let mtp_kv = (h.weights.mtp.is_some() && !placement.head_on_gpu)
                    .then(|| KvCache::new(1, n_ctx, a, KvType::F32));
                HostState {
                    kv: KvCache::new(host_attention, n_ctx, a, KvType::F32),
                    ring: Some(ring),
                    mtp_kv,
                    scratch: HostScratch::Hybrid(Box::new(HybridScratch::new(
                        config, batch_rows, n_ctx,
                    ))),
                }
            }
        };

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
                let vocab = hp.vocab_size as usize;
                let pinned_in = gpu.pinned(batch_rows * 2 * e)?;
                let pinned_hidden = gpu.pinned(batch_rows * e)?;
                let pinned_logits = gpu.pinned(batch_rows * vocab)?;
                let plan = GpuPlan {
                    first_layer: first_gpu,
                    head: placement.head_on_gpu,
                    n_ctx,
                    n_planes,
                    rows: batch_rows,
                };
                let model = GpuModel::build(gpu, &model.file, &model.graph, plan)?;
                Some(DeviceState {
                    model,
                    pinned_in,
                    pinned_hidden,
                    pinned_logits,
                })
            }
            _ => None,
        };

        let has_mtp_head = matches!(&model.graph, Graph::Hybrid(h) if h.weights.mtp.is_some());
        let (max_verify, rollback_depth, snapshot_bytes) = match &model.graph {
            Graph::Dense(_) => (requested_verify as u32, u32::MAX, 0),
            Graph::Hybrid(h) => {
                let plane = h.config.gdn.state_layout(n_gdn_layers).plane_bytes();
                if n_gdn_layers == 0 {
                    (depth as u32, u32::MAX, plane)
                } else {
                    (depth as u32, depth as u32, plane)
                }
            }
        };
        let capabilities = Capabilities {
            max_verify_tokens: max_verify,
            rollback_depth,
            hidden_state_export: true,
            mtp_head: has_mtp_head,
            snapshot_bytes_per_slot: snapshot_bytes,
        };
        let info = model.info(n_ctx as u32);
        tracing::info!(
            "cuda-hybrid: {}: {} of {n_layers} layers on the GPU{} ({} MiB of device memory), the rest on {threads} CPU threads; GPU: {device_description}",
            path.display(),
            placement.gpu_layers(),
            if placement.head_on_gpu { " with the head" } else { "" },
            placement.bytes >> 20,
        );
        Ok(Self {
            pool,
            info,
            capabilities,
            fence: PanicFence::default(),
            placement,
            host,
            device,
            batch_rows,
            n_ctx,
            seq_len: 0,
            tokens: Vec::with_capacity(n_ctx),
            hidden: Vec::new(),
            hidden_rows: 0,
            mtp_len: has_mtp_head.then_some(0),
            n_gdn_layers,
            deep_rollback: options.deep_rollback,
            slow_rollbacks: 0,
            device_description,
            model,
        })
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// What this instance can do.
    pub fn caps(&self) -> Capabilities {
        self.capabilities
    }

    /// Where the layers run.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The GPU in use, in words.
    pub fn device_description(&self) -> &str {
        &self.device_description
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.seq_len
    }

    pub fn is_empty(&self) -> bool {
        self.seq_len == 0
    }

    /// How many truncations went beyond the snapshot ring and re-decoded.
    pub fn slow_rollbacks(&self) -> u64 {
        self.slow_rollbacks
    }

    /// Entries in the MTP head's KV cache (`None` without a head).
    pub fn mtp_len(&self) -> Option<usize> {
        self.mtp_len
    }

    /// The sequence lengths [`truncate_to`](Self::truncate_to) restores in O(1).
    pub fn rollback_window(&self) -> std::ops::RangeInclusive<usize> {
        match &self.host.ring {
            Some(ring) if self.n_gdn_layers > 0 => ring.window(),
            _ => 0..=self.seq_len,
        }
    }

    /// Final-norm hidden states of every row of the last eval (`rows × hidden_size`).
    pub fn last_hidden_states(&self) -> &[f32] {
        &self.hidden[..self.hidden_rows * self.model.graph.n_embd()]
    }

    fn validate(&self, tokens: &[u32]) -> Result<(), PluginError> {
        if tokens.is_empty() {
            return Err(PluginError::invalid_input(
                "cuda-hybrid: eval called with no tokens",
            ));
        }
        let vocab = self.model.hparams.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(PluginError::invalid_input(format!(
                "cuda-hybrid: token id {bad} is out of range (vocabulary size {vocab})"
            )));
        }
        if self.seq_len + tokens.len() > self.n_ctx {
            return Err(PluginError::new(
                ErrorKind::ContextFull,
                format!(
                    "cuda-hybrid: context full: {} tokens in the sequence + {} new exceed the context size {}",
                    self.seq_len,
                    tokens.len(),
                    self.n_ctx
                ),
            ));
        }
        Ok(())
    }

    /// [`ForwardPass::eval`] without the panic guard.
    pub fn eval_tokens(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.validate(tokens)?;
        self.forward(tokens, rows, logits)
    }

    /// Evaluates `tokens` after the sequence (already validated).
    fn forward(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        let Self {
            pool,
            model,
            placement,
            host,
            device,
            batch_rows,
            seq_len,
            hidden,
            hidden_rows,
            ..
        } = self;
        let file = &model.file;
        let graph = &model.graph;
        let e = graph.n_embd();
        let eps = graph.rms_eps();
        let vocab = model.hparams.vocab_size as usize;
        let n = tokens.len();
        let start = *seq_len;
        let first_gpu = placement.first_gpu_layer;
        let n_logits = rows.count(n);

        *hidden_rows = 0;
        hidden.resize(n * e, 0.0);
        logits.clear();
        logits.resize(n_logits * vocab, 0.0);
        let embedding = graph.token_embd().view(file)?;
        let output = graph.output().view(file)?;

        for (chunk_index, chunk) in tokens.chunks(*batch_rows).enumerate() {
            let first = chunk_index * *batch_rows;
            let m = chunk.len();
            let pos0 = start + first;
            // Rows `logit_from .. m` of this chunk get logits, at logit row `logit_to ..`.
            let (logit_from, logit_to) = match rows {
                LogitRows::All => (0, first),
                LogitRows::Last if first + m == n => (m - 1, 0),
                _ => (m, 0),
            };

            // Host: embedding and the host layers.
            pool.install(|| -> Result<(), PluginError> {
                embed(&embedding, chunk, host.scratch.x(), e);
                match (graph, &mut host.scratch) {
                    (Graph::Dense(dense), HostScratch::Dense(s)) => {
                        for layer in 0..first_gpu {
                            forward_dense_layer(file, dense, layer, m, pos0, s, &mut host.kv)?;
                        }
                    }
                    (Graph::Hybrid(h), HostScratch::Hybrid(s)) => {
                        let ring = host
                            .ring
                            .as_mut()
                            .ok_or_else(|| internal("hybrid model without a host ring"))?;
                        let mut trunk = TrunkState {
                            kv: &mut host.kv,
                            ring,
                        };
                        for layer in 0..first_gpu {
                            hybrid::forward_layer(h, file, layer, m, pos0, first, s, &mut trunk)?;
                        }
                    }
                    _ => return Err(internal("model family and scratch disagree")),
                }
                Ok(())
            })?;

            let chunk_hidden = &mut hidden[first * e..(first + m) * e];
            let chunk_logits = &mut logits[logit_to * vocab..(logit_to + m - logit_from) * vocab];
            match device {
                Some(d) if placement.uses_gpu() => {
                    let gpu = &d.model.gpu;
                    d.pinned_in.as_mut_slice()?[..m * e]
                        .copy_from_slice(&host.scratch.x()[..m * e]);
                    gpu.copy_to_device(&d.pinned_in, m * e, &mut d.model.scratch.x, 0)?;
                    d.model.forward_layers(m, pos0, first)?;
                    if placement.head_on_gpu {
                        d.model.head(m, logit_from)?;
                        gpu.copy_to_host(&d.model.scratch.hidden, 0, m * e, &mut d.pinned_hidden)?;
                        let n_rows = m - logit_from;
                        gpu.copy_to_host(
                            &d.model.scratch.logits,
                            0,
                            n_rows * vocab,
                            &mut d.pinned_logits,
                        )?;
                        gpu.sync()?;
                        chunk_hidden.copy_from_slice(&pinned(&d.pinned_hidden)?[..m * e]);
                        chunk_logits.copy_from_slice(&pinned(&d.pinned_logits)?[..n_rows * vocab]);
                    } else {
                        gpu.copy_to_host(&d.model.scratch.x, 0, m * e, &mut d.pinned_hidden)?;
                        gpu.sync()?;
                        host.scratch.x()[..m * e]
                            .copy_from_slice(&pinned(&d.pinned_hidden)?[..m * e]);
                        host_head(
                            pool,
                            &mut host.scratch,
                            graph,
                            &output,
                            eps,
                            m,
                            logit_from,
                            chunk_hidden,
                            chunk_logits,
                        );
                    }
                }
                _ => host_head(
                    pool,
                    &mut host.scratch,
                    graph,
                    &output,
                    eps,
                    m,
                    logit_from,
                    chunk_hidden,
                    chunk_logits,
                ),
            }
        }
        *seq_len = start + n;
        host.kv.set_len(start + n);
        if let Some(ring) = &mut host.ring {
            ring.advance(n);
        }
        if let Some(ring) = device.as_mut().and_then(|d| d.model.ring.as_mut()) {
            ring.index.advance(n);
        }
        self.tokens.extend_from_slice(tokens);
        self.hidden_rows = n;
        Ok(())
    }

    /// [`ForwardPass::truncate`] without the panic guard.
    pub fn truncate_to(&mut self, len: usize) -> Result<(), PluginError> {
        if len > self.seq_len {
            return Err(PluginError::invalid_input(format!(
                "cuda-hybrid: cannot truncate to {len} tokens: the sequence has only {}",
                self.seq_len
            )));
        }
        if let Some(m) = &mut self.mtp_len {
            *m = (*m).min(len);
        }
        if let Some(kv) = &mut self.host.mtp_kv {
            kv.set_len(kv.len().min(len));
        }
        let device_ring = self.device.as_mut().and_then(|d| d.model.ring.as_mut());
        match &mut self.host.ring {
            None => {}
            Some(ring) if self.n_gdn_layers == 0 => {
                // No recurrent layer: only the KV cache to cut.
                ring.reset();
                ring.advance(len);
            }
            Some(ring) if ring.window().contains(&len) => {
                let restored = ring.restore(len);
                let device_restored = device_ring.is_none_or(|r| r.index.restore(len));
                if !(restored && device_restored) {
                    return Err(internal("the host and device snapshot rings disagree"));
                }
            }
            Some(ring) => {
                let window = ring.window();
                let depth = ring.depth();
                return match self.deep_rollback {
                    DeepRollback::Refuse => Err(PluginError::invalid_input(format!(
                        "cuda-hybrid: cannot truncate to {len} tokens: the recurrent state is kept only for lengths {}..={} (rollback depth {depth}), and option '{OPTION_DEEP_ROLLBACK}' = 'refuse' forbids re-decoding",
                        window.start(),
                        window.end()
                    ))),
                    DeepRollback::Redecode => {
                        tracing::debug!(
                            "cuda-hybrid: truncating to {len} tokens is outside the rollback window {}..={}; re-decoding them",
                            window.start(),
                            window.end()
                        );
                        self.redecode(len)
                    }
                };
            }
        }
        self.tokens.truncate(len);
        self.seq_len = len;
        self.host.kv.set_len(len);
        Ok(())
    }

    /// The slow rollback path: back to the empty state, then one pass over the kept tokens.
    fn redecode(&mut self, len: usize) -> Result<(), PluginError> {
        self.slow_rollbacks += 1;
        let replay = self.tokens[..len].to_vec();
        if let Some(ring) = &mut self.host.ring {
            ring.reset();
        }
        if let Some(d) = &mut self.device {
            if let Some(ring) = &mut d.model.ring {
                ring.reset(&d.model.gpu)?;
            }
        }
        self.tokens.clear();
        self.seq_len = 0;
        self.host.kv.set_len(0);
        if replay.is_empty() {
            return Ok(());
        }
        let hidden = (std::mem::take(&mut self.hidden), self.hidden_rows);
        let mut scratch_logits = RVec::new();
        let result = self.forward(&replay, LogitRows::None, &mut scratch_logits);
        (self.hidden, self.hidden_rows) = hidden;
        result
    }

    /// [`ForwardPass::mtp_eval`] without the panic guard.
    pub fn mtp_eval_into(
        &mut self,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        let no_head = || {
            PluginError::unsupported(format!(
                "cuda-hybrid: {} ({}) has no MTP head",
                self.info.name, self.info.architecture
            ))
        };
        let Graph::Hybrid(model) = &self.model.graph else {
            return Err(no_head());
        };
        let (Some(weights), Some(mtp_len)) = (&model.weights.mtp, self.mtp_len) else {
            return Err(no_head());
        };
        let e = model.config.n_embd;
        let vocab = model.config.n_vocab;
        let n = tokens.len();
        specula_cpu_engine::validate::mtp_input(
            "cuda-hybrid",
            hidden,
            tokens,
            position,
            e,
            vocab,
            mtp_len,
            self.n_ctx,
        )?;
        let n_logits = rows.count(n);
        logits.clear();
        logits.resize(n_logits * vocab, 0.0);
        hidden_out.clear();
        hidden_out.resize(n * e, 0.0);
        let file = &self.model.file;
        let chunk = self.batch_rows;
        let first_logit_row = n - n_logits;
        match &mut self.device {
            Some(d) if self.placement.head_on_gpu => {
                let embed = weights.embed.view(file)?;
                let mut start = 0;
                while start < n {
                    let m = chunk.min(n - start);
                    let logit_from = first_logit_row.max(start).min(start + m) - start;
                    {
                        let input = d.pinned_in.as_mut_slice()?;
                        for i in 0..m {
                            let row = &mut input[i * 2 * e..(i + 1) * 2 * e];
                            embed.dequantize_row(tokens[start + i] as usize, &mut row[..e]);
                            row[e..].copy_from_slice(&hidden[(start + i) * e..(start + i + 1) * e]);
                        }
                    }
                    let gpu = &d.model.gpu;
                    gpu.copy_to_device(&d.pinned_in, m * 2 * e, &mut d.model.scratch.concat, 0)?;
                    d.model.mtp(m, position + start, logit_from)?;
                    let n_rows = m - logit_from;
                    gpu.copy_to_host(&d.model.scratch.hidden, 0, m * e, &mut d.pinned_hidden)?;
                    gpu.copy_to_host(
                        &d.model.scratch.logits,
                        0,
                        n_rows * vocab,
                        &mut d.pinned_logits,
                    )?;
                    gpu.sync()?;
                    hidden_out[start * e..(start + m) * e]
                        .copy_from_slice(&pinned(&d.pinned_hidden)?[..m * e]);
                    if n_rows > 0 {
                        // Rows before `first_logit_row` get no logits; this chunk's first
                        // logit row is logit row `to`.
                        let to = start + logit_from - first_logit_row;
                        logits[to * vocab..(to + n_rows) * vocab]
                            .copy_from_slice(&pinned(&d.pinned_logits)?[..n_rows * vocab]);
                    }
                    start += m;
                }
            }
            _ => {
                let (Some(kv), HostScratch::Hybrid(scratch)) =
                    (&mut self.host.mtp_kv, &mut self.host.scratch)
                else {
                    return Err(internal("MTP head on the host without its cache"));
                };
                let config = &model.config;
                self.pool.install(|| {
                    mtp::forward_chunked(
                        config, weights, file, hidden, tokens, position, kv, scratch, chunk,
                        logits, hidden_out,
                    )
                })?;
            }
        }
        self.mtp_len = Some(position + n);
        Ok(())
    }
}

/// The hand-off buffer's contents (after a [`Gpu::sync`]).
fn pinned(buffer: &HostBuf) -> Result<&[f32], PluginError> {
    buffer.as_slice()
}

/// Writes the embeddings of `tokens` into the first rows of `x`.
fn embed(embedding: &WeightMatrix<'_>, tokens: &[u32], x: &mut [f32], e: usize) {
    for (row, &token) in x.chunks_exact_mut(e).zip(tokens) {
        embedding.dequantize_row(token as usize, row);
    }
}

/// The head on the host: final norm of the `m` rows in the scratch into `hidden`, logits of
/// rows `logit_from ..` into `logits`.
#[allow(clippy::too_many_arguments)]
fn host_head(
    pool: &ThreadPool,
    scratch: &mut HostScratch,
    graph: &Graph,
    output: &WeightMatrix<'_>,
    eps: f32,
    m: usize,
    logit_from: usize,
    hidden: &mut [f32],
    logits: &mut [f32],
) {
    let e = graph.n_embd();
    pool.install(|| {
        for (x, h) in scratch.x()[..m * e]
            .chunks_exact(e)
            .zip(hidden.chunks_exact_mut(e))
        {
            ops::rms_norm(x, graph.output_norm(), eps, h);
        }
        if logit_from < m {
            matmul(output, &hidden[logit_from * e..], logits, scratch.matmul());
        }
    });
}

/// Runs an infallible trait method through [`guard`]; a panic is logged and `fallback` used.
fn guarded<T>(fallback: impl FnOnce() -> T, body: impl FnOnce() -> T) -> T {
    match guard(|| Ok(body())).into_result() {
        Ok(value) => value,
        Err(e) => {
            tracing::error!("{}", e.message);
            fallback()
        }
    }
}

impl ForwardPass for CudaBackend {
    fn model_info(&self) -> ModelInfo {
        guarded(|| self.info.clone(), || self.info.clone())
    }

    fn capabilities(&self) -> Capabilities {
        guarded(|| self.capabilities, || self.capabilities)
    }

    fn seq_len(&self) -> PluginResult<usize> {
        self.fence.guard(PLUGIN, || Ok(self.seq_len))
    }

    fn eval(
        &mut self,
        tokens: RSlice<'_, u32>,
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.fence
            .clone()
            .guard(PLUGIN, || self.eval_tokens(tokens.as_slice(), rows, logits))
    }

    fn truncate(&mut self, len: usize) -> PluginResult<()> {
        self.fence.clone().guard(PLUGIN, || self.truncate_to(len))
    }

    fn hidden_states(&self, out: &mut RVec<f32>) -> PluginResult<()> {
        self.fence.guard(PLUGIN, || {
            out.clear();
            out.extend_from_slice(self.last_hidden_states());
            Ok(())
        })
    }

    fn mtp_eval(
        &mut self,
        hidden: RSlice<'_, f32>,
        tokens: RSlice<'_, u32>,
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.fence.clone().guard(PLUGIN, || {
            self.mtp_eval_into(
                hidden.as_slice(),
                tokens.as_slice(),
                position,
                rows,
                logits,
                hidden_out,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::std_types::RString;

    /// Once a call has panicked, every call that touches the sequence is refused, saying why,
    /// instead of answering from a state the panic may have left half-updated.
    #[test]
    fn after_a_panic_every_call_is_refused() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/models/fixtures/tiny-qwen35-mtp.gguf");
        let params = BackendParams {
            model_path: RString::from(path.to_str().unwrap()),
            threads: 1,
            context_size: 64,
            max_verify_tokens: 4,
            options: RVec::new(),
        };
        let mut backend = CudaBackend::open_host_only(&params).unwrap();
        let fence = backend.fence.clone();
        specula_plugin_api::testing::assert_refuses_every_call_after_a_panic(
            &mut backend,
            &fence,
            PLUGIN,
        );
    }
}
