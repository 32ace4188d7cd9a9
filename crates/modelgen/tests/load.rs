//! Every architecture the writer produces loads in the CPU backend and generates.

use abi_stable::std_types::{RVec, Tuple2};
use specula_cpu_simd::backend::CpuBackend;
use specula_gguf::GgmlType;
use specula_modelgen::{
    more_bits, write_model, Arch, HybridSpec, ModelSpec, MoeSpec, RandomWeights, SpmVocab, TypeMix,
    Vocab,
};
use specula_plugin_api::{BackendParams, ForwardPass, LogitRows, SequenceCalls};

fn hybrid(arch: Arch, mtp: bool) -> ModelSpec {
    ModelSpec {
        rope_dims: Some(8),
        rope_sections: (arch == Arch::Qwen35).then_some([2, 1, 1, 0]),
        hybrid: Some(HybridSpec {
            state_size: 16,
            k_heads: 2,
            v_heads: 4,
            conv_kernel: 4,
            full_attention_interval: 2,
        }),
        moe: (arch == Arch::Qwen3Next).then_some(MoeSpec {
            experts: 4,
            experts_used: 2,
            expert_ffn: 32,
            shared_ffn: 64,
        }),
        mtp,
        ..ModelSpec::dense(arch, "t", 64, 2, 4, 2, 16, 128)
    }
}

fn open(path: &std::path::Path) -> CpuBackend {
    let params = BackendParams {
        model_path: path.to_str().unwrap().into(),
        threads: 1,
        context_size: 64,
        max_verify_tokens: 4,
        max_sequences: 0,
        kv_tokens: 0,
        options: RVec::<Tuple2<_, _>>::new(),
    };
    specula_cpu_simd::open(&params).unwrap()
}

#[test]
fn every_architecture_loads_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    let specs = [
        ModelSpec::dense(Arch::Llama, "t", 64, 2, 4, 4, 16, 128),
        ModelSpec::dense(Arch::Qwen2, "t", 64, 2, 4, 2, 16, 128),
        ModelSpec {
            tied_output: true,
            ..ModelSpec::dense(Arch::Qwen3, "t", 64, 2, 4, 2, 32, 96)
        },
        hybrid(Arch::Qwen35, false),
        hybrid(Arch::Qwen35, true),
        hybrid(Arch::Qwen3Next, false),
        hybrid(Arch::Qwen3Next, true),
    ];
    for spec in specs {
        for ty in [GgmlType::F32, GgmlType::Q8_0] {
            let spec = ModelSpec {
                weight_type: ty,
                ..spec.clone()
            };
            let path = dir.path().join("m.gguf");
            write_model(
                &spec,
                &Vocab::Spm(SpmVocab::synthetic(300)),
                &mut RandomWeights::new(7),
                &path,
            )
            .unwrap();
            let mut backend = open(&path);
            let seq = backend.seq_create().into_result().unwrap();
            let info = backend.model_info();
            assert_eq!(info.architecture.as_str(), spec.arch.gguf_name());
            assert_eq!(info.vocab_size, 300);
            assert_eq!(info.has_mtp_head, spec.mtp, "{spec:?}");
            let mut logits = RVec::new();
            backend
                .eval(seq, &[1, 5, 9, 200], LogitRows::All, &mut logits)
                .into_result()
                .unwrap_or_else(|e| panic!("{:?} {ty}: {e}", spec.arch));
            assert_eq!(logits.len(), 4 * 300);
            assert!(logits.iter().all(|l| l.is_finite()), "{:?} {ty}", spec.arch);
        }
    }
}

#[test]
fn shapes_the_architecture_cannot_have_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let vocab = Vocab::Spm(SpmVocab::synthetic(300));
    let bad = [
        ModelSpec::dense(Arch::Llama, "t", 64, 2, 4, 3, 16, 128),
        ModelSpec::dense(Arch::Qwen35, "t", 64, 2, 4, 2, 16, 128),
        ModelSpec {
            mtp: true,
            ..ModelSpec::dense(Arch::Qwen3, "t", 64, 2, 4, 2, 16, 128)
        },
    ];
    for spec in bad {
        let err = write_model(&spec, &vocab, &mut RandomWeights::new(1), &path).unwrap_err();
        assert!(err.to_string().contains("invalid model shape"), "{err}");
    }
}

/// `q4_K_M` writes llama.cpp's mix (Q6_K for the tied embedding and for the attn_v-like and
/// ffn_down matrices of the blocks `more_bits` picks, Q4_K elsewhere), the mixed file loads,
/// and its verify rows are bit for bit its one-token evaluations.
#[test]
fn q4_k_m_writes_llama_cpps_mix_and_verify_rows_stay_exact() {
    let dir = tempfile::tempdir().unwrap();
    let dense = ModelSpec {
        tied_output: true,
        weight_type: GgmlType::Q4K,
        mix: TypeMix::Q4KM,
        ..ModelSpec::dense(Arch::Qwen3, "t", 256, 8, 4, 2, 64, 512)
    };
    let hybrid = ModelSpec {
        hidden: 256,
        layers: 8,
        ffn: 512,
        head_dim: 64,
        tied_output: true,
        weight_type: GgmlType::Q4K,
        mix: TypeMix::Q4KM,
        ..hybrid(Arch::Qwen35, true)
    };
    for spec in [dense, hybrid] {
        let path = dir.path().join("m.gguf");
        write_model(
            &spec,
            &Vocab::Spm(SpmVocab::synthetic(300)),
            &mut RandomWeights::new(3),
            &path,
        )
        .unwrap();
        let file = specula_gguf::GgufFile::open(&path).unwrap();
        let blocks = spec.layers + u32::from(spec.mtp);
        let type_of = |name: &str| file.tensor(name).unwrap().info.ty;
        assert_eq!(type_of("token_embd.weight"), GgmlType::Q6K);
        for b in 0..blocks {
            let six = if more_bits(b, blocks) {
                GgmlType::Q6K
            } else {
                GgmlType::Q4K
            };
            let sensitive = match spec.is_attention_layer(b) || b == spec.layers {
                true => "attn_v",
                false => "attn_qkv",
            };
            assert_eq!(
                type_of(&format!("blk.{b}.{sensitive}.weight")),
                six,
                "block {b}"
            );
            assert_eq!(
                type_of(&format!("blk.{b}.ffn_down.weight")),
                six,
                "block {b}"
            );
            assert_eq!(type_of(&format!("blk.{b}.ffn_up.weight")), GgmlType::Q4K);
        }
        let (mut batched, mut single) = (open(&path), open(&path));
        let (a, b) = (
            batched.seq_create().into_result().unwrap(),
            single.seq_create().into_result().unwrap(),
        );
        let tokens = [1, 5, 9, 200, 17];
        let mut all = RVec::new();
        batched
            .eval(a, &tokens, LogitRows::All, &mut all)
            .into_result()
            .unwrap();
        for (i, &t) in tokens.iter().enumerate() {
            let mut one = RVec::new();
            single
                .eval(b, &[t], LogitRows::Last, &mut one)
                .into_result()
                .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&all[i * 300..(i + 1) * 300]),
                bits(&one),
                "{:?} row {i}",
                spec.arch
            );
        }
    }
}
