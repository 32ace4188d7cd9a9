//! Interleaved groups of 16 weight rows ([`crate::interleaved`]) × a pass of activation rows:
//! the AVX-512 kernels (Q8_0 / Q4_0 × Q8_0, Q4_K / Q5_K / Q6_K × Q8_K), the AVX2 ones
//! (`avx2`: the same groups, integers and bits, summed by `vpmaddubsw`),
//! the AMX kernels (Q8_0 × Q8_0, passes of [`AMX_STREAM_MIN_ROWS`] rows or more over a weight
//! matrix, [`AMX_MIN_ROWS`] over cached keys; Q4_K / Q5_K × Q8_K,
//! passes of [`AMX_K_QUANT_MIN_ROWS`] or more) and their safe entry point. Each block is
//! reduced inside `vpdpbusd` (or `tdpbsud`, or AVX2's `vpmaddubsw` sums) for the 16 weight rows
//! at once.

#[cfg(target_arch = "x86_64")]
use super::block32::{Q4_0, Q8_0};
#[cfg(target_arch = "x86_64")]
use super::Rows;
use super::{OutRows, SimdLevel};

/// The fewest activation rows a pass over interleaved Q8_0 weights runs on AMX tiles (at
/// [`SimdLevel::Amx`]) when the weights are a short run read from the cache (a Q8_0 KV cache's
/// keys); fewer go through `vpdpbusd`, faster there (2 rows: 42 against 59 TSC ticks per block
/// of 16 weight rows; 4 rows: 75 against 69).
pub(crate) const AMX_MIN_ROWS: usize = 4;

/// [`AMX_MIN_ROWS`] for a weight matrix streamed from memory: more than
/// [`crate::simd::MAX_ROWS_PER_PASS`] (measured when the AVX-512 kernel took no more in one
/// pass; it now takes up to [`crate::simd::MAX_Q8_0_PASS_ROWS`], not yet measured against the
/// tiles). Up to that, the AVX-512 pass keeps up with the memory while the tiles' store-and-reload of every block's sums does not (qwen3-0.6b Q8_0,
/// Emerald Rapids Xeon, 2 threads, the kernels taking turns pass by pass in one process, ms per
/// forward pass, tiles against `vpdpbusd`: 4 rows 46.9 / 39.2 and 35.6 / 32.4, 8 rows 52.9 /
/// 47.4 and 49.6 / 44.3); beyond it the tiles read the weights once where `vpdpbusd` needs two
/// passes (12 rows 57.2 against 68.7, 16 rows 73.6 against 84.5).
pub(crate) const AMX_STREAM_MIN_ROWS: usize = crate::simd::MAX_ROWS_PER_PASS + 1;

/// The fewest activation rows a pass over interleaved Q4_K / Q5_K weights runs on AMX tiles:
/// more than the AVX-512 kernel takes in one pass ([`crate::simd::MAX_ROWS_PER_PASS`]), whose
/// weights the tiles then read once instead of twice. Each group block's products are built
/// once per pass whatever its rows (~180 TSC ticks for 16 weight rows), where `vpdpbusd`
/// costs ~55 per activation row. From the cache the tiles pass `vpdpbusd` at 6 rows (1024 ×
/// 4096 Q4_K from L3, one thread, Emerald Rapids Xeon, the best of 500 passes taking turns,
/// thousands of TSC ticks, AVX-512 against AMX: 4 rows 305 / 339, 6 403 / 358, 8 524 / 413,
/// 9 675 / 417, 16 975 / 533), but in a model's forward pass, streaming from memory, 6- to
/// 8-row passes were slower on tiles (qwen3-0.6b Q4_K, cost(8) 1.81–2.33 against 1.58–1.71):
/// the tiles' phase issues no prefetches and overlaps the vector work poorly.
pub(crate) const AMX_K_QUANT_MIN_ROWS: usize = crate::simd::MAX_ROWS_PER_PASS + 1;

/// A run of interleaved groups of 16 weight rows times a pass of activation rows at `level`
/// (AVX2, AVX-512 or AMX; [`crate::interleaved::groups_pass`]), after checking every size the
/// kernel indexes by. Every level's kernel gives the same bits.
///
/// `stream`: the run is a long stream (a weight matrix), whose multi-row passes prefetch a
/// fixed distance ahead (Q8_0 ones from
/// [`q8_0_min_rows`](crate::simd::tuning::StreamPrefetch::q8_0_min_rows) rows); off for a
/// short run (a cache block of Q8_0 keys) whose bytes past its end are not read next.
pub(crate) fn interleaved_pass(
    encoding: crate::interleaved::Encoding,
    level: SimdLevel,
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    (first, valid): (usize, usize),
    stream: bool,
) {
    assert!(
        level >= SimdLevel::Avx2,
        "interleaved: an AVX2, AVX-512 or AMX pass"
    );
    level.assert_supported();
    crate::interleaved::check_pass_sizes(encoding, level, groups, &x, out, first, valid);
    if x.count() == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx2 {
            // SAFETY: AVX2 is supported, and every size the kernel relies on is checked above.
            unsafe { avx2::interleaved_pass(encoding, groups, x, out, (first, valid), stream) };
            return;
        }
        use crate::interleaved::Encoding as E;
        type Kernel = unsafe fn(&[u8], Rows<'_, u8>, &mut OutRows<'_>, usize, usize);
        let tile_rows = if stream {
            AMX_STREAM_MIN_ROWS
        } else {
            AMX_MIN_ROWS
        };
        let tiles = level == SimdLevel::Amx && x.count() >= tile_rows;
        let k_quant_tiles = level == SimdLevel::Amx && x.count() >= AMX_K_QUANT_MIN_ROWS;
        let kernel: Kernel = match encoding {
            E::Q8_0 if tiles && stream => amx::q8_0_pass::<true>,
            E::Q8_0 if tiles => amx::q8_0_pass::<false>,
            E::Q8_0 if stream => avx512::interleaved_pass::<Q8_0, true>,
            E::Q8_0 => avx512::interleaved_pass::<Q8_0, false>,
            E::Q4_0 => avx512::interleaved_pass::<Q4_0, true>,
            E::Q4K if k_quant_tiles => amx::q4k_pass::<false>,
            E::Q5K if k_quant_tiles => amx::q4k_pass::<true>,
            E::Q4K => avx512::interleaved_q4k_pass::<false>,
            E::Q5K => avx512::interleaved_q4k_pass::<true>,
            E::Q6K => avx512::interleaved_q6k_pass,
        };
        // SAFETY: the level is supported (AMX tiles granted where it is `Amx`), and every size
        // the kernel relies on is checked above.
        unsafe { kernel(groups, x, out, first, valid) }
    }
}

/// Runs `rows` over each 16-row group of a run of `encoding` group blocks (`groups`) times
/// `N` activation rows (`x`): with the group's first block, its blocks per row, the
/// activation rows, the output rows advanced to the group's first weight row, and how many
/// of its rows are valid — every group in one call, no argument round trip through memory
/// between groups.
///
/// # Safety
///
/// The sizes [`crate::interleaved::check_pass_sizes`] checks hold for the pass, with
/// `x.count() == N`; `rows` may then read the group's blocks and every activation row, and
/// write its valid outputs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn for_each_group<const N: usize>(
    encoding: crate::interleaved::Encoding,
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
    mut rows: impl FnMut(*const u8, usize, [*const u8; N], [*mut f32; N], usize),
) {
    use crate::interleaved::GROUP_ROWS;
    use crate::simd::x86::row_ptrs;
    let blocks = x.len() / encoding.activation_block_bytes();
    let group_bytes = blocks * encoding.group_block_bytes();
    let xp = row_ptrs::<u8, N>(&x);
    let op = out.ptrs::<N>();
    for (g, group) in groups.chunks_exact(group_bytes).enumerate() {
        let offset = first + g * GROUP_ROWS;
        // SAFETY: the caller's contract: group `g`'s outputs start at `offset` in every row.
        let op = op.map(|p| unsafe { p.add(offset) });
        rows(
            group.as_ptr(),
            blocks,
            xp,
            op,
            GROUP_ROWS.min(valid - g * GROUP_ROWS),
        );
    }
}

/// Prefetches part `j` of `parts` of the `encoding` group block at `ahead`, into L2 when
/// `into_l2`, else into L1. A K-quant pass spreads a block's prefetches over its
/// sub-blocks rather than issuing them in one burst, which keeps the stream up far better
/// (a 0.6B Q4_K model's forward pass, alternating in one process: k = 1 from 13.299 /
/// 12.713 / 11.603 ms to 10.688 / 10.243 / 8.393 in three runs, k = 4 from 13.189 / 13.109
/// to 12.114 / 11.979).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse")]
#[inline]
fn prefetch_part(
    encoding: crate::interleaved::Encoding,
    ahead: *const u8,
    (j, parts): (usize, usize),
    into_l2: bool,
) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    let lines = encoding.group_block_bytes().div_ceil(64);
    for line in j * lines / parts..(j + 1) * lines / parts {
        // A prefetch never faults, so the address may run past the matrix.
        let at = ahead.wrapping_add(64 * line).cast::<i8>();
        match into_l2 {
            true => _mm_prefetch::<_MM_HINT_T1>(at),
            false => _mm_prefetch::<_MM_HINT_T0>(at),
        }
    }
}

/// The encoding the Q4_K kernel multiplies: Q5_K when `FIVE`.
#[cfg(target_arch = "x86_64")]
const fn q4k_encoding<const FIVE: bool>() -> crate::interleaved::Encoding {
    match FIVE {
        true => crate::interleaved::Encoding::Q5K,
        false => crate::interleaved::Encoding::Q4K,
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{for_each_group, prefetch_part, q4k_encoding, Q8_0};
    use crate::simd::tuning::{tuning, StreamPrefetch};
    use crate::simd::x86::avx512::prefetch_block;
    use crate::simd::{with_row_count, OutRows, Rows};

    /// A run of interleaved Q8_0 / Q4_0 groups of 16 weight rows ([`crate::interleaved`]) times a
    /// pass of activation rows in the interleaved activation format: the product of the run's
    /// weight row `i < valid` and activation row `b` at `out.row(b)[first + i]`.
    ///
    /// # Safety
    ///
    /// AVX-512 is supported; `groups` holds whole groups of `x.len() / 40` group blocks of
    /// encoding `KIND`, the last of which holds row `valid - 1`; `x` holds at most
    /// [`crate::simd::MAX_Q8_0_PASS_ROWS`] (Q8_0) or [`crate::simd::MAX_ROWS_PER_PASS`] (Q4_0)
    /// rows of whole activation blocks and `out` as many rows, each of at least
    /// `first + valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn interleaved_pass<const KIND: u8, const STREAM: bool>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            // Up to 16 rows: Q4_0 passes never exceed 8 (`pass_rows`, checked by the caller).
            with_row_count!(
                wide: x.count(),
                interleaved_groups::<KIND, STREAM>(groups, x, out, first, valid)
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
    unsafe fn interleaved_groups<const KIND: u8, const STREAM: bool, const N: usize>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        let encoding = match KIND {
            Q8_0 => crate::interleaved::Encoding::Q8_0,
            _ => crate::interleaved::Encoding::Q4_0,
        };
        let prefetch = tuning().prefetch;
        // SAFETY: the caller's contract, which `for_each_group` hands on per group.
        unsafe {
            for_each_group::<N>(encoding, groups, x, out, first, valid, |g, b, xp, op, v| {
                interleaved_rows::<KIND, STREAM, N>(g, b, xp, op, v, prefetch)
            })
        }
    }

    /// Stores lanes `0..valid` of row `r`'s 16 results at `out[r]`.
    ///
    /// # Safety
    ///
    /// Every `out[r]` holds `valid <= 16` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn store_group_results<const N: usize>(
        acc: &[__m512; N],
        out: [*mut f32; N],
        valid: usize,
    ) {
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
    unsafe fn interleaved_rows<const KIND: u8, const STREAM: bool, const N: usize>(
        group: *const u8,
        blocks: usize,
        xp: [*const u8; N],
        out: [*mut f32; N],
        valid: usize,
        prefetch: StreamPrefetch,
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
        // Q4_0 passes keep the first rule: every pass of several rows.
        let prefetching = STREAM
            && match KIND {
                Q8_0 => N >= prefetch.q8_0_min_rows,
                _ => N > 1,
            };
        for b in 0..blocks {
            // SAFETY: block `b` lies inside the group and every activation row (caller's contract):
            // 32 scale bytes then 8 (Q8_0) or 4 (Q4_0) registers of quants; 40 activation bytes.
            unsafe {
                let block = group.add(b * group_block);
                if prefetching {
                    let ahead = block.wrapping_add(prefetch.block32_ahead);
                    prefetch_block(ahead, group_block, prefetch.into_l2);
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
                let words: [*const i32; N] =
                    std::array::from_fn(|r| xp[r].add(b * act_block).cast::<i32>());
                let starts = std::array::from_fn(|r| {
                    _mm512_set1_epi32(words[r].add(BLOCK32_VALUES / 4 + 1).read_unaligned())
                });
                let sums = if N > crate::simd::MAX_ROWS_PER_PASS {
                    row_chain::<N>(&w, words, starts)
                } else {
                    let (even, odd) = row_chains::<N>(&w, words, starts);
                    std::array::from_fn(|r| _mm512_add_epi32(even[r], odd[r]))
                };
                for r in 0..N {
                    let xb = xp[r].add(b * act_block);
                    let sums = sums[r];
                    let dx = _mm512_set1_ps(xb.add(BLOCK32_VALUES).cast::<f32>().read_unaligned());
                    acc[r] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, dx), acc[r]);
                }
            }
        }
        // SAFETY: forwarded contract on `out`.
        unsafe { store_group_results(&acc, out, valid) };
    }

    /// The sums of a block's 8 weight registers `w` (register `k`: bytes `4k .. 4k + 4` of the
    /// 16 weight rows) against each activation row's 8 quant words at `words[r]`, broadcast:
    /// registers 0, 2, 4, 6 onto `even[r]`, 1, 3, 5, 7 onto a fresh `odd[r]`. Two chains per
    /// row (exact integers: the split changes no bit), and the rows' chains take turns step by
    /// step so that `2N` independent `vpdpbusd` are in flight: row after row, 8-row passes from
    /// L2 took 14–19% longer (Q8_0) and 18% (Q4_K), 4-row 6–10%; a single row the same.
    ///
    /// # Safety
    ///
    /// Every `words[r]` points at 8 readable `i32` (any alignment).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn row_chains<const N: usize>(
        w: &[__m512i; 8],
        words: [*const i32; N],
        mut even: [__m512i; N],
    ) -> ([__m512i; N], [__m512i; N]) {
        let mut odd = [_mm512_setzero_si512(); N];
        for k in (0..8).step_by(2) {
            for r in 0..N {
                // SAFETY: words `k`, `k + 1 < 8` of row `r` (the caller's contract).
                let (a, b) = unsafe {
                    (
                        words[r].add(k).read_unaligned(),
                        words[r].add(k + 1).read_unaligned(),
                    )
                };
                even[r] = _mm512_dpbusd_epi32(even[r], w[k], _mm512_set1_epi32(a));
                odd[r] = _mm512_dpbusd_epi32(odd[r], w[k + 1], _mm512_set1_epi32(b));
            }
        }
        (even, odd)
    }

    /// [`row_chains`] in one chain per row, `sums[r]` onward: for passes of more than
    /// [`crate::simd::MAX_ROWS_PER_PASS`] rows, which are independent chains enough to keep
    /// `vpdpbusd` busy, and whose second chains and their adds would not fit the registers
    /// (Zen 4, 16-row Q8_0 passes, one chain against two taking turns in one process: 7–15%
    /// cheaper; exact integers, so the same bits).
    ///
    /// # Safety
    ///
    /// As [`row_chains`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn row_chain<const N: usize>(
        w: &[__m512i; 8],
        words: [*const i32; N],
        mut sums: [__m512i; N],
    ) -> [__m512i; N] {
        for (k, w) in w.iter().enumerate() {
            for r in 0..N {
                // SAFETY: word `k < 8` of row `r` (the caller's contract).
                let a = unsafe { words[r].add(k).read_unaligned() };
                sums[r] = _mm512_dpbusd_epi32(sums[r], *w, _mm512_set1_epi32(a));
            }
        }
        sums
    }

    /// A run of interleaved Q4_K (Q5_K when `FIVE`) groups of 16 weight rows
    /// ([`crate::interleaved`]) times a pass of activation rows in the interleaved Q4_K activation
    /// format: the product of the run's weight row `i < valid` and activation row `b` at
    /// `out.row(b)[first + i]`.
    ///
    /// # Safety
    ///
    /// AVX-512 is supported; `groups` holds whole groups of `x.len() / 276` Q4_K (Q5_K) group
    /// blocks, the last of which holds row `valid - 1`; `x` holds at most
    /// [`crate::simd::MAX_ROWS_PER_PASS`] rows of whole activation blocks and `out` as many
    /// rows, each of at least `first + valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn interleaved_q4k_pass<const FIVE: bool>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match tuning().q4k_scales_by_vpmulld {
                true => with_row_count!(
                    x.count(),
                    interleaved_q4k_groups::<FIVE, BY_VPMULLD>(groups, x, out, first, valid)
                ),
                false => with_row_count!(
                    x.count(),
                    interleaved_q4k_groups::<FIVE, BY_VPDPWSSD>(groups, x, out, first, valid)
                ),
            }
        }
    }

    /// Values of [`scaled_sum`]'s `MULLO`, for the row-count dispatch.
    const BY_VPMULLD: bool = true;
    const BY_VPDPWSSD: bool = false;

    /// [`interleaved_q4k_pass`] for `N` activation rows: every group in one sweep of all the rows.
    ///
    /// One sweep of all 8 rows measured best once the prefetches were spread over the sub-blocks
    /// (see [`prefetch_part`]): 0.6B Q4_K verify pass, alternating in one process, k = 8 in
    /// 16.277 / 17.570 ms against 16.885 / 17.537 in sweeps of 4 and 19.331 / 19.917 in sweeps of 3
    /// (with the prefetches in one burst per block, sweeps of 3 had been best).
    ///
    /// # Safety
    ///
    /// As [`interleaved_q4k_pass`], with `x.count() == N`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn interleaved_q4k_groups<const FIVE: bool, const MULLO: bool, const N: usize>(
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
                interleaved_q4k_rows::<FIVE, MULLO, N>(g, b, xp, op, v, prefetch)
            })
        }
    }

    /// Per super-block and activation row: for each sub-block `j`, 8 `vpdpbusd` (two chains,
    /// [`row_chains`]) give the 16 rows' `Σ q_w · q_x`, times the rows' `sc_j` into `isum`
    /// ([`scaled_sum`]); 4 `vpdpwssd` of the rows' min pairs against the activation's sub-block
    /// sum pairs give `imin`; then two fused multiply-adds (see [`crate::interleaved`]). A
    /// sub-block's nibbles are decoded once for all the rows; the loop over sub-blocks is
    /// outermost so that only one sub-block's 8 weight registers and each row's `isum` are
    /// live.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn interleaved_q4k_rows<const FIVE: bool, const MULLO: bool, const N: usize>(
        group: *const u8,
        blocks: usize,
        xp: [*const u8; N],
        out: [*mut f32; N],
        valid: usize,
        prefetch: StreamPrefetch,
    ) {
        use crate::interleaved::Q4K_SCALES;
        let encoding = q4k_encoding::<FIVE>();
        let group_block = encoding.group_block_bytes();
        let act_block = encoding.activation_block_bytes();
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            // SAFETY: super-block `b` lies inside the group (`group_block` bytes: scales, mins, 4
            // chunks of 8 quant registers, Q5_K's masks) and every activation row (276 bytes:
            // 256 quants, the scale, 4 dwords of sums) by the caller's contract.
            unsafe {
                let block = group.add(b * group_block);
                // Unlike Q8_0, a Q4_K single-row pass gains from prefetching too (4096² from DRAM,
                // criterion, alternating builds: 1 thread 20.8–20.9 GiB/s without, 27.3–28.2 with;
                // 2 threads 35.5–35.6 without, 36.4–53.0 with): its per-block work is long enough.
                let ahead = block.wrapping_add(prefetch.k_quant_ahead);
                let mut isum = [_mm512_setzero_si512(); N];
                for j in 0..8 {
                    prefetch_part(encoding, ahead, (j, 8), prefetch.into_l2);
                    let w = q4k_sub_block::<FIVE>(block, j);
                    let scales = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                        block.add(Q4K_SCALES + 16 * j).cast(),
                    ));
                    let words =
                        std::array::from_fn(|r| xp[r].add(b * act_block + 32 * j).cast::<i32>());
                    let (even, odd) = row_chains::<N>(&w, words, [_mm512_setzero_si512(); N]);
                    for r in 0..N {
                        isum[r] = scaled_sum::<FIVE, MULLO, N>(isum[r], even[r], odd[r], scales);
                    }
                }
                let ends = Q4kBlockEnds::load(block);
                for r in 0..N {
                    acc[r] = ends.accumulate(xp[r].add(b * act_block), isum[r], acc[r]);
                }
            }
        }
        // SAFETY: forwarded contract on `out`.
        unsafe { store_group_results(&acc, out, valid) };
    }

    /// `isum + sc · (even + odd)` for a sub-block's two chains of sums `even`, `odd` and its
    /// scales `sc` (each lane's scale, `0..64`, in its low word; the high word zero), in a pass
    /// of `N` rows. A Q4_K chain sums 16 products of a level below 16 and a quant of magnitude
    /// at most 128, so it fits its lane's low word, and two `vpdpwssd` scale and add both
    /// chains where `vpaddd`, `vpmulld` (half `vpdpwssd`'s throughput on an Emerald Rapids
    /// Xeon) and `vpaddd` took three instructions. Single-row passes keep `vpmulld`, whose short
    /// chain into `isum` measured 2–8% faster there, and so do passes of several rows where
    /// `MULLO` ([`crate::simd::tuning::Tuning::q4k_scales_by_vpmulld`]: Zen 4); Q5_K's levels
    /// reach 31 and its chains do not fit a word. Exact integers either way: the same bits.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn scaled_sum<const FIVE: bool, const MULLO: bool, const N: usize>(
        isum: __m512i,
        even: __m512i,
        odd: __m512i,
        scales: __m512i,
    ) -> __m512i {
        if FIVE || N == 1 || MULLO {
            _mm512_add_epi32(
                isum,
                _mm512_mullo_epi32(_mm512_add_epi32(even, odd), scales),
            )
        } else {
            _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum, even, scales), odd, scales)
        }
    }

    /// Sub-block `j`'s levels in a Q4_K (Q5_K when `FIVE`) group block: 8 registers, register
    /// `k` holding bytes `4k .. 4k + 4` of the sub-block for the 16 weight rows (one byte per
    /// level, `0..16`, or `0..32` with Q5_K's fifth bit).
    ///
    /// # Safety
    ///
    /// `block` is a whole group block of the encoding; `j < 8`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn q4k_sub_block<const FIVE: bool>(
        block: *const u8,
        j: usize,
    ) -> [__m512i; 8] {
        use crate::interleaved::{Q4K_QUANTS, Q5K_HIGH};
        let low_nibbles = _mm512_set1_epi8(0x0f);
        let fifth_bit = _mm512_set1_epi8(0x10);
        // Sub-block `j`: the low (even `j`) or high (odd `j`) nibbles of chunk `j / 2`.
        // SAFETY: the chunk's 8 registers (and Q5_K's masks) lie inside the block.
        let chunk = unsafe { block.add(Q4K_QUANTS + 512 * (j / 2)) };
        std::array::from_fn(|k| {
            // SAFETY: as above.
            let packed = unsafe { _mm512_loadu_si512(chunk.add(64 * k).cast()) };
            let w = if j.is_multiple_of(2) {
                _mm512_and_si512(packed, low_nibbles)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low_nibbles)
            };
            if FIVE {
                // 16 added to the bytes whose fifth bit the mask sets.
                // SAFETY: as above.
                let mask: __mmask64 = unsafe {
                    block
                        .add(Q5K_HIGH + 64 * j + 8 * k)
                        .cast::<u64>()
                        .read_unaligned()
                };
                _mm512_mask_add_epi8(w, mask, w, fifth_bit)
            } else {
                w
            }
        })
    }

    /// What a Q4_K (Q5_K) group block adds to each activation row's accumulators once its
    /// integer sums `isum` are known: the mins' part `imin` and the two fused steps (see
    /// [`crate::interleaved`]), the same instructions whichever kernel summed.
    pub(super) struct Q4kBlockEnds {
        dw: __m512,
        dmin: __m512,
        mins: [__m512i; 4],
    }

    impl Q4kBlockEnds {
        /// The block's scales and mins.
        ///
        /// # Safety
        ///
        /// `block` is a whole Q4_K (Q5_K) group block.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        #[inline]
        pub(super) unsafe fn load(block: *const u8) -> Self {
            use crate::interleaved::{Q4K_DMIN, Q4K_MINS};
            // SAFETY: the f16 scales, f16 mins' scales and 4 × 32 bytes of mins lie inside
            // the block.
            unsafe {
                Self {
                    dw: _mm512_cvtph_ps(_mm256_loadu_si256(block.cast())),
                    dmin: _mm512_cvtph_ps(_mm256_loadu_si256(block.add(Q4K_DMIN).cast())),
                    mins: std::array::from_fn(|p| {
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                            block.add(Q4K_MINS + 32 * p).cast(),
                        ))
                    }),
                }
            }
        }

        /// `acc` with the block added for the activation row block `xb` whose integer sums
        /// against the 16 weight rows are `isum`.
        ///
        /// # Safety
        ///
        /// `xb` is a whole Q4_K activation block.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        #[inline]
        pub(super) unsafe fn accumulate(
            &self,
            xb: *const u8,
            isum: __m512i,
            acc: __m512,
        ) -> __m512 {
            use crate::interleaved::{Q4K_ACT_SCALE, Q4K_ACT_SUMS};
            // SAFETY: the sums and the scale lie inside the activation block.
            unsafe {
                let sums = xb.add(Q4K_ACT_SUMS).cast::<i32>();
                let pair = |p: usize| _mm512_set1_epi32(sums.add(p).read_unaligned());
                let low = _mm512_dpwssd_epi32(_mm512_setzero_si512(), self.mins[0], pair(0));
                let high = _mm512_dpwssd_epi32(_mm512_setzero_si512(), self.mins[1], pair(1));
                let low = _mm512_dpwssd_epi32(low, self.mins[2], pair(2));
                let high = _mm512_dpwssd_epi32(high, self.mins[3], pair(3));
                let imin = _mm512_add_epi32(low, high);
                let dx = _mm512_set1_ps(xb.add(Q4K_ACT_SCALE).cast::<f32>().read_unaligned());
                let acc =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(self.dw, dx), acc);
                _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(self.dmin, dx), acc)
            }
        }
    }

    /// A run of interleaved Q6_K groups of 16 weight rows ([`crate::interleaved`]) times a pass of
    /// activation rows in the interleaved Q6_K activation format: the product of the run's weight
    /// row `i < valid` and activation row `b` at `out.row(b)[first + i]`.
    ///
    /// # Safety
    ///
    /// AVX-512 is supported; `groups` holds whole groups of `x.len() / 324` Q6_K group blocks,
    /// the last of which holds row `valid - 1`; `x` holds at most
    /// [`crate::simd::MAX_ROWS_PER_PASS`] rows of whole activation blocks and `out` as many
    /// rows, each of at least `first + valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn interleaved_q6k_pass(
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
                interleaved_q6k_groups(groups, x, out, first, valid)
            )
        }
    }

    /// [`interleaved_q6k_pass`] for `N` activation rows: every group in one sweep of all the rows.
    ///
    /// # Safety
    ///
    /// As [`interleaved_q6k_pass`], with `x.count() == N`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn interleaved_q6k_groups<const N: usize>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        use crate::interleaved::Encoding;
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
                |g, b, xp, op, v| interleaved_q6k_rows::<N>(g, b, xp, op, v, prefetch),
            )
        }
    }

    /// Per super-block, for each of the 16 groups of 16 values: the group's 4 weight registers
    /// decoded once for all the rows (low nibble from its plane, high bit pair from the other,
    /// `or`ed), then per activation row 4 `vpdpbusd` (two chains, the first started at the
    /// activation's `-32 · Σ x`) give the 16 rows' `Σ (q - 32) · q_x`, times the rows' `sc_j`
    /// (`vpmulld`) into `isum`; then one fused multiply-add per row (see
    /// [`crate::interleaved`]). Prefetches as the Q4_K pass, spread over the groups.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn interleaved_q6k_rows<const N: usize>(
        group: *const u8,
        blocks: usize,
        xp: [*const u8; N],
        out: [*mut f32; N],
        valid: usize,
        prefetch: StreamPrefetch,
    ) {
        use crate::interleaved::{
            Encoding, Q6K_ACT_SCALE, Q6K_ACT_STARTS, Q6K_HIGH, Q6K_LOW, Q6K_SCALES,
        };
        let group_block = Encoding::Q6K.group_block_bytes();
        let act_block = Encoding::Q6K.activation_block_bytes();
        let mut acc = [_mm512_setzero_ps(); N];
        let low_nibbles = _mm512_set1_epi8(0x0f);
        let high_pair = _mm512_set1_epi8(0x30);
        for b in 0..blocks {
            // SAFETY: super-block `b` lies inside the group (3360 bytes: d, scales, the two
            // planes) and every activation row (324 bytes: 256 quants, the scale, 16 starts) by
            // the caller's contract.
            unsafe {
                let block = group.add(b * group_block);
                let ahead = block.wrapping_add(prefetch.k_quant_ahead);
                let mut isum = [_mm512_setzero_si512(); N];
                for j in 0..16 {
                    prefetch_part(Encoding::Q6K, ahead, (j, 16), prefetch.into_l2);
                    let low = block.add(Q6K_LOW + 256 * (j / 2));
                    let high = block.add(Q6K_HIGH + 256 * (j / 4));
                    let mut w = [_mm512_setzero_si512(); 4];
                    for (k, w) in w.iter_mut().enumerate() {
                        let l = _mm512_loadu_si512(low.add(64 * k).cast());
                        let l = match j % 2 {
                            0 => _mm512_and_si512(l, low_nibbles),
                            _ => _mm512_and_si512(_mm512_srli_epi16::<4>(l), low_nibbles),
                        };
                        // Bits 2m, 2m + 1 of each byte to bits 4, 5 (the 16-bit shifts carry
                        // bits across bytes only outside the mask).
                        let h = _mm512_loadu_si512(high.add(64 * k).cast());
                        let h = match j % 4 {
                            0 => _mm512_slli_epi16::<4>(h),
                            1 => _mm512_slli_epi16::<2>(h),
                            2 => h,
                            _ => _mm512_srli_epi16::<2>(h),
                        };
                        *w = _mm512_or_si512(l, _mm512_and_si512(h, high_pair));
                    }
                    let scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                        block.add(Q6K_SCALES + 16 * j).cast(),
                    ));
                    for r in 0..N {
                        let xb = xp[r].add(b * act_block);
                        let words = xb.add(16 * j).cast::<i32>();
                        let word = |k: usize| _mm512_set1_epi32(words.add(k).read_unaligned());
                        let start = _mm512_set1_epi32(
                            xb.add(Q6K_ACT_STARTS + 4 * j)
                                .cast::<i32>()
                                .read_unaligned(),
                        );
                        // Two independent chains (exact integers: the split changes no bit).
                        let even = _mm512_dpbusd_epi32(start, w[0], word(0));
                        let odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], word(1));
                        let even = _mm512_dpbusd_epi32(even, w[2], word(2));
                        let odd = _mm512_dpbusd_epi32(odd, w[3], word(3));
                        let sub = _mm512_add_epi32(even, odd);
                        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sub, scales));
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
                for r in 0..N {
                    let xb = xp[r].add(b * act_block);
                    let dx = _mm512_set1_ps(xb.add(Q6K_ACT_SCALE).cast::<f32>().read_unaligned());
                    acc[r] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, dx), acc[r]);
                }
            }
        }
        // SAFETY: forwarded contract on `out`.
        unsafe { store_group_results(&acc, out, valid) };
    }
}

/// The AMX kernel: interleaved Q8_0 groups times a pass of activation rows, one `tdpbsud` per
/// block and group for every row of the pass.
///
/// A Q8_0 group block's eight registers of quants (bytes `4j .. 4j + 4` of the 16 weight rows,
/// `q + 128`) are exactly a tile of 8 rows × 64 bytes in the layout `tdpbsud` wants for its
/// second operand, and the pass's activation rows' 32 quants per block are its first (`N`
/// rows × 32 bytes, the rows' stride apart): one instruction leaves, in row `r` of the result
/// tile, the 16 weight rows' integer sums for activation row `r` — the sums the AVX-512 kernel
/// builds with eight `vpdpbusd`, before it adds the block's start `-128 · Σ x`. The float steps
/// after (start added, converted, scaled by `d_w · d_x`, fused into the accumulator in block
/// order) are the AVX-512 kernel's, instruction for instruction: both kernels give the same
/// bits, so which of them a pass takes never shows in its results.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::avx512::{q4k_sub_block, store_group_results, Q4kBlockEnds};
    use super::{for_each_group, prefetch_part, q4k_encoding};
    use crate::interleaved::{Encoding, BLOCK32_VALUES};
    use crate::simd::x86::amx::TileConfig;
    use crate::simd::x86::avx512::prefetch_block;
    use crate::simd::{OutRows, Rows, MAX_TILE_ROWS};

    /// `$kernel::<G, N>(…)` for `N = $n`, a pass of 1 to 16 rows (a tile's).
    macro_rules! with_tile_rows {
        ($n:expr, $kernel:ident::<$generic:ident>$args:tt) => {
            with_tile_rows!(@ $n, $kernel, $generic, $args, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
        };
        (@ $n:expr, $kernel:ident, $generic:ident, $args:tt, $($rows:literal)*) => {
            match $n {
                $($rows => $kernel::<$generic, $rows> $args,)*
                n => unreachable!("an AMX pass of {n} rows"),
            }
        };
    }

    /// `$kernel::<G, N, N - 16>(…)` for `N = $n`, a pass of 17 to 32 rows (two tiles').
    macro_rules! with_two_tile_rows {
        ($n:expr, $kernel:ident::<$generic:ident>$args:tt) => {
            with_two_tile_rows!(
                @ $n, $kernel, $generic, $args,
                17 1 18 2 19 3 20 4 21 5 22 6 23 7 24 8 25 9 26 10 27 11 28 12 29 13 30 14 31 15 32 16
            )
        };
        (@ $n:expr, $kernel:ident, $generic:ident, $args:tt, $($rows:literal $high:literal)*) => {
            match $n {
                $($rows => $kernel::<$generic, $rows, $high> $args,)*
                n => unreachable!("a two-tile AMX pass of {n} rows"),
            }
        };
    }

    /// How far ahead of the block being multiplied the tiles' Q8_0 pass prefetches: half the
    /// AVX-512 kernel's distance, since a tile pass takes less time per block. Measured (Emerald
    /// Rapids, qwen3-0.6b Q8_0, 2 threads, ms per pass, distances taking turns in one
    /// process): 4 rows 46.95 / 45.83 at 6 KiB against 47.58 / 47.83 at 12 KiB, 8 rows 57.74 /
    /// 59.13 against 60.77 / 60.73; without prefetching, 61.06 (4 rows) and 71.90 (8 rows).
    const AMX_Q8_0_PREFETCH_BYTES: usize = 6 << 10;

    /// How far ahead the tiles' Q4_K / Q5_K pass prefetches, into L1 (the tiles are Intel's, and
    /// this is the AVX-512 kernels' plan there, [`crate::simd::tuning`]).
    const AMX_K_QUANT_PREFETCH_BYTES: usize = 16 << 10;

    /// A result tile's rows as stored: row `r` holds activation row `r`'s 16 integer sums.
    #[repr(C, align(64))]
    struct Sums<const N: usize>([[i32; 16]; N]);

    /// [`super::interleaved_pass`]'s Q8_0 pass on tiles.
    ///
    /// # Safety
    ///
    /// The process runs at [`crate::SimdLevel::Amx`]; `groups` holds whole groups of
    /// `x.len() / 40` Q8_0 group blocks, the last of which holds row `valid - 1`; `x` holds at
    /// most [`crate::simd::MAX_PASS_ROWS`] rows of whole activation blocks and `out` as many
    /// rows, each of at least `first + valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn q8_0_pass<const STREAM: bool>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            if x.count() <= MAX_TILE_ROWS {
                with_tile_rows!(
                    x.count(),
                    q8_0_groups::<STREAM>(groups, x, out, first, valid)
                )
            } else {
                with_two_tile_rows!(
                    x.count(),
                    q8_0_two_tile_groups::<STREAM>(groups, x, out, first, valid)
                )
            }
        }
    }

    /// [`q8_0_pass`] for `N` activation rows: tiles 0 and 3 an activation block (`N` × 32
    /// bytes), 1 and 4 a weight block (8 × 64), 2 and 5 their sums (`N` × 16 i32).
    ///
    /// # Safety
    ///
    /// As [`q8_0_pass`], with `x.count() == N`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q8_0_groups<const STREAM: bool, const N: usize>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        let config = TileConfig::new()
            .tile(0, N, BLOCK32_VALUES)
            .tile(1, BLOCK32_VALUES / 4, 64)
            .tile(2, N, 64)
            .tile(3, N, BLOCK32_VALUES)
            .tile(4, BLOCK32_VALUES / 4, 64)
            .tile(5, N, 64);
        let stride = x.stride();
        // SAFETY: AMX is usable (the caller's contract); `for_each_group` hands the contract
        // on per group, and the activation rows are `stride` bytes apart.
        unsafe {
            config.make_current();
            for_each_group::<N>(
                Encoding::Q8_0,
                groups,
                x,
                out,
                first,
                valid,
                |g, b, xp, op, v| q8_0_rows::<STREAM, N>(g, b, xp[0], stride, op, v),
            );
        }
    }

    /// One Q8_0 group (`blocks` group blocks at `group`) times the `N` activation rows from
    /// `x`, `stride` bytes apart: lanes `0..valid` of row `r`'s results stored at `out[r]`.
    ///
    /// Blocks go in pairs through two sets of tiles (0–2 and 3–5), so that one block's loads
    /// and multiply overlap the other's (a tile register is not renamed: one set would run
    /// each block's load, multiply, store and read back one after the other).
    ///
    /// # Safety
    ///
    /// The tiles are configured as [`q8_0_groups`] does; the group and every activation row
    /// hold `blocks` blocks; every `out[r]` holds `valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_0_rows<const STREAM: bool, const N: usize>(
        group: *const u8,
        blocks: usize,
        x: *const u8,
        stride: usize,
        out: [*mut f32; N],
        valid: usize,
    ) {
        let group_block = Encoding::Q8_0.group_block_bytes();
        let act_block = Encoding::Q8_0.activation_block_bytes();
        let mut acc = [_mm512_setzero_ps(); N];
        let mut sums = [Sums::<N>([[0; 16]; N]), Sums::<N>([[0; 16]; N])];
        let mut accumulate = |b: usize, sums: &Sums<N>| {
            // SAFETY: block `b` lies inside the group and every activation row (caller's
            // contract).
            unsafe {
                add_block_sums(
                    &mut acc,
                    sums,
                    group.add(b * group_block),
                    (x.add(b * act_block), stride),
                )
            }
        };
        // The 8 × 64 bytes of quants of block `b`, after its prefetch.
        let weights = |b: usize| {
            let block = group.wrapping_add(b * group_block);
            if STREAM {
                prefetch_block(
                    block.wrapping_add(AMX_Q8_0_PREFETCH_BYTES),
                    group_block,
                    false,
                );
            }
            block.wrapping_add(32)
        };
        let mut b = 0;
        while b + 2 <= blocks {
            let (low, high) = sums.split_at_mut(1);
            // SAFETY: blocks `b` and `b + 1` lie inside the group and every activation row
            // (caller's contract); the tiles read 8 rows of 64 bytes of quants and `N` rows of
            // 32 activation quants each, and store `N` rows of 64 bytes into each of `sums`.
            unsafe {
                asm!(
                    "tileloadd tmm0, [{x0} + {stride} * 1]",
                    "tileloadd tmm1, [{w0} + {row} * 1]",
                    "tileloadd tmm3, [{x1} + {stride} * 1]",
                    "tileloadd tmm4, [{w1} + {row} * 1]",
                    "tilezero tmm2",
                    "tilezero tmm5",
                    "tdpbsud tmm2, tmm0, tmm1",
                    "tdpbsud tmm5, tmm3, tmm4",
                    "tilestored [{s0} + {row} * 1], tmm2",
                    "tilestored [{s1} + {row} * 1], tmm5",
                    x0 = in(reg) x.add(b * act_block),
                    x1 = in(reg) x.add((b + 1) * act_block),
                    stride = in(reg) stride,
                    w0 = in(reg) weights(b),
                    w1 = in(reg) weights(b + 1),
                    row = in(reg) 64usize,
                    s0 = in(reg) low[0].0.as_mut_ptr(),
                    s1 = in(reg) high[0].0.as_mut_ptr(),
                    out("tmm0") _, out("tmm1") _, out("tmm2") _,
                    out("tmm3") _, out("tmm4") _, out("tmm5") _,
                    options(nostack),
                );
            }
            accumulate(b, &sums[0]);
            accumulate(b + 1, &sums[1]);
            b += 2;
        }
        if b < blocks {
            // SAFETY: as above, for the last block alone.
            unsafe {
                asm!(
                    "tileloadd tmm0, [{x} + {stride} * 1]",
                    "tileloadd tmm1, [{w} + {row} * 1]",
                    "tilezero tmm2",
                    "tdpbsud tmm2, tmm0, tmm1",
                    "tilestored [{sums} + {row} * 1], tmm2",
                    x = in(reg) x.add(b * act_block),
                    stride = in(reg) stride,
                    w = in(reg) weights(b),
                    row = in(reg) 64usize,
                    sums = in(reg) sums[0].0.as_mut_ptr(),
                    out("tmm0") _, out("tmm1") _, out("tmm2") _,
                    options(nostack),
                );
            }
            accumulate(b, &sums[0]);
        }
        // SAFETY: forwarded contract on `out`.
        unsafe { store_group_results(&acc, out, valid) };
    }

    /// Adds one block's integer sums of `R` activation rows (`sums`, from the tiles) into their
    /// accumulators: the AVX-512 kernel's float steps, so the tiles give its bits. `block` is
    /// the group block (16 weight scales, then quants); `xb` the block of the first activation
    /// row, the others `stride` bytes apart.
    ///
    /// # Safety
    ///
    /// `block` is a whole Q8_0 group block and every activation row holds a whole block at
    /// `xb + r * stride`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn add_block_sums<const R: usize>(
        acc: &mut [__m512; R],
        sums: &Sums<R>,
        block: *const u8,
        (xb, stride): (*const u8, usize),
    ) {
        // SAFETY: the caller's contract: 32 scale bytes at `block`, 40 activation bytes per row
        // (32 quants, the scale, the start term).
        unsafe {
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let xr = xb.add(r * stride);
                let start = xr.add(BLOCK32_VALUES + 4).cast::<i32>().read_unaligned();
                let row = _mm512_load_si512(sums.0[r].as_ptr().cast());
                let row = _mm512_add_epi32(row, _mm512_set1_epi32(start));
                let dx = _mm512_set1_ps(xr.add(BLOCK32_VALUES).cast::<f32>().read_unaligned());
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(row), _mm512_mul_ps(dw, dx), *acc);
            }
        }
    }

    /// [`q8_0_pass`] for `N` = 17 to 32 activation rows, as two tiles of rows: the first 16
    /// (tiles 0 and 2: activations, sums) and the `HIGH = N - 16` after them (3 and 5), both
    /// multiplied by one load of each weight block (tile 1). Against two passes, each block's
    /// weights are read and loaded into a tile once instead of twice, and one block's float
    /// steps run while the next block's tiles work (a 3072 × 1024 Q8_0 matrix from memory, 2
    /// threads, Emerald Rapids Xeon, taking turns in one process, ms per product: 24 rows
    /// 0.43–0.44 against 0.50–0.51 as passes of 16 and 8 rows, 20 rows 0.33 against 0.39).
    ///
    /// # Safety
    ///
    /// As [`q8_0_pass`], with `x.count() == N == 16 + HIGH`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q8_0_two_tile_groups<const STREAM: bool, const N: usize, const HIGH: usize>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        debug_assert_eq!(N, MAX_TILE_ROWS + HIGH);
        let config = TileConfig::new()
            .tile(0, MAX_TILE_ROWS, BLOCK32_VALUES)
            .tile(1, BLOCK32_VALUES / 4, 64)
            .tile(2, MAX_TILE_ROWS, 64)
            .tile(3, HIGH, BLOCK32_VALUES)
            .tile(5, HIGH, 64);
        let stride = x.stride();
        // SAFETY: AMX is usable (the caller's contract); `for_each_group` hands the contract
        // on per group, and the activation rows are `stride` bytes apart.
        unsafe {
            config.make_current();
            for_each_group::<N>(
                Encoding::Q8_0,
                groups,
                x,
                out,
                first,
                valid,
                |g, b, xp, op, v| {
                    let (low, high) = (xp[0], xp[MAX_TILE_ROWS]);
                    q8_0_two_tile_rows::<STREAM, HIGH>(g, b, [low, high], stride, &op, v)
                },
            );
        }
    }

    /// One Q8_0 group (`blocks` group blocks at `group`) times 16 + `HIGH` activation rows
    /// (the first of each tile's at `x`, rows `stride` bytes apart): lanes `0..valid` of row
    /// `r`'s results stored at `out[r]`. Block `b`'s sums go to `sums[b % 2]`, and block
    /// `b - 1`'s float steps follow block `b`'s tile instructions.
    ///
    /// # Safety
    ///
    /// The tiles are configured as [`q8_0_two_tile_groups`] does; the group and every
    /// activation row hold `blocks` blocks; every `out[r]` holds `valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_0_two_tile_rows<const STREAM: bool, const HIGH: usize>(
        group: *const u8,
        blocks: usize,
        x: [*const u8; 2],
        stride: usize,
        out: &[*mut f32],
        valid: usize,
    ) {
        let group_block = Encoding::Q8_0.group_block_bytes();
        let act_block = Encoding::Q8_0.activation_block_bytes();
        let mut low = [_mm512_setzero_ps(); MAX_TILE_ROWS];
        let mut high = [_mm512_setzero_ps(); HIGH];
        let mut sums = [
            (Sums([[0; 16]; MAX_TILE_ROWS]), Sums([[0; 16]; HIGH])),
            (Sums([[0; 16]; MAX_TILE_ROWS]), Sums([[0; 16]; HIGH])),
        ];
        let mut accumulate =
            |b: usize, (sums_low, sums_high): &(Sums<MAX_TILE_ROWS>, Sums<HIGH>)| {
                // SAFETY: block `b` lies inside the group and every activation row (caller's
                // contract).
                unsafe {
                    let block = group.add(b * group_block);
                    add_block_sums(&mut low, sums_low, block, (x[0].add(b * act_block), stride));
                    add_block_sums(
                        &mut high,
                        sums_high,
                        block,
                        (x[1].add(b * act_block), stride),
                    );
                }
            };
        for b in 0..blocks {
            let block = group.wrapping_add(b * group_block);
            if STREAM {
                prefetch_block(
                    block.wrapping_add(AMX_Q8_0_PREFETCH_BYTES),
                    group_block,
                    false,
                );
            }
            let (sums_low, sums_high) = &mut sums[b % 2];
            // SAFETY: block `b` lies inside the group and every activation row (caller's
            // contract); the tiles read 8 rows of 64 bytes of quants (after the 32 scale
            // bytes), 16 and `HIGH` rows of 32 activation quants, and store as many rows of
            // 64 bytes of sums.
            unsafe {
                asm!(
                    "tileloadd tmm0, [{x0} + {stride} * 1]",
                    "tileloadd tmm3, [{x1} + {stride} * 1]",
                    "tileloadd tmm1, [{w} + {row} * 1]",
                    "tilezero tmm2",
                    "tilezero tmm5",
                    "tdpbsud tmm2, tmm0, tmm1",
                    "tdpbsud tmm5, tmm3, tmm1",
                    "tilestored [{s0} + {row} * 1], tmm2",
                    "tilestored [{s1} + {row} * 1], tmm5",
                    x0 = in(reg) x[0].add(b * act_block),
                    x1 = in(reg) x[1].add(b * act_block),
                    stride = in(reg) stride,
                    w = in(reg) block.add(32),
                    row = in(reg) 64usize,
                    s0 = in(reg) sums_low.0.as_mut_ptr(),
                    s1 = in(reg) sums_high.0.as_mut_ptr(),
                    out("tmm0") _, out("tmm1") _, out("tmm2") _,
                    out("tmm3") _, out("tmm5") _,
                    options(nostack),
                );
            }
            if b > 0 {
                accumulate(b - 1, &sums[(b - 1) % 2]);
            }
        }
        if blocks > 0 {
            accumulate(blocks - 1, &sums[(blocks - 1) % 2]);
        }
        let (out_low, out_high) = out.split_at(MAX_TILE_ROWS);
        // SAFETY: forwarded contract on `out`.
        unsafe {
            store_group_results(&low, std::array::from_fn(|r| out_low[r]), valid);
            store_group_results(&high, std::array::from_fn(|r| out_high[r]), valid);
        }
    }

    /// A 64-byte line: the unit the Q4_K tiles' operands are laid out in.
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);

    const ZERO_LINE: Line = Line([0; 64]);

    /// Sub-blocks of 32 values in a Q4_K super-block; a tile's row of 64 bytes takes a pair.
    const SUB_BLOCKS: usize = 8;

    thread_local! {
        /// The pass's activation quants copied to 64-byte aligned rows for the Q4_K tiles
        /// (a tile load that crosses cache lines costs about twice as much), kept from pass to
        /// pass so a pass allocates nothing.
        static ALIGNED: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// [`super::interleaved_pass`]'s Q4_K (Q5_K when `FIVE`) pass on tiles.
    ///
    /// A Q4_K sub-block's integer sum is scaled by its 6-bit `sc_j` before the super-block's
    /// sums are added, so a tile of levels cannot be summed over the super-block as it is.
    /// Products of levels and scales can, one byte at a time: `sc_j = 16 · high + low` (Q5_K:
    /// `8 · high + low`), and each of `q · low`, `q · high` fits a byte. Per group block the
    /// pass builds, for each sub-block pair, a 16 × 64-byte tile of `q · low` and one of
    /// `q · high`, in the levels' own layout ([`q4k_products`]); `tdpbsud` of the activation
    /// quants against each, over the super-block, gives `Σ x · q · low` and `Σ x · q · high`,
    /// and `low + 16 · high` is exactly the AVX-512 kernel's `isum = Σ_j sc_j · Σ q · x`. From
    /// there the float steps are its own ([`Q4kBlockEnds`]), so both kernels give the same
    /// bits. Building the products costs the same for any number of rows, so the tiles pay
    /// for many rows only ([`super::AMX_K_QUANT_MIN_ROWS`]).
    ///
    /// # Safety
    ///
    /// The process runs at [`crate::SimdLevel::Amx`]; `groups` holds whole groups of
    /// `x.len() / 276` group blocks, the last of which holds row `valid - 1`; `x` holds at most
    /// [`crate::simd::MAX_TILE_ROWS`] rows of whole activation blocks and `out` as many rows,
    /// each of at least `first + valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn q4k_pass<const FIVE: bool>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe { with_tile_rows!(x.count(), q4k_groups::<FIVE>(groups, x, out, first, valid)) }
    }

    /// [`q4k_pass`] for `N` activation rows: the rows' quants copied aligned once for all the
    /// groups, then tiles 0 and 5 a sub-block pair's activation quants (`N` × 64 bytes), 1 and
    /// 6 its products' low bytes, 2 and 7 their high bytes (16 × 64 each), 3 and 4 the sums of
    /// low and of high bytes (`N` × 16 i32).
    ///
    /// # Safety
    ///
    /// As [`q4k_pass`], with `x.count() == N`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4k_groups<const FIVE: bool, const N: usize>(
        groups: &[u8],
        x: Rows<'_, u8>,
        out: &mut OutRows<'_>,
        first: usize,
        valid: usize,
    ) {
        let encoding = q4k_encoding::<FIVE>();
        let act_block = encoding.activation_block_bytes();
        let blocks = x.len() / act_block;
        let config = TileConfig::new()
            .tile(0, N, 64)
            .tile(1, 16, 64)
            .tile(2, 16, 64)
            .tile(3, N, 64)
            .tile(4, N, 64)
            .tile(5, N, 64)
            .tile(6, 16, 64)
            .tile(7, 16, 64);
        ALIGNED.with_borrow_mut(|aligned| {
            aligned.clear();
            for r in 0..N {
                let row = x.row(r);
                for b in 0..blocks {
                    let quants = row[b * act_block..][..256].chunks_exact(64);
                    aligned.extend(quants.map(|q| Line(q.try_into().expect("64 bytes"))));
                }
            }
            let mut products = [[ZERO_LINE; 16 * SUB_BLOCKS]; 2];
            let zero = || Sums::<N>([[0; 16]; N]);
            let mut sums = [[zero(), zero()], [zero(), zero()]];
            let quants = (aligned.as_ptr().cast::<u8>(), 256 * blocks);
            // SAFETY: AMX is usable (the caller's contract); `for_each_group` hands the
            // contract on per group; the aligned rows hold `blocks` super-blocks' quants,
            // `256 * blocks` bytes apart.
            unsafe {
                config.make_current();
                for_each_group::<N>(encoding, groups, x, out, first, valid, |g, b, xp, op, v| {
                    q4k_rows::<FIVE, N>(g, b, xp, quants, &mut products, &mut sums, op, v)
                });
            }
        });
    }

    /// A group block's products' bytes as `tdpbsud`'s second operand (see [`q4k_pass`]): per
    /// sub-block pair 16 lines of low bytes, then 16 of high bytes.
    type Products = [Line; 16 * SUB_BLOCKS];

    /// The bits of the base `sc_j` is split in for the products: `sc_j = 2^bits · high + low`
    /// with `low < 2^bits`, so that `q · low` and `q · high` each fit a byte (Q4_K: `q < 16`,
    /// base 16, `high < 4`; Q5_K: `q < 32`, base 8, `high < 8`).
    const fn scale_base_bits<const FIVE: bool>() -> i32 {
        if FIVE {
            3
        } else {
            4
        }
    }

    /// Builds a Q4_K (Q5_K) group block's [`Products`], prefetching the stream `ahead` as it
    /// goes. A register of levels read as 16-bit words holds two levels per word, `q_0 + 256 ·
    /// q_1`; one `vpmullw` by a digit `s` of the row's scale gives `q_0 · s + 256 · q_1 · s`,
    /// and as `q_0 · s < 256` that is each level's product in the level's own byte.
    ///
    /// # Safety
    ///
    /// `block` is a whole group block of the encoding.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn q4k_products<const FIVE: bool>(
        block: *const u8,
        ahead: *const u8,
        products: &mut Products,
    ) {
        use crate::interleaved::Q4K_SCALES;
        let encoding = q4k_encoding::<FIVE>();
        let bits = _mm512_set1_epi32(scale_base_bits::<FIVE>());
        let low_mask = _mm512_set1_epi32((1 << scale_base_bits::<FIVE>()) - 1);
        for j in 0..SUB_BLOCKS {
            prefetch_part(encoding, ahead, (j, SUB_BLOCKS), false);
            // SAFETY: sub-block `j`'s levels and 16 scales lie inside the block.
            let (w, sc) = unsafe {
                let sc = _mm_loadu_si128(block.add(Q4K_SCALES + 16 * j).cast());
                (q4k_sub_block::<FIVE>(block, j), _mm512_cvtepu8_epi32(sc))
            };
            // Each digit in both words of its row's lane.
            let words = |digit: __m512i| _mm512_or_si512(digit, _mm512_slli_epi32::<16>(digit));
            let low = words(_mm512_and_si512(sc, low_mask));
            let high = words(_mm512_srlv_epi32(sc, bits));
            // Sub-block `j` is half `j % 2` of pair `j / 2`'s tiles.
            let lines = &mut products[32 * (j / 2)..][..32];
            let half = 8 * (j % 2);
            for (k, w) in w.iter().enumerate() {
                // SAFETY: each line is 64 aligned bytes.
                unsafe {
                    let (l, h) = (_mm512_mullo_epi16(*w, low), _mm512_mullo_epi16(*w, high));
                    _mm512_store_si512(lines[half + k].0.as_mut_ptr().cast(), l);
                    _mm512_store_si512(lines[16 + half + k].0.as_mut_ptr().cast(), h);
                }
            }
        }
    }

    /// The tile work of one super-block: the `N` aligned activation rows at `x` (`stride`
    /// bytes apart) times `products`, the sums of low bytes stored in `low`, of high bytes in
    /// `high`.
    ///
    /// # Safety
    ///
    /// The tiles are configured as [`q4k_groups`] does; every row at `x` holds a super-block's
    /// 256 quants.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn q4k_tiles<const N: usize>(
        x: *const u8,
        stride: usize,
        products: &Products,
        [low, high]: &mut [Sums<N>; 2],
    ) {
        // SAFETY: the tiles read `N` rows of 64 quants per sub-block pair, 32 lines of
        // products per pair, and store `N` rows of 64 bytes into each of `low` and `high`.
        unsafe {
            asm!(
                "tilezero tmm3",
                "tilezero tmm4",
                "tileloadd tmm0, [{x} + {stride} * 1]",
                "tileloadd tmm1, [{p} + {row} * 1]",
                "tileloadd tmm2, [{p} + {row} * 1 + 1024]",
                "tileloadd tmm5, [{x} + {stride} * 1 + 64]",
                "tileloadd tmm6, [{p} + {row} * 1 + 2048]",
                "tileloadd tmm7, [{p} + {row} * 1 + 3072]",
                "tdpbsud tmm3, tmm0, tmm1",
                "tdpbsud tmm4, tmm0, tmm2",
                "tdpbsud tmm3, tmm5, tmm6",
                "tdpbsud tmm4, tmm5, tmm7",
                "tileloadd tmm0, [{x} + {stride} * 1 + 128]",
                "tileloadd tmm1, [{p} + {row} * 1 + 4096]",
                "tileloadd tmm2, [{p} + {row} * 1 + 5120]",
                "tileloadd tmm5, [{x} + {stride} * 1 + 192]",
                "tileloadd tmm6, [{p} + {row} * 1 + 6144]",
                "tileloadd tmm7, [{p} + {row} * 1 + 7168]",
                "tdpbsud tmm3, tmm0, tmm1",
                "tdpbsud tmm4, tmm0, tmm2",
                "tdpbsud tmm3, tmm5, tmm6",
                "tdpbsud tmm4, tmm5, tmm7",
                "tilestored [{low} + {row} * 1], tmm3",
                "tilestored [{high} + {row} * 1], tmm4",
                x = in(reg) x,
                stride = in(reg) stride,
                p = in(reg) products.as_ptr(),
                row = in(reg) 64usize,
                low = in(reg) low.0.as_mut_ptr(),
                high = in(reg) high.0.as_mut_ptr(),
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack),
            );
        }
    }

    /// One Q4_K (Q5_K) group (`blocks` group blocks at `group`) times the `N` activation rows
    /// (`xp`, and their quants aligned, `(rows, stride)`): lanes `0..valid` of row `r`'s
    /// results stored at `out[r]`. `products` and `sums` are scratch.
    ///
    /// A software pipeline: super-block `b + 1`'s products are built and `b - 1`'s sums
    /// accumulated while `b`'s tiles run, so that a tile load does not wait on the vector
    /// stores of its operand, nor a vector load on the tile store of its sums. (The vector
    /// stores and the tile multiplies still overlap poorly: a store cannot retire behind a
    /// `tdpbsud` still running, and the store buffer fills.)
    ///
    /// # Safety
    ///
    /// The tiles are configured as [`q4k_groups`] does; the group and every activation row
    /// hold `blocks` blocks, every aligned row as many super-blocks' quants; every `out[r]`
    /// holds `valid` outputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4k_rows<const FIVE: bool, const N: usize>(
        group: *const u8,
        blocks: usize,
        xp: [*const u8; N],
        (quants, stride): (*const u8, usize),
        products: &mut [Products; 2],
        sums: &mut [[Sums<N>; 2]; 2],
        out: [*mut f32; N],
        valid: usize,
    ) {
        let encoding = q4k_encoding::<FIVE>();
        let group_block = encoding.group_block_bytes();
        let act_block = encoding.activation_block_bytes();
        let block = |b: usize| group.wrapping_add(b * group_block);
        let build = |b: usize, products: &mut Products| {
            let ahead = block(b).wrapping_add(AMX_K_QUANT_PREFETCH_BYTES);
            // SAFETY: super-block `b` lies inside the group (caller's contract).
            unsafe { q4k_products::<FIVE>(block(b), ahead, products) }
        };
        let mut acc = [_mm512_setzero_ps(); N];
        let bits = _mm512_set1_epi32(scale_base_bits::<FIVE>());
        let mut accumulate = |b: usize, [low, high]: &[Sums<N>; 2]| {
            // SAFETY: super-block `b` lies inside the group and every activation row.
            unsafe {
                let ends = Q4kBlockEnds::load(block(b));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let low = _mm512_load_si512(low.0[r].as_ptr().cast());
                    let high = _mm512_load_si512(high.0[r].as_ptr().cast());
                    let isum = _mm512_add_epi32(low, _mm512_sllv_epi32(high, bits));
                    *acc = ends.accumulate(xp[r].add(b * act_block), isum, *acc);
                }
            }
        };
        // Super-block `b`'s products and sums are in the sets `b % 2`. Building one super-block
        // ahead measured best (1024 × 4096 Q4_K, 16 rows: 533–541 thousand TSC ticks a pass
        // against 623–706 building two ahead, whose third set of 8 KiB crowds L1).
        build(0, &mut products[0]);
        for b in 0..blocks {
            let [now, next] = products
                .get_disjoint_mut([b % 2, (b + 1) % 2])
                .expect("distinct sets");
            let [running, done] = sums
                .get_disjoint_mut([b % 2, (b + 1) % 2])
                .expect("distinct sets");
            // SAFETY: super-block `b` of every aligned row (caller's contract).
            unsafe { q4k_tiles::<N>(quants.add(256 * b), stride, now, running) };
            if b + 1 < blocks {
                build(b + 1, next);
            }
            if b > 0 {
                accumulate(b - 1, done);
            }
        }
        accumulate(blocks - 1, &sums[(blocks - 1) % 2]);
        // SAFETY: forwarded contract on `out`.
        unsafe { store_group_results(&acc, out, valid) };
    }
}
