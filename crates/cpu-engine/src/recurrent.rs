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
//! path for those (see the backends' `truncate`).

use specula_plugin_api::{ErrorKind, PluginError};

/// Sizes of the per-layer recurrent state, in f32 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLayout {
    /// GDN layers.
    pub n_layers: usize,
    /// Convolution state per layer: `(conv_kernel - 1) × conv_channels`.
    pub conv_len: usize,
    /// S matrices per layer: `n_v_heads × S × S`.
    pub ssm_len: usize,
}

impl StateLayout {
    /// Values of one layer's state.
    pub fn layer_len(&self) -> usize {
        self.conv_len + self.ssm_len
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

/// One layer's state, read-only.
#[derive(Debug, Clone, Copy)]
pub struct LayerState<'a> {
    pub conv: &'a [f32],
    pub ssm: &'a [f32],
}

/// One layer's state, being written.
#[derive(Debug)]
pub struct LayerStateMut<'a> {
    pub conv: &'a mut [f32],
    pub ssm: &'a mut [f32],
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
}

/// The planes of the recurrent state: the live one and the `depth` before it.
#[derive(Debug)]
pub struct SnapshotRing {
    layout: StateLayout,
    planes: Vec<f32>,
    index: RingIndex,
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
        let plane_len = layout.plane_len();
        let plane_bytes = layout.plane_bytes().max(1);
        let mut n_planes = depth.saturating_add(1);
        if let Some(budget) = budget_bytes {
            n_planes = n_planes.min(usize::try_from(budget / plane_bytes).unwrap_or(usize::MAX));
        }
        let too_small = |n: usize| {
            PluginError::new(
                ErrorKind::OutOfMemory,
                format!(
                    "cpu-simd: the recurrent-state ring needs at least 2 slots of {plane_bytes} bytes; {}",
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
        let mut planes: Vec<f32> = Vec::new();
        loop {
            match n_planes
                .checked_mul(plane_len)
                .map(|n| planes.try_reserve_exact(n))
            {
                Some(Ok(())) => break,
                _ if n_planes > 2 => n_planes = n_planes / 2 + 1,
                _ => return Err(too_small(n_planes)),
            }
        }
        planes.resize(n_planes * plane_len, 0.0);
        let ring = Self {
            layout,
            planes,
            index: RingIndex::new(n_planes),
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

    /// For the `step`-th token after the live state: layer `layer` of the state at length
    /// `len + step` (read) and of the plane that receives length `len + step + 1` (written).
    ///
    /// Steps of one evaluation run in order per layer, so a plane that wraps around
    /// (evaluations longer than the ring) is only overwritten after it has been read.
    pub fn step_io(&mut self, layer: usize, step: usize) -> (LayerState<'_>, LayerStateMut<'_>) {
        let (read, write) = self.index.step_planes(step);
        let plane_len = self.layout.plane_len();
        let layer_len = self.layout.layer_len();
        let conv_len = self.layout.conv_len;
        let offset = layer * layer_len;
        let (src, dst) = if read < write {
            let (a, b) = self.planes.split_at_mut(write * plane_len);
            (&a[read * plane_len..][..plane_len], &mut b[..plane_len])
        } else {
            let (a, b) = self.planes.split_at_mut(read * plane_len);
            (&b[..plane_len], &mut a[write * plane_len..][..plane_len])
        };
        let (src_conv, src_ssm) = src[offset..offset + layer_len].split_at(conv_len);
        let (dst_conv, dst_ssm) = dst[offset..offset + layer_len].split_at_mut(conv_len);
        (
            LayerState {
                conv: src_conv,
                ssm: src_ssm,
            },
            LayerStateMut {
                conv: dst_conv,
                ssm: dst_ssm,
            },
        )
    }

    /// Makes the state after `n` more tokens (written through [`step_io`]) the live one.
    ///
    /// [`step_io`]: SnapshotRing::step_io
    pub fn advance(&mut self, n: usize) {
        self.index.advance(n);
    }

    /// Makes the state at length `len` live again, if the ring still holds it. O(1).
    pub fn restore(&mut self, len: usize) -> bool {
        self.index.restore(len)
    }

    /// Back to the empty sequence: the live plane is zeroed, every snapshot forgotten.
    pub fn reset(&mut self) {
        let plane_len = self.layout.plane_len();
        let live = self.index.live_plane();
        self.planes[live * plane_len..(live + 1) * plane_len].fill(0.0);
        self.index.reset();
    }

    /// Layer `layer` of the live state.
    pub fn live_layer(&self, layer: usize) -> LayerState<'_> {
        let plane_len = self.layout.plane_len();
        let layer_len = self.layout.layer_len();
        let start = self.index.live_plane() * plane_len + layer * layer_len;
        let (conv, ssm) = self.planes[start..start + layer_len].split_at(self.layout.conv_len);
        LayerState { conv, ssm }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: StateLayout = StateLayout {
        n_layers: 2,
        conv_len: 3,
        ssm_len: 4,
    };

    /// Writes `value` into every element of every layer for one step.
    fn step(ring: &mut SnapshotRing, step: usize, value: f32) {
        for layer in 0..LAYOUT.n_layers {
            let (_, dst) = ring.step_io(layer, step);
            dst.conv.fill(value);
            dst.ssm.fill(value);
        }
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
        assert_eq!(ring.live_layer(1).ssm, &[5.0; 4]);
        assert!(!ring.restore(1));
        assert!(ring.restore(3));
        assert_eq!(ring.live_layer(0).conv, &[3.0; 3]);
        assert_eq!(ring.window(), 2..=3);
        // A batch of 2 from length 3 overwrites the planes of 4 and 5.
        step(&mut ring, 0, 40.0);
        step(&mut ring, 1, 50.0);
        ring.advance(2);
        assert_eq!(ring.live_layer(0).conv, &[50.0; 3]);
        assert!(ring.restore(4));
        assert_eq!(ring.live_layer(1).ssm, &[40.0; 4]);
        assert!(ring.restore(2));
        assert_eq!(ring.live_layer(1).ssm, &[2.0; 4]);
        ring.reset();
        assert_eq!((ring.len(), ring.window()), (0, 0..=0));
        assert_eq!(ring.live_layer(0).conv, &[0.0; 3]);
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
        assert_eq!(ring.live_layer(0).conv, &[5.0; 3]);
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
