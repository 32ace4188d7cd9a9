//! Building blocks shared by the architectures: attention over the KV cache and the FFN.

pub mod attention;
pub mod ffn;
