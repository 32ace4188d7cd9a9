//! Weight rows repacked into interleaved groups of 16, so that one block's integer dot
//! products for 16 weight rows come out of `vpdpbusd` already summed.
//!
//! In the file's row-major layout a 32-value block of one weight row fills one register, and
//! every activation row of a verify pass pays for its own reduction of that register (an
//! integer dot product per lane, then a conversion, a scale and a fused add per block pair and
//! row). Repacked — as ggml-cpu's "repack" buffers do for the same reason — block `b` of 16
//! consecutive weight rows is stored so that register `j` holds bytes `4j .. 4j + 4` of each of
//! the 16 rows. Broadcasting the activation's bytes `4j .. 4j + 4` and accumulating eight (Q8_0)
//! `vpdpbusd` gives, in lane `i`, the whole block's integer sum for weight row `i`: the
//! reduction over the block is free, and the float work (convert, scale, add) is one
//! instruction each per block for 16 weight rows and one activation row. Each weight block is
//! decoded once per pass of activation rows, as before, and a group's blocks are one
//! contiguous stream, which is what the hardware prefetchers like best.
//!
//! Layout of one group block (`16` rows × one 32-value block):
//!
//! | bytes        | Q8_0                                       | Q4_0                                   |
//! |--------------|--------------------------------------------|----------------------------------------|
//! | 0..32        | the 16 rows' f16 scales `d`, row order     | the same                               |
//! | 32..         | 8 × 64 bytes: quant bytes `4j..4j+4` of rows 0..16, each `q + 128` | 4 × 64 bytes: packed bytes `4m..4m+4` of rows 0..16 (low nibbles are values `4m..`, high nibbles values `16 + 4m..`) |
//!
//! The weights are the unsigned operand of `vpdpbusd` (`q + 128` for Q8_0, the raw nibble
//! `q + 8` for Q4_0), the activation quants the signed one; the activation format
//! (`encode_activation_row`) carries each block's `-offset · Σ x` so the kernel starts its
//! integer sum there and needs no correction afterwards. A row count that is not a multiple of
//! 16 is padded with zero rows (scale 0, value 0) that are never written out.
//!
//! Arithmetic, identical at every level and for every pass size (the scalar reference
//! `dot_rows_scalar` is bit-exact with the AVX-512 kernel): per block, the exact integer sum
//! `s = Σ q_w · q_x`, then `acc = fma(s as f32, d_w · d_x, acc)` in block order. This is
//! ggml's `ggml_vec_dot_q8_0_q8_0` reference order with the multiply and add fused.

use crate::matvec::{Layout, WeightMatrix};
use crate::q8_0::{self, Block32Encoding};
use crate::simd::{self, Rows, SimdLevel};
use crate::{f16, WeightType};

/// Weight rows per interleaved group: one output register of 16 f32 lanes.
pub const GROUP_ROWS: usize = 16;

/// Values per block (both encodings have 32-value blocks).
pub const BLOCK_VALUES: usize = q8_0::BLOCK_VALUES;

/// Bytes of the 16 f16 scales at the start of a group block.
const SCALES_BYTES: usize = 2 * GROUP_ROWS;

/// Bytes per block of an activation row in the interleaved format: 32 signed quants, the scale
/// as f32, the i32 integer-sum start `-offset · Σ q`.
pub const ACTIVATION_BLOCK_BYTES: usize = BLOCK_VALUES + 8;

/// Whether weights of type `ty` can be interleaved (and multiplied interleaved at `level`:
/// the AVX-512 kernel, or the scalar reference at the scalar level).
pub fn supports(ty: WeightType, level: SimdLevel) -> bool {
    encoding(ty).is_some() && matches!(level, SimdLevel::Avx512 | SimdLevel::Scalar)
}

/// Whether repacking weights of type `ty` makes multiplying them faster at `level`: where the
/// AVX-512 kernel runs (at the scalar level the row-major reference is as fast).
pub fn pays_off(ty: WeightType, level: SimdLevel) -> bool {
    level == SimdLevel::Avx512 && supports(ty, level)
}

/// The 32-value block encoding of an interleavable weight type.
pub(crate) fn encoding(ty: WeightType) -> Option<Block32Encoding> {
    match ty {
        WeightType::Q8_0 => Some(Block32Encoding::Q8_0),
        WeightType::Q4_0 => Some(Block32Encoding::Q4_0),
        _ => None,
    }
}

/// Bytes of one group block of `encoding`.
pub(crate) fn group_block_bytes(encoding: Block32Encoding) -> usize {
    SCALES_BYTES + GROUP_ROWS * quant_bytes(encoding)
}

/// Quant bytes per row and block.
fn quant_bytes(encoding: Block32Encoding) -> usize {
    encoding.block_bytes() - 2
}

/// The unsigned offset the weights are stored with (`q_w + offset` is what `vpdpbusd` sees).
fn weight_offset(encoding: Block32Encoding) -> i32 {
    match encoding {
        Block32Encoding::Q8_0 => 128,
        Block32Encoding::Q4_0 => 8,
    }
}

/// Bytes of `rows × cols` weights of `ty` repacked (whole groups, the last one padded).
pub fn repacked_bytes(ty: WeightType, rows: usize, cols: usize) -> Option<usize> {
    let encoding = encoding(ty)?;
    if !cols.is_multiple_of(BLOCK_VALUES) {
        return None;
    }
    Some(rows.div_ceil(GROUP_ROWS) * (cols / BLOCK_VALUES) * group_block_bytes(encoding))
}

/// A weight matrix repacked into interleaved 16-row groups, owning its bytes (built once at
/// load time from the file's row-major matrix; [`InterleavedMatrix::view`] is what
/// [`crate::matmul`] multiplies).
#[derive(Clone)]
pub struct InterleavedMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for InterleavedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterleavedMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl InterleavedMatrix {
    /// Repacks a row-major matrix; `None` if its type cannot be interleaved (see [`supports`])
    /// or it is already interleaved.
    pub fn repack(w: &WeightMatrix<'_>) -> Option<Self> {
        let encoding = encoding(w.ty())?;
        if w.layout() != Layout::RowMajor {
            return None;
        }
        let mut data = vec![0; repacked_bytes(w.ty(), w.rows(), w.cols())?];
        repack(encoding, w.bytes(), w.rows(), &mut data);
        Some(Self {
            ty: w.ty(),
            rows: w.rows(),
            cols: w.cols(),
            data,
        })
    }

    /// The matrix for [`crate::matmul`].
    pub fn view(&self) -> WeightMatrix<'_> {
        WeightMatrix::interleaved(self.ty, self.rows, self.cols, &self.data)
    }

    /// Bytes held (the padded groups).
    pub fn n_bytes(&self) -> usize {
        self.data.len()
    }
}

/// Repacks `rows` row-major weight rows of `row_bytes` each (`data`) into `out`
/// ([`repacked_bytes`] long).
pub(crate) fn repack(encoding: Block32Encoding, data: &[u8], rows: usize, out: &mut [u8]) {
    let block_bytes = encoding.block_bytes();
    let row_bytes = data.len() / rows.max(1);
    let blocks = row_bytes / block_bytes;
    let group_block = group_block_bytes(encoding);
    let quants = quant_bytes(encoding);
    out.fill(0);
    for (g, group) in out.chunks_exact_mut(blocks * group_block).enumerate() {
        for (b, dst) in group.chunks_exact_mut(group_block).enumerate() {
            if encoding == Block32Encoding::Q8_0 {
                // Padding rows: value 0 is the stored byte 128.
                dst[SCALES_BYTES..].fill(0x80);
            }
            for i in 0..GROUP_ROWS.min(rows - g * GROUP_ROWS) {
                let src =
                    &data[(g * GROUP_ROWS + i) * row_bytes + b * block_bytes..][..block_bytes];
                dst[2 * i..2 * i + 2].copy_from_slice(&src[..2]);
                for (j, bytes) in src[2..].chunks_exact(4).enumerate() {
                    let at = SCALES_BYTES + j * 4 * GROUP_ROWS + 4 * i;
                    for (d, s) in dst[at..at + 4].iter_mut().zip(bytes) {
                        *d = match encoding {
                            Block32Encoding::Q8_0 => s ^ 0x80,
                            Block32Encoding::Q4_0 => *s,
                        };
                    }
                }
            }
            debug_assert_eq!(dst.len(), SCALES_BYTES + GROUP_ROWS * quants);
        }
    }
}

/// The signed weight quants and scale of row `i` (within its group) of one group block.
fn row_block(encoding: Block32Encoding, block: &[u8], i: usize) -> (f32, [i8; BLOCK_VALUES]) {
    let d = f16::to_f32(u16::from_le_bytes([block[2 * i], block[2 * i + 1]]));
    let mut q = [0i8; BLOCK_VALUES];
    let quants = &block[SCALES_BYTES..];
    match encoding {
        Block32Encoding::Q8_0 => {
            for (t, v) in q.iter_mut().enumerate() {
                *v = (quants[(t / 4) * 4 * GROUP_ROWS + 4 * i + t % 4] ^ 0x80) as i8;
            }
        }
        Block32Encoding::Q4_0 => {
            for t in 0..BLOCK_VALUES / 2 {
                let byte = quants[(t / 4) * 4 * GROUP_ROWS + 4 * i + t % 4];
                q[t] = (byte & 0x0f) as i8 - 8;
                q[t + BLOCK_VALUES / 2] = (byte >> 4) as i8 - 8;
            }
        }
    }
    (d, q)
}

/// Decodes row `r` of a repacked matrix (`blocks` blocks per row) into `out`.
pub(crate) fn dequantize_row(encoding: Block32Encoding, data: &[u8], r: usize, out: &mut [f32]) {
    let group_block = group_block_bytes(encoding);
    let blocks = out.len() / BLOCK_VALUES;
    let group = &data[(r / GROUP_ROWS) * blocks * group_block..][..blocks * group_block];
    for (block, values) in group
        .chunks_exact(group_block)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        let (d, q) = row_block(encoding, block, r % GROUP_ROWS);
        for (v, q) in values.iter_mut().zip(q) {
            *v = f32::from(q) * d;
        }
    }
}

/// Converts a Q8_0 activation row (`bytes`, ggml blocks) into the interleaved kernels'
/// activation format for weights of `encoding` (`bytes.len() / 34 ·`
/// [`ACTIVATION_BLOCK_BYTES`] bytes).
pub(crate) fn encode_activation_row(encoding: Block32Encoding, bytes: &[u8], out: &mut [u8]) {
    debug_assert_eq!(
        out.len(),
        bytes.len() / q8_0::BLOCK_BYTES * ACTIVATION_BLOCK_BYTES
    );
    let offset = weight_offset(encoding);
    for (src, dst) in bytes
        .chunks_exact(q8_0::BLOCK_BYTES)
        .zip(out.chunks_exact_mut(ACTIVATION_BLOCK_BYTES))
    {
        let quants = &src[2..];
        let sum: i32 = quants.iter().map(|&q| i32::from(q as i8)).sum();
        dst[..BLOCK_VALUES].copy_from_slice(quants);
        dst[BLOCK_VALUES..BLOCK_VALUES + 4].copy_from_slice(&q8_0::scale(src).to_le_bytes());
        dst[BLOCK_VALUES + 4..].copy_from_slice(&(-offset * sum).to_le_bytes());
    }
}

/// One group of weight rows (`group`: its `blocks` group blocks) times a pass of at most
/// [`simd::MAX_ROWS_PER_PASS`] activation rows (interleaved format): the product of the
/// group's row `i` (`i < valid`) and activation row `b` at `out[b * stride + i]`, at `level`.
pub(crate) fn group_pass(
    encoding: Block32Encoding,
    level: SimdLevel,
    group: &[u8],
    x: Rows<'_, u8>,
    out: &mut [f32],
    stride: usize,
    valid: usize,
) {
    match level {
        SimdLevel::Avx512 => simd::interleaved_pass(encoding, group, x, out, stride, valid),
        SimdLevel::Scalar => {
            check_pass_sizes(encoding, group, &x, out, stride, valid);
            for b in 0..x.count() {
                let mut sums = [0.0; GROUP_ROWS];
                dot_rows_scalar(encoding, group, x.row(b), &mut sums);
                out[b * stride..][..valid].copy_from_slice(&sums[..valid]);
            }
        }
        SimdLevel::Avx2 => panic!("interleaved weights have no AVX2 kernel (see `supports`)"),
    }
}

/// Panics unless `group` and the activation rows `x` hold the same whole number of blocks,
/// `x` is at most one pass, `valid <= 16` and `out` holds `b * stride + i` for every activation
/// row `b` and `i < valid`: everything the kernels index by (checked once per pass, by the
/// AVX-512 entry point that guards the unsafe kernel or here for the scalar one).
pub(crate) fn check_pass_sizes(
    encoding: Block32Encoding,
    group: &[u8],
    x: &Rows<'_, u8>,
    out: &[f32],
    stride: usize,
    valid: usize,
) {
    let blocks = x.len() / ACTIVATION_BLOCK_BYTES;
    assert!(
        x.len() == blocks * ACTIVATION_BLOCK_BYTES,
        "interleaved: activation rows are not whole blocks"
    );
    assert!(
        group.len() == blocks * group_block_bytes(encoding),
        "interleaved: weight group and activation sizes differ"
    );
    assert!(valid <= GROUP_ROWS && x.count() <= simd::MAX_ROWS_PER_PASS);
    assert!(
        x.count() == 0 || (x.count() - 1) * stride + valid <= out.len(),
        "interleaved: output too small"
    );
}

/// Scalar reference: the 16 rows of one group (`group`) times one activation row `x`
/// (interleaved format) into `out`.
pub(crate) fn dot_rows_scalar(
    encoding: Block32Encoding,
    group: &[u8],
    x: &[u8],
    out: &mut [f32; GROUP_ROWS],
) {
    let group_block = group_block_bytes(encoding);
    let offset = weight_offset(encoding);
    out.fill(0.0);
    for (block, xb) in group
        .chunks_exact(group_block)
        .zip(x.chunks_exact(ACTIVATION_BLOCK_BYTES))
    {
        let dx = f32::from_le_bytes(xb[BLOCK_VALUES..BLOCK_VALUES + 4].try_into().unwrap());
        let start = i32::from_le_bytes(xb[BLOCK_VALUES + 4..].try_into().unwrap());
        for (i, acc) in out.iter_mut().enumerate() {
            let (dw, q) = row_block(encoding, block, i);
            // What `vpdpbusd` computes: unsigned stored weights times signed activations,
            // started at `-offset · Σ x`, i.e. exactly `Σ q_w · q_x`.
            let sum = q
                .iter()
                .zip(&xb[..BLOCK_VALUES])
                .fold(start, |s, (&w, &a)| {
                    s + (i32::from(w) + offset) * i32::from(a as i8)
                });
            *acc = (sum as f32).mul_add(dw * dx, *acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;
    use crate::{matmul_at, MatmulScratch};

    const ENCODINGS: [(WeightType, Block32Encoding); 2] = [
        (WeightType::Q8_0, Block32Encoding::Q8_0),
        (WeightType::Q4_0, Block32Encoding::Q4_0),
    ];

    fn levels() -> impl Iterator<Item = SimdLevel> {
        SimdLevel::supported().filter(|&l| supports(WeightType::Q8_0, l))
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Row-major encoded weights of `rows × cols` random values (with a few zero and extreme
    /// rows, so scales of 0 and full-range quants occur).
    fn weights(ty: WeightType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut values = random_vec(rows * cols, 1.0, seed);
        if rows > 2 {
            values[..cols].fill(0.0);
            for (i, v) in values[cols..2 * cols].iter_mut().enumerate() {
                *v = if i % 2 == 0 { 1e3 } else { -1e3 };
            }
        }
        crate::quantize(ty.ggml(), &values)
    }

    fn encoded_activations(encoding: Block32Encoding, x: &[f32], cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for row in x.chunks_exact(cols) {
            let mut q = vec![0; cols / 32 * q8_0::BLOCK_BYTES];
            q8_0::quantize_row_scalar(row, &mut q);
            let mut e = vec![0; cols / 32 * ACTIVATION_BLOCK_BYTES];
            encode_activation_row(encoding, &q, &mut e);
            out.extend(e);
        }
        out
    }

    #[test]
    fn repacking_keeps_every_value() {
        for (ty, _) in ENCODINGS {
            for (rows, cols) in [(1, 32), (16, 64), (17, 96), (40, 160)] {
                let data = weights(ty, rows, cols, 3);
                let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let packed = InterleavedMatrix::repack(&plain).unwrap();
                assert_eq!(packed.view().layout(), Layout::Interleaved);
                let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
                for r in 0..rows {
                    plain.dequantize_row(r, &mut a);
                    packed.view().dequantize_row(r, &mut b);
                    assert_eq!(bits(&a), bits(&b), "{ty:?} {rows}x{cols} row {r}");
                }
            }
        }
        let f16 = WeightMatrix::new(WeightType::F16, 1, 4, &[0; 8]).unwrap();
        assert!(InterleavedMatrix::repack(&f16).is_none());
    }

    /// The AVX-512 kernel against the scalar reference, bit for bit, on awkward sizes and every
    /// pass size; and the reference against ggml's block order (`dot_scalar`), which differs
    /// only by the fused multiply-add.
    #[test]
    fn simd_pass_equals_scalar_reference() {
        for (ty, encoding) in ENCODINGS {
            for (rows, cols) in [(16, 32), (5, 96), (33, 160), (17, 1056)] {
                let data = weights(ty, rows, cols, 7);
                let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let packed = InterleavedMatrix::repack(&plain).unwrap();
                let group_bytes = cols / 32 * group_block_bytes(encoding);
                for n in 1..=simd::MAX_ROWS_PER_PASS {
                    let x = random_vec(n * cols, 2.0, 11 + n as u64);
                    let acts = encoded_activations(encoding, &x, cols);
                    let act_row = cols / 32 * ACTIVATION_BLOCK_BYTES;
                    let pass = Rows::new(&acts, act_row, act_row, n);
                    for (g, group) in packed.data.chunks_exact(group_bytes).enumerate() {
                        let valid = GROUP_ROWS.min(rows - g * GROUP_ROWS);
                        let mut reference = vec![f32::NAN; n * GROUP_ROWS];
                        group_pass(
                            encoding,
                            SimdLevel::Scalar,
                            group,
                            pass,
                            &mut reference,
                            GROUP_ROWS,
                            valid,
                        );
                        for level in levels() {
                            let mut got = vec![f32::NAN; n * GROUP_ROWS];
                            group_pass(encoding, level, group, pass, &mut got, GROUP_ROWS, valid);
                            assert_eq!(
                                bits(&got),
                                bits(&reference),
                                "{ty:?} {rows}x{cols} n={n} group {g} {level}"
                            );
                        }
                        for b in 0..n {
                            let mut q = vec![0; cols / 32 * q8_0::BLOCK_BYTES];
                            q8_0::quantize_row_scalar(&x[b * cols..(b + 1) * cols], &mut q);
                            for i in 0..valid {
                                let r = g * GROUP_ROWS + i;
                                let ggml = match encoding {
                                    Block32Encoding::Q8_0 => q8_0::dot_scalar(plain.row(r), &q),
                                    Block32Encoding::Q4_0 => {
                                        crate::q4_0::dot_scalar(plain.row(r), &q)
                                    }
                                };
                                let got = reference[b * GROUP_ROWS + i];
                                let tol = 1e-5 * ggml.abs().max(1.0) * (cols / 32) as f32;
                                assert!(
                                    (got - ggml).abs() <= tol,
                                    "{ty:?} row {r}: {got} vs {ggml}"
                                );
                            }
                            // Padding rows are never written.
                            assert!(reference[b * GROUP_ROWS + valid..(b + 1) * GROUP_ROWS]
                                .iter()
                                .all(|v| v.is_nan()));
                        }
                    }
                }
            }
        }
    }

    /// Through `matmul`: every row of a batch (passes of 8 and a ragged one, 1 and 2 threads)
    /// is bit-identical to a single-row call.
    #[test]
    fn batch_rows_equal_single_rows() {
        for (ty, _) in ENCODINGS {
            for (rows, cols) in [(50, 96), (300, 256)] {
                let data = weights(ty, rows, cols, 5);
                let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let packed = InterleavedMatrix::repack(&plain).unwrap();
                let w = packed.view();
                let n = 11;
                let x = random_vec(n * cols, 1.5, 9);
                for level in levels() {
                    let mut scratch = MatmulScratch::new();
                    let mut single = vec![0.0; n * rows];
                    for b in 0..n {
                        matmul_at(
                            level,
                            &w,
                            &x[b * cols..(b + 1) * cols],
                            &mut single[b * rows..(b + 1) * rows],
                            &mut scratch,
                        );
                    }
                    for threads in [1, 2] {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(threads)
                            .build()
                            .unwrap();
                        for batch in [2, 8, n] {
                            let mut got = vec![0.0; batch * rows];
                            pool.install(|| {
                                matmul_at(level, &w, &x[..batch * cols], &mut got, &mut scratch)
                            });
                            assert_eq!(
                                bits(&got),
                                bits(&single[..batch * rows]),
                                "{ty:?} {rows}x{cols} {level} threads={threads} batch={batch}"
                            );
                        }
                    }
                }
            }
        }
    }
}
