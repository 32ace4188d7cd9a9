//! x86-64 helpers shared by several concern modules: the float-family encoding tags (const
//! generic parameters of the float and attention kernels), raw loads and row pointers, and per
//! instruction set the helper intrinsics (`avx2`: widening loads of 8 values, accumulator
//! lanes, f16 scalars, the 8-lane horizontal sum; `avx512`: masked widening loads of 16 values,
//! accumulator lanes, the line prefetch, the start and finish of a 16-lane integer pass;
//! `amx`: the tile configuration and the tile instructions the AMX kernels issue).

use super::Rows;

/// Float-family weight encodings (const-generic tags, so each kernel is monomorphised).
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;

/// Bytes of one weight element of a float-family encoding.
pub(crate) const fn float_size(kind: u8) -> usize {
    match kind {
        F32 => 4,
        _ => 2,
    }
}

/// The little-endian f32 at `p`.
#[inline(always)]
pub(crate) unsafe fn load_f32(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees four readable bytes at `p`.
    unsafe { p.cast::<f32>().read_unaligned() }
}

/// Pointers to the first element of each of the `N` rows.
#[inline(always)]
pub(crate) fn row_ptrs<T, const N: usize>(rows: &Rows<'_, T>) -> [*const T; N] {
    std::array::from_fn(|r| rows.ptr(r))
}

/// AVX2 + FMA + F16C helpers.
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{F16, F32};
    use crate::simd::Accumulator;

    /// Loads 8 weights of encoding `KIND` from `p` and widens them to f32 (exactly).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn load8<const KIND: u8>(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 elements (8 * float_size(KIND) bytes) are readable at
        // `p`.
        unsafe {
            match KIND {
                F32 => _mm256_loadu_ps(p.cast()),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p.cast()),
                ))),
            }
        }
    }

    /// Lanes `first .. first + 8` of an accumulator.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn load_lanes8(acc: &Accumulator, first: usize) -> __m256 {
        let lanes = &acc.0[first..first + 8];
        // SAFETY: `lanes` is 8 readable f32.
        unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
    }

    /// Stores `v` to lanes `first .. first + 8` of an accumulator.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn store_lanes8(acc: &mut Accumulator, first: usize, v: __m256) {
        let lanes = &mut acc.0[first..first + 8];
        // SAFETY: `lanes` is 8 writable f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) }
    }

    /// The binary16 at `p` as f32 in all 8 lanes. The broadcast writes the whole register; a
    /// scalar conversion (`_mm_cvtss_f32` of the converted half, even of a broadcast one) was
    /// compiled into an insert merging into whatever register the compiler picked
    /// (`vpinsrw $0, mem, %xmm0, %xmmN`), a false dependency on its last writer.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn splat_f16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees two readable bytes at `p`.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
    }

    /// The sum of 8 lanes by the pairwise tree (lanes `i` and `i + 4`, then `i + 2`, then `i + 1`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn reduce8(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
    }
}

/// AVX-512 (F, BW, VL, VNNI) helpers.
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::{F16, F32};
    use crate::simd::Accumulator;

    /// Lanes `first .. first + 16` of an accumulator.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn load_lanes16(acc: &Accumulator, first: usize) -> __m512 {
        let lanes = &acc.0[first..first + 16];
        // SAFETY: `lanes` is 16 readable f32.
        unsafe { _mm512_loadu_ps(lanes.as_ptr()) }
    }

    /// Stores `v` to lanes `first .. first + 16` of an accumulator.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn store_lanes16(acc: &mut Accumulator, first: usize, v: __m512) {
        let lanes = &mut acc.0[first..first + 16];
        // SAFETY: `lanes` is 16 writable f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) }
    }

    /// The binary16 at `p` as f32 in all 16 lanes. The broadcast writes the whole register,
    /// where a scalar conversion broadcast afterwards was compiled into an insert merging into
    /// whatever register was free — once a weighted sum's accumulator, which chained every
    /// step of an 8-query tile over Q8_0 values behind the last (162 µs for 4,096 values
    /// against 83 µs over f16 ones).
    ///
    /// # Safety
    ///
    /// Two bytes are readable at `p`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn splat_f16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees two readable bytes at `p`.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16))
    }

    /// Loads the first `count` (≤ 16) weights of encoding `KIND` at `p`, zeros elsewhere, as f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn load16<const KIND: u8>(p: *const u8, count: usize) -> __m512 {
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
    pub(crate) unsafe fn load16_f32(p: *const f32, count: usize) -> __m512 {
        let mask = if count >= 16 {
            0xffff
        } else {
            (1u16 << count) - 1
        };
        // SAFETY: the caller guarantees `count` f32 are readable at `p`.
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }

    /// Prefetches the `bytes` (a group block) at `ahead` into L2 when `into_l2`, else into L1,
    /// a line at a time (how far ahead and where: [`crate::simd::tuning`]).
    ///
    /// Past the group's end `ahead` is the next group, stored right after it; a prefetch never
    /// faults, so the address may run past the matrix.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn prefetch_block(ahead: *const u8, bytes: usize, into_l2: bool) {
        let mut line = 0;
        while line < bytes {
            prefetch_line(ahead.wrapping_add(line), into_l2);
            line += 64;
        }
    }

    /// Prefetches the line at `at` into L2 when `into_l2`, else into L1.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub(crate) fn prefetch_line(at: *const u8, into_l2: bool) {
        match into_l2 {
            true => _mm_prefetch::<_MM_HINT_T1>(at.cast()),
            false => _mm_prefetch::<_MM_HINT_T0>(at.cast()),
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
    pub(crate) fn pass_start<const N: usize>(output: &PassOutput<'_>) -> [__m512; N] {
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
    pub(crate) fn pass_finish<const N: usize>(acc: [__m512; N], output: PassOutput<'_>) {
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
}

/// AMX tile helpers: the tile configuration a kernel makes current before its first tile
/// instruction. The tile instructions are inline assembly in the kernels (Rust has no stable
/// AMX intrinsics), each block declaring the tile registers it writes as clobbered
/// (`out("tmm0") _`), and loading a configuration all eight.
///
/// Only code running at [`crate::SimdLevel::Amx`] may call these: that level exists only where
/// [`crate::amx::amx_support`] found the tiles granted to this process.
pub(crate) mod amx {
    use std::arch::asm;

    /// A tile configuration (`LDTILECFG`'s 64-byte operand, palette 1): per tile register its
    /// rows and bytes per row; unused registers stay 0 (unconfigured).
    #[repr(C, align(64))]
    pub(crate) struct TileConfig([u8; 64]);

    impl TileConfig {
        /// Palette 1, no tile configured.
        pub(crate) const fn new() -> Self {
            let mut bytes = [0; 64];
            bytes[0] = 1;
            Self(bytes)
        }

        /// Tile register `tile` as `rows` rows of `row_bytes` bytes (at most 16 and 64).
        pub(crate) const fn tile(mut self, tile: usize, rows: usize, row_bytes: usize) -> Self {
            assert!(tile < 8 && rows <= 16 && row_bytes <= 64 && row_bytes.is_multiple_of(4));
            self.0[16 + 2 * tile] = row_bytes as u8;
            self.0[48 + tile] = rows as u8;
            self
        }

        /// Makes this the thread's tile configuration, loading it only when the one in force
        /// differs. `LDTILECFG` costs ~260 TSC ticks (Emerald Rapids Xeon, a loop of it alone),
        /// more than a short pass's tile work; reading the configuration in force back
        /// (`STTILECFG`, ~23) and comparing is cheap, and right whoever loaded it (another copy
        /// of this crate in another plugin on the same thread included). The configuration then
        /// stays (tiles in use) until another is loaded.
        ///
        /// # Safety
        ///
        /// The process runs at [`crate::SimdLevel::Amx`] (tiles granted).
        #[inline]
        pub(crate) unsafe fn make_current(&self) {
            let mut current = Self([0; 64]);
            // SAFETY: the caller guarantees AMX is usable; `STTILECFG` writes 64 bytes (zeros
            // when no configuration is in force) into `current`, and `LDTILECFG` reads 64.
            unsafe {
                asm!("sttilecfg [{}]", in(reg) current.0.as_mut_ptr(), options(nostack));
                if current.0 != self.0 {
                    asm!(
                        "ldtilecfg [{}]",
                        in(reg) self.0.as_ptr(),
                        out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                        out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                        options(nostack, readonly),
                    );
                }
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The configuration in force on this thread.
        fn in_force() -> [u8; 64] {
            let mut current = TileConfig([0; 64]);
            // SAFETY: only called where the tiles are granted; writes 64 bytes.
            unsafe { asm!("sttilecfg [{}]", in(reg) current.0.as_mut_ptr(), options(nostack)) };
            current.0
        }

        /// `make_current` leaves its configuration in force whatever was loaded before it —
        /// also behind its back (another copy of this crate on the same thread).
        #[test]
        fn make_current_puts_its_configuration_in_force() {
            if crate::SimdLevel::best_supported() < crate::SimdLevel::Amx {
                eprintln!("skipped: no AMX tiles granted on this machine");
                return;
            }
            let eight = TileConfig::new().tile(0, 8, 32).tile(1, 8, 64);
            let sixteen = TileConfig::new().tile(0, 16, 32).tile(1, 8, 64);
            // SAFETY: the tiles are granted (checked above).
            unsafe {
                eight.make_current();
                assert_eq!(in_force(), eight.0);
                eight.make_current();
                assert_eq!(in_force(), eight.0);
                // Another loader, not through `make_current`.
                asm!("ldtilecfg [{}]", in(reg) sixteen.0.as_ptr(), options(nostack, readonly));
                eight.make_current();
                assert_eq!(in_force(), eight.0);
                asm!("tilerelease", options(nostack, nomem));
                assert_eq!(in_force(), [0; 64]);
                sixteen.make_current();
                assert_eq!(in_force(), sixteen.0);
                asm!("tilerelease", options(nostack, nomem));
            }
        }
    }
}
