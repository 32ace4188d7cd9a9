//! The Gated DeltaNet recurrence on the CPU: the convolution over the conv state, the L2 norms
//! and the delta rule head by head ([`crate::blocks::gdn`] says what it computes).
//!
//! The convolution runs through [`conv_rows`] and the recurrence head by head: a pass's rows
//! in runs of up to 16 (and each run of a tree's rows that continue the row before) as chains
//! through [`delta_rule::chain`], which read the state a run starts from once and write a
//! state only where the ring's plan says ([`SnapshotRing::plan_chain`]: a run's last row; the
//! others' rank-one steps recorded). A state row takes the same instructions whatever the
//! run, so a verify row and a single-token evaluation agree bit for bit ([`head_step`] is the
//! one-row step they equal).

use rayon::prelude::*;
use specula_kernels::activations::{self, Gate};
use specula_kernels::delta_rule::{self, DeltaInputs};
use specula_kernels::ops;
use specula_kernels::simd;

use crate::blocks::gdn::{GdnShape, GdnWeights};
use crate::recurrent::{ChainPlan, Prefix, SnapshotRing};

/// Below this many state values per token, heads run on the calling thread.
const PARALLEL_MIN_STATE: usize = 1 << 15;

/// The most rows a chain runs through [`delta_rule::chain`] (each state row carried in
/// registers through all the rows); longer evaluations (prefill) run as several. The chain's
/// steps are one dependency chain per state row, fed with every row's keys and queries again
/// for each state row: past 16 rows those no longer stay in L1 (qwen35-0.8b Q8_0, Emerald
/// Rapids Xeon, both ways taking turns in one process, GDN time per pass chained against row
/// by row: 1 row 2.26 / 2.48 ms against 2.56 / 2.80, 4 rows 4.74 / 5.15 against 7.00 / 6.88, 8
/// rows 9.62 / 9.66 against 13.75 / 14.23, 12 rows 12.46 / 13.89 against 16.94 / 16.70).
const CHAIN_MAX_ROWS: usize = 16;

/// How [`recurrence`] runs its rows through the S matrices.
enum Plan {
    Chain(ChainPlan),
    /// The planes of a tree's start state and of each row's.
    Tree(Vec<usize>),
}

/// One value head's buffers in [`recurrence`]: its S matrices in every plane, its outputs
/// and its recorded rank-one steps.
type HeadBuffers<'a> = ((&'a mut [f32], &'a mut [f32]), &'a mut [f32]);

/// Buffers of [`recurrence`] for up to `rows` rows.
#[derive(Debug, Default)]
pub struct GdnScratch {
    /// Betas and alphas split out of a grouped projection.
    beta: Vec<f32>,
    alpha: Vec<f32>,
    /// The convolved, normalised `[q | k | v]` of every row.
    qkv: Vec<f32>,
    /// Head outputs head-major (`[head][row][S]`), as the parallel heads write them.
    heads: Vec<f32>,
    /// A deferring chain's rank-one steps, `[head][row]`: decay, `S` keys, `S` deltas.
    updates: Vec<f32>,
}

impl GdnScratch {
    pub fn new(shape: &GdnShape, rows: usize) -> Self {
        let hv = shape.n_v_heads;
        Self {
            beta: vec![0.0; rows * hv],
            alpha: vec![0.0; rows * hv],
            qkv: vec![0.0; rows * shape.channels()],
            heads: vec![0.0; rows * shape.value_dim()],
            updates: vec![0.0; rows * hv * (1 + 2 * shape.head_dim)],
        }
    }
}

/// Where [`recurrence`] finds the rows' betas and alphas.
#[derive(Debug, Clone, Copy)]
pub enum BetaAlphaIn<'a> {
    /// One beta and one alpha per value head, in two buffers.
    Separate { beta: &'a [f32], alpha: &'a [f32] },
    /// Grouped per key head: `Hv/Hk` betas then `Hv/Hk` alphas (qwen3next's `ssm_ba`).
    Grouped(&'a [f32]),
}

/// The projected rows of a GDN layer.
#[derive(Debug, Clone, Copy)]
pub struct GdnRows<'a> {
    /// `m × channels`: the mixed `[q | k | v]`.
    pub mixed: &'a [f32],
    /// `m × value_dim`: the output gate.
    pub z: &'a [f32],
    pub beta_alpha: BetaAlphaIn<'a>,
}

/// Runs GDN layer `slot` (its index among the model's GDN layers) over `m` projected rows and
/// writes the normalised, gated head outputs to `out` (`m × value_dim`, row-major).
///
/// Row `i` is the `step0 + i`-th token after the ring's live state: it reads that state and
/// writes the next plane (see [`SnapshotRing::conv_io`]); the caller advances the ring once the
/// whole evaluation is done. The convolution runs the rows (in parallel when there are
/// several; a row depends only on the inputs before it); then each value head runs all
/// `m` rows with its S matrix hot in cache, the heads in parallel (one fork-join per layer
/// however many rows are verified). Every row takes the same steps as a single-token call.
///
/// With `tree` (the rows of a tree evaluation), row `i` reads the state its parent wrote
/// (`tree[i]`: that state's step, 0 for a root) instead of the one before it — its
/// convolution's inputs and its S matrices are its path's — and still writes step
/// `step0 + i + 1`.
#[allow(clippy::too_many_arguments)]
pub fn recurrence(
    shape: &GdnShape,
    w: &GdnWeights,
    input: GdnRows<'_>,
    m: usize,
    ring: &mut SnapshotRing,
    slot: usize,
    step0: usize,
    tree: Option<&[usize]>,
    s: &mut GdnScratch,
    out: &mut [f32],
) {
    let (c, vd, hv, sd) = (
        shape.channels(),
        shape.value_dim(),
        shape.n_v_heads,
        shape.head_dim,
    );
    let (beta, alpha) = match input.beta_alpha {
        BetaAlphaIn::Separate { beta, alpha } => (beta, alpha),
        BetaAlphaIn::Grouped(ba) => {
            let per_group = hv / shape.n_k_heads;
            for i in 0..m {
                let row = &ba[i * 2 * hv..(i + 1) * 2 * hv];
                for (g, group) in row.chunks_exact(2 * per_group).enumerate() {
                    let heads = i * hv + g * per_group..i * hv + (g + 1) * per_group;
                    s.beta[heads.clone()].copy_from_slice(&group[..per_group]);
                    s.alpha[heads].copy_from_slice(&group[per_group..]);
                }
            }
            (&s.beta[..], &s.alpha[..])
        }
    };
    let mixed = &input.mixed[..m * c];
    match tree {
        None => {
            conv_rows(
                shape,
                w,
                ring.conv_state(slot, step0),
                mixed,
                &mut s.qkv[..m * c],
            );
            for (i, mixed) in mixed.chunks_exact(c).enumerate() {
                let (src, dst) = ring.conv_io(slot, step0 + i);
                next_conv_state(src, mixed, dst);
            }
        }
        // Row by row: a row's history is its parent's convolution state.
        Some(reads) => {
            for (i, mixed) in mixed.chunks_exact(c).enumerate() {
                let (src, dst) = ring.conv_tree_io(slot, reads[i], step0 + i);
                conv_rows(shape, w, src, mixed, &mut s.qkv[i * c..(i + 1) * c]);
                next_conv_state(src, mixed, dst);
            }
        }
    }

    // A chain writes the S matrices where its runs end and records its other rows' rank-one
    // steps (1 KiB per head and row) for the ring to rebuild if a rollback lands on one; a
    // tree writes every row's (a later row may start from any).
    let plan = match tree {
        None => Plan::Chain(ring.plan_chain(
            slot,
            step0,
            m,
            CHAIN_MAX_ROWS,
            delta_rule::records_deltas(simd::level(), sd),
        )),
        Some(_) => Plan::Tree(ring.plan_tree(slot, step0, m)),
    };
    let stride = 1 + 2 * sd;
    let (qkv, z) = (&s.qkv[..m * c], &input.z[..m * vd]);
    let per_head = ring.head_planes_len();
    let (states, prefix) = match &plan {
        Plan::Chain(plan) => ring.layer_states(slot, plan),
        Plan::Tree(_) => (ring.layer_heads_mut(slot), Prefix::default()),
    };
    let head = |(h, ((planes, outputs), updates)): (usize, HeadBuffers<'_>)| {
        let inputs = |i: usize| HeadInputs {
            qkv: &qkv[i * c..(i + 1) * c],
            z: &z[i * vd + h * sd..][..sd],
            beta: beta[i * hv + h],
            alpha: alpha[i * hv + h],
        };
        // Rows `rows` as one chain through `delta_rule::chain`: the first reads plane `read`,
        // each later one the state the row before computed (in registers); row `i`'s state
        // goes to plane `writes[i - rows.start]`, or nowhere; with `record`, each row's
        // rank-one step goes to `updates`.
        let chain = |planes: &mut [f32],
                     outputs: &mut [f32],
                     updates: &mut [f32],
                     rows: std::ops::Range<usize>,
                     read: usize,
                     writes: &[Option<usize>],
                     record: bool| {
            let xs: Vec<DeltaInputs<'_>> = rows
                .clone()
                .map(|i| delta_inputs(shape, w, h, inputs(i)))
                .collect();
            let run = &mut outputs[rows.start * sd..rows.end * sd];
            if record {
                let mut deltas = vec![0.0f32; rows.len() * sd];
                // The first run starts from the state the recorded prefix leads to.
                let prefix = match rows.start {
                    0 => prefix.head(h),
                    _ => Vec::new(),
                };
                delta_rule::chain_recorded(&xs, &prefix, planes, read, writes, run, &mut deltas);
                let steps = &mut updates[rows.start * stride..rows.end * stride];
                for ((x, u), d) in xs
                    .iter()
                    .zip(steps.chunks_exact_mut(stride))
                    .zip(deltas.chunks_exact(sd))
                {
                    u[0] = x.decay;
                    u[1..1 + sd].copy_from_slice(x.k);
                    u[1 + sd..].copy_from_slice(d);
                }
            } else {
                delta_rule::chain(&xs, planes, read, writes, run);
            }
            for (i, o) in rows.zip(run.chunks_exact_mut(sd)) {
                gated_output(shape, w, o, inputs(i).z);
            }
        };
        match (&plan, tree) {
            (Plan::Chain(plan), _) => {
                for (rows, read) in &plan.runs {
                    let writes = &plan.writes[rows.clone()];
                    let record = plan.record;
                    chain(
                        planes,
                        outputs,
                        updates,
                        rows.clone(),
                        *read,
                        writes,
                        record,
                    );
                }
            }
            // A tree: each run of rows that continue the row before (`reads[i]` the step row
            // `i - 1` wrote) as one chain from its first row's parent; every state kept.
            (Plan::Tree(tree_planes), Some(reads)) => {
                let writes: Vec<Option<usize>> =
                    tree_planes[step0 + 1..].iter().copied().map(Some).collect();
                let mut first = 0;
                while first < m {
                    let mut end = first + 1;
                    while end < m && end - first < CHAIN_MAX_ROWS && reads[end] == step0 + end {
                        end += 1;
                    }
                    let read = tree_planes[reads[first]];
                    let run_writes = &writes[first..end];
                    chain(
                        planes,
                        outputs,
                        updates,
                        first..end,
                        read,
                        run_writes,
                        false,
                    );
                    first = end;
                }
            }
            (Plan::Tree(_), None) => unreachable!("a tree plan for a chain"),
        }
    };
    let heads = &mut s.heads[..m * vd];
    let updates = &mut s.updates[..hv * m * stride];
    if hv * sd * sd < PARALLEL_MIN_STATE {
        states
            .chunks_exact_mut(per_head)
            .zip(heads.chunks_exact_mut(m * sd))
            .zip(updates.chunks_exact_mut(m * stride))
            .enumerate()
            .for_each(head);
    } else {
        states
            .par_chunks_exact_mut(per_head)
            .zip(heads.par_chunks_exact_mut(m * sd))
            .zip(updates.par_chunks_exact_mut(m * stride))
            .enumerate()
            .for_each(head);
    }
    match &plan {
        Plan::Chain(plan) => ring.commit_chain(slot, plan, &s.updates[..hv * m * stride], sd),
        Plan::Tree(planes) => ring.commit_tree(slot, step0, planes),
    }
    // Head-major to row-major for `ssm_out`.
    for (h, rows) in s.heads[..m * vd].chunks_exact(m * sd).enumerate() {
        for (i, o) in rows.chunks_exact(sd).enumerate() {
            out[i * vd + h * sd..][..sd].copy_from_slice(o);
        }
    }
}

/// The causal convolution of `m` rows (`mixed`, `m × channels`) after the convolution state
/// `history` (the `kernel - 1` inputs before the first row, oldest first): each row's
/// convolved `[q | k | v]` after SiLU to `qkv`, with `q` and `k` L2-normalised per head and `q`
/// scaled by `1/sqrt(S)`.
///
/// A row depends only on the inputs before it, not on earlier rows' results, so several rows
/// run in parallel; each row runs the same code either way.
pub fn conv_rows(
    shape: &GdnShape,
    w: &GdnWeights,
    history: &[f32],
    mixed: &[f32],
    qkv: &mut [f32],
) {
    let c = shape.channels();
    let history_rows = shape.conv_kernel - 1;
    let row = |(i, qkv): (usize, &mut [f32])| {
        // Tap `t` of row `i` reads the input `history_rows - t` rows before it.
        let input = |t: usize| {
            let back = history_rows - t;
            if back <= i {
                &mixed[(i - back) * c..][..c]
            } else {
                &history[(history_rows - (back - i)) * c..][..c]
            }
        };
        conv_row(shape, w, input, qkv);
    };
    if qkv.len() > c {
        qkv.par_chunks_exact_mut(c).enumerate().for_each(row);
    } else {
        qkv.chunks_exact_mut(c).enumerate().for_each(row);
    }
}

/// One row of [`conv_rows`]: `input(t)` is the input under tap `t` (oldest first; the last
/// tap is the row's own input).
fn conv_row<'a>(
    shape: &GdnShape,
    w: &GdnWeights,
    input: impl Fn(usize) -> &'a [f32],
    qkv: &mut [f32],
) {
    let (c, sd) = (shape.channels(), shape.head_dim);
    // Per channel the taps are summed oldest first, a tap at a time over all channels
    // (vectorisable).
    qkv.fill(0.0);
    for (t, tap) in w.conv_by_tap.chunks_exact(c).enumerate() {
        for ((o, t), v) in qkv.iter_mut().zip(tap).zip(input(t)) {
            *o += v * t;
        }
    }
    activations::silu_in_place(qkv);
    let (q, rest) = qkv.split_at_mut(shape.key_dim());
    let k = &mut rest[..shape.key_dim()];
    let q_scale = 1.0 / (sd as f32).sqrt();
    for head in q.chunks_exact_mut(sd) {
        ops::l2_norm_in_place(head, shape.eps);
        for value in head.iter_mut() {
            *value *= q_scale;
        }
    }
    for head in k.chunks_exact_mut(sd) {
        ops::l2_norm_in_place(head, shape.eps);
    }
}

/// The convolution state after one more input: `src` (the last `kernel - 1` inputs) shifted
/// by one row, `mixed` appended, into `dst`.
pub fn next_conv_state(src: &[f32], mixed: &[f32], dst: &mut [f32]) {
    let c = mixed.len();
    if let Some(kept) = dst.len().checked_sub(c) {
        dst[..kept].copy_from_slice(&src[c..]);
        dst[kept..].copy_from_slice(mixed);
    }
}

/// One token's inputs to one value head.
#[derive(Debug, Clone, Copy)]
pub struct HeadInputs<'a> {
    /// The token's convolved `[q | k | v]` ([`conv_rows`]).
    pub qkv: &'a [f32],
    /// The head's output gate (`S`).
    pub z: &'a [f32],
    /// Pre-sigmoid beta.
    pub beta: f32,
    /// Pre-softplus alpha.
    pub alpha: f32,
}

/// One token through value head `h`'s recurrence: reads the S matrix `state_in`, writes the
/// next one to `state_out` and the normalised, gated head output to `o` (`S`).
pub fn head_step(
    shape: &GdnShape,
    w: &GdnWeights,
    h: usize,
    x: HeadInputs<'_>,
    state_in: &[f32],
    state_out: &mut [f32],
    o: &mut [f32],
) {
    delta_rule::step(delta_inputs(shape, w, h, x), state_in, state_out, o);
    gated_output(shape, w, o, x.z);
}

/// Value head `h`'s delta-rule inputs for one token: its query, key and value, decay and
/// write strength.
fn delta_inputs<'a>(
    shape: &GdnShape,
    w: &GdnWeights,
    h: usize,
    x: HeadInputs<'a>,
) -> DeltaInputs<'a> {
    let sd = shape.head_dim;
    let key_dim = shape.key_dim();
    let kh = shape.head_map.key_head(h, shape.n_k_heads, shape.n_v_heads);
    let g = ops::softplus(x.alpha + w.dt_bias[h]) * w.a[h];
    DeltaInputs {
        q: &x.qkv[kh * sd..(kh + 1) * sd],
        k: &x.qkv[key_dim + kh * sd..key_dim + (kh + 1) * sd],
        v: &x.qkv[2 * key_dim + h * sd..2 * key_dim + (h + 1) * sd],
        decay: g.exp(),
        beta: activations::sigmoid(x.beta),
    }
}

/// A head's raw delta-rule output `o` normalised and gated by `z`, in place.
fn gated_output(shape: &GdnShape, w: &GdnWeights, o: &mut [f32], z: &[f32]) {
    ops::rms_norm_in_place(o, &w.norm, shape.eps);
    activations::gate_in_place(Gate::Silu, o, z);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::gdn::{BetaAlpha, BetaAlphaLayout, HeadMap};
    use crate::model::weights::{MatrixRef, Vector};

    fn vector(values: &[f32]) -> Vector {
        Vector {
            name: String::new(),
            values: values.to_vec(),
        }
    }

    /// One head, S = 2, against the recurrence written out by hand in f64.
    #[test]
    fn conv_and_head_steps_match_the_delta_rule() {
        let shape = GdnShape {
            n_embd: 4,
            conv_kernel: 2,
            head_dim: 2,
            n_k_heads: 1,
            n_v_heads: 1,
            head_map: HeadMap::Tiled,
            beta_alpha: BetaAlphaLayout::Separate,
            eps: 1e-6,
        };
        let dummy = MatrixRef {
            name: String::new(),
            ty: specula_kernels::WeightType::F32,
            rows: 0,
            cols: 0,
            interleaved: None,
        };
        let w = GdnWeights {
            attn_qkv: dummy.clone(),
            attn_gate: dummy.clone(),
            beta_alpha: BetaAlpha::Grouped(dummy.clone()),
            // Every channel: taps [0.5, 1.0] (previous input, current input).
            conv: vector(&[0.5, 1.0].repeat(6)),
            conv_by_tap: [[0.5f32; 6], [1.0; 6]].concat(),
            dt_bias: vector(&[0.1]),
            a: vector(&[-0.5]),
            norm: vector(&[1.0, 1.0]),
            ssm_out: dummy,
        };
        let mixed = [0.3, -0.2, 0.4, 0.1, 0.7, -0.6];
        let conv_prev = [0.2, 0.1, -0.3, 0.5, 0.0, 0.4];
        let s_prev = [0.1, 0.2, -0.1, 0.3];
        let (beta_raw, alpha_raw, z) = (0.4f32, -0.2f32, [0.9f32, -1.1]);
        let mut conv_next = [0.0; 6];
        let mut s_next = [0.0; 4];
        let mut qkv = vec![0.0; 6];
        let mut out = [0.0; 2];
        conv_rows(&shape, &w, &conv_prev, &mixed, &mut qkv);
        next_conv_state(&conv_prev, &mixed, &mut conv_next);
        let inputs = HeadInputs {
            qkv: &qkv,
            z: &z,
            beta: beta_raw,
            alpha: alpha_raw,
        };
        head_step(&shape, &w, 0, inputs, &s_prev, &mut s_next, &mut out);
        assert_eq!(conv_next, mixed);

        let silu = |x: f64| x / (1.0 + (-x).exp());
        let c: Vec<f64> = (0..6)
            .map(|i| silu(0.5 * conv_prev[i] as f64 + mixed[i] as f64))
            .collect();
        let l2 = |v: &[f64]| {
            let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.iter().map(|x| x / n).collect::<Vec<_>>()
        };
        let q: Vec<f64> = l2(&c[0..2]).iter().map(|x| x / 2f64.sqrt()).collect();
        let k = l2(&c[2..4]);
        let v = &c[4..6];
        let beta = 1.0 / (1.0 + (-0.4f64).exp());
        let g = ((-0.2f64 + 0.1).exp()).ln_1p() * -0.5;
        let mut m: Vec<f64> = s_prev.iter().map(|x| *x as f64 * g.exp()).collect();
        let mut o = [0.0; 2];
        for j in 0..2 {
            let pred = m[2 * j] * k[0] + m[2 * j + 1] * k[1];
            let d = (v[j] - pred) * beta;
            m[2 * j] += d * k[0];
            m[2 * j + 1] += d * k[1];
            o[j] = m[2 * j] * q[0] + m[2 * j + 1] * q[1];
        }
        for (got, want) in s_next.iter().zip(&m) {
            assert!((*got as f64 - want).abs() < 1e-6, "{s_next:?} vs {m:?}");
        }
        let rms = ((o[0] * o[0] + o[1] * o[1]) / 2.0 + 1e-6).sqrt();
        for j in 0..2 {
            let want = o[j] / rms * silu(z[j] as f64);
            assert!((out[j] as f64 - want).abs() < 1e-5, "{out:?}");
        }
    }
}
