//! Mat-vec and attention throughput, next to the machine's memory bandwidth.
//!
//! - `stream/read/t{1,2}`: a STREAM-style read of a 256 MiB buffer (integer sum) with 1 and 2
//!   threads — the bandwidth a memory-bound kernel can reach.
//! - `matvec/{type}/{n}x{rows}x{cols}/t{threads}`: [`matmul`] of `n` activation rows (1: a
//!   decode step, 8: a verify batch) against a `rows × cols` weight matrix at the process's SIMD
//!   level (`SPECULA_SIMD` lowers it), in a rayon pool of 1 or 2 threads. A quantised 4096 ×
//!   4096 matrix (9–18 MB) fits this machine's 32 MiB L3, so repeated runs read it from cache.
//! - `matvec-cold/{type}/{n}x4096x4096xK/t{threads}`: the same product over K distinct copies
//!   of the matrix in turn, K chosen so they exceed 96 MiB: weights come from DRAM, as they do
//!   in a real model whose weights are gigabytes. `{type}-interleaved`: the same matrices
//!   repacked into interleaved 16-row groups (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), as the engine multiplies them.
//! - `attention/{hot,cold}/{2,16}q`: one key/value head's attention over 4,096 f16 positions in
//!   paged blocks of 64 (see [`attention`]).
//! - `key-scores/{f16,f16-groups,q8_0}/{hot,cold}/{2,16}q`: the scores alone, from an f16
//!   cache by rows and in groups and from a Q8_0 cache's integer keys (see [`key_scores`]).
//! - `weighted-sums/{f16,q8_0}/{hot,cold}/{2,16,64}q`: the weighted sums of the values alone
//!   (see [`weighted_sums`]).
//!
//! Throughput is reported in bytes of weights (or of the buffer) per second, so a kernel's GB/s
//! reads directly against the stream bandwidth: a memory-bound mat-vec approaches it, and an
//! 8-row mat-mul that reads its weights once should run at nearly the 1-row rate.
//!
//! Run: `cargo bench -p specula-kernels --bench kernels` (add a filter such as `q4_K`,
//! `matvec-cold` or `stream` to run part of it).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use specula_kernels::{
    interleaved, matmul, simd, InterleavedMatrix, MatmulScratch, WeightMatrix, WeightType,
};

/// Size of the stream buffer: far larger than any cache.
const STREAM_BYTES: usize = 256 << 20;

/// Shapes benchmarked (`rows × cols`): one that fits a 1 MiB L2 (quantised), a small
/// projection and a square 4096 one.
const SHAPES: [(usize, usize); 3] = [(128, 4096), (1024, 4096), (4096, 4096)];

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

fn stream(c: &mut Criterion) {
    let buffer: Vec<u64> = (0..STREAM_BYTES / 8).map(|i| i as u64).collect();
    let mut group = c.benchmark_group("stream");
    group.throughput(Throughput::Bytes(STREAM_BYTES as u64));
    for threads in [1, 2] {
        let pool = pool(threads);
        group.bench_function(BenchmarkId::new("read", format!("t{threads}")), |b| {
            b.iter(|| {
                pool.install(|| {
                    buffer
                        .par_chunks(buffer.len() / threads)
                        .map(|part| part.iter().fold(0u64, |s, v| s.wrapping_add(*v)))
                        .reduce(|| 0, u64::wrapping_add)
                })
            })
        });
    }
    group.finish();
}

/// A `rows × cols` matrix of type `ty`: 64 distinct quantised random rows, repeated (the
/// reference quantisers are slow on 16M values; the kernels' speed does not depend on which
/// rows repeat, and the matrix is still far larger than the caches).
fn weight_bytes(ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let distinct = 64.min(rows);
    let mut rng = StdRng::seed_from_u64(7);
    let values: Vec<f32> = (0..distinct * cols)
        .map(|_| rng.gen_range(-0.05f32..0.05))
        .collect();
    let encoded = specula_kernels::quantize(ty.ggml(), &values);
    let row_bytes = encoded.len() / distinct;
    (0..rows)
        .flat_map(|r| &encoded[(r % distinct) * row_bytes..][..row_bytes])
        .copied()
        .collect()
}

fn matvec(c: &mut Criterion) {
    println!("SIMD level: {}", simd::level());
    let mut rng = StdRng::seed_from_u64(8);
    for ty in WeightType::ALL {
        for interleave in [false, true] {
            if interleave && !interleaved::supports(ty) {
                continue;
            }
            let suffix = if interleave { "-interleaved" } else { "" };
            let mut group = c.benchmark_group(format!("matvec/{ty}{suffix}"));
            for (rows, cols) in SHAPES {
                let data = weight_bytes(ty, rows, cols);
                let plain = WeightMatrix::new(ty, rows, cols, &data).expect("weight matrix");
                let repacked =
                    interleave.then(|| InterleavedMatrix::repack(&plain).expect("repack"));
                let w = repacked.as_ref().map_or(plain, InterleavedMatrix::view);
                group.throughput(Throughput::Bytes(data.len() as u64));
                for n in [1, 8, 16] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                    let mut out = vec![0.0; n * rows];
                    let mut scratch = MatmulScratch::new();
                    for threads in [1, 2] {
                        let pool = pool(threads);
                        let id =
                            BenchmarkId::new(format!("{n}x{rows}x{cols}"), format!("t{threads}"));
                        group.bench_function(id, |b| {
                            b.iter(|| {
                                pool.install(|| matmul(&w, black_box(&x), &mut out, &mut scratch))
                            })
                        });
                    }
                }
            }
            group.finish();
        }
    }
}

/// Bytes the cold benchmarks cycle through (well beyond a 32 MiB L3).
const COLD_BYTES: usize = 96 << 20;

fn matvec_cold(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(9);
    let (rows, cols) = (4096, 4096);
    for ty in WeightType::ALL {
        let data = weight_bytes(ty, rows, cols);
        let copies = COLD_BYTES.div_ceil(data.len());
        let matrices: Vec<Vec<u8>> = (0..copies).map(|_| data.clone()).collect();
        let views: Vec<WeightMatrix<'_>> = matrices
            .iter()
            .map(|m| WeightMatrix::new(ty, rows, cols, m).expect("weight matrix"))
            .collect();
        // Where the type can be interleaved at this level, the repacked copies too.
        let repacked: Vec<InterleavedMatrix> = if interleaved::supports(ty) {
            views.iter().filter_map(InterleavedMatrix::repack).collect()
        } else {
            Vec::new()
        };
        let layouts: Vec<(&str, Vec<WeightMatrix<'_>>)> = [
            ("", views.clone()),
            ("-interleaved", repacked.iter().map(|m| m.view()).collect()),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .collect();
        for (suffix, views) in &layouts {
            let mut group = c.benchmark_group(format!("matvec-cold/{ty}{suffix}"));
            group.throughput(Throughput::Bytes((copies * data.len()) as u64));
            for n in [1, 4, 8, 16] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let mut out = vec![0.0; n * rows];
                let mut scratch = MatmulScratch::new();
                for threads in [1, 2] {
                    let pool = pool(threads);
                    let id = BenchmarkId::new(
                        format!("{n}x{rows}x{cols}x{copies}"),
                        format!("t{threads}"),
                    );
                    group.bench_function(id, |b| {
                        b.iter(|| {
                            pool.install(|| {
                                for w in views {
                                    matmul(w, black_box(&x), &mut out, &mut scratch);
                                }
                            })
                        })
                    });
                }
            }
            group.finish();
        }
    }
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

/// Cached positions of one key/value head in the attention benchmarks, in blocks of
/// [`ATTENTION_BLOCK`] (a paged KV cache's) of head size [`ATTENTION_DIM`].
const ATTENTION_KEYS: usize = 4096;
const ATTENTION_BLOCK: usize = 64;
const ATTENTION_DIM: usize = 128;

/// `attention/{hot,cold}/{n}q`: one key/value head's scores and weighted sums over 4,096 f16
/// positions in blocks of 64, as a paged cache feeds them (block by block, the sums carried
/// on), for `n` queries (2: a decode step of a model with two query heads per key/value head;
/// 16: an 8-row verify pass); one thread. `hot`: the head's 2 MiB again and again (from
/// cache: the kernels' arithmetic); `cold`: a different head of a 256 MiB cache each time (from
/// DRAM, as a long context's decode step reads it). Throughput in bytes of keys and values.
fn attention(c: &mut Criterion) {
    use specula_kernels::attention::{scores, Cached};
    let block_values = ATTENTION_BLOCK * ATTENTION_DIM;
    let head_values = ATTENTION_KEYS * ATTENTION_DIM;
    let mut rng = StdRng::seed_from_u64(11);
    let cold_heads = (256 << 20) / (4 * head_values);
    let cache: Vec<u16> = (0..cold_heads * 2 * head_values)
        .map(|_| specula_kernels::f16::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect();
    let blocks = ATTENTION_KEYS / ATTENTION_BLOCK;
    // Blocks of a head scattered over the cache, as a pool hands them out.
    let mut order: Vec<usize> = (0..cold_heads * blocks).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    let mut group = c.benchmark_group("attention");
    group.throughput(Throughput::Bytes((4 * head_values) as u64));
    for n in [2usize, 16] {
        let queries: Vec<f32> = (0..n * ATTENTION_DIM)
            .map(|_| rng.gen_range(-0.1f32..0.1))
            .collect();
        let q = simd::Rows::new(&queries, ATTENTION_DIM, ATTENTION_DIM, n);
        let limits_all: Vec<usize> = (0..n).map(|i| ATTENTION_KEYS - n + 1 + i).collect();
        let mut sc = vec![0.0f32; n * ATTENTION_KEYS];
        let mut out = vec![0.0f32; n * ATTENTION_DIM];
        let mut here = vec![0usize; n];
        for temp in ["hot", "cold"] {
            let mut head = 0;
            group.bench_function(BenchmarkId::new(temp, format!("{n}q")), |b| {
                b.iter(|| {
                    head = next_head(temp, head, cold_heads);
                    let block_at = |kv: usize, b: usize| {
                        let slot = order[head * blocks + b];
                        let first = (2 * slot + kv) * block_values;
                        Cached::F16(&cache[..]).rows(
                            first,
                            ATTENTION_DIM,
                            ATTENTION_DIM,
                            ATTENTION_BLOCK,
                        )
                    };
                    for b in 0..blocks {
                        let first = b * ATTENTION_BLOCK;
                        for (h, &l) in here.iter_mut().zip(&limits_all) {
                            *h = l.saturating_sub(first).min(ATTENTION_BLOCK);
                        }
                        // The last key block is followed by the first value block.
                        let next = if b + 1 < blocks {
                            block_at(0, b + 1)
                        } else {
                            block_at(1, 0)
                        };
                        let keys = block_at(0, b).followed_by(next);
                        scores(q, keys, &here, &mut sc[first..], ATTENTION_KEYS);
                    }
                    for b in 0..blocks {
                        let first = b * ATTENTION_BLOCK;
                        for (h, &l) in here.iter_mut().zip(&limits_all) {
                            *h = l.saturating_sub(first).min(ATTENTION_BLOCK);
                        }
                        let p = simd::Rows::new(&sc[first..], ATTENTION_KEYS, ATTENTION_BLOCK, n);
                        sum_value_block(b, blocks, |b| block_at(1, b), p, &here, &mut out);
                    }
                    black_box(&out);
                })
            });
        }
    }
    group.finish();
}

/// The head a `hot` or `cold` benchmark reads next, after `head` of `heads`: always the
/// first (from cache), or each in turn (from DRAM).
fn next_head(temp: &str, head: usize, heads: usize) -> usize {
    match temp {
        "hot" => 0,
        _ => (head + 1) % heads,
    }
}

/// The weighted sums of value block `b` of a head's `blocks` (`block_at`, the next one
/// prefetched as it is read) onto `out` (fresh at block 0), as the engine sums a paged cache.
fn sum_value_block<'a>(
    b: usize,
    blocks: usize,
    block_at: impl Fn(usize) -> specula_kernels::attention::CachedRows<'a>,
    probs: simd::Rows<'_, f32>,
    limits: &[usize],
    out: &mut [f32],
) {
    use specula_kernels::attention::{weighted_sums, weighted_sums_onto};
    let mut values = block_at(b);
    if b + 1 < blocks {
        values = values.followed_by(block_at(b + 1));
    }
    if b == 0 {
        weighted_sums(probs, values, limits, out);
    } else {
        weighted_sums_onto(probs, values, limits, out);
    }
}

/// `key-scores/{f16,f16-groups,q8_0}/{hot,cold}/{n}q`: the scores alone of one key head over
/// 4,096 positions in blocks of 64, from an f16 cache by rows and in value-major groups
/// ([`f16_keys`]; f32 arithmetic both) and from a Q8_0 cache's interleaved keys (queries
/// quantised once per call, integer dot products: [`q8_keys`]);
/// `hot` and `cold` as in [`attention`]. Throughput in bytes of f16 keys (the same work).
fn key_scores(c: &mut Criterion) {
    use specula_kernels::attention::{scores, Cached};
    use specula_kernels::{f16_keys, q8_keys};
    let head_values = ATTENTION_KEYS * ATTENTION_DIM;
    let blocks = ATTENTION_KEYS / ATTENTION_BLOCK;
    let mut rng = StdRng::seed_from_u64(12);
    let cold_heads = (256 << 20) / (2 * head_values);
    let keys: Vec<f32> = (0..ATTENTION_DIM * 97)
        .map(|_| rng.gen_range(-1.0f32..1.0))
        .collect();
    let key = |p: usize| &keys[(p % 97) * ATTENTION_DIM..][..ATTENTION_DIM];
    let half: Vec<u16> = (0..cold_heads * head_values)
        .map(|i| specula_kernels::f16::from_f32(keys[i % keys.len()]))
        .collect();
    let q8_block = q8_keys::head_bytes(ATTENTION_DIM, ATTENTION_BLOCK);
    let mut q8 = vec![0u8; cold_heads * blocks * q8_block];
    for (b, region) in q8.chunks_exact_mut(q8_block).enumerate() {
        for slot in 0..ATTENTION_BLOCK {
            q8_keys::store(key(b + slot), region, slot);
        }
    }
    let f16_block = f16_keys::head_units(ATTENTION_DIM, ATTENTION_BLOCK);
    let mut grouped = vec![0u16; cold_heads * blocks * f16_block];
    for (b, region) in grouped.chunks_exact_mut(f16_block).enumerate() {
        for slot in 0..ATTENTION_BLOCK {
            f16_keys::store(key(b + slot), region, slot);
        }
    }
    let mut order: Vec<usize> = (0..cold_heads * blocks).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    let mut group = c.benchmark_group("key-scores");
    group.throughput(Throughput::Bytes((2 * head_values) as u64));
    for n in [2usize, 16] {
        let queries: Vec<f32> = (0..n * ATTENTION_DIM)
            .map(|_| rng.gen_range(-0.1f32..0.1))
            .collect();
        let q = simd::Rows::new(&queries, ATTENTION_DIM, ATTENTION_DIM, n);
        let mut quantized = vec![0u8; n * q8_keys::query_bytes(ATTENTION_DIM)];
        let mut sc = vec![0.0f32; n * ATTENTION_KEYS];
        let limits = vec![ATTENTION_BLOCK; n];
        for cache in ["f16", "f16-groups", "q8_0"] {
            for temp in ["hot", "cold"] {
                let mut head = 0;
                let id = BenchmarkId::new(format!("{cache}/{temp}"), format!("{n}q"));
                group.bench_function(id, |b| {
                    b.iter(|| {
                        head = next_head(temp, head, cold_heads);
                        let qb = q8_keys::query_bytes(ATTENTION_DIM);
                        if cache == "q8_0" {
                            q8_keys::quantize_queries(q, &mut quantized);
                        }
                        let qrows = simd::Rows::new(&quantized, qb, qb, n);
                        for b in 0..blocks {
                            let slot = order[head * blocks + b];
                            let out = &mut sc[b * ATTENTION_BLOCK..];
                            if cache == "q8_0" {
                                let region = &q8[slot * q8_block..][..q8_block];
                                let next = match order.get(head * blocks + b + 1) {
                                    Some(&s) if b + 1 < blocks => &q8[s * q8_block..][..q8_block],
                                    _ => &[],
                                };
                                q8_keys::scores(
                                    qrows,
                                    region,
                                    ATTENTION_BLOCK,
                                    next,
                                    out,
                                    ATTENTION_KEYS,
                                );
                            } else if cache == "f16-groups" {
                                let region = &grouped[slot * f16_block..][..f16_block];
                                let next = match order.get(head * blocks + b + 1) {
                                    Some(&s) if b + 1 < blocks => {
                                        &grouped[s * f16_block..][..f16_block]
                                    }
                                    _ => &[],
                                };
                                f16_keys::scores(
                                    q,
                                    region,
                                    ATTENTION_BLOCK,
                                    next,
                                    out,
                                    ATTENTION_KEYS,
                                );
                            } else {
                                let rows = |slot: usize| {
                                    Cached::F16(&half[..]).rows(
                                        slot * ATTENTION_BLOCK * ATTENTION_DIM,
                                        ATTENTION_DIM,
                                        ATTENTION_DIM,
                                        ATTENTION_BLOCK,
                                    )
                                };
                                let mut keys = rows(slot);
                                if b + 1 < blocks {
                                    keys = keys.followed_by(rows(order[head * blocks + b + 1]));
                                }
                                scores(q, keys, &limits, out, ATTENTION_KEYS);
                            }
                        }
                        black_box(&sc);
                    })
                });
            }
        }
    }
    group.finish();
}

/// `weighted-sums/{f16,q8_0}/{hot,cold}/{n}q`: the weighted sums alone of `n` queries (2: a
/// decode step's query heads of one key head, 16: an 8-row verify pass's, 64: a prefill
/// chunk's) over one value head of 4,096 positions in blocks of 64, block by block onto the
/// outputs as the engine sums a paged cache, from an f16 cache and a Q8_0 one (rows of
/// blocks); `hot` and `cold` as in [`attention`]. Throughput in bytes of f16 values.
fn weighted_sums(c: &mut Criterion) {
    use specula_kernels::attention::Cached;
    use specula_kernels::q8_0;
    let head_values = ATTENTION_KEYS * ATTENTION_DIM;
    let blocks = ATTENTION_KEYS / ATTENTION_BLOCK;
    let mut rng = StdRng::seed_from_u64(13);
    let cold_heads = (256 << 20) / (2 * head_values);
    let half: Vec<u16> = (0..cold_heads * head_values)
        .map(|_| specula_kernels::f16::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect();
    let row_bytes = ATTENTION_DIM / q8_0::BLOCK_VALUES * q8_0::BLOCK_BYTES;
    let mut blocks_q8 = vec![0u8; cold_heads * ATTENTION_KEYS * row_bytes];
    let mut row = vec![0.0f32; ATTENTION_DIM];
    for (bytes, values) in blocks_q8
        .chunks_exact_mut(row_bytes)
        .zip(half.chunks_exact(ATTENTION_DIM))
    {
        for (x, &h) in row.iter_mut().zip(values) {
            *x = specula_kernels::f16::to_f32(h);
        }
        q8_0::quantize_row(&row, bytes);
    }
    let mut order: Vec<usize> = (0..cold_heads * blocks).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    let mut group = c.benchmark_group("weighted-sums");
    group.throughput(Throughput::Bytes((2 * head_values) as u64));
    for n in [2usize, 16, 64] {
        let probs: Vec<f32> = (0..n * ATTENTION_KEYS)
            .map(|_| rng.gen_range(0.0f32..0.001))
            .collect();
        let limits = vec![ATTENTION_BLOCK; n];
        let mut out = vec![0.0f32; n * ATTENTION_DIM];
        for cache in ["f16", "q8_0"] {
            for temp in ["hot", "cold"] {
                let mut head = 0;
                let id = BenchmarkId::new(format!("{cache}/{temp}"), format!("{n}q"));
                group.bench_function(id, |b| {
                    b.iter(|| {
                        head = next_head(temp, head, cold_heads);
                        let block_at = |b: usize| {
                            let slot = order[head * blocks + b];
                            match cache {
                                "f16" => Cached::F16(&half[..]).rows(
                                    slot * ATTENTION_BLOCK * ATTENTION_DIM,
                                    ATTENTION_DIM,
                                    ATTENTION_DIM,
                                    ATTENTION_BLOCK,
                                ),
                                _ => Cached::Q8_0(&blocks_q8[..]).rows(
                                    slot * ATTENTION_BLOCK * row_bytes,
                                    row_bytes,
                                    row_bytes,
                                    ATTENTION_BLOCK,
                                ),
                            }
                        };
                        for b in 0..blocks {
                            let p = simd::Rows::new(
                                &probs[b * ATTENTION_BLOCK..],
                                ATTENTION_KEYS,
                                ATTENTION_BLOCK,
                                n,
                            );
                            sum_value_block(b, blocks, block_at, p, &limits, &mut out);
                        }
                        black_box(&out);
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = stream, matvec, matvec_cold, attention, key_scores, weighted_sums
}
criterion_main!(benches);
