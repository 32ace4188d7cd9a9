//! What the K-quant formats (Q4_K, Q5_K, Q6_K — super-blocks of 256 values) share: ggml's
//! rounding helper and scale searches (the reference quantisers depend on them bit for bit),
//! the 6-bit scale/min packing of Q4_K and Q5_K, and the dispatch of their dot products with
//! Q8_K activation rows.
//!
//! Every dot product with Q8_K activations is, per super-block, an exact integer sum
//! `Σ_j scale_j · Σ q_w · q_x` (plus, for Q4_K / Q5_K, the mins term `Σ_j min_j · bsum_j`, read
//! from the Q8_K block's precomputed sums), turned into f32 once with the block scales. Only the
//! f32 accumulation over super-blocks differs between the scalar reference (one f32, in order)
//! and the SIMD kernels (8 or 16 f32 lanes summed at the end).

use crate::q8_k;
use crate::simd::{self, Accumulator, Rows, SimdLevel};

/// Values per super-block (ggml's `QK_K`).
pub const SUPER_BLOCK_VALUES: usize = 256;

/// ggml's `nearest_int`: round to nearest, ties to even. Well below `2^22` in magnitude (every
/// activation, and any sane weight) adding `1.5 · 2^23` makes the float unit round at the
/// integer position, and the integer is read from the mantissa — a few inline instructions,
/// where `round_ties_even` is a library call without SSE4.1; beyond that the library call.
#[inline]
pub(crate) fn nearest_int(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    if v.abs() < 4_000_000.0 {
        ((v + MAGIC).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
    } else {
        v.round_ties_even() as i32
    }
}

/// ggml's `make_qkx2_quants` without the mean-absolute-deviation option: fits
/// `x ≈ scale · L + min` (`min ≤ 0`, `L` in `0 ..= nmax`) minimising the `weights`-weighted
/// squared error, trying `nstep + 1` grid scales `(rmin + rdelta · step + nmax) / (max - min)`
/// and a least-squares refit for each. Writes the levels to `levels` and returns
/// `(scale, -min)`.
///
/// The float expressions keep ggml's evaluation order (no fused multiply-adds), so the chosen
/// levels and scales are those of ggml's reference quantiser built without FP contraction.
pub(crate) fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    levels: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    debug_assert!(n <= 32 && weights.len() == n && levels.len() == n);
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    // `min` changes when a better fit is found, and later trials start from it (as in ggml).
    let level = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        levels[i] = level(iscale, x[i], min) as u8;
        let diff = scale * f32::from(levels[i]) + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut trial = [0u8; 32];
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = level(iscale, x[i], min);
            trial[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(trial[i]) + this_min - x[i];
                error += weights[i] * (diff * diff);
            }
            if error < best_error {
                levels.copy_from_slice(&trial[..n]);
                best_error = error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights (the weights are
/// `x²`): a symmetric fit `x ≈ scale · (L - nmax)`, `L` in `0 .. 2·nmax`, trying 19 grid
/// scales around `-nmax / max` and keeping the best least-squares fit. Writes the levels and
/// returns the scale (0 for an all-zero group).
pub(crate) fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    /// ggml's `GROUP_MAX_EPS`: groups whose largest magnitude is below this are all zero.
    const GROUP_MAX_EPS: f32 = 1e-15;
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| {
        let (mut sum_lx, mut sum_l2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sum_lx += w * v * l;
            sum_l2 += w * l * l;
        }
        (sum_lx, sum_l2)
    };
    let store = |iscale: f32, levels: &mut [i8]| {
        for (dst, &v) in levels.iter_mut().zip(x) {
            *dst = (nmax + level(iscale, v)) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    store(iscale, levels);
    let (sum_lx, sum_l2) = fit(iscale);
    let mut scale = if sum_l2 != 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for step in -9..=9 {
        if step == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sum_lx, sum_l2) = fit(iscale);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            store(iscale, levels);
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// Packs eight 6-bit scales and mins into the 12 bytes of Q4_K / Q5_K (ggml's layout):
/// bytes 0..4 hold scales 0..4 (low 6 bits) and the top 2 bits of scales 4..8; bytes 4..8 the
/// same for mins; bytes 8..12 the low 4 bits of scale `j` (low nibble) and min `j` (high
/// nibble) for `j` in 4..8.
pub(crate) fn pack_scales_mins(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (scales[j], mins[j]);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    packed
}

/// Unpacks the eight 6-bit scales and mins of a Q4_K / Q5_K super-block (ggml's
/// `get_scale_min_k4` for every sub-block).
#[inline]
pub(crate) fn unpack_scales_mins(packed: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (mut scales, mut mins) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        scales[j] = packed[j] & 63;
        mins[j] = packed[j + 4] & 63;
    }
    for j in 4..8 {
        scales[j] = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
        mins[j] = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
    (scales, mins)
}

/// Weight-quantiser front end shared by Q4_K and Q5_K (ggml's `quantize_row_q{4,5}_K_ref`
/// up to the bit packing): per sub-block of 32 a weighted min/scale fit, the scales and mins
/// quantised to 6 bits against the block maxima, then every value re-quantised against the
/// stored (f16-rounded) scales. Returns the packed scales, `d` and `dmin` as f16 bits, and the
/// levels `0 ..= nmax` of the 256 values.
pub(crate) fn quantize_with_mins(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
) -> ([u8; 12], u16, u16, [u8; SUPER_BLOCK_VALUES]) {
    debug_assert_eq!(x.len(), SUPER_BLOCK_VALUES);
    let mut levels = [0u8; SUPER_BLOCK_VALUES];
    let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let sub = &x[32 * j..32 * (j + 1)];
        let mut sum_x2 = 0.0f32;
        for v in sub {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0.0f32; 32];
        for (w, v) in weights.iter_mut().zip(sub) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            nmax,
            sub,
            &weights,
            &mut levels[32 * j..32 * (j + 1)],
            rmin,
            0.1,
            nstep,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    // `as u8` wraps like C's int -> uint8_t conversion before the clamp.
    let six_bits = |v: f32| (nearest_int(v) as u8).min(63);
    let scale_levels: [u8; 8] = std::array::from_fn(|j| six_bits(inv_scale * scales[j]));
    let min_levels: [u8; 8] = std::array::from_fn(|j| six_bits(inv_min * mins[j]));
    let packed = pack_scales_mins(&scale_levels, &min_levels);
    let d = crate::f16::from_f32(max_scale / 63.0);
    let dmin = crate::f16::from_f32(max_min / 63.0);
    let (d_f, dmin_f) = (crate::f16::to_f32(d), crate::f16::to_f32(dmin));
    let (sc, mn) = unpack_scales_mins(&packed);
    for j in 0..8 {
        let step = d_f * f32::from(sc[j]);
        if step == 0.0 {
            continue; // keeps the fit's levels, as ggml does
        }
        let offset = dmin_f * f32::from(mn[j]);
        for i in 32 * j..32 * (j + 1) {
            levels[i] = nearest_int((x[i] + offset) / step).clamp(0, nmax) as u8;
        }
    }
    (packed, d, dmin, levels)
}

/// The K-quant weight encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KEncoding {
    Q4K,
    Q5K,
    Q6K,
}

impl KEncoding {
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            KEncoding::Q4K => crate::q4_k::BLOCK_BYTES,
            KEncoding::Q5K => crate::q5_k::BLOCK_BYTES,
            KEncoding::Q6K => crate::q6_k::BLOCK_BYTES,
        }
    }

    fn scalar_dot(self) -> fn(&[u8], &[u8]) -> f32 {
        match self {
            KEncoding::Q4K => crate::q4_k::dot_scalar,
            KEncoding::Q5K => crate::q5_k::dot_scalar,
            KEncoding::Q6K => crate::q6_k::dot_scalar,
        }
    }
}

/// Checks that `w` (type `encoding`) and a Q8_K row of `x_len` bytes in `level`'s format
/// ([`q8_k::wide_block_bytes`]) have the same number of super-blocks.
pub(crate) fn check_sizes(encoding: KEncoding, level: SimdLevel, w_len: usize, x_len: usize) {
    let block = q8_k::wide_block_bytes(level);
    assert_eq!(
        x_len % block,
        0,
        "dot: activation row is not whole Q8_K blocks"
    );
    assert_eq!(
        w_len,
        x_len / block * encoding.block_bytes(),
        "dot: weight row and activation sizes differ"
    );
}

/// The multi-input dot product of a K-quant weight row with Q8_K activation rows: checks sizes
/// and `level`, then runs the level's kernel over the whole row (the scalar level runs the
/// reference per row).
pub(crate) fn k_quant_dot_rows(
    encoding: KEncoding,
    level: SimdLevel,
    w: &[u8],
    x: Rows<'_, u8>,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        x.count(),
        "dot_rows: one output per activation row"
    );
    check_sizes(encoding, SimdLevel::Scalar, w.len(), x.len());
    if level == SimdLevel::Scalar {
        let scalar = encoding.scalar_dot();
        for (b, o) in out.iter_mut().enumerate() {
            *o = scalar(w, x.row(b));
        }
    } else if q8_k::wide_block_bytes(level) == q8_k::BLOCK_BYTES {
        simd::accumulate_and_sum(x, out, k_quant_lanes(level), |x, acc| {
            k_quant_accumulate(encoding, level, Rows::single(w), x, acc, None)
        });
    } else {
        let format = simd::WidenedFormat {
            plain_block: q8_k::BLOCK_BYTES,
            wide_block: q8_k::wide_block_bytes(level),
            weight_block: encoding.block_bytes(),
        };
        simd::widened_accumulate_and_sum(
            w,
            x,
            out,
            k_quant_lanes(level),
            format,
            |plain, wide| q8_k::widen_row(level, plain, wide),
            |w, x, acc| k_quant_accumulate(encoding, level, Rows::single(w), x, acc, None),
        );
    }
}

/// Accumulator lanes of the K-quant kernels at a SIMD `level`.
pub(crate) fn k_quant_lanes(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512 | SimdLevel::Amx => 16,
        _ => 8,
    }
}

/// Adds K-quant weight rows (or runs of super-blocks) times each Q8_K activation row (the same
/// super-blocks) into the pairs' accumulators, at a SIMD `level` (checked to be supported).
pub(crate) fn k_quant_accumulate(
    encoding: KEncoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    simd::k_quant_accumulate(encoding, level, w, x, acc, prefetch_next);
}

/// The scalar dot product of Q4_K / Q5_K weights with Q8_K activations, given the decoder of
/// a super-block's 256 levels (`0 ..= 31`, value order): per super-block the exact integer sums
/// `Σ_j sc_j · Σ q_w · q_x` and `Σ_j m_j · bsum_j`, then
/// `sum += (d_x · d) · isum - (d_x · dmin) · imin` in f32, super-blocks in order.
pub(crate) fn dot_with_mins_scalar(
    encoding: KEncoding,
    w: &[u8],
    x: &[u8],
    levels_of: impl Fn(&[u8], &mut [u8; SUPER_BLOCK_VALUES]),
) -> f32 {
    check_sizes(encoding, SimdLevel::Scalar, w.len(), x.len());
    let mut sum = 0.0f32;
    let mut levels = [0u8; SUPER_BLOCK_VALUES];
    for (wb, xb) in w
        .chunks_exact(encoding.block_bytes())
        .zip(x.chunks_exact(q8_k::BLOCK_BYTES))
    {
        let (dx, xq, bsums) = q8_k::parts(xb);
        let d = crate::f16::to_f32(u16::from_le_bytes([wb[0], wb[1]]));
        let dmin = crate::f16::to_f32(u16::from_le_bytes([wb[2], wb[3]]));
        let (sc, mn) = unpack_scales_mins(wb[4..16].try_into().unwrap());
        levels_of(wb, &mut levels);
        let mut isum = 0i32;
        let mut imin = 0i32;
        for j in 0..8 {
            let sub: i32 = (32 * j..32 * (j + 1))
                .map(|i| i32::from(levels[i]) * i32::from(xq[i] as i8))
                .sum();
            isum += i32::from(sc[j]) * sub;
            imin += i32::from(mn[j]) * (i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1]));
        }
        sum += (dx * d) * isum as f32 - (dx * dmin) * imin as f32;
    }
    sum
}

/// Round-trip checks shared by the K-quant weight types' tests: over random rows of two
/// shapes, the RMS error relative to the RMS value is at most `max_relative_rms`, and no value
/// is off by more than `max_range_fraction` of its 32-value group's range.
#[cfg(test)]
pub(crate) fn check_round_trip(
    quantize: fn(&[f32], &mut [u8]),
    dequantize: fn(&[u8], &mut [f32]),
    block_bytes: usize,
    max_relative_rms: f64,
    max_range_fraction: f32,
) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let n = 32 * SUPER_BLOCK_VALUES;
    for bell_shaped in [false, true] {
        let x: Vec<f32> = (0..n)
            .map(|_| {
                let terms = if bell_shaped { 4 } else { 1 };
                (0..terms).map(|_| rng.gen_range(-1.0f32..1.0)).sum::<f32>() * 3.0
            })
            .collect();
        let mut q = vec![0u8; n / SUPER_BLOCK_VALUES * block_bytes];
        quantize(&x, &mut q);
        let mut back = vec![0.0; n];
        dequantize(&q, &mut back);
        let squares = |f: &dyn Fn(usize) -> f32| -> f64 {
            ((0..n).map(|i| f64::from(f(i)).powi(2)).sum::<f64>() / n as f64).sqrt()
        };
        let relative_rms = squares(&|i| x[i] - back[i]) / squares(&|i| x[i]);
        assert!(
            relative_rms <= max_relative_rms,
            "relative RMS error {relative_rms} > {max_relative_rms}"
        );
        for (values, restored) in x.chunks(32).zip(back.chunks(32)) {
            let max = values.iter().copied().fold(f32::MIN, f32::max).max(0.0);
            let min = values.iter().copied().fold(f32::MAX, f32::min).min(0.0);
            let bound = (max - min) * max_range_fraction;
            for (a, b) in values.iter().zip(restored) {
                assert!((a - b).abs() <= bound, "{a} -> {b} (bound {bound})");
            }
        }
        // An all-zero row stays zero.
        let zeros = vec![0.0; SUPER_BLOCK_VALUES];
        let mut q = vec![0u8; block_bytes];
        quantize(&zeros, &mut q);
        let mut back = vec![1.0; SUPER_BLOCK_VALUES];
        dequantize(&q, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_equals_round_ties_even() {
        let mut v = -5_000_000.0f32;
        while v < 5_000_000.0 {
            for x in [
                v,
                v + 0.5,
                v + 0.25,
                v + 0.499_999_97,
                v.next_up(),
                v.next_down(),
            ] {
                assert_eq!(nearest_int(x), x.round_ties_even() as i32, "{x}");
            }
            v += 997.31;
        }
        for x in [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            2.5,
            127.5,
            -127.5,
            4_194_303.5,
            f32::NAN,
        ] {
            assert_eq!(nearest_int(x), x.round_ties_even() as i32, "{x}");
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even_like_ggml() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-0.5), 0);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-2.7), -3);
        assert_eq!(nearest_int(126.49), 126);
    }

    #[test]
    fn scale_packing_round_trips_every_6_bit_value() {
        for seed in 0..64u8 {
            let scales: [u8; 8] = std::array::from_fn(|j| (seed + 7 * j as u8) % 64);
            let mins: [u8; 8] = std::array::from_fn(|j| (63 - seed + 11 * j as u8) % 64);
            let packed = pack_scales_mins(&scales, &mins);
            assert_eq!(unpack_scales_mins(&packed), (scales, mins));
        }
    }
}
