//! A plugin library's file, checked before the system loader sees it, and the private copy
//! that is loaded.
//!
//! The system loader trusts its input: a truncated library whose loadable segments run past
//! the end of the file is mapped anyway, and the process dies with SIGBUS the first time a
//! page past the end is touched — before any error can be reported. So the host reads the
//! file, parses its ELF header and program headers (with `object`), and hands the loader only
//! a library of this machine's class, byte order and architecture whose segments all lie
//! inside the file.
//!
//! What is loaded is a private copy of exactly the bytes checked: a library replaced or
//! rewritten in place afterwards can neither change nor crash code already loaded from it,
//! and a new build at the same path is a new file to the loader (which would otherwise hand
//! back the library it already has for that path or inode).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

/// Held while the private directory is created or removed, so one thread's copy cannot land
/// in a directory another thread is removing.
static PRIVATE_DIR: Mutex<()> = Mutex::new(());

/// What identifies the contents of a file on disk: a replaced or rewritten file differs in
/// at least one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    pub size: u64,
    pub modified: Option<SystemTime>,
    /// Device and inode, where the platform has them.
    pub inode: Option<(u64, u64)>,
}

impl FileIdentity {
    /// The identity of the file at `path` now.
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        #[cfg(unix)]
        let inode = {
            use std::os::unix::fs::MetadataExt;
            Some((meta.dev(), meta.ino()))
        };
        #[cfg(not(unix))]
        let inode = None;
        Ok(Self {
            size: meta.len(),
            modified: meta.modified().ok(),
            inode,
        })
    }

    /// The modification time as seconds since the Unix epoch, if known.
    pub fn modified_unix(&self) -> Option<u64> {
        self.modified
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
    }
}

/// Checks that `bytes` is a shared library the system loader of this machine can map without
/// reading past the end of the file. The error says what is wrong, for the plugin listing.
pub fn check(bytes: &[u8]) -> Result<(), String> {
    #[cfg(all(unix, not(target_vendor = "apple")))]
    return elf::check(bytes);
    #[cfg(not(all(unix, not(target_vendor = "apple"))))]
    {
        let _ = bytes;
        Ok(())
    }
}

#[cfg(all(unix, not(target_vendor = "apple")))]
mod elf {
    use object::elf::{FileHeader64, ET_DYN, PT_LOAD};
    use object::read::elf::{FileHeader, ProgramHeader};
    use object::{Endian, Endianness, FileKind};

    /// The `e_machine` this host runs, or `None` where it is not listed (no check then).
    fn host_machine() -> Option<u16> {
        match std::env::consts::ARCH {
            "x86_64" => Some(object::elf::EM_X86_64),
            "aarch64" => Some(object::elf::EM_AARCH64),
            "riscv64" => Some(object::elf::EM_RISCV),
            "powerpc64" => Some(object::elf::EM_PPC64),
            "s390x" => Some(object::elf::EM_S390),
            "loongarch64" => Some(object::elf::EM_LOONGARCH),
            _ => None,
        }
    }

    fn machine_name(machine: u16) -> String {
        match machine {
            object::elf::EM_X86_64 => "x86_64".into(),
            object::elf::EM_386 => "x86".into(),
            object::elf::EM_AARCH64 => "aarch64".into(),
            object::elf::EM_ARM => "arm".into(),
            object::elf::EM_RISCV => "riscv".into(),
            object::elf::EM_PPC64 => "powerpc64".into(),
            object::elf::EM_S390 => "s390x".into(),
            object::elf::EM_LOONGARCH => "loongarch".into(),
            other => format!("machine type {other}"),
        }
    }

    pub(super) fn check(bytes: &[u8]) -> Result<(), String> {
        match FileKind::parse(bytes) {
            Ok(FileKind::Elf64) if cfg!(target_pointer_width = "64") => {}
            Ok(FileKind::Elf32) if cfg!(target_pointer_width = "64") => {
                return Err("a 32-bit ELF library; this host is 64-bit".into())
            }
            Ok(kind) => return Err(format!("not an ELF shared library of this host ({kind:?})")),
            Err(_) if bytes.len() < 64 => {
                return Err(format!(
                    "not an ELF shared library ({} bytes: too short for an ELF header)",
                    bytes.len()
                ))
            }
            Err(e) => return Err(format!("not an ELF shared library ({e})")),
        }
        let header = FileHeader64::<Endianness>::parse(bytes).map_err(|e| {
            format!(
                "its ELF header is broken or cut short ({e}; {} bytes): truncated?",
                bytes.len()
            )
        })?;
        let endian = header
            .endian()
            .map_err(|e| format!("broken ELF header ({e})"))?;
        if endian.is_little_endian() != cfg!(target_endian = "little") {
            return Err("an ELF library of the other byte order than this host's".into());
        }
        let machine = header.e_machine(endian);
        if let Some(host) = host_machine() {
            if machine != host {
                return Err(format!(
                    "built for {}; this host is {}",
                    machine_name(machine),
                    machine_name(host)
                ));
            }
        }
        if header.e_type(endian) != ET_DYN {
            return Err("an ELF file that is not a shared library (e_type is not ET_DYN)".into());
        }
        let segments = header.program_headers(endian, bytes).map_err(|e| {
            format!(
                "its program headers lie outside the file ({e}; {} bytes): truncated?",
                bytes.len()
            )
        })?;
        let mut loadable = 0;
        for (i, segment) in segments.iter().enumerate() {
            if segment.p_type(endian) != PT_LOAD {
                continue;
            }
            loadable += 1;
            let offset = segment.p_offset(endian);
            let size = segment.p_filesz(endian);
            let end = offset.checked_add(size);
            if end.is_none_or(|end| end > bytes.len() as u64) {
                return Err(format!(
                    "loadable segment {i} (file bytes {offset}..{}) runs past the end of the file ({} bytes): truncated?",
                    offset.saturating_add(size),
                    bytes.len()
                ));
            }
        }
        if loadable == 0 {
            return Err("an ELF library with no loadable segments".into());
        }
        Ok(())
    }
}

/// Writes `bytes` to a new file in this process's private plugin directory, named after
/// `original`, and returns its path. The caller loads it, then [`discard`]s it.
pub fn private_copy(original: &Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("specula-plugins-{}", std::process::id()));
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    let name = original
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "plugin".into());
    let path = dir.join(format!("{}-{name}", NEXT.fetch_add(1, Ordering::Relaxed)));
    let _dir = PRIVATE_DIR.lock().unwrap_or_else(|e| e.into_inner());
    builder.create(&dir)?;
    std::fs::write(&path, bytes)?;
    Ok(path)
}

/// Removes a private copy once it is loaded (the loader keeps its mapping) or failed to load.
pub fn discard(copy: &Path) {
    let _dir = PRIVATE_DIR.lock().unwrap_or_else(|e| e.into_inner());
    let _ = std::fs::remove_file(copy);
    if let Some(dir) = copy.parent() {
        // Only succeeds once the directory is empty.
        let _ = std::fs::remove_dir(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a_shared_library() -> Vec<u8> {
        // The C library this process has mapped.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let libc = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("libc.so") || p.contains("libc-"))
            .map(PathBuf::from);
        std::fs::read(libc.expect("libc is mapped")).unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_real_library_passes_and_its_truncations_do_not() {
        use object::read::elf::{FileHeader, ProgramHeader};
        let lib = a_shared_library();
        check(&lib).unwrap();
        // Where the last loadable segment ends: cutting anywhere before is fatal to a loader.
        let header = object::elf::FileHeader64::<object::Endianness>::parse(&*lib).unwrap();
        let endian = header.endian().unwrap();
        let load_end = header
            .program_headers(endian, &*lib)
            .unwrap()
            .iter()
            .filter(|p| p.p_type(endian) == object::elf::PT_LOAD)
            .map(|p| (p.p_offset(endian) + p.p_filesz(endian)) as usize)
            .max()
            .unwrap();
        for cut in [0, 3, 63, 64, 200, 4096, load_end / 2, load_end - 1] {
            let err = check(&lib[..cut]).unwrap_err();
            assert!(
                err.contains("truncated")
                    || err.contains("too short")
                    || err.contains("not an ELF"),
                "cut at {cut}: {err}"
            );
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn other_machines_and_classes_are_named() {
        let mut lib = a_shared_library();
        // e_machine is the u16 at byte 18 (little-endian on this host).
        let other = if std::env::consts::ARCH == "aarch64" {
            object::elf::EM_X86_64
        } else {
            object::elf::EM_AARCH64
        };
        lib[18..20].copy_from_slice(&other.to_le_bytes());
        let err = check(&lib).unwrap_err();
        assert!(err.contains("built for"), "{err}");
        lib[4] = 1; // EI_CLASS = ELFCLASS32
        let err = check(&lib).unwrap_err();
        assert!(err.contains("32-bit"), "{err}");
        assert!(check(b"#!/bin/sh\necho not a library\n").is_err());
    }

    #[test]
    fn private_copies_are_distinct_and_removed() {
        let a = private_copy(Path::new("/x/libspecula_a.so"), b"one").unwrap();
        let b = private_copy(Path::new("/x/libspecula_a.so"), b"two").unwrap();
        assert_ne!(a, b);
        assert!(a
            .file_name()
            .unwrap()
            .to_string_lossy()
            .ends_with("libspecula_a.so"));
        assert_eq!(std::fs::read(&b).unwrap(), b"two");
        discard(&a);
        discard(&b);
        assert!(!a.exists() && !b.exists());
    }
}
