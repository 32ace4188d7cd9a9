//! The CUDA C kernel sources (`plugins/cuda-hybrid/kernels/*.cu`, one file per concern) and
//! their compilation to PTX with NVRTC.
//!
//! Every source is compiled on its own with [`COMMON`] prepended (NVRTC gets no include path
//! and no CUDA headers). The backend compiles all of them when it opens, for the compute
//! capability of its device, and caches the PTX twice: in the process (a second backend on the
//! same kind of device reuses it) and on disk (`kernel_cache` option; keyed by a hash of the
//! source text, the NVRTC options and the NVRTC version), so later runs skip NVRTC.
//!
//! [`compile_all`] is also what the PTX test runs on machines without a GPU: NVRTC needs no
//! driver and no device.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use specula_plugin_api::{ErrorKind, PluginError};

/// Device helpers prepended to every source.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel file and the entry points the plugin launches from it.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    pub text: &'static str,
    /// The `extern "C" __global__` functions the Rust side looks up.
    pub functions: &'static [&'static str],
}

/// The entry points of `matvec.cu`: the activation quantisers, then `matvec_`, `matmul_`,
/// `matmul2_`, `matmul4_` and `matmul_ids_` of every weight type, named from the kernels'
/// weight-type table ([`specula_kernels::for_each_weight_type`],
/// [`specula_kernels::WeightType::kernel_name`]).
macro_rules! matvec_functions {
    ($($variant:ident $module:ident $name:literal,)*) => {
        &[
            "quantize_q8_0",
            "quantize_q8_k",
            $(concat!("matvec_", $name),)*
            $(concat!("matmul_", $name),)*
            $(concat!("matmul2_", $name),)*
            $(concat!("matmul4_", $name),)*
            $(concat!("matmul_ids_", $name),)*
        ]
    };
}

/// Every kernel source of the plugin.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "matvec.cu",
        text: include_str!("../kernels/matvec.cu"),
        functions: specula_kernels::for_each_weight_type!(matvec_functions),
    },
    KernelSource {
        file: "norm.cu",
        text: include_str!("../kernels/norm.cu"),
        functions: &["rms_norm"],
    },
    KernelSource {
        file: "rope.cu",
        text: include_str!("../kernels/rope.cu"),
        functions: &["qk_norm_rope"],
    },
    KernelSource {
        file: "attention.cu",
        text: include_str!("../kernels/attention.cu"),
        functions: &[
            "attention",
            "attention_f16",
            "attention_q8_0",
            "kv_store",
            "kv_store_f16",
            "kv_store_q8_0",
        ],
    },
    KernelSource {
        file: "conv.cu",
        text: include_str!("../kernels/conv.cu"),
        functions: &["gdn_conv"],
    },
    KernelSource {
        file: "gdn.cu",
        text: include_str!("../kernels/gdn.cu"),
        functions: &["gdn_qk_l2norm", "gdn_recurrence", "gdn_gated_norm"],
    },
    KernelSource {
        file: "moe.cu",
        text: include_str!("../kernels/moe.cu"),
        functions: &["moe_route", "moe_combine", "add_gated"],
    },
    KernelSource {
        file: "elementwise.cu",
        text: include_str!("../kernels/elementwise.cu"),
        functions: &["add_in_place", "swiglu", "add_row_bias"],
    },
];

/// The lowest compute capability the kernels are written for (Volta); the PTX test compiles
/// for it and for Hopper.
pub const MIN_ARCH: (i32, i32) = (7, 0);

/// The text NVRTC compiles for `source`: [`COMMON`], then the file with a `#line` directive so
/// compiler messages name the right file and line.
pub fn full_source(source: &KernelSource) -> String {
    format!("{COMMON}\n#line 1 \"{}\"\n{}", source.file, source.text)
}

/// NVRTC options for a device of compute capability `arch` (major, minor).
pub fn compile_options(arch: (i32, i32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{}{}", arch.0, arch.1),
        "--std=c++14".to_string(),
        "-lineinfo".to_string(),
    ]
}

/// The PTX of one source.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub source: KernelSource,
    pub ptx: String,
}

fn nvrtc_error(message: String) -> PluginError {
    PluginError::new(ErrorKind::Internal, message)
}

/// Compiles one source to PTX for `arch`. Needs NVRTC to be loadable (see
/// [`crate::driver::nvrtc_available`]); errors carry NVRTC's log.
pub fn compile(source: &KernelSource, arch: (i32, i32)) -> Result<String, PluginError> {
    let options = cudarc::nvrtc::CompileOptions {
        options: compile_options(arch),
        name: Some(source.file.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(full_source(source), options).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}:\n{}", log.to_string_lossy())
            }
            other => format!("{other:?}"),
        };
        nvrtc_error(format!(
            "cuda-hybrid: NVRTC could not compile kernels/{} for compute_{}{}: {detail}",
            source.file, arch.0, arch.1
        ))
    })?;
    Ok(ptx.to_src())
}

/// Compiles one source to machine code (CUBIN) for the real architecture `sm_{arch}`, which
/// also runs NVRTC's built-in ptxas: register and shared-memory limits are checked as they
/// would be when the driver loads the PTX. Returns the CUBIN size and NVRTC's log (ptxas'
/// resource report and any warnings). Used by the PTX test; the backend itself loads PTX.
pub fn compile_cubin(
    source: &KernelSource,
    arch: (i32, i32),
) -> Result<(usize, String), PluginError> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::CString;

    let fail = |what: String| {
        nvrtc_error(format!(
            "cuda-hybrid: NVRTC could not compile kernels/{} for sm_{}{}: {what}",
            source.file, arch.0, arch.1
        ))
    };
    let text = CString::new(full_source(source)).map_err(|e| fail(e.to_string()))?;
    let name = CString::new(source.file).map_err(|e| fail(e.to_string()))?;
    let prog = result::create_program(&text, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let options = [
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++14".to_string(),
        "--ptxas-options=-v".to_string(),
    ];
    // SAFETY: `prog` is a live program from create_program, destroyed once below; `text` and
    // `name` outlive it.
    let outcome = unsafe {
        let compiled = result::compile_program(prog, &options);
        let log = result::get_program_log(prog)
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        let size = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
            let mut cubin = vec![0 as std::ffi::c_char; size];
            sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr()).result()?;
            Ok(size)
        });
        let _ = result::destroy_program(prog);
        size.map(|size| (size, log.clone()))
            .map_err(|e| fail(format!("{e:?}:\n{log}")))
    };
    outcome
}

/// Compiles every source for `arch`, checking that each declared entry point is in its PTX.
pub fn compile_all(arch: (i32, i32)) -> Result<Vec<CompiledKernel>, PluginError> {
    SOURCES
        .iter()
        .map(|source| {
            let ptx = compile(source, arch)?;
            check_entries(source, &ptx)?;
            Ok(CompiledKernel {
                source: *source,
                ptx,
            })
        })
        .collect()
}

/// Checks that every function `source` declares is an entry of `ptx`.
pub fn check_entries(source: &KernelSource, ptx: &str) -> Result<(), PluginError> {
    for function in source.functions {
        let entry = format!(".entry {function}(");
        if !ptx.contains(&entry) {
            return Err(nvrtc_error(format!(
                "cuda-hybrid: kernels/{} compiled, but its PTX has no entry '{function}'",
                source.file
            )));
        }
    }
    Ok(())
}

/// The NVRTC version, as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), PluginError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the caller has made sure NVRTC can be loaded.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_error(format!(
            "cuda-hybrid: nvrtcVersion failed: {status:?}"
        )));
    }
    Ok((major, minor))
}

/// The virtual architectures this NVRTC compiles for, as (major, minor), oldest first (CUDA
/// 12's NVRTC starts at 5.0, CUDA 13's at 7.5).
pub fn supported_archs() -> Result<Vec<(i32, i32)>, PluginError> {
    use cudarc::nvrtc::sys;
    let mut count = 0;
    // SAFETY: out-parameter calls into NVRTC, which the caller has made sure is loadable; the
    // buffer holds the `count` entries NVRTC reported.
    let archs = unsafe {
        let status = sys::nvrtcGetNumSupportedArchs(&mut count);
        if status != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(nvrtc_error(format!(
                "cuda-hybrid: nvrtcGetNumSupportedArchs failed: {status:?}"
            )));
        }
        let mut archs = vec![0i32; count.max(0) as usize];
        let status = sys::nvrtcGetSupportedArchs(archs.as_mut_ptr());
        if status != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(nvrtc_error(format!(
                "cuda-hybrid: nvrtcGetSupportedArchs failed: {status:?}"
            )));
        }
        archs
    };
    let mut archs: Vec<(i32, i32)> = archs.iter().map(|a| (a / 10, a % 10)).collect();
    archs.sort_unstable();
    Ok(archs)
}

/// FNV-1a, 64 bits: a hash that is the same in every build (for cache file names).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &byte in *part {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash ^= 0xff;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The file a source's PTX is cached in, under `dir`.
pub fn cache_file(
    dir: &Path,
    source: &KernelSource,
    arch: (i32, i32),
    nvrtc: (i32, i32),
) -> PathBuf {
    let options = compile_options(arch).join(" ");
    let version = format!("{}.{}", nvrtc.0, nvrtc.1);
    let hash = fnv1a(&[
        COMMON.as_bytes(),
        source.text.as_bytes(),
        options.as_bytes(),
        version.as_bytes(),
    ]);
    let stem = source.file.trim_end_matches(".cu");
    dir.join(format!("{stem}-sm{}{}-{hash:016x}.ptx", arch.0, arch.1))
}

type ProcessCache = Mutex<HashMap<(i32, i32), Arc<Vec<CompiledKernel>>>>;

fn process_cache() -> &'static ProcessCache {
    static CACHE: OnceLock<ProcessCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Every kernel's PTX for `arch`: from this process's cache, else from the disk cache in
/// `disk` (when given), else compiled with NVRTC (and then stored in both caches; a disk cache
/// that cannot be written is only logged).
pub fn load_all(
    arch: (i32, i32),
    disk: Option<&Path>,
) -> Result<Arc<Vec<CompiledKernel>>, PluginError> {
    let mut cache = process_cache()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(hit) = cache.get(&arch) {
        return Ok(hit.clone());
    }
    let nvrtc = nvrtc_version()?;
    let mut compiled = Vec::with_capacity(SOURCES.len());
    for source in SOURCES {
        let file = disk.map(|dir| cache_file(dir, source, arch, nvrtc));
        let cached = file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .filter(|ptx| check_entries(source, ptx).is_ok());
        let ptx = match cached {
            Some(ptx) => ptx,
            None => {
                let ptx = compile(source, arch)?;
                check_entries(source, &ptx)?;
                if let Some(file) = &file {
                    store(file, &ptx);
                }
                ptx
            }
        };
        compiled.push(CompiledKernel {
            source: *source,
            ptx,
        });
    }
    let compiled = Arc::new(compiled);
    cache.insert(arch, compiled.clone());
    Ok(compiled)
}

/// Writes `ptx` to `file` through a temporary file and a rename, so a concurrent reader never
/// sees half a file.
fn store(file: &Path, ptx: &str) {
    let result = (|| -> std::io::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, ptx)?;
        std::fs::rename(&tmp, file)
    })();
    if let Err(e) = result {
        tracing::warn!(
            "cuda-hybrid: cannot write the kernel cache {}: {e}",
            file.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_is_listed_once() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = SOURCES.iter().map(|s| s.file.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
        for source in SOURCES {
            let text = std::fs::read_to_string(dir.join(source.file)).unwrap();
            assert_eq!(text, source.text, "{}", source.file);
            for function in source.functions {
                assert!(
                    source
                        .text
                        .contains(&format!("__global__ void {function}("))
                        || source
                            .text
                            .contains(&format!("DEFINE_ATTENTION({function},"))
                        || source.text.contains("DEFINE_MATMUL("),
                    "{}: no kernel {function}",
                    source.file
                );
            }
        }
    }

    #[test]
    fn cache_files_change_with_source_arch_and_version() {
        let dir = Path::new("/cache");
        let a = cache_file(dir, &SOURCES[0], (8, 0), (12, 9));
        assert!(
            a.to_string_lossy().starts_with("/cache/matvec-sm80-"),
            "{a:?}"
        );
        assert_ne!(a, cache_file(dir, &SOURCES[0], (9, 0), (12, 9)));
        assert_ne!(a, cache_file(dir, &SOURCES[0], (8, 0), (12, 8)));
        assert_ne!(a, cache_file(dir, &SOURCES[1], (8, 0), (12, 9)));
    }
}
