//! The recurrent state of a hybrid model and its snapshot ring.
//!
//! A Gated DeltaNet layer carries state from token to token: the last `conv_kernel - 1` inputs
//! of its causal convolution and one S×S matrix per value head. All GDN layers' states at one
//! sequence length form a **plane**. The ring keeps the states of the last `depth` lengths
//! whether they came from one verify batch or from single-token evaluations, and rolling back
//! to any of them is O(1) or one rebuilt matrix per head, never a re-decode:
//!
//! - The convolution states (small) sit in a ring of `depth + 1` planes: the token that takes
//!   the sequence from length `L` to `L + 1` reads the plane of `L` and writes the next one.
//! - The S matrices (large: ~19 MB per plane for a 0.8B model) are written only where a chain
//!   of rows ends; the rows before keep their rank-one steps and are rebuilt from them, bit for
//!   bit, when a rollback lands on one ([`SnapshotRing`]). Their planes are taken as needed,
//!   so a speculating sequence touches a few of them rather than one per draft position.
//!
//! A batch row and a single-token evaluation run exactly the same arithmetic on exactly the
//! same input. Lengths further back than `depth` tokens are forgotten; the backend takes its
//! slow path for those (see `Backend::truncate_to` in `crate::backend`).
//!
//! Storage is ordered for the way the recurrence runs: a layer's convolution states are
//! consecutive planes, and each value head's S matrices in every plane are one contiguous
//! slice ([`SnapshotRing::layer_heads_mut`]), so the heads of a layer run in parallel, each
//! over all tokens of an evaluation with its own matrix hot in cache, from one borrow.

use std::collections::BTreeMap;

use specula_kernels::aligned::AlignedVec;
use specula_kernels::delta_rule;
use specula_plugin_api::{ErrorKind, PluginError};

/// Sizes of the per-layer recurrent state, in f32 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLayout {
    /// GDN layers.
    pub n_layers: usize,
    /// Convolution state per layer: `(conv_kernel - 1) × conv_channels`.
    pub conv_len: usize,
    /// Value heads per layer, each with one S matrix.
    pub n_heads: usize,
    /// Values of one head's S matrix: `S × S`.
    pub head_len: usize,
}

impl StateLayout {
    /// S matrices per layer: `n_heads × S × S`.
    pub fn ssm_len(&self) -> usize {
        self.n_heads * self.head_len
    }

    /// Values of one layer's state.
    pub fn layer_len(&self) -> usize {
        self.conv_len + self.ssm_len()
    }

    /// Values of one plane (every layer).
    pub fn plane_len(&self) -> usize {
        self.n_layers * self.layer_len()
    }

    /// Bytes of one plane: what one snapshot slot costs.
    pub fn plane_bytes(&self) -> u64 {
        4 * self.plane_len() as u64
    }
}

/// Of `planes` (consecutive planes of `len` values), plane `read` and plane `write` (which
/// must differ), the second mutably: a token's state in and state out.
pub fn read_write(
    planes: &mut [f32],
    len: usize,
    read: usize,
    write: usize,
) -> (&[f32], &mut [f32]) {
    assert_ne!(read, write, "a state is never updated in place");
    if read < write {
        let (a, b) = planes.split_at_mut(write * len);
        (&a[read * len..][..len], &mut b[..len])
    } else {
        let (a, b) = planes.split_at_mut(read * len);
        (&b[..len], &mut a[write * len..][..len])
    }
}

/// How the ring came out of [`SnapshotRing::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSize {
    /// The depth asked for.
    pub requested: usize,
    /// The depth allocated (at least 1).
    pub depth: usize,
}

/// The bookkeeping of a snapshot ring: which plane holds the state of which sequence length.
///
/// Shared by the host ring ([`SnapshotRing`]: its convolution planes and its window) and rings
/// kept in other memory (a GPU backend's device ring), so every ring advances, restores and
/// forgets states by the same rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingIndex {
    n_planes: usize,
    /// Plane holding the state at `len`.
    live: usize,
    /// Sequence length of the live state.
    len: usize,
    /// The shortest length whose state is still in the ring.
    oldest: usize,
}

impl RingIndex {
    /// The index of an empty sequence in a ring of `n_planes` planes (at least 2).
    pub fn new(n_planes: usize) -> Self {
        assert!(n_planes >= 2, "a snapshot ring needs at least 2 planes");
        Self {
            n_planes,
            live: 0,
            len: 0,
            oldest: 0,
        }
    }

    /// Planes in the ring (`depth + 1`).
    pub fn n_planes(&self) -> usize {
        self.n_planes
    }

    /// How many tokens back the ring can restore.
    pub fn depth(&self) -> usize {
        self.n_planes - 1
    }

    /// Sequence length of the live state.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The plane holding the live state.
    pub fn live_plane(&self) -> usize {
        self.live
    }

    /// The lengths whose states the ring holds: `oldest ..= len`.
    pub fn window(&self) -> std::ops::RangeInclusive<usize> {
        self.oldest..=self.len
    }

    /// For the `step`-th token after the live state: the plane holding the state at length
    /// `len + step` (read) and the plane that receives length `len + step + 1` (written).
    pub fn step_planes(&self, step: usize) -> (usize, usize) {
        let read = (self.live + step) % self.n_planes;
        (read, (read + 1) % self.n_planes)
    }

    /// The plane of the `step`-th state after the live one (step 0: the live plane).
    pub fn plane_of(&self, step: usize) -> usize {
        (self.live + step) % self.n_planes
    }

    /// For row `row` of a tree evaluation whose parent's state is the `read`-th after the live
    /// state (0 for a root): the plane it reads and the plane it writes (step `row + 1`).
    pub fn tree_planes(&self, read: usize, row: usize) -> (usize, usize) {
        (self.plane_of(read), self.plane_of(row + 1))
    }

    /// Makes the state after `n` more tokens the live one.
    pub fn advance(&mut self, n: usize) {
        self.live = (self.live + n) % self.n_planes;
        self.len += n;
        self.oldest = self.oldest.max(self.len.saturating_sub(self.depth()));
    }

    /// Makes the state at length `len` live again, if the ring still holds it. O(1).
    pub fn restore(&mut self, len: usize) -> bool {
        if !self.window().contains(&len) {
            return false;
        }
        let back = self.len - len;
        self.live = (self.live + self.n_planes - back % self.n_planes) % self.n_planes;
        self.len = len;
        true
    }

    /// Back to the empty sequence (the owner zeroes the live plane).
    pub fn reset(&mut self) {
        self.len = 0;
        self.oldest = 0;
    }

    /// Makes the live plane the state at length `len`, with no snapshot before it (the owner
    /// has written that state into the live plane).
    pub fn start_at(&mut self, len: usize) {
        self.len = len;
        self.oldest = len;
    }
}

/// One sequence's recurrent state at one length, outside a ring: what the prefix cache keeps
/// at block boundaries, so that a new sequence starting with the same tokens starts from it
/// instead of re-running them. Filled layer by layer as a pass reaches the boundary
/// ([`SnapshotRing::save_layer`]); complete once every layer holds the same length.
#[derive(Debug)]
pub struct StatePlane {
    layout: StateLayout,
    /// Convolution states, `[layer][conv_len]`.
    conv: Vec<f32>,
    /// S matrices, `[layer][head][head_len]`.
    ssm: Vec<f32>,
    /// Per layer: the sequence length whose state it holds (0: none).
    lens: Vec<usize>,
}

impl StatePlane {
    /// An empty plane for `layout`, or `None` when the memory cannot be had (mapped lazily:
    /// a plane never written occupies no memory).
    pub fn new(layout: StateLayout) -> Option<Self> {
        Some(Self {
            layout,
            conv: specula_kernels::aligned::try_zeroed_vec(layout.n_layers * layout.conv_len)?,
            ssm: specula_kernels::aligned::try_zeroed_vec(layout.n_layers * layout.ssm_len())?,
            lens: vec![0; layout.n_layers],
        })
    }

    /// The length whose state every layer holds, if they all hold the same one.
    pub fn state_len(&self) -> Option<usize> {
        let first = *self.lens.first()?;
        (first > 0 && self.lens.iter().all(|&l| l == first)).then_some(first)
    }

    /// Forgets what it holds (a new pass fills it again).
    pub fn clear(&mut self) {
        self.lens.fill(0);
    }

    /// Bytes of state it holds.
    pub fn n_bytes(&self) -> u64 {
        self.layout.plane_bytes()
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }
}

/// The recurrent state of one sequence: its convolution states in a ring of `depth + 1`
/// planes ([`RingIndex`]), and its S matrices at every length the ring can restore, each held
/// in a plane or recorded as the rank-one steps that lead to it from one.
///
/// A chain of rows (a verify pass, a prefill's runs of up to [`ChainPlan`]'s run length)
/// writes only its last row's S matrices; the rows before it keep their decay, key and one
/// `δ` per state row (1 KiB per head and row instead of a 64 KiB matrix), from which a state
/// is rebuilt exactly ([`delta_rule::replay`]: the chain's own multiply and fused multiply-add
/// per value) when a restore lands on it. Planes are taken lowest first and freed as soon as
/// no restorable length needs them, so a sequence that speculates in chains touches a few
/// planes, not one per draft position; the ring allocates `depth + 4` (mapped lazily: a
/// plane never written occupies no memory), enough for a tree of `depth` rows beside a full
/// window.
#[derive(Debug)]
pub struct SnapshotRing {
    layout: StateLayout,
    /// Convolution states, `[layer][plane][conv_len]`.
    conv: Vec<f32>,
    /// S matrices, `[layer][head][plane][head_len]`, on a cache line so that the delta rule's
    /// 64-byte row loads and stores (rows of S values, S a multiple of 16) each touch one line.
    ssm: AlignedVec<f32>,
    /// Planes of S matrices.
    n_ssm_planes: usize,
    index: RingIndex,
    /// Per layer: where the S matrices of each restorable length are.
    held: Vec<HeldStates>,
}

/// Values of one head's recorded step: the decay, `key_dim` keys, one `δ` per state row.
fn record_stride(head_len: usize, key_dim: usize) -> usize {
    1 + key_dim + head_len / key_dim
}

/// Planes of S matrices beyond the ring's `depth + 1`: a chain's start kept below the window
/// as a record's base, a prefill's transient plane, and a rebuilt state.
const EXTRA_SSM_PLANES: usize = 3;

/// Where one GDN layer's S matrices of each restorable length are.
#[derive(Debug, Clone, Default)]
struct HeldStates {
    at: BTreeMap<usize, Held>,
    records: BTreeMap<usize, Record>,
    next_id: usize,
    /// The ring's depth: a record this long is not continued.
    depth: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Plane(usize),
    /// By record `id`: step `len - base` of it.
    Recorded(usize),
}

/// The rank-one steps of a chain's rows from the state at `base` (held in a plane while any
/// length refers to the record).
#[derive(Debug, Clone)]
struct Record {
    base: usize,
    steps: usize,
    /// Keys per head (`S`).
    key_dim: usize,
    /// Values of one step (every head's).
    step_values: usize,
    /// `[step][head]`: the decay, `key_dim` keys, one `δ` per state row.
    updates: Vec<f32>,
}

impl HeldStates {
    /// When the state at `start` is only recorded, by a record ending there and shorter than
    /// the ring's depth: that record and its base.
    fn recorded_tail(&self, start: usize) -> Option<(usize, usize)> {
        let Some(&Held::Recorded(id)) = self.at.get(&start) else {
            return None;
        };
        let r = &self.records[&id];
        (r.base + r.steps == start && r.steps < self.depth).then_some((id, r.base))
    }

    /// The record a chain starting at `start` may continue: the one ending there, its base
    /// fewer than the ring's depth back.
    fn tail(&self, start: usize) -> Option<usize> {
        let (&id, _) = self
            .records
            .iter()
            .find(|(_, r)| r.base + r.steps == start && r.steps < self.depth)?;
        Some(id)
    }

    fn at(len: usize, plane: usize, depth: usize) -> Self {
        Self {
            at: BTreeMap::from([(len, Held::Plane(plane))]),
            depth,
            ..Self::default()
        }
    }

    fn plane(&self, len: usize) -> Option<usize> {
        match self.at.get(&len) {
            Some(&Held::Plane(p)) => Some(p),
            _ => None,
        }
    }

    /// The lowest plane no length holds and `taken` does not name.
    fn free_plane(&self, n_planes: usize, taken: &[usize]) -> usize {
        let mut used = vec![false; n_planes];
        for held in self.at.values() {
            if let Held::Plane(p) = held {
                used[*p] = true;
            }
        }
        for &p in taken {
            used[p] = true;
        }
        used.iter()
            .position(|u| !u)
            .expect("snapshot ring: every S-matrix plane is in use")
    }

    /// Forgets every length after `len`, and the recorded steps past it (a path rolled back:
    /// a chain from `len` must not continue them).
    fn cut(&mut self, len: usize) {
        self.at.retain(|&l, _| l <= len);
        self.records.retain(|_, r| r.base < len);
        for r in self.records.values_mut() {
            r.steps = r.steps.min(len - r.base);
            r.updates.truncate(r.steps * r.step_values);
        }
    }

    /// Forgets the lengths `keep` rejects (a plane that is the base of a record some kept
    /// length refers to stays), and the records no length refers to.
    fn retain(&mut self, keep: impl Fn(usize) -> bool) {
        self.at
            .retain(|&len, held| keep(len) || matches!(held, Held::Plane(_)));
        let live: std::collections::BTreeSet<usize> = self
            .at
            .values()
            .filter_map(|held| match held {
                Held::Recorded(id) => Some(*id),
                Held::Plane(_) => None,
            })
            .collect();
        // The record that ends at the newest length is kept too while the next chain may
        // continue it.
        let newest = self.at.keys().next_back().copied();
        let depth = self.depth;
        self.records.retain(|id, r| {
            live.contains(id) || Some(r.base + r.steps) == newest && r.steps < depth
        });
        let bases: std::collections::BTreeSet<usize> =
            self.records.values().map(|r| r.base).collect();
        self.at.retain(|&len, held| {
            keep(len) || matches!(held, Held::Plane(_)) && bases.contains(&len)
        });
    }
}

/// The recorded steps a chain replays before its rows ([`SnapshotRing::layer_states`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Prefix<'a> {
    /// `[step][head]`: the decay, `key_dim` keys, one `δ` per state row.
    updates: &'a [f32],
    heads: usize,
    key_dim: usize,
    rows: usize,
}

impl<'a> Prefix<'a> {
    /// Value head `head`'s steps.
    pub fn head(&self, head: usize) -> Vec<delta_rule::RankOne<'a>> {
        let stride = 1 + self.key_dim + self.rows;
        self.updates
            .chunks_exact(stride * self.heads.max(1))
            .map(|step| {
                let u = &step[head * stride..][..stride];
                delta_rule::RankOne {
                    decay: u[0],
                    k: &u[1..1 + self.key_dim],
                    delta: &u[1 + self.key_dim..],
                }
            })
            .collect()
    }
}

/// How one layer's chain of rows runs through its S matrices ([`SnapshotRing::plan_chain`]).
#[derive(Debug, Clone)]
pub struct ChainPlan {
    /// The sequence length the chain starts from.
    start: usize,
    /// Runs of rows, each one chain through [`delta_rule::chain`]: the rows and the plane the
    /// run reads.
    pub runs: Vec<(std::ops::Range<usize>, usize)>,
    /// Per row: the plane its S matrices are written to, if any.
    pub writes: Vec<Option<usize>>,
    /// Whether the runs record their rows' rank-one steps ([`delta_rule::chain_recorded`]).
    pub record: bool,
    /// Per row: how the ring holds its state afterwards (none: not restorable).
    keeps: Vec<Option<Keep>>,
    /// The first length restorable after the chain.
    oldest: usize,
    /// The record the chain continues (see [`SnapshotRing::plan_chain`]).
    continues: Option<usize>,
    /// The record (and how many of its steps) taking the read plane to the chain's start,
    /// when that state is only recorded ([`SnapshotRing::layer_states`]).
    prefix: Option<(usize, usize)>,
}

impl ChainPlan {
    /// One recording run of `m` rows from length `start` continuing record `id`: it reads plane
    /// `planes[0]` (taken through `prefix` first), writes its last state to `planes[1]` and
    /// records the others.
    fn continuing(
        start: usize,
        m: usize,
        oldest: usize,
        [read, write]: [usize; 2],
        id: usize,
        prefix: Option<(usize, usize)>,
    ) -> Self {
        let keeps = (0..m)
            .map(|i| match i + 1 == m {
                true => Some(Keep::Plane(write)),
                false => (start + i + 1 >= oldest).then_some(Keep::Recorded),
            })
            .collect();
        let mut writes = vec![None; m];
        writes[m - 1] = Some(write);
        Self {
            start,
            runs: vec![(0..m, read)],
            writes,
            record: true,
            keeps,
            oldest,
            continues: Some(id),
            prefix,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    Plane(usize),
    Recorded,
}

impl SnapshotRing {
    /// Allocates a ring of `depth` snapshots plus the live plane, all zero (the state of the
    /// empty sequence).
    ///
    /// At most `budget_bytes` go to the `depth + 1` planes when given (the 3 spare planes of S
    /// matrices come on top, written only by trees and long prefills), and a failed
    /// allocation is retried with fewer planes: the depth is then smaller than asked (the caller warns and advertises
    /// it). Fewer than two planes cannot run the recurrence, which is an `OutOfMemory` error.
    pub fn allocate(
        layout: StateLayout,
        depth: usize,
        budget_bytes: Option<u64>,
    ) -> Result<(Self, RingSize), PluginError> {
        let plane_bytes = layout.plane_bytes().max(1);
        let mut n_planes = depth.saturating_add(1);
        if let Some(budget) = budget_bytes {
            n_planes = n_planes.min(usize::try_from(budget / plane_bytes).unwrap_or(usize::MAX));
        }
        let too_small = |n: usize| {
            PluginError::new(
                ErrorKind::OutOfMemory,
                format!(
                    "the recurrent-state ring needs at least 2 slots of {plane_bytes} bytes; {}",
                    match budget_bytes {
                        Some(b) if n < 2 => format!("the budget of {b} bytes holds {n}"),
                        _ => "allocating them failed".to_string(),
                    }
                ),
            )
        };
        if n_planes < 2 {
            return Err(too_small(n_planes));
        }
        let allocate = |n_planes: usize| {
            // Zeroed lazily: planes a run never reaches occupy no memory.
            let conv = specula_kernels::aligned::try_zeroed_vec(
                n_planes.checked_mul(layout.n_layers * layout.conv_len)?,
            )?;
            let ssm = AlignedVec::try_zeroed(
                (n_planes + EXTRA_SSM_PLANES).checked_mul(layout.n_layers * layout.ssm_len())?,
            )?;
            Some((conv, ssm))
        };
        let (conv, ssm) = loop {
            match allocate(n_planes) {
                Some(states) => break states,
                None if n_planes > 2 => n_planes = n_planes / 2 + 1,
                None => return Err(too_small(n_planes)),
            }
        };
        let ring = Self {
            layout,
            conv,
            ssm,
            n_ssm_planes: n_planes + EXTRA_SSM_PLANES,
            index: RingIndex::new(n_planes),
            held: vec![HeldStates::at(0, 0, n_planes - 1); layout.n_layers],
        };
        let size = RingSize {
            requested: depth,
            depth: n_planes - 1,
        };
        Ok((ring, size))
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    /// The ring's bookkeeping (which length is live, which convolution plane holds which).
    pub fn index(&self) -> &RingIndex {
        &self.index
    }

    /// How many tokens back the ring can restore.
    pub fn depth(&self) -> usize {
        self.index.depth()
    }

    /// Sequence length of the live state.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The lengths whose states the ring holds: `oldest ..= len`.
    pub fn window(&self) -> std::ops::RangeInclusive<usize> {
        self.index.window()
    }

    /// Bytes of all planes the ring may write.
    pub fn n_bytes(&self) -> u64 {
        4 * (self.conv.len() + self.ssm.as_slice().len()) as u64
    }

    /// Layer `layer`'s convolution states, one plane after another.
    fn conv_planes(&mut self, layer: usize) -> &mut [f32] {
        let len = self.index.n_planes() * self.layout.conv_len;
        &mut self.conv[layer * len..][..len]
    }

    /// For the `step`-th token after the live state: layer `layer`'s convolution state at
    /// length `len + step` (read) and the one it writes for length `len + step + 1`.
    ///
    /// Steps of one evaluation run in order per layer, so a plane that wraps around
    /// (evaluations longer than the ring) is only overwritten after it has been read.
    pub fn conv_io(&mut self, layer: usize, step: usize) -> (&[f32], &mut [f32]) {
        let (read, write) = self.index.step_planes(step);
        let len = self.layout.conv_len;
        read_write(self.conv_planes(layer), len, read, write)
    }

    /// Layer `layer`'s convolution states for a tree row ([`RingIndex::tree_planes`]): the
    /// parent's state (step `read`) and the row's own (step `row + 1`).
    pub fn conv_tree_io(&mut self, layer: usize, read: usize, row: usize) -> (&[f32], &mut [f32]) {
        let (read, write) = self.index.tree_planes(read, row);
        let len = self.layout.conv_len;
        read_write(self.conv_planes(layer), len, read, write)
    }

    /// Layer `layer`'s convolution state at length `len + step` (what the `step`-th token
    /// after the live state reads).
    pub fn conv_state(&self, layer: usize, step: usize) -> &[f32] {
        let (read, _) = self.index.step_planes(step);
        let len = self.layout.conv_len;
        let planes = self.index.n_planes() * len;
        &self.conv[layer * planes + read * len..][..len]
    }

    /// Layer `layer`'s S matrices, head after head: each value head's matrix in every plane
    /// is one slice of [`SnapshotRing::head_planes_len`] values (plane `p` at `p · head_len`;
    /// the planes a chain or tree reads and writes come from [`SnapshotRing::plan_chain`] and
    /// [`SnapshotRing::plan_tree`]), so `chunks_exact_mut` hands each head its own.
    pub fn layer_heads_mut(&mut self, layer: usize) -> &mut [f32] {
        let len = self.layout.n_heads * self.head_planes_len();
        &mut self.ssm.as_mut_slice()[layer * len..][..len]
    }

    /// [`SnapshotRing::layer_heads_mut`] and, for a chain whose plan starts from a recorded
    /// state, the recorded steps from the plane it reads to that state.
    pub fn layer_states(&mut self, layer: usize, plan: &ChainPlan) -> (&mut [f32], Prefix<'_>) {
        let len = self.layout.n_heads * self.head_planes_len();
        let states = &mut self.ssm.as_mut_slice()[layer * len..][..len];
        let prefix = match plan.prefix {
            Some((id, steps)) => {
                let r = &self.held[layer].records[&id];
                Prefix {
                    updates: &r.updates[..steps * r.step_values],
                    heads: self.layout.n_heads,
                    key_dim: r.key_dim,
                    rows: self.layout.head_len / r.key_dim,
                }
            }
            None => Prefix::default(),
        };
        (states, prefix)
    }

    /// Values of one head's slice of [`SnapshotRing::layer_heads_mut`]: its matrix in every
    /// plane.
    pub fn head_planes_len(&self) -> usize {
        self.n_ssm_planes * self.layout.head_len
    }

    /// How layer `layer` runs `m` rows from the `step0`-th state after the live one as chains
    /// of at most `max_run` rows: their state written only where it must be (a run's last
    /// row), the rest recorded (`record`, when the CPU has the recording kernel) or, without
    /// it, written for the lengths the ring must be able to restore. Makes that starting
    /// state a plane and frees the planes of lengths the evaluation takes out of the window.
    /// Run it, then hand the plan to [`SnapshotRing::commit_chain`].
    pub fn plan_chain(
        &mut self,
        layer: usize,
        step0: usize,
        m: usize,
        max_run: usize,
        record: bool,
    ) -> ChainPlan {
        let start = self.index.len() + step0;
        let oldest = self.oldest_after(start + m);
        // A short chain from a state only recorded (the live state after a rollback) reads the
        // record's base plane and replays the recorded steps in registers first
        // ([`delta_rule::chain_recorded`]'s prefix), continuing the record; its last state goes
        // to a plane of its own. A rollback then costs no rebuild.
        let short = record && m <= max_run && oldest <= start;
        if let Some((id, base)) = self.held[layer].recorded_tail(start).filter(|_| short) {
            self.held[layer].cut(start);
            self.held[layer].retain(|len| len >= oldest || len == start);
            let held = &self.held[layer];
            let read = held
                .plane(base)
                .expect("snapshot ring: a record's base is a plane");
            let fresh = held.free_plane(self.n_ssm_planes, &[]);
            let prefix = Some((id, start - base));
            return ChainPlan::continuing(start, m, oldest, [read, fresh], id, prefix);
        }
        let read0 = self.prepare(layer, start, oldest);
        let held = &self.held[layer];
        // A short chain from the end of a record younger than the ring's depth continues it:
        // the starting state, rebuilt from the record when needed, is overwritten in place by
        // the chain's last one. So a run of evaluations (single tokens, verify passes) keeps
        // its states in one base plane, the live plane and their records.
        let continues = short.then(|| held.tail(start)).flatten();
        if let Some(id) = continues {
            return ChainPlan::continuing(start, m, oldest, [read0, read0], id, None);
        }
        let n_planes = self.n_ssm_planes;
        let mut taken = Vec::new();
        let take = |taken: &mut Vec<usize>| {
            let p = held.free_plane(n_planes, taken);
            taken.push(p);
            p
        };
        let max_run = max_run.max(1);
        // Whether the run of rows `a ..` keeps a record (of a row the ring must keep, or the
        // last run's, which the next chain may continue): its start is then the record's base.
        let depth = self.index.depth();
        let records_kept = |a: usize| {
            let b = (a + max_run).min(m);
            record && (b == m && b - a < depth || b > a + 1 && start + b > oldest)
        };
        let (mut writes, mut keeps) = (vec![None; m], vec![None; m]);
        let (mut runs, mut read, mut transient) = (Vec::new(), read0, None);
        let mut a = 0;
        while a < m {
            let b = (a + max_run).min(m);
            for i in a..b - 1 {
                if start + i + 1 >= oldest {
                    if record {
                        keeps[i] = Some(Keep::Recorded);
                    } else {
                        let p = take(&mut taken);
                        (writes[i], keeps[i]) = (Some(p), Some(Keep::Plane(p)));
                    }
                }
            }
            let last = b - 1;
            if start + b >= oldest || (b < m && records_kept(b)) {
                let p = take(&mut taken);
                (writes[last], keeps[last]) = (Some(p), Some(Keep::Plane(p)));
            } else {
                // A state no one restores: one plane for all of them, each run written over
                // the one before (a chain may write the plane it reads).
                let p = *transient.get_or_insert_with(|| take(&mut taken));
                writes[last] = Some(p);
            }
            runs.push((a..b, read));
            read = writes[last].expect("a run's last row is written");
            a = b;
        }
        ChainPlan {
            start,
            runs,
            writes,
            record,
            keeps,
            oldest,
            continues: None,
            prefix: None,
        }
    }

    /// Records what a chain planned by [`SnapshotRing::plan_chain`] left: the planes it wrote
    /// and, with `updates` (`[head][row]`: the decay, `key_dim` keys and one `δ` per state
    /// row, as [`delta_rule::chain_recorded`] gave them), its recorded rows.
    pub fn commit_chain(
        &mut self,
        layer: usize,
        plan: &ChainPlan,
        updates: &[f32],
        key_dim: usize,
    ) {
        let m = plan.writes.len();
        let stride = record_stride(self.layout.head_len, key_dim);
        let heads = self.layout.n_heads;
        let held = &mut self.held[layer];
        // Rows `rows`' steps, `[step][head]`, appended to `kept`.
        let steps_of = |rows: std::ops::Range<usize>, kept: &mut Vec<f32>| {
            for i in rows {
                for h in 0..heads {
                    kept.extend_from_slice(&updates[(h * m + i) * stride..][..stride]);
                }
            }
        };
        let last_run = plan.runs.len().saturating_sub(1);
        for (run, (rows, _)) in plan.runs.iter().enumerate() {
            let recorded = || {
                rows.clone()
                    .filter(|&i| plan.keeps[i] == Some(Keep::Recorded))
            };
            // A record for the run's recorded rows, and for the last run in any case (the
            // next chain may continue it).
            if !plan.record || (run != last_run && recorded().next().is_none()) {
                continue;
            }
            let id = match plan.continues {
                Some(id) => {
                    let record = held.records.get_mut(&id).expect("a continued record");
                    steps_of(rows.clone(), &mut record.updates);
                    record.steps += rows.len();
                    // The starting state was overwritten: its record holds it now.
                    held.at.insert(plan.start, Held::Recorded(id));
                    id
                }
                None => {
                    let mut kept = Vec::with_capacity(heads * rows.len() * stride);
                    steps_of(rows.clone(), &mut kept);
                    let id = held.next_id;
                    held.next_id += 1;
                    let record = Record {
                        base: plan.start + rows.start,
                        steps: rows.len(),
                        key_dim,
                        step_values: heads * stride,
                        updates: kept,
                    };
                    held.records.insert(id, record);
                    id
                }
            };
            for i in recorded() {
                held.at.insert(plan.start + i + 1, Held::Recorded(id));
            }
        }
        for (i, keep) in plan.keeps.iter().enumerate() {
            if let Some(Keep::Plane(p)) = keep {
                held.at.insert(plan.start + i + 1, Held::Plane(*p));
            }
        }
        let oldest = plan.oldest;
        held.retain(|len| len >= oldest);
    }

    /// The planes of a tree evaluation of `m` rows from the `step0`-th state after the live
    /// one, in layer `layer`: `[k]` holds the state at step `k` for `k <= step0` (the tree's
    /// base and its rows an earlier pass evaluated, which a row here may start from), and
    /// `[step0 + i + 1]` receives row `i`'s. Every row's state is written (a later row may
    /// start from any); hand them to [`SnapshotRing::commit_tree`] once the rows ran.
    pub fn plan_tree(&mut self, layer: usize, step0: usize, m: usize) -> Vec<usize> {
        let len = self.index.len();
        let start = len + step0;
        let oldest = self.oldest_after(start + m);
        let read = self.prepare(layer, start, oldest);
        let held = &self.held[layer];
        let mut planes: Vec<usize> = (0..step0)
            .map(|k| {
                held.plane(len + k)
                    .expect("snapshot ring: a tree's earlier states are planes")
            })
            .collect();
        planes.push(read);
        for _ in 0..m {
            let p = held.free_plane(self.n_ssm_planes, &planes);
            planes.push(p);
        }
        planes
    }

    /// Records the planes of a tree evaluation ([`SnapshotRing::plan_tree`]): row `i`'s state
    /// as the state at the `step0 + i + 1`-th length after the live one.
    pub fn commit_tree(&mut self, layer: usize, step0: usize, planes: &[usize]) {
        let start = self.index.len() + step0;
        let rows = &planes[step0 + 1..];
        let oldest = self.oldest_after(start + rows.len());
        let held = &mut self.held[layer];
        for (i, &p) in rows.iter().enumerate() {
            held.at.insert(start + i + 1, Held::Plane(p));
        }
        held.retain(|len| len >= oldest);
    }

    /// The first length the ring still restores once it reaches length `end`.
    fn oldest_after(&self, end: usize) -> usize {
        end.saturating_sub(self.index.depth())
            .max(*self.index.window().start())
    }

    /// Before an evaluation of layer `layer` from length `start`: that state in a plane
    /// (returned), later lengths forgotten, and lengths before `oldest` freed.
    fn prepare(&mut self, layer: usize, start: usize, oldest: usize) -> usize {
        let read = self.materialize(layer, start);
        let held = &mut self.held[layer];
        held.cut(start);
        held.retain(|len| len >= oldest || len == start);
        read
    }

    /// The plane holding layer `layer`'s S matrices at length `len`, rebuilt from its record
    /// into a free plane if it was recorded.
    fn materialize(&mut self, layer: usize, len: usize) -> usize {
        let held = &self.held[layer];
        let id = match held.at.get(&len) {
            Some(&Held::Plane(p)) => return p,
            Some(&Held::Recorded(id)) => id,
            None => panic!("snapshot ring: layer {layer} holds no state at length {len}"),
        };
        let record = &held.records[&id];
        let from = held
            .plane(record.base)
            .expect("snapshot ring: a record's base is a plane");
        let to = held.free_plane(self.n_ssm_planes, &[]);
        let (head_len, heads, base, key_dim) = (
            self.layout.head_len,
            self.layout.n_heads,
            record.base,
            record.key_dim,
        );
        let stride = record_stride(head_len, key_dim);
        let rows = head_len / key_dim;
        let updates = std::mem::take(
            &mut self.held[layer]
                .records
                .get_mut(&id)
                .expect("a held record")
                .updates,
        );
        let per_head = self.head_planes_len();
        for (h, planes) in self
            .layer_heads_mut(layer)
            .chunks_exact_mut(per_head)
            .enumerate()
        {
            let replayed: Vec<delta_rule::RankOne<'_>> = (0..len - base)
                .map(|i| {
                    let u = &updates[(i * heads + h) * stride..][..stride];
                    delta_rule::RankOne {
                        decay: u[0],
                        k: &u[1..1 + key_dim],
                        delta: &u[1 + key_dim..1 + key_dim + rows],
                    }
                })
                .collect();
            let (state_in, state_out) = read_write(planes, head_len, from, to);
            delta_rule::replay(&replayed, state_in, state_out);
        }
        let held = &mut self.held[layer];
        held.records.get_mut(&id).expect("a held record").updates = updates;
        held.at.insert(len, Held::Plane(to));
        to
    }

    /// After a tree of `n` rows was evaluated and the ring advanced past it: makes the states
    /// of the tree rows `path` (a root-to-node path; row `r` wrote step `r + 1`) the states at
    /// the lengths after the tree's start, in order, the last one live — as if the path alone
    /// had been evaluated. Needs `n` within the ring's depth (the tree's states all kept).
    /// With `boundary` (a length the path reaches, and a plane), the state at that length is
    /// copied into the plane too, as a pass crossing it would ([`Self::save_layer`]).
    pub fn keep_path(
        &mut self,
        n: usize,
        path: &[u32],
        boundary: Option<(usize, &mut StatePlane)>,
    ) {
        let base = self.index.len() - n;
        assert!(
            n <= self.index.depth() && self.index.restore(base),
            "snapshot ring: a tree of {n} rows does not fit a ring of depth {}",
            self.index.depth()
        );
        let conv_len = self.layout.conv_len;
        for (k, &row) in path.iter().enumerate() {
            let (from, to) = (
                self.index.plane_of(row as usize + 1),
                self.index.plane_of(k + 1),
            );
            if from != to {
                for layer in 0..self.layout.n_layers {
                    self.conv_planes(layer)
                        .copy_within(from * conv_len..(from + 1) * conv_len, to * conv_len);
                }
            }
        }
        // The S matrices change lengths, not planes.
        for held in &mut self.held {
            let rows: Vec<Held> = path
                .iter()
                .map(|&row| held.at[&(base + row as usize + 1)])
                .collect();
            held.cut(base);
            for (k, row) in rows.into_iter().enumerate() {
                held.at.insert(base + k + 1, row);
            }
        }
        if let Some((at, plane)) = boundary {
            assert!(
                at > base && at <= base + path.len(),
                "snapshot ring: length {at} is not on the kept path"
            );
            for layer in 0..self.layout.n_layers {
                self.save_layer(layer, at - base, plane, at);
            }
        }
        self.advance(path.len());
    }

    /// Makes the state after `n` more tokens (written through [`SnapshotRing::conv_io`] and
    /// the chains' and trees' plans) the live one.
    pub fn advance(&mut self, n: usize) {
        self.index.advance(n);
        self.forget_before_window();
    }

    fn forget_before_window(&mut self) {
        let oldest = *self.index.window().start();
        for held in &mut self.held {
            held.retain(|len| len >= oldest);
        }
    }

    /// Makes the state at length `len` live again, if the ring still holds it. O(1): a state
    /// only recorded is rebuilt by whatever reads it next (a chain replays the record first).
    pub fn restore(&mut self, len: usize) -> bool {
        if !self.index.restore(len) {
            return false;
        }
        for held in &mut self.held {
            held.cut(len);
        }
        true
    }

    /// Makes this ring hold what `other` holds (every restorable state and which length each
    /// holds): a forked sequence keeps its parent's state and rollback window.
    ///
    /// # Panics
    ///
    /// If the rings differ in layout or depth.
    pub fn copy_from(&mut self, other: &Self) {
        assert!(
            self.layout == other.layout
                && self.index.n_planes() == other.index.n_planes()
                && self.n_ssm_planes == other.n_ssm_planes,
            "snapshot ring: copying a ring of another shape"
        );
        self.conv.copy_from_slice(&other.conv);
        let (head_len, per_head) = (self.layout.head_len, self.head_planes_len());
        for (layer, held) in other.held.iter().enumerate() {
            let len = self.layout.n_heads * per_head;
            let src = &other.ssm.as_slice()[layer * len..][..len];
            let dst = &mut self.ssm.as_mut_slice()[layer * len..][..len];
            for held in held.at.values() {
                if let Held::Plane(p) = *held {
                    for (d, s) in dst
                        .chunks_exact_mut(per_head.max(1))
                        .zip(src.chunks_exact(per_head.max(1)))
                    {
                        d[p * head_len..][..head_len]
                            .copy_from_slice(&s[p * head_len..][..head_len]);
                    }
                }
            }
        }
        self.held.clone_from(&other.held);
        self.index = other.index;
    }

    /// Copies layer `layer`'s state at length `len + step` (what the `step`-th token after the
    /// live state reads) into `plane`, as the state at sequence length `at`.
    pub fn save_layer(&mut self, layer: usize, step: usize, plane: &mut StatePlane, at: usize) {
        assert_eq!(
            plane.layout, self.layout,
            "snapshot ring: a plane of another shape"
        );
        let (conv_len, head_len) = (self.layout.conv_len, self.layout.head_len);
        plane.conv[layer * conv_len..][..conv_len].copy_from_slice(self.conv_state(layer, step));
        let read = self.materialize(layer, self.index.len() + step);
        let per_head = self.head_planes_len();
        let heads = self.layout.n_heads;
        let layer_heads = &self.ssm.as_slice()[layer * heads * per_head..][..heads * per_head];
        let dst = &mut plane.ssm[layer * heads * head_len..][..heads * head_len];
        for (d, planes) in dst
            .chunks_exact_mut(head_len.max(1))
            .zip(layer_heads.chunks_exact(per_head.max(1)))
        {
            d.copy_from_slice(&planes[read * head_len..][..head_len]);
        }
        plane.lens[layer] = at;
    }

    /// Makes the complete `plane` the live state, as the state at its length, with no
    /// snapshot before it. Returns that length, or `None` (and changes nothing) when the
    /// plane is not complete.
    pub fn load(&mut self, plane: &StatePlane) -> Option<usize> {
        assert_eq!(
            plane.layout, self.layout,
            "snapshot ring: a plane of another shape"
        );
        let len = plane.state_len()?;
        let live = self.index.live_plane();
        let (conv_len, head_len) = (self.layout.conv_len, self.layout.head_len);
        let per_head = self.head_planes_len();
        for layer in 0..self.layout.n_layers {
            self.conv_planes(layer)[live * conv_len..][..conv_len]
                .copy_from_slice(&plane.conv[layer * conv_len..][..conv_len]);
            let heads = self.layout.n_heads;
            let src = &plane.ssm[layer * heads * head_len..][..heads * head_len];
            for (planes, s) in self
                .layer_heads_mut(layer)
                .chunks_exact_mut(per_head.max(1))
                .zip(src.chunks_exact(head_len.max(1)))
            {
                planes[..head_len].copy_from_slice(s);
            }
            self.held[layer] = HeldStates::at(len, 0, self.index.depth());
        }
        self.index.start_at(len);
        Some(len)
    }

    /// Back to the empty sequence: the live state zeroed, every snapshot forgotten.
    pub fn reset(&mut self) {
        let live = self.index.live_plane();
        let (conv_len, head_len) = (self.layout.conv_len, self.layout.head_len);
        let per_head = self.head_planes_len();
        for layer in 0..self.layout.n_layers {
            self.conv_planes(layer)[live * conv_len..][..conv_len].fill(0.0);
            for head in self
                .layer_heads_mut(layer)
                .chunks_exact_mut(per_head.max(1))
            {
                head[..head_len].fill(0.0);
            }
            self.held[layer] = HeldStates::at(0, 0, self.index.depth());
        }
        self.index.reset();
    }

    /// The live S matrix of value head `head` of layer `layer`.
    pub fn live_head(&mut self, layer: usize, head: usize) -> &[f32] {
        let len = self.layout.head_len;
        let plane = self.materialize(layer, self.index.len());
        let first = (layer * self.layout.n_heads + head) * self.head_planes_len();
        &self.ssm.as_slice()[first + plane * len..][..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: StateLayout = StateLayout {
        n_layers: 2,
        conv_len: 3,
        n_heads: 2,
        head_len: 2,
    };

    /// Writes `value` into every element of every layer for one step (the S matrices as the
    /// previous state plus `value` minus the previous state, so the read is exercised).
    fn step(ring: &mut SnapshotRing, step: usize, value: f32) {
        for layer in 0..LAYOUT.n_layers {
            let (_, dst) = ring.conv_io(layer, step);
            dst.fill(value);
            let plan = ring.plan_chain(layer, step, 1, 16, false);
            let (read, write) = (plan.runs[0].1, plan.writes[0].unwrap());
            let per_head = ring.head_planes_len();
            for head in ring.layer_heads_mut(layer).chunks_exact_mut(per_head) {
                let (src, dst) = read_write(head, LAYOUT.head_len, read, write);
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = s + (value - s);
                }
            }
            ring.commit_chain(layer, &plan, &[], 1);
        }
    }

    /// Every value of the live state of every layer.
    fn live(ring: &mut SnapshotRing) -> Vec<f32> {
        let mut values = Vec::new();
        for l in 0..LAYOUT.n_layers {
            values.extend_from_slice(ring.conv_state(l, 0));
            for h in 0..LAYOUT.n_heads {
                values.extend_from_slice(ring.live_head(l, h));
            }
        }
        values
    }

    #[test]
    fn steps_write_the_next_plane_and_restore_selects_one() {
        let (mut ring, size) = SnapshotRing::allocate(LAYOUT, 3, None).unwrap();
        assert_eq!(
            size,
            RingSize {
                requested: 3,
                depth: 3
            }
        );
        // Convolution states in 4 planes, S matrices in 4 + 3.
        assert_eq!(ring.n_bytes(), 4 * (4 * 2 * 3 + 7 * 2 * 2 * 2));
        for i in 0..5 {
            step(&mut ring, 0, (i + 1) as f32);
            ring.advance(1);
        }
        assert_eq!(ring.len(), 5);
        assert_eq!(ring.window(), 2..=5);
        assert_eq!(live(&mut ring), [5.0; 14]);
        assert!(!ring.restore(1));
        assert!(ring.restore(3));
        assert_eq!(live(&mut ring), [3.0; 14]);
        assert_eq!(ring.window(), 2..=3);
        // A batch of 2 from length 3 overwrites the planes of 4 and 5.
        step(&mut ring, 0, 40.0);
        step(&mut ring, 1, 50.0);
        ring.advance(2);
        assert_eq!(live(&mut ring), [50.0; 14]);
        assert!(ring.restore(4));
        assert_eq!(live(&mut ring), [40.0; 14]);
        assert!(ring.restore(2));
        assert_eq!(live(&mut ring), [2.0; 14]);
        ring.reset();
        assert_eq!((ring.len(), ring.window()), (0, 0..=0));
        assert_eq!(live(&mut ring), [0.0; 14]);
    }

    #[test]
    fn a_long_evaluation_keeps_the_last_depth_states() {
        let (mut ring, _) = SnapshotRing::allocate(LAYOUT, 2, None).unwrap();
        for s in 0..7 {
            step(&mut ring, s, (s + 1) as f32);
        }
        ring.advance(7);
        assert_eq!(ring.window(), 5..=7);
        assert!(ring.restore(5));
        assert_eq!(live(&mut ring), [5.0; 14]);
    }

    /// Recorded chains of one token and of several keep a window of 8 lengths in a few
    /// planes: the record's base, the live state and their neighbours, not one per length.
    #[test]
    fn recorded_chains_touch_a_few_planes() {
        let (mut ring, _) = SnapshotRing::allocate(LAYOUT, 8, None).unwrap();
        let stride = record_stride(LAYOUT.head_len, 1);
        let mut touched = std::collections::BTreeSet::new();
        for m in [
            1, 1, 3, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1,
        ] {
            for layer in 0..LAYOUT.n_layers {
                let plan = ring.plan_chain(layer, 0, m, 16, true);
                touched.extend(plan.writes.iter().flatten().copied());
                let updates = vec![0.0; LAYOUT.n_heads * m * stride];
                ring.commit_chain(layer, &plan, &updates, 1);
            }
            ring.advance(m);
            assert_eq!(ring.window().count(), ring.len().min(8) + 1);
        }
        assert!(touched.len() <= 4, "planes written: {touched:?}");
    }

    #[test]
    fn the_budget_limits_the_depth() {
        let plane = LAYOUT.plane_bytes();
        let (ring, size) = SnapshotRing::allocate(LAYOUT, 8, Some(3 * plane + 1)).unwrap();
        assert_eq!(
            size,
            RingSize {
                requested: 8,
                depth: 2
            }
        );
        assert_eq!(ring.depth(), 2);
        let err = SnapshotRing::allocate(LAYOUT, 8, Some(plane)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::OutOfMemory);
        assert!(err.message.contains("at least 2 slots"), "{}", err.message);
    }
}
