//! What a backend supplies: where the layers run and where the sequence's caches live.

use std::ops::RangeInclusive;

use specula_kernels::WeightMatrix;

use crate::graph::Rows;
use crate::model::Model;
use rayon::ThreadPool;
use specula_plugin_api::PluginError;

/// One chunk of an evaluation: at most `batch_rows` consecutive tokens of it.
#[derive(Debug, Clone, Copy)]
pub struct Chunk<'a> {
    pub tokens: &'a [u32],
    /// Position of the first token in the sequence.
    pub pos0: usize,
    /// Index of the first token among the evaluation's tokens: the snapshot-ring step of its
    /// first row (the ring advances only when the whole evaluation is committed).
    pub first: usize,
    /// Rows `logit_from ..` of the chunk get logits (`tokens.len()` for none).
    pub logit_from: usize,
}

impl Chunk<'_> {
    /// Rows in the chunk.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// The chunk's rows as the graphs see them.
    pub fn pass_rows(&self) -> Rows {
        Rows {
            n: self.tokens.len(),
            pos0: self.pos0,
            ring_step0: self.first,
        }
    }
}

/// The rows of one MTP-head pass (at most the executor's `batch_rows`): the trunk's final
/// hidden states (`tokens.len() × n_embd`) and the tokens after them, at positions
/// `position ..`; rows `logit_from ..` get logits.
#[derive(Debug, Clone, Copy)]
pub struct MtpRows<'a> {
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

    /// The pass's rows as the graphs see them.
    pub fn pass_rows(&self) -> Rows {
        Rows {
            n: self.tokens.len(),
            pos0: self.position,
            ring_step0: 0,
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

/// Runs a model's layers and owns the sequence's caches (attention KV, recurrent-state ring,
/// the MTP head's cache); [`Backend`](super::Backend) does the rest.
///
/// Every row of a chunk must get exactly the bits a one-row chunk at its position would.
pub trait Executor: Send + Sync {
    /// Runs `chunk` through the whole model: its keys, values and recurrent states go into
    /// the caches at its positions (not yet committed); the final-norm hidden states of its
    /// rows go to `hidden` (`rows × n_embd`) and the logits of rows `logit_from ..` to
    /// `logits`.
    fn forward_chunk(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunk: &Chunk<'_>,
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError>;

    /// Makes the `n` tokens evaluated from position `start` part of the sequence.
    fn commit(&mut self, start: usize, n: usize);

    /// Cuts the sequence to `len` tokens in O(1) and returns true, or returns false (changing
    /// nothing of the trunk) when the recurrent state of that length is no longer kept. Either
    /// way it cuts the MTP head's cache to at most `len` entries.
    fn rollback(&mut self, len: usize) -> Result<bool, PluginError>;

    /// The lengths [`rollback`](Self::rollback) can restore, for a sequence of `seq_len`.
    fn window(&self, seq_len: usize) -> RangeInclusive<usize>;

    /// Back to the empty sequence.
    fn reset(&mut self) -> Result<(), PluginError>;

    /// Runs the MTP head over one pass of `rows`: its cache is cut to `rows.position` entries
    /// and extended by the rows; `logits` gets the logits of rows `rows.logit_from ..`,
    /// `hidden_out` every row's head output. Only called when the capabilities say the model
    /// has the head.
    fn mtp(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        rows: &MtpRows<'_>,
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError>;
}
