//! Drafting for many sequences at once: each drafting sequence's `propose` runs on its own
//! scoped thread, and the models are lent to the drafters through proxies that gather their
//! evaluations — a draft model's `eval_batch`, the target's `mtp_eval_batch` — into one call
//! on the real instance once every drafter is waiting for one (or done). So the draft model's
//! weights are read once per draft step for all sequences, as the target's are per verify
//! pass, without the drafters knowing: each row is bit-identical to its evaluation alone, so
//! every drafter gets exactly the numbers it would drafting alone.
//!
//! Other calls (lengths, truncation, hidden states) go straight to the instance, one at a
//! time under its lock.

use std::sync::{Condvar, Mutex, MutexGuard};

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::sabi_types::RMut;
use abi_stable::std_types::{RResult, RSlice, RVec};
use specula_plugin_api::{
    BoxedForwardPass, Capabilities, ErrorKind, EvalChunk, ForwardPass, ForwardPassMut,
    ForwardPass_TO, KvUsage, LogitRows, ModelInfo, MtpChunk, PluginError, PluginResult, SeqId,
};

/// Which instance a proxy lends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Target = 0,
    Draft = 1,
}

/// An evaluation a drafter asked for, owned while it waits.
enum Call {
    Eval {
        seq: SeqId,
        tokens: Vec<u32>,
        rows: LogitRows,
        /// A tree's parents (empty for a chain).
        parents: Vec<u32>,
    },
    Mtp {
        seq: SeqId,
        hidden: Vec<f32>,
        tokens: Vec<u32>,
        position: usize,
        rows: LogitRows,
    },
}

/// What a call returned: logits, and the MTP head's hidden rows.
type Answer = PluginResult<(Vec<f32>, Vec<f32>)>;

#[derive(Default)]
struct State {
    /// Drafting threads not finished yet.
    running: usize,
    /// Set when the gathering loop stopped early (it panicked): waiting calls fail.
    closed: bool,
    /// Calls waiting for the next gathered pass: (ticket, instance, call).
    queue: Vec<(usize, Which, Call)>,
    /// Answers by ticket.
    answers: Vec<Option<Answer>>,
}

/// What the drafting threads and the gathering loop share.
pub struct Gather<'m> {
    state: Mutex<State>,
    wake: Condvar,
    target: Mutex<&'m mut BoxedForwardPass>,
    draft: Option<Mutex<&'m mut BoxedForwardPass>>,
    /// Each instance's facts, read once (a proxy answers them without a lock or a failure).
    facts: [(ModelInfo, Capabilities); 2],
    /// Sequences and rows of each gathered pass, for the caller to report.
    pub passes: Mutex<Vec<(Which, usize, usize)>>,
}

impl<'m> Gather<'m> {
    /// Lends `target` and `draft` to `threads` drafting threads.
    pub fn new(
        target: &'m mut BoxedForwardPass,
        draft: Option<&'m mut BoxedForwardPass>,
        threads: usize,
    ) -> Self {
        let target_facts = (target.model_info(), target.capabilities());
        let draft_facts = match &draft {
            Some(d) => (d.model_info(), d.capabilities()),
            None => target_facts.clone(),
        };
        Self {
            state: Mutex::new(State {
                running: threads,
                ..State::default()
            }),
            wake: Condvar::new(),
            target: Mutex::new(target),
            draft: draft.map(Mutex::new),
            facts: [target_facts, draft_facts],
            passes: Mutex::new(Vec::new()),
        }
    }

    /// Fails every waiting and later call: the gathering loop will answer no more (it is
    /// unwinding), and the drafting threads must end so that their scope can be left.
    pub fn close(&self) {
        self.state().closed = true;
        self.wake.notify_all();
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn instance(&self, which: Which) -> Option<MutexGuard<'_, &'m mut BoxedForwardPass>> {
        let m = match which {
            Which::Target => Some(&self.target),
            Which::Draft => self.draft.as_ref(),
        }?;
        Some(m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A drafting thread is done (also when it failed or panicked: call it from a guard).
    pub fn finished(&self) {
        self.state().running -= 1;
        self.wake.notify_all();
    }

    /// Queues `call` and waits for its answer.
    fn ask(&self, which: Which, call: Call) -> Answer {
        let mut state = self.state();
        let ticket = state.answers.len();
        state.answers.push(None);
        state.queue.push((ticket, which, call));
        self.wake.notify_all();
        loop {
            if let Some(answer) = state.answers[ticket].take() {
                return answer;
            }
            if state.closed {
                return RResult::RErr(PluginError::new(
                    ErrorKind::Internal,
                    "the gathered drafting pass did not run",
                ));
            }
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Runs the gathered passes until every drafting thread is done: whenever every running
    /// thread waits for an evaluation, one pass per instance answers them all.
    pub fn serve(&self) {
        let mut state = self.state();
        loop {
            let waiting = state.queue.len();
            if state.running == 0 {
                return;
            }
            if waiting < state.running {
                state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let calls = std::mem::take(&mut state.queue);
            drop(state);
            let answers = self.run(calls);
            state = self.state();
            for (ticket, answer) in answers {
                state.answers[ticket] = Some(answer);
            }
            self.wake.notify_all();
        }
    }

    /// One pass per instance and kind over `calls`; a failed pass is retried call by call,
    /// so only the drafter at fault sees an error.
    fn run(&self, calls: Vec<(usize, Which, Call)>) -> Vec<(usize, Answer)> {
        let mut answers = Vec::with_capacity(calls.len());
        for which in [Which::Target, Which::Draft] {
            let evals: Vec<_> = calls
                .iter()
                .filter(|(_, w, c)| *w == which && matches!(c, Call::Eval { .. }))
                .collect();
            let mtps: Vec<_> = calls
                .iter()
                .filter(|(_, w, c)| *w == which && matches!(c, Call::Mtp { .. }))
                .collect();
            for group in [evals, mtps] {
                if group.is_empty() {
                    continue;
                }
                let Some(mut instance) = self.instance(which) else {
                    let missing = PluginError::invalid_input("no such model is lent");
                    answers.extend(
                        group
                            .iter()
                            .map(|(t, ..)| (*t, RResult::RErr(missing.clone()))),
                    );
                    continue;
                };
                let calls: Vec<&Call> = group.iter().map(|(_, _, c)| c).collect();
                let rows: usize = calls.iter().map(|c| call_rows(c)).sum();
                self.passes.lock().unwrap_or_else(|e| e.into_inner()).push((
                    which,
                    calls.len(),
                    rows,
                ));
                match run_calls(&mut instance, &calls) {
                    RResult::ROk(split) => answers.extend(
                        group
                            .iter()
                            .map(|(t, ..)| *t)
                            .zip(split.into_iter().map(RResult::ROk)),
                    ),
                    RResult::RErr(_) => {
                        for (ticket, _, call) in &group {
                            let alone = run_calls(&mut instance, &[call])
                                .map(|mut v| v.pop().expect("one answer"));
                            answers.push((*ticket, alone));
                        }
                    }
                }
            }
        }
        answers
    }
}

fn call_rows(call: &Call) -> usize {
    match call {
        Call::Eval { tokens, .. } | Call::Mtp { tokens, .. } => tokens.len(),
    }
}

/// Runs `calls` (all of one kind) in one pass on `instance`; each call's logits and hidden
/// rows, in order.
fn run_calls(
    instance: &mut BoxedForwardPass,
    calls: &[&Call],
) -> PluginResult<Vec<(Vec<f32>, Vec<f32>)>> {
    let vocab = instance.model_info().vocab_size as usize;
    let mut logits = RVec::new();
    let mut hidden = RVec::new();
    let result = match calls.first() {
        Some(Call::Eval { .. }) => {
            let chunks: Vec<EvalChunk<'_>> = calls
                .iter()
                .map(|c| match c {
                    Call::Eval {
                        seq,
                        tokens,
                        rows,
                        parents,
                    } => EvalChunk {
                        seq: *seq,
                        tokens: RSlice::from_slice(tokens),
                        rows: *rows,
                        parents: RSlice::from_slice(parents),
                    },
                    Call::Mtp { .. } => unreachable!("one kind per pass"),
                })
                .collect();
            instance.eval_batch(RSlice::from_slice(&chunks), &mut logits)
        }
        Some(Call::Mtp { .. }) => {
            let chunks: Vec<MtpChunk<'_>> = calls
                .iter()
                .map(|c| match c {
                    Call::Mtp {
                        seq,
                        hidden,
                        tokens,
                        position,
                        rows,
                    } => MtpChunk {
                        seq: *seq,
                        hidden: RSlice::from_slice(hidden),
                        tokens: RSlice::from_slice(tokens),
                        position: *position,
                        rows: *rows,
                    },
                    Call::Eval { .. } => unreachable!("one kind per pass"),
                })
                .collect();
            instance.mtp_eval_batch(RSlice::from_slice(&chunks), &mut logits, &mut hidden)
        }
        None => return RResult::ROk(Vec::new()),
    };
    if let RResult::RErr(e) = result {
        return RResult::RErr(e);
    }
    let hidden_size = instance.model_info().hidden_size as usize;
    let sizes = |c: &&Call| match c {
        Call::Eval { tokens, rows, .. } => (rows.count(tokens.len()) * vocab, 0),
        Call::Mtp { tokens, rows, .. } => {
            (rows.count(tokens.len()) * vocab, tokens.len() * hidden_size)
        }
    };
    let (want_logits, want_hidden) = calls
        .iter()
        .map(sizes)
        .fold((0, 0), |(a, b), (l, h)| (a + l, b + h));
    if logits.len() != want_logits || hidden.len() < want_hidden {
        return RResult::RErr(PluginError::new(
            ErrorKind::Internal,
            format!(
                "a gathered drafting pass returned {} logits and {} hidden values, {want_logits} and {want_hidden} were expected",
                logits.len(),
                hidden.len()
            ),
        ));
    }
    let (mut l, mut h) = (0, 0);
    let split = calls
        .iter()
        .map(|c| {
            let (n, rows) = match c {
                Call::Eval { tokens, rows, .. } | Call::Mtp { tokens, rows, .. } => {
                    (tokens.len(), *rows)
                }
            };
            let nl = rows.count(n) * vocab;
            let own_logits = logits[l..l + nl].to_vec();
            l += nl;
            let own_hidden = if matches!(c, Call::Mtp { .. }) {
                let nh = n * hidden_size;
                let v = hidden[h..h + nh].to_vec();
                h += nh;
                v
            } else {
                Vec::new()
            };
            (own_logits, own_hidden)
        })
        .collect();
    RResult::ROk(split)
}

/// One drafting thread's view of an instance.
pub struct Proxy<'g, 'm> {
    gather: &'g Gather<'m>,
    which: Which,
}

impl<'g, 'm> Proxy<'g, 'm> {
    pub fn new(gather: &'g Gather<'m>, which: Which) -> Self {
        Self { gather, which }
    }

    /// The proxy as the borrowed backend a drafter is lent.
    pub fn lend(&mut self) -> ForwardPassMut<'_> {
        ForwardPass_TO::from_ptr(RMut::new(self), TD_Opaque)
    }

    fn with<T>(&self, f: impl FnOnce(&mut BoxedForwardPass) -> PluginResult<T>) -> PluginResult<T> {
        match self.gather.instance(self.which) {
            Some(mut instance) => f(&mut instance),
            None => RResult::RErr(PluginError::invalid_input("no such model is lent")),
        }
    }
}

impl ForwardPass for Proxy<'_, '_> {
    fn model_info(&self) -> ModelInfo {
        self.gather.facts[self.which as usize].0.clone()
    }
    fn capabilities(&self) -> Capabilities {
        self.gather.facts[self.which as usize].1
    }
    fn seq_create(&mut self) -> PluginResult<SeqId> {
        RResult::RErr(PluginError::invalid_input(
            "a drafter may not create sequences",
        ))
    }
    fn seq_fork(&mut self, _seq: SeqId) -> PluginResult<SeqId> {
        RResult::RErr(PluginError::invalid_input(
            "a drafter may not fork sequences",
        ))
    }
    fn seq_free(&mut self, _seq: SeqId) -> PluginResult<()> {
        RResult::RErr(PluginError::invalid_input(
            "a drafter may not free sequences",
        ))
    }
    fn seq_reuse_prefix(&mut self, seq: SeqId, tokens: RSlice<'_, u32>) -> PluginResult<usize> {
        self.with(|i| i.seq_reuse_prefix(seq, tokens))
    }
    fn seq_len(&self, seq: SeqId) -> PluginResult<usize> {
        self.with(|i| i.seq_len(seq))
    }
    fn kv_usage(&self) -> KvUsage {
        self.with(|i| RResult::ROk(i.kv_usage()))
            .into_result()
            .unwrap_or_default()
    }
    fn eval_batch(
        &mut self,
        chunks: RSlice<'_, EvalChunk<'_>>,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        let [chunk] = chunks.as_slice() else {
            return RResult::RErr(PluginError::invalid_input(
                "a drafter evaluates one chunk of its own sequence at a time",
            ));
        };
        let call = Call::Eval {
            seq: chunk.seq,
            tokens: chunk.tokens.to_vec(),
            rows: chunk.rows,
            parents: chunk.parents.to_vec(),
        };
        self.gather.ask(self.which, call).map(|(l, _)| {
            logits.clear();
            logits.extend_from_slice(&l);
        })
    }
    fn truncate(&mut self, seq: SeqId, len: usize) -> PluginResult<()> {
        self.with(|i| i.truncate(seq, len))
    }
    fn seq_keep_path(&mut self, seq: SeqId, path: RSlice<'_, u32>) -> PluginResult<()> {
        self.with(|i| i.seq_keep_path(seq, path))
    }
    fn hidden_states(&self, seq: SeqId, out: &mut RVec<f32>) -> PluginResult<()> {
        self.with(|i| i.hidden_states(seq, out))
    }
    fn mtp_eval_batch(
        &mut self,
        chunks: RSlice<'_, MtpChunk<'_>>,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        let [chunk] = chunks.as_slice() else {
            return RResult::RErr(PluginError::invalid_input(
                "a drafter runs the MTP head over one chunk of its own sequence at a time",
            ));
        };
        let call = Call::Mtp {
            seq: chunk.seq,
            hidden: chunk.hidden.to_vec(),
            tokens: chunk.tokens.to_vec(),
            position: chunk.position,
            rows: chunk.rows,
        };
        self.gather.ask(self.which, call).map(|(l, h)| {
            logits.clear();
            logits.extend_from_slice(&l);
            hidden_out.clear();
            hidden_out.extend_from_slice(&h);
        })
    }
}
