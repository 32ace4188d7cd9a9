//! Specula drafter plugin `mtp`: self-speculation through the target's own MTP / NextN head.
//!
//! The head maps (final-norm hidden of position `p`, token at `p + 1`) to logits for `p + 2`
//! and a hidden state of its own. Its KV cache needs one entry per position built from the
//! trunk's **real** hidden states, so after every target pass this drafter keeps the hidden
//! rows of the accepted positions, and before drafting it steps the head through them
//! (position by position, as the trunk saw them). The last of those steps — the trunk's
//! newest hidden state with the certain token — yields the first draft; each further draft
//! chains the head's own hidden state. Chained steps write speculative KV entries past the
//! accepted positions; the next catch-up overwrites them, and the backend cuts them with the
//! trunk on rollback.
//!
//! With `[drafter.options] context_hints = true`, greedy drafts also take context hints (what
//! followed the context's last tokens earlier, [`specula_drafting::TreeGrower`]): trees and
//! chains are then grown by the calibrated grower. Off by default: the trained head is right
//! more often than its softmax says, so until the calibration has learned that, hints displace
//! its first choices (the built-in 128-token run: 92% of drafts accepted without, 83% with;
//! over 40 runs of 256 tokens hints gained 2.5%).

use abi_stable::std_types::{RSlice, RVec};
use std::collections::HashMap;

use specula_drafting::{DraftPicker, TreeGrower, CONTEXT_HINTS};
use specula_plugin_api::{
    Draft, DraftRequest, Drafter, DrafterModels, DrafterParams, LentSequence, LogitRows,
    PanicFence, PluginError, PluginResult, SeqId,
};

/// The MTP self-speculation drafter.
#[derive(Debug)]
pub struct MtpDrafter {
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
    hidden_size: usize,
    vocab: usize,
    /// Head KV entries `[0, real)` come from real trunk hidden states.
    real: usize,
    /// Real trunk hidden rows not yet fed to the head, for positions `pending_from..`.
    pending_from: usize,
    pending: Vec<f32>,
    /// False when the hidden rows lost track of the trunk (then nothing is drafted until
    /// the next `begin`).
    in_step: bool,
    /// The target sequence the head's cache and the rows belong to.
    sequence: Option<SeqId>,
    rows: RVec<f32>,
    logits: RVec<f32>,
    hidden: RVec<f32>,
    chained: RVec<f32>,
    /// Grows trees, learning which drafts the target accepts.
    grower: TreeGrower,
}

impl MtpDrafter {
    /// Checks that `params` can make a drafter: a target with an MTP head, and no option but
    /// `context_hints` (`true` or `false`, default `false`).
    pub fn check(params: &DrafterParams) -> Result<(), PluginError> {
        let target = &params.target;
        let head = if target.has_mtp_head {
            Ok(())
        } else {
            Err(PluginError::unsupported(format!(
                "the mtp drafter needs a target with an MTP (NextN) head; {} ({}) has none",
                target.name, target.architecture
            )))
        };
        let options = params
            .check_options(&[CONTEXT_HINTS])
            .and_then(|()| TreeGrower::for_drafter(params, false).map(|_| ()));
        PluginError::all([head, options])
    }

    pub fn new(params: &DrafterParams) -> Result<Self, PluginError> {
        Self::check(params)?;
        let target = &params.target;
        Ok(Self {
            fence: PanicFence::default(),
            hidden_size: target.hidden_size as usize,
            vocab: target.vocab_size as usize,
            real: 0,
            pending_from: 0,
            pending: Vec::new(),
            in_step: false,
            sequence: None,
            rows: RVec::new(),
            logits: RVec::new(),
            hidden: RVec::new(),
            chained: RVec::new(),
            grower: TreeGrower::for_drafter(params, false)?,
        })
    }

    fn pending_rows(&self) -> usize {
        self.pending.len() / self.hidden_size
    }

    /// Appends the first `n` hidden rows of the target's last eval, which started at
    /// `position`.
    fn keep_rows(
        &mut self,
        target: &LentSequence<'_>,
        position: usize,
        n: usize,
    ) -> Result<(), PluginError> {
        target.hidden_states(&mut self.rows).into_result()?;
        let h = self.hidden_size;
        if self.rows.len() < n * h {
            return Err(PluginError::invalid_input(format!(
                "the target returned {} hidden values, {} rows of {h} were expected",
                self.rows.len(),
                n
            )));
        }
        if self.pending_from + self.pending_rows() != position {
            // A gap or overlap: the drafter missed a pass. Stop drafting until restarted.
            self.in_step = false;
            return Ok(());
        }
        self.pending.extend_from_slice(&self.rows[..n * h]);
        Ok(())
    }

    /// Steps the head through the pending real hidden rows up to the certain token, then
    /// chains up to `max` drafts.
    fn draft(
        &mut self,
        target: &mut LentSequence<'_>,
        request: &DraftRequest<'_>,
        out: &mut Draft,
    ) -> Result<(), PluginError> {
        out.clear();
        let context: &[u32] = &request.context;
        let certain_at = context.len() - 1;
        let h = self.hidden_size;
        let max = request.max_tokens as usize;
        let room = (target.model_info().context_size as usize).saturating_sub(context.len());
        if !self.in_step
            || max == 0
            || room == 0
            || certain_at <= self.real
            || self.pending_from > self.real
            || self.pending_from + self.pending_rows() < certain_at
        {
            return Ok(());
        }
        // Catch up in one pass: the real hidden of every p from `real` up to the certain
        // token's predecessor, each with the token at p + 1. Only the last row's logits (the
        // trunk's newest hidden with the certain token) are needed: they give the first draft.
        let from = (self.real - self.pending_from) * h;
        let to = (certain_at - self.pending_from) * h;
        target
            .mtp_eval(
                &self.pending[from..to],
                &context[self.real + 1..=certain_at],
                self.real,
                LogitRows::Last,
                &mut self.logits,
                &mut self.hidden,
            )
            .into_result()?;
        let last = self.hidden.len() - h;
        self.hidden.drain(..last);
        self.real = certain_at;
        self.pending.clear();
        self.pending_from = certain_at;

        let n = max.min(room);
        if self.grower.grows(request) {
            return self.draft_tree(target, request, certain_at, n, out);
        }
        let mut picker = DraftPicker::new(request);
        for i in 0..n {
            let token = picker.pick(&self.logits[..self.vocab], out);
            if i + 1 < n {
                std::mem::swap(&mut self.chained, &mut self.hidden);
                target
                    .mtp_eval(
                        &self.chained,
                        &[token],
                        certain_at + i,
                        LogitRows::Last,
                        &mut self.logits,
                        &mut self.hidden,
                    )
                    .into_result()?;
            }
        }
        Ok(())
    }
}

impl MtpDrafter {
    /// Grows a tree (or, for a greedy chain with context hints, a chain) of up to `n` drafts
    /// best first ([`TreeGrower`]) from the head's logits after the catch-up. A node's
    /// children come from one head step over it, fed its parent's head output; the head's cache holds one path's speculative entries at a
    /// time, so a node on another branch first re-runs the head over its own ancestors from
    /// where the two paths part (one call, the rows bit-identical to the first time).
    fn draft_tree(
        &mut self,
        target: &mut LentSequence<'_>,
        request: &DraftRequest<'_>,
        certain_at: usize,
        n: usize,
        out: &mut Draft,
    ) -> Result<(), PluginError> {
        let (h, vocab) = (self.hidden_size, self.vocab);
        let root = self.logits[..vocab].to_vec();
        let first_input = self.hidden[..h].to_vec();
        // The head's output after each node evaluated (by its path), and the path whose
        // entries the head's cache holds after the certain token.
        let mut outputs: HashMap<Vec<u32>, Vec<f32>> = HashMap::new();
        let mut cached: Vec<u32> = Vec::new();
        let mut grower = std::mem::take(&mut self.grower);
        let grown = grower.grow(request, &root, n, out, |path, logits| {
            let common = cached
                .iter()
                .zip(path)
                .take_while(|(a, b)| a == b)
                .count()
                .min(path.len() - 1);
            let mut inputs = Vec::with_capacity((path.len() - common) * h);
            for k in common..path.len() {
                match k {
                    0 => inputs.extend_from_slice(&first_input),
                    _ => inputs.extend_from_slice(&outputs[&path[..k]]),
                }
            }
            target
                .mtp_eval(
                    &inputs,
                    &path[common..],
                    certain_at + common,
                    LogitRows::Last,
                    &mut self.logits,
                    &mut self.hidden,
                )
                .into_result()?;
            for (j, k) in (common..path.len()).enumerate() {
                outputs.insert(
                    path[..=k].to_vec(),
                    self.hidden[j * h..(j + 1) * h].to_vec(),
                );
            }
            cached = path.to_vec();
            logits.clear();
            logits.extend_from_slice(&self.logits[..vocab]);
            Ok(())
        });
        self.grower = grower;
        grown
    }
}

impl Drafter for MtpDrafter {
    fn begin(
        &mut self,
        prompt: RSlice<'_, u32>,
        reused: u32,
        mut models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        self.fence.clone().guard("mtp", || {
            // A tree grown for an earlier sequence is never judged now.
            self.grower.forget();
            let target = models.target_model()?;
            let reused = reused as usize;
            let same_sequence = self.sequence.replace(target.seq) == Some(target.seq);
            // The head's cache (entries [0, real), cut with the trunk's) and the trunk rows
            // kept from the previous sequence stay valid for the reused positions.
            let continues = reused > 0
                && same_sequence
                && self.in_step
                && (reused <= self.real
                    || (self.pending_from <= self.real
                        && reused <= self.pending_from + self.pending_rows()));
            if continues {
                if reused <= self.real {
                    // The head caught up past the kept prefix: it restarts at its end, from
                    // the rows of the prompt pass.
                    self.real = reused;
                    self.pending.clear();
                    self.pending_from = reused;
                } else {
                    self.pending
                        .truncate((reused - self.pending_from) * self.hidden_size);
                }
            } else if !same_sequence {
                // A new sequence, begun from the target's prefix cache when `reused` > 0: the
                // backend rebuilt the head's cache for the reused positions with them.
                self.real = reused;
                self.pending.clear();
                self.pending_from = reused;
                self.in_step = true;
            } else {
                self.real = 0;
                self.pending.clear();
                self.pending_from = 0;
                self.in_step = reused == 0;
                if reused > 0 {
                    // Nothing to continue from: no drafts until the next fresh sequence.
                    return Ok(());
                }
            }
            // The prompt pass evaluated positions reused..len.
            self.keep_rows(target, reused, prompt.len() - reused)
        })
    }

    fn propose(
        &mut self,
        request: DraftRequest<'_>,
        mut models: DrafterModels<'_>,
        out: &mut Draft,
    ) -> PluginResult<()> {
        self.fence.clone().guard("mtp", || {
            let target = models.target_model()?;
            self.draft(target, &request, out)
        })
    }

    fn accept(
        &mut self,
        accepted: RSlice<'_, u32>,
        mut models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        self.fence.clone().guard("mtp", || {
            self.grower.learn(accepted.as_slice());
            let target = models.target_model()?;
            // The pass began at the certain token, right after the rows kept so far, and
            // evaluated it and the drafts; the target now ends after the certain token and
            // the accepted drafts — or one token earlier, when a stop inside the accepted run
            // left the last emitted token unevaluated.
            let position = self.pending_from + self.pending_rows();
            let kept = 1 + accepted.len();
            let held = target.len().into_result()?;
            if held < position || held > position + kept {
                // The drafter missed a pass: stop drafting until restarted.
                self.in_step = false;
                return Ok(());
            }
            self.keep_rows(target, position, held - position)
        })
    }
}

specula_plugin_api::export_drafter! {
    name: "mtp",
    description: "self-speculation through the target's MTP (NextN) head",
    create: MtpDrafter::new,
    check: MtpDrafter::check,
}
