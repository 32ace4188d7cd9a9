//! RMSNorm and RoPE ([`crate::ops`]): the sum of squares in f64 lanes, the scaling by the norm
//! and the weight, and the rotation of RoPE's pairs, AVX2 and AVX-512 kernels over whole
//! registers (the callers finish the tail with the scalar reference) and their entry points.

use super::SimdLevel;

/// The squares of `x` (squared in f32) summed in f64 into 8 lanes, value `i` into lane
/// `i % 8`, over the whole chunks of 8 at `level` (none at the scalar level); returns the lanes
/// and how many values they hold ([`crate::ops::rms_norm`]).
pub(crate) fn sum_squares_f64(level: SimdLevel, x: &[f32]) -> ([f64; 8], usize) {
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported.
    unsafe {
        match level {
            SimdLevel::Scalar => ([0.0; 8], 0),
            SimdLevel::Avx2 => avx2::sum_squares_f64(x),
            SimdLevel::Avx512 => avx512::sum_squares_f64(x),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    ([0.0; 8], 0)
}

/// `out[i] = (x[i] · scale) · weight[i]` for the whole registers among `x.len()` values at
/// `level` (none at the scalar level); returns how many it did. `out` may be `x`.
///
/// # Safety
///
/// `x` and `weight` readable and `out` writable for `len` values.
pub(crate) unsafe fn scale_mul(
    level: SimdLevel,
    x: *const f32,
    scale: f32,
    weight: *const f32,
    out: *mut f32,
    len: usize,
) -> usize {
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; the pointers are the caller's contract.
    unsafe {
        match level {
            SimdLevel::Scalar => 0,
            SimdLevel::Avx2 => avx2::scale_mul(x, scale, weight, out, len),
            SimdLevel::Avx512 => avx512::scale_mul(x, scale, weight, out, len),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Rotates the pairs `(first[i], second[i])` by `cos[i]`, `sin[i]` ([`crate::Rope::apply`]) for
/// the whole registers among them at `level` (none at the scalar level); returns how many it
/// did.
pub(crate) fn rotate_pairs(
    level: SimdLevel,
    first: &mut [f32],
    second: &mut [f32],
    cos: &[f32],
    sin: &[f32],
) -> usize {
    let len = first.len();
    assert!(
        second.len() == len && cos.len() == len && sin.len() == len,
        "rope: sizes differ"
    );
    level.assert_supported();
    let (x0, x1) = (first.as_mut_ptr(), second.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; four slices of `len` values (checked above).
    unsafe {
        match level {
            SimdLevel::Scalar => 0,
            SimdLevel::Avx2 => avx2::rotate_pairs(x0, x1, cos.as_ptr(), sin.as_ptr(), len),
            SimdLevel::Avx512 => avx512::rotate_pairs(x0, x1, cos.as_ptr(), sin.as_ptr(), len),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::avx512::sum_squares_f64`] with AVX2: lanes 0-3 and 4-7 in two registers.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn sum_squares_f64(x: &[f32]) -> ([f64; 8], usize) {
        let chunks = x.len() / 8;
        let (mut low, mut high) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for c in 0..chunks {
            // SAFETY: values `8c .. 8c + 8` lie inside `x`.
            let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * c)) };
            let squares = _mm256_mul_ps(v, v);
            low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(squares)));
            high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(squares)));
        }
        let mut lanes = [0.0; 8];
        // SAFETY: `lanes` holds 8 f64.
        unsafe {
            _mm256_storeu_pd(lanes.as_mut_ptr(), low);
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4), high);
        }
        (lanes, 8 * chunks)
    }

    /// [`super::avx512::scale_mul`] with AVX2 (whole registers of 8).
    ///
    /// # Safety
    ///
    /// As the AVX-512 kernel, with AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn scale_mul(
        x: *const f32,
        scale: f32,
        weight: *const f32,
        out: *mut f32,
        len: usize,
    ) -> usize {
        let full = len / 8;
        let s = _mm256_set1_ps(scale);
        for c in 0..full {
            // SAFETY: values `8c .. 8c + 8` exist behind every pointer (caller's contract).
            unsafe {
                let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(8 * c)), s);
                let v = _mm256_mul_ps(v, _mm256_loadu_ps(weight.add(8 * c)));
                _mm256_storeu_ps(out.add(8 * c), v);
            }
        }
        8 * full
    }

    /// [`super::avx512::rotate_pairs`] with AVX2 (whole registers of 8).
    ///
    /// # Safety
    ///
    /// As the AVX-512 kernel, with AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn rotate_pairs(
        x0: *mut f32,
        x1: *mut f32,
        cos: *const f32,
        sin: *const f32,
        len: usize,
    ) -> usize {
        let full = len / 8;
        for i in 0..full {
            // SAFETY: values `8i .. 8i + 8` exist behind every pointer (caller's contract).
            unsafe {
                let (a, b) = (
                    _mm256_loadu_ps(x0.add(8 * i)),
                    _mm256_loadu_ps(x1.add(8 * i)),
                );
                let (c, s) = (
                    _mm256_loadu_ps(cos.add(8 * i)),
                    _mm256_loadu_ps(sin.add(8 * i)),
                );
                let first = _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s));
                let second = _mm256_add_ps(_mm256_mul_ps(a, s), _mm256_mul_ps(b, c));
                _mm256_storeu_ps(x0.add(8 * i), first);
                _mm256_storeu_ps(x1.add(8 * i), second);
            }
        }
        8 * full
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// The squares of `x`'s values (squared in f32) summed in f64 into 8 lanes, value `i` into
    /// lane `i % 8`, over the whole chunks of 8; returns the lanes and how many values it took.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn sum_squares_f64(x: &[f32]) -> ([f64; 8], usize) {
        let chunks = x.len() / 8;
        let mut acc = _mm512_setzero_pd();
        for c in 0..chunks {
            // SAFETY: values `8c .. 8c + 8` lie inside `x`.
            let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * c)) };
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_mul_ps(v, v)));
        }
        let mut lanes = [0.0; 8];
        // SAFETY: `lanes` holds 8 f64.
        unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), acc) };
        (lanes, 8 * chunks)
    }

    /// `out[i] = (x[i] · scale) · weight[i]` for the whole registers of 16 among `len` values;
    /// returns how many it did.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `x` and `weight` readable and `out` writable for `len`
    /// values (`out` may be `x`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn scale_mul(
        x: *const f32,
        scale: f32,
        weight: *const f32,
        out: *mut f32,
        len: usize,
    ) -> usize {
        let full = len / 16;
        let s = _mm512_set1_ps(scale);
        for c in 0..full {
            // SAFETY: values `16c .. 16c + 16` exist behind every pointer (caller's contract).
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(x.add(16 * c)), s);
                let v = _mm512_mul_ps(v, _mm512_loadu_ps(weight.add(16 * c)));
                _mm512_storeu_ps(out.add(16 * c), v);
            }
        }
        16 * full
    }

    /// Rotates pairs `(a, b) = (x0[i], x1[i])` to `(a·c − b·s, a·s + b·c)` by `cos[i]`, `sin[i]`
    /// for the whole registers of 16 among `len` pairs; returns how many it did.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `x0` and `x1` writable (not overlapping) and `cos`,
    /// `sin` readable for `len` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn rotate_pairs(
        x0: *mut f32,
        x1: *mut f32,
        cos: *const f32,
        sin: *const f32,
        len: usize,
    ) -> usize {
        let full = len / 16;
        for i in 0..full {
            // SAFETY: values `16i .. 16i + 16` exist behind every pointer (caller's contract).
            unsafe {
                let (a, b) = (
                    _mm512_loadu_ps(x0.add(16 * i)),
                    _mm512_loadu_ps(x1.add(16 * i)),
                );
                let (c, s) = (
                    _mm512_loadu_ps(cos.add(16 * i)),
                    _mm512_loadu_ps(sin.add(16 * i)),
                );
                let first = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s));
                let second = _mm512_add_ps(_mm512_mul_ps(a, s), _mm512_mul_ps(b, c));
                _mm512_storeu_ps(x0.add(16 * i), first);
                _mm512_storeu_ps(x1.add(16 * i), second);
            }
        }
        16 * full
    }
}
