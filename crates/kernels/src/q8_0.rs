//! Q8_0 (ggml type 8): blocks of 32 values, each an f16 scale `d` and 32 signed bytes.
//!
//! Block layout (34 bytes, as ggml's `block_q8_0`):
//!
//! | bytes  | field | meaning                                   |
//! |--------|-------|-------------------------------------------|
//! | 0..2   | `d`   | scale, IEEE binary16 little-endian        |
//! | 2..34  | `qs`  | 32 quants, `i8`; value `j` is `qs[j] * d` |
//!
//! Quantisation follows ggml's reference `quantize_row_q8_0_ref`: `d = amax / 127`, the quants
//! are `round(x * (1/d))` (ties away from zero) with the unrounded f32 `d`, and `d` is then
//! stored as f16. A Q8_0 weight row is multiplied with an activation row quantised the same
//! way (once per input row, see [`crate::matvec`](mod@crate::matvec)), block by block as
//! `ggml_vec_dot_q8_0_q8_0`: an exact integer sum per block, times `d_w * d_x` in f32. The
//! scalar reference sums the blocks in order in one f32; the SIMD kernels (shared with Q4_0,
//! see `block32_dot_rows`) fuse each block into 8 f32 lanes and sum the lanes at the end.

use crate::f16;
use crate::simd::{self, Accumulator, RowSumsEncoding, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;

/// Values per block.
pub const BLOCK_VALUES: usize = 32;
/// Bytes per block: the f16 scale and 32 quants.
pub const BLOCK_BYTES: usize = 2 + BLOCK_VALUES;

/// The Q8_0 entry of the weight-type table ([`crate::for_each_weight_type`]).
pub(crate) const INFO: TypeInfo = TypeInfo {
    ggml: crate::GgmlType::Q8_0,
    block_values: BLOCK_VALUES,
    block_bytes: BLOCK_BYTES,
    activation: ActivationFormat::Q8_0,
    quantize_row,
    dequantize_row,
    kernels: Kernels::Quantized(TypeKernels {
        dot_scalar,
        dot_rows,
        accumulate,
        lanes: block32_lanes,
        row_sums: Some(RowSumsEncoding::Block32(Block32Encoding::Q8_0)),
    }),
    interleaved: Some(crate::interleaved::Encoding::Q8_0),
};

/// Quantises `x` (a whole number of blocks) into `out` (`x.len() / 32 * 34` bytes).
///
/// Runs an AVX-512 version where the CPU has it (activation rows are quantised once per
/// mat-vec, on the critical path); it writes exactly the bytes of [`quantize_row_scalar`].
pub fn quantize_row(x: &[f32], out: &mut [u8]) {
    check_quantize_sizes(x, out);
    if SimdLevel::best_supported() >= SimdLevel::Avx512 {
        simd::quantize_q8_0_row(x, out);
    } else {
        quantize_row_scalar(x, out);
    }
}

/// Scalar reference of [`quantize_row`] (ggml's `quantize_row_q8_0_ref`).
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
    assert_eq!(x.len() % BLOCK_VALUES, 0, "q8_0 row: not whole blocks");
    assert_eq!(
        out.len(),
        x.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q8_0 row: output size"
    );
}

/// Quantises one block of 32 values (the reference, also the SIMD version's fallback for
/// blocks holding a NaN).
#[inline]
pub(crate) fn quantize_block(values: &[f32], block: &mut [u8]) {
    // ggml's MAX(amax, |v|) keeps the comparison order, so NaNs land as they do in ggml.
    let amax = values.iter().fold(
        0.0f32,
        |amax, v| if amax > v.abs() { amax } else { v.abs() },
    );
    let d = amax / 127.0;
    let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
    block[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, v) in block[2..].iter_mut().zip(values) {
        *q = round_half_away(v * inverse) as i8 as u8;
    }
}

/// C's `roundf`: to nearest, ties away from zero, as an integer (for `|v| < 2^31`; `f32::round`
/// is a library call without SSE4.1). Exact: truncation, then the fraction `|v| - trunc` is
/// exactly representable and compared with one half.
#[inline]
pub(crate) fn round_half_away(v: f32) -> i32 {
    let magnitude = v.abs();
    let whole = magnitude as i32;
    // Wrapping: an infinite `v` (a block too small for `1 / d` to be finite) comes out as
    // `i32::MIN` in every build profile, whose low byte — the quant — is 0, as the SIMD
    // quantiser's.
    let rounded = whole.wrapping_add(i32::from(magnitude - whole as f32 >= 0.5));
    if v < 0.0 {
        rounded.wrapping_neg()
    } else {
        rounded
    }
}

/// Decodes Q8_0 `bytes` into `out` (a whole number of blocks).
///
/// Runs an AVX-512 or AVX2 version at those [`simd::level`]s (a Q8_0 KV cache's values are
/// read through this, for every position of every step); it gives exactly the values of
/// [`dequantize_row_scalar`].
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    match simd::level() {
        SimdLevel::Scalar => dequantize_row_scalar(bytes, out),
        level => simd::dequantize_q8_0_row(level, bytes, out),
    }
}

/// Scalar reference of [`dequantize_row`]: each quant times the block's scale.
pub fn dequantize_row_scalar(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK_VALUES, 0, "q8_0 row: not whole blocks");
    assert_eq!(
        bytes.len(),
        out.len() / BLOCK_VALUES * BLOCK_BYTES,
        "q8_0 row: input size"
    );
    for (block, values) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        let d = scale(block);
        for (v, q) in values.iter_mut().zip(&block[2..]) {
            *v = f32::from(*q as i8) * d;
        }
    }
}

/// The f16 scale at the start of a Q8_0 (or Q4_0) block, as f32.
#[inline(always)]
pub(crate) fn scale(block: &[u8]) -> f32 {
    f16::to_f32(u16::from_le_bytes([block[0], block[1]]))
}

/// Dot product of a Q8_0 weight row with a Q8_0-quantised activation row, at the process's
/// [`simd::level`].
pub fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut out = [0.0];
    dot_rows(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every Q8_0 activation row of `x`, reading `w` once per pass of
/// rows, at `level` (which must be supported); row `b` is bit-identical to [`dot`] at that
/// level.
pub fn dot_rows(level: SimdLevel, w: &[u8], x: Rows<'_, u8>, out: &mut [f32]) {
    block32_dot_rows(Block32Encoding::Q8_0, level, w, x, out);
}

/// The weight encodings with 32-value blocks that multiply Q8_0 activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Block32Encoding {
    Q8_0,
    Q4_0,
}

impl Block32Encoding {
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Block32Encoding::Q8_0 => BLOCK_BYTES,
            Block32Encoding::Q4_0 => crate::q4_0::BLOCK_BYTES,
        }
    }

    fn scalar_dot(self) -> fn(&[u8], &[u8]) -> f32 {
        match self {
            Block32Encoding::Q8_0 => dot_scalar,
            Block32Encoding::Q4_0 => crate::q4_0::dot_scalar,
        }
    }
}

/// The multi-input dot product of a Q8_0 / Q4_0 weight row with Q8_0 activation rows: checks
/// sizes and `level`, then runs the level's kernel over the whole row (the scalar level runs
/// the reference per row). SIMD levels widen the activation rows first ([`widen_row`]), a run
/// of blocks at a time on the stack.
pub(crate) fn block32_dot_rows(
    encoding: Block32Encoding,
    level: SimdLevel,
    w: &[u8],
    x: Rows<'_, u8>,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        x.count(),
        "dot_rows: one output per activation row"
    );
    if level == SimdLevel::Scalar {
        check_block32_sizes(encoding, level, w.len(), x.len());
        let scalar = encoding.scalar_dot();
        for (b, o) in out.iter_mut().enumerate() {
            *o = scalar(w, x.row(b));
        }
        return;
    }
    let wide_block = wide_block_bytes(level);
    check_block32_sizes(encoding, level, w.len(), x.len() / BLOCK_BYTES * wide_block);
    let format = simd::WidenedFormat {
        plain_block: BLOCK_BYTES,
        wide_block,
        weight_block: encoding.block_bytes(),
    };
    simd::widened_accumulate_and_sum(
        w,
        x,
        out,
        block32_lanes(level),
        format,
        |plain, wide| widen_row(level, plain, wide),
        |w, x, acc| block32_accumulate(encoding, level, Rows::single(w), x, acc, None),
    );
}

/// Accumulator lanes of the 32-value block kernels at a SIMD `level`: 8 at AVX2, 16 at AVX-512
/// (two blocks per register: even blocks in lanes 0..8, odd blocks in lanes 8..16).
pub(crate) fn block32_lanes(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512 | SimdLevel::Amx => 16,
        _ => 8,
    }
}

/// Bytes per block of the Q8_0 activation format the SIMD kernels multiply ([`widen_row`]).
pub(crate) fn wide_block_bytes(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Scalar => BLOCK_BYTES,
        SimdLevel::Avx2 => AVX2_WIDE_BLOCK_BYTES,
        SimdLevel::Avx512 | SimdLevel::Amx => AVX512_WIDE_BLOCK_BYTES,
    }
}

/// AVX2 activation block: the scale as f32 (the f16 value, converted exactly), then the 32
/// quants.
pub(crate) const AVX2_WIDE_BLOCK_BYTES: usize = 4 + BLOCK_VALUES;

/// AVX-512 activation blocks, laid out by pairs of blocks (`2p`, `2p + 1`) in 128 bytes: the
/// 64 quants offset to unsigned (`q + 128`, the unsigned operand of `vpdpbusd`; the weights
/// stay signed and the kernel subtracts `128 · Σ w`), then each block's scale as f32 repeated
/// over the 8 accumulator lanes of its block. A row's odd last block is 32 quants and 8 scales.
/// One load each for quants and scales per pair and row: nothing is shuffled per row.
pub(crate) const AVX512_WIDE_BLOCK_BYTES: usize = 64;

/// Converts a Q8_0 row into the activation format of `level` (`bytes.len() / 34 ·`
/// [`wide_block_bytes`] bytes): the same values, with the scales stored as f32 so the kernels
/// do not convert them once per weight row.
pub(crate) fn widen_row(level: SimdLevel, bytes: &[u8], wide: &mut [u8]) {
    let block_bytes = wide_block_bytes(level);
    debug_assert_eq!(wide.len(), bytes.len() / BLOCK_BYTES * block_bytes);
    match level {
        SimdLevel::Scalar => wide.copy_from_slice(bytes),
        SimdLevel::Avx2 => {
            for (src, dst) in bytes
                .chunks_exact(BLOCK_BYTES)
                .zip(wide.chunks_exact_mut(block_bytes))
            {
                dst[..4].copy_from_slice(&scale(src).to_le_bytes());
                dst[4..].copy_from_slice(&src[2..]);
            }
        }
        SimdLevel::Avx512 | SimdLevel::Amx => {
            for (pair, dst) in bytes
                .chunks(2 * BLOCK_BYTES)
                .zip(wide.chunks_mut(2 * block_bytes))
            {
                let blocks = pair.len() / BLOCK_BYTES;
                let (quants, scales) = dst.split_at_mut(blocks * BLOCK_VALUES);
                for (i, src) in pair.chunks_exact(BLOCK_BYTES).enumerate() {
                    for (q, v) in quants[i * BLOCK_VALUES..][..BLOCK_VALUES]
                        .iter_mut()
                        .zip(&src[2..])
                    {
                        *q = v ^ 0x80;
                    }
                    let d = scale(src).to_le_bytes();
                    for lane in scales[i * 32..][..32].chunks_exact_mut(4) {
                        lane.copy_from_slice(&d);
                    }
                }
            }
        }
    }
}

/// Checks that `w` and activation rows of `wide_len` bytes in `level`'s format
/// ([`wide_block_bytes`]) hold the same whole number of blocks.
pub(crate) fn check_block32_sizes(
    encoding: Block32Encoding,
    level: SimdLevel,
    w_len: usize,
    wide_len: usize,
) {
    let block = wide_block_bytes(level);
    assert_eq!(
        wide_len % block,
        0,
        "dot: activation row is not whole Q8_0 blocks"
    );
    assert_eq!(
        w_len,
        wide_len / block * encoding.block_bytes(),
        "dot: weight row and activation sizes differ"
    );
}

/// Adds Q8_0 / Q4_0 weight rows (or runs of blocks, starting at an even block of the row)
/// times each widened Q8_0 activation row ([`widen_row`], the same blocks) into the pairs'
/// accumulators, at a SIMD `level` (checked to be supported).
pub(crate) fn block32_accumulate(
    encoding: Block32Encoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    simd::block32_accumulate(encoding, level, w, x, acc, prefetch_next);
}

/// Adds weight rows (or runs of their blocks) times each widened activation row
/// ([`widen_row`]) into the pairs' accumulators at a SIMD `level`: the tiled form of
/// [`dot_rows`] used by the mat-vec.
pub(crate) fn accumulate(
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    block32_accumulate(Block32Encoding::Q8_0, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`].
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    assert_eq!(w.len(), x.len(), "q8_0 dot: row sizes differ");
    assert_eq!(w.len() % BLOCK_BYTES, 0, "q8_0 dot: not whole blocks");
    let mut sum = 0.0f32;
    for (wb, xb) in w.chunks_exact(BLOCK_BYTES).zip(x.chunks_exact(BLOCK_BYTES)) {
        let block_sum: i32 = wb[2..]
            .iter()
            .zip(&xb[2..])
            .map(|(&a, &b)| i32::from(a as i8) * i32::from(b as i8))
            .sum();
        sum += block_sum as f32 * (scale(wb) * scale(xb));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    /// Blocks that stress the quantiser: random, ties at every half step (amax 127 makes
    /// the scale exactly 1), all zero, subnormal, huge, infinite and NaN values.
    fn awkward_blocks() -> Vec<f32> {
        let mut x = random_vec(32 * 8, 3.0, 5);
        let ties: Vec<f32> = (0..31)
            .map(|i| i as f32 * 4.0 - 61.5)
            .chain([127.0])
            .collect();
        x.extend(&ties);
        x.extend(ties.iter().map(|v| -v));
        x.extend([0.0; 32]);
        x.extend((0..32).map(|i| f32::from_bits(i + 1) * if i % 2 == 0 { 1.0 } else { -1.0 }));
        x.extend((0..32).map(|i| (i as f32 - 16.0) * 1e36));
        let mut special = random_vec(32, 1.0, 6);
        special[3] = f32::INFINITY;
        x.extend(&special);
        special[3] = f32::NAN;
        x.extend(&special);
        special[3] = 0.5;
        special[31] = f32::NAN;
        x.extend(&special);
        x
    }

    #[test]
    fn simd_quantisation_writes_the_reference_bytes() {
        let x = awkward_blocks();
        let mut scalar = vec![0u8; x.len() / BLOCK_VALUES * BLOCK_BYTES];
        quantize_row_scalar(&x, &mut scalar);
        assert_eq!(quantized(&x), scalar);
        // The ties really are ties: 2.5 rounds away from zero.
        let tie_block = &scalar[8 * BLOCK_BYTES..9 * BLOCK_BYTES];
        assert_eq!(tie_block[2] as i8, -62);
    }

    /// The SIMD dequantisers (every supported level) give the reference's bits, on the
    /// awkward blocks (NaN, infinite and subnormal scales, quants of -128) at every length up
    /// to 11 blocks.
    #[test]
    fn simd_dequantisation_gives_the_reference_values() {
        let mut bytes = quantized(&awkward_blocks());
        // Scales a quantiser never writes: NaN, infinity, subnormal; quants of -128.
        for (i, scale) in [0x7e00u16, 0x7c00, 0x0001].into_iter().enumerate() {
            bytes[i * BLOCK_BYTES..][..2].copy_from_slice(&scale.to_le_bytes());
        }
        bytes[3 * BLOCK_BYTES + 2..4 * BLOCK_BYTES].fill(0x80);
        for blocks in 1..=11.min(bytes.len() / BLOCK_BYTES) {
            let row = &bytes[..blocks * BLOCK_BYTES];
            let mut want = vec![0.0; blocks * BLOCK_VALUES];
            dequantize_row_scalar(row, &mut want);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dequantized(row)), bits(&want), "{blocks} blocks");
            for level in SimdLevel::supported().filter(|&l| l != SimdLevel::Scalar) {
                let mut got = vec![f32::NAN; want.len()];
                simd::dequantize_q8_0_row(level, row, &mut got);
                assert_eq!(bits(&got), bits(&want), "{level:?}, {blocks} blocks");
            }
        }
    }

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
    fn round_trip_error_is_within_half_a_step_per_block() {
        let x = random_vec(4096 + 32, 3.0, 51);
        let back = dequantized(&quantized(&x));
        for (values, restored) in x.chunks(32).zip(back.chunks(32)) {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // Half a quantisation step, plus the f16 rounding of d (2^-11 relative) times 127.
            let bound = amax / 127.0 * 0.5 + amax * (1.0 / 2048.0) + 1e-6;
            for (a, b) in values.iter().zip(restored) {
                assert!((a - b).abs() <= bound, "{a} -> {b} (bound {bound})");
            }
        }
    }

    #[test]
    fn round_half_away_equals_roundf() {
        let mut v = -200.0f32;
        while v < 200.0 {
            for x in [v, v + 0.5, v + 0.499_999_97, v.next_up(), v.next_down()] {
                assert_eq!(round_half_away(x), x.round() as i32, "{x}");
            }
            v += 0.731;
        }
        for x in [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -2.5,
            127.49,
            8_388_607.5,
            f32::NAN,
        ] {
            assert_eq!(round_half_away(x), x.round() as i32, "{x}");
        }
    }

    #[test]
    fn block_layout_and_rounding_match_ggml_reference() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0; // amax -> d = 1, id = 1
        x[1] = -2.5; // ties round away from zero
        x[2] = 2.5;
        x[3] = 0.49;
        x[4] = -127.0;
        let q = quantized(&x);
        assert_eq!(q.len(), 34);
        assert_eq!(u16::from_le_bytes([q[0], q[1]]), 0x3c00, "d = 1.0 in f16");
        assert_eq!(q[2] as i8, 127);
        assert_eq!(q[3] as i8, -3);
        assert_eq!(q[4] as i8, 3);
        assert_eq!(q[5] as i8, 0);
        assert_eq!(q[6] as i8, -127);
        // An all-zero block has d = 0 and zero quants.
        assert_eq!(quantized(&[0.0; 32]), vec![0u8; 34]);
    }

    #[test]
    fn dot_matches_f64_reference_on_awkward_sizes() {
        for n in [32, 64, 96, 4096 + 32] {
            let w = random_vec(n, 1.0, 60 + n as u64);
            let x = random_vec(n, 1.0, 61 + n as u64);
            let (wq, xq) = (quantized(&w), quantized(&x));
            // Exact: the dequantised rows multiplied in f64.
            let (wd, xd) = (dequantized(&wq), dequantized(&xq));
            let exact: f64 = wd.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
            let magnitude: f64 = wd
                .iter()
                .zip(&xd)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let got = dot(&wq, &xq) as f64;
            let tol = magnitude * (n as f64 / 32.0 + 2.0) * f32::EPSILON as f64;
            assert!(
                (got - exact).abs() <= tol,
                "n={n}: {got} vs {exact} (tol {tol})"
            );
            // And close to the unquantised product.
            let ideal: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let quant_tol = (n as f64).sqrt() * 0.02;
            assert!(
                (got - ideal).abs() <= quant_tol,
                "n={n}: {got} vs ideal {ideal}"
            );
        }
    }

    #[test]
    fn dot_is_block_sums_times_scales_in_order() {
        let w = random_vec(96, 1.0, 70);
        let x = random_vec(96, 1.0, 71);
        let (wq, xq) = (quantized(&w), quantized(&x));
        let mut expected = 0.0f32;
        for (wb, xb) in wq.chunks(34).zip(xq.chunks(34)) {
            let s: i32 = (0..32)
                .map(|j| (wb[2 + j] as i8 as i32) * (xb[2 + j] as i8 as i32))
                .sum();
            let dw = half::f16::from_bits(u16::from_le_bytes([wb[0], wb[1]])).to_f32();
            let dx = half::f16::from_bits(u16::from_le_bytes([xb[0], xb[1]])).to_f32();
            expected += s as f32 * (dw * dx);
        }
        assert_eq!(dot_scalar(&wq, &xq).to_bits(), expected.to_bits());
    }
}
