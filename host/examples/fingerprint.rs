//! Fingerprints what a backend plugin computes, to show that a refactor changed no bit.
//!
//! ```text
//! cargo run --release -p specula-host --example fingerprint -- \
//!     PLUGIN.so [-o KEY=VALUE]... MODEL.gguf...
//! ```
//!
//! `-o` passes a backend option (e.g. `-o kv_type=f16`) to every model.
//!
//! For each model, the hash of every f32 of a fixed sequence of calls
//! ([`specula_plugin_api::testing::fingerprint`]), printed per model: run it with the plugin
//! built before and after a change, on the same machine and SIMD level (`SPECULA_SIMD`), and
//! compare the lines. `plugins/cuda-hybrid/examples/fingerprint_emulated.rs` does the same for
//! cuda-hybrid's device path on the host emulator of its kernels.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use specula_plugin_api::testing::fingerprint;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let plugin = args
        .next()
        .context("usage: fingerprint PLUGIN.so [-o KEY=VALUE]... MODEL.gguf...")?;
    let plugin =
        specula_host::plugins::load_library(Path::new(&plugin)).map_err(|e| anyhow!("{e}"))?;
    let (mut options, mut models) = (Vec::new(), Vec::new());
    while let Some(arg) = args.next() {
        if arg == "-o" {
            let option = args.next().context("-o needs KEY=VALUE")?;
            let (key, value) = option
                .split_once('=')
                .with_context(|| format!("-o {option}: expected KEY=VALUE"))?;
            options.push((key.to_string(), value.to_string()));
        } else {
            models.push(arg);
        }
    }
    for model in models {
        let params =
            specula_host::plugins::backend_params(Path::new(&model), 2, 256, 8, options.clone());
        let mut backend = plugin
            .open_backend(&params)
            .map_err(|e| anyhow!("{model}: {e}"))?;
        let hash = fingerprint(&mut backend)
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| model.clone())?;
        println!("{hash:016x}  {model}");
    }
    Ok(())
}
