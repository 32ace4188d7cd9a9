//! SentencePiece-style BPE (`tokenizer.ggml.model` = `llama`): pieces with scores, spaces
//! escaped as `▁`, byte-fallback `<0xXX>` tokens.
//!
//! The text is split into characters; then the adjacent pair whose concatenation is a piece
//! with the highest score is merged (leftmost first among equal scores), until no pair forms a
//! piece. Characters left without a piece become their UTF-8 bytes' `<0xXX>` tokens (or
//! `<unk>` when the vocabulary has no byte tokens).
//!
//! Only normal and user-defined tokens are pieces here, as in SentencePiece: control, byte and
//! unknown tokens are never produced by merging text (llama.cpp does not check the type, so
//! there a literal `<0x41>` or `<s>` in plain text could merge into those tokens).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashSet};
use std::hash::BuildHasherDefault;

use super::vocab::{FastHasher, TokenType, Vocab};

/// The escaped form of a space.
pub(crate) const SPACE: char = '\u{2581}';

pub(crate) struct Spm {
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
    /// Characters that occur in some piece of two or more characters. Any other character can
    /// never take part in a merge, so the text is cut there into independent chunks (exactly
    /// the same result, with small heaps on long inputs).
    joinable: HashSet<char, BuildHasherDefault<FastHasher>>,
}

fn is_piece(ty: TokenType) -> bool {
    matches!(ty, TokenType::Normal | TokenType::UserDefined)
}

impl Spm {
    pub fn new(vocab: &Vocab, unk: Option<u32>) -> Self {
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab.id(&format!("<0x{b:02X}>"));
        }
        let mut joinable = HashSet::default();
        for (text, &ty) in vocab.texts.iter().zip(&vocab.types) {
            if is_piece(ty) && text.chars().nth(1).is_some() {
                joinable.extend(text.chars());
            }
        }
        Self {
            byte_tokens,
            unk,
            joinable,
        }
    }

    fn piece(&self, vocab: &Vocab, text: &str) -> Option<u32> {
        vocab
            .id(text)
            .filter(|&id| vocab.ty(id).is_some_and(is_piece))
    }

    /// Appends the tokens of `text` (spaces already escaped, prefix already added) to `out`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let mut work = Work::default();
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if !self.joinable.contains(&c) {
                if start < i {
                    self.encode_chunk(vocab, &text[start..i], &mut work, out);
                }
                let end = i + c.len_utf8();
                self.emit(vocab, &text[i..end], out);
                start = end;
            }
        }
        if start < text.len() {
            self.encode_chunk(vocab, &text[start..], &mut work, out);
        }
    }

    fn encode_chunk(&self, vocab: &Vocab, chunk: &str, work: &mut Work, out: &mut Vec<u32>) {
        let syms = &mut work.syms;
        let heap = &mut work.heap;
        syms.clear();
        heap.clear();
        for (i, (offset, c)) in chunk.char_indices().enumerate() {
            syms.push(Sym {
                start: offset,
                len: c.len_utf8(),
                prev: if i == 0 { NONE } else { i - 1 },
                next: NONE,
            });
            if i > 0 {
                syms[i - 1].next = i;
            }
        }
        for i in 1..syms.len() {
            self.push_pair(vocab, chunk, syms, heap, i - 1, i);
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (c.left, c.right);
            // Stale if either side was merged away or grew since the pair was queued.
            if syms[l].next != r || syms[l].len == 0 || syms[l].len + syms[r].len != c.size {
                continue;
            }
            syms[l].len = c.size;
            let after = syms[r].next;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            syms[r].len = 0;
            syms[r].next = NONE;
            if syms[l].prev != NONE {
                self.push_pair(vocab, chunk, syms, heap, syms[l].prev, l);
            }
            if after != NONE {
                self.push_pair(vocab, chunk, syms, heap, l, after);
            }
        }
        let mut i = if syms.is_empty() { NONE } else { 0 };
        while i != NONE {
            let s = &syms[i];
            self.emit(vocab, &chunk[s.start..s.start + s.len], out);
            i = s.next;
        }
    }

    /// Emits one final symbol: its piece, or its bytes.
    fn emit(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        if let Some(id) = self.piece(vocab, text) {
            out.push(id);
            return;
        }
        for b in text.bytes() {
            if let Some(id) = self.byte_tokens[b as usize].or(self.unk) {
                out.push(id);
            }
        }
    }

    fn push_pair(
        &self,
        vocab: &Vocab,
        chunk: &str,
        syms: &[Sym],
        heap: &mut BinaryHeap<Candidate>,
        left: usize,
        right: usize,
    ) {
        let start = syms[left].start;
        let size = syms[left].len + syms[right].len;
        if let Some(id) = self.piece(vocab, &chunk[start..start + size]) {
            heap.push(Candidate {
                score: vocab.scores[id as usize],
                left,
                right,
                size,
            });
        }
    }
}

const NONE: usize = usize::MAX;

/// A symbol: a byte span of the chunk (`len` 0 once merged into its left neighbour).
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged piece, to detect stale entries.
    size: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl Ord for Candidate {
    /// The max-heap pops the highest score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Default)]
struct Work {
    syms: Vec<Sym>,
    heap: BinaryHeap<Candidate>,
}
