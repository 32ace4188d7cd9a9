//! Whether this process may execute AMX tile instructions (Intel Sapphire Rapids and later:
//! `AMX-TILE` with `AMX-INT8`, 1 KiB tile registers multiplied by `TDPBSUD` and its kin).
//!
//! Three things must hold, and a virtual machine can break each: the CPU reports the features
//! (CPUID leaf 7), the operating system has enabled the tile state in `XCR0` (bits 17 and 18,
//! `XTILECFG` and `XTILEDATA`), and — on Linux 5.16 and later, where the 8 KiB tile data is
//! granted per process — `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` succeeds. A
//! program that executes a tile instruction without all three dies with `SIGILL` (as
//! llama.cpp's AMX path does on some cloud VMs that advertise the features). [`amx_support`]
//! checks them in that order, without executing a tile instruction, and asks for the
//! permission once per process.
//!
//! Where it finds the tiles granted, the process runs at [`crate::SimdLevel::Amx`]: passes of
//! several activation rows over interleaved Q8_0 weights go through one `TDPBSUD` per block
//! and 16 weight rows, and passes of 9 or more over Q4_K / Q5_K through tiles of their levels
//! times their sub-block scales (`simd/interleaved.rs`), bit-identical to the AVX-512 kernels. `specula
//! bench` reports what the probe found; `SPECULA_SIMD=avx512` keeps a process off the tiles.
//!
//! The probe runs when the process's SIMD level is first decided, so every process that uses
//! the kernels asks for the permission: once granted, Linux sizes its signal frames for the
//! tile data (an alternate signal stack smaller than that is then refused, process-wide).

use std::sync::OnceLock;

/// What [`amx_support`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmxSupport {
    /// Not an x86-64 CPU with `AMX-TILE` and `AMX-INT8` (CPUID leaf 7, EDX bits 24 and 25):
    /// every AMD CPU so far, Intel before Sapphire Rapids, or a hypervisor that hides them.
    NotOnThisCpu,
    /// The CPU has the tiles but the operating system has not enabled their state in `XCR0`.
    NotEnabledByOs,
    /// The kernel refused the process the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)` failed
    /// with this errno, or the permission it reports afterwards lacks `XTILEDATA`).
    PermissionRefused(i32),
    /// The process may execute tile instructions.
    Granted,
}

impl std::fmt::Display for AmxSupport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmxSupport::NotOnThisCpu => write!(f, "not on this CPU (no AMX-TILE / AMX-INT8 in CPUID)"),
            AmxSupport::NotEnabledByOs => {
                write!(f, "the CPU has it, but the OS has not enabled the tile state (XCR0)")
            }
            AmxSupport::PermissionRefused(errno) => write!(
                f,
                "the CPU and OS have it, but the kernel refused this process the tile data (arch_prctl errno {errno})"
            ),
            AmxSupport::Granted => write!(f, "usable (tile data granted to this process)"),
        }
    }
}

/// Whether this process may use AMX tiles; probed once per process (the first call asks the
/// kernel for the permission).
pub fn amx_support() -> AmxSupport {
    static SUPPORT: OnceLock<AmxSupport> = OnceLock::new();
    *SUPPORT.get_or_init(probe)
}

#[cfg(target_arch = "x86_64")]
fn probe() -> AmxSupport {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 0: the highest leaf.
    let max_leaf = __cpuid_count(0, 0).eax;
    if max_leaf < 7 {
        return AmxSupport::NotOnThisCpu;
    }
    let leaf7 = __cpuid_count(7, 0);
    let (amx_tile, amx_int8) = (leaf7.edx >> 24 & 1 == 1, leaf7.edx >> 25 & 1 == 1);
    if !(amx_tile && amx_int8) {
        return AmxSupport::NotOnThisCpu;
    }
    let osxsave = __cpuid_count(1, 0).ecx >> 27 & 1 == 1;
    if !osxsave || xcr0() >> 17 & 3 != 3 {
        return AmxSupport::NotEnabledByOs;
    }
    request_tile_data()
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> AmxSupport {
    AmxSupport::NotOnThisCpu
}

/// `XCR0`, the state components the OS enabled.
#[cfg(target_arch = "x86_64")]
fn xcr0() -> u64 {
    #[target_feature(enable = "xsave")]
    fn read() -> u64 {
        // SAFETY: `xgetbv` with ECX = 0 reads XCR0; the caller checked OSXSAVE.
        unsafe { std::arch::x86_64::_xgetbv(0) }
    }
    // SAFETY: OSXSAVE (checked by the caller) means XSAVE is supported and enabled.
    unsafe { read() }
}

/// Asks Linux for the tile data (`ARCH_REQ_XCOMP_PERM`), then reads the permission back
/// (`ARCH_GET_XCOMP_PERM`).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> AmxSupport {
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these codes takes an integer argument and changes only this
    // process's permitted XSAVE features.
    let requested = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if requested != 0 {
        return AmxSupport::PermissionRefused(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1),
        );
    }
    let mut permitted: u64 = 0;
    // SAFETY: ARCH_GET_XCOMP_PERM writes one u64 through the pointer, which points at a live
    // local.
    let read = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut permitted as *mut u64,
        )
    };
    if read != 0 || permitted >> XFEATURE_XTILEDATA & 1 == 0 {
        return AmxSupport::PermissionRefused(if read != 0 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        } else {
            0
        });
    }
    AmxSupport::Granted
}

/// Elsewhere the tile state is enabled for every process by the OS that set `XCR0`.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_data() -> AmxSupport {
    AmxSupport::Granted
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe answers the same every time and never executes a tile instruction; where the
    /// CPU lacks AMX (every AMD CPU) it says so.
    #[test]
    fn the_probe_is_stable_and_names_what_it_found() {
        let first = amx_support();
        assert_eq!(first, amx_support());
        let text = first.to_string();
        assert!(!text.is_empty());
        if crate::simd::amd_cpu() {
            assert_eq!(first, AmxSupport::NotOnThisCpu, "{text}");
        }
    }
}
