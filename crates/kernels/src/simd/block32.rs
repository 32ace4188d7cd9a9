//! Q8_0 / Q4_0 weight rows (blocks of 32 values) × Q8_0 activation rows: the AVX2 and AVX-512
//! kernels and their safe entry point. The AVX-512 whole-row form ([`avx512::block32_row_sums`])
//! is driven by [`super::row_sums`].
//!
//! AVX2: per row and block the exact integer dot of the 32 quant pairs in 8 i32 lanes, two
//! blocks summed before they meet the accumulator. AVX-512: two blocks per zmm, `vpdpbusd`
//! (VNNI) forms each block's integer dot; an odd last block goes through the AVX2 decoder
//! (AVX-512 implies the AVX2 set this crate asks for).

use super::rows::check_simd_call;
#[cfg(target_arch = "x86_64")]
use super::rows::{for_each_weight_row, RowKernel};
use super::{Accumulator, Rows, SimdLevel};

/// 32-value block weight encodings.
pub(crate) const Q8_0: u8 = 0;
pub(crate) const Q4_0: u8 = 1;

/// Q8_0 / Q4_0 weight rows (runs of blocks starting at an even block of the row) times widened
/// Q8_0 activation rows, accumulated per pair.
pub(crate) fn block32_accumulate(
    encoding: crate::q8_0::Block32Encoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    crate::q8_0::check_block32_sizes(encoding, level, w.len(), x.len());
    check_simd_call(level, &w, &x, acc);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::q8_0::Block32Encoding as E;
        let kernel: RowKernel<u8> = match (level, encoding) {
            (SimdLevel::Avx2, E::Q8_0) => avx2::block32_rows::<Q8_0>,
            (SimdLevel::Avx2, E::Q4_0) => avx2::block32_rows::<Q4_0>,
            (_, E::Q8_0) => avx512::block32_rows::<Q8_0>,
            (_, E::Q4_0) => avx512::block32_rows::<Q4_0>,
        };
        // SAFETY: the level is supported and every weight and activation row hold the same
        // whole number of blocks (checked above).
        unsafe { for_each_weight_row(kernel, w, x, acc, prefetch_next) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Q8_0;
    use crate::simd::x86::avx2::{load_lanes8, splat_f16, store_lanes8};
    use crate::simd::x86::{load_f32, row_ptrs};
    use crate::simd::{in_passes, with_row_count, Accumulator, Rows};
    use crate::{q4_0, q8_0};

    /// Decodes weight block `b` of encoding `KIND`: its 32 signed quants and its scale (in every
    /// lane).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn decode_block32<const KIND: u8>(
        w: *const u8,
        b: usize,
    ) -> (__m256i, __m256) {
        // SAFETY: the caller guarantees block `b` lies inside the weight row.
        unsafe {
            match KIND {
                Q8_0 => {
                    let block = w.add(b * q8_0::BLOCK_BYTES);
                    (_mm256_loadu_si256(block.add(2).cast()), splat_f16(block))
                }
                _ => {
                    let block = w.add(b * q4_0::BLOCK_BYTES);
                    let packed = _mm_loadu_si128(block.add(2).cast());
                    let nibble = _mm_set1_epi8(0x0f);
                    let low = _mm_and_si128(packed, nibble);
                    let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), nibble);
                    let q = _mm256_set_m128i(high, low);
                    (_mm256_sub_epi8(q, _mm256_set1_epi8(8)), splat_f16(block))
                }
            }
        }
    }

    /// Q8_0 / Q4_0 weight row × Q8_0 activation rows. Per row and block: the exact integer dot of
    /// the 32 quant pairs in 8 i32 lanes, converted to f32 and multiplied by `d_w · d_x`; two
    /// consecutive blocks are summed (`fma(s1, f1, s0 · f0)`) and then added to the row's 8
    /// accumulator lanes (an odd last block is fused in alone).
    ///
    /// Activation rows are widened Q8_0 blocks ([`q8_0::widen_row`]: f32 scale, 32 quants).
    ///
    /// # Safety
    ///
    /// AVX2, FMA and F16C must be available; `w` and every row must be the same whole number of
    /// blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
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

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block32_pass<const KIND: u8, const N: usize>(
        w: &[u8],
        rows: Rows<'_, u8>,
        state: &mut [Accumulator],
    ) {
        let blocks = rows.len() / q8_0::AVX2_WIDE_BLOCK_BYTES;
        let xp = row_ptrs::<u8, N>(&rows);
        let ones = _mm256_set1_epi16(1);
        // Block `b` of row `r`: (scale d_w · d_x, exact integer dot as f32), 8 lanes each.
        let term = |wq: __m256i, w_abs: __m256i, dw: __m256, xb: *const u8| {
            // SAFETY: `xb` is a whole widened Q8_0 block of an activation row.
            unsafe {
                let xq = _mm256_loadu_si256(xb.add(4).cast());
                // |w| · (x with w's sign) = w · x; pair sums stay below 2 · 128 · 127.
                let pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xq, wq));
                let sums = _mm256_madd_epi16(pairs, ones);
                let dx = _mm256_set1_ps(load_f32(xb));
                (_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sums))
            }
        };
        let mut acc: [__m256; N] = std::array::from_fn(|r| load_lanes8(&state[r], 0));
        // Blocks go in pairs, summed before they meet the accumulator (half the dependency chain);
        // an odd last block is fused alone. Callers tile rows at even blocks, so pairs never
        // straddle a tile boundary.
        let mut b = 0;
        while b + 1 < blocks {
            // SAFETY: blocks `b`, `b + 1` lie inside the weight row and every activation row.
            unsafe {
                let (wq0, dw0) = decode_block32::<KIND>(w.as_ptr(), b);
                let (wq1, dw1) = decode_block32::<KIND>(w.as_ptr(), b + 1);
                let (abs0, abs1) = (_mm256_sign_epi8(wq0, wq0), _mm256_sign_epi8(wq1, wq1));
                for r in 0..N {
                    let xb = xp[r].add(b * q8_0::AVX2_WIDE_BLOCK_BYTES);
                    let (s0, f0) = term(wq0, abs0, dw0, xb);
                    let (s1, f1) = term(wq1, abs1, dw1, xb.add(q8_0::AVX2_WIDE_BLOCK_BYTES));
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
                    let (s, f) = term(wq, w_abs, dw, xp[r].add(b * q8_0::AVX2_WIDE_BLOCK_BYTES));
                    acc[r] = _mm256_fmadd_ps(s, f, acc[r]);
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

    use super::avx2::decode_block32;
    use super::Q8_0;
    use crate::q8_0;
    use crate::simd::x86::avx512::{pass_finish, pass_start, PassOutput};
    use crate::simd::x86::row_ptrs;
    use crate::simd::{in_passes, with_row_count, Accumulator, Rows};

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

    /// [`block32_rows`] over whole rows (at most [`crate::simd::MAX_ROWS_PER_PASS`] activation
    /// rows): activation row `b`'s dot product with `w` at `out[b * stride]`, reduced in
    /// registers.
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
                    let shifted =
                        _mm512_srlv_epi64(spread, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
                    let nibbles = _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
                    _mm512_sub_epi8(nibbles, _mm512_set1_epi8(8))
                }
            };
            (quants, scales)
        }
    }

    /// Joins two 256-bit halves into one zmm (`low` in lanes 0..8 of i32, `high` above).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn join(low: __m256i, high: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
    }
}
