//! Attention scores over f16 keys in value-major groups of 16 positions
//! ([`crate::f16_keys`]): one kernel over [`F32Lanes`], instantiated for AVX2 and AVX-512, and
//! its safe entry point. A register's lanes are consecutive keys (a chunk: a whole group at
//! AVX-512, half of one at AVX2): per value `d`, each chunk's values widened once and one fused
//! multiply-add per query, so every lane takes the scalar reference's sequence.

use super::{Rows, SimdLevel};

/// [`crate::f16_keys::scores`] at a SIMD `level` (not scalar) over `keys`, whole groups of
/// `queries.len()` values covering the first `count` positions; `next` (what the caller reads
/// next) is prefetched into L2 as the kernel reads `keys`.
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
            && n > 0
            && count.div_ceil(crate::f16_keys::GROUP_POSITIONS) * group <= keys.len()
            && count <= stride
            && (n - 1) * stride + count <= out.len(),
        "f16 key scores: sizes"
    );
    level.assert_supported();
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (keys, next, out);
    #[cfg(target_arch = "x86_64")]
    {
        let keys = x86::Stream { keys, next };
        // SAFETY: the level is supported and the sizes are checked above.
        unsafe {
            match level {
                SimdLevel::Avx2 => x86::avx2(queries, keys, count, out, stride),
                _ => x86::avx512(queries, keys, count, out, stride),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::f16_keys::GROUP_POSITIONS;
    use crate::simd::lanes::{Avx2, Avx512, F32Lanes};
    use crate::simd::{prefetch_lines, Rows};

    /// Halves ahead of the one a kernel reads whose line it prefetches into L1: a block's
    /// groups are contiguous, read value by value (32 bytes a step per group), too slowly for
    /// the hardware prefetchers to run ahead of a pass from memory.
    const PREFETCH_AHEAD: usize = 512;

    /// The keys a kernel reads (each line fetched into L1 [`PREFETCH_AHEAD`] halves before it
    /// is read) and the ones its caller reads next (fetched into L2 as the kernel reaches the
    /// same place in its own: a burst of a whole block's prefetches at the start would overrun
    /// the core's miss buffers — a decode step's keys from DRAM took 89.6 µs that way against
    /// 50.7).
    #[derive(Clone, Copy)]
    pub(super) struct Stream<'a> {
        pub(super) keys: &'a [u16],
        pub(super) next: &'a [u16],
    }

    impl Stream<'_> {
        /// The same keys without the next ones: for query tiles after the first, whose
        /// prefetches the first issued.
        fn alone(self) -> Self {
            Self {
                keys: self.keys,
                next: &[],
            }
        }

        /// Prefetches the line at half `at` + [`PREFETCH_AHEAD`] of the keys into L1 and the
        /// line at half `at` of the next ones into L2.
        #[inline(always)]
        fn prefetch(&self, at: usize) {
            // A prefetch never faults: the address may run past the keys.
            let ahead = self.keys.as_ptr().wrapping_add(at + PREFETCH_AHEAD);
            prefetch_lines(ahead.cast(), 1, false);
            if at < self.next.len() {
                prefetch_lines(self.next[at..].as_ptr().cast(), 1, true);
            }
        }
    }

    /// [`scores`] at AVX2.
    ///
    /// # Safety
    ///
    /// AVX2, FMA and F16C are available; otherwise as [`scores`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        count: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: forwarded contract; the level's instructions are available.
        unsafe { scores::<Avx2>(queries, keys, count, out, stride) }
    }

    /// [`scores`] at AVX-512.
    ///
    /// # Safety
    ///
    /// AVX-512 is available; otherwise as [`scores`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn avx512(
        queries: Rows<'_, f32>,
        keys: Stream<'_>,
        count: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: forwarded contract; the level's instructions are available.
        unsafe { scores::<Avx512>(queries, keys, count, out, stride) }
    }

    /// Every query against every chunk of keys: tiles of `T` queries × `C` chunks, `T · C`
    /// independent multiply-add chains (8 where two or more queries are left, 4 for the last
    /// one: a 64-position block is 4 chunks at 16 lanes) to cover the FMA latency. At AVX2,
    /// six or more queries go in tiles of 6 × 2: fewer broadcasts and widenings per
    /// multiply-add (criterion `key-scores/f16-groups/hot/16q` on Zen 4: 199 µs in tiles of
    /// 8 × 1, 157 in 6 × 2; at AVX-512 6 × 2 took 183 µs against 152).
    ///
    /// # Safety
    ///
    /// `V`'s instructions are available; `keys.keys` holds the whole groups of the first
    /// `count` positions of `queries.len() > 0` values; `out` holds `count` scores per query
    /// at `stride`.
    #[inline(always)]
    unsafe fn scores<V: F32Lanes>(
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
            let at = (queries, keys, count, first);
            // SAFETY: forwarded contract; queries `first .. first + T` exist.
            unsafe {
                first += match n - first {
                    6.. if V::LANES == 8 => tile_rows::<V, 6, 2>(at, out, stride),
                    8.. => tile_rows::<V, 8, 1>(at, out, stride),
                    4..=7 => tile_rows::<V, 4, 2>(at, out, stride),
                    2 | 3 => tile_rows::<V, 2, 4>(at, out, stride),
                    _ => tile_rows::<V, 1, 4>(at, out, stride),
                };
            }
        }
    }

    /// Queries `first .. first + T` of `(queries, keys, count, first)` against every chunk,
    /// `C` chunks at a time (then one at a time); returns `T`.
    ///
    /// # Safety
    ///
    /// As [`scores`], with queries `first .. first + T` present.
    #[inline(always)]
    unsafe fn tile_rows<V: F32Lanes, const T: usize, const C: usize>(
        (queries, keys, count, first): (Rows<'_, f32>, Stream<'_>, usize, usize),
        out: &mut [f32],
        stride: usize,
    ) -> usize {
        let chunks = count.div_ceil(V::LANES);
        let q: [*const f32; T] = std::array::from_fn(|t| queries.ptr(first + t));
        let out = out.as_mut_ptr();
        let mut c = 0;
        // SAFETY: forwarded contract (score row `first + t` starts at `(first + t) · stride` of
        // `out`); chunks `c .. c + C` (or `c`) are below `chunks`.
        unsafe {
            let o: [*mut f32; T] = std::array::from_fn(|t| out.add((first + t) * stride));
            while c + C <= chunks {
                tile::<V, T, C>(q, queries.len(), keys, count, o, c);
                c += C;
            }
            while c < chunks {
                tile::<V, T, 1>(q, queries.len(), keys, count, o, c);
                c += 1;
            }
        }
        T
    }

    /// Queries `q` (of `dim` values) against chunks `c0 .. c0 + C` (keys `LANES · c ..` of
    /// each): per value one widened register per chunk and one fused multiply-add per (query,
    /// chunk); each chunk's scores stored for the positions below `count`.
    ///
    /// # Safety
    ///
    /// As [`scores`]; every query pointer reads `dim` values, every output pointer writes up to
    /// `count` scores, chunks `c0 .. c0 + C` hold positions below `count`.
    #[inline(always)]
    unsafe fn tile<V: F32Lanes, const T: usize, const C: usize>(
        q: [*const f32; T],
        dim: usize,
        keys: Stream<'_>,
        count: usize,
        o: [*mut f32; T],
        c0: usize,
    ) {
        let per_group = GROUP_POSITIONS / V::LANES;
        // Chunk `c`'s value 0: its group's first half, plus its place in the group.
        let base: [usize; C] = std::array::from_fn(|i| {
            let c = c0 + i;
            c / per_group * GROUP_POSITIONS * dim + c % per_group * V::LANES
        });
        // SAFETY: value `d < dim` of chunk `c` is `LANES` halves at `base + 16d`, inside
        // `keys.keys` (its group is whole); query values `d < dim`; scores `LANES · c + lane`
        // below `count` (the rest of a last chunk goes through `buf`).
        unsafe {
            let mut acc = [[V::splat(0.0); C]; T];
            for d in 0..dim {
                if d.is_multiple_of(2) {
                    // A line holds two values of a group: one prefetch per group.
                    for (i, &at) in base.iter().enumerate() {
                        if (c0 + i).is_multiple_of(per_group) {
                            keys.prefetch(at + GROUP_POSITIONS * d);
                        }
                    }
                }
                let k: [V; C] = std::array::from_fn(|i| {
                    V::load_f16(keys.keys.as_ptr().add(base[i] + GROUP_POSITIONS * d))
                });
                for (t, row) in acc.iter_mut().enumerate() {
                    let x = V::splat(*q[t].add(d));
                    for (a, &k) in row.iter_mut().zip(&k) {
                        *a = x.mul_add(k, *a);
                    }
                }
            }
            for (t, row) in acc.iter().enumerate() {
                for (i, scores) in row.iter().enumerate() {
                    let at = (c0 + i) * V::LANES;
                    let lanes = (count - at).min(V::LANES);
                    if lanes == V::LANES {
                        scores.store(o[t].add(at));
                    } else {
                        let mut buf = [0.0f32; GROUP_POSITIONS];
                        scores.store(buf.as_mut_ptr());
                        std::ptr::copy_nonoverlapping(buf.as_ptr(), o[t].add(at), lanes);
                    }
                }
            }
        }
    }
}
