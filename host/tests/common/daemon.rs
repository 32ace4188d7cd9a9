//! A `specula serve` daemon for the end-to-end tests: the binary of this build on a free port
//! of 127.0.0.1, killed when the test ends (its log printed when the test failed), with a small
//! HTTP client, an SSE reader and stories260K profiles.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{plugin_dir, shared, specula_bin};

/// Greedy continuation of "Once upon a time" by stories260K.
pub const LILY: &str = ", there was a little girl named Lily";

/// A running daemon; killed on drop, its log printed when the test failed.
pub struct Daemon {
    pub child: Child,
    pub url: String,
    log: PathBuf,
    pub agent: ureq::Agent,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts `specula serve --profiles SOURCES --listen 127.0.0.1:0` with this build's
    /// plugins (or `plugin_path`) and waits until it listens.
    pub fn start(sources: &[&Path], plugin_path: Option<&Path>) -> Self {
        Self::start_with(sources, plugin_path, &[], &[])
    }

    /// [`Daemon::start`] with extra command-line arguments and environment variables.
    pub fn start_with(
        sources: &[&Path],
        plugin_path: Option<&Path>,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("daemon.log");
        let mut cmd = Command::new(specula_bin());
        cmd.arg("serve");
        if !sources.is_empty() {
            cmd.arg("--profiles").args(sources);
        }
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(["--debounce-ms", "100", "--drain-timeout", "20"])
            .env(
                "SPECULA_PLUGIN_PATH",
                plugin_path.map_or_else(plugin_dir, Path::to_path_buf),
            )
            .env("SPECULA_HOME", dir.path())
            .env_remove("SPECULA_API_KEY")
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().expect("spawn specula serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {} // keep draining
        });
        let line = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the daemon did not start listening:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Self {
            child,
            url,
            log,
            agent,
            _dir: dir,
        }
    }

    /// Starts and waits until `/health` says 200.
    pub fn ready(sources: &[&Path]) -> Self {
        let d = Self::start(sources, None);
        d.wait_healthy();
        d
    }

    pub fn wait_healthy(&self) {
        self.wait_for("GET /health = 200", |d| d.get("/health").0 == 200);
    }

    /// Polls `check` every 25 ms for up to 15 s.
    pub fn wait_for(&self, what: &str, check: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !check(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut r = self
            .agent
            .get(format!("{}{path}", self.url))
            .call()
            .unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    pub fn get_json(&self, path: &str) -> (u16, Value) {
        let (status, text) = self.get(path);
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    /// POSTs raw text; returns the status and the JSON answer.
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let mut r = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .send(body)
            .unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, &body.to_string())
    }

    /// Starts a streaming request; its events are read as the test goes.
    pub fn stream(&self, path: &str, body: &Value) -> Sse {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let r = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .send(body.to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        Sse {
            lines: BufReader::new(Box::new(r.into_body().into_reader())),
        }
    }

    pub fn metrics(&self) -> String {
        let (status, text) = self.get("/metrics");
        assert_eq!(status, 200);
        text
    }

    pub fn health(&self) -> (u16, Value) {
        self.get_json("/health")
    }

    /// Sends a Unix signal (`TERM`, `HUP`).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name} failed");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- daemon log ---\n{}", self.log());
        }
    }
}

/// A server-sent event stream.
pub struct Sse {
    lines: BufReader<Box<dyn Read + Send>>,
}

/// What a finished stream carried.
pub struct Streamed {
    pub text: String,
    pub chunks: usize,
    pub last: Value,
}

impl Sse {
    /// The next `data:` payload (comments and blank lines skipped).
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.lines.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return Some(data.to_string());
            }
        }
    }

    /// The next chunk as JSON.
    pub fn next_chunk(&mut self) -> Value {
        let data = self.next_data().expect("stream ended early");
        serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"))
    }

    /// Reads to `[DONE]`, which must come right after the chunk with the finish reason, and
    /// the stream must end there.
    pub fn finish(mut self, already: &str) -> Streamed {
        let mut text = already.to_string();
        let mut chunks = 0;
        loop {
            let data = self.next_data().expect("stream cut before [DONE]");
            assert_ne!(data, "[DONE]", "[DONE] before a finish reason");
            let chunk: Value = serde_json::from_str(&data).unwrap();
            assert!(chunk.get("error").is_none(), "error event: {chunk}");
            chunks += 1;
            let choice = &chunk["choices"][0];
            text.push_str(
                choice["text"]
                    .as_str()
                    .or(choice["delta"]["content"].as_str())
                    .unwrap_or(""),
            );
            if !choice["finish_reason"].is_null() {
                assert_eq!(self.next_data().as_deref(), Some("[DONE]"));
                assert_eq!(self.next_data(), None, "data after [DONE]");
                return Streamed {
                    text,
                    chunks,
                    last: chunk,
                };
            }
            assert!(
                chunk.get("usage").is_none(),
                "usage before the end: {chunk}"
            );
        }
    }
}

/// A profile for stories260K (one thread per slot, greedy by default) plus `extra` TOML.
pub fn stories_profile(dir: &Path, file: &str, extra: &str) -> PathBuf {
    let path = dir.join(file);
    write_stories_profile(&path, extra);
    path
}

pub fn write_stories_profile(path: &Path, extra: &str) {
    let text = format!(
        "[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 1\n{extra}\n",
        shared("models/stories260K.gguf").to_str().unwrap()
    );
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap(); // atomic, as editors save
}

pub const GREEDY: &str = "[sampling]\ntemperature = 0.0\n";

/// Long generations, for requests that must still run while something else happens.
pub const LONG_CONTEXT: &str = "context_size = 2048\n";

pub fn completion(model: &str, prompt: &str, max_tokens: u32) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": max_tokens})
}

pub fn text_of(v: &Value) -> &str {
    v["choices"][0]["text"]
        .as_str()
        .or(v["choices"][0]["message"]["content"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
}

pub fn metric(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from\n{metrics}"))
}
