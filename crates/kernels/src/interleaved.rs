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
//! Layout of one group block (`16` rows × one 32-value block) of Q8_0 and Q4_0:
//!
//! | bytes        | Q8_0                                       | Q4_0                                   |
//! |--------------|--------------------------------------------|----------------------------------------|
//! | 0..32        | the 16 rows' f16 scales `d`, row order     | the same                               |
//! | 32..         | 8 × 64 bytes: quant bytes `4j..4j+4` of rows 0..16, each `q + 128` | 4 × 64 bytes: packed bytes `4m..4m+4` of rows 0..16 (low nibbles are values `4m..`, high nibbles values `16 + 4m..`) |
//!
//! The weights are the unsigned operand of `vpdpbusd` (`q + 128` for Q8_0, the raw nibble
//! `q + 8` for Q4_0), the activation quants the signed one; the activation format
//! (`encode_activation_row`: per block 32 quants, the f32 scale, an i32) carries each block's
//! `-offset · Σ x` so the kernel starts its integer sum there and needs no correction
//! afterwards. A row count that is not a multiple of 16 is padded with zero rows (scale 0,
//! value 0) that are never written out.
//!
//! Q4_K (256-value super-blocks of eight 32-value sub-blocks, each with a 6-bit scale `sc_j`
//! and min `m_j`; value `d · sc_j · q - dmin · m_j`, `q` in `0..16`) is stored with its scales
//! and mins unpacked to bytes, so the kernel widens them with one instruction, 148 bytes per
//! row and super-block (the file's 144 plus 4). One group block (`16` rows × one super-block):
//!
//! | bytes        | Q4_K                                                                  |
//! |--------------|-----------------------------------------------------------------------|
//! | 0..32        | the 16 rows' f16 `d`, row order                                       |
//! | 32..64       | the 16 rows' f16 `dmin`                                               |
//! | 64..192      | 8 × 16 bytes: sub-block `j`'s scale `sc_j` of rows 0..16 (`vpmovzxbd` → one i32 lane per row) |
//! | 192..320     | 4 × 32 bytes: for sub-block pair `p`, `(m_2p, m_2p+1)` of rows 0..16 (`vpmovzxbw` → one i16 pair per row's lane) |
//! | 320..2368    | 4 chunks × 8 × 64 bytes: register `r` of chunk `c` holds bytes `4r..4r+4` of the file's 32-byte chunk `c` of rows 0..16 (low nibbles: sub-block `2c`, values `4r..`; high nibbles: sub-block `2c + 1`) |
//!
//! Q5_K (Q4_K with a fifth bit per level, `q` in `0..32`) is the same group block followed by
//! its fifth bits as byte masks, 8 × 8 × 8 bytes: the `u64` at `64 · j + 8 · r` has bit
//! `4 · i + t` set when value `4r + t` of sub-block `j` of row `i` has its fifth bit — the mask
//! of the bytes of register `r` of sub-block `j` (as the nibbles lay them out) to add 16 to.
//! 180 bytes per row and super-block (the file's 176 plus 4).
//!
//! Its nibbles are `vpdpbusd`'s unsigned operand as they are (no offset). Its activation
//! format is the Q8_K row of the row-major path re-encoded per super-block: the 256 quants, the
//! f32 scale `d_x`, and the 8 sub-block sums `Σ x` as i16, in pairs (one dword per pair, which
//! `vpdpwssd` multiplies against a row's pair of mins).
//!
//! Q6_K (256-value super-blocks of sixteen 16-value groups, each with a signed 8-bit scale
//! `sc_j`; value `d · sc_j · (q - 32)`, `q` in `0..64`) keeps the file's 210 bytes per row and
//! super-block, its 6-bit levels split into a plane of low nibbles and a plane of high bit
//! pairs. One group block (`16` rows × one super-block):
//!
//! | bytes        | Q6_K                                                                  |
//! |--------------|-----------------------------------------------------------------------|
//! | 0..32        | the 16 rows' f16 `d`, row order                                       |
//! | 32..288      | 16 × 16 bytes: group `j`'s scale `sc_j` of rows 0..16 (`vpmovsxbd` → one i32 lane per row) |
//! | 288..2336    | 8 chunks × 4 × 64 bytes: register `r` of chunk `c` holds bytes `4r..4r+4` of rows 0..16, byte `t` holding the low nibbles of value `t` of group `2c` (low) and of group `2c + 1` (high) |
//! | 2336..3360   | 4 chunks × 4 × 64 bytes: the same for the high bit pairs, byte `t` holding those of value `t` of groups `4c .. 4c + 4` (bits `2m, 2m + 1` for group `4c + m`) |
//!
//! A group's levels `q` are `vpdpbusd`'s unsigned operand; its activation format is the Q8_K
//! row's 256 quants, the f32 scale `d_x`, and per group the i32 `-32 · Σ x` (from Q8_K's sums
//! of 16) that each group's integer sum starts at, so that it comes out as `Σ (q - 32) · x`.
//!
//! Arithmetic, identical at every level and for every pass size (the scalar reference
//! `dot_rows_scalar` is bit-exact with the AVX2, AVX-512 and AMX kernels):
//!
//! - Q8_0, Q4_0: per block, the exact integer sum `s = Σ q_w · q_x`, then
//!   `acc = fma(s as f32, d_w · d_x, acc)` in block order. This is ggml's
//!   `ggml_vec_dot_q8_0_q8_0` reference order with the multiply and add fused.
//! - Q4_K, Q5_K: per super-block, the exact integers `isum = Σ_j sc_j · Σ q_w · q_x` and
//!   `imin = Σ_j m_j · Σ_{sub-block j} q_x`, then `acc = fma(isum as f32, d_w · d_x, acc)` and
//!   `acc = fma(-(imin as f32), dmin_w · d_x, acc)`, super-blocks in order. The integers are
//!   those of ggml's `ggml_vec_dot_q4_K_q8_K` (`…q5_K…`); only the f32 steps are fused and
//!   ordered differently (so results differ from the row-major kernels in the last bits).
//! - Q6_K: per super-block the exact integer `isum = Σ_j sc_j · Σ_{group j} (q_w - 32) · q_x`
//!   (ggml's `ggml_vec_dot_q6_K_q8_K`'s), then `acc = fma(isum as f32, d_w · d_x, acc)`,
//!   super-blocks in order.

use crate::aligned::AlignedVec;
use crate::matvec::{Layout, WeightMatrix};
use crate::simd::{self, OutRows, Rows, SimdLevel};
use crate::{f16, k_quants, q4_k, q5_k, q6_k, q8_0, q8_k, ActivationFormat, WeightType};

/// Weight rows per interleaved group: one output register of 16 f32 lanes.
pub const GROUP_ROWS: usize = 16;

/// Values per block of the 32-value encodings (Q8_0, Q4_0).
pub(crate) const BLOCK32_VALUES: usize = q8_0::BLOCK_VALUES;

/// Bytes of 16 f16 scales (one per row of a group): the start of every group block.
const SCALES_BYTES: usize = 2 * GROUP_ROWS;

/// Offset of the 16 rows' f16 `dmin` in a Q4_K group block.
pub(crate) const Q4K_DMIN: usize = SCALES_BYTES;
/// Offset of the unpacked sub-block scales (8 × 16 bytes) in a Q4_K group block.
pub(crate) const Q4K_SCALES: usize = Q4K_DMIN + SCALES_BYTES;
/// Offset of the unpacked sub-block mins (4 pairs × 32 bytes) in a Q4_K group block.
pub(crate) const Q4K_MINS: usize = Q4K_SCALES + 8 * GROUP_ROWS;
/// Offset of the interleaved quants (4 chunks × 8 registers of 64 bytes) in a Q4_K group
/// block.
pub(crate) const Q4K_QUANTS: usize = Q4K_MINS + 8 * GROUP_ROWS;
/// Offset of the fifth-bit masks (8 sub-blocks × 8 registers × 8 bytes) in a Q5_K group
/// block, after the Q4_K layout.
pub(crate) const Q5K_HIGH: usize = Q4K_QUANTS + GROUP_ROWS * q4_k::BLOCK_VALUES / 2;
/// Offset of the f32 scale in a Q4_K activation block (after the 256 quants).
pub(crate) const Q4K_ACT_SCALE: usize = q4_k::BLOCK_VALUES;
/// Offset of the 8 i16 sub-block sums in a Q4_K activation block.
pub(crate) const Q4K_ACT_SUMS: usize = Q4K_ACT_SCALE + 4;

/// Offset of the group scales (16 × 16 bytes) in a Q6_K group block.
pub(crate) const Q6K_SCALES: usize = SCALES_BYTES;
/// Offset of the low-nibble plane (8 chunks × 4 registers of 64 bytes) in a Q6_K group block.
pub(crate) const Q6K_LOW: usize = Q6K_SCALES + 16 * GROUP_ROWS;
/// Offset of the high-bit-pair plane (4 chunks × 4 registers of 64 bytes) in a Q6_K group
/// block.
pub(crate) const Q6K_HIGH: usize = Q6K_LOW + GROUP_ROWS * q6_k::BLOCK_VALUES / 2;
/// Offset of the f32 scale in a Q6_K activation block (after the 256 quants).
pub(crate) const Q6K_ACT_SCALE: usize = q6_k::BLOCK_VALUES;
/// Offset of the 16 i32 group starts `-32 · Σ x` in a Q6_K activation block.
pub(crate) const Q6K_ACT_STARTS: usize = Q6K_ACT_SCALE + 4;

/// The weight encodings that can be interleaved, each with its group-block and activation
/// formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    Q8_0,
    Q4_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Encoding {
    /// Values per (super-)block.
    pub(crate) fn block_values(self) -> usize {
        match self {
            Encoding::Q8_0 | Encoding::Q4_0 => BLOCK32_VALUES,
            Encoding::Q4K | Encoding::Q5K => q4_k::BLOCK_VALUES,
            Encoding::Q6K => q6_k::BLOCK_VALUES,
        }
    }

    /// Bytes of one block of one row in the file.
    fn file_block_bytes(self) -> usize {
        match self {
            Encoding::Q8_0 => q8_0::BLOCK_BYTES,
            Encoding::Q4_0 => crate::q4_0::BLOCK_BYTES,
            Encoding::Q4K => q4_k::BLOCK_BYTES,
            Encoding::Q5K => q5_k::BLOCK_BYTES,
            Encoding::Q6K => q6_k::BLOCK_BYTES,
        }
    }

    /// Bytes of one group block (16 rows × one block).
    pub(crate) fn group_block_bytes(self) -> usize {
        match self {
            // The file's bytes, rearranged.
            Encoding::Q8_0 | Encoding::Q4_0 | Encoding::Q6K => GROUP_ROWS * self.file_block_bytes(),
            Encoding::Q4K => Q4K_QUANTS + GROUP_ROWS * q4_k::BLOCK_VALUES / 2,
            Encoding::Q5K => Q5K_HIGH + GROUP_ROWS * q5_k::BLOCK_VALUES / 8,
        }
    }

    /// Bytes per block of an activation row in this encoding's interleaved format.
    pub(crate) fn activation_block_bytes(self) -> usize {
        match self {
            // 32 signed quants, the scale as f32, the i32 integer-sum start `-offset · Σ q`.
            Encoding::Q8_0 | Encoding::Q4_0 => BLOCK32_VALUES + 8,
            // 256 signed quants, the scale as f32, 8 i16 sub-block sums.
            Encoding::Q4K | Encoding::Q5K => Q4K_ACT_SUMS + 2 * 8,
            // 256 signed quants, the scale as f32, 16 i32 group starts.
            Encoding::Q6K => Q6K_ACT_STARTS + 4 * 16,
        }
    }

    /// The format activation rows are quantised to before [`encode_activation_row`] (the
    /// row-major kernels' format for the same weight type).
    pub(crate) fn activation(self) -> ActivationFormat {
        match self {
            Encoding::Q8_0 | Encoding::Q4_0 => ActivationFormat::Q8_0,
            Encoding::Q4K | Encoding::Q5K | Encoding::Q6K => ActivationFormat::Q8K,
        }
    }

    /// Bytes of the group blocks of one 16-row group of `cols` values.
    pub(crate) fn group_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.group_block_bytes()
    }

    /// Bytes of one activation row of `cols` values in the interleaved format.
    pub(crate) fn activation_row_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.activation_block_bytes()
    }
}

/// Whether weights of type `ty` can be interleaved (and multiplied interleaved: every level has
/// its kernel, the scalar one the reference).
pub fn supports(ty: WeightType) -> bool {
    encoding(ty).is_some()
}

/// Whether repacking weights of type `ty` makes multiplying them faster at `level`: where a
/// SIMD kernel runs (at the scalar level the row-major reference is as fast).
pub fn pays_off(ty: WeightType, level: SimdLevel) -> bool {
    level >= SimdLevel::Avx2 && supports(ty)
}

/// The interleaved encoding of a weight type, if it has one.
pub(crate) fn encoding(ty: WeightType) -> Option<Encoding> {
    ty.info().interleaved
}

/// The unsigned offset the weights of an encoding are stored with (`q_w + offset` is what
/// `vpdpbusd` sees; Q6_K's levels are its quants plus 32).
fn weight_offset(encoding: Encoding) -> i32 {
    match encoding {
        Encoding::Q8_0 => 128,
        Encoding::Q4_0 => 8,
        Encoding::Q4K | Encoding::Q5K => 0,
        Encoding::Q6K => 32,
    }
}

/// Bytes of `rows × cols` weights of `ty` repacked (whole groups, the last one padded).
pub fn repacked_bytes(ty: WeightType, rows: usize, cols: usize) -> Option<usize> {
    let encoding = encoding(ty)?;
    if !cols.is_multiple_of(encoding.block_values()) {
        return None;
    }
    Some(rows.div_ceil(GROUP_ROWS) * encoding.group_bytes(cols))
}

/// A weight matrix repacked into interleaved 16-row groups, owning its bytes (built once at
/// load time from the file's row-major matrix; [`InterleavedMatrix::view`] is what
/// [`crate::matmul`] multiplies).
#[derive(Clone)]
pub struct InterleavedMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    /// On a cache line, so the kernels' 64-byte loads of a group block's aligned parts each
    /// stay within one line.
    data: AlignedVec<u8>,
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
        let mut data = AlignedVec::zeroed(repacked_bytes(w.ty(), w.rows(), w.cols())?);
        repack(encoding, w.bytes(), w.rows(), data.as_mut_slice());
        Some(Self {
            ty: w.ty(),
            rows: w.rows(),
            cols: w.cols(),
            data,
        })
    }

    /// The matrix for [`crate::matmul`].
    pub fn view(&self) -> WeightMatrix<'_> {
        WeightMatrix::interleaved(self.ty, self.rows, self.cols, self.data.as_slice())
    }

    /// Bytes held (the padded groups).
    pub fn n_bytes(&self) -> usize {
        self.data.len()
    }
}

/// Stores the 4-byte words of one row's quant bytes `src` into a group block's quant area
/// `dst`: word `w` of row `i` at `64 · w + 4 · i` (register `w` holds word `w` of rows 0..16),
/// each byte mapped by `map`.
fn interleave_words(src: &[u8], dst: &mut [u8], i: usize, map: impl Fn(u8) -> u8) {
    for (w, word) in src.chunks_exact(4).enumerate() {
        let at = w * 4 * GROUP_ROWS + 4 * i;
        for (d, s) in dst[at..at + 4].iter_mut().zip(word) {
            *d = map(*s);
        }
    }
}

/// Byte `t` of row `i`'s quant bytes in a group block's quant area (the inverse of
/// [`interleave_words`]).
#[inline]
fn quant_byte(quants: &[u8], i: usize, t: usize) -> u8 {
    quants[(t / 4) * 4 * GROUP_ROWS + 4 * i + t % 4]
}

/// Writes file block `src` of row `i` (within its group) into group block `dst`.
pub(crate) fn repack_row_block(encoding: Encoding, src: &[u8], dst: &mut [u8], i: usize) {
    dst[2 * i..2 * i + 2].copy_from_slice(&src[..2]);
    match encoding {
        Encoding::Q8_0 => interleave_words(&src[2..], &mut dst[SCALES_BYTES..], i, |s| s ^ 0x80),
        Encoding::Q4_0 => interleave_words(&src[2..], &mut dst[SCALES_BYTES..], i, |s| s),
        Encoding::Q4K | Encoding::Q5K => {
            dst[Q4K_DMIN + 2 * i..Q4K_DMIN + 2 * i + 2].copy_from_slice(&src[2..4]);
            let (sc, mn) = k_quants::unpack_scales_mins(src[4..16].try_into().unwrap());
            for j in 0..8 {
                dst[Q4K_SCALES + GROUP_ROWS * j + i] = sc[j];
                dst[Q4K_MINS + 2 * GROUP_ROWS * (j / 2) + 2 * i + j % 2] = mn[j];
            }
            if encoding == Encoding::Q5K {
                // Q5_K's `qh` (bytes 16..48: bit `j` of byte `l` for value `l` of sub-block
                // `j`) into the masks, then its nibbles, packed as Q4_K's.
                for j in 0..8 {
                    for l in 0..32 {
                        if src[16 + l] >> j & 1 == 1 {
                            let bit = 4 * i + l % 4;
                            dst[Q5K_HIGH + 64 * j + 8 * (l / 4) + bit / 8] |= 1 << (bit % 8);
                        }
                    }
                }
                interleave_words(&src[48..], &mut dst[Q4K_QUANTS..Q5K_HIGH], i, |s| s);
            } else {
                interleave_words(&src[16..], &mut dst[Q4K_QUANTS..], i, |s| s);
            }
        }
        Encoding::Q6K => {
            // `d` is at the end of the file's block (the copy above took quant bytes).
            dst[2 * i..2 * i + 2].copy_from_slice(&src[q6_k::BLOCK_BYTES - 2..]);
            for (j, sc) in q6_k::group_scales(src).into_iter().enumerate() {
                dst[Q6K_SCALES + GROUP_ROWS * j + i] = sc as u8;
            }
            let mut levels = [0u8; q6_k::BLOCK_VALUES];
            q6_k::levels(src, &mut levels);
            let group = |j: usize| &levels[16 * j..16 * (j + 1)];
            for c in 0..8 {
                let low: [u8; 16] = std::array::from_fn(|t| {
                    group(2 * c)[t] & 0x0f | (group(2 * c + 1)[t] & 0x0f) << 4
                });
                interleave_words(&low, &mut dst[Q6K_LOW + 256 * c..], i, |s| s);
            }
            for c in 0..4 {
                let high: [u8; 16] = std::array::from_fn(|t| {
                    (0..4).fold(0, |h, m| h | (group(4 * c + m)[t] >> 4) << (2 * m))
                });
                interleave_words(&high, &mut dst[Q6K_HIGH + 256 * c..], i, |s| s);
            }
        }
    }
}

/// Repacks `rows` row-major weight rows of `row_bytes` each (`data`) into `out`
/// ([`repacked_bytes`] long).
pub(crate) fn repack(encoding: Encoding, data: &[u8], rows: usize, out: &mut [u8]) {
    let block_bytes = encoding.file_block_bytes();
    let row_bytes = data.len() / rows.max(1);
    let blocks = row_bytes / block_bytes;
    let group_block = encoding.group_block_bytes();
    out.fill(0);
    for (g, group) in out.chunks_exact_mut(blocks * group_block).enumerate() {
        for (b, dst) in group.chunks_exact_mut(group_block).enumerate() {
            if encoding == Encoding::Q8_0 {
                // Padding rows: value 0 is the stored byte 128.
                dst[SCALES_BYTES..].fill(0x80);
            }
            for i in 0..GROUP_ROWS.min(rows - g * GROUP_ROWS) {
                let src =
                    &data[(g * GROUP_ROWS + i) * row_bytes + b * block_bytes..][..block_bytes];
                repack_row_block(encoding, src, dst, i);
            }
        }
    }
}

/// The file's Q8_0 block (34 bytes, into `out`) of row `i` of a Q8_0 group block: the inverse
/// of [`repack_row_block`].
pub(crate) fn unpack_q8_0_row_block(block: &[u8], i: usize, out: &mut [u8]) {
    out[..2].copy_from_slice(&block[2 * i..2 * i + 2]);
    for (t, q) in out[2..2 + BLOCK32_VALUES].iter_mut().enumerate() {
        *q = quant_byte(&block[SCALES_BYTES..], i, t) ^ 0x80;
    }
}

/// The signed weight quants and scale of row `i` (within its group) of one group block of a
/// 32-value encoding.
fn row_block32(encoding: Encoding, block: &[u8], i: usize) -> (f32, [i8; BLOCK32_VALUES]) {
    let d = f16::to_f32(u16::from_le_bytes([block[2 * i], block[2 * i + 1]]));
    let mut q = [0i8; BLOCK32_VALUES];
    let quants = &block[SCALES_BYTES..];
    match encoding {
        Encoding::Q8_0 => {
            for (t, v) in q.iter_mut().enumerate() {
                *v = (quant_byte(quants, i, t) ^ 0x80) as i8;
            }
        }
        Encoding::Q4_0 => {
            for t in 0..BLOCK32_VALUES / 2 {
                let byte = quant_byte(quants, i, t);
                q[t] = (byte & 0x0f) as i8 - 8;
                q[t + BLOCK32_VALUES / 2] = (byte >> 4) as i8 - 8;
            }
        }
        Encoding::Q4K | Encoding::Q5K | Encoding::Q6K => {
            unreachable!("K-quants have 256-value super-blocks")
        }
    }
    (d, q)
}

/// One row's super-block of a Q6_K group block, decoded.
struct Q6kRow {
    d: f32,
    scales: [i8; 16],
    /// The 256 levels (`0..64`, quant + 32), value order.
    levels: [u8; q6_k::BLOCK_VALUES],
}

/// Decodes row `i` (within its group) of a Q6_K group block.
fn q6k_row(block: &[u8], i: usize) -> Q6kRow {
    let mut levels = [0u8; q6_k::BLOCK_VALUES];
    for (v, level) in levels.iter_mut().enumerate() {
        let (j, t) = (v / 16, v % 16);
        let low = quant_byte(&block[Q6K_LOW + 256 * (j / 2)..], i, t) >> (4 * (j % 2)) & 0x0f;
        let high = quant_byte(&block[Q6K_HIGH + 256 * (j / 4)..], i, t) >> (2 * (j % 4)) & 3;
        *level = low | high << 4;
    }
    Q6kRow {
        d: f16::to_f32(u16::from_le_bytes([block[2 * i], block[2 * i + 1]])),
        scales: std::array::from_fn(|j| block[Q6K_SCALES + GROUP_ROWS * j + i] as i8),
        levels,
    }
}

/// One row's super-block of a Q4_K group block, decoded.
struct Q4kRow {
    d: f32,
    dmin: f32,
    scales: [u8; 8],
    mins: [u8; 8],
    /// The 256 levels (`0..16`), value order.
    levels: [u8; q4_k::BLOCK_VALUES],
}

/// Decodes row `i` (within its group) of a Q4_K or Q5_K (`encoding`) group block.
fn q4k_row(encoding: Encoding, block: &[u8], i: usize) -> Q4kRow {
    let half = |at: usize| {
        f16::to_f32(u16::from_le_bytes([
            block[at + 2 * i],
            block[at + 2 * i + 1],
        ]))
    };
    let quants = &block[Q4K_QUANTS..];
    let mut levels = [0u8; q4_k::BLOCK_VALUES];
    for t in 0..q4_k::BLOCK_VALUES / 2 {
        let byte = quant_byte(quants, i, t);
        let (c, l) = (t / 32, t % 32);
        levels[64 * c + l] = byte & 0x0f;
        levels[64 * c + 32 + l] = byte >> 4;
    }
    if encoding == Encoding::Q5K {
        for (v, level) in levels.iter_mut().enumerate() {
            let (j, l) = (v / 32, v % 32);
            let bit = 4 * i + l % 4;
            *level |= (block[Q5K_HIGH + 64 * j + 8 * (l / 4) + bit / 8] >> (bit % 8) & 1) << 4;
        }
    }
    Q4kRow {
        d: half(0),
        dmin: half(Q4K_DMIN),
        scales: std::array::from_fn(|j| block[Q4K_SCALES + GROUP_ROWS * j + i]),
        mins: std::array::from_fn(|j| block[Q4K_MINS + 2 * GROUP_ROWS * (j / 2) + 2 * i + j % 2]),
        levels,
    }
}

/// Decodes row `r` of a repacked matrix into `out` (a whole number of blocks), bit for bit
/// as the type's `dequantize_row` decodes the file's row.
pub(crate) fn dequantize_row(encoding: Encoding, data: &[u8], r: usize, out: &mut [f32]) {
    let group_block = encoding.group_block_bytes();
    let group_bytes = encoding.group_bytes(out.len());
    let group = &data[(r / GROUP_ROWS) * group_bytes..][..group_bytes];
    let i = r % GROUP_ROWS;
    for (block, values) in group
        .chunks_exact(group_block)
        .zip(out.chunks_exact_mut(encoding.block_values()))
    {
        if matches!(encoding, Encoding::Q4K | Encoding::Q5K) {
            let row = q4k_row(encoding, block, i);
            q4_k::dequantize_levels_with_mins(
                row.d,
                row.dmin,
                &row.scales,
                &row.mins,
                &row.levels,
                values,
            );
        } else if encoding == Encoding::Q6K {
            // As `q6_k::dequantize_row`: `(d · scale) · (q - 32)`.
            let row = q6k_row(block, i);
            for (v, (value, &level)) in values.iter_mut().zip(&row.levels).enumerate() {
                *value = (row.d * f32::from(row.scales[v / 16])) * f32::from(level as i8 - 32);
            }
        } else {
            let (d, q) = row_block32(encoding, block, i);
            for (v, q) in values.iter_mut().zip(q) {
                *v = f32::from(q) * d;
            }
        }
    }
}

/// Converts an activation row quantised to [`Encoding::activation`] (`bytes`: Q8_0 or Q8_K
/// blocks) into the interleaved kernels' activation format for weights of `encoding`
/// ([`Encoding::activation_row_bytes`] bytes).
pub(crate) fn encode_activation_row(encoding: Encoding, bytes: &[u8], out: &mut [u8]) {
    let (plain_block, act_block) = match encoding.activation() {
        ActivationFormat::Q8_0 => (q8_0::BLOCK_BYTES, encoding.activation_block_bytes()),
        _ => (q8_k::BLOCK_BYTES, encoding.activation_block_bytes()),
    };
    debug_assert_eq!(out.len(), bytes.len() / plain_block * act_block);
    let offset = weight_offset(encoding);
    for (src, dst) in bytes
        .chunks_exact(plain_block)
        .zip(out.chunks_exact_mut(act_block))
    {
        if matches!(encoding, Encoding::Q4K | Encoding::Q5K) {
            // Q8_K's sums of 16 quants, two per sub-block of 32 (|Σ| ≤ 32 · 127: an i16).
            let (d, quants, sums16) = q8_k::parts(src);
            dst[..Q4K_ACT_SCALE].copy_from_slice(quants);
            dst[Q4K_ACT_SCALE..Q4K_ACT_SUMS].copy_from_slice(&d.to_le_bytes());
            for (sum, pair) in dst[Q4K_ACT_SUMS..]
                .chunks_exact_mut(2)
                .zip(sums16.chunks_exact(2))
            {
                sum.copy_from_slice(&(pair[0] + pair[1]).to_le_bytes());
            }
        } else if encoding == Encoding::Q6K {
            // Q8_K's sums of 16 quants are Q6_K's groups': each group's sum starts at
            // `-32 · Σ x` (|·| ≤ 32 · 16 · 127).
            let (d, quants, sums16) = q8_k::parts(src);
            dst[..Q6K_ACT_SCALE].copy_from_slice(quants);
            dst[Q6K_ACT_SCALE..Q6K_ACT_STARTS].copy_from_slice(&d.to_le_bytes());
            for (start, &sum) in dst[Q6K_ACT_STARTS..].chunks_exact_mut(4).zip(&sums16) {
                start.copy_from_slice(&(-offset * i32::from(sum)).to_le_bytes());
            }
        } else {
            let quants = &src[2..];
            let sum: i32 = quants.iter().map(|&q| i32::from(q as i8)).sum();
            dst[..BLOCK32_VALUES].copy_from_slice(quants);
            dst[BLOCK32_VALUES..BLOCK32_VALUES + 4]
                .copy_from_slice(&q8_0::scale(src).to_le_bytes());
            dst[BLOCK32_VALUES + 4..].copy_from_slice(&(-offset * sum).to_le_bytes());
        }
    }
}

/// Quantises the activation row `x` as the row-major kernels for the same weight type do
/// (Q8_0 or Q8_K, into `quantized`: [`Encoding::activation`]'s row bytes) and encodes it
/// into `out` ([`Encoding::activation_row_bytes`]).
pub(crate) fn quantize_activation_row(
    encoding: Encoding,
    x: &[f32],
    quantized: &mut [u8],
    out: &mut [u8],
) {
    match encoding.activation() {
        ActivationFormat::Q8_0 => q8_0::quantize_row(x, quantized),
        _ => q8_k::quantize_row(x, quantized),
    }
    encode_activation_row(encoding, quantized, out);
}

/// A run of whole groups of weight rows (`groups`: their group blocks, group after group)
/// times a pass of at most [`pass_rows`] activation rows (interleaved format):
/// the product of the run's weight row `i < valid` and activation row `b` at
/// `out.row(b)[first + i]`, at `level`. Rows of the last group from `valid` on are padding and
/// never written. `stream`: the run is part of a long stream (see [`simd::interleaved_pass`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn groups_pass(
    encoding: Encoding,
    level: SimdLevel,
    groups: &[u8],
    x: Rows<'_, u8>,
    out: &mut OutRows<'_>,
    first: usize,
    valid: usize,
    stream: bool,
) {
    match level {
        SimdLevel::Avx2 | SimdLevel::Avx512 | SimdLevel::Amx => {
            simd::interleaved_pass(encoding, level, groups, x, out, (first, valid), stream)
        }
        SimdLevel::Scalar => {
            let group_bytes = check_pass_sizes(encoding, level, groups, &x, out, first, valid);
            for (g, group) in groups.chunks_exact(group_bytes).enumerate() {
                let rows = GROUP_ROWS.min(valid - g * GROUP_ROWS);
                for b in 0..x.count() {
                    let mut sums = [0.0; GROUP_ROWS];
                    dot_rows_scalar(encoding, group, x.row(b), &mut sums);
                    out.row(b)[first + g * GROUP_ROWS..][..rows].copy_from_slice(&sums[..rows]);
                }
            }
        }
    }
}

/// The most activation rows one pass over `encoding` groups takes at `level`: where the AMX
/// kernels run, two tiles' 32 for Q8_0 and a tile's 16 for Q4_K and Q5_K; on AVX-512
/// [`simd::MAX_Q8_0_PASS_ROWS`] for Q8_0 and [`simd::MAX_ROWS_PER_PASS`] for the others; on
/// AVX2 [`simd::MAX_ROWS_PER_PASS`] for every encoding (the scalar reference takes as many as
/// the AMX kernels, to be compared with them).
pub(crate) fn pass_rows(encoding: Encoding, level: SimdLevel) -> usize {
    match (encoding, level) {
        (Encoding::Q8_0, SimdLevel::Amx | SimdLevel::Scalar) => simd::MAX_PASS_ROWS,
        (Encoding::Q8_0, SimdLevel::Avx512) => simd::MAX_Q8_0_PASS_ROWS,
        (Encoding::Q4K | Encoding::Q5K, SimdLevel::Amx | SimdLevel::Scalar) => simd::MAX_TILE_ROWS,
        _ => simd::MAX_ROWS_PER_PASS,
    }
}

/// Panics unless `groups` is whole groups of as many blocks as each activation row of `x`
/// holds, `valid` rows end in the last group, `x` is one pass with a row of `out` for each
/// activation row, and every row of `out` holds `first + valid` outputs: everything the
/// kernels index by (checked once per pass, by the SIMD entry point that guards the unsafe
/// kernels or here for the scalar one). Returns the bytes of one group.
pub(crate) fn check_pass_sizes(
    encoding: Encoding,
    level: SimdLevel,
    groups: &[u8],
    x: &Rows<'_, u8>,
    out: &OutRows<'_>,
    first: usize,
    valid: usize,
) -> usize {
    let act_block = encoding.activation_block_bytes();
    let blocks = x.len() / act_block;
    assert!(
        blocks > 0 && x.len() == blocks * act_block,
        "interleaved: activation rows are not whole blocks"
    );
    let group_bytes = blocks * encoding.group_block_bytes();
    assert!(
        groups.len().is_multiple_of(group_bytes),
        "interleaved: weight groups and activation sizes differ"
    );
    let n_groups = groups.len() / group_bytes;
    assert!(
        valid <= n_groups * GROUP_ROWS && valid + GROUP_ROWS > n_groups * GROUP_ROWS,
        "interleaved: {valid} valid rows in {n_groups} groups"
    );
    assert!(
        x.count() == out.count() && x.count() <= pass_rows(encoding, level),
        "interleaved: {} activation rows, {} output rows at {level}",
        x.count(),
        out.count()
    );
    assert!(
        x.count() == 0 || first + valid <= out.len(),
        "interleaved: output too small"
    );
    group_bytes
}

/// Scalar reference: the 16 rows of one group (`group`) times one activation row `x`
/// (interleaved format) into `out`, with the AVX-512 kernel's arithmetic (see the module doc).
pub(crate) fn dot_rows_scalar(
    encoding: Encoding,
    group: &[u8],
    x: &[u8],
    out: &mut [f32; GROUP_ROWS],
) {
    out.fill(0.0);
    let blocks = group
        .chunks_exact(encoding.group_block_bytes())
        .zip(x.chunks_exact(encoding.activation_block_bytes()));
    if matches!(encoding, Encoding::Q4K | Encoding::Q5K) {
        for (block, xb) in blocks {
            let xq = &xb[..Q4K_ACT_SCALE];
            let dx = f32::from_le_bytes(xb[Q4K_ACT_SCALE..Q4K_ACT_SUMS].try_into().unwrap());
            let sums: [i16; 8] = std::array::from_fn(|j| {
                i16::from_le_bytes([xb[Q4K_ACT_SUMS + 2 * j], xb[Q4K_ACT_SUMS + 2 * j + 1]])
            });
            for (i, acc) in out.iter_mut().enumerate() {
                let row = q4k_row(encoding, block, i);
                let (mut isum, mut imin) = (0i32, 0i32);
                for (j, (levels, xq)) in row
                    .levels
                    .chunks_exact(32)
                    .zip(xq.chunks_exact(32))
                    .enumerate()
                {
                    let sub: i32 = levels
                        .iter()
                        .zip(xq)
                        .map(|(&w, &a)| i32::from(w) * i32::from(a as i8))
                        .sum();
                    isum += i32::from(row.scales[j]) * sub;
                    imin += i32::from(row.mins[j]) * i32::from(sums[j]);
                }
                *acc = (isum as f32).mul_add(row.d * dx, *acc);
                *acc = (-(imin as f32)).mul_add(row.dmin * dx, *acc);
            }
        }
        return;
    }
    if encoding == Encoding::Q6K {
        for (block, xb) in blocks {
            let xq = &xb[..Q6K_ACT_SCALE];
            let dx = f32::from_le_bytes(xb[Q6K_ACT_SCALE..Q6K_ACT_STARTS].try_into().unwrap());
            let starts: [i32; 16] = std::array::from_fn(|j| {
                i32::from_le_bytes(xb[Q6K_ACT_STARTS + 4 * j..][..4].try_into().unwrap())
            });
            for (i, acc) in out.iter_mut().enumerate() {
                let row = q6k_row(block, i);
                let mut isum = 0i32;
                for (j, (levels, xq)) in row
                    .levels
                    .chunks_exact(16)
                    .zip(xq.chunks_exact(16))
                    .enumerate()
                {
                    // What `vpdpbusd` computes from the start `-32 · Σ x`: `Σ (q - 32) · x`.
                    let group = levels.iter().zip(xq).fold(starts[j], |s, (&w, &a)| {
                        s + i32::from(w) * i32::from(a as i8)
                    });
                    isum += i32::from(row.scales[j]) * group;
                }
                *acc = (isum as f32).mul_add(row.d * dx, *acc);
            }
        }
        return;
    }
    let offset = weight_offset(encoding);
    for (block, xb) in blocks {
        let dx = f32::from_le_bytes(xb[BLOCK32_VALUES..BLOCK32_VALUES + 4].try_into().unwrap());
        let start = i32::from_le_bytes(xb[BLOCK32_VALUES + 4..].try_into().unwrap());
        for (i, acc) in out.iter_mut().enumerate() {
            let (dw, q) = row_block32(encoding, block, i);
            // What `vpdpbusd` computes: unsigned stored weights times signed activations,
            // started at `-offset · Σ x`, i.e. exactly `Σ q_w · q_x`.
            let sum = q
                .iter()
                .zip(&xb[..BLOCK32_VALUES])
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

    const ENCODINGS: [(WeightType, Encoding); 5] = [
        (WeightType::Q8_0, Encoding::Q8_0),
        (WeightType::Q4_0, Encoding::Q4_0),
        (WeightType::Q4K, Encoding::Q4K),
        (WeightType::Q5K, Encoding::Q5K),
        (WeightType::Q6K, Encoding::Q6K),
    ];

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `(rows, cols)` from `(rows, blocks)` for an encoding's block size.
    fn shapes(encoding: Encoding, blocks: &[(usize, usize)]) -> Vec<(usize, usize)> {
        blocks
            .iter()
            .map(|&(rows, b)| (rows, b * encoding.block_values()))
            .collect()
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
        if rows > 3 {
            // All positive: Q4_K sub-blocks whose mins are 0.
            for v in &mut values[2 * cols..3 * cols] {
                *v = v.abs() + 0.5;
            }
        }
        crate::quantize(ty.ggml(), &values)
    }

    /// Activation rows of `cols` values each, quantised and encoded as `matmul` does.
    fn encoded_activations(encoding: Encoding, x: &[f32], cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for row in x.chunks_exact(cols) {
            let mut q = vec![0; encoding.activation().row_bytes(cols).unwrap()];
            let mut e = vec![0; encoding.activation_row_bytes(cols)];
            quantize_activation_row(encoding, row, &mut q, &mut e);
            out.extend(e);
        }
        out
    }

    /// `Σ |w_i · x_i|` over the dequantised weight row `r` and the f32 activations: the scale
    /// of the rounding differences between two orders of the same dot product.
    fn magnitude(w: &WeightMatrix<'_>, r: usize, x: &[f32]) -> f32 {
        let mut row = vec![0.0; w.cols()];
        w.dequantize_row(r, &mut row);
        row.iter().zip(x).map(|(a, b)| (a * b).abs()).sum()
    }

    #[test]
    fn repacking_keeps_every_value() {
        for (ty, encoding) in ENCODINGS {
            for (rows, cols) in shapes(encoding, &[(1, 1), (16, 2), (17, 3), (40, 5)]) {
                let data = weights(ty, rows, cols, 3);
                let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let packed = InterleavedMatrix::repack(&plain).unwrap();
                assert_eq!(packed.view().layout(), Layout::Interleaved);
                assert_eq!(
                    packed.n_bytes(),
                    rows.div_ceil(GROUP_ROWS) * cols / encoding.block_values()
                        * encoding.group_block_bytes()
                );
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
        // The bytes start on a cache line, in a clone too.
        let data = weights(WeightType::Q4K, 20, 512, 4);
        let packed =
            InterleavedMatrix::repack(&WeightMatrix::new(WeightType::Q4K, 20, 512, &data).unwrap())
                .unwrap();
        let copy = packed.clone();
        for m in [&packed, &copy] {
            assert_eq!(m.view().bytes().as_ptr() as usize % 64, 0);
        }
        assert_eq!(packed.view().bytes(), copy.view().bytes());
        // Q4_K: 148 bytes per row and super-block; rows must be whole super-blocks.
        assert_eq!(Encoding::Q4K.group_block_bytes(), GROUP_ROWS * 148);
        assert_eq!(
            repacked_bytes(WeightType::Q4K, 17, 512),
            Some(2 * 2 * GROUP_ROWS * 148)
        );
        assert_eq!(repacked_bytes(WeightType::Q4K, 16, 32), None);
        // Q6_K: the file's 210 bytes per row and super-block.
        assert_eq!(Encoding::Q6K.group_block_bytes(), GROUP_ROWS * 210);
        assert_eq!(
            repacked_bytes(WeightType::Q6K, 16, 256),
            Some(GROUP_ROWS * 210)
        );
        // Q5_K: the file's 176 bytes plus 4.
        assert_eq!(Encoding::Q5K.group_block_bytes(), GROUP_ROWS * 180);
        assert_eq!(
            repacked_bytes(WeightType::Q5K, 16, 512),
            Some(2 * GROUP_ROWS * 180)
        );
        assert_eq!(repacked_bytes(WeightType::BF16, 16, 256), None);
    }

    /// Every SIMD level's kernel against the scalar reference, bit for bit, on awkward sizes and
    /// every pass size; and the reference against ggml's order (`dot_scalar` of the row-major
    /// encoding), which differs only in the rounding of the f32 steps.
    #[test]
    fn simd_pass_equals_scalar_reference() {
        for (ty, encoding) in ENCODINGS {
            let blocks: &[(usize, usize)] = match encoding {
                Encoding::Q4K | Encoding::Q5K | Encoding::Q6K => {
                    &[(16, 1), (5, 1), (17, 2), (33, 3)]
                }
                _ => &[(16, 1), (5, 3), (33, 5), (17, 33)],
            };
            for (rows, cols) in shapes(encoding, blocks) {
                let data = weights(ty, rows, cols, 7);
                let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let packed = InterleavedMatrix::repack(&plain).unwrap();
                let group_bytes = encoding.group_bytes(cols);
                for n in 1..=pass_rows(encoding, SimdLevel::Scalar) {
                    let mut x = random_vec(n * cols, 2.0, 11 + n as u64);
                    if n > 2 {
                        // One activation row of extreme magnitude (full-range quants and
                        // sums), one of zeros.
                        x[..cols].iter_mut().for_each(|v| *v = v.signum() * 3.0);
                        x[cols..2 * cols].fill(0.0);
                    }
                    let acts = encoded_activations(encoding, &x, cols);
                    let act_row = encoding.activation_row_bytes(cols);
                    let pass = Rows::new(&acts, act_row, act_row, n);
                    // The reference group by group, each level over the whole run of groups
                    // in one call.
                    let mut reference = vec![f32::NAN; n * rows];
                    for (g, group) in packed.data.as_slice().chunks_exact(group_bytes).enumerate() {
                        let valid = GROUP_ROWS.min(rows - g * GROUP_ROWS);
                        let mut out = OutRows::new(reference.chunks_exact_mut(rows));
                        let level = SimdLevel::Scalar;
                        groups_pass(
                            encoding,
                            level,
                            group,
                            pass,
                            &mut out,
                            g * GROUP_ROWS,
                            valid,
                            true,
                        );
                    }
                    // Every family's kernel variants, whatever this CPU is.
                    crate::simd::for_each_tuning(|tuning| {
                        for level in SimdLevel::supported().filter(|&l| n <= pass_rows(encoding, l))
                        {
                            // Each output row is followed by a guard of NaNs: the padding rows
                            // of the last group are never written.
                            let mut got = vec![f32::NAN; n * (rows + GROUP_ROWS)];
                            let rows_out = got.chunks_exact_mut(rows + GROUP_ROWS);
                            let mut out = OutRows::new(rows_out.map(|row| &mut row[..rows]));
                            groups_pass(
                                encoding,
                                level,
                                packed.data.as_slice(),
                                pass,
                                &mut out,
                                0,
                                rows,
                                level < SimdLevel::Avx512 || n % 2 == 0,
                            );
                            for (b, row) in got.chunks_exact(rows + GROUP_ROWS).enumerate() {
                                assert_eq!(
                                    bits(&row[..rows]),
                                    bits(&reference[b * rows..(b + 1) * rows]),
                                    "{ty:?} {rows}x{cols} n={n} {level} {tuning:?} row {b}"
                                );
                                assert!(row[rows..].iter().all(|v| v.is_nan()));
                            }
                        }
                    });
                    for b in 0..n {
                        let xb = &x[b * cols..(b + 1) * cols];
                        let mut q = vec![0; encoding.activation().row_bytes(cols).unwrap()];
                        for r in 0..rows {
                            let ggml = match encoding {
                                Encoding::Q8_0 => {
                                    q8_0::quantize_row_scalar(xb, &mut q);
                                    q8_0::dot_scalar(plain.row(r), &q)
                                }
                                Encoding::Q4_0 => {
                                    q8_0::quantize_row_scalar(xb, &mut q);
                                    crate::q4_0::dot_scalar(plain.row(r), &q)
                                }
                                Encoding::Q4K => {
                                    q8_k::quantize_row_scalar(xb, &mut q);
                                    q4_k::dot_scalar(plain.row(r), &q)
                                }
                                Encoding::Q5K => {
                                    q8_k::quantize_row_scalar(xb, &mut q);
                                    q5_k::dot_scalar(plain.row(r), &q)
                                }
                                Encoding::Q6K => {
                                    q8_k::quantize_row_scalar(xb, &mut q);
                                    q6_k::dot_scalar(plain.row(r), &q)
                                }
                            };
                            let got = reference[b * rows + r];
                            let tol = 1e-6 * magnitude(&plain, r, xb);
                            assert!(
                                (got - ggml).abs() <= tol,
                                "{ty:?} row {r}: {got} vs {ggml} (tolerance {tol})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Through `matmul`: every row of a batch (whole passes and a ragged one, 1 and 2 threads)
    /// is bit-identical to a single-row call, and close to the row-major matrix's result.
    #[test]
    fn batch_rows_equal_single_rows() {
        for (ty, encoding) in ENCODINGS {
            let blocks: &[(usize, usize)] = match encoding {
                Encoding::Q4K | Encoding::Q5K | Encoding::Q6K => &[(50, 1), (300, 2)],
                _ => &[(50, 3), (300, 8)],
            };
            for (rows, cols) in shapes(encoding, blocks) {
                let data = weights(ty, rows, cols, 5);
                let plain = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let packed = InterleavedMatrix::repack(&plain).unwrap();
                let w = packed.view();
                // More rows than one pass takes at any level (32 with AMX tiles of Q8_0, 16
                // of Q4_K / Q5_K): whole passes and ragged ones on every kernel.
                let n = 45;
                let x = random_vec(n * cols, 1.5, 9);
                for level in SimdLevel::supported() {
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
                        for batch in [2, 8, 11, 21, n] {
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
                    // The row-major matrix at the same level: the same integers, the f32 steps
                    // in another order.
                    let mut row_major = vec![0.0; n * rows];
                    matmul_at(level, &plain, &x, &mut row_major, &mut scratch);
                    for b in 0..n {
                        let xb = &x[b * cols..(b + 1) * cols];
                        for r in 0..rows {
                            let (got, want) = (single[b * rows + r], row_major[b * rows + r]);
                            let tol = 1e-6 * magnitude(&plain, r, xb);
                            assert!(
                                (got - want).abs() <= tol,
                                "{ty:?} {level} row {r} of batch row {b}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
