//! Tokenizer metadata for generated models: a SentencePiece-style vocabulary built here, or
//! the tokenizer of an existing GGUF copied verbatim.

use specula_gguf::{GgufFile, GgufWriter, Value};

/// Token types as GGUF stores them.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const BYTE: i32 = 6;

/// A SentencePiece-style vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then pieces.
#[derive(Debug, Clone, PartialEq)]
pub struct SpmVocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    seen: std::collections::HashSet<String>,
}

impl SpmVocab {
    pub const UNK: u32 = 0;
    pub const BOS: u32 = 1;
    pub const EOS: u32 = 2;

    /// Only the special and byte tokens.
    pub fn bytes_only() -> Self {
        let mut v = Self {
            tokens: Vec::new(),
            scores: Vec::new(),
            types: Vec::new(),
            seen: Default::default(),
        };
        for (text, ty) in [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)] {
            v.add(text.to_string(), 0.0, ty);
        }
        for b in 0..=255u8 {
            v.add(format!("<0x{b:02X}>"), 0.0, BYTE);
        }
        v
    }

    /// Byte tokens plus `words` (each as `▁word`, SentencePiece's space-prefixed form) and every
    /// prefix the merges need to reach them. Longer pieces score higher, so the tokenizer
    /// merges up to whole words.
    pub fn from_words<'a>(words: impl IntoIterator<Item = &'a str>) -> Self {
        let mut v = Self::bytes_only();
        let mut pieces: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for word in words {
            let piece = format!("\u{2581}{word}");
            let chars: Vec<char> = piece.chars().collect();
            for end in 1..=chars.len() {
                let prefix: String = chars[..end].iter().collect();
                if seen.insert(prefix.clone()) {
                    pieces.push(prefix);
                }
            }
            // The bare word (after punctuation or at the start of a line) too.
            let bare: Vec<char> = word.chars().collect();
            for end in 1..=bare.len() {
                let prefix: String = bare[..end].iter().collect();
                if seen.insert(prefix.clone()) {
                    pieces.push(prefix);
                }
            }
        }
        for piece in pieces {
            let score = piece.chars().count() as f32;
            v.push(piece, score);
        }
        v
    }

    /// A vocabulary of exactly `n` tokens (at least the 259 special and byte tokens): letter
    /// pieces, letter pairs, then numbered word pieces — for benchmark models.
    pub fn synthetic(n: usize) -> Self {
        let mut vocab = Self::bytes_only();
        let letters: Vec<char> = ('a'..='z').collect();
        let mut pieces: Vec<String> = letters.iter().map(|c| format!("\u{2581}{c}")).collect();
        for a in &letters {
            for b in &letters {
                pieces.push(format!("{a}{b}"));
            }
        }
        let mut k = 0usize;
        while vocab.len() < n {
            let piece = pieces
                .get(k)
                .cloned()
                .unwrap_or_else(|| format!("\u{2581}w{k}"));
            vocab.push(piece, -(k as f32));
            k += 1;
        }
        vocab
    }

    /// Adds a normal piece (ignored if present).
    pub fn push(&mut self, piece: String, score: f32) {
        self.add(piece, score, NORMAL);
    }

    fn add(&mut self, piece: String, score: f32, ty: i32) {
        if self.seen.insert(piece.clone()) {
            self.tokens.push(piece);
            self.scores.push(score);
            self.types.push(ty);
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// Writes the `tokenizer.ggml.*` keys.
    pub fn write_metadata(&self, w: &mut GgufWriter) {
        w.set_str("tokenizer.ggml.model", "llama")
            .set_str_array("tokenizer.ggml.tokens", self.tokens.iter().cloned())
            .set_f32_array("tokenizer.ggml.scores", self.scores.iter().copied())
            .set_i32_array("tokenizer.ggml.token_type", self.types.iter().copied())
            .set_u32("tokenizer.ggml.bos_token_id", Self::BOS)
            .set_u32("tokenizer.ggml.eos_token_id", Self::EOS)
            .set_u32("tokenizer.ggml.unknown_token_id", Self::UNK)
            .set_bool("tokenizer.ggml.add_bos_token", true)
            .set_bool("tokenizer.ggml.add_eos_token", false);
    }
}

/// The tokenizer a generated model carries.
#[derive(Debug, Clone)]
pub enum Vocab {
    /// A vocabulary built here.
    Spm(SpmVocab),
    /// Every `tokenizer.*` key of an existing model, copied.
    Copied {
        metadata: Vec<(String, Value)>,
        size: usize,
    },
}

impl Vocab {
    /// The tokenizer of `file`, to be copied verbatim.
    pub fn copy_from(file: &GgufFile) -> Result<Self, specula_gguf::GgufError> {
        let size = file
            .get_str_array("tokenizer.ggml.tokens")?
            .map(|t| t.len())
            .unwrap_or(0);
        let metadata = file
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect();
        Ok(Self::Copied { metadata, size })
    }

    pub fn len(&self) -> usize {
        match self {
            Vocab::Spm(v) => v.len(),
            Vocab::Copied { size, .. } => *size,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the `tokenizer.*` keys.
    pub fn write_metadata(&self, w: &mut GgufWriter) {
        match self {
            Vocab::Spm(v) => v.write_metadata(w),
            Vocab::Copied { metadata, .. } => {
                for (k, v) in metadata {
                    w.set(k.clone(), v.clone());
                }
            }
        }
    }
}

impl From<SpmVocab> for Vocab {
    fn from(v: SpmVocab) -> Self {
        Vocab::Spm(v)
    }
}
