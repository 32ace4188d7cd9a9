//! `specula tokenize` and `specula detokenize`: a model's tokenizer, from its GGUF metadata.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use crate::pipeline::load_tokenizer;

#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    /// The GGUF model whose tokenizer to use (only its metadata is read).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    model: PathBuf,
    /// The text; read from stdin when absent and stdin is not a terminal.
    text: Option<String>,
    /// Do not add BOS (or EOS) as the model does for a prompt.
    #[arg(long)]
    no_bos: bool,
    /// Tokenize control-token texts (`<s>`, `<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Print the ids only.
    #[arg(long)]
    ids: bool,
    /// Print JSON: an array of ids, or of `{"id", "piece"}` objects.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct DetokenizeArgs {
    /// The GGUF model whose tokenizer to use (only its metadata is read).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    model: PathBuf,
    /// Token ids (separated by spaces or commas; `[1, 2]` works too).
    #[arg(required = true, num_args = 1.., value_name = "IDS")]
    ids: Vec<String>,
}

pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<ExitCode> {
    let tokenizer = load_tokenizer(&args.model)?;
    let text = match args.text {
        Some(text) => text,
        None if !std::io::stdin().is_terminal() => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read the text from stdin")?;
            text
        }
        None => anyhow::bail!("give the text to tokenize as an argument or on stdin"),
    };
    let ids = tokenizer.encode(&text, !args.no_bos, !args.no_parse_special);
    let piece =
        |id: u32| String::from_utf8_lossy(&tokenizer.token_to_piece_special(id)).into_owned();
    if args.json {
        let value = if args.ids {
            serde_json::json!(ids)
        } else {
            ids.iter()
                .map(|&id| serde_json::json!({"id": id, "piece": piece(id)}))
                .collect()
        };
        println!("{value}");
    } else if args.ids {
        println!("{ids:?}");
    } else {
        for &id in &ids {
            println!("{id:>7} -> {:?}", piece(id));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn detokenize(args: DetokenizeArgs) -> anyhow::Result<ExitCode> {
    let tokenizer = load_tokenizer(&args.model)?;
    let vocab = tokenizer.vocab_size();
    let mut ids = Vec::new();
    for word in args
        .ids
        .iter()
        .flat_map(|a| a.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']'))
        .filter(|w| !w.is_empty())
    {
        let id: u32 = word
            .parse()
            .with_context(|| format!("{word:?} is not a token id"))?;
        anyhow::ensure!(
            (id as usize) < vocab,
            "token id {id} is out of range (the vocabulary of {} has {vocab} tokens)",
            args.model.display()
        );
        ids.push(id);
    }
    let bytes = tokenizer.decode(&ids);
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(&bytes)?;
    writeln!(out)?;
    Ok(ExitCode::SUCCESS)
}
