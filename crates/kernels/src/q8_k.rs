//! Q8_K (ggml type 15): the activation format of the K-quant dot products — super-blocks of 256
//! values, an f32 scale, 256 signed bytes, and the sums of each group of 16 quants.
//!
//! Block layout (292 bytes, as ggml's `block_q8_K`):
//!
//! | bytes    | field   | meaning                                             |
//! |----------|---------|-----------------------------------------------------|
//! | 0..4     | `d`     | scale, f32 little-endian                            |
//! | 4..260   | `qs`    | 256 quants, `i8`; value `j` is `qs[j] * d`          |
//! | 260..292 | `bsums` | 16 × i16 little-endian: `bsums[g] = Σ qs[16g..16g+16]` |
//!
//! Quantisation follows ggml's `quantize_row_q8_K_ref`: the value of largest magnitude `max`
//! (sign kept) maps to `-127` (`iscale = -127 / max`), every value to
//! `min(127, nearest_int(iscale · x))` (ties to even), and `d = 1 / iscale`. An all-zero block
//! has `d = 0` and zero quants (and zero sums: ggml leaves its sums unwritten there).
//!
//! Q8_K is never a weight type here; [`crate::matvec`](mod@crate::matvec) quantises activation rows to it for
//! Q4_K, Q5_K and Q6_K weights, as ggml's `vec_dot_type` does.

use crate::k_quants::{nearest_int, SUPER_BLOCK_VALUES};
use crate::SimdLevel;

/// Values per block.
pub const BLOCK_VALUES: usize = SUPER_BLOCK_VALUES;
/// Bytes per block: f32 scale, 256 quants, 16 i16 sums.
pub const BLOCK_BYTES: usize = 4 + BLOCK_VALUES + 2 * BLOCK_VALUES / 16;

/// Byte offset of the quants in a block.
const QS: usize = 4;
/// Byte offset of the group sums in a block.
const BSUMS: usize = QS + BLOCK_VALUES;

/// Quantises `x` (a whole number of blocks) into `out` (`x.len() / 256 * 292` bytes).
///
/// Runs an AVX-512 version where the CPU has it (activation rows are quantised once per
/// mat-vec, on the critical path); it writes exactly the bytes of [`quantize_row_scalar`].
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    check_quantize_sizes(x, out);
    if crate::SimdLevel::best_supported() >= crate::SimdLevel::Avx512 {
        crate::simd::quantize_q8_k_row(x, out);
    } else {
        quantize_row_scalar(x, out);
    }
}

/// Scalar reference of [`quantize_row`] (ggml's `quantize_row_q8_K_ref`).
pub fn quantize_row_scalar(x: &[f32], out: &mut [u8]) {
    check_quantize_sizes(x, out);
    for (values, block) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        quantize_block(values, block);
    }
}

fn check_quantize_sizes(x: &[f32], out: &[u8]) {
    assert_eq!(x.len() % BLOCK_VALUES, 0, "q8_K row: not whole blocks");
    assert_eq!(
        out.len(),
        x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q8_K row: output size"
    );
}

/// Quantises one block of 256 values (the reference, also the SIMD version's fallback for
/// blocks holding a NaN).
pub(crate) fn quantize_block(values: &[f32], block: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in values {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        block.fill(0);
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in block[QS..BSUMS].iter_mut().zip(values) {
        *q = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for g in 0..BLOCK_VALUES / 16 {
        let sum: i32 = block[QS + 16 * g..QS + 16 * (g + 1)]
            .iter()
            .map(|&q| i32::from(q as i8))
            .sum();
        block[BSUMS + 2 * g..BSUMS + 2 * g + 2].copy_from_slice(&(sum as i16).to_le_bytes());
    }
    block[..QS].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

/// Bytes per block of the Q8_K activation format the kernels of `level` multiply
/// ([`widen_row`]): the plain block, except at AVX-512.
pub(crate) fn wide_block_bytes(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512 | SimdLevel::Amx => AVX512_WIDE_BLOCK_BYTES,
        _ => BLOCK_BYTES,
    }
}

/// AVX-512 activation block: the 256 quants, then the scale `d` as f32 in each of 16 lanes,
/// then `d · bsums[g]` (f32) for the 16 groups of 16. The kernel applies a super-block's
/// minimums (or Q6_K's offset) as one fused multiply-add of these against per-group weight
/// coefficients, and its scale without broadcasting: one load each per row and super-block.
pub(crate) const AVX512_WIDE_BLOCK_BYTES: usize = BLOCK_VALUES + 2 * 64;

/// Byte offset of the 16 repeated scales in an AVX-512 block.
pub(crate) const AVX512_SCALES: usize = BLOCK_VALUES;
/// Byte offset of the 16 scaled group sums in an AVX-512 block.
pub(crate) const AVX512_SCALED_SUMS: usize = BLOCK_VALUES + 64;

/// Converts a Q8_K row into the activation format of `level` (`bytes.len() / 292 ·`
/// [`wide_block_bytes`] bytes).
pub(crate) fn widen_row(level: SimdLevel, bytes: &[u8], wide: &mut [u8]) {
    let block_bytes = wide_block_bytes(level);
    debug_assert_eq!(wide.len(), bytes.len() / BLOCK_BYTES * block_bytes);
    if level < SimdLevel::Avx512 {
        wide.copy_from_slice(bytes);
        return;
    }
    for (src, dst) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(wide.chunks_exact_mut(block_bytes))
    {
        let (d, quants, sums) = parts(src);
        dst[..BLOCK_VALUES].copy_from_slice(quants);
        let (scales, scaled_sums) = dst[AVX512_SCALES..].split_at_mut(64);
        for lane in scales.chunks_exact_mut(4) {
            lane.copy_from_slice(&d.to_le_bytes());
        }
        for (lane, sum) in scaled_sums.chunks_exact_mut(4).zip(sums) {
            lane.copy_from_slice(&(d * f32::from(sum)).to_le_bytes());
        }
    }
}

/// Decodes Q8_K `bytes` into `out` (a whole number of blocks).
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK_VALUES, 0, "q8_K row: not whole blocks");
    assert_eq!(
        bytes.len(),
        out.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q8_K row: input size"
    );
    for (block, values) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        let (d, qs, _) = parts(block);
        for (v, &q) in values.iter_mut().zip(qs) {
            *v = f32::from(q as i8) * d;
        }
    }
}

/// A block's scale, quants (as stored bytes; reinterpret as `i8`) and group sums.
#[inline]
pub(crate) fn parts(block: &[u8]) -> (f32, &[u8], [i16; 16]) {
    let d = f32::from_le_bytes(block[..QS].try_into().unwrap());
    let bsums = std::array::from_fn(|g| {
        i16::from_le_bytes([block[BSUMS + 2 * g], block[BSUMS + 2 * g + 1]])
    });
    (d, &block[QS..BSUMS], bsums)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    /// The AVX-512 quantiser (where this CPU has it) writes the reference bytes on blocks with
    /// ties at every half step (max -127 makes the scale exactly 1), a repeated largest
    /// magnitude of both signs, zeros, subnormals, huge, infinite and NaN values.
    #[test]
    fn simd_quantisation_writes_the_reference_bytes() {
        let mut x = random_vec(256 * 3, 2.0, 9);
        x.extend((0..255).map(|i| i as f32 - 127.5).chain([-127.0]));
        let mut repeated = random_vec(256, 1.0, 10);
        repeated[40] = 3.0;
        repeated[41] = -3.0;
        repeated[200] = -3.0;
        x.extend(&repeated);
        repeated[40] = -3.0;
        repeated[41] = 3.0;
        x.extend(&repeated);
        x.extend([0.0; 256]);
        x.extend((0..256).map(|i| f32::from_bits(i + 1)));
        x.extend((0..256).map(|i| (i as f32 - 128.0) * 1e36));
        let mut special = random_vec(256, 1.0, 11);
        special[7] = f32::NEG_INFINITY;
        x.extend(&special);
        special[7] = f32::NAN;
        x.extend(&special);
        let mut fast = vec![0u8; x.len() / BLOCK_VALUES * BLOCK_BYTES];
        let mut scalar = fast.clone();
        quantize_row(&x, &mut fast);
        quantize_row_scalar(&x, &mut scalar);
        for (b, (f, s)) in fast
            .chunks_exact(BLOCK_BYTES)
            .zip(scalar.chunks_exact(BLOCK_BYTES))
            .enumerate()
        {
            assert_eq!(f, s, "block {b}");
        }
    }

    #[test]
    fn layout_rounding_and_sums_match_ggml_reference() {
        let mut x = [0.0f32; 256];
        x[7] = -254.0; // largest magnitude, negative: iscale = -127 / -254 = 0.5
        x[0] = 3.0; // 1.5 -> 2 (ties to even)
        x[1] = 5.0; // 2.5 -> 2
        x[2] = -1.0; // -0.5 -> 0
        x[16] = 254.0; // 127
        let mut q = vec![0u8; BLOCK_BYTES];
        quantize_row(&x, &mut q);
        let (d, qs, bsums) = parts(&q);
        assert_eq!(d, 2.0);
        assert_eq!(qs[0] as i8, 2);
        assert_eq!(qs[1] as i8, 2);
        assert_eq!(qs[2] as i8, 0);
        assert_eq!(qs[7] as i8, -127);
        assert_eq!(qs[16] as i8, 127);
        assert_eq!(bsums[0], 2 + 2 - 127);
        assert_eq!(bsums[1], 127);
        assert!(bsums[2..].iter().all(|&s| s == 0));
        // A positive maximum maps to -127 and d is negative.
        let mut y = [0.0f32; 256];
        y[3] = 10.0;
        quantize_row(&y, &mut q);
        let (d, qs, _) = parts(&q);
        assert_eq!(qs[3] as i8, -127);
        assert!(d < 0.0 && (d * -127.0 - 10.0).abs() < 1e-5);
        quantize_row(&[0.0; 256], &mut q);
        assert!(q.iter().all(|&b| b == 0));
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let x = random_vec(4 * 256, 5.0, 211);
        let mut q = vec![0u8; 4 * BLOCK_BYTES];
        quantize_row(&x, &mut q);
        let mut back = vec![0.0; x.len()];
        dequantize_row(&q, &mut back);
        for (values, restored) in x.chunks(256).zip(back.chunks(256)) {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let bound = amax / 127.0 * 0.5 * (1.0 + 1e-5);
            for (a, b) in values.iter().zip(restored) {
                assert!((a - b).abs() <= bound, "{a} -> {b} (bound {bound})");
            }
        }
    }
}
