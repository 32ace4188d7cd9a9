//! AVX-512 (F, BW, VL, VNNI) kernels.
//!
//! Same structure and contract as [`super::avx2`]: multi-input kernels that read a weight row
//! once per pass of up to [`super::MAX_ROWS_PER_PASS`] activation rows, with per-row
//! accumulators updated by a fixed instruction sequence, so that a row's result does not
//! depend on the other rows of the pass. The differences from AVX2:
//!
//! - float family: 32 lanes per row (two zmm registers), masked loads for the tail;
//! - 32-value blocks: `vpdpbusd` (VNNI) forms the block's integer dot in one instruction;
//! - K-quants: 64 values per register, `vpmaddubsw` then `vpdpwssd` (VNNI) applies the
//!   sub-block scales while accumulating, so a super-block is 8 instructions per row.
//!
//! Weight decoding is shared with the AVX2 module (its functions run here too: AVX-512 implies
//! the AVX2 set this crate asks for).

use std::arch::x86_64::*;

use super::avx2::{
    decode_block32, decode_k_with_mins, decode_q6_k, float_size, k_block_bytes, load_f32,
    load_lanes8, row_ptrs, splat_f16, store_lanes8, DecodedSuperBlock, F16, F32, Q6_K,
};
use super::{in_passes, with_row_count, Accumulator, Rows};
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
    let mut i = 0;
    while i < len {
        let count = (len - i).min(16);
        let mask = if count == 16 {
            0xffff
        } else {
            (1u16 << count) - 1
        };
        // SAFETY: `count` elements from `i` exist in both slices; masked lanes are untouched.
        unsafe {
            let yp = y.as_mut_ptr().add(i);
            let v = _mm512_fmadd_ps(
                av,
                _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i)),
                _mm512_maskz_loadu_ps(mask, yp),
            );
            _mm512_mask_storeu_ps(yp, mask, v);
        }
        i += 16;
    }
}

// ---------------------------------------------------------------------------------------------
// Q8_0 / Q4_0 weights × Q8_0 activations (blocks of 32)
// ---------------------------------------------------------------------------------------------

/// Q8_0 / Q4_0 weight row × Q8_0 activation rows: as the AVX2 kernel (blocks in pairs), with
/// the block's integer dot formed by one `vpdpbusd` (`|w|` unsigned × `x` carrying `w`'s sign).
///
/// # Safety
///
/// The AVX-512 level must be available; `w` and every row must be the same whole number of
/// blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn block32_rows<const KIND: u8>(
    w: &[u8],
    rows: Rows<'_, u8>,
    acc: &mut [Accumulator],
) {
    in_passes(rows, acc, |group, group_acc| {
        // SAFETY: forwarded contract.
        unsafe { with_row_count!(group_acc.len(), block32_pass::<KIND>(w, group, group_acc)) }
    });
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block32_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, u8>,
    state: &mut [Accumulator],
) {
    let blocks = rows.len() / q8_0::BLOCK_BYTES;
    let xp = row_ptrs::<u8, N>(&rows);
    // Block `b` of row `r`: (scale d_w · d_x, exact integer dot as f32), 8 lanes each.
    let term = |wq: __m256i, w_abs: __m256i, dw: __m256, xb: *const u8| {
        // SAFETY: `xb` is a whole Q8_0 block of an activation row.
        unsafe {
            let xq = _mm256_loadu_si256(xb.add(2).cast());
            let signed_x = _mm256_sign_epi8(xq, wq);
            let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, signed_x);
            (_mm256_mul_ps(dw, splat_f16(xb)), _mm256_cvtepi32_ps(sums))
        }
    };
    let mut acc: [__m256; N] = std::array::from_fn(|r| load_lanes8(&state[r], 0));
    // Pairs of blocks as in the AVX2 kernel.
    let mut b = 0;
    while b + 1 < blocks {
        // SAFETY: blocks `b`, `b + 1` lie inside the weight row and every activation row.
        unsafe {
            let (wq0, dw0) = decode_block32::<KIND>(w.as_ptr(), b);
            let (wq1, dw1) = decode_block32::<KIND>(w.as_ptr(), b + 1);
            let (abs0, abs1) = (_mm256_sign_epi8(wq0, wq0), _mm256_sign_epi8(wq1, wq1));
            for r in 0..N {
                let xb = xp[r].add(b * q8_0::BLOCK_BYTES);
                let (s0, f0) = term(wq0, abs0, dw0, xb);
                let (s1, f1) = term(wq1, abs1, dw1, xb.add(q8_0::BLOCK_BYTES));
                let pair = _mm256_fmadd_ps(s1, f1, _mm256_mul_ps(s0, f0));
                acc[r] = _mm256_add_ps(acc[r], pair);
            }
        }
        b += 2;
    }
    if b < blocks {
        // SAFETY: block `b` lies inside the weight row and every activation row.
        unsafe {
            let (wq, dw) = decode_block32::<KIND>(w.as_ptr(), b);
            let w_abs = _mm256_sign_epi8(wq, wq);
            for r in 0..N {
                let (s, f) = term(wq, w_abs, dw, xp[r].add(b * q8_0::BLOCK_BYTES));
                acc[r] = _mm256_fmadd_ps(s, f, acc[r]);
            }
        }
    }
    for (s, a) in state.iter_mut().zip(acc) {
        store_lanes8(s, 0, a);
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

/// A decoded super-block regrouped into 64-value registers.
struct WideSuperBlock {
    quants: [__m512i; 4],
    multipliers: [__m512i; 4],
    narrow: DecodedSuperBlock,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn widen(narrow: DecodedSuperBlock) -> WideSuperBlock {
    WideSuperBlock {
        quants: std::array::from_fn(|k| join(narrow.quants[2 * k], narrow.quants[2 * k + 1])),
        multipliers: std::array::from_fn(|k| {
            join(narrow.multipliers[2 * k], narrow.multipliers[2 * k + 1])
        }),
        narrow,
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
        unsafe { with_row_count!(group_acc.len(), k_quant_pass::<KIND>(w, group, group_acc)) }
    });
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_quant_pass<const KIND: u8, const N: usize>(
    w: &[u8],
    rows: Rows<'_, u8>,
    state: &mut [Accumulator],
) {
    let blocks = rows.len() / q8_k::BLOCK_BYTES;
    let xp = row_ptrs::<u8, N>(&rows);
    let mut acc: [__m512; N] = std::array::from_fn(|r| load_lanes16(&state[r], 0));
    for b in 0..blocks {
        // SAFETY: super-block `b` lies inside the weight row and every activation row.
        unsafe {
            let block = w.as_ptr().add(b * k_block_bytes(KIND));
            let decoded = widen(match KIND {
                Q6_K => decode_q6_k(block),
                _ => decode_k_with_mins::<KIND>(block),
            });
            for r in 0..N {
                let xb = xp[r].add(b * q8_k::BLOCK_BYTES);
                let dx = load_f32(xb);
                let xq = xb.add(4);
                let mut sums = _mm512_setzero_si512();
                for k in 0..4 {
                    let x = _mm512_loadu_si512(xq.add(64 * k).cast());
                    let pairs = _mm512_maddubs_epi16(decoded.quants[k], x);
                    sums = _mm512_dpwssd_epi32(sums, pairs, decoded.multipliers[k]);
                }
                let bsums = _mm256_loadu_si256(xb.add(260).cast());
                let bsum_term = _mm512_zextsi256_si512(_mm256_madd_epi16(
                    bsums,
                    decoded.narrow.bsum_multipliers,
                ));
                let scale = _mm512_set1_ps(dx * decoded.narrow.d);
                match KIND {
                    Q6_K => {
                        let exact = _mm512_sub_epi32(sums, _mm512_slli_epi32::<5>(bsum_term));
                        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(exact), acc[r]);
                    }
                    _ => {
                        let min_scale = _mm512_set1_ps(dx * decoded.narrow.dmin);
                        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[r]);
                        acc[r] = _mm512_fnmadd_ps(min_scale, _mm512_cvtepi32_ps(bsum_term), acc[r]);
                    }
                }
            }
        }
    }
    for (s, a) in state.iter_mut().zip(acc) {
        store_lanes16(s, 0, a);
    }
}
