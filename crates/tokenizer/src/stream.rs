//! Streaming detokenisation: token ids in, complete UTF-8 text out.

use super::Tokenizer;

/// Turns token ids, one at a time, into text that is always whole UTF-8.
///
/// A token's bytes may end inside a multi-byte character (byte-fallback and byte-level
/// tokens); those bytes are held back until the character completes. Bytes that can never
/// become valid (a stray continuation byte, a sequence cut short by a new start byte, an
/// encoded surrogate, ...) are emitted as U+FFFD at once, so nothing is held for more than the
/// three bytes of an unfinished character. Control tokens contribute no text.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
    /// Whether the SentencePiece leading-space rule still applies (see [`Tokenizer::decode`]).
    at_start: bool,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder for tokens that continue text already shown (e.g. generated after a prompt):
    /// every piece is emitted as is, leading spaces included.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
            at_start: false,
        }
    }

    /// A decoder for a sequence from its start: like [`Tokenizer::decode`], it drops the space
    /// a SentencePiece tokenizer added in front of the first piece.
    pub fn from_start(tokenizer: &'a Tokenizer) -> Self {
        Self {
            at_start: true,
            ..Self::new(tokenizer)
        }
    }

    /// Adds token `id`; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.tokenizer.piece_bytes(id);
        if !piece.is_empty() {
            let strip = self.at_start && self.tokenizer.strips_leading_space(id);
            self.at_start = false;
            self.pending
                .extend_from_slice(if strip { &piece[1..] } else { piece });
        }
        self.drain(false)
    }

    /// Ends the stream: returns what is left, an unfinished character as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    fn drain(&mut self, finished: bool) -> String {
        drain_utf8(&mut self.pending, finished)
    }
}

/// Removes every decidable byte from the front of `pending` and returns it as text: valid
/// UTF-8 as is, each invalid sequence as one U+FFFD; an unfinished character at the end stays
/// in `pending` unless `finished`.
fn drain_utf8(pending: &mut Vec<u8>, finished: bool) -> String {
    let mut out = String::new();
    let mut pos = 0;
    while pos < pending.len() {
        match std::str::from_utf8(&pending[pos..]) {
            Ok(text) => {
                out.push_str(text);
                pos = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                if let Ok(text) = std::str::from_utf8(&pending[pos..pos + valid]) {
                    out.push_str(text);
                }
                pos += valid;
                match e.error_len() {
                    // Invalid whatever follows.
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        pos += bad;
                    }
                    // A character's start with bytes still to come.
                    None if finished => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        pos = pending.len();
                    }
                    None => break,
                }
            }
        }
    }
    pending.drain(..pos);
    out
}

#[cfg(test)]
mod tests {
    use super::drain_utf8;

    fn feed(chunks: &[&[u8]]) -> Vec<String> {
        let mut pending = Vec::new();
        let mut out = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            pending.extend_from_slice(c);
            out.push(drain_utf8(&mut pending, i + 1 == chunks.len()));
        }
        assert!(pending.is_empty());
        out
    }

    #[test]
    fn holds_back_only_unfinished_characters() {
        // Held back, then completed.
        assert_eq!(feed(&[b"\xF0\x9F", b"\x98\x80", b""]), ["", "😀", ""]);
        // A lone continuation byte is replaced at once.
        assert_eq!(feed(&[b"\x80a", b""]), ["\u{FFFD}a", ""]);
        // A sequence broken by a new start byte.
        assert_eq!(
            feed(&[b"\xE4\xB8", b"\xE4\xB8\xAD", b""]),
            ["", "\u{FFFD}中", ""]
        );
        // An encoded surrogate can never be valid.
        assert_eq!(feed(&[b"\xED\xA0", b""]), ["\u{FFFD}\u{FFFD}", ""]);
        // Unfinished at the end.
        assert_eq!(feed(&[b"a\xE4"]), ["a\u{FFFD}"]);
    }
}
