//! Accepting and serving HTTP/1.1 connections, with the limits a daemon facing the network
//! needs: a bound on open connections, and timeouts for a request's head, its body and an
//! idle keep-alive connection.
//!
//! Each connection runs hyper's HTTP/1 server (half-close allowed, so a client that sends its
//! request and then shuts its sending side still gets the answer) next to a watchdog that
//! follows the connection's `Phase`:
//!
//! * **head**: from the connection's first byte, or the next request's first byte, until
//!   hyper has parsed the request head — at most [`HttpLimits::header_timeout`];
//! * **busy**: a request is being answered (its body is read within
//!   [`HttpLimits::body_timeout`] by `read_body_in_time`; the answer may stream for as
//!   long as generation takes);
//! * **idle**: between requests — at most [`HttpLimits::keep_alive_timeout`].
//!
//! A connection over its limit is closed. Beyond [`HttpLimits::max_connections`] open
//! connections, a new one is answered 503 at once and closed, so a flood of idle or slow
//! clients cannot hold the daemon while well-behaved ones wait in the kernel's backlog.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

use super::api::{ApiError, Endpoint};
use super::metrics::{Metrics, NO_MODEL};

/// The connection limits of `specula serve` (`--header-timeout`, `--body-timeout`,
/// `--keep-alive-timeout`, `--max-connections`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpLimits {
    /// Longest time from a request's first byte to the end of its head.
    pub header_timeout: Duration,
    /// Longest time to receive a request's whole body once its head is in.
    pub body_timeout: Duration,
    /// Longest time a connection may sit idle between requests.
    pub keep_alive_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(30),
            max_connections: 256,
            max_body_bytes: 2 << 20,
        }
    }
}

/// Where a connection is in its life, for the watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for (the rest of) a request head since `since`.
    Head { since: Instant },
    /// Between requests since `since`: nothing of the next request has arrived.
    Idle { since: Instant },
    /// `requests` requests are being answered.
    Busy { requests: usize },
}

impl Phase {
    /// When the connection must be closed if the phase has not changed by then, and why.
    fn deadline(self, limits: &HttpLimits) -> Option<(Instant, &'static str)> {
        match self {
            Phase::Head { since } => Some((since + limits.header_timeout, "header")),
            Phase::Idle { since } => Some((since + limits.keep_alive_timeout, "keep_alive")),
            Phase::Busy { .. } => None,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` turns true, then lets the open connections
/// finish their requests (hyper's graceful shutdown) and returns once all are closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let app = app.layer(axum::middleware::from_fn_with_state(
        (limits, metrics.clone()),
        read_body_in_time,
    ));
    let open = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped(&mut shutdown) => break,
        };
        let (stream, peer) = match accepted {
            Ok(connection) => connection,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match open.clone().try_acquire_owned() {
            Ok(permit) => {
                let (app, metrics, shutdown) = (app.clone(), metrics.clone(), shutdown.clone());
                tokio::spawn(async move {
                    metrics.http_connections.inc();
                    serve_connection(stream, app, limits, &metrics, shutdown).await;
                    metrics.http_connections.dec();
                    drop(permit);
                });
            }
            Err(_) => {
                tracing::warn!(%peer, limit = limits.max_connections, "too many open connections: refusing one");
                metrics.http_refused.inc();
                let error = ApiError::unavailable(
                    format!(
                        "Too many open connections (the limit is {}); retry later",
                        limits.max_connections
                    ),
                    "too_many_connections",
                );
                tokio::spawn(refuse(stream, error, true));
            }
        }
    }
    // Every connection holds a permit until it is closed. Until then a new connection is
    // answered at once, not left in the listen queue until the daemon exits.
    let all_closed = open.acquire_many(limits.max_connections as u32);
    tokio::pin!(all_closed);
    loop {
        tokio::select! {
            _ = &mut all_closed => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    metrics.http_refused.inc();
                    let error = ApiError::unavailable(
                        "The daemon is shutting down; send the request to another instance",
                        "shutting_down",
                    );
                    tokio::spawn(refuse(stream, error, false));
                }
                // Out of file descriptors and the like: back off, as above.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: HttpLimits,
    metrics: &Metrics,
    mut shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let (phase_tx, mut phase) = watch::channel(Phase::Head {
        since: Instant::now(),
    });
    let phase_tx = Arc::new(phase_tx);
    let io = TokioIo::new(WatchedStream {
        inner: stream,
        phase: phase_tx.clone(),
    });
    let service = TowerToHyperService::new(tower::service_fn(move |request: Request<_>| {
        let guard = BusyGuard::enter(phase_tx.clone());
        let app = app.clone();
        async move {
            let response = app.oneshot(request.map(Body::new)).await?;
            Ok::<_, std::convert::Infallible>(response.map(|body| {
                Body::new(GuardedBody {
                    inner: body,
                    _guard: guard,
                })
            }))
        }
    }));
    let connection = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .keep_alive(true)
        .serve_connection(io, service);
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            reason = over_limit(&mut phase, &limits) => {
                tracing::debug!(reason, "closing a connection over its time limit");
                metrics.http_timeouts.with_label_values(&[reason]).inc();
                return;
            }
            _ = stopped(&mut shutdown), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Resolves once `shutdown` is true (never, if its sender is gone without saying so).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Resolves, with the phase's name, once the connection has stayed in a timed phase past its
/// deadline; pending while it keeps moving.
async fn over_limit(phase: &mut watch::Receiver<Phase>, limits: &HttpLimits) -> &'static str {
    loop {
        let now = *phase.borrow_and_update();
        match now.deadline(limits) {
            Some((deadline, reason)) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {
                        if *phase.borrow() == now {
                            return reason;
                        }
                    }
                    changed = phase.changed() => if changed.is_err() {
                        return std::future::pending().await;
                    },
                }
            }
            None => {
                if phase.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }
}

/// Answers 503 to a connection over the limit and closes it.
async fn refuse(mut stream: TcpStream, error: ApiError, retry_here: bool) {
    let body = error.body().to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}connection: close\r\n\r\n{body}",
        body.len(),
        if retry_here { "retry-after: 1\r\n" } else { "" }
    );
    // Short: every refused connection is held open until then.
    let _ = tokio::time::timeout(Duration::from_millis(250), async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent until it closes: a socket closed with unread bytes sends
        // a reset, which can discard the answer before the client reads it.
        let mut sink = [0u8; 4096];
        let mut left = 64usize << 10;
        while left > 0 {
            match tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await? {
                0 => break,
                n => left = left.saturating_sub(n),
            }
        }
        Ok::<(), io::Error>(())
    })
    .await;
}

/// Buffers a request's body within the body timeout and the size limit, so a client that
/// trickles its body cannot hold a connection (408), and hands the handler the whole body.
async fn read_body_in_time(
    axum::extract::State((limits, metrics)): axum::extract::State<(HttpLimits, Arc<Metrics>)>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    if request.method() == Method::GET || request.method() == Method::HEAD {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    // Answers given here never reach a handler: counted here, under the endpoint's label.
    let endpoint = match parts.uri.path() {
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/chat/completions" => Some(Endpoint::Chat),
        _ => None,
    };
    let count = |status: u16| {
        if let Some(endpoint) = endpoint {
            metrics.record_request(NO_MODEL, endpoint.as_str(), status);
        }
    };
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        // Refused before a byte of it is read (and so before `100 Continue` is sent).
        let mut error = ApiError::bad_request(
            format!(
                "The request body is larger than {} bytes",
                limits.max_body_bytes
            ),
            None,
        );
        error.status = axum::http::StatusCode::PAYLOAD_TOO_LARGE;
        let mut response = error.into_response();
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        count(413);
        return response;
    }
    let read = axum::body::to_bytes(body, limits.max_body_bytes);
    let bytes = match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let mut error = ApiError::bad_request(
                if too_large {
                    format!(
                        "The request body is larger than {} bytes",
                        limits.max_body_bytes
                    )
                } else {
                    format!("Cannot read the request body: {e}")
                },
                None,
            );
            if too_large {
                error.status = axum::http::StatusCode::PAYLOAD_TOO_LARGE;
            }
            count(error.status.as_u16());
            return error.into_response();
        }
        Err(_) => {
            let mut error = ApiError::bad_request(
                format!(
                    "The request body did not arrive within {} s",
                    limits.body_timeout.as_secs_f64()
                ),
                None,
            );
            error.status = axum::http::StatusCode::REQUEST_TIMEOUT;
            error.code = Some("request_timeout");
            metrics.http_timeouts.with_label_values(&["body"]).inc();
            count(408);
            let mut response = error.into_response();
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            return response;
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// The TCP stream, telling the watchdog when the first byte of a request arrives.
struct WatchedStream {
    inner: TcpStream,
    phase: Arc<watch::Sender<Phase>>,
}

impl AsyncRead for WatchedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.phase.send_if_modified(|phase| match phase {
                Phase::Idle { .. } => {
                    *phase = Phase::Head {
                        since: Instant::now(),
                    };
                    true
                }
                _ => false,
            });
        }
        polled
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A request being answered: the connection is busy from the parsed head until the answer's
/// body is done (or dropped), then idle.
struct BusyGuard {
    phase: Arc<watch::Sender<Phase>>,
}

impl BusyGuard {
    fn enter(phase: Arc<watch::Sender<Phase>>) -> Self {
        phase.send_modify(|p| {
            *p = match *p {
                Phase::Busy { requests } => Phase::Busy {
                    requests: requests + 1,
                },
                _ => Phase::Busy { requests: 1 },
            }
        });
        Self { phase }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.phase.send_modify(|p| {
            *p = match *p {
                Phase::Busy { requests } if requests > 1 => Phase::Busy {
                    requests: requests - 1,
                },
                _ => Phase::Idle {
                    since: Instant::now(),
                },
            }
        });
    }
}

/// A response body that keeps its request's [`BusyGuard`] until it is finished or dropped.
struct GuardedBody {
    inner: Body,
    _guard: BusyGuard,
}

impl http_body::Body for GuardedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_follow_the_phase() {
        let limits = HttpLimits::default();
        let t = Instant::now();
        assert_eq!(
            Phase::Head { since: t }.deadline(&limits),
            Some((t + limits.header_timeout, "header"))
        );
        assert_eq!(
            Phase::Idle { since: t }.deadline(&limits),
            Some((t + limits.keep_alive_timeout, "keep_alive"))
        );
        assert_eq!(Phase::Busy { requests: 2 }.deadline(&limits), None);
    }
}
