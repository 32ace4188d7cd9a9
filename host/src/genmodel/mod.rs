//! `specula gen-model`: named model shapes (benchmark presets) and the `demo` bigram model,
//! written with the shared writer in `specula-modelgen`.

mod demo;

use anyhow::bail;
use specula_gguf::GgmlType;
pub use specula_modelgen::{
    write_model, Arch, HybridSpec, ModelSpec, MoeSpec, RandomWeights, SpmVocab, TypeMix, Vocab,
    WeightSource,
};

pub use demo::{write_demo_model, CORPUS as DEFAULT_CORPUS};

/// Named shapes for `specula gen-model --preset`.
pub const PRESETS: &[(&str, &str)] = &[
    ("tiny-llama", "llama, dim 64, 2 layers, 4 heads, FFN 128 (tests)"),
    ("tiny-qwen3", "qwen3, dim 64, 2 layers, 4 heads / 2 kv heads, head dim 32, FFN 128 (tests)"),
    ("tiny-qwen35", "qwen35 hybrid, dim 64, 4 layers (3 GDN + 1 attention), MTP block (tests)"),
    ("small-llama", "llama, dim 512, 8 layers, 8 heads / 4 kv heads, FFN 1536"),
    ("qwen25-0.5b", "Qwen2.5-0.5B's shape: qwen2, dim 896, 24 layers, 14/2 heads of 64, q/k/v biases, FFN 4864, vocab 151936, tied"),
    ("qwen3-0.6b", "Qwen3-0.6B's shape: qwen3, dim 1024, 28 layers, 16/8 heads of 128, FFN 3072, vocab 151936, tied"),
    ("qwen35-0.8b", "Qwen3.5-0.8B's shape: qwen35, dim 1024, 24 layers (6 × (3 GDN + 1 attention)), 8/2 heads of 256, FFN 3584, GDN 16/16 heads of 128, MTP block, vocab 151936, tied"),
    ("qwen35-2b", "Qwen3.5-2B's shape: qwen35, dim 2048, 24 layers (6 × (3 GDN + 1 attention)), 8/2 heads of 256, FFN 6144, GDN 16/16 heads of 128, MTP block, vocab 248320, tied, Q4_K"),
    ("demo", "a word-bigram model of an embedded public-domain text (English-like word salad, no download)"),
];

/// A preset shape (see [`PRESETS`]); `demo` is written by [`write_demo_model`] instead.
pub fn preset(name: &str) -> anyhow::Result<ModelSpec> {
    let dense = |arch, hidden, layers, heads, kv, head_dim, ffn| {
        ModelSpec::dense(arch, name, hidden, layers, heads, kv, head_dim, ffn)
    };
    Ok(match name {
        "tiny-llama" => dense(Arch::Llama, 64, 2, 4, 4, 16, 128),
        "tiny-qwen3" => ModelSpec {
            rope_base: 1e6,
            rms_eps: 1e-6,
            ..dense(Arch::Qwen3, 64, 2, 4, 2, 32, 128)
        },
        "tiny-qwen35" => ModelSpec {
            rope_base: 1e7,
            rms_eps: 1e-6,
            rope_dims: Some(8),
            rope_sections: Some([2, 1, 1, 0]),
            hybrid: Some(HybridSpec {
                state_size: 16,
                k_heads: 2,
                v_heads: 4,
                conv_kernel: 4,
                full_attention_interval: 4,
            }),
            mtp: true,
            ..dense(Arch::Qwen35, 64, 4, 4, 2, 16, 128)
        },
        "small-llama" => dense(Arch::Llama, 512, 8, 8, 4, 64, 1536),
        // Qwen2.5-0.5B's published config: hidden 896, 24 layers, 14 query / 2 KV heads of 64,
        // intermediate 4864, vocab 151936, rope theta 1e6, rms eps 1e-6, tied.
        "qwen25-0.5b" => ModelSpec {
            context: 32768,
            rope_base: 1e6,
            rms_eps: 1e-6,
            weight_type: GgmlType::Q8_0,
            tied_output: true,
            vocab: Some(151936),
            ..dense(Arch::Qwen2, 896, 24, 14, 2, 64, 4864)
        },
        // Qwen3-0.6B's published config: hidden 1024, 28 layers, 16 query / 8 KV heads of
        // 128, intermediate 3072, vocab 151936, rope theta 1e6, rms eps 1e-6, tied.
        "qwen3-0.6b" => ModelSpec {
            context: 40960,
            rope_base: 1e6,
            rms_eps: 1e-6,
            weight_type: GgmlType::Q8_0,
            tied_output: true,
            vocab: Some(151936),
            ..dense(Arch::Qwen3, 1024, 28, 16, 8, 128, 3072)
        },
        // Qwen3.5-0.8B's published figures: hidden 1024, 24 layers as 6 × (3 Gated DeltaNet +
        // 1 gated attention), 8 query / 2 KV heads of 256, FFN 3584, rope theta 1e7, partial
        // rotary (64 of 256 dims, sections [11, 11, 10, 0]), one MTP head. Its GDN head counts
        // were not found published; 16 key / 16 value heads of 128 follow the family's small
        // configurations. Vocabulary 151936 as the benchmark issue asks (the real one has 248320).
        "qwen35-0.8b" => ModelSpec {
            context: 32768,
            rope_base: 1e7,
            rms_eps: 1e-6,
            rope_dims: Some(64),
            rope_sections: Some([11, 11, 10, 0]),
            weight_type: GgmlType::Q8_0,
            tied_output: true,
            vocab: Some(151936),
            hybrid: Some(HybridSpec {
                state_size: 128,
                k_heads: 16,
                v_heads: 16,
                conv_kernel: 4,
                full_attention_interval: 4,
            }),
            mtp: true,
            ..dense(Arch::Qwen35, 1024, 24, 8, 2, 256, 3584)
        },
        // Qwen3.5-2B's published text config: hidden 2048, 24 layers as 6 × (3 Gated DeltaNet
        // + 1 gated attention), 8 query / 2 KV heads of 256, intermediate 6144, GDN 16 key /
        // 16 value heads of 128, conv kernel 4, vocab 248320, tied, partial rotary as 0.8B,
        // one MTP layer. Q4_K, the size people run it at (about 1.9B parameters).
        "qwen35-2b" => ModelSpec {
            name: name.to_string(),
            hidden: 2048,
            ffn: 6144,
            weight_type: GgmlType::Q4K,
            vocab: Some(248320),
            ..preset("qwen35-0.8b")?
        },
        other => bail!(
            "unknown preset '{other}' (known: {})",
            PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
        ),
    })
}
