//! Grouped-query softmax attention over the KV cache on the CPU, and the per-row query/key
//! preparation (q/k norms and RoPE) before it.
//!
//! Query head `h` reads key/value head `h / (n_head / n_head_kv)` (ggml's broadcast). The query
//! heads that share a key/value head, for every row of a batch, go through the kernels'
//! multi-query attention together ([`attend_rows`]): each cached row is read once for all of
//! them. A query's scores over positions `0 ..= pos` are scaled by `1 / sqrt(head_dim)`,
//! soft-maxed, and the value rows accumulated in position order. Key/value heads may run on
//! different threads; each query's arithmetic is fixed, so the result does not depend on
//! threads or on which batch the row came in.

use rayon::prelude::*;
use specula_kernels::activations;
use specula_kernels::attention::{self as kattention, Cached};
use specula_kernels::{ops, Rope, Rows};

use crate::blocks::attention::AttentionShape;
use crate::graph::Tree;
use crate::kv_cache::CachedHeads;

/// Below this many multiply-adds per row, heads run on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 14;

/// Applies the optional per-head q/k RMSNorm (epsilon `eps`) and then `rope` by the angles of
/// the row's position (`cos`/`sin`, [`Rope::angles`]) to one row's query (`n_head × head_dim`)
/// and key (`n_head_kv × head_dim`) in place.
#[allow(clippy::too_many_arguments)]
pub fn prepare_query_key(
    rope: &Rope,
    head_dim: usize,
    eps: f32,
    q_norm: Option<&[f32]>,
    k_norm: Option<&[f32]>,
    (cos, sin): (&[f32], &[f32]),
    q: &mut [f32],
    k: &mut [f32],
) {
    for (heads, norm) in [(q, q_norm), (k, k_norm)] {
        for head in heads.chunks_exact_mut(head_dim) {
            if let Some(weight) = norm {
                ops::rms_norm_in_place(head, weight, eps);
            }
            rope.apply(head, cos, sin);
        }
    }
}

/// Rows attended together per call of the attention kernels: a verify batch at once; longer
/// batches (prefill) in pieces of this many rows.
pub const ATTENTION_ROWS: usize = 8;

/// Most values the buffers of one wave of jobs hold (beyond one job, which always fits): waves
/// bound the memory of many sequences' attention at long contexts.
const WAVE_VALUES: usize = 1 << 22;

/// The reusable buffers of [`attend_segments`]: grown to what the largest wave needed.
#[derive(Debug, Default, Clone)]
pub struct AttentionScratch {
    /// Per job and key/value head: the queries of its query heads for every row.
    queries: Vec<f32>,
    /// Per job and key/value head: one score row per query, as long as the job's keys.
    scores: Vec<f32>,
    /// Per job and key/value head: one output row per query.
    outputs: Vec<f32>,
    /// Per job and key/value head: how many keys each query sees.
    limits: Vec<usize>,
    /// Per job and key/value head, for a quantised cache's values (or keys in groups, were
    /// they read as rows): one block of its head's rows widened.
    rows: Vec<f32>,
    /// Per job and key/value head, for a Q8_0 cache's keys: its queries quantised.
    quantized: Vec<u8>,
}

impl AttentionScratch {
    /// Empty buffers (they grow with the first passes).
    pub fn new() -> Self {
        Self::default()
    }
}

/// One sequence's rows of an attention: query rows `rows` (of the `queries` and `out` of
/// [`attend_segments`]) over its cached `keys`/`values`; its first row sees positions
/// `0 .. first_len`, each next row one more — or, for a tree, what [`SegmentTree`] says.
#[derive(Debug, Clone)]
pub struct Segment<'a> {
    pub rows: std::ops::Range<usize>,
    pub first_len: usize,
    pub keys: CachedHeads<'a>,
    pub values: CachedHeads<'a>,
    pub tree: Option<SegmentTree<'a>>,
}

/// The rows of a [`Segment`] as part of a tree evaluation: the evaluation's row `e` is in
/// cache slot `base + e` and sees the slots before `base` and its ancestors' (and its own), in
/// path order. Its scores are computed over every slot up to its own, then those it sees are
/// gathered in path order before the softmax and the weighted sums, so each number is the one
/// the path evaluated alone gives.
#[derive(Debug, Clone, Copy)]
pub struct SegmentTree<'a> {
    pub tree: Tree<'a>,
    /// Cache slot of the evaluation's first row.
    pub base: usize,
    /// The segment's first row among the evaluation's.
    pub first_row: usize,
}

/// At most [`ATTENTION_ROWS`] rows of one segment, attended together per key/value head.
#[derive(Debug, Clone, Copy)]
struct Job {
    segment: usize,
    /// First row, among the segment's.
    first: usize,
    rows: usize,
    /// Keys the job's last row sees.
    n_keys: usize,
}

/// One (job, key/value head) item's buffers.
struct Item<'a> {
    job: Job,
    head: usize,
    queries: &'a mut [f32],
    scores: &'a mut [f32],
    outputs: &'a mut [f32],
    limits: &'a mut [usize],
    /// The limits within one cache block.
    block_limits: &'a mut [usize],
    /// A dequantised cache block (empty for a cache attention reads as stored).
    rows: &'a mut [f32],
    /// The queries quantised for a Q8_0 cache's keys (empty for other caches).
    quantized: &'a mut [u8],
}

/// Attention of query rows (`queries`, `rows × q_width`) of several sequences, each
/// [`Segment`] over its own cache: writes `rows × out_width` values to `out`.
///
/// The work is split into jobs of at most [`ATTENTION_ROWS`] rows of one segment; per job and
/// key/value head, the rows' query heads that share that head are multiplied together
/// ([`specula_kernels::attention`]), so each cached row is read once per job rather than once
/// per query head and row. The (job, head) items of every sequence run on the pool's threads
/// together — one fork-join for the whole pass, not one per sequence. A query's arithmetic does
/// not depend on the others, so every row gets the bits of a single-row call.
pub fn attend_segments(
    shape: &AttentionShape,
    queries: &[f32],
    segments: &[Segment<'_>],
    s: &mut AttentionScratch,
    out: &mut [f32],
) {
    let (qw, ow) = (shape.q_width(), shape.out_width());
    let mut jobs = Vec::new();
    for (i, seg) in segments.iter().enumerate() {
        let m = seg.rows.len();
        assert!(seg.rows.end * qw <= queries.len(), "attention: query rows");
        assert!(seg.rows.end * ow <= out.len(), "attention: output rows");
        let n_cached = seg.keys.count();
        assert_eq!(
            seg.values.count(),
            n_cached,
            "attention: keys and values differ in length"
        );
        assert!(
            m == 0 || seg.first_len + m - 1 <= n_cached,
            "attention: rows see more positions than are cached"
        );
        for first in (0..m).step_by(ATTENTION_ROWS) {
            let rows = ATTENTION_ROWS.min(m - first);
            jobs.push(Job {
                segment: i,
                first,
                rows,
                n_keys: seg.first_len + first + rows - 1,
            });
        }
    }
    let group = shape.n_head / shape.n_head_kv;
    // A quantised cache is read a block at a time through each item's own scratch.
    let block_rows = dequantised_block_values(shape, segments);
    let item_values =
        |job: &Job| job.rows * group * (shape.head_dim + job.n_keys + shape.value_dim) + block_rows;
    let mut start = 0;
    while start < jobs.len() {
        // A wave: the next jobs whose buffers fit `WAVE_VALUES` (at least one).
        let mut end = start + 1;
        let mut values = item_values(&jobs[start]) * shape.n_head_kv;
        while end < jobs.len() {
            let more = item_values(&jobs[end]) * shape.n_head_kv;
            if values + more > WAVE_VALUES {
                break;
            }
            values += more;
            end += 1;
        }
        attend_wave(shape, queries, segments, &jobs[start..end], s, out);
        start = end;
    }
}

/// Runs `jobs` (every key/value head of each) in one fork-join, then writes their outputs.
fn attend_wave<'a>(
    shape: &AttentionShape,
    queries: &[f32],
    segments: &[Segment<'a>],
    jobs: &[Job],
    s: &mut AttentionScratch,
    out: &mut [f32],
) {
    let (hd, vd, qw, ow) = (
        shape.head_dim,
        shape.value_dim,
        shape.q_width(),
        shape.out_width(),
    );
    let group = shape.n_head / shape.n_head_kv;
    let scale = shape.scale();
    let heads = shape.n_head_kv;
    let sizes = |job: &Job| {
        let n = job.rows * group;
        (n * hd, n * job.n_keys, n * vd, n)
    };
    let totals = jobs.iter().fold((0, 0, 0, 0), |t, job| {
        let (q, sc, o, l) = sizes(job);
        (
            t.0 + q * heads,
            t.1 + sc * heads,
            t.2 + o * heads,
            t.3 + l * heads,
        )
    });
    grow(&mut s.queries, totals.0);
    grow(&mut s.scores, totals.1);
    grow(&mut s.outputs, totals.2);
    let block_rows = dequantised_block_values(shape, segments);
    grow(&mut s.rows, block_rows * jobs.len() * heads);
    let q8_keys = segments.iter().any(|seg| seg.keys.is_q8_keys());
    let query_bytes = |job: &Job| match q8_keys {
        true => job.rows * group * specula_kernels::q8_keys::query_bytes(hd),
        false => 0,
    };
    let quantized_total: usize = jobs.iter().map(|job| query_bytes(job) * heads).sum();
    if s.quantized.len() < quantized_total {
        s.quantized.resize(quantized_total, 0);
    }
    if s.limits.len() < 2 * totals.3 {
        s.limits.resize(2 * totals.3, 0);
    }
    let mut items = Vec::with_capacity(jobs.len() * heads);
    let (mut q_rest, mut s_rest, mut o_rest, mut l_rest, mut r_rest) = (
        &mut s.queries[..],
        &mut s.scores[..],
        &mut s.outputs[..],
        &mut s.limits[..],
        &mut s.rows[..],
    );
    let mut quantized_rest = &mut s.quantized[..];
    for job in jobs {
        let (q, sc, o, l) = sizes(job);
        for head in 0..heads {
            let (queries, q_next) = q_rest.split_at_mut(q);
            let (scores, s_next) = s_rest.split_at_mut(sc);
            let (outputs, o_next) = o_rest.split_at_mut(o);
            let (limits, l_next) = l_rest.split_at_mut(l);
            let (block_limits, l_next) = l_next.split_at_mut(l);
            let (rows, r_next) = r_rest.split_at_mut(block_rows);
            (q_rest, s_rest, o_rest, l_rest, r_rest) = (q_next, s_next, o_next, l_next, r_next);
            let (quantized, rest) =
                std::mem::take(&mut quantized_rest).split_at_mut(query_bytes(job));
            quantized_rest = rest;
            items.push(Item {
                job: *job,
                head,
                queries,
                scores,
                outputs,
                limits,
                block_limits,
                rows,
                quantized,
            });
        }
    }
    let run = |item: &mut Item<'_>| {
        let Job {
            segment,
            first,
            rows,
            n_keys,
        } = item.job;
        let seg = &segments[segment];
        let g = item.head;
        for i in 0..rows {
            let row = seg.rows.start + first + i;
            let row = &queries[row * qw..(row + 1) * qw];
            for h in 0..group {
                let query = i * group + h;
                let head = g * group + h;
                item.queries[query * hd..(query + 1) * hd]
                    .copy_from_slice(&row[head * hd..(head + 1) * hd]);
                item.limits[query] = seg.first_len + first + i;
            }
        }
        let n_queries = rows * group;
        let query_rows = Rows::new(item.queries, hd, hd, n_queries);
        // The cache block by block: scores into their columns, then the weighted sums summed
        // onto the outputs in key order (the bits of one pass over contiguous keys).
        let bt = seg.keys.block_tokens();
        let blocks = n_keys.div_ceil(bt);
        let block_limits = |b: usize, here: &mut [usize], limits: &[usize]| {
            let (first_key, count) = (b * bt, bt.min(n_keys - b * bt));
            for (here, &limit) in here.iter_mut().zip(limits) {
                *here = limit.saturating_sub(first_key).min(count);
            }
            (first_key, count)
        };
        // What the kernels prefetch while they read a block: in the key loop the next block of
        // keys, after the last one the first block of values (keys in groups: fetched as the
        // last key block is read); in the value loop the next block of values.
        let stored = |heads: &CachedHeads<'a>, b: usize| {
            (b < blocks)
                .then(|| heads.stored_head_block(g, b, bt.min(n_keys - b * bt)))
                .flatten()
        };
        if seg.keys.is_q8_keys() {
            // A Q8_0 cache's keys: integer scores of the queries quantised once, every key of
            // each block (those past a query's limit are never read).
            specula_kernels::q8_keys::quantize_queries(query_rows, item.quantized);
            let qb = specula_kernels::q8_keys::query_bytes(hd);
            let quantized = Rows::new(item.quantized, qb, qb, n_queries);
            for b in 0..blocks {
                let (first_key, count) = (b * bt, bt.min(n_keys - b * bt));
                let keys = seg.keys.q8_key_block(g, b).expect("a Q8_0 cache's keys");
                let next = match b + 1 < blocks {
                    true => seg.keys.q8_key_block(g, b + 1).unwrap_or_default(),
                    false => &[],
                };
                let scores = &mut item.scores[first_key..];
                specula_kernels::q8_keys::scores(quantized, keys, count, next, scores, n_keys);
            }
        } else if seg.keys.is_f16_keys() {
            // An f16 cache's keys in groups: every key of each block (those past a query's
            // limit are never read), a register's lanes of keys at a time.
            for b in 0..blocks {
                let (first_key, count) = (b * bt, bt.min(n_keys - b * bt));
                let keys = seg.keys.f16_key_block(g, b).expect("an f16 cache's keys");
                let next = match b + 1 < blocks {
                    true => seg.keys.f16_key_block(g, b + 1).unwrap_or_default(),
                    false => {
                        if let Some(values) = stored(&seg.values, 0) {
                            values.prefetch_l2();
                        }
                        &[]
                    }
                };
                let scores = &mut item.scores[first_key..];
                specula_kernels::f16_keys::scores(query_rows, keys, count, next, scores, n_keys);
            }
        } else {
            for b in 0..blocks {
                let (first_key, count) = block_limits(b, item.block_limits, item.limits);
                let mut keys = seg.keys.head_block(g, b, count, item.rows);
                if let Some(next) = stored(&seg.keys, b + 1).or_else(|| stored(&seg.values, 0)) {
                    keys = keys.followed_by(next);
                }
                let scores = &mut item.scores[first_key..];
                kattention::scores(query_rows, keys, item.block_limits, scores, n_keys);
            }
        }
        // A tree row: the scores of the slots it sees, in path order, after the prefix (for
        // each of its query heads).
        let paths: Vec<Vec<usize>> = match &seg.tree {
            None => Vec::new(),
            Some(t) => (0..rows)
                .map(|i| t.tree.path(t.first_row + first + i))
                .collect(),
        };
        if let Some(t) = &seg.tree {
            for query in 0..n_queries {
                let path = &paths[query / group];
                let row = &mut item.scores[query * n_keys..(query + 1) * n_keys];
                for (k, &at) in path.iter().enumerate() {
                    row[t.base + k] = row[t.base + at];
                }
                item.limits[query] = t.base + path.len();
            }
        }
        for (row, &limit) in item
            .scores
            .chunks_exact_mut(n_keys.max(1))
            .zip(&*item.limits)
        {
            let row = &mut row[..limit];
            for score in row.iter_mut() {
                *score *= scale;
            }
            activations::softmax_in_place(row);
        }
        if let Some(t) = &seg.tree {
            // The cached prefix block by block below; the path's values after it.
            for limit in item.limits.iter_mut() {
                *limit = t.base;
            }
        }
        for b in 0..blocks {
            let (first_key, count) = block_limits(b, item.block_limits, item.limits);
            let mut values = seg.values.head_block(g, b, count, item.rows);
            if let Some(next) = stored(&seg.values, b + 1) {
                values = values.followed_by(next);
            }
            let probs = Rows::new(&item.scores[first_key..], n_keys, count, n_queries);
            if b == 0 {
                kattention::weighted_sums(probs, values, item.block_limits, item.outputs);
            } else {
                kattention::weighted_sums_onto(probs, values, item.block_limits, item.outputs);
            }
        }
        if let Some(t) = &seg.tree {
            // Per row: its path's value rows gathered once (each cache block read once), then
            // summed onto the output of each of its query heads.
            let vd = shape.value_dim;
            let mut gathered = Vec::new();
            for (i, path) in paths.iter().enumerate() {
                gathered.clear();
                gathered.resize(path.len() * vd, 0.0);
                let mut k = 0;
                while k < path.len() {
                    let b = (t.base + path[k]) / bt;
                    let block = seg
                        .values
                        .head_block(g, b, bt.min(n_keys - b * bt), item.rows);
                    while k < path.len() && (t.base + path[k]) / bt == b {
                        let j = (t.base + path[k]) % bt;
                        block.row_f32(j, &mut gathered[k * vd..(k + 1) * vd]);
                        k += 1;
                    }
                }
                let values = Cached::F32(&gathered).rows(0, vd, vd, path.len());
                for query in i * group..(i + 1) * group {
                    let probs = Rows::new(
                        &item.scores[query * n_keys + t.base..],
                        n_keys,
                        path.len(),
                        1,
                    );
                    kattention::weighted_sums_onto(
                        probs,
                        values,
                        &[path.len()],
                        &mut item.outputs[query * vd..(query + 1) * vd],
                    );
                }
            }
        }
    };
    let work: usize = jobs
        .iter()
        .map(|j| j.rows * shape.n_head * j.n_keys * (hd + vd))
        .sum();
    // Each item, as it starts, has the next item's first key block fetched into L2: the
    // kernels prefetch a block ahead only within an item, so at a short context (a block or
    // two per head) an item would otherwise start on rows from memory. Items run in index
    // order on each thread (rayon splits a range in contiguous pieces), so the next one is
    // usually the same thread's.
    // (Each item's keys, head and positions read of its first block.)
    let first_blocks: Vec<(&CachedHeads<'_>, usize, usize)> = items
        .iter()
        .map(|item| {
            let keys = &segments[item.job.segment].keys;
            (keys, item.head, keys.block_tokens().min(item.job.n_keys))
        })
        .collect();
    let run_and_prefetch = |(i, item): (usize, &mut Item<'_>)| {
        if let Some(&(keys, head, n)) = first_blocks.get(i + 1) {
            keys.prefetch_first_block_l2(head, n);
        }
        run(item);
    };
    if work < PARALLEL_MIN_WORK {
        items.iter_mut().enumerate().for_each(run_and_prefetch);
    } else {
        items.par_iter_mut().enumerate().for_each(run_and_prefetch);
    }
    for item in &items {
        let Job {
            segment,
            first,
            rows,
            ..
        } = item.job;
        let g = item.head;
        for i in 0..rows {
            let row = segments[segment].rows.start + first + i;
            for h in 0..group {
                let query = i * group + h;
                let head = g * group + h;
                out[row * ow + head * vd..][..vd]
                    .copy_from_slice(&item.outputs[query * vd..(query + 1) * vd]);
            }
        }
    }
}

/// Values of one item's scratch for a dequantised cache block: a block of the widest head, or
/// 0 where every cache is read as stored.
fn dequantised_block_values(shape: &AttentionShape, segments: &[Segment<'_>]) -> usize {
    // Keys are scored where they lie (rows as stored, groups by their kernels): only values
    // are ever widened into rows.
    let quantised = segments.iter().any(|seg| seg.values.needs_scratch());
    let block = segments.iter().map(|seg| seg.keys.block_tokens()).max();
    match quantised {
        true => block.unwrap_or(0) * shape.head_dim.max(shape.value_dim),
        false => 0,
    }
}

/// Grows `buffer` to at least `len` values.
fn grow(buffer: &mut Vec<f32>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}

/// Attention of `m` query rows of one sequence (`queries`, `m × q_width`) over `keys`/`values`:
/// row `i` sees positions `0 .. first_len + i` ([`attend_segments`] of one segment).
pub fn attend_rows(
    shape: &AttentionShape,
    queries: &[f32],
    first_len: usize,
    keys: CachedHeads<'_>,
    values: CachedHeads<'_>,
    s: &mut AttentionScratch,
    out: &mut [f32],
) {
    let m = queries.len() / shape.q_width();
    assert_eq!(out.len(), m * shape.out_width(), "attention: output size");
    let segment = Segment {
        rows: 0..m,
        first_len,
        keys,
        values,
        tree: None,
    };
    attend_segments(shape, queries, &[segment], s, out);
}

/// Attention of one query row over `keys`/`values` (`n_keys` cached rows of `k_width` /
/// `v_width`, positions `0 .. n_keys`), written to `out` (`out_width`): [`attend_rows`] for a
/// single row, with its own buffers.
pub fn attend(shape: &AttentionShape, q: &[f32], keys: &[f32], values: &[f32], out: &mut [f32]) {
    let n_keys = keys.len() / shape.k_width();
    let mut scratch = AttentionScratch::new();
    let keys = CachedHeads::position_major(Cached::F32(keys), shape.head_dim, shape.n_head_kv);
    let values = CachedHeads::position_major(Cached::F32(values), shape.value_dim, shape.n_head_kv);
    attend_rows(shape, q, n_keys, keys, values, &mut scratch, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_groups_share_kv_heads() {
        let shape = AttentionShape {
            n_head: 4,
            n_head_kv: 2,
            head_dim: 2,
            value_dim: 3,
        };
        let q = vec![1.0; shape.q_width()];
        let keys = vec![0.5; shape.k_width()];
        let values = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = vec![0.0; shape.out_width()];
        attend(&shape, &q, &keys, &values, &mut out);
        assert_eq!(
            out,
            vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 4.0, 5.0, 6.0]
        );
    }

    #[test]
    fn equal_scores_average_the_values() {
        let shape = AttentionShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 2,
            value_dim: 1,
        };
        let mut out = vec![0.0; 1];
        attend(
            &shape,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0, 4.0],
            &[2.0, 4.0],
            &mut out,
        );
        assert!((out[0] - 3.0).abs() < 1e-6);
    }
}
