//! Choosing the temperature sampled drafts are drawn at.
//!
//! Rejection sampling is exact whatever distribution `q` a draft was drawn from, but it accepts
//! a draft with probability `Σ min(p, q)` (`p`: the target's distribution): the closer `q` is to
//! `p`, the more drafts pass. A small draft model's distribution is flatter than its target's,
//! so drawing its drafts at the target's temperature wastes some; drawn at a lower one
//! (`T / factor`) they match better. The best factor is computed, not guessed: a drafter's
//! `q` drawn at one factor gives its distribution at any other (`q^(f / f_now)`, renormalised),
//! so each pass's first row tells exactly how often its first draft would have been accepted at
//! every factor, and the next drafts are drawn at the factor that did best lately. Learned per
//! generation, from its own rows only: a seeded generation draws the same text every time.

use crate::sampling::Candidate;

/// Factors tried: the draft temperature is the target's divided by one of them.
const FACTORS: [f32; 4] = [1.0, 1.25, 1.5, 2.0];
/// Weight of the newest row in the running figures.
const SMOOTHING: f64 = 0.05;
/// Rows observed before the factor may move from 1.
const MIN_ROWS: u32 = 8;
/// Tokens the draft distribution gives less than this fraction of its largest probability do
/// not count toward its renormalisation at other factors (the estimate is a little off, never
/// the sampling: which factor is chosen cannot make rejection sampling inexact).
const TAIL: f32 = 1e-7;

/// The draft temperature of one sampled generation.
#[derive(Debug, Clone, Default)]
pub struct DraftTemperature {
    /// Index into [`FACTORS`] of the factor the drafts being judged were drawn at.
    now: usize,
    /// Per factor, the smoothed chance that a row's first draft is accepted.
    acceptance: [f64; FACTORS.len()],
    rows: u32,
    /// The draft distribution's significant tokens: (id, ln q).
    support: Vec<(u32, f32)>,
}

impl DraftTemperature {
    /// The temperature to draw the next drafts at, for a target sampled at `temperature`.
    /// Fixes the factor until the next call: the drafts it draws are judged at it. Among
    /// factors that do equally well, the one nearest the target's temperature.
    pub fn next(&mut self, temperature: f32) -> f32 {
        if self.rows >= MIN_ROWS {
            self.now = (1..FACTORS.len()).fold(0, |best, i| {
                match self.acceptance[i] > self.acceptance[best] {
                    true => i,
                    false => best,
                }
            });
        }
        temperature / FACTORS[self.now]
    }

    /// The factor the drafts being judged were drawn at.
    pub fn factor(&self) -> f32 {
        FACTORS[self.now]
    }

    /// Learns from one judged row: `p`, the target's distribution there (its candidates);
    /// `q`, the distribution its first draft was drawn from (over the vocabulary).
    pub fn observe(&mut self, p: &[Candidate], q: &[f32]) {
        // The largest probability, NaN if any is not a number.
        let top = q
            .iter()
            .fold(0.0f32, |m, &x| if x > m || x.is_nan() { x } else { m });
        if !(top > 0.0 && top.is_finite()) {
            return;
        }
        let floor = top * TAIL;
        self.support.clear();
        self.support.extend(
            q.iter()
                .enumerate()
                .filter(|&(_, &x)| x >= floor)
                .map(|(id, &x)| (id as u32, x.ln())),
        );
        let now = FACTORS[self.now];
        let weight = if self.rows == 0 { 1.0 } else { SMOOTHING };
        for (i, &f) in FACTORS.iter().enumerate() {
            let accepted = expected_acceptance(p, q, &self.support, f / now);
            self.acceptance[i] += weight * (accepted - self.acceptance[i]);
        }
        self.rows = self.rows.saturating_add(1);
    }
}

/// `Σ min(p, q^power / Σ q^power)`: how often a draft drawn from `q` sharpened by `power`
/// would be accepted against `p`, with `q`'s significant tokens `support` (id, ln q).
fn expected_acceptance(p: &[Candidate], q: &[f32], support: &[(u32, f32)], power: f32) -> f64 {
    if power == 1.0 {
        return p
            .iter()
            .map(|c| f64::from(c.p.min(q.get(c.id as usize).copied().unwrap_or(0.0))))
            .sum();
    }
    // ln q^power, shifted by the largest so the sums cannot overflow.
    let shift = support
        .iter()
        .map(|&(_, l)| l * power)
        .fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = support
        .iter()
        .map(|&(_, l)| f64::from((l * power - shift).exp()))
        .sum();
    if total.is_nan() || total <= 0.0 {
        return 0.0;
    }
    p.iter()
        .map(|c| {
            let x = q.get(c.id as usize).copied().unwrap_or(0.0);
            let sharpened = match x > 0.0 {
                true => f64::from((x.ln() * power - shift).exp()) / total,
                false => 0.0,
            };
            f64::from(c.p).min(sharpened)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(logits: &[f32], scale: f32) -> Vec<f32> {
        let m = logits.iter().copied().fold(f32::MIN, f32::max);
        let e: Vec<f32> = logits.iter().map(|&l| ((l - m) * scale).exp()).collect();
        let s: f32 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect()
    }

    fn candidates(p: &[f32]) -> Vec<Candidate> {
        p.iter()
            .enumerate()
            .map(|(id, &p)| Candidate { id: id as u32, p })
            .collect()
    }

    #[test]
    fn expected_acceptance_is_the_overlap_of_the_sharpened_distribution() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, -3.0];
        let q = softmax(&logits, 1.0);
        let support: Vec<(u32, f32)> = q
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, x.ln()))
            .collect();
        let p = candidates(&softmax(&logits, 1.7));
        for power in [1.0f32, 1.25, 1.7, 2.0] {
            // q at `power` is the softmax of the logits scaled by it.
            let sharpened = softmax(&logits, power);
            let want: f64 = p
                .iter()
                .map(|c| f64::from(c.p.min(sharpened[c.id as usize])))
                .sum();
            let got = expected_acceptance(&p, &q, &support, power);
            assert!(
                (got - want).abs() < 1e-5,
                "power {power}: {got} against {want}"
            );
        }
        // At the target's own sharpness the draft is always accepted.
        assert!((expected_acceptance(&p, &q, &support, 1.7) - 1.0).abs() < 1e-5);
    }

    #[test]
    fn a_drafter_flatter_than_its_target_is_drawn_colder_and_a_matching_one_is_not() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, -3.0, 0.0, 1.5];
        for (target_sharpness, want) in [(1.5f32, 1.5f32), (1.0, 1.0), (2.2, 2.0)] {
            // The target samples at 0.8 from logits `target_sharpness` times the drafter's.
            let p = candidates(&softmax(&logits, target_sharpness / 0.8));
            let mut tuner = DraftTemperature::default();
            for _ in 0..40 {
                let t = tuner.next(0.8);
                let q = softmax(&logits, 1.0 / t);
                tuner.observe(&p, &q);
            }
            tuner.next(0.8);
            assert_eq!(tuner.factor(), want, "target sharper by {target_sharpness}");
        }
    }

    #[test]
    fn the_factor_stays_until_rows_are_seen_and_bad_rows_are_ignored() {
        let mut tuner = DraftTemperature::default();
        let p = candidates(&[1.0, 0.0]);
        tuner.observe(&p, &[0.0, 0.0]);
        tuner.observe(&p, &[f32::NAN, 0.5]);
        assert_eq!(tuner.next(1.0), 1.0);
        for _ in 0..MIN_ROWS - 1 {
            tuner.observe(&p, &[0.6, 0.4]);
        }
        assert_eq!(tuner.next(1.0), 1.0, "too few rows to move");
        tuner.observe(&p, &[0.6, 0.4]);
        assert_eq!(tuner.next(1.0), 0.5, "a one-hot target: the coldest factor");

        // A drafter whose distribution is the same at every factor (one-hot): no reason to
        // move from the target's temperature.
        let mut tuner = DraftTemperature::default();
        for _ in 0..MIN_ROWS {
            tuner.observe(&candidates(&[0.7, 0.3]), &[1.0, 0.0]);
        }
        assert_eq!(tuner.next(1.0), 1.0);
    }
}
