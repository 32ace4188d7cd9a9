//! CPU kernels of Specula: tensor block formats, dot products, the multi-row mat-vec, and the
//! per-row operations (RMSNorm, L2 norm, RoPE incl. partial and multi-section, softmax, SwiGLU,
//! sigmoid, softplus).
//!
//! One module per tensor type, as ggml-cpu is organised ([`f32`], [`f16`], [`bf16`],
//! [`q8_0`]); each has its block layout, `quantize_row`, `dequantize_row` and `dot` (a weight
//! row with an activation row). The `dot` functions currently call scalar references
//! (`dot_scalar`) written so the compiler vectorises them; hand-written SIMD paths will sit
//! beside them, selected once per process, so every row on a given machine runs the same code.
//!
//! Determinism is a design rule: every output element is computed by one fixed sequential
//! code path, so results never depend on the thread count or on how many rows are batched
//! together. Speculative decoding relies on this (a verify row must be bit-identical to a
//! single-token forward pass).
//!
//! [`quantize`] and [`dequantize`] encode and decode whole tensors for any supported type
//! (used to write model files); [`try_quantize`] and [`try_dequantize`] are their fallible
//! forms.

pub mod bf16;
mod error;
pub mod f16;
pub mod f32;
pub mod matvec;
pub mod ops;
pub mod q8_0;

pub use error::KernelError;
pub use matvec::{matmul, matvec, MatmulScratch, WeightMatrix};
pub use ops::{Rope, RopeMode, RopeSections};
pub use specula_gguf::GgmlType;

/// A tensor type the kernels can multiply with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl WeightType {
    /// Every supported type.
    pub const ALL: [WeightType; 4] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::BF16,
        WeightType::Q8_0,
    ];

    /// The supported type for a GGUF tensor type, if any.
    pub fn from_ggml(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::F32 => Some(WeightType::F32),
            GgmlType::F16 => Some(WeightType::F16),
            GgmlType::BF16 => Some(WeightType::BF16),
            GgmlType::Q8_0 => Some(WeightType::Q8_0),
            _ => None,
        }
    }

    /// The GGUF tensor type.
    pub fn ggml(self) -> GgmlType {
        match self {
            WeightType::F32 => GgmlType::F32,
            WeightType::F16 => GgmlType::F16,
            WeightType::BF16 => GgmlType::BF16,
            WeightType::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            WeightType::F32 => f32::BLOCK_VALUES,
            WeightType::F16 => f16::BLOCK_VALUES,
            WeightType::BF16 => bf16::BLOCK_VALUES,
            WeightType::Q8_0 => q8_0::BLOCK_VALUES,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => f32::BLOCK_BYTES,
            WeightType::F16 => f16::BLOCK_BYTES,
            WeightType::BF16 => bf16::BLOCK_BYTES,
            WeightType::Q8_0 => q8_0::BLOCK_BYTES,
        }
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_values())
            .then(|| n / self.block_values() * self.block_bytes())
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.ggml().name())
    }
}

fn supported(ty: GgmlType) -> Result<WeightType, KernelError> {
    WeightType::from_ggml(ty).ok_or(KernelError::UnsupportedType(ty))
}

/// Encodes `x` (`n` values, a whole number of blocks of the type) into row `out`
/// (`ty.row_bytes(n)` bytes).
pub fn quantize_row_into(ty: WeightType, x: &[f32], out: &mut [u8]) {
    match ty {
        WeightType::F32 => f32::quantize_row(x, out),
        WeightType::F16 => f16::quantize_row(x, out),
        WeightType::BF16 => bf16::quantize_row(x, out),
        WeightType::Q8_0 => q8_0::quantize_row(x, out),
    }
}

/// Decodes `bytes` of type `ty` into `out`.
pub fn dequantize_row_into(ty: WeightType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        WeightType::F32 => f32::dequantize_row(bytes, out),
        WeightType::F16 => f16::dequantize_row(bytes, out),
        WeightType::BF16 => bf16::dequantize_row(bytes, out),
        WeightType::Q8_0 => q8_0::dequantize_row(bytes, out),
    }
}

/// Encodes the values `x` as tensor data of type `ty` (F32, F16, BF16 or Q8_0).
///
/// For block types `x.len()` must be a whole number of blocks; a tensor whose rows are whole
/// blocks always is.
///
/// # Panics
///
/// If `ty` is not supported or `x` is not whole blocks; [`try_quantize`] returns those as
/// errors instead.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    try_quantize(ty, x).unwrap_or_else(|e| panic!("quantize: {e}"))
}

/// [`quantize`], reporting an unsupported type or partial block as an error.
pub fn try_quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, KernelError> {
    let wt = supported(ty)?;
    let len = wt.row_bytes(x.len()).ok_or(KernelError::NotWholeBlocks {
        ty,
        n: x.len(),
        block: wt.block_values(),
    })?;
    let mut out = vec![0u8; len];
    quantize_row_into(wt, x, &mut out);
    Ok(out)
}

/// Decodes `n` values of type `ty` from tensor data `bytes` (exactly their size).
///
/// # Panics
///
/// If `ty` is not supported or `bytes` is not the size of `n` values; [`try_dequantize`]
/// returns those as errors instead.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    try_dequantize(ty, bytes, n).unwrap_or_else(|e| panic!("dequantize: {e}"))
}

/// [`dequantize`], reporting an unsupported type or a size mismatch as an error.
pub fn try_dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, KernelError> {
    let wt = supported(ty)?;
    let expected = wt.row_bytes(n).ok_or(KernelError::NotWholeBlocks {
        ty,
        n,
        block: wt.block_values(),
    })?;
    if bytes.len() != expected {
        return Err(KernelError::WrongByteLength {
            ty,
            n,
            expected,
            found: bytes.len(),
        });
    }
    let mut out = vec![0.0; n];
    dequantize_row_into(wt, bytes, &mut out);
    Ok(out)
}

#[cfg(test)]
pub(crate) mod test_util {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `n` values uniform in `[-scale, scale)`, reproducible from `seed`.
    pub fn random_vec(n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    /// Checks an f32 dot product against an f64 reference with the error bound of a
    /// lane-accumulated f32 sum (plus `extra`).
    pub fn assert_dot_close(got: f32, reference: f64, w: &[f32], x: &[f32], extra: f64) {
        let n = w.len();
        let magnitude: f64 = w
            .iter()
            .zip(x)
            .map(|(a, b)| (*a as f64 * *b as f64).abs())
            .sum();
        let steps = (n as f64 / 16.0).ceil() + 6.0;
        let tol = steps * f32::EPSILON as f64 * magnitude + extra;
        assert!(
            (got as f64 - reference).abs() <= tol,
            "n={n}: got {got}, reference {reference}, tolerance {tol}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_util::random_vec;

    #[test]
    fn dispatchers_round_trip_every_supported_type() {
        let x = random_vec(4096 + 32, 2.0, 5);
        for ty in WeightType::ALL {
            let bytes = quantize(ty.ggml(), &x);
            assert_eq!(bytes.len(), ty.ggml().row_bytes(x.len()).unwrap(), "{ty}");
            let back = dequantize(ty.ggml(), &bytes, x.len());
            let max_err = x
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let bound = match ty {
                WeightType::F32 => 0.0,
                WeightType::F16 => 2.0 / 2048.0,
                WeightType::BF16 => 2.0 / 256.0,
                WeightType::Q8_0 => 2.0 / 127.0,
            };
            assert!(max_err <= bound, "{ty}: max error {max_err} > {bound}");
        }
    }

    #[test]
    fn dispatchers_reject_what_they_cannot_do() {
        assert_eq!(
            try_quantize(GgmlType::Q4K, &[0.0; 256]),
            Err(KernelError::UnsupportedType(GgmlType::Q4K))
        );
        assert!(matches!(
            try_quantize(GgmlType::Q8_0, &[0.0; 40]),
            Err(KernelError::NotWholeBlocks { .. })
        ));
        assert!(matches!(
            try_dequantize(GgmlType::F16, &[0; 5], 3),
            Err(KernelError::WrongByteLength {
                expected: 6,
                found: 5,
                ..
            })
        ));
    }
}
