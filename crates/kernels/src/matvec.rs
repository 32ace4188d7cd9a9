//! Weight matrices viewed over raw bytes, and the multi-input mat-vec.
//!
//! [`matmul`] multiplies a weight matrix with one or more activation rows. Activation rows are
//! first encoded for the weight type ([`WeightType::activation`]: f32, Q8_0 or Q8_K), once per
//! call (several rows on the pool's threads), or once for all the matrices of a
//! [`matmul_many`] that share an input (a layer's q, k and v projections). Output rows of the
//! weight matrix are then split across the current rayon pool (run it inside `pool.install`)
//! in contiguous ranges. Within a range, a small group of weight rows is multiplied with a
//! pass of up to [`simd::MAX_ROWS_PER_PASS`] activation rows: the kernels decode each weight
//! block once and dot it with every activation row of the pass — so a verify batch reads the
//! weights from memory once, not once per row — while the next weight row is prefetched.
//! Passes whose activations would not fit the L2 are split into column tiles, each tile kept
//! in cache while the group's weight rows stream through.
//!
//! An interleaved matrix ([`Layout::Interleaved`], see [`crate::interleaved`]) is split across
//! threads in whole 16-row groups instead, each group multiplied with every pass of activation
//! rows by the interleaved kernel; the same rules hold for it.
//!
//! Every output element is computed by one fixed sequence of operations on the full weight row
//! and the full encoded activation row: each (weight row, activation row) pair has its own
//! accumulator ([`simd::Accumulator`]) carried from tile to tile, tiles split rows only at whole
//! kernel chunks, and nothing is ever split along the reduction across threads. So an element
//! depends neither on the thread count, nor on the tiling, nor on how many activation rows were
//! multiplied together: row `b` of a batch is bit-identical to a single-row call with that
//! activation.

use rayon::prelude::*;

use crate::simd::{
    self, Accumulator, OutRows, RowSumsEncoding, Rows, SimdLevel, MAX_ROWS_PER_PASS,
};
use crate::types::{AccumulateFn, DotRowsFn, Kernels};
use crate::{interleaved, q8_0, q8_k, ActivationFormat, KernelError, WeightType};

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
    layout: Layout,
    data: &'a [u8],
}

/// How a [`WeightMatrix`]'s bytes are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Row after row, as in the GGUF file.
    RowMajor,
    /// Groups of 16 rows interleaved block by block ([`crate::interleaved`]).
    Interleaved,
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
            layout: Layout::RowMajor,
            data,
        })
    }

    /// Views repacked bytes (built by [`crate::interleaved::InterleavedMatrix`], which checked
    /// their size).
    pub(crate) fn interleaved(ty: WeightType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        Self {
            ty,
            rows,
            cols,
            row_bytes: ty
                .row_bytes(cols)
                .expect("interleaved rows are whole blocks"),
            layout: Layout::Interleaved,
            data,
        }
    }

    /// How the bytes are arranged.
    pub fn layout(&self) -> Layout {
        self.layout
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

    /// Bytes of one encoded row (in the file's row-major layout).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All the encoded bytes, in this matrix's [`Layout`].
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// The encoded bytes of row `r` of a row-major matrix.
    ///
    /// # Panics
    ///
    /// If the matrix is interleaved (its rows are not contiguous).
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert_eq!(
            self.layout,
            Layout::RowMajor,
            "row {r} of an interleaved matrix"
        );
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Decodes row `r` into `out` (`cols` values), e.g. an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self.layout {
            Layout::RowMajor => crate::dequantize_row_into(self.ty, self.row(r), out),
            Layout::Interleaved => {
                assert_eq!(out.len(), self.cols, "dequantize_row: output size");
                let encoding = interleaved::encoding(self.ty).expect("interleavable type");
                interleaved::dequantize_row(encoding, self.data, r, out);
            }
        }
    }
}

/// Reusable buffers of [`matmul`], so that steady-state calls do not allocate.
#[derive(Debug, Default, Clone)]
pub struct MatmulScratch {
    /// Activation rows encoded for quantised weight types (Q8_0 or Q8_K rows, in the widened
    /// format of the SIMD level where it has one).
    quantized: Vec<u8>,
    /// The quantised rows on their way to being widened (one per activation row).
    row_buffer: Vec<u8>,
    /// What `quantized` holds, for the next matrix of a [`matmul_many`] to reuse.
    encoded: Option<EncodedRows>,
    /// Multi-row results, each thread chunk's activation-row-major, before they are copied
    /// into place.
    staging: Vec<f32>,
}

impl MatmulScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// Weight rows multiplied together over one activation tile (their accumulators for a pass
/// take `8 · 128` bytes each).
const WEIGHT_ROWS_PER_GROUP: usize = 8;

/// Bytes of activations (one pass of rows, one column tile) beyond which a pass is split into
/// column tiles, so its activations stay in L2 while a group of weight rows streams through.
///
/// Measured on this Zen 4 (1 thread, 4 and 8 rows, 4096 and 14336 columns, every type): with
/// the next weight row prefetched, untiled passes are as fast or faster than L1-sized tiles
/// (f32 8 rows: 11.8 GB/s untiled against 6.8 with 16 KiB tiles) — the interleaved weight
/// pieces of tiling cost more than re-reading activations from L2. So only passes larger than
/// a generous share of the 1 MiB L2 are tiled.
const ACTIVATION_TILE_BYTES: usize = 512 << 10;

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
    matmul_tiled(level, w, x, out, scratch, None, false);
}

/// Several matrices times the same activation rows `x` (a layer's q, k and v projections, an
/// FFN's gate and up): `outs[i]` gets exactly what [`matmul`] of `ws[i]` and `x` writes, but
/// `x` is encoded once for consecutive matrices that take the same activation encoding rather
/// than once per matrix.
pub fn matmul_many(
    ws: &[&WeightMatrix<'_>],
    x: &[f32],
    outs: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert_eq!(ws.len(), outs.len(), "matmul_many: one output per matrix");
    for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        matmul_many_one(w, x, out, scratch, i);
    }
}

/// Matrix `index` of a [`matmul_many`] over `x`, for callers that hold one output at a time:
/// calls with `index` 0, 1, 2… over the same `x` and `scratch` write exactly what
/// [`matmul_many`] writes, encoding `x` once for consecutive matrices that take the same
/// encoding. Index 0 starts a new input.
pub fn matmul_many_one(
    w: &WeightMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
    index: usize,
) {
    if index == 0 {
        // Whatever the scratch holds was encoded from another input.
        scratch.encoded = None;
    }
    matmul_tiled(simd::level(), w, x, out, scratch, None, index > 0);
}

/// How activation rows are encoded for a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActivationEncoding {
    /// The interleaved kernels' format for weights of this encoding.
    Interleaved(interleaved::Encoding),
    /// Q8_0 or Q8_K blocks, in the level's widened format where it has one.
    Blocks(ActivationFormat, SimdLevel),
}

/// What a [`MatmulScratch`] holds encoded: `n` rows of `cols` values as `encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EncodedRows {
    encoding: ActivationEncoding,
    cols: usize,
    n: usize,
}

/// Values per block and bytes per encoded block of activation `format` at `level`.
fn activation_blocks(format: ActivationFormat, level: SimdLevel) -> (usize, usize) {
    match format {
        ActivationFormat::Q8_0 => (q8_0::BLOCK_VALUES, q8_0::wide_block_bytes(level)),
        _ => (q8_k::BLOCK_VALUES, q8_k::wide_block_bytes(level)),
    }
}

impl ActivationEncoding {
    /// Bytes of an encoded row of `cols` values, and of the plain quantised row it is made
    /// from.
    fn row_bytes(self, cols: usize) -> (usize, usize) {
        let format = match self {
            ActivationEncoding::Interleaved(encoding) => encoding.activation(),
            ActivationEncoding::Blocks(format, _) => format,
        };
        let plain = format
            .row_bytes(cols)
            .expect("weight rows are whole blocks");
        let encoded = match self {
            ActivationEncoding::Interleaved(encoding) => encoding.activation_row_bytes(cols),
            ActivationEncoding::Blocks(format, level) => {
                let (block_values, block_bytes) = activation_blocks(format, level);
                cols / block_values * block_bytes
            }
        };
        (encoded, plain)
    }

    /// Encodes the row `values` into `out`, through `plain` (a plain quantised row).
    fn encode_row(self, values: &[f32], plain: &mut [u8], out: &mut [u8]) {
        match self {
            ActivationEncoding::Interleaved(encoding) => {
                interleaved::quantize_activation_row(encoding, values, plain, out)
            }
            ActivationEncoding::Blocks(format, level) => {
                let quantize_row = match format {
                    ActivationFormat::Q8_0 => q8_0::quantize_row,
                    _ => q8_k::quantize_row,
                };
                if out.len() == plain.len() {
                    quantize_row(values, out);
                    return;
                }
                quantize_row(values, plain);
                match format {
                    ActivationFormat::Q8_0 => q8_0::widen_row(level, plain, out),
                    _ => q8_k::widen_row(level, plain, out),
                }
            }
        }
    }
}

/// Below this many activation values a call encodes its rows on the calling thread.
const PARALLEL_MIN_ENCODE: usize = 1 << 12;

/// Encodes the rows of `x` (`cols` values each) as `encoding` into `scratch.quantized` and
/// returns the bytes of an encoded row. Several rows are encoded on the pool's threads (each
/// row's bytes are the same either way). With `reuse`, rows the scratch already holds under
/// the same encoding and shape (the previous matrix of a [`matmul_many`]) are kept.
fn encode_activations(
    encoding: ActivationEncoding,
    x: &[f32],
    cols: usize,
    scratch: &mut MatmulScratch,
    reuse: bool,
) -> usize {
    let n = x.len() / cols;
    let (act_row, plain_row) = encoding.row_bytes(cols);
    let key = EncodedRows { encoding, cols, n };
    if reuse && scratch.encoded == Some(key) {
        return act_row;
    }
    scratch.encoded = None;
    if scratch.quantized.len() < n * act_row {
        scratch.quantized.resize(n * act_row, 0);
    }
    if scratch.row_buffer.len() < n * plain_row {
        scratch.row_buffer.resize(n * plain_row, 0);
    }
    let encoded = &mut scratch.quantized[..n * act_row];
    let plain = &mut scratch.row_buffer[..n * plain_row];
    let encode = |((out, plain), values): ((&mut [u8], &mut [u8]), &[f32])| {
        encoding.encode_row(values, plain, out)
    };
    if n > 1 && x.len() >= PARALLEL_MIN_ENCODE && rayon::current_num_threads() > 1 {
        encoded
            .par_chunks_exact_mut(act_row)
            .zip(plain.par_chunks_exact_mut(plain_row))
            .zip(x.par_chunks_exact(cols))
            .for_each(encode);
    } else {
        encoded
            .chunks_exact_mut(act_row)
            .zip(plain.chunks_exact_mut(plain_row))
            .zip(x.chunks_exact(cols))
            .for_each(encode);
    }
    scratch.encoded = Some(key);
    act_row
}

/// [`matmul_at`] with the activation tile budget overridden (tests force small tiles to check
/// that tiling changes no bit).
fn matmul_tiled(
    level: SimdLevel,
    w: &WeightMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
    tile_bytes: Option<usize>,
    reuse_encoded: bool,
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
    let ty = w.ty();
    let chunk_rows = match w.layout() {
        Layout::RowMajor => chunk_rows(rows),
        Layout::Interleaved => chunk_rows(rows).next_multiple_of(interleaved::GROUP_ROWS),
    };
    let encoding = match (w.layout(), ty.activation()) {
        (Layout::Interleaved, _) => Some(ActivationEncoding::Interleaved(
            interleaved::encoding(ty).expect("interleavable type"),
        )),
        (_, ActivationFormat::F32) => None,
        (_, format) => Some(ActivationEncoding::Blocks(format, level)),
    };
    let act_row = encoding.map_or(0, |e| {
        encode_activations(e, x, cols, scratch, reuse_encoded)
    });
    let MatmulScratch {
        quantized, staging, ..
    } = scratch;
    if let Some(ActivationEncoding::Interleaved(encoding)) = encoding {
        let acts = Rows::new(&quantized[..n * act_row], act_row, act_row, n);
        run_interleaved(encoding, level, w, acts, out, chunk_rows);
        return;
    }
    // One thread chunk of weight rows writes its results activation-row-major into its own
    // piece of `dest`; with several activation rows those pieces are then copied into place
    // row by row (contiguous copies, not a strided transpose).
    let dest: &mut [f32] = if n == 1 {
        &mut *out
    } else {
        staging.resize(n * rows, 0.0);
        &mut *staging
    };
    let info = ty.info();
    match info.kernels {
        Kernels::Float(kernels) => {
            let acts = Rows::new(x, cols, cols, n);
            let kernel = Kernel {
                dot_rows: kernels.dot_rows,
                accumulate: kernels.accumulate,
                row_sums: None,
                lanes: (kernels.lanes)(level),
                block_values: 1,
                weight_block_bytes: info.block_bytes,
                act_block_elems: 1,
                act_elem_bytes: 4,
                // Whole 32-value chunks (the AVX-512 step; two AVX2 steps).
                tile_align_blocks: 32,
                tile_bytes: tile_bytes.unwrap_or(ACTIVATION_TILE_BYTES),
            };
            run(&kernel, level, w, acts, dest);
        }
        Kernels::Quantized(kernels) => {
            let format = info.activation;
            let (block_values, act_block) = activation_blocks(format, level);
            let acts = Rows::new(&quantized[..n * act_row], act_row, act_row, n);
            let row_sums: Option<(RowSumsFn<u8>, RowSumsEncoding)> = match level {
                SimdLevel::Avx512 | SimdLevel::Amx => kernels
                    .row_sums
                    .map(|encoding| (simd::row_sums as RowSumsFn<u8>, encoding)),
                _ => None,
            };
            let kernel = Kernel {
                dot_rows: kernels.dot_rows,
                accumulate: kernels.accumulate,
                row_sums,
                lanes: (kernels.lanes)(level),
                block_values,
                weight_block_bytes: info.block_bytes,
                act_block_elems: act_block,
                act_elem_bytes: 1,
                // The 32-value block kernels work on pairs of blocks.
                tile_align_blocks: if format == ActivationFormat::Q8_0 {
                    2
                } else {
                    1
                },
                tile_bytes: tile_bytes.unwrap_or(ACTIVATION_TILE_BYTES),
            };
            run(&kernel, level, w, acts, dest);
        }
    }
    if n > 1 {
        scatter_chunks(staging, out, n, rows, chunk_rows);
    }
}

/// Copies the thread chunks of `staging` (each activation-row-major, see [`run`]) into `out`
/// (`n` rows of `rows` outputs).
fn scatter_chunks(staging: &[f32], out: &mut [f32], n: usize, rows: usize, chunk_rows: usize) {
    for (chunk, results) in staging[..n * rows].chunks(chunk_rows * n).enumerate() {
        let first = chunk * chunk_rows;
        let chunk_len = results.len() / n;
        for (b, row) in results.chunks_exact(chunk_len).enumerate() {
            out[b * rows + first..][..chunk_len].copy_from_slice(row);
        }
    }
}

/// [`run`] for an interleaved matrix, in thread chunks of whole 16-row groups (`chunk_rows`, a
/// multiple of 16): each pass of activation rows ([`interleaved::pass_rows`] at most) over the
/// whole matrix, one after another, each chunk's groups in one kernel call writing straight
/// into `out`.
///
/// Passes of many rows are bound by the kernels' arithmetic, not by the weights' reads, so
/// reading the weights again per pass costs less than what the alternative — each group
/// through all the passes while it is in cache — pays in a kernel call per group and pass and
/// in staging the outputs. Measured with 2 threads, the two taking turns in one process (a
/// 3072 × 1024 matrix from DRAM, ms, streamed against group by group; Q4_K and Q6_K with the
/// streamed passes first, the others in both orders): on an Emerald Rapids
/// Xeon's AMX tiles Q8_0 × 64 rows 1.04–1.10 against 1.37, qwen3-0.6b prefill of 256 tokens
/// 355 / 449 against 291 / 377 t/s (Q8_0), 385 against 363 (Q4_K); on an AMD EPYC (Zen 4,
/// AVX-512 `vpdpbusd`) 9 / 16 / 64 rows Q8_0 0.173–0.176 / 0.215–0.218 / 0.658–0.664 against
/// 0.178–0.180 / 0.217–0.222 / 0.711–0.715, Q4_K 0.126 / 0.187 / 0.681 against 0.134 / 0.202 /
/// 0.750, Q6_K 0.165 / 0.215 / 0.720 against 0.164 / 0.229 / 0.782. A row's
/// bits do not depend on the order: the passes hold the same rows either way.
fn run_interleaved(
    encoding: interleaved::Encoding,
    level: SimdLevel,
    w: &WeightMatrix<'_>,
    acts: Rows<'_, u8>,
    out: &mut [f32],
    chunk_rows: usize,
) {
    let n = acts.count();
    let rows = w.rows();
    let group_bytes = encoding.group_bytes(w.cols());
    // The group blocks of weight rows `first .. first + len` (`first` a multiple of 16).
    let groups = |first: usize, len: usize| {
        &w.bytes()[first / interleaved::GROUP_ROWS * group_bytes..]
            [..len.div_ceil(interleaved::GROUP_ROWS) * group_bytes]
    };
    let pass_rows = interleaved::pass_rows(encoding, level);
    for (acts, out) in (0..n)
        .step_by(pass_rows)
        .map(|first| acts.sub(first, pass_rows.min(n - first)))
        .zip(out.chunks_mut(pass_rows * rows))
    {
        let work = |mut run: WeightRun<'_>| {
            let groups = groups(run.first, run.len);
            interleaved::groups_pass(
                encoding,
                level,
                groups,
                acts,
                &mut run.out,
                0,
                run.len,
                true,
            );
        };
        let whole = WeightRun {
            first: 0,
            len: rows,
            out: OutRows::new(out.chunks_exact_mut(rows)),
        };
        if rayon::current_num_threads() <= 1 || rows * w.cols() * acts.count() < PARALLEL_MIN_WORK {
            work(whole);
        } else {
            rayon::iter::split(whole, |run| run.split(chunk_rows)).for_each(work);
        }
    }
}

/// Weight rows `first .. first + len` of a matrix with their outputs for every activation row
/// of a pass: the piece of a matmul one thread takes, split in halves of whole chunks while
/// rayon asks for more pieces.
struct WeightRun<'a> {
    first: usize,
    len: usize,
    out: OutRows<'a>,
}

impl WeightRun<'_> {
    /// The run in two halves of whole `chunk_rows` chunks, or whole when it is one chunk.
    fn split(self, chunk_rows: usize) -> (Self, Option<Self>) {
        let chunks = self.len.div_ceil(chunk_rows);
        if chunks < 2 {
            return (self, None);
        }
        let mid = chunks / 2 * chunk_rows;
        let (low, high) = self.out.split_at(mid);
        let high = WeightRun {
            first: self.first + mid,
            len: self.len - mid,
            out: high,
        };
        let low = WeightRun {
            first: self.first,
            len: mid,
            out: low,
        };
        (low, Some(high))
    }
}

/// Single-row [`matmul`]: `out[r] = dot(w.row(r), x)`.
pub fn matvec(w: &WeightMatrix<'_>, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
    assert_eq!(x.len(), w.cols(), "matvec: input size");
    matmul(w, x, out, scratch);
}

/// A type's whole-row SIMD kernel writing finished dot products (`row_sums`): weight rows ×
/// one pass of activation rows into `out[b * stride + i]`.
type RowSumsFn<T> =
    fn(RowSumsEncoding, SimdLevel, Rows<'_, u8>, Rows<'_, T>, &mut [f32], usize, Option<&[u8]>);

/// How a weight type's kernels are driven: whole rows at the scalar level, column tiles at SIMD
/// levels. Tiles start at multiples of `tile_align_blocks` blocks, the step the kernels keep
/// their lane order in, so that tiling never changes a result.
struct Kernel<T> {
    dot_rows: DotRowsFn<T>,
    accumulate: AccumulateFn<T>,
    /// Where the level has one: whole rows reduced in registers (no accumulator round trip),
    /// with the bits of `accumulate` and [`Accumulator::sum`].
    row_sums: Option<(RowSumsFn<T>, RowSumsEncoding)>,
    /// Accumulator lanes at the level in use.
    lanes: usize,
    /// Values per block (1 for float weights).
    block_values: usize,
    weight_block_bytes: usize,
    /// Activation elements (f32 values or encoded bytes) per block.
    act_block_elems: usize,
    act_elem_bytes: usize,
    tile_align_blocks: usize,
    /// Activation bytes of one pass per column tile.
    tile_bytes: usize,
}

/// Weight rows per thread chunk: a few chunks per thread, so that uneven progress balances.
fn chunk_rows(rows: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    rows.div_ceil(threads * 4).max(4)
}

/// Splits the weight rows into contiguous chunks of [`chunk_rows`] across the current rayon
/// pool. Chunk `c` (weight rows `first .. first + len`) fills `dest[c * chunk_rows * n ..]`
/// activation-row-major: the product of weight row `first + i` and activation row `b` at
/// `b * len + i`.
fn run<T: Sync>(
    kernel: &Kernel<T>,
    level: SimdLevel,
    w: &WeightMatrix<'_>,
    acts: Rows<'_, T>,
    dest: &mut [f32],
) {
    let n = acts.count();
    let rows = w.rows();
    let chunk_rows = chunk_rows(rows);
    let work = |(chunk, dst): (usize, &mut [f32])| {
        let first = chunk * chunk_rows;
        if level == SimdLevel::Scalar {
            let len = dst.len() / n;
            let mut outputs = [0.0; MAX_ROWS_PER_PASS];
            for i in 0..len {
                for pass_first in (0..n).step_by(MAX_ROWS_PER_PASS) {
                    let pass = acts.sub(pass_first, MAX_ROWS_PER_PASS.min(n - pass_first));
                    let outputs = &mut outputs[..pass.count()];
                    (kernel.dot_rows)(level, w.row(first + i), pass, outputs);
                    for (b, v) in outputs.iter().enumerate() {
                        dst[(pass_first + b) * len + i] = *v;
                    }
                }
            }
        } else {
            tiled_rows(kernel, level, w, first, acts, dst);
        }
    };
    for_each_chunk(dest, chunk_rows * n, rows * w.cols() * n, work);
}

/// Runs `work` on every `(index, chunk)` of `dest` (chunks of `chunk_len`), across the current
/// rayon pool unless it has one thread or the call's `multiply_adds` are too few to pay for the
/// fork-join.
fn for_each_chunk(
    dest: &mut [f32],
    chunk_len: usize,
    multiply_adds: usize,
    work: impl Fn((usize, &mut [f32])) + Sync + Send,
) {
    if rayon::current_num_threads() <= 1 || multiply_adds < PARALLEL_MIN_WORK {
        dest.chunks_mut(chunk_len).enumerate().for_each(work);
    } else {
        dest.par_chunks_mut(chunk_len).enumerate().for_each(work);
    }
}

/// The SIMD loop over weight rows `first ..` (as many as `dst` holds): groups of weight rows ×
/// passes of activation rows × column tiles, each pair's accumulator carried across tiles.
fn tiled_rows<T>(
    kernel: &Kernel<T>,
    level: SimdLevel,
    w: &WeightMatrix<'_>,
    first: usize,
    acts: Rows<'_, T>,
    dst: &mut [f32],
) {
    let n = acts.count();
    let chunk_len = dst.len() / n;
    let blocks = w.cols() / kernel.block_values;
    let pass_rows = n.min(MAX_ROWS_PER_PASS);
    let align = kernel.tile_align_blocks;
    let aligned_act_bytes = align * kernel.act_block_elems * kernel.act_elem_bytes;
    // Whole alignment steps of activations that fit the L1 budget (at least one); the row's
    // ragged end, if any, joins the last tile.
    let tile_blocks = (kernel.tile_bytes / (pass_rows * aligned_act_bytes)).max(1) * align;
    let mut acc = [Accumulator::ZERO; WEIGHT_ROWS_PER_GROUP * MAX_ROWS_PER_PASS];
    for group_start in (0..chunk_len).step_by(WEIGHT_ROWS_PER_GROUP) {
        let group_first = first + group_start;
        let group_rows = WEIGHT_ROWS_PER_GROUP.min(chunk_len - group_start);
        for pass_first in (0..n).step_by(MAX_ROWS_PER_PASS) {
            let pass = acts.sub(pass_first, pass_rows.min(n - pass_first));
            let p = pass.count();
            if let (Some((row_sums, encoding)), true) = (kernel.row_sums, blocks < 2 * tile_blocks)
            {
                // One tile: whole rows, reduced in the kernel.
                let next_group = group_first + group_rows;
                let prefetch = (p > 1).then(|| {
                    if next_group < first + chunk_len {
                        w.row(next_group)
                    } else {
                        &[][..]
                    }
                });
                let w_rows = Rows::new(
                    &w.bytes()[group_first * w.row_bytes()..],
                    w.row_bytes(),
                    w.row_bytes(),
                    group_rows,
                );
                let out = &mut dst[pass_first * chunk_len + group_start..];
                row_sums(encoding, level, w_rows, pass, out, chunk_len, prefetch);
                continue;
            }
            // Pair (r, b) at `r * p + b`: only the pairs in use are zeroed.
            let acc = &mut acc[..group_rows * p];
            acc.fill(Accumulator::ZERO);
            let mut start = 0;
            while start < blocks {
                let end = if blocks - start < 2 * tile_blocks {
                    blocks
                } else {
                    start + tile_blocks
                };
                let x_tile = pass.columns(
                    start * kernel.act_block_elems,
                    (end - start) * kernel.act_block_elems,
                );
                let w_start = start * kernel.weight_block_bytes;
                let w_len = (end - start) * kernel.weight_block_bytes;
                start = end;
                // The hardware prefetchers restart at every jump to another row: the kernel
                // asks for each next row's piece while one is multiplied, the next group's first
                // while the last is (measured: +30–60 % for multi-row passes and for f32 rows;
                // single-row quantised passes are compute-bound and lose ~10 % to the extra
                // instructions, so they skip it).
                let next_group = group_first + group_rows;
                let prefetch = (p > 1 || kernel.act_elem_bytes == 4).then(|| {
                    if next_group < first + chunk_len {
                        &w.row(next_group)[w_start..w_start + w_len]
                    } else {
                        &[][..]
                    }
                });
                let w_tile = Rows::new(
                    &w.bytes()[group_first * w.row_bytes() + w_start..],
                    w.row_bytes(),
                    w_len,
                    group_rows,
                );
                (kernel.accumulate)(level, w_tile, x_tile, acc, prefetch);
            }
            for r in 0..group_rows {
                for b in 0..p {
                    dst[(pass_first + b) * chunk_len + group_start + r] =
                        acc[r * p + b].sum(kernel.lanes);
                }
            }
        }
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
    /// to a single-row matmul of that activation, whatever the thread count; the same for the
    /// interleaved copy of every type the level multiplies interleaved, under every CPU
    /// family's kernel tuning. 37 weight rows do not divide into the thread chunks (nor into
    /// 16-row groups) evenly.
    #[test]
    fn batched_rows_are_bit_identical_to_single_rows_at_every_level() {
        let (rows, cols) = (37, 512);
        let max_n = 19;
        for ty in WeightType::ALL {
            let data = weight_data(ty, rows, cols, 80);
            let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let repacked = interleaved::InterleavedMatrix::repack(&plain);
            let x = activations(max_n, cols, 81);
            let layouts = SimdLevel::supported().map(|level| (level, plain)).chain(
                SimdLevel::supported().filter_map(|level| {
                    let packed = repacked.as_ref()?;
                    interleaved::supports(ty).then(|| (level, packed.view()))
                }),
            );
            for (level, w) in layouts {
                let ty = format!("{ty} ({:?})", w.layout());
                let mut scratch = MatmulScratch::new();
                // Every family's kernel variants, whatever this CPU is.
                crate::simd::for_each_tuning(|tuning| {
                    let singles: Vec<Vec<f32>> = (0..max_n)
                        .map(|b| {
                            let mut out = vec![0.0; rows];
                            let row = &x[b * cols..(b + 1) * cols];
                            matmul_at(level, &w, row, &mut out, &mut scratch);
                            out
                        })
                        .collect();
                    for n in (1..=8).chain([11, 16, max_n]) {
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
                                    "{ty} at {level}, {tuning:?}: row {b} of {n} ({threads} threads)"
                                );
                            }
                        }
                    }
                });
            }
        }
    }

    /// Matrices sharing an input get exactly what separate calls give, whatever mix of
    /// encodings they take and whatever the scratch held from an earlier input.
    #[test]
    fn shared_input_matches_separate_calls() {
        let cols = 512;
        let types = [
            WeightType::F32,
            WeightType::Q4K,
            WeightType::Q4K,
            WeightType::Q8_0,
            WeightType::Q4K,
            WeightType::Q6K,
        ];
        let data: Vec<(WeightType, usize, Vec<u8>)> = types
            .iter()
            .enumerate()
            .map(|(i, &ty)| {
                let rows = 16 + 9 * i;
                (ty, rows, weight_data(ty, rows, cols, 90 + i as u64))
            })
            .collect();
        let plain: Vec<WeightMatrix<'_>> = data
            .iter()
            .map(|(ty, rows, bytes)| WeightMatrix::new(*ty, *rows, cols, bytes).unwrap())
            .collect();
        let repacked: Vec<Option<interleaved::InterleavedMatrix>> = plain
            .iter()
            .enumerate()
            // Every other matrix interleaved (every level has a kernel for the copies).
            .map(|(i, w)| {
                (i % 2 == 1 && interleaved::supports(w.ty()))
                    .then(|| interleaved::InterleavedMatrix::repack(w))?
            })
            .collect();
        let matrices: Vec<WeightMatrix<'_>> = plain
            .iter()
            .zip(&repacked)
            .map(|(w, packed)| packed.as_ref().map_or(*w, |p| p.view()))
            .collect();
        let mut scratch = MatmulScratch::new();
        for (seed, n) in [(1, 1), (2, 8), (3, 8), (4, 3)] {
            let x = activations(n, cols, 100 + seed);
            let expected: Vec<Vec<f32>> = matrices
                .iter()
                .map(|w| {
                    let mut out = vec![0.0; n * w.rows()];
                    matmul(w, &x, &mut out, &mut MatmulScratch::new());
                    out
                })
                .collect();
            let mut outs: Vec<Vec<f32>> = matrices
                .iter()
                .map(|w| vec![f32::NAN; n * w.rows()])
                .collect();
            let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
            let refs: Vec<&WeightMatrix<'_>> = matrices.iter().collect();
            run_in_pool(2, || matmul_many(&refs, &x, &mut slices, &mut scratch));
            for (i, (got, want)) in outs.iter().zip(&expected).enumerate() {
                assert_eq!(bits(got), bits(want), "matrix {i}, {n} rows");
            }
        }
    }

    /// Long rows are multiplied in column tiles whose size depends on the number of rows in a
    /// pass (8 rows: a few blocks; 1 row: the whole row); tiling must not change any bit.
    #[test]
    fn column_tiling_does_not_change_any_bit() {
        let (rows, cols) = (9, 4096 + 256 + 32 + 5);
        for ty in WeightType::ALL {
            let cols = if ty.block_values() == 1 {
                cols
            } else {
                cols / ty.block_values() * ty.block_values()
            };
            let data = weight_data(ty, rows, cols, 84);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let x = activations(11, cols, 85);
            let levels = SimdLevel::supported().filter(|l| *l != SimdLevel::Scalar);
            // The default budgets, and small ones that split every type's rows into many
            // tiles (of different sizes for 8-, 3- and 1-row passes).
            for (level, budget) in
                levels.flat_map(|l| [(l, None), (l, Some(2048)), (l, Some(9000))])
            {
                let mut scratch = MatmulScratch::new();
                let mut batched = vec![0.0; 11 * rows];
                matmul_tiled(level, &w, &x, &mut batched, &mut scratch, budget, false);
                for b in 0..11 {
                    let row = &x[b * cols..(b + 1) * cols];
                    let mut single = vec![0.0; rows];
                    matmul_tiled(level, &w, row, &mut single, &mut scratch, budget, false);
                    assert_eq!(
                        bits(&single),
                        bits(&batched[b * rows..(b + 1) * rows]),
                        "{ty} at {level}, budget {budget:?}: row {b}"
                    );
                    // And equal to the type's untiled whole-row kernel.
                    for (r, s) in single.iter().enumerate() {
                        let mut o = [0.0];
                        match ty.info().kernels {
                            Kernels::Float(kernels) => {
                                (kernels.dot_rows)(level, w.row(r), Rows::single(row), &mut o)
                            }
                            Kernels::Quantized(kernels) => {
                                let format = ty.activation();
                                let mut q = vec![0u8; format.row_bytes(cols).unwrap()];
                                match format {
                                    ActivationFormat::Q8_0 => q8_0::quantize_row(row, &mut q),
                                    _ => q8_k::quantize_row(row, &mut q),
                                }
                                (kernels.dot_rows)(level, w.row(r), Rows::single(&q), &mut o)
                            }
                        }
                        let whole = o[0];
                        assert_eq!(s.to_bits(), whole.to_bits(), "{ty} at {level}: {r}, {b}");
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

    /// Row-major and (where the process level multiplies them) interleaved matrices.
    #[test]
    fn matvec_matches_dequantised_reference() {
        let (rows, cols) = (17, 256);
        let weights = random_vec(rows * cols, 0.5, 90);
        let x = random_vec(cols, 1.0, 91);
        for ty in WeightType::ALL {
            let data = crate::quantize(ty.ggml(), &weights);
            let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let repacked = interleaved::InterleavedMatrix::repack(&plain)
                .filter(|_| interleaved::supports(ty));
            for w in [Some(plain), repacked.as_ref().map(|m| m.view())]
                .into_iter()
                .flatten()
            {
                let mut out = vec![0.0; rows];
                matvec(&w, &x, &mut out, &mut MatmulScratch::new());
                let mut row = vec![0.0; cols];
                for (r, got) in out.iter().enumerate() {
                    w.dequantize_row(r, &mut row);
                    let reference: f64 =
                        row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    // Quantised types also quantise the activation: allow its error.
                    let tol = match ty.activation() {
                        ActivationFormat::F32 => 1e-4,
                        _ => 0.05,
                    };
                    assert!(
                        (*got as f64 - reference).abs() < tol,
                        "{ty:?} {:?} row {r}: {got} vs {reference}",
                        w.layout()
                    );
                }
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
