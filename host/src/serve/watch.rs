//! Reload triggers: profile file changes (through `notify`, debounced) and SIGHUP.
//!
//! The watcher watches each profile directory, and the parent directory of each profile
//! file (editors often save by writing a new file and renaming it over the old one, which a
//! watch on the file itself would miss). Events for `*.toml` files in a watched directory,
//! or for a named profile file, start a quiet-period timer; the reload runs once no event
//! came for the debounce interval, so an editor's burst of writes is one reload.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::registry::Registry;

/// Starts watching the registry's sources; reloads run `debounce` after the last event.
/// The returned watcher must be kept alive.
pub fn watch_profiles(
    registry: Arc<Registry>,
    debounce: Duration,
) -> notify::Result<notify::RecommendedWatcher> {
    let (tx, rx) = mpsc::unbounded_channel::<PathBuf>();
    let filter = Filter::new(registry.sources());
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!("profile watcher: {e}");
                return;
            }
        };
        if matches!(event.kind, EventKind::Access(_)) {
            return;
        }
        for path in event.paths {
            if filter.wants(&path) {
                let _ = tx.send(path);
            }
        }
    })?;
    for dir in Filter::dirs(registry.sources()) {
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        tracing::debug!("watching {}", dir.display());
    }
    tokio::spawn(debounced_reloads(registry, rx, debounce));
    Ok(watcher)
}

async fn debounced_reloads(
    registry: Arc<Registry>,
    mut rx: mpsc::UnboundedReceiver<PathBuf>,
    debounce: Duration,
) {
    while let Some(first) = rx.recv().await {
        let mut changed = HashSet::from([first]);
        loop {
            match tokio::time::timeout(debounce, rx.recv()).await {
                Ok(Some(path)) => {
                    changed.insert(path);
                }
                Ok(None) => return,
                Err(_quiet) => break,
            }
        }
        let mut names: Vec<String> = changed
            .iter()
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect();
        names.sort();
        tracing::info!("profile files changed: {}", names.join(", "));
        registry.reload("file change", None, false).await;
    }
}

/// Which paths are profile changes.
struct Filter {
    dirs: Vec<PathBuf>,
    files: Vec<PathBuf>,
}

impl Filter {
    fn new(sources: &[PathBuf]) -> Self {
        let mut dirs = Vec::new();
        let mut files = Vec::new();
        for s in sources {
            let s = absolute(s);
            if s.is_dir() {
                dirs.push(s);
            } else {
                files.push(s);
            }
        }
        Self { dirs, files }
    }

    /// The directories to watch: profile directories and the parents of profile files.
    fn dirs(sources: &[PathBuf]) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        for s in sources {
            let s = absolute(s);
            let dir = if s.is_dir() {
                s
            } else {
                s.parent().map(Path::to_path_buf).unwrap_or(s)
            };
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        dirs
    }

    fn wants(&self, path: &Path) -> bool {
        if self.files.iter().any(|f| f == path) {
            return true;
        }
        let is_toml = path.extension().is_some_and(|e| e == "toml")
            && !path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'));
        is_toml
            && path
                .parent()
                .is_some_and(|p| self.dirs.iter().any(|d| d == p))
    }
}

/// `path` made absolute and canonical where it exists (event paths are canonical).
fn absolute(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => parent
            .canonicalize()
            .map(|p| p.join(name))
            .unwrap_or(abs.clone()),
        _ => abs,
    }
}

/// Reloads on every SIGHUP (Unix only).
pub fn reload_on_sighup(registry: Arc<Registry>) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangups = signal(SignalKind::hangup())?;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading profiles");
                registry.reload("SIGHUP", None, false).await;
            }
        });
    }
    #[cfg(not(unix))]
    let _ = registry;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_takes_toml_files_in_profile_dirs_and_named_files() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let named = other.path().join("solo.conf");
        std::fs::write(&named, "").unwrap();
        let sources = vec![dir.path().to_path_buf(), named.clone()];
        let f = Filter::new(&sources);
        let d = dir.path().canonicalize().unwrap();
        let o = other.path().canonicalize().unwrap();
        assert!(f.wants(&d.join("a.toml")));
        assert!(!f.wants(&d.join(".a.toml.swp")));
        assert!(!f.wants(&d.join(".a.toml")));
        assert!(!f.wants(&d.join("a.txt")));
        assert!(!f.wants(&d.join("sub/a.toml")));
        assert!(f.wants(&o.join("solo.conf")));
        assert!(!f.wants(&o.join("x.toml")));
        assert_eq!(Filter::dirs(&sources), vec![d, o]);
    }
}
