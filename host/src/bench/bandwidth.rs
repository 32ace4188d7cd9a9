//! A STREAM-style read-bandwidth measurement, so decode speed can be judged against the
//! machine's memory roofline in the same run.

use std::time::Instant;

/// Bytes/second of summing a buffer far larger than the caches with `threads` threads (best
/// of `reps` passes).
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let threads = threads.max(1);
    let words = bytes / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads);
    let mut best = f64::INFINITY;
    let mut checksum = 0u64;
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|scope| {
            let handles: Vec<_> = buffer
                .chunks(chunk)
                .map(|part| scope.spawn(move || sum_lanes(part)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        best = best.min(start.elapsed().as_secs_f64());
        checksum = checksum.wrapping_add(sums.iter().fold(0, |a, &b| a.wrapping_add(b)));
    }
    std::hint::black_box(checksum);
    (words * 8) as f64 / best
}

/// Sums with independent lanes so the loop is bound by loads, not by one add chain.
fn sum_lanes(part: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut chunks = part.chunks_exact(8);
    for c in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(c) {
            *lane = lane.wrapping_add(v);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, &b| a.wrapping_add(b));
    lanes.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

#[cfg(test)]
mod tests {
    #[test]
    fn measures_something_positive() {
        let bw = super::read_bandwidth(8 << 20, 2, 2);
        assert!(bw.is_finite() && bw > 0.0);
    }
}
