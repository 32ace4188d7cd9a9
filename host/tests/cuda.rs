//! The cuda-hybrid plugin through the real `specula` binary: it is listed on every machine; a
//! profile naming it fails with a clear message where there is no CUDA driver; and, where a
//! GPU exists, it tells the same greedy story as cpu-simd, plain and with MTP drafting (these
//! GPU tests are skipped, with a message, elsewhere).

use std::path::Path;

mod common;

use common::*;

const LILY: &str = "Once upon a time, there was a little girl named Lily";

/// A profile for `model` on `backend` (plus `extra` TOML).
fn profile(dir: &Path, name: &str, backend: &str, model: &Path, extra: &str) -> String {
    let path = dir.join(name);
    let text = format!(
        "[target]\nbackend = \"{backend}\"\nmodel = {:?}\nthreads = 2\n{extra}",
        model.to_str().expect("utf-8 path")
    );
    std::fs::write(&path, text).expect("write profile");
    path.to_string_lossy().into_owned()
}

/// The greedy tokens of `specula run --json` on a profile of `backend` and `model` (with
/// `extra` appended), and how many drafts were accepted.
fn greedy_run(
    dir: &Path,
    backend: &str,
    model: &Path,
    extra: &str,
    tokens: &str,
) -> (serde_json::Value, u64) {
    let p = profile(dir, "p.toml", backend, model, extra);
    let out = specula(
        &[
            "run",
            "--profile",
            &p,
            "-n",
            tokens,
            "--temp",
            "0",
            "--json",
            "Once upon a time",
        ],
        dir,
    );
    assert!(out.status.success(), "{backend} {extra}: {}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    let accepted = v["speculative"]["accepted"].as_u64().unwrap_or(0);
    (v["tokens"].clone(), accepted)
}

/// Whether a CUDA driver is installed (then the no-driver test does not apply).
fn driver_installed() -> bool {
    specula_cuda_hybrid::driver::probe_driver().is_ok()
}

/// `true` when a GPU test can run; else prints why it is skipped (or fails, when
/// `$SPECULA_REQUIRE_GPU` is set, as `plugins/cuda-hybrid/gpu-check/run.sh` does).
fn gpu_or_skip(test: &str) -> bool {
    let required = std::env::var("SPECULA_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0");
    match specula_cuda_hybrid::driver::usable_gpu() {
        Ok(_) => true,
        Err(e) if required => panic!("{test}: SPECULA_REQUIRE_GPU is set, but: {}", e.message),
        Err(e) => {
            eprintln!("SKIPPED {test}: no GPU here: {}", e.message);
            false
        }
    }
}

#[test]
fn plugins_lists_cuda_hybrid() {
    let dir = tempfile::tempdir().unwrap();
    let out = specula(&["plugins"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text
        .lines()
        .find(|l| l.starts_with("cuda-hybrid"))
        .unwrap_or_else(|| panic!("cuda-hybrid is not listed:\n{text}"));
    assert!(
        line.contains("backend") && line.contains("libspecula_cuda_hybrid"),
        "{line}"
    );
    assert!(!text.contains("rejected"), "{text}");
}

#[test]
fn a_cuda_hybrid_profile_fails_clearly_without_a_driver() {
    if driver_installed() {
        eprintln!(
            "SKIPPED: a CUDA driver is installed here; the no-driver message is not exercised"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = profile(
        dir.path(),
        "cuda.toml",
        "cuda-hybrid",
        &shared("models/stories260K.gguf"),
        "[target.options]\ngpu_layers = \"all\"\n",
    );
    let out = specula(&["run", "--profile", &p, "-n", "4"], dir.path());
    assert!(!out.status.success(), "ran without a GPU: {}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("cuda-hybrid")
            && err.contains("no CUDA driver found")
            && err.contains("libcuda.so.1"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // `profile check` says so too, as the one problem of an otherwise sound profile.
    let out = specula(&["profile", "check", &p], dir.path());
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("1 problem") && err.contains("no CUDA driver found"),
        "{err}"
    );
}

#[test]
fn gpu_stories260k_tells_the_lily_story() {
    if !gpu_or_skip("gpu_stories260k_tells_the_lily_story") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = shared("models/stories260K.gguf");
    for options in ["", "[target.options]\ngpu_layers = 2\n"] {
        let p = profile(dir.path(), "cuda.toml", "cuda-hybrid", &model, options);
        let out = specula(
            &["run", "--profile", &p, "-n", "40", "--temp", "0"],
            dir.path(),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stdout(&out).starts_with(LILY),
            "{options}: {}",
            stdout(&out)
        );
    }
}

#[test]
fn gpu_greedy_output_equals_cpu_simd_plain_and_with_mtp_drafting() {
    if !gpu_or_skip("gpu_greedy_output_equals_cpu_simd_plain_and_with_mtp_drafting") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for model in [
        "models/trained/stories-qwen35-mtp-f32.gguf",
        "models/trained/stories-qwen35-mtp-q8_0.gguf",
    ] {
        let model = shared(model);
        let run =
            |backend: &str, extra: &str| greedy_run(dir.path(), backend, &model, extra, "64").0;
        let reference = run("cpu-simd", "");
        let mtp = "[drafter]\nplugin = \"mtp\"\n";
        assert_eq!(
            run("cuda-hybrid", ""),
            reference,
            "{}: plain",
            model.display()
        );
        assert_eq!(
            run("cuda-hybrid", mtp),
            reference,
            "{}: MTP drafting",
            model.display()
        );
        let split = "[target.options]\ngpu_layers = 2\n[drafter]\nplugin = \"mtp\"\n";
        assert_eq!(
            run("cuda-hybrid", split),
            reference,
            "{}: split + MTP",
            model.display()
        );
        let graphs = "[target.options]\ncuda_graphs = true\n[drafter]\nplugin = \"mtp\"\n";
        assert_eq!(
            run("cuda-hybrid", graphs),
            reference,
            "{}: CUDA graphs + MTP",
            model.display()
        );
    }
}

#[test]
fn gpu_greedy_output_equals_plain_with_the_draft_model() {
    if !gpu_or_skip("gpu_greedy_output_equals_plain_with_the_draft_model") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = shared("models/stories260K.gguf");
    let draft = shared("models/llama2xs-281K.gguf");
    let run = |backend: &str, extra: &str| greedy_run(dir.path(), backend, &model, extra, "96");
    let (reference, _) = run("cpu-simd", "");
    for (placement, drafter_backend) in [
        ("", "cuda-hybrid"),
        ("", "cpu-simd"),
        ("[target.options]\ngpu_layers = 2\n", "cuda-hybrid"),
    ] {
        let extra = format!(
            "{placement}[drafter]\nplugin = \"model\"\nmodel = {:?}\nbackend = \"{drafter_backend}\"\n",
            draft.to_str().expect("utf-8 path")
        );
        let (tokens, accepted) = run("cuda-hybrid", &extra);
        assert_eq!(tokens, reference, "{extra}");
        assert!(
            accepted > 0,
            "{extra}: the draft model had no draft accepted"
        );
    }
}
