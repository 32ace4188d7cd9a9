//! The engine loop: continuous batching with speculation, one loop per loaded model.
//!
//! One thread owns the target backend instance (every request is a sequence of it), the
//! draft model's instance, and one *lane* per concurrent sequence: a drafter instance and its
//! sequence of the draft model. Each step:
//!
//! 1. **Admit** the requests that arrived (between steps, never inside one): a new sequence,
//!    given what the backend's prefix cache holds of its prompt.
//! 2. **Decode rows.** Every decoding sequence emits its certain token, and its controller
//!    says how many drafts it wants; [`budget::allocate_drafts`] caps them against the
//!    measured cost curve and each sequence's acceptance; its drafter proposes them.
//! 3. **Prefill rows.** Sequences still reading their prompt add chunks, first come first
//!    served: at most `prefill_chunk` prompt tokens per pass while other sequences decode (so
//!    their streams keep flowing), the whole prompt when none does.
//! 4. **One pass**: every chunk of every sequence in one `eval_batch`. Each row is
//!    bit-identical to the same token evaluated alone, so every stream equals its output
//!    decoded alone.
//! 5. **Verify** each sequence's rows (exact acceptance per request: its own sampler, seed
//!    and rejection sampling), cut it back, tell its drafter. Finished or cancelled sequences
//!    are freed at once (their KV blocks go back to the pool) before their client hears the
//!    end.
//!
//! A failed pass is retried chunk by chunk, so only the sequence at fault fails (when the KV
//! pool is out of blocks, the newest request holding some gives them back instead); a panic in
//! one request's code (its sampler, its drafter, its text sink) fails that request only. A
//! target backend that panicked refuses every later call: the requests it ran fail, and the
//! loop opens the models again ([`EngineOptions::reopen`]) or, failing that, answers every
//! later request with why it cannot serve ([`Engine::failure`]).

pub mod budget;
mod drafting;

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Instant;

use abi_stable::std_types::{RSlice, RVec};
use anyhow::Context;
use specula_plugin_api::{
    BoxedDrafter, BoxedForwardPass, Capabilities, ErrorKind, EvalChunk, KvUsage, LentSequence,
    LogitRows, ModelInfo, PluginError, SeqId,
};
use specula_tokenizer::Tokenizer;

use crate::pipeline::{DrafterKit, Parts};
use crate::request::{Outcome, Request};
use crate::spec::{Generation, Lane, LaneDrafter};
use budget::{allocate_drafts, CostCurve};
use drafting::{Gather, Proxy, Which};

/// Prompt tokens a pass takes while other sequences decode, by default.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// A request for the engine and where its results go.
pub struct Job {
    pub request: Request,
    /// The prompt already tokenized by the target's tokenizer (as [`Generation::new`] would);
    /// `None`: the loop tokenizes it.
    pub prompt: Option<Vec<u32>>,
    /// Receives text as soon as it is certain.
    pub on_text: Box<dyn FnMut(&str) + Send>,
    /// Called once at the end, after the request's sequence is freed.
    pub on_done: Box<dyn FnOnce(Result<Outcome, JobError>) + Send>,
}

/// Why a job produced no outcome.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("generation failed: {0}")]
    Failed(String),
    #[error("internal error during generation: {0}")]
    Panicked(String),
    #[error("the model's engine has stopped")]
    Stopped,
    /// The engine cannot serve any more (its backend broke and could not be reopened).
    #[error("{0}")]
    Unavailable(String),
    /// The KV pool ran out of blocks and this, the newest request, gave its blocks back: a
    /// capacity problem of the moment, worth retrying.
    #[error("{0}")]
    Capacity(String),
}

/// What the loop reports, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineEvent {
    /// One `eval_batch`: how many sequences and rows shared it, of which prompt rows.
    Pass {
        sequences: usize,
        rows: usize,
        prefill_rows: usize,
        seconds: f64,
    },
    /// A new sequence took `reused` of its `prompt` tokens from the prefix cache.
    Admitted { prompt: usize, reused: usize },
    /// How full the target's KV pool is (at most every quarter second, and when the loop
    /// goes idle).
    Kv(KvUsage),
    /// One gathered drafting pass: the drafters of `sequences` sequences evaluated `rows`
    /// rows together, on the target's MTP head (`target`) or the draft model.
    DraftPass {
        target: bool,
        sequences: usize,
        rows: usize,
    },
}

/// How the loop schedules.
#[derive(Clone)]
pub struct EngineOptions {
    /// Most prompt tokens per pass while other sequences decode.
    pub prefill_chunk: usize,
    /// Receives [`EngineEvent`]s.
    pub observer: std::sync::Arc<dyn Fn(EngineEvent) + Send + Sync>,
    /// The target's pass cost by rows; measured at start when `None`.
    pub cost_curve: Option<CostCurve>,
    /// Opens the parts afresh (for as many sequences) after the target backend panicked:
    /// a panicked instance refuses every later call. Without it, the engine fails every
    /// later request with the panic's message.
    pub reopen: Option<Reopen>,
}

/// Opens an engine's [`Parts`] again.
pub type Reopen = std::sync::Arc<dyn Fn() -> anyhow::Result<Parts> + Send + Sync>;

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            observer: std::sync::Arc::new(|_| {}),
            cost_curve: None,
            reopen: None,
        }
    }
}

/// A running engine loop. Dropping it lets the loop finish the sequences it has, then stop.
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    sequences: usize,
    curve: CostCurve,
    failure: Failure,
}

/// Why an engine stopped serving, shared by the loop and its handle.
type Failure = std::sync::Arc<std::sync::Mutex<Option<String>>>;

impl Engine {
    /// Starts the loop for up to `sequences` concurrent sequences over `parts` (opened for
    /// that many). Creates a drafter per lane and measures the target's cost curve first,
    /// so that failures surface here.
    pub fn start(parts: Parts, sequences: usize, options: EngineOptions) -> anyhow::Result<Self> {
        let sequences = sequences.max(1);
        let (state, tokenizer) = Loop::open(parts, sequences, options)?;
        let curve = state.curve.clone();
        let failure = state.failure.clone();
        let (jobs, inbox) = mpsc::channel();
        std::thread::Builder::new()
            .name("specula-engine".into())
            .spawn(move || state.run(&tokenizer, inbox))
            .context("cannot start the engine thread")?;
        Ok(Self {
            jobs,
            sequences,
            curve,
            failure,
        })
    }

    /// Why the loop no longer serves (its target backend panicked and could not be
    /// reopened), if it does not.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Queues `job`; it joins the next step with a free lane. Gives the job back when the
    /// loop has stopped.
    pub fn submit(&self, job: Job) -> Result<(), Box<Job>> {
        self.jobs.send(job).map_err(|e| Box::new(e.0))
    }

    /// The most concurrent sequences.
    pub fn sequences(&self) -> usize {
        self.sequences
    }

    /// The target's measured pass cost.
    pub fn cost_curve(&self) -> &CostCurve {
        &self.curve
    }
}

/// A lane: one sequence's drafter and its sequence of the draft model.
struct LaneSlot {
    drafter: Option<BoxedDrafter>,
    draft_seq: Option<SeqId>,
}

impl LaneSlot {
    fn open(
        kit: Option<&DrafterKit>,
        draft_model: Option<&mut BoxedForwardPass>,
    ) -> anyhow::Result<Self> {
        let drafter = kit.map(DrafterKit::create).transpose()?;
        let draft_seq = match (drafter.is_some(), draft_model) {
            (true, Some(model)) => Some(
                model
                    .seq_create()
                    .into_result()
                    .context("cannot create a sequence of the draft model")?,
            ),
            _ => None,
        };
        Ok(Self { drafter, draft_seq })
    }
}

type TextSink = Box<dyn FnMut(&str) + Send>;

/// A request holding a sequence.
struct Running<'t> {
    generation: Generation<'t, TextSink>,
    on_done: Box<dyn FnOnce(Result<Outcome, JobError>) + Send>,
    seq: SeqId,
    lane: usize,
    /// Set when the request failed; it leaves at the end of the step.
    failed: Option<JobError>,
}

/// What a sequence contributes to this step's pass.
#[derive(Debug, Clone, Copy)]
enum Part {
    Decode,
    Prefill(usize),
}

struct Loop {
    target: BoxedForwardPass,
    draft_model: Option<BoxedForwardPass>,
    drafter: Option<DrafterKit>,
    capabilities: Capabilities,
    info: ModelInfo,
    lanes: Vec<LaneSlot>,
    options: EngineOptions,
    curve: CostCurve,
    /// The target panicked during this step: it refuses every later call.
    broken: Option<String>,
    /// Why the engine cannot serve any more (the target broke and could not be reopened);
    /// the handle reads it.
    failure: Failure,
    /// When the KV pool's usage was last reported.
    kv_reported: Option<Instant>,
}

/// Least time between two reports of the KV pool's usage.
const KV_REPORT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// The text of a panic payload.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}

/// Calls a job's `on_done`; a panic in it (the caller's code) is logged, never the loop's end.
fn answer(
    on_done: Box<dyn FnOnce(Result<Outcome, JobError>) + Send>,
    result: Result<Outcome, JobError>,
) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| on_done(result))) {
        tracing::error!(
            "a job's completion handler panicked: {}",
            panic_message(&*panic)
        );
    }
}

/// Runs `f`, turning an error or a panic into the request's failure.
fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> Result<T, JobError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(JobError::Failed(format!("{e:#}"))),
        Err(panic) => Err(JobError::Panicked(panic_message(&*panic))),
    }
}

impl Loop {
    /// The loop's state over `parts` (a drafter per lane, the target's cost curve), and the
    /// tokenizer.
    fn open(
        parts: Parts,
        sequences: usize,
        options: EngineOptions,
    ) -> anyhow::Result<(Self, Tokenizer)> {
        let Parts {
            mut target,
            tokenizer,
            info,
            drafter,
            mut draft_model,
            ..
        } = parts;
        let capabilities = target.capabilities();
        if (capabilities.max_sequences as usize) < sequences {
            anyhow::bail!(
                "the target backend holds at most {} sequences, {sequences} were asked for (serve.slots)",
                capabilities.max_sequences
            );
        }
        let mut lanes = Vec::with_capacity(sequences);
        for _ in 0..sequences {
            lanes.push(LaneSlot::open(drafter.as_ref(), draft_model.as_mut())?);
        }
        let curve = match options.cost_curve.clone() {
            Some(curve) => curve,
            None => CostCurve::measure(&mut target)
                .into_result()
                .context("cannot measure the target's pass cost")?,
        };
        tracing::debug!(?curve, "engine cost curve");
        let state = Self {
            target,
            draft_model,
            drafter,
            capabilities,
            info,
            lanes,
            options,
            curve,
            broken: None,
            failure: Failure::default(),
            kv_reported: None,
        };
        Ok((state, tokenizer))
    }

    /// After the target panicked: fails every running request, then opens the parts again
    /// (or, failing that, stops serving).
    fn recover_target(&mut self, running: &mut Vec<Running<'_>>, free: &mut Vec<usize>) {
        let Some(why) = self.broken.take() else {
            return;
        };
        tracing::error!("the target backend panicked ({why}); reopening it");
        for mut r in running.drain(..) {
            r.failed
                .get_or_insert_with(|| JobError::Failed(format!("the model failed: {why}")));
            free.push(self.leave(r));
        }
        let reopened = match &self.options.reopen {
            Some(reopen) => catch_unwind(AssertUnwindSafe(|| reopen()))
                .map_err(|p| anyhow::anyhow!("reopening panicked: {}", panic_message(&*p)))
                .and_then(|r| r)
                .and_then(|parts| Loop::open(parts, self.lanes.len(), self.options.clone())),
            None => Err(anyhow::anyhow!("no way to reopen it was given")),
        };
        match reopened {
            Ok((mut fresh, _tokenizer)) => {
                // The loop keeps the tokenizer it started with: the same file's.
                if fresh.info.vocab_size == self.info.vocab_size {
                    fresh.failure = self.failure.clone();
                    *self = fresh;
                } else {
                    self.fail(format!("the reopened model differs: {why}"));
                }
            }
            Err(e) => {
                tracing::error!("cannot reopen the target backend: {e:#}");
                self.fail(format!(
                    "the model's backend failed ({why}) and could not be reopened: {e:#}"
                ));
            }
        }
    }

    fn run(mut self, tokenizer: &Tokenizer, inbox: mpsc::Receiver<Job>) {
        let mut free: Vec<usize> = (0..self.lanes.len()).rev().collect();
        let mut pending: VecDeque<Job> = VecDeque::new();
        let mut running: Vec<Running<'_>> = Vec::new();
        let mut logits = RVec::new();
        loop {
            if running.is_empty() && pending.is_empty() {
                match inbox.recv() {
                    Ok(job) => pending.push_back(job),
                    Err(_) => break, // the engine was dropped and nothing runs
                }
            }
            pending.extend(inbox.try_iter());
            if let Some(why) = self.failed() {
                for job in pending.drain(..) {
                    answer(job.on_done, Err(JobError::Unavailable(why.clone())));
                }
                continue;
            }
            while !free.is_empty() && !pending.is_empty() {
                let job = pending.pop_front().expect("not empty");
                let lane = free.pop().expect("not empty");
                match self.admit(tokenizer, job, lane) {
                    Ok(r) => running.push(r),
                    Err(()) => free.push(lane),
                }
            }
            let step = catch_unwind(AssertUnwindSafe(|| self.step(&mut running, &mut logits)));
            if let Err(panic) = step {
                let message = panic_message(&*panic);
                tracing::error!("the engine step panicked: {message}; failing its requests");
                for r in &mut running {
                    r.failed.get_or_insert(JobError::Panicked(message.clone()));
                }
            }
            // Leave: finished, cancelled and failed sequences.
            let mut i = 0;
            while i < running.len() {
                if running[i].failed.is_some() || running[i].generation.is_done() {
                    let r = running.remove(i); // keeps arrival order for prefill
                    free.push(self.leave(r));
                } else {
                    i += 1;
                }
            }
            self.recover_target(&mut running, &mut free);
            let due = self
                .kv_reported
                .is_none_or(|t| t.elapsed() >= KV_REPORT_INTERVAL);
            if due || running.is_empty() {
                self.kv_reported = Some(Instant::now());
                (self.options.observer)(EngineEvent::Kv(self.target.kv_usage()));
            }
        }
        // Jobs that arrived after the engine was dropped.
        for job in pending.drain(..).chain(inbox.try_iter()) {
            answer(job.on_done, Err(JobError::Stopped));
        }
    }

    /// Starts `job` on `lane`: its sequence, its prefix from the cache. On failure the job
    /// is answered and `Err` returned.
    fn admit<'t>(
        &mut self,
        tokenizer: &'t Tokenizer,
        job: Job,
        lane: usize,
    ) -> Result<Running<'t>, ()> {
        let Job {
            request,
            prompt,
            on_text,
            on_done,
        } = job;
        let has_drafter = self.lanes[lane].drafter.is_some();
        let generation = guarded(|| {
            let prompt = match prompt {
                Some(tokens) => tokens,
                None => tokenizer.encode(&request.prompt, request.add_bos, true),
            };
            Ok(Generation::with_prompt(
                tokenizer,
                &self.info,
                &self.capabilities,
                has_drafter,
                request,
                prompt,
                on_text,
            )?
            .untimed())
        });
        let mut generation = match generation {
            Ok(g) => g,
            Err(e) => {
                answer(on_done, Err(e));
                return Err(());
            }
        };
        let seq = match self.target.seq_create().into_result() {
            Ok(seq) => seq,
            Err(e) => {
                self.note_target_error(&e);
                answer(
                    on_done,
                    Err(JobError::Failed(format!("cannot create a sequence: {e}"))),
                );
                return Err(());
            }
        };
        let prompt = RSlice::from_slice(generation.prompt());
        match self.target.seq_reuse_prefix(seq, prompt).into_result() {
            Ok(reused) => generation.set_reused(reused),
            Err(e) => {
                self.note_target_error(&e);
                let _ = self.target.seq_free(seq);
                answer(
                    on_done,
                    Err(JobError::Failed(format!("the prefix cache failed: {e}"))),
                );
                return Err(());
            }
        }
        (self.options.observer)(EngineEvent::Admitted {
            prompt: generation.prompt().len(),
            reused: generation.reused(),
        });
        Ok(Running {
            generation,
            on_done,
            seq,
            lane,
            failed: None,
        })
    }

    /// Stops serving for `why`.
    fn fail(&mut self, why: String) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    fn failed(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Remembers that the target panicked (it refuses every later call).
    fn note_target_error(&mut self, e: &PluginError) {
        if e.kind == ErrorKind::Panic && self.broken.is_none() {
            self.broken = Some(e.message.to_string());
        }
    }

    /// Frees `r`'s sequence, answers its job, and returns its lane.
    fn leave(&mut self, r: Running<'_>) -> usize {
        let Running {
            generation,
            on_done,
            seq,
            lane,
            failed,
            ..
        } = r;
        // A target that panicked refuses these too: that is how a failure inside a request's
        // own calls (its truncation, its drafter's) is noticed.
        let held = match self.target.seq_len(seq).into_result() {
            Ok(n) => n,
            Err(e) => {
                self.note_target_error(&e);
                0
            }
        };
        if let Err(e) = self.target.seq_free(seq).into_result() {
            self.note_target_error(&e);
            tracing::warn!("cannot free a finished sequence: {e}");
        }
        let result = match failed {
            Some(e) => {
                // The drafter may have failed (a fenced panic refuses every later call) or
                // been left mid-call: the lane gets a fresh one.
                self.renew_lane(lane);
                drop(generation);
                Err(e)
            }
            None if generation.dropped_its_drafter() => {
                // Its drafter failed and the request went on plainly: the next request on
                // this lane gets a fresh drafter.
                self.renew_lane(lane);
                match catch_unwind(AssertUnwindSafe(|| generation.finish(held))) {
                    Ok((outcome, _)) => Ok(outcome),
                    Err(panic) => Err(JobError::Panicked(panic_message(&*panic))),
                }
            }
            None => match catch_unwind(AssertUnwindSafe(|| generation.finish(held))) {
                Ok((outcome, _)) => Ok(outcome),
                Err(panic) => Err(JobError::Panicked(panic_message(&*panic))),
            },
        };
        answer(on_done, result);
        lane
    }

    /// After a failed request the lane's drafter may be broken or mid-call: a fresh one, its
    /// draft-model sequence emptied.
    fn renew_lane(&mut self, lane: usize) {
        let slot = &mut self.lanes[lane];
        if let (Some(model), Some(seq)) = (self.draft_model.as_mut(), slot.draft_seq) {
            let _ = model.truncate(seq, 0);
        }
        if let Some(kit) = &self.drafter {
            slot.drafter = match kit.create() {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::error!(
                        "cannot renew a drafter after a panic; the lane decodes plainly: {e:#}"
                    );
                    None
                }
            };
        }
    }

    /// One step over every running sequence (see the module docs).
    fn step(&mut self, running: &mut [Running<'_>], logits: &mut RVec<f32>) {
        // Decode rows: the certain tokens, then what each sequence wants to draft.
        let mut decoding = Vec::new();
        let mut wanted = Vec::new();
        let mut floor = Vec::new();
        let mut values = Vec::new();
        for (i, r) in running.iter_mut().enumerate() {
            if r.failed.is_some() || r.generation.end_if_cancelled() {
                continue;
            }
            if r.generation.is_prefilling() {
                continue;
            }
            match guarded(|| Ok(r.generation.begin_step())) {
                Ok(true) => {
                    decoding.push(i);
                    let want = r.generation.wanted_drafts();
                    wanted.push(want);
                    floor.push(r.generation.draft_floor(want));
                    values.push(r.generation.draft_values(want));
                }
                Ok(false) => {}
                Err(e) => r.failed = Some(e),
            }
        }
        // Prefill rows, first come first served.
        let mut budget = if decoding.is_empty() {
            usize::MAX
        } else {
            self.options.prefill_chunk.max(1)
        };
        let mut parts: Vec<(usize, Part)> = decoding.iter().map(|&i| (i, Part::Decode)).collect();
        let mut prefill_rows = 0;
        for (i, r) in running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if r.failed.is_none() && r.generation.is_prefilling() {
                let n = r.generation.prefill_remaining().min(budget);
                budget -= n;
                prefill_rows += n;
                parts.push((i, Part::Prefill(n)));
            }
        }
        // Drafts, within the step's row budget.
        let drafts = allocate_drafts(
            &wanted,
            &floor,
            &values,
            decoding.len() + prefill_rows,
            &self.curve,
        );
        for ((&i, &n), &want) in decoding.iter().zip(&drafts).zip(&wanted) {
            running[i].generation.granted(want, n);
        }
        let plan: Vec<(usize, usize)> = decoding
            .iter()
            .zip(&drafts)
            .filter(|&(_, &n)| n > 0)
            .map(|(&i, &n)| (i, n))
            .collect();
        let models_draft = self.draft_model.is_some() || self.capabilities.mtp_head;
        if plan.len() >= 2 && models_draft && self.drafter.is_some() {
            self.draft_together(running, &plan);
        } else {
            for &(i, n) in &plan {
                let r = &mut running[i];
                let mut lane = self.lane(r.lane, r.seq);
                if let Err(e) = guarded(|| r.generation.draft(&mut lane, n)) {
                    r.failed = Some(e);
                }
            }
        }
        parts.retain(|&(i, _)| running[i].failed.is_none());
        if parts.is_empty() {
            return;
        }

        // One pass.
        let chunks: Vec<EvalChunk<'_>> = parts
            .iter()
            .map(|&(i, part)| chunk(&running[i], part))
            .collect();
        let rows: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        let t = Instant::now();
        let result = self
            .target
            .eval_batch(RSlice::from_slice(&chunks), logits)
            .into_result();
        let seconds = t.elapsed().as_secs_f64();
        drop(chunks);
        match result {
            Ok(()) => {
                tracing::debug!(
                    sequences = parts.len(),
                    rows,
                    prefill_rows,
                    ms = seconds * 1e3,
                    "pass"
                );
                (self.options.observer)(EngineEvent::Pass {
                    sequences: parts.len(),
                    rows,
                    prefill_rows,
                    seconds,
                });
                let mut offset = 0;
                for &(i, part) in &parts {
                    let r = &mut running[i];
                    let c = chunk(r, part);
                    let n = c.rows.count(c.tokens.len()) * self.info.vocab_size as usize;
                    let own = &logits[offset..offset + n];
                    offset += n;
                    self.consume(r, part, Ok(own), seconds);
                }
            }
            Err(e) => {
                // Only the sequence at fault fails: every chunk again, alone.
                tracing::debug!("a batched pass failed ({e}); retrying its chunks one by one");
                self.note_target_error(&e);
                for &(i, part) in &parts {
                    loop {
                        if running[i].failed.is_some() {
                            break; // Gave its blocks to an older request below.
                        }
                        let t = Instant::now();
                        let alone = self
                            .target
                            .eval_batch(RSlice::from_slice(&[chunk(&running[i], part)]), logits)
                            .into_result();
                        let seconds = t.elapsed().as_secs_f64();
                        let e = match alone {
                            Ok(()) => {
                                self.consume(&mut running[i], part, Ok(logits), seconds);
                                break;
                            }
                            Err(e) => e,
                        };
                        if self.pool_is_out(&e, &running[i]) {
                            // The KV pool has no block left: the newest request gives its
                            // blocks back (it fails, saying why) and this one tries again;
                            // when this is the newest, it fails itself.
                            let newer = (i + 1..running.len()).rev().find(|&j| {
                                let r = &running[j];
                                r.failed.is_none()
                                    && !r.generation.is_done()
                                    && self.target.seq_len(r.seq).into_result().unwrap_or(0) > 0
                            });
                            if let Some(j) = newer {
                                if self.give_way(&mut running[j], &e) {
                                    continue;
                                }
                            }
                        } else {
                            self.note_target_error(&e);
                        }
                        self.consume(&mut running[i], part, Err(e), seconds);
                        break;
                    }
                }
            }
        }
    }

    /// Drafts for every sequence of `plan` (running index, drafts) at once: each proposes on
    /// its own scoped thread, and their model evaluations are gathered into one pass per
    /// instance ([`drafting`]).
    fn draft_together(&mut self, running: &mut [Running<'_>], plan: &[(usize, usize)]) {
        let name = self.drafter.as_ref().map_or("", |k| k.name.as_str());
        let gather = Gather::new(&mut self.target, self.draft_model.as_mut(), plan.len());
        let mut lanes: Vec<Option<&mut LaneSlot>> = self.lanes.iter_mut().map(Some).collect();
        let mut requests: Vec<Option<&mut Running<'_>>> = running.iter_mut().map(Some).collect();
        std::thread::scope(|scope| {
            /// Closes the gathering when this scope unwinds (a spawn failed, a pass panicked),
            /// so that no drafting thread waits for ever and the scope can be left.
            struct CloseOnUnwind<'g, 'm>(&'g Gather<'m>);
            impl Drop for CloseOnUnwind<'_, '_> {
                fn drop(&mut self) {
                    if std::thread::panicking() {
                        self.0.close();
                    }
                }
            }
            let _close = CloseOnUnwind(&gather);
            for &(i, n) in plan {
                let (Some(r), gather) = (requests[i].take(), &gather) else {
                    gather.finished();
                    continue;
                };
                let Some(slot) = lanes[r.lane].take() else {
                    gather.finished();
                    continue;
                };
                scope.spawn(move || {
                    /// Counts the thread out however it ends.
                    struct Finished<'g, 'm>(&'g Gather<'m>);
                    impl Drop for Finished<'_, '_> {
                        fn drop(&mut self) {
                            self.0.finished();
                        }
                    }
                    let _finished = Finished(gather);
                    let mut target = Proxy::new(gather, Which::Target);
                    let mut draft = Proxy::new(gather, Which::Draft);
                    let draft_seq = slot.draft_seq;
                    let mut lane = Lane {
                        target: LentSequence {
                            model: target.lend(),
                            seq: r.seq,
                        },
                        drafter: slot.drafter.as_mut().map(|drafter| LaneDrafter {
                            name,
                            drafter,
                            draft_model: draft_seq.map(|seq| LentSequence {
                                model: draft.lend(),
                                seq,
                            }),
                        }),
                    };
                    if let Err(e) = guarded(|| r.generation.draft(&mut lane, n)) {
                        r.failed = Some(e);
                    }
                });
            }
            gather.serve();
        });
        let passes = std::mem::take(&mut *gather.passes.lock().unwrap_or_else(|e| e.into_inner()));
        for (which, sequences, rows) in passes {
            (self.options.observer)(EngineEvent::DraftPass {
                target: which == Which::Target,
                sequences,
                rows,
            });
        }
    }

    /// Hands `r` its share of the pass.
    fn consume(
        &mut self,
        r: &mut Running<'_>,
        part: Part,
        logits: Result<&[f32], PluginError>,
        seconds: f64,
    ) {
        let mut lane = self.lane(r.lane, r.seq);
        let generation = &mut r.generation;
        let result = guarded(|| match (part, logits) {
            (Part::Decode, Ok(logits)) => generation.verify(&mut lane, logits, seconds),
            (Part::Prefill(n), Ok(logits)) => generation.prefilled(&mut lane, n, logits),
            (_, Err(e)) => generation.pass_failed(e),
        });
        if let Err(e) = result {
            r.failed = Some(e);
        }
    }

    /// Whether `e`, from a pass of `r`'s rows alone, says the target's KV pool is out of
    /// blocks (rather than that `r` outgrew its own context).
    fn pool_is_out(&self, e: &PluginError, r: &Running<'_>) -> bool {
        e.kind == ErrorKind::ContextFull && !r.generation.outgrows_its_context()
    }

    /// Fails `r` because the KV pool ran out (`e` says so) and frees its blocks at once, so
    /// that older requests can go on; whether its blocks were freed.
    fn give_way(&mut self, r: &mut Running<'_>, e: &PluginError) -> bool {
        tracing::warn!(
            "the KV pool is full: the newest request gives its blocks back and fails ({})",
            e.message
        );
        r.failed = Some(JobError::Capacity(format!(
            "{}; the newest requests gave way to older ones (retry, raise kv_tokens, or lower [serve] slots)",
            e.message
        )));
        match self.target.truncate(r.seq, 0).into_result() {
            Ok(()) => true,
            Err(e) => {
                self.note_target_error(&e);
                false
            }
        }
    }

    /// Lane `lane` lent for one call, with the request's sequence `seq`.
    fn lane(&mut self, lane: usize, seq: SeqId) -> Lane<'_> {
        let slot = &mut self.lanes[lane];
        let name = self.drafter.as_ref().map_or("", |k| k.name.as_str());
        let draft_model = match (self.draft_model.as_mut(), slot.draft_seq) {
            (Some(model), Some(seq)) => Some(LentSequence {
                model: model.sabi_reborrow_mut(),
                seq,
            }),
            _ => None,
        };
        Lane {
            target: LentSequence {
                model: self.target.sabi_reborrow_mut(),
                seq,
            },
            drafter: slot.drafter.as_mut().map(|drafter| LaneDrafter {
                name,
                drafter,
                draft_model,
            }),
        }
    }
}

/// `r`'s chunk of the pass.
fn chunk<'a>(r: &'a Running<'_>, part: Part) -> EvalChunk<'a> {
    match part {
        Part::Decode => EvalChunk::tree(
            r.seq,
            r.generation.rows(),
            r.generation.row_parents(),
            LogitRows::All,
        ),
        Part::Prefill(n) => {
            let (tokens, rows) = r.generation.prefill_chunk(n);
            EvalChunk::chain(r.seq, tokens, rows)
        }
    }
}
