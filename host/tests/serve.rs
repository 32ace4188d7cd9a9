//! `specula serve` over real HTTP: the real binary on a free port of 127.0.0.1, loading the
//! real plugins, driven by a small HTTP client (and by the official `openai` Python client).
//!
//! Every daemon is killed when its test ends (see [`Daemon`]'s `Drop`), and every wait has a
//! deadline.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use specula_host::plugins::library_file_name;
mod common;

use common::daemon::*;
use common::*;

#[test]
fn openai_python_client_completes_chats_and_streams_with_an_api_key() {
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but the `openai` Python module is missing (pip install openai)"
        );
        println!("skipping: the `openai` Python module is not installed (pip install openai)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    // With an API key, which the client sends as `Authorization: Bearer`.
    let key = "sk-specula-test-key";
    let d = Daemon::start_with(&[&profile], None, &["--api-key", key], &[]);
    d.wait_healthy();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_client.py");
    let out_dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (out_dir.path().join("out"), out_dir.path().join("err"));
    let mut child = Command::new("python3")
        .arg(&script)
        .args([&d.url, "stories", key])
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the openai client script ran for over 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let stderr = std::fs::read_to_string(&err_path).unwrap();
    assert!(status.success(), "{stdout}\n{stderr}\n{}", d.log());
    println!("{}", stdout.trim());
}

#[test]
fn endpoints_answer_like_openai_and_requests_stay_isolated() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(
        dir.path(),
        "stories.toml",
        "[drafter]\nplugin = \"lookup\"\n[sampling]\ntemperature = 0.0\n[speculation]\nadaptive = false\ndraft_max = 4\ndraft_min = 1\n",
    );
    let d = Daemon::ready(&[&profile]);

    let (status, health) = d.health();
    assert_eq!(status, 200);
    assert_eq!(health["status"], "ok");
    let s = &health["models"]["stories"];
    assert_eq!(
        (s["state"].as_str(), s["drafter"].as_str()),
        (Some("ready"), Some("lookup"))
    );
    assert_eq!(s["slots"], 4);
    assert_eq!(s["engine"]["sequences"], 4, "{s}");
    assert!(s["engine"]["cost_8_rows"].as_f64().unwrap() >= 1.0, "{s}");
    assert_eq!(s["engine"]["failure"], Value::Null, "{s}");
    let (_, models) = d.get_json("/v1/models");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "stories");

    // Completion: text, finish reason, usage, speculative statistics.
    let (status, c) = d.post(
        "/v1/completions",
        &completion("stories", "Once upon a time", 40),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    let text = text_of(&c).to_string();
    assert!(text.starts_with(LILY), "{text}");
    assert_eq!(c["choices"][0]["finish_reason"], "length");
    assert_eq!(c["usage"]["completion_tokens"], 40);
    assert_eq!(
        c["usage"]["total_tokens"].as_u64(),
        Some(c["usage"]["prompt_tokens"].as_u64().unwrap() + 40)
    );
    assert_eq!(c["speculative"]["drafter"], "lookup");
    assert_eq!(c["system_fingerprint"], "stories-r1");
    // A repetitive prompt gives prompt lookup something to draft.
    let cat = "The cat sat on the mat. The cat sat on the mat. The cat";
    let (_, c) = d.post("/v1/completions", &completion("stories", cat, 40));
    let spec = &c["speculative"];
    assert!(spec["drafted"].as_u64().unwrap() > 0, "{spec}");
    assert!(
        spec["accepted"].as_u64().unwrap() <= spec["drafted"].as_u64().unwrap(),
        "{spec}"
    );
    assert!(spec["acceptance_by_position"][0].is_number(), "{spec}");

    // Stop strings (string or list) and max_tokens.
    let (_, c) = d.post(
        "/v1/completions",
        &json!({"model": "stories", "prompt": "Once upon a time", "max_tokens": 40, "stop": "Lily"}),
    );
    assert_eq!(text_of(&c), ", there was a little girl named ");
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    let (_, c) = d.post(
        "/v1/completions",
        &json!({"model": "stories", "prompt": "Once upon a time", "max_tokens": 40, "stop": ["zzz", "girl"]}),
    );
    assert_eq!(text_of(&c), ", there was a little ");

    // Sampling: the same seed draws the same text; top_p near 0 is greedy.
    let sampled = |seed: u64, top_p: f64| {
        let body = json!({"model": "stories", "prompt": "Once upon a time", "max_tokens": 40,
                          "temperature": 1.0, "top_p": top_p, "seed": seed});
        text_of(&d.post("/v1/completions", &body).1).to_string()
    };
    assert_eq!(sampled(7, 1.0), sampled(7, 1.0));
    assert_ne!(sampled(7, 1.0), sampled(8, 1.0));
    assert_eq!(sampled(9, 0.001), text);

    // Streaming: the same text in chunks, usage and statistics in the last one, then [DONE].
    let streamed = d
        .stream(
            "/v1/completions",
            &completion("stories", "Once upon a time", 40),
        )
        .finish("");
    assert_eq!(streamed.text, text);
    assert!(streamed.chunks > 5);
    assert_eq!(streamed.last["choices"][0]["finish_reason"], "length");
    assert_eq!(streamed.last["usage"]["completion_tokens"], 40);
    assert_eq!(streamed.last["speculative"]["drafter"], "lookup");

    // Chat (no template in this GGUF: the plain fallback), plain and streamed.
    let chat = json!({"model": "stories", "max_tokens": 30,
                      "messages": [{"role": "user", "content": "Once upon a time"}]});
    let (status, c) = d.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    let reply = text_of(&c).to_string();
    let mut s = d.stream("/v1/chat/completions", &chat);
    let first = s.next_chunk();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let streamed = s.finish("");
    assert_eq!(streamed.text, reply);
    assert!(streamed.last["speculative"].is_object());

    // Several requests at once on two slots: each gets exactly its own greedy text.
    let prompts = [
        "Once upon a time",
        "Lily and Ben",
        "The dog",
        "One day",
        "Tom had a",
    ];
    let solo: Vec<String> = prompts
        .iter()
        .map(|p| text_of(&d.post("/v1/completions", &completion("stories", p, 60)).1).to_string())
        .collect();
    let parallel: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let d = &d;
                scope.spawn(move || {
                    let s = d.stream("/v1/completions", &completion("stories", p, 60));
                    s.finish("").text
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(parallel, solo);

    let m = d.metrics();
    for series in [
        "specula_requests_total{endpoint=\"completions\",model=\"stories\",status=\"200\"}",
        "specula_generated_tokens_total{model=\"stories\"}",
        "specula_prompt_tokens_total{model=\"stories\"}",
        "specula_request_duration_seconds_count{model=\"stories\"}",
        "specula_time_to_first_token_seconds_count{model=\"stories\"}",
        "specula_queue_wait_seconds_count{model=\"stories\"}",
        "specula_queue_depth{model=\"stories\"}",
        "specula_spec_drafted_tokens_total{drafter=\"lookup\",model=\"stories\"}",
        "specula_spec_accepted_tokens_total{drafter=\"lookup\",model=\"stories\"}",
        "specula_spec_acceptance_by_position{drafter=\"lookup\",model=\"stories\",position=\"0\"}",
    ] {
        metric(&m, series);
    }
    assert!(
        metric(
            &m,
            "specula_spec_drafted_tokens_total{drafter=\"lookup\",model=\"stories\"}"
        ) > 0.0
    );
    assert_eq!(metric(&m, "specula_queue_depth{model=\"stories\"}"), 0.0);
}

/// stories260K with a chat template in its metadata, written to `path`.
fn stories_with_chat_template(path: &Path, template: &str) {
    let source = specula_gguf::GgufFile::open(shared("models/stories260K.gguf")).unwrap();
    let mut out = specula_gguf::GgufWriter::new();
    for (key, value) in source.metadata() {
        out.set(key.clone(), value.clone());
    }
    out.set_str("tokenizer.chat_template", template);
    for info in source.tensors() {
        let data = source.tensor(&info.name).unwrap().data.to_vec();
        out.add_tensor(info.name.clone(), &info.dims, info.ty, data)
            .unwrap();
    }
    out.write(path).unwrap();
}

#[test]
fn chat_renders_the_gguf_template_and_its_exceptions_are_400s() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("templated.gguf");
    let template = "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{% if loop.first %}{{ bos_token }}{% endif %}{{ m['role'] | upper }}: {{ m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}";
    stories_with_chat_template(&model, template);
    let profile = dir.path().join("templated.toml");
    std::fs::write(
        &profile,
        format!(
            "[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 1\n{GREEDY}",
            model.to_str().unwrap()
        ),
    )
    .unwrap();
    let d = Daemon::ready(&[&profile]);
    assert_eq!(d.health().1["models"]["templated"]["chat_template"], "gguf");

    // The chat answer is the completion of the rendered template (its BOS added once).
    let messages = json!([
        {"role": "system", "content": "Stories."},
        {"role": "user", "content": " Once upon a time "},
    ]);
    let (status, chat) = d.post(
        "/v1/chat/completions",
        &json!({"model": "templated", "messages": messages, "max_tokens": 24}),
    );
    assert_eq!(status, 200, "{chat}");
    let rendered = "SYSTEM: Stories.\nUSER: Once upon a time\nASSISTANT:";
    let (_, plain) = d.post("/v1/completions", &completion("templated", rendered, 24));
    assert_eq!(
        chat["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"],
        "{chat}\n{plain}"
    );
    assert_eq!(text_of(&chat), text_of(&plain));

    // raise_exception's message is the client's 400.
    let (status, v) = d.post(
        "/v1/chat/completions",
        &json!({"model": "templated", "messages": [{"role": "tool", "content": "x"}]}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["message"], "Unknown role: tool");
    assert_eq!(v["error"]["param"], "messages");
}

#[test]
fn bad_requests_get_clear_errors_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let stories = stories_profile(
        dir.path(),
        "stories.toml",
        "context_size = 64\n[sampling]\ntemperature = 0.0\n",
    );
    // One slot, no queue, long context: for a full queue and a client that leaves.
    let tight = stories_profile(
        dir.path(),
        "tight.toml",
        &format!("{LONG_CONTEXT}[serve]\nslots = 1\nqueue = 0\n[sampling]\ntemperature = 0.0\n"),
    );
    let d = Daemon::ready(&[&stories, &tight]);
    d.wait_for("both profiles", |d| {
        d.health().1["models"]["tight"]["state"] == "ready"
    });
    // Revisions count per profile: each profile's first load is its revision 1.
    let (_, health) = d.health();
    assert_eq!(health["models"]["stories"]["revision"], 1, "{health}");
    assert_eq!(health["models"]["tight"]["revision"], 1, "{health}");
    let long_prompt = "Once upon a time there was a little girl. ".repeat(20);
    let cases: &[(&str, &str, u16, Option<&str>, &str)] = &[
        (
            "/v1/completions",
            "{\"model\": \"stories\", ",
            400,
            None,
            "not valid JSON",
        ),
        ("/v1/completions", "[1, 2]", 400, None, "JSON object"),
        (
            "/v1/completions",
            r#"{"model": "stories", "max_tokens": "ten"}"#,
            400,
            Some("max_tokens"),
            "invalid type",
        ),
        (
            "/v1/completions",
            r#"{"model": "stories", "temperature": "hot"}"#,
            400,
            Some("temperature"),
            "invalid type",
        ),
        (
            "/v1/completions",
            r#"{"model": "stories", "stop": [1]}"#,
            400,
            Some("stop"),
            "list of strings",
        ),
        (
            "/v1/completions",
            r#"{"model": 7, "prompt": "x"}"#,
            400,
            Some("model"),
            "invalid type",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x"}"#,
            400,
            None,
            "missing field `model`",
        ),
        (
            "/v1/completions",
            r#"{"model": "gpt-4", "prompt": "x"}"#,
            404,
            Some("model"),
            "does not exist",
        ),
        (
            "/v1/completions",
            r#"{"model": "stories", "prompt": "x", "max_tokens": -5}"#,
            400,
            Some("max_tokens"),
            "non-negative",
        ),
        (
            "/v1/completions",
            r#"{"model": "stories", "prompt": "x", "n": 3}"#,
            400,
            Some("n"),
            "n = 1",
        ),
        (
            "/v1/completions",
            r#"{"model": "stories", "prompt": "x", "top_p": 2}"#,
            400,
            Some("top_p"),
            "(0, 1]",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "stories"}"#,
            400,
            Some("messages"),
            "messages",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "stories", "messages": "hi"}"#,
            400,
            Some("messages"),
            "invalid type",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "stories", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            400,
            Some("messages[0].content"),
            "image_url",
        ),
    ];
    for &(path, body, status, param, needle) in cases {
        let (got, v) = d.post_raw(path, body);
        assert_eq!(got, status, "{body}: {v}");
        let e = &v["error"];
        assert_eq!(e["param"].as_str(), param, "{body}: {v}");
        assert!(e["type"].is_string() && e.get("code").is_some(), "{v}");
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{body}: {v}"
        );
    }
    let (status, v) = d.post("/v1/completions", &completion("stories", &long_prompt, 4));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "prompt");
    let chat = json!({"model": "stories", "messages": [{"role": "user", "content": long_prompt}]});
    let (status, v) = d.post("/v1/chat/completions", &chat);
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("messages")),
        "{v}"
    );
    let (status, v) = d.get_json("/v1/nothing");
    assert_eq!(status, 404, "{v}");
    let (status, v) = d.get_json("/v1/completions");
    assert_eq!(status, 405, "{v}");
    assert_eq!(v["error"]["code"], "method_not_allowed", "{v}");

    // Still serving.
    assert_eq!(d.health().0, 200);
    let (status, c) = d.post(
        "/v1/completions",
        &completion("stories", "Once upon a time", 8),
    );
    assert_eq!(status, 200, "{c}");
    assert!(text_of(&c).starts_with(", there was"), "{c}");

    // The one slot is busy and nothing may wait: 503 with Retry-After, not a hang.
    let mut running = d.stream(
        "/v1/completions",
        &completion("tight", "Once upon a time", 1800),
    );
    running.next_chunk();
    let r = d
        .agent
        .post(format!("{}/v1/completions", d.url))
        .send(completion("tight", "Once", 4).to_string())
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = serde_json::from_str(&r.into_body().read_to_string().unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "queue_full", "{v}");

    // The client leaves mid-stream: generation stops and the slot frees long before the
    // 1800 tokens would have been generated.
    drop(running);
    d.wait_for("the abandoned request to stop", |d| {
        d.health().1["models"]["tight"]["busy"] == 0
    });
    let m = d.metrics();
    let generated = metric(&m, "specula_generated_tokens_total{model=\"tight\"}");
    assert!(
        generated < 1000.0,
        "{generated} tokens generated for a client that left"
    );
    assert_eq!(
        metric(&m, "specula_cancelled_requests_total{model=\"tight\"}"),
        1.0
    );
    let (status, c) = d.post(
        "/v1/completions",
        &completion("tight", "Once upon a time", 8),
    );
    assert_eq!(status, 200, "{c}");
}

#[test]
fn reload_under_load_finishes_old_streams_and_routes_new_requests() {
    let dir = tempfile::tempdir().unwrap();
    let lookup =
        format!("{LONG_CONTEXT}[drafter]\nplugin = \"lookup\"\n[serve]\nslots = 3\n{GREEDY}");
    let profile = stories_profile(dir.path(), "stories.toml", &lookup);
    let d = Daemon::ready(&[dir.path()]);
    let old_fingerprint = d.health().1["models"]["stories"]["revision"].clone();

    // Three long streams on the lookup revision.
    const N: u64 = 1500;
    let prompts = ["Once upon a time", "Lily and Ben", "The dog"];
    let mut streams: Vec<(Sse, String)> = prompts
        .iter()
        .map(|p| {
            let mut s = d.stream("/v1/completions", &completion("stories", p, N as u32));
            let first = s.next_chunk();
            (s, first["choices"][0]["text"].as_str().unwrap().to_string())
        })
        .collect();

    // The profile changes: draft with llama2xs-281K instead.
    let draft_model = format!(
        "{LONG_CONTEXT}[drafter]\nplugin = \"model\"\nmodel = {:?}\n[speculation]\ndraft_max = 4\n[serve]\nslots = 2\n{GREEDY}",
        shared("models/llama2xs-281K.gguf").to_str().unwrap()
    );
    write_stories_profile(&profile, &draft_model);
    d.wait_for("the new revision", |d| {
        d.health().1["models"]["stories"]["drafter"] == "model"
    });
    let (_, health) = d.health();
    let draining = &health["models"]["stories"]["draining"];
    assert_eq!(draining[0]["revision"], old_fingerprint, "{health}");
    assert!(
        draining[0]["active"].as_u64().unwrap() > 0,
        "the old streams already ended: {health}"
    );

    // New requests go to the new revision.
    let (status, c) = d.post(
        "/v1/completions",
        &completion("stories", "Once upon a time", 40),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["speculative"]["drafter"], "model");
    assert!(c["speculative"]["drafted"].as_u64().unwrap() > 0, "{c}");
    assert!(text_of(&c).starts_with(LILY));
    let new_fingerprint = c["system_fingerprint"].as_str().unwrap().to_string();
    assert_ne!(new_fingerprint, format!("stories-r{old_fingerprint}"));

    // The old streams finish on the old revision, whole.
    for (s, first) in streams.drain(..) {
        let done = s.finish(&first);
        assert_eq!(done.last["usage"]["completion_tokens"], N, "{}", done.last);
        assert_eq!(done.last["choices"][0]["finish_reason"], "length");
        assert_eq!(done.last["speculative"]["drafter"], "lookup");
        assert_eq!(
            done.last["system_fingerprint"],
            format!("stories-r{old_fingerprint}")
        );
        assert!(done.text.len() > N as usize, "{} bytes", done.text.len());
    }
    d.wait_for("the old revision to be gone", |d| {
        d.health().1["models"]["stories"]["draining"] == json!([])
    });

    // Metrics show both drafters of the model.
    let m = d.metrics();
    assert!(
        metric(
            &m,
            "specula_spec_steps_total{drafter=\"lookup\",model=\"stories\"}"
        ) >= (3 * N) as f64 / 8.0
    );
    assert!(
        metric(
            &m,
            "specula_spec_drafted_tokens_total{drafter=\"model\",model=\"stories\"}"
        ) > 0.0
    );
    assert_eq!(
        metric(
            &m,
            "specula_profile_loads_total{model=\"stories\",result=\"ok\"}"
        ),
        2.0
    );
    assert_eq!(metric(&m, "specula_slots{model=\"stories\"}"), 2.0);
}

#[test]
fn broken_profiles_keep_the_old_model_and_dropped_plugins_load_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("profiles");
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::create_dir_all(&plugins).unwrap();
    let profile = stories_profile(&profiles, "stories.toml", GREEDY);
    let d = Daemon::ready(&[&profiles]);
    let serves = |d: &Daemon| {
        let (status, c) = d.post(
            "/v1/completions",
            &completion("stories", "Once upon a time", 8),
        );
        assert_eq!(status, 200, "{c}");
        assert!(text_of(&c).starts_with(", there was"), "{c}");
        c
    };

    // A syntax error: the old revision keeps serving; /health and the reload say why.
    std::fs::write(&profile, "[target\nbackend = \"cpu-simd\"\n").unwrap();
    d.wait_for("the error in /health", |d| {
        !d.health().1["models"]["stories"]["last_error"].is_null()
    });
    let (status, health) = d.health();
    assert_eq!(status, 200);
    let s = &health["models"]["stories"];
    assert_eq!(
        (s["state"].as_str(), s["revision"].as_u64()),
        (Some("ready"), Some(1)),
        "{health}"
    );
    assert!(
        s["last_error"].as_str().unwrap().contains("stories.toml"),
        "{health}"
    );
    serves(&d);
    let (status, report) = d.post("/admin/reload", &json!({}));
    assert_eq!(status, 422, "{report}");
    assert_eq!(report["ok"], false);
    let failed = &report["failed"][0];
    assert_eq!(
        (failed["model"].as_str(), failed["still_serving"].as_u64()),
        (Some("stories"), Some(1))
    );
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("TOML parse error"),
        "{report}"
    );

    // A valid profile whose drafter plugin is not there yet: same.
    let extra = format!("plugin_dir = {:?}\n", plugins.to_str().unwrap());
    let text = format!(
        "{extra}[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 1\n[drafter]\nplugin = \"dropped\"\n{GREEDY}",
        shared("models/stories260K.gguf").to_str().unwrap()
    );
    std::fs::write(&profile, &text).unwrap();
    d.wait_for("the missing plugin in /health", |d| {
        d.health().1["models"]["stories"]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("'dropped' not found"))
    });
    serves(&d);

    // The plugin is dropped into the plugin directory: SIGHUP loads the profile with it.
    std::fs::copy(
        plugin_library("drafter-lookup"),
        plugins.join(library_file_name("dropped")),
    )
    .unwrap();
    d.signal("HUP");
    d.wait_for("the reloaded profile", |d| {
        d.health().1["models"]["stories"]["drafter"] == "dropped"
    });
    let (_, health) = d.health();
    assert!(
        health["models"]["stories"]["last_error"].is_null(),
        "{health}"
    );
    assert_eq!(serves(&d)["speculative"]["drafter"], "dropped");

    // Adding a profile file adds a model; removing it removes the model.
    stories_profile(&profiles, "second.toml", GREEDY);
    d.wait_for("the added model", |d| {
        d.post("/v1/completions", &completion("second", "Once", 2))
            .0
            == 200
    });
    std::fs::remove_file(profiles.join("second.toml")).unwrap();
    d.wait_for("the removed model", |d| {
        d.post("/v1/completions", &completion("second", "Once", 2))
            .0
            == 404
    });
    let (_, models) = d.get_json("/v1/models");
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{models}");

    // A profile that never loaded: /health is 503 when nothing is ready.
    std::fs::write(
        &profile,
        "[target]\nbackend = \"cpu-simd\"\nmodel = \"missing.gguf\"\n",
    )
    .unwrap();
    let alone = Daemon::start(&[&profile], None);
    alone.wait_for("the failed load", |d| {
        d.health().1["models"]["stories"]["state"] == "failed"
    });
    let (status, health) = alone.health();
    assert_eq!(status, 503, "{health}");
    assert!(
        health["models"]["stories"]["last_error"]
            .as_str()
            .unwrap()
            .contains("missing.gguf"),
        "{health}"
    );
    let (status, v) = alone.post("/v1/completions", &completion("stories", "Once", 2));
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("model_not_ready")),
        "{v}"
    );
    // No `Retry-After`: retrying cannot help until the profile is fixed.
    let answer = alone
        .agent
        .post(format!("{}/v1/completions", alone.url))
        .header("content-type", "application/json")
        .send(completion("stories", "Once", 2).to_string())
        .unwrap();
    assert_eq!(answer.status().as_u16(), 503);
    assert!(answer.headers().get("retry-after").is_none());
}

#[cfg(unix)]
#[test]
fn sigterm_drains_the_stream_in_flight_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(
        dir.path(),
        "stories.toml",
        &format!("{LONG_CONTEXT}{GREEDY}"),
    );
    let mut d = Daemon::ready(&[&profile]);
    const N: u64 = 1500;
    let mut s = d.stream(
        "/v1/completions",
        &completion("stories", "Once upon a time", N as u32),
    );
    let first = s.next_chunk()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    d.signal("TERM");
    // Once the signal is handled, a new connection is answered at once with a 503 that says
    // why (it had waited in the listen queue until the daemon exited).
    let address = d.url.trim_start_matches("http://").to_string();
    let ask_health = || {
        use std::io::{Read, Write};
        let mut tcp = std::net::TcpStream::connect(&address).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let read = tcp.read_to_string(&mut answer);
        assert!(read.is_ok(), "no answer within 3 s: {read:?} {answer:?}");
        answer
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = ask_health();
        if answer.contains("shutting_down") {
            assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "new connections still served\n{answer}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let done = s.finish(&first);
    assert_eq!(done.last["usage"]["completion_tokens"], N);
    assert_eq!(done.last["choices"][0]["finish_reason"], "length");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = d.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon did not exit\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "{}", d.log());
    let log = d.log();
    assert!(log.contains("SIGTERM") && log.contains("drained"), "{log}");
}

#[test]
fn serve_help_explains_endpoints_and_reloading() {
    let dir = tempfile::tempdir().unwrap();
    let out = specula(&["serve", "--help"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&out);
    for needle in [
        "--profiles",
        "--listen",
        "/v1/chat/completions",
        "/health",
        "/metrics",
        "/admin/reload",
        "SIGHUP",
        "SIGTERM",
        "slots",
    ] {
        assert!(help.contains(needle), "{needle} missing from\n{help}");
    }
    let out = specula(&["serve", "--profiles", "/no/such/dir"], dir.path());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("/no/such/dir"), "{}", stderr(&out));
}

/// `serve -m FILE --alias NAME` serves a model with no profile file; llama-server's
/// `/tokenize` and `/detokenize` and OpenAI's `GET /v1/models/{id}` answer.
#[test]
fn a_model_served_without_a_profile_and_its_tokenizer_endpoints() {
    let stories = shared("models/stories260K.gguf");
    let d = Daemon::start_with(
        &[],
        None,
        &["-m", stories.to_str().unwrap(), "--alias", "tiny"],
        &[],
    );
    d.wait_healthy();
    let (status, models) = d.get_json("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");
    let (status, model) = d.get_json("/v1/models/tiny");
    assert_eq!(
        (status, model["id"].as_str()),
        (200, Some("tiny")),
        "{model}"
    );
    let (status, missing) = d.get_json("/v1/models/other");
    assert_eq!(status, 404, "{missing}");
    assert_eq!(missing["error"]["code"], "model_not_found");
    let body =
        json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0});
    let (status, c) = d.post("/v1/completions", &body);
    assert_eq!(status, 200, "{c}");
    assert!(text_of(&c).starts_with(", there was"), "{c}");

    // Tokens, as llama-server answers them (the one model is the default).
    let (status, t) = d.post("/tokenize", &json!({"content": "Once upon a time"}));
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["tokens"], json!([403, 407, 261, 378]), "{t}");
    let (_, t) = d.post(
        "/tokenize",
        &json!({"model": "tiny", "content": "Once upon", "add_special": true, "with_pieces": true}),
    );
    assert_eq!(
        t["tokens"],
        json!([{"id": 1, "piece": "<s>"}, {"id": 403, "piece": " Once"}, {"id": 407, "piece": " upon"}]),
        "{t}"
    );
    let (status, t) = d.post("/detokenize", &json!({"tokens": [1, 403, 407, 261, 378]}));
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["content"], "Once upon a time");
    let (status, e) = d.post("/detokenize", &json!({"tokens": [1, 99999]}));
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "tokens[1]", "{e}");
    let (status, e) = d.post("/tokenize", &json!({"content": 5}));
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "content", "{e}");
}

/// The engine loop batches concurrent requests into shared passes, and every stream equals
/// its output alone: 8 concurrent requests of mixed prompt lengths and `max_tokens`, on a
/// model with a drafter and one without, beside a streaming client that leaves mid-stream.
#[test]
fn concurrent_requests_share_passes_and_equal_their_output_alone() {
    let dir = tempfile::tempdir().unwrap();
    stories_profile(
        dir.path(),
        "lookup.toml",
        &format!("[drafter]\nplugin = \"lookup\"\n[serve]\nslots = 4\nprefill_chunk = 8\n{GREEDY}"),
    );
    stories_profile(
        dir.path(),
        "plain.toml",
        &format!("[serve]\nslots = 4\nprefill_chunk = 8\n{GREEDY}"),
    );
    let d = Daemon::ready(&[dir.path()]);
    let prompts = [
        "Once upon a time",
        "Lily and Ben went to the park. Lily and Ben",
        "The cat sat on the mat. The cat sat on the mat. The cat",
        "One day, a little girl named Sue found a big red ball in the garden. She wanted to play",
        "Tom had a dog",
        "The sun was",
        "Once upon a time there was a little boy who liked to run. Once upon a time",
        "Ben",
    ];
    let body = |model: &str, i: usize| {
        completion(model, prompts[i], [120, 300, 40, 200, 150, 350, 30, 250][i])
    };
    for model in ["lookup", "plain"] {
        let alone: Vec<String> = (0..8)
            .map(|i| {
                let (status, c) = d.post("/v1/completions", &body(model, i));
                assert_eq!(status, 200, "{c}");
                text_of(&c).to_string()
            })
            .collect();
        // A client that leaves after its first chunk.
        let mut leaver = d.stream("/v1/completions", &completion(model, "Lily", 500));
        leaver.next_chunk();
        let together: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let (d, body) = (&d, body(model, i));
                    s.spawn(move || {
                        std::thread::sleep(Duration::from_millis(2 * i as u64));
                        let (status, c) = d.post("/v1/completions", &body);
                        assert_eq!(status, 200, "{c}");
                        text_of(&c).to_string()
                    })
                })
                .collect();
            drop(leaver);
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, t, "{model} request {i}");
        }
        let m = d.metrics();
        let passes = metric(
            &m,
            &format!("specula_pass_sequences_count{{model=\"{model}\"}}"),
        );
        let alone_passes = metric(
            &m,
            &format!("specula_pass_sequences_bucket{{model=\"{model}\",le=\"1\"}}"),
        );
        assert!(
            passes > alone_passes,
            "{model}: no pass had two sequences ({passes} passes)"
        );
        // Every request ended: no block is used, and the prefix cache keeps their full ones.
        let kv = |state: &str| {
            metric(
                &d.metrics(),
                &format!("specula_kv_blocks{{model=\"{model}\",state=\"{state}\"}}"),
            )
        };
        d.wait_for("the KV pool's final report", |_| kv("used") == 0.0);
        assert!(kv("cached") > 0.0, "{model}");
        assert_eq!(
            metric(&m, &format!("specula_kv_block_tokens{{model=\"{model}\"}}")),
            64.0
        );
    }
}

/// `scripts/serve-bench.py`, the side-by-side load test, measures a running daemon: every
/// phase completes its requests and reports tokens per second and time to first token.
#[test]
fn the_serve_bench_script_measures_a_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let profile = stories_profile(dir.path(), "stories.toml", GREEDY);
    let d = Daemon::ready(&[&profile]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/serve-bench.py");
    let out = Command::new("python3")
        .arg(&script)
        .args([
            &d.url,
            "--model",
            "stories",
            "--clients",
            "1,3",
            "--requests",
            "2",
        ])
        .args([
            "--max-tokens",
            "16",
            "--probe-streams",
            "2",
            "--probe-tries",
            "2",
            "--unique",
            "--json",
        ])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let server = &report[d.url.as_str()];
    let phases = server["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2, "{report}");
    for (phase, clients) in phases.iter().zip([1, 3]) {
        assert_eq!(phase["clients"], clients);
        assert_eq!(phase["requests"], 2 * clients, "{phase}");
        assert_eq!(phase["errors"], json!([]));
        assert!(phase["tokens"].as_u64().unwrap() > 0, "{phase}");
        assert!(
            phase["tokens_per_second"].as_f64().unwrap() > 0.0,
            "{phase}"
        );
        assert!(phase["ttft_median"].as_f64().unwrap() > 0.0, "{phase}");
    }
    assert!(server["probe"]["ratio"].as_f64().unwrap() > 0.0, "{report}");
}
