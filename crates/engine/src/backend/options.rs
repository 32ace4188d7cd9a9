//! The `[target.options]` every backend understands, and the parser backends extend with
//! their own.
//!
//! | option | value | default |
//! |---|---|---|
//! | `ring_budget_bytes` | upper bound on the recurrent-state snapshot ring: a number of bytes, optionally with `KiB`, `MiB`, `GiB` (or `K`, `M`, `G`) | none |
//! | `deep_rollback` | `redecode` or `refuse`: what truncation beyond the ring does | `redecode` |
//! | `kv_type` | how the attention KV cache stores keys and values: `f16` (rounded to nearest-even when stored; half the memory and half the attention's memory traffic of `f32`), `f32` (exact) or `q8_0` (ggml's Q8_0 blocks, about half of `f16`, its keys scored as integers where the CPU has AVX-512; heads of a multiple of 32 values) | `f16` |
//! | `prefix_state_bytes` | the most bytes of recurrent states (one per cached block boundary, every Gated DeltaNet layer) the prefix cache keeps for a hybrid model, a byte count as for `ring_budget_bytes`; `0` turns prefix caching off for hybrids | `512MiB` |

use specula_plugin_api::{BackendParams, PluginError};

use crate::kv_cache::KvType;

/// Backend option: the most bytes the recurrent-state snapshot ring may use.
pub const OPTION_RING_BUDGET_BYTES: &str = "ring_budget_bytes";

/// Backend option: what truncation beyond the rollback window does (`redecode` or `refuse`).
pub const OPTION_DEEP_ROLLBACK: &str = "deep_rollback";

/// Backend option: the KV cache's storage type (`f16`, `f32` or `q8_0`).
pub const OPTION_KV_TYPE: &str = "kv_type";

/// Backend option: the most bytes of recurrent states the prefix cache keeps (hybrid models).
pub const OPTION_PREFIX_STATE_BYTES: &str = "prefix_state_bytes";

/// The default of [`OPTION_PREFIX_STATE_BYTES`].
pub const DEFAULT_PREFIX_STATE_BYTES: u64 = 512 << 20;

/// What truncation does for a length the snapshot ring no longer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeepRollback {
    /// Re-decode the kept prefix from the empty state (exact, one pass over it).
    Redecode,
    /// Fail with an `InvalidInput` error.
    Refuse,
}

/// The options of every backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonOptions {
    pub ring_budget_bytes: Option<u64>,
    pub deep_rollback: DeepRollback,
    pub kv_type: KvType,
    pub prefix_state_bytes: u64,
}

impl Default for CommonOptions {
    fn default() -> Self {
        Self {
            ring_budget_bytes: None,
            deep_rollback: DeepRollback::Redecode,
            kv_type: KvType::default(),
            prefix_state_bytes: DEFAULT_PREFIX_STATE_BYTES,
        }
    }
}

/// Parses a byte count: `123`, `512MiB`, `8 GiB`, `2G`, `100 KiB`.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        _ => return None,
    };
    number.checked_mul(factor)
}

/// What a backend's own option parser says of one option.
pub enum Parsed {
    /// Taken.
    Ok,
    /// Not one of the backend's options.
    Unknown,
    /// Malformed: what was expected instead.
    Expected(&'static str),
}

/// Reads `params.options`: the common ones into the returned value, every other one through
/// `own` (whose option names are `own_keys`, for the message an unknown option gets). Every
/// bad option is reported, not only the first, in one `InvalidInput` error naming `plugin`.
pub fn parse(
    plugin: &str,
    params: &BackendParams,
    own_keys: &[&str],
    mut own: impl FnMut(&str, &str) -> Parsed,
) -> Result<CommonOptions, PluginError> {
    let mut common = CommonOptions::default();
    let mut problems = Vec::new();
    for option in params.options.iter() {
        let (key, value) = (option.0.as_str(), option.1.as_str().trim());
        let parsed = match key {
            OPTION_RING_BUDGET_BYTES => match parse_bytes(value) {
                Some(bytes) => {
                    common.ring_budget_bytes = Some(bytes);
                    Parsed::Ok
                }
                None => Parsed::Expected("a number of bytes, optionally with KiB, MiB or GiB"),
            },
            OPTION_DEEP_ROLLBACK => match value {
                "redecode" => {
                    common.deep_rollback = DeepRollback::Redecode;
                    Parsed::Ok
                }
                "refuse" => {
                    common.deep_rollback = DeepRollback::Refuse;
                    Parsed::Ok
                }
                _ => Parsed::Expected("'redecode' or 'refuse'"),
            },
            OPTION_KV_TYPE => match KvType::from_name(value) {
                Some(parsed) => {
                    common.kv_type = parsed;
                    Parsed::Ok
                }
                None => Parsed::Expected("'f16', 'f32' or 'q8_0'"),
            },
            OPTION_PREFIX_STATE_BYTES => match parse_bytes(value) {
                Some(bytes) => {
                    common.prefix_state_bytes = bytes;
                    Parsed::Ok
                }
                None => Parsed::Expected("a number of bytes, optionally with KiB, MiB or GiB"),
            },
            _ => own(key, value),
        };
        match parsed {
            Parsed::Ok => {}
            Parsed::Unknown => {
                let known: Vec<&str> = [
                    OPTION_RING_BUDGET_BYTES,
                    OPTION_DEEP_ROLLBACK,
                    OPTION_KV_TYPE,
                    OPTION_PREFIX_STATE_BYTES,
                ]
                .into_iter()
                .chain(own_keys.iter().copied())
                .collect();
                problems.push(format!(
                    "unknown option '{key}' (known: {})",
                    known.join(", ")
                ));
            }
            Parsed::Expected(expected) => {
                problems.push(format!("option '{key}' = '{value}': expected {expected}"))
            }
        }
    }
    if problems.is_empty() {
        Ok(common)
    } else {
        Err(PluginError::invalid_input(format!(
            "{plugin}: {}",
            problems.join("; ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_plugin_api::ErrorKind;

    fn params(options: &[(&str, &str)]) -> BackendParams {
        specula_plugin_api::testing::backend_params("m.gguf", 1, 0, 0, options)
    }

    #[test]
    fn byte_counts_take_binary_units() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes(" 8 GiB "), Some(8 << 30));
        assert_eq!(parse_bytes("2G"), Some(2 << 30));
        assert_eq!(parse_bytes("1.5G"), None);
        assert_eq!(parse_bytes("12 parsecs"), None);
        assert_eq!(parse_bytes(""), None);
    }

    #[test]
    fn common_and_own_options_parse_and_every_bad_one_is_named() {
        let mut colour = None;
        let own = |key: &str, value: &str| match key {
            "colour" => {
                colour = Some(value.to_string());
                Parsed::Ok
            }
            _ => Parsed::Unknown,
        };
        let options = parse(
            "test",
            &params(&[
                ("ring_budget_bytes", "2MiB"),
                ("deep_rollback", "refuse"),
                ("kv_type", "f32"),
                ("prefix_state_bytes", "0"),
                ("colour", "red"),
            ]),
            &["colour"],
            own,
        )
        .unwrap();
        assert_eq!(colour.as_deref(), Some("red"));
        assert_eq!(options.ring_budget_bytes, Some(2 << 20));
        assert_eq!(options.deep_rollback, DeepRollback::Refuse);
        assert_eq!(options.kv_type, KvType::F32);
        assert_eq!(options.prefix_state_bytes, 0);
        let defaults = parse("test", &params(&[]), &[], |_, _| Parsed::Unknown).unwrap();
        assert_eq!(defaults, CommonOptions::default());
        assert_eq!(defaults.kv_type, KvType::F16);

        let err = parse(
            "test",
            &params(&[
                ("ring_budget_bytes", "lots"),
                ("deep_rollback", "maybe"),
                ("kv_type", "f8"),
                ("color", "red"),
            ]),
            &["colour"],
            |_, _| Parsed::Unknown,
        )
        .unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        for part in [
            "test: ",
            "'ring_budget_bytes' = 'lots'",
            "'deep_rollback' = 'maybe'",
            "'kv_type' = 'f8': expected 'f16', 'f32' or 'q8_0'",
            "unknown option 'color' (known: ring_budget_bytes, deep_rollback, kv_type, prefix_state_bytes, colour)",
        ] {
            assert!(err.message.contains(part), "{part}: {}", err.message);
        }
    }
}
