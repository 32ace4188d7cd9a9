//! Opening a model on the CPU: cpu-simd's options, the weight repacking and the caches; the
//! forward pass is the engine's [`Backend`] over a [`CpuExecutor`] of the whole model.
//!
//! **Hybrid models** (qwen35, qwen3next) keep, besides the attention KV cache, the recurrent
//! state of their Gated DeltaNet layers in a snapshot ring of `depth + 1` planes, where
//! `depth` is the verify capacity (`BackendParams::max_verify_tokens`, default 8, lowered with
//! a warning when the memory for it cannot be had or exceeds the `ring_budget_bytes` option).
//! Every evaluated token writes its state into the next plane, so:
//!
//! * a k-token verify (k ≤ depth) leaves the state after each of its tokens in the ring;
//! * truncating to any length of the last `depth` tokens selects that plane and cuts the KV
//!   cache: O(1), nothing is recomputed. Rolled-back tokens' planes are reused by the next
//!   tokens, and states older than `depth` evaluated tokens are gone, so the window is "the
//!   last `depth` tokens evaluated, back to where the sequence still agrees with them": a
//!   verify batch of up to `depth` tokens can always be rolled back to its start;
//! * truncating further back takes the **slow path**: the backend keeps the sequence's tokens
//!   and re-decodes the kept prefix from the empty state (one pass over `len` tokens, exact).
//!   The option `deep_rollback = "refuse"` turns that into an `InvalidInput` error instead.
//!
//! The MTP head (models with a NextN block) has its own one-layer KV cache, one entry per
//! position; an MTP eval at `position` cuts it to `position` entries and appends, and
//! truncation cuts it together with the trunk.
//!
//! Options (`[target.options]` of the profile): the engine's `ring_budget_bytes` and
//! `deep_rollback`, `kv_type` ([`specula_engine::backend::options`]: `f16` by default, `f32`
//! for an exact cache, `q8_0` for half of f16's memory) and `prefix_state_bytes`, and
//! `weight_layout` (`interleaved`, the default: Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K matrices are
//! repacked at load into interleaved 16-row groups where the CPU has AVX2 or AVX-512, which
//! makes the multi-row verify pass several times cheaper; `file`: every matrix is read from the
//! mapped file as stored). An unknown option is an error naming the known
//! ones.

use std::path::Path;

use specula_engine::backend::opening::{self, Opening};
use specula_engine::backend::options::{self, CommonOptions, Parsed};
use specula_engine::backend::{attribute, Backend};
use specula_engine::cpu::{CpuExecutor, CpuPart};
use specula_engine::model::Graph;
use specula_plugin_api::{BackendParams, Capabilities, ModelInfo, PluginError};

use crate::PLUGIN_NAME as PLUGIN;

/// A model opened on the CPU with its sequence state.
pub type CpuBackend = Backend<CpuExecutor>;

/// Backend option: how weight matrices are laid out in memory (`interleaved` or `file`).
pub const OPTION_WEIGHT_LAYOUT: &str = "weight_layout";

/// Where the multiplied weight matrices live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K matrices repacked at load into interleaved 16-row
    /// groups, where the SIMD level has a kernel for them (AVX2, AVX-512, AMX): the multi-row
    /// verify pass reads them several times faster. Costs a moment at load; the copies replace
    /// the file's pages in memory.
    Interleaved,
    /// Every matrix read straight from the memory-mapped file.
    File,
}

/// The backend options cpu-simd understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Options {
    common: CommonOptions,
    weight_layout: WeightLayout,
}

impl Options {
    /// Parses the options, reporting every bad one (not only the first) in one error.
    fn parse(params: &BackendParams) -> Result<Self, PluginError> {
        let mut weight_layout = WeightLayout::Interleaved;
        let own_keys = [OPTION_WEIGHT_LAYOUT];
        let common = options::parse(PLUGIN, params, &own_keys, |key, value| match key {
            OPTION_WEIGHT_LAYOUT => match value {
                "interleaved" => {
                    weight_layout = WeightLayout::Interleaved;
                    Parsed::Ok
                }
                "file" => {
                    weight_layout = WeightLayout::File;
                    Parsed::Ok
                }
                _ => Parsed::Expected("'interleaved' or 'file'"),
            },
            _ => Parsed::Unknown,
        })?;
        Ok(Options {
            common,
            weight_layout,
        })
    }
}

/// Checks `params` as [`open`] does — the options and the model file's header, tensor
/// records and shapes — without reading weights or allocating caches.
pub fn probe(params: &BackendParams) -> Result<ModelInfo, PluginError> {
    Options::parse(params)?;
    let (model, n_ctx) = opening::load_model(PLUGIN, params)?;
    Ok(model.info(n_ctx as u32))
}

/// Opens the model named by `params`, with room for `params.max_sequences` sequences.
pub fn open(params: &BackendParams) -> Result<CpuBackend, PluginError> {
    let options = Options::parse(params)?;
    let mut opening = Opening::start(PLUGIN, params, options.common)?;
    let path = Path::new(params.model_path.as_str());
    if options.weight_layout == WeightLayout::Interleaved {
        let started = std::time::Instant::now();
        let model = &mut opening.model;
        let bytes = opening
            .pool
            .install(|| model.interleave_weights(|_| true))
            .map_err(|e| attribute(PLUGIN, e))?;
        if bytes > 0 {
            tracing::info!(
                "{PLUGIN}: repacked {:.1} MiB of weights into interleaved row groups in {:.2?}",
                bytes as f64 / (1 << 20) as f64,
                started.elapsed()
            );
        }
    }
    let (model, n_ctx) = (&opening.model, opening.n_ctx);
    let (capabilities, ring_depth) = opening.capabilities()?;
    let batch_rows = Opening::batch_rows(&capabilities);
    let part = CpuPart {
        layers: 0,
        head: true,
        batch_rows,
        kv_type: options.common.kv_type,
        kv_tokens: opening.kv_tokens,
        ring_depth,
        max_sequences: opening.max_sequences,
        prefix_cache: true,
        prefix_state_bytes: options.common.prefix_state_bytes,
    };
    let executor = CpuExecutor::whole_model(model, part).map_err(|e| attribute(PLUGIN, e))?;
    let depth = executor.ring_depth();
    let capabilities = if matches!(model.graph, Graph::Hybrid(_)) && depth < ring_depth {
        tracing::warn!(
            "{PLUGIN}: could allocate only {depth} of the {ring_depth} recurrent-state snapshots of {} asked for; verify batches and rollback are limited to {depth} tokens",
            path.display()
        );
        Capabilities {
            max_verify_tokens: depth as u32,
            rollback_depth: capabilities.rollback_depth.min(depth as u32),
            ..capabilities
        }
    } else {
        capabilities
    };
    tracing::debug!(
        "{PLUGIN}: opened {} ({}, {} layers, {} threads, context {n_ctx}, up to {} sequences, a KV pool of {} positions in {} bytes, {} snapshot bytes per slot × {})",
        path.display(),
        model.arch.name(),
        model.hparams.block_count,
        opening.pool.current_num_threads(),
        capabilities.max_sequences,
        executor.kv_capacity(),
        executor.kv_bytes(),
        capabilities.snapshot_bytes_per_slot,
        capabilities.rollback_depth
    );
    Ok(opening.finish(executor, capabilities, batch_rows))
}
