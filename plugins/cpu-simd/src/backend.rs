//! The [`ForwardPass`] implementation: one model, one sequence, a private thread pool.

use std::path::Path;

use abi_stable::std_types::{ROption, RSlice, RVec};
use rayon::{ThreadPool, ThreadPoolBuilder};
use specula_kernels::{matmul, ops, MatmulScratch};
use specula_plugin_api::{
    guard, BackendParams, Capabilities, ErrorKind, ForwardPass, LogitRows, ModelInfo, PluginError,
    PluginResult,
};

use crate::arch::{forward_dense_layer, DenseConfig};
use crate::kv_cache::KvCache;
use crate::model::Model;

/// `max_verify_tokens` advertised when the host passes 0.
pub const DEFAULT_MAX_VERIFY_TOKENS: u32 = 8;

/// Rows pushed through the layers together. Longer evaluations (prefill) run in chunks of
/// this many rows; chunking does not change any result, it only bounds scratch memory.
const MIN_BATCH_ROWS: usize = 64;

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
    /// Attention scores, `n_head × n_ctx`.
    pub scores: Vec<f32>,
    pub rope_cos: Vec<f32>,
    pub rope_sin: Vec<f32>,
    pub matmul: MatmulScratch,
}

impl Scratch {
    fn new(config: &DenseConfig, rows: usize, n_ctx: usize) -> Self {
        let shape = &config.attention;
        let pairs = config.rope.n_rot / 2;
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
            scores: vec![0.0; shape.n_head * n_ctx],
            rope_cos: vec![0.0; pairs],
            rope_sin: vec![0.0; pairs],
            matmul: MatmulScratch::new(),
        }
    }
}

/// A model opened on the CPU with its sequence state.
pub struct CpuBackend {
    pool: ThreadPool,
    engine: Engine,
    info: ModelInfo,
    capabilities: Capabilities,
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
    kv: KvCache,
    batch_rows: usize,
    scratch: Scratch,
    /// Final-norm hidden states of the rows of the last eval, `hidden_rows × n_embd`.
    hidden: Vec<f32>,
    hidden_rows: usize,
}

impl CpuBackend {
    /// Opens the model named by `params` and sets up an empty sequence.
    pub fn open(params: &BackendParams) -> Result<Self, PluginError> {
        let path = Path::new(params.model_path.as_str());
        let model = Model::load(path)?;
        let hp = &model.hparams;
        let train_ctx = hp.context_length;
        let n_ctx = match params.context_size {
            0 => train_ctx,
            asked if asked > train_ctx => {
                tracing::warn!(
                    "cpu-simd: context size {asked} exceeds the {train_ctx} tokens {} was trained for; using {train_ctx}",
                    path.display()
                );
                train_ctx
            }
            asked => asked,
        };
        for option in params.options.iter() {
            tracing::warn!(
                "cpu-simd: ignoring unknown option '{}' = '{}'",
                option.0,
                option.1
            );
        }
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
        let max_verify_tokens = match params.max_verify_tokens {
            0 => DEFAULT_MAX_VERIFY_TOKENS,
            n => n,
        };
        let batch_rows = MIN_BATCH_ROWS.max(max_verify_tokens as usize);
        let config = &model.config;
        let kv = KvCache::new(
            model.weights.layers.len(),
            n_ctx as usize,
            config.attention.k_width(),
            config.attention.v_width(),
        );
        let scratch = Scratch::new(config, batch_rows, n_ctx as usize);
        let info = ModelInfo {
            architecture: model.arch.name().into(),
            name: model.name.as_str().into(),
            vocab_size: hp.vocab_size,
            context_size: n_ctx,
            train_context_length: train_ctx,
            hidden_size: hp.embedding_length,
            n_layers: hp.block_count,
            bos_token: ROption::from(model.bos_token),
            eos_token: ROption::from(model.eos_token),
            has_mtp_head: false,
            n_params: model.n_params,
            weight_bytes: model.weights.bytes_per_token(),
        };
        let capabilities = Capabilities {
            max_verify_tokens,
            rollback_depth: u32::MAX,
            hidden_state_export: true,
            mtp_head: false,
            snapshot_bytes_per_slot: 0,
        };
        tracing::debug!(
            "cpu-simd: opened {} ({}, {} layers, {} threads, context {n_ctx}, KV cache {} bytes)",
            path.display(),
            model.arch.name(),
            hp.block_count,
            threads,
            kv.n_bytes()
        );
        Ok(Self {
            pool,
            engine: Engine {
                model,
                kv,
                batch_rows,
                scratch,
                hidden: Vec::new(),
                hidden_rows: 0,
            },
            info,
            capabilities,
        })
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.engine.kv.len()
    }

    /// Whether the sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.engine.kv.is_empty()
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
        self.pool.install(|| engine.forward(tokens, rows, logits))
    }

    /// [`ForwardPass::truncate`] without the panic guard.
    pub fn truncate_to(&mut self, len: usize) -> Result<(), PluginError> {
        let seq_len = self.engine.kv.len();
        if len > seq_len {
            return Err(PluginError::invalid_input(format!(
                "cpu-simd: cannot truncate to {len} tokens: the sequence has only {seq_len}"
            )));
        }
        self.engine.kv.set_len(len);
        Ok(())
    }

    /// Final-norm hidden states of every row of the last eval (`rows × hidden_size`).
    pub fn last_hidden_states(&self) -> &[f32] {
        let e = self.engine.model.config.n_embd;
        &self.engine.hidden[..self.engine.hidden_rows * e]
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
            scratch: s,
            hidden,
            hidden_rows,
        } = self;
        let file = &model.file;
        let config = &model.config;
        let e = config.n_embd;
        let vocab = model.hparams.vocab_size as usize;
        let n = tokens.len();
        let start = kv.len();

        *hidden_rows = 0;
        hidden.resize(n * e, 0.0);
        logits.clear();
        logits.resize(rows.count(n) * vocab, 0.0);
        let embedding = model.weights.token_embd.view(file)?;
        let output = model.weights.output.view(file)?;

        for (chunk_index, chunk) in tokens.chunks(*batch_rows).enumerate() {
            let first = chunk_index * *batch_rows;
            let m = chunk.len();
            for (x, &token) in s.x.chunks_exact_mut(e).zip(chunk) {
                embedding.dequantize_row(token as usize, x);
            }
            for layer in 0..model.weights.layers.len() {
                forward_dense_layer(model, layer, m, start + first, s, kv)?;
            }
            let chunk_hidden = &mut hidden[first * e..(first + m) * e];
            for (x, h) in s.x.chunks_exact(e).zip(chunk_hidden.chunks_exact_mut(e)) {
                ops::rms_norm(x, &model.weights.output_norm, config.rms_eps, h);
            }
            match rows {
                LogitRows::All => matmul(
                    &output,
                    chunk_hidden,
                    &mut logits[first * vocab..(first + m) * vocab],
                    &mut s.matmul,
                ),
                LogitRows::Last if first + m == n => matmul(
                    &output,
                    &chunk_hidden[(m - 1) * e..],
                    &mut logits[..vocab],
                    &mut s.matmul,
                ),
                _ => {}
            }
        }
        kv.set_len(start + n);
        *hidden_rows = n;
        Ok(())
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

    fn seq_len(&self) -> usize {
        guarded(|| 0, || self.engine.kv.len())
    }

    fn eval(
        &mut self,
        tokens: RSlice<'_, u32>,
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        guard(|| self.eval_tokens(tokens.as_slice(), rows, logits))
    }

    fn truncate(&mut self, len: usize) -> PluginResult<()> {
        guard(|| self.truncate_to(len))
    }

    fn hidden_states(&self, out: &mut RVec<f32>) -> PluginResult<()> {
        guard(|| {
            out.clear();
            out.extend_from_slice(self.last_hidden_states());
            Ok(())
        })
    }

    fn mtp_step(
        &mut self,
        _hidden: RSlice<'_, f32>,
        _token: u32,
        _position: usize,
        _logits: &mut RVec<f32>,
        _hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        guard(|| {
            Err(PluginError::unsupported(format!(
                "cpu-simd: {} ({}) has no MTP head",
                self.info.name, self.info.architecture
            )))
        })
    }
}
