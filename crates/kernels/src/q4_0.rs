//! Q4_0 (ggml type 2): blocks of 32 values, each an f16 scale `d` and 32 four-bit quants.
//!
//! Block layout (18 bytes, as ggml's `block_q4_0`):
//!
//! | bytes  | field | meaning                                                          |
//! |--------|-------|------------------------------------------------------------------|
//! | 0..2   | `d`   | scale, IEEE binary16 little-endian                               |
//! | 2..18  | `qs`  | byte `j`: value `j` in the low nibble, value `j + 16` in the high |
//!
//! Value = `(nibble - 8) * d`, so quants span `-8 ..= 7`.
//!
//! Quantisation follows ggml's `quantize_row_q4_0_ref`: the value of largest magnitude `max`
//! (its sign kept) maps to `-8`, i.e. `d = max / -8`; each value becomes
//! `min(15, trunc(x / d + 8.5))` with the unrounded f32 `1 / d`, and `d` is stored as f16.
//!
//! Activations are quantised to Q8_0 (as ggml's `vec_dot_type` for Q4_0), and a block's dot is
//! the exact integer sum of `(q_w - 8) · q_x` times `d_w · d_x` in f32 — the same arithmetic
//! as [`crate::q8_0`], and the same kernels after the weights are decoded.

use crate::f16;
use crate::q8_0::{block32_dot_rows, scale, Block32Encoding};
use crate::simd::{self, RowSumsEncoding, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;

/// Values per block.
pub const BLOCK_VALUES: usize = 32;
/// Bytes per block: the f16 scale and 16 bytes of packed nibbles.
pub const BLOCK_BYTES: usize = 2 + BLOCK_VALUES / 2;

/// The Q4_0 entry of the weight-type table ([`crate::for_each_weight_type`]).
pub(crate) const INFO: TypeInfo = TypeInfo {
    ggml: crate::GgmlType::Q4_0,
    block_values: BLOCK_VALUES,
    block_bytes: BLOCK_BYTES,
    activation: ActivationFormat::Q8_0,
    quantize_row,
    dequantize_row,
    kernels: Kernels::Quantized(TypeKernels {
        dot_scalar,
        dot_rows,
        accumulate,
        lanes: crate::q8_0::block32_lanes,
        row_sums: Some(RowSumsEncoding::Block32(Block32Encoding::Q4_0)),
    }),
    interleaved: Some(crate::interleaved::Encoding::Q4_0),
};

/// Quantises `x` (a whole number of blocks) into `out` (`x.len() / 32 * 18` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(x.len() % BLOCK_VALUES, 0, "q4_0 row: not whole blocks");
    assert_eq!(
        out.len(),
        x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q4_0 row: output size"
    );
    for (values, block) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        quantize_block(values, block);
    }
}

fn quantize_block(values: &[f32], block: &mut [u8]) {
    // The first value of largest magnitude, sign kept (strict `<` as ggml: ties keep the first).
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in values {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
    block[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    // C's float -> int8 conversion truncates toward zero; `as i8` does too in range.
    let quant = |v: f32| ((v * inverse + 8.5) as i8).min(15) as u8;
    for j in 0..BLOCK_VALUES / 2 {
        block[2 + j] = quant(values[j]) | (quant(values[j + BLOCK_VALUES / 2]) << 4);
    }
}

/// Decodes Q4_0 `bytes` into `out` (a whole number of blocks).
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK_VALUES, 0, "q4_0 row: not whole blocks");
    assert_eq!(
        bytes.len(),
        out.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q4_0 row: input size"
    );
    for (block, values) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        let d = scale(block);
        let (low, high) = values.split_at_mut(BLOCK_VALUES / 2);
        for ((l, h), q) in low.iter_mut().zip(high).zip(&block[2..]) {
            *l = (i32::from(q & 0x0f) - 8) as f32 * d;
            *h = (i32::from(q >> 4) - 8) as f32 * d;
        }
    }
}

/// Dot product of a Q4_0 weight row with a Q8_0-quantised activation row (of the same number
/// of values), at the process's [`simd::level`].
pub fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut out = [0.0];
    dot_rows(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every Q8_0 activation row of `x`, reading `w` once per pass of
/// rows, at `level` (which must be supported); row `b` is bit-identical to [`dot`] at that
/// level.
pub fn dot_rows(level: SimdLevel, w: &[u8], x: Rows<'_, u8>, out: &mut [f32]) {
    block32_dot_rows(Block32Encoding::Q4_0, level, w, x, out);
}

/// Adds weight rows (or runs of their blocks) times each widened Q8_0 activation row
/// ([`crate::q8_0::widen_row`]) into the pairs' accumulators at a SIMD `level`: the tiled form
/// of [`dot_rows`] used by the mat-vec.
pub(crate) fn accumulate(
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [crate::simd::Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    crate::q8_0::block32_accumulate(Block32Encoding::Q4_0, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`]: per block the exact integer sum, times `d_w · d_x`, summed
/// over blocks in order in one f32.
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    let q8 = crate::q8_0::BLOCK_BYTES;
    assert_eq!(
        x.len() % q8,
        0,
        "q4_0 dot: activation is not whole Q8_0 blocks"
    );
    assert_eq!(
        w.len(),
        x.len() / q8 * BLOCK_BYTES,
        "q4_0 dot: row sizes differ"
    );
    let mut sum = 0.0f32;
    for (wb, xb) in w.chunks_exact(BLOCK_BYTES).zip(x.chunks_exact(q8)) {
        let xq = &xb[2..];
        let mut block_sum = 0i32;
        for (j, q) in wb[2..].iter().enumerate() {
            block_sum += (i32::from(q & 0x0f) - 8) * i32::from(xq[j] as i8);
            block_sum += (i32::from(q >> 4) - 8) * i32::from(xq[j + 16] as i8);
        }
        sum += block_sum as f32 * (scale(wb) * scale(xb));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    fn quantized(x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; x.len() / BLOCK_VALUES * BLOCK_BYTES];
        quantize_row(x, &mut out);
        out
    }

    fn dequantized(bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; bytes.len() / BLOCK_BYTES * BLOCK_VALUES];
        dequantize_row(bytes, &mut out);
        out
    }

    #[test]
    fn round_trip_error_is_within_one_step_per_block() {
        let x = random_vec(4096 + 32, 3.0, 151);
        let back = dequantized(&quantized(&x));
        for (values, restored) in x.chunks(32).zip(back.chunks(32)) {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // Half a step (amax / 16) inside the grid; the far end of the range (+8 · |d| is
            // not representable) may clamp to 7 steps: one whole step. Plus f16 rounding of d.
            let step = amax / 8.0;
            for (a, b) in values.iter().zip(restored) {
                let bound = if (a.abs() - amax).abs() < step / 2.0 {
                    step
                } else {
                    step / 2.0
                } + amax * (8.0 / 2048.0)
                    + 1e-6;
                assert!((a - b).abs() <= bound, "{a} -> {b} (bound {bound})");
            }
        }
    }

    #[test]
    fn block_layout_and_rounding_match_ggml_reference() {
        let mut x = [0.0f32; 32];
        x[3] = -16.0; // max magnitude, negative: d = -16 / -8 = 2, id = 0.5
        x[0] = 1.0; // 0.5 + 8.5 = 9.0 -> 9
        x[1] = 0.99; // 0.495 + 8.5 = 8.995 -> 8 (truncation, not rounding)
        x[16] = 14.0; // 7 + 8.5 = 15.5 -> 15 (value 7 * 2 = 14)
        x[17] = -3.0; // -1.5 + 8.5 = 7.0 -> 7
        x[18] = 15.9; // 7.95 + 8.5 = 16.45 -> 16 -> clamped to 15
        let q = quantized(&x);
        assert_eq!(q.len(), 18);
        assert_eq!(u16::from_le_bytes([q[0], q[1]]), 0x4000, "d = 2.0 in f16");
        assert_eq!(q[2], 9 | (15 << 4), "value 0 low nibble, value 16 high");
        assert_eq!(q[3], 8 | (7 << 4));
        assert_eq!(q[4], 8 | (15 << 4));
        assert_eq!(q[5] & 0x0f, 0, "-16 / 2 + 8.5 = 0.5 -> 0");
        let back = dequantized(&q);
        assert_eq!(back[3], -16.0);
        assert_eq!(back[16], 14.0);
        assert_eq!(back[0], 2.0);
        // A positive maximum gives a negative d.
        let mut y = [0.0f32; 32];
        y[5] = 8.0;
        let q = quantized(&y);
        assert_eq!(half::f16::from_le_bytes([q[0], q[1]]).to_f32(), -1.0);
        assert_eq!(dequantized(&q)[5], 8.0);
        // An all-zero block: d = 0 / -8 = -0 (stored as f16 -0, as ggml does), every quant 8.
        let zero = quantized(&[0.0; 32]);
        assert_eq!(u16::from_le_bytes([zero[0], zero[1]]), 0x8000);
        assert!(zero[2..].iter().all(|&b| b == 0x88));
    }

    #[test]
    fn dot_is_block_sums_times_scales_in_order() {
        let w = random_vec(96, 1.0, 170);
        let x = random_vec(96, 1.0, 171);
        let wq = quantized(&w);
        let mut xq = vec![0u8; 3 * 34];
        crate::q8_0::quantize_row(&x, &mut xq);
        let wd = dequantized(&wq);
        let mut expected = 0.0f32;
        for (b, xb) in xq.chunks(34).enumerate() {
            let dw = half::f16::from_le_bytes([wq[18 * b], wq[18 * b + 1]]).to_f32();
            let dx = half::f16::from_le_bytes([xb[0], xb[1]]).to_f32();
            let s: i32 = (0..32)
                .map(|j| (wd[32 * b + j] / dw).round() as i32 * i32::from(xb[2 + j] as i8))
                .sum();
            expected += s as f32 * (dw * dx);
        }
        assert_eq!(dot_scalar(&wq, &xq).to_bits(), expected.to_bits());
    }
}
