//! The FFI-safe error type every plugin call returns.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::std_types::{RResult, RString};
use abi_stable::StableAbi;

/// What went wrong, coarsely; the message says the rest.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller passed something out of range (a token id, a length, an option).
    InvalidInput,
    /// A file could not be read.
    Io,
    /// The model file is malformed or of an unsupported kind.
    Model,
    /// The plugin does not implement what was asked (see [`crate::Capabilities`]).
    Unsupported,
    /// An allocation failed.
    OutOfMemory,
    /// The sequence would exceed the context size.
    ContextFull,
    /// The plugin panicked; the message carries the panic payload.
    Panic,
    /// Anything else.
    Internal,
}

/// An error returned across the plugin boundary.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PluginError {
    pub kind: ErrorKind,
    pub message: RString,
}

impl PluginError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: RString::from(message.into()),
        }
    }

    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }

    pub fn model(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Model, message)
    }
}

impl PluginError {
    /// `Ok` when every check passed, else one error carrying every message (joined by `; `)
    /// and the first error's kind: a check reports all it found, not only the first.
    pub fn all(
        checks: impl IntoIterator<Item = Result<(), PluginError>>,
    ) -> Result<(), PluginError> {
        let errors: Vec<PluginError> = checks.into_iter().filter_map(Result::err).collect();
        match errors.first() {
            None => Ok(()),
            Some(first) => Err(PluginError::new(
                first.kind,
                errors
                    .iter()
                    .map(|e| e.message.as_str())
                    .collect::<Vec<_>>()
                    .join("; "),
            )),
        }
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PluginError {}

/// Result type of plugin calls.
pub type PluginResult<T> = RResult<T, PluginError>;

/// Runs a plugin entry point, converting both its error and any panic into a [`PluginResult`].
///
/// Every `extern "C"` function and trait method a plugin exposes should run its body through
/// this, so that no panic unwinds into the host.
pub fn guard<T>(body: impl FnOnce() -> Result<T, PluginError>) -> PluginResult<T> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result.into(),
        Err(payload) => {
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".to_string());
            RResult::RErr(PluginError::new(
                ErrorKind::Panic,
                format!("plugin panicked: {text}"),
            ))
        }
    }
}

/// Makes a plugin instance refuse every call once one of its calls has panicked.
///
/// A panic can leave an instance half-updated (a KV cache advanced without its recurrent
/// state, a ring slot half written); answering later calls from that state would compute
/// silently wrong results. So the first panic is remembered and every later call through
/// [`PanicFence::guard`] fails with [`ErrorKind::Panic`], naming the first panic, without
/// running: the host must open a new instance. Clones share one fence (so a `&mut self`
/// method can run its body through a clone of its own fence).
#[derive(Debug, Default, Clone)]
pub struct PanicFence(std::sync::Arc<std::sync::OnceLock<String>>);

impl PanicFence {
    /// Runs `body` like [`guard`], unless an earlier call panicked.
    pub fn guard<T>(
        &self,
        plugin: &str,
        body: impl FnOnce() -> Result<T, PluginError>,
    ) -> PluginResult<T> {
        if let Some(first) = self.0.get() {
            return RResult::RErr(PluginError::new(
                ErrorKind::Panic,
                format!(
                    "{plugin}: this instance refuses every call since an earlier one panicked ({first}); open a new instance"
                ),
            ));
        }
        let result = guard(body);
        if let RResult::RErr(e) = &result {
            if e.kind == ErrorKind::Panic {
                let _ = self.0.set(e.message.to_string());
            }
        }
        result
    }

    /// Whether a call has panicked.
    pub fn has_panicked(&self) -> bool {
        self.0.get().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_refuses_every_call_after_a_panic() {
        let fence = PanicFence::default();
        assert_eq!(fence.guard("p", || Ok(1)).into_result(), Ok(1));
        let err = fence
            .guard("p", || Err::<u32, _>(PluginError::invalid_input("bad")))
            .into_result()
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert!(!fence.has_panicked(), "an error is not a panic");
        let err = fence
            .guard::<u32>("p", || panic!("boom"))
            .into_result()
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Panic);
        let mut ran = false;
        let err = fence
            .guard("p", || {
                ran = true;
                Ok(2)
            })
            .into_result()
            .unwrap_err();
        assert!(!ran && fence.has_panicked());
        assert_eq!(err.kind, ErrorKind::Panic);
        assert!(
            err.message.contains("boom") && err.message.contains("refuses"),
            "{}",
            err.message
        );
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let result: PluginResult<()> = guard(|| panic!("boom"));
        let err = result.into_result().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Panic);
        assert!(err.message.contains("boom"), "{}", err.message);
    }

    #[test]
    fn guard_passes_values_and_errors_through() {
        assert_eq!(guard(|| Ok(7)).into_result().unwrap(), 7);
        let err = guard::<()>(|| Err(PluginError::unsupported("no mtp"))).into_result();
        assert_eq!(err.unwrap_err().kind, ErrorKind::Unsupported);
    }
}
