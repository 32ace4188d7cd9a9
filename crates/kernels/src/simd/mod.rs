//! Instruction-set levels and the once-per-process choice of one.
//!
//! Every kernel exists as a scalar reference (in its type's module) and, on x86-64, as AVX2+FMA
//! and AVX-512 versions (modules `avx2`, `avx512`). The level a process runs is decided once, the
//! first time [`level`] is called, and never changes afterwards: every row on a given machine
//! then goes through the same code, which is what makes a verify row bit-identical to a
//! single-token pass. Different levels sum in different orders, so their results differ in the
//! last bits (tests bound that difference against an f64 reference).
//!
//! The environment variable `SPECULA_SIMD` (`scalar`, `avx2`, `avx512`) lowers the level, e.g.
//! to compare levels in a benchmark; it can never raise it above what the CPU supports.
//!
//! This module holds all of the crate's `unsafe` code. The kernels in `avx2` and `avx512`
//! are `#[target_feature]` functions; the only callers are the safe entry points at the end of
//! this file (`float_accumulate`, `block32_accumulate`, `k_quant_accumulate`, `axpy`,
//! `weighted_sum`), which check [`SimdLevel::is_supported`] and every slice size the kernels'
//! unchecked loads rely on.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

/// Activation rows one weight-row pass of a multi-input kernel serves at most; callers with
/// more rows run further passes over the (by then cache-resident) weight row.
pub const MAX_ROWS_PER_PASS: usize = 8;

/// An instruction-set level a kernel can be compiled for, from slowest to fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, written so the compiler can vectorise it: the reference semantics.
    Scalar,
    /// AVX2 with FMA and F16C (x86-64, Haswell / Zen 1 and later).
    Avx2,
    /// AVX-512 F, BW, VL and VNNI on top of the AVX2 set (Ice Lake / Zen 4 and later).
    Avx512,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];

    /// Lower-case name, as accepted by `SPECULA_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
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
    if avx512 {
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
/// (1 ..= [`MAX_ROWS_PER_PASS`]): multi-input kernels are monomorphised per row count so
/// their per-row state lives in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! with_row_count {
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

/// The running sums of one (weight row, activation row) pair inside a SIMD kernel, kept
/// between calls so a row can be processed in column tiles: a kernel loads it into registers,
/// adds the tile's products in the level's fixed lane order, and stores it back. Splitting a
/// row into tiles at whole lane-chunk / block boundaries therefore changes no result bit.
///
/// Lanes used: float family 16 (AVX2) or 32 (AVX-512); 32-value blocks 8; K-quants 8 (AVX2)
/// or 16 (AVX-512). [`Accumulator::sum`] reduces them by the pairwise tree.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(64))]
pub struct Accumulator(pub(crate) [f32; 32]);

impl Accumulator {
    /// All lanes zero.
    pub const ZERO: Accumulator = Accumulator([0.0; 32]);

    /// Sums the first `lanes` lanes (a power of two) by the pairwise tree of
    /// `crate::f32::reduce_lanes`: lane `i` plus lane `i + width`, halving the width — the
    /// same additions, in the same order, as the kernels' horizontal sums.
    #[inline]
    pub fn sum(&self, lanes: usize) -> f32 {
        debug_assert!(lanes.is_power_of_two() && lanes <= 32);
        // Each halving step has a constant width, so it compiles to one vector add (a loop
        // over a run-time width compiled to a chain of scalar adds through memory, which cost
        // more than the multiplications of a short row).
        fn halve<const WIDTH: usize>(v: &mut [f32; 32]) {
            let (low, high) = v.split_at_mut(WIDTH);
            for (l, h) in low.iter_mut().zip(&high[..WIDTH]) {
                *l += *h;
            }
        }
        let mut v = self.0;
        if lanes >= 32 {
            halve::<16>(&mut v);
        }
        if lanes >= 16 {
            halve::<8>(&mut v);
        }
        if lanes >= 8 {
            halve::<4>(&mut v);
        }
        if lanes >= 4 {
            halve::<2>(&mut v);
        }
        if lanes >= 2 {
            halve::<1>(&mut v);
        }
        v[0]
    }
}

/// Activation rows of a multi-input dot product: row `b` starts at `data[b * stride]`, and
/// each row has `len` elements. Checked once by the dispatchers, so kernels can index freely.
#[derive(Debug)]
pub struct Rows<'a, T> {
    data: &'a [T],
    stride: usize,
    len: usize,
    count: usize,
}

// A view is copyable whatever the element type (derive would require `T: Copy`).
impl<T> Clone for Rows<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Rows<'_, T> {}

impl<'a, T> Rows<'a, T> {
    /// `count` rows of `len` elements, `stride` apart, inside `data`.
    ///
    /// # Panics
    ///
    /// If the rows do not fit in `data` or overlap (`stride < len`).
    pub fn new(data: &'a [T], stride: usize, len: usize, count: usize) -> Self {
        assert!(stride >= len, "rows: stride {stride} < row length {len}");
        if count > 0 {
            assert!(
                (count - 1) * stride + len <= data.len(),
                "rows: {count} rows of {len} (stride {stride}) do not fit in {}",
                data.len()
            );
        }
        Self {
            data,
            stride,
            len,
            count,
        }
    }

    /// One row.
    pub fn single(row: &'a [T]) -> Self {
        Self::new(row, row.len(), row.len(), 1)
    }

    /// Number of rows.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Elements per row.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the rows are empty (zero-length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Row `b`.
    #[inline]
    pub fn row(&self, b: usize) -> &'a [T] {
        assert!(b < self.count, "rows: row {b} of {}", self.count);
        &self.data[b * self.stride..][..self.len]
    }

    /// Rows `first .. first + count` as a new view.
    #[inline]
    pub fn sub(&self, first: usize, count: usize) -> Self {
        assert!(first + count <= self.count, "rows: sub-range out of bounds");
        if count == 0 {
            return Self {
                data: &self.data[..0],
                stride: self.stride,
                len: self.len,
                count,
            };
        }
        Self {
            data: &self.data[first * self.stride..],
            stride: self.stride,
            len: self.len,
            count,
        }
    }

    /// Columns `start .. start + len` of every row, as a new view (a column tile).
    #[inline]
    pub fn columns(&self, start: usize, len: usize) -> Self {
        assert!(start + len <= self.len, "rows: column range out of bounds");
        if self.count == 0 {
            return Self { len, ..*self };
        }
        Self {
            data: &self.data[start..],
            stride: self.stride,
            len,
            count: self.count,
        }
    }

    /// Pointer to the first element of row `b` (kernels index from it within `len`).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) fn ptr(&self, b: usize) -> *const T {
        debug_assert!(b < self.count);
        // Within bounds: `new` checked that every row fits in `data`.
        self.data[b * self.stride..].as_ptr()
    }
}

/// The outputs of one pass of activation rows (at most [`MAX_ROWS_PER_PASS`]) over a run of
/// weight rows: the product of the run's weight row `i` and activation row `b` goes to
/// `row(b)[i]`. Each row is a separate borrow, so thread chunks of weight rows can write their
/// runs of every output row in place (no staging buffer, no copy afterwards).
#[derive(Debug, Default)]
pub(crate) struct OutRows<'a> {
    rows: [&'a mut [f32]; MAX_ROWS_PER_PASS],
    count: usize,
}

impl<'a> OutRows<'a> {
    /// The rows `rows` yields (at most [`MAX_ROWS_PER_PASS`]).
    ///
    /// # Panics
    ///
    /// If it yields more.
    pub(crate) fn new(rows: impl IntoIterator<Item = &'a mut [f32]>) -> Self {
        let mut out = Self::default();
        for row in rows {
            assert!(
                out.count < MAX_ROWS_PER_PASS,
                "out rows: more than one pass"
            );
            out.rows[out.count] = row;
            out.count += 1;
        }
        out
    }

    /// Number of rows.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Outputs every row holds (the shortest row's length).
    pub(crate) fn len(&self) -> usize {
        self.rows[..self.count]
            .iter()
            .map(|r| r.len())
            .min()
            .unwrap_or(0)
    }

    /// Row `b`.
    pub(crate) fn row(&mut self, b: usize) -> &mut [f32] {
        assert!(b < self.count, "out rows: row {b} of {}", self.count);
        self.rows[b]
    }

    /// Every row split at `mid`: the outputs before and from `mid`.
    pub(crate) fn split_at(self, mid: usize) -> (Self, Self) {
        let (mut low, mut high) = (Self::default(), Self::default());
        for (b, row) in self.rows.into_iter().take(self.count).enumerate() {
            (low.rows[b], high.rows[b]) = row.split_at_mut(mid);
        }
        (low.count, high.count) = (self.count, self.count);
        (low, high)
    }

    /// Pointer to the first output of row `b` (kernels write within [`len`]).
    ///
    /// [`len`]: OutRows::len
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) fn ptr(&mut self, b: usize) -> *mut f32 {
        debug_assert!(b < self.count);
        self.rows[b].as_mut_ptr()
    }

    /// [`ptr`] of rows `0 .. N`.
    ///
    /// [`ptr`]: OutRows::ptr
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) fn ptrs<const N: usize>(&mut self) -> [*mut f32; N] {
        std::array::from_fn(|b| self.ptr(b))
    }
}

/// Runs `pass(rows, accumulators)` over consecutive groups of at most [`MAX_ROWS_PER_PASS`]
/// rows (used by every SIMD multi-input entry point).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn in_passes<T>(
    rows: Rows<'_, T>,
    acc: &mut [Accumulator],
    mut pass: impl FnMut(Rows<'_, T>, &mut [Accumulator]),
) {
    debug_assert_eq!(rows.count(), acc.len());
    for (g, group_acc) in acc.chunks_mut(MAX_ROWS_PER_PASS).enumerate() {
        let group = rows.sub(g * MAX_ROWS_PER_PASS, group_acc.len());
        pass(group, group_acc);
    }
}

/// Runs a kernel family's `accumulate` over `x` (any number of rows) in passes of at most
/// [`MAX_ROWS_PER_PASS`] rows, then writes each row's lane sum: the untiled multi-input dot
/// product every SIMD `dot_rows` is.
pub(crate) fn accumulate_and_sum<T>(
    x: Rows<'_, T>,
    out: &mut [f32],
    lanes: usize,
    mut accumulate: impl FnMut(Rows<'_, T>, &mut [Accumulator]),
) {
    if out.len() == 1 {
        // The common single-row call (e.g. one attention score) zeroes one accumulator only.
        let mut acc = [Accumulator::ZERO];
        accumulate(x, &mut acc);
        out[0] = acc[0].sum(lanes);
        return;
    }
    let mut acc = [Accumulator::ZERO; MAX_ROWS_PER_PASS];
    for (g, group_out) in out.chunks_mut(MAX_ROWS_PER_PASS).enumerate() {
        let acc = &mut acc[..group_out.len()];
        acc.fill(Accumulator::ZERO);
        accumulate(x.sub(g * MAX_ROWS_PER_PASS, group_out.len()), acc);
        for (o, a) in group_out.iter_mut().zip(acc.iter()) {
            *o = a.sum(lanes);
        }
    }
}

/// Block formats of a widened multi-input dot product ([`widened_accumulate_and_sum`]).
pub(crate) struct WidenedFormat {
    /// Bytes of one plain activation block.
    pub plain_block: usize,
    /// Bytes of one widened activation block.
    pub wide_block: usize,
    /// Bytes of the weight row per block.
    pub weight_block: usize,
}

/// Bytes of widened activations per row kept on the stack at a time.
const WIDEN_STEP_BYTES: usize = 2048;

/// [`accumulate_and_sum`] for kernels that multiply activation rows in a widened copy of
/// their plain blocks: each activation row is widened (`widen`) an even number of blocks at a
/// time into a stack buffer, and `accumulate` runs on the weight row's matching blocks.
pub(crate) fn widened_accumulate_and_sum(
    w: &[u8],
    x: Rows<'_, u8>,
    out: &mut [f32],
    lanes: usize,
    format: WidenedFormat,
    widen: impl Fn(&[u8], &mut [u8]),
    mut accumulate: impl FnMut(&[u8], Rows<'_, u8>, &mut [Accumulator]),
) {
    let WidenedFormat {
        plain_block,
        wide_block,
        weight_block,
    } = format;
    // An even number of blocks, so pairs of blocks stay together.
    let step = (WIDEN_STEP_BYTES / wide_block).max(2) & !1;
    assert!(
        step * wide_block <= WIDEN_STEP_BYTES,
        "widening: block too large"
    );
    let blocks = x.len() / plain_block;
    let mut wide = [0u8; MAX_ROWS_PER_PASS * WIDEN_STEP_BYTES];
    let mut acc = [Accumulator::ZERO; MAX_ROWS_PER_PASS];
    for (g, group_out) in out.chunks_mut(MAX_ROWS_PER_PASS).enumerate() {
        let group = x.sub(g * MAX_ROWS_PER_PASS, group_out.len());
        let acc = &mut acc[..group_out.len()];
        acc.fill(Accumulator::ZERO);
        for first in (0..blocks).step_by(step) {
            let count = step.min(blocks - first);
            let wide_row = count * wide_block;
            for (b, dst) in wide
                .chunks_exact_mut(wide_row)
                .take(group.count())
                .enumerate()
            {
                widen(
                    &group.row(b)[first * plain_block..][..count * plain_block],
                    dst,
                );
            }
            let wide_rows = Rows::new(
                &wide[..group.count() * wide_row],
                wide_row,
                wide_row,
                group.count(),
            );
            accumulate(
                &w[first * weight_block..][..count * weight_block],
                wide_rows,
                acc,
            );
        }
        for (o, a) in group_out.iter_mut().zip(acc.iter()) {
            *o = a.sum(lanes);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Safe entry points: check everything the unsafe kernels rely on, then call the level's kernel.
// ---------------------------------------------------------------------------------------------

/// Panics unless `level` is a SIMD level this CPU supports and there is one accumulator per
/// (weight row, activation row) pair.
fn check_simd_call<T>(level: SimdLevel, w: &Rows<'_, u8>, x: &Rows<'_, T>, acc: &[Accumulator]) {
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    assert_eq!(
        acc.len(),
        w.count() * x.count(),
        "accumulate: one accumulator per pair of rows"
    );
}

/// A level's kernel for one weight row times a pass of activation rows.
#[cfg(target_arch = "x86_64")]
type RowKernel<T> = unsafe fn(&[u8], Rows<'_, T>, &mut [Accumulator]);

/// The prefetch policy of the weight-row loops: with `prefetch_next`, the row after `i` is
/// asked for while row `i` is multiplied, and the given bytes (the caller's next row, or
/// nothing) while the last one is.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_after_row(w: &Rows<'_, u8>, i: usize, prefetch_next: Option<&[u8]>) {
    match prefetch_next {
        Some(_) if i + 1 < w.count() => prefetch(w.row(i + 1)),
        Some(after) => prefetch(after),
        None => {}
    }
}

/// Runs `kernel` for every weight row of `w` (pair `(i, b)` accumulating into
/// `acc[i * x.count() + b]`), prefetching as [`prefetch_after_row`] says.
///
/// # Safety
///
/// `kernel` must be safe to call with every row of `w` and `x` (its level supported, sizes as
/// it requires).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn for_each_weight_row<T>(
    kernel: RowKernel<T>,
    w: Rows<'_, u8>,
    x: Rows<'_, T>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    let p = x.count();
    for (i, row_acc) in acc.chunks_exact_mut(p.max(1)).enumerate().take(w.count()) {
        prefetch_after_row(&w, i, prefetch_next);
        // SAFETY: forwarded contract.
        unsafe { kernel(w.row(i), x, row_acc) };
    }
}

/// Float-family weight rows (`w`, encoding `encoding`) times f32 activation rows, accumulated
/// per pair; `prefetch_next` as in `for_each_weight_row`.
pub(crate) fn float_accumulate(
    encoding: crate::f32::FloatEncoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, f32>,
    acc: &mut [Accumulator],
    prefetch_next: Option<&[u8]>,
) {
    crate::f32::check_float_sizes(encoding, w.len(), x.len());
    check_simd_call(level, &w, &x, acc);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::f32::FloatEncoding as E;
        use avx2::{BF16, F16, F32};
        let kernel: RowKernel<f32> = match (level, encoding) {
            (SimdLevel::Avx2, E::F32) => avx2::float_rows::<F32>,
            (SimdLevel::Avx2, E::F16) => avx2::float_rows::<F16>,
            (SimdLevel::Avx2, E::BF16) => avx2::float_rows::<BF16>,
            (_, E::F32) => avx512::float_rows::<F32>,
            (_, E::F16) => avx512::float_rows::<F16>,
            (_, E::BF16) => avx512::float_rows::<BF16>,
        };
        // SAFETY: the level is supported and every weight row holds exactly `x.len()`
        // elements (checked above); every row of `x` is a checked view.
        unsafe { for_each_weight_row(kernel, w, x, acc, prefetch_next) }
    }
}

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
        use avx2::{Q4_0, Q8_0};
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

/// Panics unless `level` is AVX-512, there is at most one pass of activation rows, and `out`
/// holds every `b * stride + i` for weight row `i` and activation row `b`.
fn check_row_sums(
    level: SimdLevel,
    w: &Rows<'_, u8>,
    x: &Rows<'_, u8>,
    out: &[f32],
    stride: usize,
) {
    assert_eq!(level, SimdLevel::Avx512, "row sums: an AVX-512 kernel");
    level.assert_supported();
    assert!(x.count() <= MAX_ROWS_PER_PASS, "row sums: one pass of rows");
    assert!(w.count() <= stride, "row sums: outputs overlap");
    if x.count() > 0 && w.count() > 0 {
        assert!(
            (x.count() - 1) * stride + w.count() <= out.len(),
            "row sums: outputs do not fit"
        );
    }
}

/// The integer kernel families whose AVX-512 kernels finish whole rows in registers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowSumsEncoding {
    Block32(crate::q8_0::Block32Encoding),
    KQuant(crate::k_quants::KEncoding),
}

/// Integer-kernel weight rows (whole rows) times one pass of widened activation rows at
/// AVX-512: the product of weight row `i` and activation row `b` at `out[b * stride + i]`,
/// bit-identical to accumulating and summing (`*_accumulate`, [`Accumulator::sum`]).
pub(crate) fn row_sums(
    encoding: RowSumsEncoding,
    level: SimdLevel,
    w: Rows<'_, u8>,
    x: Rows<'_, u8>,
    out: &mut [f32],
    stride: usize,
    prefetch_next: Option<&[u8]>,
) {
    match encoding {
        RowSumsEncoding::Block32(e) => crate::q8_0::check_block32_sizes(e, level, w.len(), x.len()),
        RowSumsEncoding::KQuant(e) => crate::k_quants::check_sizes(e, level, w.len(), x.len()),
    }
    check_row_sums(level, &w, &x, out, stride);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::k_quants::KEncoding as K;
        use crate::q8_0::Block32Encoding as B;
        use avx2::{Q4_0, Q4_K, Q5_K, Q6_K, Q8_0};
        use RowSumsEncoding::{Block32, KQuant};
        let kernel: unsafe fn(&[u8], Rows<'_, u8>, &mut [f32], usize) = match encoding {
            Block32(B::Q8_0) => avx512::block32_row_sums::<Q8_0>,
            Block32(B::Q4_0) => avx512::block32_row_sums::<Q4_0>,
            KQuant(K::Q4K) => avx512::k_quant_row_sums::<Q4_K>,
            KQuant(K::Q5K) => avx512::k_quant_row_sums::<Q5_K>,
            KQuant(K::Q6K) => avx512::k_quant_row_sums::<Q6_K>,
        };
        for i in 0..w.count() {
            prefetch_after_row(&w, i, prefetch_next);
            // SAFETY: AVX-512 is supported; weight and activation rows hold the same whole
            // number of blocks and `out` holds every output (checked above).
            unsafe { kernel(w.row(i), x, &mut out[i..], stride) };
        }
    }
}

/// A run of interleaved groups of 16 weight rows times a pass of activation rows at AVX-512
/// ([`crate::interleaved::groups_pass`]), after checking every size the kernel indexes by.
pub(crate) fn interleaved_pass(
    encoding: crate::interleaved::Encoding,
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
) {
    SimdLevel::Avx512.assert_supported();
    crate::interleaved::check_pass_sizes(encoding, groups, &x, out, first, valid);
    if x.count() == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::interleaved::Encoding as E;
        type Kernel = unsafe fn(&[u8], Rows<'_, u8>, &mut OutRows<'_>, usize, usize);
        let kernel: Kernel = match encoding {
            E::Q8_0 => avx512::interleaved_pass::<{ avx2::Q8_0 }>,
            E::Q4_0 => avx512::interleaved_pass::<{ avx2::Q4_0 }>,
            E::Q4K => avx512::interleaved_q4k_pass,
        };
        // SAFETY: AVX-512 is supported and every size the kernel relies on is checked above.
        unsafe { kernel(groups, x, out, first, valid) }
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
        use avx2::{Q4_K, Q5_K, Q6_K};
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

/// `y += a · x` with fused multiply-adds at a SIMD `level`.
pub(crate) fn axpy(level: SimdLevel, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the lengths are equal (checked above).
    unsafe {
        match level {
            SimdLevel::Avx2 => avx2::axpy(a, x, y),
            _ => avx512::axpy(a, x, y),
        }
    }
}

/// `y += Σ_j weights[j] · rows[j]` (fused, rows in order) at a SIMD `level`.
pub(crate) fn weighted_sum(level: SimdLevel, weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
    assert_eq!(
        weights.len(),
        rows.count(),
        "weighted_sum: one weight per row"
    );
    assert_eq!(rows.len(), y.len(), "weighted_sum: row length");
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the sizes match (checked above).
    unsafe {
        match level {
            SimdLevel::Avx2 => avx2::weighted_sum(weights, rows, y),
            _ => avx512::weighted_sum(weights, rows, y),
        }
    }
}

/// One gated delta-rule step ([`crate::delta_rule::step`]) at a SIMD `level`.
pub(crate) fn delta_rule_step(
    level: SimdLevel,
    x: crate::delta_rule::DeltaInputs<'_>,
    state_in: &[f32],
    state_out: &mut [f32],
    out: &mut [f32],
) {
    let dim = x.k.len();
    assert!(
        x.q.len() == dim
            && out.len() == x.v.len()
            && state_in.len() == x.v.len() * dim
            && state_out.len() == state_in.len(),
        "delta rule: sizes"
    );
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the sizes match (checked above).
    unsafe {
        match level {
            SimdLevel::Avx2 => avx2::delta_rule_step(x, state_in, state_out, out),
            _ => avx512::delta_rule_step(x, state_in, state_out, out),
        }
    }
}

/// The exponentials and their sum of [`crate::activations::softmax_in_place_at`] at a SIMD
/// `level`: `x[i] = exp(x[i] - max)` in place, summed in the reference's lanes. The level's
/// kernels take the whole 16-value chunks; the tail runs as the scalar reference does it.
pub(crate) fn softmax_exp_sum(level: SimdLevel, x: &mut [f32]) -> f32 {
    use crate::activations::SOFTMAX_LANES;
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    let (body, tail) = x.split_at_mut(x.len() / SOFTMAX_LANES * SOFTMAX_LANES);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; `body` and `padded` are whole chunks of 16 values.
    let (mut lanes, padded) = unsafe {
        let body_max = match level {
            SimdLevel::Avx2 => avx2::max_of_chunks(body),
            _ => avx512::max_of_chunks(body),
        };
        let max = tail.iter().fold(body_max, |m, &v| m.max(v));
        // The tail as one more chunk, padded with `max` (whose exponential, 1, goes nowhere):
        // the kernel's exp has the scalar one's bits, so this is the scalar tail, vectorised.
        let mut padded = [max; SOFTMAX_LANES];
        padded[..tail.len()].copy_from_slice(tail);
        let lanes = match level {
            SimdLevel::Avx2 => {
                avx2::exp_sum_chunks(&mut padded, max);
                avx2::exp_sum_chunks(body, max)
            }
            _ => {
                avx512::exp_sum_chunks(&mut padded, max);
                avx512::exp_sum_chunks(body, max)
            }
        };
        (lanes, padded)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (mut lanes, padded): ([f32; SOFTMAX_LANES], [f32; SOFTMAX_LANES]) =
        unreachable!("no SIMD level is supported on this architecture");
    for (i, v) in tail.iter_mut().enumerate() {
        *v = padded[i];
        lanes[i] += *v;
    }
    lanes.iter().fold(0.0, |sum, &lane| sum + lane)
}

/// `silu(x)` in place at a SIMD `level` ([`crate::activations::silu_in_place`]).
pub(crate) fn silu_in_place(level: SimdLevel, x: &mut [f32]) {
    let out = x.as_mut_ptr();
    // SAFETY: one slice of `x.len()` values, read and written element by element.
    unsafe { gate_mul::<false>(level, out, None, out, x.len()) }
}

/// `gate = silu(gate) · up` at a SIMD `level` ([`crate::activations::swiglu_in_place`]).
pub(crate) fn swiglu_in_place(level: SimdLevel, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: sizes differ");
    let out = gate.as_mut_ptr();
    // SAFETY: both slices hold `gate.len()` values (checked above).
    unsafe { gate_mul::<false>(level, out, Some(up.as_ptr()), out, gate.len()) }
}

/// `x = f(gate) · x` at a SIMD `level` ([`crate::activations::gate_in_place`]).
pub(crate) fn gate_in_place(
    level: SimdLevel,
    kind: crate::activations::Gate,
    x: &mut [f32],
    gate: &[f32],
) {
    assert_eq!(x.len(), gate.len(), "gate: sizes differ");
    let out = x.as_mut_ptr();
    // SAFETY: both slices hold `x.len()` values (checked above).
    unsafe {
        match kind {
            crate::activations::Gate::Silu => {
                gate_mul::<false>(level, gate.as_ptr(), Some(out), out, x.len())
            }
            crate::activations::Gate::Sigmoid => {
                gate_mul::<true>(level, gate.as_ptr(), Some(out), out, x.len())
            }
        }
    }
}

/// The level's `gate_mul` kernel: `out[i] = f(gate[i]) · other[i]`, `f` SiLU or (`SIGMOID`)
/// the sigmoid.
///
/// # Safety
/// `gate` and `other` readable and `out` writable for `len` values (`out` may alias either).
unsafe fn gate_mul<const SIGMOID: bool>(
    level: SimdLevel,
    gate: *const f32,
    other: Option<*const f32>,
    out: *mut f32,
    len: usize,
) {
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; the pointers are the caller's contract.
    let done = unsafe {
        match level {
            SimdLevel::Avx2 => avx2::gate_mul::<SIGMOID>(gate, other, out, len),
            _ => avx512::gate_mul::<SIGMOID>(gate, other, out, len),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    // The tail through the scalar reference (the same bits).
    for i in done..len {
        // SAFETY: value `i < len` exists behind every pointer (caller's contract).
        unsafe {
            let g = *gate.add(i);
            let s = if SIGMOID {
                crate::activations::sigmoid(g)
            } else {
                crate::activations::silu(g)
            };
            *out.add(i) = match other {
                Some(other) => s * *other.add(i),
                None => s,
            };
        }
    }
}

/// The squares of `x` (squared in f32) summed in f64 into 8 lanes, value `i` into lane
/// `i % 8`, over the whole chunks of 8 at `level` (none at the scalar level); returns the lanes
/// and how many values they hold ([`crate::ops::rms_norm`]).
pub(crate) fn sum_squares_f64(level: SimdLevel, x: &[f32]) -> ([f64; 8], usize) {
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported.
    unsafe {
        match level {
            SimdLevel::Scalar => ([0.0; 8], 0),
            SimdLevel::Avx2 => avx2::sum_squares_f64(x),
            SimdLevel::Avx512 => avx512::sum_squares_f64(x),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    ([0.0; 8], 0)
}

/// `out[i] = (x[i] · scale) · weight[i]` for the whole registers among `x.len()` values at
/// `level` (none at the scalar level); returns how many it did. `out` may be `x`.
///
/// # Safety
///
/// `x` and `weight` readable and `out` writable for `len` values.
pub(crate) unsafe fn scale_mul(
    level: SimdLevel,
    x: *const f32,
    scale: f32,
    weight: *const f32,
    out: *mut f32,
    len: usize,
) -> usize {
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; the pointers are the caller's contract.
    unsafe {
        match level {
            SimdLevel::Scalar => 0,
            SimdLevel::Avx2 => avx2::scale_mul(x, scale, weight, out, len),
            SimdLevel::Avx512 => avx512::scale_mul(x, scale, weight, out, len),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Rotates the pairs `(first[i], second[i])` by `cos[i]`, `sin[i]` ([`crate::Rope::apply`]) for
/// the whole registers among them at `level` (none at the scalar level); returns how many it
/// did.
pub(crate) fn rotate_pairs(
    level: SimdLevel,
    first: &mut [f32],
    second: &mut [f32],
    cos: &[f32],
    sin: &[f32],
) -> usize {
    let len = first.len();
    assert!(
        second.len() == len && cos.len() == len && sin.len() == len,
        "rope: sizes differ"
    );
    level.assert_supported();
    let (x0, x1) = (first.as_mut_ptr(), second.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported; four slices of `len` values (checked above).
    unsafe {
        match level {
            SimdLevel::Scalar => 0,
            SimdLevel::Avx2 => avx2::rotate_pairs(x0, x1, cos.as_ptr(), sin.as_ptr(), len),
            SimdLevel::Avx512 => avx512::rotate_pairs(x0, x1, cos.as_ptr(), sin.as_ptr(), len),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// [`crate::q8_0::quantize_row`] with AVX-512 (which the caller checked is available; sizes
/// checked by the caller too).
pub(crate) fn quantize_q8_0_row(x: &[f32], out: &mut [u8]) {
    SimdLevel::Avx512.assert_supported();
    assert_eq!(
        x.len() / crate::q8_0::BLOCK_VALUES * crate::q8_0::BLOCK_BYTES,
        out.len()
    );
    assert_eq!(x.len() % crate::q8_0::BLOCK_VALUES, 0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512 is available and `out` holds one block per 32 values (checked above).
    unsafe {
        avx512::quantize_q8_0_row(x, out)
    }
}

/// [`crate::q8_k::quantize_row`] with AVX-512 (which the caller checked is available).
pub(crate) fn quantize_q8_k_row(x: &[f32], out: &mut [u8]) {
    SimdLevel::Avx512.assert_supported();
    assert_eq!(
        x.len() / crate::q8_k::BLOCK_VALUES * crate::q8_k::BLOCK_BYTES,
        out.len()
    );
    assert_eq!(x.len() % crate::q8_k::BLOCK_VALUES, 0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512 is available and `out` holds one block per 256 values (checked above).
    unsafe {
        avx512::quantize_q8_k_row(x, out)
    }
}

/// [`crate::attention::scores`] at a SIMD `level` (sizes checked by the caller).
pub(crate) fn attention_scores(
    level: SimdLevel,
    queries: Rows<'_, f32>,
    keys: crate::attention::CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
    stride: usize,
) {
    assert!(
        queries.len() == keys.len()
            && limits.len() == queries.count()
            && limits
                .iter()
                .enumerate()
                .all(|(q, &l)| l <= keys.count() && l <= stride && q * stride + l <= out.len()),
        "attention scores: sizes"
    );
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and every (query, key) pair written lies inside `out`
    // (checked above); `Rows` views are checked.
    unsafe {
        use crate::attention::CacheKind;
        let rows = keys.rows;
        match (level, keys.kind) {
            (SimdLevel::Avx2, CacheKind::F32) => {
                avx2::attention_scores::<{ avx2::F32 }>(queries, rows, limits, out, stride)
            }
            (SimdLevel::Avx2, CacheKind::F16) => {
                avx2::attention_scores::<{ avx2::F16 }>(queries, rows, limits, out, stride)
            }
            (_, CacheKind::F32) => {
                avx512::attention_scores::<{ avx2::F32 }>(queries, rows, limits, out, stride)
            }
            (_, CacheKind::F16) => {
                avx512::attention_scores::<{ avx2::F16 }>(queries, rows, limits, out, stride)
            }
        }
    }
}

/// [`crate::attention::weighted_sums`] at a SIMD `level` (sizes checked by the caller).
pub(crate) fn attention_weighted_sums(
    level: SimdLevel,
    probs: Rows<'_, f32>,
    values: crate::attention::CachedRows<'_>,
    limits: &[usize],
    out: &mut [f32],
) {
    assert!(
        out.len() == probs.count() * values.len()
            && limits.len() == probs.count()
            && limits
                .iter()
                .all(|&l| l <= values.count() && l <= probs.len()),
        "attention weighted sums: sizes"
    );
    assert!(
        level != SimdLevel::Scalar,
        "SIMD kernels run SIMD levels only"
    );
    level.assert_supported();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is supported and the sizes match (checked above).
    unsafe {
        use crate::attention::CacheKind;
        let rows = values.rows;
        match (level, values.kind) {
            (SimdLevel::Avx2, CacheKind::F32) => {
                avx2::attention_weighted_sums::<{ avx2::F32 }>(probs, rows, limits, out)
            }
            (SimdLevel::Avx2, CacheKind::F16) => {
                avx2::attention_weighted_sums::<{ avx2::F16 }>(probs, rows, limits, out)
            }
            (_, CacheKind::F32) => {
                avx512::attention_weighted_sums::<{ avx2::F32 }>(probs, rows, limits, out)
            }
            (_, CacheKind::F16) => {
                avx512::attention_weighted_sums::<{ avx2::F16 }>(probs, rows, limits, out)
            }
        }
    }
}

/// Asks the CPU to start loading `bytes` into the caches (a hint: no effect on results). The
/// column-tiled mat-vec prefetches the next weight row's piece while the current one is
/// multiplied, since the hardware prefetchers restart on every jump between rows.
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch never faults and changes no state visible to the program; the
        // address is inside `bytes`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
}

/// The bytes of an f32 slice (native order, which is the little-endian f32 weight encoding on
/// every target with SIMD kernels), so f32 vectors can go through the F32-weight kernels.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn u16_bytes(values: &[u16]) -> &[u8] {
    // SAFETY: u8 has alignment 1 and no invalid bit patterns; the byte view covers exactly the
    // same memory as `values` and borrows it for the same lifetime.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// The bytes of an f32 slice (see [`u16_bytes`] for u16).
pub(crate) fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: u8 has alignment 1 and no invalid bit patterns; the byte view covers exactly the
    // same memory as `values` and borrows it for the same lifetime.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_the_process_level_is_supported() {
        assert!(SimdLevel::Scalar < SimdLevel::Avx2 && SimdLevel::Avx2 < SimdLevel::Avx512);
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

    #[test]
    fn rows_views_check_their_bounds() {
        let data = [0u8; 11];
        let rows = Rows::new(&data, 4, 3, 3);
        assert_eq!(rows.row(2).len(), 3);
        assert_eq!(rows.sub(1, 2).row(1).as_ptr(), rows.row(2).as_ptr());
        assert!(std::panic::catch_unwind(|| Rows::new(&data[..10], 4, 3, 3)).is_err());
        assert!(std::panic::catch_unwind(|| Rows::new(&data, 2, 3, 1)).is_err());
    }
}
