//! One request's decoding as a state machine the caller drives pass by pass, so that one
//! target pass can serve many requests at once (the daemon's engine loop) or one alone
//! ([`super::generate`]). The algorithm is the folded speculative loop of the module docs;
//! this type holds a request's share of it: its prompt and history, sampler, drafter calls,
//! verdicts, stop conditions and statistics.
//!
//! Driving it: evaluate [`prefill_chunk`](Generation::prefill_chunk)s and report each with
//! [`prefilled`](Generation::prefilled) until the prompt is done; then, per step,
//! [`begin_step`](Generation::begin_step) (emits the certain token),
//! [`wanted_drafts`](Generation::wanted_drafts), [`draft`](Generation::draft), evaluate
//! [`rows`](Generation::rows) with logits for every row, and
//! [`verify`](Generation::verify) — or [`pass_failed`](Generation::pass_failed) — until
//! [`is_done`](Generation::is_done); then [`finish`](Generation::finish).

use std::time::Instant;

use abi_stable::std_types::RSlice;
use anyhow::{bail, Context};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use specula_plugin_api::{
    BoxedDrafter, Capabilities, Draft, DraftRequest, DrafterModels, ErrorKind, LentSequence,
    LogitRows, ModelInfo, PluginError, TREE_ROOT,
};
use specula_tokenizer::{StreamDecoder, Tokenizer};

use super::acceptance::{Judge, Verdict};
use super::adaptive::{self, DraftLength};
use super::stats::SpecStats;
use crate::request::{Outcome, Request, StopMatcher, StopReason, Timings};
use crate::sampling::Sampler;
use crate::scheduler::budget::{chain_values, PROBE_AFTER_STARVED_STEPS};

/// Weight of the newest tree in the smoothed value of each tree node.
const TREE_VALUE_SMOOTHING: f64 = 0.2;

/// What one generation decodes with during one call: its sequence of the target and, when
/// it speculates, its drafter with the drafter's sequence of the draft model.
pub struct Lane<'a> {
    pub target: LentSequence<'a>,
    pub drafter: Option<LaneDrafter<'a>>,
}

/// A prompt that leaves no room in the context for a new token (a caller such as `chat` can
/// tell it from other errors and say what to do there).
#[derive(Debug, thiserror::Error)]
#[error(
    "the prompt is {tokens} tokens and the context holds {context}, which leaves no room for a new token: {}",
    if context < trained {
        format!("shorten the prompt or raise the context size (-c, target.context_size; the model was trained for {trained})")
    } else {
        "shorten the prompt (that is the most the model was trained for)".to_string()
    }
)]
pub struct PromptTooLong {
    pub tokens: usize,
    pub context: usize,
    pub trained: usize,
}

/// A drafter instance (one per sequence) and what it drafts with.
pub struct LaneDrafter<'a> {
    /// The plugin name, for error messages.
    pub name: &'a str,
    pub drafter: &'a mut BoxedDrafter,
    pub draft_model: Option<LentSequence<'a>>,
}

impl Lane<'_> {
    /// The drafter, its name and the models lent to it for one call.
    fn drafter(&mut self) -> Option<(&str, &mut BoxedDrafter, DrafterModels<'_>)> {
        let target = &mut self.target;
        let slot = self.drafter.as_mut()?;
        let models = DrafterModels {
            target: Some(reborrow(target)).into(),
            draft: slot.draft_model.as_mut().map(reborrow).into(),
        };
        Some((slot.name, &mut *slot.drafter, models))
    }
}

fn reborrow<'b>(lent: &'b mut LentSequence<'_>) -> LentSequence<'b> {
    LentSequence {
        model: lent.model.sabi_reborrow_mut(),
        seq: lent.seq,
    }
}

/// What a stop check decided about one emitted token.
enum Emit {
    Continue,
    Stop(StopReason),
}

/// Emits tokens: streaming text, stop strings and the token limit.
struct Emitter<'t, F: FnMut(&str)> {
    stream: StreamDecoder<'t>,
    stops: StopMatcher,
    on_text: F,
    text: String,
    tokens: Vec<u32>,
    max_tokens: usize,
}

impl<F: FnMut(&str)> Emitter<'_, F> {
    fn emit(&mut self, token: u32) -> Emit {
        self.tokens.push(token);
        let (ready, hit) = self.stops.push(&self.stream.push(token));
        self.write(&ready);
        if hit {
            Emit::Stop(StopReason::StopString)
        } else if self.tokens.len() >= self.max_tokens {
            Emit::Stop(StopReason::MaxTokens)
        } else {
            Emit::Continue
        }
    }

    fn write(&mut self, piece: &str) {
        if !piece.is_empty() {
            (self.on_text)(piece);
            self.text.push_str(piece);
        }
    }

    fn finish(&mut self, reason: StopReason) {
        if reason != StopReason::StopString {
            let (ready, _) = self.stops.push(&self.stream.finish());
            self.write(&ready);
            let rest = self.stops.flush();
            self.write(&rest);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
    Done(StopReason),
}

/// The step in progress: what [`Generation::verify`] needs from [`Generation::begin_step`].
#[derive(Debug, Clone, Copy)]
struct Step {
    /// Tokens the target held before the pass.
    evaluated: usize,
    /// Whether the drafter was asked for drafts.
    asked: bool,
    started: Instant,
}

/// One request being decoded (see the module docs for how to drive it).
pub struct Generation<'t, F: FnMut(&str)> {
    tokenizer: &'t Tokenizer,
    eos: Option<u32>,
    vocab: usize,
    context: usize,
    request: Request,
    prompt: Vec<u32>,
    /// Prompt tokens the target already held before the first chunk (kept or cached).
    reused: usize,
    /// Prompt tokens the target holds now.
    prefilled: usize,
    phase: Phase,
    /// Prompt and emitted tokens; during a step, the certain token too.
    history: Vec<u32>,
    /// The certain token: sampled, not yet evaluated.
    t0: u32,
    sampler: Sampler,
    draft_rng: ChaCha20Rng,
    judge: Judge,
    draft: Draft,
    /// The rows of this step's pass: the certain token and the drafts.
    rows: Vec<u32>,
    /// When the drafts form a tree: each row's parent row ([`TREE_ROOT`] for the certain
    /// token); empty for a chain.
    row_parents: Vec<u32>,
    /// Whether this request asks its drafter for trees.
    tree: bool,
    /// Per node of the recent trees, in the order drafted: the drafter's estimate that its
    /// path is accepted, smoothed over trees ([`draft_values`](Self::draft_values)).
    tree_values: Vec<f64>,
    /// Whether a drafter's broken drafts were warned about (once a generation).
    warned_of_broken_drafts: bool,
    /// Steps in a row that wanted drafts and a budget granted none.
    starved: u32,
    /// The draft-length controller, when this request speculates.
    speculation: Option<DraftLength>,
    stats: SpecStats,
    out: Emitter<'t, F>,
    started: Instant,
    prefill_seconds: f64,
    /// When decoding began (the prompt done), if it did.
    decode_started: Option<Instant>,
    /// Whether the draft-length controller also judges steps by their wall time (one
    /// request per pass); see [`Generation::untimed`].
    timed: bool,
    step: Step,
}

impl<'t, F: FnMut(&str)> Generation<'t, F> {
    /// Tokenizes `request`'s prompt and checks it fits the context. `capabilities` are the
    /// target's; `has_drafter` says whether a drafter is there to speculate with (the request
    /// decides whether it does). `on_text` receives text as soon as it is certain.
    pub fn new(
        tokenizer: &'t Tokenizer,
        info: &ModelInfo,
        capabilities: &Capabilities,
        has_drafter: bool,
        request: Request,
        on_text: F,
    ) -> anyhow::Result<Self> {
        let prompt = tokenizer.encode(&request.prompt, request.add_bos, true);
        Self::with_prompt(
            tokenizer,
            info,
            capabilities,
            has_drafter,
            request,
            prompt,
            on_text,
        )
    }

    /// Like [`new`](Self::new), with the prompt already tokenized (`tokenizer.encode(prompt,
    /// add_bos, true)`), so that a caller can do that work elsewhere.
    pub fn with_prompt(
        tokenizer: &'t Tokenizer,
        info: &ModelInfo,
        capabilities: &Capabilities,
        has_drafter: bool,
        request: Request,
        mut prompt: Vec<u32>,
        on_text: F,
    ) -> anyhow::Result<Self> {
        let context = info.context_size as usize;
        if prompt.is_empty() {
            match tokenizer.bos().or(info.bos_token.into_option()) {
                Some(bos) => prompt.push(bos),
                None => bail!("the prompt is empty and the model has no BOS token to start from"),
            }
        }
        if prompt.len() >= context {
            return Err(PromptTooLong {
                tokens: prompt.len(),
                context,
                trained: info.train_context_length as usize,
            }
            .into());
        }
        let tree = request.speculation.is_some_and(|s| s.tree) && capabilities.tree_verify;
        let speculation = match request.speculation {
            Some(settings) if has_drafter && settings.draft_max > 0 => {
                let max_drafts = settings
                    .draft_max
                    .min(capabilities.max_verify_tokens.saturating_sub(1))
                    .min(capabilities.rollback_depth.saturating_sub(1));
                Some(DraftLength::new(
                    settings.draft_min,
                    max_drafts,
                    settings.adaptive,
                ))
            }
            _ => None,
        };
        let stream = if tokenizer.decode(&prompt).is_empty() {
            StreamDecoder::from_start(tokenizer)
        } else {
            StreamDecoder::new(tokenizer)
        };
        let out = Emitter {
            stream,
            stops: StopMatcher::new(&request.stop),
            on_text,
            text: String::new(),
            tokens: Vec::new(),
            max_tokens: request.max_tokens as usize,
        };
        let now = Instant::now();
        Ok(Self {
            tokenizer,
            eos: info.eos_token.into_option(),
            vocab: info.vocab_size as usize,
            context,
            sampler: Sampler::new(request.sampling.clone()),
            draft_rng: ChaCha20Rng::seed_from_u64(request.sampling.seed.unwrap_or(0) ^ 0x5eed),
            history: prompt.clone(),
            prompt,
            request,
            reused: 0,
            prefilled: 0,
            phase: Phase::Prefill,
            t0: 0,
            judge: Judge::default(),
            draft: Draft::default(),
            rows: Vec::new(),
            row_parents: Vec::new(),
            tree,
            tree_values: Vec::new(),
            warned_of_broken_drafts: false,
            starved: 0,
            speculation,
            stats: SpecStats::default(),
            out,
            started: now,
            prefill_seconds: 0.0,
            decode_started: None,
            timed: true,
            step: Step {
                evaluated: 0,
                asked: false,
                started: now,
            },
        })
    }

    /// Stops the draft-length controller from judging steps by their wall time: where many
    /// requests share each pass, a step's time is mostly the others' work (the engine loop's
    /// row budget weighs the cost of drafts instead). Acceptance still steers it.
    pub fn untimed(mut self) -> Self {
        self.timed = false;
        self
    }

    /// The prompt's tokens.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// Whether this request speculates (the profile has a drafter and the request asks).
    pub fn speculates(&self) -> bool {
        self.speculation.is_some()
    }

    /// Records that the target already holds the first `n` prompt tokens (a conversation's
    /// earlier turns, or the backend's prefix cache); prefill starts after them. Call before
    /// the first chunk. At least the last prompt token is always evaluated: its logits start
    /// the decoding.
    pub fn set_reused(&mut self, n: usize) {
        debug_assert_eq!(self.prefilled, self.reused, "set before the first chunk");
        let n = n.min(self.prompt.len() - 1);
        self.reused = n;
        self.prefilled = n;
    }

    /// Prompt tokens the target already held.
    pub fn reused(&self) -> usize {
        self.reused
    }

    /// Whether the prompt is still being evaluated.
    pub fn is_prefilling(&self) -> bool {
        self.phase == Phase::Prefill
    }

    /// Prompt tokens still to evaluate.
    pub fn prefill_remaining(&self) -> usize {
        match self.phase {
            Phase::Prefill => self.prompt.len() - self.prefilled,
            _ => 0,
        }
    }

    /// The next at most `max` (≥ 1) prompt tokens to evaluate, and which of their rows need
    /// logits (the prompt's last, which starts the decoding).
    pub fn prefill_chunk(&self, max: usize) -> (&[u32], LogitRows) {
        let end = self
            .prompt
            .len()
            .min(self.prefilled.saturating_add(max.max(1)));
        let rows = if end == self.prompt.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        (&self.prompt[self.prefilled..end], rows)
    }

    /// Reports that the target evaluated the chunk of [`prefill_chunk`](Self::prefill_chunk)
    /// with `n` tokens; `logits` are its logit rows. The drafter follows the prompt chunk by
    /// chunk ([`specula_plugin_api::Drafter::begin`]); once the prompt is done, the first
    /// token is sampled.
    pub fn prefilled(
        &mut self,
        lane: &mut Lane<'_>,
        n: usize,
        logits: &[f32],
    ) -> anyhow::Result<()> {
        let start = self.prefilled;
        self.prefilled += n;
        let done = self.prefilled == self.prompt.len();
        if done {
            self.stats.target_passes += 1;
            self.prefill_seconds = self.started.elapsed().as_secs_f64();
        }
        if self.speculation.is_some() {
            let before = lane.target.len().into_result()?;
            let answered = lane.drafter().map(|(name, drafter, models)| {
                let t = Instant::now();
                let answer = drafter
                    .begin(
                        RSlice::from_slice(&self.prompt[..self.prefilled]),
                        start as u32,
                        models,
                    )
                    .into_result();
                (name.to_string(), answer, t.elapsed().as_secs_f64())
            });
            if let Some((name, answer, seconds)) = answered {
                self.stats.draft_seconds += seconds;
                self.drafter_answered(lane, &name, "start", before, answer)?;
            }
        }
        if !done {
            return Ok(());
        }
        self.decode_started = Some(Instant::now());
        let t = Instant::now();
        self.t0 = self
            .sampler
            .sample(&logits[logits.len() - self.vocab..], &self.history);
        self.stats.sample_seconds += t.elapsed().as_secs_f64();
        self.phase = if self.request.max_tokens == 0 {
            Phase::Done(StopReason::MaxTokens)
        } else {
            Phase::Decode
        };
        Ok(())
    }

    /// Whether generation has ended.
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done(_))
    }

    /// Ends generation if the request was cancelled (the client left) — also while its
    /// prompt is still being read; returns whether it did.
    pub fn end_if_cancelled(&mut self) -> bool {
        if !self.is_done() && self.request.cancel.is_cancelled() {
            self.phase = Phase::Done(StopReason::Cancelled);
        }
        self.phase == Phase::Done(StopReason::Cancelled)
    }

    fn is_end(&self, token: u32) -> bool {
        self.tokenizer.is_end_of_generation(token) || self.eos == Some(token)
    }

    /// Starts a decode step: emits the certain token unless it ends generation. Returns
    /// whether the step goes on to a pass (false: generation is done).
    pub fn begin_step(&mut self) -> bool {
        if self.phase != Phase::Decode {
            return false;
        }
        let stop = if self.request.cancel.is_cancelled() {
            Some(StopReason::Cancelled)
        } else if self.is_end(self.t0) {
            Some(StopReason::EndOfGeneration)
        } else {
            self.history.push(self.t0);
            self.stats.steps += 1;
            self.stats.emitted += 1;
            match self.out.emit(self.t0) {
                Emit::Stop(reason) => Some(reason),
                Emit::Continue if self.history.len() >= self.context => {
                    Some(StopReason::ContextFull)
                }
                Emit::Continue => None,
            }
        };
        if let Some(reason) = stop {
            self.phase = Phase::Done(reason);
            return false;
        }
        self.step = Step {
            evaluated: self.history.len() - 1,
            asked: false,
            started: Instant::now(),
        };
        self.draft.clear();
        self.rows.clear();
        self.rows.push(self.t0);
        self.row_parents.clear();
        true
    }

    /// How many drafts this step would verify (0 when not speculating or paused, capped by
    /// the tokens still allowed and the context). Call once per step, after
    /// [`begin_step`](Self::begin_step).
    pub fn wanted_drafts(&mut self) -> usize {
        // Every draft takes a cache slot; a chain's beyond the tokens still allowed could never
        // be emitted, while a tree's nodes spread over fewer positions (deeper ones are clamped).
        let slots = self.context - self.history.len();
        let room = match self.tree {
            true => slots,
            false => slots.min(self.request.max_tokens as usize - self.out.tokens.len()),
        };
        let Some(length) = self.speculation.as_mut() else {
            return 0;
        };
        // A chain's length follows acceptance; a tree keeps its node budget (its drafter
        // shapes it) unless speculation is paused.
        let n = match length.next_len() {
            0 => 0,
            _ if self.tree => length.max_len() as usize,
            len => len as usize,
        }
        .min(room);
        if let Some(reason) = length.pause_reason() {
            self.stats.record_pause(reason);
        }
        n
    }

    /// How many of `wanted` drafts this step verifies whatever they cost: the drafts its
    /// settings fix ([`DraftLength::floor`]), and one probe after
    /// [`PROBE_AFTER_STARVED_STEPS`] steps in a row that a budget granted none (its verdict
    /// updates what the budget reads: only drafts can).
    pub fn draft_floor(&self, wanted: usize) -> usize {
        let fixed = self
            .speculation
            .as_ref()
            .map_or(0, |l| l.floor(wanted as u32) as usize);
        let probe = usize::from(self.starved >= PROBE_AFTER_STARVED_STEPS).min(wanted);
        fixed.max(probe)
    }

    /// Records what a budget granted of the `wanted` drafts ([`draft_floor`](Self::draft_floor)
    /// counts the steps in a row it granted none).
    pub fn granted(&mut self, wanted: usize, granted: usize) {
        self.starved = match wanted > 0 && granted == 0 {
            true => self.starved + 1,
            false => 0,
        };
    }

    /// The smoothed fraction of this request's drafts the target accepts (a prior of 0.5
    /// before any evidence); 0 when it does not speculate.
    pub fn acceptance(&self) -> f64 {
        self.speculation
            .as_ref()
            .map_or(0.0, DraftLength::acceptance)
    }

    /// Whether this request's drafter proposes trees (asked for, and verified by the target).
    pub fn drafts_trees(&self) -> bool {
        self.tree
    }

    /// What each of up to `wanted` drafts would add to this step's expected tokens (see
    /// [`allocate_drafts`](crate::scheduler::budget::allocate_drafts)): a chain's `p^j` at the
    /// smoothed acceptance rate; a tree's `j`-th node, the chance its drafter gave the `j`-th
    /// node of recent trees (best first, so a growing budget adds the nodes valued next), the
    /// chain's decay past the largest recent tree.
    pub fn draft_values(&self, wanted: usize) -> Vec<f64> {
        let p = self.acceptance();
        if !self.tree {
            return chain_values(p, wanted);
        }
        let mut values: Vec<f64> = self.tree_values.iter().copied().take(wanted).collect();
        while values.len() < wanted {
            let next = values.last().map_or(p, |last| last * p);
            values.push(next);
        }
        values
    }

    /// Takes a drafter's answer to `call` (`before`: the target's length when it was lent).
    /// Speculation only ever changes the speed, so a drafter that fails is dropped for the
    /// rest of this generation and decoding goes on plainly, with a warning; `false` then. A
    /// drafter must leave the target as it found it: tokens it left evaluated are cut back
    /// (and it is dropped); a target it cut shorter cannot be mended, and ends the generation.
    fn drafter_answered(
        &mut self,
        lane: &mut Lane<'_>,
        name: &str,
        call: &str,
        before: usize,
        answer: Result<(), PluginError>,
    ) -> anyhow::Result<bool> {
        let after = lane.target.len().into_result()?;
        if after < before {
            bail!(
                "drafter '{name}' cut the target's sequence it was lent from {before} to {after} tokens (in {call}), so the text cannot go on; a drafter must leave the target as it found it (docs/PLUGINS.md)"
            );
        }
        let mut failures = Vec::new();
        if let Err(e) = answer {
            failures.push(format!("failed to {call}: {}", e.message));
        }
        if after > before {
            lane.target.truncate(before).into_result().with_context(|| {
                format!(
                    "drafter '{name}' left {} tokens on the target in {call}, and they cannot be cut back",
                    after - before
                )
            })?;
            failures.push(format!(
                "left {} tokens it evaluated on the target's sequence (in {call}; they were cut back)",
                after - before
            ));
        }
        let failure = (!failures.is_empty()).then(|| failures.join(", and "));
        let Some(failure) = failure else {
            return Ok(true);
        };
        tracing::warn!(
            "drafter '{name}' {failure}; decoding on without drafts (the output is the same, only slower)"
        );
        self.stats.drafter_failure = Some(format!("drafter '{name}' {failure}"));
        self.speculation = None;
        Ok(false)
    }

    /// Whether this generation dropped its drafter (it failed, or did not leave the target
    /// as it found it): the drafter instance should not serve another.
    pub fn dropped_its_drafter(&self) -> bool {
        self.stats.drafter_failure.is_some()
    }

    /// Asks the drafter for up to `n` drafts continuing the history; they join
    /// [`rows`](Self::rows). With `n == 0` the step is plain.
    pub fn draft(&mut self, lane: &mut Lane<'_>, n: usize) -> anyhow::Result<()> {
        if n == 0 || self.speculation.is_none() {
            return Ok(());
        }
        let before = lane.target.len().into_result()?;
        let Some((name, drafter, models)) = lane.drafter() else {
            return Ok(());
        };
        self.step.asked = true;
        let t = Instant::now();
        let temperature = match self.request.sampling.temperature {
            sampled if sampled > 0.0 => self.judge.draft_temperature.next(sampled),
            greedy => greedy,
        };
        let request = DraftRequest {
            context: RSlice::from_slice(&self.history),
            max_tokens: n as u32,
            // Sampled: as cold as the drafts are likeliest to be accepted (their distribution
            // goes with them, so rejection sampling stays exact).
            temperature,
            seed: self.draft_rng.next_u64(),
            tree: self.tree,
        };
        let name = name.to_string();
        let answer = drafter
            .propose(request, models, &mut self.draft)
            .into_result();
        if !self.drafter_answered(lane, &name, "propose", before, answer)? {
            self.stats.draft_seconds += t.elapsed().as_secs_f64();
            self.draft.tokens.clear();
            self.draft.parents.clear();
            return Ok(());
        }
        let adaptive = self
            .speculation
            .as_ref()
            .is_some_and(DraftLength::is_adaptive);
        let confidence_floor = (self.request.sampling.temperature <= 0.0 && adaptive)
            .then_some(adaptive::MIN_CONFIDENCE);
        let broken = sanitize(&mut self.draft, n, self.vocab, confidence_floor, self.tree);
        if let Some(why) = broken.filter(|_| !self.warned_of_broken_drafts) {
            self.warned_of_broken_drafts = true;
            tracing::warn!(
                "drafter '{name}' {why}: those drafts were dropped (once a generation, this warning)"
            );
        }
        self.stats.draft_seconds += t.elapsed().as_secs_f64();
        let tokens = self.draft.tokens.len();
        if self.tree && !self.draft.parents.is_empty() && self.draft.confidence.len() >= tokens {
            // Nodes asked for but not offered (the drafter saw no path worth one) are worth
            // nothing; nodes past those asked for were not valued this time: forgotten (the
            // values beyond are extrapolated again).
            self.tree_values.truncate(n);
            for i in 0..n {
                let c = match self.draft.confidence[..tokens].get(i) {
                    Some(&c) if c.is_finite() => f64::from(c).clamp(0.0, 1.0),
                    _ => 0.0,
                };
                match self.tree_values.get_mut(i) {
                    Some(v) => *v += TREE_VALUE_SMOOTHING * (c - *v),
                    None => self.tree_values.push(c),
                }
            }
        }
        self.rows.extend_from_slice(&self.draft.tokens);
        if !self.draft.parents.is_empty() {
            self.row_parents.push(TREE_ROOT);
            self.row_parents
                .extend(self.draft.parents.iter().map(|&p| match p {
                    TREE_ROOT => 0,
                    p => p + 1,
                }));
        }
        Ok(())
    }

    /// The parent row of each of [`rows`](Self::rows) when the drafts form a tree (empty for
    /// a chain): what the pass's chunk carries as its `parents`.
    pub fn row_parents(&self) -> &[u32] {
        &self.row_parents
    }

    /// The tokens this step's pass evaluates (logits for every row): the certain token, then
    /// the drafts.
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// Whether this step's rows would take the sequence past its context (a context-full
    /// error is then its own, not a shared pool's).
    pub fn outgrows_its_context(&self) -> bool {
        match self.phase {
            // A prompt must leave room in the context (checked when the request is made).
            Phase::Prefill => self.prompt.len() >= self.context,
            _ => (self.history.len() + self.rows.len()).saturating_sub(1) > self.context,
        }
    }

    /// Reports that this step's pass failed with `error`. A full context ends generation;
    /// any other error — a full KV pool shared with other sequences among them — is returned.
    pub fn pass_failed(&mut self, error: PluginError) -> anyhow::Result<()> {
        let context_full = self.outgrows_its_context();
        match self.phase {
            Phase::Decode if error.kind == ErrorKind::ContextFull && context_full => {
                self.phase = Phase::Done(StopReason::ContextFull);
                Ok(())
            }
            Phase::Prefill => Err(error).context("prompt evaluation failed"),
            _ => Err(error).context("decoding failed"),
        }
    }

    /// Judges this step's pass (`logits`: one row per [`rows`](Self::rows) entry, which took
    /// `pass_seconds`), emits the accepted drafts, cuts the target back to what was emitted
    /// and tells the drafter.
    pub fn verify(
        &mut self,
        lane: &mut Lane<'_>,
        logits: &[f32],
        pass_seconds: f64,
    ) -> anyhow::Result<()> {
        self.stats.target_passes += 1;
        self.stats.verify_seconds += pass_seconds;

        let t = Instant::now();
        let n_drafts = self.draft.tokens.len();
        let base = self.history.len();
        // The accepted drafts (indices into the proposal, in order) and the token after them.
        let (path, next) = self.walk(logits);
        let accepted = path.len();
        self.history.truncate(base);
        self.stats.sample_seconds += t.elapsed().as_secs_f64();
        // A tree's drafts by depth: its deepest path stands for a chain's length.
        let positions = match self.row_parents.is_empty() {
            true => n_drafts,
            false => self.tree_depth(),
        };
        self.stats.record_verdicts(n_drafts, positions, accepted);
        tracing::trace!(
            target: "specula::spec",
            step = self.stats.steps,
            drafted = n_drafts,
            accepted,
            next,
            "verified"
        );

        // Emit accepted drafts; a stop clamps them.
        let evaluated = self.step.evaluated;
        let mut stop = None;
        let mut keep = evaluated + 1 + accepted;
        for (j, &at) in path.iter().enumerate() {
            let d = self.draft.tokens[at];
            if self.is_end(d) {
                keep = evaluated + 1 + j;
                stop = Some((j, StopReason::EndOfGeneration));
                break;
            }
            self.history.push(d);
            self.stats.emitted += 1;
            self.stats.accepted += 1;
            let emitted = match self.out.emit(d) {
                Emit::Continue if self.history.len() >= self.context => {
                    Emit::Stop(StopReason::ContextFull)
                }
                emitted => emitted,
            };
            if let Emit::Stop(reason) = emitted {
                // Like plain decoding, the last emitted token stays unevaluated.
                keep = evaluated + 1 + j;
                stop = Some((j + 1, reason));
                break;
            }
        }
        let emitted_drafts = stop.map_or(accepted, |(n, _)| n);
        self.stats.clamped += (accepted - emitted_drafts) as u64;
        if !self.row_parents.is_empty() {
            // The tree's rows down the emitted path stay; the rest of the tree goes.
            let rows: Vec<u32> = std::iter::once(0)
                .chain(path.iter().map(|&at| at as u32 + 1))
                .take(keep - evaluated)
                .collect();
            let seq = lane.target.seq;
            lane.target
                .model
                .seq_keep_path(seq, RSlice::from_slice(&rows))
                .into_result()
                .context("the target could not keep the accepted path of the tree")?;
        } else {
            let len_before = lane
                .target
                .len()
                .into_result()
                .context("the target cannot report its length")?;
            if keep < len_before {
                lane.target
                    .truncate(keep)
                    .into_result()
                    .context("the target could not roll back")?;
            }
        }
        if let Some(length) = self.speculation.as_mut() {
            length.record(
                self.step.asked,
                positions as u32,
                accepted as u32,
                1 + emitted_drafts as u32,
                self.timed
                    .then(|| self.step.started.elapsed().as_secs_f64()),
            );
            // After every target pass, drafted or not: a drafter that follows the target's
            // hidden states (MTP) must see every accepted position.
            let before = lane.target.len().into_result()?;
            let emitted: Vec<u32> = path[..emitted_drafts].iter().map(|&at| at as u32).collect();
            let answered = lane.drafter().map(|(name, drafter, models)| {
                let t = Instant::now();
                let answer = drafter
                    .accept(RSlice::from_slice(&emitted), models)
                    .into_result();
                (name.to_string(), answer, t.elapsed().as_secs_f64())
            });
            if let Some((name, answer, seconds)) = answered {
                self.stats.draft_seconds += seconds;
                self.drafter_answered(lane, &name, "accept", before, answer)?;
            }
        }
        self.phase = match stop {
            Some((_, reason)) => Phase::Done(reason),
            None => {
                self.t0 = next;
                Phase::Decode
            }
        };
        Ok(())
    }

    /// The depth of this step's tree: drafts on its deepest path.
    fn tree_depth(&self) -> usize {
        let mut depth = vec![0usize; self.row_parents.len()];
        for row in 1..self.row_parents.len() {
            depth[row] = depth[self.row_parents[row] as usize] + 1;
        }
        depth.into_iter().max().unwrap_or(0)
    }

    /// The row the pass's row `row` continues: its parent in a tree, the row before it in a
    /// chain.
    fn parent_row(&self, row: usize) -> usize {
        match self.row_parents.get(row) {
            Some(&parent) => parent as usize,
            None => row - 1,
        }
    }

    /// Judges the pass from the certain token's row down: at each row the drafts continuing
    /// it (one in a chain, its children in a tree) are judged together ([`Judge::judge`]:
    /// greedily, the target's choice where a draft proposes it — plain decoding's choice at
    /// that point, so the output is plain decoding's —; sampling, by rejection sampling
    /// recursive over siblings, so the output follows the target's distribution), and the walk
    /// goes on from the accepted draft's row. Returns the accepted drafts and the token after
    /// them; leaves the accepted drafts in the history (the caller cuts it back).
    fn walk(&mut self, logits: &[f32]) -> (Vec<usize>, u32) {
        let vocab = self.vocab;
        let has_probs = self.draft.probs.len() == self.draft.tokens.len() * vocab;
        let mut path = Vec::new();
        let mut row = 0;
        loop {
            let children: Vec<usize> = (row + 1..self.rows.len())
                .filter(|&r| self.parent_row(r) == row)
                .collect();
            let drafts: Vec<(u32, Option<&[f32]>)> = children
                .iter()
                .map(|&r| {
                    let q = has_probs.then(|| &self.draft.probs[(r - 1) * vocab..r * vocab]);
                    (self.rows[r], q)
                })
                .collect();
            let verdict = self.judge.judge(
                &mut self.sampler,
                &logits[row * vocab..(row + 1) * vocab],
                &self.history,
                &drafts,
                row == 0,
            );
            match verdict {
                Verdict::Accept(j) => {
                    row = children[j];
                    path.push(row - 1);
                    self.history.push(self.rows[row]);
                }
                Verdict::Reject(token) => return (path, token),
            }
        }
    }

    /// Ends generation: flushes held-back text and returns the outcome and the tokens the
    /// target's sequence holds (`target_len` of the history).
    pub fn finish(mut self, target_len: usize) -> (Outcome, Vec<u32>) {
        let stop_reason = match self.phase {
            Phase::Done(reason) => reason,
            _ => StopReason::Cancelled,
        };
        self.out.finish(stop_reason);
        let decode_seconds = self
            .decode_started
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        let mut held = self.history;
        held.truncate(target_len);
        let outcome = Outcome {
            timings: Timings {
                prompt_tokens: self.prompt.len(),
                reused_tokens: self.reused,
                prefill_seconds: self.prefill_seconds,
                generated_tokens: self.out.tokens.len(),
                decode_seconds,
            },
            prompt_tokens: self.prompt,
            tokens: self.out.tokens,
            text: self.out.text,
            stop_reason,
            speculative: self.stats,
        };
        (outcome, held)
    }
}

/// Drops what a drafter must not hand over: more than asked, ids outside the vocabulary, and
/// a malformed distribution. With a `confidence_floor` (greedy decoding with an adaptive draft
/// length), also the tail from the first draft its drafter gives less than that chance: when
/// sampling, keeping a draft must not depend on the sampled token, or the drafts would no
/// longer follow the distribution the drafter reported and rejection sampling would lose its
/// exactness; with a fixed draft length every draft asked for is verified.
///
/// A tree is kept only where one was asked for (`tree`) and its parents are well formed; any
/// prefix of a tree in topological order is a tree, and its drafts are not trimmed by
/// confidence (its drafter shaped it). Otherwise only the chain it starts with is kept.
///
/// Returns what broke the drafter contract (docs/PLUGINS.md), if anything did, for a warning:
/// the drafts are dropped either way, but an author should not have to guess why.
fn sanitize(
    draft: &mut Draft,
    max: usize,
    vocab: usize,
    confidence_floor: Option<f32>,
    tree: bool,
) -> Option<String> {
    let mut broken = None;
    if draft.tokens.len() > max {
        broken = Some(format!(
            "proposed {} drafts where at most {max} were asked for",
            draft.tokens.len()
        ));
    }
    let mut keep = draft.tokens.len().min(max);
    if let Some(bad) = draft.tokens[..keep]
        .iter()
        .position(|&t| t as usize >= vocab)
    {
        broken = Some(format!(
            "proposed token {} at draft {bad}, outside the vocabulary of {vocab} tokens",
            draft.tokens[bad]
        ));
        keep = bad;
    }
    if !draft.probs.is_empty() && draft.probs.len() != draft.tokens.len() * vocab {
        broken = Some(format!(
            "sent {} probabilities for {} drafts (a distribution over the {vocab} tokens per draft, or none)",
            draft.probs.len(),
            draft.tokens.len()
        ));
    }
    if !draft.parents.is_empty() {
        let well_formed = draft.parents.len() == draft.tokens.len()
            && draft
                .parents
                .iter()
                .enumerate()
                .all(|(i, &p)| p == TREE_ROOT || (p as usize) < i);
        if !well_formed {
            broken = Some(
                "proposed a tree whose parents are not one per draft, each an earlier draft or the root"
                    .into(),
            );
        }
        if tree && well_formed {
            draft.parents.truncate(keep);
            draft.tokens.truncate(keep);
            if draft.probs.len() >= keep * vocab && !draft.probs.is_empty() {
                draft.probs.truncate(keep * vocab);
            } else {
                draft.probs.clear();
            }
            return broken;
        }
        let chain = draft
            .parents
            .iter()
            .enumerate()
            .take_while(|&(i, &p)| {
                if i == 0 {
                    p == TREE_ROOT
                } else {
                    p as usize == i - 1
                }
            })
            .count();
        keep = keep.min(chain);
        draft.parents.clear();
    }
    if let Some(floor) = confidence_floor.filter(|_| draft.confidence.len() >= keep) {
        if let Some(low) = draft.confidence[..keep].iter().position(|&c| c < floor) {
            keep = low;
        }
    }
    draft.tokens.truncate(keep);
    if draft.probs.len() >= keep * vocab && !draft.probs.is_empty() {
        draft.probs.truncate(keep * vocab);
    } else {
        draft.probs.clear();
    }
    broken
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(tokens: &[u32], parents: &[u32]) -> Draft {
        let mut d = Draft::default();
        d.tokens.extend_from_slice(tokens);
        d.parents.extend_from_slice(parents);
        d
    }

    const FLOOR: Option<f32> = Some(adaptive::MIN_CONFIDENCE);

    #[test]
    fn broken_drafts_are_dropped_and_said_why() {
        let mut d = draft(&[1, 2, 3], &[]);
        assert_eq!(sanitize(&mut d, 3, 10, FLOOR, false), None);
        assert_eq!(d.tokens.len(), 3);

        let mut d = draft(&[1, 2, 3, 4], &[]);
        let why = sanitize(&mut d, 2, 10, FLOOR, false).unwrap();
        assert!(why.contains("proposed 4 drafts where at most 2"), "{why}");
        assert_eq!(&d.tokens[..], &[1, 2]);

        let mut d = draft(&[1, 12, 3], &[]);
        let why = sanitize(&mut d, 3, 10, FLOOR, false).unwrap();
        assert!(
            why.contains("token 12 at draft 1, outside the vocabulary of 10"),
            "{why}"
        );
        assert_eq!(&d.tokens[..], &[1]);

        let mut d = draft(&[1, 2, 3], &[TREE_ROOT, 2, 0]);
        let why = sanitize(&mut d, 3, 10, FLOOR, true).unwrap();
        assert!(why.contains("parents are not one per draft"), "{why}");
        assert_eq!(&d.tokens[..], &[1]);

        let mut d = draft(&[1, 2], &[]);
        d.probs.extend_from_slice(&[0.1; 7]);
        let why = sanitize(&mut d, 2, 10, None, false).unwrap();
        assert!(why.contains("sent 7 probabilities for 2 drafts"), "{why}");
        assert!(d.probs.is_empty());

        // A well-formed tree where one was asked for is not a broken draft.
        let mut d = draft(&[1, 2, 3], &[TREE_ROOT, TREE_ROOT, 0]);
        assert_eq!(sanitize(&mut d, 3, 10, FLOOR, true), None);
        assert_eq!(d.parents.len(), 3);
    }

    #[test]
    fn unlikely_greedy_drafts_are_cut_only_with_an_adaptive_length() {
        let unsure = |tokens: &[u32]| {
            let mut d = draft(tokens, &[]);
            d.confidence
                .extend_from_slice(&[0.9, 0.01, 0.9][..tokens.len()]);
            d
        };
        let mut d = unsure(&[1, 2, 3]);
        assert_eq!(sanitize(&mut d, 3, 10, FLOOR, false), None);
        assert_eq!(
            &d.tokens[..],
            &[1],
            "adaptive: cut at the unlikely second draft"
        );
        let mut d = unsure(&[1, 2, 3]);
        assert_eq!(sanitize(&mut d, 3, 10, None, false), None);
        assert_eq!(
            &d.tokens[..],
            &[1, 2, 3],
            "fixed length: every draft asked for"
        );
    }
}
