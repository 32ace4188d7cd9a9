//! Growing a draft tree best first: the node added next is always the candidate likeliest to
//! be accepted — the chance that the target accepts every draft down to and including it — so
//! a drafter that is usually right grows a chain and an unsure one branches where it is
//! unsure, each node costing one row of the verify pass. The best `n` nodes of a greedy tree
//! form a tree themselves (a node is never likelier than its parent), so growing best first
//! gives the tree of `n` nodes with the most drafts accepted on average (EAGLE-2's dynamic
//! trees). A sampled tree's later sibling may be worth more than its elder (it is judged when
//! the elder is rejected), but joins only after it: its tree is grown best first among the
//! nodes that may join.
//!
//! A draft's chance of acceptance is not its draft probability: a small draft model's are too
//! flat, a trained MTP head's top choice is right more often than its softmax says, and deep
//! drafts of a head trained one step ahead less often. So each [`TreeGrower`] calibrates its
//! drafter: a logistic regression from a draft's probability, its rank among its siblings
//! and its depth to how often the target accepted such drafts when it judged them, refitted
//! as the target judges trees ([`TreeGrower::learn`]). It replaces choosing among fixed
//! shapes by their measured acceptance, which had to spend passes trying the worse ones.
//!
//! With context hints ([`TreeGrower::with_context_hints`]) a greedy node's candidates also
//! include the token that followed the longest earlier occurrence of the text up to it (the
//! context and the node's path) — prompt lookup inside the drafter's tree. Text that repeats
//! itself (quoted passages, code, a small model's loops) is predicted by the context better
//! than by a draft model, which does not know what it was shown; the calibration learns how
//! often such hints are right, by the match's length and whether the drafter ranked them too.
//! Sampled requests take no hints: a hint is no draw from the drafter's distribution, and
//! mixing it in measured no better (docs/benchmarks.md, thirty-seventh session).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use specula_plugin_api::{Draft, DraftRequest, DrafterParams, PluginError, TREE_ROOT};

use crate::ngram::NgramIndex;
use crate::{draw, softmax};

/// Most children a node offers: in a greedy tree its drafter's likeliest next tokens, in a
/// sampled tree siblings drawn without replacement.
pub const BRANCHING: usize = 4;

/// Paths less likely than this to be accepted are not proposed (but for a tree's first node:
/// a drafter the target keeps rejecting is still judged, so the calibration can learn better).
pub const MIN_PATH_SCORE: f32 = 0.02;

/// The drafter option that turns context hints on (`true`) or off (`false`).
pub const CONTEXT_HINTS: &str = "context_hints";

/// Shortest and longest context match a hint is taken from.
const HINT_MATCH: (usize, usize) = (1, 8);
/// Matches at least this long are told apart from shorter ones by a calibration.
const LONG_MATCH: u32 = 5;

/// Depths a calibration tells apart: 1, 2, 3 and deeper.
const DEPTHS: usize = 4;
/// Judged drafts a calibration fits.
const WINDOW: usize = 2048;
/// Judged drafts between two fits, at least; later, a sixteenth of the window (a fit costs in
/// proportion to the window, and a full window moves little with a few more drafts).
const REFIT_EVERY: usize = 8;
/// Newton steps per fit (each from the last fit's weights).
const NEWTON_STEPS: usize = 2;
/// How strongly a fit is pulled toward [`PRIOR`] (in judged drafts, roughly).
const RIDGE: f64 = 4.0;
/// The weights before any judgement: the chance is the draft probability itself, a context
/// hint's 0.1 after a short match and 0.3 after a long one, whatever the drafter thinks of it
/// (a hint it does not rank would otherwise never be proposed, so never judged; low, so that
/// hints displace a drafter's first choices only once they have been right).
const PRIOR: [f32; FEATURES] = {
    let mut w = [0.0; FEATURES];
    w[1] = 1.0;
    w[HINT] = -2.2;
    w[HINT + 2] = 1.35;
    w
};

/// What a calibration knows of a draft.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Facts {
    /// Its rank among its siblings (0: the first offered).
    rank: usize,
    /// 1 under the context.
    depth: usize,
    /// Its probability under the distribution it was chosen from (greedy); the largest
    /// probability of that distribution (sampled: whether a sampled draft is proposed must
    /// not depend on its own token, or it would no longer be a draw from the distribution
    /// reported for it, and rejection sampling would lose its exactness).
    p: f32,
    /// Its first sibling's `p` (its own for the first).
    eldest: f32,
    /// Whether an ancestor is not its parent's first child: the drafter's own first choice
    /// was rejected on the way.
    off_track: bool,
    /// Whether it is the context hint at its place, and how it got there.
    hint: HintKind,
}

/// How a candidate relates to the context hint at its place (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HintKind {
    /// It is not the hint (or there was none).
    None,
    /// The drafter ranked it too; the context matched this many tokens.
    Ranked(u32),
    /// Only the hint offered it; the context matched this many tokens.
    Only(u32),
}

/// Weights of a calibration: bias, logit(p), logit(p) for later siblings, rank 1, rank 2+,
/// depth 2, depth 3, depth 4+, the first sibling's logit for later siblings, off track; for a
/// context hint instead of the first five: its bias, logit(p), a long match, not ranked.
const FEATURES: usize = 10 + DEPTHS;
/// Where a hint's weights begin.
const HINT: usize = 6 + DEPTHS;

impl Facts {
    fn features(self) -> [f32; FEATURES] {
        let logit = |p: f32| {
            let p = p.clamp(1e-4, 1.0 - 1e-4);
            (p / (1.0 - p)).ln()
        };
        let mut x = [0.0; FEATURES];
        if self.depth > 1 {
            x[3 + self.depth.min(DEPTHS)] = 1.0;
        }
        x[5 + DEPTHS] = f32::from(u8::from(self.off_track));
        let (ranked, len) = match self.hint {
            HintKind::None => {
                x[0] = 1.0;
                x[1] = logit(self.p);
                if self.rank > 0 {
                    x[2] = x[1];
                    x[2 + self.rank.min(2)] = 1.0;
                    x[4 + DEPTHS] = logit(self.eldest);
                }
                return x;
            }
            HintKind::Ranked(len) => (true, len),
            HintKind::Only(len) => (false, len),
        };
        // A hint has its own weights, whether or not the drafter ranked it: what is learned
        // from the hints it did not rank holds for those it did.
        x[HINT] = 1.0;
        x[HINT + 1] = logit(self.p);
        x[HINT + 2] = f32::from(u8::from(len >= LONG_MATCH));
        x[HINT + 3] = f32::from(u8::from(!ranked));
        x
    }
}

/// A draft the target judged, as a calibration fits it.
#[derive(Debug, Clone)]
struct Judged {
    features: [f64; FEATURES],
    accepted: bool,
}

/// How likely the target is to accept a draft it judges, by rank, depth and draft
/// probability: a logistic regression over the last [`WINDOW`] judged drafts (refitted every
/// [`REFIT_EVERY`] judged drafts or more), pulled toward `p` itself — all it knows before any
/// judgement.
#[derive(Debug, Clone)]
struct Calibration {
    weights: [f32; FEATURES],
    /// The judged drafts the fit sees.
    window: VecDeque<Judged>,
    /// Drafts judged since the last fit.
    unfitted: usize,
}

impl Calibration {
    fn new() -> Self {
        Self {
            weights: PRIOR,
            window: VecDeque::new(),
            unfitted: 0,
        }
    }

    fn predict(weights: &[f32; FEATURES], facts: Facts) -> f32 {
        let z: f32 = facts
            .features()
            .iter()
            .zip(weights)
            .map(|(x, w)| x * w)
            .sum();
        1.0 / (1.0 + (-z).exp())
    }

    /// The chance that a draft of this rank, depth and draft probability `p` is accepted if
    /// the target judges it.
    fn chance(&self, facts: Facts) -> f32 {
        Self::predict(&self.weights, facts)
    }

    fn record(&mut self, facts: Facts, accepted: bool) {
        let features = facts.features().map(f64::from);
        if !features.iter().all(|x| x.is_finite()) {
            return;
        }
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(Judged { features, accepted });
        self.unfitted += 1;
    }

    /// Refits the weights if enough drafts were judged since the last fit: Newton steps on the
    /// window's log-likelihood with a ridge toward [`PRIOR`].
    fn refit(&mut self) {
        if self.unfitted < REFIT_EVERY.max(self.window.len() / 16) {
            return;
        }
        self.unfitted = 0;
        let mut w = self.weights.map(f64::from);
        for _ in 0..NEWTON_STEPS {
            // Gradient and Hessian of the penalised negative log-likelihood.
            let mut g = [0.0f64; FEATURES];
            let mut h = [[0.0f64; FEATURES]; FEATURES];
            for i in 0..FEATURES {
                g[i] = RIDGE * (w[i] - f64::from(PRIOR[i]));
                h[i][i] = RIDGE;
            }
            for judged in &self.window {
                let x = &judged.features;
                let z: f64 = x.iter().zip(&w).map(|(x, w)| x * w).sum();
                let p = 1.0 / (1.0 + (-z).exp());
                let err = p - f64::from(u8::from(judged.accepted));
                let curve = p * (1.0 - p);
                // The Hessian's upper triangle (most features are 0 for any one draft).
                for i in (0..FEATURES).filter(|&i| x[i] != 0.0) {
                    g[i] += err * x[i];
                    let cx = curve * x[i];
                    for j in (i..FEATURES).filter(|&j| x[j] != 0.0) {
                        h[i][j] += cx * x[j];
                    }
                }
            }
            let upper = h;
            for (i, row) in h.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate().take(i) {
                    *v = upper[j][i];
                }
            }
            let Some(step) = solve(h, g) else { break };
            for i in 0..FEATURES {
                w[i] -= step[i];
            }
        }
        if w.iter().all(|w| w.is_finite()) {
            self.weights = w.map(|w| w as f32);
        }
    }
}

/// Solves `a x = b` by Gaussian elimination with partial pivoting (`None` if `a` is singular).
fn solve(mut a: [[f64; FEATURES]; FEATURES], mut b: [f64; FEATURES]) -> Option<[f64; FEATURES]> {
    for col in 0..FEATURES {
        let pivot = (col..FEATURES).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..FEATURES {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row][col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; FEATURES];
    for row in (0..FEATURES).rev() {
        let rest: f64 = (row + 1..FEATURES).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    Some(x)
}

/// A token that could join the tree under `parent`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    /// Chance that it and every draft above it are accepted.
    score: f32,
    /// Chance that the target judges it (its parent accepted; when sampling, its earlier
    /// siblings rejected).
    reach: f32,
    parent: u32,
    token: u32,
    facts: Facts,
    /// Sampled trees: the distribution it was drawn from (an index into the grower's).
    dist: usize,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Likelier first; then the earlier parent, rank and the smaller token, so ties grow
        // the same tree on every run.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.parent.cmp(&self.parent))
            .then_with(|| other.facts.rank.cmp(&self.facts.rank))
            .then_with(|| other.token.cmp(&self.token))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The last tree grown, until the target has judged it.
#[derive(Debug, Clone)]
struct Grown {
    sampled: bool,
    parents: Vec<u32>,
    facts: Vec<Facts>,
}

/// Grows draft trees for one sequence, learning from each judged tree how likely its drafts
/// are to be accepted.
#[derive(Debug, Clone)]
pub struct TreeGrower {
    greedy: Calibration,
    sampled: Calibration,
    last: Option<Grown>,
    /// With context hints: the context's n-grams.
    context: Option<NgramIndex>,
}

impl Default for TreeGrower {
    fn default() -> Self {
        Self::new()
    }
}

impl TreeGrower {
    /// A grower that has seen no judgement yet (it trusts the draft probabilities).
    pub fn new() -> Self {
        Self {
            greedy: Calibration::new(),
            sampled: Calibration::new(),
            last: None,
            context: None,
        }
    }

    /// The grower a drafter's options ask for: with context hints if `[drafter.options]
    /// context_hints` ([`CONTEXT_HINTS`]) says so, or by `default` where it is not set.
    pub fn for_drafter(params: &DrafterParams, default: bool) -> Result<Self, PluginError> {
        Ok(match params.parse_option(CONTEXT_HINTS, default)? {
            true => Self::new().with_context_hints(),
            false => Self::new(),
        })
    }

    /// The same grower, offering context hints to greedy trees and chains (see the module
    /// docs).
    pub fn with_context_hints(mut self) -> Self {
        self.context = Some(NgramIndex::new(1));
        self
    }

    /// Whether `request`'s drafts are grown here: trees, and with context hints greedy
    /// chains too (others are picked one by one from the drafter's logits).
    pub fn grows(&self, request: &DraftRequest<'_>) -> bool {
        request.tree || (request.temperature <= 0.0 && self.context.is_some())
    }

    /// Grows a tree of at most `budget` nodes for `request` into `out` (tokens, parents, as
    /// each node's confidence the calibrated chance that its path is accepted and, when
    /// sampling, the distribution each node was drawn from): the candidates under the context
    /// come from `root_logits`; each node added gets its own from `next_logits(path, logits)`,
    /// which writes the draft logits after the node (`path`: the tokens from the first draft
    /// down to it).
    ///
    /// A request for a chain (`request.tree` false) gets a chain: under each node only its
    /// likeliest candidate, `budget` drafts whatever their chance, each reporting as its
    /// confidence the calibrated chance that it is accepted once its parent is (the host
    /// trims a chain's unlikely tail).
    ///
    /// Greedy requests get the likeliest tokens after each node as its candidates. Sampled
    /// ones draw them from `softmax(logits / temperature)`, siblings without replacement
    /// (each reports the distribution it was drawn from: the one before without the earlier
    /// siblings, renormalised) — what the host's recursive rejection sampling needs to keep
    /// the target's distribution exactly.
    pub fn grow<E>(
        &mut self,
        request: &DraftRequest<'_>,
        root_logits: &[f32],
        budget: usize,
        out: &mut Draft,
        next_logits: impl FnMut(&[u32], &mut Vec<f32>) -> Result<(), E>,
    ) -> Result<(), E> {
        let sampled = request.temperature > 0.0;
        let context = match (&mut self.context, sampled) {
            (Some(index), false) => {
                index.sync(&request.context);
                Some(&*index)
            }
            _ => None,
        };
        let mut growth = Growth {
            calibration: match sampled {
                false => &self.greedy,
                true => &self.sampled,
            },
            chain: !request.tree,
            context,
            heap: BinaryHeap::new(),
            dists: Vec::new(),
            rng: ChaCha20Rng::seed_from_u64(request.seed),
            temperature: request.temperature,
            probs: Vec::new(),
            facts: Vec::new(),
        };
        let grown = growth.grow(root_logits, budget, out, next_logits);
        self.last = Some(Grown {
            sampled,
            parents: out.parents.to_vec(),
            facts: std::mem::take(&mut growth.facts),
        });
        grown
    }

    /// Drops the last tree grown without learning from it: its judgement will not come (a
    /// new sequence begins).
    pub fn forget(&mut self) {
        self.last = None;
    }

    /// Learns from the target's judgement of the last tree grown: `accepted`, the indices of
    /// its drafts the target accepted (a root-to-node path). A draft was judged when its
    /// parent was accepted — and, when sampling, none of its earlier siblings was (recursive
    /// rejection stops at the first sibling accepted). Drafts the target accepted but a stop
    /// condition cut off arrive as rejected (the host reports what it emitted): a small bias,
    /// from a generation's last pass only.
    pub fn learn(&mut self, accepted: &[u32]) {
        let Some(grown) = self.last.take() else {
            return;
        };
        let n = grown.facts.len().min(grown.parents.len());
        let mut taken = vec![false; n];
        for &a in accepted {
            if let Some(t) = taken.get_mut(a as usize) {
                *t = true;
            }
        }
        let calibration = match grown.sampled {
            false => &mut self.greedy,
            true => &mut self.sampled,
        };
        // Per parent (the context last): whether one of its children was accepted yet.
        let mut settled = vec![false; n + 1];
        for node in 0..n {
            let parent = grown.parents[node];
            let slot = match parent {
                TREE_ROOT => n,
                p => p as usize,
            };
            let reached = parent == TREE_ROOT || taken.get(slot).copied().unwrap_or(false);
            if !reached || (grown.sampled && settled[slot]) {
                continue;
            }
            calibration.record(grown.facts[node], taken[node]);
            settled[slot] |= taken[node];
        }
        calibration.refit();
    }
}

/// One tree being grown.
struct Growth<'a> {
    calibration: &'a Calibration,
    /// Only the likeliest child under each node.
    chain: bool,
    /// Greedy requests with context hints: the context's n-grams.
    context: Option<&'a NgramIndex>,
    heap: BinaryHeap<Candidate>,
    /// Sampled trees: per node offering children (the context first), the distribution its
    /// next child is drawn from.
    dists: Vec<Vec<f32>>,
    rng: ChaCha20Rng,
    /// 0: greedy.
    temperature: f32,
    probs: Vec<f32>,
    /// Per node added: what the calibration learns from.
    facts: Vec<Facts>,
}

impl Growth<'_> {
    fn grow<E>(
        &mut self,
        root_logits: &[f32],
        budget: usize,
        out: &mut Draft,
        mut next_logits: impl FnMut(&[u32], &mut Vec<f32>) -> Result<(), E>,
    ) -> Result<(), E> {
        out.clear();
        let mut logits = Vec::new();
        let hint = self.hint_after(&[]);
        self.offer(root_logits, TREE_ROOT, 1, false, 1.0, hint);
        while out.tokens.len() < budget {
            let Some(best) = self.heap.pop() else { break };
            if self.chain {
                // Its siblings would be rows of another branch.
                self.heap.clear();
            } else if best.score < MIN_PATH_SCORE && !out.tokens.is_empty() {
                break;
            }
            let node = out.tokens.len() as u32;
            out.tokens.push(best.token);
            out.parents.push(best.parent);
            out.confidence.push(match self.chain {
                true => self.calibration.chance(best.facts),
                false => best.score,
            });
            self.facts.push(best.facts);
            if self.temperature > 0.0 {
                out.probs.extend_from_slice(&self.dists[best.dist]);
                if !self.chain {
                    self.draw_sibling(&best);
                }
            }
            if out.tokens.len() == budget {
                break;
            }
            let path = path_tokens(out, node as usize);
            next_logits(&path, &mut logits)?;
            let hint = self.hint_after(&path);
            self.offer(
                &logits,
                node,
                best.facts.depth + 1,
                best.facts.off_track || best.facts.rank > 0,
                best.score,
                hint,
            );
        }
        Ok(())
    }

    /// The context hint after `path` (greedy requests with context hints): the token that
    /// followed the longest earlier occurrence of the context's end and `path` in the
    /// context, the most recent among equals, and how many tokens matched.
    fn hint_after(&self, path: &[u32]) -> Option<(u32, u32)> {
        let index = self.context?;
        let context = index.tokens();
        let (min, max) = HINT_MATCH;
        // A match reads at most `max` tokens back from the end.
        let tail: Vec<u32> = context[context.len().saturating_sub(max)..]
            .iter()
            .chain(path)
            .copied()
            .collect();
        let tail = &tail[tail.len().saturating_sub(max)..];
        let found = index.longest_match(tail, min, max, context.len())?;
        Some((context[found.start], found.len as u32))
    }

    /// Offers the first children of `parent` (at `depth`, reached with chance `reach`): a
    /// greedy tree's [`BRANCHING`] likeliest tokens of `logits` and the context `hint` (token,
    /// match length) if the drafter did not rank it, a sampled tree's first draw.
    fn offer(
        &mut self,
        logits: &[f32],
        parent: u32,
        depth: usize,
        off_track: bool,
        reach: f32,
        hint: Option<(u32, u32)>,
    ) {
        let greedy = self.temperature <= 0.0;
        let scale = if greedy { 1.0 } else { 1.0 / self.temperature };
        softmax(logits, scale, &mut self.probs);
        if greedy {
            let mut best: Vec<(u32, f32)> = Vec::with_capacity(BRANCHING + 1);
            for (token, &p) in self.probs.iter().enumerate() {
                if best.len() < BRANCHING || p > best[best.len() - 1].1 {
                    let at = best.iter().position(|&(_, q)| p > q).unwrap_or(best.len());
                    best.insert(at, (token as u32, p));
                    best.truncate(BRANCHING);
                }
            }
            let eldest = best.first().map_or(0.0, |b| b.1);
            let ranked = best.len();
            let mut hint = hint.filter(|&(token, _)| (token as usize) < self.probs.len());
            for (rank, (token, p)) in best.into_iter().enumerate() {
                let facts = Facts {
                    rank,
                    depth,
                    p,
                    eldest,
                    off_track,
                    hint: match hint {
                        Some((h, len)) if h == token => {
                            hint = None;
                            HintKind::Ranked(len)
                        }
                        _ => HintKind::None,
                    },
                };
                self.push(reach, parent, token, facts, 0);
            }
            if let Some((token, len)) = hint {
                let facts = Facts {
                    rank: ranked,
                    depth,
                    p: self.probs[token as usize],
                    eldest,
                    off_track,
                    hint: HintKind::Only(len),
                };
                self.push(reach, parent, token, facts, 0);
            }
        } else {
            let token = draw(&self.probs, self.rng.gen());
            let top = top_probability(&self.probs);
            self.dists.push(std::mem::take(&mut self.probs));
            let facts = Facts {
                rank: 0,
                depth,
                p: top,
                eldest: top,
                off_track,
                hint: HintKind::None,
            };
            self.push(reach, parent, token, facts, self.dists.len() - 1);
        }
    }

    /// Sampled trees: offers the sibling after `added`, drawn from its distribution without
    /// it, which the target judges only if it rejects `added`.
    fn draw_sibling(&mut self, added: &Candidate) {
        if added.facts.rank + 1 >= BRANCHING {
            return;
        }
        let q = &mut self.dists[added.dist];
        let rest: f32 = q.iter().sum::<f32>() - q[added.token as usize];
        if rest <= 0.0 {
            return;
        }
        q[added.token as usize] = 0.0;
        q.iter_mut().for_each(|x| *x /= rest);
        let token = draw(q, self.rng.gen());
        if q[token as usize] <= 0.0 {
            // Rounding drew an excluded token: no further sibling.
            return;
        }
        let rejected = 1.0 - self.calibration.chance(added.facts);
        let facts = Facts {
            rank: added.facts.rank + 1,
            p: top_probability(q),
            ..added.facts
        };
        self.push(
            added.reach * rejected,
            added.parent,
            token,
            facts,
            added.dist,
        );
    }

    fn push(&mut self, reach: f32, parent: u32, token: u32, facts: Facts, dist: usize) {
        // Logits with a NaN give no chance at all (rather than a NaN that sorts first).
        let score = reach * self.calibration.chance(facts);
        self.heap.push(Candidate {
            score: if score.is_finite() { score } else { 0.0 },
            reach,
            parent,
            token,
            facts,
            dist,
        });
    }
}

/// The largest probability of a distribution.
fn top_probability(q: &[f32]) -> f32 {
    q.iter().copied().fold(0.0, f32::max)
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

    /// Grows one tree with `root` under the context and `after` after any draft; returns it
    /// and the paths whose logits were asked for.
    fn grow(
        grower: &mut TreeGrower,
        temperature: f32,
        seed: u64,
        (root, after): ([f32; 4], [f32; 4]),
        budget: usize,
    ) -> (Draft, Vec<Vec<u32>>) {
        let request = DraftRequest {
            context: abi_stable::std_types::RSlice::from_slice(&[]),
            max_tokens: budget as u32,
            temperature,
            seed,
            tree: true,
        };
        let mut out = Draft::default();
        let mut asked = Vec::new();
        grower
            .grow::<()>(&request, &logits(root), budget, &mut out, |path, l| {
                asked.push(path.to_vec());
                *l = logits(after);
                Ok(())
            })
            .unwrap();
        (out, asked)
    }

    fn is_chain(draft: &Draft) -> bool {
        draft.parents.iter().enumerate().all(|(i, &p)| match i {
            0 => p == TREE_ROOT,
            _ => p as usize == i - 1,
        })
    }

    /// The drafts of `draft` on the path of `token`s the target accepts.
    fn accepted_path(draft: &Draft, token: u32) -> Vec<u32> {
        let mut path = Vec::new();
        let mut parent = TREE_ROOT;
        while let Some(node) = (0..draft.tokens.len())
            .find(|&i| draft.parents[i] == parent && draft.tokens[i] == token)
        {
            path.push(node as u32);
            parent = node as u32;
        }
        path
    }

    #[test]
    fn a_confident_drafter_grows_a_chain_and_an_unsure_one_branches() {
        let sure = [0.04, 0.9, 0.03, 0.03];
        let (out, _) = grow(&mut TreeGrower::new(), 0.0, 1, (sure, sure), 4);
        assert_eq!(out.tokens.to_vec(), vec![1, 1, 1, 1]);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, 0, 1, 2]);

        // Unsure at the root (0.5 / 0.48), surer after: both branches, then their chains.
        let unsure = ([0.5, 0.48, 0.01, 0.01], [0.1, 0.05, 0.8, 0.05]);
        let (out, asked) = grow(&mut TreeGrower::new(), 0.0, 1, unsure, 4);
        assert_eq!(out.tokens.to_vec(), vec![0, 1, 2, 2]);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, TREE_ROOT, 0, 1]);
        assert_eq!(asked, vec![vec![0], vec![1], vec![0, 2]]);
    }

    #[test]
    fn what_the_target_accepts_calibrates_the_tree() {
        let flat = [0.5, 0.45, 0.03, 0.02];
        let (fresh, _) = grow(&mut TreeGrower::new(), 0.0, 1, (flat, flat), 6);
        assert!(!is_chain(&fresh), "an unsure drafter branches: {fresh:?}");

        // A target that always takes the drafter's first choice: chains of it.
        let mut grower = TreeGrower::new();
        for _ in 0..100 {
            let (out, _) = grow(&mut grower, 0.0, 1, (flat, flat), 6);
            grower.learn(&accepted_path(&out, 0));
        }
        let (out, _) = grow(&mut grower, 0.0, 1, (flat, flat), 6);
        assert!(is_chain(&out), "{out:?}");
        assert_eq!(out.tokens.to_vec(), vec![0; 6]);

        // One that always takes its second choice: chains of that.
        let mut grower = TreeGrower::new();
        for _ in 0..100 {
            let (out, _) = grow(&mut grower, 0.0, 1, (flat, flat), 6);
            grower.learn(&accepted_path(&out, 1));
        }
        let (out, _) = grow(&mut grower, 0.0, 1, (flat, flat), 6);
        assert!(is_chain(&out), "{out:?}");
        assert_eq!(out.tokens.to_vec(), vec![1; 6]);
    }

    #[test]
    fn a_fit_learns_how_often_drafts_of_a_kind_are_accepted() {
        let first = |p| Facts {
            rank: 0,
            depth: 1,
            p,
            eldest: p,
            off_track: false,
            hint: HintKind::None,
        };
        let second = Facts {
            rank: 1,
            eldest: 0.3,
            ..first(0.2)
        };
        let mut calibration = Calibration::new();
        assert_eq!(calibration.chance(first(0.3)), 0.3);
        // An underconfident drafter: its first choices at 0.3 are accepted 9 times in 10, its
        // second ones at 0.2 once in 10.
        for i in 0..800 {
            calibration.record(first(0.3), i % 10 != 0);
            calibration.record(second, i % 10 == 0);
            calibration.refit();
        }
        let (a, b) = (calibration.chance(first(0.3)), calibration.chance(second));
        assert!((a - 0.9).abs() < 0.03, "{a}");
        assert!((b - 0.1).abs() < 0.03, "{b}");
    }

    #[test]
    fn solve_solves_a_linear_system() {
        let mut a: [[f64; FEATURES]; FEATURES] = std::array::from_fn(|i| {
            std::array::from_fn(|j| match i == j {
                true => 4.0,
                false => 1.0 / (1 + i + j) as f64,
            })
        });
        // Zero on the diagonal of the first row: needs pivoting.
        a[0][0] = 0.0;
        let x: [f64; FEATURES] = std::array::from_fn(|i| i as f64 - 2.5);
        let b = a.map(|row| row.iter().zip(&x).map(|(a, x)| a * x).sum());
        let solved = solve(a, b).expect("a regular system");
        for (s, x) in solved.iter().zip(&x) {
            assert!((s - x).abs() < 1e-9, "{solved:?}");
        }
        assert_eq!(solve([[0.0; FEATURES]; FEATURES], b), None);
    }

    #[test]
    fn judged_drafts_are_those_the_target_reached() {
        let two = ([0.5, 0.45, 0.03, 0.02], [0.25; 4]);
        // Greedy: the target's choice settles every child of an accepted node.
        let mut grower = TreeGrower::new();
        let (out, _) = grow(&mut grower, 0.0, 1, two, 2);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, TREE_ROOT]);
        grower.learn(&[1]);
        let judged = |c: &Calibration| -> Vec<(usize, bool)> {
            // The rank-1 feature tells the eldest sibling (0) from the next (1).
            c.window
                .iter()
                .map(|j| (usize::from(j.features[3] == 1.0), j.accepted))
                .collect()
        };
        assert_eq!(judged(&grower.greedy), vec![(0, false), (1, true)]);
        // Learning twice from one judgement changes nothing.
        grower.learn(&[1]);
        assert_eq!(grower.greedy.window.len(), 2);

        // Sampled: a sibling after an accepted one was never judged.
        let mut grower = TreeGrower::new();
        let (out, _) = grow(&mut grower, 1.0, 7, two, 2);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, TREE_ROOT]);
        grower.learn(&[0]);
        assert_eq!(judged(&grower.sampled), vec![(0, true)]);
        assert!(grower.greedy.window.is_empty());
    }

    #[test]
    fn sampled_trees_report_the_distribution_of_each_node() {
        let shape = ([0.4, 0.3, 0.2, 0.1], [0.3, 0.3, 0.25, 0.15]);
        let mut branched = false;
        for seed in 0..40 {
            let (out, _) = grow(&mut TreeGrower::new(), 1.0, seed, shape, 5);
            assert_eq!(out.probs.len(), out.tokens.len() * 4);
            for node in 0..out.tokens.len() {
                let row = &out.probs[node * 4..node * 4 + 4];
                let token = out.tokens[node] as usize;
                assert!(row[token] > 0.0);
                // Its confidence: the chance its path is accepted, never above its parent's.
                let c = out.confidence[node];
                assert!(c > 0.0 && c <= 1.0);
                if let Some(&parent) = out.confidence.get(out.parents[node] as usize) {
                    assert!(c <= parent);
                }
                // A later sibling's distribution is the first one's without the siblings
                // drawn before it, renormalised.
                let siblings: Vec<usize> = (0..node)
                    .filter(|&s| out.parents[s] == out.parents[node])
                    .collect();
                let Some(&eldest) = siblings.first() else {
                    continue;
                };
                branched = true;
                let first = &out.probs[eldest * 4..eldest * 4 + 4];
                let rest: f32 = (0..4)
                    .filter(|&t| !siblings.iter().any(|&s| out.tokens[s] as usize == t))
                    .map(|t| first[t])
                    .sum();
                for t in 0..4 {
                    match siblings.iter().any(|&s| out.tokens[s] as usize == t) {
                        true => assert_eq!(row[t], 0.0, "drawn without replacement"),
                        false => assert!((row[t] - first[t] / rest).abs() < 1e-5),
                    }
                }
            }
        }
        assert!(branched, "no sampled tree branched");
    }

    /// Rejection sampling stays exact only if every sampled draft is a draw from the
    /// distribution reported for it, whatever decided that it be proposed: so whether a
    /// node joins the tree must not depend on its own token. Over many seeds, each node's
    /// token given its place (parent and rank) follows its reported distribution.
    #[test]
    fn a_sampled_node_is_proposed_whatever_its_token() {
        // After token 0 the drafter is sure, after the others unsure: a grower that looked at
        // a draft's own probability would prefer some tokens to others.
        let root = logits([0.45, 0.3, 0.15, 0.1]);
        // Per place (the path above a node, its earlier siblings): tokens seen, and the
        // distribution reported (which the place determines).
        type Place = (Vec<u32>, Vec<u32>);
        let mut tally: std::collections::HashMap<Place, ([u32; 4], Vec<f32>)> = Default::default();
        for seed in 0..6000 {
            let request = DraftRequest {
                context: abi_stable::std_types::RSlice::from_slice(&[]),
                max_tokens: 2,
                temperature: 1.0,
                seed,
                tree: true,
            };
            let mut out = Draft::default();
            TreeGrower::new()
                .grow::<()>(&request, &root, 2, &mut out, |path, l| {
                    *l = match path.last() {
                        Some(0) => logits([0.85, 0.05, 0.05, 0.05]),
                        _ => logits([0.3, 0.3, 0.2, 0.2]),
                    };
                    Ok(())
                })
                .unwrap();
            for node in 0..out.tokens.len() {
                let mut above = path_tokens(&out, node);
                above.pop();
                let earlier: Vec<u32> = (0..node)
                    .filter(|&s| out.parents[s] == out.parents[node])
                    .map(|s| out.tokens[s])
                    .collect();
                let (counts, q) = tally.entry((above, earlier)).or_default();
                counts[out.tokens[node] as usize] += 1;
                if q.is_empty() {
                    q.extend_from_slice(&out.probs[node * 4..node * 4 + 4]);
                }
            }
        }
        let mut checked = 0;
        for ((above, earlier), (counts, q)) in &tally {
            let n: u32 = counts.iter().sum();
            if n < 300 {
                continue;
            }
            checked += 1;
            for t in 0..4 {
                let seen = counts[t] as f32 / n as f32;
                let sd = (q[t] * (1.0 - q[t]) / n as f32).sqrt();
                assert!(
                    (seen - q[t]).abs() < 4.5 * sd + 1e-3,
                    "under {above:?} after siblings {earlier:?}: token {t} seen {seen:.3}, \
                     drawn with {:.3} ({n} draws)",
                    q[t]
                );
            }
        }
        // The root's first draws, children of each likely first draw, and second siblings.
        assert!(checked >= 5, "{checked} places checked");
    }

    #[test]
    fn nan_logits_neither_lead_the_tree_nor_poison_the_calibration() {
        let mut grower = TreeGrower::new();
        for _ in 0..20 {
            let (out, _) = grow(
                &mut grower,
                0.0,
                1,
                ([0.5, 0.45, 0.03, 0.02], [f32::NAN; 4]),
                6,
            );
            assert!(out.confidence.iter().all(|c| c.is_finite()), "{out:?}");
            // The two sure roots first, never a NaN node before them.
            assert_eq!(out.tokens[..2], [0, 1]);
            grower.learn(&[0]);
        }
        let judged = &grower.greedy.window;
        assert!(judged
            .iter()
            .all(|j| j.features.iter().all(|x| x.is_finite())));
        assert!(grower.greedy.weights.iter().all(|w| w.is_finite()));
    }

    #[test]
    fn a_forgotten_tree_is_not_learned_from() {
        let mut grower = TreeGrower::new();
        grow(&mut grower, 0.0, 1, ([0.5, 0.45, 0.03, 0.02], [0.25; 4]), 3);
        grower.forget();
        grower.learn(&[]);
        assert!(grower.greedy.window.is_empty());
    }

    /// Grows a greedy draft for `context` over 8 tokens whose drafter always ranks 7 then 6,
    /// 5, 4 (and 0–3 far below): what the context repeats, it never ranks.
    fn grow_hinted(grower: &mut TreeGrower, context: &[u32], tree: bool, budget: usize) -> Draft {
        let request = DraftRequest {
            context: abi_stable::std_types::RSlice::from_slice(context),
            max_tokens: budget as u32,
            temperature: 0.0,
            seed: 1,
            tree,
        };
        let drafter: Vec<f32> = [1e-3, 1e-3, 1e-3, 1e-3, 0.1, 0.15, 0.2, 0.5]
            .iter()
            .map(|p: &f32| p.ln())
            .collect();
        let mut out = Draft::default();
        grower
            .grow::<()>(&request, &drafter, budget, &mut out, |_, l| {
                l.clone_from(&drafter);
                Ok(())
            })
            .unwrap();
        out
    }

    #[test]
    fn context_hints_offer_what_followed_before_and_chains_learn_to_follow_them() {
        // The context goes round 0 1 2 3: after "… 0 1" comes 2, then 3, 0, 1, …
        let context = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1];
        let mut grower = TreeGrower::new().with_context_hints();
        let tree = grow_hinted(&mut grower, &context, true, 8);
        let roots: Vec<u32> = (0..tree.tokens.len())
            .filter(|&i| tree.parents[i] == TREE_ROOT)
            .map(|i| tree.tokens[i])
            .collect();
        assert!(roots.contains(&2), "the hint under the context: {tree:?}");
        // Without hints only the drafter's candidates.
        let plain = grow_hinted(&mut TreeGrower::new(), &context, true, 8);
        assert!(plain.tokens.iter().all(|&t| t >= 4), "{plain:?}");

        // A target that follows the context: the chain comes to follow the hints, each a
        // token the drafter never ranked.
        for _ in 0..60 {
            let chain = grow_hinted(&mut grower, &context, false, 6);
            assert!(is_chain(&chain), "{chain:?}");
            assert_eq!(chain.tokens.len(), 6);
            let accepted: Vec<u32> = (0..6)
                .take_while(|&i| chain.tokens[i as usize] == [2, 3, 0, 1, 2, 3][i as usize])
                .collect();
            grower.learn(&accepted);
        }
        let chain = grow_hinted(&mut grower, &context, false, 6);
        assert_eq!(chain.tokens.to_vec(), vec![2, 3, 0, 1, 2, 3]);
        // Its confidence: each hint's calibrated chance, high now.
        assert!(chain.confidence.iter().all(|&c| c > 0.8), "{chain:?}");

        // Sampled requests take no hints.
        let request = DraftRequest {
            context: abi_stable::std_types::RSlice::from_slice(&context),
            max_tokens: 8,
            temperature: 1.0,
            seed: 3,
            tree: true,
        };
        let drafter: Vec<f32> = [-30.0, -30.0, -30.0, -30.0, 0.0, 0.0, 0.0, 0.0].to_vec();
        let mut out = Draft::default();
        grower
            .grow::<()>(&request, &drafter, 8, &mut out, |_, l| {
                l.clone_from(&drafter);
                Ok(())
            })
            .unwrap();
        assert!(out.tokens.iter().all(|&t| t >= 4), "{out:?}");
    }

    #[test]
    fn unlikely_paths_are_not_proposed() {
        // 0.25 per step: paths of three score below the floor, so the tree is two deep.
        let (out, _) = grow(&mut TreeGrower::new(), 0.0, 1, ([0.25; 4], [0.25; 4]), 60);
        let (root, under) = (BRANCHING.min(4), BRANCHING.min(4).pow(2));
        assert_eq!(out.tokens.len(), root + under, "{:?}", out.tokens);
        for node in 0..out.tokens.len() {
            assert!(path_tokens(&out, node).len() <= 2);
        }
    }
}
