//! Choosing draft tokens from a draft distribution, shared by the drafter plugins that have
//! logits (draft model, MTP head).
//!
//! For a greedy request a draft is the argmax. For a sampled request it is drawn from
//! `softmax(logits / T)` and that whole distribution is appended to [`Draft::probs`], which is
//! what the host's rejection sampling needs to stay exact. Either way the chosen token's
//! probability is reported as its confidence.
//!
//! [`TreeGrower`] grows calibrated draft trees (and, with context hints, greedy chains);
//! [`ngram`] indexes a context's n-grams for the drafts that follow earlier occurrences.

pub mod ngram;
mod tree;

pub use tree::{path_tokens, TreeGrower, BRANCHING, CONTEXT_HINTS, MIN_PATH_SCORE};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use specula_plugin_api::{Draft, DraftRequest};

/// Picks draft tokens for one [`DraftRequest`].
#[derive(Debug)]
pub struct DraftPicker {
    temperature: f32,
    rng: ChaCha20Rng,
    probs: Vec<f32>,
}

impl DraftPicker {
    pub fn new(request: &DraftRequest<'_>) -> Self {
        Self {
            temperature: request.temperature,
            rng: ChaCha20Rng::seed_from_u64(request.seed),
            probs: Vec::new(),
        }
    }

    /// Chooses the next draft from `logits` and appends it (with its confidence and, when
    /// sampling, its distribution) to `out`.
    pub fn pick(&mut self, logits: &[f32], out: &mut Draft) -> u32 {
        let sampled = self.temperature > 0.0;
        let scale = if sampled { 1.0 / self.temperature } else { 1.0 };
        softmax(logits, scale, &mut self.probs);
        let token = if sampled {
            draw(&self.probs, self.rng.gen())
        } else {
            argmax(logits)
        };
        out.tokens.push(token);
        out.confidence.push(self.probs[token as usize]);
        if sampled {
            out.probs.extend_from_slice(&self.probs);
        }
        token
    }
}

/// Lanes of [`argmax`]'s passes: one AVX-512 register (two AVX2 ones).
const LANES: usize = 16;

/// Index of the largest value (the first on ties; a NaN never wins; 0 when nothing beats
/// -inf): the greedy pick, of the host's sampler as of the drafters.
///
/// Two passes over a row that stays in cache, written so the compiler vectorises both: the
/// largest value lane by lane, then the first block of lanes holding it.
pub fn argmax(logits: &[f32]) -> u32 {
    let blocks = logits.chunks_exact(LANES);
    let tail = blocks.remainder();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for block in blocks {
        for (m, &v) in lanes.iter_mut().zip(block) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let first_block = logits
        .chunks(LANES)
        .position(|block| block.iter().fold(false, |hit, &v| hit | (v == max)))
        .unwrap_or(0);
    let within = logits[first_block * LANES..]
        .iter()
        .position(|&v| v == max)
        .unwrap_or(0);
    (first_block * LANES + within) as u32
}

/// `softmax(logits × scale)` into `out`.
pub fn softmax(logits: &[f32], scale: f32, out: &mut Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.clear();
    out.extend(logits.iter().map(|&l| ((l - max) * scale).exp()));
    let sum: f32 = out.iter().sum();
    out.iter_mut().for_each(|p| *p /= sum);
}

/// The token whose cumulative probability first exceeds `u` in `[0, 1)`.
pub fn draw(probs: &[f32], u: f32) -> u32 {
    let mut cumulative = 0.0;
    for (i, &p) in probs.iter().enumerate() {
        cumulative += p;
        if u < cumulative {
            return i as u32;
        }
    }
    probs.len().saturating_sub(1) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::std_types::RSlice;

    fn request(temperature: f32) -> DraftRequest<'static> {
        DraftRequest {
            context: RSlice::from_slice(&[]),
            max_tokens: 4,
            temperature,
            seed: 3,
            tree: false,
        }
    }

    #[test]
    fn argmax_is_the_first_largest_value_whatever_the_length() {
        // The plain loop it replaces: the first strictly larger value wins, a NaN never does.
        let reference = |x: &[f32]| {
            let mut best: Option<usize> = None;
            for (i, &v) in x.iter().enumerate() {
                if v > best.map_or(f32::NEG_INFINITY, |b| x[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        };
        for n in 0..70 {
            let base: Vec<f32> = (0..n).map(|i| ((i * 37 + 11) % 23) as f32 - 11.0).collect();
            let mut cases = vec![base.clone()];
            if n > 3 {
                let mut nan = base.clone();
                nan[0] = f32::NAN;
                nan[n / 2] = f32::NAN;
                cases.push(nan);
                let mut tie = base.clone();
                tie[n - 1] = 50.0;
                tie[n / 3] = 50.0;
                cases.push(tie);
                cases.push(vec![f32::NEG_INFINITY; n]);
                cases.push(vec![f32::NAN; n]);
            }
            for x in &cases {
                assert_eq!(argmax(x), reference(x), "{x:?}");
            }
        }
    }

    #[test]
    fn greedy_picks_the_argmax_without_a_distribution() {
        let mut out = Draft::default();
        let mut picker = DraftPicker::new(&request(0.0));
        assert_eq!(picker.pick(&[0.0, 2.0, 1.0], &mut out), 1);
        assert!(out.probs.is_empty());
        assert!(out.confidence[0] > 0.5);
    }

    #[test]
    fn sampling_reports_the_distribution_it_drew_from() {
        let mut out = Draft::default();
        let mut picker = DraftPicker::new(&request(0.7));
        let mut counts = [0u32; 3];
        for _ in 0..3000 {
            out.clear();
            counts[picker.pick(&[0.0, 1.0, 0.5], &mut out) as usize] += 1;
        }
        let p = &out.probs;
        assert_eq!(p.len(), 3);
        for (c, &p) in counts.iter().zip(p.iter()) {
            assert!((*c as f32 / 3000.0 - p).abs() < 0.03, "{counts:?} vs {p:?}");
        }
    }
}
