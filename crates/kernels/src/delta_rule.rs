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

/// Consecutive steps of one head through a snapshot ring's planes: `planes` holds planes of
/// `v.len() · k.len()` values; step 0 reads plane `read`, step `i` reads the state step `i - 1`
/// computed, writes its state to plane `writes[i]` (or nowhere, when `None`: a state the
/// ring overwrites before anyone reads it) and its output to `out[i · v.len() ..]`.
///
/// Each state row is carried in registers from step to step, so the state is read once and
/// each kept state written once, and where the CPU has AVX2 or AVX-512 the kept states are
/// written past the caches (rows of a multiple of 16 values in line-aligned planes, as a
/// snapshot ring's) (non-temporal stores: a snapshot is read again only after a rollback, a
/// live state only by the next pass), which spares the memory reading every plane before
/// overwriting it. Every step's state and output are bit for bit those of [`step`] at the same
/// level: a state row takes the same instructions in either order of the loops. A write to
/// `read` itself is allowed (the ring wraps round in a long chain): each state row is read
/// before any step writes it.
pub fn chain(
    xs: &[DeltaInputs<'_>],
    planes: &mut [f32],
    read: usize,
    writes: &[Option<usize>],
    out: &mut [f32],
) {
    chain_with(simd::level(), xs, planes, read, writes, out);
}

/// [`chain`] at `level` (which must be supported).
pub fn chain_with(
    level: SimdLevel,
    xs: &[DeltaInputs<'_>],
    planes: &mut [f32],
    read: usize,
    writes: &[Option<usize>],
    out: &mut [f32],
) {
    let Some(first) = xs.first() else {
        assert!(
            out.is_empty() && writes.is_empty(),
            "delta rule chain: no steps"
        );
        return;
    };
    let (dim, values) = (first.k.len(), first.v.len());
    assert!(
        xs.iter()
            .all(|x| x.k.len() == dim && x.q.len() == dim && x.v.len() == values),
        "delta rule chain: steps of different shapes"
    );
    let state_len = values * dim;
    let n_planes = planes.len().checked_div(state_len).unwrap_or(0);
    assert!(
        state_len > 0 && planes.len() == n_planes * state_len,
        "delta rule chain: planes are not whole states"
    );
    assert!(
        read < n_planes && writes.iter().flatten().all(|&p| p < n_planes),
        "delta rule chain: plane index out of range"
    );
    assert_eq!(
        writes.len(),
        xs.len(),
        "delta rule chain: one write per step"
    );
    assert_eq!(
        out.len(),
        xs.len() * values,
        "delta rule chain: one output per step and value"
    );
    if level != SimdLevel::Scalar
        && simd::delta_rule_chain(level, xs, planes, read, writes, out, None)
    {
        return;
    }
    // Row by row through one-row steps: a row's steps are the same instructions whether the
    // state has one row or many.
    let (mut row, mut next) = (vec![0.0f32; dim], vec![0.0f32; dim]);
    for j in 0..values {
        row.copy_from_slice(&planes[read * state_len + j * dim..][..dim]);
        for (i, x) in xs.iter().enumerate() {
            let one = DeltaInputs {
                v: &x.v[j..j + 1],
                ..*x
            };
            let o = &mut out[i * values + j..][..1];
            match level {
                SimdLevel::Scalar => step_scalar(one, &row, &mut next, o),
                _ => simd::delta_rule_step(level, one, &row, &mut next, o),
            }
            if let Some(p) = writes[i] {
                planes[p * state_len + j * dim..][..dim].copy_from_slice(&next);
            }
            std::mem::swap(&mut row, &mut next);
        }
    }
}

/// Whether [`chain_recorded`] runs at `level` for heads of `dim` key values: the register
/// kernels' head sizes (a multiple of 16 up to 128 at AVX-512, of 8 up to 128 at AVX2).
pub fn records_deltas(level: SimdLevel, dim: usize) -> bool {
    match level {
        SimdLevel::Scalar => false,
        SimdLevel::Avx2 => dim.is_multiple_of(8) && (8..=128).contains(&dim),
        _ => dim.is_multiple_of(16) && (16..=128).contains(&dim),
    }
}

/// [`chain`] at the process's level that also records each step's `δ`: step `i`'s
/// `(v_j − M_j · k) · beta` at `deltas[i · v.len() + j]`, from which [`replay`] rebuilds any
/// step's state exactly: a state the chain did not write can be had later without re-running
/// it. The state read from plane `read` is first taken through the recorded steps `prefix`
/// (as [`replay`] would: a chain can start from a state that was only recorded, with no
/// plane of its own, without writing it first).
///
/// # Panics
///
/// Unless [`records_deltas`] holds for the level and head size, or on the sizes [`chain`]
/// checks.
pub fn chain_recorded(
    xs: &[DeltaInputs<'_>],
    prefix: &[RankOne<'_>],
    planes: &mut [f32],
    read: usize,
    writes: &[Option<usize>],
    out: &mut [f32],
    deltas: &mut [f32],
) {
    let level = simd::level();
    let Some(first) = xs.first() else {
        return;
    };
    assert!(
        records_deltas(level, first.k.len()),
        "delta rule chain: no recording kernel at {level} for heads of {}",
        first.k.len()
    );
    assert_eq!(
        deltas.len(),
        out.len(),
        "delta rule chain: one delta per output"
    );
    assert!(
        prefix
            .iter()
            .all(|s| s.k.len() == first.k.len() && s.delta.len() == first.v.len()),
        "delta rule chain: a recorded step of another shape"
    );
    let state_len = first.v.len() * first.k.len();
    assert!(
        planes.len().is_multiple_of(state_len)
            && (read + 1) * state_len <= planes.len()
            && writes
                .iter()
                .flatten()
                .all(|&p| (p + 1) * state_len <= planes.len()),
        "delta rule chain: plane index out of range"
    );
    let recording = Recording { deltas, prefix };
    let ran = simd::delta_rule_chain(level, xs, planes, read, writes, out, Some(recording));
    assert!(ran, "delta rule chain: the recording kernel did not run");
}

/// What a recording chain keeps and starts from: a `δ` per step and state row, and the
/// recorded steps taking the read state to the chain's start.
pub(crate) struct Recording<'a, 'b> {
    pub deltas: &'a mut [f32],
    pub prefix: &'a [RankOne<'b>],
}

/// One recorded step of a [`chain_recorded`]: `M_j ← decay · M_j + δ_j · k` for every state
/// row `j`.
#[derive(Debug, Clone, Copy)]
pub struct RankOne<'a> {
    pub decay: f32,
    /// Key, `S` values.
    pub k: &'a [f32],
    /// One `δ` per state row.
    pub delta: &'a [f32],
}

/// The state after `steps` from `state_in`, into `state_out`: bit for bit the state a
/// recording chain computed there (the same multiply, then the same fused multiply-add, per
/// value; both are exact per value, so how they are vectorised changes no bit).
pub fn replay(steps: &[RankOne<'_>], state_in: &[f32], state_out: &mut [f32]) {
    replay_with(simd::level(), steps, state_in, state_out);
}

/// [`replay`] at `level` (which must be supported): each state row carried through every
/// step in registers where the CPU has AVX-512 and the keys are a multiple of 16, else the
/// scalar reference. Either way a value takes the same multiply and fused multiply-add.
pub fn replay_with(
    level: SimdLevel,
    steps: &[RankOne<'_>],
    state_in: &[f32],
    state_out: &mut [f32],
) {
    assert_eq!(
        state_in.len(),
        state_out.len(),
        "delta rule replay: state sizes differ"
    );
    assert!(
        steps
            .iter()
            .all(|step| step.delta.len() * step.k.len() == state_in.len()),
        "delta rule replay: a step of another shape"
    );
    if level != SimdLevel::Scalar && simd::delta_rule_replay(level, steps, state_in, state_out) {
        return;
    }
    state_out.copy_from_slice(state_in);
    for step in steps {
        let dim = step.k.len();
        for (row, &delta) in state_out.chunks_exact_mut(dim).zip(step.delta) {
            for (m, &k) in row.iter_mut().zip(step.k) {
                *m = delta.mul_add(k, *m * step.decay);
            }
        }
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
    use crate::aligned::AlignedVec;
    use crate::test_util::random_vec;

    /// Keys, queries and values of `steps` random steps (step `i` seeded from `seed + i`).
    fn step_inputs(dim: usize, values: usize, steps: usize, seed: usize) -> Vec<[Vec<f32>; 3]> {
        (0..steps)
            .map(|i| {
                let seed = (seed + i) as u64;
                [
                    random_vec(dim, 0.3, seed),
                    random_vec(dim, 0.3, seed + 1),
                    random_vec(values, 1.0, seed + 2),
                ]
            })
            .collect()
    }

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

    /// A chain's states and outputs are bit for bit those of its steps one at a time, at every
    /// level and awkward size (the register kernel's head sizes and the row-by-row ones), with
    /// skipped states, a wrap onto the read plane and a single step.
    #[test]
    fn a_chain_equals_its_steps_one_at_a_time() {
        for (dim, values, steps) in [
            (128, 12, 8),
            (128, 3, 1),
            (16, 5, 4),
            (37, 9, 5),
            (64, 6, 7),
            (24, 4, 3),
            (7, 2, 3),
        ] {
            let n_planes = 4;
            let state_len = values * dim;
            let inputs = step_inputs(dim, values, steps, 100 * dim);
            let xs: Vec<DeltaInputs<'_>> = inputs
                .iter()
                .enumerate()
                .map(|(i, [k, q, v])| DeltaInputs {
                    k,
                    q,
                    v,
                    decay: 0.9 + 0.01 * i as f32,
                    beta: 0.6,
                })
                .collect();
            let start = random_vec(n_planes * state_len, 0.5, dim as u64);
            let read = 1;
            // Planes as a ring from `read` would take them, the older states of a chain longer
            // than the ring skipped.
            let writes: Vec<Option<usize>> = (0..steps)
                .map(|i| (i + n_planes >= steps).then_some((read + i + 1) % n_planes))
                .collect();
            for level in SimdLevel::supported() {
                let mut want_planes = start.clone();
                let mut want_out = vec![0.0f32; steps * values];
                let mut state = start[read * state_len..][..state_len].to_vec();
                for (i, x) in xs.iter().enumerate() {
                    let mut next = vec![0.0f32; state_len];
                    step_with(
                        level,
                        *x,
                        &state,
                        &mut next,
                        &mut want_out[i * values..][..values],
                    );
                    if let Some(p) = writes[i] {
                        want_planes[p * state_len..][..state_len].copy_from_slice(&next);
                    }
                    state = next;
                }
                // On cache lines (non-temporal stores) and off them, under every CPU family's
                // tuning (the state prefetched ahead or not).
                crate::simd::for_each_tuning(|tuning| {
                    for offset in [0, 1] {
                        let mut buffer = AlignedVec::<f32>::zeroed(start.len() + 1);
                        let planes = &mut buffer.as_mut_slice()[offset..][..start.len()];
                        planes.copy_from_slice(&start);
                        let mut out = vec![f32::NAN; steps * values];
                        chain_with(level, &xs, planes, read, &writes, &mut out);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let case = format!("{level} dim {dim} offset {offset} {tuning:?}");
                        assert_eq!(bits(&out), bits(&want_out), "{case}: outputs");
                        assert_eq!(bits(planes), bits(&want_planes), "{case}: planes");
                    }
                });
            }
        }
    }

    /// Replay at every level the CPU has gives the scalar reference's bits, on head sizes with
    /// and without a vector kernel, odd row counts, and one to nine steps.
    #[test]
    fn replay_at_every_level_equals_the_scalar_reference() {
        for (dim, rows, steps) in [(16, 3, 1), (48, 5, 9), (128, 7, 4), (20, 3, 2), (128, 1, 2)] {
            let keys: Vec<Vec<f32>> = (0..steps)
                .map(|i| random_vec(dim, 0.3, (dim * 31 + i) as u64))
                .collect();
            let deltas: Vec<Vec<f32>> = (0..steps)
                .map(|i| random_vec(rows, 1.0, (rows * 17 + i) as u64))
                .collect();
            let recorded: Vec<RankOne<'_>> = (0..steps)
                .map(|i| RankOne {
                    decay: 0.97 - 0.01 * i as f32,
                    k: &keys[i],
                    delta: &deltas[i],
                })
                .collect();
            let start = random_vec(rows * dim, 0.5, dim as u64);
            let mut want = vec![0.0f32; start.len()];
            replay_with(SimdLevel::Scalar, &recorded, &start, &mut want);
            for level in SimdLevel::supported() {
                let mut got = vec![f32::NAN; start.len()];
                replay_with(level, &recorded, &start, &mut got);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{level} dim {dim} steps {steps}");
            }
        }
    }

    /// A recording chain's outputs and written states are those of a plain chain, and
    /// replaying its deltas rebuilds every step's state bit for bit.
    #[test]
    fn replayed_deltas_rebuild_every_state_of_a_recorded_chain() {
        let level = simd::level();
        for (dim, values, steps) in [(128, 12, 8), (16, 5, 3), (64, 7, 1), (24, 4, 3)] {
            if !records_deltas(level, dim) {
                continue;
            }
            let state_len = values * dim;
            let inputs = step_inputs(dim, values, steps, 7 * dim);
            let xs: Vec<DeltaInputs<'_>> = inputs
                .iter()
                .enumerate()
                .map(|(i, [k, q, v])| DeltaInputs {
                    k,
                    q,
                    v,
                    decay: 0.95 - 0.02 * i as f32,
                    beta: 0.4,
                })
                .collect();
            let n_planes = steps + 1;
            let start = random_vec(n_planes * state_len, 0.5, dim as u64);
            let writes: Vec<Option<usize>> = (0..steps).map(|i| Some(i + 1)).collect();
            let mut want = AlignedVec::<f32>::zeroed(start.len());
            want.as_mut_slice().copy_from_slice(&start);
            let mut want_out = vec![0.0f32; steps * values];
            chain_with(level, &xs, want.as_mut_slice(), 0, &writes, &mut want_out);

            let mut planes = AlignedVec::<f32>::zeroed(start.len());
            planes.as_mut_slice().copy_from_slice(&start);
            let mut out = vec![0.0f32; steps * values];
            let mut deltas = vec![0.0f32; steps * values];
            // Only the last state written, as a deferring ring does.
            let last: Vec<Option<usize>> = (0..steps)
                .map(|i| (i + 1 == steps).then_some(steps))
                .collect();
            chain_recorded(
                &xs,
                &[],
                planes.as_mut_slice(),
                0,
                &last,
                &mut out,
                &mut deltas,
            );
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want_out), "dim {dim}: outputs");
            let plane = |p: &[f32], i: usize| p[i * state_len..][..state_len].to_vec();
            assert_eq!(
                bits(&plane(planes.as_slice(), steps)),
                bits(&plane(want.as_slice(), steps))
            );
            let recorded: Vec<RankOne<'_>> = (0..steps)
                .map(|i| RankOne {
                    decay: xs[i].decay,
                    k: xs[i].k,
                    delta: &deltas[i * values..][..values],
                })
                .collect();
            for i in 1..=steps {
                let mut rebuilt = vec![f32::NAN; state_len];
                replay(&recorded[..i], &plane(&start, 0), &mut rebuilt);
                assert_eq!(
                    bits(&rebuilt),
                    bits(&plane(want.as_slice(), i)),
                    "dim {dim}: step {i}"
                );
            }
            // A chain from a recorded state: the plane it was recorded from, then the steps.
            for i in 1..steps {
                let mut from = AlignedVec::<f32>::zeroed(start.len());
                from.as_mut_slice().copy_from_slice(&start);
                let rest = steps - i;
                let (mut out, mut deltas) = (vec![0.0f32; rest * values], vec![0.0; rest * values]);
                let last: Vec<Option<usize>> =
                    (0..rest).map(|j| (j + 1 == rest).then_some(1)).collect();
                let (head, tail) = (&recorded[..i], &xs[i..]);
                chain_recorded(
                    tail,
                    head,
                    from.as_mut_slice(),
                    0,
                    &last,
                    &mut out,
                    &mut deltas,
                );
                assert_eq!(
                    bits(&out),
                    bits(&want_out[i * values..]),
                    "dim {dim}: from {i}"
                );
                assert_eq!(
                    bits(&plane(from.as_slice(), 1)),
                    bits(&plane(want.as_slice(), steps)),
                    "dim {dim}: from {i}"
                );
                let want_deltas: Vec<f32> = recorded[i..]
                    .iter()
                    .flat_map(|r| r.delta.iter().copied())
                    .collect();
                assert_eq!(bits(&deltas), bits(&want_deltas), "dim {dim}: from {i}");
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
