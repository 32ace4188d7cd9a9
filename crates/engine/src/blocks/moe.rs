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
//! The graphs run it as one operation ([`crate::graph::LayerOps::moe`]): how rows are grouped
//! by expert is the executor's business.

use specula_gguf::GgufFile;

use crate::model::weights::{ExpertsRef, MatrixRef};
use crate::model::LoadError;

/// Smallest routing-weight sum the normalisation divides by (ggml clamps to the smallest
/// normal f16).
pub const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

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
