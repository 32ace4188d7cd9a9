//! The recurrent state of a hybrid model and its snapshot ring.
//!
//! A Gated DeltaNet layer carries state from token to token: the last `conv_kernel - 1` inputs
//! of its causal convolution and one S×S matrix per value head. All GDN layers' states at one
//! sequence length form a **plane**. The ring holds `depth + 1` planes and the recurrence
//! never updates a state in place: the token that takes the sequence from length `L` to
//! `L + 1` reads the plane of `L` and writes the next plane of the ring. So after every token
//! the ring still holds the states of the previous `depth` lengths, whether they came from one
//! verify batch or from single-token evaluations, and rolling back to any of them is O(1): the
//! plane of that length becomes the live one. No state is ever copied, and a batch row and a
//! single-token evaluation run exactly the same arithmetic on exactly the same input.
//!
//! Lengths further back than `depth` tokens have been overwritten; the backend takes its slow
//! path for those (see `Backend::truncate_to` in `crate::backend`).
//!
//! Storage is ordered for the way the recurrence runs: a layer's convolution states are
//! consecutive planes, and each value head's S matrices in every plane are one contiguous
//! slice ([`SnapshotRing::layer_heads_mut`]), so the heads of a layer run in parallel, each
//! over all tokens of an evaluation with its own matrix hot in cache, from one borrow.

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
/// Shared by the host ring ([`SnapshotRing`]) and rings kept in other memory (a GPU backend's
/// device ring), so every ring advances, restores and forgets states by the same rules.
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

/// The planes of the recurrent state: the live one and the `depth` before it.
#[derive(Debug)]
pub struct SnapshotRing {
    layout: StateLayout,
    /// Convolution states, `[layer][plane][conv_len]`.
    conv: Vec<f32>,
    /// S matrices, `[layer][head][plane][head_len]`, on a cache line so that the delta rule's
    /// 64-byte row loads and stores (rows of S values, S a multiple of 16) each touch one line.
    ssm: AlignedVec<f32>,
    index: RingIndex,
    /// Per layer: the S matrices chains left unwritten ([`SnapshotRing::defer`]).
    deferred: Vec<Vec<Deferred>>,
}

/// S matrices a chain of rows did not write: the states at lengths `base + 1 ..` before its
/// last row's (which it wrote), rebuilt on demand from the written state at `base` by the
/// chain's recorded rank-one steps ([`delta_rule::replay`], bit for bit the chain's own
/// arithmetic). The convolution states of those lengths are written as usual.
#[derive(Debug, Clone)]
struct Deferred {
    /// The length whose written state the steps start from.
    base: usize,
    /// Keys per head (`S`); a head's state rows are `head_len / key_dim`.
    key_dim: usize,
    /// Recorded steps per head: step `i` takes length `base + i` to `base + i + 1`.
    steps: usize,
    /// `[head][step]`: the decay, `key_dim` keys, one `δ` per state row.
    updates: Vec<f32>,
    /// Whether the state at length `base + 1 + i` is still unwritten.
    pending: Vec<bool>,
}

impl Deferred {
    fn stride(&self, head_len: usize) -> usize {
        1 + self.key_dim + head_len / self.key_dim
    }

    /// Lengths still unwritten.
    fn lengths(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.pending.len())
            .filter(|&i| self.pending[i])
            .map(move |i| self.base + 1 + i)
    }

    fn is_pending(&self, len: usize) -> bool {
        len > self.base && self.pending.get(len - self.base - 1) == Some(&true)
    }

    fn forget(&mut self, len: usize) {
        if len > self.base {
            if let Some(p) = self.pending.get_mut(len - self.base - 1) {
                *p = false;
            }
        }
    }
}

impl SnapshotRing {
    /// Allocates a ring of `depth` snapshots plus the live plane, all zero (the state of the
    /// empty sequence).
    ///
    /// At most `budget_bytes` are used when given, and a failed allocation is retried with
    /// fewer planes: the depth is then smaller than asked (the caller warns and advertises
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
        let per_plane = [
            layout.n_layers * layout.conv_len,
            layout.n_layers * layout.ssm_len(),
        ];
        let allocate = |n_planes: usize| {
            // Zeroed lazily: planes a run never reaches occupy no memory.
            let conv =
                specula_kernels::aligned::try_zeroed_vec(n_planes.checked_mul(per_plane[0])?)?;
            let ssm = AlignedVec::try_zeroed(n_planes.checked_mul(per_plane[1])?)?;
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
            index: RingIndex::new(n_planes),
            deferred: vec![Vec::new(); layout.n_layers],
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

    /// The ring's bookkeeping (which plane holds which length).
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

    /// Bytes of all planes.
    pub fn n_bytes(&self) -> u64 {
        self.layout.plane_bytes() * self.index.n_planes() as u64
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
            n <= self.index.depth() && self.restore(base),
            "snapshot ring: a tree of {n} rows does not fit a ring of depth {}",
            self.index.depth()
        );
        let (conv_len, head_len) = (self.layout.conv_len, self.layout.head_len);
        let per_head = self.head_planes_len();
        for (k, &row) in path.iter().enumerate() {
            let (from, to) = (
                self.index.plane_of(row as usize + 1),
                self.index.plane_of(k + 1),
            );
            if from == to {
                continue;
            }
            for layer in 0..self.layout.n_layers {
                self.conv_planes(layer)
                    .copy_within(from * conv_len..(from + 1) * conv_len, to * conv_len);
                for head in self
                    .layer_heads_mut(layer)
                    .chunks_exact_mut(per_head.max(1))
                {
                    head.copy_within(from * head_len..(from + 1) * head_len, to * head_len);
                }
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
        self.index.advance(path.len());
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
    /// pick a token's pair with [`read_write`] and [`RingIndex::step_planes`]), so
    /// `chunks_exact_mut` hands each head its own. The ordering rule of
    /// [`SnapshotRing::conv_io`] holds per head.
    pub fn layer_heads_mut(&mut self, layer: usize) -> &mut [f32] {
        let len = self.layout.n_heads * self.head_planes_len();
        &mut self.ssm.as_mut_slice()[layer * len..][..len]
    }

    /// Values of one head's slice of [`SnapshotRing::layer_heads_mut`]: its matrix in every
    /// plane.
    pub fn head_planes_len(&self) -> usize {
        self.index.n_planes() * self.layout.head_len
    }

    /// Makes the state after `n` more tokens (written through [`SnapshotRing::conv_io`] and
    /// [`SnapshotRing::layer_heads_mut`]) the live one.
    pub fn advance(&mut self, n: usize) {
        self.index.advance(n);
    }

    /// Makes the state at length `len` live again, if the ring still holds it: O(1), or one
    /// state rebuilt per layer where a chain left it unwritten ([`SnapshotRing::defer`]).
    pub fn restore(&mut self, len: usize) -> bool {
        if !self.index.restore(len) {
            return false;
        }
        for layer in 0..self.layout.n_layers {
            let records = std::mem::take(&mut self.deferred[layer]);
            let mut kept = Vec::with_capacity(records.len());
            for mut record in records {
                if record.is_pending(len) {
                    self.rebuild(layer, &record, len);
                }
                for later in len..=record.base + record.pending.len() {
                    record.forget(later);
                }
                if record.lengths().next().is_some() {
                    kept.push(record);
                }
            }
            self.deferred[layer] = kept;
        }
        true
    }

    /// The plane holding (or receiving) the state at length `len`: one in the window, or one
    /// the evaluation running from the live state writes.
    fn plane_at(&self, len: usize) -> usize {
        let n = self.index.n_planes() as isize;
        let offset = len as isize - self.index.len() as isize;
        (self.index.live_plane() as isize + offset).rem_euclid(n) as usize
    }

    /// Records that a chain of `steps` rows from length `base` wrote layer `layer`'s S
    /// matrices only for its last row, with the rank-one steps of its rows in `updates`
    /// (`[head][step]`: the decay, `key_dim` keys, a `δ` per state row; recorded by
    /// [`delta_rule::chain_recorded`]): the states before it are rebuilt when a restore
    /// lands on one, or when the plane they start from is about to be overwritten while
    /// they may still be restored ([`SnapshotRing::settle`]).
    pub fn defer(
        &mut self,
        layer: usize,
        base: usize,
        steps: usize,
        key_dim: usize,
        updates: &[f32],
    ) {
        if steps < 2 {
            return;
        }
        let head_len = self.layout.head_len;
        let stride = 1 + key_dim + head_len / key_dim;
        assert_eq!(
            updates.len(),
            self.layout.n_heads * steps * stride,
            "snapshot ring: deferred steps of another shape"
        );
        self.deferred[layer].push(Deferred {
            base,
            key_dim,
            steps,
            updates: updates.to_vec(),
            pending: vec![true; steps - 1],
        });
    }

    /// Before an evaluation of layer `layer` writes the states at lengths `writes`: forgets
    /// unwritten states whose planes it overwrites, and rebuilds those at `keep_from` or later
    /// whose starting state it overwrites (they may still be restored after it).
    pub fn settle(
        &mut self,
        layer: usize,
        writes: std::ops::RangeInclusive<usize>,
        keep_from: usize,
    ) {
        if self.deferred[layer].is_empty() {
            return;
        }
        let n = self.index.n_planes();
        let mut overwritten = vec![false; n];
        for len in writes.take(n) {
            overwritten[self.plane_at(len)] = true;
        }
        let records = std::mem::take(&mut self.deferred[layer]);
        let mut kept = Vec::with_capacity(records.len());
        for mut record in records {
            let lengths: Vec<usize> = record.lengths().collect();
            for &len in &lengths {
                if overwritten[self.plane_at(len)] {
                    record.forget(len);
                }
            }
            if overwritten[self.plane_at(record.base)] {
                for len in record.lengths().collect::<Vec<_>>() {
                    if len >= keep_from {
                        self.rebuild(layer, &record, len);
                    }
                    record.forget(len);
                }
            }
            if record.lengths().next().is_some() {
                kept.push(record);
            }
        }
        self.deferred[layer] = kept;
    }

    /// Writes layer `layer`'s S matrices at length `len` (unwritten in `record`) into their
    /// plane, replayed from the record's starting state.
    fn rebuild(&mut self, layer: usize, record: &Deferred, len: usize) {
        let head_len = self.layout.head_len;
        let (from, to) = (self.plane_at(record.base), self.plane_at(len));
        let stride = record.stride(head_len);
        let (key_dim, rows) = (record.key_dim, head_len / record.key_dim);
        let per_head = self.head_planes_len();
        let updates = &record.updates;
        for (h, planes) in self
            .layer_heads_mut(layer)
            .chunks_exact_mut(per_head)
            .enumerate()
        {
            let steps: Vec<delta_rule::RankOne<'_>> = (0..len - record.base)
                .map(|i| {
                    let u = &updates[(h * record.steps + i) * stride..][..stride];
                    delta_rule::RankOne {
                        decay: u[0],
                        k: &u[1..1 + key_dim],
                        delta: &u[1 + key_dim..1 + key_dim + rows],
                    }
                })
                .collect();
            let (state_in, state_out) = read_write(planes, head_len, from, to);
            delta_rule::replay(&steps, state_in, state_out);
        }
    }

    /// Makes this ring hold what `other` holds (every plane and which length each holds): a
    /// forked sequence keeps its parent's state and rollback window.
    ///
    /// # Panics
    ///
    /// If the rings differ in layout or depth.
    pub fn copy_from(&mut self, other: &Self) {
        assert!(
            self.layout == other.layout && self.index.n_planes() == other.index.n_planes(),
            "snapshot ring: copying a ring of another shape"
        );
        self.conv.copy_from_slice(&other.conv);
        self.ssm
            .as_mut_slice()
            .copy_from_slice(other.ssm.as_slice());
        self.index = other.index;
        self.deferred.clone_from(&other.deferred);
    }

    /// Copies layer `layer`'s state at length `len + step` (what the `step`-th token after the
    /// live state reads) into `plane`, as the state at sequence length `at`.
    pub fn save_layer(&self, layer: usize, step: usize, plane: &mut StatePlane, at: usize) {
        assert_eq!(
            plane.layout, self.layout,
            "snapshot ring: a plane of another shape"
        );
        let (conv_len, head_len) = (self.layout.conv_len, self.layout.head_len);
        plane.conv[layer * conv_len..][..conv_len].copy_from_slice(self.conv_state(layer, step));
        let (read, _) = self.index.step_planes(step);
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
                planes[live * head_len..][..head_len].copy_from_slice(s);
            }
        }
        self.index.start_at(len);
        self.deferred.iter_mut().for_each(Vec::clear);
        Some(len)
    }

    /// Back to the empty sequence: the live plane is zeroed, every snapshot forgotten.
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
                head[live * head_len..][..head_len].fill(0.0);
            }
        }
        self.index.reset();
        self.deferred.iter_mut().for_each(Vec::clear);
    }

    /// The live S matrix of value head `head` of layer `layer`.
    pub fn live_head(&self, layer: usize, head: usize) -> &[f32] {
        let len = self.layout.head_len;
        let first = (layer * self.layout.n_heads + head) * self.head_planes_len();
        &self.ssm.as_slice()[first + self.index.live_plane() * len..][..len]
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
        let (read, write) = ring.index().step_planes(step);
        for layer in 0..LAYOUT.n_layers {
            let (_, dst) = ring.conv_io(layer, step);
            dst.fill(value);
            let per_head = ring.head_planes_len();
            for head in ring.layer_heads_mut(layer).chunks_exact_mut(per_head) {
                let (src, dst) = read_write(head, LAYOUT.head_len, read, write);
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = s + (value - s);
                }
            }
        }
    }

    /// Every value of the live state of every layer.
    fn live(ring: &SnapshotRing) -> Vec<f32> {
        (0..LAYOUT.n_layers)
            .flat_map(|l| {
                let heads = (0..LAYOUT.n_heads).flat_map(move |h| ring.live_head(l, h).to_vec());
                ring.conv_state(l, 0)
                    .iter()
                    .copied()
                    .chain(heads)
                    .collect::<Vec<_>>()
            })
            .collect()
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
        assert_eq!(ring.n_bytes(), 4 * 4 * 14);
        for i in 0..5 {
            step(&mut ring, 0, (i + 1) as f32);
            ring.advance(1);
        }
        assert_eq!(ring.len(), 5);
        assert_eq!(ring.window(), 2..=5);
        assert_eq!(live(&ring), [5.0; 14]);
        assert!(!ring.restore(1));
        assert!(ring.restore(3));
        assert_eq!(live(&ring), [3.0; 14]);
        assert_eq!(ring.window(), 2..=3);
        // A batch of 2 from length 3 overwrites the planes of 4 and 5.
        step(&mut ring, 0, 40.0);
        step(&mut ring, 1, 50.0);
        ring.advance(2);
        assert_eq!(live(&ring), [50.0; 14]);
        assert!(ring.restore(4));
        assert_eq!(live(&ring), [40.0; 14]);
        assert!(ring.restore(2));
        assert_eq!(live(&ring), [2.0; 14]);
        ring.reset();
        assert_eq!((ring.len(), ring.window()), (0, 0..=0));
        assert_eq!(live(&ring), [0.0; 14]);
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
        assert_eq!(live(&ring), [5.0; 14]);
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
