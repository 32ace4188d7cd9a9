//! `specula profile check`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use crate::check::check_profile;

#[derive(Debug, Subcommand)]
pub enum ProfileCommand {
    /// Find every problem of a profile without loading weights: keys and values, plugins,
    /// model headers, backend options, what the drafter needs; exit status 1 if any.
    Check {
        /// The profile file.
        file: PathBuf,
    },
}

pub fn run(cmd: ProfileCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ProfileCommand::Check { file } => {
            let report = check_profile(&file);
            if report.problems.is_empty() {
                println!("{}: ok", file.display());
                for (what, value) in &report.facts {
                    println!("  {what}: {value}");
                }
                Ok(ExitCode::SUCCESS)
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
                Ok(ExitCode::FAILURE)
            }
        }
    }
}
