//! The flags that say what model to run and how, shared by `specula run` and `specula chat`:
//! a profile or a model (or the built-in default), the sampling settings, the drafter.

use crate::builtin;
use crate::profile::{DrafterSection, Profile};

use super::ProfileArg;

#[derive(Debug, clap::Args)]
pub struct Setup {
    #[command(flatten)]
    pub(super) profile: ProfileArg,
    /// A GGUF model to run, without a profile (or instead of the profile's model).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub(super) model: Option<std::path::PathBuf>,
    /// Backend plugin (name or library path) for the model; default cpu-simd.
    #[arg(long, value_name = "NAME")]
    pub(super) backend: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", value_name = "N")]
    pub(super) max_tokens: Option<u32>,
    /// Stop when this string appears (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    pub(super) stop: Vec<String>,
    /// Sampling temperature; 0 = greedy [profile's, else 0.8].
    #[arg(
        long = "temp",
        alias = "temperature",
        value_name = "T",
        allow_negative_numbers = true
    )]
    pub(super) temperature: Option<f32>,
    /// Sample from the K most likely tokens; 0 = all [profile's, else 40].
    #[arg(long, value_name = "K")]
    pub(super) top_k: Option<u32>,
    /// Sample from the smallest set of tokens whose probabilities reach P; 1 = off [else 0.95].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub(super) top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one; 0 = off [else 0.05].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub(super) min_p: Option<f32>,
    /// Divide the logits of recently seen tokens by R; 1 = off [else 1.0].
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    pub(super) repeat_penalty: Option<f32>,
    /// How many recent tokens the repetition penalty looks at [else 64].
    #[arg(long, value_name = "N")]
    pub(super) repeat_last_n: Option<u32>,
    /// Seed of the sampler, for reproducible sampling [else random].
    #[arg(long, value_name = "S")]
    pub(super) seed: Option<u64>,
    /// Worker threads of the backend (0 = one per core).
    #[arg(short, long, value_name = "N")]
    pub(super) threads: Option<u32>,
    /// Context size in tokens (0 = the model's).
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub(super) context_size: Option<u32>,
    /// Do not prepend BOS to the prompt.
    #[arg(long)]
    pub(super) no_bos: bool,
    /// Drafter plugin for speculative decoding: `lookup`, `model`, `mtp`, a drafter plugin's
    /// name or library path, or `none`.
    #[arg(long, value_name = "NAME")]
    pub(super) drafter: Option<String>,
    /// Draft model for model drafting (implies `--drafter model` when no drafter is set).
    #[arg(long, value_name = "FILE")]
    pub(super) draft_model: Option<std::path::PathBuf>,
    /// Most draft tokens per step.
    #[arg(long, value_name = "N")]
    pub(super) draft_max: Option<u32>,
    /// Fewest draft tokens per step while speculating.
    #[arg(long, value_name = "N")]
    pub(super) draft_min: Option<u32>,
    /// Draft the maximum every step and verify every draft: turn off the adaptive draft length
    /// (which shortens drafts, cuts greedy drafts their drafter gives under 5%, and pauses
    /// speculation when it does not pay, judged partly by measured time).
    #[arg(long)]
    pub(super) fixed_draft: bool,
    /// Verify a tree of drafts per pass (tree speculation; `draft_max` is then the most
    /// nodes): the profile's `[speculation] tree = true`.
    #[arg(long)]
    pub(super) tree: bool,
    /// Plain decoding: ignore the profile's drafter.
    #[arg(long)]
    pub(super) no_spec: bool,
}

impl Setup {
    /// The profile these flags describe, and whether it is the built-in default (neither
    /// `--profile` nor `-m`, which is then announced on stderr).
    pub fn profile(&self) -> anyhow::Result<(Profile, bool)> {
        let builtin = self.profile.profile.is_none() && self.model.is_none();
        let mut profile = match (&self.profile.profile, &self.model) {
            (Some(path), _) => Profile::load(path)?,
            (None, Some(model)) => Profile::builtin_default(model.clone()),
            (None, None) => builtin::profile(builtin::model_path()?),
        };
        if builtin {
            eprintln!(
                "no --profile or -m given: the built-in default, {} ({})",
                builtin::DESCRIPTION,
                profile.target.model.display()
            );
        }
        self.apply(&mut profile)?;
        Ok((profile, builtin))
    }

    /// Writes the flags given over the profile's settings, checking their values.
    fn apply(&self, profile: &mut Profile) -> anyhow::Result<()> {
        let s = &mut profile.sampling;
        if let Some(v) = self.temperature {
            anyhow::ensure!(
                v >= 0.0 && v.is_finite(),
                "--temp {v}: must be a finite number >= 0"
            );
            s.temperature = v;
        }
        if let Some(v) = self.top_k {
            s.top_k = v;
        }
        if let Some(v) = self.top_p {
            anyhow::ensure!(v > 0.0 && v <= 1.0, "--top-p {v}: must be in (0, 1]");
            s.top_p = v;
        }
        if let Some(v) = self.min_p {
            anyhow::ensure!((0.0..=1.0).contains(&v), "--min-p {v}: must be in [0, 1]");
            s.min_p = v;
        }
        if let Some(v) = self.repeat_penalty {
            anyhow::ensure!(
                v > 0.0 && v.is_finite(),
                "--repeat-penalty {v}: must be > 0"
            );
            s.repeat_penalty = v;
        }
        if let Some(v) = self.repeat_last_n {
            s.repeat_last_n = v;
        }
        if self.seed.is_some() {
            s.seed = self.seed;
        }
        if let Some(v) = self.max_tokens {
            profile.generation.max_tokens = v;
        }
        if !self.stop.is_empty() {
            anyhow::ensure!(
                self.stop.iter().all(|s| !s.is_empty()),
                "--stop: stop strings must not be empty"
            );
            profile.generation.stop = self.stop.clone();
        }
        if self.no_bos {
            profile.generation.add_bos = false;
        }
        if let Some(model) = &self.model {
            profile.target.model = model.clone();
        }
        if let Some(backend) = &self.backend {
            profile.target.backend = backend.clone();
        }
        if let Some(v) = self.threads {
            profile.target.threads = v;
        }
        if let Some(v) = self.context_size {
            profile.target.context_size = v;
        }
        match self.drafter.as_deref() {
            Some("none") => profile.drafter = None,
            Some(name) => match &mut profile.drafter {
                Some(section) => section.plugin = name.to_string(),
                None => profile.drafter = Some(DrafterSection::named(name)),
            },
            None => {}
        }
        if let Some(model) = &self.draft_model {
            let section = profile
                .drafter
                .get_or_insert_with(|| DrafterSection::named("model"));
            section.model = Some(model.clone());
        }
        let spec = &mut profile.speculation;
        if let Some(v) = self.draft_max {
            anyhow::ensure!(v <= 64, "--draft-max {v}: at most 64");
            spec.draft_max = v;
        }
        if let Some(v) = self.draft_min {
            spec.draft_min = v;
        }
        anyhow::ensure!(
            spec.draft_min <= spec.draft_max,
            "--draft-min {} is larger than the draft maximum {}",
            spec.draft_min,
            spec.draft_max
        );
        if self.fixed_draft {
            spec.adaptive = false;
        }
        if self.tree {
            spec.tree = true;
        }
        if self.no_spec {
            spec.enabled = false;
        }
        Ok(())
    }
}
