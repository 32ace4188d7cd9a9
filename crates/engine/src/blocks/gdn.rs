//! The Gated DeltaNet mixer (linear attention with a recurrent state) of qwen35 / qwen3next.
//!
//! Per token, with `Kd = S × Hk` (key heads) and `Vd = S × Hv` (value heads):
//!
//! 1. `attn_qkv` gives the mixed `[q | k | v]` (`2·Kd + Vd` channels), `attn_gate` gives `z`
//!    (`Vd`), and the beta / alpha projections one value each per value head (separate
//!    `ssm_beta` / `ssm_alpha` in qwen35, one grouped `ssm_ba` in qwen3next);
//! 2. a causal depthwise convolution over the mixed channels (kernel `ssm_conv1d`, the last
//!    `kernel - 1` inputs kept as **conv state**), then SiLU;
//! 3. `q` and `k` L2-normalised per head (epsilon = the RMS epsilon), `q` scaled by `1/sqrt(S)`;
//! 4. `beta = sigmoid(b)`, `g = softplus(a + ssm_dt.bias) · ssm_a` (ssm_a is `-exp(A_log)`);
//! 5. per value head `h` (reading key head [`HeadMap::key_head`]) with state `M` (row `j` is
//!    value dimension `j`, column `i` key dimension `i`, as llama.cpp stores it):
//!    `M ← exp(g)·M`; `d_j = (v_j − M_j·k)·beta`; `M_j ← M_j + d_j·k`; `o_j = M_j·q`;
//! 6. `o` RMS-normalised per head with `ssm_norm`, times `silu(z)`, then `ssm_out`.
//!
//! The graph ([`gated_delta_net`]) runs the projections (1, 6) as matrix products and steps
//! 2–6 as one operation ([`LayerOps::gated_delta_net`]), which reads and writes the layer's
//! state in the snapshot ring.

use specula_gguf::GgufFile;
use specula_plugin_api::PluginError;

use crate::graph::{Act, BetaAlphaRows, GdnInputs, LayerOps, Rows};
use crate::model::weights::{load_f32, load_vector, MatrixRef, Vector};
use crate::model::LoadError;
use crate::recurrent::StateLayout;

/// Which key head a value head reads when there are more value heads than key heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadMap {
    /// Value head `h` reads key head `h % Hk` (qwen35 GGUFs store value heads tiled).
    Tiled,
    /// Value head `h` reads key head `h / (Hv / Hk)` (qwen3next: repeat-interleave).
    Interleaved,
}

impl HeadMap {
    /// The key head of value head `v_head`.
    pub fn key_head(self, v_head: usize, n_k_heads: usize, n_v_heads: usize) -> usize {
        match self {
            HeadMap::Tiled => v_head % n_k_heads,
            HeadMap::Interleaved => v_head / (n_v_heads / n_k_heads),
        }
    }
}

/// How a layer stores its beta and alpha projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BetaAlphaLayout {
    /// `ssm_beta` and `ssm_alpha`, `{n_embd, Hv}` each (qwen35).
    Separate,
    /// One `ssm_ba {n_embd, 2·Hv}`: per key head, `Hv/Hk` betas then `Hv/Hk` alphas (qwen3next).
    Grouped,
}

/// Dimensions of a GDN layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnShape {
    pub n_embd: usize,
    /// Convolution width (`ssm.conv_kernel`).
    pub conv_kernel: usize,
    /// Size of a key head and of a value head (`ssm.state_size`, S).
    pub head_dim: usize,
    /// Key heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`), each with an S×S state.
    pub n_v_heads: usize,
    pub head_map: HeadMap,
    pub beta_alpha: BetaAlphaLayout,
    /// Epsilon of the L2 norms and of `ssm_norm`.
    pub eps: f32,
}

impl GdnShape {
    pub fn key_dim(&self) -> usize {
        self.head_dim * self.n_k_heads
    }

    pub fn value_dim(&self) -> usize {
        self.head_dim * self.n_v_heads
    }

    /// Convolution channels: `[q | k | v]`.
    pub fn channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// The per-layer state of `n_layers` GDN layers: conv state plus S matrices.
    pub fn state_layout(&self, n_layers: usize) -> StateLayout {
        StateLayout {
            n_layers,
            conv_len: (self.conv_kernel - 1) * self.channels(),
            n_heads: self.n_v_heads,
            head_len: self.head_dim * self.head_dim,
        }
    }
}

/// The beta and alpha projections of a layer.
#[derive(Debug, Clone)]
pub enum BetaAlpha {
    Separate { beta: MatrixRef, alpha: MatrixRef },
    Grouped(MatrixRef),
}

/// The weights of one GDN layer.
#[derive(Debug, Clone)]
pub struct GdnWeights {
    /// `{n_embd, channels}`.
    pub attn_qkv: MatrixRef,
    /// `{n_embd, Vd}`: the output gate `z`.
    pub attn_gate: MatrixRef,
    pub beta_alpha: BetaAlpha,
    /// `ssm_conv1d` as stored: each channel's `kernel` taps together, oldest first.
    pub conv: Vector,
    /// `ssm_conv1d` transposed to tap-major: tap `t` (oldest input first) of channel `c` at
    /// `t · channels + c`, so the CPU's convolution runs over contiguous channels.
    pub conv_by_tap: Vec<f32>,
    /// `ssm_dt.bias`, per value head.
    pub dt_bias: Vector,
    /// `ssm_a` (`-exp(A_log)`), per value head.
    pub a: Vector,
    /// `ssm_norm`, `S` values shared by every head.
    pub norm: Vector,
    /// `{Vd, n_embd}`.
    pub ssm_out: MatrixRef,
}

/// Transposes `ssm_conv1d` (each channel's `kernel` taps together) to tap-major order.
fn tap_major(by_channel: &[f32], kernel: usize) -> Vec<f32> {
    let channels = by_channel.len() / kernel;
    let mut by_tap = vec![0.0; by_channel.len()];
    for (ch, taps) in by_channel.chunks_exact(kernel).enumerate() {
        for (t, tap) in taps.iter().enumerate() {
            by_tap[t * channels + ch] = *tap;
        }
    }
    by_tap
}

impl GdnWeights {
    /// Every weight matrix of the layer, mutably (to interleave them).
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        let mut out = vec![&mut self.attn_qkv, &mut self.attn_gate, &mut self.ssm_out];
        match &mut self.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => out.extend([beta, alpha]),
            BetaAlpha::Grouped(ba) => out.push(ba),
        }
        out
    }

    /// Loads the GDN tensors of block `layer`.
    pub fn load(file: &GgufFile, layer: usize, shape: &GdnShape) -> Result<Self, LoadError> {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let (e, hv, c, k) = (
            shape.n_embd,
            shape.n_v_heads,
            shape.channels(),
            shape.conv_kernel,
        );
        let beta_alpha = match shape.beta_alpha {
            BetaAlphaLayout::Separate => BetaAlpha::Separate {
                beta: MatrixRef::load(file, &name("ssm_beta"), hv, e)?,
                alpha: MatrixRef::load(file, &name("ssm_alpha"), hv, e)?,
            },
            BetaAlphaLayout::Grouped => {
                BetaAlpha::Grouped(MatrixRef::load(file, &name("ssm_ba"), 2 * hv, e)?)
            }
        };
        let conv = load_f32(file, &name("ssm_conv1d"), &[k as u64, c as u64])?;
        Ok(Self {
            attn_qkv: MatrixRef::load(file, &name("attn_qkv"), c, e)?,
            attn_gate: MatrixRef::load(file, &name("attn_gate"), shape.value_dim(), e)?,
            beta_alpha,
            conv_by_tap: tap_major(&conv, k),
            conv: Vector {
                name: name("ssm_conv1d"),
                values: conv,
            },
            dt_bias: load_vector(file, &format!("blk.{layer}.ssm_dt.bias"), hv)?,
            a: load_vector(file, &format!("blk.{layer}.ssm_a"), hv)?,
            norm: load_vector(file, &name("ssm_norm"), shape.head_dim)?,
            ssm_out: MatrixRef::load(file, &name("ssm_out"), e, shape.value_dim())?,
        })
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self) -> u64 {
        let projections: u64 = match &self.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => beta.n_bytes() + alpha.n_bytes(),
            BetaAlpha::Grouped(ba) => ba.n_bytes(),
        };
        let vectors = self.conv.len() + self.dt_bias.len() + self.a.len() + self.norm.len();
        self.attn_qkv.n_bytes()
            + self.attn_gate.n_bytes()
            + self.ssm_out.n_bytes()
            + projections
            + 4 * vectors as u64
    }
}

/// The Gated DeltaNet mixer of GDN layer `ring` (its index among the model's GDN layers)
/// over the normalised rows in [`Act::Xn`], into [`Act::Proj`].
pub fn gated_delta_net(
    ops: &mut impl LayerOps,
    w: &GdnWeights,
    ring: usize,
    rows: &Rows,
) -> Result<(), PluginError> {
    let (qkv, gate) = ((&w.attn_qkv, Act::Mixed), (&w.attn_gate, Act::Z));
    let beta_alpha = match &w.beta_alpha {
        BetaAlpha::Separate { beta, alpha } => {
            ops.matmul_many(
                Act::Xn,
                &[qkv, gate, (beta, Act::Beta), (alpha, Act::Alpha)],
                rows,
            )?;
            BetaAlphaRows::Separate {
                beta: Act::Beta,
                alpha: Act::Alpha,
            }
        }
        BetaAlpha::Grouped(ba) => {
            ops.matmul_many(Act::Xn, &[qkv, gate, (ba, Act::BetaAlpha)], rows)?;
            BetaAlphaRows::Grouped(Act::BetaAlpha)
        }
    };
    let inputs = GdnInputs {
        mixed: Act::Mixed,
        z: Act::Z,
        beta_alpha,
    };
    ops.gated_delta_net(w, ring, inputs, Act::GdnOut, rows)?;
    ops.matmul(&w.ssm_out, Act::GdnOut, Act::Proj, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_taps_transpose_to_tap_major() {
        // 3 channels of 2 taps, channel-major as in the file.
        let by_channel = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(tap_major(&by_channel, 2), [1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
    }

    #[test]
    fn head_maps() {
        let tiled: Vec<usize> = (0..4).map(|h| HeadMap::Tiled.key_head(h, 2, 4)).collect();
        let inter: Vec<usize> = (0..4)
            .map(|h| HeadMap::Interleaved.key_head(h, 2, 4))
            .collect();
        assert_eq!(tiled, vec![0, 1, 0, 1]);
        assert_eq!(inter, vec![0, 0, 1, 1]);
    }
}
