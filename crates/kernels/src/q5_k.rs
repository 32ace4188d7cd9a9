//! Q5_K (ggml type 13): as [`crate::q4_k`] with a fifth bit per quant — super-blocks of 256
//! values in 8 sub-blocks of 32, 6-bit scales and mins under f16 `d` and `dmin`.
//!
//! Block layout (176 bytes, as ggml's `block_q5_K`):
//!
//! | bytes   | field    | meaning                                                         |
//! |---------|----------|-----------------------------------------------------------------|
//! | 0..2    | `d`      | scale of the sub-block scales, f16                              |
//! | 2..4    | `dmin`   | scale of the sub-block mins, f16                                |
//! | 4..16   | `scales` | eight 6-bit scales and mins, packed as in Q4_K                  |
//! | 16..48  | `qh`     | bit `j` of `qh[l]` is the fifth bit of value `l` of sub-block `j` |
//! | 48..176 | `qs`     | low 4 bits, packed as Q4_K's `qs` (chunk `c`: sub-blocks `2c`, `2c + 1`) |
//!
//! Value `l` of sub-block `j` is `d · sc_j · q - dmin · m_j` with `q` in `0 ..= 31`.
//!
//! Quantisation follows ggml's `quantize_row_q5_K_ref` (see [`crate::k_quants`]).
//! Activations are quantised to Q8_K; the dot product is described there.

use crate::k_quants::{self, KEncoding, SUPER_BLOCK_VALUES};
use crate::q4_k::dequantize_block_with_mins;
use crate::simd::{self, RowSumsEncoding, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;

/// Values per block.
pub const BLOCK_VALUES: usize = SUPER_BLOCK_VALUES;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 2 + 2 + 12 + BLOCK_VALUES / 8 + BLOCK_VALUES / 2;

/// The Q5_K entry of the weight-type table ([`crate::for_each_weight_type`]).
pub(crate) const INFO: TypeInfo = TypeInfo {
    ggml: crate::GgmlType::Q5K,
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
        row_sums: Some(RowSumsEncoding::KQuant(crate::k_quants::KEncoding::Q5K)),
    }),
    interleaved: Some(crate::interleaved::Encoding::Q5K),
};

/// Byte offset of the fifth bits.
const QH: usize = 16;
/// Byte offset of the low 4 bits.
const QS: usize = QH + BLOCK_VALUES / 8;

/// Quantises `x` (a whole number of blocks) into `out` (`x.len() / 256 * 176` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(x.len() % BLOCK_VALUES, 0, "q5_K row: not whole blocks");
    assert_eq!(
        out.len(),
        x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q5_K row: output size"
    );
    for (values, block) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        let (scales, d, dmin, levels) = k_quants::quantize_with_mins(values, 31, -0.5, 15);
        block[0..2].copy_from_slice(&d.to_le_bytes());
        block[2..4].copy_from_slice(&dmin.to_le_bytes());
        block[4..QH].copy_from_slice(&scales);
        block[QH..QS].fill(0);
        for c in 0..4 {
            for l in 0..32 {
                let (low, high) = (levels[64 * c + l], levels[64 * c + 32 + l]);
                block[QH + l] |= ((low >> 4) << (2 * c)) | ((high >> 4) << (2 * c + 1));
                block[QS + 32 * c + l] = (low & 0x0f) | ((high & 0x0f) << 4);
            }
        }
    }
}

/// The 256 levels (`0 ..= 31`) of a block, in value order.
#[inline]
pub(crate) fn levels(block: &[u8], out: &mut [u8; BLOCK_VALUES]) {
    for c in 0..4 {
        for l in 0..32 {
            let q = block[QS + 32 * c + l];
            let h = block[QH + l];
            out[64 * c + l] = (q & 0x0f) | (((h >> (2 * c)) & 1) << 4);
            out[64 * c + 32 + l] = (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4);
        }
    }
}

/// Decodes Q5_K `bytes` into `out` (a whole number of blocks), as ggml's
/// `dequantize_row_q5_K`: `(d · sc) · q - (dmin · m)` in f32.
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK_VALUES, 0, "q5_K row: not whole blocks");
    assert_eq!(
        bytes.len(),
        out.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q5_K row: input size"
    );
    for (block, values) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        dequantize_block_with_mins(block, values, levels);
    }
}

/// Dot product of a Q5_K weight row with a Q8_K-quantised activation row, at the process's
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
    k_quants::k_quant_dot_rows(KEncoding::Q5K, level, w, x, out);
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
    k_quants::k_quant_accumulate(KEncoding::Q5K, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`]: per super-block the exact integers `Σ_j sc_j · Σ q_w · q_x` and
/// `Σ_j m_j · bsum_j`, then `sum += (d_x · d) · isum - (d_x · dmin) · imin` in f32, in order.
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    k_quants::dot_with_mins_scalar(KEncoding::Q5K, w, x, levels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One block written byte by byte from the layout in ggml-common.h, decoded by hand.
    #[test]
    fn decodes_a_hand_built_block_as_the_spec_says() {
        let sc = [1u8, 2, 3, 63, 17, 40, 5, 63];
        let mn = [0u8, 1, 62, 4, 33, 9, 63, 16];
        let mut block = vec![0u8; BLOCK_BYTES];
        block[0..2].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        block[2..4].copy_from_slice(&0x3400u16.to_le_bytes()); // dmin = 0.25
        block[4..16].copy_from_slice(&[65, 130, 3, 255, 128, 1, 254, 68, 0x11, 0x98, 0xf5, 0x0f]);
        for l in 0..32 {
            block[16 + l] = (l * 37 % 256) as u8; // qh: bit j = fifth bit of value l of sub-block j
        }
        for c in 0..4 {
            for l in 0..32 {
                block[48 + 32 * c + l] = (l % 16) as u8 | ((15 - (l % 16) as u8) << 4);
            }
        }
        let mut values = vec![0.0; BLOCK_VALUES];
        dequantize_row(&block, &mut values);
        for (i, v) in values.iter().enumerate() {
            let (j, l) = (i / 32, i % 32);
            let low4 = if j % 2 == 0 { l % 16 } else { 15 - l % 16 };
            let fifth = ((l * 37 % 256) >> j) & 1;
            let q = (low4 + 16 * fifth) as f32;
            let expected = 0.5 * f32::from(sc[j]) * q - 0.25 * f32::from(mn[j]);
            assert_eq!(*v, expected, "value {i} (sub-block {j})");
        }
        // On paper: value 1 of sub-block 0 has qh[1] = 37 = 0b100101, bit 0 set: q = 1 + 16,
        // 0.5·1·17 - 0 = 8.5; value 33 (sub-block 1, l = 1): bit 1 clear, q = 14:
        // 0.5·2·14 - 0.25 = 13.75.
        assert_eq!((values[1], values[33]), (8.5, 13.75));
    }

    #[test]
    fn round_trip_error_is_bounded() {
        crate::k_quants::check_round_trip(
            quantize_row,
            dequantize_row,
            BLOCK_BYTES,
            0.04,
            1.5 / 31.0,
        );
    }
}
