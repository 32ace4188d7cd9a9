//! `specula bench`.

use std::process::ExitCode;

use anyhow::Context;

use crate::bench::concurrency::{self, ConcurrencyOptions};
use crate::bench::{render, run, write_concurrency_svg, write_svg, BenchOptions};
use crate::profile::Profile;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("measured").required(true).args(["profile", "model"])))]
pub struct BenchArgs {
    /// The profile to measure.
    #[arg(short, long, value_name = "FILE")]
    profile: Option<std::path::PathBuf>,
    /// A GGUF model to measure without a profile (cpu-simd, the profile defaults).
    #[arg(short = 'm', long, value_name = "FILE")]
    model: Option<std::path::PathBuf>,
    /// Repetitions per figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens decoded per run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Drafters to compare (comma-separated): profile, lookup, model, mtp, oracle, or a drafter
    /// plugin's name or path.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "profile,lookup,mtp,oracle"
    )]
    drafters: Vec<String>,
    /// Verify batch size of the oracle run.
    #[arg(long, default_value_t = 4)]
    oracle_k: u32,
    /// Run each drafter (but the oracle) twice at the profile's `draft_max` + 1 rows per
    /// pass: drafting chains, then trees (tree speculation); with `adaptive = true` in the
    /// profile, a third time with trees sized by the target's cost curve.
    #[arg(long)]
    tree: bool,
    /// Sample the drafter runs (and the plain runs they are compared with) at this
    /// temperature, with the profile's other sampling settings and a seed per run; 0 = greedy.
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    temp: f32,
    /// Start each drafter run from its own window of the built-in text (run i about i × 1,000
    /// tokens in) instead of every run from its opening: acceptance measured over more text
    /// (the oracle, which drafts from the first prompt's plain output, is then skipped).
    #[arg(long)]
    vary_prompts: bool,
    /// Worker threads (overrides the profile).
    #[arg(short, long)]
    threads: Option<u32>,
    /// Instead of the drafters: aggregate decode t/s with N sequences decoding together in one
    /// instance for each N given (comma-separated, e.g. 1,2,4,8), the cost of one pass of
    /// 1..16 rows, and the prefill of a repeated 400-token prompt.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    concurrency: Option<Vec<usize>>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also draw the verify cost against k and each drafter's speedup (with the ideal
    /// k / cost(k)) as an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
}

pub fn run_cli(args: BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.runs > 0,
        "--runs 0: every figure is the median of at least one run"
    );
    let mut profile = match (&args.profile, &args.model) {
        (Some(path), _) => Profile::load(path)?,
        (None, Some(model)) => {
            anyhow::ensure!(
                model.is_file(),
                "-m {}: no such file (expected a GGUF model)",
                model.display()
            );
            Profile::builtin_default(model.clone())
        }
        (None, None) => unreachable!("clap requires --profile or -m"),
    };
    if let Some(t) = args.threads {
        profile.target.threads = t;
    }
    if args.concurrency.is_none() {
        check_drafter_names(&profile, &args.drafters)?;
    }
    if let Some(sequences) = args.concurrency {
        let options = ConcurrencyOptions {
            sequences,
            runs: args.runs,
            prompt_tokens: args.prompt_tokens,
            decode_tokens: args.tokens,
            ..ConcurrencyOptions::default()
        };
        let report = concurrency::run(&profile, &options)?;
        if let Some(path) = &args.plot {
            write_concurrency_svg(&report, path)?;
            eprintln!("plot written to {}", path.display());
        }
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", concurrency::render(&report));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let options = BenchOptions {
        runs: args.runs,
        prompt_tokens: args.prompt_tokens,
        decode_tokens: args.tokens,
        drafters: args.drafters,
        oracle_k: args.oracle_k,
        tree: args.tree,
        temperature: args.temp,
        vary_prompts: args.vary_prompts,
        ..BenchOptions::default()
    };
    let report = run(&profile, &options)?;
    if let Some(path) = &args.plot {
        write_svg(&report, path)?;
        eprintln!("plot written to {}", path.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(ExitCode::SUCCESS)
}

/// The drafters `bench` measures without a plugin of that name.
const BUILT_IN_DRAFTERS: [&str; 5] = ["profile", "lookup", "model", "mtp", "oracle"];

/// Refuses a `--drafters` name that is neither a drafter `bench` knows nor a drafter plugin
/// (a typo would otherwise only show as a skipped row at the end of the run).
fn check_drafter_names(profile: &Profile, names: &[String]) -> anyhow::Result<()> {
    let search = crate::plugins::SearchPath::new(&profile.plugin_dir);
    for name in names {
        if !BUILT_IN_DRAFTERS.contains(&name.as_str()) {
            search
                .load(name, specula_plugin_api::PluginKind::Drafter)
                .with_context(|| {
                    format!(
                        "--drafters: '{name}' is none of {} nor a drafter plugin",
                        BUILT_IN_DRAFTERS.join(", ")
                    )
                })?;
        }
    }
    Ok(())
}
