//! Plugin discovery and loading.
//!
//! A plugin named `cpu-simd` lives in `libspecula_cpu_simd.so` (`.dylib` on macOS,
//! `specula_cpu_simd.dll` on Windows). The host searches, in order: the profile's `plugin_dir`
//! entries, the directories in `SPECULA_PLUGIN_PATH`, and the directory of the `specula`
//! executable. A profile may also name a library by path.
//!
//! Loading checks, in order: that the file is a shared library of this machine whose
//! segments lie inside the file (`image::check`, before the system loader sees it), that
//! it exports `specula_plugin_abi_version`, that the version equals the host's
//! [`ABI_VERSION`], and that abi_stable's layout check of the root module passes. Every
//! failure names the file. What is loaded is a private copy of the bytes checked; loaded
//! libraries are never unloaded, so each file *as it is on disk* (path plus
//! [`FileIdentity`]) is loaded once and cached, and a new build copied over an old one is
//! loaded afresh.

mod image;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use abi_stable::abi_stability::abi_checking::{check_layout_compatibility, AbiInstabilityErrors};
use abi_stable::library::lib_header_from_path;
use abi_stable::std_types::{RString, RVec, Tuple2};
use specula_plugin_api::{
    BackendParams, BoxedDrafter, BoxedForwardPass, DrafterParams, ModelInfo, PluginInfo,
    PluginKind, PluginModuleRef, PluginResult, ABI_VERSION, ABI_VERSION_SYMBOL,
};

pub use image::FileIdentity;

/// Environment variable with extra plugin directories (`:`-separated, `;` on Windows).
pub const PLUGIN_PATH_ENV: &str = "SPECULA_PLUGIN_PATH";

/// Environment variable that, set (to anything), keeps the private copy of each loaded
/// plugin library in `$TMPDIR/specula-plugins-<pid>/` instead of deleting it once loaded, so
/// that `perf` and other profilers can name the plugins' functions.
pub const KEEP_COPIES_VAR: &str = "SPECULA_KEEP_PLUGIN_COPIES";

/// Why a plugin could not be found, loaded or used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PluginError {
    #[error("{kind} plugin '{name}' not found: looked for {file} in {}; set `plugin_dir` in the profile or {PLUGIN_PATH_ENV}", display_dirs(searched))]
    NotFound {
        kind: &'static str,
        name: String,
        file: String,
        searched: Vec<PathBuf>,
    },
    #[error("{path}: cannot load library: {reason}")]
    NotALibrary { path: PathBuf, reason: String },
    #[error("{path}: refused before loading: {reason}")]
    BadImage { path: PathBuf, reason: String },
    #[error("{path}: not a Specula plugin (it does not export `{ABI_VERSION_SYMBOL}`)")]
    NotAPlugin { path: PathBuf },
    #[error("{path}: plugin was built against Specula plugin ABI version {plugin}, but this host speaks ABI version {host}; rebuild the plugin against this host's specula-plugin-api")]
    AbiMismatch {
        path: PathBuf,
        plugin: u32,
        host: u32,
    },
    #[error("{path}: plugin ABI layout check failed (built against an incompatible specula-plugin-api): {reason}")]
    Layout { path: PathBuf, reason: String },
    #[error("{path}: exports `{ABI_VERSION_SYMBOL}` but no plugin module; its source needs `specula_plugin_api::export_drafter!` or `export_backend!` (docs/PLUGINS.md)")]
    NoRootModule { path: PathBuf },
    #[error("{path}: '{name}' is a {actual} plugin, where a {expected} is needed")]
    WrongKind {
        path: PathBuf,
        name: String,
        actual: &'static str,
        expected: &'static str,
    },
    #[error("{plugin} ({path}): {message}")]
    Plugin {
        plugin: String,
        path: PathBuf,
        message: String,
    },
}

fn display_dirs(dirs: &[PathBuf]) -> String {
    if dirs.is_empty() {
        return "(no directories)".into();
    }
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A plugin library that passed every check.
#[derive(Clone, Copy)]
pub struct LoadedPlugin {
    module: PluginModuleRef,
    path: &'static Path,
    identity: FileIdentity,
}

impl std::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("path", &self.path)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl LoadedPlugin {
    pub fn info(&self) -> PluginInfo {
        (self.module.info())()
    }

    /// The file it was loaded from (the private copy actually mapped is gone).
    pub fn path(&self) -> &Path {
        self.path
    }

    /// Size, modification time and inode of the file when it was loaded.
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// Which build serves: name, version, file, size and modification time.
    pub fn provenance(&self) -> PluginProvenance {
        let info = self.info();
        PluginProvenance {
            name: info.name.into(),
            version: info.version.into(),
            path: self.path.to_path_buf(),
            size: self.identity.size,
            modified: self.identity.modified_unix(),
        }
    }

    fn expect_kind(&self, expected: PluginKind) -> Result<(), PluginError> {
        let info = self.info();
        if info.kind != expected {
            return Err(PluginError::WrongKind {
                path: self.path.to_path_buf(),
                name: info.name.into(),
                actual: info.kind.as_str(),
                expected: expected.as_str(),
            });
        }
        Ok(())
    }

    fn plugin_error(&self, message: impl Into<String>) -> PluginError {
        PluginError::Plugin {
            plugin: self.info().name.into(),
            path: self.path.to_path_buf(),
            message: message.into(),
        }
    }

    /// A plugin call's result, its error naming this plugin.
    fn answer<T>(&self, result: PluginResult<T>) -> Result<T, PluginError> {
        result.into_result().map_err(|e| {
            // Plugins name themselves in their messages; the error names the plugin already.
            let own = format!("{}: ", self.info().name);
            let message = e.message.as_str();
            let message = message.strip_prefix(&own).unwrap_or(message);
            self.plugin_error(crate::wording::plain_type_names(message))
        })
    }

    /// Opens a model with this backend plugin.
    pub fn open_backend(&self, params: &BackendParams) -> Result<BoxedForwardPass, PluginError> {
        self.expect_kind(PluginKind::Backend)?;
        let open = self
            .module
            .open_backend()
            .into_option()
            .ok_or_else(|| self.plugin_error("backend plugin has no open_backend entry"))?;
        self.answer(open(params))
    }

    /// Checks backend parameters without loading weights (options, the model's header), with
    /// this backend plugin; `None` when the plugin has no probe.
    pub fn probe_backend(&self, params: &BackendParams) -> Option<Result<ModelInfo, PluginError>> {
        if let Err(e) = self.expect_kind(PluginKind::Backend) {
            return Some(Err(e));
        }
        let probe = self.module.probe_backend()?.into_option()?;
        Some(self.answer(probe(params)))
    }

    /// Checks drafter parameters without creating the drafter, with this drafter plugin;
    /// `None` when the plugin has no check.
    pub fn check_drafter(&self, params: &DrafterParams) -> Option<Result<(), PluginError>> {
        if let Err(e) = self.expect_kind(PluginKind::Drafter) {
            return Some(Err(e));
        }
        let check = self.module.check_drafter()?.into_option()?;
        Some(self.answer(check(params)))
    }

    /// Creates a drafter with this drafter plugin.
    pub fn create_drafter(&self, params: &DrafterParams) -> Result<BoxedDrafter, PluginError> {
        self.expect_kind(PluginKind::Drafter)?;
        let create = self
            .module
            .create_drafter()
            .into_option()
            .ok_or_else(|| self.plugin_error("drafter plugin has no create_drafter entry"))?;
        self.answer(create(params))
    }
}

/// The file name a plugin called `name` has on this platform (`cpu-simd` → `libspecula_cpu_simd.so`).
pub fn library_file_name(name: &str) -> String {
    format!(
        "{}specula_{}{}",
        std::env::consts::DLL_PREFIX,
        name.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    )
}

fn is_plugin_file_name(name: &str) -> bool {
    let prefix = format!("{}specula_", std::env::consts::DLL_PREFIX);
    name.starts_with(&prefix) && name.ends_with(std::env::consts::DLL_SUFFIX)
}

/// The ordered plugin search path.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    dirs: Vec<PathBuf>,
}

impl SearchPath {
    /// The profile's directories, then `SPECULA_PLUGIN_PATH`, then the executable's directory.
    pub fn new(profile_dirs: &[PathBuf]) -> Self {
        let mut dirs: Vec<PathBuf> = profile_dirs.to_vec();
        if let Some(env) = std::env::var_os(PLUGIN_PATH_ENV) {
            dirs.extend(std::env::split_paths(&env).filter(|p| !p.as_os_str().is_empty()));
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_path_buf))
        {
            dirs.push(dir);
        }
        Self::from_dirs(dirs)
    }

    /// Exactly these directories (duplicates removed).
    pub fn from_dirs(dirs: impl IntoIterator<Item = PathBuf>) -> Self {
        let mut unique: Vec<PathBuf> = Vec::new();
        for d in dirs {
            if !unique.contains(&d) {
                unique.push(d);
            }
        }
        Self { dirs: unique }
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Every file in the search path that is named like a plugin, first occurrence of each
    /// file name winning.
    pub fn candidates(&self) -> Vec<PathBuf> {
        let mut seen = Vec::new();
        let mut found = Vec::new();
        for dir in &self.dirs {
            for path in plugin_files_in(dir) {
                let name = path.file_name().map(|n| n.to_os_string());
                if !seen.contains(&name) {
                    found.push(path);
                    seen.push(name);
                }
            }
        }
        found
    }

    /// Finds and loads the plugin `reference` (a name, or a library path), which must be of
    /// `kind`. A name selects the first file named for it in search order:
    /// `libspecula_NAME.so` or `libspecula_KIND_NAME.so` (see [`plugin_name_of`]).
    pub fn load(&self, reference: &str, kind: PluginKind) -> Result<LoadedPlugin, PluginError> {
        let path = if crate::profile::looks_like_path(reference) {
            PathBuf::from(reference)
        } else {
            // `lookup` may live in `libspecula_lookup.so` or `libspecula_drafter_lookup.so`.
            let files = [
                library_file_name(reference),
                library_file_name(&format!("{}-{reference}", kind.as_str())),
            ];
            self.dirs
                .iter()
                .flat_map(|d| files.iter().map(move |f| d.join(f)))
                .find(|p| p.is_file())
                .ok_or_else(|| PluginError::NotFound {
                    kind: kind.as_str(),
                    name: reference.to_string(),
                    file: files.join(" or "),
                    searched: self.dirs.clone(),
                })?
        };
        let plugin = load_library(&path)?;
        plugin.expect_kind(kind)?;
        Ok(plugin)
    }
}

/// The name profiles select the library at `path` by, from its file name:
/// `libspecula_cpu_simd.so` is `cpu-simd`, and a kind prefix is dropped for that kind
/// (`libspecula_drafter_lookup.so` is the drafter `lookup`).
pub fn plugin_name_of(path: &Path, kind: PluginKind) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    let stem = file
        .strip_prefix(&format!("{}specula_", std::env::consts::DLL_PREFIX))?
        .strip_suffix(std::env::consts::DLL_SUFFIX)?;
    let name = stem.replace('_', "-");
    let kind_prefix = format!("{}-", kind.as_str());
    Some(match name.strip_prefix(&kind_prefix) {
        Some(rest) if !rest.is_empty() => rest.to_string(),
        _ => name,
    })
}

/// The plugin-named files of `dir`, sorted (none when it cannot be read).
fn plugin_files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_plugin_file_name(n))
        .collect();
    names.sort();
    names.into_iter().map(|n| dir.join(n)).collect()
}

/// Whether two paths are the same file (the same inode where the platform says, so hard
/// links such as cargo's `target/release/` and `target/release/deps/` copies count as one).
fn same_file(a: &Path, b: &Path) -> bool {
    match (FileIdentity::of(a), FileIdentity::of(b)) {
        (Ok(x), Ok(y)) if x.inode.is_some() => x.inode == y.inode,
        _ => a.canonicalize().ok() == b.canonicalize().ok(),
    }
}

/// Names that more than one library answers to (`libspecula_lookup.so` and
/// `libspecula_drafter_lookup.so` are both `lookup`; hard links count once), with their
/// paths: `(name, kind, paths)`.
pub fn duplicate_names(listings: &[Listing]) -> Vec<(String, PluginKind, Vec<PathBuf>)> {
    let mut by_name: Vec<(String, PluginKind, Vec<PathBuf>)> = Vec::new();
    for l in listings {
        let (Ok(info), Some(name)) = (&l.result, &l.name) else {
            continue;
        };
        match by_name
            .iter_mut()
            .find(|(n, k, _)| n == name && *k == info.kind)
        {
            Some((_, _, paths)) => {
                if !paths.iter().any(|p| same_file(p, &l.path)) {
                    paths.push(l.path.clone());
                }
            }
            None => by_name.push((name.clone(), info.kind, vec![l.path.clone()])),
        }
    }
    by_name.retain(|(_, _, paths)| paths.len() > 1);
    by_name
}

/// Which build of a plugin a pipeline runs, for logs and reload reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PluginProvenance {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    pub size: u64,
    /// Modification time of the file, seconds since the Unix epoch.
    pub modified: Option<u64>,
}

impl std::fmt::Display for PluginProvenance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} ({}, {} bytes",
            self.name,
            self.version,
            self.path.display(),
            self.size
        )?;
        if let Some(t) = self.modified {
            write!(f, ", modified at unix time {t}")?;
        }
        write!(f, ")")
    }
}

/// A file's identity, plus its path where the platform has no inode numbers (with them,
/// hard links to one file share an entry).
type CacheKey = (FileIdentity, Option<PathBuf>);

fn cache() -> &'static Mutex<HashMap<CacheKey, LoadedPlugin>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, LoadedPlugin>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Loads and checks the plugin library at `path`. Successful loads are cached by file
/// identity (a file is never loaded twice, a changed file is loaded again); failures
/// are not, so a fixed file can be tried again.
pub fn load_library(path: &Path) -> Result<LoadedPlugin, PluginError> {
    let not_a_library = |reason: String| PluginError::NotALibrary {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_file() {
        return Err(not_a_library("no such file".into()));
    }
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let identity = FileIdentity::of(path).map_err(|e| not_a_library(e.to_string()))?;
    let key = (identity, identity.inode.is_none().then_some(canonical));
    let mut cache = cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(plugin) = cache.get(&key) {
        return Ok(*plugin);
    }
    let bytes = std::fs::read(path).map_err(|e| not_a_library(e.to_string()))?;
    image::check(&bytes).map_err(|reason| PluginError::BadImage {
        path: path.to_path_buf(),
        reason,
    })?;
    let copy = image::private_copy(path, &bytes).map_err(|e| {
        not_a_library(format!(
            "cannot write a private copy to load (temporary directory {}): {e}",
            std::env::temp_dir().display()
        ))
    })?;
    let loaded = load_uncached(path, &copy, identity);
    // A profiler reads a library's symbols from its file: keeping the copy lets it name the
    // plugin's functions (the copies then stay in the temporary directory).
    if std::env::var_os(KEEP_COPIES_VAR).is_none() {
        image::discard(&copy);
    }
    let plugin = loaded?;
    cache.insert(key, plugin);
    Ok(plugin)
}

/// Loads the checked private `copy` of `path`; errors name `path`.
fn load_uncached(
    path: &Path,
    copy: &Path,
    identity: FileIdentity,
) -> Result<LoadedPlugin, PluginError> {
    let owned = path.to_path_buf();
    // SAFETY: loading a library runs its initialisers; we only load files the user pointed
    // us at (profile, plugin path) that are named like Specula plugins and that passed
    // `image::check`, from a private copy nobody else writes.
    let library =
        unsafe { libloading::Library::new(copy) }.map_err(|e| PluginError::NotALibrary {
            path: owned.clone(),
            reason: e.to_string(),
        })?;
    // SAFETY: the symbol is declared by `export_plugin!` as `extern "C" fn() -> u32`.
    let abi_version = unsafe {
        let symbol = library
            .get::<extern "C" fn() -> u32>(ABI_VERSION_SYMBOL.as_bytes())
            .map_err(|_| PluginError::NotAPlugin {
                path: owned.clone(),
            })?;
        symbol()
    };
    if abi_version != ABI_VERSION {
        return Err(PluginError::AbiMismatch {
            path: owned,
            plugin: abi_version,
            host: ABI_VERSION,
        });
    }
    let layout = |reason: String| PluginError::Layout {
        path: owned.clone(),
        reason,
    };
    let header = lib_header_from_path(copy).map_err(|e| match e {
        abi_stable::library::LibraryError::GetSymbolError { .. } => PluginError::NoRootModule {
            path: owned.clone(),
        },
        // abi_stable's text spans lines and names the private copy: one line, the user's file.
        other => layout(
            other
                .to_string()
                .replace(&*copy.to_string_lossy(), &owned.to_string_lossy())
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" "),
        ),
    })?;
    // The layout check abi_stable runs in `init_root_module` reports pages of formatted
    // text; run it first here to say in a line where the mismatch is.
    if let Some(plugin_layout) = header.layout() {
        let host_layout = <PluginModuleRef as abi_stable::StableAbi>::LAYOUT;
        if let Err(errors) = check_layout_compatibility(host_layout, plugin_layout) {
            tracing::debug!("{}: abi_stable's layout report:\n{errors}", owned.display());
            return Err(layout(layout_summary(&errors)));
        }
    }
    let module = header
        .init_root_module::<PluginModuleRef>()
        .map_err(|e| layout(e.to_string()))?;
    if module.abi_version() != ABI_VERSION {
        return Err(PluginError::AbiMismatch {
            path: owned,
            plugin: module.abi_version(),
            host: ABI_VERSION,
        });
    }
    // Plugins are never unloaded (abi_stable leaks its handle too).
    std::mem::forget(library);
    let path: &'static Path = Box::leak(owned.into_boxed_path());
    Ok(LoadedPlugin {
        module,
        path,
        identity,
    })
}

/// A line for abi_stable's layout report (which runs to pages): where the first mismatch is
/// and what differs. The whole report is logged at debug level.
fn layout_summary(report: &AbiInstabilityErrors) -> String {
    use abi_stable::abi_stability::abi_checking::AbiInstability as AI;
    use abi_stable::type_layout::TLFieldOrFunction;
    const REBUILD: &str = "rebuild the plugin against this host's specula-plugin-api";
    // The report lists every type on the path to the mismatch; the mismatch is the first
    // entry with errors.
    let Some(first) = report.errors.iter().find(|e| !e.errs.is_empty()) else {
        return format!("the root module's layout differs; {REBUILD}");
    };
    let fields: Vec<&TLFieldOrFunction> = first.stack_trace.iter().map(|s| &s.expected).collect();
    // abi_stable's own plumbing on the path (trait objects, vtables, tuple fields) says
    // nothing to a plugin author.
    let plumbing = |name: &str| {
        name.starts_with('_')
            || name.starts_with("field_")
            || matches!(name, "0" | "obj" | "vtable")
    };
    let path: Vec<String> = fields
        .iter()
        .filter_map(|f| match f {
            TLFieldOrFunction::Field(f) if !plumbing(f.name()) => Some(f.name().to_string()),
            _ => None,
        })
        .collect();
    // The mismatched type and where it sits, e.g. `DraftRequest<'a>, argument 1 of
    // create_drafter > propose`.
    let place = match fields.last() {
        Some(TLFieldOrFunction::Field(f)) => {
            let (name, rest) = path
                .split_last()
                .map_or(("", &[][..]), |(n, r)| (n.as_str(), r));
            let role = match name.strip_prefix("param_") {
                Some(i) => format!("argument {i} of {}", rest.join(" > ")),
                None if rest.is_empty() => format!("field `{name}`"),
                None => format!("field `{name}` of {}", rest.join(" > ")),
            };
            format!("{}, {role}", f.full_type())
        }
        Some(TLFieldOrFunction::Function(f)) => format!("function {}", f.name),
        None => "the root module".to_string(),
    };
    let differs = first
        .errs
        .iter()
        .map(|e| match e {
            AI::Size(v) => format!("size {} here, {} in the plugin", v.expected, v.found),
            AI::Alignment(v) => format!("alignment {} here, {} in the plugin", v.expected, v.found),
            AI::FieldCountMismatch(v) => {
                format!("{} fields here, {} in the plugin", v.expected, v.found)
            }
            AI::UnexpectedField(v) => format!(
                "field `{}` here, `{}` in the plugin",
                v.expected.name(),
                v.found.name()
            ),
            AI::Name(v) => format!("type {} here, {} in the plugin", v.expected, v.found),
            AI::PackageVersion(v) => format!(
                "package version {} here, {} in the plugin",
                v.expected.version, v.found.version
            ),
            other => format!("{other:?}").chars().take(120).collect(),
        })
        .collect::<Vec<_>>()
        .join("; ");
    format!("{place}: {differs}; {REBUILD}")
}

/// One row of `specula plugins`.
#[derive(Debug)]
pub struct Listing {
    pub path: PathBuf,
    /// The name profiles select it by ([`plugin_name_of`]), once it loaded.
    pub name: Option<String>,
    pub result: Result<PluginInfo, PluginError>,
}

/// Loads every plugin-named library in the search path and reports what each is.
pub fn list(search: &SearchPath) -> Vec<Listing> {
    search
        .candidates()
        .into_iter()
        .map(|path| {
            let result = load_library(&path).map(|p| p.info());
            let name = result
                .as_ref()
                .ok()
                .and_then(|info| plugin_name_of(&path, info.kind));
            Listing { path, name, result }
        })
        .collect()
}

/// Backend parameters from a profile's target section, for one sequence (set `max_sequences`
/// for more).
pub fn backend_params(
    model: &Path,
    threads: u32,
    context_size: u32,
    max_verify_tokens: u32,
    options: Vec<(String, String)>,
) -> BackendParams {
    BackendParams {
        model_path: RString::from(model.to_string_lossy().into_owned()),
        threads,
        context_size,
        max_verify_tokens,
        max_sequences: 1,
        kv_tokens: 0,
        options: option_pairs(options),
    }
}

/// Drafter parameters: the models it drafts for (and with), its options, its corpus.
pub fn drafter_params(
    target: ModelInfo,
    draft_model: Option<ModelInfo>,
    options: Vec<(String, String)>,
    corpus: Vec<u32>,
) -> DrafterParams {
    DrafterParams {
        target,
        draft_model: draft_model.into(),
        options: option_pairs(options),
        corpus: corpus.into(),
    }
}

fn option_pairs(options: Vec<(String, String)>) -> RVec<Tuple2<RString, RString>> {
    options
        .into_iter()
        .map(|(k, v)| Tuple2(RString::from(k), RString::from(v)))
        .collect()
}
