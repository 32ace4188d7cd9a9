//! BF16 (ggml type 30): little-endian bfloat16 values (the top half of an f32), no blocks.
//!
//! Weight rows stay in bf16; the activation row stays f32. Widening is exact (a shift), and the
//! products are accumulated with the shared lane scheme of [`crate::f32`].

use crate::f32::{float_dot_rows, lane_dot, FloatEncoding};
use crate::simd::{self, Rows, SimdLevel};

/// Values per block (plain type).
pub const BLOCK_VALUES: usize = 1;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 2;

/// Widens bfloat16 `bits` to f32 (exact).
#[inline(always)]
pub fn to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Rounds `x` to bfloat16, to nearest with ties to even; NaN stays a (quiet) NaN.
/// Subnormals are kept, as current ggml does.
#[inline]
pub fn from_f32(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        ((u >> 16) | 0x40) as u16
    } else {
        // Cannot overflow: the largest non-NaN pattern, 0xff80_0000, plus 0x8000 fits in u32.
        ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }
}

/// Encodes `x` as little-endian bf16 into `out` (`2 * x.len()` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), x.len() * BLOCK_BYTES, "bf16 row: output size");
    for (dst, v) in out.chunks_exact_mut(BLOCK_BYTES).zip(x) {
        dst.copy_from_slice(&from_f32(*v).to_le_bytes());
    }
}

/// Decodes little-endian bf16 `bytes` into `out`.
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len() * BLOCK_BYTES, "bf16 row: input size");
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(BLOCK_BYTES)) {
        *dst = to_f32(u16::from_le_bytes([src[0], src[1]]));
    }
}

/// Dot product of a bf16 weight row with an f32 activation row, at the process's
/// [`simd::level`].
pub fn dot(w: &[u8], x: &[f32]) -> f32 {
    let mut out = [0.0];
    dot_rows(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every activation row of `x`, reading `w` once per pass of rows,
/// at `level` (which must be supported); row `b` is bit-identical to [`dot`] at that level.
pub fn dot_rows(level: SimdLevel, w: &[u8], x: Rows<'_, f32>, out: &mut [f32]) {
    float_dot_rows(FloatEncoding::BF16, level, w, x, out);
}

/// Adds weight rows (or column tiles of them) times each activation row into the pairs'
/// accumulators at a SIMD `level`: the tiled form of [`dot_rows`] used by the mat-vec.
pub(crate) fn accumulate(
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, f32>,
    acc: &mut [crate::simd::Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    crate::f32::float_accumulate(FloatEncoding::BF16, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`].
pub fn dot_scalar(w: &[u8], x: &[f32]) -> f32 {
    lane_dot::<BLOCK_BYTES>(w, x, |b| to_f32(u16::from_le_bytes(b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_dot_close, random_vec};

    #[test]
    fn rounding_matches_the_half_crate() {
        let x = random_vec(10_000, 1000.0, 31);
        for v in x
            .iter()
            .copied()
            .chain([0.0, -0.0, f32::MAX, f32::MIN_POSITIVE / 3.0])
        {
            assert_eq!(from_f32(v), half::bf16::from_f32(v).to_bits(), "{v}");
        }
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        assert!(to_f32(from_f32(f32::INFINITY)).is_infinite());
    }

    #[test]
    fn round_trip_error_is_within_half_an_ulp() {
        let x = random_vec(4096, 10.0, 32);
        let mut bytes = vec![0u8; x.len() * 2];
        quantize_row(&x, &mut bytes);
        let mut back = vec![0.0; x.len()];
        dequantize_row(&bytes, &mut back);
        for (a, b) in x.iter().zip(&back) {
            // 8 significant bits: relative error at most 2^-8.
            assert!((a - b).abs() <= a.abs() / 256.0, "{a} -> {b}");
        }
    }

    #[test]
    fn dot_matches_f64_reference_on_awkward_sizes() {
        for n in [0, 1, 7, 16, 17, 32, 33, 64, 96, 100, 4096 + 32, 4099] {
            let w = random_vec(n, 1.0, 40 + n as u64);
            let x = random_vec(n, 1.0, 41 + n as u64);
            let mut wb = vec![0u8; n * 2];
            quantize_row(&w, &mut wb);
            let mut w_rounded = vec![0.0; n];
            dequantize_row(&wb, &mut w_rounded);
            let reference: f64 = w_rounded
                .iter()
                .zip(&x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            assert_dot_close(dot(&wb, &x), reference, &w_rounded, &x, 0.0);
        }
    }
}
