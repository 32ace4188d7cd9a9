//! Deciding a verify row: does the target accept one of the drafts continuing it, and if
//! not, what does it emit instead?
//!
//! A row's drafts are its children in the pass: one for a chain, several for a tree. Greedy:
//! a draft is accepted when it is the target's choice (the same `Sampler::sample` that plain
//! decoding uses, so the emitted stream is identical). Sampling: exact rejection sampling
//! (Leviathan et al.; Chen et al.), recursive over siblings (SpecInfer; Jeon et al.): draft
//! `j` is accepted with probability `min(1, p(x)/q_j(x))`; on rejection the target's
//! distribution becomes the residual `normalize(max(0, p − q_j))` for the next draft, and when
//! every draft is rejected the token is drawn from the last residual. A drafter without a
//! distribution counts as `q = one-hot(x)`. Each step is a rejection sampler whose output
//! follows its target distribution whatever its proposal, so the emitted token is distributed
//! exactly as `p`, the target's distribution after every sampling transform — siblings drawn
//! with or without replacement, the tree shaped however the drafter likes.
//!
//! A pass's first sampled row also tells the [`DraftTemperature`] how often its first draft
//! would have been accepted had it been drawn colder or hotter.

use super::draft_temperature::DraftTemperature;
use crate::sampling::{Candidate, Sampler};

/// The target's decision among the drafts continuing one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The draft at this index (among those given) is accepted.
    Accept(usize),
    /// Every draft was rejected; the target emits this token instead.
    Reject(u32),
}

/// Reusable buffers for judging rows, and what judging teaches about drafting.
#[derive(Debug, Default)]
pub struct Judge {
    candidates: Vec<Candidate>,
    residual: Vec<Candidate>,
    /// The temperature sampled drafts are best drawn at.
    pub draft_temperature: DraftTemperature,
}

impl Judge {
    /// Judges the drafts continuing one row against the row's target logits: each draft in
    /// order, with the distribution it was drawn from (`None`: one-hot). `history` is the
    /// sequence the row continues (for the repetition penalty). With `first_row` (the pass's
    /// certain token, always judged: an unbiased sample of the text) the draft temperature
    /// learns from it.
    pub fn judge(
        &mut self,
        sampler: &mut Sampler,
        logits: &[f32],
        history: &[u32],
        drafts: &[(u32, Option<&[f32]>)],
        first_row: bool,
    ) -> Verdict {
        if sampler.params().is_greedy() {
            let choice = sampler.sample(logits, history);
            return match drafts.iter().position(|&(d, _)| d == choice) {
                Some(j) => Verdict::Accept(j),
                None => Verdict::Reject(choice),
            };
        }
        sampler.distribution(logits, history, &mut self.candidates);
        if let (true, Some(&(_, Some(q)))) = (first_row, drafts.first()) {
            self.draft_temperature.observe(&self.candidates, q);
        }
        for (j, &(draft, q)) in drafts.iter().enumerate() {
            let q_of = |id: u32| match q {
                Some(q) => q.get(id as usize).copied().unwrap_or(0.0),
                None => f32::from(id == draft),
            };
            let p_d = self
                .candidates
                .iter()
                .find(|c| c.id == draft)
                .map_or(0.0, |c| c.p);
            let q_d = q_of(draft);
            if q_d > 0.0 && sampler.uniform() * q_d < p_d {
                return Verdict::Accept(j);
            }
            self.residual.clear();
            self.residual.extend(self.candidates.iter().filter_map(|c| {
                let r = c.p - q_of(c.id);
                (r > 0.0).then_some(Candidate { id: c.id, p: r })
            }));
            let total: f32 = self.residual.iter().map(|c| c.p).sum();
            if total > 0.0 {
                self.residual.iter_mut().for_each(|c| c.p /= total);
                std::mem::swap(&mut self.candidates, &mut self.residual);
            }
            // Else p ≤ q everywhere, so p = q and the rejection had probability zero: p stays.
        }
        Verdict::Reject(sampler.draw(&self.candidates))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn sampling(seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: Some(seed),
        }
    }

    fn softmax(logits: &[f32]) -> Vec<f64> {
        let m = logits.iter().cloned().fold(f32::MIN, f32::max);
        let e: Vec<f64> = logits.iter().map(|&l| f64::from(l - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect()
    }

    /// Chi-square statistic of observed counts against expected probabilities.
    fn chi_square(counts: &[u64], p: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The first emitted token of a step (accepted draft, or the correction) must be
    /// distributed as p whatever the drafter does.
    fn emitted_distribution(
        q: Option<Vec<f32>>,
        draw_draft: impl Fn(&mut Sampler) -> u32,
    ) -> (Vec<u64>, Vec<f64>) {
        let logits = [1.2f32, 0.3, -0.5, 2.0, 0.0, -1.5];
        let p = softmax(&logits);
        let mut sampler = Sampler::new(sampling(99));
        let mut judge = Judge::default();
        let mut counts = vec![0u64; logits.len()];
        for _ in 0..60_000 {
            let d = draw_draft(&mut sampler);
            let token = match judge.judge(&mut sampler, &logits, &[], &[(d, q.as_deref())], true) {
                Verdict::Accept(_) => d,
                Verdict::Reject(t) => t,
            };
            counts[token as usize] += 1;
        }
        (counts, p)
    }

    // 5 degrees of freedom: the 99.9% quantile of chi-square is 20.5.
    const CHI2_5_999: f64 = 20.5;

    #[test]
    fn rejection_sampling_with_a_distribution_is_exact() {
        // A deliberately bad drafter: q puts its mass on unlikely tokens.
        let q = vec![0.05f32, 0.1, 0.5, 0.05, 0.2, 0.1];
        let q2 = q.clone();
        let (counts, p) = emitted_distribution(Some(q), move |s| {
            s.draw(
                &q2.iter()
                    .enumerate()
                    .map(|(i, &p)| Candidate { id: i as u32, p })
                    .collect::<Vec<_>>(),
            )
        });
        let chi2 = chi_square(&counts, &p);
        assert!(
            chi2 < CHI2_5_999,
            "chi2 = {chi2}, counts {counts:?}, p {p:?}"
        );
    }

    #[test]
    fn rejection_sampling_with_one_hot_drafts_is_exact() {
        // A drafter without a distribution that always proposes the same unlikely token.
        let (counts, p) = emitted_distribution(None, |_| 5);
        let chi2 = chi_square(&counts, &p);
        assert!(
            chi2 < CHI2_5_999,
            "chi2 = {chi2}, counts {counts:?}, p {p:?}"
        );
    }

    #[test]
    fn a_perfect_drafter_is_always_accepted_and_still_exact() {
        let logits = [1.2f32, 0.3, -0.5, 2.0, 0.0, -1.5];
        let p: Vec<f32> = softmax(&logits).into_iter().map(|x| x as f32).collect();
        let p2 = p.clone();
        let (counts, pe) = emitted_distribution(Some(p), move |s| {
            s.draw(
                &p2.iter()
                    .enumerate()
                    .map(|(i, &p)| Candidate { id: i as u32, p })
                    .collect::<Vec<_>>(),
            )
        });
        assert!(chi_square(&counts, &pe) < CHI2_5_999);
    }

    /// Siblings drawn from `q` without replacement (each next one from `q` with the earlier
    /// ones taken out), or one-hot siblings: the emitted token follows `p` exactly.
    #[test]
    fn recursive_rejection_over_siblings_is_exact() {
        let logits = [1.2f32, 0.3, -0.5, 2.0, 0.0, -1.5];
        let p = softmax(&logits);
        let q = [0.05f32, 0.1, 0.5, 0.05, 0.2, 0.1];
        for (name, with_q, siblings) in [
            ("3 siblings without replacement", true, 3),
            ("1 sibling", true, 1),
            ("2 one-hot siblings", false, 2),
        ] {
            let mut sampler = Sampler::new(sampling(7));
            let mut judge = Judge::default();
            let mut counts = vec![0u64; logits.len()];
            for _ in 0..60_000 {
                // Draw the siblings, each from what is left of q.
                let mut left = q.to_vec();
                let mut children: Vec<(u32, Vec<f32>)> = Vec::new();
                for _ in 0..siblings {
                    let total: f32 = left.iter().sum();
                    let dist: Vec<f32> = left.iter().map(|x| x / total).collect();
                    let pick = sampler.draw(
                        &dist
                            .iter()
                            .enumerate()
                            .map(|(i, &p)| Candidate { id: i as u32, p })
                            .collect::<Vec<_>>(),
                    );
                    left[pick as usize] = 0.0;
                    children.push((pick, dist));
                }
                let judged: Vec<(u32, Option<&[f32]>)> = children
                    .iter()
                    .map(|(d, dist)| (*d, with_q.then_some(&dist[..])))
                    .collect();
                let token = match judge.judge(&mut sampler, &logits, &[], &judged, true) {
                    Verdict::Accept(j) => children[j].0,
                    Verdict::Reject(t) => t,
                };
                counts[token as usize] += 1;
            }
            let chi2 = chi_square(&counts, &p);
            assert!(
                chi2 < CHI2_5_999,
                "{name}: chi2 = {chi2}, counts {counts:?}, p {p:?}"
            );
        }
    }

    #[test]
    fn greedy_accepts_only_the_argmax() {
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let mut judge = Judge::default();
        let logits = [0.0f32, 3.0, 1.0];
        assert_eq!(
            judge.judge(&mut sampler, &logits, &[], &[(1, None)], false),
            Verdict::Accept(0)
        );
        assert_eq!(
            judge.judge(&mut sampler, &logits, &[], &[(2, None)], false),
            Verdict::Reject(1)
        );
        assert_eq!(
            judge.judge(&mut sampler, &logits, &[], &[(2, None), (1, None)], false),
            Verdict::Accept(1)
        );
    }
}
