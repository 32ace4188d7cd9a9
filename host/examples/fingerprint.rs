//! Fingerprints what a backend plugin computes, to show that a refactor changed no bit.
//!
//! ```text
//! cargo run --release -p specula-host --example fingerprint -- PLUGIN.so MODEL.gguf...
//! ```
//!
//! For each model: a 40-token prompt (all rows' logits and hidden states), six verify passes
//! of five tokens each truncated back by 0..3 tokens (logits, hidden states, and the MTP head's
//! rows where the model has one), then a truncation to 10 tokens (a re-decode on hybrids) and
//! three more tokens. Every f32 produced goes into one FNV-1a hash, printed per model: run it
//! with the plugin built before and after a change, on the same machine and SIMD level
//! (`SPECULA_SIMD`), and compare the lines.

use std::path::Path;

use abi_stable::std_types::{RSlice, RVec};
use anyhow::{anyhow, Context, Result};
use specula_plugin_api::{BoxedForwardPass, LogitRows};

/// FNV-1a over the bits of f32 values.
struct Fingerprint(u64);

impl Fingerprint {
    fn add(&mut self, values: &[f32]) {
        for byte in values.iter().flat_map(|v| v.to_bits().to_le_bytes()) {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn run(b: &mut BoxedForwardPass) -> Result<u64> {
    let call = |e: specula_plugin_api::PluginError| anyhow!("{e}");
    let info = b.model_info();
    let vocab = info.vocab_size;
    let mut fp = Fingerprint(0xcbf2_9ce4_8422_2325);
    let (mut logits, mut hidden) = (RVec::new(), RVec::new());
    let (mut mtp_logits, mut mtp_hidden) = (RVec::new(), RVec::new());
    let mut mtp =
        |b: &mut BoxedForwardPass, hidden: &[f32], tokens: &[u32], at, fp: &mut Fingerprint| {
            if !info.has_mtp_head {
                return Ok(());
            }
            b.mtp_eval(
                RSlice::from_slice(hidden),
                RSlice::from_slice(tokens),
                at,
                LogitRows::All,
                &mut mtp_logits,
                &mut mtp_hidden,
            )
            .into_result()
            .map_err(call)?;
            fp.add(&mtp_logits);
            fp.add(&mtp_hidden);
            Ok::<(), anyhow::Error>(())
        };

    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 1) % vocab).collect();
    b.eval(RSlice::from_slice(&prompt), LogitRows::All, &mut logits)
        .into_result()
        .map_err(call)?;
    b.hidden_states(&mut hidden).into_result().map_err(call)?;
    fp.add(&logits);
    fp.add(&hidden);
    mtp(b, &hidden, &prompt, 0, &mut fp)?;
    for step in 0..6u32 {
        let draft: Vec<u32> = (0..5).map(|i| (step * 101 + i * 13 + 7) % vocab).collect();
        let len = b.seq_len().into_result().map_err(call)?;
        b.eval(RSlice::from_slice(&draft), LogitRows::All, &mut logits)
            .into_result()
            .map_err(call)?;
        b.hidden_states(&mut hidden).into_result().map_err(call)?;
        fp.add(&logits);
        fp.add(&hidden);
        mtp(b, &hidden, &draft, len, &mut fp)?;
        b.truncate(len + step as usize % 4)
            .into_result()
            .map_err(call)?;
    }
    b.truncate(10).into_result().map_err(call)?;
    b.eval(RSlice::from_slice(&[3, 4, 5]), LogitRows::All, &mut logits)
        .into_result()
        .map_err(call)?;
    fp.add(&logits);
    Ok(fp.0)
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let plugin = args
        .next()
        .context("usage: fingerprint PLUGIN.so MODEL.gguf...")?;
    let plugin =
        specula_host::plugins::load_library(Path::new(&plugin)).map_err(|e| anyhow!("{e}"))?;
    for model in args {
        let params =
            specula_host::plugins::backend_params(Path::new(&model), 2, 256, 8, Vec::new());
        let mut backend = plugin
            .open_backend(&params)
            .map_err(|e| anyhow!("{model}: {e}"))?;
        let hash = run(&mut backend).with_context(|| model.clone())?;
        println!("{hash:016x}  {model}");
    }
    Ok(())
}
