//! Element-wise and per-row operations of the transformer graph: RMSNorm, L2 norm, RoPE,
//! softmax, SiLU / SwiGLU, sigmoid, softplus. Each follows the arithmetic of the corresponding ggml CPU op, so results
//! stay close to llama.cpp's, and each is a fixed sequential computation per row, so results
//! never depend on batching or threads.

use crate::simd::{self, SimdLevel};

/// `out = x / sqrt(mean(x²) + eps) * weight`, as ggml's `rms_norm` followed by `mul`:
/// the squares are summed in f64, the mean and scale are f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "rms_norm: output size");
    rms_norm_at(
        simd::level(),
        x.as_ptr(),
        weight,
        eps,
        out.as_mut_ptr(),
        x.len(),
    );
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let p = x.as_mut_ptr();
    rms_norm_at(simd::level(), p, weight, eps, p, x.len());
}

/// [`rms_norm`] of the `len` values at `x` into `out` (which may be `x`) at `level`: the SIMD
/// kernels do the whole registers, the scalar reference the rest, by the same arithmetic.
fn rms_norm_at(
    level: SimdLevel,
    x: *const f32,
    weight: &[f32],
    eps: f32,
    out: *mut f32,
    len: usize,
) {
    assert_eq!(len, weight.len(), "rms_norm: weight size");
    // SAFETY: `x` and `out` are `len` values (the callers' slices); `out` may alias `x`, so no
    // slice of one lives while the other is written.
    unsafe {
        let scale = rms_scale(level, std::slice::from_raw_parts(x, len), eps);
        let done = simd::scale_mul(level, x, scale, weight.as_ptr(), out, len);
        for (i, w) in weight.iter().enumerate().skip(done) {
            *out.add(i) = (*x.add(i) * scale) * w;
        }
    }
}

fn rms_scale(level: SimdLevel, x: &[f32], eps: f32) -> f32 {
    // The squares summed in f64 as ggml does, in eight interleaved partial sums (one register
    // of lanes) rather than one serial chain: a head of 128 values is otherwise 128 dependent
    // additions.
    let (mut lanes, done) = simd::sum_squares_f64(level, x);
    for (i, v) in x.iter().enumerate().skip(done) {
        lanes[i % 8] += f64::from(v * v);
    }
    let sum: f64 = lanes.iter().sum();
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// Which dimensions RoPE rotates together, and by which position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// ggml mode 0 ("normal"): adjacent pairs `(2i, 2i + 1)` — llama.
    Normal,
    /// ggml mode 2 (NeoX): halves `(i, i + n_rot / 2)` — qwen3, qwen3next (partial rotary).
    NeoX,
    /// Multi-section RoPE (ggml `rope_multi`, M-RoPE / interleaved IMROPE — qwen35): pairs are
    /// rotated as in NeoX, but each pair belongs to one of four position components (time,
    /// height, width, extra) by [`RopeSections`]. For text the first three components are the
    /// token position and the extra one is 0 (llama.cpp's convention), so pairs of the extra
    /// component are not rotated.
    MultiSection(RopeSections),
}

/// The pair-to-component split of multi-section RoPE (`rope.dimension_sections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeSections {
    /// Pairs per component: time, height, width, extra.
    pub sections: [u32; 4],
    /// Interleaved assignment (ggml `GGML_ROPE_TYPE_IMROPE`, Qwen3-VL / Qwen3.5): pair sector
    /// `s` is time when `s % 3 == 0`, height when `1`, width when `2`, each only while `s` is
    /// below three times that component's section; everything else is extra. Otherwise the
    /// sections are contiguous runs (`GGML_ROPE_TYPE_MROPE`).
    pub interleaved: bool,
}

impl RopeSections {
    /// Which component (0 time, 1 height, 2 width, 3 extra) rotated pair `pair` belongs to.
    /// Sectors repeat every `sum(sections)` pairs.
    pub fn component(&self, pair: usize) -> usize {
        let [t, h, w, e] = self.sections.map(|s| s as usize);
        let total = (t + h + w + e).max(1);
        let sector = pair % total;
        if self.interleaved {
            match sector % 3 {
                0 if sector < 3 * t => 0,
                1 if sector < 3 * h => 1,
                2 if sector < 3 * w => 2,
                _ => 3,
            }
        } else if sector < t {
            0
        } else if sector < t + h {
            1
        } else if sector < t + h + w {
            2
        } else {
            3
        }
    }
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
            let angle = match self.mode {
                // The extra component's position is 0 for text: its theta stays 0.
                RopeMode::MultiSection(sections) if sections.component(i) == 3 => 0.0,
                _ => self.freq_scale * (theta / factor),
            };
            cos[i] = angle.cos();
            sin[i] = angle.sin();
            theta *= theta_scale;
        }
    }

    /// Rotates one head (`head.len() >= n_rot`) by the angles from [`Rope::angles`].
    pub fn apply(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        self.apply_at(simd::level(), head, cos, sin);
    }

    /// [`Rope::apply`] at `level`: the SIMD kernels rotate the whole registers of NeoX halves,
    /// the scalar reference the rest, by the same arithmetic.
    fn apply_at(&self, level: SimdLevel, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let pairs = self.n_rot / 2;
        assert!(head.len() >= self.n_rot, "rope: head smaller than n_rot");
        let (cos, sin) = (&cos[..pairs], &sin[..pairs]);
        let rotate = |x0: &mut f32, x1: &mut f32, c: f32, s: f32| {
            let (a, b) = (*x0, *x1);
            *x0 = a * c - b * s;
            *x1 = a * s + b * c;
        };
        match self.mode {
            RopeMode::Normal => {
                for ((pair, &c), &s) in head[..self.n_rot].chunks_exact_mut(2).zip(cos).zip(sin) {
                    let (x0, x1) = pair.split_at_mut(1);
                    rotate(&mut x0[0], &mut x1[0], c, s);
                }
            }
            RopeMode::NeoX | RopeMode::MultiSection(_) => {
                let (first, second) = head[..self.n_rot].split_at_mut(pairs);
                let done = simd::rotate_pairs(level, first, second, cos, sin);
                for (((x0, x1), &c), &s) in
                    first.iter_mut().zip(second).zip(cos).zip(sin).skip(done)
                {
                    rotate(x0, x1, c, s);
                }
            }
        }
    }
}

/// The RoPE angles of a run of consecutive positions, computed once for every layer of a
/// forward pass (each layer rotates the same positions by the same angles) rather than once
/// per layer.
#[derive(Debug, Clone, Default)]
pub struct RopeAngles {
    /// The rotation and the runs of positions `(first, count)` held; `None` until
    /// [`RopeAngles::cover`].
    held: Option<(Rope, Vec<(usize, usize)>)>,
    /// Positions held.
    count: usize,
    /// `count` rows of `n_rot / 2` values.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeAngles {
    /// A table with room for `rows` positions of `rope` (more grow it).
    pub fn new(rope: &Rope, rows: usize) -> Self {
        let len = rows * (rope.n_rot / 2);
        Self {
            held: None,
            count: 0,
            cos: vec![0.0; len],
            sin: vec![0.0; len],
        }
    }

    /// Makes the table hold the angles of positions `first .. first + count` of `rope`
    /// ([`Rope::angles`]), computing them only when it holds others.
    pub fn cover(&mut self, rope: &Rope, first: usize, count: usize) {
        self.cover_runs(rope, &[(first, count)]);
    }

    /// Makes the table hold the angles of the positions of `runs` (each `(first, count)`:
    /// positions `first .. first + count`), one row per position in order — the rows of a pass
    /// over several sequences —, computing them only when it holds others.
    pub fn cover_runs(&mut self, rope: &Rope, runs: &[(usize, usize)]) {
        if let Some((held, held_runs)) = &self.held {
            if held_runs == runs && held == rope {
                return;
            }
        }
        let pairs = rope.n_rot / 2;
        let count: usize = runs.iter().map(|&(_, c)| c).sum();
        if self.cos.len() < count * pairs {
            self.cos.resize(count * pairs, 0.0);
            self.sin.resize(count * pairs, 0.0);
        }
        let positions = runs.iter().flat_map(|&(first, c)| first..first + c);
        for (position, (cos, sin)) in positions.zip(
            self.cos
                .chunks_exact_mut(pairs.max(1))
                .zip(self.sin.chunks_exact_mut(pairs.max(1))),
        ) {
            rope.angles(position, &mut cos[..pairs], &mut sin[..pairs]);
        }
        match &mut self.held {
            Some((held, held_runs)) => {
                held.clone_from(rope);
                held_runs.clear();
                held_runs.extend_from_slice(runs);
            }
            None => self.held = Some((rope.clone(), runs.to_vec())),
        }
        self.count = count;
    }

    /// Cosines and sines of the `i`-th position covered.
    pub fn row(&self, i: usize) -> (&[f32], &[f32]) {
        let Some((rope, _)) = &self.held else {
            panic!("rope angles: nothing covered");
        };
        let count = self.count;
        assert!(i < count, "rope angles: row {i} of {count}");
        let pairs = rope.n_rot / 2;
        (
            &self.cos[i * pairs..(i + 1) * pairs],
            &self.sin[i * pairs..(i + 1) * pairs],
        )
    }
}

/// L2 normalisation in place, as ggml's `l2_norm`: `x / max(sqrt(sum(x²)), eps)`, the squares
/// summed in f64.
pub fn l2_norm_in_place(x: &mut [f32], eps: f32) {
    let sum: f64 = x.iter().map(|v| f64::from(v * v)).sum();
    let scale = 1.0 / (sum as f32).sqrt().max(eps);
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// Softplus `ln(1 + exp(x))`, returning `x` itself above 20 where the two agree in f32
/// (ggml's threshold).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
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

    /// Every SIMD level's RMSNorm and RoPE give the scalar reference's bits, on lengths that
    /// leave every kind of tail.
    #[test]
    fn rms_norm_and_rope_simd_levels_equal_the_scalar_reference() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for len in [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 128, 130] {
            let x = random_vec(len, 3.0, len as u64);
            let w = random_vec(len, 1.0, len as u64 + 1);
            let mut want = vec![0.0; len];
            rms_norm_at(
                SimdLevel::Scalar,
                x.as_ptr(),
                &w,
                1e-6,
                want.as_mut_ptr(),
                len,
            );
            let r = rope(RopeMode::NeoX, 2 * len);
            let (mut cos, mut sin) = (vec![0.0; len], vec![0.0; len]);
            r.angles(41, &mut cos, &mut sin);
            let head = random_vec(2 * len + 3, 1.0, len as u64 + 2);
            let mut rotated = head.clone();
            r.apply_at(SimdLevel::Scalar, &mut rotated, &cos, &sin);
            for level in SimdLevel::supported() {
                let mut out = vec![0.0; len];
                rms_norm_at(level, x.as_ptr(), &w, 1e-6, out.as_mut_ptr(), len);
                assert_eq!(bits(&out), bits(&want), "rms_norm at {level}, {len} values");
                let mut in_place = x.clone();
                let p = in_place.as_mut_ptr();
                rms_norm_at(level, p, &w, 1e-6, p, len);
                assert_eq!(bits(&in_place), bits(&want), "in place at {level}, {len}");
                let mut got = head.clone();
                r.apply_at(level, &mut got, &cos, &sin);
                assert_eq!(bits(&got), bits(&rotated), "rope at {level}, {len} pairs");
            }
        }
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
    fn angle_table_holds_each_positions_angles() {
        let neox = rope(RopeMode::NeoX, 8);
        let mut scaled = neox.clone();
        scaled.freq_scale = 0.5;
        let mut table = RopeAngles::new(&neox, 2);
        for (r, first, count) in [(&neox, 5, 3), (&neox, 5, 3), (&neox, 9, 1), (&scaled, 9, 1)] {
            table.cover(r, first, count);
            for i in 0..count {
                let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
                r.angles(first + i, &mut cos, &mut sin);
                assert_eq!(table.row(i), (&cos[..], &sin[..]), "position {}", first + i);
            }
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
                    RopeMode::NeoX | RopeMode::MultiSection(_) => (i, i + 4),
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
    fn multi_section_rope_assigns_pairs_like_ggml() {
        // Interleaved (IMROPE) with sections [2, 1, 1, 0]: sectors 0..4 are t, h, w, t.
        let imrope = RopeSections {
            sections: [2, 1, 1, 0],
            interleaved: true,
        };
        let parts: Vec<usize> = (0..8).map(|p| imrope.component(p)).collect();
        assert_eq!(parts, vec![0, 1, 2, 0, 0, 1, 2, 0]);
        // [1, 1, 1, 1]: sector 3 is `3 % 3 == 0` but not below 3 * 1, so it is extra.
        let with_extra = RopeSections {
            sections: [1, 1, 1, 1],
            interleaved: true,
        };
        assert_eq!(
            (0..4).map(|p| with_extra.component(p)).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        // Contiguous (MROPE) runs.
        let mrope = RopeSections {
            sections: [2, 1, 0, 1],
            interleaved: false,
        };
        assert_eq!(
            (0..4).map(|p| mrope.component(p)).collect::<Vec<_>>(),
            vec![0, 0, 1, 3]
        );
    }

    #[test]
    fn multi_section_rope_is_neox_except_for_the_extra_component() {
        let neox = rope(RopeMode::NeoX, 8);
        let mut multi = neox.clone();
        multi.mode = RopeMode::MultiSection(RopeSections {
            sections: [1, 1, 1, 1],
            interleaved: true,
        });
        let (mut c1, mut s1) = (vec![0.0; 4], vec![0.0; 4]);
        let (mut c2, mut s2) = (vec![0.0; 4], vec![0.0; 4]);
        neox.angles(37, &mut c1, &mut s1);
        multi.angles(37, &mut c2, &mut s2);
        assert_eq!(&c1[..3], &c2[..3]);
        assert_eq!(&s1[..3], &s2[..3]);
        assert_eq!((c2[3], s2[3]), (1.0, 0.0));
        let x = random_vec(16, 1.0, 9);
        let (mut a, mut b) = (x.clone(), x.clone());
        neox.apply(&mut a, &c1, &s1);
        multi.apply(&mut b, &c2, &s2);
        for i in 0..3 {
            assert_eq!((a[i], a[i + 4]), (b[i], b[i + 4]), "pair {i}");
        }
        // Pair 3 (dims 3 and 7) of the extra component and the unrotated tail pass through.
        assert_eq!((b[3], b[7]), (x[3], x[7]));
        assert_eq!(&b[8..], &x[8..]);
        // Sections that cover every pair make it plain NeoX.
        multi.mode = RopeMode::MultiSection(RopeSections {
            sections: [2, 1, 1, 0],
            interleaved: true,
        });
        multi.angles(37, &mut c2, &mut s2);
        assert_eq!((c1.clone(), s1.clone()), (c2.clone(), s2.clone()));
    }

    #[test]
    fn l2_norm_and_softplus() {
        let mut x = vec![3.0, 4.0];
        l2_norm_in_place(&mut x, 1e-6);
        assert_eq!(x, vec![0.6, 0.8]);
        let mut zero = vec![0.0; 3];
        l2_norm_in_place(&mut zero, 1e-6);
        assert_eq!(zero, vec![0.0; 3]);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(-5.0) - 0.006_715_348).abs() < 1e-8);
    }

    #[test]
    fn add_in_place_adds() {
        let mut a = vec![1.0, 2.0];
        add_in_place(&mut a, &[0.5, 0.5]);
        assert_eq!(a, vec![1.5, 2.5]);
    }
}
