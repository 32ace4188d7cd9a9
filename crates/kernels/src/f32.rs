//! F32 (ggml type 0): plain little-endian IEEE binary32 values, no blocks.
//!
//! Also home of the lane-accumulator scheme every floating-point dot product in this crate
//! shares: element `i` of a row is accumulated into lane `i % LANES` in row order, and the
//! lanes are summed by a fixed pairwise tree at the end. The result is therefore a fixed
//! function of the two rows, whatever the caller does around it, and the loop shape lets the
//! compiler vectorise it. A future hand-written SIMD path sits beside the scalar reference and
//! is chosen once per process, so a given machine always runs the same code for every row.

/// Values per block (plain type).
pub const BLOCK_VALUES: usize = 1;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 4;

/// Accumulator lanes of the floating-point dot products (one AVX-512 register of f32).
pub(crate) const LANES: usize = 16;

/// Encodes `x` as little-endian f32 into `out` (`4 * x.len()` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), x.len() * BLOCK_BYTES, "f32 row: output size");
    for (dst, v) in out.chunks_exact_mut(BLOCK_BYTES).zip(x) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

/// Decodes little-endian f32 `bytes` into `out`.
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len() * BLOCK_BYTES, "f32 row: input size");
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(BLOCK_BYTES)) {
        *dst = decode(src);
    }
}

#[inline(always)]
fn decode(bytes: &[u8]) -> f32 {
    f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Dot product of an encoded f32 weight row with an f32 activation row.
pub fn dot(w: &[u8], x: &[f32]) -> f32 {
    dot_scalar(w, x)
}

/// Scalar reference of [`dot`].
pub fn dot_scalar(w: &[u8], x: &[f32]) -> f32 {
    lane_dot::<BLOCK_BYTES>(w, x, f32::from_le_bytes)
}

/// Dot product of two f32 slices of equal length (attention scores), same lane scheme.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    let mut acc = [0.0f32; LANES];
    let a_chunks = a.chunks_exact(LANES);
    let b_chunks = b.chunks_exact(LANES);
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (ac, bc) in a_chunks.zip(b_chunks) {
        for lane in 0..LANES {
            acc[lane] += ac[lane] * bc[lane];
        }
    }
    for (lane, (av, bv)) in a_tail.iter().zip(b_tail).enumerate() {
        acc[lane] += av * bv;
    }
    reduce_lanes(acc)
}

/// `y += a * x`, element-wise (attention value accumulation).
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// The shared lane-accumulated dot product of a weight row stored as `SIZE`-byte elements
/// (decoded by `decode`) with an f32 row.
#[inline(always)]
pub(crate) fn lane_dot<const SIZE: usize>(
    w: &[u8],
    x: &[f32],
    decode: impl Fn([u8; SIZE]) -> f32,
) -> f32 {
    assert_eq!(
        w.len(),
        x.len() * SIZE,
        "dot: weight row and activation sizes differ"
    );
    let mut acc = [0.0f32; LANES];
    let w_chunks = w.chunks_exact(LANES * SIZE);
    let x_chunks = x.chunks_exact(LANES);
    let (w_tail, x_tail) = (w_chunks.remainder(), x_chunks.remainder());
    let element = |bytes: &[u8]| -> [u8; SIZE] {
        let mut e = [0u8; SIZE];
        e.copy_from_slice(bytes);
        e
    };
    for (wc, xc) in w_chunks.zip(x_chunks) {
        let mut wv = [0.0f32; LANES];
        for (lane, v) in wv.iter_mut().enumerate() {
            *v = decode(element(&wc[lane * SIZE..(lane + 1) * SIZE]));
        }
        for lane in 0..LANES {
            acc[lane] += wv[lane] * xc[lane];
        }
    }
    for (lane, (wb, xv)) in w_tail.chunks_exact(SIZE).zip(x_tail).enumerate() {
        acc[lane] += decode(element(wb)) * xv;
    }
    reduce_lanes(acc)
}

/// Sums the lanes by a fixed pairwise tree (lane i with lane i + width, halving the width).
#[inline(always)]
pub(crate) fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_dot_close, random_vec};

    #[test]
    fn round_trip_is_exact() {
        let x = random_vec(1000, 1.0, 1);
        let mut bytes = vec![0u8; x.len() * 4];
        quantize_row(&x, &mut bytes);
        let mut back = vec![0.0; x.len()];
        dequantize_row(&bytes, &mut back);
        assert_eq!(x, back);
    }

    #[test]
    fn dot_matches_f64_reference_on_awkward_sizes() {
        for n in [
            0,
            1,
            3,
            15,
            16,
            17,
            31,
            32,
            33,
            64,
            96,
            100,
            4096 + 32,
            4099,
        ] {
            let w = random_vec(n, 1.0, 2 + n as u64);
            let x = random_vec(n, 1.0, 3 + n as u64);
            let mut wb = vec![0u8; n * 4];
            quantize_row(&w, &mut wb);
            let reference: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert_dot_close(dot(&wb, &x), reference, &w, &x, 0.0);
            assert_dot_close(dot_f32(&w, &x), reference, &w, &x, 0.0);
            assert_eq!(dot(&wb, &x).to_bits(), dot_f32(&w, &x).to_bits(), "n={n}");
        }
    }
}
