//! Activations ([`crate::activations`]): softmax's exponentials and their sum, SiLU, SwiGLU and
//! the SiLU / sigmoid gates, AVX2 and AVX-512 kernels (bit-identical to the scalar references:
//! the same operations on the same `exp`, lane by lane) and their safe entry points.

use super::SimdLevel;

/// The exponentials and their sum of [`crate::activations::softmax_in_place_at`] at a SIMD
/// `level`: `x[i] = exp(x[i] - max)` in place, summed in the reference's lanes. The level's
/// kernels take the whole 16-value chunks; the tail runs as the scalar reference does it.
pub(crate) fn softmax_exp_sum(level: SimdLevel, x: &mut [f32]) -> f32 {
    use crate::activations::SOFTMAX_LANES;
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    let (body, tail) = x.split_at_mut(x.len() / SOFTMAX_LANES * SOFTMAX_LANES);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; `body` and `padded` are whole chunks of 16 values.
    let (mut lanes, padded) = unsafe {
        let body_max = match level {
            SimdLevel::Avx2 => avx2::max_of_chunks(body),
            _ => avx512::max_of_chunks(body),
        };
        let max = tail.iter().fold(body_max, |m, &v| m.max(v));
        // The tail as one more chunk, padded with `max` (whose exponential, 1, goes nowhere):
        // the kernel's exp has the scalar one's bits, so this is the scalar tail, vectorised.
        let mut padded = [max; SOFTMAX_LANES];
        padded[..tail.len()].copy_from_slice(tail);
        let lanes = match level {
            SimdLevel::Avx2 => {
                avx2::exp_sum_chunks(&mut padded, max);
                avx2::exp_sum_chunks(body, max)
            }
            _ => {
                avx512::exp_sum_chunks(&mut padded, max);
                avx512::exp_sum_chunks(body, max)
            }
        };
        (lanes, padded)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (mut lanes, padded): ([f32; SOFTMAX_LANES], [f32; SOFTMAX_LANES]) =
        unreachable!("no SIMD level is supported on this architecture");
    for (i, v) in tail.iter_mut().enumerate() {
        *v = padded[i];
        lanes[i] += *v;
    }
    lanes.iter().fold(0.0, |sum, &lane| sum + lane)
}

/// `silu(x)` in place at a SIMD `level` ([`crate::activations::silu_in_place`]).
pub(crate) fn silu_in_place(level: SimdLevel, x: &mut [f32]) {
    let out = x.as_mut_ptr();
    // SAFETY: one slice of `x.len()` values, read and written element by element.
    unsafe { gate_mul::<false>(level, out, None, out, x.len()) }
}

/// `gate = silu(gate) · up` at a SIMD `level` ([`crate::activations::swiglu_in_place`]).
pub(crate) fn swiglu_in_place(level: SimdLevel, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: sizes differ");
    let out = gate.as_mut_ptr();
    // SAFETY: both slices hold `gate.len()` values (checked above).
    unsafe { gate_mul::<false>(level, out, Some(up.as_ptr()), out, gate.len()) }
}

/// `x = f(gate) · x` at a SIMD `level` ([`crate::activations::gate_in_place`]).
pub(crate) fn gate_in_place(
    level: SimdLevel,
    kind: crate::activations::Gate,
    x: &mut [f32],
    gate: &[f32],
) {
    assert_eq!(x.len(), gate.len(), "gate: sizes differ");
    let out = x.as_mut_ptr();
    // SAFETY: both slices hold `x.len()` values (checked above).
    unsafe {
        match kind {
            crate::activations::Gate::Silu => {
                gate_mul::<false>(level, gate.as_ptr(), Some(out), out, x.len())
            }
            crate::activations::Gate::Sigmoid => {
                gate_mul::<true>(level, gate.as_ptr(), Some(out), out, x.len())
            }
        }
    }
}

/// The level's `gate_mul` kernel: `out[i] = f(gate[i]) · other[i]`, `f` SiLU or (`SIGMOID`)
/// the sigmoid.
///
/// # Safety
/// `gate` and `other` readable and `out` writable for `len` values (`out` may alias either).
unsafe fn gate_mul<const SIGMOID: bool>(
    level: SimdLevel,
    gate: *const f32,
    other: Option<*const f32>,
    out: *mut f32,
    len: usize,
) {
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; the pointers are the caller's contract.
    let done = unsafe {
        match level {
            SimdLevel::Avx2 => avx2::gate_mul::<SIGMOID>(gate, other, out, len),
            _ => avx512::gate_mul::<SIGMOID>(gate, other, out, len),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    // The tail through the scalar reference (the same bits).
    for i in done..len {
        // SAFETY: value `i < len` exists behind every pointer (caller's contract).
        unsafe {
            let g = *gate.add(i);
            let s = if SIGMOID {
                crate::activations::sigmoid(g)
            } else {
                crate::activations::silu(g)
            };
            *out.add(i) = match other {
                Some(other) => s * *other.add(i),
                None => s,
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` per lane: the operations of [`crate::activations::exp`], in its order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn exp_ps(x: __m256) -> __m256 {
        use crate::activations::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E};
        // `max` returns its second operand for a NaN lane, as `f32::max` returns the non-NaN one.
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
            _mm256_set1_ps(EXP_MAX),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
    }

    /// `x / (1 + e^-x)` per lane, as [`crate::activations::silu`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn silu_ps(x: __m256) -> __m256 {
        let negated = _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), exp_ps(negated)))
    }

    /// `1 / (1 + e^-x)` per lane, as [`crate::activations::sigmoid`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn sigmoid_ps(x: __m256) -> __m256 {
        let negated = _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
        let one = _mm256_set1_ps(1.0);
        _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(negated)))
    }

    /// The largest value of `x` (whole chunks of 16) or -∞, for [`super::softmax_exp_sum`].
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn max_of_chunks(x: &[f32]) -> f32 {
        let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
        for half in x.chunks_exact(8) {
            // SAFETY: the half chunk holds 8 values.
            max = _mm256_max_ps(max, unsafe { _mm256_loadu_ps(half.as_ptr()) });
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 values.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), max) };
        lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
    }

    /// `x[i] = exp(x[i] - max)` over whole chunks of 16 (two registers of lanes, 0–7 and 8–15),
    /// returning the sums of lanes 0–15, for [`super::softmax_exp_sum`].
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn exp_sum_chunks(x: &mut [f32], max: f32) -> [f32; 16] {
        let shift = _mm256_set1_ps(max);
        let mut sums = [_mm256_setzero_ps(); 2];
        for chunk in x.chunks_exact_mut(16) {
            for (half, sum) in chunk.chunks_exact_mut(8).zip(&mut sums) {
                // SAFETY: the half chunk holds 8 values.
                unsafe {
                    let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(half.as_ptr()), shift));
                    _mm256_storeu_ps(half.as_mut_ptr(), e);
                    *sum = _mm256_add_ps(*sum, e);
                }
            }
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 values.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), sums[0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), sums[1]);
        }
        lanes
    }

    /// `out[i] = f(gate[i]) · other[i]` (without `other`: `f(gate[i])`), `f` SiLU or (`SIGMOID`)
    /// the sigmoid, for the whole registers of 8 among `len` values; returns how many it did
    /// (the caller finishes the tail).
    ///
    /// AVX2 and FMA must be available; `gate` and `other` readable and `out` writable for `len`
    /// values. `out` may be `gate` or `other`: each value is read before it is written.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn gate_mul<const SIGMOID: bool>(
        gate: *const f32,
        other: Option<*const f32>,
        out: *mut f32,
        len: usize,
    ) -> usize {
        let full = len / 8;
        for c in 0..full {
            // SAFETY: values `8c .. 8c + 8` exist behind every pointer (caller's contract).
            unsafe {
                let g = _mm256_loadu_ps(gate.add(8 * c));
                let mut v = if SIGMOID { sigmoid_ps(g) } else { silu_ps(g) };
                if let Some(other) = other {
                    v = _mm256_mul_ps(v, _mm256_loadu_ps(other.add(8 * c)));
                }
                _mm256_storeu_ps(out.add(8 * c), v);
            }
        }
        8 * full
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// The largest value of `x` (whole chunks of 16) or -∞, for [`super::softmax_exp_sum`].
    ///
    /// # Safety
    ///
    /// AVX-512 must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn max_of_chunks(x: &[f32]) -> f32 {
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for chunk in x.chunks_exact(16) {
            // SAFETY: the chunk holds 16 values.
            max = _mm512_max_ps(max, unsafe { _mm512_loadu_ps(chunk.as_ptr()) });
        }
        _mm512_reduce_max_ps(max)
    }

    /// `x[i] = exp(x[i] - max)` over whole chunks of 16, returning the sums of lanes 0–15, for
    /// [`super::softmax_exp_sum`].
    ///
    /// # Safety
    ///
    /// AVX-512 must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn exp_sum_chunks(x: &mut [f32], max: f32) -> [f32; 16] {
        let shift = _mm512_set1_ps(max);
        let mut sums = _mm512_setzero_ps();
        for chunk in x.chunks_exact_mut(16) {
            // SAFETY: the chunk holds 16 values.
            unsafe {
                let e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(chunk.as_ptr()), shift));
                _mm512_storeu_ps(chunk.as_mut_ptr(), e);
                sums = _mm512_add_ps(sums, e);
            }
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 values.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
        lanes
    }

    /// `e^x` per lane: the operations of [`crate::activations::exp`], in its order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn exp_ps(x: __m512) -> __m512 {
        use crate::activations::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E};
        // `max` returns its second operand for a NaN lane, as `f32::max` returns the non-NaN one.
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
            _mm512_set1_ps(EXP_MAX),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        let biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
    }

    /// `x / (1 + e^-x)` per lane, as [`crate::activations::silu`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn silu_ps(x: __m512) -> __m512 {
        let negated = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(x),
            _mm512_set1_epi32(i32::MIN),
        ));
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), exp_ps(negated)))
    }

    /// `1 / (1 + e^-x)` per lane, as [`crate::activations::sigmoid`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn sigmoid_ps(x: __m512) -> __m512 {
        let negated = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(x),
            _mm512_set1_epi32(i32::MIN),
        ));
        let one = _mm512_set1_ps(1.0);
        _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(negated)))
    }

    /// `out[i] = f(gate[i]) · other[i]` (without `other`: `f(gate[i])`), `f` SiLU or (`SIGMOID`)
    /// the sigmoid, for the whole registers of 16 among `len` values; returns how many it did
    /// (the caller finishes the tail).
    ///
    /// The AVX-512 level must be available; `gate` and `other` readable and `out` writable for
    /// `len` values. `out` may be `gate` or `other`: each value is read before it is written.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn gate_mul<const SIGMOID: bool>(
        gate: *const f32,
        other: Option<*const f32>,
        out: *mut f32,
        len: usize,
    ) -> usize {
        let full = len / 16;
        for c in 0..full {
            // SAFETY: values `16c .. 16c + 16` exist behind every pointer (caller's contract).
            unsafe {
                let g = _mm512_loadu_ps(gate.add(16 * c));
                let mut v = if SIGMOID { sigmoid_ps(g) } else { silu_ps(g) };
                if let Some(other) = other {
                    v = _mm512_mul_ps(v, _mm512_loadu_ps(other.add(16 * c)));
                }
                _mm512_storeu_ps(out.add(16 * c), v);
            }
        }
        16 * full
    }
}
