//! Attention scores over f16 keys in value-major groups of 16 positions
//! ([`crate::f16_keys`]): AVX2 and AVX-512 kernels and their safe entry point. A register's
//! lanes are keys (16 of a group at AVX-512, half a group at AVX2): per value `d`, the keys'
//! values widened once and one fused multiply-add per query, so each lane takes the scalar
//! reference's sequence.

use super::{Rows, SimdLevel};

/// [`crate::f16_keys::scores`] at a SIMD `level` (not scalar) over `keys`, whole groups of
/// `queries.len()` values covering the first `count` positions (sizes checked by the caller).
pub(crate) fn f16_key_scores(
    level: SimdLevel,
    queries: Rows<'_, f32>,
    keys: &[u16],
    next: &[u16],
    count: usize,
    out: &mut [f32],
    stride: usize,
) {
    let (dim, n) = (queries.len(), queries.count());
    let group = crate::f16_keys::GROUP_POSITIONS * dim;
    assert!(
        level != SimdLevel::Scalar
            && dim > 0
            && count.div_ceil(crate::f16_keys::GROUP_POSITIONS) * group <= keys.len()
            && count <= stride
            && (n - 1) * stride + count <= out.len(),
        "f16 key scores: sizes"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the sizes are checked above.
    unsafe {
        match level {
            SimdLevel::Avx2 => avx2::scores(queries, keys, count, out, stride),
            _ => avx512::scores(queries, Stream::new(keys, next), count, out, stride),
        }
    }
}

/// Halves ahead of the one a kernel reads whose line it prefetches into L1: a block's groups
/// are contiguous, read value by value (32 bytes a step per group), too slowly for the
/// hardware prefetchers to run ahead of a pass from memory.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 512;

/// The keys a kernel reads and the ones its caller reads next, prefetched into L2 as the
/// kernel reaches the same place in its own (a burst of a whole block's prefetches at the
/// start would overrun the core's miss buffers).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Stream<'a> {
    keys: &'a [u16],
    next: &'a [u16],
}

#[cfg(target_arch = "x86_64")]
impl<'a> Stream<'a> {
    fn new(keys: &'a [u16], next: &'a [u16]) -> Self {
        Self { keys, next }
    }

    /// The same keys without the next ones: for query tiles after the first, whose
    /// prefetches the first issued.
    fn alone(self) -> Self {
        Self {
            keys: self.keys,
            next: &[],
        }
    }

    /// Prefetches the lines at half `at` of the keys (`PREFETCH_AHEAD` ahead, into L1) and of
    /// the next ones (into L2).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn prefetch(&self, at: usize) {
        use super::x86::avx512::prefetch_line;
        // A prefetch never faults: the address may run past the keys.
        prefetch_line(
            self.keys.as_ptr().wrapping_add(at + PREFETCH_AHEAD).cast(),
            false,
        );
        if at < self.next.len() {
            prefetch_line(self.next.as_ptr().wrapping_add(at).cast(), true);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Stream;
    use crate::f16_keys::GROUP_POSITIONS;
    use crate::simd::Rows;

    /// Every query against every group: tiles of `T` queries × `G` groups, `T · G`
    /// independent multiply-add chains (8 where the queries allow) to cover the FMA latency.
    ///
    /// # Safety
    ///
    /// AVX-512 is available; `keys.keys` holds the whole groups of the first `count` positions
    /// of `queries.len() > 0` values; `out` holds `count` scores per query at `stride`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        count: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let n = queries.count();
        let mut first = 0;
        while first < n {
            let keys = if first == 0 { keys } else { keys.alone() };
            // SAFETY: forwarded contract; queries `first .. first + T` exist.
            unsafe {
                first += match n - first {
                    8.. => tile_rows::<8, 1>(queries, keys, count, out, stride, first),
                    4..=7 => tile_rows::<4, 2>(queries, keys, count, out, stride, first),
                    2 | 3 => tile_rows::<2, 4>(queries, keys, count, out, stride, first),
                    _ => tile_rows::<1, 8>(queries, keys, count, out, stride, first),
                };
            }
        }
    }

    /// Queries `first .. first + T` against every group, `G` groups at a time (then one at a
    /// time); returns `T`.
    ///
    /// # Safety
    ///
    /// As [`scores`], with queries `first .. first + T` present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_rows<const T: usize, const G: usize>(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        count: usize,
        out: &mut [f32],
        stride: usize,
        first: usize,
    ) -> usize {
        let groups = count.div_ceil(GROUP_POSITIONS);
        let q: [*const f32; T] = std::array::from_fn(|t| queries.ptr(first + t));
        let o: [*mut f32; T] = std::array::from_fn(|t| out[(first + t) * stride..].as_mut_ptr());
        let mut g = 0;
        // SAFETY: forwarded contract; groups `g .. g + G` (or `g`) are below `groups`.
        unsafe {
            while g + G <= groups {
                tile::<T, G>(q, queries.len(), keys, count, o, g);
                g += G;
            }
            while g < groups {
                tile::<T, 1>(q, queries.len(), keys, count, o, g);
                g += 1;
            }
        }
        T
    }

    /// Queries `q` (of `dim` values) against groups `g0 .. g0 + G`: per value one widened
    /// register per group and one fused multiply-add per (query, group); each group's scores
    /// stored for the positions below `count`.
    ///
    /// # Safety
    ///
    /// As [`scores`]; every query pointer reads `dim` values, every output pointer writes up
    /// to `count` scores, groups `g0 .. g0 + G` lie inside `keys`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<const T: usize, const G: usize>(
        q: [*const f32; T],
        dim: usize,
        keys: Stream<'_>,
        count: usize,
        o: [*mut f32; T],
        g0: usize,
    ) {
        let group = GROUP_POSITIONS * dim;
        // SAFETY: value `d < dim` of group `g0 + g` is 16 halves at `(g0 + g) · group + 16d`,
        // inside `keys`; query values `d < dim`; scores `16 (g0 + g) + lane < count`.
        unsafe {
            let base: [*const u16; G] =
                std::array::from_fn(|g| keys.keys.as_ptr().add((g0 + g) * group));
            let mut acc = [[_mm512_setzero_ps(); G]; T];
            for d in 0..dim {
                if d.is_multiple_of(2) {
                    for g in 0..G {
                        keys.prefetch((g0 + g) * group + GROUP_POSITIONS * d);
                    }
                }
                let k: [__m512; G] = std::array::from_fn(|g| {
                    _mm512_cvtph_ps(_mm256_loadu_si256(base[g].add(GROUP_POSITIONS * d).cast()))
                });
                for t in 0..T {
                    let x = _mm512_set1_ps(*q[t].add(d));
                    for g in 0..G {
                        acc[t][g] = _mm512_fmadd_ps(x, k[g], acc[t][g]);
                    }
                }
            }
            for (t, row) in acc.iter().enumerate() {
                for (g, scores) in row.iter().enumerate() {
                    let at = (g0 + g) * GROUP_POSITIONS;
                    let lanes = (count - at).min(GROUP_POSITIONS);
                    let mask: __mmask16 = if lanes == 16 {
                        0xffff
                    } else {
                        (1 << lanes) - 1
                    };
                    _mm512_mask_storeu_ps(o[t].add(at), mask, *scores);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::f16_keys::GROUP_POSITIONS;
    use crate::simd::Rows;

    /// Half a group's keys per register.
    const HALF: usize = GROUP_POSITIONS / 2;

    /// As the AVX-512 kernel with 8-lane registers, two per group: tiles of `T` queries × `G`
    /// groups.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA are available; otherwise as the AVX-512 kernel.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        queries: Rows<'_, f32>,
        keys: &[u16],
        count: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let n = queries.count();
        let mut first = 0;
        while first < n {
            // SAFETY: forwarded contract; queries `first .. first + T` exist.
            unsafe {
                first += match n - first {
                    4.. => tile_rows::<4, 1>(queries, keys, count, out, stride, first),
                    2 | 3 => tile_rows::<2, 2>(queries, keys, count, out, stride, first),
                    _ => tile_rows::<1, 2>(queries, keys, count, out, stride, first),
                };
            }
        }
    }

    /// Queries `first .. first + T` against every group, `G` groups at a time (then one at a
    /// time); returns `T`.
    ///
    /// # Safety
    ///
    /// As [`scores`], with queries `first .. first + T` present.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_rows<const T: usize, const G: usize>(
        queries: Rows<'_, f32>,
        keys: &[u16],
        count: usize,
        out: &mut [f32],
        stride: usize,
        first: usize,
    ) -> usize {
        let groups = count.div_ceil(GROUP_POSITIONS);
        let q: [*const f32; T] = std::array::from_fn(|t| queries.ptr(first + t));
        let o: [*mut f32; T] = std::array::from_fn(|t| out[(first + t) * stride..].as_mut_ptr());
        let mut g = 0;
        // SAFETY: forwarded contract; groups `g .. g + G` (or `g`) are below `groups`.
        unsafe {
            while g + G <= groups {
                tile::<T, G>(q, queries.len(), keys, count, o, g);
                g += G;
            }
            while g < groups {
                tile::<T, 1>(q, queries.len(), keys, count, o, g);
                g += 1;
            }
        }
        T
    }

    /// Queries `q` against groups `g0 .. g0 + G`, two 8-key registers per group.
    ///
    /// # Safety
    ///
    /// As the AVX-512 kernel's `tile`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<const T: usize, const G: usize>(
        q: [*const f32; T],
        dim: usize,
        keys: &[u16],
        count: usize,
        o: [*mut f32; T],
        g0: usize,
    ) {
        let group = GROUP_POSITIONS * dim;
        // SAFETY: as the AVX-512 kernel's; half `h` of value `d` of a group is 8 halves at
        // `16d + 8h`.
        unsafe {
            let base: [*const u16; G] =
                std::array::from_fn(|g| keys.as_ptr().add((g0 + g) * group));
            let mut acc = [[[_mm256_setzero_ps(); 2]; G]; T];
            for d in 0..dim {
                let k: [[__m256; 2]; G] = std::array::from_fn(|g| {
                    std::array::from_fn(|h| {
                        let at = base[g].add(GROUP_POSITIONS * d + HALF * h);
                        _mm256_cvtph_ps(_mm_loadu_si128(at.cast()))
                    })
                });
                for t in 0..T {
                    let x = _mm256_set1_ps(*q[t].add(d));
                    for g in 0..G {
                        for h in 0..2 {
                            acc[t][g][h] = _mm256_fmadd_ps(x, k[g][h], acc[t][g][h]);
                        }
                    }
                }
            }
            for (t, row) in acc.iter().enumerate() {
                for (g, halves) in row.iter().enumerate() {
                    for (h, scores) in halves.iter().enumerate() {
                        let at = (g0 + g) * GROUP_POSITIONS + HALF * h;
                        if at >= count {
                            continue;
                        }
                        let lanes = (count - at).min(HALF);
                        if lanes == HALF {
                            _mm256_storeu_ps(o[t].add(at), *scores);
                        } else {
                            let mut buf = [0.0f32; HALF];
                            _mm256_storeu_ps(buf.as_mut_ptr(), *scores);
                            std::ptr::copy_nonoverlapping(buf.as_ptr(), o[t].add(at), lanes);
                        }
                    }
                }
            }
        }
    }
}
