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

#[cfg(test)]
mod tests {
    use super::*;

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
