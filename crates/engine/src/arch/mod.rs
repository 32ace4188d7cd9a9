//! The architectures: one file per architecture holding its layer's graph, written once over
//! [`LayerOps`] and run by every executor, and the registry that maps
//! `general.architecture` to it ([`Architecture`], [`layer`], [`head`], [`mtp`]).
//!
//! The weights the graphs read are loaded per family: the dense decoder of llama, qwen2 and
//! qwen3 ([`dense`]), the Gated DeltaNet hybrid of qwen35 and qwen3next ([`hybrid`]) with its
//! NextN / MTP block ([`nextn`]). A new architecture is a file here with its `layer` function
//! (its `mtp` too if it has an MTP block) and its loading choices, plus its registration: a
//! variant of [`Architecture`] with its lines in `from_name`, `name` and `load`, [`SUPPORTED`],
//! and its lines in [`layer`] (and [`mtp`]).

pub mod dense;
pub mod hybrid;
pub mod llama;
pub mod nextn;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;
pub mod qwen3next;

use std::path::Path;

use specula_gguf::{GgufFile, HParams};
use specula_plugin_api::PluginError;

use crate::graph::{graph_error, Act, LayerOps, Rows};
use crate::model::weights::{MatrixRef, Vector};
use crate::model::{Graph, LoadError, Model};
use dense::load_dense;
use hybrid::load_hybrid;

/// Architectures whose `general.architecture` the backends accept.
pub const SUPPORTED: &str = "llama, qwen2, qwen3, qwen35, qwen3next";

/// A supported architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    /// Qwen2 / Qwen2.5: llama with q/k/v biases and NeoX RoPE.
    Qwen2,
    Qwen3,
    /// Qwen3.5 / 3.6: Gated DeltaNet hybrid, dense FFN, multi-section RoPE.
    Qwen35,
    /// Qwen3-Next: Gated DeltaNet hybrid, mixture-of-experts FFN, partial NeoX RoPE.
    Qwen3Next,
}

impl Architecture {
    /// The architecture named `name` in the file at `path`, or a clear refusal.
    pub fn from_name(name: &str, path: &Path) -> Result<Self, LoadError> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "qwen35" => Ok(Architecture::Qwen35),
            "qwen3next" => Ok(Architecture::Qwen3Next),
            other => Err(LoadError::UnknownArchitecture {
                path: path.display().to_string(),
                arch: other.to_string(),
                supported: SUPPORTED,
            }),
        }
    }

    /// The `general.architecture` name.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen35 => "qwen35",
            Architecture::Qwen3Next => "qwen3next",
        }
    }

    /// Loads the architecture's weights and block configuration.
    pub fn load(self, file: &GgufFile, hp: &HParams) -> Result<Graph, LoadError> {
        let dense = |model| Graph::Dense(Box::new(model));
        match self {
            Architecture::Llama => load_dense(file, hp, llama::VARIANT).map(dense),
            Architecture::Qwen2 => load_dense(file, hp, qwen2::VARIANT).map(dense),
            Architecture::Qwen3 => load_dense(file, hp, qwen3::VARIANT).map(dense),
            Architecture::Qwen35 => {
                load_hybrid(file, hp, qwen35::VARIANT).map(|m| Graph::Hybrid(Box::new(m)))
            }
            Architecture::Qwen3Next => {
                load_hybrid(file, hp, qwen3next::VARIANT).map(|m| Graph::Hybrid(Box::new(m)))
            }
        }
    }
}

/// Runs trunk layer `i` of `model` over `rows` with `ops`: the architecture's graph.
pub fn layer<O: LayerOps>(
    model: &Model,
    ops: &mut O,
    i: usize,
    rows: &Rows,
) -> Result<(), PluginError> {
    match (model.arch, &model.graph) {
        (Architecture::Llama, Graph::Dense(m)) => llama::layer(ops, &m.weights.layers[i], rows),
        (Architecture::Qwen2, Graph::Dense(m)) => qwen2::layer(ops, &m.weights.layers[i], rows),
        (Architecture::Qwen3, Graph::Dense(m)) => qwen3::layer(ops, &m.weights.layers[i], rows),
        (Architecture::Qwen35, Graph::Hybrid(m)) => qwen35::layer(ops, &m.weights.layers[i], rows),
        (Architecture::Qwen3Next, Graph::Hybrid(m)) => {
            qwen3next::layer(ops, &m.weights.layers[i], rows)
        }
        _ => Err(graph_error("the architecture and its weights disagree")),
    }
}

/// The head of `model` over the residual rows in [`Act::X`]: the final norm into
/// [`Act::Hidden`], and the logits of the rows that get them ([`Span::logit_from`]) into the
/// pass's logits.
///
/// [`Span::logit_from`]: crate::graph::Span::logit_from
pub fn head(model: &Model, ops: &mut impl LayerOps, rows: &Rows) -> Result<(), PluginError> {
    let graph = &model.graph;
    output_head(ops, graph.output_norm(), graph.output(), rows)
}

/// The MTP head of `model` over the rows whose inputs `[embedding | trunk hidden]` are in
/// [`Act::MtpIn`] (see [`nextn::forward`]).
pub fn mtp<O: LayerOps>(model: &Model, ops: &mut O, rows: &Rows) -> Result<(), PluginError> {
    let w = model
        .graph
        .mtp()
        .ok_or_else(|| graph_error("an MTP step on a model without an MTP head"))?;
    match model.arch {
        Architecture::Qwen35 => qwen35::mtp(ops, w, rows),
        Architecture::Qwen3Next => qwen3next::mtp(ops, w, rows),
        _ => Err(graph_error("the architecture and its weights disagree")),
    }
}

/// The final norm of the residual rows ([`Act::X`]) into [`Act::Hidden`], and the LM head's
/// logits of the rows that get them: the end of every architecture's graph.
pub fn output_head(
    ops: &mut impl LayerOps,
    norm: &Vector,
    output: &MatrixRef,
    rows: &Rows,
) -> Result<(), PluginError> {
    ops.rms_norm(Act::X.into(), norm, Act::Hidden.into(), rows)?;
    ops.logits(output, Act::Hidden, rows)
}
