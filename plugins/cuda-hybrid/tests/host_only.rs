//! The host side of cuda-hybrid, on machines without a GPU: with every layer on the CPU the
//! backend must be cpu-simd bit for bit — through its own pass orchestration (chunks, the
//! host half of the snapshot ring, rollback inside and beyond the window, the MTP step and
//! its cache). These paths run unchanged for the host layers of a split placement.

mod common;

use common::*;
use specula_cuda_hybrid::CudaBackend;
use specula_plugin_api::{BoxedForwardPass, ErrorKind, ForwardPass, LogitRows};

const PROMPT: [u32; 6] = [1, 403, 261, 378, 13, 300];

fn pair(
    path: &std::path::Path,
    options: &[(&str, &str)],
) -> (Solo<BoxedForwardPass>, Solo<CudaBackend>) {
    let p = params(path, 256, options);
    let cpu = cpu_simd(&p);
    let cuda = specula_cuda_hybrid::backend::open_host_only(&p)
        .unwrap_or_else(|e| panic!("cuda-hybrid {}: {e}", path.display()));
    (cpu, Solo::new(cuda))
}

#[test]
fn every_architecture_matches_cpu_simd_bit_for_bit() {
    let mut models: Vec<_> = MODELS.iter().map(|m| fixture(m)).collect();
    models.push(stories());
    models.push(trained_qwen35("q8_0"));
    for (path, kv_type) in models.iter().flat_map(|p| [(p, "f16"), (p, "f32")]) {
        let name = format!(
            "{} (kv_type {kv_type})",
            path.file_name().unwrap().to_string_lossy()
        );
        let (mut cpu, mut cuda) = pair(path, &[("kv_type", kv_type)]);
        assert_eq!(cpu.model_info(), cuda.model_info(), "{name}");
        assert_eq!(cpu.capabilities(), cuda.capabilities(), "{name}");
        assert!(!cuda.executor().placement().uses_gpu(), "{name}");
        let vocab = cuda.info().vocab_size;
        let mut rng = Rng::new(7);
        let a = eval(&mut cpu, &PROMPT, LogitRows::All);
        let b = eval(&mut cuda, &PROMPT, LogitRows::All);
        assert_eq!(bits(&a), bits(&b), "{name}: prompt");
        assert_eq!(bits(&hidden(&cpu)), bits(&hidden(&cuda)), "{name}: hidden");
        for k in [1, 3, 8] {
            let tokens = rng.tokens(k, vocab);
            for rows in [LogitRows::All, LogitRows::Last] {
                let a = eval(&mut cpu, &tokens, rows);
                let b = eval(&mut cuda, &tokens, rows);
                assert_eq!(bits(&a), bits(&b), "{name}: {k} tokens, {rows:?}");
            }
        }
        assert_eq!(cpu.len(), cuda.len());

        // Trees: every row bit-identical to its path alone, through the host half's
        // orchestration (keeping a path moves its caches and recurrent states).
        let mut p = params(path, 256, &[("kv_type", kv_type)]);
        p.max_sequences = 4;
        let mut b = specula_cuda_hybrid::backend::open_host_only(&p).unwrap();
        specula_plugin_api::testing::assert_tree_rows_match_their_paths(&mut b, 4, 3, &name);
    }
}

/// A speculative schedule — verify, partial rejection, MTP steps, rollback — on both backends.
#[test]
fn rollback_and_the_mtp_step_follow_cpu_simd() {
    for model in [
        "tiny-qwen35-mtp.gguf",
        "tiny-qwen3next-mtp.gguf",
        "tiny-llama.gguf",
    ] {
        let path = fixture(model);
        let (mut cpu, mut cuda) = pair(&path, &[]);
        let has_mtp = cuda.model_info().has_mtp_head;
        let e = cuda.info().hidden_size as usize;
        let mut rng = Rng::new(11);
        eval(&mut cpu, &PROMPT, LogitRows::All);
        eval(&mut cuda, &PROMPT, LogitRows::All);
        let mut len = PROMPT.len();
        if has_mtp {
            // Feed the head every prompt position, as the MTP drafter does.
            let h = hidden(&cuda);
            let mut next: Vec<u32> = PROMPT[1..].to_vec();
            next.push(42);
            let (la, _) = mtp(&mut cpu, &h, &next, 0);
            let (lb, _) = mtp(&mut cuda, &h, &next, 0);
            assert_eq!(bits(&la), bits(&lb), "{model}: MTP over the prompt");
        }
        for step in 0..12 {
            let k = 1 + step % 5;
            let tokens = rng.tokens(k, VOCAB as u32);
            let a = eval(&mut cpu, &tokens, LogitRows::All);
            let b = eval(&mut cuda, &tokens, LogitRows::All);
            assert_eq!(bits(&a), bits(&b), "{model} step {step}");
            if has_mtp {
                let h = hidden(&cuda);
                assert_eq!(bits(&h), bits(&hidden(&cpu)));
                let next = rng.tokens(k, VOCAB as u32);
                let (la, ha) = mtp(&mut cpu, &h, &next, len);
                let (lb, hb) = mtp(&mut cuda, &h, &next, len);
                assert_eq!(bits(&la), bits(&lb), "{model} step {step}: MTP logits");
                assert_eq!(bits(&ha), bits(&hb), "{model} step {step}: MTP hidden");
                assert_eq!(cuda.mtp_len(cuda.seq).unwrap(), Some(len + k));
                // A chained draft step overwrites the speculative entry.
                let (la, _) = mtp(&mut cpu, row(&ha, k - 1, e), &next[..1], len + k - 1);
                let (lb, _) = mtp(&mut cuda, row(&hb, k - 1, e), &next[..1], len + k - 1);
                assert_eq!(bits(&la), bits(&lb));
            }
            let keep = len + 1 + step % k;
            truncate(&mut cpu, keep);
            truncate(&mut cuda, keep);
            len = keep;
            assert_eq!(cuda.len(), len);
            if has_mtp {
                assert!(cuda.mtp_len(cuda.seq).unwrap().unwrap() <= len);
            }
        }
        assert_eq!(cuda.slow_rollbacks(), 0, "{model}");
        let a = eval(&mut cpu, &[5, 6], LogitRows::All);
        let b = eval(&mut cuda, &[5, 6], LogitRows::All);
        assert_eq!(bits(&a), bits(&b), "{model}: after the schedule");
    }
}

#[test]
fn truncation_beyond_the_ring_re_decodes_or_is_refused() {
    let path = fixture("tiny-qwen35-mtp.gguf");
    let (mut cpu, mut cuda) = pair(&path, &[]);
    let mut rng = Rng::new(3);
    let tokens = rng.tokens(30, VOCAB as u32);
    eval(&mut cpu, &tokens, LogitRows::Last);
    eval(&mut cuda, &tokens, LogitRows::Last);
    assert_eq!(cuda.rollback_window(cuda.seq).unwrap(), 22..=30);
    truncate(&mut cpu, 10);
    truncate(&mut cuda, 10);
    assert_eq!(cuda.slow_rollbacks(), 1);
    let a = eval(&mut cpu, &[7, 8, 9], LogitRows::All);
    let b = eval(&mut cuda, &[7, 8, 9], LogitRows::All);
    assert_eq!(bits(&a), bits(&b));

    let (_, mut refusing) = pair(&path, &[("deep_rollback", "refuse")]);
    eval(&mut refusing, &tokens, LogitRows::Last);
    let err = refusing.truncate_to(10).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(
        err.message.contains("22..=30") && err.message.contains("refuse"),
        "{}",
        err.message
    );
    // Inside the window it still works, and the state is exact.
    truncate(&mut refusing, 25);
    truncate(&mut cpu, 0);
    eval(&mut cpu, &tokens[..25], LogitRows::Last);
    let a = eval(&mut cpu, &[3], LogitRows::All);
    let b = eval(&mut refusing, &[3], LogitRows::All);
    assert_eq!(bits(&a), bits(&b));
}

#[test]
fn the_ring_budget_and_the_verify_capacity_follow_the_options() {
    let path = fixture("tiny-qwen35-4l-mtp.gguf");
    let full = specula_cuda_hybrid::backend::open_host_only(&params(&path, 64, &[])).unwrap();
    let plane = full.caps().snapshot_bytes_per_slot;
    assert_eq!(full.caps().max_verify_tokens, 8);
    let budget = (4 * plane).to_string();
    let small = specula_cuda_hybrid::backend::open_host_only(&params(
        &path,
        64,
        &[("ring_budget_bytes", &budget)],
    ))
    .unwrap();
    assert_eq!(small.caps().max_verify_tokens, 3);
    assert_eq!(small.caps().rollback_depth, 3);
    let too_small = plane.to_string();
    let err = specula_cuda_hybrid::backend::open_host_only(&params(
        &path,
        64,
        &[("ring_budget_bytes", &too_small)],
    ))
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    let err =
        specula_cuda_hybrid::backend::open_host_only(&params(&path, 64, &[("gpu_layers", "lots")]))
            .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("gpu_layers"), "{}", err.message);
}

#[test]
fn loader_errors_name_this_backend() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere.gguf");
    let err = specula_cuda_hybrid::backend::open_host_only(&params(&missing, 0, &[])).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Io);
    assert!(err.message.contains("nowhere.gguf"), "{}", err.message);
    assert!(!err.message.contains("cpu-simd"), "{}", err.message);
}

/// Many sequences in one pass with every layer on the host: rows bit-identical to each
/// sequence alone (the host half of a split placement runs this too).
#[test]
fn batched_sequences_are_bit_identical_to_each_sequence_alone() {
    for path in [fixture("tiny-qwen35-4l-mtp.gguf"), stories()] {
        let mut p = params(&path, 256, &[]);
        p.max_sequences = 5;
        let open = || specula_cuda_hybrid::backend::open_host_only(&p).unwrap();
        let (mut batched, mut alone) = (open(), open());
        let rollback = (batched.caps().rollback_depth as usize).min(8);
        let name = path.display().to_string();
        assert_batches_match_sequences_alone(&mut batched, &mut alone, 5, 10, rollback, 3, &name);
    }
}
