//! `specula profile check`: everything `run` would refuse about a profile, found without
//! loading weights — the plugins resolved, the model files' headers read, the backend's
//! options and the drafter's needs checked by the plugins themselves — and listed together.

use std::path::{Path, PathBuf};

use specula_gguf::GgufFile;
use specula_plugin_api::{ModelInfo, PluginKind};

use crate::pipeline::check_same_vocabulary;
use crate::plugins::{backend_params, drafter_params, LoadedPlugin, SearchPath};
use crate::profile::{options_as_text, Profile};
use specula_tokenizer::Tokenizer;

/// What a check found.
#[derive(Debug, Default)]
pub struct Report {
    /// One line each: what is wrong and where.
    pub problems: Vec<String>,
    /// What the profile runs, for the `ok` summary.
    pub facts: Vec<(&'static str, String)>,
}

impl Report {
    fn problem(&mut self, text: impl Into<String>) {
        self.problems.push(text.into());
    }
}

/// Checks the profile at `path` (its file must parse first: a parse error — bad TOML, an
/// unknown key, a value of the wrong type — is the only problem reported then; out-of-range
/// values are all reported, then nothing else).
pub fn check_profile(path: &Path) -> Report {
    let mut report = Report::default();
    let profile = match Profile::load(path) {
        Ok(p) => p,
        Err(e) => {
            e.problems().into_iter().for_each(|p| report.problem(p));
            return report;
        }
    };
    for dir in &profile.plugin_dir {
        if !dir.is_dir() {
            report.problem(format!(
                "plugin_dir: {} is not a directory (plugins are looked for in it first)",
                dir.display()
            ));
        }
    }
    let search = SearchPath::new(&profile.plugin_dir);
    let target = &profile.target;
    report.facts.push(("backend", target.backend.clone()));
    report
        .facts
        .push(("model", target.model.display().to_string()));

    let backend = resolve(
        &mut report,
        &search,
        &target.backend,
        PluginKind::Backend,
        "target.backend",
    );
    let tokenizer = read_model(&mut report, &target.model, "target.model");
    let verify_tokens = crate::pipeline::Parts::verify_tokens(&profile);
    let params = backend_params(
        &target.model,
        target.threads,
        target.context_size,
        verify_tokens,
        options_as_text(&target.options),
    );
    let info = match (&backend, &tokenizer) {
        (Some(plugin), Some(_)) => probe(&mut report, plugin, &params, "target").or_else(|| {
            // The model's facts for the drafter's check, when only the options were wrong.
            let plain = backend_params(
                &target.model,
                1,
                target.context_size,
                verify_tokens,
                Vec::new(),
            );
            plugin.probe_backend(&plain).and_then(Result::ok)
        }),
        _ => None,
    };
    if let Some(info) = &info {
        report.facts.push((
            "model info",
            format!(
                "{} ({}), {} layers, vocabulary {}, context {}{}",
                info.name,
                info.architecture,
                info.n_layers,
                info.vocab_size,
                info.context_size,
                if info.has_mtp_head { ", MTP head" } else { "" }
            ),
        ));
        if let Some(note) = crate::pipeline::context_clamped(target.context_size, info) {
            report
                .facts
                .push(("note", format!("target.context_size: {note}")));
        }
    }

    let Some(section) = &profile.drafter else {
        report
            .facts
            .push(("drafter", "none (plain decoding)".into()));
        return report;
    };
    if !profile.speculation.enabled {
        report.facts.push((
            "drafter",
            format!("{} (off: speculation.enabled = false)", section.plugin),
        ));
        return report;
    }
    report.facts.push(("drafter", section.plugin.clone()));
    if profile.speculation.draft_max == 0 {
        report.problem(
            "speculation.draft_max = 0: the drafter would never be asked for a draft; set it to 1 or more, or remove [drafter]",
        );
    }
    let drafter = resolve(
        &mut report,
        &search,
        &section.plugin,
        PluginKind::Drafter,
        "drafter.plugin",
    );

    let mut draft_info = None;
    let mut draft_model_ok = true;
    if let Some(model) = &section.model {
        draft_model_ok = false;
        let draft_tokenizer = read_model(&mut report, model, "drafter.model");
        if let (Some(t), Some(d)) = (&tokenizer, &draft_tokenizer) {
            if let Err(e) = check_same_vocabulary(t, d, &target.model, model) {
                report.problem(format!("drafter.model: {e}"));
            }
        }
        let backend_name = section.backend.as_deref().unwrap_or(&target.backend);
        let draft_backend = resolve(
            &mut report,
            &search,
            backend_name,
            PluginKind::Backend,
            "drafter.backend",
        );
        if let (Some(plugin), Some(_)) = (&draft_backend, &draft_tokenizer) {
            let threads = if section.threads > 0 {
                section.threads
            } else {
                target.threads
            };
            let params = backend_params(
                model,
                threads,
                target.context_size,
                verify_tokens,
                Vec::new(),
            );
            draft_info = probe(&mut report, plugin, &params, "drafter.model");
            draft_model_ok = draft_info.is_some();
        }
    }
    if let Some(corpus) = &section.corpus {
        if let Err(e) = check_corpus(corpus, section.corpus_max_bytes) {
            report.problem(format!("drafter.corpus: {e}"));
        }
    }
    // The drafter judges its models only when they could be read (else it would only say
    // what the problems above already say).
    if let (Some(plugin), Some(target_info), true) = (&drafter, &info, draft_model_ok) {
        let params = drafter_params(
            target_info.clone(),
            draft_info,
            options_as_text(&section.options),
            Vec::new(),
        );
        match plugin.check_drafter(&params) {
            Some(Err(e)) => report.problem(format!("drafter: {e}")),
            Some(Ok(())) => {}
            None => report.facts.push((
                "note",
                format!(
                    "the '{}' drafter plugin cannot check its settings ahead of a run",
                    section.plugin
                ),
            )),
        }
    }
    report
}

/// The plugin `reference` of `kind`, or a problem naming the profile key.
fn resolve(
    report: &mut Report,
    search: &SearchPath,
    reference: &str,
    kind: PluginKind,
    key: &str,
) -> Option<LoadedPlugin> {
    match search.load(reference, kind) {
        Ok(plugin) => Some(plugin),
        Err(e) => {
            report.problem(format!("{key}: {e}"));
            None
        }
    }
}

/// Reads the GGUF header and the tokenizer of `model`, or a problem naming the profile key.
fn read_model(report: &mut Report, model: &Path, key: &str) -> Option<Tokenizer> {
    let file = match GgufFile::open(model) {
        Ok(file) => file,
        Err(e) => {
            report.problem(format!("{key}: {e}"));
            return None;
        }
    };
    match Tokenizer::from_gguf(&file) {
        Ok(t) => Some(t),
        Err(e) => {
            report.problem(format!(
                "{key}: {}: no usable tokenizer: {e}",
                model.display()
            ));
            None
        }
    }
}

/// The backend's own check of `params`, or a problem.
fn probe(
    report: &mut Report,
    plugin: &LoadedPlugin,
    params: &specula_plugin_api::BackendParams,
    key: &str,
) -> Option<ModelInfo> {
    match plugin.probe_backend(params) {
        Some(Ok(info)) => Some(info),
        Some(Err(e)) => {
            report.problem(format!("{key}: {e}"));
            None
        }
        None => {
            report.facts.push((
                "note",
                format!("{} cannot check a model ahead of a run", plugin.info().name),
            ));
            None
        }
    }
}

/// A corpus must be a regular file within its cap (it is not read here).
fn check_corpus(path: &PathBuf, limit: u64) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!(
            "{} is not a regular file (a directory, device or pipe)",
            path.display()
        ));
    }
    if meta.len() > limit {
        return Err(format!(
            "{} is {} bytes, more than drafter.corpus_max_bytes = {limit}",
            path.display(),
            meta.len()
        ));
    }
    Ok(())
}
