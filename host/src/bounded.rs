//! Reading files a user names (profiles, drafter corpora, key files) without trusting them to
//! end: a device, pipe or directory is refused, and so is a file over a size cap — checked
//! before reading and enforced while reading, so a file that grows cannot exhaust memory.

use std::io::Read;
use std::path::Path;

/// Why a bounded read failed; the caller adds which file setting it was.
#[derive(Debug, thiserror::Error)]
pub enum BoundedReadError {
    #[error("{path} is not a regular file (a directory, device or pipe)")]
    NotAFile { path: String },
    #[error("{path} is {size} bytes, more than the limit of {limit} bytes")]
    TooLarge { path: String, size: u64, limit: u64 },
    #[error("{path} is not UTF-8 text")]
    NotText { path: String },
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The bytes of the regular file `path`, refusing it if it has more than `limit` bytes.
pub fn read(path: &Path, limit: u64) -> Result<Vec<u8>, BoundedReadError> {
    let shown = || path.display().to_string();
    let io = |source| BoundedReadError::Io {
        path: shown(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(BoundedReadError::NotAFile { path: shown() });
    }
    let too_large = |size| BoundedReadError::TooLarge {
        path: shown(),
        size,
        limit,
    };
    if meta.len() > limit {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // One byte past the limit tells a file that grew while being read.
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Like [`read`], as UTF-8 text.
pub fn read_to_string(path: &Path, limit: u64) -> Result<String, BoundedReadError> {
    String::from_utf8(read(path, limit)?).map_err(|_| BoundedReadError::NotText {
        path: path.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_large_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = read(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(matches!(err, BoundedReadError::NotAFile { .. }), "{err}");
        let err = read(dir.path(), 1 << 20).unwrap_err();
        assert!(matches!(err, BoundedReadError::NotAFile { .. }), "{err}");
        let file = dir.path().join("f.txt");
        std::fs::write(&file, "0123456789").unwrap();
        assert_eq!(read(&file, 10).unwrap(), b"0123456789");
        let err = read_to_string(&file, 9).unwrap_err().to_string();
        assert!(
            err.contains("10 bytes") && err.contains("limit of 9"),
            "{err}"
        );
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        assert!(matches!(
            read_to_string(&file, 10),
            Err(BoundedReadError::NotText { .. })
        ));
        assert!(matches!(
            read(&dir.path().join("missing"), 10),
            Err(BoundedReadError::Io { .. })
        ));
    }
}
