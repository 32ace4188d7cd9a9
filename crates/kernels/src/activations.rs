//! Element-wise activations built on one vectorisable `exp`: SiLU and sigmoid, and the gated
//! products built on them (SwiGLU's `silu(gate) · up`, Gated DeltaNet's `o · silu(z)`, gated
//! attention's `o · sigmoid(g)`).
//!
//! These run over every FFN hidden value and every Gated DeltaNet channel of every token, so a
//! libm `expf` call per value is a visible share of a verify pass (8 rows of a 0.8B hybrid:
//! ~0.9 M calls). [`exp`] is instead a fixed sequence of IEEE operations — range reduction by
//! `ln 2` in two parts, a degree-5 polynomial (Cephes' `expf` coefficients), and a power of two
//! built in the exponent bits — that the AVX2 and AVX-512 kernels execute lane by lane with the
//! same fused multiply-adds, so every level gives the same bits as this scalar reference (the
//! tests check it on awkward lengths and across the whole input range). Accuracy: within
//! 2 ulp of the exact exponential on `[-87, 88]`; inputs outside are clamped there (the
//! results, `~1.6e-38` and `~1.7e38`, change no SiLU or sigmoid value beyond the f32 result
//! they would round to anyway).

use crate::simd::{self, SimdLevel};

/// Inputs are clamped to `[EXP_MIN, EXP_MAX]`, where the scale `2^n` is a normal f32.
pub(crate) const EXP_MIN: f32 = -87.0;
pub(crate) const EXP_MAX: f32 = 88.0;
pub(crate) const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n · LN2_HI` is exact for every `|n| ≤ 127`.
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// `exp(r) ≈ 1 + r + r² · P(r)` on `|r| ≤ ln 2 / 2`, highest power first.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x`, the scalar reference of the SIMD kernels (bit-identical to them).
#[inline]
#[allow(clippy::manual_clamp)] // `clamp` keeps NaN; the SIMD `max` (like `f32::max`) does not
pub fn exp(x: f32) -> f32 {
    let x = x.max(EXP_MIN).min(EXP_MAX);
    let n = (x * LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// SiLU `x / (1 + e^-x)` with [`exp`].
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Logistic sigmoid `1 / (1 + e^-x)` with [`exp`].
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `x[i] = silu(x[i])`, at the process's [`simd::level`].
pub fn silu_in_place(x: &mut [f32]) {
    silu_in_place_at(simd::level(), x);
}

/// [`silu_in_place`] at `level` (which must be supported).
pub fn silu_in_place_at(level: SimdLevel, x: &mut [f32]) {
    match level {
        SimdLevel::Scalar => x.iter_mut().for_each(|v| *v = silu(*v)),
        _ => simd::silu_in_place(level, x),
    }
}

/// SwiGLU in place: `gate[i] = silu(gate[i]) · up[i]`, at the process's [`simd::level`].
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    swiglu_in_place_at(simd::level(), gate, up);
}

/// [`swiglu_in_place`] at `level` (which must be supported).
pub fn swiglu_in_place_at(level: SimdLevel, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: sizes differ");
    match level {
        SimdLevel::Scalar => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = silu(*g) * u;
            }
        }
        _ => simd::swiglu_in_place(level, gate, up),
    }
}

/// The function an output gate applies to its gate values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// `silu(g)`: Gated DeltaNet's `o · silu(z)` (the same products as [`swiglu_in_place`]
    /// with the result written over the other operand, bit for bit).
    Silu,
    /// `sigmoid(g)`: gated attention's output gate.
    Sigmoid,
}

impl Gate {
    /// The gate function of one value (the scalar reference).
    #[inline]
    pub fn apply(self, g: f32) -> f32 {
        match self {
            Gate::Silu => silu(g),
            Gate::Sigmoid => sigmoid(g),
        }
    }
}

/// `x[i] = f(gate[i]) · x[i]`, `f` the [`Gate`]'s function, at the process's
/// [`simd::level`].
pub fn gate_in_place(kind: Gate, x: &mut [f32], gate: &[f32]) {
    gate_in_place_at(simd::level(), kind, x, gate);
}

/// [`gate_in_place`] at `level` (which must be supported).
pub fn gate_in_place_at(level: SimdLevel, kind: Gate, x: &mut [f32], gate: &[f32]) {
    assert_eq!(x.len(), gate.len(), "gate: sizes differ");
    match level {
        SimdLevel::Scalar => {
            for (v, g) in x.iter_mut().zip(gate) {
                *v *= kind.apply(*g);
            }
        }
        _ => simd::gate_in_place(level, kind, x, gate),
    }
}

/// Lanes the softmax sums its exponentials in: element `i` goes to lane `i % 16`, and the
/// lanes are added in order at the end. (Fixed so that every SIMD level gives this reference's
/// bits; 16 is one AVX-512 register, two AVX2 ones.)
pub(crate) const SOFTMAX_LANES: usize = 16;

/// Softmax in place: `exp(x - max)` with [`exp`], summed in 16 f32 lanes (element `i` in lane
/// `i % 16`, the lanes added in order), scaled by the reciprocal of the sum; at the process's
/// [`simd::level`]. Attention runs it over every score row of every head and layer, where a
/// libm `expf` per score was a visible share of a verify pass.
pub fn softmax_in_place(x: &mut [f32]) {
    softmax_in_place_at(simd::level(), x);
}

/// [`softmax_in_place`] at `level` (which must be supported); every level gives the same bits.
pub fn softmax_in_place_at(level: SimdLevel, x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let sum = match level {
        SimdLevel::Scalar => {
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut lanes = [0.0f32; SOFTMAX_LANES];
            for (i, v) in x.iter_mut().enumerate() {
                *v = exp(*v - max);
                lanes[i % SOFTMAX_LANES] += *v;
            }
            lanes.iter().fold(0.0, |sum, &lane| sum + lane)
        }
        _ => simd::softmax_exp_sum(level, x),
    };
    let inverse = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inverse;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Distance in units of the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut x = vec![1.0, 2.0, 3.0, -100.0, 1000.0];
        softmax_in_place(&mut x);
        let sum: f32 = x.iter().sum();
        assert!((sum - 1.0).abs() < 1e-6);
        assert!(x[4] > 0.99 && x[3] >= 0.0);
        let mut y = vec![0.5, 0.25];
        softmax_in_place(&mut y);
        assert!(y[0] > y[1]);
        let mut uniform = vec![0.3; 37];
        softmax_in_place(&mut uniform);
        assert!(uniform.iter().all(|&p| (p - 1.0 / 37.0).abs() < 1e-7));
    }

    #[test]
    fn softmax_simd_levels_equal_the_scalar_reference() {
        for level in SimdLevel::supported() {
            for len in [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 1000] {
                let x = random_vec(len, 20.0, len as u64 + 7);
                let mut reference = x.clone();
                softmax_in_place_at(SimdLevel::Scalar, &mut reference);
                let mut got = x;
                softmax_in_place_at(level, &mut got);
                assert_eq!(bits(&got), bits(&reference), "{level:?} length {len}");
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulps_over_its_range() {
        let mut worst = 0;
        let steps = 200_000;
        for i in 0..=steps {
            let x = EXP_MIN + (EXP_MAX - EXP_MIN) * i as f32 / steps as f32;
            let exact = f64::from(x).exp() as f32;
            worst = worst.max(ulps(exp(x), exact));
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(EXP_MIN));
        assert_eq!(exp(1000.0), exp(EXP_MAX));
        assert!(
            exp(f32::NAN) > 0.0,
            "NaN is clamped like the SIMD max/min do"
        );
    }

    #[test]
    fn silu_matches_f64() {
        for i in -2000..=2000 {
            let x = i as f32 / 40.0;
            let want = f64::from(x) / (1.0 + (-f64::from(x)).exp());
            let got = f64::from(silu(x));
            assert!(
                (got - want).abs() <= 4.0 * f64::from(f32::EPSILON) * want.abs().max(1e-30),
                "silu({x}) = {got}, want {want}"
            );
        }
        let far = silu(-200.0);
        assert!(far <= 0.0 && far > -1e-35, "{far}");
        assert_eq!(silu(200.0), 200.0);
        assert!(silu(f32::NAN).is_nan());
        assert_eq!(silu(0.0), 0.0);
        let mut g = vec![1.0, -2.0];
        swiglu_in_place(&mut g, &[2.0, 3.0]);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
        assert_eq!(g[1], 3.0 * silu(-2.0));
        assert_eq!(sigmoid(0.0), 0.5);
        assert!((sigmoid(2.0) - 0.880_797).abs() < 1e-6);
        assert_eq!(sigmoid(-200.0), 1.0 / (1.0 + exp(EXP_MAX)));
    }

    /// Inputs over the whole range, the clamps, zeros, NaN and infinities.
    fn inputs(len: usize, seed: u64) -> Vec<f32> {
        let specials = [
            0.0,
            -0.0,
            -87.5,
            88.5,
            -200.0,
            200.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-30,
        ];
        random_vec(len, 30.0, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i % 7 == 3 {
                    specials[(i / 7) % specials.len()]
                } else {
                    *v
                }
            })
            .collect()
    }

    #[test]
    fn every_level_equals_the_scalar_reference_bit_for_bit() {
        for level in SimdLevel::supported() {
            for len in [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 3584] {
                let x = inputs(len, len as u64);
                let other = inputs(len, 1000 + len as u64);

                let (mut want, mut got) = (x.clone(), x.clone());
                silu_in_place_at(SimdLevel::Scalar, &mut want);
                silu_in_place_at(level, &mut got);
                assert_eq!(bits(&got), bits(&want), "silu {level:?} len {len}");

                let (mut want, mut got) = (x.clone(), x.clone());
                swiglu_in_place_at(SimdLevel::Scalar, &mut want, &other);
                swiglu_in_place_at(level, &mut got, &other);
                assert_eq!(bits(&got), bits(&want), "swiglu {level:?} len {len}");

                // The gate form gives the same products with the roles swapped.
                let mut gated = other.clone();
                gate_in_place_at(level, Gate::Silu, &mut gated, &x);
                assert_eq!(bits(&gated), bits(&want), "silu gate {level:?} len {len}");

                let (mut want, mut got) = (other.clone(), other.clone());
                gate_in_place_at(SimdLevel::Scalar, Gate::Sigmoid, &mut want, &x);
                gate_in_place_at(level, Gate::Sigmoid, &mut got, &x);
                assert_eq!(bits(&got), bits(&want), "sigmoid gate {level:?} len {len}");
            }
        }
    }
}
