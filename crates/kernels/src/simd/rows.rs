//! What every SIMD concern shares: the row views ([`Rows`] of activations, [`OutRows`] of
//! outputs), the per-pair [`Accumulator`] that lets a row be processed in column tiles, the
//! loops that run a level's kernel over passes of activation rows and over weight rows (with
//! the prefetch of the next weight row), the AVX-512 whole-row sums of the integer kernels
//! ([`row_sums`]), and byte views of f32 / u16 slices.

#[cfg(target_arch = "x86_64")]
use super::{block32, k_quant};
use super::{SimdLevel, MAX_PASS_ROWS, MAX_ROWS_PER_PASS};

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

    /// Elements from the start of one row to the start of the next.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn stride(&self) -> usize {
        self.stride
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

/// The outputs of one pass of activation rows (at most [`MAX_PASS_ROWS`]) over a run of
/// weight rows: the product of the run's weight row `i` and activation row `b` goes to
/// `row(b)[i]`. Each row is a separate borrow, so thread chunks of weight rows can write their
/// runs of every output row in place (no staging buffer, no copy afterwards).
#[derive(Debug, Default)]
pub(crate) struct OutRows<'a> {
    rows: [&'a mut [f32]; MAX_PASS_ROWS],
    count: usize,
}

impl<'a> OutRows<'a> {
    /// The rows `rows` yields (at most [`MAX_PASS_ROWS`]).
    ///
    /// # Panics
    ///
    /// If it yields more.
    pub(crate) fn new(rows: impl IntoIterator<Item = &'a mut [f32]>) -> Self {
        let mut out = Self::default();
        for row in rows {
            assert!(out.count < MAX_PASS_ROWS, "out rows: more than one pass");
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
// The weight-row loops of the mat-vec entry points
// ---------------------------------------------------------------------------------------------

/// Panics unless `level` is a SIMD level this CPU supports and there is one accumulator per
/// (weight row, activation row) pair.
pub(super) fn check_simd_call<T>(
    level: SimdLevel,
    w: &Rows<'_, u8>,
    x: &Rows<'_, T>,
    acc: &[Accumulator],
) {
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
pub(super) type RowKernel<T> = unsafe fn(&[u8], Rows<'_, T>, &mut [Accumulator]);

/// The prefetch policy of the weight-row loops: with `prefetch_next`, the row after `i` is
/// asked for while row `i` is multiplied, and the given bytes (the caller's next row, or
/// nothing) while the last one is.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_after_row(w: &Rows<'_, u8>, i: usize, prefetch_next: Option<&[u8]>) {
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
pub(super) unsafe fn for_each_weight_row<T>(
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

/// Panics unless `level` is AVX-512, there is at most one pass of activation rows, and `out`
/// holds every `b * stride + i` for weight row `i` and activation row `b`.
fn check_row_sums(
    level: SimdLevel,
    w: &Rows<'_, u8>,
    x: &Rows<'_, u8>,
    out: &[f32],
    stride: usize,
) {
    assert!(level >= SimdLevel::Avx512, "row sums: an AVX-512 kernel");
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
        use block32::{Q4_0, Q8_0};
        use k_quant::{Q4_K, Q5_K, Q6_K};
        use RowSumsEncoding::{Block32, KQuant};
        let kernel: unsafe fn(&[u8], Rows<'_, u8>, &mut [f32], usize) = match encoding {
            Block32(B::Q8_0) => block32::avx512::block32_row_sums::<Q8_0>,
            Block32(B::Q4_0) => block32::avx512::block32_row_sums::<Q4_0>,
            KQuant(K::Q4K) => k_quant::avx512::k_quant_row_sums::<Q4_K>,
            KQuant(K::Q5K) => k_quant::avx512::k_quant_row_sums::<Q5_K>,
            KQuant(K::Q6K) => k_quant::avx512::k_quant_row_sums::<Q6_K>,
        };
        for i in 0..w.count() {
            prefetch_after_row(&w, i, prefetch_next);
            // SAFETY: AVX-512 is supported; weight and activation rows hold the same whole
            // number of blocks and `out` holds every output (checked above).
            unsafe { kernel(w.row(i), x, &mut out[i..], stride) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefetch and byte views
// ---------------------------------------------------------------------------------------------

/// Asks the CPU to start loading `bytes` into the caches (a hint: no effect on results). The
/// column-tiled mat-vec prefetches the next weight row's piece while the current one is
/// multiplied, since the hardware prefetchers restart on every jump between rows.
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    prefetch_into(bytes, false);
}

/// [`prefetch`] into L2 only: for data read a while later (an attention kernel's next cache
/// block), which into L1 would hold up the few L1 miss buffers the data in use needs.
#[inline]
pub(crate) fn prefetch_l2(bytes: &[u8]) {
    prefetch_into(bytes, true);
}

#[inline]
fn prefetch_into(bytes: &[u8], l2: bool) {
    prefetch_lines(bytes.as_ptr(), bytes.len(), l2);
}

/// Prefetches the `len` bytes from `start` a line (64 bytes) at a time, into L2 when `l2`, else
/// into L1: [`prefetch`] / [`prefetch_l2`] for a kernel that has a row's address and length
/// rather than a slice (a step and a compare per line, no slicing).
#[inline]
pub(crate) fn prefetch_lines(start: *const u8, len: usize, l2: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let mut offset = 0;
        while offset < len {
            let line = start.wrapping_add(offset).cast();
            // SAFETY: a prefetch never faults and changes no state visible to the program.
            unsafe {
                if l2 {
                    _mm_prefetch::<_MM_HINT_T1>(line);
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(line);
                }
            }
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len, l2);
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
    fn rows_views_check_their_bounds() {
        let data = [0u8; 11];
        let rows = Rows::new(&data, 4, 3, 3);
        assert_eq!(rows.row(2).len(), 3);
        assert_eq!(rows.sub(1, 2).row(1).as_ptr(), rows.row(2).as_ptr());
        assert!(std::panic::catch_unwind(|| Rows::new(&data[..10], 4, 3, 3)).is_err());
        assert!(std::panic::catch_unwind(|| Rows::new(&data, 2, 3, 1)).is_err());
    }
}
