//! The vocabulary a model graph is written in: the [`LayerOps`] trait every executor
//! implements, the activation buffers it names ([`Act`]) and the rows of a pass ([`Rows`]).
//!
//! An architecture's layer (`arch/<name>.rs`) is a function over `&mut impl LayerOps`: it says
//! which weights multiply which buffers in which order, and nothing about where that runs. The
//! CPU executor ([`crate::cpu`]) implements the operations with the kernels of
//! `specula-kernels`, cuda-hybrid's with CUDA kernels; each is monomorphised over the graph,
//! so dispatch costs one call per operation (about ten per layer), never per row. Every
//! operation checks the buffers it is given against the model ([`Dims`]'s `check_*`), so a
//! wrong graph fails with an error naming the buffer instead of reading the wrong values.
//!
//! **Buffers by role.** The graph names buffers ([`Act`]); the executor owns them, one per
//! role, each `rows × width` values with the width fixed by the model ([`Act::width`]), so
//! both executors size them from the same [`Dims`].
//!
//! **Weights as the engine's types.** Operations take the loaded weights ([`MatrixRef`],
//! [`Vector`], the MoE and Gated DeltaNet weight structs); an executor that keeps its own
//! copies (a GPU) finds them by tensor name.
//!
//! **Parity.** Every operation computes each row independently of the others (or, for the
//! position-dependent ones, from the caches and that row's position only), so a row of a
//! many-row pass gets the bits a one-row pass at its position would. [`Rows`] says which
//! positions the rows are: today consecutive positions of one sequence; passes that carry rows
//! of several sequences (the batching of many sequences) extend it, not the operations.

use specula_kernels::Rope;
use specula_plugin_api::{ErrorKind, PluginError, TREE_ROOT};

use crate::blocks::attention::AttentionShape;
use crate::blocks::ffn::FfnShape;
use crate::blocks::gdn::{BetaAlphaLayout, GdnShape, GdnWeights};
use crate::blocks::moe::{MoeShape, MoeWeights};
use crate::model::weights::{MatrixRef, Vector};

/// An activation buffer of a pass, by role. Each holds `rows × width` values, row-major
/// ([`Act::width`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    /// The residual stream (`n_embd`).
    X,
    /// Normalised rows, the input of a block (`n_embd`).
    Xn,
    /// A block's output on its way back into the residual (`n_embd`).
    Proj,
    /// The final-norm hidden states, the LM head's input (`n_embd`).
    Hidden,
    /// The MTP head's input rows `[embedding | trunk hidden]` (`2 × n_embd`).
    MtpIn,
    /// Query heads (`n_head × head_dim`).
    Q,
    /// Query and output gate projected together, per head `head_dim` query values then
    /// `head_dim` gate values (`2 × n_head × head_dim`; gated attention).
    QGate,
    /// Key heads (`n_head_kv × head_dim`).
    K,
    /// Value heads (`n_head_kv × value_dim`).
    V,
    /// Attention output, every query head's values (`n_head × value_dim`).
    Attn,
    /// The SwiGLU FFN's gate projection, then its activation (`n_ff`).
    FfnGate,
    /// The SwiGLU FFN's up projection (`n_ff`).
    FfnUp,
    /// Gated DeltaNet: the mixed `[q | k | v]` channels before the convolution.
    Mixed,
    /// Gated DeltaNet: the output gate `z` (value dimension).
    Z,
    /// Gated DeltaNet: one pre-sigmoid beta per value head.
    Beta,
    /// Gated DeltaNet: one pre-softplus alpha per value head.
    Alpha,
    /// Gated DeltaNet: betas and alphas projected together, per key head `Hv/Hk` betas then
    /// `Hv/Hk` alphas (`2 × Hv`).
    BetaAlpha,
    /// Gated DeltaNet: the normalised, gated head outputs (value dimension), `ssm_out`'s input.
    GdnOut,
}

impl Act {
    /// Every role, in the order of [`Act::index`].
    pub const ALL: [Act; 18] = [
        Act::X,
        Act::Xn,
        Act::Proj,
        Act::Hidden,
        Act::MtpIn,
        Act::Q,
        Act::QGate,
        Act::K,
        Act::V,
        Act::Attn,
        Act::FfnGate,
        Act::FfnUp,
        Act::Mixed,
        Act::Z,
        Act::Beta,
        Act::Alpha,
        Act::BetaAlpha,
        Act::GdnOut,
    ];

    /// The role's place in [`Act::ALL`] (for executors that keep the buffers in an array).
    pub fn index(self) -> usize {
        self as usize
    }

    /// Values per row of the role's buffer in a model of `dims` (0 where the model has no
    /// such buffer).
    pub fn width(self, dims: &Dims) -> usize {
        let e = dims.n_embd;
        let a = &dims.attention;
        let gdn = |f: fn(&GdnShape) -> usize| dims.gdn.as_ref().map_or(0, f);
        match self {
            Act::X | Act::Xn | Act::Proj | Act::Hidden => e,
            Act::MtpIn => {
                if dims.mtp {
                    2 * e
                } else {
                    0
                }
            }
            Act::Q => a.q_width(),
            Act::QGate if dims.gated_attention => 2 * a.q_width(),
            Act::QGate => 0,
            Act::K => a.k_width(),
            Act::V => a.v_width(),
            Act::Attn => a.out_width(),
            Act::FfnGate | Act::FfnUp => match dims.ffn {
                FfnShape::Dense { n_ff, .. } => n_ff,
                FfnShape::Moe(_) => 0,
            },
            Act::Mixed => gdn(GdnShape::channels),
            Act::Z | Act::GdnOut => gdn(GdnShape::value_dim),
            Act::Beta | Act::Alpha => gdn(|g| match g.beta_alpha {
                BetaAlphaLayout::Separate => g.n_v_heads,
                BetaAlphaLayout::Grouped => 0,
            }),
            Act::BetaAlpha => gdn(|g| match g.beta_alpha {
                BetaAlphaLayout::Separate => 0,
                BetaAlphaLayout::Grouped => 2 * g.n_v_heads,
            }),
        }
    }

    /// The buffer's columns from `first` on.
    pub fn cols(self, first: usize) -> Cols {
        Cols { act: self, first }
    }
}

/// Columns of an activation buffer, from `first` on, in every row (an operation says how many
/// it reads or writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cols {
    pub act: Act,
    pub first: usize,
}

impl From<Act> for Cols {
    fn from(act: Act) -> Self {
        act.cols(0)
    }
}

/// The dimensions of a model that shape its passes, for any architecture: what sizes the
/// executors' buffers and what their operations need besides the weights.
#[derive(Debug, Clone)]
pub struct Dims {
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Epsilon of every RMSNorm of the model.
    pub rms_eps: f32,
    /// Every attention layer's shape (trunk and MTP head).
    pub attention: AttentionShape,
    /// Whether the attention layers project an output gate with their queries (the hybrids').
    pub gated_attention: bool,
    pub rope: Rope,
    /// The Gated DeltaNet layers' shape (hybrid models).
    pub gdn: Option<GdnShape>,
    /// The FFN's shape (every layer has the same kind).
    pub ffn: FfnShape,
    /// Whether the model has an MTP head.
    pub mtp: bool,
}

impl Dims {
    /// Values per row of buffer `act` ([`Act::width`]); an error for a buffer this model does
    /// not have (a graph naming it is wrong).
    pub fn width(&self, act: Act) -> Result<usize, PluginError> {
        match act.width(self) {
            0 => Err(graph_error(&format!(
                "{act:?}: no such buffer in this model"
            ))),
            w => Ok(w),
        }
    }

    /// The row width of `cols.act` after checking that `len` columns from `cols.first` fit
    /// in it.
    pub fn cols_width(&self, cols: Cols, len: usize) -> Result<usize, PluginError> {
        let width = self.width(cols.act)?;
        if cols.first + len > width {
            return Err(graph_error(&format!(
                "{len} columns from {} do not fit {:?} ({width} wide)",
                cols.first, cols.act
            )));
        }
        Ok(width)
    }

    /// Checks that `w` maps rows of `src` to rows of `dst`.
    pub fn check_product(&self, w: &MatrixRef, src: Act, dst: Act) -> Result<(), PluginError> {
        if w.cols != self.width(src)? || w.rows != self.width(dst)? {
            return Err(graph_error(&format!(
                "'{}' ({} × {}) does not map {src:?} to {dst:?}",
                w.name, w.rows, w.cols
            )));
        }
        Ok(())
    }

    /// The row width of `a` and `b`, which must have the same.
    pub fn common_width(&self, a: Act, b: Act) -> Result<usize, PluginError> {
        let width = self.width(a)?;
        if self.width(b)? != width {
            return Err(graph_error(&format!("{a:?} and {b:?} differ in width")));
        }
        Ok(width)
    }

    /// Checks that `v` has one value per column of `act`.
    pub fn check_row_vector(&self, v: &Vector, act: Act) -> Result<usize, PluginError> {
        let width = self.width(act)?;
        if v.len() != width {
            return Err(graph_error(&format!("'{}' does not fit {act:?}", v.name)));
        }
        Ok(width)
    }

    /// Checks that `act` is `width` wide (an operation's fixed operand).
    fn expect(&self, act: Act, width: usize) -> Result<(), PluginError> {
        match self.width(act)? {
            w if w == width => Ok(()),
            w => Err(graph_error(&format!(
                "{act:?} ({w} wide) where {width} values per row are read"
            ))),
        }
    }

    /// Checks the buffers of [`LayerOps::qk_norm_rope`].
    pub fn check_qk(&self, q: Query, k: Act) -> Result<(), PluginError> {
        let a = &self.attention;
        match q {
            Query::Plain(q) => self.expect(q, a.q_width())?,
            Query::Gated { from, into } => {
                self.expect(from, 2 * a.q_width())?;
                self.expect(into, a.q_width())?;
            }
        }
        self.expect(k, a.k_width())
    }

    /// Checks the buffers of [`LayerOps::store_kv`].
    pub fn check_kv(&self, k: Act, v: Act) -> Result<(), PluginError> {
        self.expect(k, self.attention.k_width())?;
        self.expect(v, self.attention.v_width())
    }

    /// Checks the buffers of [`LayerOps::attend`].
    pub fn check_attend(&self, q: Act, gate: Option<Act>, dst: Act) -> Result<(), PluginError> {
        let a = &self.attention;
        self.expect(q, a.q_width())?;
        if let Some(gate) = gate {
            self.expect(gate, 2 * a.q_width())?;
        }
        self.expect(dst, a.out_width())
    }

    /// Checks the buffers of [`LayerOps::gated_delta_net`] and returns the layers' shape.
    pub fn check_gdn(&self, inputs: &GdnInputs, dst: Act) -> Result<GdnShape, PluginError> {
        let g = self
            .gdn
            .ok_or_else(|| graph_error("a Gated DeltaNet layer in a model without any"))?;
        self.expect(inputs.mixed, g.channels())?;
        self.expect(inputs.z, g.value_dim())?;
        match inputs.beta_alpha {
            BetaAlphaRows::Separate { beta, alpha } => {
                self.expect(beta, g.n_v_heads)?;
                self.expect(alpha, g.n_v_heads)?;
            }
            BetaAlphaRows::Grouped(ba) => self.expect(ba, 2 * g.n_v_heads)?,
        }
        self.expect(dst, g.value_dim())?;
        Ok(g)
    }

    /// Checks the buffers of [`LayerOps::moe`] and returns the FFN's shape.
    pub fn check_moe(&self, src: Act, dst: Act) -> Result<MoeShape, PluginError> {
        let shape = *self
            .moe()
            .ok_or_else(|| graph_error("MoE weights in a model with a dense FFN"))?;
        self.expect(src, shape.n_embd)?;
        self.expect(dst, shape.n_embd)?;
        Ok(shape)
    }

    /// The MoE shape, when the FFN is a mixture of experts.
    pub fn moe(&self) -> Option<&MoeShape> {
        match &self.ffn {
            FfnShape::Moe(m) => Some(m),
            FfnShape::Dense { .. } => None,
        }
    }
}

/// The rows of one pass through the layers: `n` rows, made of one [`Span`] per sequence in the
/// pass. Row-wise operations (norms, products, activations) run over all `n` rows at once —
/// every weight is read once for every sequence —; the operations that read a sequence's
/// caches (RoPE, the KV cache, attention, the recurrence) run span by span.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub n: usize,
    pub spans: &'a [Span<'a>],
}

/// One sequence's rows in a pass: `n` tokens in cache slots `pos0 ..` of sequence `seq` (the
/// executor's index), which are the `ring_step0`-th .. tokens of their evaluation (the ring
/// advances only when an evaluation is committed). Without `tree` the slots are the tokens'
/// positions; with it, see [`Tree`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span<'a> {
    pub seq: usize,
    pub n: usize,
    pub pos0: usize,
    pub ring_step0: usize,
    /// Rows `logit_from .. n` of the span get logits (`n` for none).
    pub logit_from: usize,
    pub tree: Option<Tree<'a>>,
}

/// An evaluation whose tokens form a tree (tree speculation): row `e` of the evaluation (its
/// `ring_step0 + i`-th for row `i` of a span) sits in cache slot `base + e` but is at position
/// `base + depths[e]`, and sees the cache before `base` and its own ancestors only, so it gets
/// the bits of the path to it evaluated alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tree<'a> {
    /// Per row of the evaluation, its parent's row, or [`specula_plugin_api::TREE_ROOT`].
    pub parents: &'a [u32],
    /// Per row of the evaluation, its depth (0 for a root).
    pub depths: &'a [u32],
}

impl Tree<'_> {
    /// The rows from a root down to `row`, in order (`row` last).
    pub fn path(&self, row: usize) -> Vec<usize> {
        let mut path = vec![row];
        let mut at = row;
        while let Some(&parent) = self.parents.get(at).filter(|&&p| p != TREE_ROOT) {
            at = parent as usize;
            path.push(at);
        }
        path.reverse();
        path
    }

    /// The recurrent state row `row` starts from, as a step after the live state: its
    /// parent's (step `parent + 1`), or the live one (0) for a root.
    pub fn read_step(&self, row: usize) -> usize {
        match self.parents[row] {
            TREE_ROOT => 0,
            parent => parent as usize + 1,
        }
    }
}

impl Span<'_> {
    /// The position of row `i` (its RoPE position; its cache slot without a tree).
    pub fn position(&self, i: usize) -> usize {
        match &self.tree {
            None => self.pos0 + i,
            Some(tree) => {
                let base = self.pos0 - self.ring_step0;
                base + tree.depths[self.ring_step0 + i] as usize
            }
        }
    }
}

impl<'a> Rows<'a> {
    /// The rows of `spans`, in order.
    pub fn new(spans: &'a [Span<'a>]) -> Self {
        Self {
            n: spans.iter().map(|s| s.n).sum(),
            spans,
        }
    }

    /// Each span with the index of its first row in the pass.
    pub fn with_offsets(&self) -> impl Iterator<Item = (usize, &'a Span<'a>)> + 'a {
        self.spans.iter().scan(0, |first, span| {
            let at = *first;
            *first += span.n;
            Some((at, span))
        })
    }

    /// Rows that get logits.
    pub fn logit_rows(&self) -> usize {
        self.spans.iter().map(|s| s.n - s.logit_from.min(s.n)).sum()
    }
}

/// Which attention cache a layer keeps its keys and values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// The trunk's cache of attention layer `i` (counting the model's attention layers only).
    Trunk(usize),
    /// The MTP head's own one-layer cache.
    Mtp,
}

/// An attention layer's cache, and how a row's cache index relates to its RoPE position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSlot {
    pub cache: Cache,
    /// RoPE position minus cache index: 0 in the trunk; 1 for the MTP head, whose entry `p`
    /// holds the token of position `p + 1`.
    pub rope_offset: usize,
}

impl KvSlot {
    /// The trunk's attention layer `i`.
    pub fn trunk(i: usize) -> Self {
        Self {
            cache: Cache::Trunk(i),
            rope_offset: 0,
        }
    }

    /// The MTP head's attention.
    pub const MTP: KvSlot = KvSlot {
        cache: Cache::Mtp,
        rope_offset: 1,
    };
}

/// Where [`LayerOps::qk_norm_rope`] finds the query heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Query {
    /// Plain query heads, normalised and rotated in place.
    Plain(Act),
    /// Query and output gate projected together (the [`Act::QGate`] layout): the query halves
    /// are normalised and rotated into `into` (plain query heads); the gates stay where they
    /// are for [`LayerOps::attend`].
    Gated { from: Act, into: Act },
}

/// The per-head RMSNorm weights of queries and keys (qwen3, the gated attention).
#[derive(Debug, Clone, Copy)]
pub struct QkNorms<'w> {
    pub q: &'w Vector,
    pub k: &'w Vector,
}

/// Where a Gated DeltaNet layer's projections are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnInputs {
    /// The mixed `[q | k | v]` channels ([`Act::Mixed`]).
    pub mixed: Act,
    /// The output gate `z` ([`Act::Z`]).
    pub z: Act,
    pub beta_alpha: BetaAlphaRows,
}

/// Where a Gated DeltaNet layer's betas and alphas are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BetaAlphaRows {
    /// In two buffers (qwen35's `ssm_beta` / `ssm_alpha`).
    Separate { beta: Act, alpha: Act },
    /// In one buffer of the [`Act::BetaAlpha`] layout (qwen3next's `ssm_ba`).
    Grouped(Act),
}

/// The operations a model graph is written in. Every operation works on the first
/// `rows.n` rows of the buffers it names; widths are the buffers' ([`Act::width`]) unless an
/// operation says otherwise.
///
/// An implementation must compute each row exactly as a one-row pass at its position would,
/// whatever else is in the pass.
pub trait LayerOps {
    /// `dst = src / rms(src) · weight` per row, over `weight.len()` columns from each side's
    /// first column (`src` and `dst` may be the same columns).
    fn rms_norm(
        &mut self,
        src: Cols,
        weight: &Vector,
        dst: Cols,
        rows: &Rows,
    ) -> Result<(), PluginError>;

    /// `dst = w · src` per row (`src` rows of `w.cols`, `dst` rows of `w.rows`).
    fn matmul(
        &mut self,
        w: &MatrixRef,
        src: Act,
        dst: Act,
        rows: &Rows,
    ) -> Result<(), PluginError> {
        self.matmul_many(src, &[(w, dst)], rows)
    }

    /// Several matrices times the same rows of `src` (a layer's q/k/v projections, an FFN's
    /// gate and up), each into its own buffer: each result is what [`matmul`](Self::matmul)
    /// gives, but `src` may be prepared (quantised) once for all of them.
    fn matmul_many(
        &mut self,
        src: Act,
        jobs: &[(&MatrixRef, Act)],
        rows: &Rows,
    ) -> Result<(), PluginError>;

    /// `dst += bias` per row.
    fn add_bias(&mut self, dst: Act, bias: &Vector, rows: &Rows) -> Result<(), PluginError>;

    /// `dst += src` (the residual connections).
    fn add(&mut self, dst: Act, src: Act, rows: &Rows) -> Result<(), PluginError>;

    /// `gate = silu(gate) · up` (the SwiGLU activation).
    fn swiglu(&mut self, gate: Act, up: Act, rows: &Rows) -> Result<(), PluginError>;

    /// Per head of every row: the optional RMSNorm of `norms`, then the model's RoPE at the
    /// row's position (its cache index plus `slot.rope_offset`), on the query heads (`q`) and
    /// the key heads (`k`, in place).
    fn qk_norm_rope(
        &mut self,
        q: Query,
        k: Act,
        norms: Option<QkNorms<'_>>,
        slot: KvSlot,
        rows: &Rows,
    ) -> Result<(), PluginError>;

    /// Writes the rows' keys and values into `slot`'s cache at their positions.
    fn store_kv(&mut self, slot: KvSlot, k: Act, v: Act, rows: &Rows) -> Result<(), PluginError>;

    /// Softmax attention of the query heads `q` over `slot`'s cache: row `i` sees positions
    /// `0 ..= pos0 + i`, query head `h` reads key/value head `h / (n_head / n_head_kv)`, scores
    /// are scaled by `1 / sqrt(head_dim)`. With `gate` (a buffer of the [`Act::QGate`] layout)
    /// each head's output is multiplied by `sigmoid` of its gate. Into `dst` ([`Act::Attn`]).
    fn attend(
        &mut self,
        slot: KvSlot,
        q: Act,
        gate: Option<Act>,
        dst: Act,
        rows: &Rows,
    ) -> Result<(), PluginError>;

    /// The Gated DeltaNet recurrence of the model's GDN layer `ring` (its index among the GDN
    /// layers) after its projections: the causal convolution over the conv state, the L2
    /// norms, the delta rule over each value head's state, the output norm and gate. Row `i`
    /// reads the state left by the row before it (the first, the state of its ring step) and
    /// writes its own to the snapshot ring. Into `dst` ([`Act::GdnOut`]).
    fn gated_delta_net(
        &mut self,
        w: &GdnWeights,
        ring: usize,
        inputs: GdnInputs,
        dst: Act,
        rows: &Rows,
    ) -> Result<(), PluginError>;

    /// The mixture-of-experts FFN of `src` (normalised rows) into `dst`: routing, the chosen
    /// experts' SwiGLU outputs weighted and summed in rank order, the gated shared expert.
    fn moe(&mut self, w: &MoeWeights, src: Act, dst: Act, rows: &Rows) -> Result<(), PluginError>;

    /// The LM head: `output · hidden` of each span's rows from its
    /// [`logit_from`](Span::logit_from) into the pass's logits (one row of `n_vocab` per such
    /// row, in row order).
    fn logits(&mut self, output: &MatrixRef, hidden: Act, rows: &Rows) -> Result<(), PluginError>;
}

/// An error for a graph whose weights and architecture disagree (a bug, not bad input: the
/// loader checks every weight an architecture needs).
pub fn graph_error(what: &str) -> PluginError {
    PluginError::new(ErrorKind::Internal, format!("model graph: {what}"))
}
