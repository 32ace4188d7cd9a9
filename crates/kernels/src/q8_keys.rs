//! The keys of a Q8_0 KV cache, stored so that attention scores are integer dot products.
//!
//! A paged cache keeps the positions of one key head in blocks; as Q8_0, such a block is
//! groups of 16 positions in the layout of interleaved Q8_0 weights ([`crate::interleaved`]):
//! per 32-value block of the head, the 16 positions' f16 scales, then their quants (`q + 128`)
//! four bytes of each position per 64-byte register. That is as many bytes as 16 Q8_0 rows
//! (34 per 32 values), so a block's size does not change. The kernel reads whole groups: the
//! positions of the last group past a sequence's length hold whatever the block held before
//! (zeros in a fresh one), and their scores are never stored.
//!
//! Scores go through the interleaved Q8_0 kernel: the queries are quantised to Q8_0, as ggml
//! does for a q8_0 cache (`ggml_vec_dot_q8_0_q8_0`), and one `vpdpbusd` multiplies four
//! values of 16 keys at once — a quarter of the instructions of f32 scores over f16 keys,
//! from half the bytes. A (query, key) score is `Σ_b fma(s_b, d_k · d_q, acc)` over the head's
//! blocks in order, `s_b` the block's exact integer sum: the same bits whatever other queries
//! and keys share the call, at every level and in the scalar reference alike. At the AVX2
//! level (no `vpdpbusd`) `vpmaddubsw` sums the products in 16 bits first
//! ([`crate::interleaved`]'s AVX2 kernels): still far cheaper than widening keys stored as rows
//! to f32 and scoring one (query, key) at a time (Zen 4 at `SPECULA_SIMD=avx2`, one thread,
//! one key head of 4,096 positions from cache, criterion `key-scores`: 2 / 16 queries 30 / 219
//! µs this way, 64 / 501 µs for f16 keys as rows, which Q8_0 rows only add widening to).

use crate::interleaved::{self, Encoding, GROUP_ROWS};
use crate::simd::{self, OutRows, Rows, SimdLevel};
use crate::{f16, q8_0};

/// Positions per interleaved group.
pub const GROUP_POSITIONS: usize = GROUP_ROWS;

const ENCODING: Encoding = Encoding::Q8_0;

/// Bytes of the keys of `positions` positions (a multiple of [`GROUP_POSITIONS`]) of one head
/// of `dim` values (a multiple of 32): `positions · dim / 32 · 34`.
pub fn head_bytes(dim: usize, positions: usize) -> usize {
    assert!(
        positions.is_multiple_of(GROUP_POSITIONS) && dim.is_multiple_of(q8_0::BLOCK_VALUES),
        "q8 keys: {positions} positions of {dim} values are not whole groups and blocks"
    );
    positions / GROUP_POSITIONS * ENCODING.group_bytes(dim)
}

/// Bytes of one quantised query of `dim` values ([`quantize_queries`]).
pub fn query_bytes(dim: usize) -> usize {
    ENCODING.activation_row_bytes(dim)
}

/// The group blocks of the group holding `slot` in `head` (a head's keys of `dim` values),
/// and the slot's row within it.
fn group_of(head: &[u8], dim: usize, slot: usize) -> (std::ops::Range<usize>, usize) {
    let group = ENCODING.group_bytes(dim);
    let at = slot / GROUP_POSITIONS * group;
    assert!(
        at + group <= head.len(),
        "q8 keys: position {slot} beyond the {} bytes held",
        head.len()
    );
    (at..at + group, slot % GROUP_POSITIONS)
}

/// Quantises `key` (one head's values) to Q8_0 (ggml's quantiser) and stores it as position
/// `slot` of `head`.
pub fn store(key: &[f32], head: &mut [u8], slot: usize) {
    let mut block = [0u8; q8_0::BLOCK_BYTES];
    let (range, i) = group_of(head, key.len(), slot);
    for (values, dst) in key
        .chunks_exact(q8_0::BLOCK_VALUES)
        .zip(head[range].chunks_exact_mut(ENCODING.group_block_bytes()))
    {
        q8_0::quantize_block(values, &mut block);
        interleaved::repack_row_block(ENCODING, &block, dst, i);
    }
}

/// The Q8_0 row (ggml's bytes, `dim / 32 · 34`, into `out`) stored at position `slot` of
/// `head`.
pub fn load_row(head: &[u8], dim: usize, slot: usize, out: &mut [u8]) {
    assert_eq!(
        out.len(),
        dim / q8_0::BLOCK_VALUES * q8_0::BLOCK_BYTES,
        "q8 keys: row size"
    );
    let (range, i) = group_of(head, dim, slot);
    for (src, block) in head[range]
        .chunks_exact(ENCODING.group_block_bytes())
        .zip(out.chunks_exact_mut(q8_0::BLOCK_BYTES))
    {
        interleaved::unpack_q8_0_row_block(src, i, block);
    }
}

/// Copies position `from.1` of the head whose keys start at byte `from.0` of `store` onto
/// position `to.1` of the head at `to.0` (heads of `head` bytes of keys of `dim` values; the
/// same head or another).
pub fn copy_row(
    store: &mut [u8],
    (head, dim): (usize, usize),
    from: (usize, usize),
    to: (usize, usize),
) {
    let group_block = ENCODING.group_block_bytes();
    let (src, i) = group_of(&store[from.0..from.0 + head], dim, from.1);
    let (dst, k) = group_of(&store[to.0..to.0 + head], dim, to.1);
    let mut block = [0u8; q8_0::BLOCK_BYTES];
    for b in 0..dim / q8_0::BLOCK_VALUES {
        let at = from.0 + src.start + b * group_block;
        interleaved::unpack_q8_0_row_block(&store[at..at + group_block], i, &mut block);
        let at = to.0 + dst.start + b * group_block;
        interleaved::repack_row_block(ENCODING, &block, &mut store[at..at + group_block], k);
    }
}

/// The values of position `slot` of `head` (`out.len()` of them), as Q8_0 decodes them.
pub fn dequantize(head: &[u8], slot: usize, out: &mut [f32]) {
    let (range, i) = group_of(head, out.len(), slot);
    let mut block = [0u8; q8_0::BLOCK_BYTES];
    for (values, src) in out
        .chunks_exact_mut(q8_0::BLOCK_VALUES)
        .zip(head[range].chunks_exact(ENCODING.group_block_bytes()))
    {
        interleaved::unpack_q8_0_row_block(src, i, &mut block);
        let d = f16::to_f32(u16::from_le_bytes([block[0], block[1]]));
        for (v, &q) in values.iter_mut().zip(&block[2..]) {
            *v = f32::from(q as i8) * d;
        }
    }
}

/// Quantises each query of `queries` (Q8_0, ggml's quantiser) into `out`, one
/// [`query_bytes`] row after the other: the queries [`scores`] reads.
pub fn quantize_queries(queries: Rows<'_, f32>, out: &mut [u8]) {
    let dim = queries.len();
    let row_bytes = query_bytes(dim);
    assert!(
        out.len() >= queries.count() * row_bytes,
        "q8 keys: {} bytes for {} quantised queries",
        out.len(),
        queries.count()
    );
    let mut block = [0u8; q8_0::BLOCK_BYTES];
    for (q, row) in out
        .chunks_exact_mut(row_bytes)
        .take(queries.count())
        .enumerate()
    {
        for (values, act) in queries
            .row(q)
            .chunks_exact(q8_0::BLOCK_VALUES)
            .zip(row.chunks_exact_mut(ENCODING.activation_block_bytes()))
        {
            interleaved::quantize_activation_row(ENCODING, values, &mut block, act);
        }
    }
}

/// `out[q * stride + j]` = quantised query `q` · key `j` for every query of `queries`
/// ([`quantize_queries`]' rows) and each of the first `count` positions of `head` (a head's
/// keys of whole groups), at the process's [`simd::level`]. `next` is what the caller reads
/// next (a paged cache's next block, or empty): it is fetched into L2 before `head` is read,
/// so it arrives before its use wherever in memory it lies (measured: a cold 2-query pass
/// over 4,096 keys 78 → 34 µs) — only a hint, no result depends on it.
pub fn scores(
    queries: Rows<'_, u8>,
    head: &[u8],
    count: usize,
    next: &[u8],
    out: &mut [f32],
    stride: usize,
) {
    scores_with(simd::level(), queries, head, count, next, out, stride);
}

/// [`scores`] at `level` (which must be supported).
pub fn scores_with(
    level: SimdLevel,
    queries: Rows<'_, u8>,
    head: &[u8],
    count: usize,
    next: &[u8],
    out: &mut [f32],
    stride: usize,
) {
    level.assert_supported();
    if count == 0 || queries.count() == 0 {
        return;
    }
    let act = ENCODING.activation_block_bytes();
    assert!(
        !queries.is_empty() && queries.len().is_multiple_of(act),
        "q8 keys: quantised queries are not whole blocks"
    );
    let group_bytes = ENCODING.group_bytes(queries.len() / act * q8_0::BLOCK_VALUES);
    let groups = count.div_ceil(GROUP_POSITIONS);
    assert!(
        groups * group_bytes <= head.len(),
        "q8 keys: {count} positions beyond the {} bytes held",
        head.len()
    );
    assert!(
        count <= stride && (queries.count() - 1) * stride + count <= out.len(),
        "q8 keys: {} score rows of {count} (stride {stride}) do not fit in {}",
        queries.count(),
        out.len()
    );
    simd::prefetch_l2(next);
    let keys = &head[..groups * group_bytes];
    for first in (0..queries.count()).step_by(simd::MAX_ROWS_PER_PASS) {
        let n = simd::MAX_ROWS_PER_PASS.min(queries.count() - first);
        let windows = out[first * stride..]
            .chunks_mut(stride)
            .take(n)
            .map(|row| &mut row[..count]);
        let mut rows = OutRows::new(windows);
        let queries = queries.sub(first, n);
        interleaved::groups_pass(ENCODING, level, keys, queries, &mut rows, 0, count, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in about ±4 with a few outliers per block.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i * 7919 + seed * 104_729) % 1_000) as f32 / 125.0 - 4.0;
                if (i + seed).is_multiple_of(29) {
                    x * 6.0
                } else {
                    x
                }
            })
            .collect()
    }

    /// The reference score: Q8_0 query and key blocks, an exact integer sum per block, then
    /// `fma(s, d_k · d_q, acc)` in block order.
    fn reference(query: &[f32], key_row: &[u8]) -> f32 {
        let mut q = vec![0u8; key_row.len()];
        q8_0::quantize_row_scalar(query, &mut q);
        let mut acc = 0.0f32;
        for (kb, qb) in key_row
            .chunks_exact(q8_0::BLOCK_BYTES)
            .zip(q.chunks_exact(q8_0::BLOCK_BYTES))
        {
            let s: i32 = kb[2..]
                .iter()
                .zip(&qb[2..])
                .map(|(&k, &q)| i32::from(k as i8) * i32::from(q as i8))
                .sum();
            let dk = f16::to_f32(u16::from_le_bytes([kb[0], kb[1]]));
            let dq = f16::to_f32(u16::from_le_bytes([qb[0], qb[1]]));
            acc = (s as f32).mul_add(dk * dq, acc);
        }
        acc
    }

    #[test]
    fn stored_keys_read_back_and_copy_as_their_q8_0_rows() {
        for dim in [32, 64, 96, 128, 256] {
            let positions = 48;
            let mut head = vec![0u8; head_bytes(dim, positions)];
            for slot in (0..positions).rev().step_by(3) {
                store(&values(dim, slot), &mut head, slot);
            }
            for slot in 0..positions {
                let written = (positions - 1 - slot).is_multiple_of(3);
                let mut got = vec![0u8; dim / 32 * 34];
                load_row(&head, dim, slot, &mut got);
                if written {
                    let mut want = vec![0u8; got.len()];
                    q8_0::quantize_row_scalar(&values(dim, slot), &mut want);
                    assert_eq!(got, want, "dim {dim} slot {slot}");
                }
                // Copied into a second head of the same store, at another position.
                let mut store = [head.clone(), vec![0u8; head.len()]].concat();
                let to = positions - 1 - slot;
                copy_row(&mut store, (head.len(), dim), (0, slot), (head.len(), to));
                let mut back = vec![0u8; got.len()];
                load_row(&store[head.len()..], dim, to, &mut back);
                assert_eq!(back, got, "dim {dim} slot {slot}: copy_row");
                let mut decoded = vec![0.0; dim];
                dequantize(&head, slot, &mut decoded);
                let mut plain = vec![0.0; dim];
                q8_0::dequantize_row_scalar(&got, &mut plain);
                if written {
                    assert_eq!(decoded, plain, "dim {dim} slot {slot}: dequantize");
                } else {
                    assert!(decoded.iter().all(|&v| v == 0.0), "unwritten slot {slot}");
                }
            }
        }
    }

    /// Every level's scores equal the reference bit for bit, on awkward sizes: positions that
    /// are not whole groups, 1..=11 queries (more than one pass), strides wider than the keys.
    #[test]
    fn scores_equal_the_reference_at_every_level() {
        for dim in [32, 64, 128, 160] {
            for count in [1usize, 5, 16, 17, 40, 64] {
                let positions = count.next_multiple_of(GROUP_POSITIONS);
                let mut head = vec![0u8; head_bytes(dim, positions)];
                let mut rows = Vec::new();
                for slot in 0..count {
                    let key = values(dim, 3 * slot + 1);
                    store(&key, &mut head, slot);
                    let mut row = vec![0u8; dim / 32 * 34];
                    load_row(&head, dim, slot, &mut row);
                    rows.push(row);
                }
                for n in [1, 2, 8, 11] {
                    let queries: Vec<f32> = (0..n).flat_map(|q| values(dim, 1000 + q)).collect();
                    let mut quantized = vec![0u8; n * query_bytes(dim)];
                    quantize_queries(Rows::new(&queries, dim, dim, n), &mut quantized);
                    let qrows = Rows::new(&quantized, query_bytes(dim), query_bytes(dim), n);
                    let stride = count + 3;
                    for level in SimdLevel::supported() {
                        let mut out = vec![f32::NAN; n * stride];
                        scores_with(level, qrows, &head, count, &[], &mut out, stride);
                        for q in 0..n {
                            for (j, row) in rows.iter().enumerate() {
                                let want = reference(&queries[q * dim..(q + 1) * dim], row);
                                assert_eq!(
                                    out[q * stride + j].to_bits(),
                                    want.to_bits(),
                                    "{level:?} dim {dim} count {count} n {n} q {q} key {j}"
                                );
                            }
                            let past = &out[q * stride + count..(q + 1) * stride];
                            assert!(past.iter().all(|v| v.is_nan()), "written past the keys");
                        }
                    }
                }
            }
        }
    }
}
