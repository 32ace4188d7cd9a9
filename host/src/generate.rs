//! Opening a profile's pipeline and the plain decode loop behind `specula run`.

use std::path::Path;
use std::time::Instant;

use abi_stable::std_types::{RSlice, RVec};
use anyhow::{bail, Context};
use specula_gguf::GgufFile;
use specula_plugin_api::{BoxedForwardPass, ErrorKind, LogitRows, ModelInfo, PluginKind};

use crate::plugins::{backend_params, SearchPath};
use crate::profile::{options_as_text, Profile};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// A loaded target model: its backend instance and its tokenizer.
pub struct Pipeline {
    pub backend: BoxedForwardPass,
    pub tokenizer: Tokenizer,
    pub info: ModelInfo,
}

impl Pipeline {
    /// Loads the plugins and model a profile names.
    pub fn open(profile: &Profile) -> anyhow::Result<Self> {
        let search = SearchPath::new(&profile.plugin_dir);
        let target = &profile.target;
        let tokenizer = load_tokenizer(&target.model)?;
        let plugin = search.load(&target.backend, PluginKind::Backend)?;
        let params = backend_params(
            &target.model,
            target.threads,
            target.context_size,
            profile.speculation.draft_max + 1,
            options_as_text(&target.options),
        );
        let backend = plugin.open_backend(&params)?;
        let info = backend.model_info();
        if info.vocab_size as usize != tokenizer.vocab_size() {
            tracing::warn!(
                model_vocab = info.vocab_size,
                tokenizer_vocab = tokenizer.vocab_size(),
                "the model's output size differs from its tokenizer's vocabulary"
            );
        }
        Ok(Self {
            backend,
            tokenizer,
            info,
        })
    }
}

/// Reads the tokenizer from a GGUF file's metadata.
pub fn load_tokenizer(model: &Path) -> anyhow::Result<Tokenizer> {
    let file = GgufFile::open(model)?;
    Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot build the tokenizer of {}", model.display()))
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: String,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// Prepend BOS where the model's tokenizer asks for it.
    pub add_bos: bool,
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
}

/// Time spent, for the closing summary.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub generated_tokens: usize,
    pub decode_seconds: f64,
}

impl Timings {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_seconds)
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
}

/// Generates text for `request`, calling `on_text` with each piece of text as soon as it is
/// certain (complete UTF-8, and not possibly the start of a stop string).
pub fn generate(
    pipeline: &mut Pipeline,
    request: &Request,
    mut on_text: impl FnMut(&str),
) -> anyhow::Result<Outcome> {
    let tokenizer = &pipeline.tokenizer;
    let mut prompt = tokenizer.encode(&request.prompt, request.add_bos, true);
    if prompt.is_empty() {
        match tokenizer.bos().or(pipeline.info.bos_token.into_option()) {
            Some(bos) => prompt.push(bos),
            None => bail!("the prompt is empty and the model has no BOS token to start from"),
        }
    }
    let context = pipeline.info.context_size as usize;
    if prompt.len() >= context {
        bail!(
            "the prompt is {} tokens, but the context holds {context}",
            prompt.len()
        );
    }

    let backend = &mut pipeline.backend;
    backend.truncate(0).into_result()?;
    let mut logits = RVec::new();
    let started = Instant::now();
    backend
        .eval(RSlice::from_slice(&prompt), LogitRows::Last, &mut logits)
        .into_result()
        .context("prompt evaluation failed")?;
    let prefill = started.elapsed();

    let mut sampler = Sampler::new(request.sampling.clone());
    let mut history = prompt.clone();
    let mut tokens = Vec::new();
    // Generated text continues the prompt's; when the prompt renders nothing (BOS only) it
    // starts the text, and SentencePiece's added leading space is dropped.
    let mut stream = if tokenizer.decode(&prompt).is_empty() {
        StreamDecoder::from_start(tokenizer)
    } else {
        StreamDecoder::new(tokenizer)
    };
    let mut stops = StopMatcher::new(&request.stop);
    let mut text = String::new();
    let decode_started = Instant::now();
    let mut stop_reason = StopReason::MaxTokens;
    let mut emit = |piece: &str, text: &mut String| {
        if !piece.is_empty() {
            on_text(piece);
            text.push_str(piece);
        }
    };

    while tokens.len() < request.max_tokens as usize {
        let token = sampler.sample(&logits, &history);
        if tokenizer.is_end_of_generation(token)
            || pipeline.info.eos_token.into_option() == Some(token)
        {
            stop_reason = StopReason::EndOfGeneration;
            break;
        }
        tokens.push(token);
        history.push(token);
        let (ready, hit) = stops.push(&stream.push(token));
        emit(&ready, &mut text);
        if hit {
            stop_reason = StopReason::StopString;
            break;
        }
        if tokens.len() == request.max_tokens as usize {
            break;
        }
        if history.len() >= context {
            stop_reason = StopReason::ContextFull;
            break;
        }
        match backend
            .eval(RSlice::from_slice(&[token]), LogitRows::Last, &mut logits)
            .into_result()
        {
            Ok(()) => {}
            Err(e) if e.kind == ErrorKind::ContextFull => {
                stop_reason = StopReason::ContextFull;
                break;
            }
            Err(e) => return Err(e).context("decoding failed"),
        }
    }
    if stop_reason != StopReason::StopString {
        let (ready, _) = stops.push(&stream.finish());
        emit(&ready, &mut text);
        emit(&stops.flush(), &mut text);
    }
    let decode = decode_started.elapsed();
    Ok(Outcome {
        timings: Timings {
            prompt_tokens: prompt.len(),
            prefill_seconds: prefill.as_secs_f64(),
            generated_tokens: tokens.len(),
            decode_seconds: decode.as_secs_f64(),
        },
        prompt_tokens: prompt,
        tokens,
        text,
        stop_reason,
    })
}

/// Holds back text that could be the start of a stop string, and finds stop strings.
#[derive(Debug)]
pub struct StopMatcher<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopMatcher<'a> {
    pub fn new(stops: &'a [String]) -> Self {
        Self {
            stops,
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
    format!(
        "prompt: {} tokens, prefill {:.1} t/s | generated: {} tokens, decode {:.1} t/s",
        timings.prompt_tokens,
        timings.prefill_tokens_per_second(),
        timings.generated_tokens,
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
