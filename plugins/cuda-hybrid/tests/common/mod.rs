//! Helpers shared by the cuda-hybrid integration tests: models, backend parameters, calls
//! through the `ForwardPass` contract (so cpu-simd and cuda-hybrid are driven the same way),
//! and the "is there a GPU?" check GPU tests start with.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use abi_stable::std_types::{RString, RVec, Tuple2};
use specula_plugin_api::{BackendParams, BoxedForwardPass, ForwardPass, LogitRows};

pub const VOCAB: usize = 512;

/// `../shared/models` beside the workspace, or `models` in the directory `$SPECULA_SHARED`
/// names (for test executables run away from their checkout, as on a GPU machine).
pub fn models_dir() -> PathBuf {
    let dir = std::env::var_os("SPECULA_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"))
        .join("models");
    assert!(
        dir.join("stories260K.gguf").exists(),
        "shared models not found at {}",
        dir.display()
    );
    dir
}

pub fn fixture(name: &str) -> PathBuf {
    models_dir().join("fixtures").join(name)
}

/// The qwen2 fixture (dense, q/k/v biases, NeoX RoPE).
pub fn tiny_qwen2() -> PathBuf {
    models_dir().join("next-arch/tiny-qwen2.gguf")
}

pub fn stories() -> PathBuf {
    models_dir().join("stories260K.gguf")
}

/// The trained qwen35 model with an MTP head (`f32` or `q8_0`).
pub fn trained_qwen35(ty: &str) -> PathBuf {
    models_dir().join(format!("trained/stories-qwen35-mtp-{ty}.gguf"))
}

/// Every architecture: dense llama, the hybrids with and without MTP heads, and MoE.
pub const MODELS: [&str; 5] = [
    "tiny-llama.gguf",
    "tiny-qwen35-mtp.gguf",
    "tiny-qwen35-4l-mtp.gguf",
    "tiny-qwen3next.gguf",
    "tiny-qwen3next-mtp.gguf",
];

pub fn params(path: &Path, context_size: u32, options: &[(&str, &str)]) -> BackendParams {
    BackendParams {
        model_path: RString::from(path.to_str().expect("UTF-8 path")),
        threads: 2,
        context_size,
        max_verify_tokens: 0,
        max_sequences: 0,
        kv_tokens: 0,
        options: options
            .iter()
            .map(|(k, v)| Tuple2(RString::from(*k), RString::from(*v)))
            .collect::<RVec<_>>(),
    }
}

/// The cpu-simd backend for `params`, from its plugin library beside this test executable
/// (built because cpu-simd is a dev-dependency; it cannot be linked in beside cuda-hybrid),
/// with one sequence.
pub fn cpu_simd(params: &BackendParams) -> Solo<BoxedForwardPass> {
    let exe = std::env::current_exe().expect("test executable");
    let lib = exe.parent().expect("deps dir").join(format!(
        "{}specula_cpu_simd{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let plugin = specula_host::plugins::load_library(&lib)
        .unwrap_or_else(|e| panic!("loading {}: {e}", lib.display()));
    Solo::new(
        plugin
            .open_backend(params)
            .unwrap_or_else(|e| panic!("cpu-simd on {}: {e}", params.model_path)),
    )
}

/// Evaluates `tokens` after the sequence and returns the requested logits.
pub fn eval<B: ForwardPass>(b: &mut Solo<B>, tokens: &[u32], rows: LogitRows) -> Vec<f32> {
    b.eval(tokens, rows)
}

/// The hidden states of the sequence's last evaluated rows.
pub fn hidden<B: ForwardPass>(b: &Solo<B>) -> Vec<f32> {
    b.hidden()
}

/// Greedy decoding of `n` tokens after `prompt`, one token per eval.
pub fn greedy<B: ForwardPass>(b: &mut Solo<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let seq = b.seq;
    specula_plugin_api::testing::greedy(&mut b.backend, seq, prompt, n)
}

/// Cuts the sequence to `len` tokens.
pub fn truncate<B: ForwardPass>(b: &mut Solo<B>, len: usize) {
    b.truncate_to(len)
        .unwrap_or_else(|e| panic!("truncate to {len}: {e}"));
}

/// One MTP call: (logits of every row, hidden states of every row).
pub fn mtp<B: ForwardPass>(
    b: &mut Solo<B>,
    hidden: &[f32],
    tokens: &[u32],
    position: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (mut logits, mut out) = (RVec::new(), RVec::new());
    b.mtp_eval(
        hidden,
        tokens,
        position,
        LogitRows::All,
        &mut logits,
        &mut out,
    )
    .unwrap_or_else(|e| panic!("mtp_eval at {position}: {e}"));
    (logits.to_vec(), out.to_vec())
}

/// Largest absolute difference.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[allow(unused_imports)]
pub use specula_plugin_api::testing::{
    argmax, assert_batches_match_sequences_alone, assert_verify_rows_match_single_evals, bits, row,
    Rng, Solo,
};

/// `true` when a CUDA device can be used (driver, NVRTC and at least one device); otherwise
/// prints why the calling GPU test is skipped and returns `false`.
pub fn gpu_or_skip(test: &str) -> bool {
    match specula_cuda_hybrid::driver::usable_gpu() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED {test}: no GPU here: {}", e.message);
            false
        }
    }
}

/// What the device tests run on.
#[derive(Clone)]
pub enum Device {
    /// A CUDA device.
    Cuda,
    /// The host emulator of the kernels (no GPU here).
    Emulated(std::sync::Arc<specula_cuda_hybrid::gpu::emulator::Emulator>),
}

/// The host emulator, built once per test process with `$CXX` (default `c++`) under the
/// target directory; `Err` says why it cannot be had.
pub fn emulator() -> Result<std::sync::Arc<specula_cuda_hybrid::gpu::emulator::Emulator>, String> {
    use specula_cuda_hybrid::gpu::emulator::{build, Emulator};
    use std::sync::{Arc, OnceLock};
    static EMULATOR: OnceLock<Result<Arc<Emulator>, String>> = OnceLock::new();
    EMULATOR
        .get_or_init(|| {
            let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
            // Kept between runs, keyed by the sources; built in a private directory and
            // renamed into place, so concurrent test processes never see half a library.
            let key = fnv1a(specula_cuda_hybrid::gpu::emulator::translation_unit().as_bytes());
            let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-host-emulator");
            let library = root.join(format!("libcuda_host_kernels-{key:016x}.so"));
            if !library.exists() {
                let dir = root.join(format!("build-{}", std::process::id()));
                let built = build(&cxx, &dir)?;
                std::fs::rename(&built, &library).map_err(|e| e.to_string())?;
                let _ = std::fs::remove_dir_all(&dir);
            }
            Emulator::load(&library)
                .map(Arc::new)
                .map_err(|e| e.message.to_string())
        })
        .clone()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether `$SPECULA_REQUIRE_GPU` is set (to anything but empty / `0`): then a GPU test fails
/// instead of falling back to the emulator or skipping (`gpu-check/run.sh` sets it).
pub fn gpu_required() -> bool {
    std::env::var("SPECULA_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A CUDA device when there is one, else the host emulator when a C++ compiler can build it;
/// `None` (after printing why) when neither is available.
pub fn device_or_skip(test: &str) -> Option<Device> {
    match specula_cuda_hybrid::driver::usable_gpu() {
        Ok(_) => return Some(Device::Cuda),
        Err(e) if gpu_required() => panic!("{test}: SPECULA_REQUIRE_GPU is set, but: {e}"),
        Err(_) => {}
    }
    match emulator() {
        Ok(e) => {
            eprintln!("{test}: no GPU here, running on the host emulator of the kernels");
            Some(Device::Emulated(e))
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: no GPU here and no emulator: {why}");
            None
        }
    }
}

/// The device as a [`specula_cuda_hybrid::gpu::Gpu`].
pub fn open_device(device: &Device) -> specula_cuda_hybrid::gpu::Gpu {
    match device {
        Device::Cuda => specula_cuda_hybrid::gpu::Gpu::open(0, None, false)
            .unwrap_or_else(|e| panic!("opening the GPU: {e}")),
        Device::Emulated(e) => specula_cuda_hybrid::gpu::Gpu::emulated(e.clone(), 1 << 34, false),
    }
}

/// cuda-hybrid on `device` for `path` (context 256, `options`).
pub fn open_backend(
    device: &Device,
    path: &Path,
    options: &[(&str, &str)],
) -> Result<specula_cuda_hybrid::CudaBackend, specula_plugin_api::PluginError> {
    open_backend_with(device, path, options, 0)
}

/// cuda-hybrid on `device` for `path` (context 256, `options`) with room for `max_sequences`.
pub fn open_backend_with(
    device: &Device,
    path: &Path,
    options: &[(&str, &str)],
    max_sequences: u32,
) -> Result<specula_cuda_hybrid::CudaBackend, specula_plugin_api::PluginError> {
    let mut p = params(path, 256, options);
    p.max_sequences = max_sequences;
    match device {
        Device::Cuda => specula_cuda_hybrid::open(&p),
        Device::Emulated(e) => specula_cuda_hybrid::backend::open_emulated(&p, e.clone(), 1 << 34),
    }
}
