//! Generation requests and their outcomes: stop reasons, timings, stop-string matching,
//! cancellation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::sampling::SamplingParams;
use crate::spec::SpecStats;

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: String,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// Prepend BOS where the model's tokenizer asks for it.
    pub add_bos: bool,
    /// Draft tokens per step, or `None` for plain decoding.
    pub speculation: Option<crate::spec::SpecSettings>,
    /// Checked once per decode step: once cancelled, generation ends with
    /// [`StopReason::Cancelled`] (the daemon cancels when a client disconnects).
    pub cancel: CancelFlag,
}

/// A shared "stop now" flag. Clones share the flag; the default is never cancelled until
/// [`CancelFlag::cancel`] is called on it or a clone.
#[derive(Debug, Clone, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    /// A flag that is `shared`'s: whoever sets it (a signal handler, say) cancels.
    pub fn shared(flag: Arc<AtomicBool>) -> Self {
        Self(flag)
    }

    /// Asks every holder of this flag to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// A stop string appeared in the output.
    StopString,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The request was cancelled (see [`Request::cancel`]).
    Cancelled,
}

/// Time spent, for the closing summary.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    /// Of those, how many the target already held (a conversation's earlier turns) and did
    /// not evaluate again.
    pub reused_tokens: usize,
    pub prefill_seconds: f64,
    pub generated_tokens: usize,
    pub decode_seconds: f64,
}

impl Timings {
    /// Prompt tokens evaluated per second (the reused ones cost nothing).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(
            self.prompt_tokens - self.reused_tokens,
            self.prefill_seconds,
        )
    }

    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.generated_tokens, self.decode_seconds)
    }
}

fn rate(n: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}

/// The result of one generation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    pub prompt_tokens: Vec<u32>,
    /// Generated token ids (without an end-of-generation token; with the tokens of a stop
    /// string, whose text is cut from `text`).
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    pub timings: Timings,
    /// Speculation statistics of this request.
    pub speculative: SpecStats,
}

/// Holds back text that could be the start of a stop string, and finds stop strings.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.to_vec(),
            pending: String::new(),
        }
    }

    /// Adds text; returns the text that is now certain, and whether a stop string was found
    /// (the returned text then ends just before it).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        let first_hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_hit {
            let ready = self.pending[..at].to_string();
            self.pending.clear();
            return (ready, true);
        }
        let held = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let split = self.pending.len() - held;
        let ready = self.pending[..split].to_string();
        self.pending.drain(..split);
        (ready, false)
    }

    /// Releases held-back text at the end of generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with (at a char boundary).
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

/// Formats the closing summary of a run.
pub fn summary(timings: &Timings) -> String {
    let reused = match timings.reused_tokens {
        0 => String::new(),
        n => format!(
            " ({n} kept from before, {} evaluated)",
            timings.prompt_tokens - n
        ),
    };
    let tokens = |n: usize| format!("{n} token{}", if n == 1 { "" } else { "s" });
    format!(
        "prompt: {}{reused}, prefill {:.1} t/s | generated: {}, decode {:.1} t/s",
        tokens(timings.prompt_tokens),
        timings.prefill_tokens_per_second(),
        tokens(timings.generated_tokens),
        timings.decode_tokens_per_second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_matcher_holds_back_possible_prefixes() {
        let stops = vec!["END".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("D and more"), (String::new(), true));
    }

    #[test]
    fn stop_matcher_releases_false_alarms() {
        let stops = vec!["END".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("EN"), (String::new(), false));
        assert_eq!(m.push("x"), ("ENx".to_string(), false));
        assert_eq!(m.push("E"), (String::new(), false));
        assert_eq!(m.flush(), "E");
    }

    #[test]
    fn stop_matcher_finds_the_earliest_stop() {
        let stops = vec!["world".to_string(), "lo".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello world"), ("hel".to_string(), true));
    }

    #[test]
    fn stop_matcher_respects_char_boundaries() {
        let stops = vec!["é!".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("caf"), ("caf".to_string(), false));
        assert_eq!(m.push("é"), (String::new(), false));
        assert_eq!(m.push("?"), ("é?".to_string(), false));
    }
}
