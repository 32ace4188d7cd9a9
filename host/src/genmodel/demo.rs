//! The `demo` preset: a word-bigram language model of an embedded public-domain text (the
//! opening chapters of Tolstoy's *War and Peace*, Maude translation), written as an ordinary
//! `llama` GGUF without any download.
//!
//! How a bigram fits a transformer: each of the most frequent tokens owns one dimension of
//! the residual stream and its embedding is that unit vector (all other tokens share one
//! fallback dimension). After RMSNorm the vector is `sqrt(E)` on that dimension, so the output
//! projection's column for it holds the scaled log-probabilities of the next token. Attention
//! and FFN carry small random weights, so every layer still runs and only nudges the logits.
//! It writes word salad with English local structure, not stories: use a real model (see the
//! profiles in `profiles/`) for real text.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use specula_gguf::{GgmlType, GgufFile, GgufWriter};

use super::{write_model, Arch, ModelSpec, RandomWeights, SpmVocab, Vocab, WeightSource};
use specula_tokenizer::Tokenizer;

/// The embedded public-domain text (also the built-in benchmark prompt source).
pub const CORPUS: &str = include_str!("../../assets/default-corpus.txt");
/// Residual width: one dimension per context token, the last one shared by the rest.
const HIDDEN: usize = 512;
const WORDS: usize = 1500;
const LAYERS: u32 = 2;
const SEED: u64 = 20261121;

/// Writes the demo model to `path`.
pub fn write_demo_model(path: &Path) -> anyhow::Result<()> {
    let vocab = demo_vocab();
    let tokenizer = tokenizer_of(&vocab, path)?;
    let tokens = tokenizer.encode(&unwrapped_corpus(), true, false);

    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in &tokens {
        *counts.entry(t).or_default() += 1;
    }
    let mut by_frequency: Vec<(u32, usize)> = counts.into_iter().collect();
    by_frequency.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    // Context dimensions: BOS first, then the most frequent tokens; the last is the fallback.
    let mut dim_of: HashMap<u32, usize> = HashMap::from([(SpmVocab::BOS, 0)]);
    for &(t, _) in &by_frequency {
        if dim_of.len() == HIDDEN - 1 {
            break;
        }
        let next = dim_of.len();
        dim_of.entry(t).or_insert(next);
    }
    let fallback = HIDDEN - 1;
    let dim = |t: u32| dim_of.get(&t).copied().unwrap_or(fallback);

    let v = vocab.len();
    let mut bigrams = vec![0f32; HIDDEN * v];
    for pair in tokens.windows(2) {
        bigrams[dim(pair[0]) * v + pair[1] as usize] += 1.0;
    }
    let seen: Vec<bool> = (0..v)
        .map(|t| (0..HIDDEN).any(|d| bigrams[d * v + t] > 0.0))
        .collect();
    // Log-probabilities with add-0.1 smoothing over tokens the text uses; others get -20.
    let mut log_probs = vec![0f32; HIDDEN * v];
    for d in 0..HIDDEN {
        let row = &bigrams[d * v..(d + 1) * v];
        let total: f32 = row
            .iter()
            .zip(&seen)
            .filter(|(_, s)| **s)
            .map(|(c, _)| c + 0.1)
            .sum();
        for t in 0..v {
            log_probs[d * v + t] = if seen[t] {
                ((row[t] + 0.1) / total).ln()
            } else {
                -20.0
            };
        }
    }

    let spec = ModelSpec {
        context: 2048,
        weight_type: GgmlType::Q8_0,
        ..ModelSpec::dense(
            Arch::Llama,
            "specula-demo-bigram",
            HIDDEN as u32,
            LAYERS,
            8,
            8,
            (HIDDEN / 8) as u32,
            512,
        )
    };
    let mut weights = DemoWeights {
        random: RandomWeights::new(SEED),
        dims: (0..v as u32).map(dim).collect(),
        log_probs,
        vocab: v,
    };
    write_model(&spec, &Vocab::Spm(vocab), &mut weights, path)
        .with_context(|| format!("cannot write the default model to {}", path.display()))
}

/// The corpus with its hard line wraps joined: one line per paragraph.
fn unwrapped_corpus() -> String {
    CORPUS
        .split("\n\n")
        .map(|paragraph| paragraph.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The vocabulary: bytes, the most frequent words of the text (with their prefixes), and
/// punctuation.
fn demo_vocab() -> SpmVocab {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for word in CORPUS.split(|c: char| !c.is_alphabetic() && c != '\'') {
        let word = word.trim_matches('\'');
        if !word.is_empty() {
            *counts.entry(word).or_default() += 1;
        }
    }
    let mut words: Vec<(&str, usize)> = counts.into_iter().collect();
    words.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut vocab = SpmVocab::from_words(words.iter().take(WORDS).map(|w| w.0));
    for p in [
        ",",
        ".",
        ";",
        ":",
        "!",
        "?",
        "\"",
        "'",
        "-",
        "--",
        "(",
        ")",
        "\u{2581}\"",
        "\u{2581}(",
    ] {
        vocab.push(p.to_string(), 1.5);
    }
    vocab
}

/// Builds the tokenizer of `vocab` (through a vocab-only GGUF beside `path`).
fn tokenizer_of(vocab: &SpmVocab, path: &Path) -> anyhow::Result<Tokenizer> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let scratch = tempfile_in(dir)?;
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama");
    vocab.write_metadata(&mut w);
    w.write(&scratch)?;
    let file = GgufFile::open(&scratch);
    let _ = std::fs::remove_file(&scratch);
    Ok(Tokenizer::from_gguf(&file?)?)
}

fn tempfile_in(dir: &Path) -> anyhow::Result<PathBuf> {
    Ok(dir.join(format!(".vocab-{}.gguf.tmp", std::process::id())))
}

/// Bigram embeddings and output projection; small random weights elsewhere.
struct DemoWeights {
    random: RandomWeights,
    dims: Vec<usize>,
    log_probs: Vec<f32>,
    vocab: usize,
}

impl WeightSource for DemoWeights {
    fn tensor(&mut self, name: &str, n_in: usize, n_out: usize) -> Vec<f32> {
        match name {
            "token_embd.weight" => {
                let mut e = vec![0f32; n_in * n_out];
                for (t, &d) in self.dims.iter().enumerate() {
                    e[t * n_in + d] = 1.0;
                }
                e
            }
            "output.weight" => {
                // Row t (next token) over columns d (context dimension), divided by sqrt(E)
                // to undo RMSNorm's scaling of a unit vector.
                let scale = 1.0 / (n_in as f32).sqrt();
                let mut out = vec![0f32; n_in * n_out];
                for t in 0..self.vocab {
                    for d in 0..n_in {
                        out[t * n_in + d] = self.log_probs[d * self.vocab + t] * scale;
                    }
                }
                out
            }
            n if n.ends_with("norm.weight") => vec![1.0; n_in * n_out],
            n => {
                // Keep the layers' contribution to the residual small.
                let damp = if n.ends_with("attn_output.weight") || n.ends_with("ffn_down.weight") {
                    0.01
                } else {
                    1.0
                };
                let mut w = self.random.tensor(n, n_in, n_out);
                w.iter_mut().for_each(|x| *x *= damp);
                w
            }
        }
    }
}
