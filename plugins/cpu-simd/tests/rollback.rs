//! What speculative decoding on the hybrids rests on: a k-token verify is bit-identical, row by
//! row, to k single-token evaluations; rolling back inside the verify window restores the
//! recurrent state exactly and without recomputation; the MTP head's cache rolls back with the
//! trunk; going further back re-decodes (or is refused on request); and a small ring budget
//! shrinks the advertised capacity instead of failing.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::*;
use specula_gguf::GgmlType;
use specula_plugin_api::{ErrorKind, LogitRows};

const PROMPT: [u32; 6] = [1, 403, 261, 378, 13, 300];
const VOCAB: usize = 512;
/// The hybrid fixtures: Gated DeltaNet layers with and without an MTP head, both layouts.
const HYBRIDS: [&str; 3] = [
    "tiny-qwen35.gguf",
    "tiny-qwen35-4l-mtp.gguf",
    "tiny-qwen3next.gguf",
];
const E: usize = 64;

/// The hybrid fixtures, re-typed copies of two of them, and the trained Q8_0 model.
fn parity_models(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut models: Vec<(String, PathBuf)> = HYBRID_FIXTURES
        .iter()
        .map(|(f, _, _)| (f.to_string(), fixture(f)))
        .collect();
    for src in ["tiny-qwen35-4l-mtp.gguf", "tiny-qwen3next-mtp.gguf"] {
        for ty in [GgmlType::Q8_0, GgmlType::BF16] {
            let dst = dir.join(format!("{src}-{ty}.gguf"));
            rewrite_model(
                &fixture(src),
                &dst,
                &Rewrite {
                    matrix_type: Some(ty),
                    ..Default::default()
                },
            );
            models.push((format!("{src} {ty}"), dst));
        }
    }
    models.push(("stories-qwen35 q8_0".into(), trained_qwen35("q8_0")));
    models
}

/// For k = 1 ..= the verify capacity: one k-token eval against k single-token evals from the
/// same state, logits and hidden states bit for bit; also the prompt itself and `Last` rows.
#[test]
fn verify_rows_are_bit_identical_to_single_token_evals() {
    let dir = tempfile::tempdir().unwrap();
    for (name, path) in parity_models(dir.path()) {
        let mut batched = open(&path, 2, 160);
        let mut single = open(&path, 2, 160);
        let cap = batched.caps().max_verify_tokens as usize;
        assert_eq!(cap, 8, "{name}");
        let ks: Vec<usize> = (1..=cap).collect();
        assert_verify_rows_match_single_evals(&mut batched, &mut single, &PROMPT, &ks, 99, &name);
        assert_eq!(batched.len(), single.len());
        assert_eq!(batched.slow_rollbacks(), 0);
    }
}

/// A prompt, then `tokens`, then `after`: the logits and hidden states of `after`.
fn clean_run(path: &Path, tokens: &[u32], after: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let mut b = open(path, 2, 64);
    eval(&mut b, &PROMPT, LogitRows::Last);
    if !tokens.is_empty() {
        eval(&mut b, tokens, LogitRows::All);
    }
    let logits = eval(&mut b, after, LogitRows::All);
    (logits, hidden(&b))
}

/// Verify k drafts, roll back to prompt + j for every j in 0 ..= k, continue: the same bits as
/// a run that never saw the rejected drafts, and no re-decoding.
#[test]
fn rollback_inside_the_window_equals_a_run_without_the_rejected_tokens() {
    let after = [417, 290];
    for file in HYBRIDS {
        let path = fixture(file);
        let drafts = Rng::new(7).tokens(8, VOCAB as u32);
        let clean: Vec<_> = (0..=8)
            .map(|j| clean_run(&path, &drafts[..j], &after))
            .collect();
        for k in 1..=8 {
            for (j, (clean_logits, clean_hidden)) in clean.iter().enumerate().take(k + 1) {
                let mut spec = open(&path, 2, 64);
                eval(&mut spec, &PROMPT, LogitRows::Last);
                eval(&mut spec, &drafts[..k], LogitRows::All);
                spec.truncate_to(PROMPT.len() + j).unwrap();
                assert_eq!(spec.len(), PROMPT.len() + j);
                let logits = eval(&mut spec, &after, LogitRows::All);
                assert_eq!(
                    bits(&logits),
                    bits(clean_logits),
                    "{file}: verify {k}, roll back to prompt+{j}"
                );
                assert_eq!(bits(&hidden(&spec)), bits(clean_hidden), "{file}: hidden");
                assert_eq!(spec.slow_rollbacks(), 0, "{file}: k={k} j={j} re-decoded");
            }
        }
    }
}

/// A simulated speculative loop with a fixed acceptance schedule — full acceptance followed by
/// a zero-draft step, repeated rollbacks, rollbacks to the start of the window — compared row
/// by row with a backend that only ever evaluates the kept tokens, one at a time.
#[test]
fn speculative_loop_schedule_matches_plain_decoding() {
    // (batch size, tokens kept of it); 0 kept rolls back to the start of the window.
    let schedule = [
        (4, 4),
        (1, 1),
        (4, 2),
        (4, 0),
        (3, 0),
        (2, 1),
        (4, 4),
        (1, 1),
        (1, 0),
        (4, 1),
        (4, 3),
        (3, 3),
        (1, 1),
        (4, 0),
        (4, 2),
    ];
    for file in ["tiny-qwen35-4l-mtp.gguf", "tiny-qwen3next-mtp.gguf"] {
        let path = fixture(file);
        let mut spec = open_with(&path, 2, 128, 4, &[]);
        let mut plain = open(&path, 2, 128);
        assert_eq!(spec.caps().rollback_depth, 4);
        eval(&mut spec, &PROMPT, LogitRows::Last);
        eval(&mut plain, &PROMPT, LogitRows::Last);
        let mut rng = Rng::new(11);
        for (step, &(k, kept)) in schedule.iter().enumerate() {
            let start = spec.len();
            let batch = rng.tokens(k, VOCAB as u32);
            let rows = eval(&mut spec, &batch, LogitRows::All);
            let rows_hidden = hidden(&spec);
            for (i, &token) in batch.iter().enumerate().take(kept) {
                let r = eval(&mut plain, &[token], LogitRows::Last);
                assert_eq!(
                    bits(row(&rows, i, VOCAB)),
                    bits(&r),
                    "{file}: step {step} row {i}"
                );
                assert_eq!(
                    bits(row(&rows_hidden, i, E)),
                    bits(&hidden(&plain)),
                    "{file}: step {step} hidden {i}"
                );
            }
            spec.truncate_to(start + kept).unwrap();
            assert_eq!(spec.len(), plain.len(), "{file}: step {step}");
        }
        let tail = [5, 6, 7];
        assert_eq!(
            bits(&eval(&mut spec, &tail, LogitRows::All)),
            bits(&eval(&mut plain, &tail, LogitRows::All)),
            "{file}: after the schedule"
        );
        assert_eq!(spec.slow_rollbacks(), 0, "{file}");
    }
}

/// The MTP head's cache through a verify, a rollback and the catch-up steps of a drafter: its
/// drafts are bit-identical to those of a run that never saw the rejected tokens.
#[test]
fn mtp_cache_rolls_back_with_the_trunk() {
    let mut models: Vec<PathBuf> = HYBRID_FIXTURES
        .iter()
        .filter(|(_, _, mtp)| *mtp)
        .map(|(f, _, _)| fixture(f))
        .collect();
    models.push(trained_qwen35("f32"));
    let p = PROMPT.len();
    let (t0, next_t0) = (300u32, 301u32);
    for path in &models {
        let e = open(path, 1, 16).info().hidden_size as usize;
        for j in 0..=3 {
            // Speculative run: prompt, head in step, 3 chained drafts, verify, roll back.
            let mut a = open(path, 2, 64);
            eval(&mut a, &PROMPT, LogitRows::All);
            let h = hidden(&a);
            for q in 0..p - 1 {
                mtp(&mut a, row(&h, q, e), PROMPT[q + 1], q);
            }
            let (l1, m1) = mtp(&mut a, row(&h, p - 1, e), t0, p - 1);
            let d1 = argmax(&l1);
            let (l2, m2) = mtp(&mut a, &m1, d1, p);
            let d2 = argmax(&l2);
            let (l3, _) = mtp(&mut a, &m2, d2, p + 1);
            let drafts = [d1, d2, argmax(&l3)];
            assert_eq!(a.mtp_len(), Some(p + 2));
            eval(
                &mut a,
                &[t0, drafts[0], drafts[1], drafts[2]],
                LogitRows::All,
            );
            let verify_hidden = hidden(&a);
            a.truncate_to(p + 1 + j).unwrap();
            assert_eq!(a.mtp_len(), Some((p + 2).min(p + 1 + j)));
            // Catch up on the accepted positions with the trunk's hidden states, then draft.
            let mut caught_up = Vec::new();
            for (i, &draft) in drafts.iter().enumerate().take(j) {
                caught_up.push(mtp(&mut a, row(&verify_hidden, i, e), draft, p + i).0);
            }
            let (la, ma) = mtp(&mut a, row(&verify_hidden, j, e), next_t0, p + j);
            let (lb, _) = mtp(&mut a, &ma, argmax(&la), p + j + 1);

            // Clean run: only the kept tokens, the head stepped at every position.
            let mut kept = PROMPT.to_vec();
            kept.push(t0);
            kept.extend_from_slice(&drafts[..j]);
            let mut b = open(path, 2, 64);
            eval(&mut b, &kept, LogitRows::All);
            let hb = hidden(&b);
            let mut clean_steps = Vec::new();
            for q in 0..kept.len() - 1 {
                clean_steps.push(mtp(&mut b, row(&hb, q, e), kept[q + 1], q).0);
            }
            let (la2, ma2) = mtp(&mut b, row(&hb, kept.len() - 1, e), next_t0, p + j);
            let (lb2, _) = mtp(&mut b, &ma2, argmax(&la2), p + j + 1);

            let name = path.file_name().unwrap().to_string_lossy();
            assert_eq!(
                bits(&l1),
                bits(&clean_steps[p - 1]),
                "{name} j={j}: step p-1"
            );
            for (i, l) in caught_up.iter().enumerate() {
                assert_eq!(
                    bits(l),
                    bits(&clean_steps[p + i]),
                    "{name} j={j}: catch-up {i}"
                );
            }
            assert_eq!(bits(&la), bits(&la2), "{name} j={j}: draft 1");
            assert_eq!(bits(&ma), bits(&ma2), "{name} j={j}: draft hidden");
            assert_eq!(bits(&lb), bits(&lb2), "{name} j={j}: draft 2");
        }
    }
}

/// Truncating further back than the ring re-decodes the kept tokens (exactly), or, with
/// `deep_rollback = "refuse"`, fails with a clear error and leaves the sequence alone.
#[test]
fn rollback_beyond_the_window_re_decodes_or_is_refused() {
    let path = fixture("tiny-qwen35-4l-mtp.gguf");
    let extra = Rng::new(3).tokens(10, VOCAB as u32);
    let after = [417, 290];

    let mut b = open_with(&path, 2, 64, 4, &[]);
    eval(&mut b, &PROMPT, LogitRows::Last);
    for &t in &extra {
        eval(&mut b, &[t], LogitRows::Last);
    }
    assert_eq!(b.len(), 16);
    assert_eq!(b.rollback_window(), 12..=16);
    b.truncate_to(10).unwrap();
    assert_eq!((b.len(), b.slow_rollbacks()), (10, 1));
    let logits = eval(&mut b, &after, LogitRows::All);
    let clean = clean_run(&path, &extra[..4], &after);
    assert_eq!(bits(&logits), bits(&clean.0), "after re-decoding");
    assert_eq!(bits(&hidden(&b)), bits(&clean.1));
    // The re-decode refilled the ring: a short rollback is O(1) again.
    assert_eq!(b.rollback_window(), 8..=12);
    b.truncate_to(9).unwrap();
    assert_eq!(b.slow_rollbacks(), 1);
    // Back to the empty sequence.
    b.truncate_to(0).unwrap();
    assert_eq!((b.len(), b.slow_rollbacks()), (0, 2));
    let fresh = {
        let mut f = open(&path, 2, 64);
        eval(&mut f, &PROMPT, LogitRows::All)
    };
    assert_eq!(bits(&eval(&mut b, &PROMPT, LogitRows::All)), bits(&fresh));

    let mut r = open_with(&path, 2, 64, 4, &[("deep_rollback", "refuse")]);
    eval(&mut r, &PROMPT, LogitRows::Last);
    eval(&mut r, &extra, LogitRows::Last);
    let err = r.truncate_to(10).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(
        err.message.contains("kept only for lengths 12..=16")
            && err.message.contains("rollback depth 4")
            && err.message.contains("refuse"),
        "{}",
        err.message
    );
    assert_eq!(r.len(), 16);
    let logits = eval(&mut r, &after, LogitRows::All);
    assert_eq!(bits(&logits), bits(&clean_run(&path, &extra, &after).0));
    // Inside the window it still rolls back, to the oldest state kept too: the 10-token chain
    // above ran longer than the ring, which keeps its last four states.
    r.truncate_to(15).unwrap();
    assert_eq!(r.len(), 15);
    let mut r = open_with(&path, 2, 64, 4, &[("deep_rollback", "refuse")]);
    eval(&mut r, &PROMPT, LogitRows::Last);
    eval(&mut r, &extra, LogitRows::Last);
    r.truncate_to(12).unwrap();
    let logits = eval(&mut r, &after, LogitRows::All);
    assert_eq!(
        bits(&logits),
        bits(&clean_run(&path, &extra[..6], &after).0)
    );
    assert_eq!(r.slow_rollbacks(), 0);
}

/// A verify chain writes only its last row's recurrent state and rebuilds the others when
/// needed: here a second chain overwrites the first one's starting state while a state the
/// first left unwritten is still in the window, and a rollback to it is still exact and O(1).
#[test]
fn a_state_a_chain_left_unwritten_survives_the_next_chain() {
    let path = fixture("tiny-qwen35-4l-mtp.gguf");
    let extra = Rng::new(5).tokens(5, VOCAB as u32);
    let after = [417, 290];
    let mut b = open_with(&path, 2, 64, 4, &[]);
    eval(&mut b, &PROMPT, LogitRows::Last);
    eval(&mut b, &extra[..2], LogitRows::All);
    // 2 + 3 rows from the prompt: the ring of 5 planes wraps onto the first chain's start.
    eval(&mut b, &extra[2..], LogitRows::All);
    let start = PROMPT.len();
    assert_eq!(b.rollback_window(), start + 1..=start + 5);
    b.truncate_to(start + 1).unwrap();
    assert_eq!(b.slow_rollbacks(), 0);
    let logits = eval(&mut b, &after, LogitRows::All);
    let clean = clean_run(&path, &extra[..1], &after);
    assert_eq!(bits(&logits), bits(&clean.0));
    assert_eq!(bits(&hidden(&b)), bits(&clean.1));
}

/// A rollback forgets what a chain recorded past it: here the rolled-back path ends exactly
/// where a later chain starts (a chain from the end of a record shorter than the ring's depth
/// continues it in place), and the continuation must still be that of the kept tokens.
#[test]
fn a_chain_after_a_rollback_continues_only_the_kept_path() {
    let after = [417, 290];
    for file in HYBRIDS {
        let path = fixture(file);
        let mut b = open(&path, 2, 64);
        let depth = b.caps().rollback_depth as usize;
        assert!((4..=16).contains(&depth), "{file}: depth {depth}");
        let mut rng = Rng::new(9);
        let filler = rng.tokens(depth, VOCAB as u32);
        let n = depth - 1;
        let (first, second) = (rng.tokens(n, VOCAB as u32), rng.tokens(n, VOCAB as u32));
        eval(&mut b, &PROMPT, LogitRows::Last);
        // A chain as long as the ring is deep: the next one starts a record of its own.
        eval(&mut b, &filler, LogitRows::Last);
        let start = PROMPT.len() + depth;
        eval(&mut b, &first, LogitRows::All);
        b.truncate_to(start + 2).unwrap();
        eval(&mut b, &second, LogitRows::All);
        // Kept: two of the first chain's tokens, then the second's up to where the first
        // chain's rolled-back path ended.
        b.truncate_to(start + n).unwrap();
        let logits = eval(&mut b, &after, LogitRows::All);
        let kept = [&filler[..], &first[..2], &second[..n - 2]].concat();
        let clean = clean_run(&path, &kept, &after);
        assert_eq!(bits(&logits), bits(&clean.0), "{file}");
        // And a state of that chain rebuilt from what it recorded.
        b.truncate_to(start + n + 1).unwrap();
        let logits = eval(&mut b, &after, LogitRows::All);
        let kept = [&kept[..], &after[..1]].concat();
        let clean = clean_run(&path, &kept, &after);
        assert_eq!(bits(&logits), bits(&clean.0), "{file}");
        assert_eq!(bits(&hidden(&b)), bits(&clean.1), "{file}");
        assert_eq!(b.slow_rollbacks(), 0, "{file}");
    }
}

/// A `Write` into a shared buffer, to capture log lines.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// With `ring_budget_bytes` holding only three slots the backend advertises a verify capacity
/// and rollback depth of 2, warns, and stays exact; a budget below two slots is refused.
#[test]
fn a_small_ring_budget_lowers_the_advertised_capacity() {
    let path = fixture("tiny-qwen3next-mtp.gguf");
    let slot = open(&path, 1, 64).caps().snapshot_bytes_per_slot;
    let budget = (3 * slot + slot / 2).to_string();
    let logs = LogBuffer::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let logs = logs.clone();
            move || logs.clone()
        })
        .with_ansi(false)
        .finish();
    let mut b = tracing::subscriber::with_default(subscriber, || {
        open_with(&path, 2, 64, 8, &[("ring_budget_bytes", budget.as_str())])
    });
    let log = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("WARN")
            && log.contains("holds 2 snapshots")
            && log.contains("instead of the 8"),
        "{log}"
    );
    let caps = b.caps();
    assert_eq!((caps.max_verify_tokens, caps.rollback_depth), (2, 2));
    assert_eq!(caps.snapshot_bytes_per_slot, slot);

    // Exact verify rows and rollback within the smaller window.
    let open_small = || open_with(&path, 2, 64, 8, &[("ring_budget_bytes", budget.as_str())]);
    let mut single = open(&path, 2, 64);
    eval(&mut b, &PROMPT, LogitRows::Last);
    eval(&mut single, &PROMPT, LogitRows::Last);
    let drafts = [40, 41];
    let rows = eval(&mut b, &drafts, LogitRows::All);
    for (i, &t) in drafts.iter().enumerate() {
        assert_eq!(
            bits(row(&rows, i, VOCAB)),
            bits(&eval(&mut single, &[t], LogitRows::Last))
        );
    }
    let after = [417, 290];
    for j in 0..=2 {
        let mut spec = open_small();
        eval(&mut spec, &PROMPT, LogitRows::Last);
        eval(&mut spec, &drafts, LogitRows::All);
        spec.truncate_to(PROMPT.len() + j).unwrap();
        assert_eq!(spec.slow_rollbacks(), 0);
        let logits = eval(&mut spec, &after, LogitRows::All);
        assert_eq!(
            bits(&logits),
            bits(&clean_run(&path, &drafts[..j], &after).0),
            "j={j}"
        );
    }
    // Three back is beyond a depth of 2: the slow path, still exact.
    eval(&mut b, &[42], LogitRows::Last);
    b.truncate_to(PROMPT.len()).unwrap();
    assert_eq!(b.slow_rollbacks(), 1);
    assert_eq!(
        bits(&eval(&mut b, &after, LogitRows::All)),
        bits(&clean_run(&path, &[], &after).0)
    );

    let mut p = params(&path, 1, 64);
    p.options.push(abi_stable::std_types::Tuple2(
        "ring_budget_bytes".into(),
        slot.to_string().into(),
    ));
    let err = specula_cpu_simd::open(&p).expect_err("one slot cannot run");
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    assert!(err.message.contains("at least 2 slots"), "{}", err.message);
}

/// The verify capacity follows `max_verify_tokens`.
#[test]
fn verify_capacity_follows_the_profile() {
    for asked in [1, 3, 16] {
        let b = open_with(&fixture("tiny-qwen35.gguf"), 1, 64, asked, &[]);
        let caps = b.caps();
        assert_eq!(
            (caps.max_verify_tokens, caps.rollback_depth),
            (asked, asked)
        );
    }
}

/// Everything a larger random qwen35 produces — a chunked 100-token prefill, a verify batch,
/// a rollback, MTP steps — with 1, 2 and 3 worker threads (the recurrence runs its value heads
/// in parallel here), as bits.
fn larger_hybrid_run(path: &Path, threads: u32) -> Vec<u32> {
    let mut b = open(path, threads, 256);
    let mut rng = Rng::new(5);
    let mut prompt = vec![1];
    prompt.extend(rng.tokens(99, VOCAB as u32));
    let mut out = bits(&eval(&mut b, &prompt, LogitRows::All));
    out.extend(bits(b.last_hidden_states()));
    let h_last = b.last_hidden_states()[99 * 128..].to_vec();
    out.extend(bits(&eval(
        &mut b,
        &rng.tokens(8, VOCAB as u32),
        LogitRows::All,
    )));
    b.truncate_to(103).unwrap();
    out.extend(bits(&eval(
        &mut b,
        &rng.tokens(3, VOCAB as u32),
        LogitRows::All,
    )));
    let (l, h) = mtp(&mut b, &h_last, 7, 0);
    out.extend(bits(&l));
    let (l, _) = mtp(&mut b, &h, argmax(&l), 1);
    out.extend(bits(&l));
    assert_eq!(b.slow_rollbacks(), 0);
    out
}

#[test]
fn larger_hybrid_is_exact_across_threads_and_batches() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let path = dir.path().join(format!("qwen35-{ty}.gguf"));
        write_qwen35(&path, ty, 21);
        let one = larger_hybrid_run(&path, 1);
        assert!(one.iter().all(|&v| f32::from_bits(v).is_finite()), "{ty}");
        for threads in [2, 3] {
            assert_eq!(
                one,
                larger_hybrid_run(&path, threads),
                "{ty}: 1 vs {threads} threads"
            );
        }
        // Verify rows against single-token evals on the parallel-head path.
        let mut batched = open(&path, 3, 128);
        let mut single = open(&path, 3, 128);
        eval(&mut batched, &PROMPT, LogitRows::Last);
        eval(&mut single, &PROMPT, LogitRows::Last);
        let mut rng = Rng::new(8);
        for k in [1, 5, 8] {
            let tokens = rng.tokens(k, VOCAB as u32);
            let rows = eval(&mut batched, &tokens, LogitRows::All);
            let rows_hidden = hidden(&batched);
            for (i, &t) in tokens.iter().enumerate() {
                let r = eval(&mut single, &[t], LogitRows::Last);
                assert_eq!(bits(row(&rows, i, VOCAB)), bits(&r), "{ty}: k={k} row {i}");
                assert_eq!(
                    bits(row(&rows_hidden, i, 128)),
                    bits(&hidden(&single)),
                    "{ty}: k={k} hidden {i}"
                );
            }
        }
    }
}
