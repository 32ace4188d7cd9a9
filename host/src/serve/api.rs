//! The OpenAI-compatible surface: request bodies and their validation, response and
//! streaming-chunk bodies, and OpenAI's error format
//! (`{"error": {"message", "type", "param", "code"}}`).
//!
//! Bodies are parsed in two steps so that errors are precise: malformed JSON is one 400, and
//! a field of the wrong type or value is another naming the field in `param`. Fields the
//! daemon does not know are ignored (clients send many optional ones); fields it knows but
//! cannot honour (`n` > 1, `logprobs`, tools, a logit bias, penalties other than
//! `repeat_penalty`, JSON mode, ...) are refused rather than silently dropped.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{json, Value};

use crate::profile::Profile;
use crate::request::{Outcome, StopReason};
use crate::sampling::SamplingParams;
use crate::spec::SpecStats;

use crate::chat_template::ChatMessage;

/// An error answer in OpenAI's format.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, …
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header: only where trying again soon can succeed.
    pub retry_after: Option<&'static str>,
}

impl ApiError {
    /// 400: a bad body or field.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// 404: no profile of that name.
    pub fn unknown_model(name: &str, known: &[String]) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "The model `{name}` does not exist; this server has: {}",
                if known.is_empty() {
                    "(none)".to_string()
                } else {
                    known.join(", ")
                }
            ),
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 400 (as OpenAI's API answers it): the prompt does not fit the context.
    pub fn prompt_too_long(prompt_tokens: usize, context: usize, param: &str) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: format!(
                "This model's context holds {context} tokens, but the prompt is {prompt_tokens} tokens; shorten the prompt"
            ),
            param: Some(param.into()),
            code: Some("context_length_exceeded"),
            retry_after: None,
        }
    }

    /// 503: the model's queue is full, or it has no ready revision.
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some(code),
            retry_after: Some("1"),
        }
    }

    /// 500: something failed inside the daemon (a backend error, a panic).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 405: a known endpoint asked with another method (the `Allow` header lists the right one).
    pub fn wrong_method(method: &str, path: &str) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            kind: "invalid_request_error",
            message: format!("{path} does not take {method} requests (see the Allow header)"),
            param: None,
            code: Some("method_not_allowed"),
            retry_after: None,
        }
    }

    /// 404 for a path the daemon does not serve.
    pub fn no_route(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("Unknown endpoint {path}"),
            param: None,
            code: Some("unknown_url"),
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(seconds));
        }
        response
    }
}

/// Which OpenAI endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat_completions",
        }
    }

    /// The request field holding the prompt (for `param` in errors).
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::Chat => "messages",
        }
    }
}

/// The body of `/v1/completions` and `/v1/chat/completions` (each uses its own prompt field).
#[derive(Debug, Clone, Deserialize)]
pub struct GenerateBody {
    pub model: String,
    #[serde(default, deserialize_with = "prompt_text")]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<i64>,
    /// The chat endpoint's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extensions beyond OpenAI's fields (llama.cpp's names).
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub seed: Option<i64>,
    #[serde(default, deserialize_with = "stop_strings")]
    pub stop: Option<Vec<String>>,
    pub stream: Option<bool>,
    pub n: Option<i64>,
    pub logprobs: Option<Value>,
    pub echo: Option<bool>,
    /// OpenAI fields the daemon cannot honour: refused unless absent or neutral
    /// (`refuse_what_cannot_be_honoured`).
    pub best_of: Option<i64>,
    pub logit_bias: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub suffix: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub response_format: Option<Value>,
}

/// A chat message; `content` is a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default, deserialize_with = "message_content")]
    pub content: Option<String>,
}

/// What a request asks the generator for, after merging with the profile's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    pub stream: bool,
}

/// Parses a request body: malformed JSON and wrong field types become 400s naming the field.
pub fn parse_body(bytes: &[u8]) -> Result<GenerateBody, ApiError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!("The request body is not valid JSON: {e}"), None)
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object",
            None,
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = crate::wording::plain_type_names(&e.inner().to_string());
        if path == "." {
            ApiError::bad_request(format!("Invalid request: {message}"), None)
        } else {
            ApiError::bad_request(
                format!("Invalid value for `{path}`: {message}"),
                Some(&path),
            )
        }
    })
}

impl GenerateBody {
    /// The chat messages with text content (chat endpoint).
    pub fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        let messages = self.messages.as_ref().ok_or_else(|| {
            ApiError::bad_request("Missing required parameter: `messages`", Some("messages"))
        })?;
        if messages.is_empty() {
            return Err(ApiError::bad_request(
                "`messages` must hold at least one message",
                Some("messages"),
            ));
        }
        Ok(messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role.clone(),
                content: m.content.clone().unwrap_or_default(),
            })
            .collect())
    }

    /// A 400 naming the first field set to something the daemon would otherwise drop in
    /// silence (a client asking for tool calls or a logit bias must not get plain text as if
    /// it had been honoured); absent, null and neutral values (`best_of: 1`, penalties of 0,
    /// `{}`, `[]`, `response_format: {"type": "text"}`, `tool_choice: "none"`) pass.
    fn refuse_what_cannot_be_honoured(&self) -> Result<(), ApiError> {
        let empty = |v: &Option<Value>| match v {
            None | Some(Value::Null) => true,
            Some(Value::Object(m)) => m.is_empty(),
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::String(s)) => s.is_empty(),
            Some(_) => false,
        };
        let refused: [(&str, bool, &str); 11] = [
            (
                "best_of",
                self.best_of.is_some_and(|b| b != 1),
                "best_of > 1 is not supported",
            ),
            (
                "logit_bias",
                !empty(&self.logit_bias),
                "logit_bias is not supported",
            ),
            (
                "presence_penalty",
                self.presence_penalty.is_some_and(|p| p != 0.0),
                "presence_penalty is not supported (repeat_penalty is, as in llama.cpp)",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty.is_some_and(|p| p != 0.0),
                "frequency_penalty is not supported (repeat_penalty is, as in llama.cpp)",
            ),
            (
                "suffix",
                !empty(&self.suffix),
                "suffix (insertion) is not supported",
            ),
            (
                "top_logprobs",
                !(empty(&self.top_logprobs) || self.top_logprobs == Some(json!(0))),
                "logprobs are not supported",
            ),
            ("tools", !empty(&self.tools), "tool calls are not supported"),
            (
                "tool_choice",
                !(empty(&self.tool_choice)
                    || self.tool_choice == Some(json!("none"))
                    || self.tool_choice == Some(json!("auto"))),
                "tool calls are not supported",
            ),
            (
                "functions",
                !empty(&self.functions),
                "function calls are not supported",
            ),
            (
                "function_call",
                !(empty(&self.function_call)
                    || self.function_call == Some(json!("none"))
                    || self.function_call == Some(json!("auto"))),
                "function calls are not supported",
            ),
            (
                "response_format",
                !(empty(&self.response_format)
                    || self.response_format == Some(json!({"type": "text"}))),
                "only plain text output is supported (response_format {\"type\": \"text\"})",
            ),
        ];
        match refused.iter().find(|(_, set, _)| *set) {
            Some((param, _, why)) => Err(ApiError::bad_request(
                format!("{why}; leave `{param}` out"),
                Some(param),
            )),
            None => Ok(()),
        }
    }

    /// Checks every sampling and limit field and merges them over the profile's defaults.
    pub fn params(&self, profile: &Profile) -> Result<GenParams, ApiError> {
        let bad = |param: &str, message: String| Err(ApiError::bad_request(message, Some(param)));
        if let Some(n) = self.n {
            if n != 1 {
                return bad(
                    "n",
                    format!("n = {n}: only one choice per request (n = 1) is supported"),
                );
            }
        }
        if let Some(v) = &self.logprobs {
            if !(v.is_null() || v == &Value::Bool(false) || v == &json!(0)) {
                return bad("logprobs", "logprobs are not supported".into());
            }
        }
        if self.echo == Some(true) {
            return bad("echo", "echo is not supported".into());
        }
        self.refuse_what_cannot_be_honoured()?;
        let (limit_param, limit) = match (self.max_tokens, self.max_completion_tokens) {
            (_, Some(v)) => ("max_completion_tokens", Some(v)),
            (Some(v), None) => ("max_tokens", Some(v)),
            (None, None) => ("max_tokens", None),
        };
        let max_tokens = match limit {
            None => profile.generation.max_tokens,
            Some(v) if v < 0 => {
                return bad(
                    limit_param,
                    format!("{limit_param} = {v}: must be a non-negative integer"),
                )
            }
            Some(v) => u32::try_from(v).unwrap_or(u32::MAX),
        };
        let mut sampling = SamplingParams::from(&profile.sampling);
        if let Some(t) = self.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return bad(
                    "temperature",
                    format!("temperature = {t}: must be a number >= 0 (0 = greedy)"),
                );
            }
            sampling.temperature = t as f32;
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad("top_p", format!("top_p = {p}: must be in (0, 1]"));
            }
            sampling.top_p = p as f32;
        }
        if let Some(k) = self.top_k {
            if k < 0 {
                return bad("top_k", format!("top_k = {k}: must be >= 0 (0 = off)"));
            }
            sampling.top_k = u32::try_from(k).unwrap_or(u32::MAX);
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return bad("min_p", format!("min_p = {p}: must be in [0, 1]"));
            }
            sampling.min_p = p as f32;
        }
        if let Some(r) = self.repeat_penalty {
            if !(r.is_finite() && r > 0.0) {
                return bad(
                    "repeat_penalty",
                    format!("repeat_penalty = {r}: must be > 0"),
                );
            }
            sampling.repeat_penalty = r as f32;
        }
        if let Some(seed) = self.seed {
            // Negative seeds are valid for OpenAI; reinterpret the bits.
            sampling.seed = Some(seed as u64);
        }
        let stop = match &self.stop {
            Some(stop) => stop.clone(),
            None => profile.generation.stop.clone(),
        };
        Ok(GenParams {
            max_tokens,
            stop,
            sampling,
            stream: self.stream.unwrap_or(false),
        })
    }
}

fn prompt_text<'de, D: Deserializer<'de>>(de: D) -> Result<Option<String>, D::Error> {
    use serde::de::Error;
    match Option::<Value>::deserialize(de)? {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Ok(Some(String::new())),
            [Value::String(s)] => Ok(Some(s.clone())),
            [Value::String(_), ..] if items.iter().all(Value::is_string) => {
                Err(D::Error::custom("only one prompt per request is supported"))
            }
            _ if items.iter().all(|v| v.is_number() || v.is_array()) => Err(D::Error::custom(
                "token-id prompts are not supported; send text",
            )),
            _ => Err(D::Error::custom("expected a string")),
        },
        Some(other) => Err(D::Error::custom(format!(
            "expected a string, got {}",
            kind_of(&other)
        ))),
    }
}

fn stop_strings<'de, D: Deserializer<'de>>(de: D) -> Result<Option<Vec<String>>, D::Error> {
    use serde::de::Error;
    let stops = match Option::<Value>::deserialize(de)? {
        None => return Ok(None),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(D::Error::custom(format!(
                    "expected a string or a list of strings, got a list holding {}",
                    kind_of(&other)
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(D::Error::custom(format!(
                "expected a string or a list of strings, got {}",
                kind_of(&other)
            )))
        }
    };
    if stops.iter().any(String::is_empty) {
        return Err(D::Error::custom("stop strings must not be empty"));
    }
    Ok(Some(stops))
}

fn message_content<'de, D: Deserializer<'de>>(de: D) -> Result<Option<String>, D::Error> {
    use serde::de::Error;
    match Option::<Value>::deserialize(de)? {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some(kind), _) => {
                        return Err(D::Error::custom(format!(
                            "content parts of type `{kind}` are not supported; send text"
                        )))
                    }
                    _ => {
                        return Err(D::Error::custom(
                            "expected content parts like {\"type\": \"text\", \"text\": \"...\"}",
                        ))
                    }
                }
            }
            Ok(Some(text))
        }
        Some(other) => Err(D::Error::custom(format!(
            "expected a string or a list of content parts, got {}",
            kind_of(&other)
        ))),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(reason: StopReason) -> &'static str {
    match reason {
        StopReason::EndOfGeneration | StopReason::StopString => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::Cancelled => "cancelled",
    }
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn of(outcome: &Outcome) -> Self {
        let prompt_tokens = outcome.prompt_tokens.len();
        let completion_tokens = outcome.tokens.len();
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// The `speculative` object of every response: the drafter and its statistics for this
/// request, with the derived rates.
pub fn speculative_json(drafter: Option<&str>, stats: &SpecStats) -> Value {
    let mut v = serde_json::to_value(stats).unwrap_or_else(|_| json!({}));
    if let Some(map) = v.as_object_mut() {
        map.insert("drafter".into(), json!(drafter));
        map.insert("acceptance_rate".into(), json!(stats.acceptance_rate()));
        map.insert(
            "acceptance_by_position".into(),
            json!(stats.acceptance_by_position()),
        );
        map.insert(
            "mean_accepted_length".into(),
            json!(stats.mean_accepted_length()),
        );
        map.insert("passes_per_token".into(), json!(stats.passes_per_token()));
    }
    v
}

/// What every response and chunk of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// `model-rREVISION`: which loaded revision of the profile answered.
    pub fingerprint: String,
    pub drafter: Option<String>,
}

impl ResponseMeta {
    fn tail(&self, outcome: &Outcome) -> (Value, Value) {
        (
            json!(Usage::of(outcome)),
            speculative_json(self.drafter.as_deref(), &outcome.speculative),
        )
    }

    fn timings(outcome: &Outcome) -> Value {
        let t = &outcome.timings;
        json!({
            "prompt_tokens": t.prompt_tokens,
            "prefill_seconds": t.prefill_seconds,
            "prefill_tokens_per_second": t.prefill_tokens_per_second(),
            "generated_tokens": t.generated_tokens,
            "decode_seconds": t.decode_seconds,
            "decode_tokens_per_second": t.decode_tokens_per_second(),
        })
    }

    /// The whole answer of a non-streaming request.
    pub fn response(&self, outcome: &Outcome) -> Value {
        let (usage, speculative) = self.tail(outcome);
        let finish = finish_reason(outcome.stop_reason);
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": outcome.text, "finish_reason": finish, "logprobs": null,
            }),
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": outcome.text},
                "finish_reason": finish,
                "logprobs": null,
            }),
        };
        json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::Chat => "chat.completion",
            },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
            "usage": usage,
            "speculative": speculative,
            "timings": Self::timings(outcome),
        })
    }

    /// A streamed chunk: `text` (or, for chat, the role announcement when `text` is `None`),
    /// and with `end`, the finish reason, usage and statistics.
    pub fn chunk(&self, text: Option<&str>, end: Option<&Outcome>) -> Value {
        let finish = end.map(|o| finish_reason(o.stop_reason));
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null,
            }),
            Endpoint::Chat => {
                let delta = match (text, end) {
                    (Some(t), _) => json!({"content": t}),
                    (None, None) => json!({"role": "assistant", "content": ""}),
                    (None, Some(_)) => json!({}),
                };
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
        };
        let mut chunk = json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::Chat => "chat.completion.chunk",
            },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
        });
        if let (Some(outcome), Some(map)) = (end, chunk.as_object_mut()) {
            let (usage, speculative) = self.tail(outcome);
            map.insert("usage".into(), usage);
            map.insert("speculative".into(), speculative);
            map.insert("timings".into(), Self::timings(outcome));
        }
        chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn profile() -> Profile {
        Profile::parse(
            "[target]\nbackend = \"cpu-simd\"\nmodel = \"m.gguf\"\n[generation]\nmax_tokens = 33\nstop = [\"END\"]\n",
            Path::new("p.toml"),
        )
        .unwrap()
    }

    fn params(body: &str) -> Result<GenParams, ApiError> {
        parse_body(body.as_bytes())?.params(&profile())
    }

    #[test]
    fn malformed_json_and_wrong_types_are_400s_naming_the_field() {
        let e = parse_body(b"{\"model\": ").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let e = parse_body(b"[1]").unwrap_err();
        assert!(e.message.contains("JSON object"), "{}", e.message);
        let e = parse_body(br#"{"model": "m", "max_tokens": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse_body(br#"{"model": "m", "stop": [1]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        let e = parse_body(br#"{"model": "m", "messages": [{"role": "user", "content": 5}]}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = parse_body(br#"{"prompt": "x"}"#).unwrap_err();
        assert!(e.message.contains("missing field `model`"), "{}", e.message);
        let e = parse_body(br#"{"model": "m", "prompt": [1, 2]}"#).unwrap_err();
        assert!(e.message.contains("token-id"), "{}", e.message);
    }

    #[test]
    fn values_are_checked_and_merged_over_the_profile() {
        let p = params(r#"{"model": "m", "prompt": "x"}"#).unwrap();
        assert_eq!(
            (p.max_tokens, p.stop.clone(), p.stream),
            (33, vec!["END".to_string()], false)
        );
        let p = params(
            r#"{"model": "m", "prompt": ["x"], "max_tokens": 5, "stop": "\n", "temperature": 0, "top_p": 0.5, "seed": -1, "stream": true}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, 5);
        assert_eq!(p.stop, vec!["\n".to_string()]);
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.top_p, 0.5);
        assert_eq!(p.sampling.seed, Some(u64::MAX));
        assert!(p.stream);
        for (body, param) in [
            (r#"{"model": "m", "max_tokens": -1}"#, "max_tokens"),
            (
                r#"{"model": "m", "max_completion_tokens": -3}"#,
                "max_completion_tokens",
            ),
            (r#"{"model": "m", "temperature": -0.5}"#, "temperature"),
            (r#"{"model": "m", "top_p": 0}"#, "top_p"),
            (r#"{"model": "m", "n": 2}"#, "n"),
            (r#"{"model": "m", "logprobs": 3}"#, "logprobs"),
            (r#"{"model": "m", "best_of": 3}"#, "best_of"),
            (
                r#"{"model": "m", "logit_bias": {"403": 100}}"#,
                "logit_bias",
            ),
            (
                r#"{"model": "m", "presence_penalty": 2}"#,
                "presence_penalty",
            ),
            (
                r#"{"model": "m", "frequency_penalty": 0.5}"#,
                "frequency_penalty",
            ),
            (r#"{"model": "m", "suffix": "end"}"#, "suffix"),
            (r#"{"model": "m", "top_logprobs": 2}"#, "top_logprobs"),
            (
                r#"{"model": "m", "tools": [{"type": "function"}]}"#,
                "tools",
            ),
            (
                r#"{"model": "m", "tool_choice": "required"}"#,
                "tool_choice",
            ),
            (
                r#"{"model": "m", "functions": [{"name": "f"}]}"#,
                "functions",
            ),
            (
                r#"{"model": "m", "response_format": {"type": "json_object"}}"#,
                "response_format",
            ),
        ] {
            let e = params(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        assert!(parse_body(br#"{"model": "m", "stop": [""]}"#).is_err());
        // What a client library sends by default is not refused.
        params(
            r#"{"model": "m", "best_of": 1, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "suffix": null, "top_logprobs": 0, "tools": [], "tool_choice": "none", "functions": null, "function_call": "auto", "response_format": {"type": "text"}}"#,
        )
        .unwrap();
    }

    #[test]
    fn text_content_parts_are_joined() {
        let b = parse_body(
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(b.chat_messages().unwrap()[0].content, "ab");
        let e = parse_body(
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
        )
        .unwrap_err();
        assert!(e.message.contains("image_url"), "{}", e.message);
    }

    #[test]
    fn errors_have_openai_shape() {
        let v = ApiError::unknown_model("gpt-4", &["stories".into()]).body();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().unwrap().contains("stories"));
    }
}
