//! How many tokens to draft next: follows recent acceptance, pauses itself when speculation
//! does not pay — drafts are rarely accepted, or a speculative step costs more time per
//! emitted token than a plain one — and probes again later with exponential backoff.

/// Plain steps measured before the first speculative step, to know what a token costs.
const CALIBRATION_STEPS: u32 = 2;
/// Steps speculation stays paused the first time it stops paying (doubling on each failed
/// probe, up to [`MAX_PAUSE`]).
const FIRST_PAUSE: u32 = 16;
const MAX_PAUSE: u32 = 512;
/// Below this smoothed acceptance rate a drafter is judged useless.
const USELESS_ACCEPTANCE: f64 = 0.1;
/// Speculative steps may cost up to this factor of plain decoding's time per token (slack for
/// timing noise and for drafters that cost next to nothing when they find nothing).
const ALLOWED_COST: f64 = 1.03;
/// Speculative steps observed before the controller judges at all.
const MIN_EVIDENCE: u32 = 2;
/// Weight of the newest step in the smoothed figures.
const SMOOTHING: f64 = 0.3;
/// Drafts whose drafter confidence falls below this are not verified (greedy decoding with an
/// adaptive draft length).
pub const MIN_CONFIDENCE: f32 = 0.05;

/// Why speculation is paused on a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseReason {
    /// The first steps decode plainly to measure what a plain token costs.
    Calibrating,
    /// Recent drafts were rarely accepted.
    LowAcceptance,
    /// Speculative steps cost more time per emitted token than plain ones.
    TooSlow,
}

impl PauseReason {
    /// Why, in words, for the run summary.
    pub fn explanation(self) -> &'static str {
        match self {
            PauseReason::Calibrating => {
                "the first steps decode plainly to measure a plain token's cost"
            }
            PauseReason::LowAcceptance => "drafts were rarely accepted",
            PauseReason::TooSlow => "a verify pass cost more time than it saved",
        }
    }
}

/// The adaptive draft-length controller.
#[derive(Debug, Clone)]
pub struct DraftLength {
    min: u32,
    max: u32,
    adaptive: bool,
    current: u32,
    acceptance: f64,
    /// Smoothed seconds per emitted token of plain and of speculative steps.
    plain_cost: Option<f64>,
    spec_cost: Option<f64>,
    evidence: u32,
    paused_for: u32,
    next_pause: u32,
    /// Why the current (or last) pause began.
    pause_reason: PauseReason,
    last_was_paused: bool,
}

fn smooth(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| (1.0 - SMOOTHING) * o + SMOOTHING * new)
}

impl DraftLength {
    /// Drafts between `min` and `max` per step (`min` may be 0). Without `adaptive`, always
    /// `max`.
    pub fn new(min: u32, max: u32, adaptive: bool) -> Self {
        let min = min.min(max);
        Self {
            min,
            max,
            adaptive,
            current: if adaptive { min.max(max.min(4)) } else { max },
            acceptance: 0.5,
            plain_cost: None,
            spec_cost: None,
            evidence: 0,
            paused_for: if adaptive { CALIBRATION_STEPS } else { 0 },
            next_pause: FIRST_PAUSE,
            pause_reason: PauseReason::Calibrating,
            last_was_paused: false,
        }
    }

    /// How many tokens to draft this step (0 while paused).
    pub fn next_len(&mut self) -> u32 {
        self.last_was_paused = self.paused_for > 0;
        if self.paused_for > 0 {
            self.paused_for -= 1;
            return 0;
        }
        self.current
    }

    /// How many of `wanted` drafts a step verifies whatever they cost: all of them at a fixed
    /// length (`adaptive = false`, the profile's explicit choice), else up to the minimum.
    pub fn floor(&self, wanted: u32) -> u32 {
        if self.adaptive {
            self.min.min(wanted)
        } else {
            wanted
        }
    }

    /// Whether the length follows acceptance and cost (`false`: `--fixed-draft`, every step
    /// asks for the most drafts).
    pub fn is_adaptive(&self) -> bool {
        self.adaptive
    }

    /// The most drafts a step may have.
    pub fn max_len(&self) -> u32 {
        self.max
    }

    /// The smoothed fraction of drafts accepted (0.5 before any evidence).
    pub fn acceptance(&self) -> f64 {
        self.acceptance
    }

    /// Why the last call to [`next_len`](Self::next_len) was a paused step, if it was.
    pub fn pause_reason(&self) -> Option<PauseReason> {
        self.last_was_paused.then_some(self.pause_reason)
    }

    /// Learns from a step: the drafter was `asked` for drafts (or not, on a plain step) and
    /// returned `drafted`, of which `accepted` were accepted; `emitted` tokens came out and the
    /// step took `seconds` (drafting, verifying, sampling; `None`: not judged by time). A step whose drafter was asked
    /// counts as speculative even when it proposed nothing: its drafting time is the cost.
    pub fn record(
        &mut self,
        asked: bool,
        drafted: u32,
        accepted: u32,
        emitted: u32,
        seconds: Option<f64>,
    ) {
        if !self.adaptive || emitted == 0 {
            return;
        }
        let per_token = seconds.map(|s| s / f64::from(emitted));
        if !asked {
            if let Some(t) = per_token {
                self.plain_cost = Some(smooth(self.plain_cost, t));
            }
            return;
        }
        if let Some(t) = per_token {
            self.spec_cost = Some(smooth(self.spec_cost, t));
        }
        self.evidence += 1;
        if drafted > 0 {
            let rate = f64::from(accepted) / f64::from(drafted);
            self.acceptance = (1.0 - SMOOTHING) * self.acceptance + SMOOTHING * rate;
            self.current = if accepted == drafted {
                (self.current + 2).min(self.max)
            } else {
                (accepted + 1).clamp(self.min.max(1), self.max)
            };
        }
        let not_paying = self
            .why_not_paying()
            .filter(|_| self.evidence >= MIN_EVIDENCE);
        if let Some(reason) = not_paying {
            self.pause(reason);
        } else if accepted > 0 && self.evidence >= MIN_EVIDENCE {
            self.next_pause = FIRST_PAUSE;
        }
    }

    /// Why speculation does not pay now, if it does not: drafts are rarely accepted, or a
    /// token costs more time than plain decoding's.
    fn why_not_paying(&self) -> Option<PauseReason> {
        if self.acceptance < USELESS_ACCEPTANCE {
            return Some(PauseReason::LowAcceptance);
        }
        match (self.plain_cost, self.spec_cost) {
            (Some(plain), Some(spec)) if spec > plain * ALLOWED_COST => Some(PauseReason::TooSlow),
            _ => None,
        }
    }

    fn pause(&mut self, reason: PauseReason) {
        self.pause_reason = reason;
        self.paused_for = self.next_pause;
        self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
        // Probe with one cheap draft, judged on that step alone: it starts at the acceptance
        // threshold (one rejection re-pauses) with the failed period's costs forgotten.
        self.evidence = MIN_EVIDENCE - 1;
        self.current = self.min.max(1).min(self.max);
        self.acceptance = USELESS_ACCEPTANCE;
        self.spec_cost = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps where plain tokens cost 1.0 and a speculative step costs
    /// `spec_step` and accepts `accept(n)` of its `n` drafts.
    fn simulate(
        c: &mut DraftLength,
        steps: usize,
        spec_step: f64,
        accept: impl Fn(u32) -> u32,
    ) -> usize {
        let mut drafting = 0;
        for _ in 0..steps {
            let n = c.next_len();
            if n == 0 {
                c.record(false, 0, 0, 1, Some(1.0));
            } else {
                drafting += 1;
                let a = accept(n);
                c.record(true, n, a, a + 1, Some(spec_step));
            }
        }
        drafting
    }

    #[test]
    fn fixed_length_without_adaptation() {
        let mut c = DraftLength::new(0, 5, false);
        for _ in 0..10 {
            assert_eq!(c.next_len(), 5);
            c.record(true, 5, 0, 1, Some(1.0));
        }
    }

    #[test]
    fn calibrates_then_grows_on_full_acceptance_and_shrinks_on_rejection() {
        let mut c = DraftLength::new(1, 8, true);
        for _ in 0..CALIBRATION_STEPS {
            assert_eq!(c.next_len(), 0);
            c.record(false, 0, 0, 1, Some(1.0));
        }
        let first = c.next_len();
        assert!(first > 0);
        c.record(true, first, first, first + 1, Some(1.2));
        assert!(c.next_len() > first);
        c.record(true, 6, 1, 2, Some(1.2));
        assert_eq!(c.next_len(), 2);
    }

    #[test]
    fn useless_drafter_pauses_then_probes_with_backoff() {
        let mut c = DraftLength::new(0, 8, true);
        let drafting = simulate(&mut c, 2000, 1.1, |_| 0);
        assert!(drafting < 2000 / 20, "{drafting}");
    }

    #[test]
    fn accepted_but_too_slow_speculation_pauses() {
        // Half the drafts accepted, but a step costs 4 plain tokens.
        let mut c = DraftLength::new(0, 4, true);
        let drafting = simulate(&mut c, 2000, 4.0, |n| n / 2);
        assert!(drafting < 2000 / 20, "{drafting}");
    }

    #[test]
    fn pauses_say_why() {
        let mut c = DraftLength::new(0, 4, true);
        c.next_len();
        assert_eq!(c.pause_reason(), Some(PauseReason::Calibrating));
        // The reason of the first pause after calibration.
        let first_pause = |spec_step: f64, accept: fn(u32) -> u32| {
            let mut c = DraftLength::new(0, 4, true);
            for _ in 0..50 {
                simulate(&mut c, 1, spec_step, accept);
                match c.pause_reason() {
                    None | Some(PauseReason::Calibrating) => {}
                    reason => return reason,
                }
            }
            None
        };
        assert_eq!(first_pause(1.0, |_| 0), Some(PauseReason::LowAcceptance));
        assert_eq!(first_pause(4.0, |n| n / 2), Some(PauseReason::TooSlow));
        let mut fixed = DraftLength::new(0, 4, false);
        fixed.next_len();
        assert_eq!(fixed.pause_reason(), None);
    }

    #[test]
    fn paying_speculation_keeps_going() {
        let mut c = DraftLength::new(0, 4, true);
        let drafting = simulate(&mut c, 500, 1.2, |n| n);
        assert!(drafting > 450, "{drafting}");
    }

    #[test]
    fn an_expensive_drafter_that_proposes_nothing_pauses() {
        // Asked every step, never proposes, and its drafting doubles the step's cost.
        let mut c = DraftLength::new(0, 4, true);
        let mut asked = 0;
        for _ in 0..2000 {
            if c.next_len() == 0 {
                c.record(false, 0, 0, 1, Some(1.0));
            } else {
                asked += 1;
                c.record(true, 0, 0, 1, Some(2.0));
            }
        }
        assert!(asked < 2000 / 20, "{asked}");
    }

    #[test]
    fn a_successful_probe_resumes_speculation() {
        let mut c = DraftLength::new(0, 8, true);
        simulate(&mut c, 200, 1.1, |_| 0);
        let drafting = simulate(&mut c, 2000, 1.1, |n| n);
        assert!(drafting > 1500, "{drafting}");
    }
}
