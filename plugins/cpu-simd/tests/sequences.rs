//! Many sequences in one instance: every row of a batched pass — whatever other sequences,
//! lengths, prefill chunks and verify widths share it — is bit-identical to the same chunk
//! evaluated alone in its sequence; forks continue as their parent would; sequences are
//! bounded and checked.

mod common;

use std::path::{Path, PathBuf};

use abi_stable::std_types::{RSlice, RVec};
use common::*;
use specula_cpu_simd::CpuBackend;
use specula_drafting::argmax;
use specula_engine::kv_cache::BLOCK_TOKENS;
use specula_gguf::GgmlType;
use specula_plugin_api::testing::assert_tree_rows_match_their_paths;
use specula_plugin_api::{
    ErrorKind, EvalChunk, ForwardPass, LogitRows, SeqId, SequenceCalls, TREE_ROOT,
};

/// Opens `path` with room for `max_sequences` sequences and backend `options`.
fn open_many(path: &Path, max_sequences: u32, options: &[(&str, &str)]) -> CpuBackend {
    let mut p = params(path, 2, 256);
    p.max_sequences = max_sequences;
    for (key, value) in options {
        p.options.push(abi_stable::std_types::Tuple2(
            (*key).into(),
            (*value).into(),
        ));
    }
    specula_cpu_simd::open(&p).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

/// Every architecture (dense llama, qwen2, qwen3; hybrid qwen35 and qwen3next, with and without
/// an MTP head) and every weight type.
fn models(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut models = vec![
        ("stories260K f32".to_string(), stories()),
        ("tiny-llama f32".to_string(), tiny_llama()),
        ("tiny-qwen2 f32".to_string(), tiny_qwen2()),
        ("stories-qwen35 q8_0".to_string(), trained_qwen35("q8_0")),
    ];
    models.extend(
        HYBRID_FIXTURES
            .iter()
            .map(|(f, _, _)| (f.to_string(), fixture(f))),
    );
    for ty in [
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
    ] {
        for (name, src) in [
            ("tiny-llama", tiny_llama()),
            ("tiny-qwen35-4l-mtp", fixture("tiny-qwen35-4l-mtp.gguf")),
        ] {
            let dst = dir.join(format!("{name}-{ty}.gguf"));
            let rewrite = Rewrite {
                matrix_type: Some(ty),
                ..Default::default()
            };
            rewrite_model(&src, &dst, &rewrite);
            models.push((format!("{name} {ty}"), dst));
        }
    }
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let dst = dir.join(format!("qwen3-{ty}.gguf"));
        write_qwen3(&dst, ty, 7);
        models.push((format!("qwen3 {ty}"), dst));
    }
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let dst = dir.join(format!("qwen3-{ty}.gguf"));
        write_qwen3_shaped(&dst, ty, 7, Qwen3Shape::K_QUANT);
        models.push((format!("qwen3 {ty}"), dst));
    }
    let dst = dir.join("qwen35-wide-q8_0.gguf");
    write_qwen35(&dst, GgmlType::Q8_0, 3);
    models.push(("qwen35 wide q8_0".into(), dst));
    models
}

/// 1, 3 and 8 sequences of mixed lengths, prefill chunks beside verify rows, forks, frees and
/// truncations: every row and every MTP row bit-identical to its sequence evaluated alone.
#[test]
fn batched_rows_are_bit_identical_to_each_sequence_alone() {
    let dir = tempfile::tempdir().unwrap();
    for (name, path) in models(dir.path()) {
        for n_seqs in [1, 3, 8] {
            let mut batched = open_many(&path, n_seqs, &[]);
            let mut alone = open_many(&path, n_seqs, &[]);
            let caps = batched.capabilities();
            assert_eq!(caps.max_sequences, n_seqs, "{name}");
            let rollback = (caps.rollback_depth as usize).min(8);
            let name = format!("{name}, {n_seqs} sequences");
            assert_batches_match_sequences_alone(
                &mut batched,
                &mut alone,
                n_seqs as usize,
                12,
                rollback,
                u64::from(n_seqs),
                &name,
            );
            assert_eq!(batched.slow_rollbacks(), alone.slow_rollbacks(), "{name}");
        }
    }
}

/// The same with an f32 KV cache (the default is f16) and with the row-major weight layout.
#[test]
fn batched_rows_stay_bit_identical_with_other_cache_and_weight_layouts() {
    for options in [&[("kv_type", "f32")][..], &[("weight_layout", "file")][..]] {
        for path in [tiny_llama(), fixture("tiny-qwen3next-mtp.gguf")] {
            let mut batched = open_many(&path, 6, options);
            let mut alone = open_many(&path, 6, options);
            let name = format!("{} {options:?}", path.display());
            assert_batches_match_sequences_alone(&mut batched, &mut alone, 6, 10, 8, 5, &name);
        }
    }
}

/// A Q8_0 KV cache (`kv_type = "q8_0"`): every row of a batched pass — verify rows of mixed
/// widths, prefill chunks, forks, truncations — stays bit-identical to its sequence evaluated
/// alone, on a dense and a hybrid model whose heads are whole Q8_0 blocks; its logits stay
/// close to the f16 cache's; a model with other head sizes is refused naming the option.
#[test]
fn a_q8_0_cache_keeps_every_row_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let dense = dir.path().join("qwen3-heads64.gguf");
    write_qwen3_shaped(&dense, GgmlType::Q8_0, 7, Qwen3Shape::K_QUANT);
    let hybrid = dir.path().join("qwen35-wide.gguf");
    write_qwen35(&hybrid, GgmlType::Q8_0, 3);
    let q8 = [("kv_type", "q8_0")];
    for path in [dense, hybrid] {
        let name = format!("{} q8_0 cache", path.display());
        let mut batched = open_many(&path, 6, &q8);
        let mut alone = open_many(&path, 6, &q8);
        assert_batches_match_sequences_alone(&mut batched, &mut alone, 6, 10, 8, 5, &name);

        let prompt: Vec<u32> = Rng::new(4).tokens(BLOCK_TOKENS + 7, 512);
        let logits = |options: &[(&str, &str)]| {
            let mut b = open_many(&path, 1, options);
            let seq = b.seq_create().into_result().unwrap();
            eval_in(&mut b, seq, &prompt, LogitRows::Last)
        };
        // Greedy speculation over the q8_0 cache: verify batches of the plain greedy tokens
        // with a wrong last draft, rolled back after each, emit exactly the plain tokens.
        // A q8_0 instance after the first 20 prompt tokens, and its greedy next token.
        let start = || {
            let mut b = open_many(&path, 1, &q8);
            let seq = b.seq_create().into_result().unwrap();
            let first = argmax(&eval_in(&mut b, seq, &prompt[..20], LogitRows::Last));
            (b, seq, first)
        };
        let (mut plain, p, first) = start();
        let mut want = vec![first];
        while want.len() < 13 {
            let last = *want.last().unwrap();
            want.push(argmax(&eval_in(&mut plain, p, &[last], LogitRows::Last)));
        }
        let (mut spec, s, first) = start();
        let mut got = vec![first];
        let vocab = spec.model_info().vocab_size;
        while got.len() < 13 {
            let at = got.len();
            let mut batch = vec![got[at - 1]];
            batch.extend(&want[at..(at + 2).min(want.len())]);
            batch.push((want[(at + 2).min(want.len() - 1)] + 1) % vocab);
            let before = spec.seq_len(s).into_result().unwrap();
            let rows = eval_in(&mut spec, s, &batch, LogitRows::All);
            let mut kept = 0;
            for (i, row) in rows.chunks_exact(vocab as usize).enumerate() {
                let token = argmax(row);
                got.push(token);
                kept = i + 1;
                if i + 1 == batch.len() || batch[i + 1] != token {
                    break;
                }
            }
            spec.truncate(s, before + kept).into_result().unwrap();
        }
        assert_eq!(&got[..13], &want[..], "{name}: greedy speculation");

        let (quantised, half) = (logits(&q8), logits(&[]));
        let diff = quantised
            .iter()
            .zip(&half)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let scale = half.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            diff > 0.0 && diff < 0.03 * scale,
            "{name}: q8_0 against f16 logits {diff} (largest {scale})"
        );
    }
    let mut p = params(&tiny_llama(), 2, 256);
    p.options.push(abi_stable::std_types::Tuple2(
        "kv_type".into(),
        "q8_0".into(),
    ));
    let err = specula_cpu_simd::open(&p).map(|_| ()).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("kv_type 'q8_0'"), "{err}");
}

/// A new sequence given what the prefix cache holds of `tokens`: it and the tokens it took.
fn reuse(b: &mut CpuBackend, tokens: &[u32]) -> (SeqId, usize) {
    let seq = b.seq_create().into_result().unwrap();
    let n = b
        .seq_reuse_prefix(seq, RSlice::from_slice(tokens))
        .into_result()
        .unwrap();
    assert_eq!(b.seq_len(seq).into_result(), Ok(n));
    (seq, n)
}

fn eval_in(b: &mut CpuBackend, seq: SeqId, tokens: &[u32], rows: LogitRows) -> Vec<f32> {
    let mut logits = RVec::new();
    b.eval(seq, tokens, rows, &mut logits)
        .into_result()
        .unwrap_or_else(|e| panic!("eval in {seq}: {e}"));
    logits.to_vec()
}

/// A fork holds its parent's tokens, caches and recurrent state (and its rollback window):
/// parent and fork continue, and roll back, exactly as a fresh sequence fed the same tokens.
#[test]
fn a_fork_continues_and_rolls_back_as_its_parent_would() {
    const PROMPT: [u32; 6] = [1, 403, 261, 378, 13, 300];
    for path in [
        stories(),
        fixture("tiny-qwen35-4l-mtp.gguf"),
        fixture("tiny-qwen3next.gguf"),
    ] {
        let name = path.display().to_string();
        let mut b = open_many(&path, 4, &[]);
        let parent = b.seq_create().into_result().unwrap();
        eval_in(&mut b, parent, &PROMPT, LogitRows::Last);
        eval_in(&mut b, parent, &[7, 8, 9, 10], LogitRows::All);
        let fork = b.seq_fork(parent).into_result().unwrap();
        assert_eq!(b.seq_len(fork).into_result(), Ok(PROMPT.len() + 4));
        // Both roll back inside the window they share, then diverge.
        b.truncate(fork, PROMPT.len() + 1).into_result().unwrap();
        let from_fork = eval_in(&mut b, fork, &[41, 42], LogitRows::All);
        let from_parent = eval_in(&mut b, parent, &[51], LogitRows::All);

        let mut fresh = open_many(&path, 2, &[]);
        let a = fresh.seq_create().into_result().unwrap();
        let mut history = PROMPT.to_vec();
        history.push(7);
        eval_in(&mut fresh, a, &history, LogitRows::Last);
        let want_fork = eval_in(&mut fresh, a, &[41, 42], LogitRows::All);
        let c = fresh.seq_create().into_result().unwrap();
        history.extend([8, 9, 10]);
        eval_in(&mut fresh, c, &history, LogitRows::Last);
        let want_parent = eval_in(&mut fresh, c, &[51], LogitRows::All);
        assert_eq!(bits(&from_fork), bits(&want_fork), "{name}: fork");
        assert_eq!(bits(&from_parent), bits(&want_parent), "{name}: parent");
        assert_eq!(b.slow_rollbacks(), 0, "{name}");
    }
}

/// Sequences are bounded by `max_sequences`, a freed one is gone for good (its id is never
/// reused), and a batch naming a sequence twice or an unknown one is refused without
/// changing any sequence.
#[test]
fn sequences_are_bounded_and_checked() {
    let mut p = params(&stories(), 1, 64);
    p.max_sequences = 5000;
    let err = specula_cpu_simd::open(&p).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("max_sequences = 5000"), "{err}");

    let mut b = open_many(&stories(), 2, &[]);
    let a = b.seq_create().into_result().unwrap();
    let c = b.seq_create().into_result().unwrap();
    let full = b.seq_create().into_result().unwrap_err();
    assert_eq!(full.kind, ErrorKind::ContextFull, "{full}");
    assert!(
        full.message.contains("all 2 sequences are in use"),
        "{full}"
    );
    assert_eq!(
        b.seq_fork(a).into_result().unwrap_err().kind,
        ErrorKind::ContextFull
    );

    eval_in(&mut b, a, &[1, 2, 3], LogitRows::Last);
    let twice = [
        EvalChunk::chain(a, &[4], LogitRows::Last),
        EvalChunk::chain(a, &[5], LogitRows::Last),
    ];
    let mut logits = RVec::new();
    let err = b
        .eval_batch(RSlice::from_slice(&twice), &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("appears twice"), "{err}");
    assert_eq!(b.seq_len(a).into_result(), Ok(3));

    b.seq_free(c).into_result().unwrap();
    for err in [
        b.seq_len(c).into_result().unwrap_err(),
        b.truncate(c, 0).into_result().unwrap_err(),
        b.eval(c, &[1], LogitRows::Last, &mut logits)
            .into_result()
            .unwrap_err(),
        b.seq_free(c).into_result().unwrap_err(),
    ] {
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(err.message.contains("unknown sequence"), "{err}");
    }
    let d = b.seq_create().into_result().unwrap();
    assert!(d != a && d != c, "ids are never reused");
    assert_eq!(b.seq_len(d).into_result(), Ok(0));
    let err = b
        .eval_batch(RSlice::from_slice(&[]), &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
}

/// A new sequence whose prompt starts like an earlier one takes the cached blocks (whole
/// blocks, never the last token) and evaluates only the rest: its logits are the bits of a
/// full evaluation, also after the first sequence is gone; a prompt that differs inside a
/// block takes only the blocks before it.
#[test]
fn a_repeated_prompt_is_served_from_the_prefix_cache_bit_for_bit() {
    const B: usize = BLOCK_TOKENS;
    let prompt: Vec<u32> = Rng::new(3).tokens(3 * B + 4, 512);
    let mut b = open_many(&tiny_llama(), 3, &[]);
    let first = b.seq_create().into_result().unwrap();
    let want = eval_in(&mut b, first, &prompt, LogitRows::Last);
    let (second, n) = reuse(&mut b, &prompt);
    assert_eq!(n, 3 * B, "the three full blocks");
    let got = eval_in(&mut b, second, &prompt[n..], LogitRows::Last);
    assert_eq!(bits(&got), bits(&want));
    // Not on a sequence that holds tokens.
    let err = b
        .seq_reuse_prefix(second, RSlice::from_slice(&prompt))
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    b.seq_free(first).into_result().unwrap();
    b.seq_free(second).into_result().unwrap();

    let mut other = prompt.clone();
    other[B + 3] = (other[B + 3] + 1) % 512;
    let (third, n) = reuse(&mut b, &other);
    assert_eq!(n, B);
    let mut fresh = open_many(&tiny_llama(), 1, &[]);
    let alone = fresh.seq_create().into_result().unwrap();
    let want_other = eval_in(&mut fresh, alone, &other, LogitRows::Last);
    let got = eval_in(&mut b, third, &other[n..], LogitRows::Last);
    assert_eq!(bits(&got), bits(&want_other));
    let (_, n) = reuse(&mut b, &prompt);
    assert_eq!(n, 3 * B, "the first prompt's blocks outlived its sequence");
}

/// A hybrid serves a prefix from the cache with the recurrent state at its last block
/// boundary: a sequence begun through the prefix cache leaves the state at the last block
/// boundary each evaluation reaches — inside a long prefill chunk (whose later rows would
/// overwrite that ring plane) or at a single decoded token — and a new sequence repeating
/// the tokens takes the blocks up to the longest cached state and continues bit for bit as a
/// sequence that evaluated everything — its MTP head too, whose cache is rebuilt for the
/// reused positions. Without a state budget nothing is reused.
#[test]
fn a_hybrid_prefix_is_served_with_its_recurrent_state_bit_for_bit() {
    const B: usize = BLOCK_TOKENS;
    let alone = |path: &Path, tokens: &[u32]| {
        let mut fresh = open_many(path, 1, &[]);
        let seq = fresh.seq_create().into_result().unwrap();
        eval_in(&mut fresh, seq, tokens, LogitRows::Last)
    };
    // The MTP head's logits of positions `position ..` of `seq` after its last evaluation
    // (which began there): each trunk row with the token after it, as a drafter steps it.
    let head = |b: &mut CpuBackend, seq: SeqId, tokens: &[u32], position: usize| {
        let mut hidden = RVec::new();
        b.hidden_states(seq, &mut hidden).into_result().unwrap();
        let e = b.model_info().hidden_size as usize;
        let n = tokens.len() - 1 - position;
        let (mut logits, mut out) = (RVec::new(), RVec::new());
        b.mtp_eval(
            seq,
            &hidden[..n * e],
            &tokens[position + 1..],
            position,
            LogitRows::All,
            &mut logits,
            &mut out,
        )
        .into_result()
        .unwrap_or_else(|e| panic!("mtp_eval at {position}: {e}"));
        logits.to_vec()
    };
    let models = [
        fixture("tiny-qwen35.gguf"),
        fixture("tiny-qwen3next.gguf"),
        fixture("tiny-qwen35-mtp.gguf"),
        fixture("tiny-qwen3next-mtp.gguf"),
        trained_qwen35("q8_0"),
    ];
    for path in &models {
        let name = path.file_name().unwrap().to_string_lossy();
        let path = path.as_path();
        let has_head = open_many(path, 1, &[]).capabilities().mtp_head;
        let mut b = open_many(path, 3, &[]);
        let vocab = b.model_info().vocab_size;
        let prompt: Vec<u32> = Rng::new(9).tokens(2 * B + 10, vocab);
        // A prefill pass across the first boundary with more rows after it than the ring
        // holds, then single tokens across the second.
        let (first, n) = reuse(&mut b, &prompt);
        assert_eq!(n, 0, "{name}: nothing cached yet");
        eval_in(&mut b, first, &prompt[..40], LogitRows::Last);
        eval_in(&mut b, first, &prompt[40..B + 40], LogitRows::Last);
        for t in B + 40..prompt.len() {
            eval_in(&mut b, first, &prompt[t..t + 1], LogitRows::Last);
        }
        b.seq_free(first).into_result().unwrap();

        let (second, n) = reuse(&mut b, &prompt);
        assert_eq!(
            n,
            2 * B,
            "{name}: up to the state the single tokens reached"
        );
        let got = eval_in(&mut b, second, &prompt[n..], LogitRows::Last);
        assert_eq!(bits(&got), bits(&alone(path, &prompt)), "{name}");
        if has_head {
            let mut fresh = open_many(path, 1, &[]);
            let seq = fresh.seq_create().into_result().unwrap();
            eval_in(&mut fresh, seq, &prompt, LogitRows::Last);
            let want = head(&mut fresh, seq, &prompt, 0);
            let got = head(&mut b, second, &prompt, n);
            let v = vocab as usize;
            assert_eq!(
                bits(&got),
                bits(&want[n * v..]),
                "{name}: the MTP head after the rebuilt prefix"
            );
        }
        // The continuation too: a token past the cached state, in a pass beside another
        // sequence's prefill.
        let next = [(prompt[3] + 1) % vocab];
        let third = b.seq_create().into_result().unwrap();
        let mut logits = RVec::new();
        let chunks = [
            EvalChunk::chain(second, &next, LogitRows::All),
            EvalChunk::chain(third, &prompt[..7], LogitRows::Last),
        ];
        b.eval_batch(RSlice::from_slice(&chunks), &mut logits)
            .into_result()
            .unwrap();
        let vocab_len = vocab as usize;
        let mut longer = prompt.clone();
        longer.push(next[0]);
        assert_eq!(
            bits(&logits[..vocab_len]),
            bits(&alone(path, &longer)),
            "{name}: continuing from the cached state"
        );

        // A prompt that leaves the first one inside its second block takes the first block,
        // whose state the long chunk left.
        let mut other = prompt.clone();
        other[B + 20] = (other[B + 20] + 1) % vocab;
        let (fourth, n) = reuse(&mut b, &other);
        assert_eq!(n, B, "{name}: the state inside the long chunk");
        let got = eval_in(&mut b, fourth, &other[n..], LogitRows::Last);
        assert_eq!(bits(&got), bits(&alone(path, &other)), "{name}");

        // No state budget: no hybrid prefix.
        let mut none = open_many(path, 2, &[("prefix_state_bytes", "0")]);
        let (s, _) = reuse(&mut none, &prompt);
        eval_in(&mut none, s, &prompt, LogitRows::Last);
        none.seq_free(s).into_result().unwrap();
        assert_eq!(reuse(&mut none, &prompt).1, 0, "{name}");
    }
}

/// The KV memory of all sequences is the pool's (`kv_tokens`), not sequences × context: a
/// pass that needs more blocks than are free is refused as context-full, changing no
/// sequence, and freeing a sequence makes room.
#[test]
fn the_kv_pool_bounds_every_sequence_together() {
    let mut p = params(&tiny_llama(), 2, 256);
    p.max_sequences = 4;
    p.kv_tokens = 128;
    let mut b = specula_cpu_simd::open(&p).unwrap();
    assert_eq!(b.capabilities().kv_tokens, 128);
    let tokens = Rng::new(5).tokens(60, 512);
    let seqs: Vec<SeqId> = (0..2)
        .map(|_| b.seq_create().into_result().unwrap())
        .collect();
    for &s in &seqs {
        eval_in(&mut b, s, &tokens, LogitRows::Last);
    }
    let usage = |b: &CpuBackend| {
        let u = b.kv_usage();
        assert_eq!((u.block_tokens, u.blocks_total), (64, 2), "{u:?}");
        (u.blocks_used, u.blocks_cached, u.blocks_free())
    };
    assert_eq!(usage(&b), (2, 0, 0), "one block per live sequence");
    let third = b.seq_create().into_result().unwrap();
    let mut logits = RVec::new();
    let err = b
        .eval(third, &tokens, LogitRows::Last, &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ContextFull, "{err}");
    assert!(err.message.contains("kv_tokens"), "{err}");
    assert_eq!(b.seq_len(third).into_result(), Ok(0));
    assert_eq!(b.seq_len(seqs[0]).into_result(), Ok(60));
    b.seq_free(seqs[1]).into_result().unwrap();
    assert_eq!(usage(&b), (1, 0, 1), "a partial block is not cached");
    let got = eval_in(&mut b, third, &tokens, LogitRows::Last);
    assert_eq!(usage(&b), (2, 0, 0));
    let mut fresh = open_many(&tiny_llama(), 1, &[]);
    let alone = fresh.seq_create().into_result().unwrap();
    assert_eq!(
        bits(&got),
        bits(&eval_in(&mut fresh, alone, &tokens, LogitRows::Last))
    );
}

/// Tree verification (tree speculation) on every architecture — dense, and hybrid with each
/// row's recurrent state taken from its parent's — every weight type and every KV cache type:
/// each tree row bit-identical to its path evaluated alone, beside another sequence in the
/// pass; keeping a path continues exactly as the path alone (caches, recurrent state, hidden
/// rows). A tree larger than the verify capacity is refused.
#[test]
fn tree_rows_are_bit_identical_to_their_paths_alone() {
    let dir = tempfile::tempdir().unwrap();
    for (name, path) in models(dir.path()) {
        let mut b = open_many(&path, 4, &[]);
        assert!(b.capabilities().tree_verify, "{name}");
        assert_tree_rows_match_their_paths(&mut b, 6, 11, &name);

        let most = b.capabilities().max_verify_tokens as usize;
        let seq = b.seq_create().into_result().unwrap();
        let mut logits = RVec::new();
        let tokens = vec![1; most + 1];
        let parents = vec![TREE_ROOT; most + 1];
        let err = b
            .eval_tree(seq, &tokens, &parents, &mut logits)
            .into_result()
            .unwrap_err();
        assert!(err.message.contains("max_verify_tokens"), "{name}: {err}");
    }
    for kv_type in ["f32", "q8_0"] {
        let path = dir.path().join("qwen3-heads64-tree.gguf");
        write_qwen3_shaped(&path, GgmlType::Q8_0, 5, Qwen3Shape::K_QUANT);
        let mut b = open_many(&path, 4, &[("kv_type", kv_type)]);
        assert_tree_rows_match_their_paths(&mut b, 6, 12, &format!("qwen3 kv {kv_type}"));
    }
}

/// A hybrid sequence that decodes with trees across a block boundary still leaves that
/// boundary's recurrent state (and, with an MTP head, its hidden rows) to the prefix cache: a
/// new sequence with the same tokens takes the block and continues bit for bit as a full
/// evaluation.
#[test]
fn a_kept_tree_path_leaves_its_boundary_state_to_the_prefix_cache() {
    const B: usize = BLOCK_TOKENS;
    for path in [fixture("tiny-qwen35.gguf"), fixture("tiny-qwen35-mtp.gguf")] {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let mut b = open_many(&path, 3, &[]);
        let vocab = b.model_info().vocab_size;
        let mut rng = Rng::new(5);
        let prompt = rng.tokens(B - 3, vocab);
        // Begun through the prefix cache (nothing cached yet): the sequence is armed.
        let (seq, reused) = reuse(&mut b, &prompt);
        assert_eq!(reused, 0, "{name}");
        eval_in(&mut b, seq, &prompt, LogitRows::Last);
        // A tree of 6 rows whose kept path (rows 0, 2, 3, 5) ends past the boundary.
        let tree = rng.tokens(6, vocab);
        let parents = [TREE_ROOT, 0, 0, 2, 2, 3];
        let mut logits = RVec::new();
        b.eval_tree(seq, &tree, &parents, &mut logits)
            .into_result()
            .unwrap();
        let kept = [0u32, 2, 3, 5];
        b.seq_keep_path(seq, RSlice::from_slice(&kept))
            .into_result()
            .unwrap();
        let mut tokens = prompt.clone();
        tokens.extend(kept.iter().map(|&r| tree[r as usize]));
        assert!(tokens.len() > B, "{name}");
        let more = rng.tokens(2, vocab);
        eval_in(&mut b, seq, &more, LogitRows::Last);
        tokens.extend_from_slice(&more);

        let (again, reused) = reuse(&mut b, &tokens);
        assert_eq!(
            reused, B,
            "{name}: the boundary after the tree's path was not kept"
        );
        let got = eval_in(&mut b, again, &tokens[B..], LogitRows::Last);
        let mut fresh = open_many(&path, 1, &[]);
        let whole = fresh.seq_create().into_result().unwrap();
        let want = eval_in(&mut fresh, whole, &tokens, LogitRows::Last);
        assert!(
            bits(&got) == bits(&want),
            "{name}: continuing from the cache"
        );
    }
}
