//! Float-family weight rows (F32 / F16 / BF16) × f32 activation rows, and the f32 vector
//! operations `axpy` and `weighted_sum`: the AVX2 and AVX-512 kernels and their safe entry
//! points.
//!
//! Per activation row, the kernels keep the lane-accumulator scheme of [`crate::f32`]: element
//! `i` in lane `i % 16` (AVX2, two ymm registers) or `i % 32` (AVX-512, two zmm registers),
//! fused multiply-adds, a zero-padded (AVX2) or masked (AVX-512) ragged tail.

use super::rows::check_simd_call;
#[cfg(target_arch = "x86_64")]
use super::rows::{for_each_weight_row, RowKernel};
use super::{Accumulator, Rows, SimdLevel};

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
        use super::x86::{BF16, F16, F32};
        use crate::f32::FloatEncoding as E;
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::simd::x86::avx2::{load8, load_lanes8, store_lanes8};
    use crate::simd::x86::{float_size, row_ptrs};
    use crate::simd::{Accumulator, Rows};

    /// Rows per pass of the float kernels: two ymm accumulators per row, so four rows (8 registers)
    /// leave room for the weights and loads.
    const FLOAT_ROWS_PER_PASS: usize = 4;

    /// Adds `w[i] · x_b[i]` for a float-family weight row into each row's accumulator: 16 lanes
    /// per row (element `i` in lane `i % 16`, two ymm registers), fused multiply-adds.
    ///
    /// # Safety
    ///
    /// AVX2, FMA and F16C must be available; `w` must hold `rows.len()` elements of `KIND`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn float_rows<const KIND: u8>(
        w: &[u8],
        rows: Rows<'_, f32>,
        acc: &mut [Accumulator],
    ) {
        debug_assert_eq!(w.len(), rows.len() * float_size(KIND));
        for (g, group_acc) in acc.chunks_mut(FLOAT_ROWS_PER_PASS).enumerate() {
            let group = rows.sub(g * FLOAT_ROWS_PER_PASS, group_acc.len());
            // SAFETY: forwarded contract; `group` rows are checked views of `rows`.
            unsafe {
                match group_acc.len() {
                    1 => float_pass::<KIND, 1>(w, group, group_acc),
                    2 => float_pass::<KIND, 2>(w, group, group_acc),
                    3 => float_pass::<KIND, 3>(w, group, group_acc),
                    _ => float_pass::<KIND, 4>(w, group, group_acc),
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_pass<const KIND: u8, const N: usize>(
        w: &[u8],
        rows: Rows<'_, f32>,
        state: &mut [Accumulator],
    ) {
        let size = float_size(KIND);
        let len = rows.len();
        let full = len / 16;
        let wp = w.as_ptr();
        let xp = row_ptrs::<f32, N>(&rows);
        let mut acc: [[__m256; 2]; N] =
            std::array::from_fn(|r| [load_lanes8(&state[r], 0), load_lanes8(&state[r], 8)]);
        for c in 0..full {
            // SAFETY: chunk `c` (16 elements) lies inside the weight row and every activation row.
            unsafe {
                let w0 = load8::<KIND>(wp.add(c * 16 * size));
                let w1 = load8::<KIND>(wp.add((c * 16 + 8) * size));
                for r in 0..N {
                    let x = xp[r].add(c * 16);
                    acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), acc[r][1]);
                }
            }
        }
        let rest = len - full * 16;
        if rest > 0 {
            // The tail runs as one more zero-padded chunk: 0 · 0 adds nothing to a lane.
            let mut w_tail = [0u8; 16 * 4];
            w_tail[..rest * size].copy_from_slice(&w[full * 16 * size..]);
            // SAFETY: `w_tail` holds 16 elements of any float encoding.
            let (w0, w1) = unsafe {
                (
                    load8::<KIND>(w_tail.as_ptr()),
                    load8::<KIND>(w_tail.as_ptr().add(8 * size)),
                )
            };
            for (r, a) in acc.iter_mut().enumerate() {
                let mut x_tail = [0.0f32; 16];
                x_tail[..rest].copy_from_slice(&rows.row(r)[full * 16..]);
                // SAFETY: `x_tail` holds 16 f32.
                unsafe {
                    a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x_tail.as_ptr()), a[0]);
                    a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x_tail.as_ptr().add(8)), a[1]);
                }
            }
        }
        for (s, a) in state.iter_mut().zip(acc) {
            store_lanes8(s, 0, a[0]);
            store_lanes8(s, 8, a[1]);
        }
    }

    /// `y += a · x` with one fused multiply-add per element (the same rounding in every lane and in
    /// the scalar tail, so the result does not depend on the length or alignment).
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; `x.len() == y.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), y.len());
        let av = _mm256_set1_ps(a);
        let full = x.len() / 8;
        for c in 0..full {
            // SAFETY: elements `8c .. 8c + 8` exist in both slices.
            unsafe {
                let yp = y.as_mut_ptr().add(c * 8);
                let v = _mm256_fmadd_ps(
                    av,
                    _mm256_loadu_ps(x.as_ptr().add(c * 8)),
                    _mm256_loadu_ps(yp),
                );
                _mm256_storeu_ps(yp, v);
            }
        }
        for (yv, xv) in y[full * 8..].iter_mut().zip(&x[full * 8..]) {
            *yv = a.mul_add(*xv, *yv);
        }
    }

    /// `y[i] = fma(w_j, v_j[i], y[i])` for `j = 0, 1, …` in order — exactly [`axpy`] once per row,
    /// but each chunk of `y` stays in registers across all rows.
    ///
    /// # Safety
    ///
    /// AVX2 and FMA must be available; `weights.len() == rows.count()` and
    /// `rows.len() == y.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn weighted_sum(weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
        debug_assert!(weights.len() == rows.count() && rows.len() == y.len());
        /// Registers of `y` kept live per sweep over the rows.
        const REGS: usize = 8;
        let len = y.len();
        let full = len / 8;
        let mut chunk = 0;
        while chunk < full {
            let used = (full - chunk).min(REGS);
            // SAFETY: registers cover elements `8 · chunk .. 8 · (chunk + used)`, inside `y` and
            // every row.
            unsafe {
                let yp = y.as_mut_ptr().add(8 * chunk);
                let mut acc: [__m256; REGS] = std::array::from_fn(|k| {
                    if k < used {
                        _mm256_loadu_ps(yp.add(8 * k))
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                for (j, &wj) in weights.iter().enumerate() {
                    let wv = _mm256_set1_ps(wj);
                    let vp = rows.ptr(j).add(8 * chunk);
                    for (k, a) in acc.iter_mut().enumerate().take(used) {
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vp.add(8 * k)), *a);
                    }
                }
                for (k, a) in acc.iter().enumerate().take(used) {
                    _mm256_storeu_ps(yp.add(8 * k), *a);
                }
            }
            chunk += used;
        }
        for (i, yv) in y.iter_mut().enumerate().skip(8 * full) {
            for (j, &wj) in weights.iter().enumerate() {
                *yv = wj.mul_add(rows.row(j)[i], *yv);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::simd::x86::avx512::{load16, load16_f32, load_lanes16, store_lanes16};
    use crate::simd::x86::{float_size, row_ptrs};
    use crate::simd::{in_passes, with_row_count, Accumulator, Rows};

    /// Adds `w[i] · x_b[i]` for a float-family weight row into each row's accumulator: 32 lanes
    /// per row (element `i` in lane `i % 32`, two zmm registers), fused multiply-adds.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `w` must hold `rows.len()` elements of `KIND`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn float_rows<const KIND: u8>(
        w: &[u8],
        rows: Rows<'_, f32>,
        acc: &mut [Accumulator],
    ) {
        debug_assert_eq!(w.len(), rows.len() * float_size(KIND));
        in_passes(rows, acc, |group, group_acc| {
            // SAFETY: forwarded contract.
            unsafe { with_row_count!(group_acc.len(), float_pass::<KIND>(w, group, group_acc)) }
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn float_pass<const KIND: u8, const N: usize>(
        w: &[u8],
        rows: Rows<'_, f32>,
        state: &mut [Accumulator],
    ) {
        let size = float_size(KIND);
        let len = rows.len();
        let wp = w.as_ptr();
        let xp = row_ptrs::<f32, N>(&rows);
        let mut acc: [[__m512; 2]; N] =
            std::array::from_fn(|r| [load_lanes16(&state[r], 0), load_lanes16(&state[r], 16)]);
        let full = len / 32;
        for c in 0..full {
            let i = 32 * c;
            // SAFETY: elements `i .. i + 32` are inside the weight row and every activation row.
            unsafe {
                let w0 = load16::<KIND>(wp.add(i * size), 16);
                let w1 = load16::<KIND>(wp.add((i + 16) * size), 16);
                for r in 0..N {
                    let x = xp[r].add(i);
                    acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), acc[r][1]);
                }
            }
        }
        let i = 32 * full;
        if i < len {
            // The partial last chunk: masked loads read only the elements that exist and give
            // zeros elsewhere (0 · 0 adds nothing to a lane).
            let first = (len - i).min(16);
            let second = (len - i).saturating_sub(16);
            // SAFETY: `first` elements from `i` and `second` from `i + 16` are inside the weight
            // row and every activation row; the second pointers may lie past the end when
            // `second` is 0 (wrapping arithmetic, never dereferenced: every lane is masked off).
            unsafe {
                let w0 = load16::<KIND>(wp.add(i * size), first);
                let w1 = load16::<KIND>(wp.wrapping_add((i + 16) * size), second);
                for r in 0..N {
                    let x = xp[r].add(i);
                    acc[r][0] = _mm512_fmadd_ps(w0, load16_f32(x, first), acc[r][0]);
                    acc[r][1] =
                        _mm512_fmadd_ps(w1, load16_f32(x.wrapping_add(16), second), acc[r][1]);
                }
            }
        }
        for (s, a) in state.iter_mut().zip(acc) {
            store_lanes16(s, 0, a[0]);
            store_lanes16(s, 16, a[1]);
        }
    }

    /// `y += a · x` with one fused multiply-add per element (bit-identical to the AVX2 version).
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `x.len() == y.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), y.len());
        let av = _mm512_set1_ps(a);
        let len = x.len();
        let full = len / 16;
        for c in 0..full {
            // SAFETY: elements `16c .. 16c + 16` exist in both slices.
            unsafe {
                let yp = y.as_mut_ptr().add(16 * c);
                let v = _mm512_fmadd_ps(
                    av,
                    _mm512_loadu_ps(x.as_ptr().add(16 * c)),
                    _mm512_loadu_ps(yp),
                );
                _mm512_storeu_ps(yp, v);
            }
        }
        let rest = len - 16 * full;
        if rest > 0 {
            let mask = (1u16 << rest) - 1;
            // SAFETY: `rest` elements from `16 · full` exist in both slices; masked lanes are not
            // accessed.
            unsafe {
                let yp = y.as_mut_ptr().add(16 * full);
                let v = _mm512_fmadd_ps(
                    av,
                    _mm512_maskz_loadu_ps(mask, x.as_ptr().add(16 * full)),
                    _mm512_maskz_loadu_ps(mask, yp),
                );
                _mm512_mask_storeu_ps(yp, mask, v);
            }
        }
    }

    /// `y[i] = fma(w_j, v_j[i], y[i])` for `j = 0, 1, …` in order — exactly [`axpy`] once per row,
    /// but each chunk of `y` stays in registers across all rows.
    ///
    /// # Safety
    ///
    /// The AVX-512 level must be available; `weights.len() == rows.count()` and
    /// `rows.len() == y.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn weighted_sum(weights: &[f32], rows: Rows<'_, f32>, y: &mut [f32]) {
        debug_assert!(weights.len() == rows.count() && rows.len() == y.len());
        /// Registers of `y` kept live per sweep over the rows.
        const REGS: usize = 8;
        let len = y.len();
        let mut start = 0;
        while start < len {
            let count = (len - start).min(16 * REGS);
            let masks: [u16; REGS] = std::array::from_fn(|k| {
                let lanes = count.saturating_sub(16 * k).min(16);
                if lanes == 16 {
                    0xffff
                } else {
                    (1u16 << lanes) - 1
                }
            });
            let used = count.div_ceil(16);
            // SAFETY: lane `l` of register `k` is element `start + 16k + l` of `y` and of every
            // row; masks cover exactly the elements that exist (a full mask loads plainly).
            unsafe {
                let load = |p: *const f32, mask: u16| {
                    if mask == 0xffff {
                        _mm512_loadu_ps(p)
                    } else {
                        _mm512_maskz_loadu_ps(mask, p)
                    }
                };
                let yp = y.as_mut_ptr().add(start);
                let mut acc: [__m512; REGS] = std::array::from_fn(|k| {
                    if k < used {
                        load(yp.add(16 * k), masks[k])
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                for (j, &wj) in weights.iter().enumerate() {
                    let wv = _mm512_set1_ps(wj);
                    let vp = rows.ptr(j).add(start);
                    for (k, (a, &mask)) in acc.iter_mut().zip(&masks).enumerate().take(used) {
                        *a = _mm512_fmadd_ps(wv, load(vp.add(16 * k), mask), *a);
                    }
                }
                for (k, (a, &mask)) in acc.iter().zip(&masks).enumerate().take(used) {
                    if mask == 0xffff {
                        _mm512_storeu_ps(yp.add(16 * k), *a);
                    } else {
                        _mm512_mask_storeu_ps(yp.add(16 * k), mask, *a);
                    }
                }
            }
            start += count;
        }
    }
}
