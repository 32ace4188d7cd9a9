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
//! The projections (1, 6) run batched over all rows with the shared mat-vec; the convolution
//! (2, 3) runs through [`conv_rows`] and the recurrence (4-6) head by head through
//! [`head_step`], each row reading the state at its length from the snapshot ring and writing
//! the next ring plane. A verify row and a single-token evaluation therefore execute the same
//! code on the same data, bit for bit.

use rayon::prelude::*;
use specula_gguf::GgufFile;
use specula_kernels::activations::{self, Gate};
use specula_kernels::delta_rule::{self, DeltaInputs};
use specula_kernels::{matmul, matmul_many, ops, MatmulScratch};
use specula_plugin_api::PluginError;

use crate::model::weights::{load_f32, load_vector, MatrixRef};
use crate::model::LoadError;
use crate::recurrent::{read_write, SnapshotRing, StateLayout};

/// Below this many state values per token, heads run on the calling thread.
const PARALLEL_MIN_STATE: usize = 1 << 15;

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
    /// `ssm_conv1d` transposed to tap-major: tap `t` (oldest input first) of channel `c` at
    /// `t · channels + c`, so the convolution runs over contiguous channels.
    pub conv_by_tap: Vec<f32>,
    /// `ssm_dt.bias`, per value head.
    pub dt_bias: Vec<f32>,
    /// `ssm_a` (`-exp(A_log)`), per value head.
    pub a: Vec<f32>,
    /// `ssm_norm`, `S` values shared by every head.
    pub norm: Vec<f32>,
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
        Ok(Self {
            attn_qkv: MatrixRef::load(file, &name("attn_qkv"), c, e)?,
            attn_gate: MatrixRef::load(file, &name("attn_gate"), shape.value_dim(), e)?,
            beta_alpha,
            conv_by_tap: tap_major(
                &load_f32(file, &name("ssm_conv1d"), &[k as u64, c as u64])?,
                k,
            ),
            dt_bias: load_vector(file, &format!("blk.{layer}.ssm_dt.bias"), hv)?,
            a: load_vector(file, &format!("blk.{layer}.ssm_a"), hv)?,
            norm: load_vector(file, &name("ssm_norm"), shape.head_dim)?,
            ssm_out: MatrixRef::load(file, &name("ssm_out"), e, shape.value_dim())?,
        })
    }

    /// `ssm_conv1d` in the file's order (each channel's `kernel` taps together), for backends
    /// that keep it that way.
    pub fn conv_by_channel(&self) -> Vec<f32> {
        let channels = self.attn_qkv.rows;
        let kernel = self.conv_by_tap.len() / channels;
        let mut by_channel = vec![0.0; self.conv_by_tap.len()];
        for (t, tap) in self.conv_by_tap.chunks_exact(channels).enumerate() {
            for (ch, value) in tap.iter().enumerate() {
                by_channel[ch * kernel + t] = *value;
            }
        }
        by_channel
    }

    /// Bytes of weights read per token.
    pub fn bytes_per_token(&self) -> u64 {
        let projections: u64 = match &self.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => beta.n_bytes() + alpha.n_bytes(),
            BetaAlpha::Grouped(ba) => ba.n_bytes(),
        };
        let vectors = self.conv_by_tap.len() + self.dt_bias.len() + self.a.len() + self.norm.len();
        self.attn_qkv.n_bytes()
            + self.attn_gate.n_bytes()
            + self.ssm_out.n_bytes()
            + projections
            + 4 * vectors as u64
    }
}

/// Buffers of [`forward`] for up to `rows` rows.
#[derive(Debug, Default)]
pub struct GdnScratch {
    mixed: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    alpha: Vec<f32>,
    ba: Vec<f32>,
    /// The convolved, normalised `[q | k | v]` of every row.
    qkv: Vec<f32>,
    /// Head outputs head-major (`[head][row][S]`), as the parallel heads write them.
    heads: Vec<f32>,
    /// Head outputs row-major, the input of `ssm_out`.
    out: Vec<f32>,
}

impl GdnScratch {
    pub fn new(shape: &GdnShape, rows: usize) -> Self {
        let hv = shape.n_v_heads;
        Self {
            mixed: vec![0.0; rows * shape.channels()],
            z: vec![0.0; rows * shape.value_dim()],
            beta: vec![0.0; rows * hv],
            alpha: vec![0.0; rows * hv],
            ba: vec![0.0; rows * 2 * hv],
            qkv: vec![0.0; rows * shape.channels()],
            heads: vec![0.0; rows * shape.value_dim()],
            out: vec![0.0; rows * shape.value_dim()],
        }
    }
}

/// Runs GDN layer `slot` (its index among the model's GDN layers) over the `m` normalised rows
/// `xn` and writes the projected output to `out` (`m × n_embd`).
///
/// Row `i` is the `step0 + i`-th token after the ring's live state: it reads that state and
/// writes the next plane (see [`SnapshotRing::conv_io`]); the caller advances the ring once the
/// whole evaluation is done. The convolution runs row by row; then each value head runs all
/// `m` rows with its S matrix hot in cache, the heads in parallel (one fork-join per layer
/// however many rows are verified). Every row takes the same steps as a single-token call.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    shape: &GdnShape,
    w: &GdnWeights,
    file: &GgufFile,
    xn: &[f32],
    m: usize,
    ring: &mut SnapshotRing,
    slot: usize,
    step0: usize,
    s: &mut GdnScratch,
    mm: &mut MatmulScratch,
    out: &mut [f32],
) -> Result<(), PluginError> {
    let (c, vd, hv, sd) = (
        shape.channels(),
        shape.value_dim(),
        shape.n_v_heads,
        shape.head_dim,
    );
    let (qkv, gate) = (w.attn_qkv.view(file)?, w.attn_gate.view(file)?);
    match &w.beta_alpha {
        BetaAlpha::Separate { beta, alpha } => matmul_many(
            &[&qkv, &gate, &beta.view(file)?, &alpha.view(file)?],
            xn,
            &mut [
                &mut s.mixed[..m * c],
                &mut s.z[..m * vd],
                &mut s.beta[..m * hv],
                &mut s.alpha[..m * hv],
            ],
            mm,
        ),
        BetaAlpha::Grouped(ba) => {
            matmul_many(
                &[&qkv, &gate, &ba.view(file)?],
                xn,
                &mut [
                    &mut s.mixed[..m * c],
                    &mut s.z[..m * vd],
                    &mut s.ba[..m * 2 * hv],
                ],
                mm,
            );
            let per_group = hv / shape.n_k_heads;
            for i in 0..m {
                let row = &s.ba[i * 2 * hv..(i + 1) * 2 * hv];
                for (g, group) in row.chunks_exact(2 * per_group).enumerate() {
                    let heads = i * hv + g * per_group..i * hv + (g + 1) * per_group;
                    s.beta[heads.clone()].copy_from_slice(&group[..per_group]);
                    s.alpha[heads].copy_from_slice(&group[per_group..]);
                }
            }
        }
    }
    conv_rows(
        shape,
        w,
        ring.conv_state(slot, step0),
        &s.mixed[..m * c],
        &mut s.qkv[..m * c],
    );
    for (i, mixed) in s.mixed[..m * c].chunks_exact(c).enumerate() {
        let (src, dst) = ring.conv_io(slot, step0 + i);
        next_conv_state(src, mixed, dst);
    }

    let index = *ring.index();
    let state_len = sd * sd;
    let (qkv, z, beta, alpha) = (&s.qkv[..m * c], &s.z[..m * vd], &s.beta, &s.alpha);
    let head = |(h, (planes, outputs)): (usize, (&mut [f32], &mut [f32]))| {
        for (i, o) in outputs.chunks_exact_mut(sd).enumerate() {
            let (read, write) = index.step_planes(step0 + i);
            let (state_in, state_out) = read_write(planes, state_len, read, write);
            let inputs = HeadInputs {
                qkv: &qkv[i * c..(i + 1) * c],
                z: &z[i * vd + h * sd..][..sd],
                beta: beta[i * hv + h],
                alpha: alpha[i * hv + h],
            };
            head_step(shape, w, h, inputs, state_in, state_out, o);
        }
    };
    let per_head = ring.head_planes_len();
    let states = ring.layer_heads_mut(slot);
    let heads = &mut s.heads[..m * vd];
    if hv * state_len < PARALLEL_MIN_STATE {
        states
            .chunks_exact_mut(per_head)
            .zip(heads.chunks_exact_mut(m * sd))
            .enumerate()
            .for_each(head);
    } else {
        states
            .par_chunks_exact_mut(per_head)
            .zip(heads.par_chunks_exact_mut(m * sd))
            .enumerate()
            .for_each(head);
    }
    // Head-major to row-major for `ssm_out`.
    for (h, rows) in s.heads[..m * vd].chunks_exact(m * sd).enumerate() {
        for (i, o) in rows.chunks_exact(sd).enumerate() {
            s.out[i * vd + h * sd..][..sd].copy_from_slice(o);
        }
    }
    matmul(&w.ssm_out.view(file)?, &s.out[..m * vd], out, mm);
    Ok(())
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
    let sd = shape.head_dim;
    let key_dim = shape.key_dim();
    let kh = shape.head_map.key_head(h, shape.n_k_heads, shape.n_v_heads);
    let g = ops::softplus(x.alpha + w.dt_bias[h]) * w.a[h];
    let inputs = DeltaInputs {
        q: &x.qkv[kh * sd..(kh + 1) * sd],
        k: &x.qkv[key_dim + kh * sd..key_dim + (kh + 1) * sd],
        v: &x.qkv[2 * key_dim + h * sd..2 * key_dim + (h + 1) * sd],
        decay: g.exp(),
        beta: activations::sigmoid(x.beta),
    };
    delta_rule::step(inputs, state_in, state_out, o);
    ops::rms_norm_in_place(o, &w.norm, shape.eps);
    activations::gate_in_place(Gate::Silu, o, x.z);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_taps_transpose_and_back() {
        // 3 channels of 2 taps, channel-major as in the file.
        let by_channel = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let by_tap = tap_major(&by_channel, 2);
        assert_eq!(by_tap, [1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
        let matrix = |rows| MatrixRef {
            name: String::new(),
            ty: specula_kernels::WeightType::F32,
            rows,
            cols: 0,
            interleaved: None,
        };
        let w = GdnWeights {
            attn_qkv: matrix(3),
            attn_gate: matrix(0),
            beta_alpha: BetaAlpha::Grouped(matrix(0)),
            conv_by_tap: by_tap,
            dt_bias: Vec::new(),
            a: Vec::new(),
            norm: Vec::new(),
            ssm_out: matrix(0),
        };
        assert_eq!(w.conv_by_channel(), by_channel);
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
            conv_by_tap: [[0.5f32; 6], [1.0; 6]].concat(),
            dt_bias: vec![0.1],
            a: vec![-0.5],
            norm: vec![1.0, 1.0],
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
