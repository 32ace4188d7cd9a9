//! CPU kernels of Specula: tensor block formats, dot products, the multi-row mat-vec, and the
//! per-row operations (RMSNorm, L2 norm, RoPE incl. partial and multi-section, softmax,
//! sigmoid, softplus), vectorised SiLU / SwiGLU on a bit-reproducible `exp` ([`activations`]),
//! multi-query attention over one key/value head ([`attention`]), and the
//! fused gated delta-rule step of Gated DeltaNet ([`delta_rule`]).
//!
//! One module per tensor type, as ggml-cpu is organised: weights [`f32`](mod@f32),
//! [`f16`](mod@f16) and [`bf16`] (one module over the 16-bit encoding),
//! [`q8_0`], [`q4_0`], [`q4_k`], [`q5_k`], [`q6_k`], and the K-quants' activation format
//! [`q8_k`]. Each has its block layout, `quantize_row` (ggml's reference quantiser),
//! `dequantize_row`, `dot_scalar` (the reference dot product), and `dot` / `dot_rows` (one or
//! several activation rows against one weight row) running hand-written AVX2 or AVX-512
//! kernels ([`simd`]) at the level chosen once per process, so every row on a given machine
//! runs the same code. Activation rows multiply f32 / f16 / bf16 weights as f32, Q8_0 / Q4_0
//! weights as Q8_0 and K-quant weights as Q8_K, quantised the way ggml does
//! ([`WeightType::activation`]).
//!
//! The weight types form a table ([`for_each_weight_type`]): each weight type's module holds
//! its entry (block layout, activation format, reference quantiser, scalar reference dot, SIMD
//! entry points), the table names the modules, and [`WeightType`], its per-type dispatch and
//! every list of types (messages, [`WeightType::list`]; GPU kernel names,
//! [`WeightType::kernel_name`]) derive from it.
//!
//! Determinism is a design rule: every output element is computed by one fixed sequential
//! code path, so results never depend on the thread count or on how many rows are batched
//! together. Speculative decoding relies on this (a verify row must be bit-identical to a
//! single-token forward pass). The multi-input kernels keep one accumulator per (weight row,
//! activation row) pair and decode each weight block once for all rows of a pass; [`matmul`]
//! drives them over threads and column tiles without changing any bit ([`matvec`](mod@matvec) module).
//! Different SIMD levels sum in different lane orders, so their results differ in the last
//! bits (bounded against an exact reference by the tests); a process never mixes levels.
//!
//! Q8_0, Q4_0, Q4_K, Q5_K and Q6_K matrices can be repacked once at load into interleaved 16-row groups
//! ([`interleaved`]), whose AVX-512 kernels reduce each block inside `vpdpbusd` for 16 weight
//! rows at once (the AVX2 ones in `vpmaddubsw` sums of several words, widened once): a verify
//! pass of 8 Q8_0 rows then costs little more than a single-row pass from DRAM (Q4_K, half
//! the bytes per multiply, runs out of `vpdpbusd` throughput first).
//!
//! [`quantize`] and [`dequantize`] encode and decode whole tensors for any supported type
//! (used to write model files); [`try_quantize`] and [`try_dequantize`] are their fallible
//! forms.

pub mod activations;
pub mod aligned;
pub mod amx;
pub mod attention;
pub mod delta_rule;
mod error;
pub mod f16_keys;
pub mod f32;
mod half16;
pub mod interleaved;
pub mod k_quants;
pub mod matvec;
pub mod ops;
pub mod q4_0;
pub mod q4_k;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
pub mod q8_k;
pub mod q8_keys;
pub mod simd;
mod types;

pub use error::KernelError;
pub use half16::{bf16, f16};
pub use interleaved::InterleavedMatrix;
pub use matvec::{
    matmul, matmul_at, matmul_many, matmul_many_one, matvec, Layout, MatmulScratch, WeightMatrix,
};
pub use ops::{Rope, RopeAngles, RopeMode, RopeSections};
pub use simd::{Rows, SimdLevel};
pub use specula_gguf::GgmlType;
use types::TypeInfo;

/// The weight-type table: one line per type, giving its [`WeightType`] variant, its module and
/// its name in the GPU backend's kernel names. The module holds everything else about the type
/// (its `INFO` entry: block layout, activation format, reference quantiser, scalar reference
/// dot, SIMD entry points). Everything that lists or dispatches on types derives from this
/// table: [`WeightType`] and [`WeightType::ALL`], the per-type dispatch of the crate, the
/// supported-type lists of messages ([`WeightType::list`]), and the GPU kernel names. Adding a
/// weight type is its module and one line here.
///
/// `for_each_weight_type!(callback)` expands to
/// `callback! { Variant module "kernel_name", … }`, in table order.
#[macro_export]
macro_rules! for_each_weight_type {
    ($callback:ident) => {
        $callback! {
            F32 f32 "f32",
            F16 f16 "f16",
            BF16 bf16 "bf16",
            Q8_0 q8_0 "q8_0",
            Q4_0 q4_0 "q4_0",
            Q4K q4_k "q4_k",
            Q5K q5_k "q5_k",
            Q6K q6_k "q6_k",
        }
    };
}

/// Defines [`WeightType`] and its table dispatch from [`for_each_weight_type`].
macro_rules! define_weight_types {
    ($($variant:ident $module:ident $kernel_name:literal,)*) => {
        /// A tensor type the kernels can multiply with (one line of [`for_each_weight_type`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum WeightType {
            $($variant,)*
        }

        impl WeightType {
            /// Every supported type, in table order.
            pub const ALL: [WeightType; [$(stringify!($variant)),*].len()] =
                [$(WeightType::$variant),*];

            /// The type's entry of the table: its layout, activation format and kernels.
            #[inline]
            pub(crate) fn info(self) -> &'static TypeInfo {
                match self {
                    $(WeightType::$variant => &$module::INFO,)*
                }
            }

            /// The type's name in GPU kernel names (`matvec_<name>`): its GGUF name in lower
            /// case.
            pub fn kernel_name(self) -> &'static str {
                match self {
                    $(WeightType::$variant => $kernel_name,)*
                }
            }
        }
    };
}

for_each_weight_type!(define_weight_types);

/// How activation rows are encoded for a weight type's dot product (ggml's `vec_dot_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivationFormat {
    /// Plain f32 rows (float weights).
    F32,
    /// Q8_0 blocks of 32 (Q8_0 and Q4_0 weights).
    Q8_0,
    /// Q8_K super-blocks of 256 (K-quant weights).
    Q8K,
}

impl ActivationFormat {
    /// Bytes of an encoded row of `n` values (`n` whole blocks of the format), or `None`.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let (values, bytes) = match self {
            ActivationFormat::F32 => (1, 4),
            ActivationFormat::Q8_0 => (q8_0::BLOCK_VALUES, q8_0::BLOCK_BYTES),
            ActivationFormat::Q8K => (q8_k::BLOCK_VALUES, q8_k::BLOCK_BYTES),
        };
        n.is_multiple_of(values).then(|| n / values * bytes)
    }
}

impl WeightType {
    /// The supported type for a GGUF tensor type, if any.
    pub fn from_ggml(ty: GgmlType) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.ggml() == ty)
    }

    /// The GGUF tensor type.
    pub fn ggml(self) -> GgmlType {
        self.info().ggml
    }

    /// How activation rows are encoded to multiply this type.
    pub fn activation(self) -> ActivationFormat {
        self.info().activation
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        self.info().block_values
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.info().block_bytes
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_values())
            .then(|| n / self.block_values() * self.block_bytes())
    }

    /// The GGUF names of every supported type, comma-separated (for messages).
    pub fn list() -> String {
        Self::ALL.map(|ty| ty.ggml().name()).join(", ")
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
    (ty.info().quantize_row)(x, out)
}

/// Decodes `bytes` of type `ty` into `out`.
pub fn dequantize_row_into(ty: WeightType, bytes: &[u8], out: &mut [f32]) {
    (ty.info().dequantize_row)(bytes, out)
}

/// Encodes the values `x` as tensor data of type `ty` (any [`WeightType`]), with ggml's
/// reference quantisers.
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
    use rayon::prelude::*;
    let wt = supported(ty)?;
    let len = wt.row_bytes(x.len()).ok_or(KernelError::NotWholeBlocks {
        ty,
        n: x.len(),
        block: wt.block_values(),
    })?;
    let mut out = vec![0u8; len];
    // Blocks are encoded independently, so runs of them go to rayon's threads (the same
    // bytes as one sequential pass; writing a model is mostly this).
    out.par_chunks_mut(QUANTIZE_RUN_BLOCKS * wt.block_bytes())
        .zip(x.par_chunks(QUANTIZE_RUN_BLOCKS * wt.block_values()))
        .for_each(|(out, x)| quantize_row_into(wt, x, out));
    Ok(out)
}

/// Blocks per parallel run of [`try_quantize`].
const QUANTIZE_RUN_BLOCKS: usize = 256;

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
mod parity_tests;

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
        let x = random_vec(4096 + 256, 2.0, 5);
        for ty in WeightType::ALL {
            // The table's entries agree with it.
            assert_eq!(WeightType::from_ggml(ty.ggml()), Some(ty));
            assert_eq!(ty.kernel_name(), ty.ggml().name().to_ascii_lowercase());
            assert_eq!(
                ty.block_bytes(),
                ty.ggml().row_bytes(ty.block_values()).unwrap()
            );
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
                // Whole steps of the block grids (16, 32 and 64 levels over at most [-2, 2)).
                WeightType::Q4_0 => 2.0 / 8.0 * 1.01,
                WeightType::Q4K => 4.0 / 15.0,
                WeightType::Q5K => 4.0 / 31.0,
                WeightType::Q6K => 2.0 / 32.0,
            };
            assert!(max_err <= bound, "{ty}: max error {max_err} > {bound}");
        }
    }

    /// Runs of blocks quantised on several threads give the bytes of one sequential pass,
    /// with a ragged last run.
    #[test]
    fn parallel_quantisation_equals_one_pass() {
        for ty in WeightType::ALL {
            let n = (2 * QUANTIZE_RUN_BLOCKS + 3) * ty.block_values();
            let x = random_vec(n, 3.0, 9);
            let mut sequential = vec![0u8; ty.ggml().row_bytes(n).unwrap()];
            quantize_row_into(ty, &x, &mut sequential);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap();
            assert_eq!(pool.install(|| quantize(ty.ggml(), &x)), sequential, "{ty}");
        }
    }

    #[test]
    fn dispatchers_reject_what_they_cannot_do() {
        assert_eq!(
            KernelError::UnsupportedType(GgmlType::Q2K).to_string(),
            "tensor type q2_K is not supported by the CPU kernels \
             (supported: f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K)"
        );
        assert_eq!(
            try_quantize(GgmlType::Q2K, &[0.0; 256]),
            Err(KernelError::UnsupportedType(GgmlType::Q2K))
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
