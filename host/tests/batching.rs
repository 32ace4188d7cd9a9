//! The engine loop (continuous batching with speculation) over the real plugins: every
//! stream equals its output decoded alone, whatever shares its passes — other requests
//! joining and leaving mid-stream, prompts prefilled in chunks beside decode rows, drafts of
//! every drafter — and a panic in one request fails that request only.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use abi_stable::std_types::{RResult::RErr, RResult::ROk, RSlice, RVec};

use specula_host::pipeline::{Parts, Pipeline};
use specula_host::profile::Profile;
use specula_host::request::{CancelFlag, Outcome, Request, StopReason};
use specula_host::sampling::SamplingParams;
use specula_host::scheduler::budget::CostCurve;
use specula_host::scheduler::{Engine, EngineEvent, EngineOptions, Job, JobError};
use specula_host::spec::{generate, SpecSettings};
use specula_plugin_api::{
    box_forward_pass, BoxedForwardPass, Capabilities, ErrorKind, EvalChunk, ForwardPass, KvUsage,
    ModelInfo, MtpChunk, PluginError, PluginResult, SeqId,
};
mod common;

use common::*;

const PROMPTS: &[&str] = &[
    "Once upon a time",
    "Lily and Ben went to the park. Lily and Ben",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "",
    "One day, a little girl named Sue found a big red ball in the garden. She wanted to play \
     with it, but her mom said it was time for lunch. Sue was sad, but she",
    "Tom had a dog",
    "Once upon a time there was a little boy who liked to run. Once upon a time",
    "The sun was",
];

fn request(i: usize, speculate: bool) -> Request {
    let sampling = if i % 4 == 3 {
        // A seeded sampled request: plain decoding draws the same numbers batched or alone.
        SamplingParams {
            temperature: 0.8,
            seed: Some(7 + i as u64),
            ..SamplingParams::greedy()
        }
    } else {
        SamplingParams::greedy()
    };
    Request {
        prompt: PROMPTS[i % PROMPTS.len()].to_string(),
        max_tokens: [24, 40, 9, 33, 17, 48, 5, 28][i % 8],
        stop: if i == 2 { vec![".".into()] } else { Vec::new() },
        add_bos: true,
        // Fixed draft lengths, so that the drafts of every drafter reach the batched passes.
        // Requests 1 and 5 draft trees, verified beside the others' chains and prompt chunks.
        speculation: (speculate && i % 4 != 3).then_some(SpecSettings {
            draft_min: 1,
            draft_max: 4,
            adaptive: false,
            tree: i % 4 == 1,
        }),
        sampling,
        cancel: CancelFlag::default(),
    }
}

/// What a job reports: its text pieces as they came, then its end.
enum Report {
    Text(usize, String),
    Done(usize, Box<Result<Outcome, JobError>>),
}

fn job(i: usize, request: Request, tx: &mpsc::Sender<Report>) -> Job {
    let (text, done) = (tx.clone(), tx.clone());
    Job {
        request,
        prompt: None,
        on_text: Box::new(move |piece| {
            let _ = text.send(Report::Text(i, piece.to_string()));
        }),
        on_done: Box::new(move |result| {
            let _ = done.send(Report::Done(i, Box::new(result)));
        }),
    }
}

fn profile(dir: &Path, model: &Path, drafter: &str) -> Profile {
    let path = write_spec_profile(dir, "p.toml", model, drafter);
    Profile::load(path).unwrap()
}

/// Runs 8 requests alone, then through an engine of 3 lanes — half of them joining once
/// the first streams flow, one more leaving after its first text — and compares.
fn assert_streams_equal_alone(model: &Path, drafter: &str) {
    let dir = tempfile::tempdir().unwrap();
    let profile = profile(dir.path(), model, drafter);
    let speculate = !drafter.is_empty();
    let mut alone = Pipeline::open(&profile).unwrap();
    let expected: Vec<Outcome> = (0..8)
        .map(|i| generate(&mut alone, &request(i, speculate), |_| {}).unwrap())
        .collect();
    drop(alone);

    let passes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let draft_passes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (seen, seen_drafts) = (passes.clone(), draft_passes.clone());
    let options = EngineOptions {
        // Small chunks: long prompts are prefilled over several passes beside decode rows.
        prefill_chunk: 7,
        // Rows priced as free: the budget passes every wanted draft (on these tiny models a
        // measured curve prices rows too dear to draft at all).
        cost_curve: Some(CostCurve::from_points(vec![(1, 1.0), (64, 1.0)])),
        reopen: None,
        observer: std::sync::Arc::new(move |e| match e {
            EngineEvent::Pass {
                sequences, rows, ..
            } => seen.lock().unwrap().push((sequences, rows)),
            EngineEvent::DraftPass { sequences, .. } => seen_drafts.lock().unwrap().push(sequences),
            _ => {}
        }),
    };
    let engine = Engine::start(Parts::open(&profile, 3, None).unwrap(), 3, options).unwrap();
    let (tx, rx) = mpsc::channel();
    for i in 0..4 {
        engine
            .submit(job(i, request(i, speculate), &tx))
            .ok()
            .unwrap();
    }
    // A client that leaves after its first text.
    let leaver = request(1, speculate);
    let leave = leaver.cancel.clone();
    let mut texts = vec![String::new(); 9];
    let mut outcomes: Vec<Option<Result<Outcome, JobError>>> = (0..9).map(|_| None).collect();
    let mut joined = false;
    while outcomes.iter().any(Option::is_none) {
        let report = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the engine answers every job");
        match report {
            Report::Text(i, piece) => {
                texts[i].push_str(&piece);
                if i == 8 {
                    leave.cancel();
                }
                if !joined {
                    joined = true;
                    for i in 4..8 {
                        engine
                            .submit(job(i, request(i, speculate), &tx))
                            .ok()
                            .unwrap();
                    }
                    engine.submit(job(8, leaver.clone(), &tx)).ok().unwrap();
                }
            }
            Report::Done(i, result) => outcomes[i] = Some(*result),
        }
    }
    let mut accepted = 0;
    for (i, want) in expected.iter().enumerate() {
        let got = outcomes[i]
            .take()
            .unwrap()
            .unwrap_or_else(|e| panic!("job {i}: {e}"));
        assert_eq!(got.tokens, want.tokens, "job {i} ({drafter:?})");
        assert_eq!(got.text, want.text, "job {i}");
        assert_eq!(texts[i], want.text, "job {i}'s streamed text");
        assert_eq!(got.stop_reason, want.stop_reason, "job {i}");
        accepted += got.speculative.accepted;
    }
    if speculate {
        assert!(
            accepted > 0,
            "no draft was accepted in the batched passes ({drafter:?})"
        );
    }
    let left = outcomes[8].take().unwrap().unwrap();
    assert_eq!(left.stop_reason, StopReason::Cancelled);
    assert!(left.tokens.len() < 40, "the leaver stopped early");
    let passes = passes.lock().unwrap();
    assert!(
        passes.iter().any(|&(sequences, _)| sequences >= 3),
        "sequences shared passes: {passes:?}"
    );
    // Drafters that evaluate a model (the draft model, the target's MTP head) had their
    // evaluations gathered into passes of several sequences.
    if drafter.contains("\"model\"") || drafter.contains("\"mtp\"") {
        let draft_passes = draft_passes.lock().unwrap();
        assert!(
            draft_passes.iter().any(|&sequences| sequences >= 2),
            "drafting passes: {draft_passes:?}"
        );
    }
}

#[test]
fn plain_streams_equal_their_output_alone() {
    assert_streams_equal_alone(&shared("models/stories260K.gguf"), "");
}

#[test]
fn lookup_streams_equal_their_output_alone() {
    assert_streams_equal_alone(
        &shared("models/stories260K.gguf"),
        "[drafter]\nplugin = \"lookup\"\n",
    );
}

#[test]
fn draft_model_streams_equal_their_output_alone() {
    assert_streams_equal_alone(
        &shared("models/stories260K.gguf"),
        &format!(
            "[drafter]\nplugin = \"model\"\nmodel = {:?}\n",
            shared("models/llama2xs-281K.gguf")
        ),
    );
}

#[test]
fn mtp_streams_on_a_hybrid_equal_their_output_alone() {
    assert_streams_equal_alone(
        &shared("models/trained/stories-qwen35-mtp-q8_0.gguf"),
        "[drafter]\nplugin = \"mtp\"\n",
    );
}

/// A hybrid with an MTP head serves a repeated prompt from the prefix cache (its recurrent
/// state at a block boundary, the head's cache rebuilt): the second request takes whole
/// blocks of its prompt from the first, decodes the same tokens as alone, and its MTP drafts
/// are still accepted — the drafter continues from the rebuilt head.
#[test]
fn a_repeated_prompt_on_an_mtp_hybrid_is_served_from_the_prefix_cache() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared("models/trained/stories-qwen35-mtp-q8_0.gguf");
    let profile = profile(dir.path(), &model, "[drafter]\nplugin = \"mtp\"\n");
    let story = "Once upon a time, there was a little girl named Lily. She loved to play in \
                 the park with her friends. One day, she found a big red ball under a tree. \
                 She was very happy and ran to show her mom. Her mom smiled and said they \
                 could play with it after lunch. Lily and her friend Ben played with the ball \
                 all day. When the sun went down, they went home and had a big dinner. Lily";
    let repeated = Request {
        prompt: story.to_string(),
        max_tokens: 32,
        ..request(0, true)
    };
    let mut alone = Pipeline::open(&profile).unwrap();
    let want = generate(&mut alone, &repeated, |_| {}).unwrap();
    drop(alone);

    let admitted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = admitted.clone();
    let options = EngineOptions {
        prefill_chunk: 64,
        cost_curve: Some(CostCurve::from_points(vec![(1, 1.0), (64, 1.0)])),
        reopen: None,
        observer: Arc::new(move |e| {
            if let EngineEvent::Admitted { prompt, reused } = e {
                seen.lock().unwrap().push((prompt, reused));
            }
        }),
    };
    let engine = Engine::start(Parts::open(&profile, 2, None).unwrap(), 2, options).unwrap();
    let (tx, rx) = mpsc::channel();
    let mut outcomes = Vec::new();
    for i in 0..2 {
        engine.submit(job(i, repeated.clone(), &tx)).ok().unwrap();
        loop {
            match rx.recv_timeout(Duration::from_secs(120)).unwrap() {
                Report::Done(_, result) => {
                    outcomes.push(result.unwrap());
                    break;
                }
                Report::Text(..) => {}
            }
        }
    }
    let admitted = admitted.lock().unwrap().clone();
    let prompt = admitted[0].0;
    assert!(prompt > 128, "a prompt of several blocks: {admitted:?}");
    assert_eq!(admitted[0].1, 0, "nothing cached at first");
    assert!(
        admitted[1].1 >= 64 && admitted[1].1 < prompt,
        "whole blocks reused: {admitted:?}"
    );
    for got in &outcomes {
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(got.text, want.text);
    }
    assert!(
        outcomes[1].speculative.accepted > 0,
        "drafts after the reused prefix: {:?}",
        outcomes[1].speculative
    );
}

#[test]
fn a_panic_in_one_request_fails_that_request_only() {
    let dir = tempfile::tempdir().unwrap();
    let profile = profile(
        dir.path(),
        &shared("models/stories260K.gguf"),
        "[drafter]\nplugin = \"lookup\"\n",
    );
    let mut alone = Pipeline::open(&profile).unwrap();
    let want = generate(&mut alone, &request(1, true), |_| {}).unwrap();
    drop(alone);
    let engine = Engine::start(
        Parts::open(&profile, 2, None).unwrap(),
        2,
        EngineOptions::default(),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    let mut bomb = job(0, request(0, true), &tx);
    bomb.on_text = Box::new(|_| panic!("the client's sink exploded"));
    engine.submit(bomb).ok().unwrap();
    engine.submit(job(1, request(1, true), &tx)).ok().unwrap();
    let mut results: Vec<Option<Result<Outcome, JobError>>> = vec![None, None];
    while results.iter().any(Option::is_none) {
        if let Report::Done(i, r) = rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            results[i] = Some(*r);
        }
    }
    match results[0].take().unwrap() {
        Err(JobError::Panicked(message)) => assert!(message.contains("exploded"), "{message}"),
        other => panic!("the panicking request: {other:?}"),
    }
    assert_eq!(results[1].take().unwrap().unwrap().tokens, want.tokens);
    // The lane it used serves again.
    engine.submit(job(1, request(1, true), &tx)).ok().unwrap();
    assert_eq!(next_done(&rx).unwrap().tokens, want.tokens);
}

/// A target backend that, once `trip` is set, answers as a plugin whose panic fence caught a
/// panic: every call refused with [`ErrorKind::Panic`].
struct Tripwire {
    inner: BoxedForwardPass,
    trip: Arc<AtomicBool>,
}

impl Tripwire {
    fn check(&self) -> PluginResult<()> {
        if self.trip.load(Ordering::Relaxed) {
            RErr(PluginError::new(ErrorKind::Panic, "the kernel exploded"))
        } else {
            ROk(())
        }
    }
}

impl ForwardPass for Tripwire {
    fn model_info(&self) -> ModelInfo {
        self.inner.model_info()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn seq_create(&mut self) -> PluginResult<SeqId> {
        self.check().and_then(|()| self.inner.seq_create())
    }
    fn seq_fork(&mut self, seq: SeqId) -> PluginResult<SeqId> {
        self.check().and_then(|()| self.inner.seq_fork(seq))
    }
    fn seq_free(&mut self, seq: SeqId) -> PluginResult<()> {
        self.check().and_then(|()| self.inner.seq_free(seq))
    }
    fn seq_reuse_prefix(&mut self, seq: SeqId, tokens: RSlice<'_, u32>) -> PluginResult<usize> {
        self.check()
            .and_then(|()| self.inner.seq_reuse_prefix(seq, tokens))
    }
    fn seq_len(&self, seq: SeqId) -> PluginResult<usize> {
        self.check().and_then(|()| self.inner.seq_len(seq))
    }
    fn kv_usage(&self) -> KvUsage {
        self.inner.kv_usage()
    }
    fn eval_batch(
        &mut self,
        chunks: RSlice<'_, EvalChunk<'_>>,
        logits: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.check()
            .and_then(|()| self.inner.eval_batch(chunks, logits))
    }
    fn truncate(&mut self, seq: SeqId, len: usize) -> PluginResult<()> {
        self.check().and_then(|()| self.inner.truncate(seq, len))
    }
    fn seq_keep_path(&mut self, seq: SeqId, path: RSlice<'_, u32>) -> PluginResult<()> {
        self.check()
            .and_then(|()| self.inner.seq_keep_path(seq, path))
    }
    fn hidden_states(&self, seq: SeqId, out: &mut RVec<f32>) -> PluginResult<()> {
        self.check()
            .and_then(|()| self.inner.hidden_states(seq, out))
    }
    fn mtp_eval_batch(
        &mut self,
        chunks: RSlice<'_, MtpChunk<'_>>,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> PluginResult<()> {
        self.check()
            .and_then(|()| self.inner.mtp_eval_batch(chunks, logits, hidden_out))
    }
}

/// `profile`'s parts for 2 sequences, the target behind a [`Tripwire`], and its switch.
fn tripwired(profile: &Profile) -> (Parts, Arc<AtomicBool>) {
    let trip = Arc::new(AtomicBool::new(false));
    let mut parts = Parts::open(profile, 2, None).unwrap();
    parts.target = box_forward_pass(Tripwire {
        inner: parts.target,
        trip: trip.clone(),
    });
    (parts, trip)
}

/// The next job's end.
fn next_done(rx: &mpsc::Receiver<Report>) -> Result<Outcome, JobError> {
    loop {
        if let Report::Done(_, r) = rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            return *r;
        }
    }
}

/// Starts a long request and trips the target at its first text; returns how it ended.
fn trip_during_a_request(
    engine: &Engine,
    trip: &AtomicBool,
    tx: &mpsc::Sender<Report>,
    rx: &mpsc::Receiver<Report>,
) -> Result<Outcome, JobError> {
    let mut long = request(5, false);
    long.max_tokens = 400;
    engine.submit(job(0, long, tx)).ok().unwrap();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Report::Text(..) => trip.store(true, Ordering::Relaxed),
            Report::Done(_, r) => return *r,
        }
    }
}

/// When the target backend panics (and so refuses every later call), the requests it was
/// running fail with its message, and the engine reopens the model: later requests are
/// served as before.
#[test]
fn a_target_that_panicked_is_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let profile = profile(dir.path(), &shared("models/stories260K.gguf"), "");
    let mut alone = Pipeline::open(&profile).unwrap();
    let want = generate(&mut alone, &request(1, false), |_| {}).unwrap();
    drop(alone);

    let (parts, trip) = tripwired(&profile);
    let reopened = Arc::new(AtomicBool::new(false));
    let options = EngineOptions {
        reopen: Some(Arc::new({
            let (profile, reopened) = (profile.clone(), reopened.clone());
            move || {
                reopened.store(true, Ordering::Relaxed);
                Parts::open(&profile, 2, None)
            }
        })),
        ..EngineOptions::default()
    };
    let engine = Engine::start(parts, 2, options).unwrap();
    let (tx, rx) = mpsc::channel();
    match trip_during_a_request(&engine, &trip, &tx, &rx) {
        Err(JobError::Failed(message)) => {
            assert!(message.contains("the kernel exploded"), "{message}")
        }
        other => panic!("the request on the broken target: {other:?}"),
    }
    engine.submit(job(1, request(1, false), &tx)).ok().unwrap();
    assert_eq!(next_done(&rx).unwrap().tokens, want.tokens);
    assert!(reopened.load(Ordering::Relaxed));
}

/// Without a way to reopen it, an engine whose target panicked stops serving clearly: its
/// handle says why, and every later request is answered as unavailable, with the reason.
#[test]
fn a_target_that_cannot_be_reopened_stops_serving_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let profile = profile(dir.path(), &shared("models/stories260K.gguf"), "");
    let (parts, trip) = tripwired(&profile);
    let engine = Engine::start(parts, 2, EngineOptions::default()).unwrap();
    assert_eq!(engine.failure(), None);
    let (tx, rx) = mpsc::channel();
    let failed = trip_during_a_request(&engine, &trip, &tx, &rx);
    assert!(matches!(failed, Err(JobError::Failed(_))), "{failed:?}");
    engine.submit(job(1, request(1, false), &tx)).ok().unwrap();
    match next_done(&rx) {
        Err(JobError::Unavailable(why)) => assert!(why.contains("the kernel exploded"), "{why}"),
        other => panic!("a request after the failure: {other:?}"),
    }
    let failure = engine.failure().expect("the handle says why");
    assert!(failure.contains("could not be reopened"), "{failure}");
}

/// A request cancelled while its long prompt is still being read in chunks ends at the next
/// step, as cancelled, with nothing generated and no decode time; the request beside it runs on.
#[test]
fn a_request_cancelled_during_its_prefill_ends_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let profile = profile(dir.path(), &shared("models/stories260K.gguf"), "");
    let mut alone = Pipeline::open(&profile).unwrap();
    let want = generate(&mut alone, &request(1, false), |_| {}).unwrap();
    drop(alone);
    let options = EngineOptions {
        prefill_chunk: 2,
        ..EngineOptions::default()
    };
    let engine = Engine::start(Parts::open(&profile, 2, None).unwrap(), 2, options).unwrap();
    let (tx, rx) = mpsc::channel();
    // Once the other request decodes, the long prompt goes 2 tokens a pass; it is cancelled
    // three of the other's texts later.
    engine.submit(job(1, request(1, false), &tx)).ok().unwrap();
    let long = request(4, false);
    let cancel = long.cancel.clone();
    let mut long = Some(long);
    let mut texts_since = 0;
    let mut outcomes: Vec<Option<Outcome>> = vec![None, None];
    while outcomes.iter().any(Option::is_none) {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Report::Text(1, _) => {
                if let Some(long) = long.take() {
                    engine.submit(job(0, long, &tx)).ok().unwrap();
                } else {
                    texts_since += 1;
                    if texts_since == 3 {
                        cancel.cancel();
                    }
                }
            }
            Report::Text(..) => {}
            Report::Done(i, r) => outcomes[i] = Some(r.unwrap()),
        }
    }
    let cancelled = outcomes[0].take().unwrap();
    assert_eq!(cancelled.stop_reason, StopReason::Cancelled);
    assert!(cancelled.tokens.is_empty(), "{:?}", cancelled.tokens);
    assert_eq!(
        cancelled.timings.prefill_seconds, 0.0,
        "cancelled before its prompt was read"
    );
    assert_eq!(cancelled.timings.decode_seconds, 0.0);
    assert_eq!(outcomes[1].take().unwrap().tokens, want.tokens);
}

/// When the KV pool runs out of blocks, the newest request gives its blocks back and fails,
/// saying why, and the older ones go on to their whole output (before, every request that
/// needed a block in that pass failed).
#[test]
fn a_full_kv_pool_fails_the_newest_request_only() {
    let dir = tempfile::tempdir().unwrap();
    // 4 blocks of 64 positions for 3 sequences of ~100 tokens: room for two of them.
    let profile = profile(
        dir.path(),
        &shared("models/stories260K.gguf"),
        "context_size = 256\nkv_tokens = 256\n",
    );
    let long = |i: usize| Request {
        prompt: String::new(),
        max_tokens: 100,
        stop: Vec::new(),
        ..request(i, false)
    };
    let mut alone = Pipeline::open(&profile).unwrap();
    let want = generate(&mut alone, &long(0), |_| {}).unwrap();
    assert_eq!(want.tokens.len(), 100);
    drop(alone);
    let engine = Engine::start(
        Parts::open(&profile, 3, None).unwrap(),
        3,
        EngineOptions::default(),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    for i in 0..3 {
        engine.submit(job(i, long(i), &tx)).ok().unwrap();
    }
    let mut results: Vec<Option<Result<Outcome, JobError>>> = vec![None, None, None];
    while results.iter().any(Option::is_none) {
        if let Report::Done(i, r) = rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            results[i] = Some(*r);
        }
    }
    for (i, result) in results.iter().enumerate().take(2) {
        match result.as_ref().unwrap() {
            Ok(outcome) => assert_eq!(outcome.tokens, want.tokens, "request {i}"),
            Err(e) => panic!("request {i} failed: {e}"),
        }
    }
    match results[2].as_ref().unwrap() {
        Err(JobError::Capacity(message)) => assert!(
            message.contains("kv_tokens") && message.contains("gave way"),
            "{message}"
        ),
        other => panic!("the newest request: {other:?}"),
    }
}
