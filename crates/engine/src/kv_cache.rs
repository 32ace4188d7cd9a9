//! The attention KV cache: keys and values per layer, sized to the context when the backend
//! opens, stored as f32 or f16 ([`KvType`]).
//!
//! Each layer keeps its keys (and values) **head-major**: all positions of key/value head 0,
//! then of head 1, … — so attending over one head streams one contiguous block (a
//! position-major layout puts every position's head in a different 4 KiB page, where the
//! hardware prefetchers stop, and attention waits on memory latency row by row).
//!
//! Positions `0 .. len` are the sequence. Truncation only moves `len` (O(1)); positions past
//! it are overwritten by the next evaluation before anything reads them. Values are rounded to
//! the storage type when stored, so a verify row and a single-token pass read the same bits.

use rayon::prelude::*;
use specula_kernels::attention::{Cached, CachedRows};

use crate::blocks::attention::AttentionShape;

/// How the cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// Exact f32 (4 bytes per value): the default, the same numbers on every backend.
    #[default]
    F32,
    /// IEEE binary16, rounded to nearest-even (2 bytes per value: half the memory and half the
    /// attention's memory traffic at long contexts; llama.cpp's default cache type).
    F16,
}

impl KvType {
    /// The name used in options (`f32`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    /// The type named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        [KvType::F32, KvType::F16]
            .into_iter()
            .find(|t| t.name() == name)
    }

    fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// One layer's rows in the cache's storage type.
#[derive(Debug)]
enum Rows {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl Rows {
    fn zeroed(ty: KvType, len: usize) -> Self {
        match ty {
            KvType::F32 => Rows::F32(vec![0.0; len]),
            KvType::F16 => Rows::F16(vec![0; len]),
        }
    }

    /// Writes the `n` rows of `data` (each `heads` heads of `dim` values) at positions
    /// `pos0 ..` of a head-major store of `n_ctx` positions per head; heads on the pool's
    /// threads when there are several rows.
    fn write_rows(&mut self, data: &[f32], dim: usize, n_ctx: usize, pos0: usize) {
        fn write<T: Send>(
            store: &mut [T],
            data: &[f32],
            dim: usize,
            n_ctx: usize,
            pos0: usize,
            convert: impl Fn(f32) -> T + Sync,
        ) {
            let width = store.len() / n_ctx;
            let n = data.len() / width;
            let head = |(h, region): (usize, &mut [T])| {
                for (i, row) in data.chunks_exact(width).enumerate() {
                    let src = &row[h * dim..(h + 1) * dim];
                    for (dst, v) in region[(pos0 + i) * dim..][..dim].iter_mut().zip(src) {
                        *dst = convert(*v);
                    }
                }
            };
            if n > 1 && rayon::current_num_threads() > 1 {
                store.par_chunks_mut(n_ctx * dim).enumerate().for_each(head);
            } else {
                store.chunks_mut(n_ctx * dim).enumerate().for_each(head);
            }
        }
        match self {
            Rows::F32(store) => write(store, data, dim, n_ctx, pos0, |v| v),
            Rows::F16(store) => write(
                store,
                data,
                dim,
                n_ctx,
                pos0,
                specula_kernels::f16::from_f32,
            ),
        }
    }

    fn all(&self) -> Cached<'_> {
        match self {
            Rows::F32(rows) => Cached::F32(rows),
            Rows::F16(rows) => Cached::F16(rows),
        }
    }
}

/// The cached keys (or values) of positions `0 .. count` of one layer, head by head.
#[derive(Debug, Clone, Copy)]
pub struct CachedHeads<'a> {
    data: Cached<'a>,
    /// Values between the starts of consecutive heads.
    head_offset: usize,
    /// Values between consecutive positions of a head.
    row_stride: usize,
    /// Values per head and position.
    width: usize,
    count: usize,
}

impl<'a> CachedHeads<'a> {
    /// Position-major rows (`count` rows of `heads · width` values, head `h` at `h · width`):
    /// the layout of a plain `[position][head][value]` array.
    pub fn position_major(data: Cached<'a>, width: usize, heads: usize) -> Self {
        let row = width * heads;
        Self {
            data,
            head_offset: width,
            row_stride: row,
            width,
            count: data.len() / row.max(1),
        }
    }

    /// Positions held.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Head `h` of positions `0 .. n` (`n <= count`).
    pub fn head(&self, h: usize, n: usize) -> CachedRows<'a> {
        assert!(n <= self.count, "kv cache: {n} positions of {}", self.count);
        self.data
            .rows(h * self.head_offset, self.row_stride, self.width, n)
    }
}

/// Keys and values of every layer for up to `n_ctx` positions.
#[derive(Debug)]
pub struct KvCache {
    n_ctx: usize,
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    ty: KvType,
    keys: Vec<Rows>,
    values: Vec<Rows>,
    len: usize,
}

impl KvCache {
    /// A cache for `n_layers` layers of `n_ctx` positions of an attention of `shape` (its
    /// key/value heads and their sizes), stored as `ty`. (Zeroed memory is mapped lazily by
    /// the OS.)
    pub fn new(n_layers: usize, n_ctx: usize, shape: &AttentionShape, ty: KvType) -> Self {
        Self {
            n_ctx,
            heads: shape.n_head_kv,
            key_dim: shape.head_dim,
            value_dim: shape.value_dim,
            ty,
            keys: (0..n_layers)
                .map(|_| Rows::zeroed(ty, n_ctx * shape.k_width()))
                .collect(),
            values: (0..n_layers)
                .map(|_| Rows::zeroed(ty, n_ctx * shape.v_width()))
                .collect(),
            len: 0,
        }
    }

    /// Attention layers the cache holds.
    pub fn n_layers(&self) -> usize {
        self.keys.len()
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.n_ctx
    }

    /// How keys and values are stored.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// Positions currently in the sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the sequence length after rows `len .. new_len` have been stored, or cuts it back.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.n_ctx,
            "kv cache: length {len} beyond capacity {}",
            self.n_ctx
        );
        self.len = len;
    }

    /// Stores the key rows (each `heads × key_dim`) and value rows (each `heads × value_dim`)
    /// of positions `pos0 ..` in `layer`, rounded to the storage type.
    pub fn store(&mut self, layer: usize, pos0: usize, keys: &[f32], values: &[f32]) {
        let (heads, n_ctx) = (self.heads, self.n_ctx);
        for (rows, data, dim) in [
            (&mut self.keys[layer], keys, self.key_dim),
            (&mut self.values[layer], values, self.value_dim),
        ] {
            let width = heads * dim;
            assert!(
                width > 0 && data.len().is_multiple_of(width),
                "kv cache: rows of {width} values expected, got {}",
                data.len()
            );
            let end = pos0 + data.len() / width;
            assert!(
                end <= n_ctx,
                "kv cache: position {} beyond {n_ctx}",
                end - 1
            );
            rows.write_rows(data, dim, n_ctx, pos0);
        }
    }

    /// Keys of positions `0 .. n` in `layer`.
    pub fn keys(&self, layer: usize, n: usize) -> CachedHeads<'_> {
        self.heads_of(&self.keys[layer], self.key_dim, n)
    }

    /// Values of positions `0 .. n` in `layer`.
    pub fn values(&self, layer: usize, n: usize) -> CachedHeads<'_> {
        self.heads_of(&self.values[layer], self.value_dim, n)
    }

    fn heads_of<'a>(&self, rows: &'a Rows, dim: usize, n: usize) -> CachedHeads<'a> {
        assert!(
            n <= self.n_ctx,
            "kv cache: {n} positions beyond {}",
            self.n_ctx
        );
        CachedHeads {
            data: rows.all(),
            head_offset: self.n_ctx * dim,
            row_stride: dim,
            width: dim,
            count: n,
        }
    }

    /// Makes positions `0 .. len` of every layer hold `other`'s, and the length `len`: a
    /// forked sequence starts with its parent's cache.
    ///
    /// # Panics
    ///
    /// If the caches differ in shape, or `len` is beyond `other`'s length.
    pub fn copy_prefix_from(&mut self, other: &KvCache, len: usize) {
        assert!(
            (
                self.n_ctx,
                self.heads,
                self.key_dim,
                self.value_dim,
                self.ty,
                self.keys.len()
            ) == (
                other.n_ctx,
                other.heads,
                other.key_dim,
                other.value_dim,
                other.ty,
                other.keys.len()
            ) && len <= other.len,
            "kv cache: copying a cache of another shape"
        );
        fn copy<T: Copy>(dst: &mut [T], src: &[T], region: usize, len: usize) {
            for (d, s) in dst.chunks_exact_mut(region).zip(src.chunks_exact(region)) {
                d[..len].copy_from_slice(&s[..len]);
            }
        }
        let (n_ctx, key_dim, value_dim) = (self.n_ctx, self.key_dim, self.value_dim);
        let pairs = self
            .keys
            .iter_mut()
            .zip(&other.keys)
            .map(|(d, s)| (d, s, key_dim))
            .chain(
                self.values
                    .iter_mut()
                    .zip(&other.values)
                    .map(|(d, s)| (d, s, value_dim)),
            );
        for (dst, src, dim) in pairs {
            match (dst, src) {
                (Rows::F32(d), Rows::F32(s)) => copy(d, s, n_ctx * dim, len * dim),
                (Rows::F16(d), Rows::F16(s)) => copy(d, s, n_ctx * dim, len * dim),
                _ => unreachable!("kv cache: storage types checked equal"),
            }
        }
        self.len = len;
    }

    /// Bytes of cache memory.
    pub fn n_bytes(&self) -> usize {
        let row = self.heads * (self.key_dim + self.value_dim);
        self.ty.bytes() * self.n_ctx * row * self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Head `h` of every position held, as f32 (read back through the attention kernel: one
    /// probability of 1 per row).
    fn head(heads: CachedHeads<'_>, h: usize) -> Vec<f32> {
        let rows = heads.head(h, heads.count());
        let mut out = Vec::new();
        for j in 0..rows.count() {
            let probs: Vec<f32> = (0..rows.count())
                .map(|i| f32::from(u8::from(i == j)))
                .collect();
            let mut row = vec![0.0; rows.len()];
            let p = specula_kernels::Rows::single(&probs);
            specula_kernels::attention::weighted_sums(p, rows, &[rows.count()], &mut row);
            out.extend(row);
        }
        out
    }

    const SHAPE: AttentionShape = AttentionShape {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 1,
        value_dim: 2,
    };

    #[test]
    fn stores_rows_head_by_head_and_truncates_by_length() {
        for ty in [KvType::F32, KvType::F16] {
            let mut kv = KvCache::new(2, 4, &SHAPE, ty);
            kv.store(1, 0, &[1.0, 2.0], &[3.0, 4.0, 5.0, 6.0]);
            kv.store(1, 1, &[7.0, 8.0], &[9.0, 10.0, 11.0, 12.0]);
            // The same two rows in one call, into layer 0.
            let values = [3.0, 4.0, 5.0, 6.0, 9.0, 10.0, 11.0, 12.0];
            kv.store(0, 0, &[1.0, 2.0, 7.0, 8.0], &values);
            kv.set_len(2);
            for h in 0..2 {
                assert_eq!(head(kv.keys(0, 2), h), head(kv.keys(1, 2), h));
                assert_eq!(head(kv.values(0, 2), h), head(kv.values(1, 2), h));
            }
            assert_eq!(head(kv.keys(1, 2), 0), [1.0, 7.0]);
            assert_eq!(head(kv.keys(1, 2), 1), [2.0, 8.0]);
            assert_eq!(head(kv.values(1, 2), 1), [5.0, 6.0, 11.0, 12.0]);
            assert_eq!(head(kv.values(1, 1), 0), [3.0, 4.0]);
            kv.set_len(1);
            assert_eq!((kv.len(), kv.capacity()), (1, 4));
            assert_eq!(kv.n_bytes(), ty.bytes() * 4 * 6 * 2);
        }
    }

    #[test]
    fn f16_storage_rounds_to_nearest_even() {
        let shape = AttentionShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 1,
            value_dim: 1,
        };
        let mut kv = KvCache::new(1, 1, &shape, KvType::F16);
        // 1 + 2^-11 lies halfway between two f16 values: it rounds to the even one, 1.0.
        kv.store(0, 0, &[1.0 + 2f32.powi(-11)], &[0.1]);
        assert_eq!(head(kv.keys(0, 1), 0), [1.0]);
        let tenth = specula_kernels::f16::to_f32(0x2e66);
        assert_eq!(head(kv.values(0, 1), 0), [tenth]);
        assert_eq!(KvType::from_name("f16"), Some(KvType::F16));
        assert_eq!(KvType::from_name("q8_0"), None);
    }
}
