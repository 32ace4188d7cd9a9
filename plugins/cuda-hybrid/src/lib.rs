//! `cuda-hybrid`: Specula's GPU backend plugin.
//!
//! Runs GGUF models (the architectures of cpu-simd: `llama`, `qwen2`, `qwen3`, `qwen35`, `qwen3next`
//! with MTP heads) on one NVIDIA GPU through [cudarc], with the CUDA driver and NVRTC loaded at
//! run time: the plugin builds, and loads into the host, on machines without CUDA, and opening
//! a model there fails with a clear "no CUDA driver found" error naming the library
//! ([`driver`]). The kernels are CUDA C files in `kernels/` (one per concern), compiled with
//! NVRTC when the backend opens and cached ([`kernels`]).
//!
//! The model is the engine's: the architectures' graphs, written once, run on the GPU through
//! this crate's implementation of their operations ([`gpu::graph_ops`]). As many layers as the
//! VRAM budget allows run on the GPU; the others run on the host through the engine's CPU
//! executor ([`placement`], [`backend`]); the engine's `Backend` keeps the sequence, validates
//! calls and rolls back.
//! The guarantees are cpu-simd's: a verify row is bit-identical to the single-token forward,
//! rollback inside the snapshot-ring window is O(1) (the ring of each layer lives where its
//! state lives), and the MTP head steps with its own KV cache.
//!
//! Panics never cross the plugin boundary: every entry point runs under
//! [`specula_plugin_api::guard`], and cudarc is only touched after the driver probe.
//!
//! For tests on machines without a GPU, [`gpu::emulator`] runs the same kernel sources,
//! compiled as C++, on a host stand-in for the CUDA execution model, through the backend's
//! whole device path ([`backend::open_emulated`]).

pub mod backend;
pub mod driver;
pub mod gpu;
pub mod kernels;
pub mod options;
pub mod placement;

pub use backend::{open, probe, CudaBackend, CudaExecutor};

/// The name profiles select this plugin by.
pub const PLUGIN_NAME: &str = "cuda-hybrid";

specula_plugin_api::export_backend! {
    name: PLUGIN_NAME,
    description: "GGUF models on an NVIDIA GPU via CUDA (driver + NVRTC loaded at run time), layers that do not fit on the CPU",
    open: open,
    probe: probe,
}
