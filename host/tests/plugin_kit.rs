//! The plugin author kit: `examples/drafter-template`, a drafter crate outside the workspace
//! that depends on `specula-plugin-api` alone, built with its own `cargo build` and run by the
//! unchanged host; and what an author sees when a plugin was built against another layout of
//! the API.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::*;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where the template builds (shared by the tests, so dependencies compile once).
fn template_target() -> PathBuf {
    build_dir().join("../drafter-template")
}

/// `cargo build --release --offline` of the crate at `dir`, with the workspace's lock file
/// (so it resolves to the versions already downloaded); returns its library.
fn cargo_build(dir: &Path) -> PathBuf {
    let lock = dir.join("Cargo.lock");
    if !lock.exists() {
        std::fs::copy(workspace().join("Cargo.lock"), &lock).unwrap();
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "--release", "--offline", "--target-dir"])
        .arg(template_target())
        .current_dir(dir)
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "cargo build in {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let lib = template_target()
        .join("release")
        .join(library_file_name("drafter-template"));
    assert!(lib.is_file(), "{} is missing", lib.display());
    lib
}

fn library_file_name(name: &str) -> String {
    specula_host::plugins::library_file_name(name)
}

/// Builds the template as an author would, and runs it through the host binary: listed as
/// the drafter `template`, its greedy output equal to plain decoding, its drafts accepted.
/// (One test, so the two builds of the template do not race for its target directory.)
#[test]
fn the_template_drafter_builds_alone_and_runs_in_the_host() {
    let lib = cargo_build(&workspace().join("examples/drafter-template"));
    let plugins = tempfile::tempdir().unwrap();
    let installed = plugins.path().join(lib.file_name().unwrap());
    std::fs::copy(&lib, &installed).unwrap();
    let home = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(specula_bin())
            .args(args)
            .env("SPECULA_HOME", home.path())
            .env(
                "SPECULA_PLUGIN_PATH",
                std::env::join_paths([plugins.path(), plugin_dir().as_path()]).unwrap(),
            )
            .output()
            .unwrap()
    };
    let out = run(&["plugins"]);
    let listing = stdout(&out);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("template ") && l.contains("drafter")),
        "{listing}"
    );
    let stories = shared("models/stories260K.gguf");
    let out = run(&[
        "run",
        "-m",
        stories.to_str().unwrap(),
        "--drafter",
        "template",
        "--temp",
        "0",
        "--fixed-draft",
        "--draft-max",
        "3",
        "--check-plain",
        "-n",
        "300",
        "Once upon a time",
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(stdout(&out).starts_with(", there was a little girl named Lily"));
    assert!(
        err.contains("check: plain decoding (no drafts) gives the same 300 tokens"),
        "{err}"
    );
    let accepted: u64 = err
        .split_once(" drafted, ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no acceptance figure in {err}"));
    assert!(accepted > 20, "{err}");

    layout_mismatches_are_reported_in_a_line();
}

/// A plugin built against an API whose `DraftRequest` has one more field (same ABI version
/// number) is refused with one line naming the type, where it is, and what differs; the full
/// abi_stable report waits at debug level.
fn layout_mismatches_are_reported_in_a_line() {
    let dir = tempfile::tempdir().unwrap();
    // A copy of the API with a field added, standing alone (no workspace inheritance).
    let api = dir.path().join("plugin-api");
    copy_dir(&workspace().join("plugin-api"), &api);
    let manifest = std::fs::read_to_string(api.join("Cargo.toml"))
        .unwrap()
        .replace("version.workspace = true", "version = \"0.1.0\"")
        .replace("edition.workspace = true", "edition = \"2021\"")
        .replace("license.workspace = true", "license = \"MIT\"")
        .replace("abi_stable.workspace = true", "abi_stable = \"0.11.3\"");
    std::fs::write(api.join("Cargo.toml"), manifest).unwrap();
    let drafter_rs = api.join("src/drafter.rs");
    let source = std::fs::read_to_string(&drafter_rs).unwrap();
    let grown = source.replacen(
        "    pub tree: bool,\n}",
        "    pub tree: bool,\n    pub hint: u64,\n}",
        1,
    );
    assert_ne!(grown, source, "DraftRequest moved; update this test");
    std::fs::write(&drafter_rs, grown).unwrap();
    let template = dir.path().join("template");
    copy_dir(&workspace().join("examples/drafter-template"), &template);
    let _ = std::fs::remove_dir_all(template.join("target"));
    let manifest = std::fs::read_to_string(template.join("Cargo.toml"))
        .unwrap()
        .replace("path = \"../../plugin-api\"", "path = \"../plugin-api\"");
    std::fs::write(template.join("Cargo.toml"), manifest).unwrap();
    let lib = cargo_build(&template);
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    std::fs::copy(&lib, plugins.join(library_file_name("grown"))).unwrap();

    let home = tempfile::tempdir().unwrap();
    let out = Command::new(specula_bin())
        .arg("plugins")
        .env("SPECULA_HOME", home.path())
        .env("SPECULA_PLUGIN_PATH", &plugins)
        .output()
        .unwrap();
    let listing = stdout(&out);
    let rejected: Vec<&str> = listing
        .lines()
        .skip_while(|l| !l.starts_with("rejected"))
        .skip(1)
        .collect();
    assert_eq!(rejected.len(), 1, "{listing}");
    let line = rejected[0];
    assert!(
        line.contains("libspecula_grown")
            && line.contains("DraftRequest")
            && line.contains("size 40 here, 48 in the plugin")
            && line.contains("rebuild the plugin"),
        "{line}"
    );
    assert!(line.len() < 400, "{line}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "target" {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            copy_dir(&path, &to.join(&name));
        } else {
            std::fs::copy(&path, to.join(&name)).unwrap();
        }
    }
}
