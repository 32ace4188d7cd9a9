//! Every failure is a clear error value (never a panic): unsupported architectures and types,
//! missing or broken files, bad inputs, a full context.

mod common;

use std::path::Path;

use abi_stable::std_types::{RSlice, RVec};
use common::*;
use specula_cpu_simd::CpuBackend;
use specula_gguf::GgmlType;
use specula_plugin_api::{ErrorKind, LogitRows, PluginError};

fn open_err(path: &Path) -> PluginError {
    CpuBackend::open(&params(path, 1, 0)).expect_err("open must fail")
}

#[test]
fn hybrid_architectures_are_refused_as_not_supported_yet() {
    let fixtures = models_dir().join("fixtures");
    for (file, arch) in [
        ("tiny-qwen35.gguf", "qwen35"),
        ("tiny-qwen35-mtp.gguf", "qwen35"),
        ("tiny-qwen35-4l-mtp.gguf", "qwen35"),
        ("tiny-qwen3next.gguf", "qwen3next"),
        ("tiny-qwen3next-mtp.gguf", "qwen3next"),
    ] {
        let err = open_err(&fixtures.join(file));
        assert_eq!(err.kind, ErrorKind::Model, "{file}");
        let expected = format!("cpu-simd: architecture '{arch}' (hybrid Gated DeltaNet");
        assert!(
            err.message.starts_with(&expected),
            "{file}: {}",
            err.message
        );
        assert!(
            err.message.contains("is not supported yet"),
            "{file}: {}",
            err.message
        );
    }
    let models = specula_cpu_simd::plugin_module();
    let open_backend = models.open_backend().into_option().unwrap();
    let err = open_backend(&params(&fixtures.join("tiny-qwen35.gguf"), 1, 0))
        .into_result()
        .err()
        .unwrap();
    assert!(err
        .message
        .contains("'qwen35' (hybrid Gated DeltaNet) is not supported yet"));
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.gguf");
    rewrite_model(
        &tiny_llama(),
        &path,
        &Rewrite {
            set_str: &[("general.architecture", "gpt2")],
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(
        err.message
            .contains("unknown architecture 'gpt2' (supported: llama, qwen3)"),
        "{}",
        err.message
    );
}

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let path = Path::new("/definitely/not/here/model.gguf");
    let err = open_err(path);
    assert_eq!(err.kind, ErrorKind::Io);
    assert!(
        err.message.contains("/definitely/not/here/model.gguf"),
        "{}",
        err.message
    );
}

#[test]
fn truncated_file_is_reported_as_truncated() {
    let bytes = std::fs::read(stories()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("half.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(err.message.contains("half.gguf"), "{}", err.message);
    assert!(err.message.contains("truncated"), "{}", err.message);

    // An empty file, and a cut inside the header.
    std::fs::write(&path, b"").unwrap();
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model, "{}", err.message);
    assert!(err.message.contains("truncated"), "{}", err.message);
    std::fs::write(&path, &bytes[..100]).unwrap();
    let err = open_err(&path);
    assert!(err.message.contains("truncated"), "{}", err.message);
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("holey.gguf");
    rewrite_model(
        &tiny_llama(),
        &path,
        &Rewrite {
            drop_tensors: &["blk.1.ffn_up.weight"],
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(
        err.message.contains("missing tensor 'blk.1.ffn_up.weight'"),
        "{}",
        err.message
    );
    assert!(err.message.contains("holey.gguf"), "{}", err.message);
}

#[test]
fn wrong_shape_and_unsupported_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reshaped.gguf");
    rewrite_model(
        &tiny_llama(),
        &path,
        &Rewrite {
            set_u32: &[("llama.feed_forward_length", 96)],
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert!(
        err.message.contains("blk.0.ffn_gate.weight") && err.message.contains("shape"),
        "{}",
        err.message
    );

    let path = dir.path().join("q5_0.gguf");
    rewrite_model(
        &tiny_llama(),
        &path,
        &Rewrite {
            raw_type: Some(("blk.0.attn_q.weight", GgmlType::Q5_0)),
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(
        err.message
            .contains("tensor 'blk.0.attn_q.weight' has type q5_0"),
        "{}",
        err.message
    );
}

#[test]
fn context_overflow_is_an_error_and_leaves_the_state_alone() {
    let mut backend = open(&stories(), 1, 16);
    assert_eq!(backend.info().context_size, 16);
    let mut logits = RVec::new();
    let err = backend
        .eval_tokens(&[1; 17], LogitRows::Last, &mut logits)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ContextFull);
    assert_eq!(backend.len(), 0);

    eval(&mut backend, &[1; 10], LogitRows::Last);
    let err = backend
        .eval_tokens(&[1; 7], LogitRows::All, &mut logits)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ContextFull, "{}", err.message);
    assert!(err.message.contains("16"), "{}", err.message);
    assert_eq!(backend.len(), 10);
    eval(&mut backend, &[1; 6], LogitRows::Last);
    assert_eq!(backend.len(), 16);
    let err = backend
        .eval_tokens(&[1], LogitRows::Last, &mut logits)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ContextFull);
    // Truncation makes room again.
    backend.truncate_to(15).unwrap();
    eval(&mut backend, &[1], LogitRows::Last);
}

#[test]
fn context_larger_than_trained_is_clamped() {
    let backend = open(&llama2xs(), 1, 100_000);
    assert_eq!(backend.info().context_size, 256);
    assert_eq!(backend.info().train_context_length, 256);
}

#[test]
fn bad_inputs_are_invalid_input_errors() {
    let mut backend = specula_plugin_api::backend::box_forward_pass(open(&stories(), 1, 32));
    let mut logits = RVec::new();
    let err = backend
        .eval(RSlice::from_slice(&[]), LogitRows::Last, &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    let err = backend
        .eval(RSlice::from_slice(&[1, 512]), LogitRows::Last, &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("512"), "{}", err.message);
    assert_eq!(backend.seq_len(), 0);

    let err = backend.truncate(1).into_result().unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);

    let mut hidden = RVec::new();
    let err = backend
        .mtp_step(
            RSlice::from_slice(&[0.0; 64]),
            1,
            0,
            &mut logits,
            &mut hidden,
        )
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported);
}
