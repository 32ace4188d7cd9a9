//! Every kernel source compiles to PTX with NVRTC — no GPU or driver needed, only libnvrtc.
//!
//! Where NVRTC cannot be loaded the test is skipped with a message, unless the environment
//! variable `CI` is set (to anything but `false` / `0` / empty): then a missing NVRTC fails it,
//! so CI cannot pass without having compiled every kernel. `.ci/run` installs the
//! `nvidia-cuda-nvrtc-cu12` wheel and puts its library directory on `LD_LIBRARY_PATH`; CUDA
//! 13's NVRTC passes the same tests.

use specula_cuda_hybrid::{driver, kernels};

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// `true` when NVRTC is there; `false` (after printing why) when the test should be skipped.
fn nvrtc_or_skip() -> bool {
    match driver::ensure_nvrtc(None) {
        Ok(()) => true,
        Err(e) if in_ci() => panic!("CI is set, so the PTX check must run, but: {e}"),
        Err(e) => {
            eprintln!("SKIPPED: the kernels were not compiled to PTX: {e}");
            false
        }
    }
}

#[test]
fn every_kernel_compiles_to_ptx() {
    if !nvrtc_or_skip() {
        return;
    }
    let version = kernels::nvrtc_version().unwrap();
    // `.ci/run` names the NVRTC it means to check, so a stray one cannot stand in for it.
    if let Some(major) = std::env::var("SPECULA_EXPECT_NVRTC_MAJOR")
        .ok()
        .filter(|v| !v.is_empty())
    {
        assert_eq!(version.0.to_string(), major, "NVRTC {version:?} loaded");
    }
    // The oldest architecture both the kernels and this NVRTC support (7.0 with CUDA 12's,
    // 7.5 with CUDA 13's); `every_kernel_assembles_for_sm90…` covers Hopper down to machine
    // code.
    let oldest = kernels::supported_archs()
        .unwrap()
        .into_iter()
        .filter(|&a| a >= kernels::MIN_ARCH)
        .min()
        .expect("this NVRTC supports no architecture the kernels do");
    for arch in [oldest] {
        let started = std::time::Instant::now();
        let compiled = kernels::compile_all(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(compiled.len(), kernels::SOURCES.len());
        for kernel in &compiled {
            assert!(
                kernel
                    .ptx
                    .contains(&format!(".target sm_{}{}", arch.0, arch.1)),
                "{}: PTX for the wrong target",
                kernel.source.file
            );
        }
        eprintln!(
            "NVRTC {}.{}: {} kernel files compiled for compute_{}{} in {:.1?}",
            version.0,
            version.1,
            compiled.len(),
            arch.0,
            arch.1,
            started.elapsed()
        );
    }
}

/// The kernels also go through ptxas (NVRTC's CUBIN path) for Hopper without a warning, so
/// resource limits (registers, shared memory) are checked too; prints ptxas' report.
#[test]
fn every_kernel_assembles_for_sm90_without_warnings() {
    if !nvrtc_or_skip() {
        return;
    }
    for source in kernels::SOURCES {
        let (size, log) = kernels::compile_cubin(source, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert!(size > 0, "{}: empty CUBIN", source.file);
        assert!(
            !log.to_lowercase().contains("warning"),
            "{}: NVRTC / ptxas warnings:\n{log}",
            source.file
        );
        eprintln!("{}: {size} bytes of sm_90 code\n{log}", source.file);
    }
}
