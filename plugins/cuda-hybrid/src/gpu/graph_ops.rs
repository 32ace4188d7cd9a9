//! The graph operations on the device: [`GpuOps`] implements the engine's
//! [`LayerOps`] with the CUDA kernels of `kernels/*.cu` ([`super::ops`]), so the GPU runs the
//! architectures' graphs as written in `specula-engine`; [`Uploader`] is the same interface
//! uploading every weight an operation names, which is how [`GpuModel::build`] puts exactly the
//! weights the graphs read on the device.
//!
//! Each kernel computes a row of a k-row launch exactly as a one-row launch at the same
//! position (see the kernels' comments), so a verify row is bit-identical to the single-token
//! forward on the GPU.

use specula_engine::blocks::gdn::{GdnWeights, HeadMap};
use specula_engine::blocks::moe::MoeWeights;
use specula_engine::graph::{
    graph_error, Act, BetaAlphaRows, Cache, Cols, GdnInputs, KvSlot, LayerOps, QkNorms, Query, Rows,
};
use specula_engine::kv_cache::BLOCK_TOKENS;
use specula_engine::model::weights::{MatrixRef, Vector};
use specula_gguf::GgufFile;
use specula_plugin_api::PluginError;

use super::model::GpuModel;
use super::ops::{self, AttentionDims, Gate, GdnDims, Heads, KvLayer};
use super::weights::WeightStore;
use super::Gpu;

/// Sequence slot `seq`'s cache layer `slot` as the kernels read it, and the positions it holds
/// for the sequence: the trunk's paged cache (the model's attention layers `first_attention
/// ..`) through the sequence's block table, the MTP head's own cache through the identity.
fn cache_layer(m: &GpuModel, seq: usize, slot: KvSlot) -> Result<(KvLayer, usize), PluginError> {
    let device = m
        .seqs
        .get(seq)
        .ok_or_else(|| graph_error(&format!("sequence slot {seq} is not on the GPU")))?;
    match slot.cache {
        Cache::Trunk(layer) => {
            let i = layer
                .checked_sub(m.first_attention)
                .filter(|&i| i < m.kv.k.len())
                .ok_or_else(|| {
                    graph_error(&format!("attention layer {layer} is not on the GPU"))
                })?;
            let table = m.tables.at(seq * m.table_len);
            Ok((m.kv.layer(i, table), m.table_len * BLOCK_TOKENS))
        }
        Cache::Mtp => device
            .mtp_kv
            .as_ref()
            .map(|kv| (kv.layer(0, m.identity.ptr()), kv.rows))
            .ok_or_else(|| graph_error("the MTP head's cache is not on the GPU")),
    }
}

/// Trunk layer `layer`'s part of the device rings of `rows`' sequences ([`ops::RingSlot`] of
/// the first: the layout is every sequence's), checked: the layer is a GPU Gated DeltaNet
/// layer and the sequence has a device ring.
fn gdn_ring_slot(m: &GpuModel, rows: &Rows, layer: usize) -> Result<ops::RingSlot, PluginError> {
    let seq = rows.spans.first().map_or(0, |span| span.seq);
    let state = m
        .seqs
        .get(seq)
        .and_then(|s| s.ring.as_ref())
        .ok_or_else(|| graph_error("a Gated DeltaNet layer without a device ring"))?;
    let local = layer
        .checked_sub(m.first_gdn)
        .filter(|&i| i < state.layout.n_layers)
        .ok_or_else(|| graph_error(&format!("GDN layer {layer} is not on the GPU")))?;
    Ok(state.slot(local))
}

/// Cache layer `slot` of each span of `rows`, checked: the span's sequence is on the GPU and
/// its positions fit the cache (a trunk layer is one pool for every sequence; the MTP head's
/// caches are each sequence's own).
fn span_layers(m: &GpuModel, rows: &Rows, slot: KvSlot) -> Result<Vec<KvLayer>, PluginError> {
    rows.spans
        .iter()
        .map(|span| {
            let (layer, capacity) = cache_layer(m, span.seq, slot)?;
            if span.pos0 + span.n > capacity {
                return Err(graph_error(&format!(
                    "{} rows at positions {}.. exceed the device KV cache",
                    span.n, span.pos0
                )));
            }
            Ok(layer)
        })
        .collect()
}

/// `heads` from row `rows` on (f32 rows of `row_stride` values).
fn shifted(heads: Heads, rows: usize) -> Heads {
    Heads {
        ptr: heads.ptr + 4 * (rows * heads.row_stride) as u64,
        ..heads
    }
}

/// One pass's view of a [`GpuModel`]: its buffers, caches and weights.
pub struct GpuOps<'a> {
    m: &'a mut GpuModel,
    /// Whether the pass's row table and its tree rows' paths are in the device scratch: written once a pass, read by every layer (the rows are the same for all
    /// layers of a pass).
    rows_written: bool,
    /// The launches of the pass's Gated DeltaNet runs (the same for every layer), once
    /// written to the device ([`Self::write_gdn_runs`]).
    gdn_waves: Option<Vec<ops::GdnRuns>>,
}

impl<'a> GpuOps<'a> {
    pub fn new(m: &'a mut GpuModel) -> Self {
        Self {
            m,
            rows_written: false,
            gdn_waves: None,
        }
    }

    /// Writes the pass's row table ([`ops::AttentionRows`]: each row's sequence slot, cache
    /// position, path and RoPE position) and the paths of every tree's rows (each row: the
    /// path's length, then its nodes' cache positions), once per pass: the pass calls
    /// it before its first launch, the operations that read the table again (a no-op).
    pub fn write_rows(&mut self, rows: &Rows) -> Result<(), PluginError> {
        if self.rows_written {
            return Ok(());
        }
        let mut info: Vec<i32> = Vec::with_capacity(ops::ROW_INFO * rows.n);
        let mut paths: Vec<i32> = Vec::new();
        for span in rows.spans {
            let base = span.pos0 - span.ring_step0;
            for i in 0..span.n {
                let (path_at, tree_base) = match &span.tree {
                    None => (-1, 0),
                    Some(tree) => {
                        let at = paths.len();
                        let path = tree.path(span.ring_step0 + i);
                        paths.push(path.len() as i32);
                        paths.extend(path.iter().map(|&node| (base + node) as i32));
                        (at as i32, base as i32)
                    }
                };
                info.extend([
                    span.seq as i32,
                    (span.pos0 + i) as i32,
                    path_at,
                    tree_base,
                    span.position(i) as i32,
                ]);
            }
        }
        let m = &mut *self.m;
        m.gpu.write(&info, &mut m.scratch.extras.row_info, 0)?;
        m.gpu.write(&paths, &mut m.scratch.extras.tree_paths, 0)?;
        self.rows_written = true;
        Ok(())
    }

    /// The pass's rows as the attention and cache-store kernels read them (after
    /// [`Self::write_rows`]), through the trunk's block tables.
    fn pass_rows(&self, rows: &Rows) -> ops::AttentionRows {
        let m = &*self.m;
        ops::AttentionRows {
            info: m.scratch.extras.row_info.ptr(),
            n: rows.n,
            tables: m.tables.ptr(),
            table_stride: m.table_len,
            paths: m.scratch.extras.tree_paths.ptr(),
            max_keys: rows.spans.iter().map(|s| s.pos0 + s.n).max().unwrap_or(0),
        }
    }

    /// Writes the pass's Gated DeltaNet runs to the device and returns its launches, once per
    /// pass and before its first launch, with the row table (every GDN layer runs the same
    /// runs, in its own part of the planes; none where the GPU runs no GDN layer): each
    /// sequence's rows in runs of at most the ring's depth, so no token overwrites the plane
    /// its run starts from (the convolution reads it for every token), and a tree's rows a
    /// run at a time — rows each the child of the row before — the run's first from its
    /// parent's state (the plane of step parent + 1, or the live one for a root), each into
    /// its own plane (step row + 1). The `w`-th runs of all sequences are one launch: they are
    /// independent, while a sequence's next run starts from the state its run before wrote.
    pub fn write_gdn_runs(&mut self, rows: &Rows) -> Result<Vec<ops::GdnRuns>, PluginError> {
        if let Some(waves) = &self.gdn_waves {
            return Ok(waves.clone());
        }
        let m = &mut *self.m;
        // (wave, run), in the order of the pass's rows.
        let mut runs: Vec<(usize, ops::GdnRun)> = Vec::new();
        for (row0, span) in rows.with_offsets() {
            let Some(state) = m.seqs.get(span.seq).and_then(|s| s.ring.as_ref()) else {
                // No GDN layer on the GPU (a sequence with one has a device ring).
                continue;
            };
            let planes = state.planes.ptr();
            let depth = state.index.depth();
            let (mut step, mut wave) = (0, 0);
            while step < span.n {
                let (n, start, write) = match span.tree {
                    None => {
                        let (start, _) = state.index.step_planes(span.ring_step0 + step);
                        (depth.min(span.n - step), start, None)
                    }
                    Some(tree) => {
                        let row = span.ring_step0 + step;
                        let (start, write) = state.index.tree_planes(tree.read_step(row), row);
                        let run = (1..depth.min(span.n - step))
                            .take_while(|&k| tree.parents[row + k] as usize == row + k - 1)
                            .count();
                        (1 + run, start, Some(write))
                    }
                };
                let run = ops::GdnRun {
                    planes,
                    first: row0 + step,
                    rows: n,
                    start,
                    write,
                };
                runs.push((wave, run));
                step += n;
                wave += 1;
            }
        }
        // Wave by wave (stable: each wave's runs in the order of the rows).
        runs.sort_by_key(|&(wave, _)| wave);
        let table: Vec<i64> = runs.iter().flat_map(|(_, run)| run.words()).collect();
        m.gpu.write(&table, &mut m.scratch.extras.gdn_runs, 0)?;
        let base = m.scratch.extras.gdn_runs.ptr();
        let mut waves: Vec<ops::GdnRuns> = Vec::new();
        for (i, &(wave, run)) in runs.iter().enumerate() {
            if waves.len() == wave {
                waves.push(ops::GdnRuns {
                    table: base + (8 * ops::GDN_RUN * i) as u64,
                    count: 0,
                    max_rows: 0,
                });
            }
            let launch = &mut waves[wave];
            launch.count += 1;
            launch.max_rows = launch.max_rows.max(run.rows);
        }
        self.gdn_waves = Some(waves.clone());
        Ok(waves)
    }

    /// The `n` rows from row `first` of `all`, one sequence's at positions `pos0 ..`, through
    /// the one block table `table` (a sequence's own cache: the MTP head's).
    fn span_rows(
        &self,
        all: ops::AttentionRows,
        first: usize,
        n: usize,
        pos0: usize,
        table: u64,
    ) -> ops::AttentionRows {
        ops::AttentionRows {
            info: all.info + (4 * ops::ROW_INFO * first) as u64,
            n,
            tables: table,
            table_stride: 0,
            max_keys: pos0 + n,
            ..all
        }
    }

    /// Address of buffer `act`'s column `first` in row 0.
    fn at(&self, cols: Cols) -> u64 {
        self.m.scratch.act(cols.act).at(cols.first)
    }

    fn ptr(&self, act: Act) -> u64 {
        self.m.scratch.act(act).ptr()
    }

    fn attention_dims(&self) -> AttentionDims {
        let a = &self.m.dims.attention;
        AttentionDims {
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: a.head_dim,
            value_dim: a.value_dim,
            scale: a.scale(),
        }
    }
}

impl LayerOps for GpuOps<'_> {
    fn rms_norm(
        &mut self,
        src: Cols,
        weight: &Vector,
        dst: Cols,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let len = weight.len();
        let (ws, wd) = (
            self.m.dims.cols_width(src, len)?,
            self.m.dims.cols_width(dst, len)?,
        );
        let w = self.m.store.vector(weight)?;
        let (x, out) = (self.at(src), self.at(dst));
        let eps = self.m.dims.rms_eps;
        ops::rms_norm(&self.m.gpu, x, ws, &w, eps, w.len, rows.n, out, wd)
    }

    fn matmul_many(
        &mut self,
        src: Act,
        jobs: &[(&MatrixRef, Act)],
        rows: &Rows,
    ) -> Result<(), PluginError> {
        let matrices = jobs
            .iter()
            .map(|&(w, dst)| {
                self.m.dims.check_product(w, src, dst)?;
                Ok((self.m.store.matrix(w)?, self.ptr(dst)))
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        let jobs: Vec<_> = matrices.iter().map(|(w, out)| (w, *out)).collect();
        let s = &self.m.scratch;
        ops::matmul_many(&self.m.gpu, s.act(src).ptr(), rows.n, &jobs, &s.q8)
    }

    fn add_bias(&mut self, dst: Act, bias: &Vector, rows: &Rows) -> Result<(), PluginError> {
        self.m.dims.check_row_vector(bias, dst)?;
        let bias = self.m.store.vector(bias)?;
        ops::add_row_bias(&self.m.gpu, self.ptr(dst), &bias, rows.n)
    }

    fn add(&mut self, dst: Act, src: Act, rows: &Rows) -> Result<(), PluginError> {
        let w = self.m.dims.common_width(dst, src)?;
        let n = rows.n * w;
        ops::add_in_place(&self.m.gpu, self.ptr(dst), self.ptr(src), n)
    }

    fn swiglu(&mut self, gate: Act, up: Act, rows: &Rows) -> Result<(), PluginError> {
        let n = rows.n * self.m.dims.common_width(gate, up)?;
        ops::swiglu(&self.m.gpu, self.ptr(gate), self.ptr(up), n)
    }

    fn qk_norm_rope(
        &mut self,
        q: Query,
        k: Act,
        norms: Option<QkNorms<'_>>,
        slot: KvSlot,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        self.m.dims.check_qk(q, k)?;
        let a = self.m.dims.attention;
        let (hd, qw, kw) = (a.head_dim, a.q_width(), a.k_width());
        let (q_in, q_out) = match q {
            Query::Plain(q) => {
                let heads = Heads {
                    ptr: self.ptr(q),
                    row_stride: qw,
                    head_stride: hd,
                };
                (heads, heads)
            }
            Query::Gated { from, into } => (
                Heads {
                    ptr: self.ptr(from),
                    row_stride: 2 * qw,
                    head_stride: 2 * hd,
                },
                Heads {
                    ptr: self.ptr(into),
                    row_stride: qw,
                    head_stride: hd,
                },
            ),
        };
        let (q_norm, k_norm) = match norms {
            Some(QkNorms { q, k }) => {
                (Some(self.m.store.vector(q)?), Some(self.m.store.vector(k)?))
            }
            None => (None, None),
        };
        let keys = Heads {
            ptr: self.ptr(k),
            row_stride: kw,
            head_stride: hd,
        };
        self.write_rows(rows)?;
        let m = &*self.m;
        let (eps, offset) = (m.dims.rms_eps, slot.rope_offset);
        // Every row rotates by its own position (a tree's rows by their depths): one launch
        // for all rows of all sequences.
        let positions = ops::Positions::PerRow(m.scratch.extras.row_info.ptr());
        for (input, output, n_heads, norm) in [
            (q_in, q_out, a.n_head, &q_norm),
            (keys, keys, a.n_head_kv, &k_norm),
        ] {
            ops::qk_norm_rope(
                &m.gpu,
                input,
                output,
                n_heads,
                rows.n,
                hd,
                norm.as_ref(),
                eps,
                positions,
                offset,
                &m.rope,
            )?;
        }
        Ok(())
    }

    fn store_kv(&mut self, slot: KvSlot, k: Act, v: Act, rows: &Rows) -> Result<(), PluginError> {
        self.m.dims.check_kv(k, v)?;
        let a = &self.m.dims.attention;
        let (kw, vw) = (a.k_width(), a.v_width());
        self.write_rows(rows)?;
        let m = &*self.m;
        let (sk, sv) = (m.scratch.act(k), m.scratch.act(v));
        if rows.n * kw > sk.len() || rows.n * vw > sv.len() {
            return Err(graph_error(&format!(
                "{} rows exceed the device scratch",
                rows.n
            )));
        }
        let layers = span_layers(m, rows, slot)?;
        let all = self.pass_rows(rows);
        if let Cache::Trunk(_) = slot.cache {
            // Every sequence's trunk cache is in the same pool: all rows in one launch each.
            let Some(layer) = layers.first() else {
                return Ok(());
            };
            ops::kv_store(&m.gpu, layer.ty, sk.ptr(), kw, all, layer.keys)?;
            return ops::kv_store(&m.gpu, layer.ty, sv.ptr(), vw, all, layer.values);
        }
        // The MTP head's caches are a sequence's own: launches per sequence.
        for ((first, span), layer) in rows.with_offsets().zip(layers) {
            let span_rows = self.span_rows(all, first, span.n, span.pos0, layer.table);
            let (ks, vs) = (sk.at(first * kw), sv.at(first * vw));
            ops::kv_store(&m.gpu, layer.ty, ks, kw, span_rows, layer.keys)?;
            ops::kv_store(&m.gpu, layer.ty, vs, vw, span_rows, layer.values)?;
        }
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
        self.m.dims.check_attend(q, gate, dst)?;
        let dims = self.attention_dims();
        let (hd, qw) = (dims.head_dim, dims.n_head * dims.head_dim);
        let queries = Heads {
            ptr: self.ptr(q),
            row_stride: qw,
            head_stride: hd,
        };
        let gate = gate.map(|g| Gate {
            ptr: self.m.scratch.act(g).at(hd),
            row_stride: 2 * qw,
            head_stride: 2 * hd,
        });
        let out = self.ptr(dst);
        let ow = dims.n_head * dims.value_dim;
        self.write_rows(rows)?;
        let all = self.pass_rows(rows);
        let m = &*self.m;
        let s = &m.scratch;
        let layers = span_layers(m, rows, slot)?;
        if let Cache::Trunk(_) = slot.cache {
            // Every sequence's trunk cache is in the same pool, through its own block table:
            // all the pass's rows in one launch (per ATTENTION_ROWS).
            let Some(&layer) = layers.first() else {
                return Ok(());
            };
            return ops::attention(
                &m.gpu,
                &dims,
                queries,
                layer,
                all,
                &s.extras.scores,
                s.n_ctx,
                gate,
                out,
            );
        }
        // The MTP head's caches are a sequence's own: a launch per sequence.
        for ((first, span), layer) in rows.with_offsets().zip(layers) {
            let span_rows = self.span_rows(all, first, span.n, span.pos0, layer.table);
            ops::attention(
                &m.gpu,
                &dims,
                shifted(queries, first),
                layer,
                span_rows,
                &s.extras.scores,
                s.n_ctx,
                gate.map(|g| Gate {
                    ptr: g.ptr + 4 * (first * g.row_stride) as u64,
                    ..g
                }),
                out + 4 * (first * ow) as u64,
            )?;
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
        let shape = self.m.dims.check_gdn(&inputs, dst)?;
        let waves = self.write_gdn_runs(rows)?;
        let m = &*self.m;
        let s = &m.scratch;
        let (c, hv, sd) = (shape.channels(), shape.n_v_heads, shape.head_dim);
        let (beta, alpha, grouped) = match inputs.beta_alpha {
            BetaAlphaRows::Separate { beta, alpha } => (s.act(beta), s.act(alpha), false),
            BetaAlphaRows::Grouped(ba) => (s.act(ba), s.act(ba), true),
        };
        let (mixed, z, out) = (s.act(inputs.mixed), s.act(inputs.z), s.act(dst));
        let conv_out = &s.extras.conv_out;
        let (conv, dt_bias, a, norm) = (
            m.store.vector(&w.conv)?,
            m.store.vector(&w.dt_bias)?,
            m.store.vector(&w.a)?,
            m.store.vector(&w.norm)?,
        );
        let dims = GdnDims {
            channels: c,
            head_dim: sd,
            n_k_heads: shape.n_k_heads,
            n_v_heads: hv,
            head_map: match shape.head_map {
                HeadMap::Tiled => 0,
                HeadMap::Interleaved => 1,
            },
            eps: shape.eps,
        };
        let q_scale = 1.0 / (sd as f32).sqrt();
        // The layer's part of the planes (the same in every sequence's ring).
        let ring_slot = gdn_ring_slot(m, rows, ring)?;
        // All the convolutions, then all the recurrences: a plane's convolution state and its
        // S matrices are separate parts of it, so each keeps its own order of writes and reads.
        for wave in &waves {
            ops::gdn_conv(
                &m.gpu,
                mixed.ptr(),
                &conv,
                &ring_slot,
                wave,
                shape.conv_kernel,
                c,
                conv_out.ptr(),
            )?;
        }
        // Row-wise: every sequence's rows at once.
        ops::gdn_qk_l2norm(
            &m.gpu,
            conv_out.ptr(),
            rows.n,
            c,
            shape.n_k_heads,
            sd,
            shape.eps,
            q_scale,
        )?;
        let inputs = ops::GdnInputs {
            conv_out: conv_out.ptr(),
            beta: beta.ptr(),
            alpha: alpha.ptr(),
            grouped,
            dt_bias: dt_bias.ptr,
            ssm_a: a.ptr,
        };
        for wave in &waves {
            ops::gdn_recurrence(&m.gpu, &inputs, &dims, &ring_slot, wave, out.ptr())?;
        }
        ops::gdn_gated_norm(&m.gpu, &dims, out.ptr(), z.ptr(), norm.ptr, rows.n)
    }

    fn moe(&mut self, w: &MoeWeights, src: Act, dst: Act, rows: &Rows) -> Result<(), PluginError> {
        let m = &*self.m;
        let shape = m.dims.check_moe(src, dst)?;
        let (gpu, s, store) = (&m.gpu, &m.scratch, &m.store);
        let x = &s.extras;
        let (e, k, n) = (shape.n_embd, shape.n_used, rows.n);
        let pairs = n * k;
        let (xn, out, q8) = (s.act(src).ptr(), s.act(dst).ptr(), &s.q8);
        let (gate, up, down) = (
            store.experts(&w.gate_exps)?,
            store.experts(&w.up_exps)?,
            store.experts(&w.down_exps)?,
        );
        ops::matmul(gpu, &store.matrix(&w.gate_inp)?, xn, n, x.router.ptr(), q8)?;
        ops::moe_route(
            gpu,
            x.router.ptr(),
            n,
            shape.n_expert,
            k,
            shape.weights_scale,
            x.ids.ptr(),
            x.route_weights.ptr(),
        )?;
        let (ids, g, u) = (x.ids.ptr(), x.moe_gate.ptr(), x.moe_up.ptr());
        ops::matmul_ids(gpu, &gate, ids, pairs, xn, n, k, g, q8)?;
        ops::matmul_ids(gpu, &up, ids, pairs, xn, n, k, u, q8)?;
        ops::swiglu(gpu, g, u, pairs * gate.rows)?;
        let expert_out = x.expert_out.ptr();
        ops::matmul_ids(gpu, &down, ids, pairs, g, pairs, 1, expert_out, q8)?;
        ops::moe_combine(gpu, expert_out, x.route_weights.ptr(), n, k, e, out)?;
        if let Some(shared) = &w.shared {
            let (sg, su, sd) = (
                store.matrix(&shared.gate)?,
                store.matrix(&shared.up)?,
                store.matrix(&shared.down)?,
            );
            ops::matmul_many(gpu, xn, n, &[(&sg, g), (&su, u)], q8)?;
            ops::swiglu(gpu, g, u, n * sg.rows)?;
            ops::matmul(gpu, &sd, g, n, x.shared_out.ptr(), q8)?;
            let gate_inp = store.matrix(&shared.gate_inp)?;
            ops::matmul(gpu, &gate_inp, xn, n, x.shared_gate.ptr(), q8)?;
            ops::add_gated(gpu, out, x.shared_out.ptr(), x.shared_gate.ptr(), n, e)?;
        }
        Ok(())
    }

    fn logits(&mut self, output: &MatrixRef, hidden: Act, rows: &Rows) -> Result<(), PluginError> {
        let m = &*self.m;
        let w = m.store.matrix(output)?;
        let s = &m.scratch;
        let width = m.dims.width(hidden)?;
        // Each sequence's rows from its `logit_from`, one after another in the logits buffer.
        let mut at = 0;
        for (first, span) in rows.with_offsets() {
            let n = span.n.saturating_sub(span.logit_from);
            if n == 0 {
                continue;
            }
            let h = s.act(hidden).at((first + span.logit_from) * width);
            ops::matmul(&m.gpu, &w, h, n, s.extras.logits.at(at * w.rows), &s.q8)?;
            at += n;
        }
        Ok(())
    }
}

/// The graph operations as an upload: each operation uploads the weights it names (once) and
/// computes nothing. Running a layer's graph through it puts that layer's weights on the
/// device.
pub struct Uploader<'a> {
    gpu: &'a Gpu,
    file: &'a GgufFile,
    store: &'a mut WeightStore,
}

impl<'a> Uploader<'a> {
    pub fn new(gpu: &'a Gpu, file: &'a GgufFile, store: &'a mut WeightStore) -> Self {
        Self { gpu, file, store }
    }

    fn matrix(&mut self, m: &MatrixRef) -> Result<(), PluginError> {
        self.store.upload_matrix(self.gpu, self.file, m)
    }

    fn vector(&mut self, v: &Vector) -> Result<(), PluginError> {
        self.store.upload_vector(self.gpu, v)
    }
}

impl LayerOps for Uploader<'_> {
    fn rms_norm(&mut self, _: Cols, weight: &Vector, _: Cols, _: &Rows) -> Result<(), PluginError> {
        self.vector(weight)
    }

    fn matmul_many(
        &mut self,
        _: Act,
        jobs: &[(&MatrixRef, Act)],
        _: &Rows,
    ) -> Result<(), PluginError> {
        jobs.iter().try_for_each(|(w, _)| self.matrix(w))
    }

    fn add_bias(&mut self, _: Act, bias: &Vector, _: &Rows) -> Result<(), PluginError> {
        self.vector(bias)
    }

    fn add(&mut self, _: Act, _: Act, _: &Rows) -> Result<(), PluginError> {
        Ok(())
    }

    fn swiglu(&mut self, _: Act, _: Act, _: &Rows) -> Result<(), PluginError> {
        Ok(())
    }

    fn qk_norm_rope(
        &mut self,
        _: Query,
        _: Act,
        norms: Option<QkNorms<'_>>,
        _: KvSlot,
        _: &Rows,
    ) -> Result<(), PluginError> {
        match norms {
            Some(QkNorms { q, k }) => {
                self.vector(q)?;
                self.vector(k)
            }
            None => Ok(()),
        }
    }

    fn store_kv(&mut self, _: KvSlot, _: Act, _: Act, _: &Rows) -> Result<(), PluginError> {
        Ok(())
    }

    fn attend(
        &mut self,
        _: KvSlot,
        _: Act,
        _: Option<Act>,
        _: Act,
        _: &Rows,
    ) -> Result<(), PluginError> {
        Ok(())
    }

    fn gated_delta_net(
        &mut self,
        w: &GdnWeights,
        _: usize,
        _: GdnInputs,
        _: Act,
        _: &Rows,
    ) -> Result<(), PluginError> {
        [&w.conv, &w.dt_bias, &w.a, &w.norm]
            .into_iter()
            .try_for_each(|v| self.vector(v))
    }

    fn moe(&mut self, w: &MoeWeights, _: Act, _: Act, _: &Rows) -> Result<(), PluginError> {
        self.matrix(&w.gate_inp)?;
        for experts in [&w.gate_exps, &w.up_exps, &w.down_exps] {
            self.store.upload_experts(self.gpu, self.file, experts)?;
        }
        if let Some(shared) = &w.shared {
            for m in [&shared.gate_inp, &shared.gate, &shared.up, &shared.down] {
                self.matrix(m)?;
            }
        }
        Ok(())
    }

    fn logits(&mut self, output: &MatrixRef, _: Act, _: &Rows) -> Result<(), PluginError> {
        self.matrix(output)
    }
}
