//! Building blocks shared by the architectures: attention over the KV cache (plain and gated),
//! the FFNs (SwiGLU, mixture of experts), the Gated DeltaNet mixer and the MTP / NextN head.

pub mod attention;
pub mod ffn;
pub mod gdn;
pub mod moe;
pub mod mtp;
