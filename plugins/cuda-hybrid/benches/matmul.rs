//! The GPU mat-vec / mat-mul kernels alone, on a real GPU: time per call (activation
//! quantisation included) and weight bytes read per second, for the weight types of a Q4_K_M
//! model and the matrix shapes of a Qwen3.5-2B-sized model, at k = 1, 2, 4, 8 activation rows.
//! The k = 1 figure against the GPU's memory bandwidth says how close decoding can get to its
//! roofline; k > 1 against k = 1 is the kernels' share of the verify cost ratio.
//!
//! Needs a GPU (it measures nothing on the emulator); without one it says so and exits (with
//! status 1 where `SPECULA_REQUIRE_GPU` is set, as the GPU tests fail then).
//! `cargo bench -p specula-cuda-hybrid --bench matmul`, or from the gpu-check kit
//! (`plugins/cuda-hybrid/gpu-check/run.sh kernels`).

use criterion::{BenchmarkId, Criterion, Throughput};
use specula_cuda_hybrid::gpu::ops::{self, Q8Scratch};
use specula_cuda_hybrid::gpu::weights::DevMatrix;
use specula_cuda_hybrid::gpu::Gpu;
use specula_gguf::GgmlType;

/// (name, rows, cols): Qwen3.5-2B's FFN gate/up and down, a GDN input projection, and the
/// tied LM head.
const SHAPES: [(&str, usize, usize); 4] = [
    ("ffn_up", 6144, 2048),
    ("ffn_down", 2048, 6144),
    ("gdn_qkv", 6144, 2048),
    ("lm_head", 248_320, 2048),
];
const TYPES: [GgmlType; 4] = [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q8_0];
const ROWS: [usize; 4] = [1, 2, 4, 8];
/// Calls queued per timed batch before waiting for the GPU, so launch latency overlaps.
const CALLS_PER_SYNC: u64 = 16;

/// Deterministic bytes (xorshift); random K-quant scales are fine for timing.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u8
        })
        .collect()
}

fn bench(c: &mut Criterion, gpu: &Gpu) {
    let max_k = *ROWS.iter().max().unwrap();
    let max_cols = SHAPES.iter().map(|s| s.2).max().unwrap();
    let max_rows = SHAPES.iter().map(|s| s.1).max().unwrap();
    let x: Vec<f32> = bytes(max_k * max_cols, 7)
        .iter()
        .map(|&b| f32::from(b) / 128.0 - 1.0)
        .collect();
    let dev_x = gpu.upload(&x).expect("activations");
    let out = gpu.zeros::<f32>(max_k * max_rows).expect("output");
    let q8 = Q8Scratch::new(gpu, max_k * max_cols).expect("scratch");
    for ty in TYPES {
        for (name, rows, cols) in SHAPES {
            let row_bytes = ty.row_bytes(cols).expect("whole blocks");
            let weights = gpu
                .upload(&bytes(rows * row_bytes, rows as u64))
                .expect("weights");
            let m = DevMatrix {
                ty,
                rows,
                cols,
                row_bytes,
                ptr: weights.ptr(),
            };
            let mut group = c.benchmark_group(format!("{}/{name}", ty.name()));
            group.throughput(Throughput::Bytes((rows * row_bytes) as u64));
            for k in ROWS {
                group.bench_function(BenchmarkId::new("rows", k), |b| {
                    b.iter_custom(|iters| {
                        let started = std::time::Instant::now();
                        for _ in 0..iters.div_ceil(CALLS_PER_SYNC) * CALLS_PER_SYNC {
                            ops::matmul(gpu, &m, dev_x.ptr(), k, out.ptr(), &q8).expect("matmul");
                        }
                        gpu.sync().expect("sync");
                        let calls = iters.div_ceil(CALLS_PER_SYNC) * CALLS_PER_SYNC;
                        started.elapsed().mul_f64(iters as f64 / calls as f64)
                    })
                });
            }
            group.finish();
        }
    }
}

fn main() {
    if let Err(why) = specula_cuda_hybrid::driver::usable_gpu() {
        // As the GPU tests: with SPECULA_REQUIRE_GPU set (the gpu-check kit), no GPU fails.
        if std::env::var_os("SPECULA_REQUIRE_GPU").is_some_and(|v| !v.is_empty() && v != "0") {
            eprintln!("the GPU kernel benchmark: SPECULA_REQUIRE_GPU is set, but: {why}");
            std::process::exit(1);
        }
        eprintln!("SKIPPED the GPU kernel benchmark: {why}");
        return;
    }
    let gpu = Gpu::open(0, None, false).expect("opening the GPU");
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &gpu);
    c.final_summary();
}
