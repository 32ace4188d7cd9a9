//! Specula drafter plugin `model`: drafts with a small model that shares the target's
//! vocabulary (`[drafter] model = FILE`). The host opens the draft model through a backend
//! plugin and lends it to each call; this plugin keeps the draft model's cache in step with
//! the accepted tokens.
//!
//! Greedy requests get greedy drafts: a chain of argmaxes, or — where the host verifies trees —
//! a tree grown best first (each node the likeliest path the draft model sees, so it branches
//! where the draft model is unsure). Sampled requests get drafts sampled from the draft
//! model's softmax at the request's temperature (a chain, or a tree with sampled siblings),
//! with each draft's distribution handed over so the host's rejection sampling stays exact.
//! A tree's nodes are chosen by their chance of acceptance, calibrated on what the target
//! accepted ([`specula_drafting::TreeGrower`]), and reported as their confidence; a sampled
//! chain draft's confidence (a greedy one's too without context hints) is its probability
//! under the draft model.
//!
//! Greedy trees and chains also take context hints: the token that followed the longest
//! earlier occurrence of the text so far, offered beside the draft model's candidates and
//! calibrated the same way (a draft model does not know what the context said before; text
//! that repeats it is where speculation pays most). Greedy chains are then grown by the same
//! calibrated grower, one child per node, and report each draft's calibrated chance as its
//! confidence. Option (`[drafter.options]`): `context_hints` (default `true`).
//!
//! A draft model whose context is shorter than the target's (a small model trained on short
//! texts) sees the context's last tokens only: when the text outgrows its context, its window
//! moves up to keep the last half of it, re-evaluated in one pass, so drafting goes on (and a
//! prompt longer than its context does not stop the generation).

use abi_stable::std_types::{ROption, RSlice, RVec};
use specula_drafting::{DraftPicker, TreeGrower, CONTEXT_HINTS};
use specula_plugin_api::{
    Draft, DraftRequest, Drafter, DrafterModels, DrafterParams, ErrorKind, LentSequence, LogitRows,
    PanicFence, PluginError, PluginResult,
};

/// The draft-model drafter.
#[derive(Debug)]
pub struct ModelDrafter {
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
    vocab: usize,
    /// Where in the context the draft model's window begins: it sees the tokens from there.
    window_start: usize,
    /// Tokens the draft model has evaluated, in order (its cache: the window's first tokens).
    cached: Vec<u32>,
    logits: RVec<f32>,
    /// Grows trees, learning which drafts the target accepts.
    grower: TreeGrower,
}

impl ModelDrafter {
    /// Checks that `params` can make a drafter: a draft model whose vocabulary is the
    /// target's size, and no option but `context_hints` (`true` or `false`).
    pub fn check(params: &DrafterParams) -> Result<(), PluginError> {
        let draft = match &params.draft_model {
            ROption::RNone => Err(PluginError::invalid_input(
                "the model drafter needs a draft model: set `[drafter] model = FILE` in the profile (or --draft-model)",
            )),
            ROption::RSome(draft) if draft.vocab_size != params.target.vocab_size => {
                Err(PluginError::invalid_input(format!(
                    "target and draft vocabularies differ: {} has {} tokens, {} has {}",
                    params.target.name, params.target.vocab_size, draft.name, draft.vocab_size
                )))
            }
            ROption::RSome(_) => Ok(()),
        };
        let options = params
            .check_options(&[CONTEXT_HINTS])
            .and_then(|()| TreeGrower::for_drafter(params, true).map(|_| ()));
        PluginError::all([draft, options])
    }

    pub fn new(params: &DrafterParams) -> Result<Self, PluginError> {
        Self::check(params)?;
        Ok(Self {
            fence: PanicFence::default(),
            vocab: params.target.vocab_size as usize,
            window_start: 0,
            cached: Vec::new(),
            logits: RVec::new(),
            grower: TreeGrower::for_drafter(params, true)?,
        })
    }

    /// Makes the draft model's cache hold `context` minus its last token, evaluates that
    /// token, and leaves its logits in `self.logits`.
    fn catch_up(
        &mut self,
        model: &mut LentSequence<'_>,
        context: &[u32],
    ) -> Result<(), PluginError> {
        let common = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1)
            .min(model.len().into_result()?);
        if model.truncate(common).into_result().is_err() {
            // Beyond a recurrent model's rollback window: start over.
            model.truncate(0).into_result()?;
            self.cached.clear();
            return self.eval(model, context);
        }
        self.cached.truncate(common);
        self.eval(model, &context[common..])
    }

    /// Moves the draft model's window so that a context of `len` tokens and `drafts` more fit
    /// in its `capacity`: up to the last half of the capacity (less if the drafts need more
    /// room), or back to the start for a context shorter than the window's start (a new one).
    fn slide_window(&mut self, len: usize, drafts: usize, capacity: usize) {
        if self.window_start > len {
            self.window_start = 0;
            self.cached.clear();
        }
        if len - self.window_start + drafts > capacity {
            let keep = (capacity / 2).min(capacity.saturating_sub(drafts)).max(1);
            self.window_start = len.saturating_sub(keep);
            // Every token moves to another position: the cache is rebuilt.
            self.cached.clear();
        }
    }

    fn eval(&mut self, model: &mut LentSequence<'_>, tokens: &[u32]) -> Result<(), PluginError> {
        model
            .eval(tokens, LogitRows::Last, &mut self.logits)
            .into_result()?;
        self.cached.extend_from_slice(tokens);
        Ok(())
    }

    /// Drafts up to `request.max_tokens` tokens with the draft model.
    pub fn draft(
        &mut self,
        model: &mut LentSequence<'_>,
        request: &DraftRequest<'_>,
        out: &mut Draft,
    ) -> Result<(), PluginError> {
        out.clear();
        let capacity = model.model_info().context_size as usize;
        let n = (request.max_tokens as usize).min(capacity / 2);
        if request.context.is_empty() || n == 0 {
            return Ok(());
        }
        self.slide_window(request.context.len(), n, capacity);
        let context: &[u32] = &request.context[self.window_start..];
        match self.catch_up(model, context) {
            Ok(()) => {}
            Err(e) if e.kind == ErrorKind::ContextFull => return Ok(()),
            Err(e) => return Err(e),
        }
        if self.grower.grows(request) {
            let root = self.logits[..self.vocab].to_vec();
            let mut path_context = context.to_vec();
            let mut grower = std::mem::take(&mut self.grower);
            let grown = grower.grow(request, &root, n, out, |path, logits| {
                path_context.truncate(context.len());
                path_context.extend_from_slice(path);
                self.catch_up(model, &path_context)?;
                logits.clear();
                logits.extend_from_slice(&self.logits[..self.vocab]);
                Ok(())
            });
            self.grower = grower;
            return grown;
        }
        let mut picker = DraftPicker::new(request);
        for i in 0..n {
            let token = picker.pick(&self.logits[..self.vocab], out);
            if i + 1 < n {
                self.eval(model, &[token])?;
            }
        }
        Ok(())
    }
}

impl Drafter for ModelDrafter {
    fn begin(
        &mut self,
        prompt: RSlice<'_, u32>,
        _reused: u32,
        mut models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        self.fence.clone().guard("model", || {
            // A tree grown for an earlier sequence is never judged now.
            self.grower.forget();
            let model = models.draft_model()?;
            // Fill the cache now with all but the last token (`propose` evaluates that one),
            // keeping what the draft model already holds of it (a conversation's earlier
            // turns: the cache is a function of its tokens alone).
            self.window_start = 0;
            let capacity = model.model_info().context_size as usize;
            self.slide_window(prompt.len(), 1, capacity);
            match &prompt[self.window_start..] {
                [] | [_] => {
                    model.truncate(0).into_result()?;
                    self.cached.clear();
                    Ok(())
                }
                window => self.catch_up(model, &window[..window.len() - 1]),
            }
        })
    }

    fn propose(
        &mut self,
        request: DraftRequest<'_>,
        mut models: DrafterModels<'_>,
        out: &mut Draft,
    ) -> PluginResult<()> {
        self.fence.clone().guard("model", || {
            let model = models.draft_model()?;
            self.draft(model, &request, out)
        })
    }

    fn accept(
        &mut self,
        accepted: RSlice<'_, u32>,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        // The next `propose` cuts the cache back to what its context shares with it.
        self.fence.clone().guard("model", || {
            self.grower.learn(accepted.as_slice());
            Ok(())
        })
    }
}

specula_plugin_api::export_drafter! {
    name: "model",
    description: "drafting with a small draft model that shares the target's vocabulary",
    create: ModelDrafter::new,
    check: ModelDrafter::check,
}
