//! `specula serve` against hostile and unlucky clients and operators: slow and idle
//! connections, too many connections, half-closed connections, API keys, a plugin rebuilt in
//! place, a reload that takes a while, and clients that leave while queued.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use specula_host::plugins::library_file_name;

mod common;

use common::daemon::*;
use common::*;

/// The `host:port` of a daemon's URL.
fn address(d: &Daemon) -> String {
    d.url.trim_start_matches("http://").to_string()
}

fn connect(d: &Daemon) -> TcpStream {
    let stream = TcpStream::connect(address(d)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    stream
}

/// What a read found.
enum ReadOutcome {
    Bytes,
    Nothing,
    Closed,
}

fn read_some(stream: &mut TcpStream, buf: &mut Vec<u8>) -> ReadOutcome {
    let mut chunk = [0u8; 4096];
    match stream.read(&mut chunk) {
        Ok(0) => ReadOutcome::Closed,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            ReadOutcome::Bytes
        }
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut =>
        {
            ReadOutcome::Nothing
        }
        Err(_) => ReadOutcome::Closed,
    }
}

/// Reads until the server closes the connection or `limit` passes; returns what arrived and
/// when the connection closed (`None`: still open at the limit). With `drip`, one byte of a
/// never-ending header is sent every 200 ms meanwhile, as a slowloris client does.
fn read_until_closed(
    stream: &mut TcpStream,
    limit: Duration,
    drip: bool,
) -> (Vec<u8>, Option<Duration>) {
    let start = Instant::now();
    let mut buf = Vec::new();
    let mut last_drip = start;
    while start.elapsed() < limit {
        if drip && last_drip.elapsed() >= Duration::from_millis(200) {
            last_drip = Instant::now();
            if stream.write_all(b"a").is_err() {
                return (buf, Some(start.elapsed()));
            }
        }
        if let ReadOutcome::Closed = read_some(stream, &mut buf) {
            return (buf, Some(start.elapsed()));
        }
    }
    (buf, None)
}

/// The JSON body of a raw HTTP response.
fn body_json(response: &[u8]) -> Value {
    let text = String::from_utf8_lossy(response);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or_else(|| panic!("no body in {text}"));
    serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Header-read, body-read and keep-alive timeouts each close a connection soon after their
/// limit; a flood beyond `--max-connections` is answered 503 at once; the daemon keeps
/// serving others throughout.
#[test]
fn slow_idle_and_surplus_connections_are_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    let d = Daemon::start_with(
        &[&profile],
        None,
        &[
            "--header-timeout",
            "1",
            "--body-timeout",
            "1",
            "--keep-alive-timeout",
            "1.5",
        ],
        &[],
    );
    d.wait_healthy();
    let limit = Duration::from_secs(6);

    // Slowloris: a header that never ends, a byte every 200 ms.
    let mut slow: Vec<TcpStream> = (0..3).map(|_| connect(&d)).collect();
    for s in &mut slow {
        s.write_all(b"GET /health HTTP/1.1\r\nX-Slow: ").unwrap();
    }
    for s in &mut slow {
        let (_, closed) = read_until_closed(s, limit, true);
        let closed = closed.expect("a slowloris connection is still open after 6 s");
        assert!(closed < Duration::from_secs(4), "closed after {closed:?}");
    }
    // A connection that never sends anything.
    let (_, closed) = read_until_closed(&mut connect(&d), limit, false);
    assert!(
        closed.is_some(),
        "a silent connection is still open after 6 s"
    );

    // Keep-alive: a complete request is answered, then the idle connection is closed.
    let mut idle = connect(&d);
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let started = Instant::now();
    let (answer, closed) = read_until_closed(&mut idle, limit, false);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let closed = closed.expect("an idle keep-alive connection is still open after 6 s");
    assert!(
        closed >= Duration::from_millis(1200) && started.elapsed() < Duration::from_secs(5),
        "closed after {closed:?}"
    );

    // A body that stops arriving: 408.
    let mut trickle = connect(&d);
    trickle
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{\"model\": ",
        )
        .unwrap();
    let (answer, closed) = read_until_closed(&mut trickle, limit, false);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(closed.is_some(), "the connection stays open after a 408");
    let v = body_json(&answer);
    assert_eq!(v["error"]["code"], "request_timeout", "{v}");

    // A body declared larger than the limit: 413 at once, without `100 Continue` or a wait for
    // the body.
    let mut huge = connect(&d);
    huge.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 99999999999\r\nexpect: 100-continue\r\n\r\n",
    )
    .unwrap();
    let asked = Instant::now();
    let (answer, closed) = read_until_closed(&mut huge, limit, false);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(
        closed.is_some() && asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    let v = body_json(&answer);
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("larger than 2097152 bytes")),
        "{v}"
    );

    // Well-behaved clients were served all along.
    let (status, c) = d.post(
        "/v1/completions",
        &completion("stories", "Once upon a time", 8),
    );
    assert_eq!(status, 200, "{c}");
    let m = d.metrics();
    assert!(
        metric(
            &m,
            "specula_http_timed_out_connections_total{phase=\"header\"}"
        ) >= 4.0
    );
    assert!(
        metric(
            &m,
            "specula_http_timed_out_connections_total{phase=\"keep_alive\"}"
        ) >= 1.0
    );
    assert!(
        metric(
            &m,
            "specula_http_timed_out_connections_total{phase=\"body\"}"
        ) >= 1.0,
        "{m}"
    );
    // The 408 and the 413 answered before any handler are counted as requests too.
    for status in ["408", "413"] {
        assert!(
            m.lines().any(|l| l.starts_with("specula_requests_total{")
                && l.contains("endpoint=\"completions\"")
                && l.contains(&format!("status=\"{status}\""))),
            "{status}: {m}"
        );
    }
}

#[test]
fn connections_beyond_the_limit_are_answered_503() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    let d = Daemon::start_with(&[&profile], None, &["--max-connections", "3"], &[]);
    d.wait_healthy();
    // Three connections that are open and silent (well inside the 10 s header timeout).
    let held: Vec<TcpStream> = (0..3).map(|_| connect(&d)).collect();
    let mut extra = connect(&d);
    let (answer, closed) = read_until_closed(&mut extra, Duration::from_secs(5), false);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(closed.is_some(), "the refused connection stays open");
    let v = body_json(&answer);
    assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit is 3"),
        "{v}"
    );
    // Closing them frees their places.
    drop(held);
    d.wait_for("a request after the held connections closed", |d| {
        d.post(
            "/v1/completions",
            &completion("stories", "Once upon a time", 4),
        )
        .0 == 200
    });
    assert!(metric(&d.metrics(), "specula_http_refused_connections_total") >= 1.0);
}

/// A client may send its whole request and then shut down its sending side (as `nc -N` and
/// some HTTP/1.0 tools do): the answer still arrives, streamed or not.
#[test]
fn a_client_that_half_closes_after_its_request_gets_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    let d = Daemon::ready(&[&profile]);
    for stream in [false, true] {
        let body = json!({"model": "stories", "prompt": "Once upon a time", "max_tokens": 12, "stream": stream})
            .to_string();
        let mut s = connect(&d);
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let (answer, closed) = read_until_closed(&mut s, Duration::from_secs(20), false);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            closed.is_some(),
            "stream {stream}: no end of the answer: {text}"
        );
        assert!(text.starts_with("HTTP/1.1 200"), "stream {stream}: {text}");
        let words: String = if stream {
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|l| *l != "[DONE]")
                .map(|l| {
                    let v: Value = serde_json::from_str(l).unwrap();
                    v["choices"][0]["text"].as_str().unwrap_or("").to_string()
                })
                .collect()
        } else {
            text_of(&body_json(&answer)).to_string()
        };
        assert!(
            words.starts_with(", there was"),
            "stream {stream}: {words:?}"
        );
    }
}

/// With a key, `/v1/*` and `/admin/*` need `Authorization: Bearer KEY` (401 in OpenAI's error
/// format otherwise); `/health` and `/metrics` stay open unless `--protect-metrics`.
#[test]
fn api_keys_guard_the_api_and_admin_endpoints() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    let key_file = dir.path().join("keys.txt");
    std::fs::write(&key_file, "# team keys\nsk-from-file\n").unwrap();
    let d = Daemon::start_with(
        &[&profile],
        None,
        &[
            "--api-key",
            "sk-flag",
            "--api-key-file",
            key_file.to_str().unwrap(),
        ],
        &[],
    );
    d.wait_healthy();
    let call = |method: &str, path: &str, key: Option<&str>| -> (u16, String) {
        let url = format!("{}{path}", d.url);
        let mut r = if method == "GET" {
            let mut req = d.agent.get(&url);
            if let Some(k) = key {
                req = req.header("authorization", &format!("Bearer {k}"));
            }
            req.call().unwrap()
        } else {
            let mut req = d
                .agent
                .post(&url)
                .header("content-type", "application/json");
            if let Some(k) = key {
                req = req.header("authorization", &format!("Bearer {k}"));
            }
            req.send(completion("stories", "Once upon a time", 4).to_string())
                .unwrap()
        };
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    };
    for (method, path) in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/admin/reload"),
        ("GET", "/v1/no-such-endpoint"),
    ] {
        for key in [None, Some("sk-wrong"), Some("sk-fla")] {
            let (status, body) = call(method, path, key);
            assert_eq!(status, 401, "{method} {path} with {key:?}: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        }
    }
    for key in ["sk-flag", "sk-from-file"] {
        let (status, body) = call("POST", "/v1/completions", Some(key));
        assert_eq!(status, 200, "{body}");
        assert_eq!(call("GET", "/v1/models", Some(key)).0, 200);
    }
    assert_eq!(call("GET", "/health", None).0, 200);
    assert_eq!(call("GET", "/metrics", None).0, 200);
    assert!(!d.log().contains("without an API key"), "{}", d.log());
    drop(d);

    // From the environment, with the metrics protected too; on every interface, warned
    // about only when there is no key.
    let d = Daemon::start_with(
        &[&profile],
        None,
        &["--protect-metrics", "--listen", "0.0.0.0:0"],
        &[("SPECULA_API_KEY", "sk-env")],
    );
    let health = |key: Option<&str>| {
        let mut req = d.agent.get(format!("{}/health", d.url));
        if let Some(k) = key {
            req = req.header("authorization", &format!("Bearer {k}"));
        }
        req.call().unwrap().status().as_u16()
    };
    d.wait_for("the model to load", |_| health(Some("sk-env")) == 200);
    assert_eq!(health(None), 401);
    assert!(!d.log().contains("without an API key"), "{}", d.log());
    drop(d);
    let d = Daemon::start_with(&[&profile], None, &["--listen", "0.0.0.0:0"], &[]);
    d.wait_for("the warning", |d| d.log().contains("without an API key"));
}

/// A new build of a plugin copied over the old file at the same path is what a forced reload
/// loads; the reload report and `/health` say which build serves.
#[test]
fn a_plugin_rebuilt_at_the_same_path_serves_after_a_forced_reload() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let drafter = plugins.join(library_file_name("mine"));
    std::fs::copy(plugin_library("drafter-lookup"), &drafter).unwrap();
    let profile = dir.path().join("mtp.toml");
    std::fs::write(
        &profile,
        format!(
            "[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 1\n[drafter]\nplugin = {:?}\n[sampling]\ntemperature = 0.0\n[serve]\nslots = 1\n",
            shared("models/trained/stories-qwen35-mtp-q8_0.gguf").to_str().unwrap(),
            drafter.to_str().unwrap()
        ),
    )
    .unwrap();
    let d = Daemon::start_with(&[&profile], None, &["--no-watch"], &[]);
    d.wait_healthy();
    let served_by = |health: &Value| -> Vec<String> {
        health["models"]["mtp"]["plugins"]
            .as_array()
            .unwrap_or_else(|| panic!("no plugins in {health}"))
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(served_by(&d.health().1), ["cpu-simd", "lookup"]);
    let (status, before) = d.post(
        "/v1/completions",
        &completion("mtp", "Once upon a time", 24),
    );
    assert_eq!(status, 200, "{before}");

    // Rewrite the file in place (same inode, as `cp` does) with another drafter's build.
    let new_build = std::fs::read(plugin_library("drafter-mtp")).unwrap();
    std::fs::write(&drafter, &new_build).unwrap();
    let (status, report) = d.post("/admin/reload", &json!({"force": true}));
    assert_eq!(status, 200, "{report}");
    let loaded = &report["loaded"][0];
    let names: Vec<&str> = loaded["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["cpu-simd", "mtp"], "{report}");
    let drafter_build = &loaded["plugins"][1];
    assert_eq!(drafter_build["size"], new_build.len(), "{report}");
    assert_eq!(drafter_build["path"], drafter.to_str().unwrap(), "{report}");
    assert_eq!(served_by(&d.health().1), ["cpu-simd", "mtp"]);
    assert!(d.log().contains("mtp 0.1.0"), "{}", d.log());

    // Requests now draft through the MTP head: same greedy text, other drafting figures.
    let (status, after) = d.post(
        "/v1/completions",
        &completion("mtp", "Once upon a time", 24),
    );
    assert_eq!(status, 200, "{after}");
    assert_eq!(text_of(&after), text_of(&before));
    assert_ne!(after["system_fingerprint"], before["system_fingerprint"]);
    assert!(
        after["speculative"]["accepted"].as_u64().unwrap() > 0,
        "the MTP drafter accepts on its own model: {after}"
    );
}

/// While a changed profile loads (slowly: eight slots tokenizing a 3 MB corpus), requests
/// keep being answered by the revision serving before.
#[test]
fn requests_are_served_while_a_changed_profile_loads() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    let d = Daemon::start_with(&[&profile], None, &["--no-watch"], &[]);
    d.wait_healthy();
    let (_, first) = d.post(
        "/v1/completions",
        &completion("stories", "Once upon a time", 4),
    );
    let old = first["system_fingerprint"].clone();
    write_stories_profile(
        &profile,
        &format!(
            "{GREEDY}[serve]\nslots = 8\n[drafter]\nplugin = \"lookup\"\ncorpus = {:?}\n",
            shared("text/war-and-peace.txt").to_str().unwrap()
        ),
    );
    let url = format!("{}/admin/reload", d.url);
    let agent = d.agent.clone();
    let reload = std::thread::spawn(move || {
        agent
            .post(url)
            .header("content-type", "application/json")
            .send("{}")
            .unwrap()
            .status()
            .as_u16()
    });
    d.wait_for("the new revision to start loading", |d| {
        d.health().1["models"]["stories"]["loading"] == true
    });
    let mut during = 0;
    while d.health().1["models"]["stories"]["loading"] == true {
        let (status, c) = d.post(
            "/v1/completions",
            &completion("stories", "Once upon a time", 4),
        );
        assert_eq!(status, 200, "a request during the load: {c}");
        if c["system_fingerprint"] == old {
            during += 1;
        }
    }
    assert!(
        during > 0,
        "no request was answered while the new revision loaded"
    );
    assert_eq!(reload.join().unwrap(), 200);
    let (_, c) = d.post(
        "/v1/completions",
        &completion("stories", "Once upon a time", 4),
    );
    assert_ne!(c["system_fingerprint"], old, "{c}");
    assert_eq!(d.health().1["models"]["stories"]["slots"], 8);
}

/// A streaming client that leaves while its request waits for the one slot gives its place
/// back (the queue empties without waiting for the slot), and every later request is served.
#[test]
fn a_client_leaving_while_queued_gives_its_place_back() {
    let dir = tempfile::tempdir().unwrap();
    // A model slow enough (~130 tokens/s) to hold the slot for seconds.
    let model = small_llama(dir.path());
    let profile = dir.path().join("small.toml");
    std::fs::write(
        &profile,
        format!(
            "[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 1\ncontext_size = 2048\n[sampling]\ntemperature = 0.0\n[serve]\nslots = 1\nqueue = 2\n",
            model.to_str().unwrap()
        ),
    )
    .unwrap();
    let d = Daemon::ready(&[profile.as_path()]);
    let queued = |d: &Daemon| d.health().1["models"]["small"]["queued"].as_u64().unwrap();
    let mut running = d.stream(
        "/v1/completions",
        &completion("small", "Once upon a time", 1500),
    );
    running.next_chunk();
    let waiting = d.stream("/v1/completions", &completion("small", "Once", 8));
    d.wait_for("the second request to queue", |d| queued(d) == 1);
    drop(waiting);
    d.wait_for("the leaver to leave the queue", |d| queued(d) == 0);
    assert_eq!(
        d.health().1["models"]["small"]["busy"],
        1,
        "the first request still runs"
    );
    drop(running);
    d.wait_for("the slot to free", |d| {
        d.health().1["models"]["small"]["busy"] == 0
    });
    for _ in 0..3 {
        let (status, c) = d.post("/v1/completions", &completion("small", "Once", 4));
        assert_eq!(status, 200, "{c}");
    }
    assert_eq!(
        metric(
            &d.metrics(),
            "specula_cancelled_requests_total{model=\"small\"}"
        ),
        2.0
    );
}
