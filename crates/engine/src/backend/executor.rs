//! What a backend supplies: where the layers run and where the sequences' caches live.

use std::ops::RangeInclusive;

use specula_kernels::WeightMatrix;

use crate::graph::{Span, Tree};
use crate::model::Model;
use rayon::ThreadPool;
use specula_plugin_api::{KvUsage, PluginError};

/// One sequence's rows in a pass: consecutive tokens of one evaluation of sequence slot `seq`.
#[derive(Debug, Clone, Copy)]
pub struct Chunk<'a> {
    pub seq: usize,
    pub tokens: &'a [u32],
    /// Position of the first token in the sequence.
    pub pos0: usize,
    /// Index of the first token among the evaluation's tokens: the snapshot-ring step of its
    /// first row (the ring advances only when the whole evaluation is committed).
    pub first: usize,
    /// Rows `logit_from ..` of the chunk get logits (`tokens.len()` for none).
    pub logit_from: usize,
    /// The evaluation's tree, when its tokens form one.
    pub tree: Option<Tree<'a>>,
}

impl<'a> Chunk<'a> {
    /// Rows in the chunk.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// The chunk's rows as the graphs see them.
    pub fn span(&self) -> Span<'a> {
        Span {
            seq: self.seq,
            n: self.tokens.len(),
            pos0: self.pos0,
            ring_step0: self.first,
            logit_from: self.logit_from,
            tree: self.tree,
        }
    }

    /// The spans of a pass over `chunks`, in order (build [`crate::graph::Rows`] over them).
    pub fn spans(chunks: &[Chunk<'a>]) -> Vec<Span<'a>> {
        chunks.iter().map(Chunk::span).collect()
    }
}

/// What [`Executor::keep_path`] keeps of a tree evaluated from position `base`: its rows
/// `path` (a validated root-to-node path), as positions `base ..` in order.
#[derive(Debug, Clone, Copy)]
pub struct KeptPath<'a> {
    pub base: usize,
    pub path: &'a [u32],
    /// The sequence's tokens with the path (its full blocks may go into the prefix cache).
    pub tokens: &'a [u32],
    /// The path's final-norm hidden rows.
    pub hidden: &'a [f32],
}

/// One sequence's rows of an MTP-head pass: the trunk's final hidden states
/// (`tokens.len() × n_embd`) and the tokens after them, at positions `position ..` of sequence
/// slot `seq`; rows `logit_from ..` get logits.
#[derive(Debug, Clone, Copy)]
pub struct MtpRows<'a> {
    pub seq: usize,
    pub hidden: &'a [f32],
    pub tokens: &'a [u32],
    pub position: usize,
    pub logit_from: usize,
}

impl MtpRows<'_> {
    /// Rows in the pass.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// The rows as the graphs see them.
    pub fn span(&self) -> Span<'static> {
        Span {
            seq: self.seq,
            n: self.tokens.len(),
            pos0: self.position,
            ring_step0: 0,
            logit_from: self.logit_from,
            tree: None,
        }
    }

    /// The spans of a pass over `chunks`, in order.
    pub fn spans(chunks: &[MtpRows<'_>]) -> Vec<Span<'static>> {
        chunks.iter().map(MtpRows::span).collect()
    }

    /// Writes the input rows of every chunk of a pass, one after another ([`Self::write_inputs`]).
    pub fn write_all_inputs(chunks: &[MtpRows<'_>], embed: &WeightMatrix<'_>, out: &mut [f32]) {
        let mut at = 0;
        for chunk in chunks {
            let width = 2 * chunk.hidden.len() / chunk.rows().max(1);
            chunk.write_inputs(embed, &mut out[at..]);
            at += chunk.rows() * width;
        }
    }

    /// Writes the head's input rows `[embedding(token) | trunk hidden]` (`rows × 2·n_embd`,
    /// `embed` the head's embedding) to the start of `out`.
    pub fn write_inputs(&self, embed: &WeightMatrix<'_>, out: &mut [f32]) {
        let e = self.hidden.len() / self.tokens.len().max(1);
        let rows = out
            .chunks_exact_mut(2 * e)
            .zip(self.tokens)
            .zip(self.hidden.chunks_exact(e));
        for ((row, &token), hidden) in rows {
            let (embedded, trunk) = row.split_at_mut(e);
            embed.dequantize_row(token as usize, embedded);
            trunk.copy_from_slice(hidden);
        }
    }
}

/// Runs a model's layers and owns the sequences' caches (attention KV, recurrent-state ring,
/// the MTP head's cache), each sequence in a slot `0 .. max_sequences`;
/// [`Backend`](super::Backend) does the rest.
///
/// A pass runs chunks of several sequences together; every row must get exactly the bits a
/// one-row pass of its sequence at its position would.
pub trait Executor: Send + Sync {
    /// Gives slot `seq` the caches of an empty sequence.
    fn add_sequence(&mut self, seq: usize) -> Result<(), PluginError>;

    /// Gives slot `to` (added, empty) the caches of slot `from`, a sequence of `len` tokens.
    fn fork_sequence(&mut self, from: usize, to: usize, len: usize) -> Result<(), PluginError>;

    /// Releases slot `seq`'s caches.
    fn remove_sequence(&mut self, seq: usize);

    /// Gives every chunk's sequence the cache room for its rows (`pos0 .. pos0 + rows`)
    /// before any pass of an evaluation runs, so that a full cache fails the evaluation before
    /// it computes anything; on failure changes no sequence.
    fn reserve(&mut self, chunks: &[Chunk<'_>]) -> Result<(), PluginError>;

    /// Runs one pass over `chunks` (at most `batch_rows` rows, each sequence at most once)
    /// through the whole model: their keys, values and recurrent states go into their
    /// sequences' caches (not yet committed); the final-norm hidden states of every row go to
    /// `hidden` (`rows × n_embd`, chunk after chunk) and the logits of each chunk's rows
    /// `logit_from ..` to `logits`, chunk after chunk.
    fn forward(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunks: &[Chunk<'_>],
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError>;

    /// Makes the `n` tokens evaluated from position `start` part of sequence `seq`, whose
    /// tokens are now `tokens` (its full blocks may go into the prefix cache).
    fn commit(&mut self, seq: usize, start: usize, n: usize, tokens: &[u32]);

    /// Gives the empty sequence `seq` the longest start of `tokens` the prefix cache holds
    /// (whole blocks, never the last token) and returns its length: 0 when nothing is cached,
    /// or where the executor keeps no prefix cache. With an MTP head, the head's cache then
    /// holds those positions too (a drafter continues from them).
    fn reuse_prefix(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        seq: usize,
        tokens: &[u32],
    ) -> Result<usize, PluginError>;

    /// Cuts sequence `seq` to `len` tokens in O(1) and returns true, or returns false
    /// (changing nothing of the trunk) when the recurrent state of that length is no longer
    /// kept. Either way it cuts the MTP head's cache to at most `len` entries.
    fn rollback(&mut self, seq: usize, len: usize) -> Result<bool, PluginError>;

    /// After a tree evaluation of sequence `seq` (committed with the tokens before it): keeps
    /// the path [`KeptPath`] names and drops the tree's other rows. Only called where the
    /// capabilities advertise `tree_verify`.
    fn keep_path(&mut self, seq: usize, kept: KeptPath<'_>) -> Result<(), PluginError> {
        let _ = (seq, kept);
        Err(PluginError::new(
            specula_plugin_api::ErrorKind::Unsupported,
            "this backend keeps no trees",
        ))
    }

    /// The lengths [`rollback`](Self::rollback) can restore, for sequence `seq` of `seq_len`.
    fn window(&self, seq: usize, seq_len: usize) -> RangeInclusive<usize>;

    /// Sequence `seq` back to empty.
    fn reset(&mut self, seq: usize) -> Result<(), PluginError>;

    /// How full the attention KV pool is (nothing reported by default).
    fn kv_usage(&self) -> KvUsage {
        KvUsage::default()
    }

    /// Runs the MTP head over one pass of `chunks` (at most `batch_rows` rows, each sequence
    /// at most once): each sequence's head cache is cut to its chunk's `position` entries and
    /// extended by the rows; `logits` gets the logits of each chunk's rows `logit_from ..`,
    /// `hidden_out` every row's head output, chunk after chunk. Only called when the
    /// capabilities say the model has the head.
    fn mtp(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunks: &[MtpRows<'_>],
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError>;
}
