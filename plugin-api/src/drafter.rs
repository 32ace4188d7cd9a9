//! The drafter contract: propose tokens, learn what was accepted.

// abi_stable's `#[sabi_trait]` expands to impls inside a const block.
#![allow(non_local_definitions)]

use abi_stable::sabi_trait;
use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RBox, ROption, RSlice, RString, RVec, Tuple2};
use abi_stable::StableAbi;

use crate::backend::{Capabilities, ForwardPassMut, LogitRows, ModelInfo, SeqId, SequenceCalls};
use crate::error::PluginResult;

/// How a drafter is created (from the profile's `[drafter]` section).
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct DrafterParams {
    /// The target model the drafts are for.
    pub target: ModelInfo,
    /// The draft model, when the profile names one (the host opened it).
    pub draft_model: ROption<ModelInfo>,
    /// Drafter-specific settings from the profile's `[drafter.options]` table, as text.
    pub options: RVec<Tuple2<RString, RString>>,
    /// Static text the profile attaches to the drafter (`[drafter] corpus = FILE`), tokenized
    /// by the host with the target's tokenizer; empty when there is none.
    pub corpus: RVec<u32>,
}

/// A model lent to a drafter for one call, with the sequence the call is about: the
/// request's sequence of the target, or the drafter's own sequence of the draft model.
#[repr(C)]
#[derive(StableAbi)]
pub struct LentSequence<'a> {
    pub model: ForwardPassMut<'a>,
    pub seq: SeqId,
}

impl LentSequence<'_> {
    /// Facts about the model.
    pub fn model_info(&self) -> ModelInfo {
        self.model.model_info()
    }

    /// What the backend instance can do.
    pub fn capabilities(&self) -> Capabilities {
        self.model.capabilities()
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> PluginResult<usize> {
        self.model.seq_len(self.seq)
    }

    /// Evaluates `tokens` after the sequence ([`SequenceCalls::eval`]).
    pub fn eval(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.model.eval(self.seq, tokens, rows, logits)
    }

    /// Cuts the sequence to `len` tokens ([`crate::ForwardPass::truncate`]).
    pub fn truncate(&mut self, len: usize) -> PluginResult<()> {
        self.model.truncate(self.seq, len)
    }

    /// The hidden states of the sequence's last evaluated rows ([`crate::ForwardPass::hidden_states`]).
    pub fn hidden_states(&self, out: &mut RVec<f32>) -> PluginResult<()> {
        self.model.hidden_states(self.seq, out)
    }

    /// The MTP head over positions `position ..` of the sequence ([`SequenceCalls::mtp_eval`]).
    pub fn mtp_eval(
        &mut self,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.model
            .mtp_eval(self.seq, hidden, tokens, position, rows, logits, hidden_out)
    }
}

/// The models a drafter may use during one call. The host owns them and lends them per call;
/// a drafter never opens a backend itself. A drafter instance serves one sequence: the host
/// creates one per sequence it decodes.
#[repr(C)]
#[derive(StableAbi)]
pub struct DrafterModels<'a> {
    /// The target model and the request's sequence (used by MTP self-speculation).
    pub target: ROption<LentSequence<'a>>,
    /// The separate draft model and this drafter's sequence of it (used by draft-model
    /// speculation).
    pub draft: ROption<LentSequence<'a>>,
}

/// What the host asks of one [`Drafter::propose`] call.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct DraftRequest<'a> {
    /// Prompt, emitted tokens, and the certain next token, which ends the context.
    pub context: RSlice<'a, u32>,
    /// Most tokens to propose.
    pub max_tokens: u32,
    /// The request's sampling temperature: 0 means greedy decoding (drafts are compared with
    /// the target's argmax). Above 0, a drafter with a distribution samples each draft from it
    /// and reports it in [`Draft::probs`], so the host's rejection sampling stays exact.
    pub temperature: f32,
    /// Seed for the drafter's own sampling (changes every step).
    pub seed: u64,
    /// The host verifies a tree ([`Draft::parents`]) in one pass: a drafter may branch,
    /// with `max_tokens` the most nodes. When false it must propose a chain.
    pub tree: bool,
}

/// A proposal: up to `max_tokens` draft tokens, a chain or (when the request allows) a tree.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Default)]
pub struct Draft {
    pub tokens: RVec<u32>,
    /// Empty for a chain (each token continues the one before). For a tree, one entry per
    /// token in topological order: the index of the draft it continues (less than its own), or
    /// [`crate::TREE_ROOT`] for a token that continues the context.
    pub parents: RVec<u32>,
    /// The draft distribution each token was drawn from (`tokens.len() × vocab_size`,
    /// row-major), or empty when the drafter has none (the host then treats it as one-hot).
    pub probs: RVec<f32>,
    /// Per-token confidence in `[0, 1]` where the drafter has one, else empty. For a chain,
    /// the token's draft probability (a greedy host drops the chain from the first one below
    /// its floor); for a tree, the drafter's estimate that the target accepts the token and
    /// every draft above it (the host sizes later trees by what such nodes are worth against
    /// the rows they cost).
    pub confidence: RVec<f32>,
}

impl Draft {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.parents.clear();
        self.probs.clear();
        self.confidence.clear();
    }
}

/// Proposes draft tokens continuing a context.
#[sabi_trait]
pub trait Drafter: Send + Sync {
    /// Starts a new sequence with `prompt`. The target holds the first `reused` tokens of
    /// `prompt` already — kept from its previous sequence (the same target sequence: a
    /// conversation's earlier turns) or taken from the backend's prefix cache (a new target
    /// sequence; an MTP head's cache then holds those positions too) — so the prompt pass just
    /// before this call evaluated only `prompt[reused..]` (the rows `hidden_states` returns);
    /// `reused` is 0 for a sequence that starts empty.
    ///
    /// A host that prefills a long prompt in chunks (the daemon's engine loop, beside other
    /// requests' decode rows) calls `begin` after each chunk: with the prompt so far, and
    /// `reused` = the tokens before that chunk, which continue the previous call.
    fn begin(
        &mut self,
        prompt: RSlice<'_, u32>,
        reused: u32,
        models: DrafterModels<'_>,
    ) -> PluginResult<()>;

    /// Proposes up to `request.max_tokens` tokens continuing `request.context`. Writes into
    /// `out` (cleared first); proposing nothing is always allowed.
    ///
    /// A host may call `propose` on several instances (several sequences) at once, from
    /// different threads, and answer their model calls together: an instance must not wait
    /// for another one (no plugin-wide lock held across a model call).
    fn propose(
        &mut self,
        request: DraftRequest<'_>,
        models: DrafterModels<'_>,
        out: &mut Draft,
    ) -> PluginResult<()>;

    /// Called after every target pass of the decode loop, whether or not drafts were
    /// proposed for it: the pass evaluated the certain token and the proposal, and the drafts
    /// `accepted` (indices into the proposal, in order: `0, 1, ..` for a chain, a root-to-node
    /// path of a tree) were accepted and emitted. The target then holds the certain token and
    /// them (its `hidden_states` begin with their rows, in that order). The certain token that
    /// follows arrives with the next `propose`.
    #[sabi(last_prefix_field)]
    fn accept(&mut self, accepted: RSlice<'_, u32>, models: DrafterModels<'_>) -> PluginResult<()>;
}

/// An owned drafter as returned by a drafter plugin.
pub type BoxedDrafter = Drafter_TO<'static, RBox<()>>;

/// Boxes a drafter implementation for return across the boundary.
pub fn box_drafter<T: Drafter + 'static>(drafter: T) -> BoxedDrafter {
    Drafter_TO::from_value(drafter, TD_Opaque)
}

impl DrafterParams {
    /// The text of option `key`, if the profile set it.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options
            .iter()
            .find(|pair| pair.0.as_str() == key)
            .map(|pair| pair.1.as_str())
    }

    /// Option `key` parsed as `T`, or `default` when absent; an error names the key.
    pub fn parse_option<T: std::str::FromStr>(
        &self,
        key: &str,
        default: T,
    ) -> Result<T, crate::PluginError> {
        match self.option(key) {
            None => Ok(default),
            Some(text) => text.trim().parse().map_err(|_| {
                crate::PluginError::invalid_input(format!(
                    "drafter.options.{key}: cannot parse {text:?} as {}",
                    std::any::type_name::<T>()
                ))
            }),
        }
    }

    /// Fails on options that are not in `known`, naming every one of them and the known ones.
    pub fn check_options(&self, known: &[&str]) -> Result<(), crate::PluginError> {
        let unknown: Vec<&str> = self
            .options
            .iter()
            .map(|pair| pair.0.as_str())
            .filter(|key| !known.contains(key))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        Err(crate::PluginError::invalid_input(format!(
            "{}: unknown option{} (known: {})",
            unknown
                .iter()
                .map(|key| format!("drafter.options.{key}"))
                .collect::<Vec<_>>()
                .join(", "),
            if unknown.len() == 1 { "" } else { "s" },
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        )))
    }
}

impl<'a> DrafterModels<'a> {
    /// The lent target model, or an error saying the host lent none.
    pub fn target_model(&mut self) -> Result<&mut LentSequence<'a>, crate::PluginError> {
        self.target.as_mut().into_option().ok_or_else(|| {
            crate::PluginError::invalid_input("the host lent no target model to this drafter")
        })
    }

    /// The lent draft model, or an error saying the host lent none.
    pub fn draft_model(&mut self) -> Result<&mut LentSequence<'a>, crate::PluginError> {
        self.draft.as_mut().into_option().ok_or_else(|| {
            crate::PluginError::invalid_input(
                "the host lent no draft model to this drafter (set `[drafter] model = FILE`)",
            )
        })
    }
}
