//! The attention KV cache: one pool of fixed-size blocks per backend instance, shared by its
//! sequences through block tables (paged attention), stored as f32, f16 or Q8_0 ([`KvType`]),
//! with a prefix cache of full blocks.
//!
//! A block holds [`BLOCK_TOKENS`] positions of every layer the pool serves, **head-major** inside
//! the block: all its positions of key/value head 0, then of head 1, … — so attending over one
//! head streams contiguous runs (a position-major layout puts every position's head in a
//! different 4 KiB page, where the hardware prefetchers stop). A sequence's [`SeqKv`] lists its
//! blocks in position order and its length.
//!
//! - **Sharing.** A block is referenced by every sequence whose table holds it. A fork shares its
//!   parent's blocks; a write to a shared block (or to one the prefix cache holds) first copies
//!   it (copy-on-write), so no sequence ever sees another's later tokens.
//! - **Prefix cache.** Full blocks are keyed by their whole token prefix (a chained 128-bit
//!   hash, and the block's own tokens compared exactly). A new sequence whose prompt starts
//!   with cached blocks takes them ([`KvPool::reuse_prefix`]) and evaluates only the rest.
//!   Cached blocks no sequence uses stay until the pool needs room; then the least recently
//!   used goes first.
//! - **Truncation** cuts a sequence's length and releases the blocks past it; positions past the
//!   length are overwritten before any result depends on them. Values are rounded to the storage type
//!   when stored, so a verify row and a single-token pass read the same bits.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use rayon::prelude::*;
use specula_kernels::attention::{Cached, CachedRows};
use specula_kernels::{f16_keys, q8_0, q8_keys};
use specula_plugin_api::{ErrorKind, KvUsage, PluginError};

use crate::blocks::attention::AttentionShape;

/// Positions per block: the granularity of sharing, copy-on-write and the prefix cache. (At 32,
/// attention over 8 sequences spent 12–15% longer than at 64 or 128: each block restarts the
/// kernels' prefetching.)
pub const BLOCK_TOKENS: usize = 64;

// A block's keys are whole groups of positions (f16 and Q8_0 keys in groups).
const _: () = assert!(
    BLOCK_TOKENS.is_multiple_of(f16_keys::GROUP_POSITIONS)
        && BLOCK_TOKENS.is_multiple_of(q8_keys::GROUP_POSITIONS)
);

/// How the cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// Exact f32 (4 bytes per value).
    F32,
    /// IEEE binary16, rounded to nearest-even (2 bytes per value: half the memory and half the
    /// attention's memory traffic; llama.cpp's default cache type, and this one's). The keys of
    /// a block's head are kept as value-major groups of 16 positions
    /// ([`specula_kernels::f16_keys`]), the values as rows.
    #[default]
    F16,
    /// ggml's Q8_0 per head row: blocks of 32 values as an f16 scale and 32 signed bytes (34
    /// bytes per 32 values, about half of f16; llama.cpp's `-ctk q8_0 -ctv q8_0`). Head sizes
    /// must be multiples of 32. The keys of a block's head are kept as interleaved groups of
    /// 16 positions ([`specula_kernels::q8_keys`]) and scored against queries quantised to
    /// Q8_0 (integer dot products, as ggml does); values are rows, read dequantised.
    Q8_0,
}

impl KvType {
    /// The name used in options (`f32`, `f16`, `q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The type named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        [KvType::F32, KvType::F16, KvType::Q8_0]
            .into_iter()
            .find(|t| t.name() == name)
    }

    /// Storage units (f32s, u16s or bytes) of one head row of `dim` values, or `None` where
    /// the type cannot store such rows (Q8_0 needs whole blocks of 32).
    pub fn row_units(self, dim: usize) -> Option<usize> {
        match self {
            KvType::F32 | KvType::F16 => Some(dim),
            KvType::Q8_0 => dim
                .is_multiple_of(q8_0::BLOCK_VALUES)
                .then(|| dim / q8_0::BLOCK_VALUES * q8_0::BLOCK_BYTES),
        }
    }

    /// Bytes of one storage unit.
    pub fn unit_bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
            KvType::Q8_0 => 1,
        }
    }

    /// Bytes of one head row of `dim` values (rounded up to whole Q8_0 blocks).
    pub fn row_bytes(self, dim: usize) -> usize {
        let dim = match self {
            KvType::Q8_0 => dim.next_multiple_of(q8_0::BLOCK_VALUES),
            _ => dim,
        };
        self.row_units(dim).unwrap_or(0) * self.unit_bytes()
    }
}

/// One layer's keys (or values) of every block, in the storage type.
#[derive(Debug)]
enum Store {
    F32(Vec<f32>),
    /// f16 rows (values).
    F16(Vec<u16>),
    /// f16 keys: each head of a block as value-major groups of 16 positions
    /// ([`specula_kernels::f16_keys`]), which attention scores a register of keys at a time.
    F16Keys(Vec<u16>),
    /// Q8_0 rows (values): blocks of 32, each head row `dim / 32` of them.
    Q8(Vec<u8>),
    /// Q8_0 keys: each head of a block as interleaved groups of 16 positions
    /// ([`specula_kernels::q8_keys`]), which attention scores with integer dot products.
    Q8Keys(Vec<u8>),
}

impl Store {
    /// `len` zero values of keys (`keys`) or values, or `None` when the allocation fails.
    /// (Lazily mapped pages: blocks never written occupy no memory.) f16 keys are kept in
    /// groups of 16 positions, Q8_0 keys in interleaved groups.
    fn zeroed(ty: KvType, len: usize, keys: bool) -> Option<Self> {
        use specula_kernels::aligned::try_zeroed_vec;
        Some(match ty {
            KvType::F32 => Store::F32(try_zeroed_vec(len)?),
            KvType::F16 if keys => Store::F16Keys(try_zeroed_vec(len)?),
            KvType::F16 => Store::F16(try_zeroed_vec(len)?),
            KvType::Q8_0 if keys => Store::Q8Keys(try_zeroed_vec(len)?),
            KvType::Q8_0 => Store::Q8(try_zeroed_vec(len)?),
        })
    }

    fn all(&self) -> Stored<'_> {
        match self {
            Store::F32(v) => Stored::Rows(Cached::F32(v)),
            Store::F16(v) => Stored::Rows(Cached::F16(v)),
            Store::F16Keys(v) => Stored::F16Keys(v),
            Store::Q8(v) => Stored::Rows(Cached::Q8_0(v)),
            Store::Q8Keys(v) => Stored::Q8Keys(v),
        }
    }

    /// Storage units held.
    fn len(&self) -> usize {
        match self {
            Store::F32(v) => v.len(),
            Store::F16(v) | Store::F16Keys(v) => v.len(),
            Store::Q8(v) | Store::Q8Keys(v) => v.len(),
        }
    }

    /// Copies block `from` onto block `to` (`block` units each).
    fn copy_block(&mut self, from: usize, to: usize, block: usize) {
        match self {
            Store::F32(v) => v.copy_within(from * block..(from + 1) * block, to * block),
            Store::F16(v) | Store::F16Keys(v) => {
                v.copy_within(from * block..(from + 1) * block, to * block)
            }
            Store::Q8(v) | Store::Q8Keys(v) => {
                v.copy_within(from * block..(from + 1) * block, to * block)
            }
        }
    }

    /// Copies the head row at `from` onto `to`, each `(first unit of its head's block, slot)`,
    /// of `units` storage units.
    fn copy_row(&mut self, from: (usize, usize), to: (usize, usize), units: usize) {
        let at = |(head, slot): (usize, usize)| head + slot * units;
        match self {
            Store::F32(v) => v.copy_within(at(from)..at(from) + units, at(to)),
            Store::F16(v) => v.copy_within(at(from)..at(from) + units, at(to)),
            Store::Q8(v) => v.copy_within(at(from)..at(from) + units, at(to)),
            Store::F16Keys(v) => f16_keys::copy_row(v, (BLOCK_TOKENS * units, units), from, to),
            Store::Q8Keys(v) => {
                q8_keys::copy_row(v, (BLOCK_TOKENS * units, row_dim(units)), from, to)
            }
        }
    }

    /// Writes each job's rows of `data` (each `heads × dim` values, the rows of positions
    /// `pos0 ..`) into the blocks its `table` lists (head-major blocks of `BLOCK_TOKENS`
    /// positions, a head row `units` storage units); the (block, head) regions of every job on
    /// the pool's threads when there are several rows in all.
    ///
    /// # Panics
    ///
    /// If two jobs write the same block (a block being written has one holder: see
    /// [`KvPool::reserve`]).
    fn write_rows(&mut self, jobs: &[RowsJob<'_>], (heads, dim, units): (usize, usize, usize)) {
        fn write<T: Send>(
            store: &mut [T],
            jobs: &[RowsJob<'_>],
            (heads, dim, units): (usize, usize, usize),
            convert: impl Fn(&[f32], &mut [T], usize) + Sync,
        ) {
            let width = heads * dim;
            let block = heads * BLOCK_TOKENS * units;
            // Every block written: (its id, the job, its index in the job's table).
            let mut wanted: Vec<(usize, usize, usize)> = Vec::new();
            let mut rows = 0;
            for (j, job) in jobs.iter().enumerate() {
                let n = job.data.len() / width;
                rows += n;
                let (first, last) = (
                    job.pos0 / BLOCK_TOKENS,
                    (job.pos0 + n).div_ceil(BLOCK_TOKENS),
                );
                wanted.extend((first..last).map(|b| (job.table[b] as usize, j, b)));
            }
            wanted.sort_unstable();
            assert!(
                wanted.windows(2).all(|w| w[0].0 < w[1].0),
                "kv cache: two writes into one block"
            );
            // Each block written, split into its heads: (job, block index in its table, head,
            // region).
            let mut regions: Vec<(usize, usize, usize, &mut [T])> = Vec::new();
            let mut rest: &mut [T] = store;
            let mut consumed = 0;
            for (id, j, b) in wanted {
                let (_, tail) = rest.split_at_mut(id * block - consumed);
                let (this, tail) = tail.split_at_mut(block);
                consumed = (id + 1) * block;
                rest = tail;
                for (h, head) in this.chunks_exact_mut(BLOCK_TOKENS * units).enumerate() {
                    regions.push((j, b, h, head));
                }
            }
            let fill = |(j, b, h, region): &mut (usize, usize, usize, &mut [T])| {
                let RowsJob { data, pos0, .. } = jobs[*j];
                let n = data.len() / width;
                let start = *b * BLOCK_TOKENS;
                for i in pos0.max(start)..(pos0 + n).min(start + BLOCK_TOKENS) {
                    let src = &data[(i - pos0) * width + *h * dim..][..dim];
                    convert(src, region, i - start);
                }
            };
            if rows > 1 && rayon::current_num_threads() > 1 {
                regions.par_iter_mut().for_each(fill);
            } else {
                regions.iter_mut().for_each(fill);
            }
        }
        let shape = (heads, dim, units);
        // A head's region of a block and a position's slot in it: the position's row.
        fn row<T>(region: &mut [T], slot: usize, units: usize) -> &mut [T] {
            &mut region[slot * units..][..units]
        }
        match self {
            Store::F32(store) => write(store, jobs, shape, |src, region, slot| {
                row(region, slot, units).copy_from_slice(src)
            }),
            Store::F16(store) => write(store, jobs, shape, |src, region, slot| {
                specula_kernels::f16::from_f32_slice(src, row(region, slot, units))
            }),
            Store::Q8(store) => write(store, jobs, shape, |src, region, slot| {
                q8_0::quantize_row(src, row(region, slot, units))
            }),
            Store::F16Keys(store) => write(store, jobs, shape, f16_keys::store),
            Store::Q8Keys(store) => write(store, jobs, shape, q8_keys::store),
        }
    }
}

/// One sequence's rows for [`Store::write_rows`]: `data` holds the rows of positions `pos0 ..`,
/// in the blocks `table` lists.
#[derive(Clone, Copy)]
struct RowsJob<'a> {
    table: &'a [u32],
    data: &'a [f32],
    pos0: usize,
}

/// The rows of one sequence that [`KvPool::store_rows`] stores: its key rows (each `heads ×
/// key_dim`) and value rows (each `heads × value_dim`) of positions `pos0 ..`.
#[derive(Debug, Clone, Copy)]
pub struct KvWrite<'a> {
    pub seq: &'a SeqKv,
    pub pos0: usize,
    pub keys: &'a [f32],
    pub values: &'a [f32],
}

/// A layer's cache as stored: rows attention reads as they are (f32, f16, Q8_0 blocks), f16
/// keys in value-major groups, or Q8_0 keys in interleaved groups it scores as integers.
#[derive(Debug, Clone, Copy)]
enum Stored<'a> {
    Rows(Cached<'a>),
    F16Keys(&'a [u16]),
    Q8Keys(&'a [u8]),
}

/// The cached keys (or values) of positions `0 .. count` of one layer of one sequence, head by
/// head and block by block: what attention reads.
#[derive(Debug, Clone, Copy)]
pub struct CachedHeads<'a> {
    data: Stored<'a>,
    /// Block ids in position order (for a contiguous cache, one block at 0).
    blocks: &'a [u32],
    /// Positions per block.
    block_tokens: usize,
    /// Storage units between the starts of consecutive block ids.
    block_stride: usize,
    /// Storage units between the starts of consecutive heads in a block.
    head_offset: usize,
    /// Storage units between consecutive positions of a head.
    row_stride: usize,
    /// Storage units per head and position.
    width: usize,
    /// Values per head and position.
    values: usize,
    count: usize,
}

/// The table of a contiguous cache: one block at 0.
const ONE_BLOCK: [u32; 1] = [0];

impl<'a> CachedHeads<'a> {
    /// Position-major rows (`count` rows of `heads · width` values, head `h` at `h · width`):
    /// the layout of a plain `[position][head][value]` array, as one block.
    pub fn position_major(data: Cached<'a>, width: usize, heads: usize) -> Self {
        let row = width * heads;
        let count = data.len() / row.max(1);
        Self {
            data: Stored::Rows(data),
            blocks: &ONE_BLOCK,
            block_tokens: count.max(1),
            block_stride: 0,
            head_offset: width,
            row_stride: row,
            width,
            values: width,
            count,
        }
    }

    /// Positions held.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Positions per block (the last block of `n` positions may hold fewer).
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Values per head and position.
    pub fn values(&self) -> usize {
        self.values
    }

    /// Whether [`head_block`](Self::head_block) dequantises into its scratch.
    pub fn needs_scratch(&self) -> bool {
        matches!(self.data, Stored::Q8Keys(_) | Stored::F16Keys(_))
    }

    /// Whether these are an f16 cache's keys in groups, scored through
    /// [`f16_key_block`](Self::f16_key_block).
    pub fn is_f16_keys(&self) -> bool {
        matches!(self.data, Stored::F16Keys(_))
    }

    /// Head `h` of block `b` as f16 keys in value-major groups
    /// ([`specula_kernels::f16_keys`]: every position of the block, written or not), for an
    /// f16 cache's keys; `None` for other caches.
    pub fn f16_key_block(&self, h: usize, b: usize) -> Option<&'a [u16]> {
        match self.data {
            Stored::F16Keys(halves) => Some(&halves[self.whole_block(h, b)]),
            _ => None,
        }
    }

    /// Whether these are a Q8_0 cache's keys, scored through
    /// [`q8_key_block`](Self::q8_key_block).
    pub fn is_q8_keys(&self) -> bool {
        matches!(self.data, Stored::Q8Keys(_))
    }

    /// Head `h` of block `b` as Q8_0 keys in interleaved groups ([`specula_kernels::q8_keys`]:
    /// every position of the block, written or not), for a Q8_0 cache's keys; `None` for
    /// other caches.
    pub fn q8_key_block(&self, h: usize, b: usize) -> Option<&'a [u8]> {
        match self.data {
            Stored::Q8Keys(bytes) => Some(&bytes[self.whole_block(h, b)]),
            _ => None,
        }
    }

    /// Head `h` of the `n` positions from block `b`'s first, as stored, where the kernels read
    /// them as stored (f32, f16, Q8_0 rows); `None` for keys in groups (f16, Q8_0). (A caller
    /// hands the next block to the kernels' prefetching: [`CachedRows::followed_by`].)
    pub fn stored_head_block(&self, h: usize, b: usize, n: usize) -> Option<CachedRows<'a>> {
        assert!(
            n <= self.block_tokens && b * self.block_tokens + n <= self.count,
            "kv cache: {n} positions of block {b} beyond the {} held",
            self.count
        );
        match self.data {
            Stored::Rows(data) => Some(data.rows(self.first(h, b), self.row_stride, self.width, n)),
            Stored::F16Keys(_) | Stored::Q8Keys(_) => None,
        }
    }

    /// Where head `h`'s first position of block `b` starts in the stored data.
    fn first(&self, h: usize, b: usize) -> usize {
        self.blocks[b] as usize * self.block_stride + h * self.head_offset
    }

    /// The storage units of head `h` in block `b`, every position of the block (written or
    /// not): what keys in groups are read as.
    fn whole_block(&self, h: usize, b: usize) -> std::ops::Range<usize> {
        assert!(
            b * self.block_tokens < self.count.max(1),
            "kv cache: block {b} beyond the positions held"
        );
        let first = self.first(h, b);
        first..first + self.block_tokens * self.width
    }

    /// Fetches into L2 what attention reads first of head `h`: its first `n` positions (at
    /// most a block's) as stored — rows, or the groups holding them. (Q8_0 keys in groups are
    /// fetched by their kernel only.)
    pub fn prefetch_first_block_l2(&self, h: usize, n: usize) {
        match self.data {
            Stored::Rows(_) => {
                if let Some(rows) = self.stored_head_block(h, 0, n) {
                    rows.prefetch_l2();
                }
            }
            Stored::F16Keys(halves) => {
                let groups = n.next_multiple_of(f16_keys::GROUP_POSITIONS);
                let first = self.first(h, 0);
                f16_keys::prefetch_l2(
                    &halves[first..first + f16_keys::head_units(self.values, groups)],
                );
            }
            Stored::Q8Keys(_) => {}
        }
    }

    /// Head `h` of the `n` positions from block `b`'s first (`n` at most the block's): the
    /// stored rows, or for keys in groups (f16, Q8_0) the rows widened into `scratch` (at least
    /// `n` rows of [`values`](Self::values) each; the same f32 values whatever else is read).
    pub fn head_block<'s>(
        &self,
        h: usize,
        b: usize,
        n: usize,
        scratch: &'s mut [f32],
    ) -> CachedRows<'s>
    where
        'a: 's,
    {
        if let Some(rows) = self.stored_head_block(h, b, n) {
            return rows;
        }
        let rows = &mut scratch[..n * self.values];
        if let Some(keys) = self.f16_key_block(h, b) {
            for (slot, row) in rows.chunks_exact_mut(self.values.max(1)).enumerate() {
                f16_keys::dequantize(keys, slot, row);
            }
        } else {
            let keys = self
                .q8_key_block(h, b)
                .expect("rows not read as stored are keys in groups");
            for (slot, row) in rows.chunks_exact_mut(self.values.max(1)).enumerate() {
                q8_keys::dequantize(keys, slot, row);
            }
        }
        Cached::F32(rows).rows(0, self.values, self.values, n)
    }
}

/// One sequence's part of a [`KvPool`]: its blocks in position order and its length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqKv {
    blocks: Vec<u32>,
    len: usize,
    /// The prefix-cache keys of its first full blocks (as far as they were computed).
    keys: Vec<BlockKey>,
}

impl SeqKv {
    /// Positions in the sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Blocks the sequence holds.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The sequence's block table: the pool block holding positions `64 b .. 64 b + 63` at
    /// index `b` (a store elsewhere that mirrors the pool's blocks, such as a GPU's, reads
    /// the sequence through it).
    pub fn block_ids(&self) -> &[u32] {
        &self.blocks
    }

    /// The prefix-cache key of full block `b` (the chained hash of every token up to its
    /// end), once the pool has computed it ([`KvPool::cache_prefix`], [`KvPool::reuse_prefix`]).
    pub fn key(&self, b: usize) -> Option<BlockKey> {
        self.keys.get(b).copied()
    }
}

/// A full block's prefix-cache key: the chained hash of every token up to the block's end
/// (two independently seeded 64-bit hashes).
pub type BlockKey = (u64, u64);

/// What the prefix cache knows of a full block.
#[derive(Debug, Clone)]
struct Cached128 {
    /// The chained hash of every token up to the block's end.
    key: BlockKey,
    /// The block's own tokens (compared exactly on a hit).
    tokens: Vec<u32>,
}

/// The chained key of the block holding `tokens` after the prefix keyed `parent`: two
/// independently seeded 64-bit hashes.
fn chain_key(parent: BlockKey, tokens: &[u32]) -> BlockKey {
    let half = |seed: u64, parent: u64| {
        let mut h = DefaultHasher::new();
        (seed, parent, tokens).hash(&mut h);
        h.finish()
    };
    (
        half(0x5bd1_e995_0000_0001, parent.0),
        half(0x9e37_79b9_7f4a_7c15, parent.1),
    )
}

/// Values per head row of a Q8_0 row of `units` bytes.
fn row_dim(units: usize) -> usize {
    units / q8_0::BLOCK_BYTES * q8_0::BLOCK_VALUES
}

/// The key of the empty prefix.
const ROOT_KEY: BlockKey = (0, 0);

/// Why a pool could not give a block.
fn pool_full(n_blocks: usize) -> PluginError {
    PluginError::new(
        ErrorKind::ContextFull,
        format!(
            "the KV cache is full: all {n_blocks} blocks of {BLOCK_TOKENS} positions are in use by live sequences; free or truncate sequences, or open the backend with a larger kv_tokens"
        ),
    )
}

/// Keys and values of some layers for a pool of blocks, shared by sequences.
#[derive(Debug)]
pub struct KvPool {
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    ty: KvType,
    n_blocks: usize,
    keys: Vec<Store>,
    values: Vec<Store>,
    /// Per block: the sequences whose tables hold it.
    refs: Vec<u32>,
    /// Per block: its prefix-cache entry, while it has one.
    cached: Vec<Option<Cached128>>,
    /// Per block: when a sequence last took or released it (for LRU eviction).
    last_used: Vec<u64>,
    clock: u64,
    /// Blocks no sequence holds and the prefix cache does not keep.
    free: Vec<u32>,
    /// The prefix cache: chained key → block. `None` when prefix caching is off.
    prefix: Option<HashMap<BlockKey, u32>>,
    /// Copy-on-write copies made since [`KvPool::take_copies`] (block, its copy), for stores
    /// that mirror the pool's blocks; `None` unless [`KvPool::log_copies`] asked for them.
    copies: Option<Vec<(u32, u32)>>,
}

impl KvPool {
    /// A pool of `n_blocks` blocks for `n_layers` layers of an attention of `shape`, stored as
    /// `ty`, with a prefix cache when `prefix_cache`; an `OutOfMemory` error, saying how much
    /// it needed, when the memory cannot be had. (Zeroed memory is mapped lazily by the OS.)
    pub fn new(
        n_layers: usize,
        n_blocks: usize,
        shape: &AttentionShape,
        ty: KvType,
        prefix_cache: bool,
    ) -> Result<Self, PluginError> {
        let too_big = || {
            PluginError::new(
                ErrorKind::OutOfMemory,
                format!(
                    "cannot allocate a KV pool of {} positions ({n_blocks} blocks of {BLOCK_TOKENS}) for {n_layers} layers; lower kv_tokens or max_sequences",
                    n_blocks.saturating_mul(BLOCK_TOKENS)
                ),
            )
        };
        if u32::try_from(n_blocks).is_err() {
            return Err(too_big());
        }
        for (what, dim) in [("key", shape.head_dim), ("value", shape.value_dim)] {
            if ty.row_units(dim).is_none() {
                return Err(PluginError::invalid_input(format!(
                    "kv_type '{}' stores heads of a multiple of 32 values, but this model's {what} heads have {dim}; use kv_type 'f16'",
                    ty.name()
                )));
            }
        }
        let per_block = |dim: usize| {
            n_blocks
                .checked_mul(shape.n_head_kv * BLOCK_TOKENS * ty.row_units(dim).unwrap_or(0))
                .ok_or_else(too_big)
        };
        let stores = |dim: usize, keys: bool| -> Result<Vec<Store>, PluginError> {
            let len = per_block(dim)?;
            (0..n_layers)
                .map(|_| Store::zeroed(ty, len, keys).ok_or_else(too_big))
                .collect()
        };
        Ok(Self {
            heads: shape.n_head_kv,
            key_dim: shape.head_dim,
            value_dim: shape.value_dim,
            ty,
            n_blocks,
            keys: stores(shape.head_dim, true)?,
            values: stores(shape.value_dim, false)?,
            refs: vec![0; n_blocks],
            cached: vec![None; n_blocks],
            last_used: vec![0; n_blocks],
            clock: 0,
            free: (0..n_blocks as u32).rev().collect(),
            prefix: prefix_cache.then(HashMap::new),
            copies: None,
        })
    }

    /// Blocks the pool holds for `tokens` positions.
    pub fn blocks_for(tokens: usize) -> usize {
        tokens.div_ceil(BLOCK_TOKENS)
    }

    /// Layers the pool holds.
    pub fn n_layers(&self) -> usize {
        self.keys.len()
    }

    /// Positions the pool holds over all sequences.
    pub fn capacity(&self) -> usize {
        self.n_blocks * BLOCK_TOKENS
    }

    /// How keys and values are stored.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// Blocks live sequences hold, blocks only the prefix cache keeps, and all blocks.
    pub fn usage(&self) -> KvUsage {
        let used = self.refs.iter().filter(|&&r| r > 0).count();
        let cached = self
            .refs
            .iter()
            .zip(&self.cached)
            .filter(|(&r, c)| r == 0 && c.is_some())
            .count();
        KvUsage {
            block_tokens: BLOCK_TOKENS as u32,
            blocks_total: self.n_blocks as u64,
            blocks_used: used as u64,
            blocks_cached: cached as u64,
        }
    }

    /// Blocks no live sequence holds (free, or kept only by the prefix cache).
    pub fn unused_blocks(&self) -> usize {
        self.refs.iter().filter(|&&r| r == 0).count()
    }

    /// Bytes of cache memory.
    pub fn n_bytes(&self) -> usize {
        let row =
            self.heads * (self.ty.row_bytes(self.key_dim) + self.ty.row_bytes(self.value_dim));
        self.capacity() * row * self.keys.len()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A block no sequence holds: a free one, else the least recently used cached one (which
    /// leaves the prefix cache).
    fn take_block(&mut self) -> Result<u32, PluginError> {
        if let Some(id) = self.free.pop() {
            return Ok(id);
        }
        let victim = (0..self.n_blocks)
            .filter(|&b| self.refs[b] == 0 && self.cached[b].is_some())
            .min_by_key(|&b| self.last_used[b])
            .ok_or_else(|| pool_full(self.n_blocks))?;
        self.uncache(victim);
        Ok(victim as u32)
    }

    /// Drops block `b`'s prefix-cache entry.
    fn uncache(&mut self, b: usize) {
        if let Some(entry) = self.cached[b].take() {
            if let Some(map) = &mut self.prefix {
                if map.get(&entry.key) == Some(&(b as u32)) {
                    map.remove(&entry.key);
                }
            }
        }
    }

    /// A sequence no longer holds block `id`.
    fn release_block(&mut self, id: u32) {
        let b = id as usize;
        self.refs[b] -= 1;
        if self.refs[b] == 0 {
            self.last_used[b] = self.tick();
            if self.cached[b].is_none() {
                self.free.push(id);
            }
        }
    }

    /// Makes `seq` hold blocks for positions `0 .. end`, of which `from ..` are about to be
    /// written: a block among those that another sequence shares is first copied
    /// (copy-on-write); one only the prefix cache keeps besides `seq` leaves the cache and is
    /// written in place (a verify pass rolled back into a block it had filled). Fails, changing
    /// no block of `seq`'s prefix, when the pool has no block left.
    pub fn reserve(&mut self, seq: &mut SeqKv, from: usize, end: usize) -> Result<(), PluginError> {
        let needed = Self::blocks_for(end);
        let first_written = from / BLOCK_TOKENS;
        for b in first_written..seq.blocks.len().min(needed) {
            let id = seq.blocks[b] as usize;
            if self.refs[id] == 1 && self.cached[id].is_some() {
                self.uncache(id);
            }
            if self.refs[id] > 1 {
                let copy = self.take_block()?;
                for store in self.keys.iter_mut().chain(self.values.iter_mut()) {
                    let per_block = store.len() / self.n_blocks;
                    store.copy_block(id, copy as usize, per_block);
                }
                self.refs[copy as usize] = 1;
                self.release_block(id as u32);
                if let Some(copies) = &mut self.copies {
                    copies.push((id as u32, copy));
                }
                seq.blocks[b] = copy;
            }
        }
        while seq.blocks.len() < needed {
            let id = self.take_block()?;
            self.refs[id as usize] = 1;
            seq.blocks.push(id);
        }
        Ok(())
    }

    /// Stores the key rows (each `heads × key_dim`) and value rows (each `heads × value_dim`)
    /// of positions `pos0 ..` of `seq` in `layer`, rounded to the storage type. The blocks must
    /// have been [`reserve`](Self::reserve)d.
    pub fn store(&mut self, layer: usize, seq: &SeqKv, pos0: usize, keys: &[f32], values: &[f32]) {
        self.store_rows(
            layer,
            &[KvWrite {
                seq,
                pos0,
                keys,
                values,
            }],
        );
    }

    /// [`store`](Self::store) for the rows of several sequences at once (a pass over many
    /// sequences): their blocks are written on the pool's threads together. Each sequence's
    /// rows are rounded as they would be alone.
    pub fn store_rows(&mut self, layer: usize, writes: &[KvWrite<'_>]) {
        let heads = self.heads;
        let (key_dim, value_dim) = (self.key_dim, self.value_dim);
        let mut jobs = Vec::with_capacity(writes.len());
        for (store, dim, keys) in [
            (&mut self.keys[layer], key_dim, true),
            (&mut self.values[layer], value_dim, false),
        ] {
            let width = heads * dim;
            jobs.clear();
            for w in writes {
                let data = if keys { w.keys } else { w.values };
                assert!(
                    width > 0 && data.len().is_multiple_of(width),
                    "kv cache: rows of {width} values expected, got {}",
                    data.len()
                );
                let end = w.pos0 + data.len() / width;
                assert!(
                    Self::blocks_for(end) <= w.seq.blocks.len(),
                    "kv cache: position {} beyond the reserved blocks",
                    end - 1
                );
                jobs.push(RowsJob {
                    table: &w.seq.blocks,
                    data,
                    pos0: w.pos0,
                });
            }
            let units = self
                .ty
                .row_units(dim)
                .expect("checked when the pool was made");
            store.write_rows(&jobs, (heads, dim, units));
        }
    }

    /// Sets `seq`'s length after positions up to `len` have been stored.
    pub fn set_len(&mut self, seq: &mut SeqKv, len: usize) {
        assert!(
            Self::blocks_for(len) <= seq.blocks.len(),
            "kv cache: length {len} beyond the reserved blocks"
        );
        seq.len = len;
    }

    /// Cuts `seq` to `len` positions (at most its length) and releases the blocks past them.
    pub fn truncate(&mut self, seq: &mut SeqKv, len: usize) {
        seq.len = seq.len.min(len);
        seq.keys.truncate(seq.len / BLOCK_TOKENS);
        let keep = Self::blocks_for(seq.len);
        // Last first: a cached chain's later blocks go before its first ones when evicted.
        for id in seq.blocks.split_off(keep).into_iter().rev() {
            self.release_block(id);
        }
    }

    /// Moves the rows of positions `base + path[k]` of `seq` to positions `base + k` in every
    /// layer (each `path[k] >= k`, increasing: a tree's kept path), then cuts `seq` after them.
    /// The positions moved must be in blocks only `seq` holds (as after storing them).
    pub fn keep_rows(&mut self, seq: &mut SeqKv, base: usize, path: &[u32]) {
        let heads = self.heads;
        for (stores, dim) in [
            (&mut self.keys, self.key_dim),
            (&mut self.values, self.value_dim),
        ] {
            let units = self
                .ty
                .row_units(dim)
                .expect("checked when the pool was made");
            // A position's head row: where its head's block starts, and its slot there.
            let at = |pos: usize, h: usize| {
                let block = seq.blocks[pos / BLOCK_TOKENS] as usize;
                (
                    (block * heads + h) * BLOCK_TOKENS * units,
                    pos % BLOCK_TOKENS,
                )
            };
            for store in stores.iter_mut() {
                for (k, &row) in path.iter().enumerate() {
                    let (from, to) = (base + row as usize, base + k);
                    debug_assert!(from >= to, "kv cache: a path's rows only move down");
                    if from != to {
                        for h in 0..heads {
                            store.copy_row(at(from, h), at(to, h), units);
                        }
                    }
                }
            }
        }
        self.truncate(seq, base + path.len());
    }

    /// A new sequence holding what `seq` holds, sharing its blocks.
    pub fn fork(&mut self, seq: &SeqKv) -> SeqKv {
        for &id in &seq.blocks {
            self.refs[id as usize] += 1;
        }
        seq.clone()
    }

    /// Releases every block of `seq`, which becomes empty.
    pub fn release(&mut self, seq: &mut SeqKv) {
        seq.len = 0;
        seq.keys.clear();
        for id in std::mem::take(&mut seq.blocks).into_iter().rev() {
            self.release_block(id);
        }
    }

    /// Keys of positions `0 .. n` of `seq` in `layer`.
    pub fn keys<'a>(&'a self, layer: usize, seq: &'a SeqKv, n: usize) -> CachedHeads<'a> {
        self.heads_of(&self.keys[layer], seq, self.key_dim, n)
    }

    /// Values of positions `0 .. n` of `seq` in `layer`.
    pub fn values<'a>(&'a self, layer: usize, seq: &'a SeqKv, n: usize) -> CachedHeads<'a> {
        self.heads_of(&self.values[layer], seq, self.value_dim, n)
    }

    fn heads_of<'a>(
        &self,
        store: &'a Store,
        seq: &'a SeqKv,
        dim: usize,
        n: usize,
    ) -> CachedHeads<'a> {
        assert!(
            Self::blocks_for(n) <= seq.blocks.len(),
            "kv cache: {n} positions beyond the reserved blocks"
        );
        let units = self
            .ty
            .row_units(dim)
            .expect("checked when the pool was made");
        CachedHeads {
            data: store.all(),
            blocks: &seq.blocks,
            block_tokens: BLOCK_TOKENS,
            block_stride: self.heads * BLOCK_TOKENS * units,
            head_offset: BLOCK_TOKENS * units,
            row_stride: units,
            width: units,
            values: dim,
            count: n,
        }
    }

    /// The copy-on-write copies [`reserve`](Self::reserve) made since the last call, oldest
    /// first: `(block, copy)`. A store that mirrors the pool's blocks (a GPU's cache of other
    /// layers) makes the same copies.
    pub fn take_copies(&mut self) -> Vec<(u32, u32)> {
        self.copies.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// From now on, logs the copy-on-write copies [`take_copies`](Self::take_copies) returns.
    pub fn log_copies(&mut self) {
        self.copies.get_or_insert_with(Vec::new);
    }

    /// Puts `copies` (taken, not yet mirrored) back before any logged since.
    pub fn return_copies(&mut self, mut copies: Vec<(u32, u32)>) {
        if let Some(logged) = &mut self.copies {
            copies.append(logged);
            *logged = copies;
        }
    }

    /// Blocks in the pool.
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// Whether the pool keeps a prefix cache.
    pub fn caches_prefixes(&self) -> bool {
        self.prefix.is_some()
    }

    /// Puts `seq`'s full blocks into the prefix cache, keyed by `tokens` (the sequence's tokens,
    /// at least its length). Blocks already cached stay as they are; a block whose prefix is
    /// cached in another block is not cached twice.
    pub fn cache_prefix(&mut self, seq: &mut SeqKv, tokens: &[u32]) {
        let Some(map) = &mut self.prefix else {
            return;
        };
        let full = seq.len.min(tokens.len()) / BLOCK_TOKENS;
        let mut key = seq.keys.last().copied().unwrap_or(ROOT_KEY);
        for b in seq.keys.len()..full {
            let own = &tokens[b * BLOCK_TOKENS..(b + 1) * BLOCK_TOKENS];
            key = chain_key(key, own);
            seq.keys.push(key);
            let id = seq.blocks[b];
            if self.cached[id as usize].is_some() || map.contains_key(&key) {
                continue;
            }
            map.insert(key, id);
            self.cached[id as usize] = Some(Cached128 {
                key,
                tokens: own.to_vec(),
            });
        }
    }

    /// Gives the empty `seq` the longest run of cached blocks that starts `tokens`, at most
    /// `limit` positions of them; returns the positions it now holds.
    pub fn reuse_prefix(&mut self, seq: &mut SeqKv, tokens: &[u32], limit: usize) -> usize {
        // Blocks reserved past an empty sequence's length (an evaluation that failed) go first.
        self.release(seq);
        let Some(map) = &self.prefix else {
            return 0;
        };
        let mut found = Vec::new();
        let mut keys = Vec::new();
        let mut key = ROOT_KEY;
        for own in tokens[..limit.min(tokens.len())].chunks_exact(BLOCK_TOKENS) {
            key = chain_key(key, own);
            match map.get(&key) {
                Some(&id)
                    if self.cached[id as usize]
                        .as_ref()
                        .is_some_and(|c| c.key == key && c.tokens == own) =>
                {
                    found.push(id);
                    keys.push(key);
                }
                _ => break,
            }
        }
        let now = self.tick();
        for &id in &found {
            self.refs[id as usize] += 1;
            self.last_used[id as usize] = now;
        }
        seq.len = found.len() * BLOCK_TOKENS;
        seq.blocks = found;
        seq.keys = keys;
        seq.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Head `h` of every position held, as f32 (read back through the attention kernel: one
    /// probability of 1 per row, block by block).
    fn head(heads: CachedHeads<'_>, h: usize) -> Vec<f32> {
        let mut out = Vec::new();
        let bt = heads.block_tokens();
        let mut scratch = vec![0.0; bt * heads.values()];
        for b in 0..heads.count().div_ceil(bt) {
            let n = bt.min(heads.count() - b * bt);
            let rows = heads.head_block(h, b, n, &mut scratch);
            for j in 0..n {
                let probs: Vec<f32> = (0..n).map(|i| f32::from(u8::from(i == j))).collect();
                let mut row = vec![0.0; rows.len()];
                let p = specula_kernels::Rows::single(&probs);
                specula_kernels::attention::weighted_sums(p, rows, &[n], &mut row);
                out.extend(row);
            }
        }
        out
    }

    const SHAPE: AttentionShape = AttentionShape {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 1,
        value_dim: 2,
    };

    /// Rows of `n` positions: key head h of position p is `p + 0.5 h`, values `(p, -p - h)`.
    fn rows(pos0: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for p in pos0..pos0 + n {
            for h in 0..2 {
                k.push(p as f32 + 0.5 * h as f32);
                v.extend([p as f32, -(p as f32) - h as f32]);
            }
        }
        (k, v)
    }

    fn fill(pool: &mut KvPool, seq: &mut SeqKv, pos0: usize, n: usize) {
        pool.reserve(seq, pos0, pos0 + n).unwrap();
        let (k, v) = rows(pos0, n);
        for layer in 0..pool.n_layers() {
            pool.store(layer, seq, pos0, &k, &v);
        }
        pool.set_len(seq, pos0 + n);
    }

    fn want_keys(n: usize, h: usize) -> Vec<f32> {
        (0..n).map(|p| p as f32 + 0.5 * h as f32).collect()
    }

    #[test]
    fn stores_rows_across_blocks_head_by_head_and_truncates() {
        for ty in [KvType::F32, KvType::F16] {
            let mut pool = KvPool::new(2, 8, &SHAPE, ty, false).unwrap();
            let mut seq = SeqKv::default();
            // One row, then a run crossing two block boundaries.
            fill(&mut pool, &mut seq, 0, 1);
            fill(&mut pool, &mut seq, 1, 2 * BLOCK_TOKENS + 3);
            let n = seq.len();
            assert_eq!(seq.blocks(), 3);
            for layer in 0..2 {
                for h in 0..2 {
                    assert_eq!(head(pool.keys(layer, &seq, n), h), want_keys(n, h));
                }
                let values = head(pool.values(layer, &seq, n), 1);
                assert_eq!(&values[..4], [0.0, -1.0, 1.0, -2.0]);
            }
            pool.truncate(&mut seq, BLOCK_TOKENS);
            assert_eq!(
                (seq.len(), seq.blocks(), pool.unused_blocks()),
                (BLOCK_TOKENS, 1, 7)
            );
            assert_eq!(pool.capacity(), 8 * BLOCK_TOKENS);
            assert_eq!(pool.n_bytes(), ty.unit_bytes() * 8 * BLOCK_TOKENS * 6 * 2);
        }
    }

    /// Rows of several sequences stored in one call (their blocks on two threads) are the rows
    /// each stored alone; one call writing one block twice is refused.
    #[test]
    fn rows_of_many_sequences_stored_together_equal_each_stored_alone() {
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for ty in [KvType::F32, KvType::F16] {
            let mut together = KvPool::new(2, 16, &SHAPE, ty, false).unwrap();
            let mut alone = KvPool::new(2, 16, &SHAPE, ty, false).unwrap();
            // (positions already held, rows of this pass): a run crossing a block boundary,
            // single rows, a first row.
            let work = [(BLOCK_TOKENS - 2, 5), (7, 1), (0, 1), (2 * BLOCK_TOKENS, 1)];
            let mut seqs = [
                vec![SeqKv::default(); work.len()],
                vec![SeqKv::default(); work.len()],
            ];
            let [first, second] = &mut seqs;
            for (pool, held) in [(&mut together, &mut *first), (&mut alone, &mut *second)] {
                for (seq, &(pos0, _)) in held.iter_mut().zip(&work) {
                    fill(pool, seq, 0, pos0.max(1));
                }
            }
            // Sequence `s`'s rows: `rows` scaled by `s + 2`, so each sequence's differ.
            let data: Vec<(Vec<f32>, Vec<f32>)> = work
                .iter()
                .enumerate()
                .map(|(s, &(pos0, n))| {
                    let (k, v) = rows(pos0, n);
                    let scale = |x: Vec<f32>| x.iter().map(|x| x * (s + 2) as f32).collect();
                    (scale(k), scale(v))
                })
                .collect();
            for (pool, held) in [(&mut together, &mut *first), (&mut alone, &mut *second)] {
                for (seq, &(pos0, n)) in held.iter_mut().zip(&work) {
                    pool.reserve(seq, pos0, pos0 + n).unwrap();
                }
            }
            for layer in 0..2 {
                let writes: Vec<KvWrite<'_>> = seqs[0]
                    .iter()
                    .zip(&work)
                    .zip(&data)
                    .map(|((seq, &(pos0, _)), (keys, values))| KvWrite {
                        seq,
                        pos0,
                        keys,
                        values,
                    })
                    .collect();
                threads.install(|| together.store_rows(layer, &writes));
                for ((seq, &(pos0, _)), (k, v)) in seqs[1].iter().zip(&work).zip(&data) {
                    alone.store(layer, seq, pos0, k, v);
                }
            }
            for (i, &(pos0, n)) in work.iter().enumerate() {
                for pool_seqs in &mut seqs {
                    pool_seqs[i].len = pos0 + n;
                }
                for layer in 0..2 {
                    for h in 0..2 {
                        let (a, b) = (&seqs[0][i], &seqs[1][i]);
                        assert_eq!(
                            head(together.keys(layer, a, pos0 + n), h),
                            head(alone.keys(layer, b, pos0 + n), h),
                            "{ty:?} sequence {i} layer {layer} head {h}"
                        );
                        assert_eq!(
                            head(together.values(layer, a, pos0 + n), h),
                            head(alone.values(layer, b, pos0 + n), h)
                        );
                    }
                }
                let stored = head(together.keys(0, &seqs[0][i], pos0 + n), 1);
                assert_eq!(stored[pos0], (pos0 as f32 + 0.5) * (i + 2) as f32);
            }
            let (k, v) = &data[1];
            let twice = [(&seqs[0][1], 7), (&seqs[0][1], 7)].map(|(seq, pos0)| KvWrite {
                seq,
                pos0,
                keys: k,
                values: v,
            });
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                together.store_rows(0, &twice)
            }));
            assert!(refused.is_err(), "two writes into one block");
        }
    }

    #[test]
    fn a_fork_shares_blocks_until_either_writes_them() {
        let mut pool = KvPool::new(1, 8, &SHAPE, KvType::F32, false).unwrap();
        let mut parent = SeqKv::default();
        fill(&mut pool, &mut parent, 0, BLOCK_TOKENS + 5);
        let mut child = pool.fork(&parent);
        assert_eq!(pool.unused_blocks(), 6, "the fork copies nothing");
        // The child rolls back into the shared second block and writes there: it gets a copy.
        pool.truncate(&mut child, BLOCK_TOKENS + 2);
        pool.reserve(&mut child, BLOCK_TOKENS + 2, BLOCK_TOKENS + 3)
            .unwrap();
        pool.store(0, &child, BLOCK_TOKENS + 2, &[100.0, 100.0], &[0.0; 4]);
        pool.set_len(&mut child, BLOCK_TOKENS + 3);
        assert_ne!(parent.blocks[1], child.blocks[1]);
        assert_eq!(parent.blocks[0], child.blocks[0]);
        let n = parent.len();
        assert_eq!(head(pool.keys(0, &parent, n), 0), want_keys(n, 0));
        let mut want = want_keys(BLOCK_TOKENS + 3, 0);
        want[BLOCK_TOKENS + 2] = 100.0;
        assert_eq!(head(pool.keys(0, &child, BLOCK_TOKENS + 3), 0), want);
        pool.release(&mut parent);
        pool.release(&mut child);
        assert_eq!(pool.unused_blocks(), 8);
    }

    #[test]
    fn cached_prefixes_are_reused_exactly_and_evicted_least_recently_used_first() {
        let mut pool = KvPool::new(1, 4, &SHAPE, KvType::F32, true).unwrap();
        let tokens: Vec<u32> = (0..3 * BLOCK_TOKENS as u32).collect();
        let mut first = SeqKv::default();
        fill(&mut pool, &mut first, 0, 2 * BLOCK_TOKENS + 4);
        pool.cache_prefix(&mut first, &tokens);
        // A prompt that starts the same: both full blocks (not the partial third).
        let mut second = SeqKv::default();
        assert_eq!(
            pool.reuse_prefix(&mut second, &tokens, tokens.len()),
            2 * BLOCK_TOKENS
        );
        assert_eq!(second.blocks[..], first.blocks[..2]);
        let n = second.len();
        assert_eq!(head(pool.keys(0, &second, n), 1), want_keys(n, 1));
        // At most `limit` positions; a prompt differing in the second block gets the first.
        let mut third = SeqKv::default();
        assert_eq!(
            pool.reuse_prefix(&mut third, &tokens, 2 * BLOCK_TOKENS - 1),
            BLOCK_TOKENS
        );
        let mut other = tokens.clone();
        other[BLOCK_TOKENS + 3] = 9999;
        let mut fourth = SeqKv::default();
        assert_eq!(
            pool.reuse_prefix(&mut fourth, &other, other.len()),
            BLOCK_TOKENS
        );
        // Writing into a cached block copies it: the cache keeps the original.
        pool.truncate(&mut second, BLOCK_TOKENS + 1);
        pool.release(&mut third);
        pool.release(&mut fourth);
        fill(&mut pool, &mut second, BLOCK_TOKENS + 1, 1);
        assert_ne!(second.blocks[1], first.blocks[1]);
        // Every sequence gone: the cached blocks stay, and serve a new sequence.
        for s in [&mut first, &mut second] {
            pool.release(s);
        }
        let mut again = SeqKv::default();
        assert_eq!(
            pool.reuse_prefix(&mut again, &tokens, tokens.len()),
            2 * BLOCK_TOKENS
        );
        pool.release(&mut again);
        // A pool that needs room evicts cached blocks no sequence holds.
        let mut big = SeqKv::default();
        fill(&mut pool, &mut big, 0, 4 * BLOCK_TOKENS);
        let mut none = SeqKv::default();
        assert_eq!(pool.reuse_prefix(&mut none, &tokens, tokens.len()), 0);
        let err = pool.reserve(&mut big, 0, 5 * BLOCK_TOKENS).unwrap_err();
        assert_eq!(err.kind, ErrorKind::ContextFull);
        assert!(err.message.contains("kv_tokens"), "{err}");
    }

    /// A verify pass rolled back into a block it had filled (and the cache had taken): the
    /// block leaves the cache and is written in place, no copy of every layer.
    #[test]
    fn a_cached_block_only_its_sequence_holds_is_written_in_place() {
        let mut pool = KvPool::new(2, 4, &SHAPE, KvType::F32, true).unwrap();
        let tokens: Vec<u32> = (0..2 * BLOCK_TOKENS as u32).collect();
        let mut seq = SeqKv::default();
        fill(&mut pool, &mut seq, 0, BLOCK_TOKENS + 1);
        pool.cache_prefix(&mut seq, &tokens);
        let block = seq.blocks[0];
        pool.truncate(&mut seq, BLOCK_TOKENS - 2);
        fill(&mut pool, &mut seq, BLOCK_TOKENS - 2, 1);
        assert_eq!(seq.blocks[0], block, "written in place");
        assert_eq!(pool.unused_blocks(), 3);
        let mut other = SeqKv::default();
        assert_eq!(pool.reuse_prefix(&mut other, &tokens, tokens.len()), 0);
    }

    #[test]
    fn f16_storage_rounds_to_nearest_even() {
        let shape = AttentionShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 1,
            value_dim: 1,
        };
        let mut pool = KvPool::new(1, 1, &shape, KvType::F16, false).unwrap();
        let mut seq = SeqKv::default();
        pool.reserve(&mut seq, 0, 1).unwrap();
        // 1 + 2^-11 lies halfway between two f16 values: it rounds to the even one, 1.0.
        pool.store(0, &seq, 0, &[1.0 + 2f32.powi(-11)], &[0.1]);
        pool.set_len(&mut seq, 1);
        assert_eq!(head(pool.keys(0, &seq, 1), 0), [1.0]);
        let tenth = specula_kernels::f16::to_f32(0x2e66);
        assert_eq!(head(pool.values(0, &seq, 1), 0), [tenth]);
        assert_eq!(KvType::from_name("f16"), Some(KvType::F16));
        assert_eq!(KvType::from_name("q8_0"), Some(KvType::Q8_0));
        assert_eq!(KvType::from_name("q4_0"), None);
    }

    /// A Q8_0 cache stores each head row as ggml's Q8_0 blocks (the bytes of
    /// `q8_0::quantize_row`; keys in interleaved groups) and reads back their dequantised values, across blocks, forks
    /// and copy-on-write copies; heads that are not whole blocks of 32 are refused by name.
    #[test]
    fn q8_0_storage_holds_each_head_row_as_q8_0_blocks() {
        let shape = AttentionShape {
            n_head: 2,
            n_head_kv: 2,
            head_dim: 64,
            value_dim: 32,
        };
        let mut pool = KvPool::new(1, 4, &shape, KvType::Q8_0, false).unwrap();
        assert_eq!(
            pool.n_bytes(),
            4 * BLOCK_TOKENS * 2 * (2 * 34 + 34),
            "34 bytes per 32 values"
        );
        let n = BLOCK_TOKENS + 9;
        let value = |p: usize, h: usize, i: usize| ((p * 7 + h * 3 + i) % 23) as f32 * 0.37 - 4.0;
        let rows = |dim: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|p| (0..2).flat_map(move |h| (0..dim).map(move |i| value(p, h, i))))
                .collect()
        };
        let (keys, values) = (rows(64), rows(32));
        let mut seq = SeqKv::default();
        pool.reserve(&mut seq, 0, n).unwrap();
        pool.store(0, &seq, 0, &keys[..64 * 2 * 5], &values[..32 * 2 * 5]);
        pool.store(0, &seq, 5, &keys[64 * 2 * 5..], &values[32 * 2 * 5..]);
        pool.set_len(&mut seq, n);
        let expect = |data: &[f32], dim: usize, h: usize| -> Vec<f32> {
            let mut out = Vec::new();
            for p in 0..n {
                let src = &data[(p * 2 + h) * dim..][..dim];
                let mut bytes = vec![0; dim / 32 * 34];
                specula_kernels::q8_0::quantize_row(src, &mut bytes);
                let mut back = vec![0.0; dim];
                specula_kernels::q8_0::dequantize_row(&bytes, &mut back);
                out.extend(back);
            }
            out
        };
        for h in 0..2 {
            let got = head(pool.keys(0, &seq, n), h);
            assert_eq!(got, expect(&keys, 64, h), "keys of head {h}");
            let want = &keys[h * 64..][..64];
            assert!(got[..64]
                .iter()
                .zip(want)
                .all(|(a, b)| (a - b).abs() < 0.02));
            assert_eq!(head(pool.values(0, &seq, n), h), expect(&values, 32, h));
        }
        // A fork writing into the shared partial block gets a copy; the parent keeps its rows.
        let mut child = pool.fork(&seq);
        pool.truncate(&mut child, n - 1);
        pool.reserve(&mut child, n - 1, n).unwrap();
        pool.store(0, &child, n - 1, &[9.0; 128], &[9.0; 64]);
        pool.set_len(&mut child, n);
        assert_eq!(head(pool.keys(0, &seq, n), 1), expect(&keys, 64, 1));
        let nine = head(pool.keys(0, &child, n), 1)[(n - 1) * 64];
        assert!((nine - 9.0).abs() < 0.01, "{nine}");
        // A kept tree path moves its rows down, within a block and across blocks' groups.
        let path = [1u32, 4, 20, 70];
        let base = BLOCK_TOKENS - 8;
        let before: Vec<Vec<f32>> = [pool.keys(0, &seq, n), pool.values(0, &seq, n)]
            .into_iter()
            .map(|heads| head(heads, 1))
            .collect();
        pool.release(&mut child);
        let mut longer = pool.fork(&seq);
        pool.release(&mut seq);
        pool.reserve(&mut longer, n, base + 71).unwrap();
        let (more_k, more_v) = (
            vec![0.5; 128 * (base + 71 - n)],
            vec![0.25; 64 * (base + 71 - n)],
        );
        pool.store(0, &longer, n, &more_k, &more_v);
        pool.set_len(&mut longer, base + 71);
        let full: Vec<Vec<f32>> = [
            pool.keys(0, &longer, base + 71),
            pool.values(0, &longer, base + 71),
        ]
        .into_iter()
        .map(|heads| head(heads, 1))
        .collect();
        pool.keep_rows(&mut longer, base, &path);
        let kept = base + path.len();
        for (which, (dim, heads)) in [
            (64, pool.keys(0, &longer, kept)),
            (32, pool.values(0, &longer, kept)),
        ]
        .into_iter()
        .enumerate()
        {
            let got = head(heads, 1);
            assert_eq!(
                got[..base * dim],
                before[which][..base * dim],
                "{which}: prefix kept"
            );
            for (k, &row) in path.iter().enumerate() {
                let from = (base + row as usize) * dim;
                assert_eq!(
                    got[(base + k) * dim..][..dim],
                    full[which][from..from + dim],
                    "{which}: path row {k}"
                );
            }
        }

        let odd = AttentionShape {
            head_dim: 48,
            ..shape
        };
        let err = KvPool::new(1, 4, &odd, KvType::Q8_0, false).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert!(
            err.message.contains("kv_type 'q8_0'") && err.message.contains("48"),
            "{}",
            err.message
        );
    }
}
