//! The AVX2 kernels over interleaved groups of 16 weight rows, for CPUs without AVX-512 (most
//! desktop and laptop x86 CPUs): the same group blocks and activation formats as the AVX-512
//! kernels, the same integers and the same f32 steps, so the same bits.
//!
//! A 256-bit register holds half a group: bytes `32h .. 32h + 32` of a 64-byte register line of
//! the layout are 4 bytes of each of weight rows `8h .. 8h + 8`. Without `vpdpbusd`, a word's
//! products come from `vpmaddubsw` (unsigned weight bytes times the broadcast activation word's
//! signed bytes, adjacent pairs summed into i16 lanes), summed over several words in i16 —
//! exactly, as long as the sum fits: a level below 16 times a quant of magnitude at most 128 is
//! at most 3,840 a pair, so 8 words' sums fit (Q4_K, Q4_0, the nibbles of Q8_0), Q5_K's levels
//! below 32 fit 4 words, Q6_K's below 64 two — and then one `vpmaddwd` widens the word pairs
//! of a row's lane to i32, multiplied by the sub-block scale where there is one. Q8_0's bytes
//! (`q + 128`, up to 255, too large for a pair to fit) are split into nibbles, the high
//! nibbles' sum weighed 16.
//!
//! Each register's levels are decoded once for a sweep of [`SWEEP`] activation rows (Q4_K and
//! Q5_K: [`K_QUANT_SWEEP`], both halves of the group on each broadcast word), whose i16 sums
//! stay in registers; a pass of more rows decodes them again per sweep (from L1), and the rows
//! left over go in one sweep of their own constant count. Q6_K's groups, 4 registers a half,
//! are decoded once for all the rows, one half at a time.

use std::arch::x86_64::*;

use super::{for_each_group, prefetch_part, q4k_encoding};
use crate::interleaved::{Encoding, BLOCK32_VALUES, GROUP_ROWS};
use crate::simd::tuning::{tuning, StreamPrefetch};
use crate::simd::{with_row_count, OutRows, Rows};

/// Activation rows one decode of a Q8_0 / Q4_0 register's levels serves: 4 rows' i16 sums (8
/// registers for Q8_0's low and high nibbles) leave the decoded levels and the broadcast word
/// their registers among AVX2's 16.
const SWEEP: usize = 4;

/// [`SWEEP`] for the K-quant kernels, which run both halves of a group on each broadcast word:
/// 2 rows' sums are 8 registers. Measured on a Zen 4 EPYC at `SPECULA_SIMD=avx2` (8 activation
/// rows × eleven 4096² Q4_K matrices from DRAM, 1 / 2 threads, ms): sweeps of 1 / 2 / 3 rows
/// 14.2 / 13.2 / 18.6 and 7.2 / 7.8 / 9.9 (3 spill), one half at a time in sweeps of 4 rows
/// 14.5 and 7.9. Q5_K's levels (~17 instructions a register with its fifth bits) decoded once
/// for all the sweeps of an 8-row pass measured alike (8 rows × nine 4096² matrices, 22.4 /
/// 10.9 against 22.4 / 11.4 ms).
const K_QUANT_SWEEP: usize = 2;

/// Weight rows of a group one 256-bit register holds.
const HALF: usize = GROUP_ROWS / 2;

/// A run of interleaved Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K groups times a pass of activation
/// rows (the contract of the safe entry point, [`super::interleaved_pass`], which checks it).
///
/// # Safety
///
/// AVX2, FMA and F16C are supported; `groups` holds whole groups of `encoding` group blocks,
/// as many per group as each activation row of `x` holds blocks, the last group holding row
/// `valid - 1`; `x` holds at most [`crate::simd::MAX_ROWS_PER_PASS`] rows and `out` as many,
/// each of at least `first + valid` outputs.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn interleaved_pass(
    encoding: Encoding,
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    (first, valid): (usize, usize),
    stream: bool,
) {
    // SAFETY: forwarded contract.
    unsafe {
        match encoding {
            Encoding::Q8_0 if stream => with_row_count!(
                x.count(),
                block32_groups::<Q8_0_BYTES, STREAM>(encoding, groups, x, out, first, valid)
            ),
            Encoding::Q8_0 => with_row_count!(
                x.count(),
                block32_groups::<Q8_0_BYTES, SHORT_RUN>(encoding, groups, x, out, first, valid)
            ),
            Encoding::Q4_0 => with_row_count!(
                x.count(),
                block32_groups::<Q4_0_NIBBLES, STREAM>(encoding, groups, x, out, first, valid)
            ),
            Encoding::Q4K => with_row_count!(
                x.count(),
                q4k_groups::<FOUR_BITS>(groups, x, out, first, valid)
            ),
            Encoding::Q5K => with_row_count!(
                x.count(),
                q4k_groups::<FIVE_BITS>(groups, x, out, first, valid)
            ),
            Encoding::Q6K => {
                with_row_count!(x.count(), q6k_groups(groups, x, out, first, valid))
            }
        }
    }
}

/// Values of [`block32_groups`]'s `Q8`.
const Q8_0_BYTES: bool = true;
const Q4_0_NIBBLES: bool = false;
/// Values of [`block32_groups`]'s `STREAM`: a weight matrix, prefetched ahead; a short run (a
/// Q8_0 cache's keys) whose bytes past its end are not read next.
const STREAM: bool = true;
const SHORT_RUN: bool = false;
/// Values of [`q4k_groups`]' `FIVE`.
const FOUR_BITS: bool = false;
const FIVE_BITS: bool = true;

/// The 4-byte word at `p`, in every lane.
///
/// # Safety
///
/// 4 bytes are readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn broadcast_word(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    _mm256_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// `acc + Σ maddubs(levels, x)`: one `vpmaddubsw` and one `vpaddw`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn add_pairs(acc: __m256i, levels: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi16(acc, _mm256_maddubs_epi16(levels, x))
}

/// Stores each activation row's group results (`acc[h][r]`: half `h`'s 8 lanes of row `r`),
/// lanes `0..valid` of the 16, at `out[r]`.
///
/// # Safety
///
/// Every `out[r]` holds `valid <= 16` outputs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_group<const N: usize>(acc: &[[__m256; N]; 2], out: [*mut f32; N], valid: usize) {
    let index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (h, acc) in acc.iter().enumerate() {
        let lanes = valid.saturating_sub(HALF * h).min(HALF);
        if lanes == 0 {
            continue;
        }
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), index);
        for (acc, out) in acc.iter().zip(out) {
            // SAFETY: lanes `0..lanes` of `out + 8h` lie within the caller's `valid` outputs.
            unsafe { _mm256_maskstore_ps(out.add(HALF * h), mask, *acc) };
        }
    }
}

/// `acc[r] = fma(sums[r], d_w · d_x, acc[r])` for each activation row: the block's one float
/// step, with `d_w` the half's 8 f16 scales at `scales` and `d_x` the f32 at `xb[r] + scale_at`.
///
/// # Safety
///
/// 16 bytes are readable at `scales`, 4 at each `xb[r] + scale_at`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_scaled<const N: usize>(
    acc: &mut [__m256; N],
    sums: &[__m256i; N],
    scales: *const u8,
    xb: [*const u8; N],
    scale_at: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(scales.cast()));
        for ((acc, sums), xb) in acc.iter_mut().zip(sums).zip(xb) {
            let dx = _mm256_set1_ps(xb.add(scale_at).cast::<f32>().read_unaligned());
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*sums), _mm256_mul_ps(dw, dx), *acc);
        }
    }
}

/// Interleaved Q8_0 (`Q8`) or Q4_0 groups times `N` activation rows: every group in one sweep.
///
/// # Safety
///
/// As [`interleaved_pass`], with `x.count() == N`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block32_groups<const Q8: bool, const STREAM: bool, const N: usize>(
    encoding: Encoding,
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    let prefetch = tuning().prefetch;
    // SAFETY: the caller's contract, which `for_each_group` hands on per group.
    unsafe {
        for_each_group::<N>(encoding, groups, x, out, first, valid, |g, b, xp, op, v| {
            block32_rows::<Q8, STREAM, N>(g, b, xp, op, v, prefetch)
        })
    }
}

/// One Q8_0 / Q4_0 group times `N` activation rows. Per block and half, the 8 weight registers'
/// levels: Q4_0's nibbles (`q + 8`), or Q8_0's bytes (`q + 128`) as their low and high nibbles.
/// Per row the words' `vpmaddubsw` sums in i16 (two of them for Q8_0), widened by `vpmaddwd`
/// (the high nibbles' by 16), added to the block's start `-offset · Σ x`: exactly
/// `Σ q_w · q_x`, the AVX-512 kernel's integer; then its fused multiply-add.
///
/// # Safety
///
/// The group and every activation row hold `blocks` blocks; every `out[r]` holds `valid`
/// outputs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block32_rows<const Q8: bool, const STREAM: bool, const N: usize>(
    group: *const u8,
    blocks: usize,
    xp: [*const u8; N],
    out: [*mut f32; N],
    valid: usize,
    prefetch: StreamPrefetch,
) {
    let encoding = if Q8 { Encoding::Q8_0 } else { Encoding::Q4_0 };
    let group_block = encoding.group_block_bytes();
    let act_block = encoding.activation_block_bytes();
    let mut acc = [[_mm256_setzero_ps(); N]; 2];
    for b in 0..blocks {
        // SAFETY: block `b` lies inside the group (32 scale bytes, then 8 (Q8_0) or 4 (Q4_0)
        // registers of 64 bytes) and every activation row (40 bytes: 32 quants, the scale, the
        // start) by the caller's contract.
        unsafe {
            let block = group.add(b * group_block);
            // Every pass prefetches a stream, a single row too (unlike the AVX-512 kernel's:
            // one row of 4096² Q8_0 matrices from DRAM, one thread, 6.30 ms without, 4.17 with).
            if STREAM {
                prefetch_part(
                    encoding,
                    block.wrapping_add(prefetch.block32_ahead),
                    (0, 1),
                    prefetch.into_l2,
                );
            }
            let xb: [*const u8; N] = std::array::from_fn(|r| xp[r].add(b * act_block));
            let quants = block.add(2 * GROUP_ROWS);
            for (h, acc) in acc.iter_mut().enumerate() {
                let quants = quants.add(32 * h);
                let mut sums = [_mm256_setzero_si256(); N];
                // Sweeps of a constant row count (see `q4k_rows`), the rest in one.
                let whole = N / SWEEP * SWEEP;
                for s in (0..whole).step_by(SWEEP) {
                    let rows = std::array::from_fn(|i| xb[s + i]);
                    sums[s..s + SWEEP].copy_from_slice(&block32_sweep::<Q8, SWEEP>(quants, rows));
                }
                let rest = &mut sums[whole..];
                const { assert!(SWEEP == 4, "up to three rows are left after the sweeps") };
                match N - whole {
                    1 => rest.copy_from_slice(&block32_sweep::<Q8, 1>(quants, [xb[whole]])),
                    2 => rest.copy_from_slice(&block32_sweep::<Q8, 2>(
                        quants,
                        std::array::from_fn(|i| xb[whole + i]),
                    )),
                    3 => rest.copy_from_slice(&block32_sweep::<Q8, 3>(
                        quants,
                        std::array::from_fn(|i| xb[whole + i]),
                    )),
                    _ => {}
                }
                add_scaled(acc, &sums, block.add(16 * h), xb, BLOCK32_VALUES);
            }
        }
    }
    // SAFETY: forwarded contract on `out`.
    unsafe { store_group(&acc, out, valid) };
}

/// A Q8_0 (`Q8`) or Q4_0 block's half-group registers (`quants`: the first register's half)
/// times `R` activation blocks `xb`: per row, the words' `vpmaddubsw` sums in i16 (Q8_0: its
/// low nibbles' and high nibbles', both against word `k`; Q4_0: packed register `k`'s low
/// nibbles against word `k`, its high ones against word `k + 4`), widened by `vpmaddwd` (the
/// high nibbles' by 16) and added to the block's start `-offset · Σ x`.
///
/// # Safety
///
/// `quants` is followed by the block's 8 (Q8_0) or 4 (Q4_0) registers, 64 bytes apart; every
/// `xb[i]` is a whole activation block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block32_sweep<const Q8: bool, const R: usize>(
    quants: *const u8,
    xb: [*const u8; R],
) -> [__m256i; R] {
    let low_nibbles = _mm256_set1_epi8(0x0f);
    let mut low = [_mm256_setzero_si256(); R];
    let mut high = [_mm256_setzero_si256(); R];
    // SAFETY: the registers and the activation words read lie inside the blocks (the caller's
    // contract).
    unsafe {
        for k in 0..if Q8 { 8 } else { 4 } {
            let packed = _mm256_loadu_si256(quants.add(64 * k).cast());
            let lo = _mm256_and_si256(packed, low_nibbles);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low_nibbles);
            for ((low, high), xb) in low.iter_mut().zip(&mut high).zip(xb) {
                let word = broadcast_word(xb.add(4 * k));
                *low = add_pairs(*low, lo, word);
                if Q8 {
                    *high = add_pairs(*high, hi, word);
                } else {
                    *low = add_pairs(*low, hi, broadcast_word(xb.add(4 * k + 16)));
                }
            }
        }
        std::array::from_fn(|i| {
            let start = broadcast_word(xb[i].add(BLOCK32_VALUES + 4));
            let sum = _mm256_add_epi32(start, _mm256_madd_epi16(low[i], _mm256_set1_epi16(1)));
            match Q8 {
                true => _mm256_add_epi32(sum, _mm256_madd_epi16(high[i], _mm256_set1_epi16(16))),
                false => sum,
            }
        })
    }
}

/// Interleaved Q4_K (Q5_K when `FIVE`) groups times `N` activation rows: every group in one
/// sweep.
///
/// # Safety
///
/// As [`interleaved_pass`], with `x.count() == N`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_groups<const FIVE: bool, const N: usize>(
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    let encoding = q4k_encoding::<FIVE>();
    let prefetch = tuning().prefetch;
    // SAFETY: the caller's contract, which `for_each_group` hands on per group.
    unsafe {
        for_each_group::<N>(encoding, groups, x, out, first, valid, |g, b, xp, op, v| {
            q4k_rows::<FIVE, N>(g, b, xp, op, v, prefetch)
        })
    }
}

/// One Q4_K (Q5_K) group times `N` activation rows. Per super-block, half and sub-block pair
/// (a chunk of packed nibbles: the low ones sub-block `2c`, the high ones `2c + 1`), each row's
/// `vpmaddubsw` sums of 8 words (4 for Q5_K) in i16, times the rows' `sc_j` by `vpmaddwd` into
/// `isum`; then the mins and the two fused steps ([`Q4kHalfEnds`]).
///
/// # Safety
///
/// The group and every activation row hold `blocks` super-blocks; every `out[r]` holds `valid`
/// outputs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_rows<const FIVE: bool, const N: usize>(
    group: *const u8,
    blocks: usize,
    xp: [*const u8; N],
    out: [*mut f32; N],
    valid: usize,
    prefetch: StreamPrefetch,
) {
    let encoding = q4k_encoding::<FIVE>();
    let group_block = encoding.group_block_bytes();
    let act_block = encoding.activation_block_bytes();
    let mut acc = [[_mm256_setzero_ps(); N]; 2];
    for b in 0..blocks {
        // SAFETY: super-block `b` lies inside the group and every activation row (the caller's
        // contract; the layout in `crate::interleaved`).
        unsafe {
            let block = group.add(b * group_block);
            let ahead = block.wrapping_add(prefetch.k_quant_ahead);
            let xb: [*const u8; N] = std::array::from_fn(|r| xp[r].add(b * act_block));
            let mut isum = [[_mm256_setzero_si256(); 2]; N];
            for c in 0..4 {
                prefetch_part(encoding, ahead, (c, 4), prefetch.into_l2);
                let scales: [[__m256i; 2]; 2] = std::array::from_fn(|h| {
                    [
                        q4k_scale_pairs(block, 2 * c, h),
                        q4k_scale_pairs(block, 2 * c + 1, h),
                    ]
                });
                // Sweeps of a constant row count, so that every sweep's sums stay in
                // registers (a last sweep of `N - s` rows computed at run time did not).
                let mut add = |s: usize, sums: &[[__m256i; 2]]| {
                    for (isum, sums) in isum[s..].iter_mut().zip(sums) {
                        for (isum, sum) in isum.iter_mut().zip(sums) {
                            *isum = _mm256_add_epi32(*isum, *sum);
                        }
                    }
                };
                let whole = N / K_QUANT_SWEEP * K_QUANT_SWEEP;
                for s in (0..whole).step_by(K_QUANT_SWEEP) {
                    let rows = std::array::from_fn(|i| xb[s + i]);
                    add(
                        s,
                        &q4k_chunk::<FIVE, K_QUANT_SWEEP>(block, c, rows, &scales),
                    );
                }
                if whole < N {
                    const { assert!(K_QUANT_SWEEP == 2, "one row is left after the sweeps") };
                    add(whole, &q4k_chunk::<FIVE, 1>(block, c, [xb[whole]], &scales));
                }
            }
            for h in 0..2 {
                let ends = Q4kHalfEnds::load(block, h);
                for r in 0..N {
                    acc[h][r] = ends.accumulate(xb[r], isum[r][h], acc[h][r]);
                }
            }
        }
    }
    // SAFETY: forwarded contract on `out`.
    unsafe { store_group(&acc, out, valid) };
}

/// Chunk `c` (sub-blocks `2c`, `2c + 1`) of a Q4_K (Q5_K) group block times `R` activation
/// rows `xb` (their super-block's start): per row and half, `sc_2c · Σ` plus `sc_2c+1 · Σ` of
/// the rows' `vpmaddubsw` sums of 8 words (4 for Q5_K) in i16, widened by `vpmaddwd`.
///
/// # Safety
///
/// `block` is a whole group block of the encoding and every `xb[i]` a whole activation block;
/// `c < 4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_chunk<const FIVE: bool, const R: usize>(
    block: *const u8,
    c: usize,
    xb: [*const u8; R],
    scales: &[[__m256i; 2]; 2],
) -> [[__m256i; 2]; R] {
    // Words summed in i16 before widening: 8 (Q4_K), 4 (Q5_K), see the module doc.
    let run = if FIVE { 4 } else { 8 };
    let mut isum = [[_mm256_setzero_si256(); 2]; R];
    for first_word in (0..8).step_by(run) {
        // Per row, half, and sub-block of the pair.
        let mut sums = [[[_mm256_setzero_si256(); 2]; 2]; R];
        for k in first_word..first_word + run {
            // SAFETY: word `k` of the chunk and of each row's two sub-blocks (the caller's
            // contract).
            unsafe {
                let levels: [[__m256i; 2]; 2] =
                    std::array::from_fn(|h| q4k_levels::<FIVE>(block, c, k, h));
                for (sums, xb) in sums.iter_mut().zip(xb) {
                    let words = xb.add(64 * c + 4 * k);
                    let x = [broadcast_word(words), broadcast_word(words.add(32))];
                    for (sums, levels) in sums.iter_mut().zip(&levels) {
                        for ((sum, levels), x) in sums.iter_mut().zip(levels).zip(x) {
                            *sum = add_pairs(*sum, *levels, x);
                        }
                    }
                }
            }
        }
        for (isum, sums) in isum.iter_mut().zip(&sums) {
            for ((isum, sums), scales) in isum.iter_mut().zip(sums).zip(scales) {
                let scaled = _mm256_add_epi32(
                    _mm256_madd_epi16(sums[0], scales[0]),
                    _mm256_madd_epi16(sums[1], scales[1]),
                );
                *isum = _mm256_add_epi32(*isum, scaled);
            }
        }
    }
    isum
}

/// Sub-block `j`'s scales of half `h`'s 8 rows as `vpmaddwd` pairs: `sc_j` in both words of
/// each row's lane.
///
/// # Safety
///
/// `block` is a whole Q4_K (Q5_K) group block; `j < 8`, `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_scale_pairs(block: *const u8, j: usize, h: usize) -> __m256i {
    use crate::interleaved::Q4K_SCALES;
    // SAFETY: 8 of the 16 scale bytes of sub-block `j` (the caller's contract).
    let bytes =
        unsafe { _mm_loadl_epi64(block.add(Q4K_SCALES + GROUP_ROWS * j + HALF * h).cast()) };
    let scales = _mm256_cvtepu8_epi32(bytes);
    _mm256_or_si256(scales, _mm256_slli_epi32::<16>(scales))
}

/// Word `k` of chunk `c`'s levels for half `h`'s rows: the low nibbles (sub-block `2c`) and
/// the high ones (`2c + 1`), with Q5_K's fifth bits (16 added where a mask bit is set).
///
/// # Safety
///
/// `block` is a whole group block of the encoding; `c < 4`, `k < 8`, `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_levels<const FIVE: bool>(
    block: *const u8,
    c: usize,
    k: usize,
    h: usize,
) -> [__m256i; 2] {
    use crate::interleaved::{Q4K_QUANTS, Q5K_HIGH};
    let low_nibbles = _mm256_set1_epi8(0x0f);
    // SAFETY: the chunk's register `k` (and Q5_K's masks) lie inside the block.
    unsafe {
        let packed = _mm256_loadu_si256(block.add(Q4K_QUANTS + 512 * c + 64 * k + 32 * h).cast());
        let low = _mm256_and_si256(packed, low_nibbles);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low_nibbles);
        if !FIVE {
            return [low, high];
        }
        let mask = |j: usize| {
            let bits = block
                .add(Q5K_HIGH + 64 * j + 8 * k + 4 * h)
                .cast::<i32>()
                .read_unaligned();
            fifth_bits(bits)
        };
        [
            _mm256_or_si256(low, mask(2 * c)),
            _mm256_or_si256(high, mask(2 * c + 1)),
        ]
    }
}

/// 16 in byte `t` of the register where bit `t` of `bits` is set, else 0 (a Q5_K mask of 8
/// rows × 4 levels, [`crate::interleaved`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fifth_bits(bits: i32) -> __m256i {
    // Byte `t` takes the mask's byte `t / 8` (`vpshufb` works within 128-bit lanes, each of
    // which holds the whole broadcast word), then its bit `t % 8`.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// What half `h` of a Q4_K (Q5_K) group block adds to each activation row's accumulator once
/// its integer sums are known: the mins' part and the two fused steps of the AVX-512 kernel's
/// `Q4kBlockEnds`, 8 lanes at a time.
struct Q4kHalfEnds {
    dw: __m256,
    dmin: __m256,
    mins: [__m256i; 4],
}

impl Q4kHalfEnds {
    /// The half's scales and mins.
    ///
    /// # Safety
    ///
    /// `block` is a whole Q4_K (Q5_K) group block; `h < 2`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load(block: *const u8, h: usize) -> Self {
        use crate::interleaved::{Q4K_DMIN, Q4K_MINS};
        // SAFETY: half `h`'s 8 f16 scales, 8 f16 mins' scales and 4 × 16 bytes of min pairs lie
        // inside the block.
        unsafe {
            Self {
                dw: _mm256_cvtph_ps(_mm_loadu_si128(block.add(16 * h).cast())),
                dmin: _mm256_cvtph_ps(_mm_loadu_si128(block.add(Q4K_DMIN + 16 * h).cast())),
                mins: std::array::from_fn(|p| {
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(
                        block.add(Q4K_MINS + 32 * p + 16 * h).cast(),
                    ))
                }),
            }
        }
    }

    /// `acc` with the half block added for the activation block `xb` whose integer sums
    /// against its 8 weight rows are `isum`.
    ///
    /// # Safety
    ///
    /// `xb` is a whole Q4_K activation block.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn accumulate(&self, xb: *const u8, isum: __m256i, acc: __m256) -> __m256 {
        use crate::interleaved::{Q4K_ACT_SCALE, Q4K_ACT_SUMS};
        // SAFETY: the sums and the scale lie inside the activation block.
        unsafe {
            let sums = xb.add(Q4K_ACT_SUMS);
            let pair = |p: usize| _mm256_madd_epi16(self.mins[p], broadcast_word(sums.add(4 * p)));
            let imin = _mm256_add_epi32(
                _mm256_add_epi32(pair(0), pair(2)),
                _mm256_add_epi32(pair(1), pair(3)),
            );
            let dx = _mm256_set1_ps(xb.add(Q4K_ACT_SCALE).cast::<f32>().read_unaligned());
            let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(self.dw, dx), acc);
            _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(self.dmin, dx), acc)
        }
    }
}

/// Interleaved Q6_K groups times `N` activation rows: every group in one sweep.
///
/// # Safety
///
/// As [`interleaved_pass`], with `x.count() == N`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_groups<const N: usize>(
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    let prefetch = tuning().prefetch;
    // SAFETY: the caller's contract, which `for_each_group` hands on per group.
    unsafe {
        for_each_group::<N>(
            Encoding::Q6K,
            groups,
            x,
            out,
            first,
            valid,
            |g, b, xp, op, v| q6k_rows::<N>(g, b, xp, op, v, prefetch),
        )
    }
}

/// One Q6_K group times `N` activation rows. Per super-block, half and group of 16 values, the
/// 4 weight registers' levels decoded once (low nibble from its plane, high bit pair from the
/// other); per row two pairs of words summed in i16, each pair times the rows' `sc_j` by
/// `vpmaddwd`, and `sc_j` times the activation's start `-32 · Σ x`: exactly the AVX-512 kernel's
/// `sc_j · Σ (q - 32) · q_x`, then its fused multiply-add.
///
/// # Safety
///
/// The group and every activation row hold `blocks` super-blocks; every `out[r]` holds `valid`
/// outputs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6k_rows<const N: usize>(
    group: *const u8,
    blocks: usize,
    xp: [*const u8; N],
    out: [*mut f32; N],
    valid: usize,
    prefetch: StreamPrefetch,
) {
    use crate::interleaved::Q6K_ACT_SCALE;
    let group_block = Encoding::Q6K.group_block_bytes();
    let act_block = Encoding::Q6K.activation_block_bytes();
    let mut acc = [[_mm256_setzero_ps(); N]; 2];
    for b in 0..blocks {
        // SAFETY: super-block `b` lies inside the group (3360 bytes: d, scales, the two planes)
        // and every activation row (324 bytes: 256 quants, the scale, 16 starts) by the
        // caller's contract.
        unsafe {
            let block = group.add(b * group_block);
            let ahead = block.wrapping_add(prefetch.k_quant_ahead);
            let xb: [*const u8; N] = std::array::from_fn(|r| xp[r].add(b * act_block));
            for (h, acc) in acc.iter_mut().enumerate() {
                let mut isum = [_mm256_setzero_si256(); N];
                for quad in 0..4 {
                    prefetch_part(Encoding::Q6K, ahead, (4 * h + quad, 8), prefetch.into_l2);
                    // A group's place in its quad picks its nibbles and bit pair: constants.
                    q6k_group::<0, N>(block, 4 * quad, h, xb, &mut isum);
                    q6k_group::<1, N>(block, 4 * quad + 1, h, xb, &mut isum);
                    q6k_group::<2, N>(block, 4 * quad + 2, h, xb, &mut isum);
                    q6k_group::<3, N>(block, 4 * quad + 3, h, xb, &mut isum);
                }
                add_scaled(acc, &isum, block.add(16 * h), xb, Q6K_ACT_SCALE);
            }
        }
    }
    // SAFETY: forwarded contract on `out`.
    unsafe { store_group(&acc, out, valid) };
}

/// Q6_K group `j` (`j % 4 == M`) of half `h`: its 4 registers' levels decoded (low nibble from
/// its plane, high bit pair from the other), then for each activation row `xb[r]` two pairs of
/// words summed in i16, each pair times the rows' `sc_j` by `vpmaddwd`, plus `sc_j` times the
/// activation's start, added to `isum[r]`.
///
/// # Safety
///
/// `block` is a whole Q6_K group block and every `xb[r]` a whole activation block; `j < 16`,
/// `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6k_group<const M: usize, const N: usize>(
    block: *const u8,
    j: usize,
    h: usize,
    xb: [*const u8; N],
    isum: &mut [__m256i; N],
) {
    use crate::interleaved::{Q6K_ACT_STARTS, Q6K_HIGH, Q6K_LOW, Q6K_SCALES};
    let low_nibbles = _mm256_set1_epi8(0x0f);
    let high_pair = _mm256_set1_epi8(0x30);
    // SAFETY: the group's registers in both planes, its scales and the activation's words and
    // start lie inside the blocks (the caller's contract).
    unsafe {
        let low = block.add(Q6K_LOW + 256 * (j / 2) + 32 * h);
        let high = block.add(Q6K_HIGH + 256 * (j / 4) + 32 * h);
        let w: [__m256i; 4] = std::array::from_fn(|k| {
            let l = _mm256_loadu_si256(low.add(64 * k).cast());
            let l = match M % 2 {
                0 => _mm256_and_si256(l, low_nibbles),
                _ => _mm256_and_si256(_mm256_srli_epi16::<4>(l), low_nibbles),
            };
            // Bits 2m, 2m + 1 of each byte to bits 4, 5 (the 16-bit shifts carry bits across
            // bytes only outside the mask).
            let hb = _mm256_loadu_si256(high.add(64 * k).cast());
            let hb = match M {
                0 => _mm256_slli_epi16::<4>(hb),
                1 => _mm256_slli_epi16::<2>(hb),
                2 => hb,
                _ => _mm256_srli_epi16::<2>(hb),
            };
            _mm256_or_si256(l, _mm256_and_si256(hb, high_pair))
        });
        let scales = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
            block.add(Q6K_SCALES + GROUP_ROWS * j + HALF * h).cast(),
        ));
        // `sc_j` in both words of a lane (sign-extended to i32, its low word is `sc_j`).
        let scale_pairs =
            _mm256_blend_epi16::<0b1010_1010>(scales, _mm256_slli_epi32::<16>(scales));
        for r in 0..N {
            let words = xb[r].add(16 * j);
            let first = add_pairs(
                _mm256_maddubs_epi16(w[0], broadcast_word(words)),
                w[1],
                broadcast_word(words.add(4)),
            );
            let second = add_pairs(
                _mm256_maddubs_epi16(w[2], broadcast_word(words.add(8))),
                w[3],
                broadcast_word(words.add(12)),
            );
            let start = broadcast_word(xb[r].add(Q6K_ACT_STARTS + 4 * j));
            let sub = _mm256_add_epi32(
                _mm256_mullo_epi32(start, scales),
                _mm256_add_epi32(
                    _mm256_madd_epi16(first, scale_pairs),
                    _mm256_madd_epi16(second, scale_pairs),
                ),
            );
            isum[r] = _mm256_add_epi32(isum[r], sub);
        }
    }
}
