//! The small vector abstraction for kernels that differ between AVX2 and AVX-512 only in
//! register width: [`F32Lanes`], a register of f32 lanes with the operations those kernels use,
//! for 8 lanes ([`Avx2`]) and 16 lanes ([`Avx512`]). A kernel written once over `F32Lanes`
//! (`#[inline(always)]`) is instantiated by each level's `#[target_feature]` entry point, which
//! is where the intrinsics are compiled and inlined; the per-level code is then the code the
//! hand-written versions were.
//!
//! Each operation is one instruction of the level, so a kernel over `F32Lanes` computes every
//! lane with the same operations in the same order at either width, and the scalar reference
//! (which the kernels' tests compare against) does the same per value.

use std::arch::x86_64::*;

/// A register of `LANES` f32 values.
///
/// # Safety
///
/// Every method may only run where the implementation's instruction set is available: inside
/// the `#[target_feature]` functions of that level, which the dispatchers call only at a
/// supported [`super::SimdLevel`]. `load` and `store` read or write `LANES` values at the pointer.
pub(crate) trait F32Lanes: Copy {
    /// Values per register.
    const LANES: usize;
    unsafe fn load(p: *const f32) -> Self;
    /// `LANES` f16 values at `p`, widened (exactly).
    unsafe fn load_f16(p: *const u16) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn splat(v: f32) -> Self;
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    unsafe fn div(self, b: Self) -> Self;
    /// `self · b + c`, fused (one rounding).
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// The lane-wise minimum; `b` where a lane is NaN.
    unsafe fn min(self, b: Self) -> Self;
    /// The lane-wise maximum; `b` where a lane is NaN.
    unsafe fn max(self, b: Self) -> Self;
    /// Rounded to the nearest whole number (ties to even).
    unsafe fn round(self) -> Self;
    /// The sign flipped.
    unsafe fn neg(self) -> Self;
    /// `2^n` for lanes holding whole numbers `n` (within the normal exponent range), built from
    /// the exponent bits.
    unsafe fn exp2_whole(self) -> Self;
}

/// 8 lanes of AVX2 (with FMA).
#[derive(Clone, Copy)]
pub(crate) struct Avx2(__m256);

/// 16 lanes of AVX-512.
#[derive(Clone, Copy)]
pub(crate) struct Avx512(__m512);

// Each method is one intrinsic under the trait's contract (the level's instruction set is
// available, the pointers hold `LANES` values), so the bodies need no further reasoning.
impl F32Lanes for Avx2 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Self(_mm256_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Self(_mm256_cvtph_ps(_mm_loadu_si128(p.cast())))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Self(_mm256_set1_ps(v))
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        Self(_mm256_add_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        Self(_mm256_sub_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Self(_mm256_mul_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn div(self, b: Self) -> Self {
        Self(_mm256_div_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        Self(_mm256_fmadd_ps(self.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn min(self, b: Self) -> Self {
        Self(_mm256_min_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        Self(_mm256_max_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn round(self) -> Self {
        Self(_mm256_round_ps::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(self.0))
    }
    #[inline(always)]
    unsafe fn neg(self) -> Self {
        Self(_mm256_xor_ps(self.0, _mm256_set1_ps(-0.0)))
    }
    #[inline(always)]
    unsafe fn exp2_whole(self) -> Self {
        let biased = _mm256_add_epi32(_mm256_cvtps_epi32(self.0), _mm256_set1_epi32(127));
        Self(_mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
    }
}

impl F32Lanes for Avx512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Self(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Self(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast())))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Self(_mm512_set1_ps(v))
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        Self(_mm512_add_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        Self(_mm512_sub_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Self(_mm512_mul_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn div(self, b: Self) -> Self {
        Self(_mm512_div_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        Self(_mm512_fmadd_ps(self.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn min(self, b: Self) -> Self {
        Self(_mm512_min_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        Self(_mm512_max_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn round(self) -> Self {
        Self(_mm512_roundscale_ps::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(self.0))
    }
    #[inline(always)]
    unsafe fn neg(self) -> Self {
        Self(_mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(self.0),
            _mm512_set1_epi32(i32::MIN),
        )))
    }
    #[inline(always)]
    unsafe fn exp2_whole(self) -> Self {
        let biased = _mm512_add_epi32(_mm512_cvtps_epi32(self.0), _mm512_set1_epi32(127));
        Self(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
    }
}
