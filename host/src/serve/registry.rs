//! The served profiles and their reloading.
//!
//! Each profile file is a model named by its file stem. An [`Entry`] per name holds the
//! revision that new requests go to — an `ArcSwapOption<Model>`, swapped atomically — and
//! the entry's status. A reload (file change, SIGHUP, `POST /admin/reload`):
//!
//! 1. rescans the `--profiles` directories and files: new files add entries, vanished files
//!    remove them (requests already running keep their revision alive until they end);
//! 2. for every entry, parses the profile and compares it (and the model files' mtimes)
//!    with the serving revision; an unchanged profile is left alone, a changed or failed one
//!    is loaded **beside** the serving revision in a blocking task;
//! 3. when the new revision is ready it is swapped in; requests admitted before keep their
//!    `Arc` of the old revision and finish on it, which is dropped (with its backends) when
//!    the last of them ends;
//! 4. a profile that fails to parse or load leaves the old revision serving, and the error
//!    is kept for `/health`, logged, and returned in the reload report.
//!
//! Loading goes through [`Parts::open`], which searches the plugin directories afresh,
//! so a drafter plugin dropped into a plugin directory is found by the next reload. Reloads
//! run one at a time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use arc_swap::{ArcSwap, ArcSwapOption};
use serde::Serialize;
use serde_json::{json, Value};
use specula_gguf::GgufFile;

use crate::pipeline::Parts;
use crate::plugins::PluginProvenance;
use crate::profile::{Profile, ProfileError};
use crate::scheduler::{Engine, EngineOptions};
use specula_tokenizer::Tokenizer;

use super::metrics::Metrics;
use super::slots::{PoolGauges, SlotPool};
use super::worker::panic_message;
use crate::chat_template::ChatTemplate;

/// Why a profile could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("{0}")]
    Open(String),
    #[error("loading panicked: {0}")]
    Panic(String),
}

/// What a loaded revision depends on: the parsed profile and the model files' mtimes.
#[derive(Debug, Clone, PartialEq)]
struct Fingerprint {
    profile: Profile,
    files: Vec<(PathBuf, Option<SystemTime>)>,
}

impl Fingerprint {
    fn of(profile: &Profile) -> Self {
        let mut paths = vec![profile.target.model.clone()];
        if let Some(d) = &profile.drafter {
            paths.extend(d.model.iter().cloned());
            paths.extend(d.corpus.iter().cloned());
        }
        let files = paths
            .into_iter()
            .map(|p| {
                let mtime = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
                (p, mtime)
            })
            .collect();
        Self {
            profile: profile.clone(),
            files,
        }
    }
}

/// One loaded revision of a profile: its slots and what requests need to validate prompts.
pub struct Model {
    /// The profile name (file stem) clients use as `model`.
    pub name: String,
    /// Counts this profile's loads: 1 for the first, growing with every reload.
    pub revision: u64,
    pub path: PathBuf,
    pub profile: Profile,
    fingerprint: Fingerprint,
    /// The drafter plugin when speculating.
    pub drafter: Option<String>,
    /// The plugin builds this revision runs.
    pub plugins: Vec<PluginProvenance>,
    pub context_size: usize,
    /// For counting prompt tokens before a request is admitted.
    pub tokenizer: Tokenizer,
    pub chat: ChatTemplate,
    /// Why the model's own chat template is not used, when it has one that does not compile.
    pub chat_note: Option<String>,
    /// Admission: one slot per concurrent sequence, and the bounded queue in front.
    pub pool: Arc<SlotPool<()>>,
    /// The engine loop that batches this revision's running requests into shared passes.
    pub engine: Engine,
    /// Unix time of the load.
    pub created: u64,
}

impl Model {
    /// Opens the profile's models for `serve.slots` sequences, starts their engine loop, and
    /// reads the chat template. Blocking.
    fn load(
        name: &str,
        path: &Path,
        profile: Profile,
        fingerprint: Fingerprint,
        revision: u64,
        metrics: &Metrics,
    ) -> Result<Self, LoadError> {
        let open = |e: anyhow::Error| LoadError::Open(format!("{e:#}"));
        let file = GgufFile::open(&profile.target.model)
            .map_err(|e| LoadError::Open(format!("{}: {e}", profile.target.model.display())))?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|e| {
            LoadError::Open(format!(
                "cannot build the tokenizer of {}: {e}",
                profile.target.model.display()
            ))
        })?;
        let (chat, chat_note) = ChatTemplate::of_model(&file, &tokenizer);
        if let Some(note) = &chat_note {
            tracing::warn!(
                model = name,
                "{note}; chat requests use the plain fallback format"
            );
        }
        drop(file);
        let slots = profile.serve.slots.max(1);
        let parts = Parts::open(&profile, slots, None).map_err(open)?;
        let drafter = parts.drafter.as_ref().map(|d| d.name.clone());
        let plugins = parts.plugins.clone();
        let context_size = parts.info.context_size as usize;
        let options = EngineOptions {
            prefill_chunk: profile.serve.prefill_chunk as usize,
            observer: metrics.engine_observer(name),
            cost_curve: None,
            reopen: Some(Arc::new({
                let profile = profile.clone();
                move || Parts::open(&profile, slots, None)
            })),
        };
        let engine = Engine::start(parts, slots as usize, options).map_err(open)?;
        let gauges = PoolGauges {
            queued: metrics.queue_depth.with_label_values(&[name]),
            active: metrics.active.with_label_values(&[name]),
        };
        let pool = SlotPool::new(
            vec![(); slots as usize],
            profile.serve.queue as usize,
            gauges,
        );
        Ok(Self {
            name: name.to_string(),
            revision,
            path: path.to_path_buf(),
            drafter,
            plugins,
            context_size,
            tokenizer,
            chat,
            chat_note,
            pool,
            engine,
            created: unix_now(),
            profile,
            fingerprint,
        })
    }

    /// `name-rREVISION`, sent as `system_fingerprint`.
    pub fn fingerprint_label(&self) -> String {
        format!("{}-r{}", self.name, self.revision)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[derive(Default)]
struct EntryStatus {
    path: PathBuf,
    loading: bool,
    /// The last load attempt's error; cleared by a successful or unneeded load.
    last_error: Option<String>,
    /// Replaced revisions, alive while requests still run on them.
    retired: Vec<Weak<Model>>,
}

/// A profile name and the revision serving it.
pub struct Entry {
    pub name: String,
    serving: ArcSwapOption<Model>,
    status: Mutex<EntryStatus>,
    /// Revisions loaded for this profile so far (each load takes the next number).
    revisions: AtomicU64,
}

impl Entry {
    fn new(name: &str, path: &Path) -> Self {
        Self {
            name: name.to_string(),
            serving: ArcSwapOption::empty(),
            status: Mutex::new(EntryStatus {
                path: path.to_path_buf(),
                ..Default::default()
            }),
            revisions: AtomicU64::new(0),
        }
    }

    fn status(&self) -> std::sync::MutexGuard<'_, EntryStatus> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The revision new requests go to.
    pub fn serving(&self) -> Option<Arc<Model>> {
        self.serving.load_full()
    }

    fn swap_in(&self, model: Arc<Model>) {
        if let Some(old) = self.serving.swap(Some(model)) {
            self.retire(old);
        }
    }

    fn retire(&self, old: Arc<Model>) {
        let mut status = self.status();
        status.retired.retain(|w| w.strong_count() > 0);
        status.retired.push(Arc::downgrade(&old));
    }

    fn health(&self) -> Value {
        let serving = self.serving();
        let mut status = self.status();
        status.retired.retain(|w| w.strong_count() > 0);
        let draining: Vec<Value> = status
            .retired
            .iter()
            .filter_map(Weak::upgrade)
            .map(|m| json!({"revision": m.revision, "active": m.pool.active(), "queued": m.pool.queued()}))
            .collect();
        let engine_failure = serving.as_ref().and_then(|m| m.engine.failure());
        let state = match (&serving, status.loading, &status.last_error) {
            (Some(_), _, _) if engine_failure.is_some() => "failed",
            (Some(_), _, _) => "ready",
            (None, true, _) => "loading",
            (None, false, Some(_)) => "failed",
            (None, false, None) => "loading",
        };
        let mut v = json!({
            "state": state,
            "profile": status.path,
            "loading": status.loading,
            "last_error": status.last_error,
            "draining": draining,
        });
        if let (Some(m), Some(map)) = (serving, v.as_object_mut()) {
            map.insert("revision".into(), json!(m.revision));
            map.insert("drafter".into(), json!(m.drafter));
            map.insert("plugins".into(), json!(m.plugins));
            map.insert("slots".into(), json!(m.pool.slots()));
            map.insert("busy".into(), json!(m.pool.active()));
            map.insert("queued".into(), json!(m.pool.queued()));
            map.insert("context_size".into(), json!(m.context_size));
            map.insert(
                "chat_template".into(),
                json!(if m.chat.is_fallback() {
                    "fallback"
                } else {
                    "gguf"
                }),
            );
            map.insert("chat_template_error".into(), json!(m.chat_note));
            map.insert("loaded_at".into(), json!(m.created));
            let curve = m.engine.cost_curve();
            map.insert(
                "engine".into(),
                json!({
                    "sequences": m.engine.sequences(),
                    "cost_4_rows": curve.relative(4),
                    "cost_8_rows": curve.relative(8),
                    "failure": engine_failure,
                }),
            );
        }
        v
    }
}

/// The outcome of a model lookup for a request.
pub enum Lookup {
    Ready(Arc<Model>),
    /// Known, but no revision is serving (first load running, or it failed).
    NotReady {
        error: Option<String>,
    },
    Unknown,
}

/// What a reload did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadReport {
    pub trigger: String,
    pub loaded: Vec<Loaded>,
    pub unchanged: Vec<String>,
    pub removed: Vec<String>,
    pub failed: Vec<Failed>,
    /// Problems with the profile sources themselves (unreadable directory, duplicate names).
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Loaded {
    pub model: String,
    pub revision: u64,
    pub drafter: Option<String>,
    /// The plugin builds that serve it (name, version, file, size, modification time).
    pub plugins: Vec<PluginProvenance>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Failed {
    pub model: String,
    pub error: String,
    /// Whether an older revision keeps serving.
    pub still_serving: Option<u64>,
}

impl ReloadReport {
    pub fn ok(&self) -> bool {
        self.failed.is_empty() && self.problems.is_empty()
    }
}

/// Every served profile.
pub struct Registry {
    sources: Vec<PathBuf>,
    /// Profiles given on the command line (`serve -m FILE --alias NAME`), by name.
    inline: BTreeMap<String, Profile>,
    entries: ArcSwap<BTreeMap<String, Arc<Entry>>>,
    reload_lock: tokio::sync::Mutex<()>,
    metrics: Arc<Metrics>,
}

impl Registry {
    /// Profiles from `sources` (directories of `*.toml`, or files); nothing is loaded until
    /// the first [`Registry::reload`].
    pub fn new(sources: Vec<PathBuf>, metrics: Arc<Metrics>) -> Self {
        Self::with_inline(sources, BTreeMap::new(), metrics)
    }

    /// Profiles from `sources` plus `inline` ones that have no file (a model given with
    /// `serve -m`); an inline profile's entry shows its model file as its path.
    pub fn with_inline(
        sources: Vec<PathBuf>,
        inline: BTreeMap<String, Profile>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            sources,
            inline,
            entries: ArcSwap::from_pointee(BTreeMap::new()),
            reload_lock: tokio::sync::Mutex::new(()),
            metrics,
        }
    }

    pub fn sources(&self) -> &[PathBuf] {
        &self.sources
    }

    /// Profile names, loaded or not.
    pub fn names(&self) -> Vec<String> {
        self.entries.load().keys().cloned().collect()
    }

    /// The revisions serving now.
    pub fn ready(&self) -> Vec<Arc<Model>> {
        self.entries
            .load()
            .values()
            .filter_map(|e| e.serving())
            .collect()
    }

    /// Where a request for `name` goes.
    pub fn lookup(&self, name: &str) -> Lookup {
        match self.entries.load().get(name) {
            None => Lookup::Unknown,
            Some(entry) => match entry.serving() {
                Some(model) => Lookup::Ready(model),
                None => Lookup::NotReady {
                    error: entry.status().last_error.clone(),
                },
            },
        }
    }

    /// Per-profile status, and whether at least one profile is ready.
    pub fn health(&self) -> (bool, Value) {
        let entries = self.entries.load();
        let models: serde_json::Map<String, Value> = entries
            .iter()
            .map(|(name, e)| (name.clone(), e.health()))
            .collect();
        let ready = entries
            .values()
            .any(|e| e.serving().is_some_and(|m| m.engine.failure().is_none()));
        (ready, Value::Object(models))
    }

    /// Rescans the sources and loads what changed (everything with `force`; only the
    /// profile `only` when given). Waits for a reload already running.
    pub async fn reload(&self, trigger: &str, only: Option<&str>, force: bool) -> ReloadReport {
        let _one_at_a_time = self.reload_lock.lock().await;
        let mut report = ReloadReport {
            trigger: trigger.to_string(),
            ..Default::default()
        };
        let (mut found, problems, complete) = discover(&self.sources);
        report.problems = problems;
        for (name, profile) in &self.inline {
            if let Some(file) = found.get(name) {
                report.problems.push(format!(
                    "profile name `{name}` is used by both -m {} and {}; serving the model",
                    profile.target.model.display(),
                    file.display()
                ));
            }
            found.insert(name.clone(), profile.target.model.clone());
        }

        let current = self.entries.load_full();
        let mut next: BTreeMap<String, Arc<Entry>> = BTreeMap::new();
        for (name, path) in &found {
            let entry = match current.get(name) {
                Some(e) => {
                    e.status().path = path.clone();
                    e.clone()
                }
                None => Arc::new(Entry::new(name, path)),
            };
            next.insert(name.clone(), entry);
        }
        for (name, entry) in current.iter() {
            if next.contains_key(name) {
                continue;
            }
            if complete {
                if let Some(old) = entry.serving.swap(None) {
                    tracing::info!(model = %name, revision = old.revision, "profile removed; requests running on it finish");
                }
                self.metrics.ready.with_label_values(&[name]).set(0);
                self.metrics.slots.with_label_values(&[name]).set(0);
                report.removed.push(name.clone());
            } else {
                next.insert(name.clone(), entry.clone());
            }
        }
        self.entries.store(Arc::new(next.clone()));
        if let Some(only) = only {
            if !next.contains_key(only) {
                report.problems.push(format!("no profile named `{only}`"));
            }
        }

        for (name, entry) in next {
            if only.is_some_and(|o| o != name) {
                continue;
            }
            self.reload_entry(&name, &entry, force, &mut report).await;
        }
        if report.ok() {
            tracing::info!(
                trigger,
                loaded = report.loaded.len(),
                removed = report.removed.len(),
                "reload done"
            );
        } else {
            tracing::warn!(trigger, failed = report.failed.len(), problems = ?report.problems, "reload done with errors");
        }
        report
    }

    async fn reload_entry(
        &self,
        name: &str,
        entry: &Arc<Entry>,
        force: bool,
        report: &mut ReloadReport,
    ) {
        let path = entry.status().path.clone();
        let serving = entry.serving();
        let fail = |report: &mut ReloadReport, error: String| {
            match &serving {
                Some(old) => tracing::error!(
                    model = name,
                    "cannot load {}: {error}; revision {} keeps serving",
                    path.display(),
                    old.revision
                ),
                None => tracing::error!(model = name, "cannot load {}: {error}", path.display()),
            }
            self.metrics
                .loads
                .with_label_values(&[name, "failed"])
                .inc();
            entry.status().last_error = Some(error.clone());
            report.failed.push(Failed {
                model: name.to_string(),
                error,
                still_serving: serving.as_ref().map(|m| m.revision),
            });
        };
        let loaded = match self.inline.get(name) {
            Some(profile) => Ok(profile.clone()),
            None => Profile::load(&path),
        };
        let profile = match loaded {
            Ok(p) => p,
            Err(e) => return fail(report, e.to_string()),
        };
        let fingerprint = Fingerprint::of(&profile);
        if let Some(old) = &serving {
            // A revision whose engine stopped serving is reloaded even when unchanged.
            if !force && old.fingerprint == fingerprint && old.engine.failure().is_none() {
                entry.status().last_error = None;
                report.unchanged.push(name.to_string());
                return;
            }
        }
        entry.status().loading = true;
        let revision = entry.revisions.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(model = name, revision, "loading {}", path.display());
        let (task_name, task_path, metrics) =
            (name.to_string(), path.clone(), self.metrics.clone());
        let loaded = tokio::task::spawn_blocking(move || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Model::load(
                    &task_name,
                    &task_path,
                    profile,
                    fingerprint,
                    revision,
                    &metrics,
                )
            }))
            .unwrap_or_else(|p| Err(LoadError::Panic(panic_message(&*p))))
        })
        .await
        .unwrap_or_else(|e| Err(LoadError::Panic(e.to_string())));
        entry.status().loading = false;
        match loaded {
            Ok(model) => {
                let model = Arc::new(model);
                let plugins: Vec<String> = model.plugins.iter().map(|p| p.to_string()).collect();
                tracing::info!(
                    model = name,
                    revision,
                    drafter = model.drafter.as_deref().unwrap_or("none"),
                    slots = model.pool.slots(),
                    cost_4_rows = format!("{:.2}", model.engine.cost_curve().relative(4)),
                    cost_8_rows = format!("{:.2}", model.engine.cost_curve().relative(8)),
                    plugins = %plugins.join("; "),
                    "ready"
                );
                self.metrics.loads.with_label_values(&[name, "ok"]).inc();
                self.metrics.ready.with_label_values(&[name]).set(1);
                self.metrics
                    .slots
                    .with_label_values(&[name])
                    .set(model.pool.slots() as i64);
                report.loaded.push(Loaded {
                    model: name.to_string(),
                    revision,
                    drafter: model.drafter.clone(),
                    plugins: model.plugins.clone(),
                });
                entry.swap_in(model);
                entry.status().last_error = None;
            }
            Err(e) => fail(report, e.to_string()),
        }
    }
}

/// The profiles the sources hold now: name → file, problems, and whether every source could
/// be read (if not, nothing is removed).
fn discover(sources: &[PathBuf]) -> (BTreeMap<String, PathBuf>, Vec<String>, bool) {
    let mut found: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut complete = true;
    let mut add = |path: PathBuf, problems: &mut Vec<String>| {
        let Some(name) = profile_name(&path) else {
            return;
        };
        match found.get(&name) {
            Some(first) => problems.push(format!(
                "profile name `{name}` is used by both {} and {}; serving the first",
                first.display(),
                path.display()
            )),
            None => {
                found.insert(name, path);
            }
        }
    };
    for source in sources {
        if source.is_dir() {
            match std::fs::read_dir(source) {
                Ok(entries) => {
                    let mut files: Vec<PathBuf> = entries
                        .filter_map(Result::ok)
                        .map(|e| e.path())
                        .filter(|p| is_profile_file(p))
                        .collect();
                    files.sort();
                    for f in files {
                        add(f, &mut problems);
                    }
                }
                Err(e) => {
                    complete = false;
                    problems.push(format!(
                        "cannot read profile directory {}: {e}",
                        source.display()
                    ));
                }
            }
        } else if source.is_file() {
            add(source.clone(), &mut problems);
        }
        // A missing file source: its profile is gone (it comes back when the file does).
    }
    (found, problems, complete)
}

/// A `*.toml` file that is not hidden (editors' temporary files are).
pub fn is_profile_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    !hidden && path.extension().is_some_and(|e| e == "toml") && path.is_file()
}

/// The model name of a profile file: its stem.
pub fn profile_name(path: &Path) -> Option<String> {
    path.file_stem()
        .and_then(|s| s.to_str())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_finds_toml_files_and_reports_duplicates() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for (dir, file) in [
            (&a, "one.toml"),
            (&a, "two.toml"),
            (&a, ".hidden.toml"),
            (&a, "notes.txt"),
            (&b, "one.toml"),
        ] {
            std::fs::write(dir.path().join(file), "").unwrap();
        }
        let single = b.path().join("three.conf");
        std::fs::write(&single, "").unwrap();
        let (found, problems, complete) = discover(&[
            a.path().to_path_buf(),
            b.path().to_path_buf(),
            single.clone(),
            a.path().join("missing.toml"),
        ]);
        assert!(complete);
        assert_eq!(found.keys().collect::<Vec<_>>(), ["one", "three", "two"]);
        assert_eq!(found["one"], a.path().join("one.toml"));
        assert_eq!(found["three"], single);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("`one`"), "{problems:?}");
    }
}
