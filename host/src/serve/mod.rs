//! `specula serve`: an OpenAI-compatible HTTP daemon over named, hot-reloaded profiles.
//!
//! * [`api`]: OpenAI request/response types, validation, the error format;
//! * [`routes`]: the endpoints (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//!   `/health`, `/metrics`, `/admin/reload`) and SSE streaming;
//! * [`registry`]: the profiles, their loaded revisions, and reloading;
//! * [`slots`]: per-profile slots (the most concurrent sequences) and the bounded queue;
//! * [`worker`]: handing one admitted request to its model's engine loop
//!   ([`crate::scheduler`]);
//! * chat templates are [`crate::chat_template`] (shared with `specula chat`);
//! * [`metrics`]: Prometheus metrics;
//! * [`watch`]: reload triggers — debounced file events and SIGHUP;
//! * [`listener`]: the accept loop, with connection limits and header / body / keep-alive
//!   timeouts;
//! * [`auth`]: API keys.
//!
//! Life cycle: signal handlers and the file watcher are set up, the listener is bound (its
//! address is printed on stdout, so `--listen 127.0.0.1:0` works), and the profiles load in
//! the background — `/health` says 503 until one is ready. SIGTERM or Ctrl-C stops
//! accepting connections, lets the requests in flight finish for up to the drain timeout
//! (a second signal stops waiting), and returns `Ok`.

pub mod api;
pub mod auth;
pub mod listener;
pub mod metrics;
pub mod registry;
pub mod routes;
pub mod slots;
pub mod watch;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use auth::ApiKeys;
use listener::HttpLimits;
use metrics::Metrics;
use registry::Registry;
use routes::AppState;

/// What `specula serve` was asked to do.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Profile directories (every `*.toml` in them) and profile files.
    pub profiles: Vec<PathBuf>,
    /// Profiles without a file, by name (`serve -m FILE --alias NAME`).
    pub inline: std::collections::BTreeMap<String, crate::profile::Profile>,
    pub listen: SocketAddr,
    /// Quiet time after the last file event before a reload.
    pub debounce: Duration,
    /// Longest wait for requests in flight at shutdown.
    pub drain_timeout: Duration,
    /// Watch the profile files for changes.
    pub watch: bool,
    /// Connection limits and timeouts.
    pub limits: HttpLimits,
    /// Keys required on `/v1/*` and `/admin/*` (none: open).
    pub keys: ApiKeys,
}

/// Why the daemon could not start (or stopped abnormally).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("--profiles {0}: no such file or directory")]
    NoSuchSource(PathBuf),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("cannot watch the profile files: {0}")]
    Watch(#[from] notify::Error),
    #[error("the HTTP server failed: {0}")]
    Server(#[source] std::io::Error),
}

/// Runs the daemon until SIGTERM / Ctrl-C and the drain that follows.
pub fn run(options: ServeOptions) -> Result<(), ServeError> {
    for source in &options.profiles {
        if !source.exists() {
            return Err(ServeError::NoSuchSource(source.clone()));
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("specula-serve")
        .build()
        .map_err(ServeError::Runtime)?;
    let result = runtime.block_on(serve(options));
    // Generations still running after the drain timeout are abandoned with the process.
    runtime.shutdown_timeout(Duration::from_millis(500));
    result
}

async fn serve(options: ServeOptions) -> Result<(), ServeError> {
    let sources = options
        .profiles
        .iter()
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        .collect();
    let metrics = Arc::new(Metrics::new());
    let registry = Arc::new(Registry::with_inline(
        sources,
        options.inline.clone(),
        metrics.clone(),
    ));
    let state = Arc::new(AppState::new(registry.clone(), metrics));

    // Signals before anything else: a SIGTERM right after start is a clean shutdown.
    let mut signals = Signals::new().map_err(ServeError::Signals)?;
    watch::reload_on_sighup(registry.clone()).map_err(ServeError::Signals)?;
    let _watcher = if options.watch {
        Some(watch::watch_profiles(registry.clone(), options.debounce)?)
    } else {
        None
    };

    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: options.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(ServeError::Server)?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "specula serve: listening on http://{addr}");
        let _ = out.flush();
    }
    tracing::info!(%addr, "listening");
    if options.keys.is_empty() && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "listening beyond this machine without an API key: anyone who can reach {addr} can use and reload the models; set --api-key, SPECULA_API_KEY or --api-key-file"
        );
    }

    let startup = registry.clone();
    tokio::spawn(async move {
        startup.reload("startup", None, false).await;
    });

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = routes::router(state.clone(), Arc::new(options.keys.clone()));
    let mut server = tokio::spawn(listener::serve(
        listener,
        app,
        options.limits,
        state.metrics.clone(),
        stop_rx,
    ));

    let signal = tokio::select! {
        ended = &mut server => {
            return match ended {
                Ok(()) => Ok(()),
                Err(e) => Err(ServeError::Server(std::io::Error::other(e))),
            };
        }
        signal = signals.next() => signal,
    };
    state.shutting_down.store(true, Ordering::Relaxed);
    let requests = in_flight(&registry);
    tracing::info!(
        signal,
        in_flight = requests,
        "shutting down: no new connections; waiting up to {:?} for requests in flight",
        options.drain_timeout
    );
    let _ = stop_tx.send(true);
    tokio::select! {
        _ = &mut server => tracing::info!("drained; bye"),
        _ = tokio::time::sleep(options.drain_timeout) => {
            tracing::warn!(in_flight = in_flight(&registry), "drain timeout: abandoning requests in flight");
        }
        signal = signals.next() => {
            tracing::warn!(signal, in_flight = in_flight(&registry), "second signal: abandoning requests in flight");
        }
    }
    Ok(())
}

/// Requests holding or waiting for a slot on the serving revisions.
fn in_flight(registry: &Registry) -> usize {
    registry
        .ready()
        .iter()
        .map(|m| m.pool.active() + m.pool.queued())
        .sum()
}

/// SIGTERM and SIGINT (Ctrl-C).
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Waits for the next signal; returns its name.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}
