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
use crate::blocks::attention::AttentionShape;
use crate::graph::{Act, Dims, Rows};
use crate::kv_cache::{KvCache, KvType};
use crate::model::{Graph, Model};
use crate::pool::install_busy;
use crate::recurrent::{SnapshotRing, StateLayout};
pub use ops::{CpuOps, Scratch, SeqCaches};

/// Which part of a model a [`CpuExecutor`] runs, and how its caches are sized.
#[derive(Debug, Clone, Copy)]
pub struct CpuPart {
    /// Trunk layers `0 .. layers` run here.
    pub layers: usize,
    /// Whether the final norm, the LM head and the MTP head run here.
    pub head: bool,
    pub n_ctx: usize,
    /// Rows per pass.
    pub batch_rows: usize,
    pub kv_type: KvType,
    /// Snapshots kept of the recurrent state (the rollback depth; hybrid models).
    pub ring_depth: usize,
    /// Sequence slots.
    pub max_sequences: usize,
}

/// What one sequence's caches on the CPU look like.
#[derive(Debug, Clone, Copy)]
struct CacheShape {
    /// Attention layers run here.
    kv_layers: usize,
    attention: AttentionShape,
    n_ctx: usize,
    kv_type: KvType,
    /// The recurrent state of the GDN layers run here (hybrid models; possibly of zero
    /// layers, the ring then only keeps the bookkeeping).
    ring: Option<StateLayout>,
    /// Whether the MTP head (and so its cache) runs here.
    mtp: bool,
}

/// Runs a prefix of a model's trunk, and optionally its head, on the CPU; holds the caches of
/// those layers for every sequence.
pub struct CpuExecutor {
    part: CpuPart,
    dims: Dims,
    shape: CacheShape,
    /// Per sequence slot: its caches, while the slot holds a sequence.
    seqs: Vec<Option<SeqCaches>>,
    /// Snapshots each sequence's ring holds (0 for dense models).
    ring_depth: usize,
    /// Whether the model has recurrent (GDN) layers anywhere: then truncation is limited to
    /// the ring's window.
    recurrent: bool,
    scratch: Box<Scratch>,
}

fn internal(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, what.to_string())
}

impl CpuExecutor {
    /// The executor of a whole model (every layer and the head), with a ring of `ring_depth`
    /// snapshots per sequence for hybrid models.
    pub fn whole_model(
        model: &Model,
        n_ctx: usize,
        batch_rows: usize,
        kv_type: KvType,
        ring_depth: usize,
        max_sequences: usize,
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
                max_sequences,
            },
        )
    }

    /// The executor of `part` of `model`, with no sequence yet. A ring smaller than asked
    /// (allocating a first one failed) is reported by [`ring_depth`](Self::ring_depth).
    pub fn new(model: &Model, part: CpuPart) -> Result<Self, PluginError> {
        let dims = model.graph.dims();
        let (kv_layers, ring, mtp) = match &model.graph {
            Graph::Dense(_) => (part.layers, None, false),
            Graph::Hybrid(h) => {
                let gdn = h.weights.layers[..part.layers]
                    .iter()
                    .filter(|l| matches!(l.mixer, Mixer::Gdn { .. }))
                    .count();
                let layout = h.config.gdn.state_layout(gdn);
                (
                    part.layers - gdn,
                    Some(layout),
                    part.head && h.weights.mtp.is_some(),
                )
            }
        };
        let ring_depth = match ring {
            Some(layout) => {
                SnapshotRing::allocate(layout, part.ring_depth, None)?
                    .1
                    .depth
            }
            None => 0,
        };
        Ok(Self {
            shape: CacheShape {
                kv_layers,
                attention: dims.attention,
                n_ctx: part.n_ctx,
                kv_type: part.kv_type,
                ring,
                mtp,
            },
            scratch: Box::new(Scratch::new(&dims, part.batch_rows)),
            seqs: (0..part.max_sequences.max(1)).map(|_| None).collect(),
            ring_depth,
            recurrent: matches!(&model.graph, Graph::Hybrid(h) if h.config.n_gdn_layers > 0),
            part,
            dims,
        })
    }

    /// Empty caches for one sequence.
    fn new_caches(&self) -> Result<SeqCaches, PluginError> {
        let shape = &self.shape;
        let ring = match shape.ring {
            Some(layout) => {
                let (ring, size) = SnapshotRing::allocate(layout, self.ring_depth, None)?;
                if size.depth < self.ring_depth {
                    return Err(PluginError::new(
                        ErrorKind::OutOfMemory,
                        format!(
                            "cannot allocate {} snapshots of the recurrent state for another sequence",
                            self.ring_depth
                        ),
                    ));
                }
                Some(ring)
            }
            None => None,
        };
        let kv = |layers| KvCache::new(layers, shape.n_ctx, &shape.attention, shape.kv_type);
        Ok(SeqCaches {
            kv: kv(shape.kv_layers),
            ring,
            mtp_kv: shape.mtp.then(|| kv(1)),
        })
    }

    /// Snapshots each sequence's ring holds (0 for dense models): less than asked when
    /// allocating them failed.
    pub fn ring_depth(&self) -> usize {
        self.ring_depth
    }

    /// Bytes of one sequence's attention KV cache.
    pub fn kv_bytes(&self) -> usize {
        let a = &self.shape.attention;
        let value = match self.shape.kv_type {
            KvType::F32 => 4,
            KvType::F16 => 2,
        };
        value * self.shape.n_ctx * (a.k_width() + a.v_width()) * self.shape.kv_layers
    }

    /// The residual rows of the last [`run_layers`](Self::run_layers), `rows × n_embd`.
    pub fn residual(&mut self) -> &mut [f32] {
        self.scratch.act_mut(Act::X)
    }

    /// The caches of slot `seq`.
    fn seq(&mut self, seq: usize) -> Result<&mut SeqCaches, PluginError> {
        self.seqs
            .get_mut(seq)
            .and_then(Option::as_mut)
            .ok_or_else(|| internal(&format!("sequence slot {seq} holds no sequence")))
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
            seqs: &mut self.seqs,
            logits,
        })
    }

    /// Embeds the chunks' tokens into the residual rows and runs this part's trunk layers
    /// over them (on the current thread's pool).
    pub fn run_layers(&mut self, model: &Model, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
        let e = self.dims.n_embd;
        let spans = Chunk::spans(chunks);
        let rows = Rows::new(&spans);
        let layers = self.part.layers;
        let mut ops = self.ops(model, rows.n, &mut [])?;
        let embedding = model.graph.token_embd().view(&model.file)?;
        let tokens = chunks.iter().flat_map(|c| c.tokens);
        for (row, &token) in ops.scratch.act_mut(Act::X).chunks_exact_mut(e).zip(tokens) {
            embedding.dequantize_row(token as usize, row);
        }
        for layer in 0..layers {
            arch::layer(model, &mut ops, layer, &rows)?;
        }
        Ok(())
    }

    /// The head over the residual rows of `rows`: their final norm into `hidden`, the logits
    /// of the rows that get them into `logits` (on the current thread's pool).
    pub fn head(
        &mut self,
        model: &Model,
        rows: &Rows,
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError> {
        let e = self.dims.n_embd;
        if hidden.len() != rows.n * e {
            return Err(internal("the hidden states do not fit the rows"));
        }
        let mut ops = self.ops(model, rows.n, logits)?;
        arch::head(model, &mut ops, rows)?;
        hidden.copy_from_slice(&self.scratch.act(Act::Hidden)[..rows.n * e]);
        Ok(())
    }

    /// The MTP head over one pass of `chunks` (see [`Executor::mtp`]).
    fn mtp_pass(
        &mut self,
        model: &Model,
        chunks: &[MtpRows<'_>],
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError> {
        let embed = &model
            .graph
            .mtp()
            .ok_or_else(|| internal("MTP step on a model without an MTP head"))?
            .embed
            .view(&model.file)?;
        let spans = MtpRows::spans(chunks);
        let rows = Rows::new(&spans);
        let (e, m) = (self.dims.n_embd, rows.n);
        if hidden_out.len() != m * e {
            return Err(internal("the MTP hidden states do not fit the rows"));
        }
        for chunk in chunks {
            let kv = self
                .seq(chunk.seq)?
                .mtp_kv
                .as_mut()
                .ok_or_else(|| internal("MTP step without an MTP head on the CPU"))?;
            kv.set_len(chunk.position);
        }
        MtpRows::write_all_inputs(chunks, embed, self.scratch.act_mut(Act::MtpIn));
        let mut ops = self.ops(model, m, logits)?;
        arch::mtp(model, &mut ops, &rows)?;
        hidden_out.copy_from_slice(&self.scratch.act(Act::Hidden)[..m * e]);
        for chunk in chunks {
            if let Some(kv) = self.seq(chunk.seq)?.mtp_kv.as_mut() {
                kv.set_len(chunk.position + chunk.rows());
            }
        }
        Ok(())
    }
}

impl Executor for CpuExecutor {
    fn add_sequence(&mut self, seq: usize) -> Result<(), PluginError> {
        let caches = self.new_caches()?;
        let slot = self
            .seqs
            .get_mut(seq)
            .ok_or_else(|| internal(&format!("no sequence slot {seq}")))?;
        *slot = Some(caches);
        Ok(())
    }

    fn fork_sequence(&mut self, from: usize, to: usize, len: usize) -> Result<(), PluginError> {
        let mut caches = self.new_caches()?;
        let parent = self.seq(from)?;
        caches.kv.copy_prefix_from(&parent.kv, len);
        if let (Some(ring), Some(parent)) = (&mut caches.ring, &parent.ring) {
            ring.copy_from(parent);
        }
        if let (Some(kv), Some(parent)) = (&mut caches.mtp_kv, &parent.mtp_kv) {
            kv.copy_prefix_from(parent, parent.len());
        }
        let slot = self
            .seqs
            .get_mut(to)
            .ok_or_else(|| internal(&format!("no sequence slot {to}")))?;
        *slot = Some(caches);
        Ok(())
    }

    fn remove_sequence(&mut self, seq: usize) {
        if let Some(slot) = self.seqs.get_mut(seq) {
            *slot = None;
        }
    }

    fn forward(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunks: &[Chunk<'_>],
        hidden: &mut [f32],
        logits: &mut [f32],
    ) -> Result<(), PluginError> {
        if !self.part.head {
            return Err(internal("forward on a CPU part without the head"));
        }
        install_busy(pool, || {
            self.run_layers(model, chunks)?;
            let spans = Chunk::spans(chunks);
            self.head(model, &Rows::new(&spans), hidden, logits)
        })
    }

    fn commit(&mut self, seq: usize, start: usize, n: usize) {
        if let Ok(caches) = self.seq(seq) {
            caches.kv.set_len(start + n);
            if let Some(ring) = &mut caches.ring {
                ring.advance(n);
            }
        }
    }

    fn rollback(&mut self, seq: usize, len: usize) -> Result<bool, PluginError> {
        let recurrent = self.recurrent;
        let caches = self.seq(seq)?;
        if let Some(kv) = &mut caches.mtp_kv {
            kv.set_len(kv.len().min(len));
        }
        if let Some(ring) = &mut caches.ring {
            if !recurrent {
                // No recurrent layer: only the KV cache to cut.
                ring.reset();
                ring.advance(len);
            } else if !ring.restore(len) {
                return Ok(false);
            }
        }
        caches.kv.set_len(len);
        Ok(true)
    }

    fn window(&self, seq: usize, seq_len: usize) -> RangeInclusive<usize> {
        match self.seqs.get(seq).and_then(Option::as_ref) {
            Some(SeqCaches {
                ring: Some(ring), ..
            }) if self.recurrent => ring.window(),
            _ => 0..=seq_len,
        }
    }

    fn reset(&mut self, seq: usize) -> Result<(), PluginError> {
        let caches = self.seq(seq)?;
        if let Some(ring) = &mut caches.ring {
            ring.reset();
        }
        caches.kv.set_len(0);
        Ok(())
    }

    fn mtp(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        chunks: &[MtpRows<'_>],
        logits: &mut [f32],
        hidden_out: &mut [f32],
    ) -> Result<(), PluginError> {
        if !self.shape.mtp {
            return Err(internal("MTP step without an MTP head on the CPU"));
        }
        install_busy(pool, || self.mtp_pass(model, chunks, logits, hidden_out))
    }
}
