//! `specula bench --concurrency 1,2,4,8`: what many sequences decoding together in one backend
//! instance achieve, side by side in one run.
//!
//! Reported: aggregate plain (greedy) decode t/s with N sequences in one instance — every step
//! one `eval_batch` of one row per sequence, so each weight matrix is read once for all N —
//! and its ratio to one sequence; the cost of one pass of r rows (r = 1..16, the rows spread
//! over up to the largest N sequences, as continuous batching fills a pass) against one row;
//! and the prefill time of a 400-token prompt the first time and when a new sequence starts
//! with the same prompt again (the prefix cache's gain). The N values take turns within each
//! run, so a drift of the machine's speed moves them alike; every figure is a median.

use std::time::Instant;

use abi_stable::std_types::{RSlice, RVec};
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use specula_plugin_api::{
    BoxedForwardPass, EvalChunk, LogitRows, PluginKind, SeqId, SequenceCalls,
};

use super::median;
use crate::genmodel::DEFAULT_CORPUS;
use crate::pipeline::load_tokenizer;
use crate::plugins::{backend_params, SearchPath};
use crate::profile::{options_as_text, Profile};
use crate::sampling::argmax;

/// What `--concurrency` measures.
#[derive(Debug, Clone)]
pub struct ConcurrencyOptions {
    /// Sequences decoding together, one figure each (e.g. 1, 2, 4, 8).
    pub sequences: Vec<usize>,
    pub runs: usize,
    /// Prompt tokens each sequence starts with.
    pub prompt_tokens: usize,
    /// Tokens each sequence decodes per run.
    pub decode_tokens: usize,
    /// Rows of the largest pass whose cost is measured.
    pub max_rows: usize,
    /// Length of the repeated prompt of the prefix-cache figure.
    pub repeated_prompt_tokens: usize,
}

impl Default for ConcurrencyOptions {
    fn default() -> Self {
        Self {
            sequences: vec![1, 2, 4, 8],
            runs: 3,
            prompt_tokens: 64,
            decode_tokens: 64,
            max_rows: 16,
            repeated_prompt_tokens: 400,
        }
    }
}

/// Decoding with `sequences` sequences in one instance.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrentDecode {
    pub sequences: usize,
    /// Tokens per second over all sequences.
    pub tokens_per_second: f64,
    /// `tokens_per_second` over one sequence's.
    pub scaling: f64,
}

/// One pass of `rows` rows.
#[derive(Debug, Clone, Serialize)]
pub struct PassCost {
    pub rows: usize,
    /// Sequences the rows were spread over.
    pub sequences: usize,
    pub seconds: f64,
    /// cost(rows) / cost(1).
    pub ratio: f64,
}

/// Prefill of the same prompt in a new sequence, the first time and again.
#[derive(Debug, Clone, Serialize)]
pub struct RepeatedPrefill {
    pub prompt_tokens: usize,
    /// Tokens the second prefill took from the prefix cache.
    pub reused_tokens: usize,
    pub first_seconds: f64,
    pub repeated_seconds: f64,
    /// `repeated_seconds` over `first_seconds`.
    pub ratio: f64,
}

/// Everything `specula bench --concurrency` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyReport {
    pub model: String,
    pub architecture: String,
    pub threads: u32,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub decode: Vec<ConcurrentDecode>,
    pub pass_cost: Vec<PassCost>,
    pub repeated_prefill: RepeatedPrefill,
}

/// Opens the profile's target for `max_sequences` sequences.
fn open_target(profile: &Profile, max_sequences: usize) -> anyhow::Result<BoxedForwardPass> {
    let search = SearchPath::new(&profile.plugin_dir);
    let target = &profile.target;
    let plugin = search.load(&target.backend, PluginKind::Backend)?;
    let mut params = backend_params(
        &target.model,
        target.threads,
        target.context_size,
        profile.speculation.draft_max + 1,
        options_as_text(&target.options),
    );
    params.max_sequences = u32::try_from(max_sequences).unwrap_or(u32::MAX);
    params.kv_tokens = target.kv_tokens;
    let backend = plugin.open_backend(&params)?;
    let caps = backend.capabilities();
    anyhow::ensure!(
        caps.max_sequences as usize >= max_sequences,
        "the '{}' backend keeps at most {} sequences per instance; --concurrency needs {max_sequences}",
        target.backend,
        caps.max_sequences
    );
    Ok(backend)
}

/// One batch of one chunk per `(sequence, tokens)`, the logits of each chunk's `rows`.
fn eval_batch(
    backend: &mut BoxedForwardPass,
    work: &[(SeqId, &[u32])],
    rows: LogitRows,
    logits: &mut RVec<f32>,
) -> anyhow::Result<()> {
    let chunks: Vec<EvalChunk<'_>> = work
        .iter()
        .map(|&(seq, tokens)| EvalChunk::chain(seq, tokens, rows))
        .collect();
    backend
        .eval_batch(RSlice::from_slice(&chunks), logits)
        .into_result()?;
    Ok(())
}

/// Seconds `n` sequences take to decode `steps` tokens each, greedily, in one instance after
/// each was prefilled with its own prompt.
fn decode_seconds(
    backend: &mut BoxedForwardPass,
    prompts: &[Vec<u32>],
    steps: usize,
    vocab: usize,
) -> anyhow::Result<f64> {
    let mut logits = RVec::new();
    let mut seqs = Vec::with_capacity(prompts.len());
    let mut next = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let seq = backend.seq_create().into_result()?;
        backend
            .eval(seq, prompt, LogitRows::Last, &mut logits)
            .into_result()?;
        seqs.push(seq);
        next.push([argmax(&logits[..vocab])]);
    }
    let start = Instant::now();
    for _ in 0..steps {
        let work: Vec<(SeqId, &[u32])> =
            seqs.iter().zip(&next).map(|(&s, t)| (s, &t[..])).collect();
        eval_batch(backend, &work, LogitRows::Last, &mut logits)?;
        for (i, token) in next.iter_mut().enumerate() {
            token[0] = argmax(&logits[i * vocab..(i + 1) * vocab]);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    for seq in seqs {
        backend.seq_free(seq).into_result()?;
    }
    Ok(seconds)
}

/// The median time of one pass of `rows` rows (for each of `row_counts`) over up to `width`
/// sequences holding `prompts`; the row counts take turns within each round, the first round
/// warms up.
fn pass_seconds(
    backend: &mut BoxedForwardPass,
    prompts: &[Vec<u32>],
    row_counts: &[usize],
    rounds: usize,
    vocab: usize,
) -> anyhow::Result<Vec<(usize, f64)>> {
    let mut logits = RVec::new();
    let mut seqs = Vec::new();
    for prompt in prompts {
        let seq = backend.seq_create().into_result()?;
        backend
            .eval(seq, prompt, LogitRows::Last, &mut logits)
            .into_result()?;
        seqs.push(seq);
    }
    let batch: Vec<u32> = (0..row_counts.iter().copied().max().unwrap_or(1))
        .map(|i| (i * 7 + 13) as u32 % vocab as u32)
        .collect();
    let mut times = vec![Vec::new(); row_counts.len()];
    let mut spread = vec![0; row_counts.len()];
    for round in 0..=rounds {
        for (i, &rows) in row_counts.iter().enumerate() {
            // `rows` rows over min(rows, sequences) sequences, as evenly as they go.
            let n = rows.min(seqs.len());
            let mut work = Vec::with_capacity(n);
            let mut at = 0;
            for (j, &seq) in seqs.iter().take(n).enumerate() {
                let take = rows / n + usize::from(j < rows % n);
                work.push((seq, &batch[at..at + take]));
                at += take;
            }
            let start = Instant::now();
            eval_batch(backend, &work, LogitRows::All, &mut logits)?;
            if round > 0 {
                times[i].push(start.elapsed().as_secs_f64());
            }
            spread[i] = n;
            for (&seq, prompt) in seqs.iter().zip(prompts) {
                backend.truncate(seq, prompt.len()).into_result()?;
            }
        }
    }
    for seq in seqs {
        backend.seq_free(seq).into_result()?;
    }
    Ok(spread
        .into_iter()
        .zip(times.into_iter().map(median))
        .collect())
}

/// Seconds to prefill `prompt` in a new sequence, then in another new sequence after the
/// first was freed (what the prefix cache kept of it serves the second: it evaluates only the
/// rest), and the tokens the second took from the cache. The prefill of each asks the prefix
/// cache first, as a server does; `salt` makes the prompt one no earlier run cached.
fn repeated_prefill_seconds(
    backend: &mut BoxedForwardPass,
    prompt: &[u32],
) -> anyhow::Result<(f64, f64, usize)> {
    let mut logits = RVec::new();
    let mut prefill = |backend: &mut BoxedForwardPass| -> anyhow::Result<(f64, usize)> {
        let seq = backend.seq_create().into_result()?;
        let start = Instant::now();
        let reused = backend
            .seq_reuse_prefix(seq, RSlice::from_slice(prompt))
            .into_result()?;
        backend
            .eval(seq, &prompt[reused..], LogitRows::Last, &mut logits)
            .into_result()?;
        let seconds = start.elapsed().as_secs_f64();
        backend.seq_free(seq).into_result()?;
        Ok((seconds, reused))
    };
    let (first_seconds, _) = prefill(backend)?;
    let (repeated_seconds, reused) = prefill(backend)?;
    Ok((first_seconds, repeated_seconds, reused))
}

/// Runs the concurrency benchmark for `profile`.
pub fn run(profile: &Profile, options: &ConcurrencyOptions) -> anyhow::Result<ConcurrencyReport> {
    let mut counts = options.sequences.clone();
    counts.sort_unstable();
    counts.dedup();
    anyhow::ensure!(
        counts.first().is_some_and(|&n| n >= 1),
        "--concurrency needs sequence counts of at least 1"
    );
    let widest = *counts.last().context("no sequence count")?;
    let runs = options.runs.max(1);
    let mut backend = open_target(profile, widest.max(2))?;
    let info = backend.model_info();
    let vocab = info.vocab_size as usize;
    let context = info.context_size as usize;
    let threads = if profile.target.threads > 0 {
        profile.target.threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
    };

    // Each sequence starts with its own stretch of the corpus.
    let tokenizer = load_tokenizer(&profile.target.model)?;
    let corpus = tokenizer.encode(DEFAULT_CORPUS, true, false);
    anyhow::ensure!(
        !corpus.is_empty(),
        "the tokenizer encodes the corpus to nothing"
    );
    let prompt_len = options
        .prompt_tokens
        .clamp(1, context.saturating_sub(options.decode_tokens + 1).max(1));
    let prompts: Vec<Vec<u32>> = (0..widest)
        .map(|i| {
            corpus
                .iter()
                .copied()
                .cycle()
                .skip(i * 97)
                .take(prompt_len)
                .collect()
        })
        .collect();
    let steps = options
        .decode_tokens
        .min(context.saturating_sub(prompt_len + 1));

    // Rows per sequence within a hybrid's rollback window, which every pass is rolled back by.
    let depth = backend.capabilities().rollback_depth.max(1) as usize;
    let max_rows = options
        .max_rows
        .clamp(1, widest.max(2).saturating_mul(depth));
    let row_counts: Vec<usize> = (1..=max_rows).collect();
    let rounds = runs.max(super::VERIFY_MIN_ROUNDS);
    let bar = ProgressBar::new((runs * counts.len() + rounds + 2) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:<28} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    // Warm-up: one short decode of the widest batch (page faults, pool threads).
    decode_seconds(&mut backend, &prompts, steps.min(4), vocab)?;
    bar.set_message("concurrent decode");
    let mut seconds = vec![Vec::new(); counts.len()];
    for _ in 0..runs {
        for (i, &n) in counts.iter().enumerate() {
            seconds[i].push(decode_seconds(&mut backend, &prompts[..n], steps, vocab)?);
            bar.inc(1);
        }
    }
    let rates: Vec<f64> = counts
        .iter()
        .zip(seconds)
        .map(|(&n, s)| (n * steps) as f64 / median(s))
        .collect();
    let one = rates[0] / counts[0] as f64;
    let decode = counts
        .iter()
        .zip(&rates)
        .map(|(&n, &rate)| ConcurrentDecode {
            sequences: n,
            tokens_per_second: rate,
            scaling: rate / one,
        })
        .collect();

    bar.set_message("pass cost");
    let costs = pass_seconds(&mut backend, &prompts, &row_counts, rounds, vocab)?;
    bar.inc(rounds as u64);
    let pass_cost = row_counts
        .iter()
        .zip(&costs)
        .map(|(&rows, &(sequences, seconds))| PassCost {
            rows,
            sequences,
            seconds,
            ratio: seconds / costs[0].1,
        })
        .collect();

    bar.set_message("repeated prompt");
    let repeated: Vec<u32> = corpus
        .iter()
        .copied()
        .cycle()
        .take(options.repeated_prompt_tokens.clamp(1, context))
        .collect();
    let mut firsts = Vec::new();
    let mut agains = Vec::new();
    let mut reused = 0;
    for run in 0..runs {
        // A prompt no earlier run left in the cache: the first prefill computes every row.
        let mut prompt = repeated.clone();
        prompt[0] = (prompt[0] + 1 + run as u32) % vocab as u32;
        let (first, again, took) = repeated_prefill_seconds(&mut backend, &prompt)?;
        firsts.push(first);
        agains.push(again);
        reused = took;
    }
    bar.inc(2);
    bar.finish_and_clear();
    let (first_seconds, repeated_seconds) = (median(firsts), median(agains));
    Ok(ConcurrencyReport {
        model: info.name.to_string(),
        architecture: info.architecture.to_string(),
        threads,
        prompt_tokens: prompt_len,
        decode_tokens: steps,
        decode,
        pass_cost,
        repeated_prefill: RepeatedPrefill {
            prompt_tokens: repeated.len(),
            reused_tokens: reused,
            first_seconds,
            repeated_seconds,
            ratio: repeated_seconds / first_seconds,
        },
    })
}

/// The report as text.
pub fn render(report: &ConcurrencyReport) -> String {
    let mut out = format!(
        "model: {} ({}), {} threads; each sequence: a {}-token prompt, then {} greedy tokens\n",
        report.model,
        report.architecture,
        report.threads,
        report.prompt_tokens,
        report.decode_tokens
    );
    out += "decode, N sequences in one instance (one pass per step):\n";
    out += "  sequences  aggregate t/s  × one sequence\n";
    for d in &report.decode {
        out += &format!(
            "  {:>9}  {:>13.2}  {:>14.2}\n",
            d.sequences, d.tokens_per_second, d.scaling
        );
    }
    out += "cost of one pass of r rows (over up to the widest N sequences):\n";
    out += "  rows  sequences  ms/pass  cost(r)/cost(1)\n";
    for c in &report.pass_cost {
        out += &format!(
            "  {:>4}  {:>9}  {:>7.2}  {:>15.2}\n",
            c.rows,
            c.sequences,
            1e3 * c.seconds,
            c.ratio
        );
    }
    let r = &report.repeated_prefill;
    out += &format!(
        "prefill of a {}-token prompt in a new sequence: {:.1} ms the first time, {:.1} ms again ({:.1}% of the first; {} tokens from the prefix cache)\n",
        r.prompt_tokens,
        1e3 * r.first_seconds,
        1e3 * r.repeated_seconds,
        100.0 * r.ratio,
        r.reused_tokens
    );
    out
}
