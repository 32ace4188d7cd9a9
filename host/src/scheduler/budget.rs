//! How many rows a step's pass verifies: the target's measured cost curve against each
//! sequence's expected accepted drafts.
//!
//! A pass of `R` rows costs `cost(R)` seconds, measured once when the engine starts. A
//! sequence whose chain drafts are accepted at rate `p` expects `p^j` more tokens from its
//! `j`-th draft (all drafts before it must be accepted too); a tree's `j`-th node adds the
//! chance that its path is accepted, as its drafter estimated for the last trees. A step
//! yields one certain token per
//! decoding sequence plus the expected accepted drafts; the budget adds drafts, most valuable
//! first, while each raises the step's expected tokens per second. So a sequence whose drafts
//! are rarely accepted stops drafting, and with many sequences in the pass — rows dearer
//! relative to what one more draft buys — drafts shrink.

use std::time::Instant;

use abi_stable::std_types::{RSlice, RVec};
use specula_plugin_api::{BoxedForwardPass, EvalChunk, LogitRows, PluginResult};

/// Seconds a pass costs by its row count (piecewise linear between measured points).
#[derive(Debug, Clone, PartialEq)]
pub struct CostCurve {
    /// (rows, seconds), rows increasing, at least two points.
    points: Vec<(usize, f64)>,
}

/// Steps a sequence may want drafts and get none before it is granted one anyway: the
/// budget judges a sequence by what its drafts were worth, which only drafts can update.
pub const PROBE_AFTER_STARVED_STEPS: u32 = 16;

/// Row counts the engine measures at start.
const MEASURED_ROWS: [usize; 6] = [1, 2, 4, 8, 12, 16];
/// Tokens of context the measurement decodes after, over all its scratch sequences together
/// (at least 4 each): a short context.
const MEASURE_CONTEXT: usize = 32;

impl CostCurve {
    /// A curve through `points` (rows, seconds); rows must increase, with at least two. A
    /// point below an earlier one (timing noise) is raised to it: more rows never cost less.
    pub fn from_points(mut points: Vec<(usize, f64)>) -> Self {
        assert!(points.len() >= 2, "a cost curve needs two points");
        assert!(points.windows(2).all(|w| w[0].0 < w[1].0), "rows increase");
        for i in 1..points.len() {
            points[i].1 = points[i].1.max(points[i - 1].1);
        }
        Self { points }
    }

    /// Measures the target: passes of 1 to 16 rows after a short context, the fastest of
    /// three tries each. A pass's rows are as many verify rows of one scratch sequence as the
    /// target verifies, spread over more scratch sequences beyond that (a plain target, which
    /// verifies one token per pass, is measured as one row from each of several sequences —
    /// the passes continuous batching runs); the scratch sequences are freed again.
    pub fn measure(target: &mut BoxedForwardPass) -> PluginResult<Self> {
        let info = target.model_info();
        let capabilities = target.capabilities();
        let vocab = info.vocab_size.max(1);
        let context = (info.context_size as usize).max(2);
        let tokens: Vec<u32> = (0..context as u32)
            .map(|i| (i.wrapping_mul(7919) + 1) % vocab)
            .collect();
        let most_rows = *MEASURED_ROWS.last().expect("rows to measure");
        let per_seq = (capabilities.max_verify_tokens as usize)
            .min(context - MEASURE_CONTEXT.min(context / 2) - 1)
            .max(1);
        let wanted_seqs = most_rows
            .div_ceil(per_seq)
            .min(capabilities.max_sequences.max(1) as usize);
        // The scratch contexts together stay at MEASURE_CONTEXT tokens (at least a few each),
        // read in one pass: a big model's load does not wait on many prefills.
        let before = (MEASURE_CONTEXT / wanted_seqs)
            .clamp(4, MEASURE_CONTEXT)
            .min(context / 2);
        let mut seqs = Vec::new();
        let result = (|| {
            let mut logits = RVec::new();
            for _ in 0..wanted_seqs {
                match target.seq_create().into_result() {
                    Ok(seq) => seqs.push(seq),
                    // A pool too small for more scratch sequences measures fewer rows.
                    Err(_) if !seqs.is_empty() => break,
                    Err(e) => return Err(e),
                }
            }
            let contexts: Vec<EvalChunk<'_>> = seqs
                .iter()
                .map(|&seq| EvalChunk::chain(seq, &tokens[..before], LogitRows::None))
                .collect();
            target
                .eval_batch(RSlice::from_slice(&contexts), &mut logits)
                .into_result()?;
            let max_rows = per_seq * seqs.len();
            let mut points = Vec::new();
            for rows in MEASURED_ROWS.into_iter().filter(|&r| r <= max_rows) {
                let chunks: Vec<EvalChunk<'_>> = seqs
                    .iter()
                    .zip((0..rows).step_by(per_seq))
                    .map(|(&seq, first)| {
                        let n = per_seq.min(rows - first);
                        EvalChunk::chain(seq, &tokens[before..before + n], LogitRows::All)
                    })
                    .collect();
                let mut best = f64::INFINITY;
                for _ in 0..3 {
                    let t = Instant::now();
                    target
                        .eval_batch(RSlice::from_slice(&chunks), &mut logits)
                        .into_result()?;
                    best = best.min(t.elapsed().as_secs_f64());
                    for chunk in &chunks {
                        target.truncate(chunk.seq, before).into_result()?;
                    }
                }
                points.push((rows, best.max(1e-9)));
            }
            if points.len() < 2 {
                // One row per pass at most: rows cost what they cost alone.
                let one = points.first().map_or(1e-3, |p| p.1);
                points = vec![(1, one), (2, 2.0 * one)];
            }
            Ok(Self::from_points(points))
        })();
        let mut freed = Ok(());
        for seq in seqs {
            freed = freed.and(target.seq_free(seq).into_result());
        }
        match (result, freed) {
            (Ok(curve), Ok(())) => PluginResult::ROk(curve),
            (Err(e), _) | (Ok(_), Err(e)) => PluginResult::RErr(e),
        }
    }

    /// Seconds of a pass of `rows` rows (linear beyond the measured points).
    pub fn seconds(&self, rows: usize) -> f64 {
        let rows = rows.max(1);
        let p = &self.points;
        let i = p.partition_point(|&(r, _)| r < rows);
        let (a, b) = match i {
            0 => (p[0], p[1]),
            i if i >= p.len() => (p[p.len() - 2], p[p.len() - 1]),
            i => (p[i - 1], p[i]),
        };
        let slope = (b.1 - a.1) / (b.0 - a.0) as f64;
        (a.1 + slope * (rows as f64 - a.0 as f64)).max(1e-9)
    }

    /// `cost(rows) / cost(1)`, as the bench reports it.
    pub fn relative(&self, rows: usize) -> f64 {
        self.seconds(rows) / self.seconds(1)
    }
}

/// What each successive draft of a chain adds to a step's expected tokens when drafts are
/// accepted at rate `acceptance`: the `j`-th is emitted only if all before it are, `p^j`.
pub fn chain_values(acceptance: f64, drafts: usize) -> Vec<f64> {
    let p = acceptance.clamp(0.0, 1.0);
    (1..=drafts).map(|j| p.powi(j as i32)).collect()
}

/// How many of its `wanted` drafts each decoding sequence verifies this step: at least its
/// `floor` (drafts its settings fix), then more while they pay. `values[s][j]` is what the
/// `j + 1`-th draft of sequence `s` adds to the step's expected tokens ([`chain_values`] for
/// a chain; a tree's drafter estimates each node's); a missing value counts as 0.
/// `fixed_rows` are the pass's rows that come regardless (one certain token per decoding
/// sequence, the prefill chunks).
pub fn allocate_drafts(
    wanted: &[usize],
    floor: &[usize],
    values: &[Vec<f64>],
    fixed_rows: usize,
    curve: &CostCurve,
) -> Vec<usize> {
    let value = |s: usize, j: usize| values[s].get(j).copied().unwrap_or(0.0).max(0.0);
    let mut drafts: Vec<usize> = floor.iter().zip(wanted).map(|(&f, &w)| f.min(w)).collect();
    // Expected tokens of the step: the certain ones, then the drafts granted so far.
    let mut expected = wanted.len() as f64
        + (0..wanted.len())
            .map(|s| (0..drafts[s]).map(|j| value(s, j)).sum::<f64>())
            .sum::<f64>();
    let mut rows = fixed_rows.max(1) + drafts.iter().sum::<usize>();
    loop {
        let best = (0..wanted.len())
            .filter(|&s| drafts[s] < wanted[s])
            .map(|s| (s, value(s, drafts[s])))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((s, value)) = best else { break };
        let now = expected / curve.seconds(rows);
        let with = (expected + value) / curve.seconds(rows + 1);
        if with <= now {
            break;
        }
        drafts[s] += 1;
        expected += value;
        rows += 1;
    }
    drafts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chains(acceptance: &[f64], drafts: usize) -> Vec<Vec<f64>> {
        acceptance
            .iter()
            .map(|&p| chain_values(p, drafts))
            .collect()
    }

    /// A CPU-like curve: 8 rows for 1.5× one row, then dearer.
    fn cpu() -> CostCurve {
        CostCurve::from_points(vec![(1, 1.0), (4, 1.2), (8, 1.5), (16, 2.4)])
    }

    #[test]
    fn the_curve_interpolates_and_extrapolates() {
        let c = cpu();
        assert_eq!(c.seconds(1), 1.0);
        assert!((c.seconds(6) - 1.35).abs() < 1e-12);
        assert!((c.seconds(24) - 3.3).abs() < 1e-12);
        assert!((c.seconds(0) - 1.0).abs() < 1e-12);
        assert!((c.relative(8) - 1.5).abs() < 1e-12);
    }

    #[test]
    fn a_noisy_curve_never_falls() {
        let c = CostCurve::from_points(vec![(1, 1.0), (8, 1.5), (12, 1.8), (16, 1.6)]);
        assert!((c.seconds(16) - 1.8).abs() < 1e-12);
        assert!(c.seconds(64) >= 1.8);
    }

    #[test]
    fn one_sequence_with_good_drafts_verifies_them_all() {
        assert_eq!(
            allocate_drafts(&[4], &[0], &chains(&[0.8], 4), 1, &cpu()),
            vec![4]
        );
    }

    #[test]
    fn drafts_that_are_never_accepted_are_not_verified() {
        assert_eq!(
            allocate_drafts(&[4, 4], &[0, 0], &chains(&[0.0, 0.9], 4), 2, &cpu()),
            vec![0, 4]
        );
    }

    #[test]
    fn with_many_sequences_drafts_shrink() {
        let alone = allocate_drafts(&[8], &[0], &chains(&[0.6], 8), 1, &cpu())[0];
        let crowded = allocate_drafts(&[8; 8], &[0; 8], &chains(&[0.6; 8], 8), 8, &cpu());
        assert!(alone >= 3, "{alone}");
        assert!(crowded.iter().all(|&k| k < alone), "{crowded:?} vs {alone}");
        // The best drafts go first: equal sequences get equal shares, within one.
        let (lo, hi) = (crowded.iter().min().unwrap(), crowded.iter().max().unwrap());
        assert!(hi - lo <= 1, "{crowded:?}");
    }

    #[test]
    fn drafts_a_profile_fixes_are_verified_whatever_they_cost() {
        let steep = CostCurve::from_points(vec![(1, 1.0), (2, 2.0)]);
        assert_eq!(
            allocate_drafts(&[4, 4], &[0, 0], &chains(&[0.5, 0.5], 4), 2, &steep),
            vec![0, 0]
        );
        assert_eq!(
            allocate_drafts(&[4, 4], &[4, 1], &chains(&[0.5, 0.5], 4), 2, &steep),
            vec![4, 1]
        );
    }

    #[test]
    fn on_a_flat_curve_every_wanted_draft_is_verified() {
        let flat = CostCurve::from_points(vec![(1, 1.0), (64, 1.0001)]);
        assert_eq!(
            allocate_drafts(&[3, 5, 0], &[0; 3], &chains(&[0.3, 0.5, 0.9], 5), 3, &flat),
            vec![3, 5, 0]
        );
    }

    #[test]
    fn a_tree_gets_the_rows_its_nodes_are_worth() {
        // A chain accepted at 0.5 and a tree whose nodes its drafter values higher than the
        // chain's: the tree's later nodes still pay where the chain's do not.
        let chain = chain_values(0.5, 7);
        let tree = vec![0.8, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25];
        let granted = allocate_drafts(&[7, 7], &[0, 0], &[chain, tree], 2, &cpu());
        assert!(granted[1] > granted[0], "{granted:?}");
        // Values missing past the last tree's size count as nothing.
        assert_eq!(
            allocate_drafts(&[7], &[0], &[vec![0.9, 0.9]], 1, &cpu()),
            vec![2]
        );
    }
}
