//! A backend instance paired with the one sequence of it a pipeline decodes: the
//! single-sequence calls the speculative loop and the benchmarks make.

use abi_stable::std_types::{RSlice, RVec};
use specula_plugin_api::{
    BoxedForwardPass, Capabilities, EvalChunk, LentSequence, LogitRows, ModelInfo, PluginResult,
    SeqId, SequenceCalls,
};

/// A backend instance and the sequence of it this pipeline decodes.
pub struct SeqModel {
    pub backend: BoxedForwardPass,
    pub seq: SeqId,
    /// The length the sequence started at (what it took from the prefix cache): a recurrent
    /// state cannot be rolled back before it.
    started_at: usize,
}

impl SeqModel {
    /// `backend` with a new, empty sequence.
    pub fn new(mut backend: BoxedForwardPass) -> PluginResult<Self> {
        backend.seq_create().map(|seq| Self {
            backend,
            seq,
            started_at: 0,
        })
    }

    /// The length the sequence started at ([`reuse_prefix`](Self::reuse_prefix)'s).
    pub fn started_at(&self) -> usize {
        self.started_at
    }

    pub fn model_info(&self) -> ModelInfo {
        self.backend.model_info()
    }

    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }

    /// Tokens in the sequence.
    pub fn seq_len(&self) -> PluginResult<usize> {
        self.backend.seq_len(self.seq)
    }

    /// Evaluates `tokens` after the sequence.
    pub fn eval(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.backend.eval(self.seq, tokens, rows, logits)
    }

    /// Evaluates `tokens` with logits for every row: a chain when `parents` is empty, else
    /// the tree they describe ([`specula_plugin_api::EvalChunk::parents`]).
    pub fn eval_tree(
        &mut self,
        tokens: &[u32],
        parents: &[u32],
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        let chunk = EvalChunk::tree(self.seq, tokens, parents, LogitRows::All);
        self.backend
            .eval_batch(RSlice::from_slice(&[chunk]), logits)
    }

    /// Gives the empty sequence what the backend's prefix cache holds of `tokens`' start;
    /// returns the tokens it now holds ([`specula_plugin_api::ForwardPass::seq_reuse_prefix`]).
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> PluginResult<usize> {
        let reused = self
            .backend
            .seq_reuse_prefix(self.seq, RSlice::from_slice(tokens));
        if let abi_stable::std_types::RResult::ROk(n) = reused {
            self.started_at = n;
        }
        reused
    }

    /// Replaces the sequence by a new, empty one (a new id: what a drafter kept of the old
    /// one no longer applies).
    ///
    /// Freeing the old one may fail (a failed renewal already freed it); creating the new one
    /// is what decides.
    pub fn renew(&mut self) -> PluginResult<()> {
        let _ = self.backend.seq_free(self.seq);
        self.started_at = 0;
        self.backend.seq_create().map(|seq| self.seq = seq)
    }

    /// Cuts the sequence to `len` tokens.
    pub fn truncate(&mut self, len: usize) -> PluginResult<()> {
        self.backend.truncate(self.seq, len)
    }

    /// The hidden states of the sequence's last evaluated rows.
    pub fn hidden_states(&self, out: &mut RVec<f32>) -> PluginResult<()> {
        self.backend.hidden_states(self.seq, out)
    }

    /// The model and the sequence, lent to a drafter for one call.
    pub fn lend(&mut self) -> LentSequence<'_> {
        LentSequence {
            model: self.backend.sabi_reborrow_mut(),
            seq: self.seq,
        }
    }
}
