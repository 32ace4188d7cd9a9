//! `specula profile check`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use crate::check::check_profile;

#[derive(Debug, Subcommand)]
pub enum ProfileCommand {
    /// Find the problems of profiles without loading weights: keys and values, plugins, model
    /// headers, backend options, what the drafter needs; exit status 1 if any. A file that does
    /// not parse (bad TOML, an unknown key, a value of the wrong type) shows its first error.
    Check {
        /// The profile files.
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
    },
}

pub fn run(cmd: ProfileCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ProfileCommand::Check { files } => {
            let mut status = ExitCode::SUCCESS;
            for file in &files {
                let report = check_profile(file);
                if report.problems.is_empty() {
                    println!("{}: ok", file.display());
                    for (what, value) in &report.facts {
                        println!("  {what}: {value}");
                    }
                } else {
                    let n = report.problems.len();
                    eprintln!(
                        "{}: {n} problem{}",
                        file.display(),
                        if n == 1 { "" } else { "s" }
                    );
                    for problem in &report.problems {
                        eprintln!("  - {problem}");
                    }
                    status = ExitCode::FAILURE;
                }
            }
            Ok(status)
        }
    }
}
