//! Checks of backend inputs that every backend makes the same way, with the same messages.

use specula_plugin_api::{ErrorKind, PluginError};

/// What an MTP-head call must satisfy: rows present, `n × hidden_size` hidden values, tokens
/// in the vocabulary, no skipped position (`position <= cached`), and room in the context.
/// `backend` names the plugin in the messages.
#[allow(clippy::too_many_arguments)]
pub fn mtp_input(
    backend: &str,
    hidden: &[f32],
    tokens: &[u32],
    position: usize,
    hidden_size: usize,
    vocab: usize,
    cached: usize,
    n_ctx: usize,
) -> Result<(), PluginError> {
    let n = tokens.len();
    if n == 0 {
        return Err(PluginError::invalid_input(format!(
            "{backend}: mtp_eval called with no tokens"
        )));
    }
    if hidden.len() != n * hidden_size {
        return Err(PluginError::invalid_input(format!(
            "{backend}: mtp_eval got {} hidden values for {n} rows, expected {n} × the hidden size {hidden_size}",
            hidden.len()
        )));
    }
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(PluginError::invalid_input(format!(
            "{backend}: token id {bad} is out of range (vocabulary size {vocab})"
        )));
    }
    if position > cached {
        return Err(PluginError::invalid_input(format!(
            "{backend}: mtp_eval at position {position}, but the MTP head's cache holds only {cached} entries (steps must not skip positions)"
        )));
    }
    if position + n > n_ctx {
        return Err(PluginError::new(
            ErrorKind::ContextFull,
            format!(
                "{backend}: context full: mtp_eval of {n} rows at position {position} exceeds the context size {n_ctx}"
            ),
        ));
    }
    Ok(())
}
