//! Mat-vec throughput of every weight type, next to the machine's memory bandwidth.
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
            if interleave && !interleaved::supports(ty, simd::level()) {
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
                for n in [1, 8] {
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
        let repacked: Vec<InterleavedMatrix> = if interleaved::supports(ty, simd::level()) {
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
            for n in [1, 4, 8] {
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

criterion_group! {
    name = benches;
    config = config();
    targets = stream, matvec, matvec_cold
}
criterion_main!(benches);
