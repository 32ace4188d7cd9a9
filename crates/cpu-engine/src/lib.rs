//! Model loading and the CPU layer code shared by Specula's backends.
//!
//! [`model`] opens a GGUF file, dispatches on `general.architecture` and checks every weight
//! (zero-copy views of the memory-mapped file); [`arch`] holds the per-architecture graphs
//! (the dense decoder block and the Gated DeltaNet hybrid), [`blocks`] their building blocks
//! (attention, FFN, MoE, Gated DeltaNet, the MTP head), [`kv_cache`] the attention cache and
//! [`recurrent`] the recurrent-state snapshot ring.
//!
//! The `cpu-simd` plugin runs every layer through this code; `cuda-hybrid` runs the layers it
//! keeps on the CPU through it, so both compute those layers with the same arithmetic.
//! Every function here is a fixed sequential computation per output row: a multi-row call
//! gives each row the bits a single-row call would.

pub mod arch;
pub mod blocks;
pub mod kv_cache;
pub mod model;
pub mod pool;
pub mod recurrent;
pub mod validate;
