//! The token table (texts, scores, types) and the splitting of special-token texts out of raw
//! input before the model's own tokenisation runs.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A fast non-cryptographic hasher (FxHash's multiply-rotate) for the vocabulary and merge
/// tables. Their keys are fixed by the model file, so hash flooding is not a concern, and
/// lookups dominate tokenisation time.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A token's type, from `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 1: an ordinary piece of text.
    Normal,
    /// 2: the unknown token (and, in some vocabularies, padding placeholders).
    Unknown,
    /// 3: a control token (`<s>`, `<|im_end|>`, ...): not text; renders as nothing.
    Control,
    /// 4: an added token matched verbatim in the input and rendered verbatim.
    UserDefined,
    /// 5: a reserved, never produced slot.
    Unused,
    /// 6: a byte-fallback token `<0xXX>`.
    Byte,
    /// Any other value.
    Undefined,
}

impl TokenType {
    pub(crate) fn from_gguf(value: i64) -> Self {
        match value {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }

    /// Tokens that are split out of the input before tokenisation (llama.cpp's "special
    /// tokens cache"): control, user-defined and unknown ones.
    fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }
}

/// The token table.
pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<TokenType>,
    lookup: FastMap<String, u32>,
}

impl Vocab {
    /// Builds the table; `Err` names the first duplicated text and its two ids.
    pub fn new(
        texts: Vec<String>,
        scores: Vec<f32>,
        types: Vec<TokenType>,
    ) -> Result<Self, String> {
        let mut lookup = FastMap::with_capacity_and_hasher(texts.len(), Default::default());
        for (id, text) in texts.iter().enumerate() {
            // Empty texts can never match input; llama.cpp renames them, we just skip them.
            if text.is_empty() {
                continue;
            }
            if let Some(first) = lookup.insert(text.clone(), id as u32) {
                return Err(format!(
                    "token '{text}' appears twice (ids {first} and {id})"
                ));
            }
        }
        Ok(Self {
            texts,
            scores,
            types,
            lookup,
        })
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    /// The id of exactly `text`, whatever its type.
    pub fn id(&self, text: &str) -> Option<u32> {
        self.lookup.get(text).copied()
    }

    pub fn ty(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// Ids of the tokens whose texts are in `texts`, in id order.
    pub fn ids_of(&self, texts: &[&str]) -> Vec<u32> {
        let mut ids: Vec<u32> = texts.iter().filter_map(|t| self.id(t)).collect();
        ids.sort_unstable();
        ids
    }
}

/// A piece of input after special-token splitting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    /// Text still to be tokenised.
    Text(&'t str),
    /// A special token found verbatim in the input.
    Token(u32),
}

/// Finds special-token texts in raw input.
///
/// Semantics follow llama.cpp: tokens are tried longest text first, and each one splits every
/// remaining text fragment at all its (non-overlapping, leftmost-first) occurrences. A byte
/// trie first finds which special texts occur in the input at all, so that vocabularies with
/// thousands of added tokens cost one pass over the text plus work for the few that occur.
pub(crate) struct SpecialTokens {
    /// Special ids, longest text first (ties by id).
    ordered: Vec<u32>,
    /// Rank of each special id in `ordered`.
    rank: HashMap<u32, usize>,
    trie: Trie,
}

impl SpecialTokens {
    pub fn new(vocab: &Vocab) -> Self {
        let mut ordered: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&id| {
                vocab.types[id as usize].is_special() && !vocab.texts[id as usize].is_empty()
            })
            .collect();
        ordered.sort_by(|&a, &b| {
            let (la, lb) = (vocab.texts[a as usize].len(), vocab.texts[b as usize].len());
            lb.cmp(&la).then(a.cmp(&b))
        });
        let rank = ordered.iter().enumerate().map(|(r, &id)| (id, r)).collect();
        let mut trie = Trie::default();
        for &id in &ordered {
            trie.insert(vocab.texts[id as usize].as_bytes(), id);
        }
        Self {
            ordered,
            rank,
            trie,
        }
    }

    /// Splits `text` into raw-text fragments and special tokens. Control and unknown tokens are
    /// recognised only when `parse_special` is set; user-defined tokens always are (as in
    /// llama.cpp and Hugging Face tokenizers, which treat added tokens as pre-split).
    pub fn partition<'t>(
        &self,
        vocab: &Vocab,
        text: &'t str,
        parse_special: bool,
    ) -> Vec<Fragment<'t>> {
        if text.is_empty() {
            return Vec::new();
        }
        let allowed = |id: u32| parse_special || vocab.ty(id) == Some(TokenType::UserDefined);
        let mut present = vec![false; self.ordered.len()];
        let mut any = false;
        self.trie.scan(text.as_bytes(), |id| {
            if allowed(id) {
                if let Some(&r) = self.rank.get(&id) {
                    present[r] = true;
                    any = true;
                }
            }
        });
        let mut fragments = vec![Fragment::Text(text)];
        if !any {
            return fragments;
        }
        for (r, &id) in self.ordered.iter().enumerate() {
            if !present[r] {
                continue;
            }
            let needle = vocab.texts[id as usize].as_str();
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                // UTF-8 is self-synchronising: a match of a valid string always starts and
                // ends on character boundaries, so slicing cannot fail.
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// A byte trie of special-token texts, used to find which of them occur in a text.
#[derive(Default)]
struct Trie {
    /// Children of the root, by first byte (`u32::MAX` = none).
    root: Vec<u32>,
    nodes: Vec<TrieNode>,
}

#[derive(Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    id: Option<u32>,
}

impl Trie {
    fn insert(&mut self, text: &[u8], id: u32) {
        if self.root.is_empty() {
            self.root = vec![u32::MAX; 256];
        }
        let Some((&first, rest)) = text.split_first() else {
            return;
        };
        let mut node = match self.root[first as usize] {
            u32::MAX => {
                self.nodes.push(TrieNode::default());
                let n = (self.nodes.len() - 1) as u32;
                self.root[first as usize] = n;
                n
            }
            n => n,
        };
        for &b in rest {
            let existing = self.nodes[node as usize]
                .children
                .iter()
                .find(|(c, _)| *c == b)
                .map(|&(_, n)| n);
            node = match existing {
                Some(n) => n,
                None => {
                    self.nodes.push(TrieNode::default());
                    let n = (self.nodes.len() - 1) as u32;
                    self.nodes[node as usize].children.push((b, n));
                    n
                }
            };
        }
        // Texts are unique in the vocabulary; keep the first id if not.
        let slot = &mut self.nodes[node as usize].id;
        if slot.is_none() {
            *slot = Some(id);
        }
    }

    /// Calls `found` for every token whose text occurs anywhere in `text` (overlaps included).
    fn scan(&self, text: &[u8], mut found: impl FnMut(u32)) {
        if self.root.is_empty() {
            return;
        }
        for start in 0..text.len() {
            let mut node = self.root[text[start] as usize];
            let mut pos = start + 1;
            while node != u32::MAX {
                let n = &self.nodes[node as usize];
                if let Some(id) = n.id {
                    found(id);
                }
                let Some(&b) = text.get(pos) else { break };
                node = n
                    .children
                    .iter()
                    .find(|(c, _)| *c == b)
                    .map_or(u32::MAX, |&(_, next)| next);
                pos += 1;
            }
        }
    }
}

/// Texts of tokens that end generation (llama.cpp's list of end-of-turn / end-of-text
/// markers). Such tokens are also treated as control tokens even when the file says otherwise.
pub(crate) const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
];

/// Fill-in-the-middle padding / repository / file-separator markers; code models emit them
/// to end an infill, so they end generation too (when the file names no such token by key).
pub(crate) const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>"];
pub(crate) const FIM_REP_TEXTS: &[&str] =
    &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>"];
pub(crate) const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
