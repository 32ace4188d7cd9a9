//! Element-wise and per-row operations of the transformer graph: RMSNorm, RoPE, softmax,
//! SiLU / SwiGLU. Each follows the arithmetic of the corresponding ggml CPU op, so results
//! stay close to llama.cpp's, and each is a fixed sequential computation per row, so results
//! never depend on batching or threads.

/// `out = x / sqrt(mean(x²) + eps) * weight`, as ggml's `rms_norm` followed by `mul`:
/// the squares are summed in f64, the mean and scale are f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "rms_norm: weight size");
    assert_eq!(x.len(), out.len(), "rms_norm: output size");
    let scale = rms_scale(x, eps);
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len(), "rms_norm: weight size");
    let scale = rms_scale(x, eps);
    for (v, w) in x.iter_mut().zip(weight) {
        *v = (*v * scale) * w;
    }
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// Which dimensions RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// ggml mode 0 ("normal"): adjacent pairs `(2i, 2i + 1)` — llama.
    Normal,
    /// ggml mode 2 (NeoX): halves `(i, i + n_rot / 2)` — qwen3, qwen35, qwen3next.
    NeoX,
}

/// Fixed settings of a model's rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub mode: RopeMode,
    /// Rotated dimensions at the start of each head (even, at most the head size); the rest
    /// pass through unchanged.
    pub n_rot: usize,
    pub freq_base: f32,
    /// Linear position scaling (1 / scaling factor); 1.0 for none.
    pub freq_scale: f32,
    /// Per-pair frequency divisors (`rope_freqs.weight`, Llama 3.1 style), `n_rot / 2` values.
    pub freq_factors: Option<Vec<f32>>,
}

impl Rope {
    /// Fills `cos` and `sin` (`n_rot / 2` values each) with the rotation of position `pos`.
    ///
    /// As ggml's rope cache: `theta` starts at the position and is multiplied by
    /// `freq_base^(-2 / n_rot)` after each pair, in f32.
    pub fn angles(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let pairs = self.n_rot / 2;
        assert!(
            cos.len() == pairs && sin.len() == pairs,
            "rope: angle buffer size"
        );
        let theta_scale = self.freq_base.powf(-2.0 / self.n_rot as f32);
        let mut theta = pos as f32;
        for i in 0..pairs {
            let factor = self.freq_factors.as_ref().map_or(1.0, |f| f[i]);
            let angle = self.freq_scale * (theta / factor);
            cos[i] = angle.cos();
            sin[i] = angle.sin();
            theta *= theta_scale;
        }
    }

    /// Rotates one head (`head.len() >= n_rot`) by the angles from [`Rope::angles`].
    pub fn apply(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let pairs = self.n_rot / 2;
        assert!(head.len() >= self.n_rot, "rope: head smaller than n_rot");
        let (first, second): (fn(usize) -> usize, usize) = match self.mode {
            RopeMode::Normal => (|i| 2 * i, 1),
            RopeMode::NeoX => (|i| i, pairs),
        };
        for i in 0..pairs {
            let (a, b) = (first(i), first(i) + second);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos[i] - x1 * sin[i];
            head[b] = x0 * sin[i] + x1 * cos[i];
        }
    }
}

/// Softmax in place: `exp(x - max)`, summed in f64, scaled by the f32 reciprocal of the sum.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inverse = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inverse;
    }
}

/// SiLU: `x / (1 + exp(-x))`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SwiGLU in place: `gate[i] = silu(gate[i]) * up[i]`.
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: sizes differ");
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `dst += src`, element-wise (residual connections).
pub fn add_in_place(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "add: sizes differ");
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    #[test]
    fn rms_norm_matches_f64_reference() {
        let x = random_vec(100, 3.0, 1);
        let w = random_vec(100, 1.0, 2);
        let mut out = vec![0.0; 100];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 100.0;
        let scale = 1.0 / (ms + 1e-5).sqrt();
        for i in 0..100 {
            let expected = x[i] as f64 * scale * w[i] as f64;
            assert!((out[i] as f64 - expected).abs() < 1e-5 * (1.0 + expected.abs()));
        }
        let mut in_place = x.clone();
        rms_norm_in_place(&mut in_place, &w, 1e-5);
        assert_eq!(in_place, out);
    }

    fn rope(mode: RopeMode, n_rot: usize) -> Rope {
        Rope {
            mode,
            n_rot,
            freq_base: 10000.0,
            freq_scale: 1.0,
            freq_factors: None,
        }
    }

    #[test]
    fn rope_rotates_the_right_pairs_by_the_right_angles() {
        let head_dim = 16;
        for mode in [RopeMode::Normal, RopeMode::NeoX] {
            let r = rope(mode, 8);
            let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
            let pos = 7;
            r.angles(pos, &mut cos, &mut sin);
            let x = random_vec(head_dim, 1.0, 3);
            let mut y = x.clone();
            r.apply(&mut y, &cos, &sin);
            for i in 0..4 {
                let (a, b) = match mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::NeoX => (i, i + 4),
                };
                let theta = pos as f64 * 10000f64.powf(-2.0 * i as f64 / 8.0);
                let (c, s) = (theta.cos(), theta.sin());
                let ya = x[a] as f64 * c - x[b] as f64 * s;
                let yb = x[a] as f64 * s + x[b] as f64 * c;
                assert!((y[a] as f64 - ya).abs() < 1e-5, "{mode:?} pair {i}");
                assert!((y[b] as f64 - yb).abs() < 1e-5, "{mode:?} pair {i}");
            }
            // Dimensions past n_rot pass through.
            assert_eq!(&y[8..], &x[8..]);
        }
    }

    #[test]
    fn rope_position_zero_is_identity_and_factors_divide_frequencies() {
        let r = rope(RopeMode::Normal, 8);
        let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
        r.angles(0, &mut cos, &mut sin);
        let x = random_vec(8, 1.0, 4);
        let mut y = x.clone();
        r.apply(&mut y, &cos, &sin);
        assert_eq!(x, y);

        let mut scaled = r.clone();
        scaled.freq_factors = Some(vec![1.0, 2.0, 4.0, 8.0]);
        let (mut c2, mut s2) = (vec![0.0; 4], vec![0.0; 4]);
        scaled.angles(100, &mut c2, &mut s2);
        r.angles(100, &mut cos, &mut sin);
        assert_eq!(c2[0], cos[0]);
        assert_ne!(c2[1], cos[1]);
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut x = vec![1.0, 2.0, 3.0, -100.0, 1000.0];
        softmax_in_place(&mut x);
        let sum: f32 = x.iter().sum();
        assert!((sum - 1.0).abs() < 1e-6);
        assert!(x[4] > 0.99 && x[3] >= 0.0);
        let mut y = vec![0.5, 0.25];
        softmax_in_place(&mut y);
        assert!(y[0] > y[1]);
    }

    #[test]
    fn swiglu_is_silu_gate_times_up() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        let mut g = vec![1.0, -2.0];
        swiglu_in_place(&mut g, &[2.0, 3.0]);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
        assert!((g[1] - 3.0 * silu(-2.0)).abs() < 1e-7);
        let mut a = vec![1.0, 2.0];
        add_in_place(&mut a, &[0.5, 0.5]);
        assert_eq!(a, vec![1.5, 2.5]);
    }
}
