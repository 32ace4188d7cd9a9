//! Growing a draft tree best first (greedy requests): the node added next is always the
//! candidate whose path scores highest — the product, down to it, of each token's probability
//! under a sharpened draft distribution — so a confident drafter grows a chain and an unsure
//! one branches where it is unsure, each node costing one row of the verify pass.
//!
//! Drafters' probabilities are not calibrated (a small draft model's are too flat, a trained
//! MTP head's top choice is right more often than a branch would pay for), so the shape is
//! chosen by what the target accepts: each [`TreeGrower`] tries a few [`Shape`]s and keeps
//! growing the one whose trees got the most drafts accepted per pass, trying the others now
//! and then ([`TreeGrower::learn`]).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use specula_plugin_api::{Draft, DraftRequest, TREE_ROOT};

use crate::{draw, softmax};

/// Candidates per node in a branching shape: its most likely next tokens.
pub const BRANCHING: usize = 3;

/// Paths scoring less than this are not proposed.
pub const MIN_PATH_SCORE: f32 = 0.02;

/// How trees are grown.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    /// The top choice after each draft: a chain.
    Chain,
    /// Best first over [`BRANCHING`] candidates per node, scored by `softmax(logits × s)`
    /// (sharpened for `s > 1`).
    Branching(f32),
}

/// The shapes a grower chooses from.
const SHAPES: [Shape; 3] = [Shape::Chain, Shape::Branching(1.5), Shape::Branching(1.0)];

/// Times each shape is tried before the choice follows the measurements.
const WARMUP: u32 = 3;

/// Every this many trees, one of another shape than the best so far.
const EXPLORE_EVERY: u32 = 16;

/// Weight of the newest pass in a shape's running mean of accepted drafts.
const SMOOTHING: f64 = 0.1;

/// A token that could join the tree under `parent`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    /// Chance that the path down to and including it is accepted.
    score: f32,
    parent: u32,
    token: u32,
    /// Its probability under its parent's draft distribution.
    p: f32,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Likelier first; then the earlier parent and the smaller token, so ties grow the
        // same tree on every run.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.parent.cmp(&self.parent))
            .then_with(|| other.token.cmp(&self.token))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Grows draft trees for one sequence, choosing their shape by what the target accepted.
#[derive(Debug, Clone)]
pub struct TreeGrower {
    /// Per shape of [`SHAPES`]: trees judged, and the running mean of drafts accepted.
    tried: [u32; SHAPES.len()],
    accepted: [f64; SHAPES.len()],
    /// The shape of the last tree grown, until it is judged.
    pending: Option<usize>,
    /// Trees grown.
    grown: u32,
}

impl Default for TreeGrower {
    fn default() -> Self {
        Self::new()
    }
}

impl TreeGrower {
    /// A grower that has measured nothing yet.
    pub fn new() -> Self {
        Self {
            tried: [0; SHAPES.len()],
            accepted: [0.0; SHAPES.len()],
            pending: None,
            grown: 0,
        }
    }

    /// The shape with the most drafts accepted per pass so far (the first untried one first).
    pub fn best_shape(&self) -> Shape {
        SHAPES[self.best()]
    }

    fn best(&self) -> usize {
        if let Some(untried) = (0..SHAPES.len()).find(|&s| self.tried[s] < WARMUP) {
            return untried;
        }
        (0..SHAPES.len())
            .max_by(|&a, &b| {
                self.accepted[a]
                    .total_cmp(&self.accepted[b])
                    .then(b.cmp(&a))
            })
            .unwrap_or(0)
    }

    /// The shape of the next tree: the best, or now and then another one to measure it again.
    fn next_shape(&self) -> usize {
        let best = self.best();
        if self.grown % EXPLORE_EVERY != EXPLORE_EVERY - 1 {
            return best;
        }
        let others = SHAPES.len() - 1;
        let other = (self.grown / EXPLORE_EVERY) as usize % others;
        (0..SHAPES.len())
            .filter(|&s| s != best)
            .nth(other)
            .unwrap_or(best)
    }

    /// Learns that the target accepted `accepted` drafts of the last tree grown.
    pub fn learn(&mut self, accepted: usize) {
        if let Some(shape) = self.pending.take() {
            let a = accepted as f64;
            self.accepted[shape] = match self.tried[shape] {
                0 => a,
                _ => self.accepted[shape] + SMOOTHING * (a - self.accepted[shape]),
            };
            self.tried[shape] += 1;
        }
    }

    /// Grows a tree of at most `budget` nodes for `request` into `out` (tokens, parents, and
    /// each node's probability under the distribution it was chosen from as its confidence)
    /// in the shape the measurements favour: the candidates under the context come from
    /// `root_logits`; each node added gets its own from `next_logits(path)`, which returns the
    /// draft logits after the node (`path`: the tokens from the first draft down to it).
    /// Greedy requests get [`grow_shape`]'s trees, sampled ones [`grow_sampled`]'s.
    pub fn grow<E>(
        &mut self,
        request: &DraftRequest<'_>,
        root_logits: &[f32],
        budget: usize,
        out: &mut Draft,
        next_logits: impl FnMut(&[u32], &mut Vec<f32>) -> Result<(), E>,
    ) -> Result<(), E> {
        let shape = self.next_shape();
        self.pending = Some(shape);
        self.grown += 1;
        match request.temperature > 0.0 {
            false => grow_shape(SHAPES[shape], root_logits, budget, out, next_logits),
            true => grow_sampled(
                SHAPES[shape],
                root_logits,
                budget,
                request.temperature,
                request.seed,
                out,
                next_logits,
            ),
        }
    }
}

/// [`TreeGrower::grow`] in one shape.
pub fn grow_shape<E>(
    shape: Shape,
    root_logits: &[f32],
    budget: usize,
    out: &mut Draft,
    mut next_logits: impl FnMut(&[u32], &mut Vec<f32>) -> Result<(), E>,
) -> Result<(), E> {
    out.clear();
    let mut heap = BinaryHeap::new();
    let mut probs = Vec::new();
    let mut logits = Vec::new();
    push_children(shape, &mut heap, root_logits, TREE_ROOT, 1.0, &mut probs);
    while out.tokens.len() < budget {
        let Some(best) = heap.pop() else { break };
        if best.score < MIN_PATH_SCORE && shape != Shape::Chain {
            break;
        }
        let node = out.tokens.len() as u32;
        out.tokens.push(best.token);
        out.parents.push(best.parent);
        out.confidence.push(best.p);
        if out.tokens.len() == budget {
            break;
        }
        let path = path_tokens(out, node as usize);
        next_logits(&path, &mut logits)?;
        push_children(shape, &mut heap, &logits, node, best.score, &mut probs);
    }
    Ok(())
}

/// A sampled tree (a request at `temperature`): each node is drawn from its parent's draft
/// distribution `softmax(logits / temperature)`, reported in `out.probs` (one row per node) —
/// what the host's recursive rejection sampling needs to keep the target's distribution
/// exactly. A chain shape samples a chain; a branching one draws two siblings under the context
/// (the second from the distribution without the first, renormalised), then grows the likelier
/// branch (by the product of its drafts' probabilities) one sampled node at a time. (Sampled
/// trees do not use the sharpness: three siblings, tried, were accepted less than two.)
pub fn grow_sampled<E>(
    shape: Shape,
    root_logits: &[f32],
    budget: usize,
    temperature: f32,
    seed: u64,
    out: &mut Draft,
    mut next_logits: impl FnMut(&[u32], &mut Vec<f32>) -> Result<(), E>,
) -> Result<(), E> {
    out.clear();
    if budget == 0 {
        return Ok(());
    }
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut q = Vec::new();
    let mut logits = Vec::new();
    // Appends a node drawn from `q` under `parent`; returns its index and probability.
    let add = |q: &[f32], parent: u32, out: &mut Draft, rng: &mut ChaCha20Rng| {
        let token = draw(q, rng.gen());
        out.tokens.push(token);
        out.parents.push(parent);
        out.confidence.push(q[token as usize]);
        out.probs.extend_from_slice(q);
        (out.tokens.len() as u32 - 1, q[token as usize])
    };
    softmax(root_logits, 1.0 / temperature, &mut q);
    // Branch ends that may grow: (score, node).
    let mut ends: Vec<(f32, u32)> = Vec::new();
    let (first, p) = add(&q, TREE_ROOT, out, &mut rng);
    ends.push((p, first));
    if matches!(shape, Shape::Branching(_)) && budget >= 2 {
        let taken = out.tokens[first as usize] as usize;
        let rest = 1.0 - q[taken];
        if rest > 0.0 {
            q[taken] = 0.0;
            q.iter_mut().for_each(|x| *x /= rest);
            let (second, p) = add(&q, TREE_ROOT, out, &mut rng);
            if p > 0.0 {
                ends.push((p, second));
            } else {
                // Rounding drew the excluded token (probability 0 now): no second sibling.
                out.tokens.pop();
                out.parents.pop();
                out.confidence.pop();
                out.probs.truncate(out.tokens.len() * q.len());
            }
        }
    }
    while out.tokens.len() < budget {
        let Some(at) = (0..ends.len()).max_by(|&a, &b| ends[a].0.total_cmp(&ends[b].0)) else {
            break;
        };
        let (score, node) = ends[at];
        next_logits(&path_tokens(out, node as usize), &mut logits)?;
        softmax(&logits, 1.0 / temperature, &mut q);
        let (child, p) = add(&q, node, out, &mut rng);
        ends[at] = (score * p, child);
    }
    Ok(())
}

/// Pushes the likeliest tokens of `logits` as children of `parent` (one for a chain).
fn push_children(
    shape: Shape,
    heap: &mut BinaryHeap<Candidate>,
    logits: &[f32],
    parent: u32,
    score: f32,
    probs: &mut Vec<f32>,
) {
    let (branching, sharpness) = match shape {
        Shape::Chain => (1, 1.0),
        Shape::Branching(s) => (BRANCHING, s),
    };
    softmax(logits, sharpness, probs);
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(branching + 1);
    for (token, &p) in probs.iter().enumerate() {
        if best.len() < branching || p > best[best.len() - 1].1 {
            let at = best.iter().position(|&(_, q)| p > q).unwrap_or(best.len());
            best.insert(at, (token as u32, p));
            best.truncate(branching);
        }
    }
    for (token, p) in best {
        heap.push(Candidate {
            score: score * p,
            parent,
            token,
            p,
        });
    }
}

/// The tokens from a root of `draft`'s tree down to `node`.
pub fn path_tokens(draft: &Draft, node: usize) -> Vec<u32> {
    let mut path = vec![draft.tokens[node]];
    let mut at = node;
    while draft.parents[at] != TREE_ROOT {
        at = draft.parents[at] as usize;
        path.push(draft.tokens[at]);
    }
    path.reverse();
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits over 4 tokens whose softmax is about `probs`.
    fn logits(probs: [f32; 4]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn greedy_request() -> DraftRequest<'static> {
        DraftRequest {
            context: abi_stable::std_types::RSlice::from_slice(&[]),
            max_tokens: 8,
            temperature: 0.0,
            seed: 1,
            tree: true,
        }
    }

    fn grow(
        shape: Shape,
        root: [f32; 4],
        after: [f32; 4],
        budget: usize,
    ) -> (Draft, Vec<Vec<u32>>) {
        let mut out = Draft::default();
        let mut asked = Vec::new();
        grow_shape::<()>(shape, &logits(root), budget, &mut out, |path, l| {
            asked.push(path.to_vec());
            *l = logits(after);
            Ok(())
        })
        .unwrap();
        (out, asked)
    }

    #[test]
    fn a_confident_drafter_grows_a_chain_and_an_unsure_one_branches() {
        let plain = Shape::Branching(1.0);
        // After any path: token 1 with 0.9 — a chain of 1s, its first node the argmax.
        let (out, _) = grow(plain, [0.04, 0.9, 0.03, 0.03], [0.04, 0.9, 0.03, 0.03], 4);
        assert_eq!(out.tokens.to_vec(), vec![1, 1, 1, 1]);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, 0, 1, 2]);

        // Unsure at the root (0.5 / 0.48), surer after: both branches, then their chains.
        let (out, asked) = grow(plain, [0.5, 0.48, 0.01, 0.01], [0.1, 0.05, 0.8, 0.05], 4);
        assert_eq!(out.tokens.to_vec(), vec![0, 1, 2, 2]);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, TREE_ROOT, 0, 1]);
        assert_eq!(asked, vec![vec![0], vec![1], vec![0, 2]]);

        // The chain shape never branches.
        let (out, _) = grow(
            Shape::Chain,
            [0.5, 0.48, 0.01, 0.01],
            [0.3, 0.3, 0.2, 0.2],
            5,
        );
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, 0, 1, 2, 3]);
    }

    #[test]
    fn the_shape_whose_drafts_are_accepted_most_is_grown() {
        let mut grower = TreeGrower::new();
        let flat = logits([0.5, 0.45, 0.03, 0.02]);
        let mut shapes = Vec::new();
        for _ in 0..60 {
            let mut out = Draft::default();
            grower
                .grow::<()>(&greedy_request(), &flat, 6, &mut out, |_, l| {
                    *l = flat.clone();
                    Ok(())
                })
                .unwrap();
            let chain = out.parents.iter().enumerate().all(|(i, &p)| match i {
                0 => p == TREE_ROOT,
                _ => p as usize == i - 1,
            });
            shapes.push(chain);
            // The target accepts 4 drafts of a chain, 1 of a branching tree.
            grower.learn(if chain { 4 } else { 1 });
        }
        assert_eq!(grower.best_shape(), Shape::Chain);
        // After the warm-up, chains but for the occasional other shape.
        let late = &shapes[40..];
        assert!(
            late.iter().filter(|&&c| c).count() >= late.len() * 3 / 4,
            "{shapes:?}"
        );
        assert!(late.iter().any(|&c| !c), "never measured again: {shapes:?}");
    }

    #[test]
    fn sampled_trees_report_the_distribution_of_each_node() {
        let root = logits([0.4, 0.3, 0.2, 0.1]);
        let after = logits([0.1, 0.2, 0.3, 0.4]);
        for seed in 0..20 {
            let mut out = Draft::default();
            grow_sampled::<()>(
                Shape::Branching(1.0),
                &root,
                5,
                1.0,
                seed,
                &mut out,
                |_, l| {
                    *l = after.clone();
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(out.tokens.len(), 5);
            assert_eq!(out.probs.len(), 5 * 4);
            let (t0, t1) = (out.tokens[0] as usize, out.tokens[1] as usize);
            assert_eq!(out.parents[..2], [TREE_ROOT, TREE_ROOT]);
            assert_ne!(t0, t1, "siblings are drawn without replacement");
            // The second sibling's distribution is the first's without it.
            let (q0, q1) = (&out.probs[..4], &out.probs[4..8]);
            assert_eq!(q1[t0], 0.0);
            let rest = 1.0 - q0[t0];
            for i in (0..4).filter(|&i| i != t0) {
                assert!((q1[i] - q0[i] / rest).abs() < 1e-6);
            }
            for (node, &token) in out.tokens.iter().enumerate() {
                assert!(out.probs[node * 4 + token as usize] > 0.0);
                assert_eq!(out.confidence[node], out.probs[node * 4 + token as usize]);
            }
        }
    }

    #[test]
    fn unlikely_paths_are_not_proposed() {
        // 0.25 per step: paths of three score below the floor, so 3 + 9 nodes.
        let (out, _) = grow(Shape::Branching(1.0), [0.25; 4], [0.25; 4], 60);
        assert_eq!(out.tokens.len(), 12, "{:?}", out.tokens);
        for node in 0..out.tokens.len() {
            assert!(path_tokens(&out, node).len() <= 2);
        }
    }
}
