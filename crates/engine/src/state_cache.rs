//! The prefix cache's recurrent states: a hybrid model's Gated DeltaNet state at block
//! boundaries, keyed like the attention blocks of the KV pool's prefix cache.
//!
//! The attention half of a prefix is shared through the KV pool's cached blocks; a recurrent
//! layer has no per-position cache, only its state after the last token. So a sequence that
//! shares a prefix must also start from the state at the prefix's end: the executor captures
//! the state whenever a pass crosses a block boundary ([`crate::recurrent::StatePlane`]), and
//! this cache keeps those states under the key of the block that ends there. A new sequence
//! whose prompt starts with cached blocks takes the longest run of them that ends at a cached
//! state. States are whole planes (every GDN layer, tens of MiB for a real model), so the
//! cache is bounded by bytes and evicts the least recently used.
//!
//! A model with an MTP head also needs the head's cache for the reused positions (a drafter
//! builds it behind the trunk, from the trunk's hidden rows). Its entries are not kept;
//! the trunk's hidden rows of the prefix are ([`HiddenRows`]), and the head is run over them
//! when the prefix is reused — one layer instead of the whole trunk.

use std::collections::HashMap;
use std::sync::Arc;

use crate::kv_cache::{BlockKey, BLOCK_TOKENS};
use crate::recurrent::StatePlane;

/// A sequence's trunk hidden rows (after the final norm: what the MTP head reads), position
/// by position, in blocks of [`BLOCK_TOKENS`] rows that the boundary states of the prefix
/// cache share (a block is copied only when a sequence rewrites a shared one).
#[derive(Debug, Clone)]
pub struct HiddenRows {
    width: usize,
    blocks: Vec<Arc<Vec<f32>>>,
    len: usize,
}

impl HiddenRows {
    /// No rows yet, each to be `width` values.
    pub fn new(width: usize) -> Self {
        Self {
            width,
            blocks: Vec::new(),
            len: 0,
        }
    }

    /// The rows of the first `blocks.len()` full blocks.
    pub fn from_blocks(width: usize, blocks: Vec<Arc<Vec<f32>>>) -> Self {
        let len = blocks.len() * BLOCK_TOKENS;
        Self { width, blocks, len }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps positions `0 .. len` (at most the ones held).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        self.blocks.truncate(self.len.div_ceil(BLOCK_TOKENS));
    }

    /// Writes `rows` as positions `pos0 ..`, after cutting what follows `pos0`. Returns false
    /// (and writes nothing) when `pos0` is past the positions held: the rows before it are
    /// not known.
    pub fn write(&mut self, pos0: usize, rows: &[f32]) -> bool {
        if pos0 > self.len {
            return false;
        }
        self.truncate(pos0);
        for row in rows.chunks_exact(self.width) {
            let (b, at) = (self.len / BLOCK_TOKENS, self.len % BLOCK_TOKENS);
            if b == self.blocks.len() {
                self.blocks
                    .push(Arc::new(Vec::with_capacity(BLOCK_TOKENS * self.width)));
            }
            let block = Arc::make_mut(&mut self.blocks[b]);
            block.truncate(at * self.width);
            block.extend_from_slice(row);
            self.len += 1;
        }
        true
    }

    /// The first `n` blocks, which must be full.
    pub fn full_blocks(&self, n: usize) -> Vec<Arc<Vec<f32>>> {
        assert!(
            n * BLOCK_TOKENS <= self.len,
            "hidden rows: {n} full blocks asked for"
        );
        self.blocks[..n].to_vec()
    }
}

/// What the cache keeps at one block boundary.
pub struct BoundaryState {
    /// The recurrent state there.
    pub plane: StatePlane,
    /// The trunk's hidden rows of every position before it (empty without an MTP head).
    pub hidden: Vec<Arc<Vec<f32>>>,
}

/// A block of hidden rows, by identity: the entries along one sequence's prefix share them.
fn block_id(block: &Arc<Vec<f32>>) -> usize {
    Arc::as_ptr(block) as usize
}

fn block_bytes(block: &Arc<Vec<f32>>) -> u64 {
    4 * block.len() as u64
}

struct Entry {
    state: BoundaryState,
    last_used: u64,
}

/// States at block boundaries, least recently used evicted first, at most `budget_bytes`
/// (planes, and each block of hidden rows once however many entries share it).
pub struct StateCache {
    budget_bytes: u64,
    used_bytes: u64,
    entries: HashMap<BlockKey, Entry>,
    /// Per block of hidden rows held: how many entries hold it.
    hidden_refs: HashMap<usize, u32>,
    clock: u64,
}

impl StateCache {
    /// An empty cache holding at most `budget_bytes` of states.
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            used_bytes: 0,
            entries: HashMap::new(),
            hidden_refs: HashMap::new(),
            clock: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// States held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of the states held.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Keeps `state` (whose plane is complete) as the state at the end of the block keyed
    /// `key`, evicting the least recently used states as the budget needs. Returns a plane
    /// the caller may reuse for its next capture: `state`'s own when it is not kept (the key
    /// already has a state, or it is larger than the budget), else an evicted one (if any).
    pub fn insert(&mut self, key: BlockKey, state: BoundaryState) -> Option<StatePlane> {
        let whole = state.plane.n_bytes() + state.hidden.iter().map(block_bytes).sum::<u64>();
        if state.plane.state_len().is_none() || whole > self.budget_bytes {
            return Some(state.plane);
        }
        let now = self.tick();
        if let Some(entry) = self.entries.get_mut(&key) {
            entry.last_used = now;
            return Some(state.plane);
        }
        let mut spare = None;
        while self.used_bytes + self.added_bytes(&state) > self.budget_bytes {
            let oldest = *self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k)
                .expect("the budget is exceeded only by held states");
            let evicted = self.entries.remove(&oldest).expect("present");
            self.used_bytes -= evicted.state.plane.n_bytes();
            for block in &evicted.state.hidden {
                let refs = self.hidden_refs.get_mut(&block_id(block)).expect("counted");
                *refs -= 1;
                if *refs == 0 {
                    self.hidden_refs.remove(&block_id(block));
                    self.used_bytes -= block_bytes(block);
                }
            }
            spare = Some(evicted.state.plane);
        }
        self.used_bytes += self.added_bytes(&state);
        for block in &state.hidden {
            *self.hidden_refs.entry(block_id(block)).or_insert(0) += 1;
        }
        self.entries.insert(
            key,
            Entry {
                state,
                last_used: now,
            },
        );
        spare
    }

    /// Bytes `state` would add: its plane, and its blocks of hidden rows no entry holds yet.
    fn added_bytes(&self, state: &BoundaryState) -> u64 {
        let new_rows: u64 = state
            .hidden
            .iter()
            .filter(|b| !self.hidden_refs.contains_key(&block_id(b)))
            .map(block_bytes)
            .sum();
        state.plane.n_bytes() + new_rows
    }

    /// The state at the end of the block keyed `key` if it is held and is the state at
    /// sequence length `len` (marked as just used).
    pub fn get(&mut self, key: BlockKey, len: usize) -> Option<&BoundaryState> {
        let now = self.tick();
        let entry = self.entries.get_mut(&key)?;
        if entry.state.plane.state_len() != Some(len) {
            return None;
        }
        entry.last_used = now;
        Some(&entry.state)
    }

    /// Whether the state at the end of the block keyed `key`, at length `len`, is held.
    pub fn contains(&self, key: BlockKey, len: usize) -> bool {
        self.entries
            .get(&key)
            .is_some_and(|e| e.state.plane.state_len() == Some(len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recurrent::{SnapshotRing, StateLayout};

    const LAYOUT: StateLayout = StateLayout {
        n_layers: 2,
        conv_len: 3,
        n_heads: 2,
        head_len: 4,
    };

    /// A complete plane holding the state at `len` (a ring's live state, copied).
    fn at(len: usize) -> BoundaryState {
        let (mut ring, _) = SnapshotRing::allocate(LAYOUT, 1, None).unwrap();
        let mut plane = StatePlane::new(LAYOUT).unwrap();
        for layer in 0..LAYOUT.n_layers {
            ring.save_layer(layer, 0, &mut plane, len);
        }
        BoundaryState {
            plane,
            hidden: Vec::new(),
        }
    }

    #[test]
    fn states_are_kept_within_the_budget_least_recently_used_out_first() {
        let bytes = LAYOUT.plane_bytes();
        let mut cache = StateCache::new(2 * bytes);
        let key = |i: u64| (i, i);
        assert!(cache.insert(key(1), at(64)).is_none());
        assert!(cache.insert(key(2), at(128)).is_none());
        assert!(
            cache.get(key(1), 64).is_some(),
            "key 1 is now the most recent"
        );
        assert!(
            cache.get(key(1), 128).is_none(),
            "a state is found at its own length only"
        );
        let spare = cache.insert(key(3), at(192));
        assert!(spare.is_some(), "the evicted plane comes back for reuse");
        assert!(!cache.contains(key(2), 128), "the least recently used went");
        assert!(cache.contains(key(1), 64) && cache.contains(key(3), 192));
        assert_eq!((cache.len(), cache.used_bytes()), (2, 2 * bytes));

        // A key already held keeps its state; an incomplete plane is not kept.
        let back = cache.insert(key(1), at(64)).unwrap();
        assert_eq!(back.state_len(), Some(64));
        let mut partial = StatePlane::new(LAYOUT).unwrap();
        let (mut ring, _) = SnapshotRing::allocate(LAYOUT, 1, None).unwrap();
        ring.save_layer(0, 0, &mut partial, 256);
        assert_eq!(partial.state_len(), None);
        let partial = BoundaryState {
            plane: partial,
            hidden: Vec::new(),
        };
        assert!(cache.insert(key(4), partial).is_some());
        assert!(!cache.contains(key(4), 256));

        // Hidden rows count towards the budget, each block once however many entries hold it.
        let mut rows = HiddenRows::new(2);
        assert!(rows.write(0, &vec![1.0; 2 * 2 * BLOCK_TOKENS]));
        let block = 4 * 2 * BLOCK_TOKENS as u64;
        let mut with_rows = at(64);
        with_rows.hidden = rows.full_blocks(1);
        let mut tight = StateCache::new(bytes);
        assert!(tight.insert(key(1), with_rows).is_some(), "over the budget");
        assert!(tight.is_empty());
        let mut shared = StateCache::new(2 * bytes + 2 * block);
        let mut first = at(64);
        first.hidden = rows.full_blocks(1);
        let mut second = at(128);
        second.hidden = rows.full_blocks(2);
        assert!(shared.insert(key(1), first).is_none());
        assert!(shared.insert(key(2), second).is_none());
        assert_eq!(
            shared.used_bytes(),
            2 * bytes + 2 * block,
            "block 0 counted once"
        );
        assert!(shared.insert(key(3), at(192)).is_some(), "one eviction");
        assert!(!shared.contains(key(1), 64));
        assert_eq!(
            shared.used_bytes(),
            2 * bytes + 2 * block,
            "block 0 still held by key 2"
        );
    }

    #[test]
    fn hidden_rows_are_cut_rewritten_and_shared_copy_on_write() {
        let row = |v: f32| [v, -v];
        let mut rows = HiddenRows::new(2);
        for p in 0..BLOCK_TOKENS + 3 {
            assert!(rows.write(p, &row(p as f32)));
        }
        assert_eq!(rows.len(), BLOCK_TOKENS + 3);
        let kept = rows.full_blocks(1);
        // Rewriting inside the shared first block leaves the kept copy as it was.
        assert!(rows.write(5, &[row(100.0), row(101.0)].concat()));
        assert_eq!(rows.len(), 7);
        assert_eq!(kept[0][5 * 2..6 * 2], row(5.0));
        assert_eq!(kept[0].len(), BLOCK_TOKENS * 2);
        assert!(!rows.write(9, &row(0.0)), "a gap is refused");
        rows.truncate(3);
        assert_eq!(rows.len(), 3);
        let restored = HiddenRows::from_blocks(2, kept);
        assert_eq!(restored.len(), BLOCK_TOKENS);
    }
}
