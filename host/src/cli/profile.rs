//! `specula profile check`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use crate::profile::Profile;

#[derive(Debug, Subcommand)]
pub enum ProfileCommand {
    /// Validate a profile without loading models or plugins.
    Check {
        /// The profile file.
        file: PathBuf,
    },
}

pub fn run(cmd: ProfileCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ProfileCommand::Check { file } => {
            let profile = Profile::load(&file)?;
            println!("{}: ok", file.display());
            println!("  backend: {}", profile.target.backend);
            println!("  model:   {}", profile.target.model.display());
            if !profile.target.model.is_file() {
                println!("  warning: the model file does not exist (yet)");
            }
            match &profile.drafter {
                Some(d) => println!("  drafter: {}", d.plugin),
                None => println!("  drafter: none (plain decoding)"),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
