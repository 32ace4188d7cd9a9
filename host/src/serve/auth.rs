//! API keys: when the daemon has any (`--api-key`, `SPECULA_API_KEY`, `--api-key-file`),
//! every `/v1/*` and `/admin/*` request must carry `Authorization: Bearer KEY` with one of
//! them, or it is answered 401 in OpenAI's error format. `/health` and `/metrics` stay open
//! for probes and scrapers unless `--protect-metrics`.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;

/// The keys the daemon accepts, and what they protect.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ApiKeys {
    keys: Vec<String>,
    protect_metrics: bool,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the keys themselves.
        f.debug_struct("ApiKeys")
            .field("keys", &self.keys.len())
            .field("protect_metrics", &self.protect_metrics)
            .finish()
    }
}

/// Why a key or a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{what}: an API key must be non-empty printable ASCII without spaces (as an `Authorization: Bearer` header carries it)")]
    BadKey { what: String },
    #[error("cannot read the API key file {path}: {reason}")]
    File { path: String, reason: String },
}

/// Largest key file read.
const MAX_KEY_FILE_BYTES: u64 = 64 * 1024;

impl ApiKeys {
    /// No keys: every endpoint is open.
    pub fn none() -> Self {
        Self::default()
    }

    /// Adds `key`; `what` names where it came from in errors.
    pub fn add(&mut self, key: &str, what: &str) -> Result<(), KeyError> {
        let key = key.trim();
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(KeyError::BadKey {
                what: what.to_string(),
            });
        }
        self.keys.push(key.to_string());
        Ok(())
    }

    /// Adds every key of a key file: one per line; blank lines and lines starting with `#`
    /// are skipped.
    pub fn add_file(&mut self, path: &Path) -> Result<(), KeyError> {
        let refuse = |reason: String| KeyError::File {
            path: path.display().to_string(),
            reason,
        };
        let text = crate::bounded::read_to_string(path, MAX_KEY_FILE_BYTES)
            .map_err(|e| refuse(e.to_string()))?;
        let before = self.keys.len();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            self.add(line, &format!("{} line {}", path.display(), i + 1))?;
        }
        if self.keys.len() == before {
            return Err(refuse("it holds no key".into()));
        }
        Ok(())
    }

    /// Also require a key for `/health` and `/metrics`.
    pub fn protect_metrics(mut self, protect: bool) -> Self {
        self.protect_metrics = protect;
        self
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether a request for `path` needs a key.
    fn guards(&self, path: &str) -> bool {
        if self.keys.is_empty() {
            return false;
        }
        match path {
            "/health" | "/metrics" => self.protect_metrics,
            _ => true,
        }
    }

    /// Whether `authorization` carries one of the keys (compared in constant time).
    fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(given) = authorization
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                // The scheme is case-insensitive (RFC 9110): `bearer KEY` is `Bearer KEY`.
                let (scheme, key) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key)
            })
            .map(str::trim)
        else {
            return false;
        };
        self.keys.iter().fold(false, |ok, key| {
            ok | constant_time_eq(key.as_bytes(), given.as_bytes())
        })
    }
}

/// Equal bytes, in a time that depends only on the lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The middleware: 401 for a guarded path without a valid key.
pub async fn require_key(
    State(keys): State<Arc<ApiKeys>>,
    request: Request,
    next: Next,
) -> Response {
    if !keys.guards(request.uri().path()) {
        return next.run(request).await;
    }
    let authorization = request.headers().get(header::AUTHORIZATION);
    if keys.admits(authorization) {
        return next.run(request).await;
    }
    let message = if authorization.is_none() {
        "Missing API key: send `Authorization: Bearer YOUR_KEY` (this server was started with --api-key)"
    } else {
        "Incorrect API key provided in the Authorization header"
    };
    let error = ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "invalid_request_error",
        message: message.to_string(),
        param: None,
        code: Some("invalid_api_key"),
        retry_after: None,
    };
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> ApiKeys {
        let mut k = ApiKeys::none();
        for key in list {
            k.add(key, "test").unwrap();
        }
        k
    }

    #[test]
    fn only_guarded_paths_need_a_key() {
        let k = keys(&["sk-1"]);
        assert!(k.guards("/v1/completions") && k.guards("/admin/reload"));
        assert!(k.guards("/v1/nothing") && k.guards("/anything"));
        assert!(!k.guards("/health") && !k.guards("/metrics"));
        let k = k.protect_metrics(true);
        assert!(k.guards("/health") && k.guards("/metrics"));
        assert!(!ApiKeys::none().guards("/v1/completions"));
    }

    #[test]
    fn bearer_keys_are_matched_exactly() {
        let k = keys(&["sk-one", "sk-two"]);
        let header = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(k.admits(Some(&header("Bearer sk-one"))));
        assert!(k.admits(Some(&header("Bearer sk-two"))));
        assert!(k.admits(Some(&header("bearer sk-two"))));
        assert!(k.admits(Some(&header("BEARER sk-one"))));
        assert!(!k.admits(Some(&header("Basic sk-one"))));
        for wrong in [
            "Bearer sk-on",
            "Bearer sk-one1",
            "sk-one",
            "Basic sk-one",
            "Bearer ",
        ] {
            assert!(!k.admits(Some(&header(wrong))), "{wrong}");
        }
        assert!(!k.admits(None));
    }

    #[test]
    fn bad_keys_and_key_files_are_refused() {
        let mut k = ApiKeys::none();
        assert!(k.add("", "--api-key").is_err());
        assert!(k.add("two words", "--api-key").is_err());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("keys");
        std::fs::write(&file, "# keys\n\nsk-a\n  sk-b  \n").unwrap();
        k.add_file(&file).unwrap();
        assert_eq!(k.keys, ["sk-a", "sk-b"]);
        std::fs::write(&file, "# nothing\n").unwrap();
        let err = ApiKeys::none().add_file(&file).unwrap_err().to_string();
        assert!(err.contains("holds no key"), "{err}");
        let err = ApiKeys::none()
            .add_file(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/dev/zero"), "{err}");
    }
}
