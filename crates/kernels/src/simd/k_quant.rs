//! K-quant weight rows (Q4_K / Q5_K / Q6_K, super-blocks of 256 values) × Q8_K activation
//! rows: the AVX2 and AVX-512 kernels and their safe entry point. The AVX-512 whole-row form
//! ([`avx512::k_quant_row_sums`]) is driven by [`super::row_sums`].
//!
//! AVX2: super-blocks decoded into 32-value registers, `vpmaddubsw` then `vpmaddwd` with the
//! sub-block scales, 8 i32 lanes per row. AVX-512: decoded straight into 64-value registers
//! (scales spread by `vpermw`); `vpdpbusd` (VNNI) forms sums of 4 products, `vpackssdw` narrows
//! them and `vpdpwssd` applies the sub-block scales while accumulating, so a super-block is six
//! multiply instructions per row.

use super::rows::check_simd_call;
#[cfg(target_arch = "x86_64")]
use super::rows::{for_each_weight_row, RowKernel};
use super::{Accumulator, Rows, SimdLevel};
#[cfg(target_arch = "x86_64")]
use crate::{q4_k, q5_k, q6_k};

/// K-quant encodings.
pub(crate) const Q4_K: u8 = 0;
pub(crate) const Q5_K: u8 = 1;
pub(crate) const Q6_K: u8 = 2;

/// Bytes of one super-block of encoding `KIND`.
pub(crate) const fn k_block_bytes(kind: u8) -> usize {
    match kind {
        Q4_K => q4_k::BLOCK_BYTES,
        Q5_K => q5_k::BLOCK_BYTES,
        _ => q6_k::BLOCK_BYTES,
    }
}

/// K-quant weight rows times Q8_K activation rows, accumulated per pair.
pub(crate) fn k_quant_accumulate(
    encoding: crate::k_quants::KEncoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    crate::k_quants::check_sizes(encoding, level, w.len(), x.len());
    check_simd_call(level, &w, &x, acc);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::k_quants::KEncoding as E;
        let kernel: RowKernel<u8> = match (level, encoding) {
            (SimdLevel::Avx2, E::Q4K) => avx2::k_quant_rows::<Q4_K>,
            (SimdLevel::Avx2, E::Q5K) => avx2::k_quant_rows::<Q5_K>,
            (SimdLevel::Avx2, E::Q6K) => avx2::k_quant_rows::<Q6_K>,
            (_, E::Q4K) => avx512::k_quant_rows::<Q4_K>,
            (_, E::Q5K) => avx512::k_quant_rows::<Q5_K>,
            (_, E::Q6K) => avx512::k_quant_rows::<Q6_K>,
        };
        // SAFETY: the level is supported and every weight and activation row hold the same
        // whole number of super-blocks (checked above).
        unsafe { for_each_weight_row(kernel, w, x, acc, prefetch_next) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{k_block_bytes, Q4_K, Q6_K};
    use crate::simd::x86::avx2::{load_lanes8, splat_f16, store_lanes8};
    use crate::simd::x86::{load_f32, row_ptrs};
    use crate::simd::{in_passes, with_row_count, Accumulator, Rows};
    use crate::{k_quants, q8_k};

    /// One K-quant weight super-block decoded for the integer dot products: 256 unsigned quants
    /// in value order (8 registers of 32), the i16 multiplier pattern of each register, the mins
    /// as i16 pairs (for the bsums), and the two f32 scales in every lane (see
    /// [`splat_f16`]: converted as scalars, the compiler merged them into a live register).
    pub(crate) struct DecodedSuperBlock {
        pub(crate) quants: [__m256i; 8],
        /// Per 32 values: the i16 multipliers of the 16 `maddubs` pair sums.
        pub(crate) multipliers: [__m256i; 8],
        /// K-quants with mins (Q4_K, Q5_K): `m_j` in i16 lanes `2j, 2j + 1`, to `madd` with the 16
        /// bsums. Q6_K: the 16 signed scales, to `madd` with the bsums for the `-32` offset.
        pub(crate) bsum_multipliers: __m256i,
        pub(crate) d: __m256,
        /// `dmin` of Q4_K / Q5_K (Q6_K's `-32` offset goes through the bsums instead).
        pub(crate) dmin: __m256,
    }

    /// Broadcasts the i16 `v` to all 16 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn splat16(v: i16) -> __m256i {
        _mm256_set1_epi16(v)
    }

    /// Decodes the Q4_K / Q5_K super-block at `block`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn decode_k_with_mins<const KIND: u8>(block: *const u8) -> DecodedSuperBlock {
        // SAFETY: the caller guarantees a whole super-block at `block`.
        unsafe {
            let header = std::slice::from_raw_parts(block, 16);
            let (scales, mins) = k_quants::unpack_scales_mins(header[4..16].try_into().unwrap());
            let (qs, qh) = match KIND {
                Q4_K => (block.add(16), None),
                _ => (
                    block.add(48),
                    Some(_mm256_loadu_si256(block.add(16).cast())),
                ),
            };
            let nibble = _mm256_set1_epi8(0x0f);
            let mut quants = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let packed = _mm256_loadu_si256(qs.add(32 * c).cast());
                let mut low = _mm256_and_si256(packed, nibble);
                let mut high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble);
                if let Some(qh) = qh {
                    // Bit 2c of qh[l] is the fifth bit of value l of sub-block 2c, bit 2c + 1 of
                    // sub-block 2c + 1.
                    let bit_low = _mm256_set1_epi8(1 << (2 * c));
                    let bit_high = _mm256_set1_epi8(1 << (2 * c + 1));
                    let sixteen = _mm256_set1_epi8(16);
                    let has_low = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_low), bit_low);
                    let has_high = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_high), bit_high);
                    low = _mm256_or_si256(low, _mm256_and_si256(has_low, sixteen));
                    high = _mm256_or_si256(high, _mm256_and_si256(has_high, sixteen));
                }
                quants[2 * c] = low;
                quants[2 * c + 1] = high;
            }
            let multipliers = std::array::from_fn(|j| splat16(i16::from(scales[j])));
            // m_j in i16 lanes 2j and 2j + 1.
            let mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr().cast()));
            let bsum_multipliers = _mm256_set_m128i(
                _mm_unpackhi_epi16(mins16, mins16),
                _mm_unpacklo_epi16(mins16, mins16),
            );
            DecodedSuperBlock {
                quants,
                multipliers,
                bsum_multipliers,
                d: splat_f16(block),
                dmin: splat_f16(block.add(2)),
            }
        }
    }

    /// Decodes the Q6_K super-block at `block`; quants stay unsigned (`q + 32`), the offset is
    /// applied through the bsums.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn decode_q6_k(block: *const u8) -> DecodedSuperBlock {
        // SAFETY: the caller guarantees a whole super-block at `block`.
        unsafe {
            let ql = block;
            let qh = block.add(128);
            let scales = std::slice::from_raw_parts(block.add(192).cast::<i8>(), 16);
            let nibble = _mm256_set1_epi8(0x0f);
            let two_bits = _mm256_set1_epi8(0x30);
            let mut quants = [_mm256_setzero_si256(); 8];
            for half in 0..2 {
                let low_a = _mm256_loadu_si256(ql.add(64 * half).cast()); // values 0..32, 64..96
                let low_b = _mm256_loadu_si256(ql.add(64 * half + 32).cast()); // 32..64, 96..128
                let high = _mm256_loadu_si256(qh.add(32 * half).cast());
                // Bits 2k, 2k + 1 of qh[l] are bits 4, 5 of value l + 32k.
                let h0 = _mm256_and_si256(_mm256_slli_epi16::<4>(high), two_bits);
                let h1 = _mm256_and_si256(_mm256_slli_epi16::<2>(high), two_bits);
                let h2 = _mm256_and_si256(high, two_bits);
                let h3 = _mm256_and_si256(_mm256_srli_epi16::<2>(high), two_bits);
                quants[4 * half] = _mm256_or_si256(_mm256_and_si256(low_a, nibble), h0);
                quants[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(low_b, nibble), h1);
                quants[4 * half + 2] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(low_a), nibble), h2);
                quants[4 * half + 3] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(low_b), nibble), h3);
            }
            // Register k covers groups 2k, 2k + 1 of 16 values: 8 pair sums each, so its
            // multipliers are scale 2k in the low 128-bit lane and scale 2k + 1 in the high one.
            let spread = _mm256_setr_epi8(
                0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, //
                2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
            );
            let multipliers = std::array::from_fn(|k| {
                let pair = (u32::from(scales[2 * k] as i16 as u16))
                    | (u32::from(scales[2 * k + 1] as i16 as u16) << 16);
                _mm256_shuffle_epi8(_mm256_set1_epi32(pair as i32), spread)
            });
            let bsum_multipliers = _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(192).cast()));
            let d = splat_f16(block.add(208));
            DecodedSuperBlock {
                quants,
                multipliers,
                bsum_multipliers,
                d,
                dmin: _mm256_setzero_ps(),
            }
        }
    }

    /// K-quant weight row × Q8_K activation rows. Per row and super-block: the exact integer sums
    /// `Σ scale · Σ q_w · q_x` (8 i32 lanes) and the bsum term (mins for Q4_K / Q5_K, the `-32`
    /// offset for Q6_K), converted to f32 and fused into 8 f32 lanes with `d_x · d` and
    /// `d_x · dmin`, into the row's accumulator lanes.
    ///
    /// # Safety
    ///
    /// AVX2, FMA and F16C must be available; `w` must be whole super-blocks of `KIND` and every
    /// row the same number of Q8_K blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
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

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k_quant_pass<const KIND: u8, const N: usize>(
        w: &[u8],
        rows: Rows<'_, u8>,
        state: &mut [Accumulator],
    ) {
        let blocks = rows.len() / q8_k::BLOCK_BYTES;
        let xp = row_ptrs::<u8, N>(&rows);
        let mut acc: [__m256; N] = std::array::from_fn(|r| load_lanes8(&state[r], 0));
        for b in 0..blocks {
            // SAFETY: super-block `b` lies inside the weight row and every activation row.
            unsafe {
                let block = w.as_ptr().add(b * k_block_bytes(KIND));
                let decoded = match KIND {
                    Q6_K => decode_q6_k(block),
                    _ => decode_k_with_mins::<KIND>(block),
                };
                for r in 0..N {
                    let xb = xp[r].add(b * q8_k::BLOCK_BYTES);
                    let dx = _mm256_set1_ps(load_f32(xb));
                    let xq = xb.add(4);
                    let mut sums = _mm256_setzero_si256();
                    for k in 0..8 {
                        let x = _mm256_loadu_si256(xq.add(32 * k).cast());
                        let pairs = _mm256_maddubs_epi16(decoded.quants[k], x);
                        sums = _mm256_add_epi32(
                            sums,
                            _mm256_madd_epi16(pairs, decoded.multipliers[k]),
                        );
                    }
                    let bsums = _mm256_loadu_si256(xb.add(260).cast());
                    let bsum_term = _mm256_madd_epi16(bsums, decoded.bsum_multipliers);
                    match KIND {
                        Q6_K => {
                            // Σ scale · (q - 32) · x = Σ scale · q · x - 32 · Σ scale · bsum.
                            let exact = _mm256_sub_epi32(sums, _mm256_slli_epi32::<5>(bsum_term));
                            let scale = _mm256_mul_ps(dx, decoded.d);
                            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(exact), acc[r]);
                        }
                        _ => {
                            let scale = _mm256_mul_ps(dx, decoded.d);
                            let min_scale = _mm256_mul_ps(dx, decoded.dmin);
                            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[r]);
                            acc[r] =
                                _mm256_fnmadd_ps(min_scale, _mm256_cvtepi32_ps(bsum_term), acc[r]);
                        }
                    }
                }
            }
        }
        for (s, a) in state.iter_mut().zip(acc) {
            store_lanes8(s, 0, a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    use super::{k_block_bytes, Q4_K, Q6_K};
    use crate::q8_k;
    use crate::simd::x86::avx512::{pass_finish, pass_start, splat_f16, PassOutput};
    use crate::simd::x86::row_ptrs;
    use crate::simd::{in_passes, with_row_count, Accumulator, Rows};

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
    /// `acc -= group_coefficients · (d_x · bsum)`: no broadcast and no integer bsum product per
    /// row.
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
                // ql[64h..64h+64]: low nibbles are values 0..64 of the half, high nibbles
                // 64..128; qh[32h..32h+32]: bits (0,1), (2,3), (4,5), (6,7) top values 0..,
                // 32.., 64.., 96...
                let ql = _mm512_loadu_si512(block.add(64 * half).cast());
                let qh =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(128 + 32 * half).cast()));
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
                _mm512_permutexvar_epi16(
                    lane_pattern(|i| 4 * (2 * m + (i % 8) / 4) + i / 8),
                    scales,
                )
            });
            let d = splat_f16(block.add(208));
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

    /// [`k_quant_rows`] over whole rows (at most [`crate::simd::MAX_ROWS_PER_PASS`] activation
    /// rows): activation row `b`'s dot product with `w` at `out[b * stride]`, reduced in
    /// registers.
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
}
