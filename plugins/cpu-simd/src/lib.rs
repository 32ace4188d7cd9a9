//! `cpu-simd`: Specula's CPU backend plugin.
//!
//! Opens GGUF models (memory-mapped, weights used in place) and evaluates them on a private
//! rayon pool with the kernels of `specula-kernels`. Supported architectures: `llama` and
//! `qwen3` (dense), and the Gated DeltaNet hybrids `qwen35` (dense FFN) and `qwen3next`
//! (mixture-of-experts FFN) with their NextN / MTP heads. Weights may be F32, F16, BF16, Q8_0,
//! Q4_0, Q4_K, Q5_K or Q6_K.
//!
//! Hybrid models keep their recurrent state in a snapshot ring ([`recurrent`]), so a verify
//! batch can be rolled back to any of its token boundaries in O(1) (see [`backend`]).
//!
//! A multi-token eval returns, for every row, exactly the bits a single-token eval at that
//! position would, which the host's speculative loop relies on.
//!
//! The crate is both the plugin (cdylib, exporting [`plugin_module`] through
//! [`specula_plugin_api::export_plugin!`]) and an rlib, so tests can use [`CpuBackend`]
//! directly.

pub mod backend;

// The model loading and layer code live in the shared `specula-cpu-engine` crate (cuda-hybrid
// runs its CPU layers through them too); re-exported under their old paths.
pub use specula_cpu_engine::{arch, blocks, kv_cache, model, recurrent};

pub use backend::CpuBackend;

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{RNone, RSome, RString};
use specula_plugin_api::backend::box_forward_pass;
use specula_plugin_api::{
    guard, BackendParams, BoxedForwardPass, PluginInfo, PluginKind, PluginModule, PluginModuleRef,
    PluginResult, ABI_VERSION,
};

/// The name profiles select this plugin by.
pub const PLUGIN_NAME: &str = "cpu-simd";

const DESCRIPTION: &str =
    "GGUF models on the CPU (llama, qwen3, qwen35, qwen3next + MTP; f32/f16/bf16/q8_0/q4_0/q4_K/q5_K/q6_K weights)";

fn describe() -> PluginInfo {
    PluginInfo {
        name: RString::from(PLUGIN_NAME),
        version: RString::from(env!("CARGO_PKG_VERSION")),
        kind: PluginKind::Backend,
        description: RString::from(DESCRIPTION),
    }
}

extern "C" fn plugin_info() -> PluginInfo {
    guard(|| Ok(describe()))
        .into_result()
        .unwrap_or_else(|_| describe())
}

extern "C" fn open_backend(params: &BackendParams) -> PluginResult<BoxedForwardPass> {
    guard(|| CpuBackend::open(params).map(box_forward_pass))
}

/// The plugin's root module (what the host loads).
pub fn plugin_module() -> PluginModuleRef {
    PluginModule {
        abi_version: ABI_VERSION,
        info: plugin_info,
        open_backend: RSome(open_backend),
        create_drafter: RNone,
    }
    .leak_into_prefix()
}

specula_plugin_api::export_plugin!(plugin_module());
