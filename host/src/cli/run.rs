//! `specula run`: generate text from a prompt.

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use anyhow::Context;

use super::ProfileArg;
use crate::genmodel::{default_model_path, write_demo_model, DEMO_DESCRIPTION};
use crate::pipeline::Pipeline;
use crate::profile::DrafterSection;
use crate::profile::Profile;
use crate::request::{summary, Request};
use crate::sampling::SamplingParams;
use crate::spec::{generate, SpecSettings};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The prompt; read from stdin (without its final line end) when absent and stdin is not a
    /// terminal. Empty = start from BOS.
    prompt: Option<String>,
    #[command(flatten)]
    profile: ProfileArg,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", value_name = "N")]
    max_tokens: Option<u32>,
    /// Stop when this string appears (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    stop: Vec<String>,
    /// Sampling temperature; 0 = greedy.
    #[arg(long = "temp", alias = "temperature")]
    temperature: Option<f32>,
    #[arg(long)]
    top_k: Option<u32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repeat_penalty: Option<f32>,
    #[arg(long)]
    repeat_last_n: Option<u32>,
    #[arg(long)]
    seed: Option<u64>,
    /// Worker threads of the backend (0 = one per core).
    #[arg(short, long)]
    threads: Option<u32>,
    /// Context size in tokens (0 = the model's).
    #[arg(long = "ctx-size")]
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
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut profile = match &args.profile.profile {
        Some(path) => Profile::load(path)?,
        None => default_profile()?,
    };
    apply_overrides(&mut profile, &args)?;
    let prompt = read_prompt(args.prompt.clone())?;

    let mut pipeline = Pipeline::open(&profile)
        .with_context(|| format!("cannot open the model {}", profile.target.model.display()))?;
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
    Ok(ExitCode::SUCCESS)
}

/// The built-in profile: cpu-simd on the demo model, written on first use.
fn default_profile() -> anyhow::Result<Profile> {
    let model = default_model_path();
    if !model.is_file() {
        eprintln!(
            "no --profile given: writing the built-in default model to {} ({DEMO_DESCRIPTION})",
            model.display()
        );
        write_demo_model(&model)?;
    }
    Ok(Profile::builtin_default(model))
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
