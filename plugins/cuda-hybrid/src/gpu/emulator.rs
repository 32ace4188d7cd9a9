//! A host stand-in for the GPU, for tests on machines without one.
//!
//! The kernel sources (`kernels/*.cu`, exactly as NVRTC compiles them) are compiled as C++ with
//! `emulator/cuda_host.h`, which emulates the CUDA execution model on the host: blocks one
//! after another, the threads of a block as fibers that meet at `__syncthreads()` and at warp
//! shuffles. [`crate::gpu::Gpu::emulated`] then runs the backend's whole device path —
//! uploads, launches with the real argument lists, the device ring, the hand-off copies — with
//! host memory standing in for device memory.
//!
//! What this checks: kernel logic (indexing, reductions, barriers, launch shapes and argument
//! order) and the device-side orchestration. What it cannot: the CUDA driver calls themselves
//! (module loading, copies, real launches), timing, and CUDA's math library (glibc's stands in).
//! The plugin never uses it outside tests.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use specula_plugin_api::{ErrorKind, PluginError};

use super::Arg;
use crate::kernels::{COMMON, SOURCES};

/// The emulation header.
pub const HOST_HEADER: &str = include_str!("../../emulator/cuda_host.h");

type LaunchFn = unsafe extern "C" fn(u32, u32, u32, u32, *mut *mut c_void);

/// The emulation keeps its scheduler in globals: one launch at a time per process.
static LAUNCH: Mutex<()> = Mutex::new(());

/// The emulated kernels of a loaded host build.
pub struct Emulator {
    _library: libloading::Library,
    functions: HashMap<&'static str, LaunchFn>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator")
            .field("kernels", &self.functions.len())
            .finish()
    }
}

/// The C++ translation unit of the emulator: the header, every kernel file in a namespace of
/// its own (with the common helpers), and an `emu_launch_<kernel>` entry point per kernel.
pub fn translation_unit() -> String {
    let mut tu = String::from(HOST_HEADER);
    for source in SOURCES {
        let ns = format!("k_{}", source.file.trim_end_matches(".cu"));
        tu.push_str(&format!(
            "\nnamespace {ns} {{\n#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}\n}}\n",
            source.file, source.text
        ));
        for function in source.functions {
            tu.push_str(&format!(
                "extern \"C\" void emu_launch_{function}(unsigned gx, unsigned gy, unsigned gz, unsigned block, void** args) {{ emu::launch(&{ns}::{function}, gx, gy, gz, block, args); }}\n"
            ));
        }
    }
    tu
}

/// Builds the emulator library with the C++ compiler `cxx` in `dir`; returns its path, or the
/// compiler's complaint.
pub fn build(cxx: &str, dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let source = dir.join("cuda_host_kernels.cpp");
    let library = dir.join(format!(
        "{}cuda_host_kernels{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    std::fs::write(&source, translation_unit()).map_err(|e| e.to_string())?;
    let output = std::process::Command::new(cxx)
        // No _FORTIFY_SOURCE: its longjmp check rejects the jumps between fiber stacks.
        .args([
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-U_FORTIFY_SOURCE",
            "-shared",
            "-fPIC",
            "-w",
            "-o",
        ])
        .arg(&library)
        .arg(&source)
        .output()
        .map_err(|e| format!("cannot run {cxx}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{cxx} failed on {}:\n{}",
            source.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(library)
}

impl Emulator {
    /// Loads a library made by [`build`].
    pub fn load(library: &Path) -> Result<Self, PluginError> {
        let fail = |why: String| {
            PluginError::new(
                ErrorKind::Internal,
                format!("cuda-hybrid emulator {}: {why}", library.display()),
            )
        };
        // SAFETY: a library built from this crate's own sources by `build`.
        let lib = unsafe { libloading::Library::new(library) }.map_err(|e| fail(e.to_string()))?;
        let mut functions = HashMap::new();
        for source in SOURCES {
            for &function in source.functions {
                let symbol = format!("emu_launch_{function}");
                // SAFETY: the symbol has the `LaunchFn` signature (see `translation_unit`).
                let f: LaunchFn = unsafe { lib.get::<LaunchFn>(symbol.as_bytes()) }
                    .map(|s| *s)
                    .map_err(|e| fail(e.to_string()))?;
                functions.insert(function, f);
            }
        }
        Ok(Self {
            _library: lib,
            functions,
        })
    }

    /// The kernel named `name`, by the name the table keeps.
    pub fn kernel_name(&self, name: &str) -> Option<&'static str> {
        self.functions.get_key_value(name).map(|(k, _)| *k)
    }

    /// Runs kernel `name` over `grid` with `block` threads per block.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), PluginError> {
        let f = self.functions.get(name).ok_or_else(|| {
            PluginError::new(
                ErrorKind::Internal,
                format!("cuda-hybrid emulator: no kernel '{name}'"),
            )
        })?;
        if block == 0 || block > 1024 {
            return Err(PluginError::new(
                ErrorKind::Internal,
                format!("cuda-hybrid emulator: {name} launched with {block} threads per block"),
            ));
        }
        // Every argument in an 8-byte slot; the kernel reads its parameter type from it.
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) | Arg::U64(p) => p,
                Arg::I32(v) => u64::from(v as u32),
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut pointers: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let _one_at_a_time = LAUNCH.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `pointers` holds one live 8-byte slot per kernel parameter, little-endian,
        // so a 4-byte int or float parameter reads its value from the slot's first bytes.
        unsafe { f(grid.0, grid.1, grid.2, block, pointers.as_mut_ptr()) };
        Ok(())
    }
}
