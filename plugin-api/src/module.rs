//! The root module every plugin exports, and its metadata.

use abi_stable::library::RootModule;
use abi_stable::package_version_strings;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{ROption, RString};
use abi_stable::StableAbi;

use crate::backend::{BackendParams, BoxedForwardPass, ModelInfo};
use crate::drafter::{BoxedDrafter, DrafterParams};
use crate::error::PluginResult;

/// Which role a plugin plays.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    /// Opens models and evaluates them ([`crate::ForwardPass`]).
    Backend,
    /// Proposes draft tokens ([`crate::Drafter`]).
    Drafter,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::Backend => "backend",
            PluginKind::Drafter => "drafter",
        }
    }
}

/// What a plugin says about itself.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct PluginInfo {
    /// The name profiles use to select it, e.g. `cpu-simd`.
    pub name: RString,
    /// The plugin's own version (its crate version).
    pub version: RString,
    pub kind: PluginKind,
    /// One line for `specula plugins`.
    pub description: RString,
}

/// The root module of a plugin library.
///
/// Exactly one of `open_backend` / `create_drafter` is present, matching `info().kind`.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModuleRef)))]
#[sabi(missing_field(option))]
pub struct PluginModule {
    /// The [`crate::ABI_VERSION`] the plugin was built against (also exported as a C symbol).
    pub abi_version: u32,
    pub info: extern "C" fn() -> PluginInfo,
    /// Opens a model; present on backends.
    pub open_backend: ROption<extern "C" fn(&BackendParams) -> PluginResult<BoxedForwardPass>>,
    /// Creates a drafter; present on drafters.
    #[sabi(last_prefix_field)]
    pub create_drafter: ROption<extern "C" fn(&DrafterParams) -> PluginResult<BoxedDrafter>>,
    /// Checks a backend's parameters without loading weights or allocating caches: every
    /// option's name and value, and the model file's header (architecture, shapes). Answers
    /// the [`ModelInfo`] `open_backend` would; `specula profile check` calls it.
    pub probe_backend: ROption<extern "C" fn(&BackendParams) -> PluginResult<ModelInfo>>,
    /// Checks a drafter's parameters without creating it: its options, and what it needs of
    /// the target and draft models (`params.target`, `params.draft_model`).
    pub check_drafter: ROption<extern "C" fn(&DrafterParams) -> PluginResult<()>>,
}

impl RootModule for PluginModuleRef {
    abi_stable::declare_root_module_statics! {PluginModuleRef}
    const BASE_NAME: &'static str = "specula_plugin";
    const NAME: &'static str = "specula plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

impl PluginModule {
    /// The root module of a backend plugin.
    pub fn backend(
        info: extern "C" fn() -> PluginInfo,
        open: extern "C" fn(&BackendParams) -> PluginResult<BoxedForwardPass>,
        probe: extern "C" fn(&BackendParams) -> PluginResult<ModelInfo>,
    ) -> PluginModuleRef {
        use abi_stable::prefix_type::PrefixTypeTrait;
        PluginModule {
            abi_version: crate::ABI_VERSION,
            info,
            open_backend: ROption::RSome(open),
            create_drafter: ROption::RNone,
            probe_backend: ROption::RSome(probe),
            check_drafter: ROption::RNone,
        }
        .leak_into_prefix()
    }

    /// The root module of a drafter plugin.
    pub fn drafter(
        info: extern "C" fn() -> PluginInfo,
        create: extern "C" fn(&DrafterParams) -> PluginResult<BoxedDrafter>,
        check: extern "C" fn(&DrafterParams) -> PluginResult<()>,
    ) -> PluginModuleRef {
        use abi_stable::prefix_type::PrefixTypeTrait;
        PluginModule {
            abi_version: crate::ABI_VERSION,
            info,
            open_backend: ROption::RNone,
            create_drafter: ROption::RSome(create),
            probe_backend: ROption::RNone,
            check_drafter: ROption::RSome(check),
        }
        .leak_into_prefix()
    }
}

impl PluginInfo {
    /// Metadata for a plugin whose version is its crate's (pass `env!("CARGO_PKG_VERSION")`).
    pub fn new(name: &str, version: &str, kind: PluginKind, description: &str) -> Self {
        Self {
            name: RString::from(name),
            version: RString::from(version),
            kind,
            description: RString::from(description),
        }
    }
}
