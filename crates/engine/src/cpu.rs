//! The CPU executor: the trunk layers (all of them, or a prefix of them) and optionally the
//! head, run on the host with the kernels of `specula-kernels` on the backend's rayon pool.
//!
//! cpu-simd runs a whole model through one ([`CpuExecutor::whole_model`]); cuda-hybrid runs
//! the layers it keeps on the host through one ([`CpuExecutor::new`] with a [`CpuPart`]), so
//! both compute those layers with the same arithmetic.

use std::ops::RangeInclusive;

use rayon::ThreadPool;
use specula_kernels::{matmul, ops, MatmulScratch};
use specula_plugin_api::{ErrorKind, PluginError};

use crate::arch::hybrid::{self, HybridScratch, Mixer, TrunkState};
use crate::arch::{forward_dense_layer, Scratch};
use crate::backend::{Chunk, Executor, MtpRows};
use crate::blocks::mtp;
use crate::kv_cache::{KvCache, KvType};
use crate::model::{Graph, Model};
use crate::pool::install_busy;
use crate::recurrent::SnapshotRing;

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

/// The scratch buffers of a pass, by model family.
enum CpuScratch {
    Dense(Box<Scratch>),
    Hybrid(Box<HybridScratch>),
}

/// Runs a prefix of a model's trunk, and optionally its head, on the CPU; holds the caches of
/// those layers.
pub struct CpuExecutor {
    part: CpuPart,
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
    scratch: CpuScratch,
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
        Ok(match &model.graph {
            Graph::Dense(d) => Self {
                part,
                kv: KvCache::new(layers, n_ctx, &d.config.attention, kv_type),
                ring: None,
                recurrent: false,
                mtp_kv: None,
                scratch: CpuScratch::Dense(Box::new(Scratch::new(&d.config, batch_rows, n_ctx))),
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
                let a = &config.attention;
                Self {
                    part,
                    kv: KvCache::new(layers - gdn, n_ctx, a, kv_type),
                    ring: Some(ring),
                    recurrent: config.n_gdn_layers > 0,
                    mtp_kv: (head && h.weights.mtp.is_some())
                        .then(|| KvCache::new(1, n_ctx, a, kv_type)),
                    scratch: CpuScratch::Hybrid(Box::new(HybridScratch::new(
                        config, batch_rows, n_ctx,
                    ))),
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
        match &mut self.scratch {
            CpuScratch::Dense(s) => &mut s.x,
            CpuScratch::Hybrid(s) => &mut s.x,
        }
    }

    fn matmul_scratch(&mut self) -> &mut MatmulScratch {
        match &mut self.scratch {
            CpuScratch::Dense(s) => &mut s.matmul,
            CpuScratch::Hybrid(s) => &mut s.matmul,
        }
    }

    /// Embeds the chunk's tokens into the residual rows and runs this part's trunk layers
    /// over them (on the current thread's pool).
    pub fn run_layers(&mut self, model: &Model, chunk: &Chunk<'_>) -> Result<(), PluginError> {
        let file = &model.file;
        let graph = &model.graph;
        let e = graph.n_embd();
        let embedding = graph.token_embd().view(file)?;
        for (row, &token) in self.residual().chunks_exact_mut(e).zip(chunk.tokens) {
            embedding.dequantize_row(token as usize, row);
        }
        let m = chunk.rows();
        match (graph, &mut self.scratch) {
            (Graph::Dense(dense), CpuScratch::Dense(s)) => {
                for layer in 0..self.part.layers {
                    forward_dense_layer(file, dense, layer, m, chunk.pos0, s, &mut self.kv)?;
                }
            }
            (Graph::Hybrid(h), CpuScratch::Hybrid(s)) => {
                let ring = self
                    .ring
                    .as_mut()
                    .ok_or_else(|| internal("hybrid model without a snapshot ring"))?;
                let mut trunk = TrunkState {
                    kv: &mut self.kv,
                    ring,
                };
                for layer in 0..self.part.layers {
                    hybrid::forward_layer(
                        h,
                        file,
                        layer,
                        m,
                        chunk.pos0,
                        chunk.first,
                        s,
                        &mut trunk,
                    )?;
                }
            }
            _ => return Err(internal("model family and scratch disagree")),
        }
        Ok(())
    }

    /// The head over the `m` residual rows: their final norm into `hidden`, the logits of rows
    /// `logit_from ..` into `logits` (on the current thread's pool).
    pub fn head(
        &mut self,
        model: &Model,
        m: usize,
        logit_from: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError> {
        let graph = &model.graph;
        let (e, eps) = (graph.n_embd(), graph.rms_eps());
        let output = graph.output().view(&model.file)?;
        for (x, h) in self.residual()[..m * e]
            .chunks_exact(e)
            .zip(hidden.chunks_exact_mut(e))
        {
            ops::rms_norm(x, graph.output_norm(), eps, h);
        }
        if logit_from < m {
            matmul(
                &output,
                &hidden[logit_from * e..m * e],
                logits,
                self.matmul_scratch(),
            );
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
            self.head(model, chunk.rows(), chunk.logit_from, hidden, logits)
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
        let (Graph::Hybrid(h), Some(kv), CpuScratch::Hybrid(scratch)) =
            (&model.graph, &mut self.mtp_kv, &mut self.scratch)
        else {
            return Err(internal("MTP step without an MTP head on the CPU"));
        };
        let weights = h
            .weights
            .mtp
            .as_ref()
            .ok_or_else(|| internal("MTP cache without MTP weights"))?;
        install_busy(pool, || {
            mtp::forward_chunked(
                &h.config,
                weights,
                &model.file,
                rows.hidden,
                rows.tokens,
                rows.position,
                kv,
                scratch,
                rows.batch_rows,
                logits,
                hidden_out,
            )
        })
    }
}
