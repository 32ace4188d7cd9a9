//! Byte-level BPE (`tokenizer.ggml.model` = `gpt2`): the GPT-2 byte <-> character mapping and
//! rank-ordered merges.
//!
//! Each pre-tokenizer fragment is turned into its bytes, each byte into one vocabulary symbol
//! (the token of its mapped character); then the adjacent pair with the lowest merge rank is
//! merged, leftmost first among equal ranks, until no listed merge applies. A heap of candidate
//! pairs over a linked list of symbols makes this O(n log n) per fragment.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::pretokenize::PreTokenizer;
use super::vocab::{FastMap, Vocab};

/// The character GPT-2's byte-level BPE uses for byte `b`: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes map in order to U+0100..U+0143.
pub(crate) fn byte_to_char(b: u8) -> char {
    let cp = match b {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => b as u32,
        0x00..=0x20 => 0x100 + b as u32,
        0x7F..=0xA0 => 0x100 + 33 + (b - 0x7F) as u32,
        0xAD => 0x100 + 67,
    };
    char::from_u32(cp).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The inverse of [`byte_to_char`]; `None` for characters outside the mapping.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    match cp {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(cp as u8),
        0x100..=0x120 => Some((cp - 0x100) as u8),
        0x121..=0x142 => Some((cp - 0x121 + 0x7F) as u8),
        0x143 => Some(0xAD),
        _ => None,
    }
}

/// The bytes a byte-level token text stands for (characters outside the mapping are kept as
/// their own UTF-8; llama.cpp prints a marker there instead).
pub(crate) fn decode_text(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// A byte-level BPE model.
pub(crate) struct Bpe {
    /// (left id, right id) -> (rank, merged id).
    merges: FastMap<(u32, u32), (u32, u32)>,
    /// The token of each byte's mapped character.
    byte_tokens: [Option<u32>; 256],
    pub pre: PreTokenizer,
    ignore_merges: bool,
}

impl Bpe {
    /// Builds the merge table from `tokenizer.ggml.merges` lines (`"left right"`, in rank order).
    /// Returns the model and the number of merges skipped because a side or the result is not
    /// in the vocabulary (such merges can never fire on vocabulary symbols).
    pub fn new(vocab: &Vocab, merge_lines: &[&str], pre: PreTokenizer) -> (Self, usize) {
        let mut merges = FastMap::with_capacity_and_hasher(merge_lines.len(), Default::default());
        let mut skipped = 0;
        let mut joined = String::new();
        for (rank, line) in merge_lines.iter().enumerate() {
            // The separator is the first space after the first character (a side may itself
            // start with a space in non-byte-level vocabularies).
            let first_len = line.chars().next().map_or(0, char::len_utf8);
            let Some(sep) = line[first_len..].find(' ').map(|i| i + first_len) else {
                skipped += 1;
                continue;
            };
            let (left, right) = (&line[..sep], &line[sep + 1..]);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            match (vocab.id(left), vocab.id(right), vocab.id(&joined)) {
                (Some(l), Some(r), Some(m)) => {
                    merges.entry((l, r)).or_insert((rank as u32, m));
                }
                _ => skipped += 1,
            }
        }
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab.id(byte_to_char(b as u8).encode_utf8(&mut [0u8; 4]));
        }
        let ignore_merges = pre.spec.ignore_merges;
        (
            Self {
                merges,
                byte_tokens,
                pre,
                ignore_merges,
            },
            skipped,
        )
    }

    /// Appends the tokens of raw text `text` (not yet pre-tokenized) to `out`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let mut work = Work::default();
        let mut mapped = String::new();
        for fragment in self.pre.split(text) {
            if self.ignore_merges {
                mapped.clear();
                mapped.extend(fragment.bytes().map(byte_to_char));
                if let Some(id) = vocab.id(&mapped) {
                    out.push(id);
                    continue;
                }
            }
            self.encode_fragment(fragment.as_bytes(), &mut work, out);
        }
    }

    fn encode_fragment(&self, bytes: &[u8], work: &mut Work, out: &mut Vec<u32>) {
        let syms = &mut work.syms;
        let heap = &mut work.heap;
        syms.clear();
        heap.clear();
        let n = bytes.len();
        for (i, &b) in bytes.iter().enumerate() {
            syms.push(Sym {
                id: self.byte_tokens[b as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
            });
        }
        for i in 1..n {
            self.push_pair(syms, heap, i - 1, i);
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (c.left, c.right);
            // Stale if either side was merged away or changed since the pair was queued.
            if syms[l].next != r || syms[l].id != Some(c.left_id) || syms[r].id != Some(c.right_id)
            {
                continue;
            }
            syms[l].id = Some(c.merged);
            let after = syms[r].next;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            syms[r].id = None;
            syms[r].next = NONE;
            syms[r].prev = NONE;
            if syms[l].prev != NONE {
                self.push_pair(syms, heap, syms[l].prev, l);
            }
            if after != NONE {
                self.push_pair(syms, heap, l, after);
            }
        }
        if n == 0 {
            return;
        }
        let mut i = 0;
        loop {
            // A byte whose mapped character is not a token is dropped, as in llama.cpp.
            if let Some(id) = syms[i].id {
                out.push(id);
            }
            if syms[i].next == NONE {
                break;
            }
            i = syms[i].next;
        }
    }

    fn push_pair(&self, syms: &[Sym], heap: &mut BinaryHeap<Candidate>, left: usize, right: usize) {
        let (Some(l), Some(r)) = (syms[left].id, syms[right].id) else {
            return;
        };
        if let Some(&(rank, merged)) = self.merges.get(&(l, r)) {
            heap.push(Candidate {
                rank,
                left,
                right,
                left_id: l,
                right_id: r,
                merged,
            });
        }
    }
}

const NONE: usize = usize::MAX;

/// A symbol of the fragment being merged: a token (or `None` for an unmapped byte or a symbol
/// merged into its left neighbour) in a doubly linked list.
struct Sym {
    id: Option<u32>,
    prev: usize,
    next: usize,
}

/// A queued merge of two adjacent symbols.
#[derive(PartialEq, Eq)]
struct Candidate {
    rank: u32,
    left: usize,
    right: usize,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

impl Ord for Candidate {
    /// The max-heap pops the lowest rank first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Buffers reused across the fragments of one `encode` call.
#[derive(Default)]
struct Work {
    syms: Vec<Sym>,
    heap: BinaryHeap<Candidate>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c));
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'\t'), 'ĉ');
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        assert_eq!(char_to_byte('\u{144}'), None);
    }
}
