//! Helpers shared by the cpu-simd integration tests: model paths, opening backends, greedy
//! decoding, and writing test models (a random qwen3, re-typed copies of the shared models).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use abi_stable::std_types::{RString, RVec};
use specula_cpu_simd::CpuBackend;
use specula_gguf::{GgmlType, GgufFile, GgufWriter};
use specula_plugin_api::{BackendParams, LogitRows};

/// `/work/shared/models`, checked to exist.
pub fn models_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models");
    assert!(
        dir.join("stories260K.gguf").exists(),
        "shared models not found at {}",
        dir.display()
    );
    dir
}

pub fn stories() -> PathBuf {
    models_dir().join("stories260K.gguf")
}

pub fn llama2xs() -> PathBuf {
    models_dir().join("llama2xs-281K.gguf")
}

pub fn tiny_llama() -> PathBuf {
    models_dir().join("fixtures/tiny-llama.gguf")
}

pub fn params(path: &Path, threads: u32, context_size: u32) -> BackendParams {
    BackendParams {
        model_path: RString::from(path.to_str().expect("UTF-8 path")),
        threads,
        context_size,
        max_verify_tokens: 0,
        options: RVec::new(),
    }
}

/// Opens `path` with `threads` workers and a context of `context_size` (0: the model's).
pub fn open(path: &Path, threads: u32, context_size: u32) -> CpuBackend {
    CpuBackend::open(&params(path, threads, context_size))
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

/// Evaluates `tokens` in one call and returns the requested logits.
pub fn eval(backend: &mut CpuBackend, tokens: &[u32], rows: LogitRows) -> Vec<f32> {
    let mut logits = RVec::new();
    backend
        .eval_tokens(tokens, rows, &mut logits)
        .unwrap_or_else(|e| panic!("eval of {tokens:?}: {e}"));
    logits.to_vec()
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of `n` tokens after `prompt`, one token per eval.
pub fn greedy(backend: &mut CpuBackend, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut next = argmax(&eval(backend, prompt, LogitRows::Last));
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(next);
        if out.len() == n {
            break;
        }
        let logits = eval(backend, &[next], LogitRows::Last);
        assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
        next = argmax(&logits);
    }
    out
}

/// The pieces of `tokenizer.ggml.tokens`.
pub fn vocabulary(path: &Path) -> Vec<String> {
    let file = GgufFile::open(path).unwrap();
    file.get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .expect("tokenizer.ggml.tokens")
        .into_iter()
        .map(str::to_string)
        .collect()
}

/// SentencePiece-style decoding: `▁` is a space, `<0xNN>` a byte, control tokens vanish.
pub fn decode(ids: &[u32], vocab: &[String]) -> String {
    let mut bytes = Vec::new();
    for &id in ids {
        let piece = &vocab[id as usize];
        if piece == "<s>" || piece == "</s>" || piece == "<unk>" {
            continue;
        }
        match piece
            .strip_prefix("<0x")
            .and_then(|rest| rest.strip_suffix('>'))
            .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            Some(byte) => bytes.push(byte),
            None => bytes.extend_from_slice(piece.replace('\u{2581}', " ").as_bytes()),
        }
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    text.strip_prefix(' ').map(str::to_string).unwrap_or(text)
}

pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// A small reproducible generator (SplitMix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n)) as u32
    }

    pub fn tokens(&mut self, n: usize, vocab: u32) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab)).collect()
    }
}

/// Copies every `tokenizer.*` key of `src` into `w`.
pub fn copy_tokenizer(src: &GgufFile, w: &mut GgufWriter) {
    for (key, value) in src.metadata() {
        if key.starts_with("tokenizer.") {
            w.set(key.clone(), value.clone());
        }
    }
}

/// Encodes `values` as `ty`, falling back to F32 when rows are not whole blocks.
pub fn encode(ty: GgmlType, dims: &[u64], values: &[f32]) -> (GgmlType, Vec<u8>) {
    let ty = if dims.len() >= 2 && ty.row_bytes(dims[0] as usize).is_some() {
        ty
    } else {
        GgmlType::F32
    };
    (ty, specula_kernels::quantize(ty, values))
}

/// Shape of the random qwen3 test model.
pub const QWEN3_VOCAB: u32 = 512;

/// Writes a random-weight qwen3 model (E 64, 4 heads / 2 kv heads of 32 — so the head size is
/// not E / H —, FFN 96, 2 layers, per-head q/k norms, untied output) with matrices stored as
/// `ty`, and the tok512 vocabulary of stories260K.
pub fn write_qwen3(path: &Path, ty: GgmlType, seed: u64) {
    write_qwen3_shaped(path, ty, seed, Qwen3Shape::SMALL);
}

/// Sizes of a random qwen3 test model.
#[derive(Debug, Clone, Copy)]
pub struct Qwen3Shape {
    pub embd: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn: u64,
}

impl Qwen3Shape {
    /// The shape of [`write_qwen3`].
    pub const SMALL: Qwen3Shape = Qwen3Shape {
        embd: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 96,
    };
    /// Every matrix input a whole number of 256-value super-blocks, so K-quant types apply to
    /// every matrix (E 256, 4 heads / 2 kv heads of 64, FFN 512).
    pub const K_QUANT: Qwen3Shape = Qwen3Shape {
        embd: 256,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        ffn: 512,
    };
}

/// [`write_qwen3`] with the given sizes.
pub fn write_qwen3_shaped(path: &Path, ty: GgmlType, seed: u64, shape: Qwen3Shape) {
    let Qwen3Shape {
        embd: e,
        heads: h,
        kv_heads: hkv,
        head_dim: hd,
        ffn: ff,
    } = shape;
    let layers = 2;
    let vocab = u64::from(QWEN3_VOCAB);
    let mut rng = Rng::new(seed);
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "qwen3")
        .set_str("general.name", "test-random-qwen3")
        .set_u32("qwen3.context_length", 256)
        .set_u32("qwen3.embedding_length", e as u32)
        .set_u32("qwen3.block_count", layers)
        .set_u32("qwen3.feed_forward_length", ff as u32)
        .set_u32("qwen3.attention.head_count", h as u32)
        .set_u32("qwen3.attention.head_count_kv", hkv as u32)
        .set_u32("qwen3.attention.key_length", hd as u32)
        .set_u32("qwen3.attention.value_length", hd as u32)
        .set_f32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
        .set_u32("qwen3.rope.dimension_count", hd as u32)
        .set_f32("qwen3.rope.freq_base", 1_000_000.0);
    copy_tokenizer(&GgufFile::open(stories()).unwrap(), &mut w);

    let mut matrix = |w: &mut GgufWriter, name: String, cols: u64, rows: u64, gain: f32| {
        let scale = gain * (3.0 / cols as f32).sqrt();
        let values: Vec<f32> = (0..cols * rows).map(|_| rng.unit() * scale).collect();
        let (t, data) = encode(ty, &[cols, rows], &values);
        w.add_tensor(name, &[cols, rows], t, data).unwrap();
    };
    let norm = |w: &mut GgufWriter, name: String, n: u64, seed: u64| {
        let mut r = Rng::new(seed);
        let values: Vec<f32> = (0..n).map(|_| 1.0 + 0.02 * r.unit()).collect();
        w.add_f32(name, &[n], &values).unwrap();
    };
    matrix(&mut w, "token_embd.weight".into(), e, vocab, 1.0);
    norm(&mut w, "output_norm.weight".into(), e, seed + 1);
    matrix(&mut w, "output.weight".into(), e, vocab, 4.0);
    for l in 0..layers {
        let b = |t: &str| format!("blk.{l}.{t}.weight");
        let s = seed + 100 * u64::from(l + 1);
        norm(&mut w, b("attn_norm"), e, s);
        matrix(&mut w, b("attn_q"), e, h * hd, 1.0);
        matrix(&mut w, b("attn_k"), e, hkv * hd, 1.0);
        matrix(&mut w, b("attn_v"), e, hkv * hd, 1.0);
        matrix(&mut w, b("attn_output"), h * hd, e, 1.0);
        norm(&mut w, b("attn_q_norm"), hd, s + 1);
        norm(&mut w, b("attn_k_norm"), hd, s + 2);
        norm(&mut w, b("ffn_norm"), e, s + 3);
        matrix(&mut w, b("ffn_gate"), e, ff, 1.0);
        matrix(&mut w, b("ffn_up"), e, ff, 1.0);
        matrix(&mut w, b("ffn_down"), ff, e, 1.0);
    }
    w.write(path).unwrap();
}

/// How [`rewrite_model`] changes a model.
#[derive(Default)]
pub struct Rewrite<'a> {
    /// Store matrices (2-D tensors with whole-block rows) as this type.
    pub matrix_type: Option<GgmlType>,
    /// Leave these tensors out.
    pub drop_tensors: &'a [&'a str],
    /// Store this tensor's bytes as this (raw) type instead, zero-filled.
    pub raw_type: Option<(&'a str, GgmlType)>,
    /// Extra or replaced metadata.
    pub set_str: &'a [(&'a str, &'a str)],
    pub set_u32: &'a [(&'a str, u32)],
}

/// Writes a copy of the all-F32 model `src` to `dst`, changed as `rewrite` says.
pub fn rewrite_model(src: &Path, dst: &Path, rewrite: &Rewrite<'_>) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        w.set(key.clone(), value.clone());
    }
    for (key, value) in rewrite.set_str {
        w.set_str(*key, *value);
    }
    for (key, value) in rewrite.set_u32 {
        w.set_u32(*key, *value);
    }
    for info in file.tensors() {
        if rewrite.drop_tensors.contains(&info.name.as_str()) {
            continue;
        }
        let view = file.tensor(&info.name).unwrap();
        assert_eq!(
            info.ty,
            GgmlType::F32,
            "rewrite_model expects an all-F32 source"
        );
        let n = info.n_elements() as usize;
        if let Some((name, ty)) = rewrite.raw_type {
            if name == info.name {
                let bytes =
                    ty.row_bytes(info.dims[0] as usize).unwrap() * (n / info.dims[0] as usize);
                w.add_tensor(info.name.clone(), &info.dims, ty, vec![0u8; bytes])
                    .unwrap();
                continue;
            }
        }
        let values = specula_kernels::dequantize(GgmlType::F32, view.data, n);
        let (ty, data) = match rewrite.matrix_type {
            Some(ty) => encode(ty, &info.dims, &values),
            None => (GgmlType::F32, view.data.to_vec()),
        };
        w.add_tensor(info.name.clone(), &info.dims, ty, data)
            .unwrap();
    }
    w.write(dst).unwrap();
}
