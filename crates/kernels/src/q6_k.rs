//! Q6_K (ggml type 14): super-blocks of 256 values in 16 groups of 16, each group with a
//! signed 8-bit scale under one f16 `d`; 6-bit quants offset by 32 (no mins).
//!
//! Block layout (210 bytes, as ggml's `block_q6_K`):
//!
//! | bytes    | field    | meaning                                                   |
//! |----------|----------|-----------------------------------------------------------|
//! | 0..128   | `ql`     | low 4 bits: two halves of 64 bytes, see below            |
//! | 128..192 | `qh`     | high 2 bits: two halves of 32 bytes                      |
//! | 192..208 | `scales` | 16 × `i8`, scale of group `g` (values `16g .. 16g + 16`) |
//! | 208..210 | `d`      | super-block scale, f16                                    |
//!
//! In half `h` (values `128h ..`), with `ql = ql[64h..]`, `qh = qh[32h..]` and `l < 32`: value
//! `l` is `ql[l] & 15 | (qh[l] & 3) << 4`, value `l + 32` is `ql[l + 32] & 15 | (qh[l] >> 2 & 3) << 4`,
//! value `l + 64` is `ql[l] >> 4 | (qh[l] >> 4 & 3) << 4`, and value `l + 96` is
//! `ql[l + 32] >> 4 | (qh[l] >> 6) << 4`. A value decodes to `d · scale_g · (q - 32)`.
//!
//! Quantisation follows ggml's `quantize_row_q6_K_ref`: a symmetric least-squares fit per
//! group (`make_qx_quants`), the group scales quantised to `i8` against the largest (which maps
//! to -128), then every value re-quantised against its stored scale. Activations are quantised
//! to Q8_K; the dot product per super-block is the exact integer
//! `Σ_g scale_g · Σ (q - 32) · q_x` (the offset applied through the Q8_K group sums in the SIMD
//! kernels), times `d_x · d`.

use crate::k_quants::{self, nearest_int, KEncoding, SUPER_BLOCK_VALUES};
use crate::simd::{self, RowSumsEncoding, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;
use crate::{f16, q8_k};

/// Values per block.
pub const BLOCK_VALUES: usize = SUPER_BLOCK_VALUES;
/// Bytes per block.
pub const BLOCK_BYTES: usize = BLOCK_VALUES / 2 + BLOCK_VALUES / 4 + BLOCK_VALUES / 16 + 2;

/// The Q6_K entry of the weight-type table ([`crate::for_each_weight_type`]).
pub(crate) const INFO: TypeInfo = TypeInfo {
    ggml: crate::GgmlType::Q6K,
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
        row_sums: Some(RowSumsEncoding::KQuant(crate::k_quants::KEncoding::Q6K)),
    }),
    interleaved: Some(crate::interleaved::Encoding::Q6K),
};

/// Byte offset of the high bits.
const QH: usize = BLOCK_VALUES / 2;
/// Byte offset of the group scales.
const SCALES: usize = QH + BLOCK_VALUES / 4;
/// Byte offset of `d`.
const D: usize = SCALES + BLOCK_VALUES / 16;

/// Quantises `x` (a whole number of blocks) into `out` (`x.len() / 256 * 210` bytes).
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(x.len() % BLOCK_VALUES, 0, "q6_K row: not whole blocks");
    assert_eq!(
        out.len(),
        x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q6_K row: output size"
    );
    for (values, block) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        quantize_block(values, block);
    }
}

fn quantize_block(x: &[f32], block: &mut [u8]) {
    // Levels 0 ..= 63 (quant + 32).
    let mut levels = [0i8; BLOCK_VALUES];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ((group, group_levels), slot) in x
        .chunks_exact(16)
        .zip(levels.chunks_exact_mut(16))
        .zip(&mut scales)
    {
        let scale = k_quants::make_qx_quants(32, group, group_levels);
        *slot = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    /// ggml's `GROUP_MAX_EPS`.
    const GROUP_MAX_EPS: f32 = 1e-15;
    if max_abs_scale < GROUP_MAX_EPS {
        block.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    block[D..D + 2].copy_from_slice(&d.to_le_bytes());
    let d = f16::to_f32(d);
    for g in 0..16 {
        let scale = nearest_int(iscale * scales[g]).min(127) as i8;
        block[SCALES + g] = scale as u8;
        let step = d * f32::from(scale);
        if step == 0.0 {
            continue; // keeps the fit's levels, as ggml does
        }
        for i in 16 * g..16 * (g + 1) {
            levels[i] = (nearest_int(x[i] / step).clamp(-32, 31) + 32) as i8;
        }
    }
    let level = |i: usize| levels[i] as u8;
    for h in 0..2 {
        let (base, ql, qh) = (128 * h, 64 * h, QH + 32 * h);
        for l in 0..32 {
            let q = [
                level(base + l),
                level(base + l + 32),
                level(base + l + 64),
                level(base + l + 96),
            ];
            block[ql + l] = (q[0] & 0x0f) | ((q[2] & 0x0f) << 4);
            block[ql + l + 32] = (q[1] & 0x0f) | ((q[3] & 0x0f) << 4);
            block[qh + l] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}

/// The 256 levels (`0 ..= 63`, i.e. quant + 32) of a block, in value order.
#[inline]
pub(crate) fn levels(block: &[u8], out: &mut [u8; BLOCK_VALUES]) {
    for h in 0..2 {
        let (base, ql, qh) = (128 * h, 64 * h, QH + 32 * h);
        for l in 0..32 {
            let (a, b, high) = (block[ql + l], block[ql + l + 32], block[qh + l]);
            out[base + l] = (a & 0x0f) | ((high & 3) << 4);
            out[base + l + 32] = (b & 0x0f) | (((high >> 2) & 3) << 4);
            out[base + l + 64] = (a >> 4) | (((high >> 4) & 3) << 4);
            out[base + l + 96] = (b >> 4) | ((high >> 6) << 4);
        }
    }
}

/// The 16 group scales of a block.
pub(crate) fn group_scales(block: &[u8]) -> [i8; 16] {
    std::array::from_fn(|g| block[SCALES + g] as i8)
}

/// The super-block scale `d` of a block.
pub(crate) fn scale_of(block: &[u8]) -> f32 {
    f16::to_f32(u16::from_le_bytes([block[D], block[D + 1]]))
}

/// Decodes Q6_K `bytes` into `out` (a whole number of blocks), as ggml's
/// `dequantize_row_q6_K`: `(d · scale) · (q - 32)` in f32.
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK_VALUES, 0, "q6_K row: not whole blocks");
    assert_eq!(
        bytes.len(),
        out.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q6_K row: input size"
    );
    let mut q = [0u8; BLOCK_VALUES];
    for (block, values) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        levels(block, &mut q);
        let d = scale_of(block);
        let scales = group_scales(block);
        for (i, v) in values.iter_mut().enumerate() {
            let group_scale = f32::from(scales[i / 16]);
            *v = (d * group_scale) * f32::from(q[i] as i8 - 32);
        }
    }
}

/// Dot product of a Q6_K weight row with a Q8_K-quantised activation row, at the process's
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
    k_quants::k_quant_dot_rows(KEncoding::Q6K, level, w, x, out);
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
    k_quants::k_quant_accumulate(KEncoding::Q6K, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`]: per super-block the exact integer
/// `Σ_g scale_g · Σ (q - 32) · q_x`, then `sum += (d_x · d) · isum` in f32, blocks in order.
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    k_quants::check_sizes(KEncoding::Q6K, crate::SimdLevel::Scalar, w.len(), x.len());
    let mut sum = 0.0f32;
    let mut q = [0u8; BLOCK_VALUES];
    for (wb, xb) in w
        .chunks_exact(BLOCK_BYTES)
        .zip(x.chunks_exact(q8_k::BLOCK_BYTES))
    {
        let (dx, xq, _) = q8_k::parts(xb);
        levels(wb, &mut q);
        let scales = group_scales(wb);
        let mut isum = 0i32;
        for (g, &scale) in scales.iter().enumerate() {
            let group: i32 = (16 * g..16 * (g + 1))
                .map(|i| (i32::from(q[i]) - 32) * i32::from(xq[i] as i8))
                .sum();
            isum += i32::from(scale) * group;
        }
        sum += (dx * scale_of(wb)) * isum as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One block written byte by byte from the layout in ggml-common.h, decoded by hand.
    #[test]
    fn decodes_a_hand_built_block_as_the_spec_says() {
        let scales: [i8; 16] = [
            -128, -1, 0, 1, 127, 5, -7, 64, 2, 3, -2, 9, 11, -11, 100, -100,
        ];
        let mut block = vec![0u8; BLOCK_BYTES];
        for (i, ql) in block[..128].iter_mut().enumerate() {
            *ql = (i * 7 % 256) as u8;
        }
        for (i, qh) in block[128..192].iter_mut().enumerate() {
            *qh = (i * 29 % 256) as u8;
        }
        for (g, s) in scales.iter().enumerate() {
            block[192 + g] = *s as u8;
        }
        block[208..210].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        let mut values = vec![0.0; BLOCK_VALUES];
        dequantize_row(&block, &mut values);
        for (i, v) in values.iter().enumerate() {
            // Half h, part p (which 32 of the 128), position l: low nibble of ql[64h + l]
            // (p = 0), of ql[64h + 32 + l] (p = 1), high nibble of those (p = 2, 3); bits
            // 2p, 2p + 1 of qh[32h + l] on top.
            let (h, p, l) = (i / 128, i % 128 / 32, i % 32);
            let ql = block[64 * h + 32 * (p % 2) + l];
            let low4 = if p < 2 { ql & 0x0f } else { ql >> 4 };
            let high2 = (block[128 + 32 * h + l] >> (2 * p)) & 3;
            let q = i32::from(low4 | (high2 << 4)) - 32;
            let expected = 0.5 * f32::from(scales[i / 16]) * q as f32;
            assert_eq!(*v, expected, "value {i}");
        }
        // On paper: value 0: ql[0] = 0, qh[0] = 0: q = -32, scale -128: 0.5·-128·-32 = 2048.
        // Value 64 (p = 2): ql[0] >> 4 = 0, qh[0] bits 4,5 = 0: q = -32, scale 127 (group 4):
        // -2032. Value 1: ql[1] = 7, qh[1] = 29 = 0b11101, bits 0,1 = 01: q = 7 + 16 - 32 = -9,
        // scale -128: 576.
        assert_eq!((values[0], values[64], values[1]), (2048.0, -2032.0, 576.0));
    }

    #[test]
    fn round_trip_error_is_bounded() {
        crate::k_quants::check_round_trip(
            quantize_row,
            dequantize_row,
            BLOCK_BYTES,
            0.02,
            1.0 / 50.0,
        );
    }
}
