//! Profiles: TOML files that say which plugins to load and how to run them.
//!
//! ```toml
//! plugin_dir = "../target/release"      # optional extra plugin directory
//!
//! [target]
//! backend = "cpu-simd"                  # plugin name, or a path to a plugin library
//! model = "../models/stories260K.gguf"  # relative paths are relative to this file
//! threads = 2                           # 0 = one per core
//! context_size = 2048                   # 0 = the model's own
//!
//! [drafter]                             # optional; none = plain decoding
//! plugin = "lookup"
//!
//! [sampling]
//! temperature = 0.0                     # 0 = greedy
//! seed = 42
//!
//! [speculation]
//! draft_max = 8
//! ```
//!
//! Unknown keys and bad values are errors that name the key path (`sampling.top_p`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A profile error: the file, the key path and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read profile: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: crate::bounded::BoundedReadError,
    },
    #[error("{} is a GGUF model, not a profile: to run a model, pass it with -m (a profile is a TOML file like those in profiles/)", path.display())]
    ModelNotProfile { path: PathBuf },
    #[error("profile {path}: key `{key}`: {message}")]
    Invalid {
        path: PathBuf,
        key: String,
        message: String,
    },
    /// Several of the above, each on its own (`profile check` lists them one by one).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Several(Vec<ProfileError>),
}

impl ProfileError {
    /// Each problem on its own line's worth of text.
    pub fn problems(&self) -> Vec<String> {
        match self {
            Self::Several(all) => all.iter().map(ToString::to_string).collect(),
            one => vec![one.to_string()],
        }
    }
}

/// Largest profile file read (a profile is a few hundred bytes).
pub const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// Default of `drafter.corpus_max_bytes`: the largest corpus file read.
pub const DEFAULT_CORPUS_MAX_BYTES: u64 = 64 << 20;

fn default_corpus_max_bytes() -> u64 {
    DEFAULT_CORPUS_MAX_BYTES
}

/// A validated profile, with every path resolved against the profile's directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Extra directories searched for plugins, before `SPECULA_PLUGIN_PATH` and the
    /// executable's directory.
    #[serde(default, deserialize_with = "one_or_many")]
    pub plugin_dir: Vec<PathBuf>,
    pub target: TargetSection,
    #[serde(default)]
    pub drafter: Option<DrafterSection>,
    #[serde(default)]
    pub sampling: SamplingSection,
    #[serde(default)]
    pub speculation: SpeculationSection,
    #[serde(default)]
    pub generation: GenerationSection,
    #[serde(default)]
    pub serve: ServeSection,
}

/// `[target]`: the model being served and the backend that runs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetSection {
    /// Backend plugin name (`cpu-simd`) or a path to a plugin library.
    pub backend: String,
    /// GGUF model file.
    pub model: PathBuf,
    /// Worker threads; 0 = one per core.
    #[serde(default)]
    pub threads: u32,
    /// Context size in tokens; 0 = the model's own context length.
    #[serde(default)]
    pub context_size: u32,
    /// Attention KV positions the backend keeps over all its sequences (its block pool,
    /// shared and prefix-cached); 0 = room for each sequence to fill the context.
    #[serde(default)]
    pub kv_tokens: u32,
    /// Backend-specific settings, passed to the plugin as text.
    #[serde(default)]
    pub options: BTreeMap<String, toml::Value>,
}

/// `[drafter]`: the drafter plugin and, for model drafting, the draft model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterSection {
    /// Drafter plugin name (`lookup`, `model`, `mtp`) or a path to a plugin library.
    pub plugin: String,
    /// Draft model for model drafting.
    #[serde(default)]
    pub model: Option<PathBuf>,
    /// Backend that runs the draft model (defaults to the target's backend).
    #[serde(default)]
    pub backend: Option<String>,
    /// Threads for the draft model's backend (0 = as the target).
    #[serde(default)]
    pub threads: u32,
    /// A text file whose tokens the drafter may draft from (prompt lookup's static corpus).
    #[serde(default)]
    pub corpus: Option<PathBuf>,
    /// The largest corpus file read, in bytes (default 64 MiB); a larger one is refused.
    #[serde(default = "default_corpus_max_bytes")]
    pub corpus_max_bytes: u64,
    /// Drafter-specific settings, passed to the plugin as text.
    #[serde(default)]
    pub options: BTreeMap<String, toml::Value>,
}

impl DrafterSection {
    /// A section naming only the plugin, everything else at its default.
    pub fn named(plugin: &str) -> Self {
        Self {
            plugin: plugin.to_string(),
            model: None,
            backend: None,
            threads: 0,
            corpus: None,
            corpus_max_bytes: DEFAULT_CORPUS_MAX_BYTES,
            options: BTreeMap::new(),
        }
    }
}

/// `[sampling]`: defaults for every request; CLI flags and request fields override them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingSection {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: u32,
    /// 1 = disabled.
    pub top_p: f32,
    /// 0 = disabled.
    pub min_p: f32,
    /// 1 = disabled.
    pub repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repeat_last_n: u32,
    /// Fixed seed for reproducible sampling; absent = random.
    pub seed: Option<u64>,
}

impl Default for SamplingSection {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: None,
        }
    }
}

/// `[speculation]`: how many tokens to draft and verify per step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculationSection {
    /// Whether to speculate at all when a drafter is configured.
    pub enabled: bool,
    /// Fewest drafts per step before speculation pauses itself.
    pub draft_min: u32,
    /// Most drafts per step; the verify batch is `draft_max + 1` tokens when the profile
    /// speculates, 1 otherwise (`specula chat` keeps at least 8).
    pub draft_max: u32,
    /// Let the draft length follow recent acceptance.
    pub adaptive: bool,
    /// Verify a tree of drafts per pass where the drafter grows one and the backend verifies
    /// trees: `draft_max` is then the most nodes.
    pub tree: bool,
}

impl Default for SpeculationSection {
    fn default() -> Self {
        Self {
            enabled: true,
            draft_min: 0,
            draft_max: 7,
            adaptive: true,
            tree: false,
        }
    }
}

/// `[generation]`: request defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenerationSection {
    /// Tokens to generate when a request does not say.
    pub max_tokens: u32,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Prepend BOS as the model's tokenizer says (set false to never add it).
    pub add_bos: bool,
}

impl Default for GenerationSection {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            stop: Vec::new(),
            add_bos: true,
        }
    }
}

/// `[serve]`: how `specula serve` schedules this profile's requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeSection {
    /// Requests generated at once: the most sequences the engine loop batches into one pass.
    /// The target's KV pool holds `slots` full contexts unless `target.kv_tokens` says less.
    pub slots: u32,
    /// Requests that may wait for a free slot; beyond that the daemon answers 503.
    pub queue: u32,
    /// Most prompt tokens one pass takes while other requests decode: a long prompt is
    /// prefilled in chunks interleaved with decode steps, so running streams keep flowing.
    pub prefill_chunk: u32,
}

impl Default for ServeSection {
    fn default() -> Self {
        Self {
            slots: 4,
            queue: 16,
            prefill_chunk: crate::scheduler::DEFAULT_PREFILL_CHUNK as u32,
        }
    }
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Vec<PathBuf>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(PathBuf),
        Many(Vec<PathBuf>),
    }
    Ok(match OneOrMany::deserialize(de)? {
        OneOrMany::One(p) => vec![p],
        OneOrMany::Many(v) => v,
    })
}

impl Profile {
    /// Reads, parses and validates a profile file; relative paths become relative to its
    /// directory. Does not touch models or plugins.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ProfileError> {
        let path = path.as_ref();
        if starts_with_gguf_magic(path) {
            return Err(ProfileError::ModelNotProfile {
                path: path.to_path_buf(),
            });
        }
        let text = crate::bounded::read_to_string(path, MAX_PROFILE_BYTES).map_err(|source| {
            ProfileError::Io {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let mut profile = Self::parse(&text, path)?;
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        profile.resolve_paths(base);
        Ok(profile)
    }

    /// Parses and validates profile text; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ProfileError> {
        let de = toml::Deserializer::new(text);
        let profile: Profile = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            ProfileError::Invalid {
                path: path.to_path_buf(),
                key: if key == "." {
                    "(top level)".into()
                } else {
                    key
                },
                message: crate::wording::plain_type_names(e.into_inner().to_string().trim_end()),
            }
        })?;
        profile.validate(path)?;
        Ok(profile)
    }

    fn resolve_paths(&mut self, base: &Path) {
        let resolve = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        self.plugin_dir.iter_mut().for_each(resolve);
        resolve(&mut self.target.model);
        if let Some(d) = &mut self.drafter {
            if let Some(m) = &mut d.model {
                resolve(m);
            }
            if let Some(c) = &mut d.corpus {
                resolve(c);
            }
        }
        // A backend/drafter given as a library path is relative to the profile too.
        let resolve_plugin = |name: &mut String| {
            if looks_like_path(name) && Path::new(name.as_str()).is_relative() {
                *name = base.join(&*name).to_string_lossy().into_owned();
            }
        };
        resolve_plugin(&mut self.target.backend);
        if let Some(d) = &mut self.drafter {
            resolve_plugin(&mut d.plugin);
            if let Some(b) = &mut d.backend {
                resolve_plugin(b);
            }
        }
    }

    /// Every out-of-range value (a file that parsed): one error, or [`ProfileError::Several`].
    fn validate(&self, path: &Path) -> Result<(), ProfileError> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, message: String| {
            problems.push(ProfileError::Invalid {
                path: path.to_path_buf(),
                key: key.to_string(),
                message,
            })
        };
        if self.target.backend.trim().is_empty() {
            bad(
                "target.backend",
                "must name a backend plugin, e.g. \"cpu-simd\"".into(),
            );
        }
        if self.target.model.as_os_str().is_empty() {
            bad("target.model", "must be the path of a GGUF file".into());
        }
        if self.target.threads > 1024 {
            bad(
                "target.threads",
                format!(
                    "{} is not a sensible thread count (0 = one per core)",
                    self.target.threads
                ),
            );
        }
        let s = &self.sampling;
        if !(s.temperature >= 0.0 && s.temperature.is_finite()) {
            bad(
                "sampling.temperature",
                format!(
                    "{} must be a finite number >= 0 (0 = greedy)",
                    s.temperature
                ),
            );
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            bad(
                "sampling.top_p",
                format!("{} must be in (0, 1] (1 = disabled)", s.top_p),
            );
        }
        if !(0.0..=1.0).contains(&s.min_p) {
            bad(
                "sampling.min_p",
                format!("{} must be in [0, 1] (0 = disabled)", s.min_p),
            );
        }
        if !(s.repeat_penalty > 0.0 && s.repeat_penalty.is_finite()) {
            bad(
                "sampling.repeat_penalty",
                format!("{} must be a number > 0 (1 = disabled)", s.repeat_penalty),
            );
        }
        let sp = &self.speculation;
        if sp.draft_max > 64 {
            bad(
                "speculation.draft_max",
                format!("{} is more than 64 drafts per step", sp.draft_max),
            );
        }
        if sp.draft_min > sp.draft_max {
            bad(
                "speculation.draft_min",
                format!(
                    "{} is larger than speculation.draft_max ({})",
                    sp.draft_min, sp.draft_max
                ),
            );
        }
        if let Some(d) = &self.drafter {
            if d.plugin.trim().is_empty() {
                bad(
                    "drafter.plugin",
                    "must name a drafter plugin, e.g. \"lookup\"".into(),
                );
            }
            if d.corpus_max_bytes == 0 {
                bad(
                    "drafter.corpus_max_bytes",
                    "must be at least 1 (bytes)".into(),
                );
            }
        }
        if self.generation.stop.iter().any(String::is_empty) {
            bad("generation.stop", "stop strings must not be empty".into());
        }
        if !(1..=64).contains(&self.serve.slots) {
            bad(
                "serve.slots",
                format!("{} must be between 1 and 64", self.serve.slots),
            );
        }
        if !(1..=65_536).contains(&self.serve.prefill_chunk) {
            bad(
                "serve.prefill_chunk",
                format!(
                    "{} must be between 1 and 65536 (prompt tokens per pass)",
                    self.serve.prefill_chunk
                ),
            );
        }
        if self.serve.queue > 100_000 {
            bad(
                "serve.queue",
                format!("{} is more than 100000 waiting requests", self.serve.queue),
            );
        }
        match problems.len() {
            0 => Ok(()),
            1 => Err(problems.remove(0)),
            _ => Err(ProfileError::Several(problems)),
        }
    }

    /// The built-in profile used when `specula run` gets none: `cpu-simd` on `model`.
    pub fn builtin_default(model: PathBuf) -> Self {
        Self {
            plugin_dir: Vec::new(),
            target: TargetSection {
                backend: "cpu-simd".into(),
                model,
                threads: 0,
                context_size: 0,
                kv_tokens: 0,
                options: BTreeMap::new(),
            },
            drafter: None,
            sampling: SamplingSection::default(),
            speculation: SpeculationSection::default(),
            generation: GenerationSection::default(),
            serve: ServeSection::default(),
        }
    }
}

/// Whether a plugin reference is a library path rather than a plugin name.
pub fn looks_like_path(reference: &str) -> bool {
    reference.contains('/')
        || reference.contains('\\')
        || reference.ends_with(std::env::consts::DLL_SUFFIX)
}

/// Renders a plugin `options` table as the text pairs plugins receive.
pub fn options_as_text(options: &BTreeMap<String, toml::Value>) -> Vec<(String, String)> {
    options
        .iter()
        .map(|(k, v)| {
            let text = match v {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (k.clone(), text)
        })
        .collect()
}

/// Whether `path` is a file that starts as a GGUF model does (a model passed where a profile
/// was expected).
fn starts_with_gguf_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::metadata(path).is_ok_and(|m| m.is_file())
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok_and(|()| magic == specula_gguf::MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Profile, ProfileError> {
        Profile::parse(text, Path::new("p.toml"))
    }

    const MINIMAL: &str = "[target]\nbackend = \"cpu-simd\"\nmodel = \"m.gguf\"\n";

    #[test]
    fn minimal_profile_gets_defaults() {
        let p = parse(MINIMAL).unwrap();
        assert_eq!(p.target.backend, "cpu-simd");
        assert_eq!(p.sampling, SamplingSection::default());
        assert!(p.drafter.is_none());
    }

    #[test]
    fn misspelt_key_names_its_path() {
        let err = parse("[target]\nbackend = \"cpu-simd\"\nmodle = \"m.gguf\"\n").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("target.modle"), "{text}");
        assert!(text.contains("unknown field"), "{text}");
        assert!(text.contains("p.toml"), "{text}");
    }

    #[test]
    fn wrong_type_names_its_path() {
        let err = parse(&format!("{MINIMAL}[sampling]\ntemperature = \"hot\"\n")).unwrap_err();
        assert!(err.to_string().contains("sampling.temperature"), "{err}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (extra, key) in [
            ("[sampling]\ntop_p = 1.5\n", "sampling.top_p"),
            ("[sampling]\ntemperature = -1.0\n", "sampling.temperature"),
            ("[sampling]\nmin_p = 2.0\n", "sampling.min_p"),
            (
                "[speculation]\ndraft_min = 9\ndraft_max = 4\n",
                "speculation.draft_min",
            ),
            ("[generation]\nstop = [\"\"]\n", "generation.stop"),
            ("[serve]\nslots = 0\n", "serve.slots"),
            ("[serve]\nqueue = -1\n", "serve.queue"),
            ("[serve]\nprefill_chunk = 0\n", "serve.prefill_chunk"),
            ("[serve]\nslot = 2\n", "serve.slot"),
        ] {
            let err = parse(&format!("{MINIMAL}{extra}")).unwrap_err().to_string();
            assert!(err.contains(key), "{extra}: {err}");
        }
    }

    #[test]
    fn missing_target_is_reported() {
        let err = parse("[sampling]\ntemperature = 0.0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("target"), "{err}");
    }

    #[test]
    fn paths_resolve_against_the_profile_directory() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.toml");
        std::fs::write(&file, format!("plugin_dir = \"plugins\"\n{MINIMAL}[drafter]\nplugin = \"./libx.so\"\nmodel = \"d.gguf\"\n")).unwrap();
        let p = Profile::load(&file).unwrap();
        assert_eq!(p.target.model, dir.path().join("m.gguf"));
        assert_eq!(p.plugin_dir, vec![dir.path().join("plugins")]);
        let d = p.drafter.unwrap();
        assert_eq!(d.model.unwrap(), dir.path().join("d.gguf"));
        assert!(d.plugin.starts_with(dir.path().to_str().unwrap()));
    }

    #[test]
    fn options_become_text() {
        let p = parse(&format!(
            "{MINIMAL}[target.options]\nring = 4\nmode = \"fast\"\n"
        ))
        .unwrap();
        assert_eq!(
            options_as_text(&p.target.options),
            vec![("mode".into(), "fast".into()), ("ring".into(), "4".into())]
        );
    }
}
