//! A pass's device work replayed as a CUDA graph (option `cuda_graphs`).
//!
//! A decoding step of a small model is a few hundred launches of kernels that run for a few
//! microseconds each, so the launches themselves — the host's call per kernel and the device's
//! gap between kernels — take a good part of the step. A CUDA graph issues the whole step in
//! one call. But a graph replays the arguments it was captured with, and a pass's arguments
//! change from pass to pass (the row count, a recurrent layer's snapshot planes, the spans of
//! a batch), so this module never guesses which ones stay: while a pass is recorded
//! ([`super::Gpu::begin_pass`]) every launch and copy is kept — kernel, grid, every argument,
//! every address — instead of being issued, and at the pass's [`super::Gpu::sync`] the
//! recorded work is issued as the graph captured for exactly the same work, if there is one.
//! Work first seen is issued as it is; work seen a second time is captured (it recurs: a
//! plain decoding step, a verify pass of a given size at a given ring position), and its
//! graph kept among the most recently used. Where the graphs kept keep being dropped before
//! any replay (batches of ever new shapes: a capture costs milliseconds), captures pause for
//! a while.
//!
//! A pass where one sequence has more than [`MAX_ROWS`] rows (a prompt's prefill chunk) is not
//! recorded.
//!
//! What a pass copies from pageable host memory (the row table, block tables) is staged in a
//! page-locked arena at an offset that is part of the recorded work, so a replayed graph
//! copies the new pass's values from where they were put. The values themselves are data,
//! not part of the key; so are the contents of every buffer.

use std::collections::HashSet;

use super::Arg;

/// Graphs kept (the least recently used goes when another is captured).
pub const GRAPHS_KEPT: usize = 64;

/// The most rows one sequence may have in a pass for the pass to be recorded. A pass where a
/// sequence has more (a prompt's prefill chunk) is issued as it comes: its kernels run long
/// enough that launches do not bound it, and its shape rarely recurs, so recording it would
/// only hold its work back until the pass's end (on an H200 a 64-token prefill recorded gave
/// 7-18% fewer tokens a second). Decoding and verify passes of many sequences stay recorded.
pub const MAX_ROWS: usize = 32;

/// Bytes of the arena that pageable copies are staged in. A pass that stages more is issued
/// as it is recorded, without a graph.
pub const STAGING_BYTES: usize = 1 << 20;

/// Keys remembered as seen once (forgotten all together past this many).
const SEEN_KEPT: usize = 4096;

/// Of the last this many graphs dropped to make room, ...
const CHURN_WINDOW: usize = 32;
/// ... this many never replayed mean the passes' shapes vary too much for graphs to pay (a
/// capture costs milliseconds): no more captures for the next [`CHURN_PAUSE`] passes that
/// are not replays.
const CHURN_LIMIT: usize = 16;
const CHURN_PAUSE: u64 = 512;

/// The direction of a recorded copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// From page-locked host memory.
    HostToDevice,
    /// Into page-locked host memory.
    DeviceToHost,
    DeviceToDevice,
}

/// One recorded operation. Addresses are device pointers, or host pointers of page-locked
/// memory (on the emulator, host memory standing in for both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Launch {
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        /// The launch's arguments: `Work::args[first .. first + count]`.
        first: u32,
        count: u32,
    },
    Copy {
        kind: CopyKind,
        src: u64,
        dst: u64,
        bytes: u64,
    },
    Zero {
        dst: u64,
        bytes: u64,
    },
}

/// A pass's device work, in the order it was asked for.
#[derive(Debug, Clone, Default)]
pub struct Work {
    pub ops: Vec<Op>,
    pub args: Vec<Arg>,
}

impl Work {
    /// Records a launch.
    pub fn launch(
        &mut self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) {
        let first = self.args.len() as u32;
        self.args.extend_from_slice(args);
        self.ops.push(Op::Launch {
            kernel,
            grid,
            block,
            first,
            count: args.len() as u32,
        });
    }

    /// The arguments of a recorded launch.
    pub fn launch_args(&self, first: u32, count: u32) -> &[Arg] {
        &self.args[first as usize..(first + count) as usize]
    }

    /// A hash of everything that makes two works the same graph (a kernel by the address of
    /// its name in the kernel table, which is the same for every launch of it).
    pub fn key(&self) -> u64 {
        let mut h = Mix::default();
        for op in &self.ops {
            match *op {
                Op::Launch {
                    kernel,
                    grid,
                    block,
                    first,
                    count,
                } => {
                    h.add(kernel.as_ptr() as u64);
                    h.add(u64::from(grid.0) | u64::from(grid.1) << 32);
                    h.add(u64::from(grid.2) | u64::from(block) << 32);
                    for arg in self.launch_args(first, count) {
                        h.add(arg_bits(arg));
                    }
                }
                Op::Copy {
                    kind,
                    src,
                    dst,
                    bytes,
                } => {
                    for word in [kind as u64 + 1, src, dst, bytes] {
                        h.add(word);
                    }
                }
                Op::Zero { dst, bytes } => {
                    for word in [9, dst, bytes] {
                        h.add(word);
                    }
                }
            }
        }
        h.0
    }

    /// Whether `other` is the same work: the same operations with the same arguments.
    pub fn same(&self, other: &Work) -> bool {
        self.ops == other.ops
            && self.args.len() == other.args.len()
            && self
                .args
                .iter()
                .zip(&other.args)
                .all(|(a, b)| arg_bits(a) == arg_bits(b) && arg_kind(a) == arg_kind(b))
    }
}

fn arg_bits(arg: &Arg) -> u64 {
    match *arg {
        Arg::Ptr(p) | Arg::U64(p) => p,
        Arg::I32(v) => u64::from(v as u32),
        Arg::F32(v) => u64::from(v.to_bits()),
    }
}

fn arg_kind(arg: &Arg) -> u8 {
    match arg {
        Arg::Ptr(_) => 0,
        Arg::U64(_) => 1,
        Arg::I32(_) => 2,
        Arg::F32(_) => 3,
    }
}

/// A word-at-a-time hash (a pass is thousands of words; equal keys are confirmed by
/// [`Work::same`]).
struct Mix(u64);

impl Default for Mix {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Mix {
    fn add(&mut self, word: u64) {
        let x = (self.0 ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = x ^ (x >> 29);
    }
}

/// The arena pageable copies are staged in: `capacity` bytes at host address `base`.
#[derive(Debug)]
pub struct Staging {
    pub base: u64,
    pub capacity: usize,
    used: usize,
}

impl Staging {
    pub fn new(base: u64, capacity: usize) -> Self {
        Self {
            base,
            capacity,
            used: 0,
        }
    }

    /// Copies `data` into the arena (16-byte aligned) and returns its address, or `None`
    /// when it does not fit.
    pub fn stage(&mut self, data: &[u8]) -> Option<u64> {
        let at = self.used.next_multiple_of(16);
        let end = at.checked_add(data.len()).filter(|&e| e <= self.capacity)?;
        // SAFETY: `base .. base + capacity` is the arena's memory, which this struct owns the
        // writing of, and `at .. end` lies inside it. The device reads nothing of it
        // meanwhile: a pass's staged copies run before its `sync` returns, and the arena is
        // reused only after that (`reset`).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), (self.base as *mut u8).add(at), data.len())
        };
        self.used = end;
        Some(self.base + at as u64)
    }

    /// Makes the whole arena free again (the pass staged in it has completed).
    pub fn reset(&mut self) {
        self.used = 0;
    }
}

/// How the recorded passes went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Passes recorded.
    pub passes: u64,
    /// Passes issued as a graph kept from an earlier pass.
    pub replayed: u64,
    /// Passes captured as a new graph (then issued as it).
    pub captured: u64,
    /// Passes issued operation by operation (first seen, staging full, or not capturable).
    pub issued: u64,
    /// Captures that failed (counted in `captured` too; the work is then issued as it is
    /// whenever it recurs, counted as replayed).
    pub capture_failed: u64,
    /// Passes with more than [`MAX_ROWS`] rows of one sequence, not recorded (not in
    /// `passes`).
    pub unrecorded: u64,
}

/// A graph kept, with the work it was captured from.
#[derive(Debug)]
pub struct Kept<G> {
    key: u64,
    pub work: Work,
    /// `None` on the emulator, or where the capture failed: the work is issued as it is.
    pub graph: Option<G>,
    used: u64,
    /// Whether it was replayed since it was kept.
    replayed: bool,
}

/// The recorder's state for one device: the pass being recorded, the arena, the graphs kept.
#[derive(Debug)]
pub struct Replay<G> {
    /// The pass being recorded, between `begin_pass` and `sync`.
    pub recording: Option<Work>,
    pub staging: Staging,
    /// Whether work was issued since the last wait for the stream (so the arena may still be
    /// read by copies in flight).
    pub unwaited: bool,
    /// A finished recording's buffers, for the next pass's.
    spare: Work,
    kept: Vec<Kept<G>>,
    seen: HashSet<u64>,
    clock: u64,
    /// Of the last [`CHURN_WINDOW`] graphs dropped, whether each had been replayed.
    dropped: std::collections::VecDeque<bool>,
    /// Passes left without captures.
    paused: u64,
    pub stats: ReplayStats,
}

/// What to do with a recorded pass.
pub enum Decision<'a, G> {
    /// Issue this graph (or, without one, this work) kept from an earlier pass.
    Replay(&'a Kept<G>),
    /// Seen before: capture it, keep it ([`Replay::keep`]) and issue it.
    Capture,
    /// First seen: issue it as it is.
    Issue,
}

impl<G> Replay<G> {
    pub fn new(staging: Staging) -> Self {
        Self {
            recording: None,
            staging,
            unwaited: false,
            spare: Work::default(),
            kept: Vec::new(),
            seen: HashSet::new(),
            clock: 0,
            dropped: std::collections::VecDeque::new(),
            paused: 0,
            stats: ReplayStats::default(),
        }
    }

    /// Starts recording a pass, in the buffers of one recorded before.
    pub fn start(&mut self) {
        let mut work = std::mem::take(&mut self.spare);
        work.ops.clear();
        work.args.clear();
        self.recording = Some(work);
    }

    /// Gives back a recording's buffers once its work is issued (and not kept).
    pub fn recycle(&mut self, work: Work) {
        self.spare = work;
    }

    /// What to do with `work`, whose key is `key`.
    pub fn decide(&mut self, key: u64, work: &Work) -> Decision<'_, G> {
        self.clock += 1;
        self.stats.passes += 1;
        if let Some(i) = self
            .kept
            .iter()
            .position(|k| k.key == key && k.work.same(work))
        {
            self.stats.replayed += 1;
            self.kept[i].used = self.clock;
            self.kept[i].replayed = true;
            return Decision::Replay(&self.kept[i]);
        }
        if self.seen.len() >= SEEN_KEPT {
            self.seen.clear();
        }
        if self.paused > 0 {
            self.paused -= 1;
            self.stats.issued += 1;
            return Decision::Issue;
        }
        if self.seen.insert(key) {
            self.stats.issued += 1;
            Decision::Issue
        } else {
            self.stats.captured += 1;
            Decision::Capture
        }
    }

    /// Keeps `work`'s graph, dropping the least recently used one if there are
    /// [`GRAPHS_KEPT`] already.
    pub fn keep(&mut self, key: u64, work: Work, graph: Option<G>) {
        if self.kept.len() >= GRAPHS_KEPT {
            if let Some(oldest) = (0..self.kept.len()).min_by_key(|&i| self.kept[i].used) {
                let dropped = self.kept.swap_remove(oldest);
                self.note_dropped(dropped.replayed);
            }
        }
        self.seen.remove(&key);
        self.kept.push(Kept {
            key,
            work,
            graph,
            used: self.clock,
            replayed: false,
        });
    }

    /// Notes a graph dropped to make room, and pauses the captures when too many of the last
    /// ones dropped were never replayed.
    fn note_dropped(&mut self, replayed: bool) {
        if self.dropped.len() == CHURN_WINDOW {
            self.dropped.pop_front();
        }
        self.dropped.push_back(replayed);
        if self.dropped.iter().filter(|&&r| !r).count() >= CHURN_LIMIT {
            self.paused = CHURN_PAUSE;
            self.dropped.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(rows: i32, plane: i32) -> Work {
        let mut w = Work::default();
        w.ops.push(Op::Copy {
            kind: CopyKind::HostToDevice,
            src: 0x1000,
            dst: 0x2000,
            bytes: 64,
        });
        w.launch(
            "matvec_q8_0",
            (4, 1, 1),
            128,
            &[Arg::Ptr(0x2000), Arg::I32(rows)],
        );
        w.launch(
            "gdn_recurrence",
            (2, 1, 1),
            128,
            &[Arg::I32(plane), Arg::F32(0.5)],
        );
        w.ops.push(Op::Zero {
            dst: 0x3000,
            bytes: 16,
        });
        w
    }

    #[test]
    fn works_differing_in_any_argument_are_different_graphs() {
        let a = work(1, 3);
        assert!(a.same(&work(1, 3)));
        assert_eq!(a.key(), work(1, 3).key());
        for other in [work(2, 3), work(1, 4)] {
            assert!(!a.same(&other));
            assert_ne!(a.key(), other.key());
        }
        // The same bits as another kind of argument are another launch.
        let mut float = work(1, 3);
        float.args[1] = Arg::F32(f32::from_bits(1));
        assert!(!a.same(&float));
    }

    #[test]
    fn work_is_issued_then_captured_then_replayed_and_old_graphs_make_room() {
        let mut staging = vec![0u128; 4];
        let mut replay: Replay<u32> = Replay::new(Staging::new(staging.as_mut_ptr() as u64, 64));
        let a = work(1, 3);
        let key = a.key();
        assert!(matches!(replay.decide(key, &a), Decision::Issue));
        assert!(matches!(replay.decide(key, &a), Decision::Capture));
        replay.keep(key, a.clone(), Some(7));
        match replay.decide(key, &a) {
            Decision::Replay(kept) => assert_eq!(kept.graph, Some(7)),
            _ => panic!("a kept graph is replayed"),
        }
        assert_eq!(
            replay.stats,
            ReplayStats {
                passes: 3,
                replayed: 1,
                captured: 1,
                issued: 1,
                capture_failed: 0,
                unrecorded: 0,
            }
        );
        for plane in 10..10 + GRAPHS_KEPT as i32 {
            let w = work(1, plane);
            replay.keep(w.key(), w, None);
        }
        assert_eq!(replay.kept.len(), GRAPHS_KEPT);
        assert!(
            matches!(replay.decide(key, &a), Decision::Issue),
            "the least recently used graph made room"
        );
    }

    #[test]
    fn captures_pause_when_the_graphs_kept_are_never_replayed() {
        let mut replay: Replay<u32> = Replay::new(Staging::new(0, 0));
        // Shapes that each come twice (issued, captured) and never again.
        let mut plane = 0;
        let mut shape = |replay: &mut Replay<u32>| {
            plane += 1;
            let w = work(1, plane);
            let key = w.key();
            let first = replay.decide(key, &w);
            assert!(matches!(first, Decision::Issue));
            let second = matches!(replay.decide(key, &w), Decision::Capture);
            if second {
                replay.keep(key, w, Some(0));
            }
            second
        };
        let captured = (0..GRAPHS_KEPT + CHURN_LIMIT)
            .filter(|_| shape(&mut replay))
            .count();
        assert_eq!(
            captured,
            GRAPHS_KEPT + CHURN_LIMIT,
            "captured until the churn showed"
        );
        assert!(!shape(&mut replay), "then paused");
        assert_eq!(replay.paused, CHURN_PAUSE - 2);
        // A graph that is replayed counts for graphs: keep one busy while the others churn.
        let mut replay: Replay<u32> = Replay::new(Staging::new(0, 0));
        let busy = work(2, 0);
        let busy_key = busy.key();
        replay.decide(busy_key, &busy);
        replay.decide(busy_key, &busy);
        replay.keep(busy_key, busy.clone(), Some(1));
        for plane in 1..=400 {
            let w = work(1, plane);
            let key = w.key();
            replay.decide(key, &w);
            if matches!(replay.decide(key, &w), Decision::Capture) {
                replay.keep(key, w, Some(0));
                // Each dropped graph was replayed once.
                let again = work(1, plane);
                assert!(matches!(replay.decide(key, &again), Decision::Replay(_)));
            }
            assert!(matches!(
                replay.decide(busy_key, &busy),
                Decision::Replay(_)
            ));
        }
        assert_eq!(replay.paused, 0, "replayed graphs never pause the captures");
    }

    #[test]
    fn staging_aligns_fits_and_refuses_what_does_not_fit() {
        let mut memory = vec![0u128; 4];
        let base = memory.as_mut_ptr() as u64;
        let mut staging = Staging::new(base, 64);
        assert_eq!(staging.stage(&[1, 2, 3]), Some(base));
        assert_eq!(staging.stage(&[4; 16]), Some(base + 16));
        assert_eq!(staging.stage(&[5; 40]), None, "32 + 40 > 64");
        assert_eq!(staging.stage(&[6; 32]), Some(base + 32));
        staging.reset();
        assert_eq!(staging.stage(&[7; 64]), Some(base));
        let bytes: Vec<u8> = memory.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(bytes, vec![7; 64]);
    }
}
