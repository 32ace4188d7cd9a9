//! The weight-type table's entries: what one weight type is to the rest of the crate.
//!
//! Each type's module holds its entry, an `INFO` constant ([`TypeInfo`]): block layout,
//! activation format, reference quantiser and dequantiser, scalar reference dot product, SIMD
//! entry points, and the kernel families it belongs to (interleaved, AVX-512 row sums). The
//! table itself, [`crate::for_each_weight_type`], names each type's module once; every list of
//! types ([`crate::WeightType`], its `ALL`, messages, GPU kernel names) and every per-type
//! dispatch ([`crate::WeightType::info`]) derives from it, so adding a type is its module plus
//! one line of the table.
//!
//! Dispatch through the table happens per matrix or per row (a function pointer read from the
//! entry), never per block: the kernels themselves are the type modules' own functions.

use specula_gguf::GgmlType;

use crate::simd::{Accumulator, RowSumsEncoding, Rows, SimdLevel};
use crate::{interleaved, ActivationFormat};

/// A type's whole-row multi-input dot product (`dot_rows`).
pub(crate) type DotRowsFn<T> = fn(SimdLevel, &[u8], Rows<'_, T>, &mut [f32]);
/// A type's accumulating SIMD kernel over a column tile (`accumulate`).
pub(crate) type AccumulateFn<T> =
    fn(SimdLevel, Rows<'_, u8>, Rows<'_, T>, &mut [Accumulator], Option<&[u8]>);

/// One weight type: everything the crate needs to store, convert and multiply it.
pub(crate) struct TypeInfo {
    /// The GGUF tensor type.
    pub(crate) ggml: GgmlType,
    /// Values per block (1 for the float types).
    pub(crate) block_values: usize,
    /// Bytes per block.
    pub(crate) block_bytes: usize,
    /// How activation rows are encoded to multiply this type.
    pub(crate) activation: ActivationFormat,
    /// ggml's reference quantiser: whole blocks of values to encoded bytes.
    pub(crate) quantize_row: fn(&[f32], &mut [u8]),
    /// Encoded bytes back to values.
    pub(crate) dequantize_row: fn(&[u8], &mut [f32]),
    /// The dot products, by the element type of the activation rows.
    pub(crate) kernels: Kernels,
    /// The interleaved 16-row group encoding ([`crate::interleaved`]), if the type has one.
    pub(crate) interleaved: Option<interleaved::Encoding>,
}

/// A weight type's dot products, by the element type of its activation rows.
#[derive(Clone, Copy)]
pub(crate) enum Kernels {
    /// Float weights × f32 activation rows ([`ActivationFormat::F32`]).
    Float(TypeKernels<f32>),
    /// Quantised weights × encoded activation rows (Q8_0 or Q8_K blocks, bytes).
    Quantized(TypeKernels<u8>),
}

/// The dot products of a weight type with activation rows of element `T`.
pub(crate) struct TypeKernels<T: 'static> {
    /// The scalar reference: one weight row · one activation row (plain encoding). (The
    /// kernels reach it through their families; the parity tests through the table.)
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) dot_scalar: fn(&[u8], &[T]) -> f32,
    /// One weight row · several activation rows at a level (the scalar level runs
    /// `dot_scalar`; SIMD levels take the level's activation format).
    pub(crate) dot_rows: DotRowsFn<T>,
    /// The accumulating SIMD form of `dot_rows` over weight rows and column tiles.
    pub(crate) accumulate: AccumulateFn<T>,
    /// Accumulator lanes of the SIMD kernels at a level.
    pub(crate) lanes: fn(SimdLevel) -> usize,
    /// The kernel family of the AVX-512 whole-row sums ([`crate::simd::row_sums`]), if any.
    pub(crate) row_sums: Option<RowSumsEncoding>,
}

// Function pointers and options of `Copy` types: copyable whatever `T` is (derive would
// require `T: Copy`).
impl<T> Clone for TypeKernels<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for TypeKernels<T> {}
