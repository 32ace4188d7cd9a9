//! The [`ForwardPass`] implementation: one model, one sequence, a private thread pool.
//!
//! **Hybrid models** (qwen35, qwen3next) keep, besides the attention KV cache, the recurrent
//! state of their Gated DeltaNet layers in a [`SnapshotRing`] of `depth + 1` planes, where
//! `depth` is the verify capacity (`BackendParams::max_verify_tokens`, default 8, lowered with
//! a warning when the memory for it cannot be had or exceeds the `ring_budget_bytes` option).
//! Every evaluated token writes its state into the next plane, so:
//!
//! * a k-token verify (k ≤ depth) leaves the state after each of its tokens in the ring;
//! * [`ForwardPass::truncate`] to any length of the last `depth` tokens selects that plane and
//!   cuts the KV cache: O(1), nothing is recomputed. Rolled-back tokens' planes are reused by
//!   the next tokens, and states older than `depth` evaluated tokens are gone, so the window is
//!   "the last `depth` tokens evaluated, back to where the sequence still agrees with them":
//!   a verify batch of up to `depth` tokens can always be rolled back to its start;
//! * truncating further back takes the **slow path**: the backend keeps the sequence's tokens
//!   and re-decodes the kept prefix from the empty state (one pass over `len` tokens, exact).
//!   The option `deep_rollback = "refuse"` turns that into an `InvalidInput` error instead.
//!
//! The MTP head (models with a NextN block) has its own one-layer KV cache, one entry per
//! position; [`ForwardPass::mtp_eval`] at `position` cuts it to `position` entries and
//! appends, and `truncate` cuts it together with the trunk.
//!
//! Options (`[target.options]` of the profile): `ring_budget_bytes` (an upper bound on the
//! ring's memory), `deep_rollback` (`redecode`, the default, or `refuse`) and `kv_type` (how
//! the attention KV cache stores keys and values: `f32`, the default, or `f16`, which halves
//! its memory and the attention's memory traffic) and `weight_layout` (`interleaved`, the
//! default: Q8_0 / Q4_0 / Q4_K matrices are repacked at load into interleaved 16-row groups where the
//! CPU has AVX-512, which makes the multi-row verify pass several times cheaper; `file`: every
//! matrix is read from the mapped file as stored). An unknown option is an error naming the
//! known ones.

use std::path::Path;

use abi_stable::std_types::{RSlice, RVec};
use rayon::{ThreadPool, ThreadPoolBuilder};
use specula_kernels::{matmul, ops};
use specula_plugin_api::{
    guard, BackendParams, Capabilities, ErrorKind, ForwardPass, LogitRows, ModelInfo, PanicFence,
    PluginError, PluginResult,
};

/// The plugin's name in error messages.
const PLUGIN: &str = "cpu-simd";

use crate::arch::forward_dense_layer;
use crate::arch::hybrid::{self, HybridScratch, TrunkState};
pub use crate::arch::Scratch;
use crate::blocks::mtp;
use crate::kv_cache::{KvCache, KvType};
use crate::model::{Graph, Model};
use crate::recurrent::SnapshotRing;
use specula_cpu_engine::pool::install_busy;

/// `max_verify_tokens` advertised when the host passes 0.
pub const DEFAULT_MAX_VERIFY_TOKENS: u32 = 8;

/// Rows pushed through the layers together. Longer evaluations (prefill) run in chunks of
/// this many rows; chunking does not change any result, it only bounds scratch memory.
const MIN_BATCH_ROWS: usize = 64;

/// Backend option: the most bytes the recurrent-state snapshot ring may use.
pub const OPTION_RING_BUDGET_BYTES: &str = "ring_budget_bytes";

/// Backend option: what truncation beyond the rollback window does (`redecode` or `refuse`).
pub const OPTION_DEEP_ROLLBACK: &str = "deep_rollback";

/// Backend option: the KV cache's storage type (`f32` or `f16`).
pub const OPTION_KV_TYPE: &str = "kv_type";

/// Backend option: how weight matrices are laid out in memory (`interleaved` or `file`).
pub const OPTION_WEIGHT_LAYOUT: &str = "weight_layout";

/// Where the multiplied weight matrices live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// Q8_0 / Q4_0 / Q4_K matrices repacked at load into interleaved 16-row groups, where the SIMD
    /// level has a kernel for them (AVX-512): the multi-row verify pass reads them several
    /// times faster. Costs their size again in memory and a moment at load.
    Interleaved,
    /// Every matrix read straight from the memory-mapped file.
    File,
}

/// What [`ForwardPass::truncate`] does for a length the snapshot ring no longer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeepRollback {
    /// Re-decode the kept prefix from the empty state (exact, one pass over it).
    Redecode,
    /// Fail with an `InvalidInput` error.
    Refuse,
}

/// The backend options cpu-simd understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Options {
    ring_budget_bytes: Option<u64>,
    deep_rollback: DeepRollback,
    kv_type: KvType,
    weight_layout: WeightLayout,
}

impl Options {
    /// Parses the options, reporting every bad one (not only the first) in one error.
    fn parse(params: &BackendParams) -> Result<Self, PluginError> {
        let mut options = Options {
            ring_budget_bytes: None,
            deep_rollback: DeepRollback::Redecode,
            kv_type: KvType::default(),
            weight_layout: WeightLayout::Interleaved,
        };
        let mut problems = Vec::new();
        for option in params.options.iter() {
            let (key, value) = (option.0.as_str(), option.1.as_str().trim());
            let expected = match key {
                OPTION_RING_BUDGET_BYTES => match value.parse::<u64>() {
                    Ok(bytes) => {
                        options.ring_budget_bytes = Some(bytes);
                        continue;
                    }
                    Err(_) => "a number of bytes",
                },
                OPTION_DEEP_ROLLBACK => match value {
                    "redecode" => {
                        options.deep_rollback = DeepRollback::Redecode;
                        continue;
                    }
                    "refuse" => {
                        options.deep_rollback = DeepRollback::Refuse;
                        continue;
                    }
                    _ => "'redecode' or 'refuse'",
                },
                OPTION_KV_TYPE => match KvType::from_name(value) {
                    Some(kv_type) => {
                        options.kv_type = kv_type;
                        continue;
                    }
                    None => "'f32' or 'f16'",
                },
                OPTION_WEIGHT_LAYOUT => match value {
                    "interleaved" => {
                        options.weight_layout = WeightLayout::Interleaved;
                        continue;
                    }
                    "file" => {
                        options.weight_layout = WeightLayout::File;
                        continue;
                    }
                    _ => "'interleaved' or 'file'",
                },
                _ => {
                    problems.push(format!(
                        "unknown option '{key}' (known: {OPTION_RING_BUDGET_BYTES}, {OPTION_DEEP_ROLLBACK}, {OPTION_KV_TYPE}, {OPTION_WEIGHT_LAYOUT})"
                    ));
                    continue;
                }
            };
            problems.push(format!("option '{key}' = '{value}': expected {expected}"));
        }
        if problems.is_empty() {
            Ok(options)
        } else {
            Err(PluginError::invalid_input(format!(
                "{PLUGIN}: {}",
                problems.join("; ")
            )))
        }
    }
}

/// A model opened on the CPU with its sequence state.
pub struct CpuBackend {
    pool: ThreadPool,
    engine: Engine,
    info: ModelInfo,
    capabilities: Capabilities,
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("model", &self.engine.model)
            .field("threads", &self.pool.current_num_threads())
            .field("seq_len", &self.engine.kv.len())
            .finish_non_exhaustive()
    }
}

/// Everything the forward pass mutates, apart from the pool that runs it.
struct Engine {
    model: Model,
    /// Attention keys and values: one layer per attention layer of the trunk.
    kv: KvCache,
    batch_rows: usize,
    /// Final-norm hidden states of the rows of the last eval, `hidden_rows × n_embd`.
    hidden: Vec<f32>,
    hidden_rows: usize,
    state: SeqState,
}

/// The per-family part of the sequence state and scratch.
enum SeqState {
    Dense(Box<Scratch>),
    Hybrid(Box<HybridState>),
}

/// Sequence state of a hybrid model besides the KV cache.
struct HybridState {
    scratch: HybridScratch,
    ring: SnapshotRing,
    /// Every token of the sequence, for the slow rollback path.
    tokens: Vec<u32>,
    /// The MTP head's own cache (one layer), when the model has the head.
    mtp_kv: Option<KvCache>,
    deep_rollback: DeepRollback,
    /// Truncations that took the slow path (re-decoding).
    slow_rollbacks: u64,
}

fn internal(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, format!("cpu-simd: {what}"))
}

/// The context size in effect for `params`, warning when the asked one is capped.
fn context_size(model: &Model, params: &BackendParams, path: &Path) -> u32 {
    let n_ctx = model.context_size(params.context_size);
    if params.context_size > n_ctx {
        tracing::warn!(
            "{PLUGIN}: context size {} exceeds the {n_ctx} tokens {} was trained for; using {n_ctx}",
            params.context_size,
            path.display()
        );
    }
    n_ctx
}

impl CpuBackend {
    /// Checks `params` as [`open`](Self::open) does — the options and the model file's
    /// header, tensor records and shapes — without reading weights or allocating caches.
    pub fn probe(params: &BackendParams) -> Result<ModelInfo, PluginError> {
        Options::parse(params)?;
        let path = Path::new(params.model_path.as_str());
        let model = Model::load(path)?;
        Ok(model.info(context_size(&model, params, path)))
    }

    /// Opens the model named by `params` and sets up an empty sequence.
    pub fn open(params: &BackendParams) -> Result<Self, PluginError> {
        let options = Options::parse(params)?;
        let path = Path::new(params.model_path.as_str());
        let mut model = Model::load(path)?;
        let n_ctx = context_size(&model, params, path);
        let threads = match params.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n as usize,
        };
        let pool = ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cpu-simd-{i}"))
            .build()
            .map_err(|e| {
                PluginError::new(
                    ErrorKind::Internal,
                    format!("cpu-simd: cannot start {threads} worker threads: {e}"),
                )
            })?;
        if options.weight_layout == WeightLayout::Interleaved {
            let started = std::time::Instant::now();
            let bytes = pool.install(|| model.interleave_weights(|_| true))?;
            if bytes > 0 {
                tracing::info!(
                    "cpu-simd: repacked {:.1} MiB of weights into interleaved row groups in {:.2?}",
                    bytes as f64 / (1 << 20) as f64,
                    started.elapsed()
                );
            }
        }
        let requested_verify = match params.max_verify_tokens {
            0 => DEFAULT_MAX_VERIFY_TOKENS,
            n => n,
        };
        let n_ctx_us = n_ctx as usize;
        let (kv, state, capabilities, has_mtp_head) = match &model.graph {
            Graph::Dense(dense) => {
                let config = &dense.config;
                let batch_rows = MIN_BATCH_ROWS.max(requested_verify as usize);
                let kv = KvCache::new(
                    dense.weights.layers.len(),
                    n_ctx_us,
                    &config.attention,
                    options.kv_type,
                );
                let scratch = Scratch::new(config, batch_rows, n_ctx_us);
                let capabilities = Capabilities {
                    max_verify_tokens: requested_verify,
                    rollback_depth: u32::MAX,
                    hidden_state_export: true,
                    mtp_head: false,
                    snapshot_bytes_per_slot: 0,
                };
                (kv, SeqState::Dense(Box::new(scratch)), capabilities, false)
            }
            Graph::Hybrid(h) => {
                let config = &h.config;
                let layout = config.gdn.state_layout(config.n_gdn_layers);
                let (ring, size) = SnapshotRing::allocate(
                    layout,
                    requested_verify as usize,
                    options.ring_budget_bytes,
                )?;
                if size.depth < size.requested {
                    tracing::warn!(
                        "cpu-simd: the recurrent-state ring of {} holds {} snapshots of {} bytes instead of the {} asked for ({}); verify batches and rollback are limited to {} tokens",
                        path.display(),
                        size.depth,
                        layout.plane_bytes(),
                        size.requested,
                        match options.ring_budget_bytes {
                            Some(b) => format!("{OPTION_RING_BUDGET_BYTES} = {b}"),
                            None => "allocation failed".to_string(),
                        },
                        size.depth
                    );
                }
                let depth = u32::try_from(size.depth).unwrap_or(u32::MAX);
                let kv = KvCache::new(
                    config.n_attention_layers,
                    n_ctx_us,
                    &config.attention,
                    options.kv_type,
                );
                let mtp_kv = h
                    .weights
                    .mtp
                    .as_ref()
                    .map(|_| KvCache::new(1, n_ctx_us, &config.attention, options.kv_type));
                let has_mtp = mtp_kv.is_some();
                let batch_rows = MIN_BATCH_ROWS.max(size.depth);
                let capabilities = Capabilities {
                    max_verify_tokens: depth,
                    rollback_depth: if layout.n_layers == 0 {
                        u32::MAX
                    } else {
                        depth
                    },
                    hidden_state_export: true,
                    mtp_head: has_mtp,
                    snapshot_bytes_per_slot: layout.plane_bytes(),
                };
                let state = HybridState {
                    scratch: HybridScratch::new(config, batch_rows, n_ctx_us),
                    ring,
                    tokens: Vec::with_capacity(n_ctx_us),
                    mtp_kv,
                    deep_rollback: options.deep_rollback,
                    slow_rollbacks: 0,
                };
                (kv, SeqState::Hybrid(Box::new(state)), capabilities, has_mtp)
            }
        };
        let batch_rows = MIN_BATCH_ROWS.max(capabilities.max_verify_tokens as usize);
        let info = model.info(n_ctx);
        debug_assert_eq!(info.has_mtp_head, has_mtp_head);
        tracing::debug!(
            "cpu-simd: opened {} ({}, {} layers, {} threads, context {n_ctx}, KV cache {} bytes, {} snapshot bytes per slot × {})",
            path.display(),
            model.arch.name(),
            model.hparams.block_count,
            threads,
            kv.n_bytes(),
            capabilities.snapshot_bytes_per_slot,
            capabilities.rollback_depth
        );
        Ok(Self {
            pool,
            engine: Engine {
                model,
                kv,
                batch_rows,
                hidden: Vec::new(),
                hidden_rows: 0,
                state,
            },
            info,
            capabilities,
            fence: PanicFence::default(),
        })
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// What this instance can do (verify capacity, rollback depth, snapshot size, MTP head).
    pub fn caps(&self) -> Capabilities {
        self.capabilities
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.engine.kv.len()
    }

    /// Whether the sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.engine.kv.is_empty()
    }

    /// The sequence lengths [`truncate_to`](Self::truncate_to) restores in O(1): every length
    /// for a pure-attention model, the snapshot ring's window for a hybrid one.
    pub fn rollback_window(&self) -> std::ops::RangeInclusive<usize> {
        match &self.engine.state {
            SeqState::Hybrid(h) if h.ring.layout().n_layers > 0 => h.ring.window(),
            _ => 0..=self.engine.kv.len(),
        }
    }

    /// [`ForwardPass::eval`] without the panic guard.
    pub fn eval_tokens(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.engine.validate(tokens)?;
        let engine = &mut self.engine;
        install_busy(&self.pool, || engine.forward(tokens, rows, logits))
    }

    /// [`ForwardPass::truncate`] without the panic guard.
    pub fn truncate_to(&mut self, len: usize) -> Result<(), PluginError> {
        let seq_len = self.engine.kv.len();
        if len > seq_len {
            return Err(PluginError::invalid_input(format!(
                "cpu-simd: cannot truncate to {len} tokens: the sequence has only {seq_len}"
            )));
        }
        let engine = &mut self.engine;
        let SeqState::Hybrid(h) = &mut engine.state else {
            engine.kv.set_len(len);
            return Ok(());
        };
        if let Some(mtp_kv) = &mut h.mtp_kv {
            mtp_kv.set_len(mtp_kv.len().min(len));
        }
        if h.ring.layout().n_layers == 0 {
            // No recurrent layer: only the KV cache to cut.
            h.ring.reset();
            h.ring.advance(len);
        } else if !h.ring.restore(len) {
            let window = h.ring.window();
            match h.deep_rollback {
                DeepRollback::Refuse => {
                    return Err(PluginError::invalid_input(format!(
                        "cpu-simd: cannot truncate to {len} tokens: the recurrent state is kept only for lengths {}..={} (rollback depth {}), and option '{OPTION_DEEP_ROLLBACK}' = 'refuse' forbids re-decoding",
                        window.start(),
                        window.end(),
                        h.ring.depth()
                    )));
                }
                DeepRollback::Redecode => {
                    tracing::debug!(
                        "cpu-simd: truncating to {len} tokens is outside the rollback window {}..={}; re-decoding them",
                        window.start(),
                        window.end()
                    );
                    h.slow_rollbacks += 1;
                    let replay = h.tokens[..len].to_vec();
                    h.ring.reset();
                    h.tokens.clear();
                    engine.kv.set_len(0);
                    let hidden = (std::mem::take(&mut engine.hidden), engine.hidden_rows);
                    let mut scratch_logits = RVec::new();
                    let result = if replay.is_empty() {
                        Ok(())
                    } else {
                        install_busy(&self.pool, || {
                            engine.forward(&replay, LogitRows::None, &mut scratch_logits)
                        })
                    };
                    (engine.hidden, engine.hidden_rows) = hidden;
                    return result;
                }
            }
        }
        h.tokens.truncate(len);
        engine.kv.set_len(len);
        Ok(())
    }

    /// Final-norm hidden states of every row of the last eval (`rows × hidden_size`).
    pub fn last_hidden_states(&self) -> &[f32] {
        let e = self.engine.model.graph.n_embd();
        &self.engine.hidden[..self.engine.hidden_rows * e]
    }

    /// How many truncations went beyond the snapshot ring and re-decoded (0 for dense models).
    pub fn slow_rollbacks(&self) -> u64 {
        match &self.engine.state {
            SeqState::Hybrid(h) => h.slow_rollbacks,
            SeqState::Dense(_) => 0,
        }
    }

    /// Entries in the MTP head's KV cache (`None` without a head).
    pub fn mtp_len(&self) -> Option<usize> {
        match &self.engine.state {
            SeqState::Hybrid(h) => h.mtp_kv.as_ref().map(KvCache::len),
            SeqState::Dense(_) => None,
        }
    }

    /// One MTP step (a one-row [`CpuBackend::mtp_eval_into`] with logits).
    pub fn mtp_step_into(
        &mut self,
        hidden: &[f32],
        token: u32,
        position: usize,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.mtp_eval_into(
            hidden,
            &[token],
            position,
            LogitRows::All,
            logits,
            hidden_out,
        )
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
        let engine = &mut self.engine;
        let no_head = || {
            PluginError::unsupported(format!(
                "cpu-simd: {} ({}) has no MTP head",
                self.info.name, self.info.architecture
            ))
        };
        let (Graph::Hybrid(model), SeqState::Hybrid(h)) = (&engine.model.graph, &mut engine.state)
        else {
            return Err(no_head());
        };
        let (Some(weights), Some(kv)) = (&model.weights.mtp, &mut h.mtp_kv) else {
            return Err(no_head());
        };
        let e = model.config.n_embd;
        let vocab = model.config.n_vocab;
        let n = tokens.len();
        specula_cpu_engine::validate::mtp_input(
            "cpu-simd",
            hidden,
            tokens,
            position,
            e,
            vocab,
            kv.len(),
            kv.capacity(),
        )?;
        let n_logits = rows.count(n);
        logits.clear();
        logits.resize(n_logits * vocab, 0.0);
        hidden_out.clear();
        hidden_out.resize(n * e, 0.0);
        let file = &engine.model.file;
        let scratch = &mut h.scratch;
        let chunk = engine.batch_rows;
        install_busy(&self.pool, || {
            mtp::forward_chunked(
                &model.config,
                weights,
                file,
                hidden,
                tokens,
                position,
                kv,
                scratch,
                chunk,
                logits,
                hidden_out,
            )
        })
    }
}

impl Engine {
    fn validate(&self, tokens: &[u32]) -> Result<(), PluginError> {
        if tokens.is_empty() {
            return Err(PluginError::invalid_input(
                "cpu-simd: eval called with no tokens",
            ));
        }
        let vocab = self.model.hparams.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(PluginError::invalid_input(format!(
                "cpu-simd: token id {bad} is out of range (vocabulary size {vocab})"
            )));
        }
        let (len, n_ctx) = (self.kv.len(), self.kv.capacity());
        if len + tokens.len() > n_ctx {
            return Err(PluginError::new(
                ErrorKind::ContextFull,
                format!(
                    "cpu-simd: context full: {len} tokens in the sequence + {} new exceed the context size {n_ctx}",
                    tokens.len()
                ),
            ));
        }
        Ok(())
    }

    /// Evaluates `tokens` at the positions after the sequence (already validated).
    fn forward(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        let Engine {
            model,
            kv,
            batch_rows,
            hidden,
            hidden_rows,
            state,
        } = self;
        let file = &model.file;
        let graph = &model.graph;
        let e = graph.n_embd();
        let eps = graph.rms_eps();
        let vocab = model.hparams.vocab_size as usize;
        let n = tokens.len();
        let start = kv.len();

        *hidden_rows = 0;
        hidden.resize(n * e, 0.0);
        logits.clear();
        logits.resize(rows.count(n) * vocab, 0.0);
        let embedding = graph.token_embd().view(file)?;
        let output = graph.output().view(file)?;

        for (chunk_index, chunk) in tokens.chunks(*batch_rows).enumerate() {
            let first = chunk_index * *batch_rows;
            let m = chunk.len();
            let (x, mm) = match state {
                SeqState::Dense(s) => {
                    let Graph::Dense(dense) = graph else {
                        return Err(internal("dense state for a hybrid model"));
                    };
                    embed(&embedding, chunk, &mut s.x, e);
                    for layer in 0..dense.weights.layers.len() {
                        forward_dense_layer(file, dense, layer, m, start + first, s, kv)?;
                    }
                    let s = &mut **s;
                    (&s.x, &mut s.matmul)
                }
                SeqState::Hybrid(h) => {
                    let Graph::Hybrid(model) = graph else {
                        return Err(internal("hybrid state for a dense model"));
                    };
                    let HybridState { scratch, ring, .. } = &mut **h;
                    embed(&embedding, chunk, &mut scratch.x, e);
                    let mut trunk = TrunkState { kv, ring };
                    for layer in 0..model.weights.layers.len() {
                        hybrid::forward_layer(
                            model,
                            file,
                            layer,
                            m,
                            start + first,
                            first,
                            scratch,
                            &mut trunk,
                        )?;
                    }
                    (&scratch.x, &mut scratch.matmul)
                }
            };
            let chunk_hidden = &mut hidden[first * e..(first + m) * e];
            for (x, h) in x.chunks_exact(e).zip(chunk_hidden.chunks_exact_mut(e)) {
                ops::rms_norm(x, graph.output_norm(), eps, h);
            }
            match rows {
                LogitRows::All => matmul(
                    &output,
                    chunk_hidden,
                    &mut logits[first * vocab..(first + m) * vocab],
                    mm,
                ),
                LogitRows::Last if first + m == n => matmul(
                    &output,
                    &chunk_hidden[(m - 1) * e..],
                    &mut logits[..vocab],
                    mm,
                ),
                _ => {}
            }
        }
        kv.set_len(start + n);
        if let SeqState::Hybrid(h) = state {
            h.ring.advance(n);
            h.tokens.extend_from_slice(tokens);
        }
        *hidden_rows = n;
        Ok(())
    }
}

/// Writes the embeddings of `tokens` into the first rows of `x` (`n_embd` each).
fn embed(embedding: &specula_kernels::WeightMatrix<'_>, tokens: &[u32], x: &mut [f32], e: usize) {
    for (row, &token) in x.chunks_exact_mut(e).zip(tokens) {
        embedding.dequantize_row(token as usize, row);
    }
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

impl ForwardPass for CpuBackend {
    fn model_info(&self) -> ModelInfo {
        guarded(|| self.info.clone(), || self.info.clone())
    }

    fn capabilities(&self) -> Capabilities {
        guarded(|| self.capabilities, || self.capabilities)
    }

    fn seq_len(&self) -> PluginResult<usize> {
        self.fence.guard(PLUGIN, || Ok(self.engine.kv.len()))
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
            .join("../../../shared/models/stories260K.gguf");
        let params = BackendParams {
            model_path: RString::from(path.to_str().unwrap()),
            threads: 1,
            context_size: 64,
            max_verify_tokens: 4,
            options: RVec::new(),
        };
        let mut backend = CpuBackend::open(&params).unwrap();
        let fence = backend.fence.clone();
        specula_plugin_api::testing::assert_refuses_every_call_after_a_panic(
            &mut backend,
            &fence,
            PLUGIN,
        );
    }
}
