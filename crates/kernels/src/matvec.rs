//! Weight matrices viewed over raw bytes, and the multi-input mat-vec.
//!
//! [`matmul`] multiplies a weight matrix with one or more activation rows. Activation rows are
//! first encoded for the weight type ([`WeightType::activation`]: f32, Q8_0 or Q8_K), once per
//! call. Output rows of the weight matrix are then split across the current rayon pool (run it
//! inside `pool.install`); each worker walks a contiguous range of weight rows, and for each
//! weight row runs the type's multi-input kernel (`dot_rows`), which decodes every weight block
//! once and dots it with up to [`simd::MAX_ROWS_PER_PASS`] activation rows — so a verify batch reads
//! the weights from memory once, not once per row.
//!
//! Every output element is computed by one fixed instruction sequence on the full weight row
//! and the full encoded activation row: nothing is split along the reduction, and each
//! activation row has its own accumulators inside a pass. So an element depends neither on the
//! thread count, nor on how rows were chunked, nor on how many activation rows were multiplied
//! together: row `b` of a batch is bit-identical to a single-row call with that activation.

use rayon::prelude::*;

use crate::simd::{self, Rows, SimdLevel};
use crate::{
    bf16, f16, f32, q4_0, q4_k, q5_k, q6_k, q8_0, q8_k, ActivationFormat, KernelError, WeightType,
};

/// Below this many multiply-adds a call runs on the calling thread only (the fork-join costs
/// more than it saves). Results are the same either way.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// A row-major weight matrix of `rows` rows of `cols` values, stored as `ty`, borrowed from
/// its encoded bytes (typically straight from a memory-mapped GGUF file).
///
/// In GGUF (ggml) shape order this is a tensor `{cols, rows}`.
#[derive(Debug, Clone, Copy)]
pub struct WeightMatrix<'a> {
    ty: WeightType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

impl<'a> WeightMatrix<'a> {
    /// Views `data` as `rows` rows of `cols` values of type `ty`, checking that `cols` is a
    /// whole number of blocks and that `data` has exactly the right size.
    pub fn new(
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let row_bytes = ty.row_bytes(cols).ok_or(KernelError::NotWholeBlocks {
            ty: ty.ggml(),
            n: cols,
            block: ty.block_values(),
        })?;
        let expected = row_bytes * rows;
        if data.len() != expected {
            return Err(KernelError::WrongByteLength {
                ty: ty.ggml(),
                n: rows * cols,
                expected,
                found: data.len(),
            });
        }
        Ok(Self {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    pub fn ty(&self) -> WeightType {
        self.ty
    }

    /// Number of rows (outputs of a mat-vec).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of values per row (inputs of a mat-vec).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of one encoded row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All the encoded bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// The encoded bytes of row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Decodes row `r` into `out` (`cols` values), e.g. an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        crate::dequantize_row_into(self.ty, self.row(r), out);
    }
}

/// Reusable buffers of [`matmul`], so that steady-state calls do not allocate.
#[derive(Debug, Default, Clone)]
pub struct MatmulScratch {
    /// Activation rows encoded for quantised weight types (Q8_0 or Q8_K rows).
    quantized: Vec<u8>,
    /// Multi-row results in weight-row-major order before they are transposed into place.
    staging: Vec<f32>,
}

impl MatmulScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// `out[b * rows + r] = dot(w.row(r), x[b * cols .. (b + 1) * cols])` for every activation row
/// `b` of `x` (`x.len()` is a multiple of `w.cols()`), at the process's [`simd::level`].
pub fn matmul(w: &WeightMatrix<'_>, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
    matmul_at(simd::level(), w, x, out, scratch);
}

/// [`matmul`] at an explicit SIMD `level` (which must be supported): for tests and benchmarks
/// that compare levels. Production code calls [`matmul`], so one process uses one level.
pub fn matmul_at(
    level: SimdLevel,
    w: &WeightMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (rows, cols) = (w.rows(), w.cols());
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "matmul: input is not whole rows of {cols}"
    );
    let n = x.len() / cols;
    assert_eq!(out.len(), n * rows, "matmul: output size");
    level.assert_supported();
    if n == 0 || rows == 0 {
        return;
    }
    let MatmulScratch { quantized, staging } = scratch;
    let dest: &mut [f32] = if n == 1 {
        out
    } else {
        staging.resize(n * rows, 0.0);
        staging
    };
    match w.ty().activation() {
        ActivationFormat::F32 => {
            let acts = Rows::new(x, cols, cols, n);
            let kernel = match w.ty() {
                WeightType::F32 => f32::dot_rows,
                WeightType::F16 => f16::dot_rows,
                _ => bf16::dot_rows,
            };
            for_each_weight_row(w, n, dest, |row, out| kernel(level, row, acts, out));
        }
        format => {
            let q_row = format
                .row_bytes(cols)
                .expect("weight rows are whole blocks");
            quantized.resize(n * q_row, 0);
            let encode = match format {
                ActivationFormat::Q8_0 => q8_0::quantize_row,
                _ => q8_k::quantize_row,
            };
            for (b, q) in quantized.chunks_exact_mut(q_row).enumerate() {
                encode(&x[b * cols..(b + 1) * cols], q);
            }
            let acts = Rows::new(&quantized[..n * q_row], q_row, q_row, n);
            let kernel = match w.ty() {
                WeightType::Q8_0 => q8_0::dot_rows,
                WeightType::Q4_0 => q4_0::dot_rows,
                WeightType::Q4K => q4_k::dot_rows,
                WeightType::Q5K => q5_k::dot_rows,
                _ => q6_k::dot_rows,
            };
            for_each_weight_row(w, n, dest, |row, out| kernel(level, row, acts, out));
        }
    }
    if n > 1 {
        for (r, results) in staging.chunks_exact(n).enumerate() {
            for (b, v) in results.iter().enumerate() {
                out[b * rows + r] = *v;
            }
        }
    }
}

/// Single-row [`matmul`]: `out[r] = dot(w.row(r), x)`.
pub fn matvec(w: &WeightMatrix<'_>, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
    assert_eq!(x.len(), w.cols(), "matvec: input size");
    matmul(w, x, out, scratch);
}

/// Runs `dot_rows(weight row r, dest[r * n .. (r + 1) * n])` for every weight row `r`,
/// splitting contiguous ranges of weight rows across the current rayon pool.
fn for_each_weight_row<F>(w: &WeightMatrix<'_>, n: usize, dest: &mut [f32], dot_rows: F)
where
    F: Fn(&[u8], &mut [f32]) + Sync,
{
    let rows = w.rows();
    let threads = rayon::current_num_threads().max(1);
    let chunk_rows = rows.div_ceil(threads * 4).max(4);
    let work = |(chunk, dst): (usize, &mut [f32])| {
        let first = chunk * chunk_rows;
        for (i, outputs) in dst.chunks_exact_mut(n).enumerate() {
            dot_rows(w.row(first + i), outputs);
        }
    };
    if threads == 1 || rows * w.cols() * n < PARALLEL_MIN_WORK {
        dest.chunks_mut(chunk_rows * n).enumerate().for_each(work);
    } else {
        dest.par_chunks_mut(chunk_rows * n)
            .enumerate()
            .for_each(work);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    fn run_in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Activation rows of `cols` values; a few rows have extreme or degenerate content.
    fn activations(n: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut x = random_vec(n * cols, 1.0, seed);
        if n > 2 {
            x[cols..2 * cols].iter_mut().for_each(|v| *v *= 1e4);
            x[2 * cols..3 * cols].iter_mut().for_each(|v| *v *= 1e-4);
        }
        if n > 3 {
            x[3 * cols..4 * cols].fill(0.0);
        }
        x
    }

    fn weight_data(ty: WeightType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        crate::quantize(ty.ggml(), &random_vec(rows * cols, 0.05, seed))
    }

    /// The guarantee speculative decoding rests on: for every type and every level this CPU
    /// runs, row `b` of an n-row matmul (n = 1..=8, and 11 = more than one pass) is bit-identical
    /// to a single-row matmul of that activation, whatever the thread count. 37 weight rows do
    /// not divide into the thread chunks evenly.
    #[test]
    fn batched_rows_are_bit_identical_to_single_rows_at_every_level() {
        let (rows, cols) = (37, 512);
        let max_n = 11;
        for ty in WeightType::ALL {
            let data = weight_data(ty, rows, cols, 80);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let x = activations(max_n, cols, 81);
            for level in SimdLevel::supported() {
                let mut scratch = MatmulScratch::new();
                let singles: Vec<Vec<f32>> = (0..max_n)
                    .map(|b| {
                        let mut out = vec![0.0; rows];
                        let row = &x[b * cols..(b + 1) * cols];
                        matmul_at(level, &w, row, &mut out, &mut scratch);
                        out
                    })
                    .collect();
                for n in (1..=8).chain([max_n]) {
                    for threads in [1, 2, 3] {
                        let batched = run_in_pool(threads, || {
                            let mut out = vec![0.0; n * rows];
                            matmul_at(level, &w, &x[..n * cols], &mut out, &mut scratch);
                            out
                        });
                        for (b, single) in singles.iter().take(n).enumerate() {
                            assert_eq!(
                                bits(&batched[b * rows..(b + 1) * rows]),
                                bits(single),
                                "{ty} at {level}: row {b} of {n} ({threads} threads)"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Float weights accept any row length: tails shorter than a SIMD chunk go through the
    /// same per-row code in a batch.
    #[test]
    fn float_types_stay_bit_identical_on_ragged_lengths() {
        let rows = 5;
        for cols in [1, 7, 31, 33, 100] {
            for ty in [WeightType::F32, WeightType::F16, WeightType::BF16] {
                let data = weight_data(ty, rows, cols, 82);
                let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let x = activations(3, cols, 83);
                for level in SimdLevel::supported() {
                    let mut scratch = MatmulScratch::new();
                    let mut batched = vec![0.0; 3 * rows];
                    matmul_at(level, &w, &x, &mut batched, &mut scratch);
                    for b in 0..3 {
                        let mut single = vec![0.0; rows];
                        matmul_at(
                            level,
                            &w,
                            &x[b * cols..(b + 1) * cols],
                            &mut single,
                            &mut scratch,
                        );
                        assert_eq!(
                            bits(&single),
                            bits(&batched[b * rows..(b + 1) * rows]),
                            "{ty} at {level}, cols {cols}, row {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matvec_matches_dequantised_reference() {
        let (rows, cols) = (17, 256);
        let weights = random_vec(rows * cols, 0.5, 90);
        let x = random_vec(cols, 1.0, 91);
        for ty in WeightType::ALL {
            let data = crate::quantize(ty.ggml(), &weights);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let mut out = vec![0.0; rows];
            matvec(&w, &x, &mut out, &mut MatmulScratch::new());
            let mut row = vec![0.0; cols];
            for (r, got) in out.iter().enumerate() {
                w.dequantize_row(r, &mut row);
                let reference: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                // Quantised types also quantise the activation: allow its error.
                let tol = match ty.activation() {
                    ActivationFormat::F32 => 1e-4,
                    _ => 0.05,
                };
                assert!(
                    (*got as f64 - reference).abs() < tol,
                    "{ty:?} row {r}: {got} vs {reference}"
                );
            }
        }
    }

    #[test]
    fn views_check_their_sizes() {
        let data = vec![0u8; 34 * 2];
        assert!(WeightMatrix::new(WeightType::Q8_0, 2, 32, &data).is_ok());
        assert!(matches!(
            WeightMatrix::new(WeightType::Q8_0, 1, 40, &data),
            Err(KernelError::NotWholeBlocks { .. })
        ));
        assert!(matches!(
            WeightMatrix::new(WeightType::Q8_0, 3, 32, &data),
            Err(KernelError::WrongByteLength { .. })
        ));
    }
}
