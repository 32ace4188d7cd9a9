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
use std::sync::Arc;

use rayon::ThreadPool;
use specula_plugin_api::{ErrorKind, KvUsage, PluginError};

use crate::arch::hybrid::Mixer;
use crate::arch::{self};
use crate::backend::{Chunk, Executor, KeptPath, MtpRows};
use crate::graph::{Act, Dims, Rows};
use crate::kv_cache::BLOCK_TOKENS;
use crate::kv_cache::{KvPool, KvType, SeqKv};
use crate::model::{Graph, Model};
use crate::pool::install_busy;
use crate::recurrent::{SnapshotRing, StateLayout, StatePlane};
use crate::state_cache::{BoundaryState, HiddenRows, StateCache};
pub use ops::{CpuOps, Scratch, SeqCaches};

/// Which part of a model a [`CpuExecutor`] runs, and how its caches are sized.
#[derive(Debug, Clone, Copy)]
pub struct CpuPart {
    /// Trunk layers `0 .. layers` run here.
    pub layers: usize,
    /// Whether the final norm, the LM head and the MTP head run here.
    pub head: bool,
    /// Rows per pass.
    pub batch_rows: usize,
    pub kv_type: KvType,
    /// Positions the attention pool holds over all sequences (rounded up to whole blocks).
    pub kv_tokens: usize,
    /// Snapshots kept of the recurrent state (the rollback depth; hybrid models).
    pub ring_depth: usize,
    /// Sequence slots.
    pub max_sequences: usize,
    /// Whether full attention blocks go into a prefix cache (where a caller can reuse them).
    pub prefix_cache: bool,
    /// The most bytes of recurrent states (at block boundaries) the prefix cache keeps for
    /// a hybrid model; 0 keeps none, and hybrids then reuse no prefix.
    pub prefix_state_bytes: u64,
}

/// What one sequence's recurrent state on the CPU looks like.
#[derive(Debug, Clone, Copy)]
struct CacheShape {
    /// The recurrent state of the GDN layers run here (hybrid models; possibly of zero
    /// layers, the ring then only keeps the bookkeeping).
    ring: Option<StateLayout>,
    /// Whether the MTP head (and so its cache) runs here.
    mtp: bool,
}

/// Runs a prefix of a model's trunk, and optionally its head, on the CPU; holds the caches of
/// those layers for every sequence: one pool of attention blocks (and one for the MTP head)
/// shared by the sequences' block tables, and a snapshot ring per sequence.
pub struct CpuExecutor {
    part: CpuPart,
    dims: Dims,
    shape: CacheShape,
    /// The attention layers run here, for every sequence.
    pool: KvPool,
    /// The MTP head's attention, for every sequence.
    mtp_pool: Option<KvPool>,
    /// Per sequence slot: its caches, while the slot holds a sequence.
    seqs: Vec<Option<SeqCaches>>,
    /// Snapshots each sequence's ring holds (0 for dense models).
    ring_depth: usize,
    /// Whether the model has recurrent (GDN) layers anywhere: then truncation is limited to
    /// the ring's window, and a prompt is served from the prefix cache only as far as a
    /// recurrent state at a block boundary is cached with it ([`StateCache`]).
    recurrent: bool,
    /// The recurrent states at block boundaries of the prefix cache (hybrid models whose
    /// recurrent layers all run here, with a prefix cache and a state budget).
    states: Option<StateCache>,
    scratch: Box<Scratch>,
}

/// Moves the state `caches` captured at a block boundary of its first `len` positions into
/// `states`, under that block's key; the sequence gets a plane back for its next capture.
fn keep_boundary_state(states: &mut StateCache, caches: &mut SeqCaches, len: usize) {
    let Some(at) = caches.boundary.as_ref().and_then(StatePlane::state_len) else {
        return;
    };
    let key = match at <= len {
        true => caches.kv.key(at / BLOCK_TOKENS - 1),
        false => None,
    };
    // The head's cache is rebuilt from the trunk's hidden rows of the prefix.
    let hidden = match &caches.hidden {
        Some(rows) if rows.len() >= at => Some(rows.full_blocks(at / BLOCK_TOKENS)),
        Some(_) => None,
        None => Some(Vec::new()),
    };
    if let (Some(key), Some(hidden), Some(plane)) = (key, hidden, caches.boundary.take()) {
        let layout = *plane.layout();
        let mut next = states
            .insert(key, BoundaryState { plane, hidden })
            .or_else(|| StatePlane::new(layout));
        if let Some(plane) = &mut next {
            plane.clear();
        }
        caches.boundary = next;
    }
}

fn internal(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, what.to_string())
}

/// The caches of sequence slot `seq`, or the error saying it holds none.
fn slot_mut(seqs: &mut [Option<SeqCaches>], seq: usize) -> Result<&mut SeqCaches, PluginError> {
    seqs.get_mut(seq)
        .and_then(Option::as_mut)
        .ok_or_else(|| internal(&format!("sequence slot {seq} holds no sequence")))
}

impl CpuExecutor {
    /// The executor of a whole model (every layer and the head).
    pub fn whole_model(model: &Model, part: CpuPart) -> Result<Self, PluginError> {
        Self::new(
            model,
            CpuPart {
                layers: model.graph.n_trunk_layers(),
                head: true,
                ..part
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
        let recurrent = matches!(&model.graph, Graph::Hybrid(h) if h.config.n_gdn_layers > 0);
        // A prefix of a hybrid is served only with its recurrent state, and with the MTP
        // head's cache where the model has one: when every recurrent layer and the head run
        // here.
        let all_here = match &model.graph {
            Graph::Hybrid(h) => {
                ring.map_or(0, |r| r.n_layers) == h.config.n_gdn_layers
                    && (mtp || h.weights.mtp.is_none())
            }
            Graph::Dense(_) => true,
        };
        let states = (part.prefix_cache
            && recurrent
            && all_here
            && ring.is_some_and(|r| r.plane_bytes() <= part.prefix_state_bytes))
        .then(|| StateCache::new(part.prefix_state_bytes));
        let n_blocks = KvPool::blocks_for(part.kv_tokens.max(1));
        let a = &dims.attention;
        Ok(Self {
            shape: CacheShape { ring, mtp },
            pool: KvPool::new(
                kv_layers,
                n_blocks,
                a,
                part.kv_type,
                part.prefix_cache && (!recurrent || states.is_some()),
            )?,
            mtp_pool: match mtp {
                true => Some(KvPool::new(1, n_blocks, a, part.kv_type, false)?),
                false => None,
            },
            scratch: Box::new(Scratch::new(&dims, part.batch_rows)),
            seqs: (0..part.max_sequences.max(1)).map(|_| None).collect(),
            ring_depth,
            recurrent,
            states,
            part,
            dims,
        })
    }

    /// Empty caches for one sequence.
    fn new_caches(&self) -> Result<SeqCaches, PluginError> {
        let ring = match self.shape.ring {
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
        Ok(SeqCaches {
            kv: SeqKv::default(),
            ring,
            mtp_kv: self.shape.mtp.then(SeqKv::default),
            boundary: None,
            hidden: None,
        })
    }

    /// Snapshots each sequence's ring holds (0 for dense models): less than asked when
    /// allocating them failed.
    pub fn ring_depth(&self) -> usize {
        self.ring_depth
    }

    /// Positions the attention pool holds over all sequences.
    pub fn kv_capacity(&self) -> usize {
        self.pool.capacity()
    }

    /// Bytes of the attention pool.
    pub fn kv_bytes(&self) -> usize {
        self.pool.n_bytes()
    }

    /// Blocks of the attention pool (of [`BLOCK_TOKENS`] positions each).
    pub fn kv_blocks(&self) -> usize {
        self.pool.n_blocks()
    }

    /// Positions sequence slot `seq`'s attention cache holds (evaluated, committed or not).
    pub fn positions(&self, seq: usize) -> Option<usize> {
        Some(self.seqs.get(seq)?.as_ref()?.kv.len())
    }

    /// Sequence slot `seq`'s block table in the attention pool (`None` without a sequence).
    /// The pool keeps its block bookkeeping even when no attention layer runs here, so a
    /// device that runs the others can store them in the same blocks.
    pub fn block_table(&self, seq: usize) -> Option<&[u32]> {
        Some(self.seqs.get(seq)?.as_ref()?.kv.block_ids())
    }

    /// The copy-on-write block copies the attention pool made since the last call
    /// ([`KvPool::take_copies`]; after [`mirror_blocks`](Self::mirror_blocks)): a store
    /// mirroring the pool makes them too.
    pub fn take_block_copies(&mut self) -> Vec<(u32, u32)> {
        self.pool.take_copies()
    }

    /// Puts back copies [`take_block_copies`](Self::take_block_copies) gave that the mirror
    /// could not make (they come first next time).
    pub fn return_block_copies(&mut self, copies: Vec<(u32, u32)>) {
        self.pool.return_copies(copies);
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
            pool: &mut self.pool,
            mtp_pool: self.mtp_pool.as_mut(),
            seqs: &mut self.seqs,
            logits,
        })
    }

    /// Gives every chunk's sequence the attention blocks its rows are written to; on failure
    /// (the pool is full) releases what it gave and changes no sequence.
    pub fn reserve(&mut self, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
        let Self { pool, seqs, .. } = self;
        let mut result = Ok(());
        for chunk in chunks {
            let caches = slot_mut(seqs, chunk.seq)?;
            result = pool.reserve(&mut caches.kv, chunk.pos0, chunk.pos0 + chunk.rows());
            if result.is_err() {
                break;
            }
        }
        if result.is_err() {
            for chunk in chunks {
                if let Some(caches) = seqs.get_mut(chunk.seq).and_then(Option::as_mut) {
                    let len = caches.kv.len();
                    pool.truncate(&mut caches.kv, len);
                }
            }
        }
        result
    }

    /// Embeds the chunks' tokens into the residual rows and runs this part's trunk layers
    /// over them (on the current thread's pool).
    pub fn run_layers(&mut self, model: &Model, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
        self.reserve(chunks)?;
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
        // Sequences whose prefixes the cache keeps for the MTP head keep their hidden rows.
        for (first, span) in rows.with_offsets() {
            if let Some(caches) = self.seqs.get_mut(span.seq).and_then(Option::as_mut) {
                if let Some(history) = &mut caches.hidden {
                    if !history.write(span.pos0, &hidden[first * e..(first + span.n) * e]) {
                        caches.hidden = None;
                        caches.boundary = None;
                    }
                }
            }
        }
        Ok(())
    }

    /// Starts an evaluation of `chunks` (before [`reserve`](Self::reserve)): what an earlier
    /// one captured at a block boundary and did not keep is stale.
    pub fn begin_evaluation(&mut self, chunks: &[Chunk<'_>]) {
        for chunk in chunks {
            if let Some(plane) = self
                .seqs
                .get_mut(chunk.seq)
                .and_then(Option::as_mut)
                .and_then(|c| c.boundary.as_mut())
            {
                plane.clear();
            }
        }
    }

    /// Makes the attention pool log its copy-on-write copies for a store that mirrors its
    /// blocks ([`take_block_copies`](Self::take_block_copies)).
    pub fn mirror_blocks(&mut self) {
        self.pool.log_copies();
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
        // Each head cache is cut to its chunk's position, then given blocks for the rows.
        let no_head = || internal("MTP step without an MTP head on the CPU");
        let Self { mtp_pool, seqs, .. } = self;
        let pool = mtp_pool.as_mut().ok_or_else(no_head)?;
        for chunk in chunks {
            let kv = seqs
                .get_mut(chunk.seq)
                .and_then(Option::as_mut)
                .and_then(|c| c.mtp_kv.as_mut())
                .ok_or_else(no_head)?;
            pool.truncate(kv, chunk.position);
            pool.reserve(kv, chunk.position, chunk.position + chunk.rows())?;
        }
        MtpRows::write_all_inputs(chunks, embed, self.scratch.act_mut(Act::MtpIn));
        let mut ops = self.ops(model, m, logits)?;
        arch::mtp(model, &mut ops, &rows)?;
        hidden_out.copy_from_slice(&self.scratch.act(Act::Hidden)[..m * e]);
        let Self { mtp_pool, seqs, .. } = self;
        let pool = mtp_pool.as_mut().ok_or_else(no_head)?;
        for chunk in chunks {
            if let Some(kv) = seqs
                .get_mut(chunk.seq)
                .and_then(Option::as_mut)
                .and_then(|c| c.mtp_kv.as_mut())
            {
                pool.set_len(kv, chunk.position + chunk.rows());
            }
        }
        Ok(())
    }
}

impl CpuExecutor {
    /// [`Executor::reuse_prefix`] of a hybrid: gives the empty sequence `seq` the longest run
    /// of cached blocks starting `tokens` (at most `limit` positions) that ends at a cached
    /// recurrent state, and makes that state live. Returns the positions it now holds and the
    /// trunk's hidden rows before them (for the MTP head), or `None` when nothing is reused.
    fn reuse_recurrent_prefix(
        &mut self,
        seq: usize,
        tokens: &[u32],
        limit: usize,
    ) -> Option<(usize, Vec<Arc<Vec<f32>>>)> {
        let Self {
            pool,
            seqs,
            states,
            shape,
            dims,
            ..
        } = self;
        let caches = seqs.get_mut(seq)?.as_mut()?;
        let (states, layout, ring) = (states.as_mut()?, shape.ring?, caches.ring.as_mut()?);
        // A sequence a caller builds from the prefix cache leaves its own boundary states
        // there too (its continuations are what later prompts repeat).
        if caches.boundary.is_none() {
            caches.boundary = StatePlane::new(layout);
            caches.hidden = shape.mtp.then(|| HiddenRows::new(dims.n_embd));
        }
        let found = pool.reuse_prefix(&mut caches.kv, tokens, limit) / BLOCK_TOKENS;
        let blocks = (1..=found).rev().find(|&b| {
            caches
                .kv
                .key(b - 1)
                .is_some_and(|key| states.contains(key, b * BLOCK_TOKENS))
        });
        let loaded = blocks.and_then(|b| {
            pool.truncate(&mut caches.kv, b * BLOCK_TOKENS);
            let state = states.get(caches.kv.key(b - 1)?, b * BLOCK_TOKENS)?;
            let len = ring.load(&state.plane)?;
            Some((len, state.hidden.clone()))
        });
        match loaded {
            Some((len, hidden)) => {
                if let Some(rows) = &mut caches.hidden {
                    *rows = HiddenRows::from_blocks(dims.n_embd, hidden.clone());
                }
                Some((len, hidden))
            }
            None => {
                pool.release(&mut caches.kv);
                None
            }
        }
    }

    /// Fills sequence `seq`'s MTP-head cache for the positions of `hidden` (the trunk's
    /// hidden rows of a reused prefix, whole blocks): the head's rows over them with the
    /// tokens that follow each, as a drafter would have stepped it (no logits).
    fn rebuild_mtp_cache(
        &mut self,
        model: &Model,
        seq: usize,
        tokens: &[u32],
        hidden: &[Arc<Vec<f32>>],
    ) -> Result<(), PluginError> {
        let e = self.dims.n_embd;
        let mut out = vec![0.0; BLOCK_TOKENS * e];
        for (b, rows) in hidden.iter().enumerate() {
            let position = b * BLOCK_TOKENS;
            let chunk = MtpRows {
                seq,
                hidden: rows,
                tokens: &tokens[position + 1..=position + BLOCK_TOKENS],
                position,
                logit_from: BLOCK_TOKENS,
            };
            self.mtp_pass(model, &[chunk], &mut [], &mut out)?;
        }
        Ok(())
    }
}

impl Executor for CpuExecutor {
    fn add_sequence(&mut self, seq: usize) -> Result<(), PluginError> {
        let caches = self.new_caches()?;
        self.remove_sequence(seq);
        let slot = self
            .seqs
            .get_mut(seq)
            .ok_or_else(|| internal(&format!("no sequence slot {seq}")))?;
        *slot = Some(caches);
        Ok(())
    }

    fn fork_sequence(&mut self, from: usize, to: usize, _len: usize) -> Result<(), PluginError> {
        let mut caches = self.new_caches()?;
        let Self {
            pool,
            mtp_pool,
            seqs,
            ..
        } = self;
        let parent = seqs
            .get(from)
            .and_then(Option::as_ref)
            .ok_or_else(|| internal(&format!("sequence slot {from} holds no sequence")))?;
        caches.kv = pool.fork(&parent.kv);
        if let (Some(ring), Some(parent)) = (&mut caches.ring, &parent.ring) {
            ring.copy_from(parent);
        }
        if let (Some(plane), Some(layout)) = (&parent.boundary, self.shape.ring) {
            debug_assert_eq!(plane.layout(), &layout);
            caches.boundary = StatePlane::new(layout);
            caches.hidden = parent.hidden.clone();
        }
        if let (Some(pool), Some(parent)) = (mtp_pool.as_mut(), &parent.mtp_kv) {
            caches.mtp_kv = Some(pool.fork(parent));
        }
        self.remove_sequence(to);
        let slot = self
            .seqs
            .get_mut(to)
            .ok_or_else(|| internal(&format!("no sequence slot {to}")))?;
        *slot = Some(caches);
        Ok(())
    }

    fn remove_sequence(&mut self, seq: usize) {
        if let Some(mut caches) = self.seqs.get_mut(seq).and_then(Option::take) {
            self.pool.release(&mut caches.kv);
            if let (Some(pool), Some(kv)) = (self.mtp_pool.as_mut(), caches.mtp_kv.as_mut()) {
                pool.release(kv);
            }
        }
    }

    fn kv_usage(&self) -> KvUsage {
        self.pool.usage()
    }

    fn reuse_prefix(
        &mut self,
        model: &Model,
        pool: &ThreadPool,
        seq: usize,
        tokens: &[u32],
    ) -> Result<usize, PluginError> {
        let caches = slot_mut(&mut self.seqs, seq)?;
        if !caches.kv.is_empty() {
            return Ok(0);
        }
        // The last token is left to evaluate: its logits are what the caller wants.
        let limit = tokens.len().saturating_sub(1);
        if !self.recurrent {
            return Ok(self.pool.reuse_prefix(&mut caches.kv, tokens, limit));
        }
        let Some((len, hidden)) = self.reuse_recurrent_prefix(seq, tokens, limit) else {
            return Ok(0);
        };
        if self.shape.mtp {
            let rebuilt =
                install_busy(pool, || self.rebuild_mtp_cache(model, seq, tokens, &hidden));
            if rebuilt.is_err() {
                // No room for the head's cache: the prompt is evaluated from the start.
                self.reset(seq)?;
                return Ok(0);
            }
        }
        Ok(len)
    }

    fn reserve(&mut self, chunks: &[Chunk<'_>]) -> Result<(), PluginError> {
        self.begin_evaluation(chunks);
        CpuExecutor::reserve(self, chunks)
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

    fn commit(&mut self, seq: usize, start: usize, n: usize, tokens: &[u32]) {
        let Self {
            pool, seqs, states, ..
        } = self;
        if let Some(caches) = seqs.get_mut(seq).and_then(Option::as_mut) {
            pool.set_len(&mut caches.kv, start + n);
            pool.cache_prefix(&mut caches.kv, tokens);
            if let Some(ring) = &mut caches.ring {
                ring.advance(n);
            }
            if let Some(states) = states {
                keep_boundary_state(states, caches, start + n);
            }
        }
    }

    fn rollback(&mut self, seq: usize, len: usize) -> Result<bool, PluginError> {
        let recurrent = self.recurrent;
        let Self {
            pool,
            mtp_pool,
            seqs,
            ..
        } = self;
        let caches = slot_mut(seqs, seq)?;
        if let (Some(pool), Some(kv)) = (mtp_pool.as_mut(), caches.mtp_kv.as_mut()) {
            pool.truncate(kv, len);
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
        pool.truncate(&mut caches.kv, len);
        if let Some(rows) = &mut caches.hidden {
            rows.truncate(len);
        }
        Ok(true)
    }

    fn keep_path(&mut self, seq: usize, kept: KeptPath<'_>) -> Result<(), PluginError> {
        let KeptPath {
            base,
            path,
            tokens,
            hidden,
        } = kept;
        let recurrent = self.recurrent;
        let Self {
            pool, seqs, states, ..
        } = self;
        let caches = slot_mut(seqs, seq)?;
        let n = caches.kv.len() - base;
        let end = base + path.len();
        pool.keep_rows(&mut caches.kv, base, path);
        pool.cache_prefix(&mut caches.kv, tokens);
        if let Some(ring) = &mut caches.ring {
            if recurrent {
                // The state at a block boundary the path crosses, for the prefix cache (the
                // tree's own pass kept none: its rows were not the sequence's positions).
                let crossed = end / BLOCK_TOKENS * BLOCK_TOKENS;
                let boundary = caches
                    .boundary
                    .as_mut()
                    .filter(|_| crossed > base)
                    .map(|plane| (crossed, plane));
                ring.keep_path(n, path, boundary);
            } else {
                ring.reset();
                ring.advance(end);
            }
        }
        if let Some(history) = &mut caches.hidden {
            if !history.write(base, hidden) {
                caches.hidden = None;
                caches.boundary = None;
            }
        }
        if let Some(states) = states {
            keep_boundary_state(states, caches, end);
        }
        Ok(())
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
        let Self {
            pool,
            mtp_pool,
            seqs,
            ..
        } = self;
        let caches = slot_mut(seqs, seq)?;
        if let Some(ring) = &mut caches.ring {
            ring.reset();
        }
        if let Some(rows) = &mut caches.hidden {
            rows.truncate(0);
        }
        pool.release(&mut caches.kv);
        if let (Some(pool), Some(kv)) = (mtp_pool.as_mut(), caches.mtp_kv.as_mut()) {
            pool.release(kv);
        }
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
