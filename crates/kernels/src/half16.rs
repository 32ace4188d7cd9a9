//! The 16-bit float weight types, F16 (ggml type 1: IEEE binary16) and BF16 (ggml type 30:
//! bfloat16, the top half of an f32): little-endian values, no blocks. One module over the
//! encoding ([`Half16`]); the public paths are the modules [`f16`](mod@f16) and [`bf16`]
//! (re-exported at the crate root), which hold each encoding's conversions and table entry.
//!
//! Weight rows stay 16-bit; the activation row stays f32. Each weight is widened exactly to f32
//! and the products are accumulated with the shared lane scheme of [`crate::f32`].

use crate::f32::{float_dot_rows, lane_dot, FloatEncoding};
use crate::simd::{self, Accumulator, Rows, SimdLevel};
use crate::types::{Kernels, TypeInfo, TypeKernels};
use crate::ActivationFormat;

/// Values per block (plain types).
const BLOCK_VALUES: usize = 1;
/// Bytes per block.
const BLOCK_BYTES: usize = 2;

/// A 16-bit float encoding: its exact widening to f32 and its rounding from f32.
pub(crate) trait Half16 {
    /// Name in messages.
    const NAME: &'static str;
    /// The float kernel family's tag for the encoding.
    const FLOAT: FloatEncoding;
    /// Widens `bits` to f32 (exact).
    fn to_f32(bits: u16) -> f32;
    /// Rounds `x` to the encoding, to nearest with ties to even.
    fn from_f32(x: f32) -> u16;
}

/// IEEE binary16 ([`f16`](mod@f16)).
pub(crate) struct F16;

/// bfloat16 ([`bf16`]).
pub(crate) struct BF16;

impl Half16 for F16 {
    const NAME: &'static str = "f16";
    const FLOAT: FloatEncoding = FloatEncoding::F16;

    #[inline(always)]
    fn to_f32(bits: u16) -> f32 {
        f16::to_f32(bits)
    }

    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        f16::from_f32(x)
    }
}

impl Half16 for BF16 {
    const NAME: &'static str = "bf16";
    const FLOAT: FloatEncoding = FloatEncoding::BF16;

    #[inline(always)]
    fn to_f32(bits: u16) -> f32 {
        bf16::to_f32(bits)
    }

    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        bf16::from_f32(x)
    }
}

/// Encodes `x` as little-endian `E` values into `out` (`2 * x.len()` bytes).
fn quantize_row<E: Half16>(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        x.len() * BLOCK_BYTES,
        "{} row: output size",
        E::NAME
    );
    for (dst, v) in out.chunks_exact_mut(BLOCK_BYTES).zip(x) {
        dst.copy_from_slice(&E::from_f32(*v).to_le_bytes());
    }
}

/// Decodes little-endian `E` `bytes` into `out`.
fn dequantize_row<E: Half16>(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        bytes.len(),
        out.len() * BLOCK_BYTES,
        "{} row: input size",
        E::NAME
    );
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(BLOCK_BYTES)) {
        *dst = E::to_f32(u16::from_le_bytes([src[0], src[1]]));
    }
}

/// Dot product of an `E` weight row with an f32 activation row, at the process's
/// [`simd::level`].
fn dot<E: Half16>(w: &[u8], x: &[f32]) -> f32 {
    let mut out = [0.0];
    dot_rows::<E>(simd::level(), w, Rows::single(x), &mut out);
    out[0]
}

/// `out[b] = dot(w, x_b)` for every activation row of `x`, reading `w` once per pass of rows,
/// at `level` (which must be supported); row `b` is bit-identical to [`dot`] at that level.
fn dot_rows<E: Half16>(level: SimdLevel, w: &[u8], x: Rows<'_, f32>, out: &mut [f32]) {
    float_dot_rows(E::FLOAT, level, w, x, out);
}

/// Adds weight rows (or column tiles of them) times each activation row into the pairs'
/// accumulators at a SIMD `level`: the tiled form of [`dot_rows`] used by the mat-vec.
fn accumulate<E: Half16>(
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, f32>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    crate::f32::float_accumulate(E::FLOAT, level, w, x, acc, prefetch_next);
}

/// Scalar reference of [`dot`].
fn dot_scalar<E: Half16>(w: &[u8], x: &[f32]) -> f32 {
    lane_dot::<BLOCK_BYTES>(w, x, |b| E::to_f32(u16::from_le_bytes(b)))
}

/// The table entry of encoding `E` (ggml type `ggml`).
const fn info<E: Half16>(ggml: crate::GgmlType) -> TypeInfo {
    TypeInfo {
        ggml,
        block_values: BLOCK_VALUES,
        block_bytes: BLOCK_BYTES,
        activation: ActivationFormat::F32,
        quantize_row: quantize_row::<E>,
        dequantize_row: dequantize_row::<E>,
        kernels: Kernels::Float(TypeKernels {
            dot_scalar: dot_scalar::<E>,
            dot_rows: dot_rows::<E>,
            accumulate: accumulate::<E>,
            lanes: crate::f32::float_lanes,
            row_sums: None,
        }),
        interleaved: None,
    }
}

/// The public functions of one encoding `$E` (module `f16` or `bf16`).
macro_rules! half16_api {
    ($E:ident, $name:literal) => {
        /// Values per block (plain type).
        pub const BLOCK_VALUES: usize = super::BLOCK_VALUES;
        /// Bytes per block.
        pub const BLOCK_BYTES: usize = super::BLOCK_BYTES;

        #[doc = concat!(
            "Encodes `x` as little-endian ", $name, " into `out` (`2 * x.len()` bytes)."
        )]
        pub fn quantize_row(x: &[f32], out: &mut [u8]) {
            super::quantize_row::<super::$E>(x, out)
        }

        #[doc = concat!("Decodes little-endian ", $name, " `bytes` into `out`.")]
        pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
            super::dequantize_row::<super::$E>(bytes, out)
        }

        #[doc = concat!(
            "Dot product of a weight row of ", $name, " values with an f32 activation row, at the"
        )]
        /// process's [`crate::simd::level`].
        pub fn dot(w: &[u8], x: &[f32]) -> f32 {
            super::dot::<super::$E>(w, x)
        }

        /// `out[b] = dot(w, x_b)` for every activation row of `x`, reading `w` once per pass of
        /// rows, at `level` (which must be supported); row `b` is bit-identical to [`dot`] at
        /// that level.
        pub fn dot_rows(
            level: crate::SimdLevel,
            w: &[u8],
            x: crate::Rows<'_, f32>,
            out: &mut [f32],
        ) {
            super::dot_rows::<super::$E>(level, w, x, out)
        }

        /// Scalar reference of [`dot`].
        pub fn dot_scalar(w: &[u8], x: &[f32]) -> f32 {
            super::dot_scalar::<super::$E>(w, x)
        }
    };
}

/// F16 (ggml type 1): little-endian IEEE binary16 values, no blocks.
pub mod f16 {
    half16_api!(F16, "f16");

    /// The F16 entry of the weight-type table.
    pub(crate) const INFO: crate::types::TypeInfo = super::info::<super::F16>(crate::GgmlType::F16);

    /// Widens binary16 `bits` to f32 exactly (normals, subnormals, ±0, ±inf, NaN).
    ///
    /// Branch-free so that loops over it vectorise: all three cases are computed and one
    /// selected. Subnormals are built as `2^-14 + m·2^-24` (a normal number) minus `2^-14`,
    /// which is exact and never touches f32 subnormals (slow on some CPUs).
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

    /// Rounds every value of `x` into `out` as [`from_f32`] does, eight at a time where the
    /// CPU converts in hardware (F16C): a KV cache row's store (one value at a time, each
    /// conversion checked the CPU's features again, 2% of a single-row decode step).
    ///
    /// # Panics
    ///
    /// If the slices' lengths differ.
    pub fn from_f32_slice(x: &[f32], out: &mut [u16]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        out.reinterpret_cast_mut::<half::f16>()
            .convert_from_f32_slice(x);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

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
        fn slices_round_as_single_values() {
            let mut x = crate::test_util::random_vec(1003, 70_000.0, 5);
            x.extend([
                0.0,
                -0.0,
                1e-7,
                -6e-8,
                65519.0,
                65520.0,
                f32::INFINITY,
                -1e9,
            ]);
            for len in [0, 1, 7, 8, 9, 1011] {
                let mut out = vec![0u16; len];
                from_f32_slice(&x[..len], &mut out);
                for (v, bits) in x.iter().zip(&out) {
                    assert_eq!(*bits, from_f32(*v), "{v}");
                }
            }
        }

        #[test]
        fn round_trip_error_is_within_half_an_ulp() {
            // 11 significant bits: relative error at most 2^-11 (normal range).
            super::super::tests::check_round_trip::<super::super::F16>(11, |a| {
                a.abs() * (1.0 / 2048.0) + 1e-7
            });
            // Values exactly representable survive unchanged, and rounding is to nearest even.
            assert_eq!(to_f32(from_f32(1.0 + 1.0 / 2048.0)), 1.0);
            assert_eq!(to_f32(from_f32(1.0 + 3.0 / 2048.0)), 1.0 + 4.0 / 2048.0);
            assert_eq!(to_f32(from_f32(65504.0)), 65504.0);
            assert!(to_f32(from_f32(1e6)).is_infinite());
        }

        #[test]
        fn dot_matches_f64_reference_on_awkward_sizes() {
            super::super::tests::check_dot::<super::super::F16>(20);
        }
    }
}

/// BF16 (ggml type 30): little-endian bfloat16 values (the top half of an f32), no blocks.
pub mod bf16 {
    half16_api!(BF16, "bf16");

    /// The BF16 entry of the weight-type table.
    pub(crate) const INFO: crate::types::TypeInfo =
        super::info::<super::BF16>(crate::GgmlType::BF16);

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

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::test_util::random_vec;

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
            // 8 significant bits: relative error at most 2^-8.
            super::super::tests::check_round_trip::<super::super::BF16>(32, |a| a.abs() / 256.0);
        }

        #[test]
        fn dot_matches_f64_reference_on_awkward_sizes() {
            super::super::tests::check_dot::<super::super::BF16>(40);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_dot_close, random_vec};

    /// Encodes and decodes 4096 values (from `seed`), each within `bound(value)` of itself.
    pub(super) fn check_round_trip<E: Half16>(seed: u64, bound: impl Fn(f32) -> f32) {
        let x = random_vec(4096, 10.0, seed);
        let mut bytes = vec![0u8; x.len() * 2];
        quantize_row::<E>(&x, &mut bytes);
        let mut back = vec![0.0; x.len()];
        dequantize_row::<E>(&bytes, &mut back);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= bound(*a), "{a} -> {b}");
        }
    }

    /// [`dot`] against an f64 reference of the rounded weights, on awkward row lengths (weights
    /// from seed `seed + n`, activations from `seed + 1 + n`).
    pub(super) fn check_dot<E: Half16>(seed: u64) {
        for n in [0, 1, 7, 16, 17, 32, 33, 64, 96, 100, 4096 + 32, 4099] {
            let w = random_vec(n, 1.0, seed + n as u64);
            let x = random_vec(n, 1.0, seed + 1 + n as u64);
            let mut wb = vec![0u8; n * 2];
            quantize_row::<E>(&w, &mut wb);
            let mut w_rounded = vec![0.0; n];
            dequantize_row::<E>(&wb, &mut w_rounded);
            let reference: f64 = w_rounded
                .iter()
                .zip(&x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            assert_dot_close(dot::<E>(&wb, &x), reference, &w_rounded, &x, 0.0);
        }
    }
}
