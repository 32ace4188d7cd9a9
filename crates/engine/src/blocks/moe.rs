//! The mixture-of-experts FFN of qwen3next: softmax routing to the top-k experts and a gated
//! shared expert.
//!
//! Per row, as llama.cpp's `build_moe_ffn` configures it for qwen3next:
//! router logits `ffn_gate_inp · x` → softmax over all experts → the `expert_used_count` most
//! probable experts (ties: the lower index first) → their probabilities, normalised to sum 1
//! (the sum clamped below at 2^-14) and scaled by `expert_weights_scale` when that is neither
//! 0 nor 1 → each chosen expert's SwiGLU `down(silu(gate(x)) · up(x))` times its weight, summed
//! in rank order. The shared expert's SwiGLU output is multiplied by
//! `sigmoid(ffn_gate_inp_shexp · x)` and added.
//!
//! Rows are grouped by expert so each expert's matrices are read once per batch; the mat-vec
//! gives every row the bits it would get alone, and the per-row sums run in a fixed order, so
//! a verify row is bit-identical to a single-token evaluation.

use specula_gguf::GgufFile;
use specula_kernels::{activations, matmul, MatmulScratch};
use specula_plugin_api::PluginError;

use crate::blocks::ffn;
use crate::model::weights::{ExpertsRef, MatrixRef};
use crate::model::LoadError;

/// Smallest routing-weight sum the normalisation divides by (ggml clamps to the smallest
/// normal f16).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// Dimensions of an MoE FFN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeShape {
    pub n_embd: usize,
    pub n_expert: usize,
    pub n_used: usize,
    /// Hidden width of one routed expert.
    pub n_ff_expert: usize,
    /// Hidden width of the shared expert.
    pub n_ff_shared: usize,
    /// Factor on the normalised routing weights; 0 or 1 means none.
    pub weights_scale: f32,
}

/// The always-on shared expert and its scalar gate.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// `ffn_gate_inp_shexp {n_embd}`, a one-row matrix.
    pub gate_inp: MatrixRef,
    pub gate: MatrixRef,
    pub up: MatrixRef,
    pub down: MatrixRef,
}

/// The weights of one MoE FFN.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router, `{n_embd, n_expert}`.
    pub gate_inp: MatrixRef,
    pub gate_exps: ExpertsRef,
    pub up_exps: ExpertsRef,
    pub down_exps: ExpertsRef,
    pub shared: Option<SharedExpert>,
}

impl MoeWeights {
    /// The router and the shared expert's matrices, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        let mut out = vec![&mut self.gate_inp];
        if let Some(shared) = &mut self.shared {
            out.extend([
                &mut shared.gate_inp,
                &mut shared.gate,
                &mut shared.up,
                &mut shared.down,
            ]);
        }
        out
    }

    /// Loads the MoE tensors of block `layer`; the shared expert is optional as in llama.cpp.
    pub fn load(file: &GgufFile, layer: usize, shape: &MoeShape) -> Result<Self, LoadError> {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let (e, n, ff, sff) = (
            shape.n_embd,
            shape.n_expert,
            shape.n_ff_expert,
            shape.n_ff_shared,
        );
        let shared = match file.tensor_info(&name("ffn_up_shexp")) {
            None => None,
            Some(_) => Some(SharedExpert {
                gate_inp: MatrixRef::load_row(file, &name("ffn_gate_inp_shexp"), e)?,
                gate: MatrixRef::load(file, &name("ffn_gate_shexp"), sff, e)?,
                up: MatrixRef::load(file, &name("ffn_up_shexp"), sff, e)?,
                down: MatrixRef::load(file, &name("ffn_down_shexp"), e, sff)?,
            }),
        };
        Ok(Self {
            gate_inp: MatrixRef::load(file, &name("ffn_gate_inp"), n, e)?,
            gate_exps: ExpertsRef::load(file, &name("ffn_gate_exps"), ff, e, n)?,
            up_exps: ExpertsRef::load(file, &name("ffn_up_exps"), ff, e, n)?,
            down_exps: ExpertsRef::load(file, &name("ffn_down_exps"), e, ff, n)?,
            shared,
        })
    }

    /// Bytes of weights read per token: the router, `n_used` experts and the shared expert.
    pub fn bytes_per_token(&self, n_used: usize) -> u64 {
        let expert = self.gate_exps.expert_bytes()
            + self.up_exps.expert_bytes()
            + self.down_exps.expert_bytes();
        let shared = self.shared.as_ref().map_or(0, |s| {
            s.gate_inp.n_bytes() + s.gate.n_bytes() + s.up.n_bytes() + s.down.n_bytes()
        });
        self.gate_inp.n_bytes() + n_used as u64 * expert + shared
    }
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
        ffn::swiglu(
            &ffn::FfnWeights {
                gate: w.gate_exps.view(file, expert)?,
                up: w.up_exps.view(file, expert)?,
                down: w.down_exps.view(file, expert)?,
            },
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
        ffn::swiglu(
            &ffn::FfnWeights {
                gate: shared.gate.view(file)?,
                up: shared.up.view(file)?,
                down: shared.down.view(file)?,
            },
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
