//! The `[target.options]` cuda-hybrid understands.
//!
//! | option | value | default |
//! |---|---|---|
//! | `gpu_layers` | trunk layers on the GPU (the *last* ones), or `auto` | `auto`: as many as `vram_budget` holds |
//! | `vram_budget` | bytes of GPU memory the backend may use: a number, optionally with `KiB`, `MiB`, `GiB` (or `K`, `M`, `G`) | the device's free memory at open minus a reserve (5 %, at least 256 MiB) |
//! | `device` | CUDA device ordinal | `0` |
//! | `ring_budget_bytes` | upper bound on the recurrent-state snapshot ring (host and device parts together; an engine option) | none |
//! | `deep_rollback` | `redecode` or `refuse`: truncation beyond the ring (an engine option) | `redecode` |
//! | `kv_type` | `f16`, `f32` or `q8_0`: how the attention KV cache stores keys and values, on the host and on the device (an engine option; `q8_0` needs heads of a multiple of 32 values) | `f16` |
//! | `nvrtc_path` | the NVRTC library (`libnvrtc.so.13` or `.12`) or its directory, when it is not on the loader path | `$SPECULA_NVRTC_PATH` |
//! | `kernel_cache` | directory for compiled PTX, or `off` | `$SPECULA_HOME/cuda-kernels`, else `$XDG_CACHE_HOME/specula/cuda-kernels`, else `~/.cache/specula/cuda-kernels` |
//! | `cuda_graphs` | `true` or `false`: issue each recurring pass as one CUDA graph ([`crate::gpu::replay`]) | `true` |
//!
//! Unknown options and malformed values are `InvalidInput` errors
//! naming the option.

use std::path::PathBuf;

use specula_engine::backend::options::{self, parse_bytes, CommonOptions, Parsed};
use specula_plugin_api::{BackendParams, PluginError};

use crate::PLUGIN_NAME;

pub const OPTION_GPU_LAYERS: &str = "gpu_layers";
pub const OPTION_VRAM_BUDGET: &str = "vram_budget";
pub const OPTION_DEVICE: &str = "device";
pub const OPTION_NVRTC_PATH: &str = "nvrtc_path";
pub const OPTION_KERNEL_CACHE: &str = "kernel_cache";
pub const OPTION_CUDA_GRAPHS: &str = "cuda_graphs";

/// The options of this backend besides the engine's, for the error an unknown one gets.
const OWN_OPTIONS: [&str; 6] = [
    OPTION_GPU_LAYERS,
    OPTION_VRAM_BUDGET,
    OPTION_DEVICE,
    OPTION_NVRTC_PATH,
    OPTION_KERNEL_CACHE,
    OPTION_CUDA_GRAPHS,
];

/// How many trunk layers go on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    /// As many as the VRAM budget holds.
    Auto,
    /// Exactly this many (the last ones); more than the model has means all.
    Count(usize),
}

/// Parsed backend options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub gpu_layers: GpuLayers,
    pub vram_budget: Option<u64>,
    pub device: usize,
    /// `ring_budget_bytes` and `deep_rollback`.
    pub common: CommonOptions,
    pub nvrtc_path: Option<PathBuf>,
    /// `None`: no disk cache.
    pub kernel_cache: Option<PathBuf>,
    /// Recurring passes issued as CUDA graphs.
    pub cuda_graphs: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            gpu_layers: GpuLayers::Auto,
            vram_budget: None,
            device: 0,
            common: CommonOptions::default(),
            nvrtc_path: None,
            kernel_cache: default_kernel_cache(),
            cuda_graphs: true,
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

impl Options {
    /// Reads the options of `params`, reporting every bad one in one error.
    pub fn parse(params: &BackendParams) -> Result<Self, PluginError> {
        let mut options = Options::default();
        let common = options::parse(PLUGIN_NAME, params, &OWN_OPTIONS, |key, value| {
            match key {
                OPTION_GPU_LAYERS => match value {
                    "auto" => options.gpu_layers = GpuLayers::Auto,
                    "all" => options.gpu_layers = GpuLayers::Count(usize::MAX),
                    _ => match value.parse() {
                        Ok(n) => options.gpu_layers = GpuLayers::Count(n),
                        Err(_) => return Parsed::Expected("a number of layers, 'all' or 'auto'"),
                    },
                },
                OPTION_VRAM_BUDGET => match parse_bytes(value) {
                    Some(bytes) => options.vram_budget = Some(bytes),
                    None => {
                        return Parsed::Expected(
                            "a number of bytes, optionally with KiB, MiB or GiB",
                        )
                    }
                },
                OPTION_DEVICE => match value.parse() {
                    Ok(device) => options.device = device,
                    Err(_) => return Parsed::Expected("a CUDA device number"),
                },
                OPTION_NVRTC_PATH => {
                    options.nvrtc_path = (!value.is_empty()).then(|| PathBuf::from(value))
                }
                OPTION_KERNEL_CACHE => {
                    options.kernel_cache = match value {
                        "off" | "none" | "" => None,
                        dir => Some(PathBuf::from(dir)),
                    }
                }
                OPTION_CUDA_GRAPHS => match value {
                    "true" => options.cuda_graphs = true,
                    "false" => options.cuda_graphs = false,
                    _ => return Parsed::Expected("true or false"),
                },
                _ => return Parsed::Unknown,
            }
            Parsed::Ok
        })?;
        options.common = common;
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_engine::backend::options::DeepRollback;
    use specula_engine::kv_cache::KvType;
    use specula_plugin_api::ErrorKind;

    fn params(options: &[(&str, &str)]) -> BackendParams {
        specula_plugin_api::testing::backend_params("m.gguf", 1, 0, 0, options)
    }

    #[test]
    fn options_parse_and_bad_values_name_the_option() {
        let o = Options::parse(&params(&[
            ("gpu_layers", "12"),
            ("vram_budget", "6GiB"),
            ("device", "1"),
            ("ring_budget_bytes", "1000"),
            ("deep_rollback", "refuse"),
            ("kv_type", "f32"),
            ("nvrtc_path", "/opt/nvrtc/lib"),
            ("kernel_cache", "off"),
            ("cuda_graphs", "false"),
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
        assert_eq!(o.common.ring_budget_bytes, Some(1000));
        assert_eq!(o.common.deep_rollback, DeepRollback::Refuse);
        assert_eq!(o.common.kv_type, KvType::F32);
        assert_eq!(Options::default().common.kv_type, KvType::F16);
        assert_eq!(o.nvrtc_path, Some(PathBuf::from("/opt/nvrtc/lib")));
        assert_eq!(o.kernel_cache, None);
        assert!(!o.cuda_graphs && Options::default().cuda_graphs);
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
            ("kv_type", "q4_0"),
            ("cuda_graphs", "yes"),
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
