//! Helpers shared by the cpu-simd integration tests: model paths, opening backends, greedy
//! decoding, and writing test models (a random qwen3, re-typed copies of the shared models).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use abi_stable::std_types::{RString, RVec};
use specula_cpu_simd::CpuBackend;
use specula_gguf::{GgmlType, GgufFile, GgufWriter};
use specula_plugin_api::BackendParams;

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

/// The qwen2 fixture (q/k/v biases, NeoX RoPE).
pub fn tiny_qwen2() -> PathBuf {
    models_dir().join("next-arch/tiny-qwen2.gguf")
}

pub fn params(path: &Path, threads: u32, context_size: u32) -> BackendParams {
    BackendParams {
        model_path: RString::from(path.to_str().expect("UTF-8 path")),
        threads,
        context_size,
        max_verify_tokens: 0,
        max_sequences: 0,
        kv_tokens: 0,
        options: RVec::new(),
    }
}

/// A cpu-simd instance and one sequence of it.
pub type Solo = specula_plugin_api::testing::Solo<CpuBackend>;

/// Opens `path` with `threads` workers and a context of `context_size` (0: the model's), with
/// one sequence.
pub fn open(path: &Path, threads: u32, context_size: u32) -> Solo {
    Solo::new(open_raw(path, threads, context_size))
}

/// Opens `path` as [`open`] does, with no sequence yet.
pub fn open_raw(path: &Path, threads: u32, context_size: u32) -> CpuBackend {
    specula_cpu_simd::open(&params(path, threads, context_size))
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

/// Evaluates `tokens` after the sequence and returns the requested logits.
pub fn eval(b: &mut Solo, tokens: &[u32], rows: specula_plugin_api::LogitRows) -> Vec<f32> {
    b.eval(tokens, rows)
}

/// The hidden states of the sequence's last evaluated rows.
pub fn hidden(b: &Solo) -> Vec<f32> {
    b.hidden()
}

/// Greedy decoding of `n` tokens after `prompt`, one token per eval.
pub fn greedy(b: &mut Solo, prompt: &[u32], n: usize) -> Vec<u32> {
    let seq = b.seq;
    specula_plugin_api::testing::greedy(&mut b.backend, seq, prompt, n)
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

#[allow(unused_imports)]
pub use specula_plugin_api::testing::{
    argmax, assert_batches_match_sequences_alone, assert_verify_rows_match_single_evals, bits, row,
    Rng,
};

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
    /// Make this tensor's first value NaN (a corrupt weight).
    pub nan_in: Option<&'a str>,
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
        let mut values = specula_kernels::dequantize(GgmlType::F32, view.data, n);
        if rewrite.nan_in == Some(info.name.as_str()) {
            values[0] = f32::NAN;
        }
        let (ty, data) = match rewrite.matrix_type {
            Some(ty) => encode(ty, &info.dims, &values),
            None => (
                GgmlType::F32,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        };
        w.add_tensor(info.name.clone(), &info.dims, ty, data)
            .unwrap();
    }
    w.write(dst).unwrap();
}

/// A file of `../shared/models/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    models_dir().join("fixtures").join(name)
}

/// The trained qwen35 model with an MTP head (`f32` or `q8_0`).
pub fn trained_qwen35(ty: &str) -> PathBuf {
    models_dir().join(format!("trained/stories-qwen35-mtp-{ty}.gguf"))
}

/// The hybrid fixtures: (file, architecture, has an MTP head).
pub const HYBRID_FIXTURES: [(&str, &str, bool); 5] = [
    ("tiny-qwen35.gguf", "qwen35", false),
    ("tiny-qwen35-mtp.gguf", "qwen35", true),
    ("tiny-qwen35-4l-mtp.gguf", "qwen35", true),
    ("tiny-qwen3next.gguf", "qwen3next", false),
    ("tiny-qwen3next-mtp.gguf", "qwen3next", true),
];

/// Opens `path` asking for a verify capacity of `max_verify` (0: the default) with backend
/// `options`.
pub fn open_with(
    path: &Path,
    threads: u32,
    context_size: u32,
    max_verify: u32,
    options: &[(&str, &str)],
) -> Solo {
    Solo::new(open_raw_with(
        path,
        threads,
        context_size,
        max_verify,
        options,
    ))
}

/// Opens `path` as [`open_with`] does, with no sequence yet.
pub fn open_raw_with(
    path: &Path,
    threads: u32,
    context_size: u32,
    max_verify: u32,
    options: &[(&str, &str)],
) -> CpuBackend {
    let mut p = params(path, threads, context_size);
    p.max_verify_tokens = max_verify;
    for (key, value) in options {
        p.options.push(abi_stable::std_types::Tuple2(
            (*key).into(),
            (*value).into(),
        ));
    }
    specula_cpu_simd::open(&p).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

/// One MTP step; returns (logits, hidden).
pub fn mtp(
    backend: &mut Solo,
    hidden: &[f32],
    token: u32,
    position: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (mut logits, mut out) = (RVec::new(), RVec::new());
    let seq = backend.seq;
    backend
        .backend
        .mtp_step_into(seq, hidden, token, position, &mut logits, &mut out)
        .unwrap_or_else(|e| panic!("mtp_step at {position}: {e}"));
    (logits.to_vec(), out.to_vec())
}

/// Writes a random-weight qwen35 hybrid larger than the shared fixtures (E 128; 4 trunk layers
/// GDN, attention, GDN, attention; GDN with 4 key heads and 8 value heads of 64, so one
/// layer's S matrices are 32768 values and the recurrence runs its heads in parallel;
/// attention 4 heads / 2 kv heads of 32 with IMROPE sections [2, 2, 2, 2] over 16 dims, so the
/// last two rotary pairs belong to the unrotated extra component; FFN 192; an MTP block),
/// matrices stored as `ty`, vocabulary tok512.
pub fn write_qwen35(path: &Path, ty: GgmlType, seed: u64) {
    let (e, h, hkv, hd, ff, trunk) = (128u64, 4u64, 2u64, 32u64, 192u64, 4u32);
    let (s, hk, hv, kernel) = (64u64, 4u64, 8u64, 4u64);
    let channels = 2 * s * hk + s * hv;
    let vocab = u64::from(QWEN3_VOCAB);
    let mut rng = Rng::new(seed);
    let mut w = GgufWriter::new();
    let a = "qwen35";
    w.set_str("general.architecture", a)
        .set_str("general.name", "test-random-qwen35")
        .set_u32(format!("{a}.context_length"), 512)
        .set_u32(format!("{a}.embedding_length"), e as u32)
        .set_u32(format!("{a}.block_count"), trunk + 1)
        .set_u32(format!("{a}.feed_forward_length"), ff as u32)
        .set_u32(format!("{a}.attention.head_count"), h as u32)
        .set_u32(format!("{a}.attention.head_count_kv"), hkv as u32)
        .set_u32(format!("{a}.attention.key_length"), hd as u32)
        .set_u32(format!("{a}.attention.value_length"), hd as u32)
        .set_f32(format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6)
        .set_u32(format!("{a}.rope.dimension_count"), 16)
        .set_f32(format!("{a}.rope.freq_base"), 1e7)
        .set_i32_array(format!("{a}.rope.dimension_sections"), [2, 2, 2, 2])
        .set_u32(format!("{a}.ssm.conv_kernel"), kernel as u32)
        .set_u32(format!("{a}.ssm.state_size"), s as u32)
        .set_u32(format!("{a}.ssm.group_count"), hk as u32)
        .set_u32(format!("{a}.ssm.time_step_rank"), hv as u32)
        .set_u32(format!("{a}.ssm.inner_size"), (s * hv) as u32)
        .set_u32(format!("{a}.full_attention_interval"), 2)
        .set_u32(format!("{a}.nextn_predict_layers"), 1);
    copy_tokenizer(&GgufFile::open(stories()).unwrap(), &mut w);

    let mut matrix = |w: &mut GgufWriter, name: String, dims: &[u64], gain: f32| {
        let scale = gain * (3.0 / dims[0] as f32).sqrt();
        let n: u64 = dims.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.unit() * scale).collect();
        let (t, data) = encode(ty, dims, &values);
        w.add_tensor(name, dims, t, data).unwrap();
    };
    let vector = |w: &mut GgufWriter, name: String, n: u64, seed: u64, base: f32, spread: f32| {
        let mut r = Rng::new(seed);
        let values: Vec<f32> = (0..n).map(|_| base + spread * r.unit()).collect();
        w.add_f32(name, &[n], &values).unwrap();
    };
    matrix(&mut w, "token_embd.weight".into(), &[e, vocab], 1.0);
    vector(&mut w, "output_norm.weight".into(), e, seed + 1, 1.0, 0.02);
    matrix(&mut w, "output.weight".into(), &[e, vocab], 4.0);
    for l in 0..=trunk {
        let b = |t: &str| format!("blk.{l}.{t}.weight");
        let sd = seed + 100 * u64::from(l + 1);
        vector(&mut w, b("attn_norm"), e, sd, 1.0, 0.02);
        vector(&mut w, b("post_attention_norm"), e, sd + 1, 1.0, 0.02);
        let attention = l % 2 == 1 || l == trunk;
        if attention {
            matrix(&mut w, b("attn_q"), &[e, 2 * h * hd], 1.0);
            matrix(&mut w, b("attn_k"), &[e, hkv * hd], 1.0);
            matrix(&mut w, b("attn_v"), &[e, hkv * hd], 1.0);
            matrix(&mut w, b("attn_output"), &[h * hd, e], 1.0);
            vector(&mut w, b("attn_q_norm"), hd, sd + 2, 1.0, 0.02);
            vector(&mut w, b("attn_k_norm"), hd, sd + 3, 1.0, 0.02);
        } else {
            matrix(&mut w, b("attn_qkv"), &[e, channels], 1.0);
            matrix(&mut w, b("attn_gate"), &[e, s * hv], 1.0);
            matrix(&mut w, b("ssm_conv1d"), &[kernel, channels], 1.0);
            vector(&mut w, format!("blk.{l}.ssm_dt.bias"), hv, sd + 4, 0.0, 0.5);
            vector(&mut w, format!("blk.{l}.ssm_a"), hv, sd + 5, -1.0, 0.5);
            matrix(&mut w, b("ssm_beta"), &[e, hv], 1.0);
            matrix(&mut w, b("ssm_alpha"), &[e, hv], 1.0);
            vector(&mut w, b("ssm_norm"), s, sd + 6, 1.0, 0.02);
            matrix(&mut w, b("ssm_out"), &[s * hv, e], 1.0);
        }
        matrix(&mut w, b("ffn_gate"), &[e, ff], 1.0);
        matrix(&mut w, b("ffn_up"), &[e, ff], 1.0);
        matrix(&mut w, b("ffn_down"), &[ff, e], 1.0);
        if l == trunk {
            matrix(&mut w, b("nextn.eh_proj"), &[2 * e, e], 1.0);
            vector(&mut w, b("nextn.enorm"), e, sd + 7, 1.0, 0.02);
            vector(&mut w, b("nextn.hnorm"), e, sd + 8, 1.0, 0.02);
            vector(&mut w, b("nextn.shared_head_norm"), e, sd + 9, 1.0, 0.02);
        }
    }
    w.write(path).unwrap();
}

/// The engine backend's own calls on the one sequence of a [`Solo`] (they shadow the
/// backend's, which take the sequence).
#[allow(dead_code)]
pub trait SoloCalls {
    fn mtp_len(&self) -> Option<usize>;
    fn last_hidden_states(&self) -> &[f32];
    fn rollback_window(&self) -> std::ops::RangeInclusive<usize>;
    fn eval_tokens(
        &mut self,
        tokens: &[u32],
        rows: specula_plugin_api::LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), specula_plugin_api::PluginError>;
    fn mtp_step_into(
        &mut self,
        hidden: &[f32],
        token: u32,
        position: usize,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), specula_plugin_api::PluginError>;
    #[allow(clippy::too_many_arguments)]
    fn mtp_eval_into(
        &mut self,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: specula_plugin_api::LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), specula_plugin_api::PluginError>;
}

impl SoloCalls for Solo {
    fn mtp_len(&self) -> Option<usize> {
        self.backend.mtp_len(self.seq).unwrap()
    }
    fn last_hidden_states(&self) -> &[f32] {
        self.backend.last_hidden_states(self.seq).unwrap()
    }
    fn rollback_window(&self) -> std::ops::RangeInclusive<usize> {
        self.backend.rollback_window(self.seq).unwrap()
    }
    fn eval_tokens(
        &mut self,
        tokens: &[u32],
        rows: specula_plugin_api::LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), specula_plugin_api::PluginError> {
        let seq = self.seq;
        self.backend.eval_tokens(seq, tokens, rows, logits)
    }
    fn mtp_step_into(
        &mut self,
        hidden: &[f32],
        token: u32,
        position: usize,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), specula_plugin_api::PluginError> {
        let seq = self.seq;
        self.backend
            .mtp_step_into(seq, hidden, token, position, logits, hidden_out)
    }
    fn mtp_eval_into(
        &mut self,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: specula_plugin_api::LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), specula_plugin_api::PluginError> {
        let seq = self.seq;
        self.backend
            .mtp_eval_into(seq, hidden, tokens, position, rows, logits, hidden_out)
    }
}
