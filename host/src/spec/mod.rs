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
mod draft_temperature;
mod generation;
mod stats;

use abi_stable::std_types::RVec;
use anyhow::Context;

pub use acceptance::{Judge, Verdict};
pub use adaptive::DraftLength;
pub use generation::{Generation, Lane, LaneDrafter, PromptTooLong};
pub use stats::SpecStats;

use crate::pipeline::{DrafterSlot, Pipeline};
use crate::request::{Outcome, Request};
use crate::scheduler::budget::allocate_drafts;
use crate::sequence::SeqModel;

/// How much to speculate (from the profile's `[speculation]` section and CLI flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecSettings {
    pub draft_min: u32,
    pub draft_max: u32,
    pub adaptive: bool,
    /// Ask the drafter for trees ([`crate::profile::SpeculationSection::tree`]).
    pub tree: bool,
}

impl From<&crate::profile::SpeculationSection> for SpecSettings {
    fn from(s: &crate::profile::SpeculationSection) -> Self {
        Self {
            draft_min: s.draft_min,
            draft_max: s.draft_max,
            adaptive: s.adaptive,
            tree: s.tree,
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
        cost_curve,
        ..
    } = pipeline;
    let mut generation = Generation::new(
        tokenizer,
        info,
        &target.capabilities(),
        drafter.is_some(),
        request.clone(),
        on_text,
    )?;
    let prompt = generation.prompt();
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
    // Cutting a recurrent state back further than its snapshots reach (the advertised depth,
    // and never before the length the sequence started at from the prefix cache) would
    // re-decode the kept tokens (and empty an MTP head's cache under a drafter that continues
    // from it): a new sequence from the prefix cache does better.
    let held = target.seq_len().into_result().unwrap_or(0);
    let depth = target.capabilities().rollback_depth as usize;
    if reused > held || held - reused > depth || reused < target.started_at() {
        reused = 0;
    }
    if reused > 0 && target.truncate(reused).into_result().is_err() {
        reused = 0; // Beyond what the backend can roll back to: start afresh.
    }
    if reused == 0 {
        // A new sequence: a drafter starts over, or from the prefix cache's positions.
        target.renew().into_result()?;
        if reuse {
            // What earlier sequences left in the backend's prefix cache (whole blocks).
            reused = target.reuse_prefix(prompt).into_result()?;
        }
    }
    generation.set_reused(reused);

    let mut logits = RVec::new();
    // The whole prompt in one evaluation (the backend splits it into passes).
    let (chunk, rows) = generation.prefill_chunk(usize::MAX);
    let n = chunk.len();
    target
        .eval(chunk, rows, &mut logits)
        .into_result()
        .context("prompt evaluation failed")?;
    generation.prefilled(&mut lane(target, drafter), n, &logits)?;

    while generation.begin_step() {
        let mut wanted = generation.wanted_drafts();
        if let Some(curve) = cost_curve.as_ref().filter(|_| generation.drafts_trees()) {
            // A tree's nodes while they pay for their rows.
            let floor = generation.draft_floor(wanted);
            let values = generation.draft_values(wanted);
            let granted = allocate_drafts(&[wanted], &[floor], &[values], 1, curve)[0];
            generation.granted(wanted, granted);
            wanted = granted;
        }
        generation.draft(&mut lane(target, drafter), wanted)?;
        let t = std::time::Instant::now();
        match target
            .eval_tree(generation.rows(), generation.row_parents(), &mut logits)
            .into_result()
        {
            Ok(()) => {
                let seconds = t.elapsed().as_secs_f64();
                generation.verify(&mut lane(target, drafter), &logits, seconds)?;
            }
            Err(e) => generation.pass_failed(e)?,
        }
    }
    if generation.dropped_its_drafter() {
        if let Some(slot) = drafter.as_mut() {
            slot.renew();
        }
    }
    let held = target.seq_len().into_result()?;
    let (outcome, history) = generation.finish(held);
    *cached = history;
    Ok(outcome)
}

/// The target's sequence and the drafter with its draft model, lent for one call.
fn lane<'a>(target: &'a mut SeqModel, drafter: &'a mut Option<DrafterSlot>) -> Lane<'a> {
    Lane {
        target: target.lend(),
        drafter: drafter.as_mut().map(|slot| LaneDrafter {
            name: &slot.name,
            drafter: &mut slot.drafter,
            draft_model: slot.draft_model.as_mut().map(SeqModel::lend),
        }),
    }
}
