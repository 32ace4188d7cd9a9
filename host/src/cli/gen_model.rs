//! `specula gen-model`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use specula_gguf::GgmlType;

use crate::genmodel::{
    preset, write_demo_model, write_model, Arch, RandomWeights, SpmVocab, TypeMix, Vocab, PRESETS,
};

#[derive(Debug, clap::Args)]
pub struct GenModelArgs {
    /// Output GGUF file.
    #[arg(
        short,
        long,
        value_name = "FILE",
        required_unless_present = "list_presets"
    )]
    out: Option<PathBuf>,
    /// Named shape (see --list-presets); the flags below override it.
    #[arg(long, default_value = "tiny-llama")]
    preset: String,
    /// List the presets and exit.
    #[arg(long)]
    list_presets: bool,
    /// Architecture: llama, qwen2, qwen3 (qwen35 / qwen3next come from presets).
    #[arg(long, value_parser = parse_dense_arch)]
    arch: Option<Arch>,
    // Help from the kernels' weight-type table (`type_help`).
    #[arg(long = "type", value_name = "TYPE", help = type_help())]
    weight_type: Option<String>,
    /// Model width (embedding length).
    #[arg(long)]
    hidden: Option<u32>,
    /// Transformer blocks (an MTP block comes on top).
    #[arg(long)]
    layers: Option<u32>,
    /// Query heads.
    #[arg(long)]
    heads: Option<u32>,
    /// Key / value heads.
    #[arg(long)]
    kv_heads: Option<u32>,
    /// Values per attention head.
    #[arg(long)]
    head_dim: Option<u32>,
    /// Feed-forward width.
    #[arg(long)]
    ffn: Option<u32>,
    /// Context length the model declares.
    #[arg(long)]
    context: Option<u32>,
    /// Vocabulary size (byte tokens plus synthetic pieces; at least 259). Default: the
    /// preset's, else 512.
    #[arg(long)]
    vocab: Option<u32>,
    /// Write no output.weight (tie it to token_embd).
    #[arg(long)]
    tied: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

pub fn run(args: GenModelArgs) -> anyhow::Result<ExitCode> {
    if args.list_presets {
        for (name, what) in PRESETS {
            println!("{name:<12} {what}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let out = args
        .out
        .clone()
        .context("--out FILE is required (the GGUF file to write)")?;
    if args.preset == "demo" {
        write_demo_model(&out)?;
        println!("wrote {} (demo bigram model)", out.display());
        return Ok(ExitCode::SUCCESS);
    }
    let mut spec = preset(&args.preset)?;
    if let Some(a) = args.arch {
        spec.arch = a;
    }
    if let Some(t) = &args.weight_type {
        (spec.mix, spec.weight_type) = match TypeMix::from_name(t) {
            Some(mix) => mix,
            None => GgmlType::from_name(t)
                .filter(|ty| specula_kernels::WeightType::from_ggml(*ty).is_some())
                .map(|ty| (TypeMix::Uniform, ty))
                .with_context(|| {
                    format!(
                        "--type {t}: not a tensor type gen-model writes (use {} or q4_K_M)",
                        specula_kernels::WeightType::list()
                    )
                })?,
        };
    }
    macro_rules! set {
        ($($field:ident),*) => { $( if let Some(v) = args.$field { spec.$field = v; } )* };
    }
    set!(hidden, layers, heads, kv_heads, head_dim, ffn, context);
    spec.tied_output |= args.tied;
    let vocab_size = args.vocab.or(spec.vocab).unwrap_or(512);
    if vocab_size < 259 {
        anyhow::bail!(
            "--vocab {vocab_size}: at least 259 tokens are needed (3 special + 256 bytes)"
        );
    }
    let vocab = Vocab::Spm(SpmVocab::synthetic(vocab_size as usize));
    write_model(&spec, &vocab, &mut RandomWeights::new(args.seed), &out)?;
    println!(
        "wrote {}: {} dim {} layers {} heads {}/{} ffn {} vocab {} ({})",
        out.display(),
        spec.arch.gguf_name(),
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.kv_heads,
        spec.ffn,
        vocab.len(),
        spec.mix.name(spec.weight_type)
    );
    Ok(ExitCode::SUCCESS)
}

/// The help of `--type`: every weight type the kernels write.
fn type_help() -> String {
    format!(
        "Weight type of the matrices: {}, or q4_K_M (llama.cpp's mix: Q4_K, with Q6_K for the \
         output and half the attn_v / ffn_down matrices); matrices whose rows are not whole \
         blocks of it stay f32",
        specula_kernels::WeightType::list()
    )
}

fn parse_dense_arch(name: &str) -> Result<Arch, String> {
    match Arch::from_name(name) {
        Some(a @ (Arch::Llama | Arch::Qwen2 | Arch::Qwen3)) => Ok(a),
        _ => Err(format!(
            "'{name}': --arch takes llama, qwen2 or qwen3; use --preset for hybrids"
        )),
    }
}
