//! Finding the CUDA driver and NVRTC before cudarc is touched.
//!
//! cudarc (with `dynamic-loading`) opens `libcuda` and `libnvrtc` with dlopen on first use and
//! **panics** when it cannot. So the plugin probes for the libraries itself, with libloading,
//! and turns their absence into an error that names the library it looked for; only then
//! does it call into cudarc (and every entry point still runs under
//! [`specula_plugin_api::guard`], so a panic inside cudarc becomes an error, never an unwind
//! into the host).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use specula_plugin_api::{ErrorKind, PluginError};

/// The driver library the plugin needs (the NVIDIA driver installs it).
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// The NVRTC libraries the plugin compiles its kernels with, newest first: CUDA 13's and CUDA
/// 12's (the toolkit's `lib64`, or the PyPI wheels `nvidia-cuda-nvrtc`, in `nvidia/cu13/lib/`,
/// and `nvidia-cuda-nvrtc-cu12`, in `nvidia/cuda_nvrtc/lib/`). cudarc opens the first of its
/// candidate names that loads: the unversioned `libnvrtc.so`, then these.
pub const NVRTC_LIBRARIES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc.so.12"];

/// Environment variable naming the NVRTC library file, or the directory holding it, when it
/// is not on the loader's search path (the `nvrtc_path` option does the same per profile).
pub const NVRTC_ENV: &str = "SPECULA_NVRTC_PATH";

/// Checks that the CUDA driver library can be loaded, without touching cudarc.
pub fn probe_driver() -> Result<(), PluginError> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: loading the NVIDIA driver library runs its initialisers, which is what
            // using CUDA at all requires; the handle is dropped again (cudarc loads it itself).
            let first = unsafe { libloading::Library::new(DRIVER_LIBRARY) };
            let error = match first {
                Ok(_) => return Ok(()),
                Err(e) => e.to_string(),
            };
            // SAFETY: as above.
            if unsafe { libloading::Library::new("libcuda.so") }.is_ok() {
                return Ok(());
            }
            Err(error)
        })
        .clone()
        .map_err(|why| {
            PluginError::new(
                ErrorKind::Unsupported,
                format!(
                    "cuda-hybrid: no CUDA driver found: cannot load {DRIVER_LIBRARY} ({why}). \
                     This backend needs an NVIDIA GPU with its driver installed; on a machine \
                     without one use backend = \"cpu-simd\""
                ),
            )
        })?;
    // cudarc searches a few more names; make sure it will find one of them too.
    // SAFETY: only dlopen / dlclose of the driver library, which loaded above.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(PluginError::new(
            ErrorKind::Unsupported,
            format!("cuda-hybrid: no CUDA driver found: {DRIVER_LIBRARY} loads, but cudarc cannot open it"),
        ));
    }
    Ok(())
}

/// Where NVRTC was asked to be looked for: the option, else the environment variable.
fn nvrtc_hint(option: Option<&Path>) -> Option<PathBuf> {
    option
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(NVRTC_ENV).map(PathBuf::from))
        .filter(|p| !p.as_os_str().is_empty())
}

/// Makes NVRTC loadable for cudarc: if `hint` (the `nvrtc_path` option, else
/// `$SPECULA_NVRTC_PATH`) names the library or its directory, that file is loaded first (and
/// kept loaded, so cudarc's dlopen of its soname finds it); otherwise the loader's search path
/// (`LD_LIBRARY_PATH`, the system directories) must have one of [`NVRTC_LIBRARIES`].
///
/// Returns the error to report when NVRTC cannot be found.
pub fn ensure_nvrtc(option: Option<&Path>) -> Result<(), PluginError> {
    let hint = nvrtc_hint(option);
    let mut tried = Vec::new();
    if let Some(hint) = &hint {
        let files: Vec<PathBuf> = if hint.is_dir() {
            NVRTC_LIBRARIES.iter().map(|name| hint.join(name)).collect()
        } else {
            vec![hint.clone()]
        };
        for file in files {
            // SAFETY: loads the NVRTC library named by the user; leaked so it stays resident.
            match unsafe { libloading::Library::new(&file) } {
                Ok(lib) => {
                    std::mem::forget(lib);
                    break;
                }
                Err(e) => tried.push(format!("{} ({e})", file.display())),
            }
        }
    }
    // SAFETY: dlopen / dlclose of the NVRTC library only.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    for name in NVRTC_LIBRARIES {
        // SAFETY: as above.
        if let Err(e) = unsafe { libloading::Library::new(name) } {
            tried.push(format!("{name} ({e})"));
        }
    }
    Err(PluginError::new(
        ErrorKind::Unsupported,
        format!(
            "cuda-hybrid: NVRTC not found (tried {}). The kernels are compiled with NVRTC when \
             the backend opens: install the CUDA toolkit (12 or 13), or `pip install \
             nvidia-cuda-nvrtc` (CUDA 13) or `nvidia-cuda-nvrtc-cu12` and put the wheel's lib \
             directory (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib) on LD_LIBRARY_PATH, in \
             ${NVRTC_ENV} or in the option nvrtc_path",
            tried.join(", ")
        ),
    ))
}

/// Whether NVRTC can be loaded (see [`ensure_nvrtc`]), without an error message.
pub fn nvrtc_available() -> bool {
    ensure_nvrtc(None).is_ok()
}

/// Whether this machine can run the backend: the driver loads, NVRTC loads (the option-less
/// search), and the driver reports at least one device. Returns the number of devices, or
/// the reason there is none (what GPU tests print when they skip).
pub fn usable_gpu() -> Result<usize, PluginError> {
    probe_driver()?;
    ensure_nvrtc(None)?;
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err(PluginError::unsupported(
            "cuda-hybrid: the CUDA driver reports no device",
        )),
        Err(e) => Err(PluginError::unsupported(format!(
            "cuda-hybrid: the CUDA driver reports no usable device: {e:?}"
        ))),
    }
}
