//! The `[target.options]` cuda-hybrid understands.
//!
//! | option | value | default |
//! |---|---|---|
//! | `gpu_layers` | trunk layers on the GPU (the *last* ones), or `auto` | `auto`: as many as `vram_budget` holds |
//! | `vram_budget` | bytes of GPU memory the backend may use: a number, optionally with `KiB`, `MiB`, `GiB` (or `K`, `M`, `G`) | the device's free memory at open minus a reserve (5 %, at least 256 MiB) |
//! | `device` | CUDA device ordinal | `0` |
//! | `ring_budget_bytes` | upper bound on the recurrent-state snapshot ring (host and device parts together) | none |
//! | `deep_rollback` | `redecode` or `refuse`: truncation beyond the ring | `redecode` |
//! | `nvrtc_path` | the NVRTC library (`libnvrtc.so.13` or `.12`) or its directory, when it is not on the loader path | `$SPECULA_NVRTC_PATH` |
//! | `kernel_cache` | directory for compiled PTX, or `off` | `$SPECULA_HOME/cuda-kernels`, else `$XDG_CACHE_HOME/specula/cuda-kernels`, else `~/.cache/specula/cuda-kernels` |
//!
//! Unknown options and malformed values are `InvalidInput` errors
//! naming the option.

use std::path::PathBuf;

use specula_plugin_api::{BackendParams, PluginError};

pub const OPTION_GPU_LAYERS: &str = "gpu_layers";
pub const OPTION_VRAM_BUDGET: &str = "vram_budget";
pub const OPTION_DEVICE: &str = "device";
pub const OPTION_RING_BUDGET_BYTES: &str = "ring_budget_bytes";
pub const OPTION_DEEP_ROLLBACK: &str = "deep_rollback";
pub const OPTION_NVRTC_PATH: &str = "nvrtc_path";
pub const OPTION_KERNEL_CACHE: &str = "kernel_cache";

/// Every option name, for the error an unknown one gets.
const KNOWN_OPTIONS: [&str; 7] = [
    OPTION_GPU_LAYERS,
    OPTION_VRAM_BUDGET,
    OPTION_DEVICE,
    OPTION_RING_BUDGET_BYTES,
    OPTION_DEEP_ROLLBACK,
    OPTION_NVRTC_PATH,
    OPTION_KERNEL_CACHE,
];

/// How many trunk layers go on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    /// As many as the VRAM budget holds.
    Auto,
    /// Exactly this many (the last ones); more than the model has means all.
    Count(usize),
}

/// What truncation beyond the snapshot ring does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeepRollback {
    /// Re-decode the kept prefix from the empty state (exact, one pass over it).
    Redecode,
    /// Fail with an `InvalidInput` error.
    Refuse,
}

/// Parsed backend options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub gpu_layers: GpuLayers,
    pub vram_budget: Option<u64>,
    pub device: usize,
    pub ring_budget_bytes: Option<u64>,
    pub deep_rollback: DeepRollback,
    pub nvrtc_path: Option<PathBuf>,
    /// `None`: no disk cache.
    pub kernel_cache: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            gpu_layers: GpuLayers::Auto,
            vram_budget: None,
            device: 0,
            ring_budget_bytes: None,
            deep_rollback: DeepRollback::Redecode,
            nvrtc_path: None,
            kernel_cache: default_kernel_cache(),
        }
    }
}

/// `$SPECULA_HOME/cuda-kernels`, else `$XDG_CACHE_HOME/specula/cuda-kernels`, else
/// `~/.cache/specula/cuda-kernels` (the places the host keeps its own cache).
pub fn default_kernel_cache() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    var("SPECULA_HOME")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("specula")))
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache").join("specula")))
        .map(|dir| dir.join("cuda-kernels"))
}

fn bad(key: &str, value: &str, expected: &str) -> PluginError {
    PluginError::invalid_input(format!(
        "cuda-hybrid: option '{key}' = '{value}': expected {expected}"
    ))
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

impl Options {
    /// Reads the options of `params`.
    pub fn parse(params: &BackendParams) -> Result<Self, PluginError> {
        let mut options = Options::default();
        for option in params.options.iter() {
            let (key, value) = (option.0.as_str(), option.1.as_str().trim());
            match key {
                OPTION_GPU_LAYERS => {
                    options.gpu_layers =
                        match value {
                            "auto" => GpuLayers::Auto,
                            "all" => GpuLayers::Count(usize::MAX),
                            _ => GpuLayers::Count(value.parse().map_err(|_| {
                                bad(key, value, "a number of layers, 'all' or 'auto'")
                            })?),
                        }
                }
                OPTION_VRAM_BUDGET => {
                    options.vram_budget = Some(parse_bytes(value).ok_or_else(|| {
                        bad(
                            key,
                            value,
                            "a number of bytes, optionally with KiB, MiB or GiB",
                        )
                    })?)
                }
                OPTION_DEVICE => {
                    options.device = value
                        .parse()
                        .map_err(|_| bad(key, value, "a CUDA device number"))?
                }
                OPTION_RING_BUDGET_BYTES => {
                    options.ring_budget_bytes = Some(
                        parse_bytes(value).ok_or_else(|| bad(key, value, "a number of bytes"))?,
                    )
                }
                OPTION_DEEP_ROLLBACK => {
                    options.deep_rollback = match value {
                        "redecode" => DeepRollback::Redecode,
                        "refuse" => DeepRollback::Refuse,
                        _ => return Err(bad(key, value, "'redecode' or 'refuse'")),
                    }
                }
                OPTION_NVRTC_PATH => {
                    options.nvrtc_path = (!value.is_empty()).then(|| PathBuf::from(value))
                }
                OPTION_KERNEL_CACHE => {
                    options.kernel_cache = match value {
                        "off" | "none" | "" => None,
                        dir => Some(PathBuf::from(dir)),
                    }
                }
                _ => {
                    return Err(PluginError::invalid_input(format!(
                        "cuda-hybrid: unknown option '{key}' (known: {})",
                        KNOWN_OPTIONS.join(", ")
                    )))
                }
            }
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::std_types::{RString, RVec, Tuple2};
    use specula_plugin_api::ErrorKind;

    fn params(options: &[(&str, &str)]) -> BackendParams {
        BackendParams {
            model_path: RString::from("m.gguf"),
            threads: 1,
            context_size: 0,
            max_verify_tokens: 0,
            options: options
                .iter()
                .map(|(k, v)| Tuple2(RString::from(*k), RString::from(*v)))
                .collect::<RVec<_>>(),
        }
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
    fn options_parse_and_bad_values_name_the_option() {
        let o = Options::parse(&params(&[
            ("gpu_layers", "12"),
            ("vram_budget", "6GiB"),
            ("device", "1"),
            ("ring_budget_bytes", "1000"),
            ("deep_rollback", "refuse"),
            ("nvrtc_path", "/opt/nvrtc/lib"),
            ("kernel_cache", "off"),
        ]))
        .unwrap();
        let unknown = Options::parse(&params(&[("gpu_layer", "3")])).unwrap_err();
        assert!(
            unknown.message.contains("unknown option 'gpu_layer'")
                && unknown.message.contains("gpu_layers"),
            "{unknown}"
        );
        assert_eq!(o.gpu_layers, GpuLayers::Count(12));
        assert_eq!(o.vram_budget, Some(6 << 30));
        assert_eq!(o.device, 1);
        assert_eq!(o.ring_budget_bytes, Some(1000));
        assert_eq!(o.deep_rollback, DeepRollback::Refuse);
        assert_eq!(o.nvrtc_path, Some(PathBuf::from("/opt/nvrtc/lib")));
        assert_eq!(o.kernel_cache, None);
        assert_eq!(
            Options::parse(&params(&[("gpu_layers", "all")]))
                .unwrap()
                .gpu_layers,
            GpuLayers::Count(usize::MAX)
        );
        assert_eq!(
            Options::parse(&params(&[("gpu_layers", "auto")]))
                .unwrap()
                .gpu_layers,
            GpuLayers::Auto
        );
        for (key, value) in [
            ("gpu_layers", "many"),
            ("vram_budget", "lots"),
            ("device", "-1"),
            ("deep_rollback", "maybe"),
        ] {
            let err = Options::parse(&params(&[(key, value)])).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidInput);
            assert!(
                err.message.contains(key) && err.message.contains(value),
                "{}",
                err.message
            );
        }
    }
}
