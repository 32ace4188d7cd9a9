//! `specula plugins`.

use std::process::ExitCode;

use specula_plugin_api::ABI_VERSION;

use super::ProfileArg;
use crate::plugins::{duplicate_names, list, SearchPath};
use crate::profile::Profile;

#[derive(Debug, clap::Args)]
pub struct PluginsArgs {
    #[command(flatten)]
    profile: ProfileArg,
}

pub fn run(args: PluginsArgs) -> anyhow::Result<ExitCode> {
    let dirs = match &args.profile.profile {
        Some(p) => Profile::load(p)?.plugin_dir,
        None => Vec::new(),
    };
    let search = SearchPath::new(&dirs);
    println!("host plugin ABI version: {ABI_VERSION}");
    println!("search path:");
    for d in search.dirs() {
        println!("  {}", d.display());
    }
    let listings = list(&search);
    let (ok, rejected): (Vec<_>, Vec<_>) = listings.iter().partition(|l| l.result.is_ok());
    if ok.is_empty() {
        println!("no plugins found");
    } else {
        println!(
            "{:<16} {:<8} {:<8} {:<4} path",
            "name", "kind", "version", "abi"
        );
        for l in &ok {
            let info = l.result.as_ref().expect("partitioned");
            let name = l.name.as_deref().unwrap_or(info.name.as_str());
            println!(
                "{:<16} {:<8} {:<8} {:<4} {}",
                name,
                info.kind.as_str(),
                info.version,
                ABI_VERSION,
                l.path.display()
            );
            if !info.description.is_empty() {
                println!("{:<16} {}", "", info.description);
            }
        }
    }
    for l in &ok {
        let info = l.result.as_ref().expect("partitioned");
        if let Some(name) = l.name.as_deref().filter(|n| *n != info.name.as_str()) {
            println!(
                "note: {} calls itself '{}'; profiles select it by its file name, as '{name}'",
                l.path.display(),
                info.name
            );
        }
    }
    for (name, kind, paths) in duplicate_names(&listings) {
        let chosen = search
            .load(&name, kind)
            .map(|p| p.path().display().to_string())
            .unwrap_or_else(|e| format!("none ({e})"));
        println!(
            "warning: {} libraries answer to the {} name '{name}' ({}); profiles naming '{name}' get {chosen}",
            paths.len(),
            kind.as_str(),
            paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if !rejected.is_empty() {
        println!("rejected:");
        for l in &rejected {
            if let Err(e) = &l.result {
                println!("  {e}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
