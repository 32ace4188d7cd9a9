//! Opening what a profile names: the target backend and its tokenizer, and, for speculative
//! decoding, the drafter plugin with the draft-model backend it may need.

use std::path::Path;

use anyhow::Context;
use specula_gguf::GgufFile;
use specula_plugin_api::{BoxedDrafter, BoxedForwardPass, DrafterParams, ModelInfo, PluginKind};

use crate::plugins::{backend_params, drafter_params, LoadedPlugin, PluginProvenance, SearchPath};
use crate::profile::{options_as_text, DrafterSection, Profile};
use crate::scheduler::budget::CostCurve;
use crate::sequence::SeqModel;
use specula_tokenizer::Tokenizer;

/// A drafter and the draft model the host opened for it.
pub struct DrafterSlot {
    /// The plugin name from the profile (`lookup`, `model`, `mtp`).
    pub name: String,
    pub drafter: BoxedDrafter,
    /// The separate draft model and the drafter's sequence of it, for model drafting.
    pub draft_model: Option<SeqModel>,
    /// What makes a fresh drafter after one was dropped ([`DrafterSlot::renew`]); `None`
    /// for a drafter given directly (tests).
    pub kit: Option<DrafterKit>,
}

impl DrafterSlot {
    /// A fresh drafter instance after a generation dropped this one (it failed, or left the
    /// target changed): the next generation drafts again; without a kit, it keeps this one.
    pub fn renew(&mut self) {
        let Some(kit) = &self.kit else {
            return;
        };
        match kit.create() {
            Ok(drafter) => self.drafter = drafter,
            Err(e) => tracing::warn!("cannot make a fresh '{}' drafter: {e:#}", self.name),
        }
        if let Some(model) = &mut self.draft_model {
            let _ = model.truncate(0);
        }
    }
}

/// A loaded profile: target model, tokenizer and optional drafter.
pub struct Pipeline {
    /// The target model and the sequence this pipeline decodes.
    pub target: SeqModel,
    pub tokenizer: Tokenizer,
    pub info: ModelInfo,
    pub drafter: Option<DrafterSlot>,
    /// The plugin builds this pipeline runs (target backend, drafter, draft-model backend).
    pub plugins: Vec<PluginProvenance>,
    /// The tokens the target's sequence holds after the last generation (empty when unknown),
    /// so a continuing one can keep them ([`crate::spec::generate_continuing`]).
    pub cached: Vec<u32>,
    /// The target's pass cost by row count, measured at open when the profile speculates
    /// with trees of an adaptive size: each step's tree gets the nodes that pay for their rows.
    pub cost_curve: Option<CostCurve>,
}

impl Pipeline {
    /// Loads the plugins and models a profile names. The drafter is opened only when the
    /// profile has a `[drafter]` section and `speculation.enabled` is true. Without one the
    /// target verifies one token per pass ([`Parts::verify_tokens`]): a drafter attached later
    /// needs [`open_with_verify_tokens`](Self::open_with_verify_tokens).
    pub fn open(profile: &Profile) -> anyhow::Result<Self> {
        Self::open_with_corpus(profile, None)
    }

    /// Like [`open`](Self::open), but hands the drafter `corpus` as token ids instead of
    /// tokenizing `drafter.corpus` (benchmarks use it to give prompt lookup the exact output).
    pub fn open_with_corpus(profile: &Profile, corpus: Option<Vec<u32>>) -> anyhow::Result<Self> {
        Self::from_parts(Parts::open(profile, 1, corpus)?, profile)
    }

    /// Like [`open`](Self::open), with room for verify passes of `verify_tokens` rows even
    /// when the profile does not speculate (the bench measures the verify cost of a plain
    /// pipeline).
    pub fn open_with_verify_tokens(profile: &Profile, verify_tokens: u32) -> anyhow::Result<Self> {
        Self::from_parts(Parts::open_sized(profile, 1, None, verify_tokens)?, profile)
    }

    fn from_parts(mut parts: Parts, profile: &Profile) -> anyhow::Result<Self> {
        let s = &profile.speculation;
        let cost_curve = match parts.drafter.is_some() && s.tree && s.adaptive {
            true => match CostCurve::measure(&mut parts.target).into_result() {
                Ok(curve) => Some(curve),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "cannot measure the target's pass cost: trees keep speculation.draft_max nodes"
                    );
                    None
                }
            },
            false => None,
        };
        let target = SeqModel::new(parts.target)
            .into_result()
            .context("cannot create a sequence of the target model")?;
        let drafter = match parts.drafter {
            Some(kit) => {
                let draft_model = match parts.draft_model {
                    Some(backend) => Some(
                        SeqModel::new(backend)
                            .into_result()
                            .context("cannot create a sequence of the draft model")?,
                    ),
                    None => None,
                };
                Some(DrafterSlot {
                    drafter: kit.create()?,
                    name: kit.name.clone(),
                    draft_model,
                    kit: Some(kit),
                })
            }
            None => None,
        };
        Ok(Self {
            target,
            tokenizer: parts.tokenizer,
            info: parts.info,
            drafter,
            plugins: parts.plugins,
            cached: Vec::new(),
            cost_curve,
        })
    }
}

/// A drafter plugin with its parameters: creates one drafter per sequence.
pub struct DrafterKit {
    /// The plugin name from the profile (`lookup`, `model`, `mtp`).
    pub name: String,
    plugin: LoadedPlugin,
    params: DrafterParams,
}

impl DrafterKit {
    /// A new drafter instance, for one sequence.
    pub fn create(&self) -> anyhow::Result<BoxedDrafter> {
        self.plugin
            .create_drafter(&self.params)
            .with_context(|| format!("cannot set up the '{}' drafter", self.name))
    }
}

/// What a profile opens for up to `sequences` concurrent sequences: one target backend
/// instance and one draft-model instance shared by them all, and the drafter plugin that
/// creates a drafter per sequence.
pub struct Parts {
    pub target: BoxedForwardPass,
    pub tokenizer: Tokenizer,
    pub info: ModelInfo,
    /// Present when the profile speculates (`[drafter]` and `speculation.enabled`).
    pub drafter: Option<DrafterKit>,
    /// The separate draft model, for model drafting.
    pub draft_model: Option<BoxedForwardPass>,
    /// The plugin builds these parts run (target backend, draft-model backend, drafter).
    pub plugins: Vec<PluginProvenance>,
}

impl Parts {
    /// Loads the plugins and models `profile` names, sized for `sequences` sequences and the
    /// verify passes its speculation needs ([`Parts::verify_tokens`]).
    pub fn open(
        profile: &Profile,
        sequences: u32,
        corpus: Option<Vec<u32>>,
    ) -> anyhow::Result<Self> {
        Self::open_sized(profile, sequences, corpus, Self::verify_tokens(profile))
    }

    /// The most tokens one verify pass of `profile` holds: the longest draft plus the certain
    /// token when it speculates, one when it decodes plainly — so that a hybrid model's
    /// recurrent-state snapshot ring (a plane per verify position) takes no memory a plain
    /// run cannot use.
    pub fn verify_tokens(profile: &Profile) -> u32 {
        match profile.drafter.is_some() && profile.speculation.enabled {
            true => profile.speculation.draft_max + 1,
            false => 1,
        }
    }

    /// [`open`](Self::open) with room for verify passes of `verify_tokens` rows.
    pub fn open_sized(
        profile: &Profile,
        sequences: u32,
        corpus: Option<Vec<u32>>,
        verify_tokens: u32,
    ) -> anyhow::Result<Self> {
        let search = SearchPath::new(&profile.plugin_dir);
        let target = &profile.target;
        warn_of_oversubscription(target.threads);
        let tokenizer = load_tokenizer(&target.model)?;
        let plugin = search.load(&target.backend, PluginKind::Backend)?;
        let mut plugins = vec![plugin.provenance()];
        let mut params = backend_params(
            &target.model,
            target.threads,
            target.context_size,
            verify_tokens,
            options_as_text(&target.options),
        );
        params.kv_tokens = target.kv_tokens;
        params.max_sequences = sequences;
        let backend = plugin.open_backend(&params)?;
        let info = backend.model_info();
        if let Some(note) = context_clamped(target.context_size, &info) {
            tracing::warn!("{}: {note}", target.model.display());
        }
        if info.vocab_size as usize != tokenizer.vocab_size() {
            tracing::warn!(
                model_vocab = info.vocab_size,
                tokenizer_vocab = tokenizer.vocab_size(),
                "the model's output size differs from its tokenizer's vocabulary"
            );
        }
        let (drafter, draft_model) = match &profile.drafter {
            Some(section) if profile.speculation.enabled => open_drafter(
                profile,
                section,
                &search,
                &tokenizer,
                &info,
                corpus,
                sequences,
                &mut plugins,
            )
            .map(|(kit, model)| (Some(kit), model))
            .with_context(|| format!("cannot set up the '{}' drafter", section.plugin))?,
            _ => (None, None),
        };
        Ok(Self {
            target: backend,
            tokenizer,
            info,
            drafter,
            draft_model,
            plugins,
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn open_drafter(
    profile: &Profile,
    section: &DrafterSection,
    search: &SearchPath,
    tokenizer: &Tokenizer,
    target_info: &ModelInfo,
    corpus_tokens: Option<Vec<u32>>,
    sequences: u32,
    plugins: &mut Vec<PluginProvenance>,
) -> anyhow::Result<(DrafterKit, Option<BoxedForwardPass>)> {
    let draft_model = match &section.model {
        Some(model) => {
            let draft_tokenizer = load_tokenizer(model)?;
            check_same_vocabulary(tokenizer, &draft_tokenizer, &profile.target.model, model)?;
            let backend_name = section
                .backend
                .as_deref()
                .unwrap_or(&profile.target.backend);
            let plugin = search.load(backend_name, PluginKind::Backend)?;
            plugins.push(plugin.provenance());
            let threads = if section.threads > 0 {
                section.threads
            } else {
                profile.target.threads
            };
            let mut params = backend_params(
                model,
                threads,
                profile.target.context_size,
                profile.speculation.draft_max + 1,
                Vec::new(),
            );
            params.max_sequences = sequences;
            Some(
                plugin
                    .open_backend(&params)
                    .with_context(|| format!("cannot open the draft model {}", model.display()))?,
            )
        }
        None => None,
    };
    let corpus = match (corpus_tokens, &section.corpus) {
        (Some(tokens), _) => tokens,
        (None, Some(path)) => {
            let text = crate::bounded::read_to_string(path, section.corpus_max_bytes).map_err(
                |e| match e {
                    crate::bounded::BoundedReadError::TooLarge { .. } => anyhow::anyhow!(
                        "drafter.corpus: {e}; raise drafter.corpus_max_bytes for a larger corpus"
                    ),
                    e => anyhow::anyhow!("drafter.corpus: {e}"),
                },
            )?;
            tokenizer.encode(&text, false, false)
        }
        (None, None) => Vec::new(),
    };
    let params = drafter_params(
        target_info.clone(),
        draft_model.as_ref().map(|m| m.model_info()),
        options_as_text(&section.options),
        corpus,
    );
    let plugin = search.load(&section.plugin, PluginKind::Drafter)?;
    plugins.push(plugin.provenance());
    let kit = DrafterKit {
        name: section.plugin.clone(),
        plugin,
        params,
    };
    Ok((kit, draft_model))
}

/// Warns when `threads` workers would outnumber the CPUs: every pass waits for its slowest
/// worker, and a worker that waits for a core makes a pass many times slower.
fn warn_of_oversubscription(threads: u32) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads as usize > cpus {
        tracing::warn!(
            "{threads} worker threads on {cpus} CPUs: passes slow down sharply when threads outnumber the cores; use -t 0 (or target.threads = 0) for one per core"
        );
    }
}

/// What to tell a user who asked for a context of `asked` tokens (0: the model's own) that
/// the backend cut to the length the model was trained for, if it did.
pub(crate) fn context_clamped(asked: u32, info: &ModelInfo) -> Option<String> {
    (asked > info.context_size).then(|| {
        format!(
            "a context of {asked} tokens was asked for, but the model was trained for {}; using {}",
            info.train_context_length, info.context_size
        )
    })
}

/// Model drafting needs the two models to speak the same token ids.
pub(crate) fn check_same_vocabulary(
    target: &Tokenizer,
    draft: &Tokenizer,
    target_path: &Path,
    draft_path: &Path,
) -> anyhow::Result<()> {
    let mismatch = |detail: String| {
        anyhow::anyhow!(
            "target and draft vocabularies differ ({} vs {}): {detail}; a draft model must use the target's tokenizer",
            target_path.display(),
            draft_path.display()
        )
    };
    if target.vocab_size() != draft.vocab_size() {
        return Err(mismatch(format!(
            "{} tokens vs {} tokens",
            target.vocab_size(),
            draft.vocab_size()
        )));
    }
    for id in 0..target.vocab_size() as u32 {
        let (a, b) = (target.token_text(id), draft.token_text(id));
        if a != b {
            return Err(mismatch(format!("token {id} is {a:?} vs {b:?}")));
        }
    }
    Ok(())
}

/// Reads the tokenizer from a GGUF file's metadata.
pub fn load_tokenizer(model: &Path) -> anyhow::Result<Tokenizer> {
    let file = GgufFile::open(model)?;
    Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot build the tokenizer of {}", model.display()))
}
