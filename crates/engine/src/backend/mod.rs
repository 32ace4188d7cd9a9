//! The part of a backend that does not depend on where the layers run: written once, used by
//! cpu-simd and cuda-hybrid.
//!
//! A backend is a [`Backend`] over an [`Executor`]. [`Backend`] implements the plugin ABI's
//! [`ForwardPass`]: it validates every call, keeps the sequence (its tokens, the hidden
//! states of the last eval, the MTP head's length), splits an eval into chunks of at most
//! `batch_rows` rows, and implements truncation — O(1) inside the executor's rollback window,
//! otherwise re-decoding the kept prefix or refusing, as the `deep_rollback` option says. A
//! panicked instance refuses every later call ([`PanicFence`]). Every error leaving it names
//! the plugin.
//!
//! The [`Executor`] owns the caches and runs the layers: [`crate::cpu::CpuExecutor`] on the
//! host, cuda-hybrid's executor on a GPU (with a host prefix run by a `CpuExecutor`).

mod executor;
pub mod opening;
pub mod options;
pub mod validate;

use std::ops::RangeInclusive;

use abi_stable::std_types::{RSlice, RVec};
use rayon::ThreadPool;
use specula_plugin_api::{
    guard, Capabilities, ErrorKind, ForwardPass, LogitRows, ModelInfo, PanicFence, PluginError,
    PluginResult,
};

pub use executor::{Chunk, Executor, MtpRows};
pub use options::DeepRollback;

use crate::model::Model;

/// `max_verify_tokens` advertised when the host passes 0.
pub const DEFAULT_MAX_VERIFY_TOKENS: u32 = 8;

/// Rows pushed through the layers together, at least ([`opening::Opening::batch_rows`]: the
/// verify capacity when larger). Longer evaluations (prefill) run in chunks of this many rows;
/// chunking changes no result, it only bounds scratch memory.
pub const MIN_BATCH_ROWS: usize = 64;

/// How a backend instance was set up: what [`Backend::new`] needs besides the model and the
/// executor.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// The plugin's name, the first word of every error message.
    pub plugin: &'static str,
    pub capabilities: Capabilities,
    /// The context size in effect.
    pub n_ctx: usize,
    /// Rows per chunk (the executor's scratch holds this many).
    pub batch_rows: usize,
    pub deep_rollback: DeepRollback,
}

/// One model, one sequence, evaluated by `X`: the [`ForwardPass`] of a backend plugin.
pub struct Backend<X> {
    setup: Setup,
    model: Model,
    info: ModelInfo,
    pool: ThreadPool,
    executor: X,
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
    /// Every token of the sequence (the slow rollback path replays them).
    tokens: Vec<u32>,
    /// Final-norm hidden states of the rows of the last eval, `hidden_rows × n_embd`.
    hidden: Vec<f32>,
    hidden_rows: usize,
    /// Entries in the MTP head's KV cache (`None` without a head).
    mtp_len: Option<usize>,
    /// Truncations that took the slow path (re-decoding).
    slow_rollbacks: u64,
    /// Set when resetting the executor's state failed: its caches may disagree with the
    /// sequence, so every later call is refused.
    broken: Option<String>,
}

impl<X> std::fmt::Debug for Backend<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(self.setup.plugin)
            .field("model", &self.model)
            .field("threads", &self.pool.current_num_threads())
            .field("seq_len", &self.tokens.len())
            .finish_non_exhaustive()
    }
}

/// Prefixes `e`'s message with the plugin's name unless it already starts with it: messages
/// of the shared code never name a plugin.
pub fn attribute(plugin: &str, e: PluginError) -> PluginError {
    let message = e.message.as_str();
    if message
        .strip_prefix(plugin)
        .is_some_and(|rest| rest.starts_with(':'))
    {
        e
    } else {
        PluginError::new(e.kind, format!("{plugin}: {message}"))
    }
}

impl<X: Executor> Backend<X> {
    /// An empty sequence over `model`, evaluated by `executor` on `pool`.
    pub fn new(model: Model, pool: ThreadPool, executor: X, setup: Setup) -> Self {
        let info = model.info(u32::try_from(setup.n_ctx).unwrap_or(u32::MAX));
        Self {
            info,
            pool,
            executor,
            fence: PanicFence::default(),
            tokens: Vec::with_capacity(setup.n_ctx),
            hidden: Vec::new(),
            hidden_rows: 0,
            mtp_len: setup.capabilities.mtp_head.then_some(0),
            slow_rollbacks: 0,
            broken: None,
            setup,
            model,
        }
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// What this instance can do (verify capacity, rollback depth, snapshot size, MTP head).
    pub fn caps(&self) -> Capabilities {
        self.setup.capabilities
    }

    /// The executor (for backend-specific facts, e.g. where the layers run).
    pub fn executor(&self) -> &X {
        &self.executor
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The sequence lengths [`truncate_to`](Self::truncate_to) restores in O(1): every length
    /// for a pure-attention model, the snapshot ring's window for a hybrid one.
    pub fn rollback_window(&self) -> RangeInclusive<usize> {
        self.executor.window(self.tokens.len())
    }

    /// How many truncations went beyond the snapshot ring and re-decoded (0 for dense models).
    pub fn slow_rollbacks(&self) -> u64 {
        self.slow_rollbacks
    }

    /// Entries in the MTP head's KV cache (`None` without a head).
    pub fn mtp_len(&self) -> Option<usize> {
        self.mtp_len
    }

    /// Final-norm hidden states of every row of the last eval (`rows × hidden_size`).
    pub fn last_hidden_states(&self) -> &[f32] {
        &self.hidden[..self.hidden_rows * self.model.graph.n_embd()]
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
            .map_err(|e| attribute(self.setup.plugin, e))
    }

    /// Refuses every call once the executor's state could not be reset.
    fn usable(&self) -> Result<(), PluginError> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(PluginError::new(
                ErrorKind::Internal,
                format!(
                    "{}: this instance refuses every call since resetting its state failed ({why}); open a new instance",
                    self.setup.plugin
                ),
            )),
        }
    }

    fn validate(&self, tokens: &[u32]) -> Result<(), PluginError> {
        self.usable()?;
        let plugin = self.setup.plugin;
        if tokens.is_empty() {
            return Err(PluginError::invalid_input(format!(
                "{plugin}: eval called with no tokens"
            )));
        }
        let vocab = self.info.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(PluginError::invalid_input(format!(
                "{plugin}: token id {bad} is out of range (vocabulary size {vocab})"
            )));
        }
        let (len, n_ctx) = (self.tokens.len(), self.setup.n_ctx);
        if len + tokens.len() > n_ctx {
            return Err(PluginError::new(
                ErrorKind::ContextFull,
                format!(
                    "{plugin}: context full: {len} tokens in the sequence + {} new exceed the context size {n_ctx}",
                    tokens.len()
                ),
            ));
        }
        Ok(())
    }

    /// Evaluates `tokens` at the positions after the sequence (already validated), in chunks
    /// of at most `batch_rows` rows.
    fn forward(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        let e = self.model.graph.n_embd();
        let vocab = self.info.vocab_size as usize;
        let batch_rows = self.setup.batch_rows;
        let n = tokens.len();
        let start = self.tokens.len();

        self.hidden_rows = 0;
        self.hidden.resize(n * e, 0.0);
        logits.clear();
        logits.resize(rows.count(n) * vocab, 0.0);
        for (chunk_index, chunk_tokens) in tokens.chunks(batch_rows).enumerate() {
            let first = chunk_index * batch_rows;
            let m = chunk_tokens.len();
            // Rows `logit_from .. m` of this chunk get logits, at logit row `logit_to ..`.
            let (logit_from, logit_to) = match rows {
                LogitRows::All => (0, first),
                LogitRows::Last if first + m == n => (m - 1, 0),
                _ => (m, 0),
            };
            let chunk = Chunk {
                tokens: chunk_tokens,
                pos0: start + first,
                first,
                logit_from,
            };
            self.executor.forward_chunk(
                &self.model,
                &self.pool,
                &chunk,
                &mut self.hidden[first * e..(first + m) * e],
                &mut logits[logit_to * vocab..(logit_to + m - logit_from) * vocab],
            )?;
        }
        self.executor.commit(start, n);
        self.tokens.extend_from_slice(tokens);
        self.hidden_rows = n;
        Ok(())
    }

    /// [`ForwardPass::truncate`] without the panic guard.
    pub fn truncate_to(&mut self, len: usize) -> Result<(), PluginError> {
        self.usable()?;
        let plugin = self.setup.plugin;
        let seq_len = self.tokens.len();
        if len > seq_len {
            return Err(PluginError::invalid_input(format!(
                "{plugin}: cannot truncate to {len} tokens: the sequence has only {seq_len}"
            )));
        }
        if let Some(mtp_len) = &mut self.mtp_len {
            *mtp_len = (*mtp_len).min(len);
        }
        let window = self.executor.window(seq_len);
        if self
            .executor
            .rollback(len)
            .map_err(|e| attribute(plugin, e))?
        {
            self.tokens.truncate(len);
            return Ok(());
        }
        match self.setup.deep_rollback {
            DeepRollback::Refuse => Err(PluginError::invalid_input(format!(
                "{plugin}: cannot truncate to {len} tokens: the recurrent state is kept only for lengths {}..={} (rollback depth {}), and option '{}' = 'refuse' forbids re-decoding",
                window.start(),
                window.end(),
                self.setup.capabilities.rollback_depth,
                options::OPTION_DEEP_ROLLBACK,
            ))),
            DeepRollback::Redecode => {
                tracing::debug!(
                    "{plugin}: truncating to {len} tokens is outside the rollback window {}..={}; re-decoding them",
                    window.start(),
                    window.end()
                );
                self.redecode(len).map_err(|e| attribute(plugin, e))
            }
        }
    }

    /// The slow rollback path: back to the empty state, then one pass over the kept tokens.
    fn redecode(&mut self, len: usize) -> Result<(), PluginError> {
        self.slow_rollbacks += 1;
        if let Err(e) = self.executor.reset() {
            self.broken = Some(e.message.to_string());
            return Err(e);
        }
        let mut replay = std::mem::take(&mut self.tokens);
        replay.truncate(len);
        if replay.is_empty() {
            return Ok(());
        }
        let hidden = (std::mem::take(&mut self.hidden), self.hidden_rows);
        let mut scratch_logits = RVec::new();
        let result = self.forward(&replay, LogitRows::None, &mut scratch_logits);
        (self.hidden, self.hidden_rows) = hidden;
        result
    }

    /// One MTP step (a one-row [`mtp_eval_into`](Self::mtp_eval_into) with logits).
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
        self.usable()?;
        let plugin = self.setup.plugin;
        let Some(cached) = self.mtp_len else {
            return Err(PluginError::unsupported(format!(
                "{plugin}: {} ({}) has no MTP head",
                self.info.name, self.info.architecture
            )));
        };
        let e = self.model.graph.n_embd();
        let vocab = self.info.vocab_size as usize;
        let n = tokens.len();
        validate::mtp_input(
            plugin,
            hidden,
            tokens,
            position,
            e,
            vocab,
            cached,
            self.setup.n_ctx,
        )?;
        logits.clear();
        logits.resize(rows.count(n) * vocab, 0.0);
        hidden_out.clear();
        hidden_out.resize(n * e, 0.0);
        // In passes of at most `batch_rows` rows (chunking changes no bits: every row is
        // computed as a one-row call); rows `first_logit_row ..` of the call get logits.
        let first_logit_row = n - rows.count(n);
        let mut result = Ok(());
        let mut start = 0;
        while start < n && result.is_ok() {
            let end = n.min(start + self.setup.batch_rows);
            let lo = first_logit_row.clamp(start, end);
            let at = lo.saturating_sub(first_logit_row) * vocab;
            let pass = MtpRows {
                hidden: &hidden[start * e..end * e],
                tokens: &tokens[start..end],
                position: position + start,
                logit_from: lo - start,
            };
            result = self.executor.mtp(
                &self.model,
                &self.pool,
                &pass,
                &mut logits[at..at + (end - lo) * vocab],
                &mut hidden_out[start * e..end * e],
            );
            start = end;
        }
        // The head's cache was cut to `position` before the rows were appended.
        self.mtp_len = Some(match result {
            Ok(()) => position + n,
            Err(_) => cached.min(position),
        });
        result.map_err(|e| attribute(plugin, e))
    }

    /// The panic fence (tests check that a panicked instance refuses later calls).
    #[doc(hidden)]
    pub fn fence(&self) -> &PanicFence {
        &self.fence
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

impl<X: Executor> ForwardPass for Backend<X> {
    fn model_info(&self) -> ModelInfo {
        guarded(|| self.info.clone(), || self.info.clone())
    }

    fn capabilities(&self) -> Capabilities {
        guarded(|| self.setup.capabilities, || self.setup.capabilities)
    }

    fn seq_len(&self) -> PluginResult<usize> {
        self.fence
            .guard(self.setup.plugin, || Ok(self.tokens.len()))
    }

    fn eval(
        &mut self,
        tokens: RSlice<'_, u32>,
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.fence.clone().guard(self.setup.plugin, || {
            self.eval_tokens(tokens.as_slice(), rows, logits)
        })
    }

    fn truncate(&mut self, len: usize) -> PluginResult<()> {
        self.fence
            .clone()
            .guard(self.setup.plugin, || self.truncate_to(len))
    }

    fn hidden_states(&self, out: &mut RVec<f32>) -> PluginResult<()> {
        self.fence.guard(self.setup.plugin, || {
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
        self.fence.clone().guard(self.setup.plugin, || {
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
    use crate::cpu::CpuExecutor;
    use crate::kv_cache::KvType;
    use specula_plugin_api::testing;

    fn open_test_backend<X: Executor>(wrap: impl FnOnce(CpuExecutor) -> X) -> Backend<X> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/models/fixtures/tiny-qwen35-mtp.gguf"
        );
        let params = testing::backend_params(path, 1, 64, 4, &[]);
        let (model, n_ctx) = opening::load_model("test", &params).unwrap();
        let executor = CpuExecutor::whole_model(&model, n_ctx, 64, KvType::F32, 4).unwrap();
        let setup = Setup {
            plugin: "test",
            capabilities: Capabilities {
                max_verify_tokens: 4,
                rollback_depth: 4,
                hidden_state_export: true,
                mtp_head: true,
                snapshot_bytes_per_slot: 0,
            },
            n_ctx,
            batch_rows: 64,
            deep_rollback: DeepRollback::Redecode,
        };
        let pool = opening::thread_pool("test", &params).unwrap();
        Backend::new(model, pool, wrap(executor), setup)
    }

    /// A CPU executor whose reset fails, standing in for a device that fails mid-rollback.
    struct FailingReset(CpuExecutor);

    impl Executor for FailingReset {
        fn forward_chunk(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            chunk: &Chunk<'_>,
            hidden: &mut [f32],
            logits: &mut [f32],
        ) -> Result<(), PluginError> {
            self.0.forward_chunk(model, pool, chunk, hidden, logits)
        }
        fn commit(&mut self, start: usize, n: usize) {
            self.0.commit(start, n)
        }
        fn rollback(&mut self, len: usize) -> Result<bool, PluginError> {
            self.0.rollback(len)
        }
        fn window(&self, seq_len: usize) -> RangeInclusive<usize> {
            self.0.window(seq_len)
        }
        fn reset(&mut self) -> Result<(), PluginError> {
            Err(PluginError::new(ErrorKind::Internal, "device gone"))
        }
        fn mtp(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            rows: &MtpRows<'_>,
            logits: &mut [f32],
            hidden_out: &mut [f32],
        ) -> Result<(), PluginError> {
            self.0.mtp(model, pool, rows, logits, hidden_out)
        }
    }

    /// When the state cannot be reset for a re-decode, the instance refuses every later call
    /// instead of computing from caches that disagree with the sequence.
    #[test]
    fn a_failed_reset_makes_the_instance_refuse_later_calls() {
        let mut backend = open_test_backend(FailingReset);
        let mut logits = RVec::new();
        let tokens: Vec<u32> = (1..=12).collect();
        backend
            .eval_tokens(&tokens, LogitRows::Last, &mut logits)
            .unwrap();
        let err = backend.truncate_to(2).unwrap_err();
        assert!(err.message.contains("device gone"), "{err}");
        for err in [
            backend
                .eval_tokens(&[1], LogitRows::Last, &mut logits)
                .unwrap_err(),
            backend.truncate_to(1).unwrap_err(),
        ] {
            assert_eq!(err.kind, ErrorKind::Internal);
            assert!(
                err.message.starts_with("test: ") && err.message.contains("open a new instance"),
                "{err}"
            );
        }
    }

    /// Once a call has panicked, every call that touches the sequence is refused, saying why,
    /// instead of answering from a state the panic may have left half-updated.
    #[test]
    fn after_a_panic_every_call_is_refused() {
        let mut backend = open_test_backend(|x| x);
        let fence = backend.fence().clone();
        testing::assert_refuses_every_call_after_a_panic(&mut backend, &fence, "test");
    }

    #[test]
    fn errors_name_the_plugin_once() {
        let plain = PluginError::invalid_input("m.gguf: bad");
        assert_eq!(
            attribute("cpu-simd", plain).message.as_str(),
            "cpu-simd: m.gguf: bad"
        );
        let named = PluginError::invalid_input("cpu-simd: m.gguf: bad");
        assert_eq!(
            attribute("cpu-simd", named).message.as_str(),
            "cpu-simd: m.gguf: bad"
        );
        let other = PluginError::invalid_input("cpu-simdish: bad");
        assert_eq!(
            attribute("cpu-simd", other).message.as_str(),
            "cpu-simd: cpu-simdish: bad"
        );
    }
}
