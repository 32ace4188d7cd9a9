//! F16 (ggml type 1): little-endian IEEE binary16 values, no blocks.
//!
//! Weight rows stay in f16; the activation row stays f32. Each weight is widened exactly to f32
//! and the products are accumulated with the shared lane scheme of [`crate::f32`].

use crate::f32::{float_dot_rows, lane_dot, FloatEncoding};
use crate::simd::{self, Rows, SimdLevel};

/// Values per block (plain type).
pub const BLOCK_VALUES: usize = 1;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 2;

/// Widens binary16 `bits` to f32 exactly (normals, subnormals, ±0, ±inf, NaN).
///
/// Branch-free so that loops over it vectorise: all three cases are computed and one selected.
/// Subnormals are built as `2^-14 + m·2^-24` (a normal number) minus `2^-14`, which is exact
/// and never touches f32 subnormals (slow on some CPUs).
#[inline(always)]
pub fn to_f32(bits: u16) -> f32 {
    const EXP_MASK: u32 = 0x1f << 23; // the f16 exponent, once shifted into f32 position
    let sign = u32::from(bits & 0x8000) << 16;
    let shifted = u32::from(bits & 0x7fff) << 13;
    let exponent = shifted & EXP_MASK;
    let normal = f32::from_bits(shifted + (112 << 23)); // rebias 15 -> 127
    let subnormal_base = f32::from_bits(113 << 23); // 2^-14
    let subnormal = f32::from_bits(shifted + (113 << 23)) - subnormal_base;
    let inf_or_nan = f32::from_bits(shifted + (224 << 23)); // exponent 31 -> 255
    let magnitude = if exponent == EXP_MASK {
        inf_or_nan
    } else if exponent == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// Rounds `x` to binary16, to nearest with ties to even (as ggml's `GGML_FP32_TO_FP16`).
#[inline]
pub fn from_f32(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Encodes `x` as little-endian f16 into `out` (`2 * x.len()` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), x.len() * BLOCK_BYTES, "f16 row: output size");
    for (dst, v) in out.chunks_exact_mut(BLOCK_BYTES).zip(x) {
        dst.copy_from_slice(&from_f32(*v).to_le_bytes());
    }
}

/// Decodes little-endian f16 `bytes` into `out`.
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len() * BLOCK_BYTES, "f16 row: input size");
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(BLOCK_BYTES)) {
        *dst = to_f32(u16::from_le_bytes([src[0], src[1]]));
    }
}

/// Dot product of an f16 weight row with an f32 activation row, at the process's
/// [`simd::level`].
pub fn dot(w: &[u8], x: &[f32]) -> f32 {
    let mut out = [0.0];
    dot_rows(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every activation row of `x`, reading `w` once per pass of rows,
/// at `level` (which must be supported); row `b` is bit-identical to [`dot`] at that level.
pub fn dot_rows(level: SimdLevel, w: &[u8], x: Rows<'_, f32>, out: &mut [f32]) {
    float_dot_rows(FloatEncoding::F16, level, w, x, out);
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
    crate::f32::float_accumulate(FloatEncoding::F16, level, w, x, acc, prefetch_next);
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
    fn widening_matches_the_half_crate_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let ours = to_f32(bits);
            let theirs = half::f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn round_trip_error_is_within_half_an_ulp() {
        let x = random_vec(4096, 10.0, 11);
        let mut bytes = vec![0u8; x.len() * 2];
        quantize_row(&x, &mut bytes);
        let mut back = vec![0.0; x.len()];
        dequantize_row(&bytes, &mut back);
        for (a, b) in x.iter().zip(&back) {
            // 11 significant bits: relative error at most 2^-11 (normal range).
            assert!(
                (a - b).abs() <= a.abs() * (1.0 / 2048.0) + 1e-7,
                "{a} -> {b}"
            );
        }
        // Values exactly representable survive unchanged, and rounding is to nearest even.
        assert_eq!(to_f32(from_f32(1.0 + 1.0 / 2048.0)), 1.0);
        assert_eq!(to_f32(from_f32(1.0 + 3.0 / 2048.0)), 1.0 + 4.0 / 2048.0);
        assert_eq!(to_f32(from_f32(65504.0)), 65504.0);
        assert!(to_f32(from_f32(1e6)).is_infinite());
    }

    #[test]
    fn dot_matches_f64_reference_on_awkward_sizes() {
        for n in [0, 1, 7, 16, 17, 32, 33, 64, 96, 100, 4096 + 32, 4099] {
            let w = random_vec(n, 1.0, 20 + n as u64);
            let x = random_vec(n, 1.0, 21 + n as u64);
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
