//! The CPU executor: the trunk layers (all of them, or a prefix of them) and optionally the
//! head, run on the host — the architectures' graphs over [`CpuOps`], the graph operations
//! implemented with the kernels of `specula-kernels` on the backend's rayon pool.
//!
//! cpu-simd runs a whole model through one ([`CpuExecutor::whole_model`]); cuda-hybrid runs
//! the layers it keeps on the host through one ([`CpuExecutor::new`] with a [`CpuPart`]), so
//! both compute those layers with the same arithmetic.

pub mod attention;
pub mod gdn;
pub mod moe;
pub mod ops;

use std::ops::RangeInclusive;

use rayon::ThreadPool;
use specula_plugin_api::{ErrorKind, PluginError};

use crate::arch::hybrid::Mixer;
use crate::arch::{self};
use crate::backend::{Chunk, Executor, MtpRows};
use crate::graph::{Act, Dims, Rows};
use crate::kv_cache::{KvCache, KvType};
use crate::model::{Graph, Model};
use crate::pool::install_busy;
use crate::recurrent::SnapshotRing;
pub use ops::{CpuOps, Scratch};

/// Which part of a model a [`CpuExecutor`] runs, and how its caches are sized.
#[derive(Debug, Clone, Copy)]
pub struct CpuPart {
    /// Trunk layers `0 .. layers` run here.
    pub layers: usize,
    /// Whether the final norm, the LM head and the MTP head run here.
    pub head: bool,
    pub n_ctx: usize,
    /// Rows per chunk.
    pub batch_rows: usize,
    pub kv_type: KvType,
    /// Snapshots kept of the recurrent state (the rollback depth; hybrid models).
    pub ring_depth: usize,
}

/// Runs a prefix of a model's trunk, and optionally its head, on the CPU; holds the caches of
/// those layers.
pub struct CpuExecutor {
    part: CpuPart,
    dims: Dims,
    /// KV cache of the attention layers run here.
    kv: KvCache,
    /// Snapshot ring of the GDN layers run here (hybrid models; possibly of zero layers, it
    /// then only keeps the bookkeeping).
    ring: Option<SnapshotRing>,
    /// Whether the model has recurrent (GDN) layers anywhere: then truncation is limited to
    /// the ring's window.
    recurrent: bool,
    /// The MTP head's cache, when the model has the head and it runs here.
    mtp_kv: Option<KvCache>,
    scratch: Box<Scratch>,
}

fn internal(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, what.to_string())
}

impl CpuExecutor {
    /// The executor of a whole model (every layer and the head), with a ring of `ring_depth`
    /// snapshots for hybrid models.
    pub fn whole_model(
        model: &Model,
        n_ctx: usize,
        batch_rows: usize,
        kv_type: KvType,
        ring_depth: usize,
    ) -> Result<Self, PluginError> {
        Self::new(
            model,
            CpuPart {
                layers: model.graph.n_trunk_layers(),
                head: true,
                n_ctx,
                batch_rows,
                kv_type,
                ring_depth,
            },
        )
    }

    /// The executor of `part` of `model`. A ring smaller than asked (allocation failed) is
    /// reported by [`ring_depth`](Self::ring_depth).
    pub fn new(model: &Model, part: CpuPart) -> Result<Self, PluginError> {
        let CpuPart {
            layers,
            head,
            n_ctx,
            batch_rows,
            kv_type,
            ring_depth,
        } = part;
        let dims = model.graph.dims();
        let scratch = Box::new(Scratch::new(&dims, batch_rows, n_ctx));
        let a = &dims.attention;
        Ok(match &model.graph {
            Graph::Dense(_) => Self {
                part,
                kv: KvCache::new(layers, n_ctx, a, kv_type),
                ring: None,
                recurrent: false,
                mtp_kv: None,
                scratch,
                dims,
            },
            Graph::Hybrid(h) => {
                let config = &h.config;
                let here = &h.weights.layers[..layers];
                let gdn = here
                    .iter()
                    .filter(|l| matches!(l.mixer, Mixer::Gdn { .. }))
                    .count();
                let (ring, _) =
                    SnapshotRing::allocate(config.gdn.state_layout(gdn), ring_depth, None)?;
                Self {
                    part,
                    kv: KvCache::new(layers - gdn, n_ctx, a, kv_type),
                    ring: Some(ring),
                    recurrent: config.n_gdn_layers > 0,
                    mtp_kv: (head && h.weights.mtp.is_some())
                        .then(|| KvCache::new(1, n_ctx, a, kv_type)),
                    scratch,
                    dims,
                }
            }
        })
    }

    /// Snapshots the ring holds (0 for dense models): less than asked when allocating them
    /// failed.
    pub fn ring_depth(&self) -> usize {
        self.ring.as_ref().map_or(0, SnapshotRing::depth)
    }

    /// Bytes of the attention KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.n_bytes()
    }

    /// The residual rows of the last [`run_layers`](Self::run_layers), `rows × n_embd`.
    pub fn residual(&mut self) -> &mut [f32] {
        self.scratch.act_mut(Act::X)
    }

    /// The operations of one pass of `n` rows over this executor's buffers and caches, its
    /// logits going to `logits`.
    fn ops<'a>(
        &'a mut self,
        model: &'a Model,
        n: usize,
        logits: &'a mut [f32],
    ) -> Result<CpuOps<'a>, PluginError> {
        if n > self.scratch.rows() {
            return Err(internal(&format!(
                "a pass of {n} rows, but the buffers hold {}",
                self.scratch.rows()
            )));
        }
        Ok(CpuOps {
            dims: &self.dims,
            file: &model.file,
            scratch: &mut self.scratch,
            kv: &mut self.kv,
            ring: self.ring.as_mut(),
            mtp_kv: self.mtp_kv.as_mut(),
            logits,
        })
    }

    /// Embeds the chunk's tokens into the residual rows and runs this part's trunk layers
    /// over them (on the current thread's pool).
    pub fn run_layers(&mut self, model: &Model, chunk: &Chunk<'_>) -> Result<(), PluginError> {
        let e = self.dims.n_embd;
        let rows = chunk.pass_rows();
        let layers = self.part.layers;
        let mut ops = self.ops(model, rows.n, &mut [])?;
        let embedding = model.graph.token_embd().view(&model.file)?;
        for (row, &token) in ops
            .scratch
            .act_mut(Act::X)
            .chunks_exact_mut(e)
            .zip(chunk.tokens)
        {
            embedding.dequantize_row(token as usize, row);
        }
        for layer in 0..layers {
            arch::layer(model, &mut ops, layer, &rows)?;
        }
        Ok(())
    }

    /// The head over the residual rows of `rows`: their final norm into `hidden`, the logits
    /// of rows `logit_from ..` into `logits` (on the current thread's pool).
    pub fn head(
        &mut self,
        model: &Model,
        rows: &Rows,
        logit_from: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError> {
        let e = self.dims.n_embd;
        if hidden.len() != rows.n * e {
            return Err(internal("the hidden states do not fit the rows"));
        }
        let mut ops = self.ops(model, rows.n, logits)?;
        arch::head(model, &mut ops, rows, logit_from)?;
        hidden.copy_from_slice(&self.scratch.act(Act::Hidden)[..rows.n * e]);
        Ok(())
    }

    /// The MTP head over one pass of `rows` (see [`Executor::mtp`]).
    fn mtp_pass(
        &mut self,
        model: &Model,
        rows: &MtpRows<'_>,
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError> {
        let embed = &model
            .graph
            .mtp()
            .ok_or_else(|| internal("MTP step on a model without an MTP head"))?
            .embed
            .view(&model.file)?;
        let (e, m) = (self.dims.n_embd, rows.rows());
        if hidden_out.len() != m * e {
            return Err(internal("the MTP hidden states do not fit the rows"));
        }
        let kv = self
            .mtp_kv
            .as_mut()
            .ok_or_else(|| internal("MTP step without an MTP head on the CPU"))?;
        kv.set_len(rows.position);
        rows.write_inputs(embed, self.scratch.act_mut(Act::MtpIn));
        let mut ops = self.ops(model, m, logits)?;
        arch::mtp(model, &mut ops, &rows.pass_rows(), rows.logit_from)?;
        hidden_out.copy_from_slice(&self.scratch.act(Act::Hidden)[..m * e]);
        if let Some(kv) = self.mtp_kv.as_mut() {
            kv.set_len(rows.position + m);
        }
        Ok(())
    }
}

impl Executor for CpuExecutor {
    fn forward_chunk(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunk: &Chunk<'_>,
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError> {
        if !self.part.head {
            return Err(internal("forward_chunk on a CPU part without the head"));
        }
        install_busy(pool, || {
            self.run_layers(model, chunk)?;
            self.head(model, &chunk.pass_rows(), chunk.logit_from, hidden, logits)
        })
    }

    fn commit(&mut self, start: usize, n: usize) {
        self.kv.set_len(start + n);
        if let Some(ring) = &mut self.ring {
            ring.advance(n);
        }
    }

    fn rollback(&mut self, len: usize) -> Result<bool, PluginError> {
        if let Some(kv) = &mut self.mtp_kv {
            kv.set_len(kv.len().min(len));
        }
        if let Some(ring) = &mut self.ring {
            if !self.recurrent {
                // No recurrent layer: only the KV cache to cut.
                ring.reset();
                ring.advance(len);
            } else if !ring.restore(len) {
                return Ok(false);
            }
        }
        self.kv.set_len(len);
        Ok(true)
    }

    fn window(&self, seq_len: usize) -> RangeInclusive<usize> {
        match &self.ring {
            Some(ring) if self.recurrent => ring.window(),
            _ => 0..=seq_len,
        }
    }

    fn reset(&mut self) -> Result<(), PluginError> {
        if let Some(ring) = &mut self.ring {
            ring.reset();
        }
        self.kv.set_len(0);
        Ok(())
    }

    fn mtp(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        rows: &MtpRows<'_>,
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError> {
        if self.mtp_kv.is_none() {
            return Err(internal("MTP step without an MTP head on the CPU"));
        }
        install_busy(pool, || self.mtp_pass(model, rows, logits, hidden_out))
    }
}
