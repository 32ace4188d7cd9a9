//! The `specula` command line.

mod bench;
mod chat;
mod gen_model;
mod plugins;
mod profile;
mod run;
mod serve;
mod setup;
mod tokens;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Specula: speculative decoding that pays off, on your own machine.
#[derive(Debug, Parser)]
#[command(name = "specula", version, long_about = None)]
pub struct Cli {
    /// Log filter (e.g. `info`, `specula=debug`); also read from SPECULA_LOG.
    #[arg(long, global = true, value_name = "FILTER")]
    pub log: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text from a prompt (argument or stdin).
    Run(run::RunArgs),
    /// Talk with a model, turn by turn, through its chat template.
    Chat(chat::ChatArgs),
    /// List the plugins found in the plugin search path, and why any library was rejected.
    Plugins(plugins::PluginsArgs),
    /// Work with profiles.
    #[command(subcommand)]
    Profile(profile::ProfileCommand),
    /// Write a GGUF model of a given shape with random (or demo) weights.
    GenModel(gen_model::GenModelArgs),
    /// Measure prefill, decode, verify cost and speculative speedups of a profile.
    Bench(bench::BenchArgs),
    /// Serve profiles over an OpenAI-compatible HTTP API, reloading them when they change.
    #[command(long_about = serve::LONG_ABOUT)]
    Serve(serve::ServeArgs),
    /// Split text into a model's tokens (ids and pieces).
    Tokenize(tokens::TokenizeArgs),
    /// Turn token ids back into text.
    Detokenize(tokens::DetokenizeArgs),
}

/// Parses the command line, runs it, and turns errors into a message and exit code 1.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The daemon logs its life cycle (loads, reloads, shutdown) by default.
    let default_filter = match cli.command {
        Command::Serve(_) => "warn,specula_host::serve=info",
        _ => "warn",
    };
    init_logging(cli.log.as_deref(), default_filter);
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Plugins(args) => plugins::run(args),
        Command::Profile(cmd) => profile::run(cmd),
        Command::GenModel(args) => gen_model::run(args),
        Command::Bench(args) => bench::run_cli(args),
        Command::Serve(args) => serve::run_cli(args),
        Command::Tokenize(args) => tokens::tokenize(args),
        Command::Detokenize(args) => tokens::detokenize(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", error_chain(&err));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined by `: `, leaving out a cause whose text the message so far
/// already carries (errors that print their source *and* expose it would say it twice).
fn error_chain(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn init_logging(filter: Option<&str>, default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = filter
        .map(EnvFilter::new)
        .or_else(|| EnvFilter::try_from_env("SPECULA_LOG").ok())
        .unwrap_or_else(|| EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let gguf = specula_gguf::GgufError::Io {
            path: "m.gguf".into(),
            source: io,
        };
        let err = anyhow::Error::new(gguf).context("cannot open the model");
        assert_eq!(
            error_chain(&err),
            "cannot open the model: cannot read m.gguf: No such file or directory"
        );
    }
}

/// `--profile FILE`, shared by several commands.
#[derive(Debug, Clone, clap::Args)]
pub struct ProfileArg {
    /// Profile (TOML) naming the backend, model, drafter and defaults.
    #[arg(short, long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
}
