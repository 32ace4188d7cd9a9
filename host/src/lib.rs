//! The Specula host: everything between the user and the plugins.
//!
//! * [`profile`]: TOML profiles, validated with key paths in every error;
//! * [`check`]: `specula profile check`, a profile's problems found without loading weights;
//! * [`plugins`]: discovery and loading of backend and drafter plugins through the stable ABI;
//! * [`sampling`]: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds;
//! * [`pipeline`]: opening what a profile names (target, tokenizer, drafter, draft model);
//! * [`request`]: generation requests, outcomes, stop strings;
//! * [`spec`]: the folded k-token speculative loop (plain decoding is its zero-draft case);
//! * [`scheduler`]: the engine loop batching every running request into one pass
//!   (continuous batching with speculation);
//! * [`genmodel`]: writing GGUF models of given shapes (`specula gen-model`);
//! * [`builtin`]: the built-in default model and profile of `specula run`;
//! * [`chat_template`]: rendering conversations with a model's GGUF chat template;
//! * [`bench`](mod@bench): `specula bench`, speed figures measured side by side;
//! * [`serve`]: `specula serve`, the OpenAI-compatible daemon with hot-reloaded profiles;
//! * [`cli`]: the `specula` command line;
//! * [`bounded`]: reading user-named files with a size cap;
//! * [`wording`]: serde's type names in a user's words.

pub mod bench;
pub mod bounded;
pub mod builtin;
pub mod chat_template;
pub mod check;
pub mod cli;
pub mod genmodel;
pub mod pipeline;
pub mod plugins;
pub mod profile;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod serve;
pub mod spec;
pub mod wording;
