//! `specula run`: generate text from a prompt.

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use anyhow::Context;

use super::setup::Setup;
use crate::pipeline::Pipeline;
use crate::request::{summary, Outcome, Request, StopReason};
use crate::sampling::SamplingParams;
use crate::spec::{generate, SpecSettings};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The prompt; read from stdin (without its final line end) when absent and stdin is not a
    /// terminal. Empty = start from BOS.
    prompt: Option<String>,
    #[command(flatten)]
    setup: Setup,
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
    let (profile, builtin) = args.setup.profile()?;
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
        if outcome.stop_reason == StopReason::ContextFull {
            eprintln!(
                "stopped: the context of {} tokens is full{}",
                pipeline.info.context_size,
                if pipeline.info.context_size < pipeline.info.train_context_length {
                    format!(
                        "; raise it with -c or target.context_size (the model was trained for {})",
                        pipeline.info.train_context_length
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    let skipped = if request.speculation.is_none() {
        Some("there is no drafter")
    } else if request.sampling.temperature > 0.0 {
        Some("sampled output is not plain decoding's token for token; use --temp 0")
    } else if outcome.speculative.drafted == 0 {
        Some("no drafts were made")
    } else {
        None
    };
    match skipped {
        None if args.check_plain || builtin => check_plain(&mut pipeline, &request, &outcome),
        Some(why) if args.check_plain => {
            eprintln!("check: skipped ({why})");
            Ok(ExitCode::SUCCESS)
        }
        _ => Ok(ExitCode::SUCCESS),
    }
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
