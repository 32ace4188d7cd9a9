//! An append-only n-gram index over a token sequence: where did this suffix occur before?

use std::collections::HashMap;

/// Occurrences of every `key_len`-gram of a growing sequence, by end position.
#[derive(Debug, Default, Clone)]
pub struct NgramIndex {
    key_len: usize,
    tokens: Vec<u32>,
    /// key → end positions (exclusive), ascending.
    ends: HashMap<Vec<u32>, Vec<usize>>,
}

/// Most candidates examined per lookup (the most recent ones).
const MAX_CANDIDATES: usize = 64;

/// A match: the continuation starts at `start` in the indexed sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// Length of the matched suffix.
    pub len: usize,
    /// Where the continuation starts.
    pub start: usize,
}

impl NgramIndex {
    /// An empty index keyed by `key_len`-grams (at least 1).
    pub fn new(key_len: usize) -> Self {
        Self {
            key_len: key_len.max(1),
            ..Self::default()
        }
    }

    /// The sequence indexed.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets the sequence.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.ends.clear();
    }

    /// Makes the indexed sequence `tokens`: appends what it adds to the sequence indexed, or
    /// indexes it anew where it does not continue that sequence.
    pub fn sync(&mut self, tokens: &[u32]) {
        let known = &self.tokens;
        if tokens.len() < known.len() || tokens[..known.len()] != *known {
            self.clear();
        }
        let from = self.tokens.len();
        self.extend(&tokens[from..]);
    }

    /// Appends tokens, indexing every new n-gram.
    pub fn extend(&mut self, more: &[u32]) {
        for &t in more {
            self.tokens.push(t);
            let end = self.tokens.len();
            if end >= self.key_len {
                let key = self.tokens[end - self.key_len..end].to_vec();
                self.ends.entry(key).or_default().push(end);
            }
        }
    }

    /// The longest match (at least `min_len`, at most `max_len` tokens) of the end of `query`
    /// that is followed by at least one token, most recent first on ties. `before` limits the
    /// continuation to positions `< before` (so a sequence does not match its own suffix).
    pub fn longest_match(
        &self,
        query: &[u32],
        min_len: usize,
        max_len: usize,
        before: usize,
    ) -> Option<Match> {
        self.matches(query, min_len, max_len, before)
            .into_iter()
            .next()
    }

    /// Every match of [`longest_match`](Self::longest_match)'s kind among the most recent
    /// occurrences of the key, longest first, most recent first among equals.
    pub fn matches(
        &self,
        query: &[u32],
        min_len: usize,
        max_len: usize,
        before: usize,
    ) -> Vec<Match> {
        if query.len() < self.key_len {
            return Vec::new();
        }
        let key = &query[query.len() - self.key_len..];
        let Some(ends) = self.ends.get(key) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for &end in ends
            .iter()
            .rev()
            .filter(|&&e| e < before)
            .take(MAX_CANDIDATES)
        {
            // Extend the match backwards from the key.
            let mut len = self.key_len;
            while len < max_len
                && len < query.len()
                && len < end
                && self.tokens[end - len - 1] == query[query.len() - len - 1]
            {
                len += 1;
            }
            if len >= min_len {
                found.push(Match { len, start: end });
            }
        }
        // Stable: the most recent first among equal lengths.
        found.sort_by_key(|m| std::cmp::Reverse(m.len));
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_then_most_recent_match() {
        let mut idx = NgramIndex::new(1);
        //                 0  1  2  3  4  5  6  7  8  9
        idx.extend(&[5, 1, 2, 9, 1, 2, 3, 7, 1, 2]);
        // Query ends with [1, 2]: occurrences end at 3 (followed by 9) and 6 (followed by 3);
        // the one ending at 10 is the query itself, excluded by `before`.
        let m = idx.longest_match(&[0, 1, 2], 1, 4, 10).unwrap();
        assert_eq!(m, Match { len: 2, start: 6 });
        // [2, 9, 1, 2] occurs whole at 2..6.
        let m = idx.longest_match(&[2, 9, 1, 2], 1, 4, 10).unwrap();
        assert_eq!(m, Match { len: 4, start: 6 });
        let m = idx.longest_match(&[7, 5, 1, 2], 1, 4, 10).unwrap();
        assert_eq!(m, Match { len: 3, start: 3 }, "longer beats more recent");
        assert_eq!(idx.longest_match(&[4, 4], 1, 4, 10), None);
        assert_eq!(
            idx.longest_match(&[1, 2], 3, 4, 10),
            None,
            "shorter than min_len"
        );
    }

    #[test]
    fn sync_appends_what_continues_and_reindexes_what_does_not() {
        let mut idx = NgramIndex::new(1);
        idx.sync(&[1, 2, 3]);
        idx.sync(&[1, 2, 3, 1, 2]);
        assert_eq!(idx.tokens(), &[1, 2, 3, 1, 2]);
        assert_eq!(
            idx.longest_match(&[1, 2], 1, 4, 5),
            Some(Match { len: 2, start: 2 })
        );
        // Another sequence: nothing of the old one is matched.
        idx.sync(&[7, 2, 9]);
        assert_eq!(idx.tokens(), &[7, 2, 9]);
        assert_eq!(
            idx.longest_match(&[1, 2], 1, 4, 3),
            Some(Match { len: 1, start: 2 })
        );
        idx.sync(&[7]);
        assert_eq!(idx.tokens(), &[7]);
    }
}
