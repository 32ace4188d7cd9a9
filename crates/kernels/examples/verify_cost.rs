//! Scratch: matmul cost of n rows vs 1 row over a qwen3-0.6b-shaped stack of matrices.
use specula_kernels::{matmul, MatmulScratch, WeightMatrix, WeightType};
use std::time::Instant;

fn main() {
    let ty = match std::env::args().nth(1).as_deref() {
        Some("q8_0") => WeightType::Q8_0,
        Some("q6_k") => WeightType::Q6K,
        _ => WeightType::Q4K,
    };
    let threads: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2);
    let layers = 28;
    let shapes = [
        (2048, 1024),
        (1024, 1024),
        (1024, 1024),
        (1024, 2048),
        (3072, 1024),
        (3072, 1024),
        (1024, 3072),
    ];
    let mut mats: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    let distinct: Vec<f32> = (0..64 * 3072)
        .map(|i| (((i * 7919) % 1000) as f32 - 500.0) * 1e-4)
        .collect();
    for _ in 0..layers {
        for &(rows, cols) in &shapes {
            let enc = specula_kernels::quantize(ty.ggml(), &distinct[..64 * cols]);
            let rb = enc.len() / 64;
            let data: Vec<u8> = (0..rows)
                .flat_map(|r| enc[(r % 64) * rb..][..rb].to_vec())
                .collect();
            mats.push((rows, cols, data));
        }
    }
    let (rows, cols) = (151936, 1024);
    let enc = specula_kernels::quantize(ty.ggml(), &distinct[..64 * cols]);
    let rb = enc.len() / 64;
    let head: Vec<u8> = (0..rows)
        .flat_map(|r| enc[(r % 64) * rb..][..rb].to_vec())
        .collect();
    mats.push((rows, cols, head));
    let bytes: usize = mats.iter().map(|m| m.2.len()).sum();
    println!("{} MiB of {:?}", bytes >> 20, ty);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let x: Vec<f32> = (0..8 * 3072)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
        .collect();
    let mut out = vec![0.0; 8 * 151936];
    let mut scratch = MatmulScratch::new();
    let mut time = |n: usize| {
        let mut best = f64::MAX;
        for _ in 0..7 {
            let t = Instant::now();
            pool.install(|| {
                for (rows, cols, data) in &mats {
                    let w = WeightMatrix::new(ty, *rows, *cols, data).unwrap();
                    matmul(&w, &x[..n * cols], &mut out[..n * rows], &mut scratch);
                }
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    if let Some(n) = std::env::args().nth(3) {
        let n: usize = n.parse().unwrap();
        for _ in 0..3 {
            time(n);
        }
        return;
    }
    let one = time(1);
    println!(
        "n=1 {:.2} ms  {:.1} GB/s",
        one * 1e3,
        bytes as f64 / one / 1e9
    );
    for n in [2, 4, 8] {
        let t = time(n);
        println!("n={n} {:.2} ms ratio {:.2}", t * 1e3, t / one);
    }
}
