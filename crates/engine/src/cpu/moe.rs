//! The mixture-of-experts FFN on the CPU ([`crate::blocks::moe`] says what it computes).
//!
//! Rows are grouped by expert so each expert's matrices are read once per batch; the mat-vec
//! gives every row the bits it would get alone, and the per-row sums run in a fixed order, so
//! a verify row is bit-identical to a single-token evaluation.

use specula_gguf::GgufFile;
use specula_kernels::{activations, matmul, matmul_many, MatmulScratch, WeightMatrix};
use specula_plugin_api::PluginError;

use crate::blocks::moe::{MoeShape, MoeWeights, MIN_WEIGHT_SUM};

/// `down(silu(gate · x) · up · x)` of the rows `x` into `out`, with `gate` and `up` as scratch.
fn swiglu(
    [gate_w, up_w, down_w]: [&WeightMatrix<'_>; 3],
    x: &[f32],
    gate: &mut [f32],
    up: &mut [f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_many(&[gate_w, up_w], x, &mut [&mut *gate, &mut *up], scratch);
    activations::swiglu_in_place(gate, up);
    matmul(down_w, gate, out, scratch);
}

/// Buffers of [`forward`] for up to `rows` rows.
#[derive(Debug, Default)]
pub struct MoeScratch {
    probs: Vec<f32>,
    order: Vec<usize>,
    selected: Vec<usize>,
    weights: Vec<f32>,
    /// Per (row, rank): the routed expert's output, `rows × n_used × n_embd`.
    expert_out: Vec<f32>,
    members: Vec<(usize, usize)>,
    gathered: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    shared_gate: Vec<f32>,
    shared_up: Vec<f32>,
    shared_out: Vec<f32>,
    shared_scale: Vec<f32>,
}

impl MoeScratch {
    pub fn new(shape: &MoeShape, rows: usize) -> Self {
        let e = shape.n_embd;
        Self {
            probs: vec![0.0; rows * shape.n_expert],
            order: Vec::with_capacity(shape.n_expert),
            selected: vec![0; rows * shape.n_used],
            weights: vec![0.0; rows * shape.n_used],
            expert_out: vec![0.0; rows * shape.n_used * e],
            members: Vec::with_capacity(rows),
            gathered: vec![0.0; rows * e],
            gate: vec![0.0; rows * shape.n_ff_expert],
            up: vec![0.0; rows * shape.n_ff_expert],
            down: vec![0.0; rows * e],
            shared_gate: vec![0.0; rows * shape.n_ff_shared],
            shared_up: vec![0.0; rows * shape.n_ff_shared],
            shared_out: vec![0.0; rows * e],
            shared_scale: vec![0.0; rows],
        }
    }
}

/// Runs the MoE FFN over the `m` normalised rows `xn` into `out` (`m × n_embd`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    shape: &MoeShape,
    w: &MoeWeights,
    file: &GgufFile,
    xn: &[f32],
    m: usize,
    s: &mut MoeScratch,
    mm: &mut MatmulScratch,
    out: &mut [f32],
) -> Result<(), PluginError> {
    let (e, n_expert, k, ff) = (
        shape.n_embd,
        shape.n_expert,
        shape.n_used,
        shape.n_ff_expert,
    );

    // Routing.
    let probs = &mut s.probs[..m * n_expert];
    matmul(&w.gate_inp.view(file)?, xn, probs, mm);
    for i in 0..m {
        let row = &mut probs[i * n_expert..(i + 1) * n_expert];
        activations::softmax_in_place(row);
        s.order.clear();
        s.order.extend(0..n_expert);
        s.order
            .sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let selected = &mut s.selected[i * k..(i + 1) * k];
        let weights = &mut s.weights[i * k..(i + 1) * k];
        selected.copy_from_slice(&s.order[..k]);
        for (wt, &x) in weights.iter_mut().zip(selected.iter()) {
            *wt = row[x];
        }
        let sum = weights.iter().map(|&v| f64::from(v)).sum::<f64>() as f32;
        let sum = sum.max(MIN_WEIGHT_SUM);
        for wt in weights.iter_mut() {
            *wt /= sum;
        }
        if shape.weights_scale != 0.0 && shape.weights_scale != 1.0 {
            for wt in weights.iter_mut() {
                *wt *= shape.weights_scale;
            }
        }
    }

    // Each expert over the rows routed to it.
    for expert in 0..n_expert {
        s.members.clear();
        for i in 0..m {
            if let Some(rank) = s.selected[i * k..(i + 1) * k]
                .iter()
                .position(|&x| x == expert)
            {
                s.members.push((i, rank));
            }
        }
        let count = s.members.len();
        if count == 0 {
            continue;
        }
        for (dst, &(i, _)) in s.gathered.chunks_exact_mut(e).zip(&s.members) {
            dst.copy_from_slice(&xn[i * e..(i + 1) * e]);
        }
        swiglu(
            [
                &w.gate_exps.view(file, expert)?,
                &w.up_exps.view(file, expert)?,
                &w.down_exps.view(file, expert)?,
            ],
            &s.gathered[..count * e],
            &mut s.gate[..count * ff],
            &mut s.up[..count * ff],
            &mut s.down[..count * e],
            mm,
        );
        for (result, &(i, rank)) in s.down.chunks_exact(e).zip(&s.members) {
            s.expert_out[(i * k + rank) * e..(i * k + rank + 1) * e].copy_from_slice(result);
        }
    }

    // Weighted sum in rank order.
    for i in 0..m {
        let dst = &mut out[i * e..(i + 1) * e];
        for rank in 0..k {
            let weight = s.weights[i * k + rank];
            let result = &s.expert_out[(i * k + rank) * e..(i * k + rank + 1) * e];
            if rank == 0 {
                for (d, r) in dst.iter_mut().zip(result) {
                    *d = r * weight;
                }
            } else {
                for (d, r) in dst.iter_mut().zip(result) {
                    *d += r * weight;
                }
            }
        }
    }

    if let Some(shared) = &w.shared {
        let sff = shape.n_ff_shared;
        swiglu(
            [
                &shared.gate.view(file)?,
                &shared.up.view(file)?,
                &shared.down.view(file)?,
            ],
            xn,
            &mut s.shared_gate[..m * sff],
            &mut s.shared_up[..m * sff],
            &mut s.shared_out[..m * e],
            mm,
        );
        matmul(
            &shared.gate_inp.view(file)?,
            xn,
            &mut s.shared_scale[..m],
            mm,
        );
        for i in 0..m {
            let scale = activations::sigmoid(s.shared_scale[i]);
            for (d, v) in out[i * e..(i + 1) * e]
                .iter_mut()
                .zip(&s.shared_out[i * e..(i + 1) * e])
            {
                *d += v * scale;
            }
        }
    }
    Ok(())
}
