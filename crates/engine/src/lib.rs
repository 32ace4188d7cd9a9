//! The engine every Specula backend is built from: model loading, the architectures' graphs,
//! the CPU executor, and the backend scaffolding.
//!
//! [`model`] opens a GGUF file, dispatches on `general.architecture` and checks every weight
//! (zero-copy views of the memory-mapped file). [`graph`] is the vocabulary a model graph is
//! written in: the [`graph::LayerOps`] trait every executor implements and the activation
//! buffers it names. [`arch`] holds one graph per architecture, written once and run by every
//! executor, and [`blocks`] the building blocks they share (attention, FFN, MoE, Gated
//! DeltaNet).
//!
//! [`backend`] is what a backend plugin does besides running layers — the plugin ABI's
//! `ForwardPass`, validation, the sequence, chunking, rollback and re-decoding, options — over
//! an [`backend::Executor`] that runs the layers; [`cpu::CpuExecutor`] runs them on the host
//! with [`kv_cache`] as the attention cache and [`recurrent`] as the recurrent-state snapshot
//! ring. The `cpu-simd` plugin is a `Backend<CpuExecutor>`; `cuda-hybrid` runs the layers it
//! keeps on the host through a `CpuExecutor` and the others through its own implementation of
//! the same operations, so both run the same graphs.
//! Every operation is a fixed sequential computation per output row: a multi-row call gives
//! each row the bits a single-row call would.

pub mod arch;
pub mod backend;
pub mod blocks;
pub mod cpu;
pub mod graph;
pub mod kv_cache;
pub mod model;
pub mod pool;
pub mod recurrent;
pub mod state_cache;
