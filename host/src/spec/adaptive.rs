//! How many tokens to draft next: follows recent acceptance, pauses itself when speculation
//! does not pay, and probes again later.

/// Steps speculation stays paused the first time it stops paying (doubling on each failed
/// probe, up to [`MAX_PAUSE`]).
const FIRST_PAUSE: u32 = 16;
const MAX_PAUSE: u32 = 512;
/// Below this smoothed acceptance rate a drafter is judged useless.
const USELESS_ACCEPTANCE: f64 = 0.1;
/// Verified drafting steps before the controller judges at all.
const MIN_EVIDENCE: u32 = 4;
/// Weight of the newest step in the smoothed acceptance rate.
const SMOOTHING: f64 = 0.3;
/// Drafts whose drafter confidence falls below this are not verified.
pub const MIN_CONFIDENCE: f32 = 0.05;

/// The adaptive draft-length controller.
#[derive(Debug, Clone)]
pub struct DraftLength {
    min: u32,
    max: u32,
    adaptive: bool,
    current: u32,
    smoothed_acceptance: f64,
    evidence: u32,
    paused_for: u32,
    next_pause: u32,
    last_was_paused: bool,
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
            smoothed_acceptance: 0.5,
            evidence: 0,
            paused_for: 0,
            next_pause: FIRST_PAUSE,
            last_was_paused: false,
        }
    }

    /// How many tokens to draft this step (0 while paused).
    pub fn next_len(&mut self) -> u32 {
        self.last_was_paused = self.paused_for > 0;
        if self.paused_for > 0 {
            self.paused_for -= 1;
            if self.paused_for == 0 {
                // Probe: one cheap draft.
                self.current = self.min.max(1).min(self.max);
                self.evidence = MIN_EVIDENCE - 1;
                self.smoothed_acceptance = USELESS_ACCEPTANCE;
            }
            return 0;
        }
        self.current
    }

    /// Whether the last call to [`next_len`](Self::next_len) was a paused step.
    pub fn is_paused(&self) -> bool {
        self.last_was_paused
    }

    /// Learns from a verified step: `drafted` proposals, `accepted` of them accepted.
    pub fn update(&mut self, drafted: u32, accepted: u32) {
        if !self.adaptive || drafted == 0 {
            return;
        }
        let rate = f64::from(accepted) / f64::from(drafted);
        self.smoothed_acceptance = (1.0 - SMOOTHING) * self.smoothed_acceptance + SMOOTHING * rate;
        self.evidence += 1;
        self.current = if accepted == drafted {
            (self.current + 2).min(self.max)
        } else {
            (accepted + 1).clamp(self.min.max(1), self.max)
        };
        if self.evidence >= MIN_EVIDENCE && self.smoothed_acceptance < USELESS_ACCEPTANCE {
            self.paused_for = self.next_pause;
            self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
            self.evidence = 0;
        } else if accepted > 0 {
            self.next_pause = FIRST_PAUSE;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_length_without_adaptation() {
        let mut c = DraftLength::new(0, 5, false);
        for _ in 0..10 {
            assert_eq!(c.next_len(), 5);
            c.update(5, 0);
        }
    }

    #[test]
    fn grows_on_full_acceptance_and_shrinks_on_rejection() {
        let mut c = DraftLength::new(1, 8, true);
        let first = c.next_len();
        c.update(first, first);
        assert!(c.next_len() > first);
        c.update(6, 1);
        assert_eq!(c.next_len(), 2);
    }

    #[test]
    fn useless_drafter_pauses_then_probes_with_backoff() {
        let mut c = DraftLength::new(0, 8, true);
        let mut drafting_steps = 0;
        for _ in 0..2000 {
            let n = c.next_len();
            if n > 0 {
                drafting_steps += 1;
                c.update(n, 0);
            }
        }
        // A few probes with exponential backoff: well under 5% of steps draft.
        assert!(drafting_steps < 2000 / 20, "{drafting_steps}");
    }

    #[test]
    fn a_successful_probe_resumes_speculation() {
        let mut c = DraftLength::new(0, 8, true);
        loop {
            let n = c.next_len();
            if c.is_paused() {
                break;
            }
            c.update(n, 0);
        }
        let mut n = 0;
        while n == 0 {
            n = c.next_len();
        }
        c.update(n, n);
        assert!(c.next_len() > n);
    }
}
