//! SIMD kernels: the instruction-set levels, the once-per-process choice of one, and the
//! hand-written AVX2 and AVX-512 kernels, one module per concern.
//!
//! Every kernel exists as a scalar reference (in its type's or operation's module) and, on
//! x86-64, as AVX2+FMA+F16C and AVX-512 versions. The level a process runs is decided once, the
//! first time [`level`] is called, and never changes afterwards: every row on a given machine
//! then goes through the same code, which is what makes a verify row bit-identical to a
//! single-token pass. Different levels sum in different orders, so their results differ in the
//! last bits (tests bound that difference against an f64 reference) — except `amx`, whose
//! tile kernels give `avx512`'s bits.
//!
//! The environment variable `SPECULA_SIMD` (`scalar`, `avx2`, `avx512`, `amx`) lowers the
//! level, e.g. to compare levels in a benchmark; it can never raise it above what the CPU
//! supports.
//!
//! # Layout
//!
//! One file per concern, each holding its AVX2 kernels (submodule `avx2`), its AVX-512 kernels
//! (`avx512`) and the safe entry points the rest of the crate calls (re-exported here), so a
//! change to one concern touches one file:
//!
//! - `float`: F32 / F16 / BF16 weight rows × f32 activation rows, `axpy`, `weighted_sum`;
//! - `block32`: Q8_0 / Q4_0 weight rows × Q8_0 activation rows (blocks of 32);
//! - `k_quant`: Q4_K / Q5_K / Q6_K weight rows × Q8_K activation rows (super-blocks of 256);
//! - `interleaved`: interleaved groups of 16 weight rows (its AVX2 kernels in
//!   `interleaved/avx2.rs`; Q8_0, Q4_K and Q5_K also on AMX tiles, module `amx`);
//! - `attention`: attention scores and weighted sums over one cached key / value head;
//! - `delta_rule`: the gated delta-rule step and its chains;
//! - `activations`: softmax's exponentials, SiLU, SwiGLU and sigmoid gates;
//! - `norm_rope`: RMSNorm's sum of squares and scaling, RoPE's pair rotation;
//! - `quantize`: Q8_0 / Q8_K activation quantisation (AVX-512 only).
//!
//! Shared by them: `rows` (the row views [`Rows`] and `OutRows`, the per-pair
//! [`Accumulator`], the loops that run a kernel over weight rows and passes of activation rows,
//! and the AVX-512 whole-row sums of the integer kernels), `x86` (the float-encoding tags
//! and the per-ISA helper intrinsics several concerns use: widening loads, accumulator lanes,
//! horizontal sums, prefetches), `tuning` (what the interleaved kernels choose per CPU
//! family: where and how far ahead they prefetch a weight matrix, a Q4_K scaling instruction)
//! and `lanes` (a register of f32 lanes, 8 or 16 wide: the kernels that differ between the
//! levels only in width — RMSNorm's scaling, RoPE's rotation, the activations' exponential,
//! SiLU, sigmoid and gates — are written once over it).
//!
//! # Multi-input kernels
//!
//! The mat-vec kernels (float, block32, k_quant, interleaved) read a weight row (or a column
//! tile of it) once per pass and dot it with up to [`MAX_ROWS_PER_PASS`] activation rows (fewer
//! for the AVX2 float kernels, whose per-row accumulators fill the 16 ymm registers sooner;
//! more for interleaved Q8_0, `MAX_Q8_0_PASS_ROWS`, and on AMX tiles).
//! Each activation row has its own accumulator ([`Accumulator`], loaded into registers at the
//! start and stored back at the end), updated by the same instruction sequence whatever the
//! number of rows in the pass, so a row's result does not depend on its neighbours: the
//! single-row `dot` of every type is the kernel with one row.
//!
//! # Safety
//!
//! This module tree holds nearly all of the crate's `unsafe` code. The kernels in the
//! `avx2` and `avx512` submodules are `#[target_feature]` functions; their only callers are
//! the safe entry points of the same file (`float_accumulate`, `block32_accumulate`,
//! `k_quant_accumulate`, `row_sums`, `interleaved_pass`, `axpy`, `weighted_sum`,
//! `attention_scores`, …), which check [`SimdLevel::is_supported`] and every slice size the
//! kernels' unchecked loads rely on. (`scale_mul` is itself `unsafe`: its caller,
//! `crate::ops`'s in-place RMSNorm, passes possibly aliasing pointers.)

use std::sync::OnceLock;

mod activations;
mod attention;
mod block32;
mod delta_rule;
mod f16_keys;
mod float;
mod interleaved;
mod k_quant;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod norm_rope;
mod quantize;
mod rows;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
mod tuning;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use activations::{gate_in_place, silu_in_place, softmax_exp_sum, swiglu_in_place};
pub(crate) use attention::{attention_scores, attention_weighted_sums};
pub(crate) use block32::block32_accumulate;
pub(crate) use delta_rule::{delta_rule_chain, delta_rule_replay, delta_rule_step};
pub(crate) use f16_keys::f16_key_scores;
pub(crate) use float::{axpy, float_accumulate, weighted_sum};
pub(crate) use interleaved::interleaved_pass;
pub(crate) use k_quant::k_quant_accumulate;
pub(crate) use norm_rope::{rotate_pairs, scale_mul, sum_squares_f64};
pub(crate) use quantize::{dequantize_q8_0_row, quantize_q8_0_row, quantize_q8_k_row};
pub(crate) use rows::{
    accumulate_and_sum, f32_bytes, prefetch_l2, prefetch_lines, row_sums,
    widened_accumulate_and_sum, OutRows, RowSumsEncoding, WidenedFormat,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use rows::{in_passes, u16_bytes};
pub use rows::{Accumulator, Rows};
#[cfg(test)]
pub(crate) use tuning::{amd_cpu, tests::for_each_tuning};

/// Activation rows one weight-row pass of a multi-input kernel serves at most; callers with
/// more rows run further passes over the weight row (row-major kernels: while it is in
/// cache; interleaved ones: over the whole matrix again, see `matvec`).
pub const MAX_ROWS_PER_PASS: usize = 8;

/// Activation rows one AVX-512 pass over interleaved Q8_0 weights serves at most: beyond
/// [`MAX_ROWS_PER_PASS`] each row sums in one `vpdpbusd` chain instead of two, and a pass of
/// 9–16 rows reads the weights once where two passes read them twice (Zen 4, 2 threads, a
/// 3072 × 1024 matrix from DRAM, one pass against two taking turns in one process, ms: 9 rows
/// 0.153–0.162 against 0.188–0.197, 12 rows 0.164–0.170 against 0.195–0.206, 16 rows even
/// with two chains per row and 7–15% cheaper with one). In a model's verify pass (qwen3-0.6b
/// Q8_0, both orders in one process) 9–16 rows cost 10–19% less.
pub(crate) const MAX_Q8_0_PASS_ROWS: usize = 16;

/// Activation rows one tile of the AMX kernels holds (a tile's 16 rows).
pub(crate) const MAX_TILE_ROWS: usize = 16;

/// Activation rows one pass of any kernel serves at most: the AMX Q8_0 kernel's two tiles of
/// rows.
pub(crate) const MAX_PASS_ROWS: usize = 2 * MAX_TILE_ROWS;

/// An instruction-set level a kernel can be compiled for, from slowest to fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, written so the compiler can vectorise it: the reference semantics.
    Scalar,
    /// AVX2 with FMA and F16C (x86-64, Haswell / Zen 1 and later).
    Avx2,
    /// AVX-512 F, BW, VL and VNNI on top of the AVX2 set (Ice Lake / Zen 4 and later).
    Avx512,
    /// AVX-512 plus AMX-INT8 tile multipliers the OS grants this process (Sapphire Rapids and
    /// later; see [`crate::amx`]): the AVX-512 kernels, with multi-row passes over interleaved
    /// Q8_0 weights on the tiles (bit-identical to the AVX-512 kernel).
    Amx,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Amx,
    ];

    /// Lower-case name, as accepted by `SPECULA_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Amx => "amx",
        }
    }

    /// The level named `name` (see [`SimdLevel::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.name() == name)
    }

    /// The best level this CPU supports (detected once).
    pub fn best_supported() -> Self {
        static BEST: OnceLock<SimdLevel> = OnceLock::new();
        *BEST.get_or_init(detect)
    }

    /// Whether this CPU can run code of this level.
    #[inline]
    pub fn is_supported(self) -> bool {
        self <= Self::best_supported()
    }

    /// Every level this CPU can run, lowest first (what tests iterate over).
    pub fn supported() -> impl Iterator<Item = SimdLevel> {
        Self::ALL.into_iter().filter(|l| l.is_supported())
    }

    /// Panics unless this CPU supports the level: the guard in front of every SIMD entry.
    #[inline]
    pub(crate) fn assert_supported(self) {
        assert!(
            self.is_supported(),
            "SIMD level {} is not supported by this CPU (best: {})",
            self.name(),
            Self::best_supported().name()
        );
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni");
    if avx512 && crate::amx::amx_support() == crate::amx::AmxSupport::Granted {
        SimdLevel::Amx
    } else if avx512 {
        SimdLevel::Avx512
    } else if avx2 {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// The level every kernel of this process runs: the best supported one, lowered by
/// `SPECULA_SIMD` when that names a lower level. Decided on the first call, fixed after.
pub fn level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = SimdLevel::best_supported();
        match std::env::var("SPECULA_SIMD") {
            Ok(name) => match SimdLevel::from_name(name.trim()) {
                Some(asked) => asked.min(best),
                None => best,
            },
            Err(_) => best,
        }
    })
}

/// Calls `$kernel::<G…, N>($args…)` (or `$kernel::<N>($args…)`) with `N` the const equal to `$n`
/// (1 ..= [`MAX_ROWS_PER_PASS`], or ..= [`MAX_Q8_0_PASS_ROWS`] after `wide:`): multi-input
/// kernels are monomorphised per row count so their per-row state lives in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! with_row_count {
    // `wide:` up to 16 rows ([`MAX_Q8_0_PASS_ROWS`]).
    (wide: $n:expr, $kernel:ident :: < $($generic:ident),* > ( $($arg:expr),* $(,)? )) => {
        match $n {
            9 => $kernel::<$($generic,)* 9>($($arg),*),
            10 => $kernel::<$($generic,)* 10>($($arg),*),
            11 => $kernel::<$($generic,)* 11>($($arg),*),
            12 => $kernel::<$($generic,)* 12>($($arg),*),
            13 => $kernel::<$($generic,)* 13>($($arg),*),
            14 => $kernel::<$($generic,)* 14>($($arg),*),
            15 => $kernel::<$($generic,)* 15>($($arg),*),
            16 => $kernel::<$($generic,)* 16>($($arg),*),
            n => with_row_count!(n, $kernel::<$($generic),*>($($arg),*)),
        }
    };
    ($n:expr, $kernel:ident :: < $($generic:ident),* > ( $($arg:expr),* $(,)? )) => {
        match $n {
            1 => $kernel::<$($generic,)* 1>($($arg),*),
            2 => $kernel::<$($generic,)* 2>($($arg),*),
            3 => $kernel::<$($generic,)* 3>($($arg),*),
            4 => $kernel::<$($generic,)* 4>($($arg),*),
            5 => $kernel::<$($generic,)* 5>($($arg),*),
            6 => $kernel::<$($generic,)* 6>($($arg),*),
            7 => $kernel::<$($generic,)* 7>($($arg),*),
            8 => $kernel::<$($generic,)* 8>($($arg),*),
            n => unreachable!("row pass of {n} rows"),
        }
    };
    // A kernel generic over the row count only.
    ($n:expr, $kernel:ident ( $($arg:expr),* $(,)? )) => {
        with_row_count!($n, $kernel::<>($($arg),*))
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use with_row_count;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_the_process_level_is_supported() {
        assert!(SimdLevel::Scalar < SimdLevel::Avx2 && SimdLevel::Avx2 < SimdLevel::Avx512);
        assert!(SimdLevel::Avx512 < SimdLevel::Amx);
        assert!(SimdLevel::Scalar.is_supported());
        assert!(level().is_supported());
        assert!(level() <= SimdLevel::best_supported());
        for l in SimdLevel::ALL {
            assert_eq!(SimdLevel::from_name(l.name()), Some(l));
        }
        assert_eq!(
            SimdLevel::supported().last(),
            Some(SimdLevel::best_supported())
        );
    }
}
