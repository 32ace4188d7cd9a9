//! The decode loop does not allocate: once a `MatmulScratch` has seen a shape, further
//! `matmul` calls of every weight type (1 and 8 activation rows) and the attention helpers run
//! without touching the heap. With one thread that is exact. With two, rayon's work-stealing
//! deques occasionally grow or shrink their buffers (its allocation, not the kernels'), so the
//! test allows a few (0–2 observed, 16 allowed) over 160 parallel calls — not one per call.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use specula_kernels::{
    f32 as kf32, interleaved, matmul, quantize, InterleavedMatrix, MatmulScratch, Rows,
    WeightMatrix, WeightType,
};

/// The system allocator, counting allocations.
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steady_state_matmul_and_attention_do_not_allocate() {
    let (rows, cols) = (300, 512);
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
        .collect();
    let x: Vec<f32> = (0..8 * cols)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
        .collect();
    let weights: Vec<(WeightType, Vec<u8>)> = WeightType::ALL
        .iter()
        .map(|&ty| (ty, quantize(ty.ggml(), &values)))
        .collect();
    // The interleaved copies the engine multiplies where the level has a kernel for them.
    let repacked: Vec<InterleavedMatrix> = weights
        .iter()
        .filter(|(ty, _)| interleaved::supports(*ty))
        .map(|(ty, data)| {
            InterleavedMatrix::repack(&WeightMatrix::new(*ty, rows, cols, data).unwrap()).unwrap()
        })
        .collect();
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut scratch = MatmulScratch::new();
        let mut out = vec![0.0; 8 * rows];
        let mut scores = vec![0.0; 64];
        let mut attn = vec![0.0; 128];
        let keys: Vec<f32> = (0..64 * 128).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut run = |scratch: &mut MatmulScratch, out: &mut [f32]| {
            pool.install(|| {
                let plain = weights
                    .iter()
                    .map(|(ty, data)| WeightMatrix::new(*ty, rows, cols, data).unwrap());
                for w in plain.chain(repacked.iter().map(InterleavedMatrix::view)) {
                    for n in [1, 8] {
                        matmul(&w, &x[..n * cols], &mut out[..n * rows], scratch);
                    }
                }
            });
            let key_rows = Rows::new(&keys, 128, 128, 64);
            kf32::dot_f32_rows(&x[..128], key_rows, &mut scores);
            kf32::weighted_sum(&scores, key_rows, &mut attn);
        };
        run(&mut scratch, &mut out); // sizes the scratch
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        for _ in 0..10 {
            run(&mut scratch, &mut out);
        }
        let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
        let allowed = if threads == 1 { 0 } else { 16 };
        assert!(
            allocations <= allowed,
            "{threads} threads: {allocations} allocations in {} matmul calls",
            20 * (weights.len() + repacked.len())
        );
    }
}
