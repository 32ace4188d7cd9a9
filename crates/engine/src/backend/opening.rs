//! The steps of opening a backend that every backend takes the same way.

use std::path::Path;

use rayon::{ThreadPool, ThreadPoolBuilder};
use specula_plugin_api::{BackendParams, Capabilities, ErrorKind, PluginError};

use super::options::CommonOptions;
use super::{
    attribute, options, Backend, Executor, Setup, DEFAULT_MAX_VERIFY_TOKENS, MIN_BATCH_ROWS,
};
use crate::kv_cache::{KvPool, BLOCK_TOKENS};
use crate::model::{Graph, Model};

/// A backend being opened: what every backend does first (its model loaded, its pool started)
/// and the step that ends it ([`finish`](Self::finish)); in between, the backend places the
/// model, repacks weights and builds its executor.
pub struct Opening {
    pub plugin: &'static str,
    pub model: Model,
    /// The context size in effect.
    pub n_ctx: usize,
    pub pool: ThreadPool,
    pub common: CommonOptions,
    /// The verify capacity asked for ([`requested_verify`]).
    pub requested_verify: usize,
    /// Sequence slots asked for (at least 1).
    pub max_sequences: usize,
    /// Attention positions the block pool holds over all sequences (whole blocks).
    pub kv_tokens: usize,
}

impl Opening {
    /// Loads the model `params` names and starts the worker pool, for `plugin` whose options
    /// (the engine's part) are `common`.
    pub fn start(
        plugin: &'static str,
        params: &BackendParams,
        common: CommonOptions,
    ) -> Result<Self, PluginError> {
        if params.max_sequences > MAX_SEQUENCES {
            return Err(PluginError::invalid_input(format!(
                "{plugin}: max_sequences = {} is more than the {MAX_SEQUENCES} sequences one instance holds",
                params.max_sequences
            )));
        }
        let (model, n_ctx) = load_model(plugin, params)?;
        let pool = thread_pool(plugin, params)?;
        Ok(Self {
            plugin,
            model,
            n_ctx,
            pool,
            common,
            requested_verify: requested_verify(params),
            max_sequences: params.max_sequences.max(1) as usize,
            kv_tokens: kv_tokens(params, n_ctx),
        })
    }

    /// What an instance can do, and the depth of the snapshot ring it needs: the verify
    /// capacity asked for, lowered for a hybrid model to what the `ring_budget_bytes` option
    /// holds (with a warning); rollback without limit where no layer is recurrent, else as deep
    /// as the ring. (Dense models: a depth of 0, no ring.)
    ///
    /// The KV capacity is the block pool's (`kv_tokens`); `max_batch_rows` is
    /// [`Self::batch_rows`].
    pub fn capabilities(&self) -> Result<(Capabilities, usize), PluginError> {
        let requested = self.requested_verify;
        let max_sequences = self.max_sequences as u32;
        let kv_tokens = self.kv_tokens as u64;
        let (mut capabilities, depth) = match &self.model.graph {
            Graph::Dense(_) => (
                Capabilities {
                    max_verify_tokens: requested as u32,
                    rollback_depth: u32::MAX,
                    max_sequences,
                    max_batch_rows: 0,
                    kv_tokens,
                    hidden_state_export: true,
                    mtp_head: false,
                    snapshot_bytes_per_slot: 0,
                    tree_verify: true,
                },
                0,
            ),
            Graph::Hybrid(h) => {
                let layout = h.config.gdn.state_layout(h.config.n_gdn_layers);
                let depth = ring_depth(
                    self.plugin,
                    self.model.file.path(),
                    layout.plane_bytes(),
                    requested,
                    self.common.ring_budget_bytes,
                )?;
                let capabilities = Capabilities {
                    max_verify_tokens: depth as u32,
                    rollback_depth: if layout.n_layers == 0 {
                        u32::MAX
                    } else {
                        depth as u32
                    },
                    max_sequences,
                    max_batch_rows: 0,
                    kv_tokens,
                    hidden_state_export: true,
                    mtp_head: h.weights.mtp.is_some(),
                    snapshot_bytes_per_slot: layout.plane_bytes(),
                    tree_verify: true,
                };
                (capabilities, depth)
            }
        };
        capabilities.max_batch_rows = Self::batch_rows(&capabilities) as u32;
        Ok((capabilities, depth))
    }

    /// Rows per pass for an instance advertising `capabilities`: every sequence's verify
    /// batch fits one pass, and prefill runs in passes of at least [`MIN_BATCH_ROWS`].
    pub fn batch_rows(capabilities: &Capabilities) -> usize {
        let verify = capabilities.max_verify_tokens as usize;
        MIN_BATCH_ROWS.max(verify * capabilities.max_sequences.max(1) as usize)
    }

    /// The backend: `executor` over the model with an empty sequence, advertising
    /// `capabilities` and evaluating in chunks of `batch_rows` rows.
    pub fn finish<X: Executor>(
        self,
        executor: X,
        capabilities: Capabilities,
        batch_rows: usize,
    ) -> Backend<X> {
        let setup = Setup {
            plugin: self.plugin,
            capabilities,
            n_ctx: self.n_ctx,
            batch_rows,
            deep_rollback: self.common.deep_rollback,
        };
        Backend::new(self.model, self.pool, executor, setup)
    }
}

/// Loads the model `params` names and returns it with the context size in effect, warning
/// when the asked one exceeds what the model was trained for.
pub fn load_model(plugin: &str, params: &BackendParams) -> Result<(Model, usize), PluginError> {
    let path = Path::new(params.model_path.as_str());
    let model = Model::load(path).map_err(|e| attribute(plugin, e.into()))?;
    let n_ctx = model.context_size(params.context_size);
    if params.context_size > n_ctx {
        tracing::warn!(
            "{plugin}: context size {} exceeds the {n_ctx} tokens {} was trained for; using {n_ctx}",
            params.context_size,
            path.display()
        );
    }
    Ok((model, n_ctx as usize))
}

/// The backend's private worker pool: `params.threads` threads, or one per CPU for 0.
pub fn thread_pool(plugin: &str, params: &BackendParams) -> Result<ThreadPool, PluginError> {
    let threads = match params.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n as usize,
    };
    ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name({
            let plugin = plugin.to_string();
            move |i| format!("{plugin}-{i}")
        })
        .build()
        .map_err(|e| {
            PluginError::new(
                ErrorKind::Internal,
                format!("{plugin}: cannot start {threads} worker threads: {e}"),
            )
        })
}

/// The attention positions of an instance's block pool: `params.kv_tokens`, or room for every
/// sequence to fill the context (`max_sequences × n_ctx`) for 0; whole blocks.
pub fn kv_tokens(params: &BackendParams, n_ctx: usize) -> usize {
    let blocks = match params.kv_tokens {
        0 => (params.max_sequences.max(1) as usize).saturating_mul(KvPool::blocks_for(n_ctx)),
        n => KvPool::blocks_for(n as usize),
    };
    blocks.max(1).saturating_mul(BLOCK_TOKENS)
}

/// The most sequences one instance holds.
pub const MAX_SEQUENCES: u32 = 1024;

/// The verify capacity asked for: `params.max_verify_tokens`, or the default for 0.
pub fn requested_verify(params: &BackendParams) -> usize {
    match params.max_verify_tokens {
        0 => DEFAULT_MAX_VERIFY_TOKENS as usize,
        n => n as usize,
    }
}

/// The depth of a snapshot ring of `plane_bytes` per plane: the `requested` verify capacity,
/// lowered (with a warning) to what `budget` bytes hold. Fewer than two planes cannot run
/// the recurrence, which is an `OutOfMemory` error.
pub fn ring_depth(
    plugin: &str,
    path: &Path,
    plane_bytes: u64,
    requested: usize,
    budget: Option<u64>,
) -> Result<usize, PluginError> {
    let plane = plane_bytes.max(1);
    let mut n_planes = requested.saturating_add(1);
    if let Some(budget) = budget {
        n_planes = n_planes.min(usize::try_from(budget / plane).unwrap_or(usize::MAX));
    }
    if n_planes < 2 {
        return Err(PluginError::new(
            ErrorKind::OutOfMemory,
            format!(
                "{plugin}: the recurrent-state ring needs at least 2 slots of {plane} bytes; the budget {} = {} holds {n_planes}",
                options::OPTION_RING_BUDGET_BYTES,
                budget.unwrap_or(0)
            ),
        ));
    }
    let depth = n_planes - 1;
    if depth < requested {
        tracing::warn!(
            "{plugin}: the recurrent-state ring of {} holds {depth} snapshots of {plane} bytes instead of the {requested} asked for ({} = {}); verify batches and rollback are limited to {depth} tokens",
            path.display(),
            options::OPTION_RING_BUDGET_BYTES,
            budget.unwrap_or(0)
        );
    }
    Ok(depth)
}
