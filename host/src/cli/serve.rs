//! `specula serve`: the OpenAI-compatible daemon (see [`crate::serve`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use crate::serve::auth::ApiKeys;
use crate::serve::listener::HttpLimits;
use crate::serve::{run, ServeOptions};

/// `specula serve --help`.
pub(super) const LONG_ABOUT: &str = "\
Serve profiles over an OpenAI-compatible HTTP API.

Each profile file is a model named by its file stem (profiles/stories.toml is `stories`).
Endpoints:
  POST /v1/completions, POST /v1/chat/completions   (\"stream\": true for SSE)
  GET  /v1/models, GET /v1/models/{id}
  POST /tokenize, POST /detokenize   ({\"model\", \"content\"} / {\"model\", \"tokens\"})
  GET  /health          200 when at least one profile is ready, with per-profile status
  GET  /metrics         Prometheus text: requests, tokens, latency, queue, speculation
  POST /admin/reload    reload now; {\"model\": NAME} for one, {\"force\": true} even if unchanged

Profiles reload when their files change, on SIGHUP, and on POST /admin/reload: a changed
profile loads beside the serving one and takes new requests once ready; requests already
running finish on the old one; a profile that fails to load leaves the old one serving and
reports why in /health, the log and the reload response. Each profile serves `[serve] slots`
requests at once (default 4) with up to `[serve] queue` more waiting (default 16; beyond that:
503). Its engine loop batches every running request into one forward pass per step (certain
tokens, drafts within a row budget, prompt chunks of at most `[serve] prefill_chunk` tokens
while others decode), and every stream's output is its output alone. SIGTERM or Ctrl-C stops accepting connections
and waits for requests in flight (up to --drain-timeout) before exiting with status 0.

Connections: a request's head must arrive within --header-timeout of its first byte (or of
the connection opening), its body within --body-timeout, and an idle keep-alive connection
closes after --keep-alive-timeout; beyond --max-connections open ones, a new connection is
answered 503. A client may half-close its side after sending a request and still get the
answer.

API keys: with --api-key, SPECULA_API_KEY or --api-key-file, every /v1/* and /admin/*
request needs `Authorization: Bearer KEY` (else 401); /health and /metrics stay open unless
--protect-metrics. Listening on a non-loopback address without a key prints a warning.";

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("served").required(true).multiple(true).args(["profiles", "model"])))]
pub struct ServeArgs {
    /// Profile directories (every *.toml file in them) and profile files.
    #[arg(long, value_name = "DIR|FILE", num_args = 1..)]
    profiles: Vec<PathBuf>,
    /// Serve this GGUF model without a profile (cpu-simd, the profile defaults).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    model: Option<PathBuf>,
    /// The name clients use for the -m model (default: its file stem).
    #[arg(long, value_name = "NAME", requires = "model")]
    alias: Option<String>,
    /// Address to listen on (an IP address or a host name such as localhost); port 0 picks a
    /// free port. The address is printed on stdout.
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:8080", value_parser = listen_address)]
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
    /// Longest time for a request head, from its first byte (or the connection opening).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0, value_parser = positive_seconds)]
    header_timeout: f64,
    /// Longest time to receive a request body once its head has arrived.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    body_timeout: f64,
    /// How long an idle keep-alive connection stays open between requests.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    keep_alive_timeout: f64,
    /// Most connections open at once; more are answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_connections: u32,
    /// Require `Authorization: Bearer KEY` on /v1/* and /admin/* (also SPECULA_API_KEY).
    #[arg(
        long,
        value_name = "KEY",
        env = "SPECULA_API_KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// A file of API keys, one per line (# comments and blank lines skipped); with --api-key,
    /// both are accepted.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// Require the API key on /health and /metrics too.
    #[arg(long)]
    protect_metrics: bool,
}

/// `--listen`: `IP:PORT`, or `HOST:PORT` for the first address the host name resolves to.
fn listen_address(text: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    match text.to_socket_addrs() {
        Ok(mut addresses) => addresses
            .next()
            .ok_or_else(|| format!("{text:?} resolves to no address")),
        Err(e) => Err(format!(
            "{text:?} is not ADDR:PORT (e.g. 127.0.0.1:8080 or localhost:8080): {e}"
        )),
    }
}

/// A timeout in seconds: a finite number above 0.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Ok(s),
        _ => Err(format!(
            "{text:?} is not a number of seconds between 0 (exclusive) and 86400"
        )),
    }
}

pub fn run_cli(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut keys = ApiKeys::none();
    if let Some(key) = &args.api_key {
        keys.add(key, "--api-key / SPECULA_API_KEY")?;
    }
    if let Some(file) = &args.api_key_file {
        keys.add_file(file)?;
    }
    if args.protect_metrics && keys.is_empty() {
        anyhow::bail!(
            "--protect-metrics needs an API key (--api-key, SPECULA_API_KEY or --api-key-file)"
        );
    }
    let limits = HttpLimits {
        header_timeout: Duration::from_secs_f64(args.header_timeout),
        body_timeout: Duration::from_secs_f64(args.body_timeout),
        keep_alive_timeout: Duration::from_secs_f64(args.keep_alive_timeout),
        max_connections: args.max_connections as usize,
        ..HttpLimits::default()
    };
    let mut inline = std::collections::BTreeMap::new();
    if let Some(model) = &args.model {
        anyhow::ensure!(
            model.is_file(),
            "-m {}: no such file (expected a GGUF model)",
            model.display()
        );
        let name = match &args.alias {
            Some(alias) => alias.clone(),
            None => crate::serve::registry::profile_name(model)
                .with_context(|| format!("-m {}: give it a name with --alias", model.display()))?,
        };
        anyhow::ensure!(
            !name.is_empty() && !name.contains('/'),
            "--alias {name:?}: a model name must be non-empty and without '/'"
        );
        let model = std::path::absolute(model).unwrap_or_else(|_| model.clone());
        inline.insert(name, crate::profile::Profile::builtin_default(model));
    }
    run(ServeOptions {
        profiles: args.profiles,
        inline,
        listen: args.listen,
        debounce: Duration::from_millis(args.debounce_ms),
        drain_timeout: Duration::from_secs(args.drain_timeout),
        watch: !args.no_watch,
        limits,
        keys: keys.protect_metrics(args.protect_metrics),
    })?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_takes_host_names_as_well_as_addresses() {
        assert_eq!(
            listen_address("127.0.0.1:8080").unwrap(),
            "127.0.0.1:8080".parse::<SocketAddr>().unwrap()
        );
        let local = listen_address("localhost:8080").unwrap();
        assert!(local.ip().is_loopback() && local.port() == 8080, "{local}");
        let err = listen_address("localhost").unwrap_err();
        assert!(err.contains("e.g. 127.0.0.1:8080"), "{err}");
    }
}
