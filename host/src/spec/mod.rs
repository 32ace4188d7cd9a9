//! The folded k-token speculative loop — and plain decoding, which is the same loop with no
//! drafts.
//!
//! State: the target has evaluated every token of `history` except the last, the **certain**
//! token `t0`, which was already sampled. Each step:
//!
//! 1. `t0` is emitted (unless it ends generation);
//! 2. the drafter proposes `d1..dn` continuing `history`;
//! 3. one target pass evaluates `[t0, d1..dn]` with logits for every row;
//! 4. row `i` decides token `i+1`: accept `d(i+1)`, or reject it and take the target's own
//!    choice; when every draft is accepted, the last row gives one more token;
//! 5. accepted drafts are emitted (a stop condition clamps them), the target is truncated to
//!    the emitted tokens, and the decided extra token becomes the next `t0` — it rides into the
//!    next pass, so no separate commit pass is ever made.
//!
//! After generation the target holds exactly what plain decoding would leave: every emitted
//! token evaluated except the last, unless generation ended on an end-of-generation token
//! (then every emitted token is evaluated).

mod acceptance;
mod adaptive;
mod stats;

use std::time::Instant;

use abi_stable::std_types::{RSlice, RVec};
use anyhow::{bail, Context};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use specula_plugin_api::{Draft, DraftRequest, DrafterModels, ErrorKind, LogitRows};

pub use acceptance::{Judge, Verdict};
pub use adaptive::DraftLength;
pub use stats::SpecStats;

use crate::pipeline::Pipeline;
use crate::request::{Outcome, Request, StopMatcher, StopReason, Timings};
use crate::sampling::Sampler;
use crate::sequence::SeqModel;
use specula_tokenizer::StreamDecoder;

/// How much to speculate (from the profile's `[speculation]` section and CLI flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecSettings {
    pub draft_min: u32,
    pub draft_max: u32,
    pub adaptive: bool,
}

impl From<&crate::profile::SpeculationSection> for SpecSettings {
    fn from(s: &crate::profile::SpeculationSection) -> Self {
        Self {
            draft_min: s.draft_min,
            draft_max: s.draft_max,
            adaptive: s.adaptive,
        }
    }
}

/// What a stop check decided about one emitted token.
enum Emit {
    Continue,
    Stop(StopReason),
}

/// Emits tokens: streaming text, stop strings and the token limit.
struct Emitter<'a, F: FnMut(&str)> {
    stream: StreamDecoder<'a>,
    stops: StopMatcher<'a>,
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

/// Generates text for `request` with `pipeline`'s target, speculating with its drafter when
/// the request asks for it. `on_text` receives text as soon as it is certain. The target
/// starts from an empty sequence.
pub fn generate(
    pipeline: &mut Pipeline,
    request: &Request,
    on_text: impl FnMut(&str),
) -> anyhow::Result<Outcome> {
    run(pipeline, request, false, on_text)
}

/// Like [`generate`], but keeps the longest start of the prompt that the target still holds
/// from the previous generation (a conversation's earlier turns) and evaluates only the rest.
/// The output is the same: every row of a pass is bit-identical to that token evaluated
/// alone, so how the prompt is split between passes changes nothing.
pub fn generate_continuing(
    pipeline: &mut Pipeline,
    request: &Request,
    on_text: impl FnMut(&str),
) -> anyhow::Result<Outcome> {
    run(pipeline, request, true, on_text)
}

fn run(
    pipeline: &mut Pipeline,
    request: &Request,
    reuse: bool,
    on_text: impl FnMut(&str),
) -> anyhow::Result<Outcome> {
    let Pipeline {
        target,
        tokenizer,
        info,
        drafter,
        cached,
        ..
    } = pipeline;
    let vocab = info.vocab_size as usize;
    let context = info.context_size as usize;

    let mut prompt = tokenizer.encode(&request.prompt, request.add_bos, true);
    if prompt.is_empty() {
        match tokenizer.bos().or(info.bos_token.into_option()) {
            Some(bos) => prompt.push(bos),
            None => bail!("the prompt is empty and the model has no BOS token to start from"),
        }
    }
    if prompt.len() >= context {
        bail!(
            "the prompt is {} tokens, but the context holds {context}",
            prompt.len()
        );
    }

    let mut stats = SpecStats::default();
    let mut logits = RVec::new();
    let started = Instant::now();
    // What the target holds is known again only once this generation ends well.
    let previous = std::mem::take(cached);
    let mut reused = if reuse {
        // The last prompt token is always evaluated: its logits start the decoding.
        let common = prompt
            .iter()
            .zip(&previous)
            .take_while(|(a, b)| a == b)
            .count();
        common.min(prompt.len() - 1)
    } else {
        0
    };
    if reused > 0 && target.truncate(reused).into_result().is_err() {
        reused = 0; // Beyond what the backend can roll back to: start afresh.
    }
    if reused == 0 {
        target.truncate(0).into_result()?;
        if reuse {
            // What earlier sequences left in the backend's prefix cache (whole blocks).
            reused = target.reuse_prefix(&prompt).into_result()?;
        }
    }
    target
        .eval(&prompt[reused..], LogitRows::Last, &mut logits)
        .into_result()
        .context("prompt evaluation failed")?;
    stats.target_passes += 1;
    let prefill_seconds = started.elapsed().as_secs_f64();

    let capabilities = target.capabilities();
    let mut speculation = match (request.speculation, drafter.as_mut()) {
        (Some(settings), Some(slot)) if settings.draft_max > 0 => {
            let max_drafts = settings
                .draft_max
                .min(capabilities.max_verify_tokens.saturating_sub(1))
                .min(capabilities.rollback_depth.saturating_sub(1));
            let t = Instant::now();
            let models = lend(target, &mut slot.draft_model);
            slot.drafter
                .begin(RSlice::from_slice(&prompt), reused as u32, models)
                .into_result()
                .with_context(|| format!("drafter '{}' failed to start", slot.name))?;
            stats.draft_seconds += t.elapsed().as_secs_f64();
            Some((
                slot,
                DraftLength::new(settings.draft_min, max_drafts, settings.adaptive),
            ))
        }
        _ => None,
    };

    let decode_started = Instant::now();
    let mut sampler = Sampler::new(request.sampling.clone());
    let mut draft_rng = ChaCha20Rng::seed_from_u64(request.sampling.seed.unwrap_or(0) ^ 0x5eed);
    let mut judge = Judge::default();
    let mut draft = Draft::default();
    let mut batch: Vec<u32> = Vec::new();
    let mut history = prompt.clone();
    let stream = if tokenizer.decode(&prompt).is_empty() {
        StreamDecoder::from_start(tokenizer)
    } else {
        StreamDecoder::new(tokenizer)
    };
    let mut out = Emitter {
        stream,
        stops: StopMatcher::new(&request.stop),
        on_text,
        text: String::new(),
        tokens: Vec::new(),
        max_tokens: request.max_tokens as usize,
    };
    let is_end =
        |t: u32| tokenizer.is_end_of_generation(t) || info.eos_token.into_option() == Some(t);

    let t = Instant::now();
    let mut t0 = sampler.sample(&logits[logits.len() - vocab..], &history);
    stats.sample_seconds += t.elapsed().as_secs_f64();

    let stop_reason = if request.max_tokens == 0 {
        StopReason::MaxTokens
    } else {
        'generation: loop {
            if request.cancel.is_cancelled() {
                break StopReason::Cancelled;
            }
            // 1. The certain token.
            if is_end(t0) {
                break StopReason::EndOfGeneration;
            }
            history.push(t0);
            stats.steps += 1;
            stats.emitted += 1;
            if let Emit::Stop(reason) = out.emit(t0) {
                break reason;
            }
            if history.len() >= context {
                break StopReason::ContextFull;
            }
            let evaluated = history.len() - 1;
            let step_started = Instant::now();

            // 2. Drafts.
            draft.clear();
            let mut asked = false;
            if let Some((slot, length)) = speculation.as_mut() {
                let room =
                    (request.max_tokens as usize - out.tokens.len()).min(context - history.len());
                let n = (length.next_len() as usize).min(room);
                if let Some(reason) = length.pause_reason() {
                    stats.record_pause(reason);
                }
                if n > 0 {
                    asked = true;
                    let t = Instant::now();
                    let models = lend(target, &mut slot.draft_model);
                    let request = DraftRequest {
                        context: RSlice::from_slice(&history),
                        max_tokens: n as u32,
                        temperature: request.sampling.temperature,
                        seed: draft_rng.next_u64(),
                    };
                    slot.drafter
                        .propose(request, models, &mut draft)
                        .into_result()
                        .with_context(|| format!("drafter '{}' failed to propose", slot.name))?;
                    sanitize(&mut draft, n, vocab, request.temperature <= 0.0);
                    stats.draft_seconds += t.elapsed().as_secs_f64();
                }
            }
            let n_drafts = draft.tokens.len();

            // 3. One target pass over the certain token and the drafts.
            batch.clear();
            batch.push(t0);
            batch.extend_from_slice(&draft.tokens);
            let t = Instant::now();
            match target
                .eval(&batch, LogitRows::All, &mut logits)
                .into_result()
            {
                Ok(()) => {}
                Err(e) if e.kind == ErrorKind::ContextFull => break StopReason::ContextFull,
                Err(e) => return Err(e).context("decoding failed"),
            }
            stats.target_passes += 1;
            stats.verify_seconds += t.elapsed().as_secs_f64();

            // 4. Walk the rows. Row i continues `history` + the first i drafts.
            let t = Instant::now();
            let mut accepted = 0;
            let mut next = None;
            let has_probs = n_drafts > 0 && draft.probs.len() == n_drafts * vocab;
            let base = history.len();
            history.extend_from_slice(&draft.tokens);
            for (i, &d) in draft.tokens.iter().enumerate() {
                let row = &logits[i * vocab..(i + 1) * vocab];
                let q = has_probs.then(|| &draft.probs[i * vocab..(i + 1) * vocab]);
                match judge.judge(&mut sampler, row, &history[..base + i], d, q) {
                    Verdict::Accept => accepted += 1,
                    Verdict::Reject(token) => {
                        next = Some(token);
                        break;
                    }
                }
            }
            let next = match next {
                Some(token) => token,
                None => {
                    let row = &logits[n_drafts * vocab..(n_drafts + 1) * vocab];
                    sampler.sample(row, &history)
                }
            };
            history.truncate(base);
            stats.sample_seconds += t.elapsed().as_secs_f64();
            stats.record_verdicts(n_drafts, accepted);
            tracing::trace!(
                target: "specula::spec",
                step = stats.steps,
                drafted = n_drafts,
                accepted,
                next,
                "verified"
            );

            // 5. Emit accepted drafts; a stop clamps them.
            let mut stop = None;
            let mut keep = evaluated + 1 + accepted;
            for (j, &d) in draft.tokens[..accepted].iter().enumerate() {
                if is_end(d) {
                    keep = evaluated + 1 + j;
                    stop = Some((j, StopReason::EndOfGeneration));
                    break;
                }
                history.push(d);
                stats.emitted += 1;
                stats.accepted += 1;
                if let Emit::Stop(reason) = out.emit(d) {
                    // Like plain decoding, the last emitted token stays unevaluated.
                    keep = evaluated + 1 + j;
                    stop = Some((j + 1, reason));
                    break;
                }
            }
            let emitted_drafts = stop.map_or(accepted, |(n, _)| n);
            stats.clamped += (accepted - emitted_drafts) as u64;
            let len_before = target
                .seq_len()
                .into_result()
                .context("the target cannot report its length")?;
            if keep < len_before {
                target
                    .truncate(keep)
                    .into_result()
                    .context("the target could not roll back")?;
            }
            if let Some((slot, length)) = speculation.as_mut() {
                length.record(
                    asked,
                    n_drafts as u32,
                    accepted as u32,
                    1 + emitted_drafts as u32,
                    step_started.elapsed().as_secs_f64(),
                );
                // After every target pass, drafted or not: a drafter that follows the target's
                // hidden states (MTP) must see every accepted position.
                let t = Instant::now();
                slot.drafter
                    .accept(emitted_drafts as u32, lend(target, &mut slot.draft_model))
                    .into_result()
                    .with_context(|| format!("drafter '{}' failed to accept", slot.name))?;
                stats.draft_seconds += t.elapsed().as_secs_f64();
            }
            if let Some((_, reason)) = stop {
                break 'generation reason;
            }
            t0 = next;
        }
    };
    out.finish(stop_reason);
    let decode_seconds = decode_started.elapsed().as_secs_f64();
    let held = target.seq_len().into_result()?;
    *cached = history;
    cached.truncate(held);
    Ok(Outcome {
        timings: Timings {
            prompt_tokens: prompt.len(),
            reused_tokens: reused,
            prefill_seconds,
            generated_tokens: out.tokens.len(),
            decode_seconds,
        },
        prompt_tokens: prompt,
        tokens: out.tokens,
        text: out.text,
        stop_reason,
        speculative: stats,
    })
}

/// Lends the target and the draft model to a drafter for one call.
fn lend<'a>(target: &'a mut SeqModel, draft: &'a mut Option<SeqModel>) -> DrafterModels<'a> {
    DrafterModels {
        target: Some(target.lend()).into(),
        draft: draft.as_mut().map(SeqModel::lend).into(),
    }
}

/// Drops what a drafter must not hand over: more than asked, ids outside the vocabulary, and
/// a malformed distribution. With `greedy`, also low-confidence tails: when sampling, keeping a
/// draft must not depend on the sampled token, or the drafts would no longer follow the
/// distribution the drafter reported and rejection sampling would lose its exactness.
fn sanitize(draft: &mut Draft, max: usize, vocab: usize, greedy: bool) {
    let mut keep = draft.tokens.len().min(max);
    if let Some(bad) = draft.tokens[..keep]
        .iter()
        .position(|&t| t as usize >= vocab)
    {
        keep = bad;
    }
    if greedy && draft.confidence.len() >= keep {
        if let Some(low) = draft.confidence[..keep]
            .iter()
            .position(|&c| c < adaptive::MIN_CONFIDENCE)
        {
            keep = low;
        }
    }
    draft.tokens.truncate(keep);
    if draft.probs.len() >= keep * vocab && !draft.probs.is_empty() {
        draft.probs.truncate(keep * vocab);
    } else {
        draft.probs.clear();
    }
}
