//! Tokenizers read from GGUF metadata, with llama.cpp's semantics.
//!
//! Two families, chosen by `tokenizer.ggml.model`:
//!
//! * `llama`: SentencePiece-style BPE over scored pieces (`spm.rs`): spaces become `▁`, a `▁`
//!   is put in front of the text (`tokenizer.ggml.add_space_prefix`, default true), characters
//!   without a piece fall back to `<0xXX>` byte tokens;
//! * `gpt2`: byte-level BPE with ranked merges (`bpe.rs`) after a regex pre-tokenizer chosen by
//!   `tokenizer.ggml.pre` (`pretokenize.rs`). An unknown `pre` value is refused (as llama.cpp
//!   does); a missing one selects llama.cpp's `default` set with a warning.
//!
//! Before either runs, special-token texts are split out of the input (`vocab.rs`): control
//! and unknown tokens only when `parse_special` is set, user-defined (added) tokens always.
//!
//! Special ids: `bos_token_id` / `eos_token_id` (u32::MAX means none; absent means 1 / 2 for
//! SentencePiece, none for BPE), `add_bos_token` / `add_eos_token` (absent: SentencePiece adds
//! BOS; BPE adds BOS only for the Llama 3 family of pre-tokenizers, as in llama.cpp; nobody
//! adds EOS). End of generation: EOS, `eot_token_id`, `eom_token_id`, the FIM pad / repo /
//! file-separator tokens, and llama.cpp's list of end markers by text (`<|endoftext|>`,
//! `<|im_end|>`, `<|eot_id|>`, `<|end|>`, `</s>`, ...), which also become control tokens.
//!
//! Decoding renders control tokens as nothing, byte tokens as their byte, and never fails:
//! ids outside the vocabulary decode to nothing. [`StreamDecoder`] turns ids into whole UTF-8
//! text one token at a time.
//!
//! Deliberate differences from llama.cpp: decoding does not apply `clean_up_tokenization_spaces`
//! (so `decode(encode(s)) == s` holds for byte-level models too); the SentencePiece leading
//! space is also dropped after leading tokens that render nothing (e.g. BOS); a BPE file
//! without BOS/EOS keys has none (llama.cpp assumes id 11); model-name-specific strip rules
//! (Phi-3's) are not applied.

mod bpe;
mod error;
mod pretokenize;
mod spm;
mod stream;
mod vocab;

use std::collections::HashSet;

use specula_gguf::GgufFile;

pub use error::TokenizerError;
pub use stream::StreamDecoder;
pub use vocab::TokenType;

use bpe::Bpe;
use pretokenize::PreTokenizer;
use spm::Spm;
use vocab::{Fragment, SpecialTokens, Vocab};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_FIM_PAD: &str = "tokenizer.ggml.fim_pad_token_id";
const KEY_FIM_REP: &str = "tokenizer.ggml.fim_rep_token_id";
const KEY_FIM_SEP: &str = "tokenizer.ggml.fim_sep_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// The tokenizer family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `llama`: SentencePiece-style BPE with scores and byte fallback.
    SentencePiece,
    /// `gpt2`: byte-level BPE with merges and a regex pre-tokenizer.
    ByteLevelBpe,
}

enum Model {
    Spm(Spm),
    Bpe(Bpe),
}

/// A tokenizer: text to token ids and back.
pub struct Tokenizer {
    model: Model,
    vocab: Vocab,
    specials: SpecialTokens,
    /// Each token's bytes when rendered as text (control and unknown tokens: empty).
    pieces: Vec<Box<[u8]>>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    end_of_generation: HashSet<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("pre", &self.pre_tokenizer())
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by `file`'s `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let path = file.path().to_path_buf();
        let invalid = |key: &str, what: String| TokenizerError::Invalid {
            path: path.clone(),
            key: key.to_string(),
            what,
        };

        let model_name = file
            .get_str(KEY_MODEL)?
            .ok_or_else(|| TokenizerError::MissingKey {
                path: path.clone(),
                key: KEY_MODEL,
            })?;
        let kind = match model_name {
            "llama" => TokenizerKind::SentencePiece,
            "gpt2" => TokenizerKind::ByteLevelBpe,
            other => {
                return Err(TokenizerError::UnknownModel {
                    path: path.clone(),
                    key: KEY_MODEL,
                    model: other.to_string(),
                })
            }
        };

        let texts = file
            .get_str_array(KEY_TOKENS)?
            .ok_or_else(|| TokenizerError::MissingKey {
                path: path.clone(),
                key: KEY_TOKENS,
            })?;
        let n = texts.len();
        if n == 0 || n > u32::MAX as usize / 2 {
            return Err(invalid(KEY_TOKENS, format!("holds {n} tokens")));
        }
        let scores = match file.get_f32_array(KEY_SCORES)? {
            None => vec![0.0; n],
            Some(s) if s.len() >= n => s[..n].to_vec(),
            Some(s) => {
                return Err(invalid(
                    KEY_SCORES,
                    format!("has {} entries for {n} tokens", s.len()),
                ))
            }
        };
        let mut types = match file.get_i64_array(KEY_TOKEN_TYPE)? {
            None => vec![TokenType::Normal; n],
            Some(t) if t.len() >= n => t[..n].iter().map(|&v| TokenType::from_gguf(v)).collect(),
            Some(t) => {
                return Err(invalid(
                    KEY_TOKEN_TYPE,
                    format!("has {} entries for {n} tokens", t.len()),
                ))
            }
        };

        // End-of-generation markers found by text are control tokens whatever the file says
        // (llama.cpp does the same), so they are neither merged from text nor rendered.
        let eog_by_text: Vec<u32> = texts
            .iter()
            .enumerate()
            .filter(|(_, t)| vocab::END_OF_GENERATION_TEXTS.contains(t))
            .map(|(i, _)| i as u32)
            .collect();
        for &id in &eog_by_text {
            types[id as usize] = TokenType::Control;
        }

        let vocab = Vocab::new(texts.iter().map(|s| s.to_string()).collect(), scores, types)
            .map_err(|e| invalid(KEY_TOKENS, e))?;

        let special_id = |key: &'static str, default: Option<u32>| -> Option<u32> {
            match file.get(key).map(|v| v.as_i128()) {
                None => default.filter(|&id| (id as usize) < n),
                Some(Some(v)) if v >= 0 && (v as usize) < n => Some(v as u32),
                // u32::MAX (and -1) mean "none".
                Some(Some(v)) if v == u32::MAX as i128 || v == -1 => None,
                Some(other) => {
                    tracing::warn!(file = %path.display(), key, value = ?other, vocab_size = n, "special token id out of range; ignoring it");
                    None
                }
            }
        };
        let spm = kind == TokenizerKind::SentencePiece;
        let bos = special_id(KEY_BOS, if spm { Some(1) } else { None });
        let eos = special_id(KEY_EOS, if spm { Some(2) } else { None });
        let unk = special_id(KEY_UNK, if spm { Some(0) } else { None });

        let (model, default_add_bos) = match kind {
            TokenizerKind::SentencePiece => (Model::Spm(Spm::new(&vocab, unk)), true),
            TokenizerKind::ByteLevelBpe => {
                let merges =
                    file.get_str_array(KEY_MERGES)?
                        .ok_or_else(|| TokenizerError::MissingKey {
                            path: path.clone(),
                            key: KEY_MERGES,
                        })?;
                let spec = match file.get_str(KEY_PRE)? {
                    None => {
                        tracing::warn!(file = %path.display(), "no {KEY_PRE}: using llama.cpp's 'default' pre-tokenizer; tokenisation may not match the model's training");
                        pretokenize::spec("default")
                    }
                    Some(pre) => pretokenize::spec(pre),
                }
                .ok_or_else(|| TokenizerError::UnknownPreTokenizer {
                    path: path.clone(),
                    key: KEY_PRE,
                    pre: file.get_str(KEY_PRE).ok().flatten().unwrap_or("").to_string(),
                    known: pretokenize::known_names(),
                })?;
                let pre = PreTokenizer::new(spec).map_err(|e| invalid(KEY_PRE, e))?;
                let (bpe, skipped) = Bpe::new(&vocab, &merges, pre);
                if skipped > 0 {
                    tracing::debug!(file = %path.display(), skipped, "merges whose sides or result are not tokens were skipped");
                }
                (Model::Bpe(bpe), spec.add_bos)
            }
        };

        let add_bos = match file.get_bool(KEY_ADD_BOS)? {
            Some(true) if bos.is_none() => {
                return Err(invalid(
                    KEY_ADD_BOS,
                    format!("is true, but the file has no valid {KEY_BOS}"),
                ))
            }
            Some(v) => v,
            None => default_add_bos && bos.is_some(),
        };
        let add_eos = match file.get_bool(KEY_ADD_EOS)? {
            Some(true) if eos.is_none() => {
                return Err(invalid(
                    KEY_ADD_EOS,
                    format!("is true, but the file has no valid {KEY_EOS}"),
                ))
            }
            Some(v) => v,
            None => false,
        };
        let add_space_prefix = spm && file.get_bool(KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);

        let mut end_of_generation: HashSet<u32> = eog_by_text.into_iter().collect();
        end_of_generation.extend(eos);
        end_of_generation.extend(special_id(KEY_EOT, None));
        end_of_generation.extend(special_id(KEY_EOM, None));
        for (key, list) in [
            (KEY_FIM_PAD, vocab::FIM_PAD_TEXTS),
            (KEY_FIM_REP, vocab::FIM_REP_TEXTS),
            (KEY_FIM_SEP, vocab::FIM_SEP_TEXTS),
        ] {
            end_of_generation.extend(special_id(key, None).or(vocab.ids_of(list).first().copied()));
        }

        let pieces = (0..n as u32)
            .map(|id| render(kind, &vocab, id, false).into_boxed_slice())
            .collect();
        let specials = SpecialTokens::new(&vocab);

        Ok(Self {
            model,
            vocab,
            specials,
            pieces,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix,
            end_of_generation,
        })
    }

    /// Tokenizes `text`.
    ///
    /// `add_special` adds BOS / EOS as the model asks (`add_bos` / `add_eos`). With
    /// `parse_special`, control-token texts in `text` (e.g. `<s>`, `<|im_start|>`) become those
    /// tokens; without it they are tokenized as plain text. User-defined tokens are always
    /// matched. Never fails: text without a piece falls back to byte tokens.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let fragments = self.specials.partition(&self.vocab, text, parse_special);
        match &self.model {
            Model::Spm(spm) => {
                // A `▁` goes in front of the first text and of any text after a special token.
                let mut after_special = true;
                let mut buf = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                        Fragment::Text(t) => {
                            buf.clear();
                            if self.add_space_prefix && after_special {
                                buf.push(spm::SPACE);
                            }
                            buf.extend(t.chars().map(|c| if c == ' ' { spm::SPACE } else { c }));
                            spm.encode(&self.vocab, &buf, &mut out);
                            after_special = false;
                        }
                    }
                }
            }
            Model::Bpe(bpe) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(t) => bpe.encode(&self.vocab, t, &mut out),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// The bytes of a token sequence.
    ///
    /// Control and unknown tokens render as nothing; ids outside the vocabulary as nothing.
    /// For SentencePiece models with a space prefix, the one space that `encode` put in front
    /// of the text is dropped from the first token that renders anything, so that
    /// `decode(encode(s, ..))` gives back `s`. Bytes are returned as they are (a sequence can
    /// end inside a character, or hold invalid UTF-8 from byte tokens).
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at_start = true;
        for &id in ids {
            let piece = self.piece_bytes(id);
            if piece.is_empty() {
                continue;
            }
            if at_start && self.strips_leading_space(id) {
                out.extend_from_slice(&piece[1..]);
            } else {
                out.extend_from_slice(piece);
            }
            at_start = false;
        }
        out
    }

    /// The bytes token `id` renders as in running text (empty for control, unknown and unused
    /// tokens, and for ids outside the vocabulary).
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        self.piece_bytes(id).to_vec()
    }

    /// Like [`token_to_piece`](Self::token_to_piece), but control and unknown tokens render as
    /// their text (for showing prompts and debugging).
    pub fn token_to_piece_special(&self, id: u32) -> Vec<u8> {
        render(self.kind(), &self.vocab, id, true)
    }

    /// The raw vocabulary text of `id` (with `▁` or byte-level characters as stored).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The id whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// The type of `id` as used here (end-of-generation markers count as control tokens).
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.vocab.ty(id)
    }

    /// The number of tokens (ids are `0..vocab_size`).
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The tokenizer family (`tokenizer.ggml.model`).
    pub fn kind(&self) -> TokenizerKind {
        match self.model {
            Model::Spm(_) => TokenizerKind::SentencePiece,
            Model::Bpe(_) => TokenizerKind::ByteLevelBpe,
        }
    }

    /// The canonical name of the byte-level pre-tokenizer (`None` for SentencePiece).
    pub fn pre_tokenizer(&self) -> Option<&'static str> {
        match &self.model {
            Model::Spm(_) => None,
            Model::Bpe(bpe) => Some(bpe.pre.spec.name),
        }
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, if the model has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generating `id` ends generation: EOS, EOT, EOM, the fill-in-the-middle
    /// pad/repo/file-separator tokens, and control tokens such as `<|endoftext|>`,
    /// `<|im_end|>`, `<|eot_id|>`, `<|end|>`, `<end_of_turn>`.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    /// Whether `id` is a control token (not text: `<s>`, `<|im_start|>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.ty(id) == Some(TokenType::Control)
    }

    pub(crate) fn piece_bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], |p| p)
    }

    /// Whether `id`, rendered first, carries the space `encode` put in front of the text.
    pub(crate) fn strips_leading_space(&self, id: u32) -> bool {
        self.add_space_prefix
            && self.vocab.ty(id) == Some(TokenType::Normal)
            && self.piece_bytes(id).first() == Some(&b' ')
    }
}

/// Renders token `id` as bytes; control and unknown tokens only when `special`.
fn render(kind: TokenizerKind, vocab: &Vocab, id: u32, special: bool) -> Vec<u8> {
    let (Some(text), Some(ty)) = (vocab.texts.get(id as usize), vocab.ty(id)) else {
        return Vec::new();
    };
    match ty {
        TokenType::Control | TokenType::Unknown if special => text.as_bytes().to_vec(),
        TokenType::Control | TokenType::Unknown | TokenType::Unused | TokenType::Undefined => {
            Vec::new()
        }
        TokenType::UserDefined => text.as_bytes().to_vec(),
        TokenType::Byte => match parse_byte_token(text) {
            Some(b) => vec![b],
            None => text.as_bytes().to_vec(),
        },
        TokenType::Normal => match kind {
            TokenizerKind::SentencePiece => text.replace(spm::SPACE, " ").into_bytes(),
            TokenizerKind::ByteLevelBpe => bpe::decode_text(text),
        },
    }
}

/// The byte of a `<0xXX>` token text.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
