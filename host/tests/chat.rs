//! `specula chat`: scripted conversations on stdin (the cache kept between turns gives the
//! same answers as evaluating every turn afresh, with and without drafting), and a session in
//! a pseudo-terminal where Ctrl-C stops an answer, not the program.

use std::io::Write;
use std::process::{Command, Stdio};

mod common;

use common::*;

/// Runs `specula chat ARGS` with `script` on stdin; returns stdout.
fn chat(args: &[&str], script: impl AsRef<[u8]>, home: &std::path::Path) -> String {
    let mut child = Command::new(specula_bin())
        .arg("chat")
        .args(args)
        .env("SPECULA_HOME", home)
        .env("SPECULA_PLUGIN_PATH", plugin_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_ref())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout(&out)
}

#[test]
fn a_scripted_conversation_keeps_its_turns_in_the_cache() {
    let home = tempfile::tempdir().unwrap();
    let stories = shared("models/stories260K.gguf");
    let args = ["-m", stories.to_str().unwrap(), "--temp", "0", "-n", "30"];
    let script =
        "Hello there\n/stats\nTell me a story\n/stats\n/reset\nHello there\n/exit\nNot read\n";
    let out = chat(&args, script, home.path());
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    let (first, stats1, second, stats2, reset, again) =
        (lines[0], lines[1], lines[2], lines[3], lines[4], lines[5]);
    assert!(
        !first.trim().is_empty() && !second.trim().is_empty(),
        "{out}"
    );
    assert!(
        stats1.starts_with("turns: 1;") && stats1.contains("(0 kept"),
        "{stats1}"
    );
    // The second turn kept the first in the cache: fewer tokens evaluated than prompted.
    let kept: usize = stats2
        .split_once("prompt tokens: ")
        .and_then(|(_, rest)| rest.split_once(" ("))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stats2}"));
    assert!(stats2.starts_with("turns: 2;") && kept > 10, "{stats2}");
    assert_eq!(reset, "(conversation reset)");
    assert_eq!(again, first, "the same conversation after /reset");

    // Evaluating every turn afresh answers the same.
    let fresh = chat(&[&args[..], &["--no-keep"]].concat(), script, home.path());
    let fresh_lines: Vec<&str> = fresh.lines().collect();
    assert_eq!(
        (fresh_lines[0], fresh_lines[2], fresh_lines[5]),
        (first, second, again)
    );
}

/// A conversation that outgrows the context says so and how to go on (`/reset`), and a line
/// that is not UTF-8 is read as text with replacement characters; the session carries on.
#[test]
fn a_full_context_and_a_line_that_is_not_utf8_leave_the_session_going() {
    let home = tempfile::tempdir().unwrap();
    let stories = shared("models/stories260K.gguf");
    let args = [
        "-m",
        stories.to_str().unwrap(),
        "--temp",
        "0",
        "-n",
        "40",
        "-c",
        "64",
    ];
    let script: &[u8] =
        b"Tell me a story\nTell me more\nAnd then?\n/reset\nhi \xff\xfe there\n/stats\n";
    let out = chat(&args, script, home.path());
    assert!(
        out.contains("[the context is full: /reset starts over]"),
        "{out}"
    );
    assert!(
        out.contains("no longer fits the context of 64 tokens: /reset starts a new one"),
        "{out}"
    );
    let stats = out.lines().last().unwrap();
    assert!(stats.starts_with("turns: 2;"), "{out}");
}

/// The built-in model drafting through its MTP head: answers equal plain decoding's, with the
/// cache kept or not, and the drafter keeps drafting on later turns (its head continues from
/// the kept prefix).
#[test]
fn conversations_speculate_across_turns_with_plain_output() {
    let home = tempfile::tempdir().unwrap();
    let script = "Once upon a time\nTell me about Lily\nWhat did she find?\n/stats\n";
    let kept = chat(&["--temp", "0", "-n", "48"], script, home.path());
    let fresh = chat(
        &["--temp", "0", "-n", "48", "--no-keep"],
        script,
        home.path(),
    );
    let plain = chat(
        &["--temp", "0", "-n", "48", "--no-spec"],
        script,
        home.path(),
    );
    let answers = |out: &str| out.lines().take(3).map(str::to_string).collect::<Vec<_>>();
    assert_eq!(answers(&kept), answers(&plain), "{kept}\n{plain}");
    assert_eq!(answers(&fresh), answers(&plain));
    let figure = |out: &str, key: &str| -> u64 {
        out.split_once(key)
            .and_then(|(before, _)| before.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {key:?} in {out}"))
    };
    // Drafting did not stop after the first turn: as many drafts as without the cache.
    assert_eq!(
        figure(&kept, " drafted,"),
        figure(&fresh, " drafted,"),
        "{kept}\n{fresh}"
    );
    assert!(figure(&kept, " drafted,") > 60, "{kept}");
    assert!(
        kept.contains("kept in the cache") && !kept.contains("(0 kept"),
        "{kept}"
    );
}

#[test]
fn ctrl_c_in_a_terminal_stops_the_answer_not_the_program() {
    let has_python = Command::new("python3")
        .args(["-c", "import pty"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_python {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI has no python3 with pty"
        );
        eprintln!("SKIPPED: no python3 with the pty module");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A model slow enough (~130 tokens/s) that the answer is still being written at Ctrl-C.
    let model = small_llama(dir.path());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/chat_pty.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(specula_bin())
        .arg(&model)
        .env("SPECULA_HOME", dir.path())
        .env("SPECULA_PLUGIN_PATH", plugin_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("chat_pty: ok"), "{}", stdout(&out));
}
