//! Q4_K (ggml type 12): super-blocks of 256 values in 8 sub-blocks of 32, each sub-block with
//! a 6-bit scale and a 6-bit min, under two f16 super-block scales; 4-bit quants.
//!
//! Block layout (144 bytes, as ggml's `block_q4_K`):
//!
//! | bytes   | field    | meaning                                                        |
//! |---------|----------|----------------------------------------------------------------|
//! | 0..2    | `d`      | scale of the sub-block scales, f16                             |
//! | 2..4    | `dmin`   | scale of the sub-block mins, f16                               |
//! | 4..16   | `scales` | eight 6-bit scales `sc_j` and mins `m_j` (see below)           |
//! | 16..144 | `qs`     | 4 chunks of 32 bytes: chunk `c` holds sub-block `2c` in the low nibbles and `2c + 1` in the high nibbles |
//!
//! Value `i` of sub-block `j` is `d · sc_j · q - dmin · m_j`. Scale bytes: for `j < 4`,
//! `sc_j = scales[j] & 63` and `m_j = scales[j + 4] & 63`; for `j ≥ 4`, the low 4 bits come
//! from `scales[j + 4]` (scale in the low nibble, min in the high one) and the top 2 bits from
//! the top bits of `scales[j - 4]` (scale) and `scales[j]` (min).
//!
//! Quantisation follows ggml's `quantize_row_q4_K_ref` (see [`crate::k_quants`]).
//! Activations are quantised to Q8_K; the dot product is described there.

use crate::f16;
use crate::k_quants::{self, KEncoding, SUPER_BLOCK_VALUES};
use crate::simd::{self, RowSumsEncoding, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;

/// Values per block.
pub const BLOCK_VALUES: usize = SUPER_BLOCK_VALUES;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 2 + 2 + 12 + BLOCK_VALUES / 2;

/// The Q4_K entry of the weight-type table ([`crate::for_each_weight_type`]).
pub(crate) const INFO: TypeInfo = TypeInfo {
    ggml: crate::GgmlType::Q4K,
    block_values: BLOCK_VALUES,
    block_bytes: BLOCK_BYTES,
    activation: ActivationFormat::Q8K,
    quantize_row,
    dequantize_row,
    kernels: Kernels::Quantized(TypeKernels {
        dot_scalar,
        dot_rows,
        accumulate,
        lanes: crate::k_quants::k_quant_lanes,
        row_sums: Some(RowSumsEncoding::KQuant(crate::k_quants::KEncoding::Q4K)),
    }),
    interleaved: Some(crate::interleaved::Encoding::Q4K),
};

/// Quantises `x` (a whole number of blocks) into `out` (`x.len() / 256 * 144` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(x.len() % BLOCK_VALUES, 0, "q4_K row: not whole blocks");
    assert_eq!(
        out.len(),
        x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q4_K row: output size"
    );
    for (values, block) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        let (scales, d, dmin, levels) = k_quants::quantize_with_mins(values, 15, -1.0, 20);
        block[0..2].copy_from_slice(&d.to_le_bytes());
        block[2..4].copy_from_slice(&dmin.to_le_bytes());
        block[4..16].copy_from_slice(&scales);
        for c in 0..4 {
            for l in 0..32 {
                block[16 + 32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
            }
        }
    }
}

/// The 256 levels (`0 ..= 15`) of a block, in value order.
#[inline]
pub(crate) fn levels(block: &[u8], out: &mut [u8; BLOCK_VALUES]) {
    for c in 0..4 {
        for l in 0..32 {
            let q = block[16 + 32 * c + l];
            out[64 * c + l] = q & 0x0f;
            out[64 * c + 32 + l] = q >> 4;
        }
    }
}

/// Decodes Q4_K `bytes` into `out` (a whole number of blocks), as ggml's
/// `dequantize_row_q4_K`: `(d · sc) · q - (dmin · m)` in f32.
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK_VALUES, 0, "q4_K row: not whole blocks");
    assert_eq!(
        bytes.len(),
        out.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q4_K row: input size"
    );
    for (block, values) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        dequantize_block_with_mins(block, values, levels);
    }
}

/// Shared by Q4_K and Q5_K: decodes one super-block given its level decoder.
pub(crate) fn dequantize_block_with_mins(
    block: &[u8],
    values: &mut [f32],
    levels_of: impl Fn(&[u8], &mut [u8; BLOCK_VALUES]),
) {
    let mut q = [0u8; BLOCK_VALUES];
    levels_of(block, &mut q);
    let d = f16::to_f32(u16::from_le_bytes([block[0], block[1]]));
    let dmin = f16::to_f32(u16::from_le_bytes([block[2], block[3]]));
    let (sc, mn) = k_quants::unpack_scales_mins(block[4..16].try_into().unwrap());
    dequantize_levels_with_mins(d, dmin, &sc, &mn, &q, values);
}

/// The value formula of Q4_K / Q5_K on decoded fields (super-block scales `d`, `dmin`,
/// sub-block scales and mins, the 256 levels in value order): value `i` of sub-block `j` is
/// `(d · sc_j) · q_i - dmin · m_j` in f32. Shared with the interleaved layout, whose decoded
/// rows must give the file's values bit for bit.
pub(crate) fn dequantize_levels_with_mins(
    d: f32,
    dmin: f32,
    sc: &[u8; 8],
    mn: &[u8; 8],
    q: &[u8; BLOCK_VALUES],
    values: &mut [f32],
) {
    for j in 0..8 {
        let step = d * f32::from(sc[j]);
        let offset = dmin * f32::from(mn[j]);
        for i in 32 * j..32 * (j + 1) {
            values[i] = step * f32::from(q[i]) - offset;
        }
    }
}

/// Dot product of a Q4_K weight row with a Q8_K-quantised activation row, at the process's
/// [`simd::level`].
pub fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut out = [0.0];
    dot_rows(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every Q8_K activation row of `x`, reading `w` once per pass of
/// rows, at `level` (which must be supported); row `b` is bit-identical to [`dot`] at that
/// level.
pub fn dot_rows(level: SimdLevel, w: &[u8], x: Rows<'_, u8>, out: &mut [f32]) {
    k_quants::k_quant_dot_rows(KEncoding::Q4K, level, w, x, out);
}

/// Adds weight rows (or runs of their blocks) times each activation row into the pairs'
/// accumulators at a SIMD `level`: the tiled form of [`dot_rows`] used by the mat-vec.
pub(crate) fn accumulate(
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [crate::simd::Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    k_quants::k_quant_accumulate(KEncoding::Q4K, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`]: per super-block the exact integers `Σ_j sc_j · Σ q_w · q_x` and
/// `Σ_j m_j · bsum_j`, then `sum += (d_x · d) · isum - (d_x · dmin) · imin` in f32, in order.
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    k_quants::dot_with_mins_scalar(KEncoding::Q4K, w, x, levels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One block written byte by byte from the layout in ggml-common.h, decoded by hand.
    #[test]
    fn decodes_a_hand_built_block_as_the_spec_says() {
        // Sub-block scales and mins (6 bits each), chosen to exercise the top-bit packing.
        let sc = [1u8, 2, 3, 63, 17, 40, 5, 63];
        let mn = [0u8, 1, 62, 4, 33, 9, 63, 16];
        let mut block = vec![0u8; BLOCK_BYTES];
        block[0..2].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        block[2..4].copy_from_slice(&0x3400u16.to_le_bytes()); // dmin = 0.25

        // scales[0..4]: sc0..3, top bits of sc4..7 (17 -> 01, 40 -> 10, 5 -> 00, 63 -> 11).
        // scales[4..8]: m0..3, top bits of m4..7 (33 -> 10, 9 -> 00, 63 -> 11, 16 -> 01).
        // scales[8..12]: low nibbles of sc4..7 | low nibbles of m4..7 << 4.
        let packed = [65u8, 130, 3, 255, 128, 1, 254, 68, 0x11, 0x98, 0xf5, 0x0f];
        block[4..16].copy_from_slice(&packed);
        for c in 0..4 {
            for l in 0..32 {
                block[16 + 32 * c + l] = (l % 16) as u8 | ((15 - (l % 16) as u8) << 4);
            }
        }
        let mut values = vec![0.0; BLOCK_VALUES];
        dequantize_row(&block, &mut values);
        for (i, v) in values.iter().enumerate() {
            let (j, l) = (i / 32, i % 32);
            // Even sub-blocks are low nibbles (l % 16), odd ones high nibbles (15 - l % 16).
            let q = if j % 2 == 0 { l % 16 } else { 15 - l % 16 } as f32;
            let expected = 0.5 * f32::from(sc[j]) * q - 0.25 * f32::from(mn[j]);
            assert_eq!(*v, expected, "value {i} (sub-block {j})");
        }
        // Spot checks worked out on paper: value 0 = 0.5·1·0 - 0 = 0; value 32 (sub-block 1,
        // q = 15) = 0.5·2·15 - 0.25·1 = 14.75; value 255 (sub-block 7, q = 0) = -4.
        assert_eq!((values[0], values[32], values[255]), (0.0, 14.75, -4.0));
        assert_eq!(crate::k_quants::pack_scales_mins(&sc, &mn), packed);
    }

    #[test]
    fn round_trip_error_is_bounded() {
        crate::k_quants::check_round_trip(
            quantize_row,
            dequantize_row,
            BLOCK_BYTES,
            0.08,
            1.0 / 15.0,
        );
    }

    #[test]
    fn quantiser_reproduces_exactly_representable_blocks() {
        // Values already on a Q4_K grid (d · sc · q - dmin · m with small integers) are
        // recovered within f16 rounding of the super-block scales.
        let x: Vec<f32> = (0..BLOCK_VALUES)
            .map(|i| (i % 16) as f32 * 0.25 - 1.0 - (i / 32) as f32 * 0.125)
            .collect();
        let mut q = vec![0u8; BLOCK_BYTES];
        quantize_row(&x, &mut q);
        let mut back = vec![0.0; BLOCK_VALUES];
        dequantize_row(&q, &mut back);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= 0.02, "{a} -> {b}");
        }
    }
}
