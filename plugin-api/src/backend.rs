//! The backend contract: one model, many sequences, one forward pass over all of them.

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
    /// The most sequences the host keeps at once; 0 means 1.
    pub max_sequences: u32,
    /// Attention KV positions the instance keeps over all its sequences (its block pool);
    /// 0 means `max_sequences` times the context size.
    pub kv_tokens: u32,
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
    /// The most tokens of one sequence the host should verify in one pass (the snapshot ring
    /// keeps this many states per sequence).
    pub max_verify_tokens: u32,
    /// How many tokens back [`ForwardPass::truncate`] can go without recomputation:
    /// `u32::MAX` for pure-attention models, the snapshot-ring depth for recurrent ones.
    pub rollback_depth: u32,
    /// The most sequences live at once.
    pub max_sequences: u32,
    /// The most rows (over all chunks) one forward pass takes; larger batches run in several.
    pub max_batch_rows: u32,
    /// Attention KV capacity in tokens, over all sequences.
    pub kv_tokens: u64,
    /// [`ForwardPass::hidden_states`] works.
    pub hidden_state_export: bool,
    /// [`ForwardPass::mtp_eval_batch`] works.
    pub mtp_head: bool,
    /// Bytes one recurrent-state snapshot slot occupies (0 for pure-attention models).
    pub snapshot_bytes_per_slot: u64,
    /// [`EvalChunk::parents`] may describe a tree (tree speculation) and
    /// [`ForwardPass::seq_keep_path`] works.
    pub tree_verify: bool,
}

/// How full an instance's attention KV pool is, in blocks of `block_tokens` positions.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvUsage {
    /// Positions per block (0 where the backend reports no pool).
    pub block_tokens: u32,
    pub blocks_total: u64,
    /// Blocks live sequences hold.
    pub blocks_used: u64,
    /// Blocks only the prefix cache keeps (reclaimed, least recently used first, when needed).
    pub blocks_cached: u64,
}

impl KvUsage {
    /// Blocks nothing holds.
    pub fn blocks_free(&self) -> u64 {
        self.blocks_total
            .saturating_sub(self.blocks_used + self.blocks_cached)
    }
}

/// Which rows of an [`EvalChunk`] get logits.
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

/// A sequence of one backend instance: the handle [`ForwardPass::seq_create`] returns.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

/// The parent of a tree row that continues the sequence itself (see [`EvalChunk::parents`]).
pub const TREE_ROOT: u32 = u32::MAX;

/// One sequence's part of an [`ForwardPass::eval_batch`]: `tokens` appended at the positions
/// after the sequence, the logits of `rows` of them returned.
///
/// With `parents` empty the tokens are a chain: each continues the one before it. Otherwise
/// (a backend advertising [`Capabilities::tree_verify`]) they are a tree in topological order:
/// `parents[i]` is the index of the row token `i` continues (less than `i`), or [`TREE_ROOT`]
/// for a row that continues the sequence's last token. A row is at the position after its
/// parent's and sees the sequence and its own ancestors only, so its logits are the bits of
/// evaluating the path to it alone. Until [`ForwardPass::seq_keep_path`] keeps one path (or
/// [`ForwardPass::truncate`] cuts the tree off) the sequence takes no other evaluation.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct EvalChunk<'a> {
    pub seq: SeqId,
    pub tokens: RSlice<'a, u32>,
    pub rows: LogitRows,
    pub parents: RSlice<'a, u32>,
}

impl<'a> EvalChunk<'a> {
    /// A chunk of consecutive tokens (no tree).
    pub fn chain(seq: SeqId, tokens: &'a [u32], rows: LogitRows) -> Self {
        Self {
            seq,
            tokens: RSlice::from_slice(tokens),
            rows,
            parents: RSlice::empty(),
        }
    }

    /// A chunk of `tokens` forming the tree `parents` (see [`EvalChunk`]).
    pub fn tree(seq: SeqId, tokens: &'a [u32], parents: &'a [u32], rows: LogitRows) -> Self {
        Self {
            seq,
            tokens: RSlice::from_slice(tokens),
            rows,
            parents: RSlice::from_slice(parents),
        }
    }
}

/// One sequence's part of an [`ForwardPass::mtp_eval_batch`]: the MTP head over consecutive
/// positions `position ..` of the sequence. Row `i` takes the final-norm hidden state of
/// position `position + i` (`hidden`, row-major, `hidden_size` per row) and the token at
/// `position + i + 1` (`tokens[i]`), and gives the logits for position `position + i + 2`.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct MtpChunk<'a> {
    pub seq: SeqId,
    pub hidden: RSlice<'a, f32>,
    pub tokens: RSlice<'a, u32>,
    pub position: usize,
    pub rows: LogitRows,
}

/// One model and the sequences evaluated over it (each with its KV cache, recurrent state and
/// snapshot ring).
///
/// Positions are implicit: a sequence holds [`seq_len`](ForwardPass::seq_len) tokens, and an
/// evaluation appends at the positions that follow. One [`eval_batch`](ForwardPass::eval_batch)
/// evaluates chunks of several sequences in one forward pass (every weight matrix read once for
/// all rows); each row is bit-identical to the same token evaluated alone in its sequence,
/// whatever else shares the pass. The single-sequence calls of [`SequenceCalls`] wrap it.
#[sabi_trait]
pub trait ForwardPass: Send + Sync {
    /// Facts about the loaded model.
    fn model_info(&self) -> ModelInfo;

    /// What this backend instance can do.
    fn capabilities(&self) -> Capabilities;

    /// A new, empty sequence; an error ([`crate::ErrorKind::ContextFull`]) when
    /// [`Capabilities::max_sequences`] are live.
    fn seq_create(&mut self) -> PluginResult<SeqId>;

    /// A new sequence holding what `seq` holds (its tokens, caches, recurrent state and
    /// rollback window): attention pages are shared until either writes them.
    fn seq_fork(&mut self, seq: SeqId) -> PluginResult<SeqId>;

    /// Ends `seq` and releases what it held.
    fn seq_free(&mut self, seq: SeqId) -> PluginResult<()>;

    /// Gives the empty `seq` the longest start of `tokens` whose state the instance still
    /// holds from earlier evaluations (the prefix cache: whole blocks of positions any
    /// sequence evaluated with exactly these tokens before them — for a model with recurrent
    /// layers, up to a block boundary whose recurrent state it kept), never the last token —
    /// its logits are what the caller evaluates next — and returns how many tokens `seq` now
    /// holds. The caller then evaluates `tokens[returned..]`: the logits are the bits a full
    /// evaluation gives, and [`hidden_states`](ForwardPass::hidden_states) covers the
    /// evaluated rows only. With an MTP head, the head's cache holds the returned positions
    /// too, as if a drafter had stepped it through them ([`mtp_eval_batch`](ForwardPass::mtp_eval_batch)
    /// continues at that position). 0 when nothing is cached, or where the backend keeps no
    /// prefix cache.
    fn seq_reuse_prefix(&mut self, seq: SeqId, tokens: RSlice<'_, u32>) -> PluginResult<usize>;

    /// Number of tokens in `seq`; an error once the instance is unusable (an earlier call
    /// panicked).
    fn seq_len(&self, seq: SeqId) -> PluginResult<usize>;

    /// How full the attention KV pool is now.
    fn kv_usage(&self) -> KvUsage;

    /// Evaluates every chunk's tokens at the positions after its sequence, all in one forward
    /// pass (several passes of [`Capabilities::max_batch_rows`] rows when they do not fit one),
    /// and writes the logits of the requested rows into `logits`: chunk by chunk in order,
    /// row-major, `vocab_size` per row (resized). A sequence appears at most once per batch.
    ///
    /// Every row is bit-identical to the logits a single-token eval of that token at the same
    /// position of its sequence would return.
    fn eval_batch(
        &mut self,
        chunks: RSlice<'_, EvalChunk<'_>>,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()>;

    /// Cuts `seq` back to `len` tokens: attention KV is cut, recurrent state restored from the
    /// sequence's snapshot ring. Fails with a clear error if `len` is beyond the rollback
    /// window of a recurrent model.
    fn truncate(&mut self, seq: SeqId, len: usize) -> PluginResult<()>;

    /// After an evaluation of `seq` whose chunk was a tree ([`EvalChunk::parents`]): keeps
    /// the tree's rows `path` — a root, then a child of it, and so on — as the sequence's next
    /// tokens, in that order, and drops the other rows (their cache entries and states). The
    /// sequence then holds `path.len()` tokens more than before the tree, exactly as if the
    /// path alone had been evaluated, and [`hidden_states`](ForwardPass::hidden_states)
    /// returns the path's rows. An error names what does not hold.
    fn seq_keep_path(&mut self, seq: SeqId, path: RSlice<'_, u32>) -> PluginResult<()>;

    /// The final-norm hidden states of every row `seq` had in the last evaluation of it
    /// (row-major, `hidden_size` per row; resized).
    fn hidden_states(&self, seq: SeqId, out: &mut RVec<f32>) -> PluginResult<()>;

    /// The MTP head over every chunk, in one pass: `hidden_out` receives every row's
    /// final-norm hidden state of the head (which feeds a chained step), chunk by chunk;
    /// `logits` the rows asked for (row-major, `vocab_size` per row; resized).
    ///
    /// The head keeps its own KV cache per sequence, one entry per position. A chunk at
    /// `position` first cuts its sequence's head cache to `position` entries (so `position`
    /// may not exceed its length), then appends one entry per row: feeding every accepted
    /// position keeps the cache in step with the trunk, and chained draft steps overwrite each
    /// other's speculative entries. [`truncate`] cuts it together with the trunk. Row `i` is
    /// bit-identical to a one-row call at `position + i`.
    ///
    /// [`truncate`]: ForwardPass::truncate
    #[sabi(last_prefix_field)]
    fn mtp_eval_batch(
        &mut self,
        chunks: RSlice<'_, MtpChunk<'_>>,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()>;
}

/// One-sequence calls over [`ForwardPass`]'s batched ones (a batch of one chunk).
pub trait SequenceCalls: ForwardPass {
    /// Evaluates `tokens` at the positions after `seq` ([`ForwardPass::eval_batch`] of one
    /// chunk).
    fn eval(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        let chunk = EvalChunk::chain(seq, tokens, rows);
        self.eval_batch(RSlice::from_slice(&[chunk]), logits)
    }

    /// Evaluates the tree `tokens` / `parents` after `seq` ([`ForwardPass::eval_batch`] of one
    /// tree chunk), logits for every row.
    fn eval_tree(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        parents: &[u32],
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        let chunk = EvalChunk::tree(seq, tokens, parents, LogitRows::All);
        self.eval_batch(RSlice::from_slice(&[chunk]), logits)
    }

    /// The MTP head over consecutive positions of `seq` ([`ForwardPass::mtp_eval_batch`] of one
    /// chunk).
    #[allow(clippy::too_many_arguments)]
    fn mtp_eval(
        &mut self,
        seq: SeqId,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        let chunk = MtpChunk {
            seq,
            hidden: RSlice::from_slice(hidden),
            tokens: RSlice::from_slice(tokens),
            position,
            rows,
        };
        self.mtp_eval_batch(RSlice::from_slice(&[chunk]), logits, hidden_out)
    }
}

impl<T: ForwardPass + ?Sized> SequenceCalls for T {}

/// An owned backend instance as returned by a backend plugin.
pub type BoxedForwardPass = ForwardPass_TO<'static, RBox<()>>;

/// A borrowed backend instance, as handed to drafters for the duration of one call.
pub type ForwardPassMut<'a> = ForwardPass_TO<'a, RMut<'a, ()>>;

/// Boxes a backend implementation for return across the boundary.
pub fn box_forward_pass<T: ForwardPass + 'static>(backend: T) -> BoxedForwardPass {
    ForwardPass_TO::from_value(backend, TD_Opaque)
}
