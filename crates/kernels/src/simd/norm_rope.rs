//! RMSNorm and RoPE ([`crate::ops`]): the sum of squares in f64 lanes, the scaling by the norm
//! and the weight, and the rotation of RoPE's pairs, AVX2 and AVX-512 kernels over whole
//! registers (the callers finish the tail with the scalar reference) and their entry points.
//! The scaling and the rotation differ between the levels only in width: they are written once
//! over [`F32Lanes`] and instantiated by each level.

#[cfg(target_arch = "x86_64")]
use super::lanes::F32Lanes;
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
            SimdLevel::Avx512 | SimdLevel::Amx => avx512::sum_squares_f64(x),
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
            SimdLevel::Avx512 | SimdLevel::Amx => avx512::scale_mul(x, scale, weight, out, len),
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
            SimdLevel::Avx512 | SimdLevel::Amx => {
                avx512::rotate_pairs(x0, x1, cos.as_ptr(), sin.as_ptr(), len)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// `out[i] = (x[i] · scale) · weight[i]` for the whole registers of `V` among `len` values;
/// returns how many it did.
///
/// # Safety
///
/// `V`'s instruction set available; `x` and `weight` readable and `out` writable for `len`
/// values (`out` may be `x`: each register is read before it is written).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scale_mul_lanes<V: F32Lanes>(
    x: *const f32,
    scale: f32,
    weight: *const f32,
    out: *mut f32,
    len: usize,
) -> usize {
    let full = len / V::LANES;
    // SAFETY: register `c < full` covers values `c·LANES ..` of every pointer (the caller's
    // contract), and the instruction set is the caller's.
    unsafe {
        let s = V::splat(scale);
        for c in 0..full {
            let at = c * V::LANES;
            let v = V::load(x.add(at)).mul(s).mul(V::load(weight.add(at)));
            v.store(out.add(at));
        }
    }
    full * V::LANES
}

/// Rotates pairs `(a, b) = (x0[i], x1[i])` to `(a·c − b·s, a·s + b·c)` by `cos[i]`, `sin[i]`
/// for the whole registers of `V` among `len` pairs; returns how many it did.
///
/// # Safety
///
/// `V`'s instruction set available; `x0` and `x1` writable (not overlapping) and `cos`, `sin`
/// readable for `len` values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rotate_pairs_lanes<V: F32Lanes>(
    x0: *mut f32,
    x1: *mut f32,
    cos: *const f32,
    sin: *const f32,
    len: usize,
) -> usize {
    let full = len / V::LANES;
    // SAFETY: register `i < full` covers values `i·LANES ..` of every pointer (the caller's
    // contract), and the instruction set is the caller's.
    unsafe {
        for i in 0..full {
            let at = i * V::LANES;
            let (a, b) = (V::load(x0.add(at)), V::load(x1.add(at)));
            let (c, s) = (V::load(cos.add(at)), V::load(sin.add(at)));
            a.mul(c).sub(b.mul(s)).store(x0.add(at));
            a.mul(s).add(b.mul(c)).store(x1.add(at));
        }
    }
    full * V::LANES
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::simd::lanes::Avx2;

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

    /// [`super::scale_mul`]'s kernel with 8 lanes.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; the pointers as [`super::scale_mul`] says.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn scale_mul(
        x: *const f32,
        scale: f32,
        weight: *const f32,
        out: *mut f32,
        len: usize,
    ) -> usize {
        // SAFETY: AVX2 is available here; the pointers are the caller's contract.
        unsafe { super::scale_mul_lanes::<Avx2>(x, scale, weight, out, len) }
    }

    /// [`super::rotate_pairs`]'s kernel with 8 lanes.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; `x0` and `x1` writable (not overlapping) and `cos`,
    /// `sin` readable for `len` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn rotate_pairs(
        x0: *mut f32,
        x1: *mut f32,
        cos: *const f32,
        sin: *const f32,
        len: usize,
    ) -> usize {
        // SAFETY: AVX2 is available here; the pointers are the caller's contract.
        unsafe { super::rotate_pairs_lanes::<Avx2>(x0, x1, cos, sin, len) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::simd::lanes::Avx512;

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

    /// [`super::scale_mul`]'s kernel with 16 lanes.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; the pointers as [`super::scale_mul`] says.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn scale_mul(
        x: *const f32,
        scale: f32,
        weight: *const f32,
        out: *mut f32,
        len: usize,
    ) -> usize {
        // SAFETY: AVX-512 is available here; the pointers are the caller's contract.
        unsafe { super::scale_mul_lanes::<Avx512>(x, scale, weight, out, len) }
    }

    /// [`super::rotate_pairs`]'s kernel with 16 lanes.
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
        // SAFETY: AVX-512 is available here; the pointers are the caller's contract.
        unsafe { super::rotate_pairs_lanes::<Avx512>(x0, x1, cos, sin, len) }
    }
}
