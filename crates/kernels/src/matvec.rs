//! Weight matrices viewed over raw bytes, and the multi-row mat-vec.
//!
//! [`matmul`] multiplies a weight matrix with one or more activation rows. Output rows of the
//! weight matrix are split across the current rayon pool (run it inside `pool.install`); every
//! output element is computed by exactly one call of the type's `dot` on the full weight row
//! and the full (prepared) activation row. Nothing is ever split along the reduction, so an
//! element does not depend on the thread count, on how the rows were chunked, or on how many
//! activation rows were multiplied together: row `b` of a batch is bit-identical to a
//! single-row call with that activation.

use rayon::prelude::*;

use crate::{bf16, f16, f32, q8_0, KernelError, WeightType};

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
    /// Activation rows quantised for quantised weight types.
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
/// `b` of `x` (`x.len()` is a multiple of `w.cols()`).
///
/// Activation rows are prepared once per call for the weight type (quantised to Q8_0 for Q8_0
/// weights, left f32 otherwise); then each worker walks a contiguous range of weight rows and
/// computes all activation rows against each weight row, so a batch reads the weights once.
pub fn matmul(w: &WeightMatrix<'_>, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
    let (rows, cols) = (w.rows(), w.cols());
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "matmul: input is not whole rows of {cols}"
    );
    let n = x.len() / cols;
    assert_eq!(out.len(), n * rows, "matmul: output size");
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
    let input = |b: usize| &x[b * cols..(b + 1) * cols];
    match w.ty() {
        WeightType::F32 => for_each_output(w, n, dest, |row, b| f32::dot(row, input(b))),
        WeightType::F16 => for_each_output(w, n, dest, |row, b| f16::dot(row, input(b))),
        WeightType::BF16 => for_each_output(w, n, dest, |row, b| bf16::dot(row, input(b))),
        WeightType::Q8_0 => {
            let q_row = w.row_bytes();
            quantized.resize(n * q_row, 0);
            for (b, q) in quantized.chunks_exact_mut(q_row).enumerate() {
                q8_0::quantize_row(input(b), q);
            }
            let quantized = &*quantized;
            for_each_output(w, n, dest, |row, b| {
                q8_0::dot(row, &quantized[b * q_row..(b + 1) * q_row])
            });
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

/// Fills `dest[r * n + b] = dot(r, b)` over all weight rows `r` and activation rows `b`,
/// splitting contiguous ranges of weight rows across the current rayon pool.
fn for_each_output<F>(w: &WeightMatrix<'_>, n: usize, dest: &mut [f32], dot: F)
where
    F: Fn(&[u8], usize) -> f32 + Sync,
{
    let rows = w.rows();
    let threads = rayon::current_num_threads().max(1);
    let chunk_rows = rows.div_ceil(threads * 4).max(4);
    let work = |(chunk, dst): (usize, &mut [f32])| {
        let first = chunk * chunk_rows;
        for (i, outputs) in dst.chunks_exact_mut(n).enumerate() {
            let row = w.row(first + i);
            for (b, o) in outputs.iter_mut().enumerate() {
                *o = dot(row, b);
            }
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

    #[test]
    fn results_do_not_depend_on_threads_or_batch_size() {
        let (rows, cols, n) = (300, 4096 + 32, 5);
        for ty in WeightType::ALL {
            let weights = random_vec(rows * cols, 0.05, 80);
            let data = crate::quantize(ty.ggml(), &weights);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let x = random_vec(n * cols, 1.0, 81);

            let batched = |threads| {
                run_in_pool(threads, || {
                    let mut out = vec![0.0; n * rows];
                    matmul(&w, &x, &mut out, &mut MatmulScratch::new());
                    out
                })
            };
            let one = batched(1);
            for threads in [2, 3, 7] {
                assert_eq!(
                    bits(&one),
                    bits(&batched(threads)),
                    "{ty:?} threads={threads}"
                );
            }
            let mut scratch = MatmulScratch::new();
            for b in 0..n {
                let single = run_in_pool(3, || {
                    let mut out = vec![0.0; rows];
                    matvec(&w, &x[b * cols..(b + 1) * cols], &mut out, &mut scratch);
                    out
                });
                assert_eq!(
                    bits(&single),
                    bits(&one[b * rows..(b + 1) * rows]),
                    "{ty:?} row {b}"
                );
            }
        }
    }

    #[test]
    fn matvec_matches_dequantised_reference() {
        let (rows, cols) = (17, 96);
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
                // Q8_0 also quantises the activation: allow its error.
                let tol = if ty == WeightType::Q8_0 { 0.05 } else { 1e-4 };
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
