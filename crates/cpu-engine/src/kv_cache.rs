//! The attention KV cache: f32 keys and values per layer, one row per position, sized to the
//! context when the backend opens.
//!
//! Rows `0 .. len` are the sequence. Truncation only moves `len` (O(1)); rows past it are
//! overwritten by the next evaluation before anything reads them.

/// Keys and values of every layer for up to `n_ctx` positions.
#[derive(Debug)]
pub struct KvCache {
    n_ctx: usize,
    k_width: usize,
    v_width: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// A cache for `n_layers` layers of `n_ctx` positions, with key rows of `k_width` and value
    /// rows of `v_width` values. (Zeroed memory is mapped lazily by the OS.)
    pub fn new(n_layers: usize, n_ctx: usize, k_width: usize, v_width: usize) -> Self {
        Self {
            n_ctx,
            k_width,
            v_width,
            keys: (0..n_layers).map(|_| vec![0.0; n_ctx * k_width]).collect(),
            values: (0..n_layers).map(|_| vec![0.0; n_ctx * v_width]).collect(),
            len: 0,
        }
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.n_ctx
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

    /// Stores the key and value rows of position `pos` in `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        self.keys[layer][pos * self.k_width..(pos + 1) * self.k_width].copy_from_slice(key);
        self.values[layer][pos * self.v_width..(pos + 1) * self.v_width].copy_from_slice(value);
    }

    /// Key rows of positions `0 .. n` in `layer`.
    pub fn keys(&self, layer: usize, n: usize) -> &[f32] {
        &self.keys[layer][..n * self.k_width]
    }

    /// Value rows of positions `0 .. n` in `layer`.
    pub fn values(&self, layer: usize, n: usize) -> &[f32] {
        &self.values[layer][..n * self.v_width]
    }

    /// Bytes of cache memory.
    pub fn n_bytes(&self) -> usize {
        4 * self.n_ctx * (self.k_width + self.v_width) * self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_rows_and_truncates_by_length() {
        let mut kv = KvCache::new(2, 4, 2, 3);
        kv.store(1, 0, &[1.0, 2.0], &[3.0, 4.0, 5.0]);
        kv.store(1, 1, &[6.0, 7.0], &[8.0, 9.0, 10.0]);
        kv.set_len(2);
        assert_eq!(kv.keys(1, 2), &[1.0, 2.0, 6.0, 7.0]);
        assert_eq!(kv.values(1, 1), &[3.0, 4.0, 5.0]);
        kv.set_len(1);
        assert_eq!((kv.len(), kv.capacity()), (1, 4));
        assert_eq!(kv.n_bytes(), 4 * 4 * 5 * 2);
    }
}
