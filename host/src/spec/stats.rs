//! Speculation statistics, per request and cumulative.

use serde::Serialize;

use super::adaptive::PauseReason;

/// What speculation did during one request (or, merged, many).
///
/// Invariants, checked by the tests on every run: `accepted <= drafted`, per position too;
/// `emitted == steps + accepted` (each step emits its certain token plus the accepted drafts
/// that survive a stop condition; `clamped` counts those that did not); `target_passes` counts
/// every target evaluation once (prefill and one verify pass per step that evaluated).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecStats {
    /// Decode steps: each emits one certain token.
    pub steps: u64,
    /// Target forward passes: prefill plus one verify pass per step.
    pub target_passes: u64,
    /// Draft tokens proposed and verified.
    pub drafted: u64,
    /// Draft tokens accepted and emitted.
    pub accepted: u64,
    /// Draft tokens the target accepted but a stop condition cut off.
    pub clamped: u64,
    /// Tokens emitted (certain tokens plus accepted drafts).
    pub emitted: u64,
    /// Steps on which drafts were proposed.
    pub steps_with_drafts: u64,
    /// Steps the adaptive controller kept speculation paused.
    pub paused_steps: u64,
    /// Of those: the first steps, decoded plainly to measure a plain token's cost.
    pub paused_calibrating: u64,
    /// Of those: paused because drafts were rarely accepted.
    pub paused_low_acceptance: u64,
    /// Of those: paused because speculative steps cost more time per token than plain ones.
    pub paused_too_slow: u64,
    /// `drafted_by_position[i]`: drafts verified at position `i` (0 = first draft).
    pub drafted_by_position: Vec<u64>,
    /// `accepted_by_position[i]`: drafts accepted at position `i`.
    pub accepted_by_position: Vec<u64>,
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    pub sample_seconds: f64,
    /// Why the drafter was dropped partway through this request (it failed, or did not
    /// leave the target as it found it): decoding went on plainly from there. Not merged into
    /// totals, and not sent to API clients (it may quote a plugin's panic; the log has it).
    #[serde(skip)]
    pub drafter_failure: Option<String>,
}

impl SpecStats {
    /// Records a verified step: `drafted` proposals reaching `positions` tokens ahead (a
    /// chain's length, a tree's depth), of which `accepted` were accepted by the target
    /// (before any stop clamp).
    pub fn record_verdicts(&mut self, drafted: usize, positions: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.steps_with_drafts += 1;
        self.drafted += drafted as u64;
        grow(&mut self.drafted_by_position, positions);
        grow(&mut self.accepted_by_position, positions);
        for i in 0..positions {
            self.drafted_by_position[i] += 1;
        }
        for i in 0..accepted {
            self.accepted_by_position[i] += 1;
        }
    }

    /// Fraction of drafted tokens that were accepted.
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted + self.clamped, self.drafted)
    }

    /// Mean accepted drafts per step that drafted.
    pub fn mean_accepted_length(&self) -> f64 {
        ratio(self.accepted + self.clamped, self.steps_with_drafts)
    }

    /// Target passes per emitted token (1.0 = plain decoding; lower is better).
    pub fn passes_per_token(&self) -> f64 {
        ratio(self.target_passes, self.emitted)
    }

    /// Acceptance rate at each draft position.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.drafted_by_position
            .iter()
            .zip(&self.accepted_by_position)
            .map(|(&d, &a)| ratio(a, d))
            .collect()
    }

    /// Adds another request's statistics (cumulative counters).
    pub fn merge(&mut self, other: &SpecStats) {
        self.steps += other.steps;
        self.target_passes += other.target_passes;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.clamped += other.clamped;
        self.emitted += other.emitted;
        self.steps_with_drafts += other.steps_with_drafts;
        self.paused_steps += other.paused_steps;
        self.paused_calibrating += other.paused_calibrating;
        self.paused_low_acceptance += other.paused_low_acceptance;
        self.paused_too_slow += other.paused_too_slow;
        let n = other.drafted_by_position.len();
        grow(&mut self.drafted_by_position, n);
        grow(&mut self.accepted_by_position, n);
        for i in 0..n {
            self.drafted_by_position[i] += other.drafted_by_position[i];
            self.accepted_by_position[i] += other.accepted_by_position[i];
        }
        self.draft_seconds += other.draft_seconds;
        self.verify_seconds += other.verify_seconds;
        self.sample_seconds += other.sample_seconds;
    }

    /// Counts a step on which speculation was paused, and why.
    pub fn record_pause(&mut self, reason: PauseReason) {
        self.paused_steps += 1;
        *match reason {
            PauseReason::Calibrating => &mut self.paused_calibrating,
            PauseReason::LowAcceptance => &mut self.paused_low_acceptance,
            PauseReason::TooSlow => &mut self.paused_too_slow,
        } += 1;
    }

    /// "speculation paused on 112 of 200 steps: …", or `None` when it never paused.
    pub fn pause_report(&self) -> Option<String> {
        if self.paused_steps == 0 {
            return None;
        }
        let mut reasons: Vec<(u64, PauseReason)> = [
            (self.paused_too_slow, PauseReason::TooSlow),
            (self.paused_low_acceptance, PauseReason::LowAcceptance),
            (self.paused_calibrating, PauseReason::Calibrating),
        ]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .collect();
        reasons.sort_by_key(|r| std::cmp::Reverse(r.0));
        let why = reasons
            .iter()
            .map(|(n, r)| {
                let plural = if *n == 1 { "" } else { "s" };
                format!("{} ({n} step{plural})", r.explanation())
            })
            .collect::<Vec<_>>()
            .join("; ");
        Some(format!(
            "speculation paused on {} of {} steps: {why}",
            self.paused_steps, self.steps
        ))
    }

    /// A few lines for `specula run`.
    pub fn report(&self) -> String {
        let by_position = self
            .acceptance_by_position()
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "speculation: {} steps, {} drafted, {} accepted ({:.1}%), mean accepted length {:.2}, {:.3} target passes/token\n\
             acceptance by draft position: [{by_position}]\n\
             time: draft {:.3}s, verify {:.3}s, sampling {:.3}s{}",
            self.steps,
            self.drafted,
            self.accepted + self.clamped,
            100.0 * self.acceptance_rate(),
            self.mean_accepted_length(),
            self.passes_per_token(),
            self.draft_seconds,
            self.verify_seconds,
            self.sample_seconds,
            self.pause_report()
                .map(|p| format!("\n{p}"))
                .unwrap_or_default(),
        ) + &self
            .drafter_failure
            .as_ref()
            .map(|why| format!("\n{why}; decoded on without drafts from there"))
            .unwrap_or_default()
    }
}

fn grow(v: &mut Vec<u64>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_report_says_why_largest_first() {
        let mut s = SpecStats {
            steps: 200,
            ..Default::default()
        };
        assert_eq!(s.pause_report(), None);
        s.record_pause(PauseReason::Calibrating);
        for _ in 0..3 {
            s.record_pause(PauseReason::TooSlow);
        }
        assert_eq!(
            s.pause_report().unwrap(),
            "speculation paused on 4 of 200 steps: a verify pass cost more time than it saved (3 steps); the first steps decode plainly to measure a plain token's cost (1 step)"
        );
        assert!(s.report().ends_with(&s.pause_report().unwrap()));
    }

    #[test]
    fn verdicts_count_by_position() {
        let mut s = SpecStats::default();
        s.record_verdicts(3, 3, 1);
        s.record_verdicts(2, 2, 2);
        s.record_verdicts(0, 0, 0);
        assert_eq!(s.drafted, 5);
        assert_eq!(s.steps_with_drafts, 2);
        assert_eq!(s.drafted_by_position, vec![2, 2, 1]);
        assert_eq!(s.accepted_by_position, vec![2, 1, 0]);
        let mut total = SpecStats::default();
        total.merge(&s);
        total.merge(&s);
        assert_eq!(total.drafted_by_position, vec![4, 4, 2]);
    }
}
