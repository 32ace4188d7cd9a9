//! The feed-forward networks: SwiGLU `down(silu(gate(x)) · up(x))` (its weights and its graph)
//! and the FFN of a hybrid block, SwiGLU or mixture of experts.

use specula_gguf::GgufFile;
use specula_plugin_api::PluginError;

use crate::blocks::moe::{MoeShape, MoeWeights};
use crate::graph::{Act, LayerOps, Rows};
use crate::model::weights::MatrixRef;
use crate::model::LoadError;

/// The three matrices of a SwiGLU FFN.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    /// `{n_embd, n_ff}`.
    pub gate: MatrixRef,
    /// `{n_embd, n_ff}`.
    pub up: MatrixRef,
    /// `{n_ff, n_embd}`.
    pub down: MatrixRef,
}

impl SwiGlu {
    /// Loads `blk.{layer}.ffn_gate`, `ffn_up` and `ffn_down`.
    pub fn load(
        file: &GgufFile,
        layer: usize,
        n_embd: usize,
        n_ff: usize,
    ) -> Result<Self, LoadError> {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        Ok(Self {
            gate: MatrixRef::load(file, &name("ffn_gate"), n_ff, n_embd)?,
            up: MatrixRef::load(file, &name("ffn_up"), n_ff, n_embd)?,
            down: MatrixRef::load(file, &name("ffn_down"), n_embd, n_ff)?,
        })
    }

    /// The three matrices.
    pub fn matrices(&self) -> [&MatrixRef; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// The three matrices, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> [&mut MatrixRef; 3] {
        [&mut self.gate, &mut self.up, &mut self.down]
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self) -> u64 {
        self.matrices().iter().map(|m| m.n_bytes()).sum()
    }
}

/// The SwiGLU FFN over the normalised rows in [`Act::Xn`] into [`Act::Proj`].
pub fn swiglu(ops: &mut impl LayerOps, w: &SwiGlu, rows: &Rows) -> Result<(), PluginError> {
    ops.matmul_many(
        Act::Xn,
        &[(&w.gate, Act::FfnGate), (&w.up, Act::FfnUp)],
        rows,
    )?;
    ops.swiglu(Act::FfnGate, Act::FfnUp, rows)?;
    ops.matmul(&w.down, Act::FfnGate, Act::Proj, rows)
}

/// The FFN of a hybrid block: dense SwiGLU (qwen35) or mixture of experts (qwen3next).
#[derive(Debug, Clone)]
pub enum FfnBlock {
    Dense(SwiGlu),
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
            FfnBlock::Dense(w) => w.matrices_mut().into(),
            FfnBlock::Moe(moe) => moe.matrices_mut(),
        }
    }

    /// Loads the FFN tensors of block `layer`.
    pub fn load(file: &GgufFile, layer: usize, shape: &FfnShape) -> Result<Self, LoadError> {
        match shape {
            FfnShape::Dense { n_embd, n_ff } => {
                SwiGlu::load(file, layer, *n_embd, *n_ff).map(FfnBlock::Dense)
            }
            FfnShape::Moe(moe) => {
                MoeWeights::load(file, layer, moe).map(|w| FfnBlock::Moe(Box::new(w)))
            }
        }
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self, shape: &FfnShape) -> u64 {
        match (self, shape) {
            (FfnBlock::Dense(w), _) => w.bytes_per_token(),
            (FfnBlock::Moe(w), FfnShape::Moe(s)) => w.bytes_per_token(s.n_used),
            (FfnBlock::Moe(w), _) => w.bytes_per_token(0),
        }
    }
}
