//! `specula` end to end: the real binary loading the real cpu-simd plugin through profiles.

mod common;

use common::*;

const LILY: &str = "Once upon a time, there was a little girl named Lily";

#[test]
fn stories260k_tells_the_lily_story_from_bos() {
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(
        dir.path(),
        "stories.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    let out = specula_ok(
        &[
            "run",
            "--profile",
            profile.to_str().unwrap(),
            "-n",
            "40",
            "--temp",
            "0",
        ],
        dir.path(),
    );
    let text = stdout(&out);
    assert!(text.starts_with(LILY), "{text:?}");
    let summary = stderr(&out);
    assert!(
        summary.contains("prefill") && summary.contains("decode") && summary.contains("t/s"),
        "{summary}"
    );
}

#[test]
fn json_output_carries_token_ids_and_stop_strings_cut_text() {
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(
        dir.path(),
        "stories.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    let out = specula_ok(
        &[
            "run",
            "--profile",
            profile.to_str().unwrap(),
            "-n",
            "40",
            "--temp",
            "0",
            "--json",
            "--stop",
            "Lily",
        ],
        dir.path(),
    );
    let v: serde_json::Value = json_of(&out);
    assert_eq!(
        v["text"],
        "Once upon a time, there was a little girl named "
    );
    assert_eq!(v["stop_reason"], "stop_string");
    assert_eq!(v["prompt_tokens"], serde_json::json!([1]));
    assert!(v["tokens"].as_array().unwrap().len() >= 10);
}

#[test]
fn prompt_from_argument_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(
        dir.path(),
        "stories.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    let out = specula_ok(
        &[
            "run",
            "--profile",
            profile.to_str().unwrap(),
            "-n",
            "20",
            "--temp",
            "0",
            "--json",
            "Once upon a time",
        ],
        dir.path(),
    );
    let v: serde_json::Value = json_of(&out);
    assert!(v["prompt_tokens"].as_array().unwrap().len() > 2);
    assert!(
        v["text"]
            .as_str()
            .unwrap()
            .starts_with(", there was a little girl named Lily"),
        "{v}"
    );
}

#[test]
fn same_seed_gives_the_same_sampled_text() {
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(
        dir.path(),
        "stories.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    let p = profile.to_str().unwrap();
    let run = |seed: &str| {
        let out = specula_ok(
            &[
                "run",
                "--profile",
                p,
                "-n",
                "48",
                "--temp",
                "0.9",
                "--seed",
                seed,
                "--json",
            ],
            dir.path(),
        );
        let v: serde_json::Value = json_of(&out);
        v["tokens"].clone()
    };
    assert_eq!(run("11"), run("11"));
    assert_ne!(run("11"), run("12"));
}

#[test]
fn tiny_llama_fixture_generates() {
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(
        dir.path(),
        "tiny.toml",
        &shared("models/fixtures/tiny-llama.gguf"),
        "",
    );
    let out = specula_ok(
        &[
            "run",
            "--profile",
            profile.to_str().unwrap(),
            "-n",
            "24",
            "--temp",
            "0",
            "--json",
        ],
        dir.path(),
    );
    let v: serde_json::Value = json_of(&out);
    let n = v["tokens"].as_array().unwrap().len();
    assert!(n == 24 || v["stop_reason"] == "end_of_generation", "{v}");
}

/// The Gated DeltaNet hybrids (qwen35 dense, qwen3next MoE, with and without an MTP block)
/// generate through the CLI, and the trained qwen35 model tells the teacher's story.
#[test]
fn hybrid_models_generate() {
    let dir = tempfile::tempdir().unwrap();
    for file in [
        "fixtures/tiny-qwen35.gguf",
        "fixtures/tiny-qwen35-mtp.gguf",
        "fixtures/tiny-qwen35-4l-mtp.gguf",
        "fixtures/tiny-qwen3next.gguf",
        "fixtures/tiny-qwen3next-mtp.gguf",
    ] {
        let profile = write_profile(dir.path(), "h.toml", &shared(&format!("models/{file}")), "");
        let out = specula(
            &[
                "run",
                "--profile",
                profile.to_str().unwrap(),
                "-n",
                "16",
                "--temp",
                "0",
                "--json",
            ],
            dir.path(),
        );
        let err = stderr(&out);
        assert!(out.status.success(), "{file}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        let v: serde_json::Value = json_of(&out);
        let n = v["tokens"].as_array().unwrap().len();
        assert!(
            n == 16 || v["stop_reason"] == "end_of_generation",
            "{file}: {v}"
        );
    }
    let profile = write_profile(
        dir.path(),
        "trained.toml",
        &shared("models/trained/stories-qwen35-mtp-q8_0.gguf"),
        "",
    );
    let out = specula_ok(
        &[
            "run",
            "--profile",
            profile.to_str().unwrap(),
            "-n",
            "40",
            "--temp",
            "0",
        ],
        dir.path(),
    );
    let text = stdout(&out);
    assert!(text.starts_with(LILY), "{text:?}");
}

/// With no profile, `specula run` runs the built-in trained qwen35 + MTP model (embedded in
/// the binary, written to SPECULA_HOME), speculates, and checks the output against plain
/// decoding.
#[test]
fn default_run_tells_a_story_speculating_with_plain_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = specula_ok(&["run", "Once upon a time"], dir.path());
    let model = dir.path().join("stories-qwen35-mtp-q8_0.gguf");
    assert!(model.is_file());
    let text = stdout(&out);
    assert!(
        text.starts_with(", there was a little girl named Lily"),
        "{text:?}"
    );
    let err = stderr(&out);
    assert!(err.contains("the built-in default"), "{err}");
    assert!(err.contains("drafter: mtp"), "{err}");
    let acceptance: f64 = err
        .split_once("accepted (")
        .and_then(|(_, rest)| rest.split_once('%'))
        .map(|(n, _)| n.parse().unwrap())
        .unwrap_or_else(|| panic!("no acceptance in {err}"));
    assert!(acceptance > 75.0, "{err}");
    assert!(
        err.contains("check: plain decoding (no drafts) gives the same 128 tokens"),
        "{err}"
    );
    // A second run reuses the model file and says the same.
    let again = specula_ok(&["run", "Once upon a time"], dir.path());
    assert_eq!(stdout(&again), text);
    // A damaged copy in the cache is replaced by the embedded bytes.
    std::fs::write(&model, b"GGUF broken").unwrap();
    let repaired = specula_ok(&["run", "-n", "8", "Once upon a time"], dir.path());
    assert!(stdout(&repaired).starts_with(", there was"));
}

/// `-m FILE` runs a model without a profile, with the flags a llama.cpp user knows; a model
/// path given as the prompt is caught.
#[test]
fn models_run_without_a_profile() {
    let dir = tempfile::tempdir().unwrap();
    let stories = shared("models/stories260K.gguf");
    let out = specula_ok(
        &[
            "run",
            "-m",
            stories.to_str().unwrap(),
            "-n",
            "12",
            "--temp",
            "0",
            "-t",
            "1",
            "-c",
            "128",
            "Once upon a time",
        ],
        dir.path(),
    );
    assert!(
        stdout(&out).starts_with(", there was a little girl named Lily"),
        "{}",
        stdout(&out)
    );
    // With a drafter and a draft model, flags only; then with trees of drafts (`--tree`):
    // the same text, checked against plain decoding.
    let draft_model = shared("models/llama2xs-281K.gguf");
    for extra in [&[][..], &["--tree", "--fixed-draft"][..]] {
        let mut args = vec![
            "run",
            "-m",
            stories.to_str().unwrap(),
            "--draft-model",
            draft_model.to_str().unwrap(),
            "-n",
            "24",
            "--temp",
            "0",
            "--check-plain",
        ];
        args.extend_from_slice(extra);
        args.push("Once upon a time");
        let out = specula_ok(&args, dir.path());
        assert!(stdout(&out).starts_with(", there was a little girl named Lily"));
        let err = stderr(&out);
        assert!(
            err.contains("drafter: model")
                && err.contains("check: plain decoding (no drafts) gives the same"),
            "{extra:?}: {err}"
        );
    }

    let out = specula(&["run", stories.to_str().unwrap()], dir.path());
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("is a model file") && err.contains("specula run -m"),
        "{err}"
    );

    // A drafter that does not exist is reported as the drafter, not as the model.
    let out = specula(
        &[
            "run",
            "-m",
            stories.to_str().unwrap(),
            "--drafter",
            "telepathy",
            "x",
        ],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("cannot set up the 'telepathy' drafter")
            && !err.contains("cannot open the model"),
        "{err}"
    );

    let out = specula(
        &["run", "-m", stories.to_str().unwrap(), "--temp", "-1", "x"],
        dir.path(),
    );
    assert!(
        stderr(&out).contains("--temp -1: must be"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn plugins_lists_cpu_simd() {
    let dir = tempfile::tempdir().unwrap();
    let out = specula_ok(&["plugins"], dir.path());
    let text = stdout(&out);
    let line = text
        .lines()
        .find(|l| l.starts_with("cpu-simd"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("backend") && line.contains("libspecula_cpu_simd"),
        "{line}"
    );
}

#[test]
fn profile_check_reports_misspelt_keys_with_their_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[target]\nbackend = \"cpu-simd\"\nmodle = \"x.gguf\"\n",
    )
    .unwrap();
    let out = specula(&["profile", "check", path.to_str().unwrap()], dir.path());
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("target.modle") && err.contains("unknown field") && err.contains("bad.toml"),
        "{err}"
    );

    let good = write_profile(
        dir.path(),
        "good.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    specula_ok(&["profile", "check", good.to_str().unwrap()], dir.path());
}

/// `profile check` finds, without loading weights, every problem `run` would hit, lists them
/// all, and exits non-zero; a sound profile is `ok`.
#[test]
fn profile_check_finds_every_problem_run_would_hit() {
    let dir = tempfile::tempdir().unwrap();
    let stories = shared("models/stories260K.gguf");
    let mtp_model = shared("models/trained/stories-qwen35-mtp-q8_0.gguf");
    let bad_hints = format!(
        "[drafter]\nplugin = \"model\"\nmodel = {:?}\n[drafter.options]\ncontext_hints = \"maybe\"\n",
        shared("models/llama2xs-281K.gguf").to_str().unwrap()
    );
    let text = dir.path().join("notes.gguf");
    std::fs::write(&text, "these are notes, not a model").unwrap();
    let check = |name: &str, model: &std::path::Path, extra: &str| {
        let path = write_profile(dir.path(), name, model, extra);
        let out = specula(&["profile", "check", path.to_str().unwrap()], dir.path());
        (out.status.success(), stdout(&out), stderr(&out))
    };
    // (profile, model, extra TOML, what each problem line must say)
    let cases: &[(&str, &std::path::Path, &str, &[&str])] = &[
        ("unknown-backend.toml", &stories, "", &[]),
        (
            "missing.toml",
            std::path::Path::new("/nowhere/m.gguf"),
            "",
            &["target.model", "/nowhere/m.gguf"],
        ),
        ("text.toml", &text, "", &["target.model", "not a GGUF file"]),
        (
            "options.toml",
            &stories,
            "[target.options]\nkv_type = \"f8\"\ncolour = \"blue\"\n",
            &["kv_type' = 'f8'", "unknown option 'colour'"],
        ),
        (
            "draft-max.toml",
            &mtp_model,
            "[drafter]\nplugin = \"mtp\"\n[speculation]\ndraft_max = 0\n",
            &["speculation.draft_max = 0"],
        ),
        (
            "no-head.toml",
            &stories,
            "[drafter]\nplugin = \"mtp\"\n",
            &["needs a target with an MTP"],
        ),
        (
            "drafter-options.toml",
            &stories,
            "[drafter]\nplugin = \"lookup\"\n[drafter.options]\nn_mni = 2\nn_mux = 9\n",
            &["drafter.options.n_mni, drafter.options.n_mux: unknown options"],
        ),
        (
            "model-options.toml",
            &stories,
            &bad_hints,
            &["drafter.options.context_hints: cannot parse \"maybe\" as bool"],
        ),
        (
            "mtp-options.toml",
            &mtp_model,
            "[drafter]\nplugin = \"mtp\"\n[drafter.options]\ncontext_hints = 1\n",
            &["drafter.options.context_hints: cannot parse \"1\" as bool"],
        ),
        (
            "unknown-drafter.toml",
            &stories,
            "[drafter]\nplugin = \"telepathy\"\n",
            &["drafter.plugin", "'telepathy' not found"],
        ),
    ];
    for (name, model, extra, needles) in cases {
        let extra = if *name == "unknown-backend.toml" {
            // write_profile names cpu-simd; this one names a backend that does not exist.
            let path = dir.path().join(name);
            std::fs::write(
                &path,
                format!(
                    "[target]\nbackend = \"warp-drive\"\nmodel = {:?}\n",
                    stories.to_str().unwrap()
                ),
            )
            .unwrap();
            let out = specula(&["profile", "check", path.to_str().unwrap()], dir.path());
            assert!(!out.status.success());
            let err = stderr(&out);
            assert!(
                err.contains("target.backend") && err.contains("'warp-drive' not found"),
                "{err}"
            );
            continue;
        } else {
            extra
        };
        let (ok, _, err) = check(name, model, extra);
        assert!(!ok, "{name} passed the check");
        for needle in *needles {
            assert!(err.contains(needle), "{name}: no {needle:?} in\n{err}");
        }
    }
    // Several problems at once are all listed.
    let (ok, _, err) = check(
        "many.toml",
        &stories,
        "[target.options]\nkv_type = \"f8\"\n[drafter]\nplugin = \"model\"\nmodel = \"/nowhere/draft.gguf\"\n[speculation]\ndraft_max = 0\n",
    );
    assert!(!ok);
    assert!(err.contains("3 problems"), "{err}");
    // A draft model speaking another vocabulary.
    let (ok, _, err) = check(
        "vocab.toml",
        &stories,
        &format!(
            "[drafter]\nplugin = \"model\"\nmodel = {:?}\n",
            shared("vocab/ggml-vocab-llama-spm.gguf").to_str().unwrap()
        ),
    );
    assert!(!ok);
    assert!(err.contains("vocabularies differ"), "{err}");
    // Sound profiles.
    for (name, model, extra) in [
        ("plain.toml", &stories, ""),
        ("mtp.toml", &mtp_model, "[drafter]\nplugin = \"mtp\"\n"),
        (
            "draft.toml",
            &stories,
            &format!(
                "[drafter]\nplugin = \"model\"\nmodel = {:?}\n",
                shared("models/llama2xs-281K.gguf").to_str().unwrap()
            )[..],
        ),
    ] {
        let (ok, out, err) = check(name, model, extra);
        assert!(ok, "{name}: {err}");
        assert!(out.contains(": ok"), "{out}");
    }
}

/// The slips of a first run each get a line that says what happened and what to do, instead
/// of silence or a message about something else.
#[test]
fn first_run_slips_are_explained() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared("models/stories260K.gguf");
    let m = model.to_str().unwrap();
    let run = |args: &[&str]| {
        let mut all = vec!["run", "-m", m, "--temp", "0"];
        all.extend_from_slice(args);
        specula(&all, dir.path())
    };
    let says = |out: &std::process::Output, text: &str| {
        assert!(
            stderr(out).contains(text),
            "{text:?} not in:\n{}",
            stderr(out)
        );
    };
    // A context beyond the trained length is cut, and the cut is said.
    let out = run(&["-c", "100000", "-n", "3", "Once"]);
    assert!(out.status.success(), "{}", stderr(&out));
    says(
        &out,
        "a context of 100000 tokens was asked for, but the model was trained for 2048; using 2048",
    );
    // A full context ends the text with a line saying so (not only in --json).
    let out = run(&["-c", "10", "-n", "100", "Once"]);
    says(
        &out,
        "stopped: the context of 10 tokens is full; raise it with -c",
    );
    // A prompt that fills the context names both fixes.
    let out = run(&["-c", "5", "Once upon a time there was"]);
    assert!(!out.status.success());
    says(&out, "leaves no room for a new token");
    says(&out, "trained for 2048");
    // --check-plain that cannot check says why.
    let out = run(&["--check-plain", "-n", "4", "Once"]);
    says(&out, "check: skipped (there is no drafter)");
    // More threads than CPUs.
    let out = run(&["-t", "1024", "-n", "1", "Once"]);
    says(&out, "1024 worker threads on");
    // A model where a profile belongs.
    let out = specula(&["run", "--profile", m, "Once"], dir.path());
    says(
        &out,
        "is a GGUF model, not a profile: to run a model, pass it with -m",
    );
    // Every out-of-range value of a profile, and several profiles in one check.
    let bad = write_profile(
        dir.path(),
        "bad.toml",
        &model,
        "[sampling]\ntemperature = -1.0\ntop_p = 1.5\nmin_p = -2.0\n",
    );
    let good = write_profile(dir.path(), "good.toml", &model, "");
    let out = specula(
        &[
            "profile",
            "check",
            good.to_str().unwrap(),
            bad.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert!(!out.status.success());
    assert!(stdout(&out).contains("good.toml: ok"), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains("bad.toml: 3 problems"), "{err}");
    for key in ["sampling.temperature", "sampling.top_p", "sampling.min_p"] {
        assert!(err.contains(key), "{key}: {err}");
    }
    // A drafter typo in bench is an error before any measuring, and so are zero runs.
    for (args, says) in [
        (
            &["--drafters", "lookp"][..],
            "--drafters: 'lookp' is none of",
        ),
        (&["--runs", "0"][..], "--runs 0"),
    ] {
        let mut all = vec!["bench", "--profile", good.to_str().unwrap()];
        all.extend_from_slice(args);
        let out = specula(&all, dir.path());
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
    // bench measures a bare model as run does.
    let out = specula(
        &[
            "bench",
            "-m",
            m,
            "--runs",
            "1",
            "-n",
            "8",
            "--prompt-tokens",
            "8",
            "--drafters",
            "lookup",
            "--json",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json_of(&out)["prompt_tokens"], 8);
    // A plugin directory that is not there.
    let lost = write_profile(dir.path(), "lost.toml", &model, "");
    let text = std::fs::read_to_string(&lost).unwrap();
    std::fs::write(
        &lost,
        format!("plugin_dir = [\"/nowhere/plugins\"]\n{text}"),
    )
    .unwrap();
    let out = specula(&["profile", "check", lost.to_str().unwrap()], dir.path());
    says(&out, "plugin_dir: /nowhere/plugins is not a directory");
    // `serve` without anything to serve names both ways to give it something.
    let out = specula(&["serve"], dir.path());
    assert!(
        stderr(&out).contains("--profiles") && stderr(&out).contains("--model"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn missing_model_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere.gguf");
    let profile = write_profile(dir.path(), "p.toml", &missing, "");
    let out = specula(
        &["run", "--profile", profile.to_str().unwrap(), "-n", "4"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("nowhere.gguf") && !err.contains("panicked"),
        "{err}"
    );
    // The OS error is said once, not once per layer of context.
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn gen_model_lists_presets_without_an_output_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = specula_ok(&["gen-model", "--list-presets"], dir.path());
    assert!(stdout(&out).contains("qwen35-2b"), "{}", stdout(&out));
    let out = specula(&["gen-model", "--preset", "tiny-llama"], dir.path());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--out"), "{}", stderr(&out));
}

#[test]
fn gen_model_writes_the_quantised_types_and_names_the_ones_it_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("m.gguf");
    let gen = |ty: &str| {
        specula(
            &[
                "gen-model",
                "--preset",
                "tiny-llama",
                "--hidden",
                "256",
                "--head-dim",
                "64",
                "--ffn",
                "512",
                "--type",
                ty,
                "--out",
                out_path.to_str().unwrap(),
            ],
            dir.path(),
        )
    };
    for ty in ["q4_0", "Q4_K", "q5_K", "q6_K"] {
        let out = gen(ty);
        assert!(out.status.success(), "{ty}: {}", stderr(&out));
        let file = specula_gguf::GgufFile::open(&out_path).unwrap();
        let q = file.tensor("blk.0.attn_q.weight").unwrap();
        assert!(
            q.info.ty.name().eq_ignore_ascii_case(ty),
            "{ty}: {}",
            q.info.ty
        );
    }
    // llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the output and (of 2 blocks) block 1's
    // attn_v and ffn_down.
    let out = gen("q4_K_M");
    assert!(out.status.success(), "q4_K_M: {}", stderr(&out));
    assert!(stdout(&out).contains("(q4_K_M)"), "{}", stdout(&out));
    let file = specula_gguf::GgufFile::open(&out_path).unwrap();
    let type_of = |name: &str| file.tensor(name).unwrap().info.ty.name().to_string();
    assert_eq!(type_of("blk.0.attn_q.weight"), "q4_K");
    assert_eq!(type_of("blk.0.attn_v.weight"), "q4_K");
    assert_eq!(type_of("blk.1.attn_v.weight"), "q6_K");
    assert_eq!(type_of("blk.1.ffn_down.weight"), "q6_K");
    assert_eq!(type_of("output.weight"), "q6_K");
    let out = gen("q2_K");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("--type q2_K") && err.contains("q4_K, q5_K, q6_K or q4_K_M"),
        "{err}"
    );
}

#[test]
fn truncated_model_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(shared("models/stories260K.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let profile = write_profile(dir.path(), "p.toml", &cut, "");
    let out = specula(
        &["run", "--profile", profile.to_str().unwrap(), "-n", "4"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("cut.gguf") && err.contains("truncated"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn unknown_backend_lists_where_it_looked() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("p.toml");
    std::fs::write(
        &profile,
        format!(
            "plugin_dir = \"extra\"\n[target]\nbackend = \"warp-drive\"\nmodel = {:?}\n",
            shared("models/stories260K.gguf").to_str().unwrap()
        ),
    )
    .unwrap();
    let out = specula(
        &["run", "--profile", profile.to_str().unwrap(), "-n", "4"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("warp-drive") && err.contains("libspecula_warp_drive"),
        "{err}"
    );
    assert!(
        err.contains(dir.path().join("extra").to_str().unwrap()),
        "{err}"
    );
    assert!(err.contains(build_dir().to_str().unwrap()), "{err}");
}

#[test]
fn drafter_flags_and_example_profiles_speculate_with_plain_output() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run = |args: &[&str]| {
        let out = specula(args, dir.path());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        out
    };
    let json = |out: &std::process::Output| -> serde_json::Value {
        serde_json::from_str(stdout(out).trim()).unwrap()
    };
    for name in [
        "stories260k-lookup.toml",
        "stories260k-draft-model.toml",
        "stories-qwen35-mtp.toml",
    ] {
        let profile = root.join("profiles").join(name);
        let p = profile.to_str().unwrap();
        let base = [
            "run",
            "--profile",
            p,
            "-n",
            "64",
            "--temp",
            "0",
            "--json",
            // The adaptive controller judges partly by measured time, and may pause a drafter
            // that finds nothing early on a loaded machine: draft every step.
            "--fixed-draft",
            "Lily and Ben went to the park. Lily and Ben went to the park. Lily and Ben",
        ];
        let spec = json(&run(&base));
        let plain = json(&run(&[&base[..], &["--no-spec"]].concat()));
        assert_eq!(spec["tokens"], plain["tokens"], "{name}");
        assert!(
            spec["speculative"]["drafted"].as_u64().unwrap() > 0,
            "{name}: {spec}"
        );
        assert_eq!(plain["speculative"]["drafted"].as_u64().unwrap(), 0);
        // Without --json the statistics go to stderr.
        let out = run(&[
            "run",
            "--profile",
            p,
            "-n",
            "32",
            "--temp",
            "0",
            "Once upon a time",
        ]);
        let err = stderr(&out);
        assert!(
            err.contains("speculation:") && err.contains("acceptance by draft position"),
            "{err}"
        );
    }
    // --drafter / --draft-model on a plain profile.
    let plain_profile = write_profile(
        dir.path(),
        "plain.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    let draft = shared("models/llama2xs-281K.gguf");
    let out = run(&[
        "run",
        "--profile",
        plain_profile.to_str().unwrap(),
        "-n",
        "48",
        "--temp",
        "0",
        "--json",
        "--draft-model",
        draft.to_str().unwrap(),
        "--draft-max",
        "3",
        "Once upon a time",
    ]);
    let v = json(&out);
    assert!(v["speculative"]["drafted"].as_u64().unwrap() > 0, "{v}");
    let out = run(&[
        "run",
        "--profile",
        plain_profile.to_str().unwrap(),
        "-n",
        "48",
        "--temp",
        "0",
        "--json",
        "--drafter",
        "lookup",
        "Once upon a time",
    ]);
    assert!(json(&out)["speculative"].is_object());
    let bad = specula(
        &[
            "run",
            "--profile",
            plain_profile.to_str().unwrap(),
            "--drafter",
            "telepathy",
            "-n",
            "4",
        ],
        dir.path(),
    );
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("drafter plugin 'telepathy' not found"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn prompt_from_stdin_drops_the_final_line_end() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(
        dir.path(),
        "stories.toml",
        &shared("models/stories260K.gguf"),
        "",
    );
    let mut child = std::process::Command::new(specula_bin())
        .args([
            "run",
            "--profile",
            profile.to_str().unwrap(),
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
        ])
        .env("SPECULA_PLUGIN_PATH", plugin_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Once upon a time\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = json_of(&out);
    assert!(
        v["text"]
            .as_str()
            .unwrap()
            .starts_with(", there was a little girl"),
        "{v}"
    );
}

/// `specula bench --json` with `args` on a plain profile of the shared `model` (written in
/// `dir`, which is also the home): the report.
fn bench_report(dir: &std::path::Path, model: &str, args: &[&str]) -> serde_json::Value {
    let profile = write_profile(dir, "bench.toml", &shared(model), "");
    let mut all = vec!["bench", "--profile", profile.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    json_of(&specula_ok(&all, dir))
}

/// `specula bench --concurrency` end to end, on a dense and a hybrid model: a decode figure
/// per sequence count (one sequence the unit), a pass cost per row count up to 16 (one row
/// the unit, the rows spread over the sequences), the repeated-prompt prefill, and the plot.
#[test]
fn bench_concurrency_reports_every_figure_as_json() {
    let dir = tempfile::tempdir().unwrap();
    for model in [
        "models/stories260K.gguf",
        "models/trained/stories-qwen35-mtp-q8_0.gguf",
    ] {
        let plot = dir.path().join("concurrency.svg");
        let report = bench_report(
            dir.path(),
            model,
            &[
                "--concurrency",
                "1,3,2",
                "--runs",
                "1",
                "-n",
                "8",
                "--prompt-tokens",
                "8",
                "--plot",
                plot.to_str().unwrap(),
            ],
        );
        let decode = report["decode"].as_array().expect("decode figures");
        let counts: Vec<u64> = decode
            .iter()
            .map(|d| d["sequences"].as_u64().unwrap())
            .collect();
        assert_eq!(counts, [1, 2, 3], "{model}");
        assert_eq!(decode[0]["scaling"], 1.0, "{model}");
        assert!(decode
            .iter()
            .all(|d| d["tokens_per_second"].as_f64().unwrap() > 0.0));
        let costs = report["pass_cost"].as_array().expect("pass costs");
        // Up to 16 rows, fewer where 3 sequences' rollback windows hold fewer.
        assert!(costs.len() >= 12 && costs.len() <= 16, "{model}: {costs:?}");
        assert_eq!(costs[0]["ratio"], 1.0);
        assert_eq!(costs[2]["sequences"], 3);
        assert_eq!(costs[costs.len() - 1]["sequences"], 3);
        let prefill = &report["repeated_prefill"];
        assert!(
            prefill["first_seconds"].as_f64().unwrap() > 0.0,
            "{prefill}"
        );
        assert!(
            prefill["prompt_tokens"].as_u64().unwrap() > 100,
            "{prefill}"
        );
        let svg = std::fs::read_to_string(&plot).unwrap();
        assert!(svg.contains("aggregate greedy decode"), "{model}");
    }
}

/// `specula bench --tree --vary-prompts`: each drafter runs as chains and as trees at the
/// same rows per pass, then as trees sized by the cost curve, each run from its own prompt,
/// and greedy outputs equal plain decoding run by run.
#[test]
fn bench_compares_chains_and_trees_over_varied_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let report = bench_report(
        dir.path(),
        "models/trained/stories-qwen35-mtp-q8_0.gguf",
        &[
            "--runs",
            "3",
            "-n",
            "24",
            "--prompt-tokens",
            "16",
            "--drafters",
            "mtp,lookup",
            "--tree",
            "--vary-prompts",
        ],
    );
    let drafters = report["drafters"].as_array().expect("drafter runs");
    let names: Vec<&str> = drafters
        .iter()
        .map(|d| d["drafter"].as_str().unwrap())
        .collect();
    // The profile adapts its drafts: trees sized by the cost curve too.
    let expected = [
        "mtp",
        "mtp tree",
        "mtp tree adaptive",
        "lookup",
        "lookup tree",
        "lookup tree adaptive",
    ];
    assert_eq!(names, expected, "{report}");
    let trees: Vec<bool> = drafters.iter().map(|d| d["tree"] == true).collect();
    assert_eq!(trees, [false, true, true, false, true, true], "{report}");
    for run in drafters {
        assert_eq!(run["output_matches_plain"], true, "{run}");
    }
    // The trained head's drafts are accepted, as chains and as trees (at fixed rows; the
    // adaptive run may pause speculation where it does not pay in time).
    for mtp in &drafters[..2] {
        assert!(mtp["mean_accepted_length"].as_f64().unwrap() > 1.0, "{mtp}");
    }
}

/// `specula bench` end to end on the trained stories model: every batch size up to the
/// backend's capacity has a verify cost (the first one the unit), the oracle drafter accepts
/// everything and gives the plain output, and both bandwidth measurements are there.
#[test]
fn bench_reports_every_figure_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("bench.svg");
    let report = bench_report(
        dir.path(),
        "models/stories260K.gguf",
        &[
            "--runs",
            "1",
            "-n",
            "16",
            "--prompt-tokens",
            "16",
            "--drafters",
            "oracle,mtp",
            "--plot",
            plot.to_str().unwrap(),
        ],
    );
    // mtp cannot run on stories260K: skipped, saying why.
    let skipped = report["skipped"].to_string();
    assert!(
        skipped.contains("mtp") && skipped.contains("no MTP head"),
        "{skipped}"
    );
    let verify = report["verify"].as_array().expect("verify costs");
    assert!(verify.len() >= 8, "{verify:?}");
    assert_eq!(verify[0]["k"], 1);
    assert_eq!(verify[0]["ratio"], 1.0);
    assert!(verify.iter().all(|v| v["seconds"].as_f64().unwrap() > 0.0));
    for field in [
        "bandwidth_bytes_per_second",
        "bandwidth_at_end_bytes_per_second",
        "prefill_tokens_per_second",
        "decode_tokens_per_second",
    ] {
        assert!(report[field].as_f64().unwrap() > 0.0, "{field}: {report}");
    }
    let oracle = &report["drafters"][0];
    assert_eq!(oracle["drafter"], "oracle");
    assert_eq!(oracle["output_matches_plain"], true);
    assert_eq!(oracle["acceptance"], 1.0);
    // Its speedup is against plain decoding and its ideal against the verify cost, both
    // measured again in its own pipeline.
    let plain_here = oracle["plain_decode_tokens_per_second"].as_f64().unwrap();
    let speedup = oracle["speedup"].as_f64().unwrap();
    let tps = oracle["decode_tokens_per_second"].as_f64().unwrap();
    assert!(
        plain_here > 0.0 && (speedup - tps / plain_here).abs() < 1e-9,
        "{oracle}"
    );
    let ratio = oracle["verify_ratio"].as_f64().unwrap();
    let ideal = oracle["ideal_speedup"].as_f64().unwrap();
    assert!(ratio > 0.0 && ideal > 0.0, "{oracle}");
    let efficiency = oracle["efficiency"].as_f64().unwrap();
    assert!((efficiency - speedup / ideal).abs() < 1e-9, "{oracle}");

    // The plot: valid SVG whose text carries the figures.
    let svg = std::fs::read_to_string(dir.path().join("bench.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.is_text())
        .filter_map(|n| n.text())
        .collect();
    let has = |needle: &str| texts.iter().any(|t| t.contains(needle));
    assert!(has("verify cost"), "{texts:?}");
    assert!(has(&format!("oracle {speedup:.2}x")), "{texts:?}");
    assert!(has("ideal: k / cost(k)"), "{texts:?}");
    for v in verify {
        let ratio = format!("{:.2}", v["ratio"].as_f64().unwrap());
        assert!(has(&ratio), "no {ratio} in {texts:?}");
    }
}

/// `specula` with `args`, killed if it runs longer than `limit` (then `None`): for inputs that
/// used to be read without end.
fn specula_within(
    args: &[&str],
    home: &std::path::Path,
    limit: std::time::Duration,
) -> Option<std::process::Output> {
    let mut child = std::process::Command::new(specula_bin())
        .args(args)
        .env("SPECULA_HOME", home)
        .env("SPECULA_PLUGIN_PATH", plugin_dir())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Some(child.wait_with_output().unwrap())
}

/// A corpus or profile that is a device, or larger than its cap, is refused at once with the
/// setting named, instead of being read until memory runs out.
#[test]
fn unbounded_and_oversized_inputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let limit = std::time::Duration::from_secs(30);
    let stories = shared("models/stories260K.gguf");
    let device = write_profile(
        dir.path(),
        "device.toml",
        &stories,
        "[drafter]\nplugin = \"lookup\"\ncorpus = \"/dev/zero\"\n",
    );
    let out = specula_within(
        &["run", "--profile", device.to_str().unwrap(), "-n", "4"],
        dir.path(),
        limit,
    )
    .expect("a /dev/zero corpus is read without end");
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("drafter.corpus")
            && err.contains("/dev/zero")
            && err.contains("not a regular file"),
        "{err}"
    );

    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "Once upon a time there was a girl. ".repeat(100)).unwrap();
    let capped = write_profile(
        dir.path(),
        "capped.toml",
        &stories,
        &format!(
            "[drafter]\nplugin = \"lookup\"\ncorpus = {:?}\ncorpus_max_bytes = 1000\n",
            corpus.to_str().unwrap()
        ),
    );
    let out = specula(
        &["run", "--profile", capped.to_str().unwrap(), "-n", "4"],
        dir.path(),
    );
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("3500 bytes")
            && err.contains("limit of 1000")
            && err.contains("corpus_max_bytes"),
        "{err}"
    );
    // Raised, the same corpus drafts.
    let raised = write_profile(
        dir.path(),
        "raised.toml",
        &stories,
        &format!(
            "[drafter]\nplugin = \"lookup\"\ncorpus = {:?}\ncorpus_max_bytes = 4000\n",
            corpus.to_str().unwrap()
        ),
    );
    specula_ok(
        &["run", "--profile", raised.to_str().unwrap(), "-n", "4"],
        dir.path(),
    );

    for args in [
        &["run", "--profile", "/dev/zero", "-n", "1"][..],
        &["profile", "check", "/dev/zero"],
    ] {
        let out = specula_within(args, dir.path(), limit)
            .expect("a /dev/zero profile is read without end");
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("/dev/zero") && err.contains("not a regular file"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let stories = shared("models/stories260K.gguf");
    let m = stories.to_str().unwrap();
    let out = specula_ok(&["tokenize", "-m", m, "Once upon a time"], dir.path());
    let lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 5, "{lines:?}");
    assert!(
        lines[0].contains("1 -> \"<s>\"") && lines[1].contains("403 -> \" Once\""),
        "{lines:?}"
    );
    let out = specula_ok(
        &["tokenize", "-m", m, "--no-bos", "--ids", "Once upon a time"],
        dir.path(),
    );
    assert_eq!(stdout(&out).trim(), "[403, 407, 261, 378]");
    let out = specula_ok(&["tokenize", "-m", m, "--json", "Once"], dir.path());
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(
        v,
        serde_json::json!([{"id": 1, "piece": "<s>"}, {"id": 403, "piece": " Once"}])
    );
    let out = specula_ok(
        &["detokenize", "-m", m, "1", "403", "407,261", "[378]"],
        dir.path(),
    );
    assert_eq!(stdout(&out), "Once upon a time\n");
    let out = specula(&["detokenize", "-m", m, "1", "512"], dir.path());
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("token id 512 is out of range"),
        "{}",
        stderr(&out)
    );
}

/// With `SPECULA_KEEP_PLUGIN_COPIES` set, the private copies of the loaded plugins stay in the
/// temporary directory (for a profiler to read their symbols); without it, none is left.
#[test]
fn plugin_copies_stay_only_when_asked() {
    for keep in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let mut command = std::process::Command::new(specula_bin());
        command
            .args(["plugins"])
            .env("SPECULA_HOME", tmp.path())
            .env("SPECULA_PLUGIN_PATH", plugin_dir())
            .env("TMPDIR", tmp.path())
            .env_remove("SPECULA_KEEP_PLUGIN_COPIES");
        if keep {
            command.env("SPECULA_KEEP_PLUGIN_COPIES", "1");
        }
        let out = command.output().expect("run specula plugins");
        assert!(out.status.success(), "{}", stderr(&out));
        let copies: Vec<_> = walk(tmp.path())
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "so"))
            .collect();
        match keep {
            true => assert!(
                copies
                    .iter()
                    .any(|p| p.to_string_lossy().contains("cpu_simd")),
                "{copies:?}"
            ),
            false => assert!(copies.is_empty(), "{copies:?}"),
        }
    }
}

/// Every file below `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        match path.is_dir() {
            true => files.extend(walk(&path)),
            false => files.push(path),
        }
    }
    files
}
