//! Real (trained) models and the shared fixtures: the math must reproduce known text.

mod common;

use abi_stable::std_types::RVec;
use common::*;
use specula_plugin_api::{LogitRows, PluginKind, SequenceCalls};

#[test]
fn stories260k_greedy_story_from_bos() {
    let path = stories();
    let mut backend = open(&path, 2, 0);
    let info = backend.info().clone();
    assert_eq!(info.architecture.as_str(), "llama");
    assert_eq!(
        (info.vocab_size, info.hidden_size, info.n_layers),
        (512, 64, 5)
    );
    assert_eq!((info.context_size, info.train_context_length), (2048, 2048));
    assert_eq!(info.bos_token.into_option(), Some(1));
    assert_eq!(info.eos_token.into_option(), Some(2));
    assert_eq!(info.n_params, 292_800);
    assert!(!info.has_mtp_head);
    // Per token: every weight except the embedding table, plus one embedding row.
    assert_eq!(info.weight_bytes, (292_800 - 512 * 64 + 64) * 4);

    let ids = greedy(&mut backend, &[1], 40);
    let text = decode(&ids, &vocabulary(&path));
    assert!(
        text.starts_with("Once upon a time, there was a little girl named Lily"),
        "got {text:?}"
    );
    assert_eq!(backend.len(), 40);
}

#[test]
fn llama2xs_tied_output_tells_a_story() {
    let path = llama2xs();
    let mut backend = open(&path, 2, 0);
    assert_eq!(backend.info().name.as_str(), "llama2xs");
    assert_eq!(backend.info().context_size, 256);
    // Tied output: the embedding table is read in full as the output projection.
    assert_eq!(backend.info().weight_bytes, 279_232 * 4);
    let ids = greedy(&mut backend, &[1], 40);
    let text = decode(&ids, &vocabulary(&path));
    // Coherent TinyStories English (llama.cpp gives the same opening).
    assert!(text.starts_with("Once upon a time"), "got {text:?}");
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 15, "got {text:?}");
    assert!(text.is_ascii(), "got {text:?}");
    let common = [
        "the", "a", "was", "and", "to", "She", "He", "her", "his", "day", "Once", "upon", "time,",
    ];
    let hits = words.iter().filter(|w| common.contains(w)).count();
    assert!(hits >= 4, "not story-like: {text:?}");
    eprintln!("llama2xs: {text}");
}

#[test]
fn tiny_llama_generates_with_finite_logits() {
    let mut backend = open(&tiny_llama(), 2, 0);
    assert_eq!(backend.info().name.as_str(), "tiny-random-llama");
    let ids = greedy(&mut backend, &[1, 300, 301], 32);
    assert_eq!(ids.len(), 32);
    assert!(ids.iter().all(|&t| t < 512));
    assert_eq!(backend.len(), 3 + 31);
}

#[test]
fn through_the_plugin_module_and_trait_object() {
    let module = specula_cpu_simd::plugin_module();
    let info = (module.info())();
    assert_eq!(info.name.as_str(), "cpu-simd");
    assert_eq!(info.kind, PluginKind::Backend);
    assert_eq!(module.abi_version(), specula_plugin_api::ABI_VERSION);
    let open_backend = module.open_backend().into_option().expect("open_backend");
    let mut backend = open_backend(&params(&stories(), 2, 64))
        .into_result()
        .unwrap();
    let seq = backend.seq_create().into_result().unwrap();

    let caps = backend.capabilities();
    assert_eq!(caps.max_verify_tokens, 8);
    assert_eq!(caps.rollback_depth, u32::MAX);
    assert!(caps.hidden_state_export && !caps.mtp_head);
    assert_eq!(caps.snapshot_bytes_per_slot, 0);
    assert_eq!(backend.model_info().context_size, 64);

    let mut logits = RVec::new();
    backend
        .eval(seq, &[1, 403], LogitRows::All, &mut logits)
        .into_result()
        .unwrap();
    assert_eq!(logits.len(), 2 * 512);
    assert_eq!(backend.seq_len(seq).unwrap(), 2);
    let mut hidden = RVec::new();
    backend
        .hidden_states(seq, &mut hidden)
        .into_result()
        .unwrap();
    assert_eq!(hidden.len(), 2 * 64);
    backend.truncate(seq, 1).into_result().unwrap();
    assert_eq!(backend.seq_len(seq).unwrap(), 1);

    // Errors come back as values, never as panics.
    let err = open_backend(&params(std::path::Path::new("/no/such/model.gguf"), 1, 0))
        .into_result()
        .err()
        .expect("missing file must fail");
    assert!(
        err.message.contains("/no/such/model.gguf"),
        "{}",
        err.message
    );
}
