//! The keys of an f16 KV cache, stored so that attention scores a register's lanes of keys at
//! once (16 at AVX-512, 8 at AVX2).
//!
//! A paged cache keeps the positions of one key head in blocks; as f16 keys, such a block is
//! groups of 16 positions, each group value-major: value 0 of its 16 positions, then value 1 of
//! them, and so on (`16 · dim` halves, as many as 16 rows, so a block's size does not change).
//! The kernel reads whole groups: the positions of the last group past a sequence's length
//! hold whatever the block held before (zeros in a fresh one), and their scores are never
//! stored.
//!
//! Stored by rows, each (query, key) score was a dot product reduced across a register's
//! lanes; by groups, the lanes are the keys: one widened register of 16 keys' value `d`, one
//! fused multiply-add per query and value, no horizontal sums. On Zen 4 (criterion
//! `key-scores`, one thread, one key head of 4,096 positions) a verify pass's 16 queries took
//! 213 µs by rows and 151 µs in groups from cache, 238 / 167 µs from DRAM; a decode step's 2
//! queries 57 / 51 µs from DRAM. A (query, key) score is
//! `acc = fma(q_d, k_d, acc)` over the head's values in order from `d = 0` (`acc` from zero):
//! the same bits whatever other queries and keys share the call, at every SIMD level and in
//! the scalar reference alike.

use crate::f16;
use crate::simd::{self, Rows, SimdLevel};

/// Positions per group.
pub const GROUP_POSITIONS: usize = 16;

/// Halves of the keys of `positions` positions (a multiple of [`GROUP_POSITIONS`]) of one head
/// of `dim` values: `positions · dim`.
pub fn head_units(dim: usize, positions: usize) -> usize {
    assert!(
        positions.is_multiple_of(GROUP_POSITIONS),
        "f16 keys: {positions} positions are not whole groups"
    );
    positions * dim
}

/// The halves of the group holding `slot` in `head` (a head's keys of `dim` values), and the
/// slot's lane within it.
fn group_of(head: &[u16], dim: usize, slot: usize) -> (std::ops::Range<usize>, usize) {
    let group = GROUP_POSITIONS * dim;
    let at = slot / GROUP_POSITIONS * group;
    assert!(
        at + group <= head.len(),
        "f16 keys: position {slot} beyond the {} halves held",
        head.len()
    );
    (at..at + group, slot % GROUP_POSITIONS)
}

/// Rounds `key` (one head's values) to f16 ([`f16::from_f32_slice`]) and stores it as position
/// `slot` of `head`.
pub fn store(key: &[f32], head: &mut [u16], slot: usize) {
    const CHUNK: usize = 64;
    let (range, lane) = group_of(head, key.len(), slot);
    let mut halves = [0u16; CHUNK];
    for (values, group) in key
        .chunks(CHUNK)
        .zip(head[range].chunks_mut(CHUNK * GROUP_POSITIONS))
    {
        let halves = &mut halves[..values.len()];
        f16::from_f32_slice(values, halves);
        for (&value, dst) in halves.iter().zip(group.chunks_exact_mut(GROUP_POSITIONS)) {
            dst[lane] = value;
        }
    }
}

/// The f16 row (`out.len()` values) stored at position `slot` of `head`.
pub fn load_row(head: &[u16], slot: usize, out: &mut [u16]) {
    let (range, lane) = group_of(head, out.len(), slot);
    for (value, src) in out
        .iter_mut()
        .zip(head[range].chunks_exact(GROUP_POSITIONS))
    {
        *value = src[lane];
    }
}

/// Copies position `from.1` of the head whose keys start at half `from.0` of `store` onto
/// position `to.1` of the head at `to.0` (heads of `head` halves of keys of `dim` values; the
/// same head or another).
pub fn copy_row(
    store: &mut [u16],
    (head, dim): (usize, usize),
    from: (usize, usize),
    to: (usize, usize),
) {
    let (src, i) = group_of(&store[from.0..from.0 + head], dim, from.1);
    let (dst, k) = group_of(&store[to.0..to.0 + head], dim, to.1);
    for d in 0..dim {
        store[to.0 + dst.start + d * GROUP_POSITIONS + k] =
            store[from.0 + src.start + d * GROUP_POSITIONS + i];
    }
}

/// The values of position `slot` of `head` (`out.len()` of them), widened to f32.
pub fn dequantize(head: &[u16], slot: usize, out: &mut [f32]) {
    let (range, lane) = group_of(head, out.len(), slot);
    for (value, src) in out
        .iter_mut()
        .zip(head[range].chunks_exact(GROUP_POSITIONS))
    {
        *value = f16::to_f32(src[lane]);
    }
}

/// Fetches `head` (a block's keys, say) into L2: a hint, no result depends on it.
pub fn prefetch_l2(head: &[u16]) {
    simd::prefetch_lines(head.as_ptr().cast(), std::mem::size_of_val(head), true);
}

/// `out[q * stride + j]` = query `q` · key `j` for every query of `queries` and each of the
/// first `count` positions of `head` (a head's keys of whole groups), at the process's
/// [`simd::level`]. `next` is what the caller reads next (a paged cache's next block, or
/// empty): it is fetched into L2 as `head` is read — only a hint.
pub fn scores(
    queries: Rows<'_, f32>,
    head: &[u16],
    count: usize,
    next: &[u16],
    out: &mut [f32],
    stride: usize,
) {
    scores_with(simd::level(), queries, head, count, next, out, stride);
}

/// [`scores`] at `level` (which must be supported).
pub fn scores_with(
    level: SimdLevel,
    queries: Rows<'_, f32>,
    head: &[u16],
    count: usize,
    next: &[u16],
    out: &mut [f32],
    stride: usize,
) {
    level.assert_supported();
    if count == 0 || queries.count() == 0 {
        return;
    }
    let dim = queries.len();
    let groups = count.div_ceil(GROUP_POSITIONS);
    assert!(
        dim > 0 && groups * GROUP_POSITIONS * dim <= head.len(),
        "f16 keys: {count} positions beyond the {} halves held",
        head.len()
    );
    assert!(
        count <= stride && (queries.count() - 1) * stride + count <= out.len(),
        "f16 keys: {} score rows of {count} (stride {stride}) do not fit in {}",
        queries.count(),
        out.len()
    );
    let keys = &head[..groups * GROUP_POSITIONS * dim];
    match level {
        SimdLevel::Scalar => scores_scalar(queries, keys, count, out, stride),
        // The kernels prefetch `next` as they read `head`.
        _ => simd::f16_key_scores(level, queries, keys, next, count, out, stride),
    }
}

/// The scalar reference of [`scores`]: per (query, key) `acc = fma(q_d, k_d, acc)` over the
/// values in order.
fn scores_scalar(
    queries: Rows<'_, f32>,
    keys: &[u16],
    count: usize,
    out: &mut [f32],
    stride: usize,
) {
    let dim = queries.len();
    for q in 0..queries.count() {
        let query = queries.row(q);
        for (j, score) in out[q * stride..][..count].iter_mut().enumerate() {
            let group = &keys[j / GROUP_POSITIONS * GROUP_POSITIONS * dim..];
            let lane = j % GROUP_POSITIONS;
            *score = query.iter().enumerate().fold(0.0f32, |acc, (d, &x)| {
                x.mul_add(f16::to_f32(group[d * GROUP_POSITIONS + lane]), acc)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in about ±4.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 1_000) as f32 / 125.0 - 4.0)
            .collect()
    }

    #[test]
    fn stored_keys_read_back_and_copy_as_their_f16_rows() {
        for dim in [1, 8, 40, 64, 128] {
            let positions = 48;
            let mut head = vec![0u16; head_units(dim, positions)];
            for slot in (0..positions).rev().step_by(3) {
                store(&values(dim, slot), &mut head, slot);
            }
            for slot in 0..positions {
                let written = (positions - 1 - slot).is_multiple_of(3);
                let mut got = vec![0u16; dim];
                load_row(&head, slot, &mut got);
                let mut want = vec![0u16; dim];
                if written {
                    f16::from_f32_slice(&values(dim, slot), &mut want);
                }
                assert_eq!(got, want, "dim {dim} slot {slot}");
                let mut two_heads = [head.clone(), vec![0u16; head.len()]].concat();
                let to = positions - 1 - slot;
                copy_row(
                    &mut two_heads,
                    (head.len(), dim),
                    (0, slot),
                    (head.len(), to),
                );
                let mut back = vec![0u16; dim];
                load_row(&two_heads[head.len()..], to, &mut back);
                assert_eq!(back, got, "dim {dim} slot {slot}: copy_row");
                let mut decoded = vec![0.0; dim];
                dequantize(&head, slot, &mut decoded);
                let widened: Vec<f32> = got.iter().map(|&h| f16::to_f32(h)).collect();
                assert_eq!(decoded, widened, "dim {dim} slot {slot}: dequantize");
            }
        }
    }

    /// Every level's scores equal the reference bit for bit, on awkward sizes: positions that
    /// are not whole groups, 1..=19 queries (every tile), strides wider than the keys.
    #[test]
    fn scores_equal_the_reference_at_every_level() {
        for dim in [1, 16, 40, 64, 128] {
            for count in [1usize, 5, 16, 17, 40, 64, 130] {
                let positions = count.next_multiple_of(GROUP_POSITIONS);
                // Lanes past `count` hold values too (a reused block): never stored.
                let mut head = vec![0u16; head_units(dim, positions)];
                for slot in 0..positions {
                    store(&values(dim, 3 * slot + 1), &mut head, slot);
                }
                for n in [1, 2, 3, 5, 8, 11, 16, 19] {
                    let queries: Vec<f32> = (0..n).flat_map(|q| values(dim, 1000 + q)).collect();
                    let rows = Rows::new(&queries, dim, dim, n);
                    let stride = count + 3;
                    for level in SimdLevel::supported() {
                        // The last row as long as its scores: nothing stored past them.
                        let mut out = vec![f32::NAN; (n - 1) * stride + count];
                        // Another head as the next one read (prefetched only).
                        let next = &head[..head.len() / 2];
                        scores_with(level, rows, &head, count, next, &mut out, stride);
                        for q in 0..n {
                            for j in 0..count {
                                let mut key = vec![0.0; dim];
                                dequantize(&head, j, &mut key);
                                let want = queries[q * dim..(q + 1) * dim]
                                    .iter()
                                    .zip(&key)
                                    .fold(0.0f32, |acc, (&x, &k)| x.mul_add(k, acc));
                                assert_eq!(
                                    out[q * stride + j].to_bits(),
                                    want.to_bits(),
                                    "{level:?} dim {dim} count {count} n {n} q {q} key {j}"
                                );
                            }
                            if q + 1 < n {
                                let past = &out[q * stride + count..(q + 1) * stride];
                                assert!(past.iter().all(|v| v.is_nan()), "written past the keys");
                            }
                        }
                    }
                }
            }
        }
    }
}
