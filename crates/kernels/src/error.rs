//! Errors of the crate-level encode/decode dispatchers and of weight views.

use specula_gguf::GgmlType;

/// What can be wrong with a request to a kernel dispatcher.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The tensor type has no kernels here (yet).
    #[error(
        "tensor type {0} is not supported by the CPU kernels (supported: {types})",
        types = crate::WeightType::list()
    )]
    UnsupportedType(GgmlType),
    /// A row length is not a whole number of blocks of the type.
    #[error("{n} values are not a whole number of {ty} blocks ({block} values each)")]
    NotWholeBlocks {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    /// A byte buffer has the wrong size for the number of values asked for.
    #[error("{n} values of type {ty} take {expected} bytes, got {found}")]
    WrongByteLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        found: usize,
    },
}
