//! The built-in default: what `specula run` uses without `--profile` or `-m`.
//!
//! A real trained transformer that speculates: a small `qwen35` hybrid (Gated DeltaNet and
//! gated attention layers) with a trained MTP head, distilled from stories260K for this
//! project (MIT; `host/assets/README.md`). It is embedded in the binary, so a fresh machine
//! needs nothing else; the first run writes it to the cache directory ([`cache_dir`]), where
//! the plugins can open it by path.
//!
//! The profile decodes greedily with the `mtp` drafter at a fixed draft length: the output is
//! token for token what plain decoding gives (`specula run` checks it and says so).

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::profile::{DrafterSection, Profile};

/// The model's bytes (1.3 MB, Q8_0).
const MODEL: &[u8] = include_bytes!("../assets/stories-qwen35-mtp-q8_0.gguf");
/// Its file name in the cache directory.
const MODEL_FILE: &str = "stories-qwen35-mtp-q8_0.gguf";
/// Drafts per step: the MTP head chains three steps well on this model.
const DRAFT_LENGTH: u32 = 3;
/// Tokens generated when `-n` is not given (the model never emits EOS: it starts a new story).
const MAX_TOKENS: u32 = 128;

/// What the default model is, for messages.
pub const DESCRIPTION: &str = "a small qwen35 hybrid with a trained MTP head, distilled from \
stories260K (TinyStories); it writes short children's stories";

/// Where Specula keeps what it writes for itself: `$SPECULA_HOME`, else
/// `$XDG_CACHE_HOME/specula`, else `~/.cache/specula`, else the temporary directory.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SPECULA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("specula")))
        .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/specula")))
        .unwrap_or_else(|| std::env::temp_dir().join("specula"))
}

/// The path of the built-in model, written there first if it is missing or differs from the
/// embedded bytes (a file of another size or content is replaced).
pub fn model_path() -> anyhow::Result<PathBuf> {
    let path = cache_dir().join(MODEL_FILE);
    let current = std::fs::read(&path).ok();
    if current.as_deref() != Some(MODEL) {
        write_atomically(&path, MODEL)
            .with_context(|| format!("cannot write the built-in model to {}", path.display()))?;
    }
    Ok(path)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// The built-in profile on `model`: cpu-simd, greedy, the MTP drafter at a fixed draft length.
pub fn profile(model: PathBuf) -> Profile {
    let mut profile = Profile::builtin_default(model);
    profile.drafter = Some(DrafterSection::named("mtp"));
    profile.sampling.temperature = 0.0;
    profile.speculation.draft_max = DRAFT_LENGTH;
    profile.speculation.draft_min = DRAFT_LENGTH;
    profile.speculation.adaptive = false;
    profile.generation.max_tokens = MAX_TOKENS;
    profile
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_model_is_a_qwen35_with_an_mtp_head() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MODEL_FILE);
        write_atomically(&path, MODEL).unwrap();
        let file = specula_gguf::GgufFile::open(&path).unwrap();
        assert_eq!(file.architecture().unwrap(), "qwen35");
        assert_eq!(
            file.get_u32("qwen35.nextn_predict_layers").unwrap(),
            Some(1)
        );
        let p = profile(path);
        assert_eq!(p.drafter.unwrap().plugin, "mtp");
        assert!(!p.speculation.adaptive);
    }
}
