//! `specula serve`: the OpenAI-compatible daemon (see [`crate::serve`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::serve::{run, ServeOptions};

/// `specula serve --help`.
pub(super) const LONG_ABOUT: &str = "\
Serve profiles over an OpenAI-compatible HTTP API.

Each profile file is a model named by its file stem (profiles/stories.toml is `stories`).
Endpoints:
  POST /v1/completions, POST /v1/chat/completions   (\"stream\": true for SSE)
  GET  /v1/models
  GET  /health          200 when at least one profile is ready, with per-profile status
  GET  /metrics         Prometheus text: requests, tokens, latency, queue, speculation
  POST /admin/reload    reload now; {\"model\": NAME} for one, {\"force\": true} even if unchanged

Profiles reload when their files change, on SIGHUP, and on POST /admin/reload: a changed
profile loads beside the serving one and takes new requests once ready; requests already
running finish on the old one; a profile that fails to load leaves the old one serving and
reports why in /health, the log and the reload response. Each profile serves `[serve] slots`
requests at once (default 2, each slot its own backend instance) with up to `[serve] queue`
more waiting (default 16; beyond that: 503). SIGTERM or Ctrl-C stops accepting connections
and waits for requests in flight (up to --drain-timeout) before exiting with status 0.";

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Profile directories (every *.toml file in them) and profile files.
    #[arg(long, value_name = "DIR|FILE", num_args = 1.., required = true)]
    profiles: Vec<PathBuf>,
    /// Address to listen on; port 0 picks a free port. The address is printed on stdout.
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Quiet time after the last profile file change before reloading.
    #[arg(long, value_name = "MS", default_value_t = 250)]
    debounce_ms: u64,
    /// Longest wait for requests in flight at shutdown.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    drain_timeout: u64,
    /// Do not watch profile files (reload with SIGHUP or POST /admin/reload only).
    #[arg(long)]
    no_watch: bool,
}

pub fn run_cli(args: ServeArgs) -> anyhow::Result<ExitCode> {
    run(ServeOptions {
        profiles: args.profiles,
        listen: args.listen,
        debounce: Duration::from_millis(args.debounce_ms),
        drain_timeout: Duration::from_secs(args.drain_timeout),
        watch: !args.no_watch,
    })?;
    Ok(ExitCode::SUCCESS)
}
