//! Typed launches of the kernels in `kernels/*.cu`: each function passes its arguments in the
//! order of the kernel's C signature and picks the launch shape its comment documents.

use specula_engine::kv_cache::KvType;
use specula_gguf::GgmlType;
use specula_kernels::{ActivationFormat, Rope, RopeMode, WeightType};
use specula_plugin_api::{ErrorKind, PluginError};

use super::weights::{kernel_suffix, DevExperts, DevMatrix, DevVec};
use super::{int, Arg, DevBuf, Gpu};

/// Weight rows per matmul block and activation rows per block (MM_WARPS, MM_COLS in
/// matvec.cu).
const MM_WARPS: usize = 4;
const MM_COLS: usize = 8;
/// Query rows per attention launch: the score scratch holds this many rows.
pub const ATTENTION_ROWS: usize = 8;
/// Block size of the row-wise kernels (rms_norm, attention, moe_route, element-wise).
const ROW_BLOCK: u32 = 256;
const ATTENTION_BLOCK: u32 = 128;

fn blocks(n: usize, per: usize) -> u32 {
    u32::try_from(n.div_ceil(per)).expect("grid dimension fits in u32")
}

fn internal(message: String) -> PluginError {
    PluginError::new(ErrorKind::Internal, message)
}

/// Power of two >= n (at least 32, at most 1024).
fn block_for(n: usize) -> u32 {
    n.next_power_of_two().clamp(32, 1024) as u32
}

/// How the kernels of weight type `ty` take their activation rows: exactly as cpu-simd's
/// kernels do (f32, or quantised to Q8_0 / Q8_K on the device first).
fn activations(ty: GgmlType) -> ActivationFormat {
    WeightType::from_ggml(ty).map_or(ActivationFormat::F32, WeightType::activation)
}

/// Quantised activation rows for the quantised weight types (quantize_q8_0's or
/// quantize_q8_k's outputs).
#[derive(Debug)]
pub struct Q8Scratch {
    /// The quants, row-major like the f32 rows.
    pub q: DevBuf<i8>,
    /// Block scales: one per 32 values (Q8_0) or per 256 (Q8_K).
    pub d: DevBuf<f32>,
    /// Q8_K only: the sum of each 32 quants.
    pub sums: DevBuf<i32>,
}

impl Q8Scratch {
    /// Room for `values` activation values (a multiple of 32).
    pub fn new(gpu: &Gpu, values: usize) -> Result<Self, PluginError> {
        Ok(Self {
            q: gpu.zeros(values)?,
            d: gpu.zeros(values.div_ceil(32))?,
            sums: gpu.zeros(values.div_ceil(32))?,
        })
    }

    /// Device bytes of a scratch for `values` values.
    pub fn bytes(values: usize) -> u64 {
        (values + 8 * values.div_ceil(32)) as u64
    }

    /// Quantises the `values` f32 activations at `x` as the kernels of weight type `ty` take
    /// them (nothing to do for the float types).
    pub fn quantize_for(
        &self,
        gpu: &Gpu,
        ty: GgmlType,
        x: u64,
        values: usize,
    ) -> Result<(), PluginError> {
        let format = activations(ty);
        if format == ActivationFormat::F32 {
            return Ok(());
        }
        let block = if format == ActivationFormat::Q8K {
            256
        } else {
            32
        };
        if values > self.q.len() || !values.is_multiple_of(block) {
            return Err(internal(format!(
                "cuda-hybrid: {values} activations are not whole {block}-value blocks within the quantisation scratch of {}",
                self.q.len()
            )));
        }
        let n_blocks = values / block;
        let mut args = vec![
            Arg::Ptr(x),
            Arg::U64(n_blocks as u64),
            Arg::Ptr(self.q.ptr()),
            Arg::Ptr(self.d.ptr()),
        ];
        let name = if format == ActivationFormat::Q8K {
            args.push(Arg::Ptr(self.sums.ptr()));
            "quantize_q8_k"
        } else {
            "quantize_q8_0"
        };
        gpu.launch(name, (blocks(n_blocks, 4), 1, 1), 128, &args)
    }

    /// The activation arguments of a quantised matmul kernel: quants, scales, sums.
    fn args(&self) -> [Arg; 3] {
        [
            Arg::Ptr(self.q.ptr()),
            Arg::Ptr(self.d.ptr()),
            Arg::Ptr(self.sums.ptr()),
        ]
    }
}

fn suffix(ty: GgmlType) -> Result<&'static str, PluginError> {
    kernel_suffix(ty).ok_or_else(|| {
        PluginError::unsupported(format!(
            "cuda-hybrid: no GPU kernel for {} weights (supported: {})",
            ty.name(),
            specula_kernels::WeightType::list()
        ))
    })
}

/// The activation arguments of a matmul of `ty` over `x_rows` rows of `cols` at `x`: the f32
/// rows themselves, or their quantised form in `q8` (quantised there first unless `quantised`).
fn activation_args(
    gpu: &Gpu,
    ty: GgmlType,
    (x, x_rows, cols): (u64, usize, usize),
    q8: &Q8Scratch,
    quantised: bool,
) -> Result<Vec<Arg>, PluginError> {
    if activations(ty) == ActivationFormat::F32 {
        return Ok(vec![Arg::Ptr(x)]);
    }
    if !quantised {
        q8.quantize_for(gpu, ty, x, x_rows * cols)?;
    }
    Ok(q8.args().to_vec())
}

/// `out[b * rows + r] = dot(w row r, x row b)` for the `n` activation rows at `x`
/// (`n × w.cols` f32) into `out` (`n × w.rows`). Quantised weight types quantise the rows into
/// `q8` first.
pub fn matmul(
    gpu: &Gpu,
    w: &DevMatrix,
    x: u64,
    n: usize,
    out: u64,
    q8: &Q8Scratch,
) -> Result<(), PluginError> {
    matmul_many(gpu, x, n, &[(w, out)], q8)
}

/// [`matmul`] of several matrices with the same `n` activation rows at `x` (a layer's q, k
/// and v projections, an FFN's gate and up): the rows are quantised once for consecutive
/// matrices that take the same activation format, not once per matrix. No output may overlap
/// `x`.
pub fn matmul_many(
    gpu: &Gpu,
    x: u64,
    n: usize,
    jobs: &[(&DevMatrix, u64)],
    q8: &Q8Scratch,
) -> Result<(), PluginError> {
    if n == 0 {
        return Ok(());
    }
    let mut quantised_for = None;
    for &(w, out) in jobs {
        if w.cols != jobs[0].0.cols {
            return Err(internal(format!(
                "cuda-hybrid: matrices of {} and {} columns share activation rows",
                jobs[0].0.cols, w.cols
            )));
        }
        let format = activations(w.ty);
        let quantised = quantised_for == Some(format);
        // The narrowest kernel that holds the n rows: the same bits, fewer registers.
        let (kind, per_block) = match n {
            1 => ("matvec", 1),
            2 => ("matmul2", 2),
            3 | 4 => ("matmul4", 4),
            _ => ("matmul", MM_COLS),
        };
        let name = format!("{kind}_{}", suffix(w.ty)?);
        let mut args = vec![
            Arg::Ptr(w.ptr),
            Arg::U64(w.row_bytes as u64),
            int(w.rows),
            int(w.cols),
        ];
        args.extend(activation_args(gpu, w.ty, (x, n, w.cols), q8, quantised)?);
        args.extend([int(n), Arg::Ptr(out)]);
        if format != ActivationFormat::F32 {
            quantised_for = Some(format);
        }
        let grid = (blocks(w.rows, MM_WARPS), blocks(n, per_block), 1);
        gpu.launch(&name, grid, (32 * MM_WARPS) as u32, &args)?;
    }
    Ok(())
}

/// Expert mat-vecs: for pair p < `pairs`, `out[p] = experts[ids[p]] · x[p / x_div]`
/// (`x` rows of `w.cols`, `out` rows of `w.rows`). `x_rows` is how many rows `x` has.
#[allow(clippy::too_many_arguments)]
pub fn matmul_ids(
    gpu: &Gpu,
    w: &DevExperts,
    ids: u64,
    pairs: usize,
    x: u64,
    x_rows: usize,
    x_div: usize,
    out: u64,
    q8: &Q8Scratch,
) -> Result<(), PluginError> {
    if pairs == 0 {
        return Ok(());
    }
    let name = format!("matmul_ids_{}", suffix(w.ty)?);
    let mut args = vec![
        Arg::Ptr(w.ptr),
        Arg::U64(w.row_bytes as u64),
        Arg::U64(w.matrix_bytes as u64),
        int(w.rows),
        int(w.cols),
        Arg::Ptr(ids),
    ];
    args.extend(activation_args(gpu, w.ty, (x, x_rows, w.cols), q8, false)?);
    args.extend([int(x_div), Arg::Ptr(out)]);
    let grid = (blocks(w.rows, MM_WARPS), blocks(pairs, 1), 1);
    gpu.launch(&name, grid, (32 * MM_WARPS) as u32, &args)
}

/// RMSNorm of `rows` rows of `n` values (`x + r * x_stride`) with weight `w` into
/// `out + r * out_stride` (may equal `x`).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: u64,
    x_stride: usize,
    w: &DevVec,
    eps: f32,
    n: usize,
    rows: usize,
    out: u64,
    out_stride: usize,
) -> Result<(), PluginError> {
    gpu.launch(
        "rms_norm",
        (blocks(rows, 1), 1, 1),
        ROW_BLOCK,
        &[
            Arg::Ptr(x),
            Arg::U64(x_stride as u64),
            Arg::Ptr(w.ptr),
            Arg::F32(eps),
            int(n),
            Arg::Ptr(out),
            Arg::U64(out_stride as u64),
        ],
    )
}

/// The device form of a model's RoPE settings.
#[derive(Debug, Clone, Copy)]
pub struct DevRope {
    pub mode: i32,
    pub n_rot: usize,
    pub theta_scale: f32,
    pub freq_scale: f32,
    /// `rope_freqs` on the device, or 0.
    pub freq_factors: u64,
    pub sections: [i32; 4],
    pub interleaved: bool,
}

impl DevRope {
    /// From the CPU settings (`freq_factors` already uploaded when the rope has them).
    pub fn new(rope: &Rope, freq_factors: Option<&DevVec>) -> Self {
        let (mode, sections, interleaved) = match rope.mode {
            RopeMode::Normal => (0, [0; 4], false),
            RopeMode::NeoX => (1, [0; 4], false),
            RopeMode::MultiSection(s) => (2, s.sections.map(|v| v as i32), s.interleaved),
        };
        Self {
            mode,
            n_rot: rope.n_rot,
            // Exactly the CPU's expression, so the angles match bit for bit.
            theta_scale: rope.freq_base.powf(-2.0 / rope.n_rot as f32),
            freq_scale: rope.freq_scale,
            freq_factors: freq_factors.map_or(0, |v| v.ptr),
            sections,
            interleaved,
        }
    }
}

/// Where the heads of a q/k norm + RoPE pass are.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub ptr: u64,
    pub row_stride: usize,
    pub head_stride: usize,
}

/// The positions of a RoPE launch's rows.
#[derive(Debug, Clone, Copy)]
pub enum Positions {
    /// Row `r` at `pos0 + r`.
    From(usize),
    /// Row `r` at the RoPE position of its entry in the row table at this address
    /// ([`AttentionRows`]).
    PerRow(u64),
}

/// Per-head RMSNorm (when `norm` is given) and RoPE of `n_heads` heads of `head_dim` in each
/// of `rows` rows, row `r` at its position (`positions`) plus `pos_offset`.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    gpu: &Gpu,
    input: Heads,
    output: Heads,
    n_heads: usize,
    rows: usize,
    head_dim: usize,
    norm: Option<&DevVec>,
    eps: f32,
    positions: Positions,
    pos_offset: usize,
    rope: &DevRope,
) -> Result<(), PluginError> {
    let (per_row, pos0) = match positions {
        Positions::From(pos0) => (0, pos0),
        Positions::PerRow(ptr) => (ptr, 0),
    };
    if head_dim > 1024 {
        return Err(internal(format!(
            "cuda-hybrid: head size {head_dim} exceeds the RoPE kernel's 1024"
        )));
    }
    gpu.launch(
        "qk_norm_rope",
        (blocks(n_heads, 1), blocks(rows, 1), 1),
        block_for(head_dim),
        &[
            Arg::Ptr(input.ptr),
            Arg::U64(input.row_stride as u64),
            int(input.head_stride),
            Arg::Ptr(output.ptr),
            Arg::U64(output.row_stride as u64),
            int(output.head_stride),
            int(head_dim),
            Arg::Ptr(norm.map_or(0, |v| v.ptr)),
            Arg::F32(eps),
            Arg::Ptr(per_row),
            int(pos0),
            int(pos_offset),
            int(rope.n_rot),
            Arg::I32(rope.mode),
            Arg::F32(rope.theta_scale),
            Arg::F32(rope.freq_scale),
            Arg::Ptr(rope.freq_factors),
            Arg::I32(rope.sections[0]),
            Arg::I32(rope.sections[1]),
            Arg::I32(rope.sections[2]),
            Arg::I32(rope.sections[3]),
            Arg::I32(i32::from(rope.interleaved)),
        ],
    )
}

/// Shape of an attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttentionDims {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub scale: f32,
}

/// The output gate of gated attention: `sigmoid(gate)` values per row and head.
#[derive(Debug, Clone, Copy)]
pub struct Gate {
    pub ptr: u64,
    pub row_stride: usize,
    pub head_stride: usize,
}

/// A KV cache layer on the device: its keys and values (cache rows of `k_width` / `v_width`
/// values of type `ty`) and the block table of the sequence at hand (position `p` is cache row
/// `table[p / 64] · 64 + p % 64`; an unpaged cache has the identity table). [`attention`] and
/// [`kv_store`] read the keys and values from here and the tables from their
/// [`AttentionRows`], which may span several sequences.
#[derive(Debug, Clone, Copy)]
pub struct KvLayer {
    pub ty: KvType,
    pub keys: u64,
    pub values: u64,
    pub table: u64,
}

/// Stores the `rows.n` rows of `width` f32 values at `src` (each at its row's cache position
/// in its sequence, through the tables of `rows`) into the cache rows at `dst`, of type `kv`.
pub fn kv_store(
    gpu: &Gpu,
    kv: KvType,
    src: u64,
    width: usize,
    rows: AttentionRows,
    dst: u64,
) -> Result<(), PluginError> {
    let (kernel, threads) = match kv {
        KvType::F32 => ("kv_store", rows.n * width),
        KvType::F16 => ("kv_store_f16", rows.n * width),
        // A thread per 32-value block.
        KvType::Q8_0 => ("kv_store_q8_0", rows.n * width / 32),
    };
    gpu.launch(
        kernel,
        (blocks(threads, ROW_BLOCK as usize), 1, 1),
        ROW_BLOCK,
        &[
            Arg::Ptr(src),
            Arg::U64(rows.n as u64),
            Arg::U64(width as u64),
            Arg::Ptr(rows.info),
            Arg::Ptr(rows.tables),
            Arg::U64(rows.table_stride as u64),
            Arg::Ptr(dst),
        ],
    )
}

/// Ints per row of a pass's row table ([`AttentionRows`]; ROW_INFO in kernels/common.cuh).
pub const ROW_INFO: usize = 5;

/// The rows of an [`attention`] launch, which may belong to different sequences: per row
/// [`ROW_INFO`] ints at `info` — its sequence slot, its cache position, where its tree path
/// starts in `paths` (-1: a chain row, which sees positions 0 ..= its own), its tree's first
/// position and its RoPE position ([`qk_norm_rope`]) — and where the block tables are: sequence `s`'s at `tables + 4 * s *
/// table_stride` (an unpaged cache: an identity table and `table_stride` 0). `max_keys` is the
/// most keys a row sees.
#[derive(Debug, Clone, Copy)]
pub struct AttentionRows {
    pub info: u64,
    pub n: usize,
    pub tables: u64,
    pub table_stride: usize,
    pub paths: u64,
    pub max_keys: usize,
}

/// The row table of `n` chain rows of sequence slot `seq` at positions `pos0 ..`.
pub fn chain_rows(seq: usize, pos0: usize, n: usize) -> Vec<i32> {
    (0..n)
        .flat_map(|i| [seq as i32, (pos0 + i) as i32, -1, 0, (pos0 + i) as i32])
        .collect()
}

/// Attention of the query rows `q` of `rows` over the cache layer `kv` (its keys and values;
/// the tables come with the rows), into `out` (`rows.n × n_head × value_dim`), in launches of
/// [`ATTENTION_ROWS`] rows; `scores` holds `ATTENTION_ROWS × n_head × score_stride` floats.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    dims: &AttentionDims,
    q: Heads,
    kv: KvLayer,
    rows: AttentionRows,
    scores: &DevBuf<f32>,
    score_stride: usize,
    gate: Option<Gate>,
    out: u64,
) -> Result<(), PluginError> {
    if dims.head_dim > 1024 {
        return Err(internal(format!(
            "cuda-hybrid: head size {} exceeds the attention kernel's 1024",
            dims.head_dim
        )));
    }
    if rows.max_keys > score_stride || scores.len() < ATTENTION_ROWS * dims.n_head * score_stride {
        return Err(internal(format!(
            "cuda-hybrid: attention over {} positions exceeds the score scratch",
            rows.max_keys
        )));
    }
    let out_row = dims.n_head * dims.value_dim;
    let mut first = 0;
    while first < rows.n {
        let m = ATTENTION_ROWS.min(rows.n - first);
        let gate_args = match gate {
            Some(g) => [
                Arg::Ptr(g.ptr + (4 * first * g.row_stride) as u64),
                Arg::U64(g.row_stride as u64),
                int(g.head_stride),
            ],
            None => [Arg::Ptr(0), Arg::U64(0), Arg::I32(0)],
        };
        gpu.launch(
            match kv.ty {
                KvType::F32 => "attention",
                KvType::F16 => "attention_f16",
                KvType::Q8_0 => "attention_q8_0",
            },
            (blocks(dims.n_head, 1), blocks(m, 1), 1),
            ATTENTION_BLOCK,
            &[
                Arg::Ptr(q.ptr + (4 * first * q.row_stride) as u64),
                Arg::U64(q.row_stride as u64),
                int(q.head_stride),
                Arg::Ptr(rows.tables),
                Arg::U64(rows.table_stride as u64),
                Arg::Ptr(rows.info + (4 * first * ROW_INFO) as u64),
                Arg::Ptr(rows.paths),
                Arg::Ptr(kv.keys),
                Arg::Ptr(kv.values),
                int(dims.n_head),
                int(dims.n_head_kv),
                int(dims.head_dim),
                int(dims.value_dim),
                Arg::F32(dims.scale),
                Arg::Ptr(scores.ptr()),
                Arg::U64(score_stride as u64),
                gate_args[0],
                gate_args[1],
                gate_args[2],
                Arg::Ptr(out + (4 * first * out_row) as u64),
            ],
        )?;
        first += m;
    }
    Ok(())
}

/// Where a Gated DeltaNet layer's state is in a sequence's device ring. (The kernels take
/// the ring's address from each run, [`GdnRun::planes`], and the layout from here.)
#[derive(Debug, Clone, Copy)]
pub struct RingSlot {
    pub planes: u64,
    pub plane_len: usize,
    pub n_planes: usize,
    /// Offset of the layer's state inside a plane.
    pub layer_offset: usize,
    /// Length of the layer's conv state (its S matrices follow).
    pub conv_len: usize,
}

/// Words per run in a Gated DeltaNet launch's run table (`GdnRun` in kernels/common.cuh).
pub const GDN_RUN: usize = 5;

/// One run of a Gated DeltaNet launch: `rows` consecutive rows of one sequence, from row
/// `first` of the pass, whose ring planes are at `planes`; its first row reads plane `start`,
/// row `t` writes plane `write + t` when given (a run of a tree's rows, each the child of the
/// one before), else `start + 1 + t`. A launch's runs are independent of each other (at most
/// one per sequence), and a run has fewer rows than the ring has planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnRun {
    pub planes: u64,
    pub first: usize,
    pub rows: usize,
    pub start: usize,
    pub write: Option<usize>,
}

impl GdnRun {
    /// The run as its words in a run table.
    pub fn words(&self) -> [i64; GDN_RUN] {
        [
            self.planes as i64,
            self.first as i64,
            self.rows as i64,
            self.start as i64,
            self.write.map_or(-1, |w| w as i64),
        ]
    }
}

/// The runs of one Gated DeltaNet launch: `count` runs ([`GdnRun::words`]) at device address
/// `table`, none of more than `max_rows` rows.
#[derive(Debug, Clone, Copy)]
pub struct GdnRuns {
    pub table: u64,
    pub count: usize,
    pub max_rows: usize,
}

/// The causal convolution of the rows of `runs` (the pass's rows `mixed`, into the pass's
/// rows `out`), each run's first token reading its start plane and every token writing its
/// own (see [`GdnRun`]), in layer `ring`'s part of each plane.
#[allow(clippy::too_many_arguments)]
pub fn gdn_conv(
    gpu: &Gpu,
    mixed: u64,
    taps: &DevVec,
    ring: &RingSlot,
    runs: &GdnRuns,
    kernel: usize,
    channels: usize,
    out: u64,
) -> Result<(), PluginError> {
    if runs.max_rows >= ring.n_planes {
        return Err(internal(format!(
            "cuda-hybrid: {} convolution steps in one run, but the ring has {} planes",
            runs.max_rows, ring.n_planes
        )));
    }
    gpu.launch(
        "gdn_conv",
        (
            blocks(channels, 128),
            blocks(runs.max_rows, 1),
            blocks(runs.count, 1),
        ),
        128,
        &[
            Arg::Ptr(mixed),
            Arg::Ptr(taps.ptr),
            Arg::Ptr(runs.table),
            Arg::U64(ring.plane_len as u64),
            Arg::U64(ring.layer_offset as u64),
            int(ring.n_planes),
            int(kernel),
            int(channels),
            Arg::Ptr(out),
        ],
    )
}

/// L2 norm of the q and k heads of `rows` convolved rows (q also scaled by `q_scale`).
#[allow(clippy::too_many_arguments)]
pub fn gdn_qk_l2norm(
    gpu: &Gpu,
    x: u64,
    rows: usize,
    channels: usize,
    n_k_heads: usize,
    head_dim: usize,
    eps: f32,
    q_scale: f32,
) -> Result<(), PluginError> {
    gpu.launch(
        "gdn_qk_l2norm",
        (blocks(2 * n_k_heads, 1), blocks(rows, 1), 1),
        block_for(head_dim),
        &[
            Arg::Ptr(x),
            int(channels),
            int(n_k_heads),
            int(head_dim),
            Arg::F32(eps),
            Arg::F32(q_scale),
        ],
    )
}

/// Inputs of [`gdn_recurrence`] besides the ring.
#[derive(Debug, Clone, Copy)]
pub struct GdnInputs {
    pub conv_out: u64,
    pub beta: u64,
    pub alpha: u64,
    pub grouped: bool,
    pub dt_bias: u64,
    pub ssm_a: u64,
}

/// Shape of a Gated DeltaNet layer.
#[derive(Debug, Clone, Copy)]
pub struct GdnDims {
    pub channels: usize,
    pub head_dim: usize,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// 0: tiled (qwen35), 1: interleaved (qwen3next).
    pub head_map: i32,
    pub eps: f32,
}

/// Warps per block of `gdn_recurrence` (a warp per state row) and the most state columns it
/// holds per lane (kernels/gdn.cu).
const GDN_WARPS: usize = 4;
const GDN_MAX_STATE: usize = 32 * 8;

/// The recurrence of the rows of `runs` (the pass's rows of `inputs`), each run's tokens in
/// order, the first reading its start plane and each the next the state the token before
/// wrote (see [`GdnRun`]), in layer `ring`'s part of each plane; writes each row's
/// `n_v_heads × head_dim` values to the pass's rows `out`, which [`gdn_gated_norm`] then
/// norms and gates.
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrence(
    gpu: &Gpu,
    inputs: &GdnInputs,
    dims: &GdnDims,
    ring: &RingSlot,
    runs: &GdnRuns,
    out: u64,
) -> Result<(), PluginError> {
    if runs.max_rows >= ring.n_planes {
        return Err(internal(format!(
            "cuda-hybrid: {} recurrence steps in one run, but the ring has {} planes",
            runs.max_rows, ring.n_planes
        )));
    }
    if dims.head_dim > GDN_MAX_STATE {
        return Err(internal(format!(
            "cuda-hybrid: Gated DeltaNet state size {} exceeds the kernel's {GDN_MAX_STATE}",
            dims.head_dim
        )));
    }
    gpu.launch(
        "gdn_recurrence",
        (
            blocks(dims.n_v_heads, 1),
            blocks(dims.head_dim, GDN_WARPS),
            blocks(runs.count, 1),
        ),
        (32 * GDN_WARPS) as u32,
        &[
            Arg::Ptr(inputs.conv_out),
            int(dims.channels),
            Arg::Ptr(inputs.beta),
            Arg::Ptr(inputs.alpha),
            Arg::I32(i32::from(inputs.grouped)),
            Arg::Ptr(inputs.dt_bias),
            Arg::Ptr(inputs.ssm_a),
            Arg::Ptr(runs.table),
            Arg::U64(ring.plane_len as u64),
            Arg::U64(ring.layer_offset as u64),
            Arg::U64(ring.conv_len as u64),
            int(ring.n_planes),
            int(dims.head_dim),
            int(dims.n_k_heads),
            int(dims.n_v_heads),
            Arg::I32(dims.head_map),
            Arg::Ptr(out),
        ],
    )
}

/// The gated output norm of `rows` rows of [`gdn_recurrence`]'s output, in place: each value
/// head RMS-normed, times `norm` and `silu` of the gate rows `z`.
pub fn gdn_gated_norm(
    gpu: &Gpu,
    dims: &GdnDims,
    out: u64,
    z: u64,
    norm: u64,
    rows: usize,
) -> Result<(), PluginError> {
    if dims.head_dim > 1024 {
        return Err(internal(format!(
            "cuda-hybrid: Gated DeltaNet state size {} exceeds the output norm's 1024",
            dims.head_dim
        )));
    }
    gpu.launch(
        "gdn_gated_norm",
        (blocks(dims.n_v_heads, 1), blocks(rows, 1), 1),
        dims.head_dim as u32,
        &[
            Arg::Ptr(out),
            Arg::Ptr(z),
            Arg::Ptr(norm),
            Arg::F32(dims.eps),
            int(dims.head_dim),
            int(dims.n_v_heads),
        ],
    )
}

/// Routing of `rows` rows of router logits (overwritten with probabilities).
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    gpu: &Gpu,
    logits: u64,
    rows: usize,
    n_expert: usize,
    k: usize,
    weights_scale: f32,
    ids: u64,
    weights: u64,
) -> Result<(), PluginError> {
    gpu.launch(
        "moe_route",
        (blocks(rows, 1), 1, 1),
        ROW_BLOCK,
        &[
            Arg::Ptr(logits),
            int(n_expert),
            int(k),
            Arg::F32(weights_scale),
            Arg::Ptr(ids),
            Arg::Ptr(weights),
        ],
    )
}

/// `out[r] = Σ_rank weights[r][rank] · expert_out[r·k + rank]` for `rows` rows of `n_embd`.
pub fn moe_combine(
    gpu: &Gpu,
    expert_out: u64,
    weights: u64,
    rows: usize,
    k: usize,
    n_embd: usize,
    out: u64,
) -> Result<(), PluginError> {
    gpu.launch(
        "moe_combine",
        (blocks(n_embd, ROW_BLOCK as usize), blocks(rows, 1), 1),
        ROW_BLOCK,
        &[
            Arg::Ptr(expert_out),
            Arg::Ptr(weights),
            int(k),
            int(n_embd),
            Arg::Ptr(out),
        ],
    )
}

/// `out[r] += shared[r] · sigmoid(gate[r])` for `rows` rows of `n_embd`.
pub fn add_gated(
    gpu: &Gpu,
    out: u64,
    shared: u64,
    gate: u64,
    rows: usize,
    n_embd: usize,
) -> Result<(), PluginError> {
    gpu.launch(
        "add_gated",
        (blocks(n_embd, ROW_BLOCK as usize), blocks(rows, 1), 1),
        ROW_BLOCK,
        &[Arg::Ptr(out), Arg::Ptr(shared), Arg::Ptr(gate), int(n_embd)],
    )
}

/// `dst += src` over `n` values.
pub fn add_in_place(gpu: &Gpu, dst: u64, src: u64, n: usize) -> Result<(), PluginError> {
    gpu.launch(
        "add_in_place",
        (blocks(n, ROW_BLOCK as usize), 1, 1),
        ROW_BLOCK,
        &[Arg::Ptr(dst), Arg::Ptr(src), Arg::U64(n as u64)],
    )
}

/// `x[r] += bias` for `rows` rows of `bias.len` values.
pub fn add_row_bias(gpu: &Gpu, x: u64, bias: &DevVec, rows: usize) -> Result<(), PluginError> {
    let n = rows * bias.len;
    gpu.launch(
        "add_row_bias",
        (blocks(n, ROW_BLOCK as usize), 1, 1),
        ROW_BLOCK,
        &[
            Arg::Ptr(x),
            Arg::Ptr(bias.ptr),
            Arg::U64(rows as u64),
            Arg::U64(bias.len as u64),
        ],
    )
}

/// `gate = silu(gate) · up` over `n` values.
pub fn swiglu(gpu: &Gpu, gate: u64, up: u64, n: usize) -> Result<(), PluginError> {
    gpu.launch(
        "swiglu",
        (blocks(n, ROW_BLOCK as usize), 1, 1),
        ROW_BLOCK,
        &[Arg::Ptr(gate), Arg::Ptr(up), Arg::U64(n as u64)],
    )
}
