//! One step of the gated delta rule — the recurrence of a Gated DeltaNet value head — fused
//! into one pass per state row.
//!
//! The state `M` has one row per value dimension `j` and one column per key dimension `i`. For
//! a token with key `k`, query `q`, value `v`, decay `exp(g)` and write strength `beta`:
//!
//! ```text
//! M_j ← decay · M_j
//! d_j = (v_j − M_j · k) · beta
//! M_j ← M_j + d_j · k
//! o_j = M_j · q
//! ```
//!
//! The state is read from one buffer and written to another (the snapshot ring's planes), so
//! a step never overwrites a state that rollback may still need. Each row is one pass of
//! loads, multiplies and stores with its two dot products in registers — no call per row.
//! Like every kernel here, a level's result depends only on the inputs, so a verify row and a
//! single-token step agree bit for bit.

use crate::simd::{self, SimdLevel};

/// The per-token inputs of one value head's step.
#[derive(Debug, Clone, Copy)]
pub struct DeltaInputs<'a> {
    /// Key, `S` values (L2-normalised by the caller).
    pub k: &'a [f32],
    /// Query, `S` values.
    pub q: &'a [f32],
    /// Value, one per state row.
    pub v: &'a [f32],
    /// `exp(g)`: how much of the previous state is kept.
    pub decay: f32,
    /// Write strength (`sigmoid(b)`).
    pub beta: f32,
}

/// One step at the process's [`simd::level`]: reads `state_in` (`v.len()` rows of `k.len()`),
/// writes the next state to `state_out` and the head output to `out` (`v.len()` values).
pub fn step(x: DeltaInputs<'_>, state_in: &[f32], state_out: &mut [f32], out: &mut [f32]) {
    step_with(simd::level(), x, state_in, state_out, out);
}

/// [`step`] at `level` (which must be supported).
pub fn step_with(
    level: SimdLevel,
    x: DeltaInputs<'_>,
    state_in: &[f32],
    state_out: &mut [f32],
    out: &mut [f32],
) {
    let dim = x.k.len();
    assert_eq!(x.q.len(), dim, "delta rule: query and key lengths differ");
    assert_eq!(out.len(), x.v.len(), "delta rule: one output per value");
    assert_eq!(
        state_in.len(),
        x.v.len() * dim,
        "delta rule: input state is not values × keys"
    );
    assert_eq!(
        state_out.len(),
        state_in.len(),
        "delta rule: state sizes differ"
    );
    match level {
        SimdLevel::Scalar => step_scalar(x, state_in, state_out, out),
        _ => simd::delta_rule_step(level, x, state_in, state_out, out),
    }
}

/// Scalar reference of [`step`]: each dot product summed in order in one f32.
pub fn step_scalar(x: DeltaInputs<'_>, state_in: &[f32], state_out: &mut [f32], out: &mut [f32]) {
    let dim = x.k.len();
    for (j, (row_out, row_in)) in state_out
        .chunks_exact_mut(dim)
        .zip(state_in.chunks_exact(dim))
        .enumerate()
    {
        let mut predicted = 0.0f32;
        for ((o, i), k) in row_out.iter_mut().zip(row_in).zip(x.k) {
            *o = i * x.decay;
            predicted += *o * k;
        }
        let delta = (x.v[j] - predicted) * x.beta;
        let mut read = 0.0f32;
        for ((o, k), q) in row_out.iter_mut().zip(x.k).zip(x.q) {
            *o += delta * k;
            read += *o * q;
        }
        out[j] = read;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    /// f64 reference of one step.
    fn reference(x: DeltaInputs<'_>, state_in: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let dim = x.k.len();
        let mut state: Vec<f64> = state_in.iter().map(|&v| f64::from(v)).collect();
        let mut out = vec![0.0; x.v.len()];
        for (j, row) in state.chunks_exact_mut(dim).enumerate() {
            row.iter_mut().for_each(|m| *m *= f64::from(x.decay));
            let predicted: f64 = row.iter().zip(x.k).map(|(m, k)| m * f64::from(*k)).sum();
            let delta = (f64::from(x.v[j]) - predicted) * f64::from(x.beta);
            row.iter_mut()
                .zip(x.k)
                .for_each(|(m, k)| *m += delta * f64::from(*k));
            out[j] = row.iter().zip(x.q).map(|(m, q)| m * f64::from(*q)).sum();
        }
        (state, out)
    }

    /// Every level (the scalar reference included) stays within a few ulps of the f64
    /// reference, at awkward sizes (tails of every length, a single column, the real 128).
    #[test]
    fn every_level_matches_the_f64_reference_at_awkward_sizes() {
        for (dim, values) in [
            (1, 3),
            (7, 5),
            (16, 16),
            (37, 9),
            (64, 6),
            (128, 12),
            (200, 4),
        ] {
            let k = random_vec(dim, 0.3, dim as u64);
            let q = random_vec(dim, 0.3, dim as u64 + 1);
            let v = random_vec(values, 1.0, dim as u64 + 2);
            let state_in = random_vec(values * dim, 0.5, dim as u64 + 3);
            let x = DeltaInputs {
                k: &k,
                q: &q,
                v: &v,
                decay: 0.93,
                beta: 0.7,
            };
            let (want_state, want_out) = reference(x, &state_in);
            let magnitude = 1.0 + dim as f64 * 0.5;
            for level in SimdLevel::supported() {
                let mut state = vec![f32::NAN; values * dim];
                let mut out = vec![f32::NAN; values];
                step_with(level, x, &state_in, &mut state, &mut out);
                let bound = (dim as f64 + 4.0) * f64::from(f32::EPSILON) * magnitude;
                for (got, want) in state.iter().zip(&want_state) {
                    assert!(
                        (f64::from(*got) - want).abs() <= bound,
                        "{level} dim {dim}: state {got} vs {want}"
                    );
                }
                for (got, want) in out.iter().zip(&want_out) {
                    assert!(
                        (f64::from(*got) - want).abs() <= bound,
                        "{level} dim {dim}: output {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A step only reads its inputs: the same inputs give the same bits, whatever the output
    /// buffers held before.
    #[test]
    fn results_do_not_depend_on_the_output_buffers() {
        let dim = 40;
        let k = random_vec(dim, 0.3, 1);
        let q = random_vec(dim, 0.3, 2);
        let v = random_vec(6, 1.0, 3);
        let state_in = random_vec(6 * dim, 0.5, 4);
        let x = DeltaInputs {
            k: &k,
            q: &q,
            v: &v,
            decay: 0.5,
            beta: 0.25,
        };
        for level in SimdLevel::supported() {
            let mut first = (vec![0.0; 6 * dim], vec![0.0; 6]);
            let mut second = (vec![7.0; 6 * dim], vec![-3.0; 6]);
            step_with(level, x, &state_in, &mut first.0, &mut first.1);
            step_with(level, x, &state_in, &mut second.0, &mut second.1);
            assert_eq!(first, second, "{level}");
        }
    }
}
