//! Helpers for the end-to-end tests in `host/tests/`: the `specula` binary and plugin
//! libraries cargo built for this test run, the shared models, and small profile and plugin
//! fixtures. (Each test file uses some of them.)
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// `target/<profile>/`, the directory holding the `specula` binary and the plugin libraries
/// (the test executable itself lives in its `deps/` subdirectory).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// The `specula` binary cargo built for this test run, from the same sources as the test
/// (never an older binary that happens to be in `target/`). `$SPECULA_BIN` overrides it for
/// test executables run away from their checkout (the GPU kit, `plugins/cuda-hybrid/gpu-check/`).
pub fn specula_bin() -> PathBuf {
    let bin = std::env::var_os("SPECULA_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_specula")));
    assert!(bin.is_file(), "{} is missing", bin.display());
    bin
}

/// Where `cargo test` leaves the plugin libraries it builds as dependencies of this crate:
/// `target/<profile>/deps/` (only `cargo build` copies them up beside the binary).
pub fn plugin_dir() -> PathBuf {
    build_dir().join("deps")
}

/// The built library of plugin crate `name` (e.g. `cpu-simd`, `drafter-lookup`).
pub fn plugin_library(name: &str) -> PathBuf {
    let file = format!(
        "{}specula_{}{}",
        std::env::consts::DLL_PREFIX,
        name.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    );
    let path = plugin_dir().join(&file);
    assert!(path.is_file(), "{} is missing", path.display());
    path
}

/// A file in the shared folder: `../shared` from the workspace root, or the directory
/// `$SPECULA_SHARED` names (for test executables run away from their checkout, as on a GPU
/// machine; see `plugins/cuda-hybrid/gpu-check/`).
pub fn shared(rel: &str) -> PathBuf {
    let path = std::env::var_os("SPECULA_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
        .join(rel);
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// Writes a profile for `model` on the cpu-simd backend (plus `extra` TOML) into `dir`.
pub fn write_profile(dir: &Path, name: &str, model: &Path, extra: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 2\n{extra}",
        model.to_str().expect("utf-8 path")
    );
    std::fs::write(&path, text).expect("write profile");
    path
}

/// Runs `specula` with `args`, empty stdin, `SPECULA_HOME` set to `home`, and the plugin
/// libraries of this build on `SPECULA_PLUGIN_PATH`.
pub fn specula(args: &[&str], home: &Path) -> Output {
    Command::new(specula_bin())
        .args(args)
        .env("SPECULA_HOME", home)
        .env("SPECULA_PLUGIN_PATH", plugin_dir())
        .stdin(Stdio::null())
        .output()
        .expect("run specula")
}

/// Standard output as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Standard error as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Compiles `source` into a shared library at `path` with the `rustc` cargo used.
pub fn compile_cdylib(source: &str, path: &Path) {
    let dir = path.parent().expect("dir");
    let src = dir.join(format!(
        "{}.rs",
        path.file_stem().unwrap().to_string_lossy()
    ));
    std::fs::write(&src, source).expect("write source");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let status = Command::new(rustc)
        .args(["--edition", "2021", "--crate-type", "cdylib", "-o"])
        .arg(path)
        .arg(&src)
        .status()
        .expect("run rustc");
    assert!(status.success(), "rustc failed on {}", src.display());
}

/// Writes a profile with the plugin directory of this build, `model` as target on cpu-simd,
/// and `extra` TOML appended (e.g. a `[drafter]` section); returns its path.
pub fn write_spec_profile(dir: &Path, name: &str, model: &Path, extra: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "plugin_dir = {:?}\n[target]\nbackend = \"cpu-simd\"\nmodel = {:?}\nthreads = 2\n{extra}",
        plugin_dir().to_str().expect("utf-8 path"),
        model.to_str().expect("utf-8 path")
    );
    std::fs::write(&path, text).expect("write profile");
    path
}

/// [`specula`], asserting that it succeeded (showing its stderr when not).
pub fn specula_ok(args: &[&str], home: &Path) -> Output {
    let out = specula(args, home);
    assert!(
        out.status.success(),
        "specula {args:?} failed: {}",
        stderr(&out)
    );
    out
}

/// Standard output parsed as the one JSON object `--json` prints.
pub fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_str(stdout(out).trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(out)))
}
pub mod daemon;

/// Writes `gen-model`'s `small-llama` preset (dim 512, 8 layers, F32) into `dir`: a model
/// slow enough on the CPU (~130 tokens/s on one thread) for tests that need a generation to
/// be still running while something else happens.
pub fn small_llama(dir: &Path) -> PathBuf {
    let model = dir.join("small.gguf");
    specula_ok(
        &[
            "gen-model",
            "--preset",
            "small-llama",
            "--out",
            model.to_str().expect("utf-8 path"),
        ],
        dir,
    );
    model
}
