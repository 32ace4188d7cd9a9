//! The SwiGLU feed-forward network `down(silu(gate(x)) * up(x))`, and the FFN of a hybrid
//! block (SwiGLU or mixture of experts).

use specula_gguf::GgufFile;
use specula_kernels::{activations, matmul, matmul_many, MatmulScratch, WeightMatrix};
use specula_plugin_api::PluginError;

use crate::blocks::moe::{self, MoeScratch, MoeShape, MoeWeights};
use crate::model::weights::MatrixRef;
use crate::model::LoadError;

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
    matmul_many(&[&w.gate, &w.up], x, &mut [&mut *gate, &mut *up], scratch);
    activations::swiglu_in_place(gate, up);
    matmul(&w.down, gate, out, scratch);
}

/// The FFN of a hybrid block: dense SwiGLU (qwen35) or mixture of experts (qwen3next).
#[derive(Debug, Clone)]
pub enum FfnBlock {
    Dense {
        gate: MatrixRef,
        up: MatrixRef,
        down: MatrixRef,
    },
    Moe(Box<MoeWeights>),
}

/// Dimensions of a [`FfnBlock`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FfnShape {
    Dense { n_embd: usize, n_ff: usize },
    Moe(MoeShape),
}

impl FfnBlock {
    /// Every weight matrix of the block, mutably (to interleave them); the stacked MoE
    /// experts are not among them (they stay in the file's layout).
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        match self {
            FfnBlock::Dense { gate, up, down } => vec![gate, up, down],
            FfnBlock::Moe(moe) => moe.matrices_mut(),
        }
    }

    /// Loads the FFN tensors of block `layer`.
    pub fn load(file: &GgufFile, layer: usize, shape: &FfnShape) -> Result<Self, LoadError> {
        match shape {
            FfnShape::Dense { n_embd, n_ff } => {
                let name = |t: &str| format!("blk.{layer}.{t}.weight");
                Ok(FfnBlock::Dense {
                    gate: MatrixRef::load(file, &name("ffn_gate"), *n_ff, *n_embd)?,
                    up: MatrixRef::load(file, &name("ffn_up"), *n_ff, *n_embd)?,
                    down: MatrixRef::load(file, &name("ffn_down"), *n_embd, *n_ff)?,
                })
            }
            FfnShape::Moe(moe) => {
                MoeWeights::load(file, layer, moe).map(|w| FfnBlock::Moe(Box::new(w)))
            }
        }
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self, shape: &FfnShape) -> u64 {
        match (self, shape) {
            (FfnBlock::Dense { gate, up, down }, _) => {
                gate.n_bytes() + up.n_bytes() + down.n_bytes()
            }
            (FfnBlock::Moe(w), FfnShape::Moe(s)) => w.bytes_per_token(s.n_used),
            (FfnBlock::Moe(w), _) => w.bytes_per_token(0),
        }
    }
}

/// Buffers of [`forward_block`] for up to `rows` rows.
#[derive(Debug, Default)]
pub struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    moe: MoeScratch,
}

impl FfnScratch {
    pub fn new(shape: &FfnShape, rows: usize) -> Self {
        match shape {
            FfnShape::Dense { n_ff, .. } => Self {
                gate: vec![0.0; rows * n_ff],
                up: vec![0.0; rows * n_ff],
                moe: MoeScratch::default(),
            },
            FfnShape::Moe(moe) => Self {
                gate: Vec::new(),
                up: Vec::new(),
                moe: MoeScratch::new(moe, rows),
            },
        }
    }
}

/// Runs `block` over the `m` normalised rows `xn` into `out` (`m × n_embd`).
#[allow(clippy::too_many_arguments)]
pub fn forward_block(
    shape: &FfnShape,
    block: &FfnBlock,
    file: &GgufFile,
    xn: &[f32],
    m: usize,
    s: &mut FfnScratch,
    mm: &mut MatmulScratch,
    out: &mut [f32],
) -> Result<(), PluginError> {
    match (block, shape) {
        (FfnBlock::Dense { gate, up, down }, FfnShape::Dense { n_ff, .. }) => {
            swiglu(
                &FfnWeights {
                    gate: gate.view(file)?,
                    up: up.view(file)?,
                    down: down.view(file)?,
                },
                xn,
                &mut s.gate[..m * n_ff],
                &mut s.up[..m * n_ff],
                out,
                mm,
            );
            Ok(())
        }
        (FfnBlock::Moe(w), FfnShape::Moe(moe_shape)) => {
            moe::forward(moe_shape, w, file, xn, m, &mut s.moe, mm, out)
        }
        _ => Err(PluginError::new(
            specula_plugin_api::ErrorKind::Internal,
            "FFN weights and shape disagree",
        )),
    }
}
