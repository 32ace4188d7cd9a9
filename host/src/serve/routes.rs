//! The HTTP endpoints: OpenAI's completions, chat completions and models, plus `/health`,
//! `/metrics` and `/admin/reload`.
//!
//! A generation request is validated completely — body, model, fields, chat template,
//! prompt length — before it is admitted, so every client error is an OpenAI-style 4xx
//! that costs no slot. Then it is admitted to its model's queue (503 when full) and handed
//! to [`worker::start`]. A streaming answer is OpenAI's SSE: `data: {chunk}` events, the last
//! chunk carrying `finish_reason`, `usage` and `speculative`, then `data: [DONE]`. When the
//! client goes away the response (or the handler future) is dropped, which sets the
//! request's cancel flag, and generation stops within one decode step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::request::{CancelFlag, Request};
use crate::spec::SpecSettings;

use super::api::{parse_body, ApiError, Endpoint, GenerateBody, ResponseMeta};
use super::auth::{require_key, ApiKeys};
use super::metrics::{Metrics, NO_MODEL};
use super::registry::{Lookup, Model, Registry};
use super::slots::SlotError;
use super::worker::{self, Event};

/// What every handler shares.
pub struct AppState {
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// Set once SIGTERM / Ctrl-C arrived: `/health` answers 503 while requests drain.
    pub shutting_down: AtomicBool,
    next_id: AtomicU64,
    /// Random per process, so that response ids do not repeat across restarts.
    id_salt: u64,
}

impl AppState {
    pub fn new(registry: Arc<Registry>, metrics: Arc<Metrics>) -> Self {
        Self {
            registry,
            metrics,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            id_salt: rand::random(),
        }
    }
}

type Shared = State<Arc<AppState>>;

/// Interval of SSE keep-alive comments while a stream waits (queued, or between tokens).
const SSE_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// The daemon's routes; panics in handlers become 500s in OpenAI's error format, and with
/// `keys`, guarded paths need one of them ([`super::auth`]).
pub fn router(state: Arc<AppState>, keys: Arc<ApiKeys>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/reload", post(admin_reload))
        .method_not_allowed_fallback(|method: axum::http::Method, uri: Uri| async move {
            ApiError::wrong_method(method.as_str(), uri.path())
        })
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .layer(panics_to_500s())
        .layer(axum::middleware::from_fn_with_state(keys, require_key))
        .with_state(state)
}

type PanicHandler = fn(Box<dyn std::any::Any + Send>) -> Response;

/// Turns a panic in a handler into a logged 500 with an OpenAI-style body; the daemon and
/// the connection's other requests carry on. (Panics during generation are caught in
/// [`worker`], where the slot is also repaired.)
fn panics_to_500s() -> tower_http::catch_panic::CatchPanicLayer<PanicHandler> {
    tower_http::catch_panic::CatchPanicLayer::custom(|panic| {
        let message = worker::panic_message(&*panic);
        tracing::error!("request handler panicked: {message}");
        ApiError::internal(format!("internal error: {message}")).into_response()
    })
}

async fn completions(state: Shared, body: Result<Bytes, BytesRejection>) -> Response {
    generate(state, Endpoint::Completions, body).await
}

async fn chat_completions(state: Shared, body: Result<Bytes, BytesRejection>) -> Response {
    generate(state, Endpoint::Chat, body).await
}

async fn generate(
    State(state): Shared,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let (label, response) = match prepare_and_start(&state, endpoint, body, arrived).await {
        Ok((model, response)) => (model, response),
        Err((model, error)) => {
            if error.status.is_server_error() {
                tracing::warn!(model, "{}: {}", error.status, error.message);
            } else {
                tracing::debug!(model, "{}: {}", error.status, error.message);
            }
            (model, error.into_response())
        }
    };
    state
        .metrics
        .record_request(&label, endpoint.as_str(), response.status().as_u16());
    response
}

type Failure = (String, ApiError);

/// Validates, admits and starts a request; the `String`s are the metrics' model label.
async fn prepare_and_start(
    state: &AppState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
) -> Result<(String, Response), Failure> {
    let unlabelled = |e: ApiError| (NO_MODEL.to_string(), e);
    let bytes = body.map_err(|e| {
        unlabelled(ApiError {
            status: e.status(),
            ..ApiError::bad_request(e.body_text(), None)
        })
    })?;
    let body = parse_body(&bytes).map_err(unlabelled)?;
    let model = match state.registry.lookup(&body.model) {
        Lookup::Ready(model) => model,
        Lookup::Unknown => {
            return Err(unlabelled(ApiError::unknown_model(
                &body.model,
                &state.registry.names(),
            )))
        }
        Lookup::NotReady { error } => {
            let failed = error.is_some();
            let why = match error {
                Some(e) => format!("it failed to load (fix its profile): {e}"),
                None => "it is still loading".to_string(),
            };
            let mut error = ApiError::unavailable(
                format!("The model `{}` is not ready: {why}", body.model),
                "model_not_ready",
            );
            if failed {
                // Trying again cannot help until the profile is fixed.
                error.retry_after = None;
            }
            return Err((body.model.clone(), error));
        }
    };
    let label = model.name.clone();
    let labelled = |e: ApiError| (label.clone(), e);
    let (request, stream) = build_request(&model, endpoint, &body).map_err(labelled)?;

    // Tokenize off the async threads (long prompts take a while), once: the engine loop
    // takes the tokens as they are.
    let counting = model.clone();
    let (prompt, add_bos) = (request.prompt.clone(), request.add_bos);
    let prompt_ids =
        tokio::task::spawn_blocking(move || counting.tokenizer.encode(&prompt, add_bos, true))
            .await
            .map_err(|e| labelled(ApiError::internal(format!("tokenizing failed: {e}"))))?;
    let prompt_tokens = prompt_ids.len().max(1);
    if prompt_tokens >= model.context_size {
        return Err(labelled(ApiError::prompt_too_long(
            prompt_tokens,
            model.context_size,
            endpoint.prompt_param(),
        )));
    }

    let ticket = model.pool.admit().map_err(|e| {
        labelled(match e {
            SlotError::QueueFull { .. } => ApiError::unavailable(
                format!("The model `{}` is busy: {e}; retry later", model.name),
                "queue_full",
            ),
            SlotError::Closed => ApiError::unavailable(
                format!("The model `{}`: {e}", model.name),
                "model_unavailable",
            ),
        })
    })?;
    let meta = ResponseMeta {
        endpoint,
        id: format!(
            "{}-{:016x}{:x}",
            match endpoint {
                Endpoint::Completions => "cmpl",
                Endpoint::Chat => "chatcmpl",
            },
            state.id_salt,
            state.next_id.fetch_add(1, Ordering::Relaxed)
        ),
        created: unix_now(),
        model: model.name.clone(),
        fingerprint: model.fingerprint_label(),
        drafter: model.drafter.clone(),
    };
    let guard = CancelOnDrop(request.cancel.clone());
    let rx = worker::start(
        model.clone(),
        ticket,
        request,
        prompt_ids,
        arrived,
        state.metrics.clone(),
    );
    let response = if stream {
        let stream = ChunkStream::new(rx, meta, guard);
        // Frequent keep-alive comments: a write is how a client that left is noticed (its
        // half-closed connection looks like one that only stopped sending), so a departed
        // streaming client stops generating, or leaves the queue, within a few seconds.
        Sse::new(stream)
            .keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
            .into_response()
    } else {
        collect(rx, &meta, guard).await.map_err(labelled)?
    };
    Ok((label, response))
}

/// The generator's request: prompt (the chat template rendered), limits, sampling,
/// speculation; and whether to stream.
fn build_request(
    model: &Model,
    endpoint: Endpoint,
    body: &GenerateBody,
) -> Result<(Request, bool), ApiError> {
    let params = body.params(&model.profile)?;
    let mut add_bos = model.profile.generation.add_bos;
    let mut stop = params.stop;
    let prompt = match endpoint {
        Endpoint::Completions => body.prompt.clone().unwrap_or_default(),
        Endpoint::Chat => {
            let messages = body.chat_messages()?;
            let (text, bos) = model
                .chat
                .prompt(&messages, &model.tokenizer, add_bos)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
            add_bos = bos;
            stop.extend(model.chat.stops().iter().map(|s| s.to_string()));
            text
        }
    };
    let request = Request {
        prompt,
        max_tokens: params.max_tokens,
        stop,
        sampling: params.sampling,
        add_bos,
        speculation: model
            .drafter
            .is_some()
            .then(|| SpecSettings::from(&model.profile.speculation)),
        cancel: CancelFlag::default(),
    };
    Ok((request, params.stream))
}

/// Waits for the whole answer of a non-streaming request.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<Event>,
    meta: &ResponseMeta,
    _cancel_if_dropped: CancelOnDrop,
) -> Result<Response, ApiError> {
    while let Some(event) = rx.recv().await {
        match event {
            Event::Text(_) => {}
            Event::Done(outcome) => return Ok(Json(meta.response(&outcome)).into_response()),
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal("generation ended without an answer"))
}

/// Cancels the request when dropped: the client went away (or the answer is complete, when
/// cancelling no longer matters).
struct CancelOnDrop(CancelFlag);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The SSE events of a streaming request.
struct ChunkStream {
    rx: mpsc::UnboundedReceiver<Event>,
    meta: ResponseMeta,
    pending: VecDeque<SseEvent>,
    finished: bool,
    _cancel_if_dropped: CancelOnDrop,
}

impl ChunkStream {
    fn new(rx: mpsc::UnboundedReceiver<Event>, meta: ResponseMeta, cancel: CancelOnDrop) -> Self {
        let mut pending = VecDeque::new();
        if meta.endpoint == Endpoint::Chat {
            pending.push_back(data(&meta.chunk(None, None)));
        }
        Self {
            rx,
            meta,
            pending,
            finished: false,
            _cancel_if_dropped: cancel,
        }
    }
}

fn data(value: &Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

impl Stream for ChunkStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            if self.finished {
                return Poll::Ready(None);
            }
            match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Event::Text(text))) => {
                    let chunk = data(&self.meta.chunk(Some(&text), None));
                    return Poll::Ready(Some(Ok(chunk)));
                }
                Poll::Ready(Some(Event::Done(outcome))) => {
                    let last = data(&self.meta.chunk(None, Some(&outcome)));
                    self.pending.push_back(last);
                    self.pending.push_back(SseEvent::default().data("[DONE]"));
                    self.finished = true;
                }
                Poll::Ready(Some(Event::Failed(error))) => {
                    self.pending.push_back(data(&error.body()));
                    self.pending.push_back(SseEvent::default().data("[DONE]"));
                    self.finished = true;
                }
                Poll::Ready(None) => {
                    let error = ApiError::internal("generation ended without an answer");
                    self.pending.push_back(data(&error.body()));
                    self.finished = true;
                }
            }
        }
    }
}

/// One model in OpenAI's `model` object shape (plus what Specula knows of it).
fn model_object(m: &Model) -> Value {
    json!({
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "specula",
        "revision": m.revision,
        "drafter": m.drafter,
        "context_size": m.context_size,
    })
}

async fn models(State(state): Shared) -> Json<Value> {
    let data: Vec<Value> = state
        .registry
        .ready()
        .iter()
        .map(|m| model_object(m))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}` (the `openai` client's `models.retrieve`).
async fn model_by_id(
    State(state): Shared,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match state.registry.lookup(&id) {
        Lookup::Ready(model) => Json(model_object(&model)).into_response(),
        _ => ApiError::unknown_model(&id, &state.registry.names()).into_response(),
    }
}

/// The ready model a tokenizer request names, or the only one when it names none.
fn tokenizer_model(state: &AppState, name: Option<&str>) -> Result<Arc<Model>, ApiError> {
    let name = match name {
        Some(name) => name.to_string(),
        None => {
            let ready = state.registry.ready();
            match ready.as_slice() {
                [only] => return Ok(only.clone()),
                _ => {
                    return Err(ApiError::bad_request(
                        format!(
                            "This server has {} ready models; say which with \"model\"",
                            ready.len()
                        ),
                        Some("model"),
                    ))
                }
            }
        }
    };
    match state.registry.lookup(&name) {
        Lookup::Ready(model) => Ok(model),
        _ => Err(ApiError::unknown_model(&name, &state.registry.names())),
    }
}

fn json_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let param = e.path().to_string();
        ApiError::bad_request(
            crate::wording::plain_type_names(&e.inner().to_string()),
            (param != ".").then_some(param.as_str()),
        )
    })
}

#[derive(Deserialize)]
struct TokenizeBody {
    #[serde(default)]
    model: Option<String>,
    content: String,
    /// Add BOS / EOS as the model does for prompts (llama-server's default: no).
    #[serde(default)]
    add_special: bool,
    /// Control-token texts (`<s>`, `<|im_start|>`) become their tokens (default: yes).
    #[serde(default = "yes")]
    parse_special: bool,
    /// Answer `{"id", "piece"}` objects instead of bare ids.
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// `POST /tokenize`, as llama-server: `{"content", "add_special", "parse_special",
/// "with_pieces", "model"}` → `{"tokens": [...]}`.
async fn tokenize(State(state): Shared, body: Result<Bytes, BytesRejection>) -> Response {
    let answer = async {
        let bytes = body.map_err(|e| ApiError::bad_request(e.body_text(), None))?;
        let body: TokenizeBody = json_body(&bytes)?;
        let model = tokenizer_model(&state, body.model.as_deref())?;
        tokio::task::spawn_blocking(move || {
            let t = &model.tokenizer;
            let ids = t.encode(&body.content, body.add_special, body.parse_special);
            let tokens: Vec<Value> = if body.with_pieces {
                ids.iter()
                    .map(|&id| {
                        let bytes = t.token_to_piece_special(id);
                        let piece = match String::from_utf8(bytes) {
                            Ok(text) => json!(text),
                            Err(e) => json!(e.into_bytes()),
                        };
                        json!({"id": id, "piece": piece})
                    })
                    .collect()
            } else {
                ids.iter().map(|&id| json!(id)).collect()
            };
            json!({"tokens": tokens})
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))
    };
    match answer.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
struct DetokenizeBody {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /detokenize`, as llama-server: `{"tokens": [...], "model"}` → `{"content"}`.
async fn detokenize(State(state): Shared, body: Result<Bytes, BytesRejection>) -> Response {
    let answer = (|| {
        let bytes = body.map_err(|e| ApiError::bad_request(e.body_text(), None))?;
        let body: DetokenizeBody = json_body(&bytes)?;
        let model = tokenizer_model(&state, body.model.as_deref())?;
        let vocab = model.tokenizer.vocab_size();
        if let Some((i, id)) = body
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            return Err(ApiError::bad_request(
                format!("token id {id} is out of range (vocabulary size {vocab})"),
                Some(&format!("tokens[{i}]")),
            ));
        }
        let content = String::from_utf8_lossy(&model.tokenizer.decode(&body.tokens)).into_owned();
        Ok(json!({"content": content}))
    })();
    match answer {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn health(State(state): Shared) -> Response {
    let (ready, models) = state.registry.health();
    let shutting_down = state.shutting_down.load(Ordering::Relaxed);
    let (code, status) = match (ready, shutting_down) {
        (_, true) => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        (true, false) => (StatusCode::OK, "ok"),
        (false, false) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    };
    (code, Json(json!({"status": status, "models": models}))).into_response()
}

async fn metrics(State(state): Shared) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// `POST /admin/reload` options, from the query string or a JSON body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadOptions {
    /// Reload only this profile.
    model: Option<String>,
    /// Reload even if the profile did not change.
    #[serde(default)]
    force: bool,
}

async fn admin_reload(
    State(state): Shared,
    query: Result<Query<ReloadOptions>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Response {
    let Ok(Query(mut options)) = query else {
        return ApiError::bad_request("unknown reload option; use `model` and `force`", None)
            .into_response();
    };
    if !body.iter().all(u8::is_ascii_whitespace) {
        match serde_json::from_slice::<ReloadOptions>(&body) {
            Ok(o) => {
                options.model = o.model.or(options.model);
                options.force |= o.force;
            }
            Err(e) => {
                return ApiError::bad_request(format!("invalid reload options: {e}"), None)
                    .into_response()
            }
        }
    }
    let report = state
        .registry
        .reload("admin request", options.model.as_deref(), options.force)
        .await;
    let code = if report.ok() {
        StatusCode::OK
    } else {
        StatusCode::UNPROCESSABLE_ENTITY
    };
    let mut body = serde_json::to_value(&report).unwrap_or_else(|_| json!({}));
    if let Some(map) = body.as_object_mut() {
        map.insert("ok".into(), json!(report.ok()));
    }
    (code, Json(body)).into_response()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request as HttpRequest;
    use tower::ServiceExt;

    #[test]
    fn a_panicking_handler_is_a_500_in_openai_format() {
        let app: Router = Router::new()
            .route(
                "/boom",
                get(|| async {
                    if unix_now() > 0 {
                        panic!("kaboom");
                    }
                    "unreachable"
                }),
            )
            .layer(panics_to_500s());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (status, body) = runtime.block_on(async {
            let request = HttpRequest::get("/boom").body(Body::empty()).unwrap();
            let response = app.oneshot(request).await.unwrap();
            let status = response.status();
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap();
            (status, serde_json::from_slice::<Value>(&bytes).unwrap())
        });
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body["error"]["type"], "server_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("kaboom"),
            "{body}"
        );
    }
}
