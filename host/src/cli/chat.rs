//! `specula chat`: a multi-turn conversation with a model, through its GGUF chat template
//! (the daemon's renderer), speculating as the profile says.
//!
//! Each turn renders the whole conversation, and the target keeps what it already holds of
//! it ([`generate_continuing`]): a turn evaluates only its new tokens. Ctrl-C stops the answer
//! being written, not the program. Commands: `/reset`, `/stats`, `/help`, `/exit`. With stdin
//! not a terminal, its lines are the script: each is a message or a command.

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use specula_gguf::GgufFile;

use super::setup::Setup;
use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::pipeline::{Parts, Pipeline};
use crate::request::{CancelFlag, Request, StopReason};
use crate::sampling::SamplingParams;
use crate::spec::{generate, generate_continuing, PromptTooLong, SpecSettings, SpecStats};

#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    setup: Setup,
    /// A system message that opens the conversation.
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Evaluate the whole conversation again every turn instead of keeping it in the cache
    /// (for comparison: the answers are the same).
    #[arg(long, hide = true)]
    no_keep: bool,
}

const HELP: &str = "commands: /reset (forget the conversation), /stats (this session's figures), /exit (or Ctrl-D); Ctrl-C stops an answer";

/// What the session has done, for `/stats`.
#[derive(Default)]
struct Session {
    turns: usize,
    prompt_tokens: usize,
    reused_tokens: usize,
    generated_tokens: usize,
    decode_seconds: f64,
    speculative: SpecStats,
}

/// The fewest verify rows (and so rollback depth) a chat's target is opened for.
const CHAT_MIN_VERIFY_TOKENS: u32 = 8;

pub fn run(args: ChatArgs) -> anyhow::Result<ExitCode> {
    let (profile, _) = args.setup.profile()?;
    // Each turn continues the conversation's cache, cutting back where the new prompt's tokens
    // leave the cached ones (often a few tokens before its end): room for that many verify
    // rows keeps a hybrid's cut O(1) even when the profile does not speculate.
    let verify_tokens = Parts::verify_tokens(&profile).max(CHAT_MIN_VERIFY_TOKENS);
    let mut pipeline = Pipeline::open_with_verify_tokens(&profile, verify_tokens)?;
    let file = GgufFile::open(&profile.target.model)?;
    let (template, note) = ChatTemplate::of_model(&file, &pipeline.tokenizer);
    drop(file);
    if let Some(note) = note {
        eprintln!("warning: {note}; using the plain format");
    }
    let interactive = std::io::stdin().is_terminal();

    // Ctrl-C sets this flag (the process goes on); each answer watches it.
    let interrupted = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, interrupted.clone())
        .context("cannot catch Ctrl-C")?;

    let opening: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage {
            role: "system".into(),
            content: s.clone(),
        })
        .collect();
    let mut messages = opening.clone();
    let mut session = Session::default();
    let mut stops = profile.generation.stop.clone();
    stops.extend(template.stops().iter().map(|s| s.to_string()));
    if interactive {
        eprintln!(
            "chatting with {} ({}){}; {HELP}",
            pipeline.info.name,
            profile.target.model.display(),
            pipeline
                .drafter
                .as_ref()
                .map(|d| format!(", drafting with {}", d.name))
                .unwrap_or_default()
        );
    }

    let stdin = std::io::stdin();
    // Bytes that are not UTF-8 (a pasted binary, a terminal in another encoding) become U+FFFD
    // instead of ending the session.
    let mut lines = stdin
        .lock()
        .split(b'\n')
        .map(|line| line.map(|bytes| String::from_utf8_lossy(&bytes).into_owned()));
    loop {
        if interactive {
            print!("> ");
            std::io::stdout().flush()?;
        }
        let Some(line) = lines.next() else {
            break; // Ctrl-D, or the end of the script.
        };
        let line = line.context("cannot read stdin")?;
        let line = line.trim_end_matches('\r');
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/help" => {
                println!("{HELP}");
                continue;
            }
            "/reset" => {
                messages = opening.clone();
                println!("(conversation reset)");
                continue;
            }
            "/stats" => {
                println!("{}", session.report());
                continue;
            }
            command if command.starts_with('/') => {
                println!("unknown command {command}; {HELP}");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: line.to_string(),
        });
        let (prompt, add_bos) =
            match template.prompt(&messages, &pipeline.tokenizer, profile.generation.add_bos) {
                Ok(p) => p,
                Err(e) => {
                    messages.pop();
                    println!("the chat template refused the conversation: {e}");
                    continue;
                }
            };
        interrupted.store(false, Ordering::Relaxed);
        let request = Request {
            prompt,
            max_tokens: profile.generation.max_tokens,
            stop: stops.clone(),
            sampling: SamplingParams::from(&profile.sampling),
            add_bos,
            speculation: pipeline
                .drafter
                .is_some()
                .then(|| SpecSettings::from(&profile.speculation)),
            cancel: CancelFlag::shared(interrupted.clone()),
        };
        let print = |piece: &str| {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        };
        let outcome = if args.no_keep {
            generate(&mut pipeline, &request, print)
        } else {
            generate_continuing(&mut pipeline, &request, print)
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) => {
                messages.pop();
                match e.downcast_ref::<PromptTooLong>() {
                    Some(long) => println!(
                        "the conversation ({} tokens with this message) no longer fits the context of {} tokens: /reset starts a new one (or raise -c)",
                        long.tokens, long.context
                    ),
                    None => {
                        println!();
                        eprintln!("error: {e:#}");
                    }
                }
                continue;
            }
        };
        match outcome.stop_reason {
            StopReason::Cancelled => print!(" [stopped]"),
            StopReason::ContextFull => print!(" [the context is full: /reset starts over]"),
            _ => {}
        }
        println!();
        session.record(&outcome);
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: outcome.text.trim().to_string(),
        });
    }
    Ok(ExitCode::SUCCESS)
}

impl Session {
    fn record(&mut self, outcome: &crate::request::Outcome) {
        self.turns += 1;
        self.prompt_tokens += outcome.timings.prompt_tokens;
        self.reused_tokens += outcome.timings.reused_tokens;
        self.generated_tokens += outcome.timings.generated_tokens;
        self.decode_seconds += outcome.timings.decode_seconds;
        self.speculative.merge(&outcome.speculative);
    }

    fn report(&self) -> String {
        let mut text = format!(
            "turns: {}; prompt tokens: {} ({} kept in the cache from earlier turns, {} evaluated); generated: {} tokens, {:.1} t/s",
            self.turns,
            self.prompt_tokens,
            self.reused_tokens,
            self.prompt_tokens - self.reused_tokens,
            self.generated_tokens,
            if self.decode_seconds > 0.0 {
                self.generated_tokens as f64 / self.decode_seconds
            } else {
                0.0
            }
        );
        if self.speculative.drafted > 0 || self.speculative.paused_steps > 0 {
            text.push('\n');
            text.push_str(&self.speculative.report());
        }
        text
    }
}
