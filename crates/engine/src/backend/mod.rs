//! The part of a backend that does not depend on where the layers run: written once, used by
//! cpu-simd and cuda-hybrid.
//!
//! A backend is a [`Backend`] over an [`Executor`]. [`Backend`] implements the plugin ABI's
//! [`ForwardPass`]: it validates every call, keeps the sequences (their tokens, the hidden
//! states of their last evaluation, the MTP head's length), splits a batch into passes of at
//! most `batch_rows` rows (several sequences share a pass; a long chunk spans several), and
//! implements truncation — O(1) inside the executor's rollback window, otherwise re-decoding
//! the kept prefix or refusing, as the `deep_rollback` option says. A panicked instance refuses
//! every later call ([`PanicFence`]). Every error leaving it names the plugin.
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
    guard, Capabilities, ErrorKind, EvalChunk, ForwardPass, KvUsage, LogitRows, ModelInfo,
    MtpChunk, PanicFence, PluginError, PluginResult, SeqId, TREE_ROOT,
};

pub use executor::{Chunk, Executor, KeptPath, MtpRows};
pub use options::DeepRollback;

use crate::graph::Tree;
use crate::model::Model;

/// `max_verify_tokens` advertised when the host passes 0.
pub const DEFAULT_MAX_VERIFY_TOKENS: u32 = 8;

/// Rows pushed through the layers together, at least ([`opening::Opening::batch_rows`]: the
/// verify capacity of every sequence when larger). Longer evaluations (prefill) run in passes
/// of this many rows; splitting changes no result, it only bounds scratch memory.
pub const MIN_BATCH_ROWS: usize = 64;

/// How a backend instance was set up: what [`Backend::new`] needs besides the model and the
/// executor.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// The plugin's name, the first word of every error message.
    pub plugin: &'static str,
    /// What the instance advertises, `max_sequences` included (the executor's slots).
    pub capabilities: Capabilities,
    /// The context size in effect.
    pub n_ctx: usize,
    /// Rows per pass (the executor's scratch holds this many).
    pub batch_rows: usize,
    pub deep_rollback: DeepRollback,
}

/// One sequence of a [`Backend`].
#[derive(Debug, Clone)]
struct Sequence {
    id: SeqId,
    /// Every token of the sequence (the slow rollback path replays them).
    tokens: Vec<u32>,
    /// Final-norm hidden states of the rows of its last evaluation, `hidden_rows × n_embd`.
    hidden: Vec<f32>,
    hidden_rows: usize,
    /// Entries in the MTP head's KV cache (`None` without a head).
    mtp_len: Option<usize>,
    /// The tree its last evaluation appended, until a path of it is kept or it is cut off.
    tree: Option<PendingTree>,
}

/// A tree evaluation's rows still in a sequence (after `base` tokens), in evaluation order.
#[derive(Debug, Clone)]
struct PendingTree {
    base: usize,
    parents: Vec<u32>,
}

/// One model and its sequences, evaluated by `X`: the [`ForwardPass`] of a backend plugin.
pub struct Backend<X> {
    setup: Setup,
    model: Model,
    info: ModelInfo,
    pool: ThreadPool,
    executor: X,
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
    /// The executor's sequence slots: the sequence each holds.
    slots: Vec<Option<Sequence>>,
    /// The id the next new sequence gets (ids are never reused).
    next_id: u32,
    /// Final-norm hidden states of one pass's rows.
    pass_hidden: Vec<f32>,
    /// Truncations that took the slow path (re-decoding).
    slow_rollbacks: u64,
    /// Set when resetting the executor's state failed: its caches may disagree with the
    /// sequences, so every later call is refused.
    broken: Option<String>,
}

impl<X> std::fmt::Debug for Backend<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(self.setup.plugin)
            .field("model", &self.model)
            .field("threads", &self.pool.current_num_threads())
            .field("sequences", &self.slots.iter().flatten().count())
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

/// One sequence's share of a batch, validated: its slot, its tokens, and where they go.
#[derive(Debug, Clone)]
struct Work<'a> {
    slot: usize,
    tokens: &'a [u32],
    rows: LogitRows,
    /// The sequence's length before the batch.
    start: usize,
    /// For a tree: each row's parent and depth (both empty for a chain).
    parents: &'a [u32],
    depths: Vec<u32>,
}

impl Work<'_> {
    /// The tree the tokens form, if they form one.
    fn tree(&self) -> Option<Tree<'_>> {
        (!self.parents.is_empty()).then_some(Tree {
            parents: self.parents,
            depths: &self.depths,
        })
    }
}

/// The depth of each row of the tree `parents` (see [`EvalChunk::parents`]), or what is wrong
/// with it.
fn tree_depths(parents: &[u32], n_tokens: usize) -> Result<Vec<u32>, String> {
    if parents.len() != n_tokens {
        return Err(format!(
            "a tree of {n_tokens} tokens needs {n_tokens} parents, got {}",
            parents.len()
        ));
    }
    let mut depths = Vec::with_capacity(n_tokens);
    for (i, &parent) in parents.iter().enumerate() {
        depths.push(match parent {
            TREE_ROOT => 0,
            p if (p as usize) < i => depths[p as usize] + 1,
            p => {
                return Err(format!(
                    "row {i} of the tree names row {p} as its parent; a parent comes before its children (or is TREE_ROOT)"
                ))
            }
        });
    }
    Ok(depths)
}

/// One sequence's share of an MTP batch, validated.
#[derive(Debug, Clone, Copy)]
struct MtpWork<'a> {
    slot: usize,
    hidden: &'a [f32],
    tokens: &'a [u32],
    position: usize,
    rows: LogitRows,
}

/// Splits the rows of `sizes` (rows per chunk, in order) into passes of at most `batch_rows`
/// rows: each pass is a list of `(chunk, first row, rows)` pieces.
fn plan_passes(sizes: impl Iterator<Item = usize>, batch_rows: usize) -> Vec<Vec<[usize; 3]>> {
    let mut passes = vec![Vec::new()];
    let mut room = batch_rows;
    for (chunk, n) in sizes.enumerate() {
        let mut done = 0;
        while done < n {
            if room == 0 {
                passes.push(Vec::new());
                room = batch_rows;
            }
            let take = room.min(n - done);
            passes
                .last_mut()
                .expect("one pass")
                .push([chunk, done, take]);
            done += take;
            room -= take;
        }
    }
    passes.retain(|pass| !pass.is_empty());
    passes
}

/// Rows `first .. first + take` of a chunk of `n` rows that asks for `rows`: which of them
/// (from the returned index) get logits.
fn piece_logit_from(rows: LogitRows, n: usize, first: usize, take: usize) -> usize {
    let from = n - rows.count(n);
    from.clamp(first, first + take) - first
}

/// Refuses a pass whose final hidden states hold NaN or infinity (`hidden`: the pass's
/// rows, `chunks` in order): such rows come from weights that hold them or from an overflow,
/// and every logit and token computed from them would be noise. A few thousand values a row,
/// against the millions of weights the row read.
fn check_finite(model: &Model, chunks: &[Chunk<'_>], hidden: &[f32]) -> Result<(), PluginError> {
    let Some(at) = hidden.iter().position(|v| !v.is_finite()) else {
        return Ok(());
    };
    let row = at / model.graph.n_embd();
    let mut first = 0;
    let place = chunks
        .iter()
        .find_map(|c| {
            let hit = (first..first + c.rows())
                .contains(&row)
                .then(|| match c.tree {
                    None => format!(
                        " (sequence slot {}, position {})",
                        c.seq,
                        c.pos0 + row - first
                    ),
                    Some(_) => format!(" (sequence slot {}, a tree row)", c.seq),
                });
            first += c.rows();
            hit
        })
        .unwrap_or_default();
    Err(PluginError::model(format!(
        "{}: the hidden state of row {row} of a pass{place} is not finite (NaN or infinity): the model's weights hold NaN or infinity, or an activation overflowed; check the file",
        model.file.path().display()
    )))
}

impl<X: Executor> Backend<X> {
    /// `executor` over `model` with no sequence yet, on `pool`.
    pub fn new(model: Model, pool: ThreadPool, executor: X, setup: Setup) -> Self {
        let info = model.info(u32::try_from(setup.n_ctx).unwrap_or(u32::MAX));
        let slots = (0..setup.capabilities.max_sequences.max(1))
            .map(|_| None)
            .collect();
        Self {
            info,
            pool,
            executor,
            fence: PanicFence::default(),
            slots,
            next_id: 0,
            pass_hidden: Vec::new(),
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

    /// What this instance can do (verify capacity, rollback depth, sequences, MTP head).
    pub fn caps(&self) -> Capabilities {
        self.setup.capabilities
    }

    /// The executor (for backend-specific facts, e.g. where the layers run).
    pub fn executor(&self) -> &X {
        &self.executor
    }

    /// How many truncations went beyond a snapshot ring and re-decoded (0 for dense models).
    pub fn slow_rollbacks(&self) -> u64 {
        self.slow_rollbacks
    }

    fn plugin_error(&self, kind: ErrorKind, what: String) -> PluginError {
        PluginError::new(kind, format!("{}: {what}", self.setup.plugin))
    }

    /// The slot holding `seq`.
    fn slot_of(&self, seq: SeqId) -> Result<usize, PluginError> {
        self.slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.id == seq))
            .ok_or_else(|| {
                self.plugin_error(
                    ErrorKind::InvalidInput,
                    format!("unknown {seq} (never created, or freed); create one with seq_create"),
                )
            })
    }

    fn sequence(&self, seq: SeqId) -> Result<&Sequence, PluginError> {
        let slot = self.slot_of(seq)?;
        Ok(self.slots[slot].as_ref().expect("slot_of found it"))
    }

    fn sequence_mut(&mut self, slot: usize) -> &mut Sequence {
        self.slots[slot].as_mut().expect("a slot found by slot_of")
    }

    /// A free slot, or the error saying all are taken.
    fn free_slot(&self) -> Result<usize, PluginError> {
        self.slots.iter().position(Option::is_none).ok_or_else(|| {
            self.plugin_error(
                ErrorKind::ContextFull,
                format!(
                    "all {} sequences are in use; free one first, or open the backend with a larger max_sequences",
                    self.slots.len()
                ),
            )
        })
    }

    /// A new, empty sequence.
    pub fn create_sequence(&mut self) -> Result<SeqId, PluginError> {
        self.usable()?;
        let slot = self.free_slot()?;
        self.executor
            .add_sequence(slot)
            .map_err(|e| attribute(self.setup.plugin, e))?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.slots[slot] = Some(Sequence {
            id,
            tokens: Vec::new(),
            hidden: Vec::new(),
            hidden_rows: 0,
            mtp_len: self.setup.capabilities.mtp_head.then_some(0),
            tree: None,
        });
        Ok(id)
    }

    /// A new sequence holding what `seq` holds.
    pub fn fork_sequence(&mut self, seq: SeqId) -> Result<SeqId, PluginError> {
        self.usable()?;
        let from = self.slot_of(seq)?;
        let to = self.free_slot()?;
        let parent = self.slots[from].clone().expect("slot_of found it");
        if parent.tree.is_some() {
            return Err(self.unresolved_tree(seq));
        }
        self.executor
            .fork_sequence(from, to, parent.tokens.len())
            .map_err(|e| attribute(self.setup.plugin, e))?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let len = parent.tokens.len();
        self.slots[to] = Some(Sequence {
            id,
            // The head's entries past the trunk (chained drafts) stay the parent's.
            mtp_len: parent.mtp_len.map(|m| m.min(len)),
            ..parent
        });
        Ok(id)
    }

    /// Ends `seq`.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), PluginError> {
        let slot = self.slot_of(seq)?;
        self.executor.remove_sequence(slot);
        self.slots[slot] = None;
        Ok(())
    }

    /// [`ForwardPass::seq_reuse_prefix`] without the panic guard.
    pub fn reuse_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize, PluginError> {
        self.usable()?;
        let slot = self.slot_of(seq)?;
        let len = self.sequence_mut(slot).tokens.len();
        if len > 0 {
            return Err(self.plugin_error(
                ErrorKind::InvalidInput,
                format!("seq_reuse_prefix needs an empty sequence, but {seq} holds {len} tokens"),
            ));
        }
        let vocab = self.info.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(self.plugin_error(
                ErrorKind::InvalidInput,
                format!("token id {bad} is out of range (vocabulary size {vocab})"),
            ));
        }
        let n_ctx = self.setup.n_ctx;
        let reused = self
            .executor
            .reuse_prefix(
                &self.model,
                &self.pool,
                slot,
                &tokens[..tokens.len().min(n_ctx)],
            )
            .map_err(|e| attribute(self.setup.plugin, e))?;
        let seq = self.sequence_mut(slot);
        seq.tokens.extend_from_slice(&tokens[..reused]);
        seq.hidden_rows = 0;
        // The executor rebuilt the MTP head's cache for the reused positions.
        if let Some(mtp_len) = &mut seq.mtp_len {
            *mtp_len = reused;
        }
        Ok(reused)
    }

    /// Tokens in `seq`.
    pub fn seq_length(&self, seq: SeqId) -> Result<usize, PluginError> {
        Ok(self.sequence(seq)?.tokens.len())
    }

    /// The lengths of `seq` [`truncate_to`](Self::truncate_to) restores in O(1): every length
    /// for a pure-attention model, the snapshot ring's window for a hybrid one.
    pub fn rollback_window(&self, seq: SeqId) -> Result<RangeInclusive<usize>, PluginError> {
        let slot = self.slot_of(seq)?;
        let len = self.slots[slot].as_ref().map_or(0, |s| s.tokens.len());
        Ok(self.executor.window(slot, len))
    }

    /// Entries in `seq`'s MTP head cache (`None` without a head).
    pub fn mtp_len(&self, seq: SeqId) -> Result<Option<usize>, PluginError> {
        Ok(self.sequence(seq)?.mtp_len)
    }

    /// Final-norm hidden states of every row of `seq`'s last evaluation (`rows × hidden_size`).
    pub fn last_hidden_states(&self, seq: SeqId) -> Result<&[f32], PluginError> {
        let s = self.sequence(seq)?;
        Ok(&s.hidden[..s.hidden_rows * self.model.graph.n_embd()])
    }

    /// The error for a call on a sequence that still holds a whole tree.
    fn unresolved_tree(&self, seq: SeqId) -> PluginError {
        self.plugin_error(
            ErrorKind::InvalidInput,
            format!("{seq} still holds every row of its last evaluation, a tree: keep one path of it (seq_keep_path) or truncate it to where the tree began first"),
        )
    }

    /// Refuses every call once the executor's state could not be reset.
    fn usable(&self) -> Result<(), PluginError> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(self.plugin_error(
                ErrorKind::Internal,
                format!("this instance refuses every call since resetting its state failed ({why}); open a new instance"),
            )),
        }
    }

    /// One sequence's evaluation ([`Self::eval_batch_into`] of one chunk).
    pub fn eval_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.eval_batch_into(&[EvalChunk::chain(seq, tokens, rows)], logits)
    }

    /// [`ForwardPass::eval_batch`] without the panic guard.
    pub fn eval_batch_into(
        &mut self,
        chunks: &[EvalChunk<'_>],
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        let work = self.validate(chunks)?;
        // A full cache fails here, before anything is computed or changed.
        self.reserve(&work)
            .map_err(|e| attribute(self.setup.plugin, e))?;
        let result = self.forward(&work, logits);
        if result.is_err() {
            self.recover(&work);
        }
        result.map_err(|e| attribute(self.setup.plugin, e))
    }

    fn validate<'a>(&self, chunks: &[EvalChunk<'a>]) -> Result<Vec<Work<'a>>, PluginError> {
        self.usable()?;
        if chunks.is_empty() {
            return Err(self.plugin_error(
                ErrorKind::InvalidInput,
                "eval_batch called with no chunks".into(),
            ));
        }
        let vocab = self.info.vocab_size;
        let n_ctx = self.setup.n_ctx;
        let mut work: Vec<Work<'a>> = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let (seq, tokens) = (chunk.seq, chunk.tokens.as_slice());
            let slot = self.slot_of(seq)?;
            if work.iter().any(|w| w.slot == slot) {
                return Err(self.plugin_error(
                    ErrorKind::InvalidInput,
                    format!("{seq} appears twice in one eval_batch; give each sequence one chunk"),
                ));
            }
            if tokens.is_empty() {
                return Err(self.plugin_error(
                    ErrorKind::InvalidInput,
                    format!("eval called with no tokens for {seq}"),
                ));
            }
            if let Some(bad) = tokens.iter().find(|&&t| t >= vocab) {
                return Err(self.plugin_error(
                    ErrorKind::InvalidInput,
                    format!("token id {bad} is out of range (vocabulary size {vocab})"),
                ));
            }
            let sequence = self.slots[slot].as_ref().expect("slot_of found it");
            if sequence.tree.is_some() {
                return Err(self.unresolved_tree(seq));
            }
            let parents = chunk.parents.as_slice();
            let depths = if parents.is_empty() {
                Vec::new()
            } else if !self.setup.capabilities.tree_verify {
                return Err(self.plugin_error(
                    ErrorKind::Unsupported,
                    format!("{seq}: this backend does not verify trees (capability tree_verify is false); send the drafts as a chain"),
                ));
            } else if tokens.len() > self.setup.capabilities.max_verify_tokens as usize {
                // Every row's state is kept until a path is chosen: the snapshot ring's depth.
                return Err(self.plugin_error(
                    ErrorKind::InvalidInput,
                    format!(
                        "{seq}: a tree of {} rows is larger than the {} a verify pass takes (max_verify_tokens)",
                        tokens.len(),
                        self.setup.capabilities.max_verify_tokens
                    ),
                ));
            } else {
                tree_depths(parents, tokens.len()).map_err(|what| {
                    self.plugin_error(ErrorKind::InvalidInput, format!("{seq}: {what}"))
                })?
            };
            let len = sequence.tokens.len();
            if len + tokens.len() > n_ctx {
                return Err(self.plugin_error(
                    ErrorKind::ContextFull,
                    format!(
                        "context full: {len} tokens in {seq} + {} new exceed the context size {n_ctx}",
                        tokens.len()
                    ),
                ));
            }
            work.push(Work {
                slot,
                tokens,
                rows: chunk.rows,
                start: len,
                parents,
                depths,
            });
        }
        Ok(work)
    }

    /// After an evaluation of `work` failed: every sequence of it back to what it held before,
    /// so that no later call computes from a half-written state. A pure-attention sequence is
    /// cut back (O(1)); a recurrent one may have had snapshots overwritten by the steps that
    /// ran, so it is re-decoded; where that fails too, the instance refuses every later call.
    fn recover(&mut self, work: &[Work<'_>]) {
        let recurrent = self.setup.capabilities.rollback_depth != u32::MAX;
        for w in work {
            let seq = self.sequence_mut(w.slot);
            seq.hidden_rows = 0;
            if let Some(mtp_len) = &mut seq.mtp_len {
                *mtp_len = (*mtp_len).min(w.start);
            }
            let restored = if recurrent {
                self.redecode(w.slot, w.start)
            } else {
                self.executor.rollback(w.slot, w.start).map(|_| ())
            };
            if let Err(e) = restored {
                self.broken = Some(format!(
                    "restoring a sequence after a failed evaluation failed: {}",
                    e.message
                ));
            }
        }
    }

    /// Takes the cache room for every row of `work` (see [`Executor::reserve`]).
    fn reserve(&mut self, work: &[Work<'_>]) -> Result<(), PluginError> {
        let whole: Vec<Chunk<'_>> = work
            .iter()
            .map(|w| Chunk {
                seq: w.slot,
                tokens: w.tokens,
                pos0: w.start,
                first: 0,
                logit_from: w.tokens.len(),
                tree: w.tree(),
            })
            .collect();
        self.executor.reserve(&whole)
    }

    /// Evaluates validated and [`reserve`](Self::reserve)d `work` in passes of at most
    /// `batch_rows` rows: logits chunk by chunk into `logits`, each sequence's hidden states
    /// into its own buffer.
    fn forward(&mut self, work: &[Work<'_>], logits: &mut RVec<f32>) -> Result<(), PluginError> {
        let e = self.model.graph.n_embd();
        let vocab = self.info.vocab_size as usize;
        logits.clear();
        logits.resize(
            work.iter()
                .map(|w| w.rows.count(w.tokens.len()))
                .sum::<usize>()
                * vocab,
            0.0,
        );
        for w in work {
            let seq = self.sequence_mut(w.slot);
            seq.hidden_rows = 0;
            seq.hidden.resize(w.tokens.len() * e, 0.0);
        }
        self.pass_hidden.resize(self.setup.batch_rows * e, 0.0);
        let mut logit_at = 0;
        for pass in plan_passes(work.iter().map(|w| w.tokens.len()), self.setup.batch_rows) {
            let chunks: Vec<Chunk<'_>> = pass
                .iter()
                .map(|&[c, first, take]| {
                    let w = &work[c];
                    Chunk {
                        seq: w.slot,
                        tokens: &w.tokens[first..first + take],
                        pos0: w.start + first,
                        first,
                        logit_from: piece_logit_from(w.rows, w.tokens.len(), first, take),
                        tree: w.tree(),
                    }
                })
                .collect();
            let m: usize = chunks.iter().map(Chunk::rows).sum();
            let n_logits: usize = chunks.iter().map(|c| c.rows() - c.logit_from).sum();
            let hidden = &mut self.pass_hidden[..m * e];
            self.executor.forward(
                &self.model,
                &self.pool,
                &chunks,
                hidden,
                &mut logits[logit_at..logit_at + n_logits * vocab],
            )?;
            check_finite(&self.model, &chunks, hidden)?;
            logit_at += n_logits * vocab;
            let mut row = 0;
            for &[c, first, take] in &pass {
                let slot = work[c].slot;
                let seq = self.slots[slot].as_mut().expect("validated");
                seq.hidden[first * e..(first + take) * e]
                    .copy_from_slice(&self.pass_hidden[row * e..(row + take) * e]);
                row += take;
            }
        }
        for w in work {
            let seq = self.slots[w.slot].as_mut().expect("validated");
            seq.tokens.extend_from_slice(w.tokens);
            seq.hidden_rows = w.tokens.len();
            // A tree's rows are not the sequence's tokens in order: the prefix cache keys only
            // the blocks before it.
            let keyed = if w.parents.is_empty() {
                seq.tokens.len()
            } else {
                seq.tree = Some(PendingTree {
                    base: w.start,
                    parents: w.parents.to_vec(),
                });
                w.start
            };
            self.executor
                .commit(w.slot, w.start, w.tokens.len(), &seq.tokens[..keyed]);
        }
        Ok(())
    }

    /// [`ForwardPass::seq_keep_path`] without the panic guard.
    pub fn keep_path(&mut self, seq: SeqId, path: &[u32]) -> Result<(), PluginError> {
        self.usable()?;
        let slot = self.slot_of(seq)?;
        let Some(tree) = self.sequence_mut(slot).tree.clone() else {
            return Err(self.plugin_error(
                ErrorKind::InvalidInput,
                format!("seq_keep_path: the last evaluation of {seq} was not a tree"),
            ));
        };
        let bad = |what: String| {
            self.plugin_error(
                ErrorKind::InvalidInput,
                format!("seq_keep_path on {seq}: {what}"),
            )
        };
        if path.is_empty() {
            return Err(bad(
                "the path is empty; truncate the sequence to drop the whole tree".into(),
            ));
        }
        let mut parent = TREE_ROOT;
        for (k, &row) in path.iter().enumerate() {
            match tree.parents.get(row as usize) {
                None => {
                    return Err(bad(format!(
                        "row {row} is not in the tree of {} rows",
                        tree.parents.len()
                    )))
                }
                Some(&p) if p != parent => {
                    return Err(bad(format!(
                        "step {k} of the path, row {row}, does not continue {}",
                        if parent == TREE_ROOT {
                            "the sequence (it is not a root)".to_string()
                        } else {
                            format!("row {parent}")
                        }
                    )))
                }
                Some(_) => parent = row,
            }
        }
        let e = self.model.graph.n_embd();
        let seq_state = self.sequence_mut(slot);
        let base = tree.base;
        let kept: Vec<u32> = path
            .iter()
            .map(|&row| seq_state.tokens[base + row as usize])
            .collect();
        seq_state.tokens.truncate(base);
        seq_state.tokens.extend_from_slice(&kept);
        // The path's hidden rows, in path order (each row only moves down or stays).
        if seq_state.hidden_rows == tree.parents.len() {
            for (k, &row) in path.iter().enumerate() {
                let row = row as usize;
                if row != k {
                    seq_state.hidden.copy_within(row * e..(row + 1) * e, k * e);
                }
            }
            seq_state.hidden_rows = path.len();
        } else {
            seq_state.hidden_rows = 0;
        }
        if let Some(mtp_len) = &mut seq_state.mtp_len {
            *mtp_len = (*mtp_len).min(base);
        }
        seq_state.tree = None;
        let tokens = seq_state.tokens.clone();
        let hidden = seq_state.hidden[..seq_state.hidden_rows * e].to_vec();
        let kept = KeptPath {
            base,
            path,
            tokens: &tokens,
            hidden: &hidden,
        };
        if let Err(e) = self.executor.keep_path(slot, kept) {
            self.broken = Some(format!("keeping a path of a tree failed: {}", e.message));
            return Err(attribute(self.setup.plugin, e));
        }
        Ok(())
    }

    /// [`ForwardPass::truncate`] without the panic guard.
    pub fn truncate_to(&mut self, seq: SeqId, len: usize) -> Result<(), PluginError> {
        self.usable()?;
        let plugin = self.setup.plugin;
        let slot = self.slot_of(seq)?;
        let seq_len = self.sequence_mut(slot).tokens.len();
        if len > seq_len {
            return Err(self.plugin_error(
                ErrorKind::InvalidInput,
                format!("cannot truncate {seq} to {len} tokens: it has only {seq_len}"),
            ));
        }
        if let Some(tree) = &self.sequence_mut(slot).tree {
            if len > tree.base {
                return Err(self.unresolved_tree(seq));
            }
        }
        if let Some(mtp_len) = &mut self.sequence_mut(slot).mtp_len {
            *mtp_len = (*mtp_len).min(len);
        }
        let window = self.executor.window(slot, seq_len);
        if self
            .executor
            .rollback(slot, len)
            .map_err(|e| attribute(plugin, e))?
        {
            let seq = self.sequence_mut(slot);
            seq.tokens.truncate(len);
            seq.tree = None;
            return Ok(());
        }
        match self.setup.deep_rollback {
            DeepRollback::Refuse => Err(self.plugin_error(
                ErrorKind::InvalidInput,
                format!(
                    "cannot truncate {seq} to {len} tokens: the recurrent state is kept only for lengths {}..={} (rollback depth {}), and option '{}' = 'refuse' forbids re-decoding",
                    window.start(),
                    window.end(),
                    self.setup.capabilities.rollback_depth,
                    options::OPTION_DEEP_ROLLBACK,
                ),
            )),
            DeepRollback::Redecode => {
                tracing::debug!(
                    "{plugin}: truncating {seq} to {len} tokens is outside the rollback window {}..={}; re-decoding them",
                    window.start(),
                    window.end()
                );
                self.redecode(slot, len).map_err(|e| attribute(plugin, e))
            }
        }
    }

    /// The slow rollback path: sequence `slot` back to empty, then one evaluation of the kept
    /// tokens. The MTP head's cache is emptied with it.
    fn redecode(&mut self, slot: usize, len: usize) -> Result<(), PluginError> {
        self.slow_rollbacks += 1;
        if let Err(e) = self.executor.reset(slot) {
            self.broken = Some(e.message.to_string());
            return Err(e);
        }
        let seq = self.sequence_mut(slot);
        if let Some(mtp_len) = &mut seq.mtp_len {
            *mtp_len = 0;
        }
        let mut replay = std::mem::take(&mut seq.tokens);
        replay.truncate(len);
        if replay.is_empty() {
            return Ok(());
        }
        let hidden = (std::mem::take(&mut seq.hidden), seq.hidden_rows);
        seq.tree = None;
        let work = [Work {
            slot,
            tokens: &replay,
            rows: LogitRows::None,
            start: 0,
            parents: &[],
            depths: Vec::new(),
        }];
        let result = self
            .reserve(&work)
            .and_then(|()| self.forward(&work, &mut RVec::new()));
        let seq = self.sequence_mut(slot);
        (seq.hidden, seq.hidden_rows) = hidden;
        if result.is_err() {
            // The sequence is empty now: what was evaluated of it is not kept.
            let _ = self.executor.reset(slot);
        }
        result
    }

    /// One MTP step (a one-row [`mtp_eval_into`](Self::mtp_eval_into) with logits).
    pub fn mtp_step_into(
        &mut self,
        seq: SeqId,
        hidden: &[f32],
        token: u32,
        position: usize,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.mtp_eval_into(
            seq,
            hidden,
            &[token],
            position,
            LogitRows::All,
            logits,
            hidden_out,
        )
    }

    /// One sequence's MTP-head rows ([`Self::mtp_batch_into`] of one chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn mtp_eval_into(
        &mut self,
        seq: SeqId,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        let chunk = MtpChunk {
            seq,
            hidden: RSlice::from_slice(hidden),
            tokens: RSlice::from_slice(tokens),
            position,
            rows,
        };
        self.mtp_batch_into(&[chunk], logits, hidden_out)
    }

    /// [`ForwardPass::mtp_eval_batch`] without the panic guard.
    pub fn mtp_batch_into(
        &mut self,
        chunks: &[MtpChunk<'_>],
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.usable()?;
        let plugin = self.setup.plugin;
        if !self.setup.capabilities.mtp_head {
            return Err(PluginError::unsupported(format!(
                "{plugin}: {} ({}) has no MTP head",
                self.info.name, self.info.architecture
            )));
        }
        let e = self.model.graph.n_embd();
        let vocab = self.info.vocab_size as usize;
        let mut work: Vec<MtpWork<'_>> = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let slot = self.slot_of(chunk.seq)?;
            if work.iter().any(|w| w.slot == slot) {
                return Err(self.plugin_error(
                    ErrorKind::InvalidInput,
                    format!(
                        "{} appears twice in one mtp_eval_batch; give each sequence one chunk",
                        chunk.seq
                    ),
                ));
            }
            let cached = self.sequence_mut(slot).mtp_len.unwrap_or(0);
            let (hidden, tokens) = (chunk.hidden.as_slice(), chunk.tokens.as_slice());
            validate::mtp_input(
                plugin,
                hidden,
                tokens,
                chunk.position,
                e,
                vocab,
                cached,
                self.setup.n_ctx,
            )?;
            work.push(MtpWork {
                slot,
                hidden,
                tokens,
                position: chunk.position,
                rows: chunk.rows,
            });
        }
        let n_rows: usize = work.iter().map(|w| w.tokens.len()).sum();
        logits.clear();
        logits.resize(
            work.iter()
                .map(|w| w.rows.count(w.tokens.len()))
                .sum::<usize>()
                * vocab,
            0.0,
        );
        hidden_out.clear();
        hidden_out.resize(n_rows * e, 0.0);
        let (mut logit_at, mut row_at) = (0, 0);
        let mut result = Ok(());
        for pass in plan_passes(work.iter().map(|w| w.tokens.len()), self.setup.batch_rows) {
            let chunks: Vec<MtpRows<'_>> = pass
                .iter()
                .map(|&[c, first, take]| {
                    let w = &work[c];
                    MtpRows {
                        seq: w.slot,
                        hidden: &w.hidden[first * e..(first + take) * e],
                        tokens: &w.tokens[first..first + take],
                        position: w.position + first,
                        logit_from: piece_logit_from(w.rows, w.tokens.len(), first, take),
                    }
                })
                .collect();
            let m: usize = chunks.iter().map(MtpRows::rows).sum();
            let n_logits: usize = chunks.iter().map(|c| c.rows() - c.logit_from).sum();
            result = self.executor.mtp(
                &self.model,
                &self.pool,
                &chunks,
                &mut logits[logit_at..logit_at + n_logits * vocab],
                &mut hidden_out[row_at * e..(row_at + m) * e],
            );
            if result.is_err() {
                break;
            }
            logit_at += n_logits * vocab;
            row_at += m;
        }
        // Each head cache was cut to its chunk's position before the rows were appended.
        let ok = result.is_ok();
        for w in &work {
            let seq = self.sequence_mut(w.slot);
            let cached = seq.mtp_len.unwrap_or(0);
            seq.mtp_len = Some(if ok {
                w.position + w.tokens.len()
            } else {
                cached.min(w.position)
            });
        }
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

    fn seq_create(&mut self) -> PluginResult<SeqId> {
        self.fence
            .clone()
            .guard(self.setup.plugin, || self.create_sequence())
    }

    fn seq_fork(&mut self, seq: SeqId) -> PluginResult<SeqId> {
        self.fence
            .clone()
            .guard(self.setup.plugin, || self.fork_sequence(seq))
    }

    fn seq_free(&mut self, seq: SeqId) -> PluginResult<()> {
        self.fence
            .clone()
            .guard(self.setup.plugin, || self.free_sequence(seq))
    }

    fn seq_reuse_prefix(&mut self, seq: SeqId, tokens: RSlice<'_, u32>) -> PluginResult<usize> {
        self.fence.clone().guard(self.setup.plugin, || {
            self.reuse_prefix(seq, tokens.as_slice())
        })
    }

    fn seq_len(&self, seq: SeqId) -> PluginResult<usize> {
        self.fence.guard(self.setup.plugin, || self.seq_length(seq))
    }

    fn kv_usage(&self) -> KvUsage {
        guarded(KvUsage::default, || self.executor.kv_usage())
    }

    fn eval_batch(
        &mut self,
        chunks: RSlice<'_, EvalChunk<'_>>,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.fence.clone().guard(self.setup.plugin, || {
            self.eval_batch_into(chunks.as_slice(), logits)
        })
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> PluginResult<()> {
        self.fence
            .clone()
            .guard(self.setup.plugin, || self.truncate_to(seq, len))
    }

    fn seq_keep_path(&mut self, seq: SeqId, path: RSlice<'_, u32>) -> PluginResult<()> {
        self.fence
            .clone()
            .guard(self.setup.plugin, || self.keep_path(seq, path.as_slice()))
    }

    fn hidden_states(&self, seq: SeqId, out: &mut RVec<f32>) -> PluginResult<()> {
        self.fence.guard(self.setup.plugin, || {
            out.clear();
            out.extend_from_slice(self.last_hidden_states(seq)?);
            Ok(())
        })
    }

    fn mtp_eval_batch(
        &mut self,
        chunks: RSlice<'_, MtpChunk<'_>>,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.fence.clone().guard(self.setup.plugin, || {
            self.mtp_batch_into(chunks.as_slice(), logits, hidden_out)
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
        let params = testing::backend_params(path, 1, 256, 4, &[]);
        let (model, n_ctx) = opening::load_model("test", &params).unwrap();
        let part = crate::cpu::CpuPart {
            layers: 0,
            head: true,
            batch_rows: 64,
            kv_type: KvType::F32,
            kv_tokens: n_ctx,
            ring_depth: 4,
            max_sequences: 1,
            prefix_cache: true,
            prefix_state_bytes: 0,
        };
        let executor = CpuExecutor::whole_model(&model, part).unwrap();
        let setup = Setup {
            plugin: "test",
            capabilities: Capabilities {
                max_verify_tokens: 4,
                rollback_depth: 4,
                max_sequences: 1,
                max_batch_rows: 64,
                kv_tokens: n_ctx as u64,
                hidden_state_export: true,
                mtp_head: true,
                snapshot_bytes_per_slot: 0,
                tree_verify: false,
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
        fn add_sequence(&mut self, seq: usize) -> Result<(), PluginError> {
            self.0.add_sequence(seq)
        }
        fn fork_sequence(&mut self, from: usize, to: usize, len: usize) -> Result<(), PluginError> {
            self.0.fork_sequence(from, to, len)
        }
        fn remove_sequence(&mut self, seq: usize) {
            self.0.remove_sequence(seq)
        }
        fn reserve(&mut self, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
            Executor::reserve(&mut self.0, chunks)
        }
        fn forward(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            chunks: &[Chunk<'_>],
            hidden: &mut [f32],
            logits: &mut [f32],
        ) -> Result<(), PluginError> {
            self.0.forward(model, pool, chunks, hidden, logits)
        }
        fn commit(&mut self, seq: usize, start: usize, n: usize, tokens: &[u32]) {
            self.0.commit(seq, start, n, tokens)
        }
        fn reuse_prefix(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            seq: usize,
            tokens: &[u32],
        ) -> Result<usize, PluginError> {
            self.0.reuse_prefix(model, pool, seq, tokens)
        }
        fn rollback(&mut self, seq: usize, len: usize) -> Result<bool, PluginError> {
            self.0.rollback(seq, len)
        }
        fn window(&self, seq: usize, seq_len: usize) -> RangeInclusive<usize> {
            self.0.window(seq, seq_len)
        }
        fn reset(&mut self, _seq: usize) -> Result<(), PluginError> {
            Err(PluginError::new(ErrorKind::Internal, "device gone"))
        }
        fn mtp(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            chunks: &[MtpRows<'_>],
            logits: &mut [f32],
            hidden_out: &mut [f32],
        ) -> Result<(), PluginError> {
            self.0.mtp(model, pool, chunks, logits, hidden_out)
        }
    }

    /// A CPU executor whose `fail_at`-th pass fails, standing in for a device that fails in
    /// the middle of an evaluation.
    struct FailingPass {
        cpu: CpuExecutor,
        passes: usize,
        fail_at: usize,
    }

    impl Executor for FailingPass {
        fn add_sequence(&mut self, seq: usize) -> Result<(), PluginError> {
            self.cpu.add_sequence(seq)
        }
        fn fork_sequence(&mut self, from: usize, to: usize, len: usize) -> Result<(), PluginError> {
            self.cpu.fork_sequence(from, to, len)
        }
        fn remove_sequence(&mut self, seq: usize) {
            self.cpu.remove_sequence(seq)
        }
        fn reserve(&mut self, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
            Executor::reserve(&mut self.cpu, chunks)
        }
        fn forward(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            chunks: &[Chunk<'_>],
            hidden: &mut [f32],
            logits: &mut [f32],
        ) -> Result<(), PluginError> {
            self.passes += 1;
            self.cpu.forward(model, pool, chunks, hidden, logits)?;
            if self.passes == self.fail_at {
                return Err(PluginError::new(ErrorKind::Internal, "device lost"));
            }
            Ok(())
        }
        fn commit(&mut self, seq: usize, start: usize, n: usize, tokens: &[u32]) {
            self.cpu.commit(seq, start, n, tokens)
        }
        fn reuse_prefix(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            seq: usize,
            tokens: &[u32],
        ) -> Result<usize, PluginError> {
            self.cpu.reuse_prefix(model, pool, seq, tokens)
        }
        fn rollback(&mut self, seq: usize, len: usize) -> Result<bool, PluginError> {
            self.cpu.rollback(seq, len)
        }
        fn window(&self, seq: usize, seq_len: usize) -> RangeInclusive<usize> {
            self.cpu.window(seq, seq_len)
        }
        fn reset(&mut self, seq: usize) -> Result<(), PluginError> {
            self.cpu.reset(seq)
        }
        fn mtp(
            &mut self,
            model: &Model,
            pool: &ThreadPool,
            chunks: &[MtpRows<'_>],
            logits: &mut [f32],
            hidden_out: &mut [f32],
        ) -> Result<(), PluginError> {
            self.cpu.mtp(model, pool, chunks, logits, hidden_out)
        }
    }

    /// An evaluation that fails after its first pass ran (the second of two passes, after
    /// the first advanced the recurrent state past the ring's depth) leaves the sequence as it
    /// was: the next evaluation gives the bits of a run that never saw the failed one.
    #[test]
    fn a_failed_evaluation_leaves_the_sequence_as_it_was() {
        let mut logits = RVec::new();
        let prompt: Vec<u32> = (1..=12).collect();
        let long: Vec<u32> = (0..100).map(|i| (i * 7 + 3) % 200).collect();
        let mut failing = open_test_backend(|cpu| FailingPass {
            cpu,
            passes: 0,
            fail_at: 3,
        });
        let seq = failing.create_sequence().unwrap();
        failing
            .eval_tokens(seq, &prompt, LogitRows::Last, &mut logits)
            .unwrap();
        let err = failing
            .eval_tokens(seq, &long, LogitRows::Last, &mut logits)
            .unwrap_err();
        assert!(err.message.contains("device lost"), "{err}");
        assert_eq!(failing.seq_length(seq).unwrap(), 12);
        let after = failing
            .eval_tokens(seq, &[5, 6], LogitRows::All, &mut logits)
            .map(|()| logits.to_vec())
            .unwrap();

        let mut clean = open_test_backend(|x| x);
        let c = clean.create_sequence().unwrap();
        clean
            .eval_tokens(c, &prompt, LogitRows::Last, &mut logits)
            .unwrap();
        clean
            .eval_tokens(c, &[5, 6], LogitRows::All, &mut logits)
            .unwrap();
        assert_eq!(testing::bits(&after), testing::bits(&logits));
    }

    /// A re-decode (a truncation past the ring) empties the MTP head's cache with the
    /// sequence's caches, and says so: a step at a later position is refused.
    #[test]
    fn a_redecode_empties_the_mtp_cache() {
        let mut backend = open_test_backend(|x| x);
        let seq = backend.create_sequence().unwrap();
        let (mut logits, mut hidden_out) = (RVec::new(), RVec::new());
        let tokens: Vec<u32> = (1..=12).collect();
        backend
            .eval_tokens(seq, &tokens, LogitRows::Last, &mut logits)
            .unwrap();
        let hidden = backend.last_hidden_states(seq).unwrap()[..11 * 64].to_vec();
        backend
            .mtp_eval_into(
                seq,
                &hidden,
                &tokens[1..],
                0,
                LogitRows::Last,
                &mut logits,
                &mut hidden_out,
            )
            .unwrap();
        assert_eq!(backend.mtp_len(seq).unwrap(), Some(11));
        backend.truncate_to(seq, 3).unwrap();
        assert_eq!(backend.slow_rollbacks(), 1);
        assert_eq!(backend.mtp_len(seq).unwrap(), Some(0));
        let err = backend
            .mtp_step_into(seq, &hidden[..64], 2, 2, &mut logits, &mut hidden_out)
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    }

    /// When the state cannot be reset for a re-decode, the instance refuses every later call
    /// instead of computing from caches that disagree with the sequence.
    #[test]
    fn a_failed_reset_makes_the_instance_refuse_later_calls() {
        let mut backend = open_test_backend(FailingReset);
        let mut logits = RVec::new();
        let tokens: Vec<u32> = (1..=12).collect();
        let seq = backend.create_sequence().unwrap();
        backend
            .eval_tokens(seq, &tokens, LogitRows::Last, &mut logits)
            .unwrap();
        let err = backend.truncate_to(seq, 2).unwrap_err();
        assert!(err.message.contains("device gone"), "{err}");
        for err in [
            backend
                .eval_tokens(seq, &[1], LogitRows::Last, &mut logits)
                .unwrap_err(),
            backend.truncate_to(seq, 1).unwrap_err(),
            backend.create_sequence().unwrap_err(),
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
