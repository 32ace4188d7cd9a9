//! Activation quantisation to Q8_0 and Q8_K ([`crate::q8_0::quantize_row`],
//! [`crate::q8_k::quantize_row`]) and Q8_0 dequantisation ([`crate::q8_0::dequantize_row`], what
//! a Q8_0 KV cache is read through): the AVX-512 kernels and an AVX2 dequantiser (bit-identical
//! to the scalar references), and their safe entry points.

use super::SimdLevel;

/// [`crate::q8_0::quantize_row`] with AVX-512 (which the caller checked is available; sizes
/// checked by the caller too).
pub(crate) fn quantize_q8_0_row(x: &[f32], out: &mut [u8]) {
    SimdLevel::Avx512.assert_supported();
    assert_eq!(
        x.len() / crate::q8_0::BLOCK_VALUES * crate::q8_0::BLOCK_BYTES,
        out.len()
    );
    assert_eq!(x.len() % crate::q8_0::BLOCK_VALUES, 0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512 is available and `out` holds one block per 32 values (checked above).
    unsafe {
        avx512::quantize_q8_0_row(x, out)
    }
}

/// [`crate::q8_0::dequantize_row`] at a SIMD `level` (AVX-512 or AVX2, which the caller checked
/// is available).
pub(crate) fn dequantize_q8_0_row(level: SimdLevel, bytes: &[u8], out: &mut [f32]) {
    level.assert_supported();
    assert_eq!(out.len() % crate::q8_0::BLOCK_VALUES, 0);
    assert_eq!(
        out.len() / crate::q8_0::BLOCK_VALUES * crate::q8_0::BLOCK_BYTES,
        bytes.len()
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is available and `bytes` holds one block per 32 values of `out`
    // (checked above).
    unsafe {
        match level {
            SimdLevel::Avx512 | SimdLevel::Amx => avx512::dequantize_q8_0_row(bytes, out),
            SimdLevel::Avx2 => avx2::dequantize_q8_0_row(bytes, out),
            SimdLevel::Scalar => panic!("SIMD kernels run SIMD levels only"),
        }
    }
}

/// [`crate::q8_k::quantize_row`] with AVX-512 (which the caller checked is available).
pub(crate) fn quantize_q8_k_row(x: &[f32], out: &mut [u8]) {
    SimdLevel::Avx512.assert_supported();
    assert_eq!(
        x.len() / crate::q8_k::BLOCK_VALUES * crate::q8_k::BLOCK_BYTES,
        out.len()
    );
    assert_eq!(x.len() % crate::q8_k::BLOCK_VALUES, 0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512 is available and `out` holds one block per 256 values (checked above).
    unsafe {
        avx512::quantize_q8_k_row(x, out)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::q8_0;

    /// Q8_0 dequantisation: each quant widened to f32 and multiplied by its block's scale
    /// (`q8_0::dequantize_row_scalar`'s values, 8 at a time).
    ///
    /// # Safety
    ///
    /// The AVX2 level must be available; `bytes` holds one block per 32 values of `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize_q8_0_row(bytes: &[u8], out: &mut [f32]) {
        for (block, values) in bytes
            .chunks_exact(q8_0::BLOCK_BYTES)
            .zip(out.chunks_exact_mut(q8_0::BLOCK_VALUES))
        {
            let d = _mm256_set1_ps(q8_0::scale(block));
            for part in 0..4 {
                // SAFETY: a block holds 2 scale bytes then 32 quants, and `values` 32 f32s.
                unsafe {
                    let quants = _mm_loadl_epi64(block.as_ptr().add(2 + 8 * part).cast());
                    let wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(quants));
                    _mm256_storeu_ps(values.as_mut_ptr().add(8 * part), _mm256_mul_ps(wide, d));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::{q8_0, q8_k};

    /// Whether any of the 16 lanes is NaN.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn has_nan(v: __m512) -> bool {
        _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) != 0
    }

    /// C's `roundf` per lane (ties away from zero), exactly as `q8_0::round_half_away`:
    /// truncate, then step away from zero where the dropped fraction is at least one half.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn round_half_away(v: __m512) -> __m512i {
        let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let fraction = _mm512_abs_ps(_mm512_sub_ps(v, whole));
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(fraction, _mm512_set1_ps(0.5));
        let sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(i32::MIN));
        let step = _mm512_castsi512_ps(_mm512_or_si512(
            sign,
            _mm512_castps_si512(_mm512_set1_ps(1.0)),
        ));
        _mm512_cvttps_epi32(_mm512_mask_add_ps(whole, up, whole, step))
    }

    /// Q8_0 dequantisation (`q8_0::dequantize_row_scalar`'s values): per block, each quant
    /// widened to f32 exactly and multiplied by the block's scale, one rounding as there.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `bytes` holds one block per 32 values of `out`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize_q8_0_row(bytes: &[u8], out: &mut [f32]) {
        for (block, values) in bytes
            .chunks_exact(q8_0::BLOCK_BYTES)
            .zip(out.chunks_exact_mut(q8_0::BLOCK_VALUES))
        {
            let d = _mm512_set1_ps(q8_0::scale(block));
            // SAFETY: a block holds 2 scale bytes then 32 quants, and `values` 32 f32s.
            unsafe {
                let quants = _mm256_loadu_si256(block.as_ptr().add(2).cast());
                let low = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(quants));
                let high = _mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(quants));
                let out = values.as_mut_ptr();
                _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(low), d));
                _mm512_storeu_ps(out.add(16), _mm512_mul_ps(_mm512_cvtepi32_ps(high), d));
            }
        }
    }

    /// Q8_0 activation quantisation (`q8_0::quantize_row_scalar`'s bytes): per block of 32 the
    /// largest magnitude, `d = amax / 127`, quants `roundf(v / d)`. Blocks holding a NaN go
    /// through the scalar block quantiser (its NaN handling is order-dependent).
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `x` is whole blocks and `out` one block per 32 values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn quantize_q8_0_row(x: &[f32], out: &mut [u8]) {
        for (values, block) in x
            .chunks_exact(q8_0::BLOCK_VALUES)
            .zip(out.chunks_exact_mut(q8_0::BLOCK_BYTES))
        {
            // SAFETY: `values` holds 32 floats and `block` 34 bytes.
            unsafe {
                let v = [
                    _mm512_loadu_ps(values.as_ptr()),
                    _mm512_loadu_ps(values.as_ptr().add(16)),
                ];
                if has_nan(v[0]) || has_nan(v[1]) {
                    q8_0::quantize_block(values, block);
                    continue;
                }
                let amax =
                    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
                let d = amax / 127.0;
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                block[..2].copy_from_slice(&crate::f16::from_f32(d).to_le_bytes());
                for (h, part) in v.iter().enumerate() {
                    let q = round_half_away(_mm512_mul_ps(*part, _mm512_set1_ps(inverse)));
                    _mm_storeu_si128(
                        block.as_mut_ptr().add(2 + 16 * h).cast(),
                        _mm512_cvtepi32_epi8(q),
                    );
                }
            }
        }
    }

    /// Q8_K activation quantisation (`q8_k::quantize_row_scalar`'s bytes): per block of 256 the
    /// first value of largest magnitude `max` maps to -127 (`iscale = -127 / max`), quants
    /// `min(127, round_ties_even(iscale · v))`, the sums of each 16 quants, `d = 1 / iscale`.
    /// Blocks holding a NaN go through the scalar block quantiser.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `x` is whole blocks and `out` one block per 256
    /// values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn quantize_q8_k_row(x: &[f32], out: &mut [u8]) {
        const GROUPS: usize = q8_k::BLOCK_VALUES / 16;
        for (values, block) in x
            .chunks_exact(q8_k::BLOCK_VALUES)
            .zip(out.chunks_exact_mut(q8_k::BLOCK_BYTES))
        {
            // SAFETY: `values` holds 256 floats and `block` 292 bytes.
            unsafe {
                let mut v = [_mm512_setzero_ps(); GROUPS];
                let mut magnitudes = [_mm512_setzero_ps(); GROUPS];
                let mut any_nan = false;
                let mut largest = _mm512_setzero_ps();
                for g in 0..GROUPS {
                    v[g] = _mm512_loadu_ps(values.as_ptr().add(16 * g));
                    any_nan |= has_nan(v[g]);
                    magnitudes[g] = _mm512_abs_ps(v[g]);
                    largest = _mm512_max_ps(largest, magnitudes[g]);
                }
                if any_nan {
                    q8_k::quantize_block(values, block);
                    continue;
                }
                let amax = _mm512_reduce_max_ps(largest);
                if amax == 0.0 {
                    block.fill(0);
                    continue;
                }
                // The first value of that magnitude, as the scalar scan keeps it.
                let splat = _mm512_set1_ps(amax);
                let mut first = 0;
                for (g, m) in magnitudes.iter().enumerate() {
                    let hits = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(*m, splat);
                    if hits != 0 {
                        first = 16 * g + hits.trailing_zeros() as usize;
                        break;
                    }
                }
                let iscale = -127.0 / values[first];
                let scale = _mm512_set1_ps(iscale);
                let qs = block.as_mut_ptr().add(4);
                let sums = block.as_mut_ptr().add(4 + q8_k::BLOCK_VALUES);
                for (g, part) in v.iter().enumerate() {
                    let rounded = _mm512_roundscale_ps::<
                        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                    >(_mm512_mul_ps(scale, *part));
                    let q = _mm512_min_epi32(_mm512_cvtps_epi32(rounded), _mm512_set1_epi32(127));
                    _mm_storeu_si128(qs.add(16 * g).cast(), _mm512_cvtepi32_epi8(q));
                    let sum = _mm512_reduce_add_epi32(q) as i16;
                    sums.add(2 * g)
                        .cast::<[u8; 2]>()
                        .write_unaligned(sum.to_le_bytes());
                }
                block[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
            }
        }
    }
}
