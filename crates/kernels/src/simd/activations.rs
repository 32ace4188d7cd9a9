//! Activations ([`crate::activations`]): softmax's exponentials and their sum, SiLU, SwiGLU and
//! the SiLU / sigmoid gates, AVX2 and AVX-512 kernels (bit-identical to the scalar references:
//! the same operations on the same `exp`, lane by lane) and their safe entry points. Besides
//! the softmax's maximum, the levels differ only in width: the kernels are written once over
//! [`F32Lanes`] and instantiated by each level.

#[cfg(target_arch = "x86_64")]
use super::lanes::F32Lanes;
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

/// `e^x` per lane: the operations of [`crate::activations::exp`], in its order.
///
/// # Safety
///
/// `V`'s instruction set available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_lanes<V: F32Lanes>(x: V) -> V {
    use crate::activations::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E};
    // SAFETY: the instruction set is the caller's.
    unsafe {
        // `max` gives its second operand for a NaN lane, as `f32::max` gives the non-NaN one.
        let x = x.max(V::splat(EXP_MIN)).min(V::splat(EXP_MAX));
        let n = x.mul(V::splat(LOG2_E)).round();
        let r = n.mul_add(V::splat(-LN2_HI), x);
        let r = n.mul_add(V::splat(-LN2_LO), r);
        let mut p = V::splat(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = p.mul_add(r, V::splat(*c));
        }
        let y = p.mul_add(r.mul(r), r).add(V::splat(1.0));
        y.mul(n.exp2_whole())
    }
}

/// `x / (1 + e^-x)` per lane, as [`crate::activations::silu`].
///
/// # Safety
///
/// `V`'s instruction set available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn silu_lanes<V: F32Lanes>(x: V) -> V {
    // SAFETY: the instruction set is the caller's.
    unsafe { x.div(V::splat(1.0).add(exp_lanes(x.neg()))) }
}

/// `1 / (1 + e^-x)` per lane, as [`crate::activations::sigmoid`].
///
/// # Safety
///
/// `V`'s instruction set available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sigmoid_lanes<V: F32Lanes>(x: V) -> V {
    // SAFETY: the instruction set is the caller's.
    unsafe {
        let one = V::splat(1.0);
        one.div(one.add(exp_lanes(x.neg())))
    }
}

/// `out[i] = f(gate[i]) · other[i]` (without `other`: `f(gate[i])`), `f` SiLU or (`SIGMOID`)
/// the sigmoid, for the whole registers of `V` among `len` values; returns how many it did
/// (the caller finishes the tail).
///
/// # Safety
///
/// `V`'s instruction set available; `gate` and `other` readable and `out` writable for `len`
/// values. `out` may be `gate` or `other`: each value is read before it is written.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gate_mul_lanes<V: F32Lanes, const SIGMOID: bool>(
    gate: *const f32,
    other: Option<*const f32>,
    out: *mut f32,
    len: usize,
) -> usize {
    let full = len / V::LANES;
    // SAFETY: register `c < full` covers values `c·LANES ..` behind every pointer (the
    // caller's contract), and the instruction set is the caller's.
    unsafe {
        for c in 0..full {
            let at = c * V::LANES;
            let g = V::load(gate.add(at));
            let mut v = if SIGMOID {
                sigmoid_lanes(g)
            } else {
                silu_lanes(g)
            };
            if let Some(other) = other {
                v = v.mul(V::load(other.add(at)));
            }
            v.store(out.add(at));
        }
    }
    full * V::LANES
}

/// `x[i] = exp(x[i] - max)` over whole chunks of 16, returning the sums of lanes 0–15 (value
/// `i` of a chunk into lane `i`), for [`softmax_exp_sum`].
///
/// # Safety
///
/// `V`'s instruction set available; `V` has 8 or 16 lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_sum_chunks<V: F32Lanes>(x: &mut [f32], max: f32) -> [f32; 16] {
    let mut lanes = [0.0f32; 16];
    // SAFETY: each part of a chunk holds `LANES` values, `lanes` 16; the instruction set is
    // the caller's.
    unsafe {
        let shift = V::splat(max);
        let mut sums = [V::splat(0.0); 2];
        for chunk in x.chunks_exact_mut(16) {
            for (part, sum) in chunk.chunks_exact_mut(V::LANES).zip(&mut sums) {
                let e = exp_lanes(V::load(part.as_ptr()).sub(shift));
                e.store(part.as_mut_ptr());
                *sum = sum.add(e);
            }
        }
        for (k, sum) in sums.iter().take(16 / V::LANES).enumerate() {
            sum.store(lanes.as_mut_ptr().add(k * V::LANES));
        }
    }
    lanes
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::simd::lanes::Avx2;

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

    /// [`super::exp_sum_chunks`] with 8 lanes (lanes 0–7 and 8–15 in two registers).
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn exp_sum_chunks(x: &mut [f32], max: f32) -> [f32; 16] {
        // SAFETY: AVX2 is available here.
        unsafe { super::exp_sum_chunks::<Avx2>(x, max) }
    }

    /// [`super::gate_mul_lanes`] with 8 lanes.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; the pointers as [`super::gate_mul_lanes`] says.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn gate_mul<const SIGMOID: bool>(
        gate: *const f32,
        other: Option<*const f32>,
        out: *mut f32,
        len: usize,
    ) -> usize {
        // SAFETY: AVX2 is available here; the pointers are the caller's contract.
        unsafe { super::gate_mul_lanes::<Avx2, SIGMOID>(gate, other, out, len) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::simd::lanes::Avx512;

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

    /// [`super::exp_sum_chunks`] with 16 lanes.
    ///
    /// # Safety
    ///
    /// AVX-512 must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn exp_sum_chunks(x: &mut [f32], max: f32) -> [f32; 16] {
        // SAFETY: AVX-512 is available here.
        unsafe { super::exp_sum_chunks::<Avx512>(x, max) }
    }

    /// [`super::gate_mul_lanes`] with 16 lanes.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; the pointers as [`super::gate_mul_lanes`] says.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn gate_mul<const SIGMOID: bool>(
        gate: *const f32,
        other: Option<*const f32>,
        out: *mut f32,
        len: usize,
    ) -> usize {
        // SAFETY: AVX-512 is available here; the pointers are the caller's contract.
        unsafe { super::gate_mul_lanes::<Avx512, SIGMOID>(gate, other, out, len) }
    }
}
