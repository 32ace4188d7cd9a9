//! F32 (ggml type 0): plain little-endian IEEE binary32 values, no blocks.
//!
//! Also home of the lane-accumulator scheme every floating-point dot product in this crate
//! shares: element `i` of a row is accumulated into lane `i % LANES` in row order, and the
//! lanes are summed by a fixed pairwise tree at the end. The scalar reference
//! ([`dot_scalar`]) does exactly that with 16 lanes; the SIMD versions keep the scheme with
//! fused multiply-adds (AVX2: 16 lanes, AVX-512: 32 lanes folded to 16 before the tree). The
//! result is a fixed function of the two rows for a given [`SimdLevel`], and the process runs
//! one level (see [`crate::simd`]), so a row's result never depends on what runs beside it.
//!
//! The float-family dispatch (`float_dot_rows`) lives here and is shared by F16 and BF16.

use crate::simd::{self, Accumulator, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;

/// Values per block (plain type).
pub const BLOCK_VALUES: usize = 1;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 4;

/// The F32 entry of the weight-type table ([`crate::for_each_weight_type`]).
pub(crate) const INFO: TypeInfo = TypeInfo {
    ggml: crate::GgmlType::F32,
    block_values: BLOCK_VALUES,
    block_bytes: BLOCK_BYTES,
    activation: ActivationFormat::F32,
    quantize_row,
    dequantize_row,
    kernels: Kernels::Float(TypeKernels {
        dot_scalar,
        dot_rows,
        accumulate,
        lanes: float_lanes,
        row_sums: None,
    }),
    interleaved: None,
};

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

/// Dot product of an encoded f32 weight row with an f32 activation row, at the process's
/// [`simd::level`].
pub fn dot(w: &[u8], x: &[f32]) -> f32 {
    let mut out = [0.0];
    dot_rows(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every activation row `x_b` of `x`, reading `w` once per pass of
/// rows, at `level` (which must be supported). Row `b`'s result is bit-identical to [`dot`]
/// of that row at the same level.
pub fn dot_rows(level: SimdLevel, w: &[u8], x: Rows<'_, f32>, out: &mut [f32]) {
    float_dot_rows(FloatEncoding::F32, level, w, x, out);
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
    float_accumulate(FloatEncoding::F32, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`].
pub fn dot_scalar(w: &[u8], x: &[f32]) -> f32 {
    lane_dot::<BLOCK_BYTES>(w, x, f32::from_le_bytes)
}

/// Dot product of two f32 slices of equal length (attention scores), at the process's
/// [`simd::level`]; bit-identical to [`dot`] of `a`'s encoding with `b`.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_with(simd::level(), a, b)
}

/// [`dot_f32`] at `level` (which must be supported).
pub fn dot_f32_with(level: SimdLevel, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    match level {
        SimdLevel::Scalar => dot_f32_scalar(a, b),
        #[cfg(target_arch = "x86_64")]
        _ => {
            let mut out = [0.0];
            dot_rows(level, simd::f32_bytes(a), Rows::single(b), &mut out);
            out[0]
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no SIMD levels on this target"),
    }
}

/// Scalar reference of [`dot_f32`] (same lanes and tree as [`dot_scalar`]).
pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
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

/// `y += a * x`, element-wise (attention value accumulation), at the process's
/// [`simd::level`]. SIMD levels use one fused multiply-add per element (so AVX2 and AVX-512
/// agree bit for bit); the scalar level multiplies, then adds.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    axpy_with(simd::level(), a, x, y);
}

/// [`axpy`] at `level` (which must be supported).
pub fn axpy_with(level: SimdLevel, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    match level {
        SimdLevel::Scalar => axpy_scalar(a, x, y),
        _ => simd::axpy(level, a, x, y),
    }
}

/// `y += Σ_j weights[j] · rows[j]`, rows in order: the attention output `Σ_j p_j · v_j`, at
/// the process's [`simd::level`]. Bit-identical to calling [`axpy`] once per row in order (each
/// element goes through the same chain of fused multiply-adds, or of multiply-then-add at the
/// scalar level), but the SIMD versions keep `y` in registers across the rows.
pub fn weighted_sum(weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
    weighted_sum_with(simd::level(), weights, rows, y);
}

/// [`weighted_sum`] at `level` (which must be supported).
pub fn weighted_sum_with(level: SimdLevel, weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
    assert_eq!(
        weights.len(),
        rows.count(),
        "weighted_sum: one weight per row"
    );
    assert_eq!(rows.len(), y.len(), "weighted_sum: row length");
    match level {
        SimdLevel::Scalar => {
            for (j, &wj) in weights.iter().enumerate() {
                axpy_scalar(wj, rows.row(j), y);
            }
        }
        _ => simd::weighted_sum(level, weights, rows, y),
    }
}

/// `out[j] = dot_f32(a, rows[j])` for every row (attention scores of one query against many
/// keys), at the process's [`simd::level`]: the multi-input kernel with `a` as the weight row,
/// so each score is bit-identical to [`dot_f32`] of that row.
pub fn dot_f32_rows(a: &[f32], rows: Rows<'_, f32>, out: &mut [f32]) {
    dot_f32_rows_with(simd::level(), a, rows, out);
}

/// [`dot_f32_rows`] at `level` (which must be supported).
pub fn dot_f32_rows_with(level: SimdLevel, a: &[f32], rows: Rows<'_, f32>, out: &mut [f32]) {
    assert_eq!(a.len(), rows.len(), "dot_f32_rows: length mismatch");
    assert_eq!(out.len(), rows.count(), "dot_f32_rows: one output per row");
    match level {
        SimdLevel::Scalar => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = dot_f32_scalar(a, rows.row(j));
            }
        }
        #[cfg(target_arch = "x86_64")]
        _ => dot_rows(level, simd::f32_bytes(a), rows, out),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no SIMD levels on this target"),
    }
}

/// Scalar reference of [`axpy`].
pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// The float weight encodings (F32, F16, BF16), which share one kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FloatEncoding {
    F32,
    F16,
    BF16,
}

impl FloatEncoding {
    pub(crate) fn bytes(self) -> usize {
        match self {
            FloatEncoding::F32 => 4,
            FloatEncoding::F16 | FloatEncoding::BF16 => 2,
        }
    }

    fn scalar_dot(self) -> fn(&[u8], &[f32]) -> f32 {
        match self {
            FloatEncoding::F32 => dot_scalar,
            FloatEncoding::F16 => crate::f16::dot_scalar,
            FloatEncoding::BF16 => crate::bf16::dot_scalar,
        }
    }
}

/// The multi-input dot product of a float-family weight row: checks sizes and `level`, then
/// runs the level's kernel over the whole row (the scalar level runs the reference per row).
pub(crate) fn float_dot_rows(
    encoding: FloatEncoding,
    level: SimdLevel,
    w: &[u8],
    x: Rows<'_, f32>,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        x.count(),
        "dot_rows: one output per activation row"
    );
    if level == SimdLevel::Scalar {
        check_float_sizes(encoding, w.len(), x.len());
        let scalar = encoding.scalar_dot();
        for (b, o) in out.iter_mut().enumerate() {
            *o = scalar(w, x.row(b));
        }
    } else {
        simd::accumulate_and_sum(x, out, float_lanes(level), |x, acc| {
            float_accumulate(encoding, level, Rows::single(w), x, acc, None)
        });
    }
}

pub(crate) fn check_float_sizes(encoding: FloatEncoding, w_len: usize, x_len: usize) {
    assert_eq!(
        w_len,
        x_len * encoding.bytes(),
        "dot: weight row and activation sizes differ"
    );
}

/// Accumulator lanes of the float-family kernels at a SIMD `level`.
pub(crate) fn float_lanes(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512 | SimdLevel::Amx => 32,
        _ => 16,
    }
}

/// Adds float-family weight rows (or column tiles) times each activation row (the same
/// columns) into the pairs' accumulators, at a SIMD `level` (checked to be supported).
pub(crate) fn float_accumulate(
    encoding: FloatEncoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, f32>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    simd::float_accumulate(encoding, level, w, x, acc, prefetch_next);
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
