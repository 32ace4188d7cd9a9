//! Building blocks shared by the architectures — attention, the FFNs (SwiGLU, mixture of
//! experts), the Gated DeltaNet mixer: their shapes, their weights and how they load, and, for
//! the blocks that are more than one operation, their graphs over [`crate::graph::LayerOps`].

pub mod attention;
pub mod ffn;
pub mod gdn;
pub mod moe;
