//! Every dot-product kernel, at every SIMD level this CPU runs, against an exact f64 evaluation
//! of the same encoded rows.
//!
//! The levels sum in different orders, so they are compared with a bound rather than bit for
//! bit: the error of an f32 sum of `k` rounded terms is at most about `k · ε · Σ|term|`. The
//! magnitude is taken over the element-level terms the kernels add (integer partial sums may
//! cancel inside a lane): `|w_i · x_i|`, and for the K-quants with mins the scale terms and the
//! min terms separately. The bound is `(blocks + 16) · ε · magnitude`, with `blocks` the number
//! of f32 accumulation steps per lane of the scalar reference.
//!
//! Data: sizes of 1, 3 and 17 blocks and a large row; per block a random magnitude from 1e-4 to
//! 1e3 (activations 1e-6 to 1e4), some all-zero blocks and single outliers — so f16 scales
//! include subnormals, and blocks of very different sizes are summed together.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::simd::{Rows, SimdLevel};
use crate::types::Kernels;
use crate::{f16, q4_k, q5_k, q6_k, q8_0, q8_k, ActivationFormat, WeightType};

/// `n` values in blocks of `block`, each block with its own magnitude (one of `scales`), some
/// blocks zero, some with one outlier.
fn awkward_values(n: usize, block: usize, scales: &[f32], seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut x = Vec::with_capacity(n);
    for start in (0..n).step_by(block) {
        let len = block.min(n - start);
        let kind = rng.gen_range(0..10);
        let scale = scales[rng.gen_range(0..scales.len())];
        let mut values: Vec<f32> = (0..len)
            .map(|_| {
                if kind == 0 {
                    0.0
                } else {
                    rng.gen_range(-1.0..1.0) * scale
                }
            })
            .collect();
        if kind == 1 {
            let i = rng.gen_range(0..len);
            values[i] *= 30.0; // stays inside the f16 range at the largest block scale
        }
        x.extend(values);
    }
    x
}

const WEIGHT_SCALES: [f32; 6] = [1e-4, 1e-2, 0.05, 1.0, 30.0, 1e3];
const ACTIVATION_SCALES: [f32; 6] = [1e-6, 1e-2, 1.0, 3.0, 100.0, 1e4];

/// The exact value of a dot product of two encoded rows and the magnitude of the terms the
/// kernels add.
struct Exact {
    value: f64,
    magnitude: f64,
    /// f32 accumulation steps per lane of the scalar reference.
    steps: usize,
}

fn f16_at(bytes: &[u8], at: usize) -> f64 {
    f64::from(f16::to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]])))
}

/// Exact value of a float-family weight row (decoded exactly) with f32 activations.
fn exact_float(ty: WeightType, w: &[u8], x: &[f32]) -> Exact {
    let mut wd = vec![0.0; x.len()];
    crate::dequantize_row_into(ty, w, &mut wd);
    let terms = wd.iter().zip(x).map(|(a, b)| f64::from(*a) * f64::from(*b));
    Exact {
        value: terms.clone().sum(),
        magnitude: terms.map(f64::abs).sum(),
        steps: x.len() / 16 + 1,
    }
}

/// Exact value of a Q8_0 / Q4_0 weight row with a Q8_0 row: per block `isum · d_w · d_x`.
fn exact_block32(ty: WeightType, w: &[u8], x: &[u8]) -> Exact {
    let n = x.len() / q8_0::BLOCK_BYTES * 32;
    let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
    crate::dequantize_row_into(ty, w, &mut wd); // q · d is exact in f32
    q8_0::dequantize_row(x, &mut xd);
    let mut exact = Exact {
        value: 0.0,
        magnitude: 0.0,
        steps: n / 32,
    };
    for (a, b) in wd.iter().zip(&xd) {
        let term = f64::from(*a) * f64::from(*b);
        exact.value += term;
        exact.magnitude += term.abs();
    }
    exact
}

/// Exact value of a K-quant weight row with a Q8_K row, from the spec's decomposition.
fn exact_k(ty: WeightType, w: &[u8], x: &[u8]) -> Exact {
    let blocks = x.len() / q8_k::BLOCK_BYTES;
    let mut exact = Exact {
        value: 0.0,
        magnitude: 0.0,
        steps: blocks,
    };
    let bb = ty.block_bytes();
    let mut q = [0u8; 256];
    for (wb, xb) in w.chunks(bb).zip(x.chunks(q8_k::BLOCK_BYTES)) {
        let (dx, xq, bsums) = q8_k::parts(xb);
        let dx = f64::from(dx);
        let xi = |i: usize| f64::from(xq[i] as i8);
        match ty {
            WeightType::Q6K => {
                q6_k::levels(wb, &mut q);
                let scales = q6_k::group_scales(wb);
                let d = f64::from(q6_k::scale_of(wb));
                for i in 0..256 {
                    let term =
                        dx * d * f64::from(scales[i / 16]) * (f64::from(q[i]) - 32.0) * xi(i);
                    exact.value += term;
                    exact.magnitude += term.abs();
                }
            }
            _ => {
                if ty == WeightType::Q4K {
                    q4_k::levels(wb, &mut q);
                } else {
                    q5_k::levels(wb, &mut q);
                }
                let (sc, mn) = crate::k_quants::unpack_scales_mins(wb[4..16].try_into().unwrap());
                let (d, dmin) = (f16_at(wb, 0), f16_at(wb, 2));
                for i in 0..256 {
                    let term = dx * d * f64::from(sc[i / 32]) * f64::from(q[i]) * xi(i);
                    exact.value += term;
                    exact.magnitude += term.abs();
                }
                for g in 0..16 {
                    let term = dx * dmin * f64::from(mn[g / 2]) * f64::from(bsums[g]);
                    exact.value -= term;
                    exact.magnitude += term.abs();
                }
            }
        }
    }
    exact
}

fn assert_close(got: f32, exact: &Exact, what: &str) {
    let tol = (exact.steps as f64 + 16.0) * f64::from(f32::EPSILON) * exact.magnitude;
    assert!(
        got.is_finite() && (f64::from(got) - exact.value).abs() <= tol,
        "{what}: got {got}, exact {}, tolerance {tol}",
        exact.value
    );
}

/// Block counts tested for every type (the last is a large row).
const BLOCK_COUNTS: [usize; 4] = [1, 3, 17, 64];

#[test]
fn every_simd_level_matches_the_exact_dot_product_for_every_type() {
    for ty in WeightType::ALL {
        // Float types have no blocks: use 32-value "blocks" of data, plus ragged lengths.
        let block = ty.block_values().max(32);
        let mut lengths: Vec<usize> = BLOCK_COUNTS.iter().map(|b| b * block).collect();
        if ty.block_values() == 1 {
            lengths.extend([1, 15, 17, 100, 1000 + 7]);
        }
        for (case, &n) in lengths.iter().enumerate() {
            let seed = 1000 * case as u64 + ty.ggml().id() as u64;
            let w_values = awkward_values(n, block, &WEIGHT_SCALES, seed);
            let x_values = awkward_values(n, block, &ACTIVATION_SCALES, seed + 1);
            let w = crate::quantize(ty.ggml(), &w_values);
            let what = |level: SimdLevel| format!("{ty} with {n} values at {level}");
            match ty.info().kernels {
                Kernels::Float(kernels) => {
                    let exact = exact_float(ty, &w, &x_values);
                    let scalar = (kernels.dot_scalar)(&w, &x_values);
                    assert_close(scalar, &exact, &what(SimdLevel::Scalar));
                    for level in SimdLevel::supported() {
                        let mut out = [0.0];
                        (kernels.dot_rows)(level, &w, Rows::single(&x_values), &mut out);
                        assert_close(out[0], &exact, &what(level));
                    }
                }
                Kernels::Quantized(kernels) => {
                    let mut x = vec![0u8; ty.activation().row_bytes(n).unwrap()];
                    let exact = match ty.activation() {
                        ActivationFormat::Q8_0 => {
                            q8_0::quantize_row(&x_values, &mut x);
                            exact_block32(ty, &w, &x)
                        }
                        _ => {
                            q8_k::quantize_row(&x_values, &mut x);
                            exact_k(ty, &w, &x)
                        }
                    };
                    let (dot_rows, scalar) = (kernels.dot_rows, kernels.dot_scalar);
                    let reference = scalar(&w, &x);
                    assert_close(reference, &exact, &what(SimdLevel::Scalar));
                    for level in SimdLevel::supported() {
                        let mut out = [0.0];
                        dot_rows(level, &w, Rows::single(&x), &mut out);
                        assert_close(out[0], &exact, &what(level));
                        if level == SimdLevel::Scalar {
                            assert_eq!(out[0].to_bits(), reference.to_bits(), "{}", what(level));
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn attention_helpers_match_their_references_at_every_level() {
    for n in [0, 1, 7, 16, 31, 32, 33, 64, 100, 128, 129, 200, 1000] {
        let a = awkward_values(n, 16, &ACTIVATION_SCALES, 7 + n as u64);
        let b = awkward_values(n, 16, &ACTIVATION_SCALES, 8 + n as u64);
        let terms = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y));
        let exact = Exact {
            value: terms.clone().sum(),
            magnitude: terms.map(f64::abs).sum(),
            steps: n / 16 + 1,
        };
        let mut y_scalar = b.clone();
        crate::f32::axpy_scalar(0.37, &a, &mut y_scalar);
        let mut y_fused: Option<Vec<f32>> = None;
        for level in SimdLevel::supported() {
            let got = crate::f32::dot_f32_with(level, &a, &b);
            assert_close(got, &exact, &format!("dot_f32 of {n} at {level}"));
            // Same kernel as the F32 weight dot product, hence the same bits.
            let mut out = [0.0];
            crate::f32::dot_rows(
                level,
                crate::simd::f32_bytes(&a),
                Rows::single(&b),
                &mut out,
            );
            assert_eq!(got.to_bits(), out[0].to_bits(), "dot_f32 of {n} at {level}");

            let mut y = b.clone();
            crate::f32::axpy_with(level, 0.37, &a, &mut y);
            for (i, (got, reference)) in y.iter().zip(&y_scalar).enumerate() {
                let tol = 2.0 * f32::EPSILON * (0.37 * a[i].abs() + b[i].abs());
                assert!(
                    (got - reference).abs() <= tol,
                    "axpy[{i}] of {n} at {level}"
                );
            }
            // The many-rows forms equal the one-row forms bit for bit.
            if n > 0 {
                let keys: Vec<f32> = (0..5)
                    .flat_map(|k| b.iter().map(move |v| v * k as f32))
                    .collect();
                let rows = Rows::new(&keys, n, n, 5);
                let mut scores = [0.0; 5];
                crate::f32::dot_f32_rows_with(level, &a, rows, &mut scores);
                for (j, s) in scores.iter().enumerate() {
                    let one = crate::f32::dot_f32_with(level, &a, rows.row(j));
                    assert_eq!(s.to_bits(), one.to_bits(), "dot_f32_rows of {n} at {level}");
                }
                let weights = [0.5, -1.25, 3.0, 1e-3, 7.0];
                let mut summed = a.clone();
                crate::f32::weighted_sum_with(level, &weights, rows, &mut summed);
                let mut stepped = a.clone();
                for (j, w) in weights.iter().enumerate() {
                    crate::f32::axpy_with(level, *w, rows.row(j), &mut stepped);
                }
                assert_eq!(summed, stepped, "weighted_sum of {n} at {level}");
            }
            if level > SimdLevel::Scalar {
                // Every SIMD level fuses each element: AVX2 and AVX-512 agree bit for bit.
                match &y_fused {
                    Some(previous) => assert_eq!(previous, &y, "axpy of {n} at {level}"),
                    None => y_fused = Some(y),
                }
            }
        }
    }
}
