//! The Specula host: everything between the user and the plugins.
//!
//! * [`profile`]: TOML profiles, validated with key paths in every error;
//! * [`plugins`]: discovery and loading of backend and drafter plugins through the stable ABI;
//! * [`tokenizer`]: SentencePiece and byte-level BPE tokenizers read from GGUF metadata;
//! * [`sampling`]: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds;
//! * [`generate`]: the decode loop behind `specula run`;
//! * [`genmodel`]: writing GGUF models of given shapes (`specula gen-model`, the default model);
//! * [`cli`]: the `specula` command line.

pub mod cli;
pub mod generate;
pub mod genmodel;
pub mod plugins;
pub mod profile;
pub mod sampling;
pub mod tokenizer;
