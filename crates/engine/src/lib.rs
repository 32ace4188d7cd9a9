//! The engine every Specula backend is built from: model loading, the architectures' graphs,
//! the CPU layer code, and the backend scaffolding.
//!
//! [`model`] opens a GGUF file, dispatches on `general.architecture` and checks every weight
//! (zero-copy views of the memory-mapped file); [`arch`] holds the per-architecture graphs
//! (the dense decoder block and the Gated DeltaNet hybrid), [`blocks`] their building blocks
//! (attention, FFN, MoE, Gated DeltaNet, the MTP head), [`kv_cache`] the attention cache and
//! [`recurrent`] the recurrent-state snapshot ring.
//!
//! [`backend`] is what a backend plugin does besides running layers — the plugin ABI's
//! `ForwardPass`, validation, the sequence, chunking, rollback and re-decoding, options — over
//! an [`backend::Executor`] that runs the layers; [`cpu::CpuExecutor`] runs them on the host.
//! The `cpu-simd` plugin is a `Backend<CpuExecutor>`; `cuda-hybrid` runs the layers it keeps
//! on the host through a `CpuExecutor`, so both compute those layers with the same arithmetic.
//! Every function here is a fixed sequential computation per output row: a multi-row call
//! gives each row the bits a single-row call would.

pub mod arch;
pub mod backend;
pub mod blocks;
pub mod cpu;
pub mod kv_cache;
pub mod model;
pub mod pool;
pub mod recurrent;
