//! Fingerprints what cuda-hybrid's device path computes, on the host emulator of its kernels,
//! to show that a refactor changed no bit.
//!
//! ```text
//! cargo run --release -p specula-cuda-hybrid --example fingerprint_emulated -- MODEL.gguf...
//! ```
//!
//! For each model and three placements (every layer on the device; the last layer, or the last
//! two, and the head there, the others on the host), the hash of every f32 of a fixed
//! sequence of calls ([`specula_plugin_api::testing::fingerprint`]). Builds the emulator with
//! `$CXX` (default `c++`) into a temporary directory first. Compare the lines of the builds before and after a
//! change, on the same machine and SIMD level (`SPECULA_SIMD`).

use std::sync::Arc;

use specula_cuda_hybrid::backend::open_emulated;
use specula_cuda_hybrid::gpu::emulator::{build, Emulator};
use specula_plugin_api::testing::{backend_params, fingerprint};

fn main() -> Result<(), String> {
    let models: Vec<String> = std::env::args().skip(1).collect();
    if models.is_empty() {
        return Err("usage: fingerprint_emulated MODEL.gguf...".to_string());
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let library = build(&cxx, dir.path())?;
    let emulator = Arc::new(Emulator::load(&library).map_err(|e| e.to_string())?);
    for model in &models {
        let placements: [(&str, &[(&str, &str)]); 3] = [
            ("all", &[]),
            ("split1", &[("gpu_layers", "1")]),
            ("split2", &[("gpu_layers", "2")]),
        ];
        for (placement, options) in placements {
            let params = backend_params(model, 2, 256, 8, options);
            let mut backend = open_emulated(&params, emulator.clone(), 1 << 34)
                .map_err(|e| format!("{model}: {e}"))?;
            let hash = fingerprint(&mut backend).map_err(|e| format!("{model}: {e}"))?;
            println!("{hash:016x}  {placement:6}  {model}");
        }
    }
    Ok(())
}
