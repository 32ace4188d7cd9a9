//! `specula bench`: what a profile's model and drafters achieve on this machine, measured side
//! by side in one run.
//!
//! Reported: read bandwidth; prefill t/s; plain decode t/s and its share of the memory
//! roofline (weight bytes per token ÷ decode time, against the measured bandwidth); the verify
//! cost ratio cost(k)/cost(1) for k = 1..capacity; and for each drafter the end-to-end decode
//! t/s, speedup over plain decoding and acceptance. The `oracle` drafter is prompt lookup from
//! a corpus holding the plain greedy output (acceptance ≈ 100%): its speedup against the ideal
//! k ÷ ratio(k) is the engine's efficiency. Every figure is the median of `runs` runs.
//!
//! Each drafter runs in a pipeline of its own, that is with its own copy of the weights in
//! memory, and on a shared machine two copies can be read at quite different speeds. So a
//! drafter's speedup is against plain decoding in that same pipeline (plain and speculative
//! runs taking turns), and the oracle's ideal against the verify cost measured there too.

mod bandwidth;
pub mod concurrency;
mod plot;

pub use plot::{write_concurrency_svg, write_svg};

use std::time::Instant;

use abi_stable::std_types::RVec;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use specula_plugin_api::LogitRows;

pub use bandwidth::read_bandwidth;

use crate::genmodel::DEFAULT_CORPUS;
use crate::pipeline::Pipeline;
use crate::profile::{DrafterSection, Profile};
use crate::request::{Outcome, Request};
use crate::sampling::SamplingParams;
use crate::sequence::SeqModel;
use crate::spec::{generate, SpecSettings};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Repetitions per figure (the median is reported).
    pub runs: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Drafters to compare: `profile` (the profile's own), `lookup`, `mtp`, `oracle`, or a
    /// plugin name.
    pub drafters: Vec<String>,
    /// Batch size of the oracle run (drafts = k − 1).
    pub oracle_k: u32,
    /// Runs each drafter (but the oracle) twice at the same fixed rows per pass
    /// (`draft_max` + 1): drafting chains, then trees; and where the profile adapts its drafts
    /// (`adaptive = true`) a third time, with trees of the nodes that pay on the target's
    /// measured cost curve.
    pub tree: bool,
    /// Sampling temperature of the drafter runs and their plain runs (0: greedy); sampled runs
    /// are seeded by their run index, so every build samples the same.
    pub temperature: f32,
    /// Each drafter run (and the plain run it is compared with) starts from its own window of
    /// the built-in text, [`PROMPT_STRIDE`] tokens after the last run's.
    pub vary_prompts: bool,
    /// Bytes read by the bandwidth measurement.
    pub bandwidth_bytes: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            runs: 3,
            prompt_tokens: 128,
            decode_tokens: 128,
            drafters: vec![
                "profile".into(),
                "lookup".into(),
                "mtp".into(),
                "oracle".into(),
            ],
            oracle_k: 4,
            tree: false,
            temperature: 0.0,
            vary_prompts: false,
            bandwidth_bytes: 1 << 30,
        }
    }
}

/// One verify batch size.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyCost {
    pub k: u32,
    pub seconds: f64,
    /// cost(k) / cost(1).
    pub ratio: f64,
}

/// One drafter's end-to-end result.
#[derive(Debug, Clone, Serialize)]
pub struct DrafterRun {
    /// The drafter, with ` tree` after it for its tree runs (` tree adaptive` for trees sized
    /// by the cost curve).
    pub drafter: String,
    /// Drafts proposed as trees (`--tree`).
    pub tree: bool,
    pub decode_tokens_per_second: f64,
    /// Plain decoding in the drafter's pipeline (the same weights in memory), the runs taking
    /// turns with the speculative ones.
    pub plain_decode_tokens_per_second: f64,
    /// `decode_tokens_per_second` over `plain_decode_tokens_per_second`.
    pub speedup: f64,
    pub acceptance: f64,
    pub mean_accepted_length: f64,
    pub passes_per_token: f64,
    /// Same greedy output as plain decoding (`None` for sampled runs).
    pub output_matches_plain: Option<bool>,
    /// For the oracle: ratio(k) measured in its pipeline, k ÷ ratio(k), and speedup ÷ that.
    pub verify_ratio: Option<f64>,
    pub ideal_speedup: Option<f64>,
    pub efficiency: Option<f64>,
}

/// A change of the measured bandwidth between the start and the end of a run beyond which the
/// report warns that the machine changed speed under it.
const BANDWIDTH_DRIFT_WARNING: f64 = 0.15;

impl BenchReport {
    /// The relative change of the bandwidth from the start to the end of the run, if it is
    /// beyond 15% (`BANDWIDTH_DRIFT_WARNING`).
    pub fn bandwidth_drift(&self) -> Option<f64> {
        let start = self.bandwidth_bytes_per_second;
        let drift = self.bandwidth_at_end_bytes_per_second / start - 1.0;
        (start > 0.0 && drift.abs() > BANDWIDTH_DRIFT_WARNING).then_some(drift)
    }
}

/// Everything `specula bench` measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub architecture: String,
    /// The model file's tensors by storage type, most bytes first (a llama.cpp `Q4_K_M` file
    /// is mostly Q4_K with some Q6_K).
    pub tensor_types: Vec<TensorTypeShare>,
    pub weight_bytes: u64,
    pub threads: u32,
    /// Whether this process may use AMX tiles ([`specula_kernels::amx::amx_support`]).
    pub amx: String,
    /// The SIMD level the CPU kernels run at (`amx`, `avx512`, `avx2` or `scalar`: the best
    /// the CPU has, unless `SPECULA_SIMD` lowers it).
    pub simd: String,
    /// Measured first; the roofline is against it.
    pub bandwidth_bytes_per_second: f64,
    /// Measured again after every other figure.
    pub bandwidth_at_end_bytes_per_second: f64,
    pub prompt_tokens: usize,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    /// Weight bytes per token × decode t/s ÷ bandwidth.
    pub roofline_fraction: f64,
    /// KV-cache bytes one position adds (every attention layer's keys and values in the
    /// profile's `kv_type`), from the model file; `None` where its shape is not known.
    pub kv_bytes_per_position: Option<u64>,
    /// The roofline with the KV cache read too: (weight bytes + KV bytes of the mean context
    /// of the decode runs) × decode t/s ÷ bandwidth — what bounds decoding at long contexts.
    pub roofline_with_kv_fraction: Option<f64>,
    /// Bytes of recurrent state a hybrid reads and writes per token (every Gated DeltaNet
    /// layer's S matrices and convolution state, f32, once each way); `None` for a model
    /// without recurrent layers.
    pub recurrent_bytes_per_token: Option<u64>,
    /// The roofline with the KV cache and the recurrent state too: (weight bytes + KV bytes of
    /// the mean context + recurrent bytes per token) × decode t/s ÷ bandwidth — every byte a
    /// hybrid's decoding step must move.
    pub roofline_with_state_fraction: Option<f64>,
    /// The model's peak resident memory: the larger of the process's peak while the model
    /// loaded and its peak from prefill through the verify passes to the end of plain decoding
    /// (the bandwidth probe's buffer between them left out); where the OS reports them (Linux).
    /// The target has room for the profile's verify passes, so a hybrid's snapshot ring is
    /// counted as a speculating run holds it.
    pub peak_rss_bytes: Option<u64>,
    pub verify: Vec<VerifyCost>,
    pub drafters: Vec<DrafterRun>,
    /// Drafters that could not run here, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// The tensors of one storage type in the model file.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TensorTypeShare {
    /// ggml's name of the type (`Q4_K`, `Q6_K`, `F32`, ...).
    pub ty: String,
    pub tensors: usize,
    pub bytes: u64,
}

/// The tensors of `file` grouped by storage type, most bytes first.
fn tensor_types(file: &specula_gguf::GgufFile) -> Vec<TensorTypeShare> {
    let mut shares: Vec<TensorTypeShare> = Vec::new();
    for t in file.tensors() {
        let ty = t.ty.to_string();
        match shares.iter_mut().find(|s| s.ty == ty) {
            Some(s) => {
                s.tensors += 1;
                s.bytes += t.n_bytes();
            }
            None => shares.push(TensorTypeShare {
                ty,
                tensors: 1,
                bytes: t.n_bytes(),
            }),
        }
    }
    shares.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.ty.cmp(&b.ty)));
    shares
}

/// KV-cache bytes one position adds: the attention layers (every trunk layer of a dense model,
/// the full-attention ones of a hybrid) times their key and value widths, in the profile's
/// `kv_type` (f16 unless it says `f32` or `q8_0`).
fn kv_bytes_per_position(file: &specula_gguf::GgufFile, profile: &Profile) -> Option<u64> {
    use specula_gguf::hparams::{HParams, HybridParams};
    let hp = HParams::from_gguf(file).ok()?;
    let layers = match HybridParams::from_gguf(file, &hp) {
        Ok(hybrid) => hybrid.recurrent.iter().filter(|&&r| !r).count() as u64,
        Err(_) => u64::from(hp.block_count),
    };
    let kv_type = profile
        .target
        .options
        .get("kv_type")
        .and_then(|v| v.as_str());
    // Bytes of one head row of `dim` values: f32, f16, or Q8_0 blocks (34 bytes per 32).
    let row = |dim: u32| {
        let dim = u64::from(dim);
        u64::from(hp.head_count_kv)
            * match kv_type {
                Some("f32") => 4 * dim,
                Some("q8_0") => dim.div_ceil(32) * 34,
                _ => 2 * dim,
            }
    };
    Some(layers * (row(hp.key_length) + row(hp.value_length)))
}

/// Recurrent-state bytes a decoding step reads and writes: per Gated DeltaNet layer, `Hv` S×S
/// matrices and `conv_kernel - 1` rows of the convolution's channels (`[q | k | v]`), f32,
/// each read once and written once. `None` for a model without recurrent layers.
fn recurrent_bytes_per_token(file: &specula_gguf::GgufFile) -> Option<u64> {
    use specula_gguf::hparams::{HParams, HybridParams};
    let hp = HParams::from_gguf(file).ok()?;
    let hybrid = HybridParams::from_gguf(file, &hp).ok()?;
    let layers = hybrid.recurrent.iter().filter(|&&r| r).count() as u64;
    let s = u64::from(hybrid.state_size);
    let matrices = u64::from(hybrid.time_step_rank) * s * s;
    let channels = 2 * u64::from(hybrid.group_count) * s + u64::from(hybrid.inner_size);
    let conv = u64::from(hybrid.conv_kernel - 1) * channels;
    Some(layers * (matrices + conv) * 4 * 2)
}

/// Resets the process's peak resident set (`VmHWM`) to its current size (Linux 4.0+);
/// whether it could.
fn reset_peak_resident() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A `Vm…` line of `/proc/self/status` in bytes (Linux; `None` elsewhere).
fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Runs the benchmark for `profile`.
/// Timed rounds of the verify-cost measurement at least (each evaluates every batch size once).
const VERIFY_MIN_ROUNDS: usize = 9;

/// Tokens between two runs' prompts with [`BenchOptions::vary_prompts`].
pub const PROMPT_STRIDE: usize = 1009;

pub fn run(profile: &Profile, options: &BenchOptions) -> anyhow::Result<BenchReport> {
    let runs = options.runs.max(1);
    let file = specula_gguf::GgufFile::open(&profile.target.model)?;
    let tensor_types = tensor_types(&file);
    let kv_bytes_per_position = kv_bytes_per_position(&file, profile);
    let recurrent_bytes_per_token = recurrent_bytes_per_token(&file);
    drop(file);
    let mut plain_profile = profile.clone();
    plain_profile.drafter = None;
    // Plain decoding, but with room for the verify passes whose cost the bench measures.
    let mut pipeline =
        Pipeline::open_with_verify_tokens(&plain_profile, profile.speculation.draft_max + 1)?;
    let load_peak = proc_status_bytes("VmHWM:");
    let info = pipeline.info.clone();
    let capacity = pipeline.target.capabilities().max_verify_tokens.max(1);
    let threads = if profile.target.threads > 0 {
        profile.target.threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
    };

    let corpus_ids = pipeline.tokenizer.encode(DEFAULT_CORPUS, true, false);
    let prompt_tokens = options
        .prompt_tokens
        .clamp(1, info.context_size as usize / 2);
    if options.prompt_tokens > prompt_tokens {
        tracing::warn!(
            "a prompt of {} tokens leaves too little of the {}-token context to decode in; measuring a prompt of {prompt_tokens} (raise target.context_size for longer ones)",
            options.prompt_tokens,
            info.context_size
        );
    }
    let prompt_ids: Vec<u32> = corpus_ids.iter().copied().take(prompt_tokens).collect();
    let prompt_text = String::from_utf8_lossy(&pipeline.tokenizer.decode(&prompt_ids)).into_owned();

    let rounds = runs.max(VERIFY_MIN_ROUNDS);
    let oracles = options.drafters.iter().filter(|d| *d == "oracle").count();
    // With trees: chains and trees at fixed rows, and trees sized as the profile's adaptive
    // settings size them.
    let variants = 2 + usize::from(profile.speculation.adaptive);
    let drafter_runs = match options.tree {
        true => variants * (options.drafters.len() - oracles) + oracles,
        false => options.drafters.len(),
    };
    let total = 2 + runs + rounds + runs + 2 * runs * drafter_runs + rounds * oracles;
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:<28} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    bar.set_message("memory bandwidth");
    let bandwidth = read_bandwidth(options.bandwidth_bytes, threads as usize, 3);
    // The probe's buffer is not the model's: start the peak again from here (where the OS
    // cannot, the resident size after decoding stands in for the peak).
    let peak_reset = reset_peak_resident();
    bar.inc(1);

    // Prefill.
    bar.set_message("prefill");
    let target = &mut pipeline.target;
    let mut logits = RVec::new();
    let mut prefill = Vec::new();
    for _ in 0..runs {
        target.truncate(0).into_result()?;
        let start = Instant::now();
        target
            .eval(&prompt_ids, LogitRows::Last, &mut logits)
            .into_result()?;
        prefill.push(prompt_ids.len() as f64 / start.elapsed().as_secs_f64());
        bar.inc(1);
    }

    // Verify cost at the end of the prompt, for every batch size.
    bar.set_message("verify cost");
    let batch: Vec<u32> = corpus_ids[prompt_ids.len()..]
        .iter()
        .copied()
        .cycle()
        .take(capacity as usize)
        .collect();
    let ks: Vec<usize> = (1..=capacity as usize).collect();
    let seconds = verify_seconds(target, &prompt_ids, &batch, &ks, rounds, &bar)?;
    let verify: Vec<VerifyCost> = (1..=capacity)
        .zip(&seconds)
        .map(|(k, &cost)| VerifyCost {
            k,
            seconds: cost,
            ratio: cost / seconds[0],
        })
        .collect();

    // Plain decoding.
    bar.set_message("plain decode");
    // Each drafter run's prompt: the first for all unless they vary.
    let prompts: Vec<String> = match options.vary_prompts {
        false => vec![prompt_text.clone()],
        true => (0..runs)
            .map(|run| {
                let span = corpus_ids.len().saturating_sub(prompt_ids.len()).max(1);
                let at = run * PROMPT_STRIDE % span;
                let window = &corpus_ids[at..(at + prompt_ids.len()).min(corpus_ids.len())];
                String::from_utf8_lossy(&pipeline.tokenizer.decode(window)).into_owned()
            })
            .collect(),
    };
    let request = |speculation, run: usize| Request {
        prompt: prompts[run % prompts.len()].clone(),
        max_tokens: options.decode_tokens as u32,
        stop: Vec::new(),
        sampling: SamplingParams::greedy(),
        add_bos: true,
        speculation,
        cancel: Default::default(),
    };
    let mut plain_rates = Vec::new();
    let mut plain_output: Option<Outcome> = None;
    for _ in 0..runs {
        let outcome = generate(&mut pipeline, &request(None, 0), |_| {})?;
        plain_rates.push(outcome.timings.decode_tokens_per_second());
        plain_output = Some(outcome);
        bar.inc(1);
    }
    let plain = plain_output.context("no plain run")?;
    let decode_tps = median(plain_rates);
    let roofline_fraction = info.weight_bytes as f64 * decode_tps / bandwidth;
    let mean_context = prompt_ids.len() as f64 + options.decode_tokens as f64 / 2.0;
    let kv_bytes = kv_bytes_per_position.map(|kv| kv as f64 * mean_context);
    let roofline_with_kv_fraction =
        kv_bytes.map(|kv| (info.weight_bytes as f64 + kv) * decode_tps / bandwidth);
    let roofline_with_state_fraction = recurrent_bytes_per_token.map(|state| {
        (info.weight_bytes as f64 + kv_bytes.unwrap_or(0.0) + state as f64) * decode_tps / bandwidth
    });
    let run_peak = proc_status_bytes(if peak_reset { "VmHWM:" } else { "VmRSS:" });
    let peak_rss_bytes = load_peak.max(run_peak);
    drop(pipeline);

    // Drafters.
    let mut drafters = Vec::new();
    let mut skipped = Vec::new();
    let mut runs_to_make = Vec::new();
    for name in &options.drafters {
        if name == "oracle" && options.vary_prompts {
            skipped.push((
                name.clone(),
                "the oracle drafts from the first prompt's plain output: run it without \
                 --vary-prompts"
                    .to_string(),
            ));
            continue;
        }
        match drafter_setup(profile, name, &info, options) {
            // Chains and trees at the same rows per pass; then, where the profile adapts its
            // drafts, trees with the nodes that pay on the target's cost curve.
            Ok(Some((own, section))) if options.tree && name != "oracle" => {
                let fixed = SpecSettings {
                    draft_min: own.draft_max,
                    adaptive: false,
                    ..own
                };
                runs_to_make.push((name.clone(), Ok(Some((fixed, section.clone())))));
                let tree = SpecSettings {
                    tree: true,
                    ..fixed
                };
                runs_to_make.push((format!("{name} tree"), Ok(Some((tree, section.clone())))));
                if own.adaptive {
                    let adaptive = SpecSettings { tree: true, ..own };
                    let run = (
                        format!("{name} tree adaptive"),
                        Ok(Some((adaptive, section))),
                    );
                    runs_to_make.push(run);
                }
            }
            setup => runs_to_make.push((name.clone(), setup)),
        }
    }
    for (name, setup) in runs_to_make {
        let name = &name;
        bar.set_message(format!("drafter {name}"));
        let (settings, section) = match setup {
            Ok(Some(setup)) => setup,
            Ok(None) => {
                bar.inc(runs as u64);
                continue;
            }
            Err(reason) => {
                skipped.push((name.clone(), format!("{reason:#}")));
                bar.inc(runs as u64);
                continue;
            }
        };
        let mut p = profile.clone();
        p.drafter = Some(section);
        p.speculation.enabled = true;
        p.speculation.draft_max = settings.draft_max;
        p.speculation.adaptive = settings.adaptive;
        p.speculation.tree = settings.tree;
        // The oracle drafts from the plain run's exact tokens.
        let corpus = (name == "oracle").then(|| {
            let mut tokens = plain.prompt_tokens.clone();
            tokens.extend_from_slice(&plain.tokens);
            tokens
        });
        let mut pipeline = match Pipeline::open_with_corpus(&p, corpus) {
            Ok(pipeline) => pipeline,
            Err(e) => {
                skipped.push((name.clone(), format!("{e:#}")));
                bar.inc(runs as u64);
                continue;
            }
        };
        // Plain and speculative runs take turns, so that both see the same weights in
        // memory and the same moment of the machine.
        let (mut rates, mut plain_rates_here) = (Vec::new(), Vec::new());
        let mut matches_plain = true;
        let mut stats = crate::spec::SpecStats::default();
        let sampled = |speculation, run: usize| {
            let mut request = request(speculation, run);
            if options.temperature > 0.0 {
                // The profile's sampling filters at the temperature asked for.
                request.sampling = SamplingParams {
                    temperature: options.temperature,
                    seed: Some(run as u64),
                    ..SamplingParams::from(&profile.sampling)
                };
            }
            request
        };
        for run in 0..runs {
            let plain_here = generate(&mut pipeline, &sampled(None, run), |_| {})?;
            plain_rates_here.push(plain_here.timings.decode_tokens_per_second());
            bar.inc(1);
            let outcome = generate(&mut pipeline, &sampled(Some(settings), run), |_| {})?;
            matches_plain &= outcome.tokens == plain_here.tokens;
            rates.push(outcome.timings.decode_tokens_per_second());
            stats.merge(&outcome.speculative);
            bar.inc(1);
        }
        let (tps, plain_tps) = (median(rates), median(plain_rates_here));
        let speedup = tps / plain_tps;
        let s = &stats;
        let (verify_ratio, ideal, efficiency) = if name == "oracle" {
            let k = (settings.draft_max + 1).min(capacity) as usize;
            let seconds = verify_seconds(
                &mut pipeline.target,
                &prompt_ids,
                &batch,
                &[1, k],
                rounds,
                &bar,
            )?;
            let ratio = seconds[1] / seconds[0];
            let ideal = k as f64 / ratio;
            (Some(ratio), Some(ideal), Some(speedup / ideal))
        } else {
            (None, None, None)
        };
        drafters.push(DrafterRun {
            drafter: name.clone(),
            tree: settings.tree,
            decode_tokens_per_second: tps,
            plain_decode_tokens_per_second: plain_tps,
            speedup,
            acceptance: s.acceptance_rate(),
            mean_accepted_length: s.mean_accepted_length(),
            passes_per_token: s.passes_per_token(),
            output_matches_plain: (options.temperature <= 0.0).then_some(matches_plain),
            verify_ratio,
            ideal_speedup: ideal,
            efficiency,
        });
    }
    // Shared machines change speed under a run (other tenants' memory traffic): measured
    // again, the bandwidth shows whether the figures above saw the same machine.
    bar.set_message("memory bandwidth again");
    let bandwidth_at_end = read_bandwidth(options.bandwidth_bytes, threads as usize, 3);
    bar.inc(1);
    bar.finish_and_clear();

    Ok(BenchReport {
        model: info.name.to_string(),
        architecture: info.architecture.to_string(),
        tensor_types,
        weight_bytes: info.weight_bytes,
        threads,
        amx: specula_kernels::amx::amx_support().to_string(),
        simd: specula_kernels::simd::level().to_string(),
        bandwidth_bytes_per_second: bandwidth,
        bandwidth_at_end_bytes_per_second: bandwidth_at_end,
        prompt_tokens: prompt_ids.len(),
        prefill_tokens_per_second: median(prefill),
        decode_tokens_per_second: decode_tps,
        roofline_fraction,
        kv_bytes_per_position,
        roofline_with_kv_fraction,
        recurrent_bytes_per_token,
        roofline_with_state_fraction,
        peak_rss_bytes,
        verify,
        drafters,
        skipped,
    })
}

/// The median time of one target pass over `batch[..k]` at the end of `prompt`, for each `k`
/// in `ks`. The batch sizes take turns within each of `rounds` repetitions (k = 1, 2, …, then
/// again), so a drift of the machine's speed moves every k alike instead of skewing their
/// ratios; a first round warms up and is not counted.
fn verify_seconds(
    target: &mut SeqModel,
    prompt: &[u32],
    batch: &[u32],
    ks: &[usize],
    rounds: usize,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<f64>> {
    let mut logits = RVec::new();
    target.truncate(0).into_result()?;
    target
        .eval(prompt, LogitRows::Last, &mut logits)
        .into_result()?;
    let mut times = vec![Vec::new(); ks.len()];
    for round in 0..=rounds {
        for (&k, times) in ks.iter().zip(&mut times) {
            target.truncate(prompt.len()).into_result()?;
            let start = Instant::now();
            target
                .eval(&batch[..k], LogitRows::All, &mut logits)
                .into_result()?;
            if round > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        if round > 0 {
            bar.inc(1);
        }
    }
    Ok(times.into_iter().map(median).collect())
}

/// The drafter section and settings for one named drafter; `None` when it is measured
/// already (as `profile`), an error saying why when it cannot run on this model.
fn drafter_setup(
    profile: &Profile,
    name: &str,
    info: &specula_plugin_api::ModelInfo,
    options: &BenchOptions,
) -> anyhow::Result<Option<(SpecSettings, DrafterSection)>> {
    let settings = SpecSettings::from(&profile.speculation);
    Ok(match name {
        "profile" => profile.drafter.clone().map(|d| (settings, d)),
        "mtp" if !info.has_mtp_head => anyhow::bail!(
            "{} has no MTP head (nextn_predict_layers is 0), so there is nothing to draft with",
            profile.target.model.display()
        ),
        "oracle" => {
            let mut s = DrafterSection::named("lookup");
            // The corpus holds the whole run, so its match is the longest: a long n_max lets
            // it beat shorter repeats inside the context.
            s.options.insert("n_min".into(), toml::Value::Integer(1));
            s.options.insert("n_max".into(), toml::Value::Integer(64));
            let k = options.oracle_k.max(2);
            Some((
                SpecSettings {
                    draft_min: k - 1,
                    draft_max: k - 1,
                    adaptive: false,
                    tree: false,
                },
                s,
            ))
        }
        other => {
            let measured_as_profile = options.drafters.iter().any(|d| d == "profile")
                && profile.drafter.as_ref().is_some_and(|d| d.plugin == other);
            if measured_as_profile {
                None
            } else {
                Some((settings, DrafterSection::named(other)))
            }
        }
    })
}

/// The report as a table.
pub fn render(report: &BenchReport) -> String {
    let gb = |b: f64| b / 1e9;
    let mut out = String::new();
    out += &format!(
        "model: {} ({}), {:.1} MiB of weights per token, {} threads\n",
        report.model,
        report.architecture,
        report.weight_bytes as f64 / (1 << 20) as f64,
        report.threads
    );
    let file_bytes: u64 = report.tensor_types.iter().map(|s| s.bytes).sum();
    let shares: Vec<String> = report
        .tensor_types
        .iter()
        .map(|s| {
            format!(
                "{} {:.1}% ({} tensors)",
                s.ty,
                100.0 * s.bytes as f64 / file_bytes.max(1) as f64,
                s.tensors
            )
        })
        .collect();
    out += &format!(
        "tensor types (of the file's bytes): {}\n",
        shares.join(", ")
    );
    out += &format!(
        "SIMD level: {}; AMX tiles: {} (multi-row Q8_0 passes use them at level amx)\n",
        report.simd, report.amx
    );
    if let Some(rss) = report.peak_rss_bytes {
        out += &format!(
            "peak resident memory: {:.1} MiB (the model loaded, verifying and decoding)\n",
            rss as f64 / (1 << 20) as f64
        );
    }
    out += &format!(
        "memory read bandwidth: {:.1} GB/s ({:.1} GB/s at the end of the run)\n",
        gb(report.bandwidth_bytes_per_second),
        gb(report.bandwidth_at_end_bytes_per_second)
    );
    if let Some(drift) = report.bandwidth_drift() {
        out += &format!(
            "warning: the memory bandwidth moved by {:+.0}% during the run; the machine's speed changed under it, so its figures (ratios and roofline included) are not comparable with each other\n",
            100.0 * drift
        );
    }
    out += &format!(
        "prefill ({} tokens): {:.1} t/s\n",
        report.prompt_tokens, report.prefill_tokens_per_second
    );
    out += &format!(
        "plain decode: {:.2} t/s = {:.1}% of the memory roofline ({:.2} t/s at {:.1} GB/s)\n",
        report.decode_tokens_per_second,
        100.0 * report.roofline_fraction,
        report.bandwidth_bytes_per_second / report.weight_bytes.max(1) as f64,
        gb(report.bandwidth_bytes_per_second)
    );
    if let (Some(kv), Some(fraction)) = (
        report.kv_bytes_per_position,
        report.roofline_with_kv_fraction,
    ) {
        out += &format!(
            "  with the KV cache read ({:.1} KiB per position): {:.1}% of the roofline of weights + KV\n",
            kv as f64 / 1024.0,
            100.0 * fraction
        );
    }
    if let (Some(state), Some(fraction)) = (
        report.recurrent_bytes_per_token,
        report.roofline_with_state_fraction,
    ) {
        out += &format!(
            "  with the recurrent state read and written ({:.1} MiB per token): {:.1}% of the roofline of weights + KV + state\n",
            state as f64 / (1 << 20) as f64,
            100.0 * fraction
        );
    }
    out += "verify cost ratio cost(k)/cost(1):";
    for v in &report.verify {
        out += &format!(" k={} {:.2}", v.k, v.ratio);
    }
    out += "\n\n";
    out += "speedups are against plain decoding in each drafter's own pipeline (same weights in memory, runs taking turns)\n";
    // The drafter column as wide as its longest name ("lookup tree adaptive").
    let w = report
        .drafters
        .iter()
        .map(|d| d.drafter.len())
        .max()
        .unwrap_or(0)
        .max(10);
    out += &format!(
        "{:<w$} {:>10} {:>10} {:>8} {:>10} {:>10} {:>12} {:>8}\n",
        "drafter",
        "decode t/s",
        "plain t/s",
        "speedup",
        "acceptance",
        "mean acc.",
        "passes/token",
        "= plain"
    );
    for d in &report.drafters {
        out += &format!(
            "{:<w$} {:>10.2} {:>10.2} {:>7.2}x {:>9.1}% {:>10.2} {:>12.3} {:>8}\n",
            d.drafter,
            d.decode_tokens_per_second,
            d.plain_decode_tokens_per_second,
            d.speedup,
            100.0 * d.acceptance,
            d.mean_accepted_length,
            d.passes_per_token,
            match d.output_matches_plain {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "sampled",
            }
        );
        if let (Some(ratio), Some(ideal), Some(eff)) =
            (d.verify_ratio, d.ideal_speedup, d.efficiency)
        {
            out += &format!(
                "{:<w$} ideal speedup k/ratio(k) = {ideal:.2}x (ratio {ratio:.2} in this pipeline), reached {:.1}% of it\n",
                "",
                100.0 * eff
            );
        }
    }
    for (name, reason) in &report.skipped {
        out += &format!("skipped {name}: {reason}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(start: f64, end: f64) -> BenchReport {
        BenchReport {
            model: "m".into(),
            architecture: "llama".into(),
            tensor_types: vec![
                TensorTypeShare {
                    ty: "Q4_K".into(),
                    tensors: 3,
                    bytes: 3 << 20,
                },
                TensorTypeShare {
                    ty: "Q6_K".into(),
                    tensors: 1,
                    bytes: 1 << 20,
                },
            ],
            weight_bytes: 1 << 20,
            threads: 2,
            amx: "not on this CPU".into(),
            simd: "avx512".into(),
            bandwidth_bytes_per_second: start,
            bandwidth_at_end_bytes_per_second: end,
            prompt_tokens: 8,
            prefill_tokens_per_second: 100.0,
            decode_tokens_per_second: 10.0,
            roofline_fraction: 0.5,
            kv_bytes_per_position: Some(2048),
            roofline_with_kv_fraction: Some(0.6),
            recurrent_bytes_per_token: Some(3 << 19),
            roofline_with_state_fraction: Some(0.7),
            peak_rss_bytes: Some(3 << 20),
            verify: vec![VerifyCost {
                k: 1,
                seconds: 0.01,
                ratio: 1.0,
            }],
            drafters: Vec::new(),
            skipped: Vec::new(),
        }
    }

    /// A dense model's every layer holds KV, a hybrid's full-attention layers only; an f32
    /// cache doubles it.
    #[test]
    fn kv_bytes_per_position_counts_the_attention_layers() {
        let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models");
        for (model, hybrid) in [
            ("stories260K.gguf", false),
            ("fixtures/tiny-qwen35-mtp.gguf", true),
        ] {
            let path = shared.join(model);
            let file = specula_gguf::GgufFile::open(&path).unwrap();
            let hp = specula_gguf::HParams::from_gguf(&file).unwrap();
            let layers = match hybrid {
                true => {
                    let h = specula_gguf::HybridParams::from_gguf(&file, &hp).unwrap();
                    let attention = h.recurrent.iter().filter(|&&r| !r).count() as u64;
                    assert!(attention > 0 && attention < u64::from(h.n_trunk), "{model}");
                    attention
                }
                false => u64::from(hp.block_count),
            };
            let per_layer = u64::from(hp.k_width() + hp.v_width());
            let mut profile = Profile::builtin_default(path.clone());
            assert_eq!(
                kv_bytes_per_position(&file, &profile),
                Some(2 * layers * per_layer),
                "{model}"
            );
            profile
                .target
                .options
                .insert("kv_type".into(), toml::Value::String("f32".into()));
            assert_eq!(
                kv_bytes_per_position(&file, &profile),
                Some(4 * layers * per_layer),
                "{model}"
            );
        }
    }

    /// A hybrid moves each GDN layer's S matrices and convolution rows both ways per token; a
    /// dense model has no recurrent state.
    #[test]
    fn recurrent_bytes_per_token_counts_the_gdn_layers() {
        let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models");
        let dense = specula_gguf::GgufFile::open(shared.join("stories260K.gguf")).unwrap();
        assert_eq!(recurrent_bytes_per_token(&dense), None);
        let path = shared.join("fixtures/tiny-qwen35-mtp.gguf");
        let file = specula_gguf::GgufFile::open(&path).unwrap();
        let hp = specula_gguf::HParams::from_gguf(&file).unwrap();
        let h = specula_gguf::HybridParams::from_gguf(&file, &hp).unwrap();
        let gdn = h.recurrent.iter().filter(|&&r| r).count() as u64;
        assert!(gdn > 0 && gdn < u64::from(h.n_trunk));
        let (s, hv, hk) = (
            u64::from(h.state_size),
            u64::from(h.time_step_rank),
            u64::from(h.group_count),
        );
        let conv_rows = u64::from(h.conv_kernel) - 1;
        let per_layer = hv * s * s + conv_rows * (2 * hk * s + hv * s);
        assert_eq!(recurrent_bytes_per_token(&file), Some(8 * gdn * per_layer));
    }

    #[test]
    fn a_bandwidth_that_moved_during_the_run_is_flagged() {
        assert_eq!(report(40e9, 44e9).bandwidth_drift(), None);
        let text = render(&report(40e9, 44e9));
        assert!(text.contains("40.0 GB/s (44.0 GB/s at the end"), "{text}");
        assert!(text.contains("peak resident memory: 3.0 MiB"), "{text}");
        assert!(
            text.contains("SIMD level: avx512; AMX tiles: not on this CPU"),
            "{text}"
        );
        assert!(
            text.contains("(2.0 KiB per position): 60.0% of the roofline of weights + KV"),
            "{text}"
        );
        assert!(
            text.contains("(1.5 MiB per token): 70.0% of the roofline of weights + KV + state"),
            "{text}"
        );
        #[cfg(target_os = "linux")]
        assert!(proc_status_bytes("VmRSS:").is_some_and(|b| b > 0));
        assert!(
            text.contains("tensor types (of the file's bytes): Q4_K 75.0% (3 tensors), Q6_K 25.0% (1 tensors)"),
            "{text}"
        );
        assert!(!text.contains("warning"), "{text}");
        let drift = report(40e9, 60e9).bandwidth_drift().expect("a drift");
        assert!((drift - 0.5).abs() < 1e-9);
        assert!(render(&report(40e9, 60e9)).contains("moved by +50%"));
        assert!(report(60e9, 40e9).bandwidth_drift().unwrap() < 0.0);
    }
}
