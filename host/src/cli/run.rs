//! `specula run`: generate text from a prompt.

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use anyhow::Context;

use super::ProfileArg;
use crate::builtin;
use crate::pipeline::Pipeline;
use crate::profile::DrafterSection;
use crate::profile::Profile;
use crate::request::{summary, Outcome, Request};
use crate::sampling::SamplingParams;
use crate::spec::{generate, SpecSettings};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The prompt; read from stdin (without its final line end) when absent and stdin is not a
    /// terminal. Empty = start from BOS.
    prompt: Option<String>,
    #[command(flatten)]
    profile: ProfileArg,
    /// A GGUF model to run, without a profile (or instead of the profile's model).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    model: Option<std::path::PathBuf>,
    /// Backend plugin (name or library path) for the model; default cpu-simd.
    #[arg(long, value_name = "NAME")]
    backend: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", value_name = "N")]
    max_tokens: Option<u32>,
    /// Stop when this string appears (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    stop: Vec<String>,
    /// Sampling temperature; 0 = greedy [profile's, else 0.8].
    #[arg(
        long = "temp",
        alias = "temperature",
        value_name = "T",
        allow_negative_numbers = true
    )]
    temperature: Option<f32>,
    /// Sample from the K most likely tokens; 0 = all [profile's, else 40].
    #[arg(long, value_name = "K")]
    top_k: Option<u32>,
    /// Sample from the smallest set of tokens whose probabilities reach P; 1 = off [else 0.95].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one; 0 = off [else 0.05].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    min_p: Option<f32>,
    /// Divide the logits of recently seen tokens by R; 1 = off [else 1.0].
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    repeat_penalty: Option<f32>,
    /// How many recent tokens the repetition penalty looks at [else 64].
    #[arg(long, value_name = "N")]
    repeat_last_n: Option<u32>,
    /// Seed of the sampler, for reproducible sampling [else random].
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Worker threads of the backend (0 = one per core).
    #[arg(short, long, value_name = "N")]
    threads: Option<u32>,
    /// Context size in tokens (0 = the model's).
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    context_size: Option<u32>,
    /// Do not prepend BOS to the prompt.
    #[arg(long)]
    no_bos: bool,
    /// Drafter plugin for speculative decoding (`lookup`, `model`, `mtp`, or `none`).
    #[arg(long, value_name = "NAME")]
    drafter: Option<String>,
    /// Draft model for model drafting (implies `--drafter model` when no drafter is set).
    #[arg(long, value_name = "FILE")]
    draft_model: Option<std::path::PathBuf>,
    /// Most draft tokens per step.
    #[arg(long)]
    draft_max: Option<u32>,
    /// Fewest draft tokens per step while speculating.
    #[arg(long)]
    draft_min: Option<u32>,
    /// Draft the maximum every step: turn off the adaptive draft length (which shortens drafts
    /// and pauses speculation when it does not pay, judged partly by measured time).
    #[arg(long)]
    fixed_draft: bool,
    /// Plain decoding: ignore the profile's drafter.
    #[arg(long)]
    no_spec: bool,
    /// Print one JSON object (text, token ids, timings, speculation statistics) instead of
    /// streaming text.
    #[arg(long)]
    json: bool,
    /// Greedy speculative runs: decode again without drafts and report whether the tokens are
    /// identical (the built-in default always does).
    #[arg(long)]
    check_plain: bool,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    refuse_a_model_as_prompt(args.prompt.as_deref())?;
    let builtin = args.profile.profile.is_none() && args.model.is_none();
    let mut profile = match (&args.profile.profile, &args.model) {
        (Some(path), _) => Profile::load(path)?,
        (None, Some(model)) => Profile::builtin_default(model.clone()),
        (None, None) => builtin::profile(builtin::model_path()?),
    };
    if builtin {
        eprintln!(
            "no --profile or -m given: the built-in default, {} ({})",
            builtin::DESCRIPTION,
            profile.target.model.display()
        );
    }
    apply_overrides(&mut profile, &args)?;
    let prompt = read_prompt(args.prompt.clone())?;

    let mut pipeline = Pipeline::open(&profile)?;
    let request = Request {
        prompt,
        max_tokens: profile.generation.max_tokens,
        stop: profile.generation.stop.clone(),
        sampling: SamplingParams::from(&profile.sampling),
        add_bos: profile.generation.add_bos,
        speculation: pipeline
            .drafter
            .is_some()
            .then(|| SpecSettings::from(&profile.speculation)),
        cancel: Default::default(),
    };

    let stdout = std::io::stdout();
    let json = args.json;
    let outcome = generate(&mut pipeline, &request, |piece| {
        if !json {
            let mut out = stdout.lock();
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
    })?;
    if json {
        let value = serde_json::json!({
            "model": pipeline.info.name.as_str(),
            "text": outcome.text,
            "prompt_tokens": outcome.prompt_tokens,
            "tokens": outcome.tokens,
            "stop_reason": outcome.stop_reason,
            "timings": outcome.timings,
            "speculative": outcome.speculative,
        });
        println!("{value}");
    } else {
        println!();
        eprintln!("{}", summary(&outcome.timings));
        if let Some(slot) = &pipeline.drafter {
            eprintln!("drafter: {}", slot.name);
            eprintln!("{}", outcome.speculative.report());
        }
    }
    let speculated = request.speculation.is_some() && outcome.speculative.drafted > 0;
    if (args.check_plain || builtin) && speculated && request.sampling.temperature <= 0.0 {
        return check_plain(&mut pipeline, &request, &outcome);
    }
    Ok(ExitCode::SUCCESS)
}

/// Decodes `request` again without drafts and says whether the tokens equal `speculative`'s
/// (greedy speculation must give exactly plain decoding's output); exit status 1 if not.
fn check_plain(
    pipeline: &mut Pipeline,
    request: &Request,
    speculative: &Outcome,
) -> anyhow::Result<ExitCode> {
    let plain_request = Request {
        speculation: None,
        ..request.clone()
    };
    let plain = generate(pipeline, &plain_request, |_| {})?;
    let speculative_passes = speculative.speculative.target_passes;
    let speculative = &speculative.tokens;
    match plain
        .tokens
        .iter()
        .zip(speculative)
        .position(|(a, b)| a != b)
    {
        None if plain.tokens.len() == speculative.len() => {
            eprintln!(
                "check: plain decoding (no drafts) gives the same {} tokens: the output is exactly plain decoding's, in {} target passes instead of {}",
                speculative.len(),
                speculative_passes,
                plain.speculative.target_passes,
            );
            Ok(ExitCode::SUCCESS)
        }
        first => {
            let at = first.unwrap_or(plain.tokens.len().min(speculative.len()));
            eprintln!(
                "check FAILED: plain decoding differs from the speculative output at token {at} ({} vs {} tokens); please report this",
                plain.tokens.len(),
                speculative.len()
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `specula run model.gguf` is a common slip: the model goes after `-m`.
fn refuse_a_model_as_prompt(prompt: Option<&str>) -> anyhow::Result<()> {
    if let Some(p) = prompt {
        let path = std::path::Path::new(p);
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            && path.is_file()
        {
            anyhow::bail!(
                "the prompt {p:?} is a model file; to run it, write `specula run -m {p} \"your prompt\"`"
            );
        }
    }
    Ok(())
}

fn apply_overrides(profile: &mut Profile, args: &RunArgs) -> anyhow::Result<()> {
    let s = &mut profile.sampling;
    if let Some(v) = args.temperature {
        anyhow::ensure!(
            v >= 0.0 && v.is_finite(),
            "--temp {v}: must be a finite number >= 0"
        );
        s.temperature = v;
    }
    if let Some(v) = args.top_k {
        s.top_k = v;
    }
    if let Some(v) = args.top_p {
        anyhow::ensure!(v > 0.0 && v <= 1.0, "--top-p {v}: must be in (0, 1]");
        s.top_p = v;
    }
    if let Some(v) = args.min_p {
        anyhow::ensure!((0.0..=1.0).contains(&v), "--min-p {v}: must be in [0, 1]");
        s.min_p = v;
    }
    if let Some(v) = args.repeat_penalty {
        anyhow::ensure!(
            v > 0.0 && v.is_finite(),
            "--repeat-penalty {v}: must be > 0"
        );
        s.repeat_penalty = v;
    }
    if let Some(v) = args.repeat_last_n {
        s.repeat_last_n = v;
    }
    if args.seed.is_some() {
        s.seed = args.seed;
    }
    if let Some(v) = args.max_tokens {
        profile.generation.max_tokens = v;
    }
    if !args.stop.is_empty() {
        anyhow::ensure!(
            args.stop.iter().all(|s| !s.is_empty()),
            "--stop: stop strings must not be empty"
        );
        profile.generation.stop = args.stop.clone();
    }
    if args.no_bos {
        profile.generation.add_bos = false;
    }
    if let Some(model) = &args.model {
        profile.target.model = model.clone();
    }
    if let Some(backend) = &args.backend {
        profile.target.backend = backend.clone();
    }
    if let Some(v) = args.threads {
        profile.target.threads = v;
    }
    if let Some(v) = args.context_size {
        profile.target.context_size = v;
    }
    match args.drafter.as_deref() {
        Some("none") => profile.drafter = None,
        Some(name) => match &mut profile.drafter {
            Some(section) => section.plugin = name.to_string(),
            None => profile.drafter = Some(DrafterSection::named(name)),
        },
        None => {}
    }
    if let Some(model) = &args.draft_model {
        let section = profile
            .drafter
            .get_or_insert_with(|| DrafterSection::named("model"));
        section.model = Some(model.clone());
    }
    let spec = &mut profile.speculation;
    if let Some(v) = args.draft_max {
        anyhow::ensure!(v <= 64, "--draft-max {v}: at most 64");
        spec.draft_max = v;
    }
    if let Some(v) = args.draft_min {
        spec.draft_min = v;
    }
    anyhow::ensure!(
        spec.draft_min <= spec.draft_max,
        "--draft-min {} is larger than the draft maximum {}",
        spec.draft_min,
        spec.draft_max
    );
    if args.fixed_draft {
        spec.adaptive = false;
    }
    if args.no_spec {
        spec.enabled = false;
    }
    Ok(())
}

fn read_prompt(arg: Option<String>) -> anyhow::Result<String> {
    if let Some(p) = arg {
        return Ok(p);
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(String::new());
    }
    let mut text = String::new();
    stdin
        .lock()
        .read_to_string(&mut text)
        .context("cannot read the prompt from stdin")?;
    // `echo TEXT | specula run` means TEXT: drop the one line end the shell added.
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}
