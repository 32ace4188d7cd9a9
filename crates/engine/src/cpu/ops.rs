//! The graph operations on the CPU: [`CpuOps`] implements [`LayerOps`] with the kernels of
//! `specula-kernels` over the pass's buffers ([`Scratch`]) and the sequence's caches.
//!
//! Row-wise operations (norms, products, residuals) run over all rows at once; the per-row
//! query/key preparation runs rows on the pool's threads; attention, the Gated DeltaNet
//! recurrence and the MoE FFN are the CPU modules beside this one. Each computes a row exactly
//! as a one-row pass would.

use rayon::prelude::*;
use specula_gguf::GgufFile;
use specula_kernels::activations::{self, Gate};
use specula_kernels::{matmul, matmul_many_one, ops, MatmulScratch, RopeAngles};
use specula_plugin_api::PluginError;

use super::attention::{
    attend_segments, prepare_query_key, AttentionScratch, Segment, SegmentTree,
};
use super::gdn::{self, BetaAlphaIn, GdnRows, GdnScratch};
use super::moe::{self, MoeScratch};
use crate::blocks::gdn::GdnWeights;
use crate::blocks::moe::MoeWeights;
use crate::graph::{
    graph_error, Act, BetaAlphaRows, Cache, Cols, Dims, GdnInputs, KvSlot, LayerOps, QkNorms,
    Query, Rows,
};
use crate::kv_cache::{KvPool, KvWrite, SeqKv, BLOCK_TOKENS};
use crate::model::weights::{MatrixRef, Vector};
use crate::recurrent::{SnapshotRing, StatePlane};
use crate::state_cache::HiddenRows;

/// The buffers of a CPU pass over up to `rows` rows: one per [`Act`] role, and what the
/// operations need besides.
#[derive(Debug)]
pub struct Scratch {
    /// Rows a pass may have.
    rows: usize,
    acts: [Vec<f32>; Act::ALL.len()],
    attention: AttentionScratch,
    /// RoPE angles of the rows' positions, shared by every layer of a pass.
    angles: RopeAngles,
    /// Output gates of gated attention, split out of [`Act::QGate`].
    gate: Vec<f32>,
    gdn: GdnScratch,
    moe: MoeScratch,
    matmul: MatmulScratch,
    /// The hidden rows that get logits, gathered when they are not contiguous.
    logit_rows: Vec<f32>,
}

impl Scratch {
    /// Buffers for passes of up to `rows` rows.
    pub fn new(dims: &Dims, rows: usize) -> Self {
        Self {
            rows,
            acts: Act::ALL.map(|act| vec![0.0; rows * act.width(dims)]),
            attention: AttentionScratch::new(),
            angles: RopeAngles::new(&dims.rope, rows),
            gate: vec![0.0; Act::QGate.width(dims) / 2 * rows],
            gdn: dims
                .gdn
                .map_or_else(GdnScratch::default, |g| GdnScratch::new(&g, rows)),
            moe: dims
                .moe()
                .map_or_else(MoeScratch::default, |m| MoeScratch::new(m, rows)),
            matmul: MatmulScratch::new(),
            logit_rows: Vec::new(),
        }
    }

    /// Rows a pass may have.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Buffer `act`, all its rows.
    pub fn act(&self, act: Act) -> &[f32] {
        &self.acts[act.index()]
    }

    /// Buffer `act`, all its rows, mutably.
    pub fn act_mut(&mut self, act: Act) -> &mut [f32] {
        &mut self.acts[act.index()]
    }
}

/// Buffers `acts` at once, mutably (distinct roles).
fn disjoint<const N: usize>(
    bufs: &mut [Vec<f32>; Act::ALL.len()],
    acts: [Act; N],
) -> Result<[&mut Vec<f32>; N], PluginError> {
    bufs.get_disjoint_mut(acts.map(Act::index))
        .map_err(|_| graph_error(&format!("one buffer both read and written: {acts:?}")))
}

/// One sequence's caches on the CPU: its blocks of the attention KV pools and the recurrent
/// state of the layers run here.
#[derive(Debug)]
pub struct SeqCaches {
    /// Its part of the trunk's attention pool (the layers run here).
    pub kv: SeqKv,
    /// The recurrent state of the GDN layers run here.
    pub ring: Option<SnapshotRing>,
    /// Its part of the MTP head's pool.
    pub mtp_kv: Option<SeqKv>,
    /// Where a pass that crosses a block boundary leaves the recurrent state at the last
    /// boundary it crosses, for the prefix cache (`None`: the sequence's states are not
    /// captured).
    pub boundary: Option<StatePlane>,
    /// The trunk's hidden rows of every position, which a boundary state keeps for the MTP
    /// head (kept beside `boundary` when the head runs here).
    pub hidden: Option<HiddenRows>,
}

/// One pass's view of a [`super::CpuExecutor`]: its buffers, the attention pools and the
/// sequences' caches the layers read and write (indexed by [`crate::graph::Span::seq`]), and
/// where the logits go.
pub struct CpuOps<'a> {
    pub dims: &'a Dims,
    pub file: &'a GgufFile,
    pub scratch: &'a mut Scratch,
    /// The trunk's attention pool.
    pub pool: &'a mut KvPool,
    /// The MTP head's pool.
    pub mtp_pool: Option<&'a mut KvPool>,
    pub seqs: &'a mut [Option<SeqCaches>],
    /// The logits of the pass's rows that get them.
    pub logits: &'a mut [f32],
}

/// Values of an element-wise step from which its rows are split over the pool's threads.
const PARALLEL_ELEMENTWISE: usize = 1 << 13;

/// The caches of sequence slot `seq`.
fn seq_caches(seqs: &[Option<SeqCaches>], seq: usize) -> Result<&SeqCaches, PluginError> {
    seqs.get(seq)
        .and_then(Option::as_ref)
        .ok_or_else(|| graph_error(&format!("sequence slot {seq} has no caches")))
}

/// The pool of `slot`: `pool` (the trunk's) or `mtp_pool` (the MTP head's).
fn pool_of<P>(pool: P, mtp_pool: Option<P>, slot: KvSlot) -> Result<P, PluginError> {
    match slot.cache {
        Cache::Trunk(_) => Ok(pool),
        Cache::Mtp => mtp_pool.ok_or_else(|| graph_error("the MTP head's cache is not here")),
    }
}

/// The layer of `slot` in its pool `pool` ([`pool_of`]) and the sequence's part of it.
fn place_of<'c>(
    pool: &KvPool,
    caches: &'c SeqCaches,
    slot: KvSlot,
) -> Result<(usize, &'c SeqKv), PluginError> {
    let (layer, seq) = match slot.cache {
        Cache::Trunk(layer) => (layer, &caches.kv),
        Cache::Mtp => (
            0,
            caches
                .mtp_kv
                .as_ref()
                .ok_or_else(|| graph_error("the MTP head's cache is not here"))?,
        ),
    };
    if layer >= pool.n_layers() {
        return Err(graph_error(&format!("attention layer {layer} is not here")));
    }
    Ok((layer, seq))
}

/// The pool of `slot` (one of `pool` and `mtp_pool`), the layer there, and the sequence's part
/// of it.
fn cache_of<P: std::ops::Deref<Target = KvPool>>(
    pool: P,
    mtp_pool: Option<P>,
    caches: &SeqCaches,
    slot: KvSlot,
) -> Result<(P, usize, &SeqKv), PluginError> {
    let pool = pool_of(pool, mtp_pool, slot)?;
    let (layer, seq) = place_of(&pool, caches, slot)?;
    Ok((pool, layer, seq))
}

impl LayerOps for CpuOps<'_> {
    fn rms_norm(
        &mut self,
        src: Cols,
        weight: &Vector,
        dst: Cols,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let (n, len, eps) = (rows.n, weight.len(), self.dims.rms_eps);
        let (ws, wd) = (
            self.dims.cols_width(src, len)?,
            self.dims.cols_width(dst, len)?,
        );
        let (from, to) = (src.first..src.first + len, dst.first..dst.first + len);
        if src.act == dst.act {
            if from != to {
                return Err(graph_error("rms_norm: in place, but to other columns"));
            }
            for row in self.scratch.acts[src.act.index()][..n * ws].chunks_exact_mut(ws) {
                ops::rms_norm_in_place(&mut row[from.clone()], weight, eps);
            }
        } else {
            let [x, out] = disjoint(&mut self.scratch.acts, [src.act, dst.act])?;
            for (x, out) in x[..n * ws].chunks_exact(ws).zip(out.chunks_exact_mut(wd)) {
                ops::rms_norm(&x[from.clone()], weight, eps, &mut out[to.clone()]);
            }
        }
        Ok(())
    }

    fn matmul_many(
        &mut self,
        src: Act,
        jobs: &[(&MatrixRef, Act)],
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let n = rows.n;
        for (i, &(w, dst)) in jobs.iter().enumerate() {
            self.dims.check_product(w, src, dst)?;
            let view = w.view(self.file)?;
            let [x, out] = disjoint(&mut self.scratch.acts, [src, dst])?;
            let (x, out) = (&x[..n * w.cols], &mut out[..n * w.rows]);
            matmul_many_one(&view, x, out, &mut self.scratch.matmul, i);
        }
        Ok(())
    }

    fn add_bias(&mut self, dst: Act, bias: &Vector, rows: &Rows) -> Result<(), PluginError> {
        let w = self.dims.check_row_vector(bias, dst)?;
        for row in self.scratch.acts[dst.index()][..rows.n * w].chunks_exact_mut(w) {
            ops::add_in_place(row, bias);
        }
        Ok(())
    }

    fn add(&mut self, dst: Act, src: Act, rows: &Rows) -> Result<(), PluginError> {
        let w = self.dims.common_width(dst, src)?;
        let [d, s] = disjoint(&mut self.scratch.acts, [dst, src])?;
        ops::add_in_place(&mut d[..rows.n * w], &s[..rows.n * w]);
        Ok(())
    }

    fn swiglu(&mut self, gate: Act, up: Act, rows: &Rows) -> Result<(), PluginError> {
        let w = self.dims.common_width(gate, up)?;
        let [g, u] = disjoint(&mut self.scratch.acts, [gate, up])?;
        let (g, u) = (&mut g[..rows.n * w], &u[..rows.n * w]);
        // Rows on the pool's threads when there is enough of them (each value's bits are its
        // own whatever the split).
        if rows.n > 1 && g.len() >= PARALLEL_ELEMENTWISE {
            g.par_chunks_mut(w)
                .zip(u.par_chunks(w))
                .for_each(|(g, u)| activations::swiglu_in_place(g, u));
        } else {
            activations::swiglu_in_place(g, u);
        }
        Ok(())
    }

    fn qk_norm_rope(
        &mut self,
        q: Query,
        k: Act,
        norms: Option<QkNorms<'_>>,
        slot: KvSlot,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let (dims, n) = (self.dims, rows.n);
        dims.check_qk(q, k)?;
        let (rope, eps, hd) = (&dims.rope, dims.rms_eps, dims.attention.head_dim);
        let (qw, kw) = (dims.attention.q_width(), dims.attention.k_width());
        let (q_norm, k_norm) = match norms {
            Some(QkNorms { q, k }) => (Some(&q[..]), Some(&k[..])),
            None => (None, None),
        };
        let s = &mut *self.scratch;
        // Consecutive positions per span; a tree's rows each at their own.
        let mut runs: Vec<(usize, usize)> = Vec::with_capacity(rows.spans.len());
        for span in rows.spans {
            match span.tree {
                None => runs.push((span.pos0 + slot.rope_offset, span.n)),
                Some(_) => {
                    runs.extend((0..span.n).map(|i| (span.position(i) + slot.rope_offset, 1)))
                }
            }
        }
        s.angles.cover_runs(rope, &runs);
        let angles = &s.angles;
        // Rows on the pool's threads (a single row stays on this one).
        match q {
            Query::Plain(q) => {
                let [q, k] = disjoint(&mut s.acts, [q, k])?;
                q[..n * qw]
                    .par_chunks_mut(qw)
                    .zip(k[..n * kw].par_chunks_mut(kw))
                    .enumerate()
                    .for_each(|(i, (q, k))| {
                        prepare_query_key(rope, hd, eps, q_norm, k_norm, angles.row(i), q, k);
                    });
            }
            Query::Gated { from, into } => {
                let [full, q, k] = disjoint(&mut s.acts, [from, into, k])?;
                q[..n * qw]
                    .par_chunks_mut(qw)
                    .zip(k[..n * kw].par_chunks_mut(kw))
                    .zip(full[..n * 2 * qw].par_chunks(2 * qw))
                    .enumerate()
                    .for_each(|(i, ((q, k), full))| {
                        for (pair, head) in full.chunks_exact(2 * hd).zip(q.chunks_exact_mut(hd)) {
                            head.copy_from_slice(&pair[..hd]);
                        }
                        prepare_query_key(rope, hd, eps, q_norm, k_norm, angles.row(i), q, k);
                    });
            }
        }
        Ok(())
    }

    fn store_kv(&mut self, slot: KvSlot, k: Act, v: Act, rows: &Rows) -> Result<(), PluginError> {
        self.dims.check_kv(k, v)?;
        let (kw, vw) = (self.dims.attention.k_width(), self.dims.attention.v_width());
        let acts = &self.scratch.acts;
        let pool = pool_of(&mut *self.pool, self.mtp_pool.as_deref_mut(), slot)?;
        // Every sequence's rows in one store (one fork-join for the pass's sequences).
        let mut writes = Vec::with_capacity(rows.spans.len());
        let mut target = None;
        for (first, span) in rows.with_offsets() {
            let caches = seq_caches(self.seqs, span.seq)?;
            let (layer, seq) = place_of(pool, caches, slot)?;
            target = Some(layer);
            let range = |w: usize| first * w..(first + span.n) * w;
            writes.push(KvWrite {
                seq,
                pos0: span.pos0,
                keys: &acts[k.index()][range(kw)],
                values: &acts[v.index()][range(vw)],
            });
        }
        let Some(layer) = target else {
            return Ok(());
        };
        pool.store_rows(layer, &writes);
        Ok(())
    }

    fn attend(
        &mut self,
        slot: KvSlot,
        q: Act,
        gate: Option<Act>,
        dst: Act,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let dims = self.dims;
        dims.check_attend(q, gate, dst)?;
        let shape = &dims.attention;
        let (n, qw, ow) = (rows.n, shape.q_width(), shape.out_width());
        let s = &mut *self.scratch;
        let [queries, out] = disjoint(&mut s.acts, [q, dst])?;
        let mut segments = Vec::with_capacity(rows.spans.len());
        for (first, span) in rows.with_offsets() {
            let caches = seq_caches(self.seqs, span.seq)?;
            let (pool, layer, seq) = cache_of(&*self.pool, self.mtp_pool.as_deref(), caches, slot)?;
            let end = span.pos0 + span.n;
            segments.push(Segment {
                rows: first..first + span.n,
                first_len: span.pos0 + 1,
                keys: pool.keys(layer, seq, end),
                values: pool.values(layer, seq, end),
                tree: span.tree.map(|tree| SegmentTree {
                    tree,
                    base: span.pos0 - span.ring_step0,
                    first_row: span.ring_step0,
                }),
            });
        }
        attend_segments(
            shape,
            &queries[..n * qw],
            &segments,
            &mut s.attention,
            &mut out[..n * ow],
        );
        if let Some(gate) = gate {
            let hd = shape.head_dim;
            let [full, out] = disjoint(&mut s.acts, [gate, dst])?;
            let gates = &mut s.gate[..n * qw];
            for (row, full) in gates.chunks_exact_mut(qw).zip(full.chunks_exact(2 * qw)) {
                for (head, pair) in row.chunks_exact_mut(hd).zip(full.chunks_exact(2 * hd)) {
                    head.copy_from_slice(&pair[hd..]);
                }
            }
            activations::gate_in_place(Gate::Sigmoid, &mut out[..n * ow], &gates[..n * ow]);
        }
        Ok(())
    }

    fn gated_delta_net(
        &mut self,
        w: &GdnWeights,
        ring: usize,
        inputs: GdnInputs,
        dst: Act,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let shape = self.dims.check_gdn(&inputs, dst)?;
        let s = &mut *self.scratch;
        let vd = shape.value_dim();
        let (c, hv) = (shape.channels(), shape.n_v_heads);
        let (input, out) = match inputs.beta_alpha {
            BetaAlphaRows::Separate { beta, alpha } => {
                let [mixed, z, beta, alpha, out] =
                    disjoint(&mut s.acts, [inputs.mixed, inputs.z, beta, alpha, dst])?;
                let beta_alpha = BetaAlphaIn::Separate { beta, alpha };
                (
                    GdnRows {
                        mixed,
                        z,
                        beta_alpha,
                    },
                    out,
                )
            }
            BetaAlphaRows::Grouped(ba) => {
                let [mixed, z, ba, out] = disjoint(&mut s.acts, [inputs.mixed, inputs.z, ba, dst])?;
                let beta_alpha = BetaAlphaIn::Grouped(ba);
                (
                    GdnRows {
                        mixed,
                        z,
                        beta_alpha,
                    },
                    out,
                )
            }
        };
        for (first, span) in rows.with_offsets() {
            // A tree row reads the state its parent wrote: step `parent + 1`, 0 for a root.
            let reads: Option<Vec<usize>> = span.tree.map(|tree| {
                (0..span.n)
                    .map(|i| tree.read_step(span.ring_step0 + i))
                    .collect()
            });
            let SeqCaches {
                ring: state,
                boundary,
                ..
            } = self
                .seqs
                .get_mut(span.seq)
                .and_then(Option::as_mut)
                .ok_or_else(|| graph_error(&format!("sequence slot {} has no caches", span.seq)))?;
            let state = state
                .as_mut()
                .filter(|state| ring < state.layout().n_layers)
                .ok_or_else(|| graph_error(&format!("GDN layer {ring} is not here")))?;
            // Rows `from .. from + n` of the span, from its `from`-th step after the live state.
            let mut run = |state: &mut SnapshotRing, from: usize, n: usize| {
                let at = first + from;
                let rows = GdnRows {
                    mixed: &input.mixed[at * c..],
                    z: &input.z[at * vd..],
                    beta_alpha: match input.beta_alpha {
                        BetaAlphaIn::Separate { beta, alpha } => BetaAlphaIn::Separate {
                            beta: &beta[at * hv..],
                            alpha: &alpha[at * hv..],
                        },
                        BetaAlphaIn::Grouped(ba) => BetaAlphaIn::Grouped(&ba[at * 2 * hv..]),
                    },
                };
                gdn::recurrence(
                    &shape,
                    w,
                    rows,
                    n,
                    state,
                    ring,
                    span.ring_step0 + from,
                    reads.as_ref().map(|r| &r[from..]),
                    &mut s.gdn,
                    &mut out[at * vd..(at + n) * vd],
                );
            };
            // The last block boundary the span's rows reach: the rows up to it run first,
            // then its state is copied before the rest of the rows can overwrite its plane
            // (each row runs the same steps either way).
            // (A tree's rows are not the sequence's positions: no boundary state is kept.)
            let end = span.pos0 + span.n;
            let crossed = end / BLOCK_TOKENS * BLOCK_TOKENS;
            match boundary {
                Some(plane) if crossed > span.pos0 && span.tree.is_none() => {
                    let upto = crossed - span.pos0;
                    run(state, 0, upto);
                    state.save_layer(ring, span.ring_step0 + upto, plane, crossed);
                    if upto < span.n {
                        run(state, upto, span.n - upto);
                    }
                }
                _ => run(state, 0, span.n),
            }
        }
        Ok(())
    }

    fn moe(&mut self, w: &MoeWeights, src: Act, dst: Act, rows: &Rows) -> Result<(), PluginError> {
        let shape = self.dims.check_moe(src, dst)?;
        let (n, e) = (rows.n, shape.n_embd);
        let s = &mut *self.scratch;
        let [x, out] = disjoint(&mut s.acts, [src, dst])?;
        moe::forward(
            &shape,
            w,
            self.file,
            &x[..n * e],
            n,
            &mut s.moe,
            &mut s.matmul,
            &mut out[..n * e],
        )
    }

    fn logits(&mut self, output: &MatrixRef, hidden: Act, rows: &Rows) -> Result<(), PluginError> {
        let e = self.dims.width(hidden)?;
        let n_logits = rows.logit_rows();
        if n_logits == 0 {
            return Ok(());
        }
        if self.logits.len() != n_logits * output.rows || output.cols != e {
            return Err(graph_error(
                "logits: the output does not fit the rows asked for",
            ));
        }
        let view = output.view(self.file)?;
        let s = &mut *self.scratch;
        let all = &s.acts[hidden.index()];
        // The rows that get logits, contiguous when they already are (one span); each row's
        // product does not depend on the rows beside it.
        let ranges: Vec<_> = rows
            .with_offsets()
            .filter(|(_, span)| span.logit_from < span.n)
            .map(|(first, span)| (first + span.logit_from) * e..(first + span.n) * e)
            .collect();
        let h = match ranges.as_slice() {
            [range] => &all[range.clone()],
            _ => {
                s.logit_rows.clear();
                for range in ranges {
                    s.logit_rows.extend_from_slice(&all[range]);
                }
                &s.logit_rows[..]
            }
        };
        matmul(&view, h, self.logits, &mut s.matmul);
        Ok(())
    }
}
