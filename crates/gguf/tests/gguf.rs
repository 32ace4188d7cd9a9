//! GGUF reading on the shared real models, writer round trips, and every kind of broken file.

use std::path::{Path, PathBuf};

use specula_gguf::{
    GgmlType, GgufError, GgufFile, GgufWriter, HParams, HybridParams, MoeParams, Value, ValueType,
};

fn shared(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
}

#[test]
fn reads_stories260k() {
    let f = GgufFile::open(shared("models/stories260K.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.tensors().len(), 48);
    assert_eq!(f.req_u32("llama.embedding_length").unwrap(), 64);
    assert_eq!(f.req_u32("llama.attention.head_count_kv").unwrap(), 4);
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens")
            .unwrap()
            .unwrap()
            .len(),
        512
    );
    let embd = f.tensor_shaped("token_embd.weight", &[64, 512]).unwrap();
    assert_eq!(embd.info.ty, GgmlType::F32);
    assert_eq!(embd.data.len(), 64 * 512 * 4);
    // The converter stored output.weight as a byte-identical copy of token_embd.
    assert_eq!(f.tensor("output.weight").unwrap().data, embd.data);
}

#[test]
fn reads_every_fixture() {
    for name in [
        "tiny-llama",
        "tiny-qwen35",
        "tiny-qwen35-mtp",
        "tiny-qwen35-4l-mtp",
        "tiny-qwen3next",
        "tiny-qwen3next-mtp",
    ] {
        let f = GgufFile::open(shared(&format!("models/fixtures/{name}.gguf"))).unwrap();
        assert!(f.tensors().len() > 20, "{name}");
    }
}

/// The hybrid keys of every hybrid fixture and of the trained qwen35 model, as
/// `../shared/models/README.md` lists them.
#[test]
fn reads_hybrid_hyper_parameters() {
    // (file, trunk layers, recurrent schedule, nextn, sections, experts)
    type Case<'a> = (
        &'a str,
        u32,
        &'a [bool],
        u32,
        Option<[u32; 4]>,
        Option<(u32, u32, u32, u32)>,
    );
    let cases: [Case<'_>; 6] = [
        (
            "fixtures/tiny-qwen35",
            2,
            &[true, false],
            0,
            Some([2, 1, 1, 0]),
            None,
        ),
        (
            "fixtures/tiny-qwen35-mtp",
            2,
            &[true, false],
            1,
            Some([2, 1, 1, 0]),
            None,
        ),
        (
            "fixtures/tiny-qwen35-4l-mtp",
            4,
            &[true, true, true, false],
            1,
            Some([2, 1, 1, 0]),
            None,
        ),
        (
            "fixtures/tiny-qwen3next",
            2,
            &[true, false],
            0,
            None,
            Some((4, 2, 32, 64)),
        ),
        (
            "fixtures/tiny-qwen3next-mtp",
            2,
            &[true, false],
            1,
            None,
            Some((4, 2, 32, 64)),
        ),
        (
            "trained/stories-qwen35-mtp-f32",
            4,
            &[true, true, true, false],
            1,
            Some([3, 3, 2, 0]),
            None,
        ),
    ];
    for (name, n_trunk, schedule, nextn, sections, experts) in cases {
        let f = GgufFile::open(shared(&format!("models/{name}.gguf"))).unwrap();
        let hp = HParams::from_gguf(&f).unwrap();
        let h = HybridParams::from_gguf(&f, &hp).unwrap();
        assert_eq!(h.n_trunk, n_trunk, "{name}");
        assert_eq!(h.recurrent, schedule, "{name}");
        assert_eq!(h.nextn_predict_layers, nextn, "{name}");
        assert_eq!(h.rope_sections, sections, "{name}");
        assert_eq!(h.conv_kernel, 4, "{name}");
        match experts {
            Some((n, used, ff, shared_ff)) => {
                let m = MoeParams::from_gguf(&f, &hp).unwrap();
                assert_eq!(
                    (
                        m.expert_count,
                        m.expert_used_count,
                        m.expert_feed_forward_length,
                        m.expert_shared_feed_forward_length
                    ),
                    (n, used, ff, shared_ff),
                    "{name}"
                );
            }
            None => assert!(MoeParams::from_gguf(&f, &hp).is_err(), "{name}"),
        }
    }
}

#[test]
fn writer_round_trips_metadata_and_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama")
        .set_u32("a.u32", 7)
        .set_f32("a.f32", 1.5)
        .set_bool("a.bool", true)
        .set("a.i64", Value::I64(-3))
        .set_str_array("a.strings", ["x", "ÿ", "▁hello"])
        .set_f32_array("a.floats", [0.5, -1.0])
        .set_i32_array("a.ints", [1, -2, 3]);
    let values: Vec<f32> = (0..96).map(|i| i as f32 * 0.25).collect();
    w.add_f32("t.weight", &[32, 3], &values).unwrap();
    w.add_tensor("q.weight", &[32], GgmlType::Q8_0, vec![1u8; 34])
        .unwrap();
    w.write(&path).unwrap();

    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_u32("a.u32").unwrap(), Some(7));
    assert_eq!(f.get_f32("a.f32").unwrap(), Some(1.5));
    assert_eq!(f.get_bool("a.bool").unwrap(), Some(true));
    assert_eq!(f.get("a.i64"), Some(&Value::I64(-3)));
    assert_eq!(
        f.get_str_array("a.strings").unwrap().unwrap(),
        vec!["x", "ÿ", "▁hello"]
    );
    assert_eq!(
        f.get_f32_array("a.floats").unwrap().unwrap(),
        vec![0.5, -1.0]
    );
    assert_eq!(f.get_i64_array("a.ints").unwrap().unwrap(), vec![1, -2, 3]);
    let t = f.tensor("t.weight").unwrap();
    assert_eq!(t.info.dims, vec![32, 3]);
    let back: Vec<f32> = t
        .data
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(back, values);
    assert_eq!(f.tensor("q.weight").unwrap().data, &[1u8; 34][..]);
    assert_eq!(f.get("a.strings").unwrap().value_type(), ValueType::Array);
}

#[test]
fn writer_rejects_wrong_sizes() {
    let mut w = GgufWriter::new();
    let err = w
        .add_tensor("x", &[40], GgmlType::Q8_0, vec![0; 34])
        .unwrap_err();
    assert!(err.to_string().contains("'x'"), "{err}");
}

#[test]
fn truncated_file_is_reported_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(shared("models/stories260K.gguf")).unwrap();
    for cut in [2, 10, 100, 5000, bytes.len() / 2, bytes.len() - 1] {
        let path = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, GgufError::Truncated { .. }),
            "cut at {cut}: {text}"
        );
        assert!(text.contains(path.to_str().unwrap()), "{text}");
    }
}

#[test]
fn devices_and_directories_are_not_read() {
    let dir = tempfile::tempdir().unwrap();
    for path in [Path::new("/dev/zero"), dir.path()] {
        if !path.exists() {
            continue;
        }
        let err = GgufFile::open(path).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, GgufError::NotAFile { .. } | GgufError::Io { .. }),
            "{text}"
        );
        assert!(text.contains(path.to_str().unwrap()), "{text}");
    }
    let err = GgufFile::open("/dev/zero").unwrap_err();
    assert!(matches!(err, GgufError::NotAFile { .. }), "{err}");
}

#[test]
fn bad_magic_and_version_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    std::fs::write(&path, b"not a gguf file at all").unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(
        err.to_string()
            .contains("not a GGUF file: it starts with \"not \", not \"GGUF\""),
        "{err}"
    );
    std::fs::write(&path, b"").unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::Empty { .. }), "{err}");
    assert!(err.to_string().contains("is empty (0 bytes)"), "{err}");

    // A vocabulary-only file (metadata, no tensors) asked for a weight says what it is.
    let vocab = GgufFile::open(shared("vocab/ggml-vocab-llama-spm.gguf")).unwrap();
    let err = vocab.tensor("token_embd.weight").unwrap_err();
    assert!(
        err.to_string().contains("holds no tensors") && err.to_string().contains("vocabulary-only"),
        "{err}"
    );

    let mut bytes = std::fs::read(shared("models/fixtures/tiny-llama.gguf")).unwrap();
    bytes[4..8].copy_from_slice(&9u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(
        err.to_string().contains("unsupported GGUF version 9"),
        "{err}"
    );
}

#[test]
fn unknown_tensor_type_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    let mut w = GgufWriter::new();
    w.add_f32("only.weight", &[4], &[0.0; 4]).unwrap();
    w.write(&path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // The tensor record ends with: type id (u32), offset (u64). Patch the type id to 99.
    let name_at = bytes.windows(11).position(|w| w == b"only.weight").unwrap();
    let type_at = name_at + 11 + 4 + 8;
    bytes[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("only.weight") && text.contains("99"),
        "{text}"
    );
}

#[test]
fn missing_and_mistyped_keys_name_the_key() {
    let f = GgufFile::open(shared("models/fixtures/tiny-llama.gguf")).unwrap();
    let err = f.req_u32("llama.no_such_key").unwrap_err().to_string();
    assert!(
        err.contains("llama.no_such_key") && err.contains("tiny-llama.gguf"),
        "{err}"
    );
    let err = f.req_u32("general.architecture").unwrap_err().to_string();
    assert!(
        err.contains("general.architecture") && err.contains("string"),
        "{err}"
    );
    let err = f.tensor("blk.9.attn_q.weight").unwrap_err().to_string();
    assert!(err.contains("blk.9.attn_q.weight"), "{err}");
    let err = f
        .tensor_shaped("output_norm.weight", &[32])
        .unwrap_err()
        .to_string();
    assert!(err.contains("[64]") && err.contains("[32]"), "{err}");
}

#[test]
fn absurd_counts_do_not_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
}

/// Released pages leave the resident set only: the tensor reads the same bytes afterwards.
/// Whole pages inside the tensor are released; nothing for bytes that are not the map's or for
/// an image held in memory.
#[test]
fn released_tensor_pages_read_back_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let values: Vec<f32> = (0..64 * 1024).map(|i| (i % 977) as f32 - 300.0).collect();
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama");
    w.add_f32("big.weight", &[1024, 64], &values).unwrap();
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let data = f.tensor("big.weight").unwrap().data;
    let before = data.to_vec();
    let released = f.release(data);
    #[cfg(target_os = "linux")]
    assert!(
        released >= data.len() - 2 * 4096 && released <= data.len(),
        "{released}"
    );
    assert_eq!(released % 4096, 0);
    assert_eq!(data, &before[..]);
    assert_eq!(f.release(&before), 0, "not the map's bytes");
    let image = GgufFile::from_bytes("image", std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(image.release(image.tensor("big.weight").unwrap().data), 0);
}
