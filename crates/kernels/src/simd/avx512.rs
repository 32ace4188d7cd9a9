//! AVX-512 (F, BW, VL, VNNI) kernels.
//!
//! Same structure and contract as [`super::avx2`]: multi-input kernels that read a weight row
//! once per pass of up to [`super::MAX_ROWS_PER_PASS`] activation rows, with per-row
//! accumulators updated by a fixed instruction sequence, so that a row's result does not
//! depend on the other rows of the pass. The differences from AVX2:
//!
//! - float family: 32 lanes per row (two zmm registers), masked loads only for a ragged tail;
//! - 32-value blocks: two blocks per zmm, `vpdpbusd` (VNNI) forms each block's integer dot;
//! - K-quants: decoded straight into 64-value registers (scales spread by `vpermw`),
//!   `vpmaddubsw` then `vpdpwssd` (VNNI) applies the sub-block scales while accumulating, so a
//!   super-block is 8 multiply instructions per row.
//!
//! The 32-value block decoder for a single (odd last) block is shared with the AVX2 module (its
//! functions run here too: AVX-512 implies the AVX2 set this crate asks for).

use std::arch::x86_64::*;

use super::avx2::{
    decode_block32, float_size, k_block_bytes, row_ptrs, F16, F32, Q4_K, Q6_K, Q8_0,
};
use super::{in_passes, with_row_count, Accumulator, OutRows, Rows};
use crate::{q8_0, q8_k};

/// Lanes `first .. first + 16` of an accumulator.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn load_lanes16(acc: &Accumulator, first: usize) -> __m512 {
    let lanes = &acc.0[first..first + 16];
    // SAFETY: `lanes` is 16 readable f32.
    unsafe { _mm512_loadu_ps(lanes.as_ptr()) }
}

/// Stores `v` to lanes `first .. first + 16` of an accumulator.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn store_lanes16(acc: &mut Accumulator, first: usize, v: __m512) {
    let lanes = &mut acc.0[first..first + 16];
    // SAFETY: `lanes` is 16 writable f32.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) }
}

/// Loads the first `count` (≤ 16) weights of encoding `KIND` at `p`, zeros elsewhere, as f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn load16<const KIND: u8>(p: *const u8, count: usize) -> __m512 {
    if count >= 16 {
        // SAFETY: the caller guarantees 16 elements are readable at `p`.
        return unsafe {
            match KIND {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.cast()),
                ))),
            }
        };
    }
    let mask = if count >= 16 {
        0xffff
    } else {
        (1u16 << count) - 1
    };
    // SAFETY: the caller guarantees `count` elements are readable at `p`; masked-off lanes
    // are not accessed.
    unsafe {
        match KIND {
            F32 => _mm512_maskz_loadu_ps(mask, p.cast()),
            F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(mask, p.cast()),
            ))),
        }
    }
}

/// Loads the first `count` (≤ 16) f32 at `p`, zeros elsewhere.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn load16_f32(p: *const f32, count: usize) -> __m512 {
    let mask = if count >= 16 {
        0xffff
    } else {
        (1u16 << count) - 1
    };
    // SAFETY: the caller guarantees `count` f32 are readable at `p`.
    unsafe { _mm512_maskz_loadu_ps(mask, p) }
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16 weights × f32 activations
// ---------------------------------------------------------------------------------------------

/// Adds `w[i] · x_b[i]` for a float-family weight row into each row's accumulator: 32 lanes
/// per row (element `i` in lane `i % 32`, two zmm registers), fused multiply-adds.
///
/// # Safety
///
/// The AVX-512 level must be available; `w` must hold `rows.len()` elements of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn float_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, f32>,
    acc: &mut [Accumulator],
) {
    debug_assert_eq!(w.len(), rows.len() * float_size(KIND));
    in_passes(rows, acc, |group, group_acc| {
        // SAFETY: forwarded contract.
        unsafe { with_row_count!(group_acc.len(), float_pass::<KIND>(w, group, group_acc)) }
    });
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn float_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, f32>,
    state: &mut [Accumulator],
) {
    let size = float_size(KIND);
    let len = rows.len();
    let wp = w.as_ptr();
    let xp = row_ptrs::<f32, N>(&rows);
    let mut acc: [[__m512; 2]; N] =
        std::array::from_fn(|r| [load_lanes16(&state[r], 0), load_lanes16(&state[r], 16)]);
    let full = len / 32;
    for c in 0..full {
        let i = 32 * c;
        // SAFETY: elements `i .. i + 32` are inside the weight row and every activation row.
        unsafe {
            let w0 = load16::<KIND>(wp.add(i * size), 16);
            let w1 = load16::<KIND>(wp.add((i + 16) * size), 16);
            for r in 0..N {
                let x = xp[r].add(i);
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), acc[r][1]);
            }
        }
    }
    let i = 32 * full;
    if i < len {
        // The partial last chunk: masked loads read only the elements that exist and give
        // zeros elsewhere (0 · 0 adds nothing to a lane).
        let first = (len - i).min(16);
        let second = (len - i).saturating_sub(16);
        // SAFETY: `first` elements from `i` and `second` from `i + 16` are inside the weight
        // row and every activation row; the second pointers may lie past the end when
        // `second` is 0 (wrapping arithmetic, never dereferenced: every lane is masked off).
        unsafe {
            let w0 = load16::<KIND>(wp.add(i * size), first);
            let w1 = load16::<KIND>(wp.wrapping_add((i + 16) * size), second);
            for r in 0..N {
                let x = xp[r].add(i);
                acc[r][0] = _mm512_fmadd_ps(w0, load16_f32(x, first), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, load16_f32(x.wrapping_add(16), second), acc[r][1]);
            }
        }
    }
    for (s, a) in state.iter_mut().zip(acc) {
        store_lanes16(s, 0, a[0]);
        store_lanes16(s, 16, a[1]);
    }
}

/// `y += a · x` with one fused multiply-add per element (bit-identical to the AVX2 version).
///
/// # Safety
///
/// The AVX-512 level must be available; `x.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    let av = _mm512_set1_ps(a);
    let len = x.len();
    let full = len / 16;
    for c in 0..full {
        // SAFETY: elements `16c .. 16c + 16` exist in both slices.
        unsafe {
            let yp = y.as_mut_ptr().add(16 * c);
            let v = _mm512_fmadd_ps(
                av,
                _mm512_loadu_ps(x.as_ptr().add(16 * c)),
                _mm512_loadu_ps(yp),
            );
            _mm512_storeu_ps(yp, v);
        }
    }
    let rest = len - 16 * full;
    if rest > 0 {
        let mask = (1u16 << rest) - 1;
        // SAFETY: `rest` elements from `16 · full` exist in both slices; masked lanes are not
        // accessed.
        unsafe {
            let yp = y.as_mut_ptr().add(16 * full);
            let v = _mm512_fmadd_ps(
                av,
                _mm512_maskz_loadu_ps(mask, x.as_ptr().add(16 * full)),
                _mm512_maskz_loadu_ps(mask, yp),
            );
            _mm512_mask_storeu_ps(yp, mask, v);
        }
    }
}

/// One gated delta-rule step ([`crate::delta_rule::step`]): per state row, one pass that
/// scales the row by the decay, stores it and dots it with `k`; then one that adds `d_j · k`,
/// stores and dots with `q`. Two accumulators per dot (even / odd 16-lane chunks), a masked
/// tail, and the same reduction for every row.
///
/// # Safety
///
/// The AVX-512 level must be available; `q.len() == k.len()`, `out.len() == v.len()` and both
/// states hold `v.len() · k.len()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn delta_rule_step(
    x: crate::delta_rule::DeltaInputs<'_>,
    state_in: &[f32],
    state_out: &mut [f32],
    out: &mut [f32],
) {
    let dim = x.k.len();
    // Common head sizes keep k, q and the row in registers (one load and one store per
    // chunk of the row).
    if dim.is_multiple_of(16) && (1..=8).contains(&(dim / 16)) {
        // SAFETY: forwarded contract; `dim` is `16 · CHUNKS`.
        unsafe {
            match dim / 16 {
                1 => delta_rule_rows::<1>(x, state_in, state_out, out),
                2 => delta_rule_rows::<2>(x, state_in, state_out, out),
                3 => delta_rule_rows::<3>(x, state_in, state_out, out),
                4 => delta_rule_rows::<4>(x, state_in, state_out, out),
                5 => delta_rule_rows::<5>(x, state_in, state_out, out),
                6 => delta_rule_rows::<6>(x, state_in, state_out, out),
                7 => delta_rule_rows::<7>(x, state_in, state_out, out),
                _ => delta_rule_rows::<8>(x, state_in, state_out, out),
            }
        }
        return;
    }
    let chunks = dim.div_ceil(16);
    let mask_of = |c: usize| -> u16 {
        let lanes = (dim - 16 * c).min(16);
        if lanes == 16 {
            0xffff
        } else {
            (1u16 << lanes) - 1
        }
    };
    let decay = _mm512_set1_ps(x.decay);
    for (j, o) in out.iter_mut().enumerate() {
        // SAFETY: row `j` of both states holds `dim` values; chunk `c` covers values
        // `16c ..` of the row and of `k` / `q`, masked to the ones that exist.
        unsafe {
            let src = state_in.as_ptr().add(j * dim);
            let dst = state_out.as_mut_ptr().add(j * dim);
            let kp = x.k.as_ptr();
            let qp = x.q.as_ptr();
            let mut acc = [_mm512_setzero_ps(); 2];
            for c in 0..chunks {
                let mask = mask_of(c);
                let row = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src.add(16 * c)), decay);
                _mm512_mask_storeu_ps(dst.add(16 * c), mask, row);
                let k = _mm512_maskz_loadu_ps(mask, kp.add(16 * c));
                acc[c % 2] = _mm512_fmadd_ps(row, k, acc[c % 2]);
            }
            let predicted = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            let delta = _mm512_set1_ps((x.v[j] - predicted) * x.beta);
            let mut acc = [_mm512_setzero_ps(); 2];
            for c in 0..chunks {
                let mask = mask_of(c);
                let k = _mm512_maskz_loadu_ps(mask, kp.add(16 * c));
                let row = _mm512_fmadd_ps(delta, k, _mm512_maskz_loadu_ps(mask, dst.add(16 * c)));
                _mm512_mask_storeu_ps(dst.add(16 * c), mask, row);
                let q = _mm512_maskz_loadu_ps(mask, qp.add(16 * c));
                acc[c % 2] = _mm512_fmadd_ps(row, q, acc[c % 2]);
            }
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Activation quantisation (bit-identical to the scalar references)
// ---------------------------------------------------------------------------------------------

/// Whether any of the 16 lanes is NaN.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn has_nan(v: __m512) -> bool {
    _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) != 0
}

/// C's `roundf` per lane (ties away from zero), exactly as `q8_0::round_half_away`:
/// truncate, then step away from zero where the dropped fraction is at least one half.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn round_half_away(v: __m512) -> __m512i {
    let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
    let fraction = _mm512_abs_ps(_mm512_sub_ps(v, whole));
    let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(fraction, _mm512_set1_ps(0.5));
    let sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(i32::MIN));
    let step = _mm512_castsi512_ps(_mm512_or_si512(
        sign,
        _mm512_castps_si512(_mm512_set1_ps(1.0)),
    ));
    _mm512_cvttps_epi32(_mm512_mask_add_ps(whole, up, whole, step))
}

/// Q8_0 activation quantisation (`q8_0::quantize_row_scalar`'s bytes): per block of 32 the
/// largest magnitude, `d = amax / 127`, quants `roundf(v / d)`. Blocks holding a NaN go
/// through the scalar block quantiser (its NaN handling is order-dependent).
///
/// # Safety
///
/// The AVX-512 level must be available; `x` is whole blocks and `out` one block per 32 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0_row(x: &[f32], out: &mut [u8]) {
    for (values, block) in x
        .chunks_exact(q8_0::BLOCK_VALUES)
        .zip(out.chunks_exact_mut(q8_0::BLOCK_BYTES))
    {
        // SAFETY: `values` holds 32 floats and `block` 34 bytes.
        unsafe {
            let v = [
                _mm512_loadu_ps(values.as_ptr()),
                _mm512_loadu_ps(values.as_ptr().add(16)),
            ];
            if has_nan(v[0]) || has_nan(v[1]) {
                q8_0::quantize_block(values, block);
                continue;
            }
            let amax =
                _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            let d = amax / 127.0;
            let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
            block[..2].copy_from_slice(&crate::f16::from_f32(d).to_le_bytes());
            for (h, part) in v.iter().enumerate() {
                let q = round_half_away(_mm512_mul_ps(*part, _mm512_set1_ps(inverse)));
                _mm_storeu_si128(
                    block.as_mut_ptr().add(2 + 16 * h).cast(),
                    _mm512_cvtepi32_epi8(q),
                );
            }
        }
    }
}

/// Q8_K activation quantisation (`q8_k::quantize_row_scalar`'s bytes): per block of 256 the
/// first value of largest magnitude `max` maps to -127 (`iscale = -127 / max`), quants
/// `min(127, round_ties_even(iscale · v))`, the sums of each 16 quants, `d = 1 / iscale`.
/// Blocks holding a NaN go through the scalar block quantiser.
///
/// # Safety
///
/// The AVX-512 level must be available; `x` is whole blocks and `out` one block per 256
/// values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k_row(x: &[f32], out: &mut [u8]) {
    const GROUPS: usize = q8_k::BLOCK_VALUES / 16;
    for (values, block) in x
        .chunks_exact(q8_k::BLOCK_VALUES)
        .zip(out.chunks_exact_mut(q8_k::BLOCK_BYTES))
    {
        // SAFETY: `values` holds 256 floats and `block` 292 bytes.
        unsafe {
            let mut v = [_mm512_setzero_ps(); GROUPS];
            let mut magnitudes = [_mm512_setzero_ps(); GROUPS];
            let mut any_nan = false;
            let mut largest = _mm512_setzero_ps();
            for g in 0..GROUPS {
                v[g] = _mm512_loadu_ps(values.as_ptr().add(16 * g));
                any_nan |= has_nan(v[g]);
                magnitudes[g] = _mm512_abs_ps(v[g]);
                largest = _mm512_max_ps(largest, magnitudes[g]);
            }
            if any_nan {
                q8_k::quantize_block(values, block);
                continue;
            }
            let amax = _mm512_reduce_max_ps(largest);
            if amax == 0.0 {
                block.fill(0);
                continue;
            }
            // The first value of that magnitude, as the scalar scan keeps it.
            let splat = _mm512_set1_ps(amax);
            let mut first = 0;
            for (g, m) in magnitudes.iter().enumerate() {
                let hits = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(*m, splat);
                if hits != 0 {
                    first = 16 * g + hits.trailing_zeros() as usize;
                    break;
                }
            }
            let iscale = -127.0 / values[first];
            let scale = _mm512_set1_ps(iscale);
            let qs = block.as_mut_ptr().add(4);
            let sums = block.as_mut_ptr().add(4 + q8_k::BLOCK_VALUES);
            for (g, part) in v.iter().enumerate() {
                let rounded = _mm512_roundscale_ps::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(_mm512_mul_ps(scale, *part));
                let q = _mm512_min_epi32(_mm512_cvtps_epi32(rounded), _mm512_set1_epi32(127));
                _mm_storeu_si128(qs.add(16 * g).cast(), _mm512_cvtepi32_epi8(q));
                let sum = _mm512_reduce_add_epi32(q) as i16;
                sums.add(2 * g)
                    .cast::<[u8; 2]>()
                    .write_unaligned(sum.to_le_bytes());
            }
            block[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
    }
}

/// [`delta_rule_step`] for rows of exactly `16 · CHUNKS` values, with `k`, `q` and the row
/// in registers.
///
/// # Safety
///
/// As [`delta_rule_step`], and `k.len() == 16 · CHUNKS`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn delta_rule_rows<const CHUNKS: usize>(
    x: crate::delta_rule::DeltaInputs<'_>,
    state_in: &[f32],
    state_out: &mut [f32],
    out: &mut [f32],
) {
    let dim = 16 * CHUNKS;
    // SAFETY: `k` and `q` hold `dim` values; row `j` of both states holds `dim` values.
    unsafe {
        let k: [__m512; CHUNKS] =
            std::array::from_fn(|c| _mm512_loadu_ps(x.k.as_ptr().add(16 * c)));
        let q: [__m512; CHUNKS] =
            std::array::from_fn(|c| _mm512_loadu_ps(x.q.as_ptr().add(16 * c)));
        let decay = _mm512_set1_ps(x.decay);
        for (j, o) in out.iter_mut().enumerate() {
            let src = state_in.as_ptr().add(j * dim);
            let dst = state_out.as_mut_ptr().add(j * dim);
            let mut row = [_mm512_setzero_ps(); CHUNKS];
            let mut acc = [_mm512_setzero_ps(); 2];
            for c in 0..CHUNKS {
                row[c] = _mm512_mul_ps(_mm512_loadu_ps(src.add(16 * c)), decay);
                acc[c % 2] = _mm512_fmadd_ps(row[c], k[c], acc[c % 2]);
            }
            let predicted = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            let delta = _mm512_set1_ps((x.v[j] - predicted) * x.beta);
            let mut acc = [_mm512_setzero_ps(); 2];
            for c in 0..CHUNKS {
                row[c] = _mm512_fmadd_ps(delta, k[c], row[c]);
                _mm512_storeu_ps(dst.add(16 * c), row[c]);
                acc[c % 2] = _mm512_fmadd_ps(row[c], q[c], acc[c % 2]);
            }
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention over one key/value head
// ---------------------------------------------------------------------------------------------

/// Queries whose registers stay live while the keys stream past ([`attention_scores`]).
const SCORE_TILE: usize = 2;

/// Attention scores ([`crate::attention::scores`]) over cached keys stored as `KIND` (F32 or
/// F16; `keys` are rows of bytes). Head sizes of 16 · C (C ≤ 8) keep a tile of queries in
/// registers and load each key once for the tile; other sizes run one query at a time with
/// masked chunks. Per (query, key): two accumulators over the chunks (even / odd), then one
/// horizontal sum — whatever the other queries.
///
/// # Safety
///
/// The AVX-512 level must be available; every key row holds `queries.len()` values of `KIND`;
/// every limit is at most the key count and `q * stride + limit <= out.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn attention_scores<const KIND: u8>(
    queries: Rows<'_, f32>,
    keys: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
) {
    let dim = queries.len();
    let size = float_size(KIND);
    // SAFETY: forwarded contract.
    unsafe {
        if dim.is_multiple_of(16) && (1..=8).contains(&(dim / 16)) {
            match dim / 16 {
                1 => scores_tiled::<KIND, 1>(queries, keys, limits, out, stride),
                2 => scores_tiled::<KIND, 2>(queries, keys, limits, out, stride),
                3 => scores_tiled::<KIND, 3>(queries, keys, limits, out, stride),
                4 => scores_tiled::<KIND, 4>(queries, keys, limits, out, stride),
                5 => scores_tiled::<KIND, 5>(queries, keys, limits, out, stride),
                6 => scores_tiled::<KIND, 6>(queries, keys, limits, out, stride),
                7 => scores_tiled::<KIND, 7>(queries, keys, limits, out, stride),
                _ => scores_tiled::<KIND, 8>(queries, keys, limits, out, stride),
            }
            return;
        }
        let chunks = dim.div_ceil(16);
        for (q, &limit) in limits.iter().enumerate() {
            let qp = queries.ptr(q);
            for j in 0..limit {
                let kp = keys.ptr(j);
                let mut acc = [_mm512_setzero_ps(); 2];
                for c in 0..chunks {
                    let lanes = (dim - 16 * c).min(16);
                    acc[c % 2] = _mm512_fmadd_ps(
                        load16_f32(qp.add(16 * c), lanes),
                        load16::<KIND>(kp.add(16 * c * size), lanes),
                        acc[c % 2],
                    );
                }
                out[q * stride + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            }
        }
    }
}

/// [`attention_scores`] for head size `16 · C`: queries in tiles of [`SCORE_TILE`] (then
/// one) held in registers while the keys stream past, keys in blocks of 16 whose dot products
/// with a query are summed across lanes together ([`sum_lanes_16`]) rather than one
/// horizontal sum per key. A key's arithmetic is the same wherever it falls in a block and
/// whatever the other keys and queries: two accumulators over the chunks (even / odd), their
/// sum, then the lane tree of [`sum_lanes_16`].
///
/// # Safety
///
/// As [`attention_scores`], with `queries.len() == 16 · C`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn scores_tiled<const KIND: u8, const C: usize>(
    queries: Rows<'_, f32>,
    keys: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
) {
    let mut first = 0;
    while first < limits.len() {
        // SAFETY: forwarded contract; the tile's queries are `first .. first + T`.
        unsafe {
            first += if limits.len() - first >= SCORE_TILE {
                scores_tile::<KIND, C, SCORE_TILE>(queries, keys, limits, out, stride, first)
            } else {
                scores_tile::<KIND, C, 1>(queries, keys, limits, out, stride, first)
            };
        }
    }
}

/// Cached rows ahead of the current one whose lines the attention kernels prefetch: a head's
/// rows are contiguous, but each row is only a few lines, too few for the hardware prefetchers
/// to run ahead of a pass that starts from memory.
const PREFETCH_ROWS: usize = 4;

/// Prefetches every line of cached row `j + PREFETCH_ROWS` of `rows`, when there is one.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn prefetch_row_ahead(rows: Rows<'_, u8>, j: usize) {
    if j + PREFETCH_ROWS < rows.count() {
        prefetch_block(rows.ptr(j + PREFETCH_ROWS), rows.len());
    }
}

/// One tile of `T` queries from `first` for [`scores_tiled`]; returns `T`.
///
/// # Safety
///
/// As [`scores_tiled`], with queries `first .. first + T` present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn scores_tile<const KIND: u8, const C: usize, const T: usize>(
    queries: Rows<'_, f32>,
    keys: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
    first: usize,
) -> usize {
    let size = float_size(KIND);
    let tile_limits = &limits[first..first + T];
    let longest = tile_limits.iter().copied().max().unwrap_or(0);
    let shortest = tile_limits.iter().copied().min().unwrap_or(0);
    // SAFETY: rows `first .. first + T` exist; key `j < longest` exists; the written scores
    // lie inside `out` (the caller's contract).
    unsafe {
        let q: [[__m512; C]; T] = std::array::from_fn(|t| {
            let qp = queries.ptr(first + t);
            std::array::from_fn(|c| _mm512_loadu_ps(qp.add(16 * c)))
        });
        // Per query, one vector of lane products per key of a block. Slots of keys past the
        // block's end or a query's limit keep what they held (zeros, or an earlier block's
        // products): each lane of a lane sum depends on its own slot only, and those lanes
        // are never stored.
        let mut products = [[_mm512_setzero_ps(); 16]; T];
        for block in (0..longest).step_by(16) {
            let in_block = 16.min(longest - block);
            for (j, key) in (block..block + in_block).enumerate() {
                prefetch_row_ahead(keys, key);
                let kp = keys.ptr(key);
                let k: [__m512; C] =
                    std::array::from_fn(|c| load16::<KIND>(kp.add(16 * c * size), 16));
                let every = key < shortest;
                for t in 0..T {
                    if !every && key >= tile_limits[t] {
                        continue;
                    }
                    let mut acc = [_mm512_setzero_ps(); 2];
                    for c in 0..C {
                        acc[c % 2] = _mm512_fmadd_ps(q[t][c], k[c], acc[c % 2]);
                    }
                    products[t][j] = _mm512_add_ps(acc[0], acc[1]);
                }
            }
            for (t, &limit) in tile_limits.iter().enumerate() {
                if block >= limit {
                    continue;
                }
                let keep = (limit - block).min(16);
                let mask = if keep == 16 {
                    0xffff
                } else {
                    (1u16 << keep) - 1
                };
                let sums = sum_lanes_16(&products[t]);
                let dst = out.as_mut_ptr().add((first + t) * stride + block);
                _mm512_mask_storeu_ps(dst, mask, sums);
            }
        }
    }
    T
}

/// The lane sums of 16 vectors, in order: lane `j` of the result is the sum of the 16 lanes of
/// `v[j]`, always by the same tree (lanes `i` and `i + 8`, then `+ 4`, then `+ 2`, then
/// `+ 1`), whatever the other vectors hold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn sum_lanes_16(v: &[__m512; 16]) -> __m512 {
    // Each step adds the two halves of every vector's partial sums and packs two vectors'
    // halved partials into one.
    // Lanes 0..8 of `w[i]`: v[2i] lanes i + lanes i + 8; lanes 8..16: the same for v[2i + 1].
    let w: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // 128-bit quarter `r` of `x[i]`: the four partial sums of v[4i + r].
    let x: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (w[2 * i], w[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // Quarter `r` of `y[i]`: two partials of v[8i + r], then two of v[8i + 4 + r].
    let y: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    // Lane `4r + m`: the sum of v[4m + r].
    let sums = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, sums)
}

/// Attention weighted sums ([`crate::attention::weighted_sums`]) over cached values stored as
/// `KIND`: per output element `y = fma(p_j, v_j, y)` for keys `j` in order from zero. Head
/// sizes of 16 · C (C ≤ 8) keep a tile of outputs in registers and load each value row once
/// for the tile; other sizes run one query at a time with masked chunks through memory (the
/// same per-element sequence).
///
/// # Safety
///
/// The AVX-512 level must be available; `out` holds one row of the values' length per query;
/// every limit is at most the value count and the probability row length.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn attention_weighted_sums<const KIND: u8>(
    probs: Rows<'_, f32>,
    values: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
) {
    let size = float_size(KIND);
    let dim = values.len() / size;
    // SAFETY: forwarded contract.
    unsafe {
        if dim.is_multiple_of(16) && (1..=8).contains(&(dim / 16)) {
            match dim / 16 {
                1 => sums_tiled::<KIND, 1>(probs, values, limits, out),
                2 => sums_tiled::<KIND, 2>(probs, values, limits, out),
                3 => sums_tiled::<KIND, 3>(probs, values, limits, out),
                4 => sums_tiled::<KIND, 4>(probs, values, limits, out),
                5 => sums_tiled::<KIND, 5>(probs, values, limits, out),
                6 => sums_tiled::<KIND, 6>(probs, values, limits, out),
                7 => sums_tiled::<KIND, 7>(probs, values, limits, out),
                _ => sums_tiled::<KIND, 8>(probs, values, limits, out),
            }
            return;
        }
        let chunks = dim.div_ceil(16);
        for (q, (o, &limit)) in out.chunks_exact_mut(dim.max(1)).zip(limits).enumerate() {
            o.fill(0.0);
            let op = o.as_mut_ptr();
            for j in 0..limit {
                let p = _mm512_set1_ps(*probs.ptr(q).add(j));
                let vp = values.ptr(j);
                for c in 0..chunks {
                    let lanes = (dim - 16 * c).min(16);
                    let mask = if lanes == 16 {
                        0xffff
                    } else {
                        (1u16 << lanes) - 1
                    };
                    let y = _mm512_fmadd_ps(
                        p,
                        load16::<KIND>(vp.add(16 * c * size), lanes),
                        _mm512_maskz_loadu_ps(mask, op.add(16 * c)),
                    );
                    _mm512_mask_storeu_ps(op.add(16 * c), mask, y);
                }
            }
        }
    }
}

/// [`attention_weighted_sums`] for head size `16 · C`: queries in tiles of 8, 4, 2 and 1 whose
/// outputs for one 16-value chunk stay in registers while that chunk of every value row
/// streams past, so each value row is read once per chunk for a whole tile (rather than once
/// per query), and each probability is broadcast straight from memory.
///
/// # Safety
///
/// As [`attention_weighted_sums`], with values of `16 · C` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn sums_tiled<const KIND: u8, const C: usize>(
    probs: Rows<'_, f32>,
    values: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
) {
    let mut first = 0;
    while first < limits.len() {
        let left = limits.len() - first;
        // SAFETY: forwarded contract; the tile's queries are `first .. first + T`.
        unsafe {
            first += match left {
                8.. => sums_tile::<KIND, C, 8>(probs, values, limits, out, first),
                4..=7 => sums_tile::<KIND, C, 4>(probs, values, limits, out, first),
                2 | 3 => sums_tile::<KIND, C, 2>(probs, values, limits, out, first),
                _ => sums_tile::<KIND, C, 1>(probs, values, limits, out, first),
            };
        }
    }
}

/// One tile of `T` queries from `first` for [`sums_tiled`]; returns `T`.
///
/// # Safety
///
/// As [`sums_tiled`], with queries `first .. first + T` present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn sums_tile<const KIND: u8, const C: usize, const T: usize>(
    probs: Rows<'_, f32>,
    values: Rows<'_, u8>,
    limits: &[usize],
    out: &mut [f32],
    first: usize,
) -> usize {
    let (dim, size) = (16 * C, float_size(KIND));
    let tile_limits = &limits[first..first + T];
    let longest = tile_limits.iter().copied().max().unwrap_or(0);
    let shortest = tile_limits.iter().copied().min().unwrap_or(0);
    // SAFETY: value rows `j < longest` exist; probability rows `first .. first + T` hold at
    // least their limits; output rows `first + t` lie inside `out`.
    unsafe {
        let p: [*const f32; T] = std::array::from_fn(|t| probs.ptr(first + t));
        for c in 0..C {
            let mut acc = [_mm512_setzero_ps(); T];
            // Values every query of the tile sees, then the causal tail checked per query.
            for j in 0..shortest {
                if c == 0 {
                    prefetch_row_ahead(values, j);
                }
                let v = load16::<KIND>(values.ptr(j).add(16 * c * size), 16);
                for (y, row) in acc.iter_mut().zip(&p) {
                    *y = _mm512_fmadd_ps(_mm512_set1_ps(*row.add(j)), v, *y);
                }
            }
            for j in shortest..longest {
                let v = load16::<KIND>(values.ptr(j).add(16 * c * size), 16);
                for ((y, row), &limit) in acc.iter_mut().zip(&p).zip(tile_limits) {
                    if j < limit {
                        *y = _mm512_fmadd_ps(_mm512_set1_ps(*row.add(j)), v, *y);
                    }
                }
            }
            for (t, y) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add((first + t) * dim + 16 * c), *y);
            }
        }
    }
    T
}

/// `y[i] = fma(w_j, v_j[i], y[i])` for `j = 0, 1, …` in order — exactly [`axpy`] once per row,
/// but each chunk of `y` stays in registers across all rows.
///
/// # Safety
///
/// The AVX-512 level must be available; `weights.len() == rows.count()` and
/// `rows.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn weighted_sum(weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
    debug_assert!(weights.len() == rows.count() && rows.len() == y.len());
    /// Registers of `y` kept live per sweep over the rows.
    const REGS: usize = 8;
    let len = y.len();
    let mut start = 0;
    while start < len {
        let count = (len - start).min(16 * REGS);
        let masks: [u16; REGS] = std::array::from_fn(|k| {
            let lanes = count.saturating_sub(16 * k).min(16);
            if lanes == 16 {
                0xffff
            } else {
                (1u16 << lanes) - 1
            }
        });
        let used = count.div_ceil(16);
        // SAFETY: lane `l` of register `k` is element `start + 16k + l` of `y` and of every row;
        // masks cover exactly the elements that exist (a full mask loads plainly).
        unsafe {
            let load = |p: *const f32, mask: u16| {
                if mask == 0xffff {
                    _mm512_loadu_ps(p)
                } else {
                    _mm512_maskz_loadu_ps(mask, p)
                }
            };
            let yp = y.as_mut_ptr().add(start);
            let mut acc: [__m512; REGS] = std::array::from_fn(|k| {
                if k < used {
                    load(yp.add(16 * k), masks[k])
                } else {
                    _mm512_setzero_ps()
                }
            });
            for (j, &wj) in weights.iter().enumerate() {
                let wv = _mm512_set1_ps(wj);
                let vp = rows.ptr(j).add(start);
                for (k, (a, &mask)) in acc.iter_mut().zip(&masks).enumerate().take(used) {
                    *a = _mm512_fmadd_ps(wv, load(vp.add(16 * k), mask), *a);
                }
            }
            for (k, (a, &mask)) in acc.iter().zip(&masks).enumerate().take(used) {
                if mask == 0xffff {
                    _mm512_storeu_ps(yp.add(16 * k), *a);
                } else {
                    _mm512_mask_storeu_ps(yp.add(16 * k), mask, *a);
                }
            }
        }
        start += count;
    }
}

/// Where a 16-lane integer-kernel pass leaves its results.
pub(crate) enum PassOutput<'a> {
    /// Carried accumulators: the pass is a column tile of its rows.
    State(&'a mut [Accumulator]),
    /// Whole rows: activation row `b`'s sum at `out[b * stride]`.
    Sums { out: &'a mut [f32], stride: usize },
}

/// The accumulators a pass starts from: the carried state, or zeros for a whole row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn pass_start<const N: usize>(output: &PassOutput<'_>) -> [__m512; N] {
    match output {
        PassOutput::State(state) => std::array::from_fn(|r| load_lanes16(&state[r], 0)),
        PassOutput::Sums { .. } => [_mm512_setzero_ps(); N],
    }
}

/// Stores a pass's accumulators, or their sums by the pairwise tree of
/// [`Accumulator::sum`] (lane `i` plus lane `i + 8`, then `+ 4`, `+ 2`, `+ 1`): the same bits
/// either way, so whole rows and tiled rows agree.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn pass_finish<const N: usize>(acc: [__m512; N], output: PassOutput<'_>) {
    match output {
        PassOutput::State(state) => {
            for (s, a) in state.iter_mut().zip(acc) {
                store_lanes16(s, 0, a);
            }
        }
        PassOutput::Sums { out, stride } => {
            for (r, a) in acc.into_iter().enumerate() {
                let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
                let eight = _mm256_add_ps(_mm512_castps512_ps256(a), high);
                let four = _mm_add_ps(
                    _mm256_castps256_ps128(eight),
                    _mm256_extractf128_ps::<1>(eight),
                );
                let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
                out[r * stride] = _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Q8_0 / Q4_0 weights × Q8_0 activations (blocks of 32)
// ---------------------------------------------------------------------------------------------

/// Q8_0 / Q4_0 weight row × widened Q8_0 activation rows ([`q8_0::widen_row`]: quants offset
/// to unsigned, scales spread over lanes), two blocks per zmm register: block `2p` in lanes
/// 0..8, block `2p + 1` in lanes 8..16. Per weight pair, shared by all rows: the signed quants
/// and `-128 · Σ w` per lane. Per row and pair: one `vpdpbusd` starting from that offset gives
/// the exact integer dots `Σ (x + 128) · w - 128 · Σ w = Σ x · w`, converted to f32 and fused
/// into the row's 16 accumulator lanes with the scales `d_w · d_x` of each half. An odd last
/// block goes into lanes 0..8 alone.
///
/// # Safety
///
/// The AVX-512 level must be available; `w` and every row must be the same whole number of
/// blocks, and the run must start at an even block of the row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn block32_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    acc: &mut [Accumulator],
) {
    in_passes(rows, acc, |group, group_acc| {
        // SAFETY: forwarded contract.
        unsafe {
            with_row_count!(
                group_acc.len(),
                block32_pass::<KIND>(w, group, PassOutput::State(group_acc))
            )
        }
    });
}

/// [`block32_rows`] over whole rows (at most [`super::MAX_ROWS_PER_PASS`] activation rows):
/// activation row `b`'s dot product with `w` at `out[b * stride]`, reduced in registers.
///
/// # Safety
///
/// As [`block32_rows`] (the run is the whole row); `out` holds index
/// `(rows.count() - 1) * stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn block32_row_sums<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    out: &mut [f32],
    stride: usize,
) {
    let output = PassOutput::Sums { out, stride };
    // SAFETY: forwarded contract.
    unsafe { with_row_count!(rows.count(), block32_pass::<KIND>(w, rows, output)) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block32_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, u8>,
    output: PassOutput<'_>,
) {
    const WIDE: usize = q8_0::AVX512_WIDE_BLOCK_BYTES;
    let blocks = rows.len() / WIDE;
    let xp = row_ptrs::<u8, N>(&rows);
    let mut acc: [__m512; N] = pass_start(&output);
    let offset_unit = _mm512_set1_epi8(-128);
    let mut b = 0;
    while b + 1 < blocks {
        // SAFETY: blocks `b`, `b + 1` lie inside the weight row and every activation row (a
        // pair of activation blocks is 64 quants then 16 scales).
        unsafe {
            let (wq, dw) = decode_block32_pair::<KIND>(w.as_ptr(), b);
            // `vpdpbusd` with `-128` as the unsigned operand: 128 · Σ w, negated.
            let offset = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset_unit, wq),
            );
            for r in 0..N {
                let xb = xp[r].add(b * WIDE);
                let sums = _mm512_dpbusd_epi32(offset, _mm512_loadu_si512(xb.cast()), wq);
                let scale = _mm512_mul_ps(dw, _mm512_loadu_ps(xb.add(64).cast()));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[r]);
            }
        }
        b += 2;
    }
    if b < blocks {
        // SAFETY: block `b` lies inside the weight row and every activation row (an odd last
        // activation block is 32 quants then 8 scales).
        unsafe {
            let (wq, dw) = decode_block32::<KIND>(w.as_ptr(), b);
            let offset = _mm256_sub_epi32(
                _mm256_setzero_si256(),
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), wq),
            );
            for r in 0..N {
                let xb = xp[r].add(b * WIDE);
                let sums = _mm256_dpbusd_epi32(offset, _mm256_loadu_si256(xb.cast()), wq);
                let scale = _mm256_mul_ps(dw, _mm256_loadu_ps(xb.add(32).cast()));
                let low = _mm512_castps512_ps256(acc[r]);
                let low = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), low);
                acc[r] = _mm512_castpd_ps(_mm512_insertf64x4::<0>(
                    _mm512_castps_pd(acc[r]),
                    _mm256_castps_pd(low),
                ));
            }
        }
    }
    pass_finish(acc, output);
}

/// Decodes weight blocks `b` and `b + 1` of encoding `KIND` into one zmm of 64 signed quants
/// (block `b` in the low half) and their scales (`d_b` in lanes 0..8, `d_{b+1}` in 8..16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn decode_block32_pair<const KIND: u8>(w: *const u8, b: usize) -> (__m512i, __m512) {
    let (bytes, quants_at) = match KIND {
        Q8_0 => (q8_0::BLOCK_BYTES, 2),
        _ => (crate::q4_0::BLOCK_BYTES, 2),
    };
    // SAFETY: the caller guarantees blocks `b` and `b + 1` lie inside the weight row.
    unsafe {
        let first = w.add(b * bytes);
        let second = first.add(bytes);
        let half = |p: *const u8| _mm_set1_epi16(p.cast::<u16>().read_unaligned() as i16);
        let scales = _mm512_cvtph_ps(_mm256_set_m128i(half(second), half(first)));
        let quants = match KIND {
            Q8_0 => join(
                _mm256_loadu_si256(first.add(quants_at).cast()),
                _mm256_loadu_si256(second.add(quants_at).cast()),
            ),
            _ => {
                // 128-bit lanes [q_b, q_b, q_b+1, q_b+1], odd lanes shifted down a nibble:
                // low nibbles (values 0..16) then high nibbles (16..32) of each block.
                let packed = _mm256_set_m128i(
                    _mm_loadu_si128(second.add(quants_at).cast()),
                    _mm_loadu_si128(first.add(quants_at).cast()),
                );
                let spread = _mm512_permutexvar_epi64(
                    _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                    _mm512_castsi256_si512(packed),
                );
                let shifted = _mm512_srlv_epi64(spread, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
                let nibbles = _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
                _mm512_sub_epi8(nibbles, _mm512_set1_epi8(8))
            }
        };
        (quants, scales)
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants (super-blocks of 256) × Q8_K activations
// ---------------------------------------------------------------------------------------------

/// Joins two 256-bit halves into one zmm (`low` in lanes 0..8 of i32, `high` above).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn join(low: __m256i, high: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
}

/// One K-quant weight super-block decoded for the integer dot products, 64 values per
/// register: unsigned quants in value order, the i16 scale multipliers, the bsum multipliers,
/// and the block scales.
///
/// Per activation row, `vpdpbusd` forms the exact sums of 4 products per i32 lane for each
/// quant register; `vpackssdw` narrows registers `2m` and `2m + 1` into one register of i16
/// (every such sum fits: at most 4 · 63 · 128 < 2^15) and `vpdpwssd` multiplies each i16 by its
/// sub-block's scale (`multipliers[m]`, laid out in the pack's lane order) while accumulating.
/// Six multiply instructions per row and super-block (`vpmaddubsw` + `vpdpwssd` on every
/// register took eight).
///
/// The widened activation block ([`q8_k::widen_row`]) carries `d_x` in 16 lanes and
/// `d_x · bsum_g` per group of 16, so the row's update is `acc += (d · d_x) · sums` and
/// `acc -= group_coefficients · (d_x · bsum)`: no broadcast and no integer bsum product per row.
struct WideSuperBlock {
    quants: [__m512i; 4],
    multipliers: [__m512i; 2],
    /// The super-block scale `d` in every lane.
    d: __m512,
    /// Per group `g` of 16 values: Q4_K / Q5_K `dmin · m_{g/2}` (the minimums); Q6_K
    /// `32 · d · scale_g` (the quants' `+32` offset).
    group_coefficients: __m512,
}

/// Index vector for `vpermw` selecting i16 element `f(lane)` into each of the 32 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn lane_pattern(f: impl Fn(i16) -> i16) -> __m512i {
    let lanes: [i16; 32] = std::array::from_fn(|i| f(i as i16));
    // SAFETY: `lanes` is 64 readable bytes.
    unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) }
}

/// Decodes the Q4_K / Q5_K super-block at `block` straight into 64-value registers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn decode_k_with_mins_wide<const KIND: u8>(block: *const u8) -> WideSuperBlock {
    // SAFETY: the caller guarantees a whole super-block at `block`.
    unsafe {
        // The 6-bit scales and mins, four at a time (ggml-common.h layout): bytes 0..4 hold
        // scales 0..4 and the top bits of scales 4..8, bytes 4..8 the same for mins, bytes
        // 8..12 the low nibbles of scales (low) and mins (high) 4..8.
        let word = |i: usize| block.add(4 + 4 * i).cast::<u32>().read_unaligned();
        let (a, b, c) = (word(0), word(1), word(2));
        let (low6, low4, top2) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
        let scales_0_4 = a & low6;
        let mins_0_4 = b & low6;
        let scales_4_8 = (c & low4) | (((a >> 6) & top2) << 4);
        let mins_4_8 = ((c >> 4) & low4) | (((b >> 6) & top2) << 4);
        // i16 elements 0..8: scales, 8..16: mins.
        let scale_min = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_setr_epi32(
            scales_0_4 as i32,
            scales_4_8 as i32,
            mins_0_4 as i32,
            mins_4_8 as i32,
        )));
        // Quant register k holds sub-blocks 2k (i32 sums 0..8) and 2k + 1 (8..16). Packed
        // register m, i16 lane i: 128-bit lane i / 8 of register 2m (i % 8 < 4) or 2m + 1.
        let multipliers = std::array::from_fn(|m| {
            let m = m as i16;
            _mm512_permutexvar_epi16(
                lane_pattern(|i| 4 * m + 2 * ((i % 8) / 4) + i / 16),
                scale_min,
            )
        });
        // m_{g/2} for the 16 groups, as f32.
        let group_mins = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(
            _mm512_permutexvar_epi16(lane_pattern(|i| 8 + (i % 16) / 2), scale_min),
        )));
        let qs = match KIND {
            Q4_K => block.add(16),
            _ => block.add(48),
        };
        let nibble = _mm512_set1_epi8(0x0f);
        let high_half_down = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
        let quants = std::array::from_fn(|c| {
            // Chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones.
            let packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * c).cast()));
            let low4 = _mm512_and_si512(_mm512_srlv_epi64(packed, high_half_down), nibble);
            if KIND == Q4_K {
                return low4;
            }
            // Fifth bits: bit 2c (low half) or 2c + 1 (high half) of qh[l].
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(16).cast()));
            let bits = _mm512_inserti64x4::<1>(
                _mm512_set1_epi8(1 << (2 * c)),
                _mm256_set1_epi8(1 << (2 * c + 1)),
            );
            let has_fifth = _mm512_test_epi8_mask(qh, bits);
            _mm512_mask_add_epi8(low4, has_fifth, low4, _mm512_set1_epi8(16))
        });
        let halves = block.cast::<u32>().read_unaligned();
        let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(halves as i32));
        WideSuperBlock {
            quants,
            multipliers,
            d: _mm512_broadcastss_ps(scales),
            group_coefficients: _mm512_mul_ps(
                _mm512_broadcastss_ps(_mm_movehdup_ps(scales)),
                group_mins,
            ),
        }
    }
}

/// Decodes the Q6_K super-block at `block` straight into 64-value registers; quants stay
/// unsigned (`q + 32`), the offset is applied through the bsums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn decode_q6_k_wide(block: *const u8) -> WideSuperBlock {
    // SAFETY: the caller guarantees a whole super-block at `block`.
    unsafe {
        let nibble = _mm512_set1_epi8(0x0f);
        let two_bits = _mm512_set1_epi8(0x30);
        let mut quants = [_mm512_setzero_si512(); 4];
        for half in 0..2 {
            // ql[64h..64h+64]: low nibbles are values 0..64 of the half, high nibbles 64..128;
            // qh[32h..32h+32]: bits (0,1), (2,3), (4,5), (6,7) top values 0.., 32.., 64.., 96...
            let ql = _mm512_loadu_si512(block.add(64 * half).cast());
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(128 + 32 * half).cast()));
            let top_a = _mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2));
            let top_b = _mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2));
            quants[2 * half] = _mm512_or_si512(
                _mm512_and_si512(ql, nibble),
                _mm512_and_si512(top_a, two_bits),
            );
            quants[2 * half + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), nibble),
                _mm512_and_si512(top_b, two_bits),
            );
        }
        let group_scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(192).cast()));
        let scales = _mm512_castsi256_si512(group_scales);
        // Quant register k holds groups 4k .. 4k + 4 of 16 values (4 i32 sums each). Packed
        // register m, i16 lane i: 128-bit lane i / 8 (= the group within the register) of
        // register 2m (i % 8 < 4) or 2m + 1.
        let multipliers = std::array::from_fn(|m| {
            let m = m as i16;
            _mm512_permutexvar_epi16(lane_pattern(|i| 4 * (2 * m + (i % 8) / 4) + i / 8), scales)
        });
        let d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_set1_epi16(
            block.add(208).cast::<u16>().read_unaligned() as i16,
        )));
        let offsets =
            _mm512_cvtepi32_ps(_mm512_slli_epi32::<5>(_mm512_cvtepi16_epi32(group_scales)));
        WideSuperBlock {
            quants,
            multipliers,
            d,
            group_coefficients: _mm512_mul_ps(d, offsets),
        }
    }
}

/// K-quant weight row × Q8_K activation rows: as the AVX2 kernel, 64 values per step, the
/// scales applied by `vpdpwssd` into 16 i32 lanes, fused into the row's 16 accumulator lanes.
///
/// # Safety
///
/// The AVX-512 level must be available; `w` must be whole super-blocks of `KIND` and every
/// row the same number of Q8_K blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_quant_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    acc: &mut [Accumulator],
) {
    in_passes(rows, acc, |group, group_acc| {
        // SAFETY: forwarded contract.
        unsafe {
            with_row_count!(
                group_acc.len(),
                k_quant_pass::<KIND>(w, group, PassOutput::State(group_acc))
            )
        }
    });
}

/// [`k_quant_rows`] over whole rows (at most [`super::MAX_ROWS_PER_PASS`] activation rows):
/// activation row `b`'s dot product with `w` at `out[b * stride]`, reduced in registers.
///
/// # Safety
///
/// As [`k_quant_rows`]; `out` holds index `(rows.count() - 1) * stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_quant_row_sums<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    out: &mut [f32],
    stride: usize,
) {
    let output = PassOutput::Sums { out, stride };
    // SAFETY: forwarded contract.
    unsafe { with_row_count!(rows.count(), k_quant_pass::<KIND>(w, rows, output)) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_quant_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, u8>,
    output: PassOutput<'_>,
) {
    const WIDE: usize = q8_k::AVX512_WIDE_BLOCK_BYTES;
    let blocks = rows.len() / WIDE;
    let xp = row_ptrs::<u8, N>(&rows);
    let mut acc: [__m512; N] = pass_start(&output);
    for b in 0..blocks {
        // SAFETY: super-block `b` lies inside the weight row and every activation row.
        unsafe {
            let block = w.as_ptr().add(b * k_block_bytes(KIND));
            let decoded = match KIND {
                Q6_K => decode_q6_k_wide(block),
                _ => decode_k_with_mins_wide::<KIND>(block),
            };
            for r in 0..N {
                let xq = xp[r].add(b * WIDE);
                let mut sums = _mm512_setzero_si512();
                for m in 0..2 {
                    let quad_sums = |k: usize| {
                        let x = _mm512_loadu_si512(xq.add(64 * k).cast());
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), decoded.quants[k], x)
                    };
                    let packed = _mm512_packs_epi32(quad_sums(2 * m), quad_sums(2 * m + 1));
                    sums = _mm512_dpwssd_epi32(sums, packed, decoded.multipliers[m]);
                }
                let dx = _mm512_loadu_ps(xq.add(q8_k::AVX512_SCALES).cast());
                let scaled_sums = _mm512_loadu_ps(xq.add(q8_k::AVX512_SCALED_SUMS).cast());
                let scale = _mm512_mul_ps(decoded.d, dx);
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[r]);
                acc[r] = _mm512_fnmadd_ps(decoded.group_coefficients, scaled_sums, acc[r]);
            }
        }
    }
    pass_finish(acc, output);
}

// ---------------------------------------------------------------------------------------------
// Interleaved weight groups (16 rows): Q8_0 / Q4_0 × Q8_0 activations, Q4_K × Q8_K activations
// ---------------------------------------------------------------------------------------------

/// A run of interleaved Q8_0 / Q4_0 groups of 16 weight rows ([`crate::interleaved`]) times a
/// pass of activation rows in the interleaved activation format: the product of the run's
/// weight row `i < valid` and activation row `b` at `out.row(b)[first + i]`.
///
/// # Safety
///
/// AVX-512 is supported; `groups` holds whole groups of `x.len() / 40` group blocks of encoding
/// `KIND`, the last of which holds row `valid - 1`; `x` holds at most
/// [`super::MAX_ROWS_PER_PASS`] rows of whole activation blocks and `out` as many rows, each of
/// at least `first + valid` outputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn interleaved_pass<const KIND: u8>(
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    // SAFETY: forwarded contract.
    unsafe {
        with_row_count!(
            x.count(),
            interleaved_groups::<KIND>(groups, x, out, first, valid)
        )
    }
}

/// [`interleaved_pass`] for `N` activation rows: the groups one after the other, all in one
/// call (no argument round trip through memory between groups).
///
/// # Safety
///
/// As [`interleaved_pass`], with `x.count() == N`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn interleaved_groups<const KIND: u8, const N: usize>(
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    use crate::interleaved::{Encoding, GROUP_ROWS};
    let encoding = match KIND {
        Q8_0 => Encoding::Q8_0,
        _ => Encoding::Q4_0,
    };
    let blocks = x.len() / encoding.activation_block_bytes();
    let group_bytes = blocks * encoding.group_block_bytes();
    let xp = row_ptrs::<u8, N>(&x);
    let op = out.ptrs::<N>();
    for (g, group) in groups.chunks_exact(group_bytes).enumerate() {
        let offset = first + g * GROUP_ROWS;
        // SAFETY: the caller's contract; group `g`'s outputs start at `offset` in every row.
        unsafe {
            interleaved_rows::<KIND, N>(
                group.as_ptr(),
                blocks,
                xp,
                op.map(|p| p.add(offset)),
                GROUP_ROWS.min(valid - g * GROUP_ROWS),
            )
        }
    }
}

/// How far ahead of the block being multiplied a multi-row Q8_0 / Q4_0 interleaved pass
/// prefetches. Measured (4096² from DRAM, 1 thread): Q8_0 best at 12–13 KiB. (Q4_K has its
/// own, [`Q4K_PREFETCH_BYTES`].)
const INTERLEAVED_PREFETCH_BYTES: usize = 12 << 10;

/// Prefetches the `bytes` (a group block) at `ahead` into L1, a line at a time.
///
/// Multi-row interleaved passes compute long enough per block that the hardware prefetchers
/// fall behind the stream (measured, 4096² Q8_0 from DRAM, 1 thread, 8 rows: 9.2 GB/s without,
/// 22.8 / 33.1 GB/s prefetching 4 / 13 KiB ahead); single-row passes stream faster without.
/// Past the group's end `ahead` is the next group, stored right after it; a prefetch never
/// faults, so the address may run past the matrix.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn prefetch_block(ahead: *const u8, bytes: usize) {
    let mut line = 0;
    while line < bytes {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
        line += 64;
    }
}

/// Stores lanes `0..valid` of row `r`'s 16 results at `out[r]`.
///
/// # Safety
///
/// Every `out[r]` holds `valid <= 16` outputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn store_group_results<const N: usize>(acc: &[__m512; N], out: [*mut f32; N], valid: usize) {
    let mask: __mmask16 = if valid >= 16 {
        0xffff
    } else {
        (1u16 << valid) - 1
    };
    for (acc, out) in acc.iter().zip(out) {
        // SAFETY: the caller guarantees `out` holds `valid` outputs.
        unsafe { _mm512_mask_storeu_ps(out, mask, *acc) };
    }
}

/// One Q8_0 / Q4_0 group (`blocks` group blocks at `group`) times `N` activation rows (`xp`):
/// lanes `0..valid` of row `r`'s results stored at `out[r]`.
///
/// # Safety
///
/// The group and every activation row hold `blocks` blocks; every `out[r]` holds `valid`
/// outputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn interleaved_rows<const KIND: u8, const N: usize>(
    group: *const u8,
    blocks: usize,
    xp: [*const u8; N],
    out: [*mut f32; N],
    valid: usize,
) {
    use crate::interleaved::{Encoding, BLOCK32_VALUES};
    let encoding = match KIND {
        Q8_0 => Encoding::Q8_0,
        _ => Encoding::Q4_0,
    };
    let group_block = encoding.group_block_bytes();
    let act_block = encoding.activation_block_bytes();
    let mut acc = [_mm512_setzero_ps(); N];
    let low_nibbles = _mm512_set1_epi8(0x0f);
    for b in 0..blocks {
        // SAFETY: block `b` lies inside the group and every activation row (caller's contract):
        // 32 scale bytes then 8 (Q8_0) or 4 (Q4_0) registers of quants; 40 activation bytes.
        unsafe {
            let block = group.add(b * group_block);
            if N > 1 {
                prefetch_block(block.wrapping_add(INTERLEAVED_PREFETCH_BYTES), group_block);
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let quants = block.add(32);
            let mut w = [_mm512_setzero_si512(); 8];
            if KIND == Q8_0 {
                for (j, w) in w.iter_mut().enumerate() {
                    *w = _mm512_loadu_si512(quants.add(64 * j).cast());
                }
            } else {
                for m in 0..4 {
                    let packed = _mm512_loadu_si512(quants.add(64 * m).cast());
                    w[m] = _mm512_and_si512(packed, low_nibbles);
                    w[m + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low_nibbles);
                }
            }
            for r in 0..N {
                let xb = xp[r].add(b * act_block);
                let words = xb.cast::<i32>();
                macro_rules! word {
                    ($j:expr) => {
                        _mm512_set1_epi32(words.add($j).read_unaligned())
                    };
                }
                let start = _mm512_set1_epi32(words.add(BLOCK32_VALUES / 4 + 1).read_unaligned());
                // Two independent chains (integer sums: the split changes no bit) keep a
                // single-row pass from waiting on `vpdpbusd` latency.
                let mut even = _mm512_dpbusd_epi32(start, w[0], word!(0));
                let mut odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], word!(1));
                for j in (2..8).step_by(2) {
                    even = _mm512_dpbusd_epi32(even, w[j], word!(j));
                    odd = _mm512_dpbusd_epi32(odd, w[j + 1], word!(j + 1));
                }
                let sums = _mm512_add_epi32(even, odd);
                let dx = _mm512_set1_ps(xb.add(BLOCK32_VALUES).cast::<f32>().read_unaligned());
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, dx), acc[r]);
            }
        }
    }
    // SAFETY: forwarded contract on `out`.
    unsafe { store_group_results(&acc, out, valid) };
}

/// A run of interleaved Q4_K groups of 16 weight rows ([`crate::interleaved`]) times a pass of
/// activation rows in the interleaved Q4_K activation format: the product of the run's weight
/// row `i < valid` and activation row `b` at `out.row(b)[first + i]`.
///
/// # Safety
///
/// AVX-512 is supported; `groups` holds whole groups of `x.len() / 276` Q4_K group blocks, the
/// last of which holds row `valid - 1`; `x` holds at most [`super::MAX_ROWS_PER_PASS`] rows of
/// whole activation blocks and `out` as many rows, each of at least `first + valid` outputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn interleaved_q4k_pass(
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    // SAFETY: forwarded contract.
    unsafe {
        with_row_count!(
            x.count(),
            interleaved_q4k_groups(groups, x, out, first, valid)
        )
    }
}

/// [`interleaved_q4k_pass`] for `N` activation rows: every group in one sweep of all the rows.
///
/// One sweep of all 8 rows measured best once the prefetches were spread over the sub-blocks
/// (see [`Q4K_PREFETCH_BYTES`]): 0.6B Q4_K verify pass, alternating in one process, k = 8 in
/// 16.277 / 17.570 ms against 16.885 / 17.537 in sweeps of 4 and 19.331 / 19.917 in sweeps of 3
/// (with the prefetches in one burst per block, sweeps of 3 had been best).
///
/// # Safety
///
/// As [`interleaved_q4k_pass`], with `x.count() == N`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn interleaved_q4k_groups<const N: usize>(
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    use crate::interleaved::{Encoding, GROUP_ROWS};
    let blocks = x.len() / Encoding::Q4K.activation_block_bytes();
    let group_bytes = blocks * Encoding::Q4K.group_block_bytes();
    let xp = row_ptrs::<u8, N>(&x);
    let op = out.ptrs::<N>();
    for (g, group) in groups.chunks_exact(group_bytes).enumerate() {
        let offset = first + g * GROUP_ROWS;
        // SAFETY: the caller's contract; group `g`'s outputs start at `offset` in every row.
        unsafe {
            interleaved_q4k_rows::<N>(
                group.as_ptr(),
                blocks,
                xp,
                op.map(|p| p.add(offset)),
                GROUP_ROWS.min(valid - g * GROUP_ROWS),
            )
        }
    }
}

/// How far ahead of the block being multiplied the Q4_K pass prefetches, an eighth of a group
/// block before each of the block's 8 sub-blocks rather than the whole of it in one burst.
///
/// Spread that way the stream keeps up far better (0.6B Q4_K forward pass, variants alternating
/// in one process): k = 1 from 13.299 / 12.713 / 11.603 ms to 10.688 / 10.243 / 8.393 in three
/// runs, k = 4 from 13.189 / 13.109 to 12.114 / 11.979. The distance: k = 8 took
/// 14.851 / 13.784 / 13.465 / 13.521 ms prefetching 8 / 12 / 16 / 24 KiB ahead (in sweeps of 3
/// rows then), k = 1 the same within noise.
const Q4K_PREFETCH_BYTES: usize = 16 << 10;

/// Prefetches sub-block `j`'s eighth of the group block at `ahead`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn prefetch_q4k_sub_block(ahead: *const u8, j: usize) {
    let lines = crate::interleaved::Encoding::Q4K
        .group_block_bytes()
        .div_ceil(64);
    for line in j * lines / 8..(j + 1) * lines / 8 {
        // A prefetch never faults, so the address may run past the matrix.
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
    }
}

/// Per super-block and activation row: for each sub-block `j`, 8 `vpdpbusd` (two chains) give
/// the 16 rows' `Σ q_w · q_x`, times the rows' `sc_j` (`vpmulld`) into `isum`; 4 `vpdpwssd` of
/// the rows' min pairs against the activation's sub-block sum pairs give `imin`; then two
/// fused multiply-adds (see [`crate::interleaved`]). A sub-block's nibbles are decoded once
/// for all the rows; the loop over sub-blocks is outermost so that only one sub-block's 8
/// weight registers and each row's `isum` are live.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn interleaved_q4k_rows<const N: usize>(
    group: *const u8,
    blocks: usize,
    xp: [*const u8; N],
    out: [*mut f32; N],
    valid: usize,
) {
    use crate::interleaved::{
        Encoding, Q4K_ACT_SCALE, Q4K_ACT_SUMS, Q4K_DMIN, Q4K_MINS, Q4K_QUANTS, Q4K_SCALES,
    };
    let group_block = Encoding::Q4K.group_block_bytes();
    let act_block = Encoding::Q4K.activation_block_bytes();
    let mut acc = [_mm512_setzero_ps(); N];
    let low_nibbles = _mm512_set1_epi8(0x0f);
    for b in 0..blocks {
        // SAFETY: super-block `b` lies inside the group (2368 bytes: scales, mins, 4 chunks of
        // 8 quant registers) and every activation row (276 bytes: 256 quants, the scale, 4
        // dwords of sums) by the caller's contract.
        unsafe {
            let block = group.add(b * group_block);
            // Unlike Q8_0, a Q4_K single-row pass gains from prefetching too (4096² from DRAM,
            // criterion, alternating builds: 1 thread 20.8–20.9 GiB/s without, 27.3–28.2 with;
            // 2 threads 35.5–35.6 without, 36.4–53.0 with): its per-block work is long enough.
            let ahead = block.wrapping_add(Q4K_PREFETCH_BYTES);
            let mut isum = [_mm512_setzero_si512(); N];
            for j in 0..8 {
                prefetch_q4k_sub_block(ahead, j);
                // Sub-block `j`: the low (even `j`) or high (odd `j`) nibbles of chunk `j / 2`.
                let chunk = block.add(Q4K_QUANTS + 512 * (j / 2));
                let mut w = [_mm512_setzero_si512(); 8];
                for (k, w) in w.iter_mut().enumerate() {
                    let packed = _mm512_loadu_si512(chunk.add(64 * k).cast());
                    *w = if j % 2 == 0 {
                        _mm512_and_si512(packed, low_nibbles)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low_nibbles)
                    };
                }
                let scales =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(Q4K_SCALES + 16 * j).cast()));
                for r in 0..N {
                    let words = xp[r].add(b * act_block + 32 * j).cast::<i32>();
                    macro_rules! word {
                        ($k:expr) => {
                            _mm512_set1_epi32(words.add($k).read_unaligned())
                        };
                    }
                    // Two independent chains (exact integers: the split changes no bit).
                    let mut even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], word!(0));
                    let mut odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], word!(1));
                    for k in (2..8).step_by(2) {
                        even = _mm512_dpbusd_epi32(even, w[k], word!(k));
                        odd = _mm512_dpbusd_epi32(odd, w[k + 1], word!(k + 1));
                    }
                    let sub = _mm512_add_epi32(even, odd);
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sub, scales));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(Q4K_DMIN).cast()));
            let mins: [__m512i; 4] = std::array::from_fn(|p| {
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(block.add(Q4K_MINS + 32 * p).cast()))
            });
            for r in 0..N {
                let xb = xp[r].add(b * act_block);
                let sums = xb.add(Q4K_ACT_SUMS).cast::<i32>();
                let pair = |p: usize| _mm512_set1_epi32(sums.add(p).read_unaligned());
                let low = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins[0], pair(0));
                let high = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins[1], pair(1));
                let low = _mm512_dpwssd_epi32(low, mins[2], pair(2));
                let high = _mm512_dpwssd_epi32(high, mins[3], pair(3));
                let imin = _mm512_add_epi32(low, high);
                let dx = _mm512_set1_ps(xb.add(Q4K_ACT_SCALE).cast::<f32>().read_unaligned());
                acc[r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, dx), acc[r]);
                acc[r] =
                    _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(dmin, dx), acc[r]);
            }
        }
    }
    // SAFETY: forwarded contract on `out`.
    unsafe { store_group_results(&acc, out, valid) };
}

// ---------------------------------------------------------------------------------------------
// Activations (bit-identical to the scalar references in `crate::activations`)
// ---------------------------------------------------------------------------------------------

/// The largest value of `x` (whole chunks of 16) or -∞, for [`super::softmax_exp_sum`].
///
/// # Safety
///
/// AVX-512 must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn max_of_chunks(x: &[f32]) -> f32 {
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    for chunk in x.chunks_exact(16) {
        // SAFETY: the chunk holds 16 values.
        max = _mm512_max_ps(max, unsafe { _mm512_loadu_ps(chunk.as_ptr()) });
    }
    _mm512_reduce_max_ps(max)
}

/// `x[i] = exp(x[i] - max)` over whole chunks of 16, returning the sums of lanes 0–15, for
/// [`super::softmax_exp_sum`].
///
/// # Safety
///
/// AVX-512 must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn exp_sum_chunks(x: &mut [f32], max: f32) -> [f32; 16] {
    let shift = _mm512_set1_ps(max);
    let mut sums = _mm512_setzero_ps();
    for chunk in x.chunks_exact_mut(16) {
        // SAFETY: the chunk holds 16 values.
        unsafe {
            let e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(chunk.as_ptr()), shift));
            _mm512_storeu_ps(chunk.as_mut_ptr(), e);
            sums = _mm512_add_ps(sums, e);
        }
    }
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds 16 values.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
    lanes
}

/// `e^x` per lane: the operations of [`crate::activations::exp`], in its order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn exp_ps(x: __m512) -> __m512 {
    use crate::activations::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E};
    // `max` returns its second operand for a NaN lane, as `f32::max` returns the non-NaN one.
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
        _mm512_set1_ps(EXP_MAX),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)),
    );
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    let biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
}

/// `x / (1 + e^-x)` per lane, as [`crate::activations::silu`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn silu_ps(x: __m512) -> __m512 {
    let negated = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(i32::MIN),
    ));
    _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), exp_ps(negated)))
}

/// `1 / (1 + e^-x)` per lane, as [`crate::activations::sigmoid`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn sigmoid_ps(x: __m512) -> __m512 {
    let negated = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(i32::MIN),
    ));
    let one = _mm512_set1_ps(1.0);
    _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(negated)))
}

/// `out[i] = f(gate[i]) · other[i]` (without `other`: `f(gate[i])`), `f` SiLU or (`SIGMOID`)
/// the sigmoid, for the whole registers of 16 among `len` values; returns how many it did
/// (the caller finishes the tail).
///
/// The AVX-512 level must be available; `gate` and `other` readable and `out` writable for
/// `len` values. `out` may be `gate` or `other`: each value is read before it is written.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gate_mul<const SIGMOID: bool>(
    gate: *const f32,
    other: Option<*const f32>,
    out: *mut f32,
    len: usize,
) -> usize {
    let full = len / 16;
    for c in 0..full {
        // SAFETY: values `16c .. 16c + 16` exist behind every pointer (caller's contract).
        unsafe {
            let g = _mm512_loadu_ps(gate.add(16 * c));
            let mut v = if SIGMOID { sigmoid_ps(g) } else { silu_ps(g) };
            if let Some(other) = other {
                v = _mm512_mul_ps(v, _mm512_loadu_ps(other.add(16 * c)));
            }
            _mm512_storeu_ps(out.add(16 * c), v);
        }
    }
    16 * full
}

// ---------------------------------------------------------------------------------------------
// RMSNorm and RoPE
// ---------------------------------------------------------------------------------------------

/// The squares of `x`'s values (squared in f32) summed in f64 into 8 lanes, value `i` into
/// lane `i % 8`, over the whole chunks of 8; returns the lanes and how many values it took.
///
/// # Safety
///
/// The AVX-512 level must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn sum_squares_f64(x: &[f32]) -> ([f64; 8], usize) {
    let chunks = x.len() / 8;
    let mut acc = _mm512_setzero_pd();
    for c in 0..chunks {
        // SAFETY: values `8c .. 8c + 8` lie inside `x`.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * c)) };
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_mul_ps(v, v)));
    }
    let mut lanes = [0.0; 8];
    // SAFETY: `lanes` holds 8 f64.
    unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), acc) };
    (lanes, 8 * chunks)
}

/// `out[i] = (x[i] · scale) · weight[i]` for the whole registers of 16 among `len` values;
/// returns how many it did.
///
/// # Safety
///
/// The AVX-512 level must be available; `x` and `weight` readable and `out` writable for `len`
/// values (`out` may be `x`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn scale_mul(
    x: *const f32,
    scale: f32,
    weight: *const f32,
    out: *mut f32,
    len: usize,
) -> usize {
    let full = len / 16;
    let s = _mm512_set1_ps(scale);
    for c in 0..full {
        // SAFETY: values `16c .. 16c + 16` exist behind every pointer (caller's contract).
        unsafe {
            let v = _mm512_mul_ps(_mm512_loadu_ps(x.add(16 * c)), s);
            let v = _mm512_mul_ps(v, _mm512_loadu_ps(weight.add(16 * c)));
            _mm512_storeu_ps(out.add(16 * c), v);
        }
    }
    16 * full
}

/// Rotates pairs `(a, b) = (x0[i], x1[i])` to `(a·c − b·s, a·s + b·c)` by `cos[i]`, `sin[i]`
/// for the whole registers of 16 among `len` pairs; returns how many it did.
///
/// # Safety
///
/// The AVX-512 level must be available; `x0` and `x1` writable (not overlapping) and `cos`,
/// `sin` readable for `len` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rotate_pairs(
    x0: *mut f32,
    x1: *mut f32,
    cos: *const f32,
    sin: *const f32,
    len: usize,
) -> usize {
    let full = len / 16;
    for i in 0..full {
        // SAFETY: values `16i .. 16i + 16` exist behind every pointer (caller's contract).
        unsafe {
            let (a, b) = (
                _mm512_loadu_ps(x0.add(16 * i)),
                _mm512_loadu_ps(x1.add(16 * i)),
            );
            let (c, s) = (
                _mm512_loadu_ps(cos.add(16 * i)),
                _mm512_loadu_ps(sin.add(16 * i)),
            );
            let first = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s));
            let second = _mm512_add_ps(_mm512_mul_ps(a, s), _mm512_mul_ps(b, c));
            _mm512_storeu_ps(x0.add(16 * i), first);
            _mm512_storeu_ps(x1.add(16 * i), second);
        }
    }
    16 * full
}
