//! Choosing the next token from logits: greedy, or temperature sampling with top-k, top-p,
//! min-p and a repetition penalty, from a seeded generator (same seed, same output).
//!
//! The transforms run in llama.cpp's default order: repetition penalty, top-k, top-p, min-p,
//! temperature, then a draw. [`Sampler::distribution`] exposes the final distribution so that
//! speculative decoding can do exact rejection sampling against it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// Sampling settings (see `[sampling]` in profiles).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: u32,
    /// 1 = disabled.
    pub top_p: f32,
    /// 0 = disabled.
    pub min_p: f32,
    /// 1 = disabled.
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    /// `None` = seeded from the OS.
    pub seed: Option<u64>,
}

impl SamplingParams {
    /// Plain greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: Some(0),
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

impl From<&crate::profile::SamplingSection> for SamplingParams {
    fn from(s: &crate::profile::SamplingSection) -> Self {
        Self {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            repeat_last_n: s.repeat_last_n,
            seed: s.seed,
        }
    }
}

/// A token with its probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub p: f32,
}

/// Picks tokens from logits.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    scratch: Vec<Candidate>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            params,
            rng: ChaCha20Rng::seed_from_u64(seed),
            scratch: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token. `history` is the sequence so far (for the repetition penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.params.is_greedy() && self.params.repeat_penalty == 1.0 {
            return argmax(logits);
        }
        let mut candidates = std::mem::take(&mut self.scratch);
        self.distribution(logits, history, &mut candidates);
        let id = self.draw(&candidates);
        self.scratch = candidates;
        id
    }

    /// The distribution the next token is drawn from, after every transform, as candidates
    /// sorted by descending probability (summing to 1). Greedy gives one candidate with p = 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32], out: &mut Vec<Candidate>) {
        let p = &self.params;
        out.clear();
        out.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| Candidate { id: i as u32, p: l }),
        );
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = history.len().saturating_sub(p.repeat_last_n as usize);
            let mut penalised = history[start..].to_vec();
            penalised.sort_unstable();
            penalised.dedup();
            for id in penalised {
                if let Some(c) = out.get_mut(id as usize) {
                    c.p = if c.p > 0.0 {
                        c.p / p.repeat_penalty
                    } else {
                        c.p * p.repeat_penalty
                    };
                }
            }
        }
        // A total order: higher logit first, lower id first on ties. Only the candidates that
        // greedy or top-k keep are sorted (selected first in linear time, not a sort of the
        // whole vocabulary): the same list a full sort would start with.
        let order = |a: &Candidate, b: &Candidate| b.p.total_cmp(&a.p).then(a.id.cmp(&b.id));
        let keep = match (p.is_greedy(), p.top_k) {
            (true, _) => 1,
            (false, 0) => out.len(),
            (false, k) => k as usize,
        };
        if keep < out.len() {
            out.select_nth_unstable_by(keep - 1, order);
            out.truncate(keep);
        }
        out.sort_by(order);
        if p.is_greedy() {
            out[0].p = 1.0;
            return;
        }
        softmax_in_place(out, 1.0);
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut keep = out.len();
            for (i, c) in out.iter().enumerate() {
                cumulative += c.p;
                if cumulative >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            out.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let threshold = out[0].p * p.min_p;
            let keep = out.iter().take_while(|c| c.p >= threshold).count();
            out.truncate(keep.max(1));
        }
        // Temperature on the surviving candidates: p^(1/T), renormalised.
        let inv_t = 1.0 / p.temperature;
        for c in out.iter_mut() {
            c.p = c.p.ln() * inv_t;
        }
        softmax_in_place(out, 1.0);
    }

    /// Draws one token from a distribution produced by [`distribution`](Self::distribution).
    pub fn draw(&mut self, candidates: &[Candidate]) -> u32 {
        let r: f32 = self.rng.gen();
        let mut cumulative = 0.0;
        for c in candidates {
            cumulative += c.p;
            if r < cumulative {
                return c.id;
            }
        }
        candidates.last().map(|c| c.id).unwrap_or(0)
    }

    /// A uniform number in [0, 1) from this sampler's generator (for rejection sampling).
    pub fn uniform(&mut self) -> f32 {
        self.rng.gen()
    }
}

/// Index of the largest logit (the first one on ties): the greedy pick, the same function
/// the drafters pick greedy drafts with.
pub use specula_drafting::argmax;

/// Turns the `p` fields (holding logits) into probabilities.
fn softmax_in_place(candidates: &mut [Candidate], scale: f32) {
    let max = candidates
        .iter()
        .map(|c| c.p)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for c in candidates.iter_mut() {
        c.p = ((c.p - max) * scale).exp();
        sum += f64::from(c.p);
    }
    for c in candidates.iter_mut() {
        c.p = (f64::from(c.p) / sum) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: Some(7),
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0], &[]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
        let run = || {
            let mut s = Sampler::new(params(1.0));
            (0..100).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        let mut other = params(1.0);
        other.seed = Some(8);
        let mut s = Sampler::new(other);
        let b: Vec<_> = (0..100).map(|_| s.sample(&logits, &[])).collect();
        assert_ne!(run(), b);
    }

    #[test]
    fn top_k_keeps_k_best() {
        let s = Sampler::new(SamplingParams {
            top_k: 2,
            ..params(1.0)
        });
        let mut out = Vec::new();
        s.distribution(&[1.0, 5.0, 3.0, 4.0], &[], &mut out);
        let ids: Vec<_> = out.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![1, 3]);
        assert!((out.iter().map(|c| c.p).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    /// Top-k selects before it sorts; the kept list must be the head of the fully sorted
    /// vocabulary (higher logit first, lower id first on ties), ties across the cut included.
    #[test]
    fn top_k_keeps_the_head_of_the_full_order() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 7919) % 23) as f32 * 0.5).collect();
        let mut sorted: Vec<u32> = (0..500).collect();
        sorted.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        for k in [1, 2, 21, 22, 23, 40, 499, 500, 600] {
            let s = Sampler::new(SamplingParams {
                top_k: k,
                ..params(1.0)
            });
            let mut out = Vec::new();
            s.distribution(&logits, &[], &mut out);
            let ids: Vec<u32> = out.iter().map(|c| c.id).collect();
            assert_eq!(ids, sorted[..(k as usize).min(500)], "top_k {k}");
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // probabilities 0.5, 0.25, 0.125, 0.125
        let logits = [2f32.ln() * 2.0, 2f32.ln(), 0.0, 0.0];
        let s = Sampler::new(SamplingParams {
            top_p: 0.7,
            ..params(1.0)
        });
        let mut out = Vec::new();
        s.distribution(&logits, &[], &mut out);
        assert_eq!(out.iter().map(|c| c.id).collect::<Vec<_>>(), vec![0, 1]);
        assert!((out[0].p - 2.0 / 3.0).abs() < 1e-5);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = [2f32.ln() * 2.0, 2f32.ln(), 0.0, 0.0];
        let s = Sampler::new(SamplingParams {
            min_p: 0.3,
            ..params(1.0)
        });
        let mut out = Vec::new();
        s.distribution(&logits, &[], &mut out);
        assert_eq!(out.len(), 2, "0.125 < 0.3 * 0.5");
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let logits = [1.0f32, 0.0];
        let mut out = Vec::new();
        Sampler::new(params(0.5)).distribution(&logits, &[], &mut out);
        let sharp = out[0].p;
        Sampler::new(params(2.0)).distribution(&logits, &[], &mut out);
        let flat = out[0].p;
        let base = 1.0 / (1.0 + (-1.0f32).exp());
        assert!(sharp > base && base > flat, "{sharp} {base} {flat}");
    }

    #[test]
    fn repetition_penalty_pushes_seen_tokens_down() {
        let s = Sampler::new(SamplingParams {
            repeat_penalty: 4.0,
            ..SamplingParams::greedy()
        });
        let mut out = Vec::new();
        s.distribution(&[2.0, 1.0, -1.0], &[0], &mut out);
        assert_eq!(out[0].id, 1, "2.0 / 4 = 0.5 < 1.0");
    }

    #[test]
    fn empirical_frequencies_follow_the_distribution() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut s = Sampler::new(params(1.0));
        let mut expected = Vec::new();
        s.distribution(&logits, &[], &mut expected);
        let n = 20_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        for c in &expected {
            let freq = counts[c.id as usize] as f32 / n as f32;
            assert!(
                (freq - c.p).abs() < 0.015,
                "token {}: {freq} vs {}",
                c.id,
                c.p
            );
        }
    }
}
