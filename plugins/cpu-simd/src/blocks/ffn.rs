//! The SwiGLU feed-forward network: `down(silu(gate(x)) * up(x))`.

use specula_kernels::{matmul, ops, MatmulScratch, WeightMatrix};

/// The three matrices of a SwiGLU FFN.
pub struct FfnWeights<'a> {
    /// `{n_embd, n_ff}`.
    pub gate: WeightMatrix<'a>,
    /// `{n_embd, n_ff}`.
    pub up: WeightMatrix<'a>,
    /// `{n_ff, n_embd}`.
    pub down: WeightMatrix<'a>,
}

/// Runs the FFN over the rows of `x` (`n × n_embd`) into `out` (`n × n_embd`), using `gate` and
/// `up` (`n × n_ff`) as scratch.
pub fn swiglu(
    w: &FfnWeights<'_>,
    x: &[f32],
    gate: &mut [f32],
    up: &mut [f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul(&w.gate, x, gate, scratch);
    matmul(&w.up, x, up, scratch);
    ops::swiglu_in_place(gate, up);
    matmul(&w.down, gate, out, scratch);
}
