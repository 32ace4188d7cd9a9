//! The backend contract: one model, one sequence state.

// abi_stable's `#[sabi_trait]` expands to impls inside a const block.
#![allow(non_local_definitions)]

use abi_stable::sabi_trait;
use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::sabi_types::RMut;
use abi_stable::std_types::{RBox, ROption, RSlice, RString, RVec, Tuple2};
use abi_stable::StableAbi;

use crate::error::PluginResult;

/// How a backend is asked to open a model (from the profile's `[target]` section).
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct BackendParams {
    /// Path of the GGUF model file.
    pub model_path: RString,
    /// Worker threads; 0 means one per available core.
    pub threads: u32,
    /// Context size in tokens; 0 means the model's own context length.
    pub context_size: u32,
    /// The largest verify batch the host intends to use (the snapshot-ring depth of recurrent
    /// models); the backend may advertise less.
    pub max_verify_tokens: u32,
    /// Backend-specific settings from the profile's `[target.options]` table, as text.
    pub options: RVec<Tuple2<RString, RString>>,
}

/// Facts about the loaded model.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// `general.architecture`, e.g. `llama`.
    pub architecture: RString,
    /// `general.name`, or the file stem.
    pub name: RString,
    pub vocab_size: u32,
    /// The context size in effect (profile, capped by the model's).
    pub context_size: u32,
    /// The context length the model was trained for.
    pub train_context_length: u32,
    pub hidden_size: u32,
    pub n_layers: u32,
    pub bos_token: ROption<u32>,
    pub eos_token: ROption<u32>,
    pub has_mtp_head: bool,
    pub n_params: u64,
    /// Bytes of weights read per forward token (for roofline figures).
    pub weight_bytes: u64,
}

/// What a backend can do. Absent capabilities are `0` / `false`, never faked.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The most tokens one [`ForwardPass::eval`] verifies with per-row logits.
    pub max_verify_tokens: u32,
    /// How many tokens back [`ForwardPass::truncate`] can go without recomputation:
    /// `u32::MAX` for pure-attention models, the snapshot-ring depth for recurrent ones.
    pub rollback_depth: u32,
    /// [`ForwardPass::hidden_states`] works.
    pub hidden_state_export: bool,
    /// [`ForwardPass::mtp_eval`] works.
    pub mtp_head: bool,
    /// Bytes one recurrent-state snapshot slot occupies (0 for pure-attention models).
    pub snapshot_bytes_per_slot: u64,
}

/// Which rows of an [`ForwardPass::eval`] get logits.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// No logits (pure cache fill).
    None,
    /// Only the last row (prefill, plain decode).
    Last,
    /// Every row (verify).
    All,
}

impl LogitRows {
    /// How many rows of logits an eval of `n_tokens` returns.
    pub fn count(self, n_tokens: usize) -> usize {
        match self {
            LogitRows::None => 0,
            LogitRows::Last => usize::from(n_tokens > 0),
            LogitRows::All => n_tokens,
        }
    }
}

/// One model with one sequence state (KV cache and recurrent state).
///
/// Positions are implicit: the sequence holds [`seq_len`](ForwardPass::seq_len) tokens, and
/// `eval` appends at the positions that follow.
#[sabi_trait]
pub trait ForwardPass: Send + Sync {
    /// Facts about the loaded model.
    fn model_info(&self) -> ModelInfo;

    /// What this backend instance can do.
    fn capabilities(&self) -> Capabilities;

    /// Number of tokens in the sequence state; an error once the instance is unusable (an
    /// earlier call panicked).
    fn seq_len(&self) -> PluginResult<usize>;

    /// Evaluates `tokens` at positions `seq_len() ..`, in one pass, and writes the logits of
    /// the requested rows into `logits` (row-major, `vocab_size` per row; resized).
    ///
    /// Row `i` of a multi-token eval is bit-identical to the logits a single-token eval of
    /// `tokens[i]` at the same position would return.
    fn eval(
        &mut self,
        tokens: RSlice<'_, u32>,
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()>;

    /// Cuts the sequence back to `len` tokens: attention KV is cut, recurrent state restored
    /// from the snapshot ring. Fails with a clear error if `len` is beyond the rollback window
    /// of a recurrent model.
    fn truncate(&mut self, len: usize) -> PluginResult<()>;

    /// The final-norm hidden states of every row of the last `eval`
    /// (row-major, `hidden_size` per row; resized).
    fn hidden_states(&self, out: &mut RVec<f32>) -> PluginResult<()>;

    /// The MTP head over consecutive positions, in one pass: row `i` takes the final-norm
    /// hidden state of position `position + i` (`hidden`, row-major, `hidden_size` per row)
    /// and the token at `position + i + 1` (`tokens[i]`), and gives the logits for position
    /// `position + i + 2` and the head's own final-norm hidden state, which feeds a chained
    /// step. `hidden_out` receives every row's hidden state; `logits` the rows asked for
    /// (row-major, `vocab_size` per row; resized).
    ///
    /// The head keeps its own KV cache, one entry per position. A call at `position` first
    /// cuts that cache to `position` entries (so `position` may not exceed its length), then
    /// appends one entry per row: feeding every accepted position keeps the cache in step with
    /// the trunk, and chained draft steps overwrite each other's speculative entries.
    /// [`truncate`] cuts it together with the trunk. Row `i` is bit-identical to a one-row
    /// call at `position + i`.
    ///
    /// [`truncate`]: ForwardPass::truncate
    #[sabi(last_prefix_field)]
    #[allow(clippy::too_many_arguments)]
    fn mtp_eval(
        &mut self,
        hidden: RSlice<'_, f32>,
        tokens: RSlice<'_, u32>,
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()>;
}

/// An owned backend instance as returned by a backend plugin.
pub type BoxedForwardPass = ForwardPass_TO<'static, RBox<()>>;

/// A borrowed backend instance, as handed to drafters for the duration of one call.
pub type ForwardPassMut<'a> = ForwardPass_TO<'a, RMut<'a, ()>>;

/// Boxes a backend implementation for return across the boundary.
pub fn box_forward_pass<T: ForwardPass + 'static>(backend: T) -> BoxedForwardPass {
    ForwardPass_TO::from_value(backend, TD_Opaque)
}
