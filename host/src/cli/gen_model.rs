//! `specula gen-model`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use specula_gguf::GgmlType;

use crate::genmodel::{
    write_demo_model, write_model, Arch, ModelSpec, RandomWeights, SpmVocab, PRESETS,
};

#[derive(Debug, clap::Args)]
pub struct GenModelArgs {
    /// Output GGUF file.
    #[arg(short, long, value_name = "FILE")]
    out: PathBuf,
    /// Named shape (tiny-llama, tiny-qwen3, small-llama, demo); flags below override it.
    #[arg(long, default_value = "tiny-llama")]
    preset: String,
    /// List the presets and exit.
    #[arg(long)]
    list_presets: bool,
    #[arg(long, value_enum)]
    arch: Option<Arch>,
    /// Weight type of the matrices: f32, f16, bf16, q8_0.
    #[arg(long = "type", value_name = "TYPE")]
    weight_type: Option<String>,
    #[arg(long)]
    hidden: Option<u32>,
    #[arg(long)]
    layers: Option<u32>,
    #[arg(long)]
    heads: Option<u32>,
    #[arg(long)]
    kv_heads: Option<u32>,
    #[arg(long)]
    head_dim: Option<u32>,
    #[arg(long)]
    ffn: Option<u32>,
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
    if args.preset == "demo" {
        write_demo_model(&args.out)?;
        println!("wrote {} (demo bigram model)", args.out.display());
        return Ok(ExitCode::SUCCESS);
    }
    let mut spec = ModelSpec::preset(&args.preset)?;
    if let Some(a) = args.arch {
        spec.arch = a;
    }
    if let Some(t) = &args.weight_type {
        spec.weight_type = GgmlType::from_name(t).with_context(|| {
            format!("--type {t}: unknown tensor type (use f32, f16, bf16 or q8_0)")
        })?;
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
    let vocab = synthetic_vocab(vocab_size as usize);
    write_model(&spec, &vocab, &mut RandomWeights::new(args.seed), &args.out)?;
    println!(
        "wrote {}: {} dim {} layers {} heads {}/{} ffn {} vocab {} ({})",
        args.out.display(),
        spec.arch.gguf_name(),
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.kv_heads,
        spec.ffn,
        vocab.len(),
        spec.weight_type
    );
    Ok(ExitCode::SUCCESS)
}

/// A vocabulary of exactly `n` tokens: bytes, then letter pairs and triples as pieces.
fn synthetic_vocab(n: usize) -> SpmVocab {
    let mut vocab = SpmVocab::bytes_only();
    let letters: Vec<char> = ('a'..='z').collect();
    let mut pieces = letters
        .iter()
        .map(|c| format!("\u{2581}{c}"))
        .collect::<Vec<_>>();
    for a in &letters {
        for b in &letters {
            pieces.push(format!("{a}{b}"));
        }
    }
    let mut k = 0usize;
    while vocab.len() < n {
        let piece = match pieces.get(k) {
            Some(p) => p.clone(),
            None => format!("\u{2581}w{k}"),
        };
        vocab.push(piece, -(k as f32));
        k += 1;
    }
    vocab
}
