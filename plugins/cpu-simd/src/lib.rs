//! `cpu-simd`: Specula's CPU backend plugin.
//!
//! Opens GGUF models (memory-mapped, weights used in place) and evaluates them on a private
//! rayon pool with the kernels of `specula-kernels`. Supported architectures: `llama`,
//! `qwen2` and `qwen3` (dense), and the Gated DeltaNet hybrids `qwen35` (dense FFN) and `qwen3next`
//! (mixture-of-experts FFN) with their NextN / MTP heads. Weights may be F32, F16, BF16, Q8_0,
//! Q4_0, Q4_K, Q5_K or Q6_K.
//!
//! The plugin is the engine's `Backend` over a `CpuExecutor` of the whole model
//! (`specula-engine`); this crate holds what is cpu-simd's own: its options and how it opens
//! a model ([`backend`]). Hybrid models keep their recurrent state in a snapshot ring
//! ([`recurrent`]), so a verify batch can be rolled back to any of its token boundaries in
//! O(1).
//!
//! A multi-token eval returns, for every row, exactly the bits a single-token eval at that
//! position would, which the host's speculative loop relies on.
//!
//! The crate is both the plugin (cdylib, exporting [`plugin_module`] through
//! [`specula_plugin_api::export_backend!`]) and an rlib, so tests can use [`CpuBackend`]
//! directly ([`open`]).

pub mod backend;

// The model loading, the graphs and the CPU executor live in the shared `specula-engine` crate
// (cuda-hybrid runs the same graphs); re-exported under their old paths.
pub use specula_engine::{arch, blocks, kv_cache, model, recurrent};

pub use backend::{open, probe, CpuBackend};

/// The name profiles select this plugin by.
pub const PLUGIN_NAME: &str = "cpu-simd";

specula_plugin_api::export_backend! {
    name: PLUGIN_NAME,
    description: "GGUF models on the CPU (llama, qwen2, qwen3, qwen35, qwen3next + MTP; f32/f16/bf16/q8_0/q4_0/q4_K/q5_K/q6_K weights)",
    open: open,
    probe: probe,
}
