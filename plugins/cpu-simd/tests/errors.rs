//! Every failure is a clear error value (never a panic): unsupported architectures and types,
//! missing or broken files (dense and hybrid), bad inputs and options, misuse of the MTP head,
//! a full context.

mod common;

use std::path::Path;

use abi_stable::std_types::RVec;
use common::*;
use specula_gguf::GgmlType;
use specula_plugin_api::{ErrorKind, LogitRows, PluginError, SequenceCalls};

fn open_err(path: &Path) -> PluginError {
    specula_cpu_simd::open(&params(path, 1, 0)).expect_err("open must fail")
}

fn fixture(name: &str) -> std::path::PathBuf {
    models_dir().join("fixtures").join(name)
}

#[test]
fn broken_hybrid_files_are_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    // A missing Gated DeltaNet tensor.
    let path = dir.path().join("no-conv.gguf");
    rewrite_model(
        &fixture("tiny-qwen35.gguf"),
        &path,
        &Rewrite {
            drop_tensors: &["blk.0.ssm_conv1d.weight"],
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(
        err.message.contains("blk.0.ssm_conv1d.weight") && err.message.contains("no-conv.gguf"),
        "{}",
        err.message
    );
    // A missing MTP tensor when nextn_predict_layers says there is a head.
    let path = dir.path().join("no-eh-proj.gguf");
    rewrite_model(
        &fixture("tiny-qwen35-mtp.gguf"),
        &path,
        &Rewrite {
            drop_tensors: &["blk.2.nextn.eh_proj.weight"],
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert!(
        err.message.contains("blk.2.nextn.eh_proj.weight"),
        "{}",
        err.message
    );
    // qwen35 needs its RoPE sections.
    let path = dir.path().join("no-sections.gguf");
    let file = specula_gguf::GgufFile::open(fixture("tiny-qwen35.gguf")).unwrap();
    let mut w = specula_gguf::GgufWriter::new();
    for (key, value) in file.metadata() {
        if key != "qwen35.rope.dimension_sections" {
            w.set(key.clone(), value.clone());
        }
    }
    for info in file.tensors() {
        let view = file.tensor(&info.name).unwrap();
        w.add_tensor(info.name.clone(), &info.dims, info.ty, view.data.to_vec())
            .unwrap();
    }
    w.write(&path).unwrap();
    let err = open_err(&path);
    assert!(
        err.message.contains("'qwen35.rope.dimension_sections'"),
        "{}",
        err.message
    );
    // More than one NextN block is not implemented.
    let path = dir.path().join("two-nextn.gguf");
    rewrite_model(
        &fixture("tiny-qwen35-4l-mtp.gguf"),
        &path,
        &Rewrite {
            set_u32: &[("qwen35.nextn_predict_layers", 2)],
            ..Default::default()
        },
    );
    let err = open_err(&path);
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(
        err.message.contains("2 NextN / MTP blocks") && err.message.contains("not supported"),
        "{}",
        err.message
    );
}

#[test]
fn bad_backend_options_are_invalid_input() {
    for (key, value) in [
        ("ring_budget_bytes", "lots"),
        ("deep_rollback", "sometimes"),
        ("kv_type", "q8_0"),
        ("weight_layout", "rows"),
    ] {
        let mut p = params(&fixture("tiny-qwen35.gguf"), 1, 64);
        p.options
            .push(abi_stable::std_types::Tuple2(key.into(), value.into()));
        let err = specula_cpu_simd::open(&p).expect_err("bad option");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{key}");
        assert!(
            err.message.contains(key) && err.message.contains(value),
            "{}",
            err.message
        );
    }
}

#[test]
fn mtp_eval_errors() {
    let mut logits = RVec::new();
    let mut hidden = RVec::new();
    // No head: dense models and hybrids without a NextN block.
    for path in [tiny_llama(), fixture("tiny-qwen35.gguf")] {
        let mut b = open(&path, 1, 64);
        let err = b
            .mtp_step_into(&[0.0; 64], 5, 0, &mut logits, &mut hidden)
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Unsupported, "{}", path.display());
        assert!(err.message.contains("has no MTP head"), "{}", err.message);
    }
    let mut b = open(&fixture("tiny-qwen35-mtp.gguf"), 1, 16);
    // A hidden state of the wrong size, a bad token, a skipped position, a full context.
    let cases: [(&[f32], u32, usize, ErrorKind, &str); 4] = [
        (&[0.0; 63], 5, 0, ErrorKind::InvalidInput, "hidden size 64"),
        (&[0.0; 64], 512, 0, ErrorKind::InvalidInput, "token id 512"),
        (
            &[0.0; 64],
            5,
            1,
            ErrorKind::InvalidInput,
            "holds only 0 entries",
        ),
        (
            &[0.0; 64],
            5,
            16,
            ErrorKind::InvalidInput,
            "holds only 0 entries",
        ),
    ];
    for (h, token, position, kind, text) in cases {
        let err = b
            .mtp_step_into(h, token, position, &mut logits, &mut hidden)
            .unwrap_err();
        assert_eq!(err.kind, kind, "{}", err.message);
        assert!(err.message.contains(text), "{}", err.message);
    }
    for position in 0..16 {
        b.mtp_step_into(&[0.1; 64], 5, position, &mut logits, &mut hidden)
            .unwrap();
    }
    let err = b
        .mtp_step_into(&[0.1; 64], 5, 16, &mut logits, &mut hidden)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ContextFull, "{}", err.message);
    // Through the trait object the errors are values too.
    let module = specula_cpu_simd::plugin_module();
    let open_backend = module.open_backend().into_option().unwrap();
    let mut backend = open_backend(&params(&tiny_llama(), 1, 16))
        .into_result()
        .unwrap();
    let seq = backend.seq_create().into_result().unwrap();
    let err = backend
        .mtp_eval(
            seq,
            &[0.0; 64],
            &[1],
            0,
            LogitRows::All,
            &mut logits,
            &mut hidden,
        )
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported);
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
        err.message.contains(
            "unknown architecture 'gpt2' (supported: llama, qwen2, qwen3, qwen35, qwen3next)"
        ),
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
    assert!(
        err.message.contains("is empty (0 bytes)"),
        "{}",
        err.message
    );
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
fn nan_weights_are_an_error_not_noise() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nan.gguf");
    rewrite_model(
        &tiny_llama(),
        &path,
        &Rewrite {
            nan_in: Some("blk.0.ffn_up.weight"),
            ..Default::default()
        },
    );
    let mut backend = specula_plugin_api::backend::box_forward_pass(open_raw(&path, 1, 0));
    let seq = backend.seq_create().into_result().unwrap();
    let mut logits = RVec::new();
    let err = backend
        .eval(seq, &[1, 2, 3], LogitRows::Last, &mut logits)
        .into_result()
        .expect_err("NaN weights must not give logits");
    assert_eq!(err.kind, ErrorKind::Model);
    assert!(
        err.message.contains("not finite") && err.message.contains("nan.gguf"),
        "{}",
        err.message
    );
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
    let mut backend = specula_plugin_api::backend::box_forward_pass(open_raw(&stories(), 1, 32));
    let seq = backend.seq_create().into_result().unwrap();
    let mut logits = RVec::new();
    let err = backend
        .eval(seq, &[], LogitRows::Last, &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    let err = backend
        .eval(seq, &[1, 512], LogitRows::Last, &mut logits)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("512"), "{}", err.message);
    assert_eq!(backend.seq_len(seq).unwrap(), 0);

    let err = backend.truncate(seq, 1).into_result().unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);

    let mut hidden = RVec::new();
    let err = backend
        .mtp_eval(
            seq,
            &[0.0; 64],
            &[1],
            0,
            LogitRows::All,
            &mut logits,
            &mut hidden,
        )
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported);
}
