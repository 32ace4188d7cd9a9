//! The folded speculative loop over the real plugins: greedy parity with plain decoding for
//! every drafter, stops inside accepted runs, accounting, exact rejection sampling, and the
//! cost of a useless drafter.

use std::path::Path;

use abi_stable::std_types::{RSlice, RVec};
use specula_host::pipeline::{DrafterSlot, Pipeline};
use specula_host::profile::Profile;
use specula_host::request::{Outcome, Request, StopReason};
use specula_host::sampling::{Sampler, SamplingParams};
use specula_host::spec::{generate, SpecSettings};
use specula_plugin_api::{
    box_drafter, Draft, DraftRequest, Drafter, DrafterModels, LogitRows, PluginResult,
};
mod common;

use common::*;

const STORY_PROMPTS: &[&str] = &[
    "",
    "Once upon a time",
    "Lily and Ben went to the park. Lily and Ben",
    "The cat sat on the mat. The cat sat on the mat. The cat",
];

/// The `[drafter]` section of a profile drafting with the model at `draft` alone: no context
/// hints, which would stand in for its own first choices until the calibration learns better.
fn draft_model_alone_section(draft: &Path) -> String {
    format!(
        "{}[drafter.options]\ncontext_hints = false\n",
        draft_model_section(draft)
    )
}

/// A pipeline with room for the profile's verify passes even without a drafter: some tests
/// attach their own drafter after opening.
fn open(dir: &Path, model: &str, drafter: &str) -> Pipeline {
    let profile =
        Profile::load(write_spec_profile(dir, "p.toml", &shared(model), drafter)).unwrap();
    Pipeline::open_with_verify_tokens(&profile, profile.speculation.draft_max + 1).unwrap()
}

fn request(prompt: &str, max_tokens: u32, sampling: SamplingParams, spec: bool) -> Request {
    Request {
        prompt: prompt.to_string(),
        max_tokens,
        stop: Vec::new(),
        sampling,
        add_bos: true,
        speculation: spec.then_some(SpecSettings {
            draft_min: 0,
            draft_max: 7,
            adaptive: true,
            tree: false,
        }),
        cancel: Default::default(),
    }
}

/// The `[drafter]` section of a profile drafting with the model at `draft`.
fn draft_model_section(draft: &Path) -> String {
    format!(
        "[drafter]\nplugin = \"model\"\nmodel = {:?}\n",
        draft.to_str().unwrap()
    )
}

/// stories260K drafted by its real draft model, llama2xs-281K.
fn open_story_pair(dir: &Path) -> Pipeline {
    let draft = shared("models/llama2xs-281K.gguf");
    open(dir, "models/stories260K.gguf", &draft_model_section(&draft))
}

/// Generates, checks the accounting invariants, and returns the outcome with the target's
/// final sequence length.
fn run(pipeline: &mut Pipeline, request: &Request) -> (Outcome, usize) {
    let outcome = generate(pipeline, request, |_| {}).unwrap();
    check_accounting(&outcome);
    (outcome, pipeline.target.seq_len().unwrap())
}

fn check_accounting(o: &Outcome) {
    let s = &o.speculative;
    assert!(s.accepted + s.clamped <= s.drafted, "{s:?}");
    for (a, d) in s.accepted_by_position.iter().zip(&s.drafted_by_position) {
        assert!(a <= d, "{s:?}");
    }
    assert_eq!(s.emitted, s.steps + s.accepted, "{s:?}");
    assert_eq!(s.emitted as usize, o.tokens.len(), "{s:?}");
    assert!(
        s.target_passes <= 1 + s.steps && s.target_passes >= s.steps,
        "{s:?}"
    );
}

/// Plain and speculative greedy decoding emit the same ids, stop for the same reason, and
/// leave the target at the same length.
fn assert_parity(pipeline: &mut Pipeline, prompt: &str, max_tokens: u32, stop: &[&str]) -> Outcome {
    assert_parity_with(pipeline, prompt, max_tokens, stop, ADAPTIVE)
}

/// The adaptive controller as profiles configure it by default.
const ADAPTIVE: SpecSettings = SpecSettings {
    draft_min: 0,
    draft_max: 7,
    adaptive: true,
    tree: false,
};

/// A fixed draft length, for figures about the drafter itself and for runs that must not
/// depend on timing.
const FIXED_4: SpecSettings = SpecSettings {
    draft_min: 4,
    draft_max: 4,
    adaptive: false,
    tree: false,
};
const FIXED_7: SpecSettings = SpecSettings {
    draft_min: 7,
    draft_max: 7,
    adaptive: false,
    tree: false,
};
/// Trees of 7 nodes: 8 rows per pass, as [`FIXED_7`]'s chains.
const TREE_7: SpecSettings = SpecSettings {
    tree: true,
    ..FIXED_7
};

fn assert_parity_with(
    pipeline: &mut Pipeline,
    prompt: &str,
    max_tokens: u32,
    stop: &[&str],
    settings: SpecSettings,
) -> Outcome {
    let mut plain_req = request(prompt, max_tokens, SamplingParams::greedy(), false);
    plain_req.stop = stop.iter().map(|s| s.to_string()).collect();
    let mut spec_req = plain_req.clone();
    spec_req.speculation = Some(settings);
    let (plain, plain_len) = run(pipeline, &plain_req);
    let (spec, spec_len) = run(pipeline, &spec_req);
    assert_eq!(spec.tokens, plain.tokens, "prompt {prompt:?}");
    assert_eq!(spec.text, plain.text, "prompt {prompt:?}");
    assert_eq!(spec.stop_reason, plain.stop_reason, "prompt {prompt:?}");
    assert_eq!(
        spec_len, plain_len,
        "prompt {prompt:?}: target length after generation"
    );
    assert_eq!(plain.speculative.drafted, 0);
    spec
}

#[test]
fn lookup_greedy_parity_on_every_dense_model() {
    let dir = tempfile::tempdir().unwrap();
    for model in [
        "models/stories260K.gguf",
        "models/llama2xs-281K.gguf",
        "models/fixtures/tiny-llama.gguf",
        "models/next-arch/tiny-qwen2.gguf",
    ] {
        let mut p = open(dir.path(), model, "[drafter]\nplugin = \"lookup\"\n");
        let mut drafted = 0;
        for prompt in STORY_PROMPTS {
            for max in [64, 97] {
                assert_parity(&mut p, prompt, max, &[]);
                drafted += assert_parity_with(&mut p, prompt, max, &[], FIXED_7)
                    .speculative
                    .drafted;
            }
        }
        assert!(drafted > 0, "{model}: lookup never drafted");
    }
}

#[test]
fn stops_inside_accepted_runs_clamp_and_keep_parity() {
    let dir = tempfile::tempdir().unwrap();
    // A corpus holding the greedy continuation makes nearly every draft accepted, so token
    // limits and stop strings land inside accepted runs.
    let mut plain = open(dir.path(), "models/stories260K.gguf", "");
    let (full, _) = run(
        &mut plain,
        &request("Once upon a time", 200, SamplingParams::greedy(), false),
    );
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, format!("Once upon a time{}", full.text)).unwrap();
    let mut p = open(
        dir.path(),
        "models/stories260K.gguf",
        &format!(
            "[drafter]\nplugin = \"lookup\"\ncorpus = {:?}\n",
            corpus.to_str().unwrap()
        ),
    );
    let mut clamped = 0;
    for max in [1, 2, 5, 17, 33, 64, 150] {
        let o = assert_parity_with(&mut p, "Once upon a time", max, &[], FIXED_7);
        assert_parity(&mut p, "Once upon a time", max, &[]);
        assert_eq!(o.tokens.len(), max as usize);
        clamped += o.speculative.clamped;
    }
    for stop in ["Lily", "park.", "happy", "\n"] {
        let o = assert_parity_with(&mut p, "Once upon a time", 150, &[stop], FIXED_7);
        assert_parity(&mut p, "Once upon a time", 150, &[stop]);
        clamped += o.speculative.clamped;
    }
    assert!(clamped > 0, "no stop ever landed inside an accepted run");

    // An end-of-generation token inside an accepted run: make a frequent token end generation.
    let ids = p.tokenizer.encode(" the", false, false);
    let the = *ids.last().unwrap();
    p.info.eos_token = Some(the).into();
    let o = assert_parity_with(&mut p, "Once upon a time", 150, &[], FIXED_7);
    assert_eq!(o.stop_reason, StopReason::EndOfGeneration);
    assert_parity(&mut p, "Once upon a time", 150, &[]);
}

/// A cancelled request stops within one decode step, plain or speculative, and the pipeline
/// serves the next request as if nothing happened.
#[test]
fn cancellation_stops_within_a_step_and_leaves_the_pipeline_usable() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = open(
        dir.path(),
        "models/stories260K.gguf",
        "[drafter]\nplugin = \"lookup\"\n",
    );
    for spec in [false, true] {
        let req = request("Once upon a time", 200, SamplingParams::greedy(), spec);
        let (expected, _) = run(&mut p, &req);

        req.cancel.cancel();
        let (o, _) = run(&mut p, &req);
        assert_eq!(o.stop_reason, StopReason::Cancelled);
        assert!(o.tokens.is_empty(), "{:?}", o.tokens);

        let req = request("Once upon a time", 200, SamplingParams::greedy(), spec);
        let cancel = req.cancel.clone();
        let mut pieces = 0;
        let o = generate(&mut p, &req, |_| {
            pieces += 1;
            if pieces == 5 {
                cancel.cancel();
            }
        })
        .unwrap();
        check_accounting(&o);
        assert_eq!(o.stop_reason, StopReason::Cancelled);
        assert!(
            o.tokens.len() >= 5 && o.tokens.len() < 5 + 9,
            "{}",
            o.tokens.len()
        );
        assert_eq!(o.tokens, expected.tokens[..o.tokens.len()]);

        let (again, _) = run(
            &mut p,
            &request("Once upon a time", 200, SamplingParams::greedy(), spec),
        );
        assert_eq!(again.tokens, expected.tokens);
    }
}

#[test]
fn model_drafting_real_pair_has_real_acceptance_and_parity() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = open_story_pair(dir.path());
    let mut total = specula_host::spec::SpecStats::default();
    for prompt in STORY_PROMPTS {
        let o = assert_parity_with(&mut p, prompt, 96, &[], FIXED_4);
        total.merge(&o.speculative);
        // The adaptive controller keeps parity too.
        assert_parity(&mut p, prompt, 64, &[]);
    }
    println!(
        "stories260K + llama2xs-281K draft: acceptance {:.3} ({} of {} drafts), by position {:?}, mean accepted length {:.2}, passes/token {:.3}",
        total.acceptance_rate(),
        total.accepted + total.clamped,
        total.drafted,
        total.acceptance_by_position(),
        total.mean_accepted_length(),
        total.passes_per_token()
    );
    assert!(total.acceptance_rate() > 0.4, "{total:?}");
    assert!(total.passes_per_token() < 0.8, "{total:?}");
}

#[test]
fn self_drafting_accepts_everything() {
    let dir = tempfile::tempdir().unwrap();
    for model in [
        "models/fixtures/tiny-llama.gguf",
        "models/stories260K.gguf",
        "models/next-arch/tiny-qwen2.gguf",
    ] {
        let draft = shared(model);
        let mut p = open(dir.path(), model, &draft_model_alone_section(&draft));
        for prompt in STORY_PROMPTS {
            let o = assert_parity_with(&mut p, prompt, 80, &[], FIXED_4);
            let s = &o.speculative;
            assert!(s.drafted > 0);
            assert_eq!(s.accepted + s.clamped, s.drafted, "{model}: {s:?}");
        }
    }
}

#[test]
fn mismatched_draft_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // A model with another vocabulary: gen-model's synthetic one.
    let other = dir.path().join("other.gguf");
    let out = specula(
        &[
            "gen-model",
            "--out",
            other.to_str().unwrap(),
            "--vocab",
            "600",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let profile = write_spec_profile(
        dir.path(),
        "p.toml",
        &shared("models/stories260K.gguf"),
        &draft_model_section(&other),
    );
    let err = match Pipeline::open(&Profile::load(profile).unwrap()) {
        Ok(_) => panic!("opened a draft model with another vocabulary"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("vocabularies differ") && err.contains("other.gguf"),
        "{err}"
    );
}

/// Proposes tokens the target never picks; with a distribution or without; and from its
/// `fault.1`-th proposal on misbehaves as `fault.0` says.
struct BadDrafter {
    vocab: usize,
    with_probs: bool,
    fault: Option<(Fault, usize)>,
    proposals: usize,
}

impl Drafter for BadDrafter {
    fn begin(
        &mut self,
        _prompt: RSlice<'_, u32>,
        _reused: u32,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        Ok(()).into()
    }

    fn propose(
        &mut self,
        request: DraftRequest<'_>,
        mut models: DrafterModels<'_>,
        out: &mut Draft,
    ) -> PluginResult<()> {
        self.proposals += 1;
        out.clear();
        if let Some((fault, _)) = self.fault.filter(|&(_, at)| self.proposals >= at) {
            out.tokens.extend((0..request.max_tokens).map(|_| 0u32));
            let target = models.target.as_mut().unwrap();
            match fault {
                Fault::Fails => {
                    return Err(specula_plugin_api::PluginError::model("out of ideas")).into()
                }
                Fault::LeavesTokens => {
                    let mut logits = RVec::new();
                    target.eval(&[5, 6], LogitRows::Last, &mut logits).unwrap();
                }
                Fault::CutsTarget => {
                    let len = target.len().unwrap();
                    target.truncate(len - 1).unwrap();
                }
            }
            return Ok(()).into();
        }
        for i in 0..request.max_tokens as usize {
            // Control token <unk>, or a skewed distribution that favours byte tokens.
            if self.with_probs {
                let mut q = vec![0.0f32; self.vocab];
                for (t, p) in q.iter_mut().enumerate() {
                    *p = if (3..259).contains(&t) { 3.0 } else { 1.0 };
                }
                let sum: f32 = q.iter().sum();
                q.iter_mut().for_each(|p| *p /= sum);
                let token = ((request.seed as usize).wrapping_add(i * 7919) % 256 + 3) as u32;
                out.tokens.push(token);
                out.probs.extend_from_slice(&q);
            } else {
                out.tokens.push(0);
            }
        }
        Ok(()).into()
    }

    fn accept(
        &mut self,
        _accepted: RSlice<'_, u32>,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        Ok(()).into()
    }
}

fn with_bad_drafter(p: &mut Pipeline, with_probs: bool) {
    p.drafter = Some(DrafterSlot {
        name: "bad".into(),
        drafter: box_drafter(BadDrafter {
            vocab: p.info.vocab_size as usize,
            with_probs,
            fault: None,
            proposals: 0,
        }),
        draft_model: None,
        kit: None,
    });
}

#[test]
fn an_always_wrong_drafter_costs_almost_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = open(dir.path(), "models/stories260K.gguf", "");
    with_bad_drafter(&mut p, false);
    let o = assert_parity(&mut p, "Once upon a time", 400, &[]);
    let s = &o.speculative;
    println!(
        "always-wrong drafter, 400 tokens: {:.4} target passes/token, {} of {} steps drafted, {} paused",
        s.passes_per_token(),
        s.steps_with_drafts,
        s.steps,
        s.paused_steps
    );
    assert_eq!(s.accepted, 0);
    assert!(s.passes_per_token() <= 1.05, "{s:?}");
    // Speculation pauses itself: only a few probing steps draft at all.
    assert!(s.steps_with_drafts * 20 < s.steps, "{s:?}");
    assert!(s.paused_steps > 0, "{s:?}");
    // The summary says so, and why: its drafts were never accepted.
    assert!(s.paused_low_acceptance > s.paused_steps / 2, "{s:?}");
    let report = s.report();
    assert!(
        report.contains(&format!(
            "speculation paused on {} of {} steps: drafts were rarely accepted",
            s.paused_steps, s.steps
        )),
        "{report}"
    );
}

/// How a [`BadDrafter`] misbehaves.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Its proposal fails (as a plugin's panic reaches the host: an error).
    Fails,
    /// It evaluates two tokens on the target and leaves them there.
    LeavesTokens,
    /// It cuts the target's last token off.
    CutsTarget,
}

/// Speculation only ever changes the speed: a drafter that fails or leaves tokens on
/// the target is dropped with the reason in the statistics, and decoding goes on plainly to
/// the same output; one that cuts the target (which cannot be mended) ends the generation
/// with an error naming it.
#[test]
fn a_failing_drafter_is_dropped_and_the_output_stays_plain() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = open(dir.path(), "models/stories260K.gguf", "");
    let with = |p: &mut Pipeline, fault: Fault| {
        p.drafter = Some(DrafterSlot {
            name: "faulty".into(),
            drafter: box_drafter(BadDrafter {
                vocab: p.info.vocab_size as usize,
                with_probs: false,
                fault: Some((fault, 3)),
                proposals: 0,
            }),
            draft_model: None,
            kit: None,
        });
    };
    for (fault, says) in [
        (
            Fault::Fails,
            "drafter 'faulty' failed to propose: out of ideas",
        ),
        (
            Fault::LeavesTokens,
            "drafter 'faulty' left 2 tokens it evaluated on the target's sequence",
        ),
    ] {
        with(&mut p, fault);
        let o = assert_parity_with(&mut p, "Once upon a time", 60, &[], FIXED_4);
        let why = o.speculative.drafter_failure.as_deref().unwrap_or_default();
        assert!(why.starts_with(says), "{fault:?}: {why:?}");
        assert!(o.speculative.report().contains("decoded on without drafts"));
        // It drafted before it failed, and not after.
        assert_eq!(o.speculative.steps_with_drafts, 2, "{fault:?}");
    }
    with(&mut p, Fault::CutsTarget);
    let mut spec = request("Once upon a time", 60, SamplingParams::greedy(), false);
    spec.speculation = Some(FIXED_4);
    let err = generate(&mut p, &spec, |_| {}).unwrap_err();
    assert!(
        format!("{err:#}").contains("drafter 'faulty' cut the target's sequence it was lent"),
        "{err:#}"
    );
}

/// The joint distribution of the first two sampled tokens, computed from the target.
fn expected_pairs(
    p: &mut Pipeline,
    prompt: &[u32],
    sampling: &SamplingParams,
) -> Vec<((u32, u32), f64)> {
    let vocab = p.info.vocab_size as usize;
    let sampler = Sampler::new(sampling.clone());
    let mut logits = RVec::new();
    let mut first = Vec::new();
    p.target.truncate(0).into_result().unwrap();
    p.target
        .eval(prompt, LogitRows::Last, &mut logits)
        .into_result()
        .unwrap();
    sampler.distribution(&logits[..vocab], prompt, &mut first);
    let mut pairs = Vec::new();
    for c1 in &first {
        p.target.truncate(prompt.len()).into_result().unwrap();
        p.target
            .eval(&[c1.id], LogitRows::Last, &mut logits)
            .into_result()
            .unwrap();
        let mut history = prompt.to_vec();
        history.push(c1.id);
        let mut second = Vec::new();
        sampler.distribution(&logits[..vocab], &history, &mut second);
        for c2 in &second {
            pairs.push(((c1.id, c2.id), f64::from(c1.p) * f64::from(c2.p)));
        }
    }
    pairs
}

#[test]
fn rejection_sampling_keeps_the_target_distribution() {
    let dir = tempfile::tempdir().unwrap();
    // Trees at a higher temperature: their drafters are then unsure enough at the first
    // token to draw several siblings, which the target judges one after another.
    let sampling = |seed, tree: bool| SamplingParams {
        temperature: if tree { 3.0 } else { 1.0 },
        top_k: 3,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed: Some(seed),
    };
    let prompt = "Once upon a time, there was a";
    type Setup<'a> = (&'a str, Box<dyn Fn(&Path) -> Pipeline + 'a>);
    let setups: Vec<Setup> = vec![
        // Trees: siblings drawn without replacement, judged by recursive rejection.
        ("draft model, trees", Box::new(open_story_pair)),
        (
            "mtp (trained stories-qwen35), trees",
            Box::new(|d: &Path| {
                open(
                    d,
                    "models/trained/stories-qwen35-mtp-q8_0.gguf",
                    "[drafter]\nplugin = \"mtp\"\n",
                )
            }),
        ),
        ("draft model", Box::new(open_story_pair)),
        (
            "bad drafter with a distribution",
            Box::new(|d: &Path| {
                let mut p = open(d, "models/stories260K.gguf", "");
                with_bad_drafter(&mut p, true);
                p
            }),
        ),
        (
            "bad one-hot drafter",
            Box::new(|d: &Path| {
                let mut p = open(d, "models/stories260K.gguf", "");
                with_bad_drafter(&mut p, false);
                p
            }),
        ),
    ];
    for (name, make) in setups {
        let mut p = make(dir.path());
        let prompt_ids = p.tokenizer.encode(prompt, true, true);
        let tree = name.ends_with("trees");
        let expected = expected_pairs(&mut p, &prompt_ids, &sampling(0, tree));
        let n = 3000;
        let mut counts = vec![0u64; expected.len()];
        let mut drafted = 0;
        for seed in 0..n {
            let mut req = request(prompt, 2, sampling(seed, tree), true);
            // Always draft, so every second token goes through rejection sampling.
            req.speculation = Some(SpecSettings {
                draft_min: 3,
                draft_max: 3,
                adaptive: false,
                tree,
            });
            let (o, _) = run(&mut p, &req);
            drafted += o.speculative.drafted;
            let pair = (o.tokens[0], o.tokens[1]);
            let cell = expected
                .iter()
                .position(|(k, _)| *k == pair)
                .unwrap_or_else(|| panic!("{name}: {pair:?} outside the support"));
            counts[cell] += 1;
        }
        assert!(drafted >= n, "{name}: drafts were not verified");
        // Chi-square over cells with enough expected mass; 8 degrees of freedom at most
        // (3 × 3 cells): the 99.9% quantile is 26.1.
        let chi2: f64 = expected
            .iter()
            .zip(&counts)
            .map(|((_, p), &c)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        println!(
            "{name}: chi-square {chi2:.2} over {} cells, {n} samples",
            expected.len()
        );
        assert!(
            chi2 < 26.1,
            "{name}: chi2 {chi2}, counts {counts:?}, expected {expected:?}"
        );
    }
}

#[test]
fn sampled_speculation_is_reproducible_with_a_seed() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = open_story_pair(dir.path());
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repeat_penalty: 1.1,
        repeat_last_n: 64,
        seed: Some(5),
    };
    // A fixed draft length: the adaptive controller follows timing, so with it a sampled
    // run may draw a different (equally distributed) text for the same seed (see README).
    let mut req = request("Once upon a time", 80, sampling, true);
    req.speculation = Some(FIXED_4);
    let (a, _) = run(&mut p, &req);
    let (b, _) = run(&mut p, &req);
    assert_eq!(a.tokens, b.tokens);
    assert!(a.speculative.accepted > 0, "{:?}", a.speculative);
}

const HYBRIDS: &[&str] = &[
    "models/fixtures/tiny-qwen35.gguf",
    "models/fixtures/tiny-qwen35-mtp.gguf",
    "models/fixtures/tiny-qwen35-4l-mtp.gguf",
    "models/fixtures/tiny-qwen3next.gguf",
    "models/fixtures/tiny-qwen3next-mtp.gguf",
    "models/trained/stories-qwen35-mtp-q8_0.gguf",
];

const MTP_MODELS: &[&str] = &[
    "models/fixtures/tiny-qwen35-mtp.gguf",
    "models/fixtures/tiny-qwen35-4l-mtp.gguf",
    "models/fixtures/tiny-qwen3next-mtp.gguf",
    "models/trained/stories-qwen35-mtp-f32.gguf",
    "models/trained/stories-qwen35-mtp-q8_0.gguf",
];

#[test]
fn lookup_greedy_parity_on_every_hybrid_model() {
    let dir = tempfile::tempdir().unwrap();
    for model in HYBRIDS {
        let mut p = open(dir.path(), model, "[drafter]\nplugin = \"lookup\"\n");
        for prompt in STORY_PROMPTS {
            assert_parity(&mut p, prompt, 72, &[]);
            assert_parity_with(&mut p, prompt, 72, &[], FIXED_7);
        }
    }
}

#[test]
fn mtp_greedy_parity_on_every_mtp_model() {
    let dir = tempfile::tempdir().unwrap();
    for model in MTP_MODELS {
        let mut p = open(dir.path(), model, "[drafter]\nplugin = \"mtp\"\n");
        let mut total = specula_host::spec::SpecStats::default();
        for prompt in STORY_PROMPTS {
            for settings in [FIXED_4, ADAPTIVE] {
                let o = assert_parity_with(&mut p, prompt, 80, &[], settings);
                total.merge(&o.speculative);
            }
            // Token limits and stop strings inside accepted runs.
            for max in [3, 17, 41] {
                assert_parity_with(&mut p, prompt, max, &[], FIXED_4);
            }
            assert_parity_with(&mut p, prompt, 80, &["Lily", "."], FIXED_4);
        }
        // With context hints (off by default for the head): chains and trees.
        let hinted = "[drafter]\nplugin = \"mtp\"\n[drafter.options]\ncontext_hints = true\n";
        let mut h = open(dir.path(), model, hinted);
        for prompt in STORY_PROMPTS {
            for settings in [FIXED_7, TREE_7] {
                assert_parity_with(&mut h, prompt, 80, &[], settings);
            }
        }
        assert!(total.drafted > 0, "{model}");
        println!(
            "{model}: MTP acceptance {:.3} ({} of {}), by position {:?}, passes/token {:.3}",
            total.acceptance_rate(),
            total.accepted + total.clamped,
            total.drafted,
            total.acceptance_by_position(),
            total.passes_per_token()
        );
        if model.contains("trained") {
            // A trained MTP head: README reports ~83% at draft length 3 in llama.cpp.
            assert!(total.acceptance_rate() > 0.6, "{model}: {total:?}");
        }
    }
}

#[test]
fn mtp_needs_a_model_with_an_mtp_head() {
    let dir = tempfile::tempdir().unwrap();
    let profile = write_spec_profile(
        dir.path(),
        "p.toml",
        &shared("models/stories260K.gguf"),
        "[drafter]\nplugin = \"mtp\"\n",
    );
    let err = match Pipeline::open(&Profile::load(profile).unwrap()) {
        Ok(_) => panic!("mtp drafting opened on a model without an MTP head"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("MTP") && err.contains("has none"), "{err}");
}

#[test]
fn hybrid_fixture_drafting_for_itself_accepts_everything() {
    let dir = tempfile::tempdir().unwrap();
    for model in [
        "models/fixtures/tiny-qwen35.gguf",
        "models/fixtures/tiny-qwen3next.gguf",
    ] {
        let draft = shared(model);
        let mut p = open(dir.path(), model, &draft_model_alone_section(&draft));
        for prompt in STORY_PROMPTS {
            let o = assert_parity_with(&mut p, prompt, 64, &[], FIXED_4);
            let s = &o.speculative;
            assert!(s.drafted > 0);
            assert_eq!(s.accepted + s.clamped, s.drafted, "{model}: {s:?}");
        }
    }
}

/// A profile that decodes plainly opens its target for one-token passes (a hybrid's snapshot
/// ring then holds no planes it cannot use); a speculating one for its longest draft plus one.
#[test]
fn plain_profiles_open_one_token_verify_passes() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared("models/trained/stories-qwen35-mtp-q8_0.gguf");
    let plain = Profile::load(write_spec_profile(dir.path(), "plain.toml", &model, "")).unwrap();
    let p = Pipeline::open(&plain).unwrap();
    assert_eq!(p.target.capabilities().max_verify_tokens, 1);
    let mtp = "[drafter]\nplugin = \"mtp\"\n[speculation]\ndraft_max = 3\n";
    let spec = Profile::load(write_spec_profile(dir.path(), "mtp.toml", &model, mtp)).unwrap();
    let p = Pipeline::open(&spec).unwrap();
    assert_eq!(p.target.capabilities().max_verify_tokens, 4);
    let p = Pipeline::open_with_verify_tokens(&plain, 4).unwrap();
    assert_eq!(p.target.capabilities().max_verify_tokens, 4);
}

/// A conversation on a hybrid with an MTP head whose next turn keeps less of the previous one
/// than the recurrent state's snapshots reach: the turn starts a new target sequence (from the
/// prefix cache as far as it serves) instead of re-decoding the kept tokens under the drafter,
/// and its output equals the same request run afresh — MTP drafting still on.
#[test]
fn a_turn_that_keeps_less_than_the_rollback_window_starts_a_new_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let model = "models/trained/stories-qwen35-mtp-q8_0.gguf";
    let mut chat = open(dir.path(), model, "[drafter]\nplugin = \"mtp\"\n");
    let story = "Once upon a time, there was a little girl named Lily. She loved to play in \
                 the park with her friends. One day, she found a big red ball under a tree. \
                 She was very happy and ran to show her mom.";
    let first = request(story, 40, SamplingParams::greedy(), true);
    specula_host::spec::generate_continuing(&mut chat, &first, |_| {}).unwrap();
    // The next prompt parts from the first inside it: far behind what the target holds.
    let second = request(
        &format!("{} Her mom said no.", &story[..story.len() / 2]),
        24,
        SamplingParams::greedy(),
        true,
    );
    let got = specula_host::spec::generate_continuing(&mut chat, &second, |_| {}).unwrap();
    check_accounting(&got);
    let mut fresh = open(dir.path(), model, "[drafter]\nplugin = \"mtp\"\n");
    let want = generate(&mut fresh, &second, |_| {}).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert!(got.speculative.accepted > 0, "{:?}", got.speculative);
}

/// Tree speculation (greedy) through `p`'s drafter: the output equals plain decoding — also
/// with token limits, stop strings and an end-of-generation token inside the accepted path —
/// and returns the tokens per target pass of chains and of trees at 8 rows per pass.
fn tree_parity(p: &mut Pipeline, name: &str) -> (f64, f64) {
    let (mut chains, mut trees) = (
        specula_host::spec::SpecStats::default(),
        specula_host::spec::SpecStats::default(),
    );
    for prompt in STORY_PROMPTS {
        trees.merge(&assert_parity_with(p, prompt, 96, &[], TREE_7).speculative);
        chains.merge(&assert_parity_with(p, prompt, 96, &[], FIXED_7).speculative);
        for max in [1, 3, 10] {
            assert_parity_with(p, prompt, max, &[], TREE_7);
        }
        for stop in ["Lily", "park.", "\n"] {
            assert_parity_with(p, prompt, 96, &[stop], TREE_7);
        }
    }
    assert!(trees.drafted > 0, "{name}: {trees:?}");
    let eos = p.info.eos_token;
    let ids = p.tokenizer.encode(" the", false, false);
    p.info.eos_token = Some(*ids.last().unwrap()).into();
    for prompt in STORY_PROMPTS {
        assert_parity_with(p, prompt, 150, &[], TREE_7);
    }
    p.info.eos_token = eos;
    let per_pass = |s: &specula_host::spec::SpecStats| s.emitted as f64 / s.target_passes as f64;
    println!(
        "{name}, 8 rows per pass: tokens per target pass chain {:.3}, tree {:.3}",
        per_pass(&chains),
        per_pass(&trees)
    );
    (per_pass(&chains), per_pass(&trees))
}

/// Tree speculation keeps greedy parity with the draft model (a dense pair), with lookup (a
/// dense and a hybrid model) and with the MTP head on every MTP model (hybrids: each tree
/// row's recurrent state from its parent's).
#[test]
fn tree_speculation_keeps_greedy_parity() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = open_story_pair(dir.path());
    let (chain, tree) = tree_parity(&mut p, "stories260K + llama2xs-281K");
    assert!(
        tree > chain,
        "trees {tree:.3} against chains {chain:.3} tokens per pass"
    );
    for model in [
        "models/stories260K.gguf",
        "models/fixtures/tiny-qwen35.gguf",
    ] {
        let mut p = open(dir.path(), model, "[drafter]\nplugin = \"lookup\"\n");
        tree_parity(&mut p, &format!("{model} + lookup"));
    }
    for model in MTP_MODELS {
        let mut p = open(dir.path(), model, "[drafter]\nplugin = \"mtp\"\n");
        tree_parity(&mut p, model);
    }
}

/// The draft model's drafts with context hints (the default) and without: both keep greedy
/// parity, chains and trees, and the hints raise the tokens per pass where the text repeats
/// itself (the small target falls into loops on these prompts, eight windows of the stories
/// `specula bench` prompts with).
#[test]
fn context_hints_raise_the_draft_models_acceptance_and_keep_parity() {
    let dir = tempfile::tempdir().unwrap();
    let draft = shared("models/llama2xs-281K.gguf");
    let stories = specula_host::genmodel::DEFAULT_CORPUS;
    let prompts: Vec<&str> = (0..8)
        .map(|i| {
            let at = stories.floor_char_boundary(i * stories.len() / 8);
            &stories[at..stories.floor_char_boundary(at + 120)]
        })
        .collect();
    let mut per_pass = Vec::new();
    for drafter in [
        draft_model_section(&draft),
        draft_model_alone_section(&draft),
    ] {
        // Room for the prompt and 256 tokens (the `[target]` table is still open).
        let section = format!("context_size = 512\n{drafter}");
        let mut p = open(dir.path(), "models/stories260K.gguf", &section);
        let (mut chains, mut trees) = (
            specula_host::spec::SpecStats::default(),
            specula_host::spec::SpecStats::default(),
        );
        for prompt in &prompts {
            chains.merge(&assert_parity_with(&mut p, prompt, 256, &[], FIXED_7).speculative);
            trees.merge(&assert_parity_with(&mut p, prompt, 256, &[], TREE_7).speculative);
        }
        let rate = |s: &specula_host::spec::SpecStats| s.emitted as f64 / s.target_passes as f64;
        per_pass.push((rate(&chains), rate(&trees)));
    }
    let [(chain, tree), (alone_chain, alone_tree)] = per_pass[..] else {
        unreachable!()
    };
    println!(
        "tokens per pass with context hints: chain {chain:.3}, tree {tree:.3}; without: chain \
         {alone_chain:.3}, tree {alone_tree:.3}"
    );
    assert!(
        chain > alone_chain * 1.05,
        "chains {chain:.3} against {alone_chain:.3}"
    );
    assert!(
        tree > alone_tree * 1.05,
        "trees {tree:.3} against {alone_tree:.3}"
    );
}

/// llama2xs-281K was trained on 256-token texts, stories260K on 2,048: with a prompt longer than
/// the draft model's context, and a generation running on past it, the draft model drafts
/// every step from a window of the context's last tokens, chains and trees, with greedy
/// parity.
#[test]
fn a_draft_model_with_a_shorter_context_drafts_from_a_window() {
    let dir = tempfile::tempdir().unwrap();
    let draft = shared("models/llama2xs-281K.gguf");
    let section = format!("context_size = 1024\n{}", draft_model_section(&draft));
    let mut p = open(dir.path(), "models/stories260K.gguf", &section);
    let stories = specula_host::genmodel::DEFAULT_CORPUS;
    let long = &stories[..stories.floor_char_boundary(600)];
    for (prompt, max_tokens) in [(long, 200), ("Once upon a time", 400)] {
        assert!(p.tokenizer.encode(prompt, true, false).len() + max_tokens > 256 + 100);
        for settings in [FIXED_7, TREE_7] {
            let o = assert_parity_with(&mut p, prompt, max_tokens as u32, &[], settings);
            let s = &o.speculative;
            assert_eq!(s.steps_with_drafts, s.steps, "a step without drafts: {s:?}");
            assert!(s.accepted > 0, "{s:?}");
        }
    }
}

/// Accepted drafts that fill the context end generation where plain decoding ends it, chains
/// and trees alike (a drafter that drafts the target itself: every draft accepted up to the
/// last position).
#[test]
fn drafts_that_fill_the_context_stop_where_plain_decoding_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared("models/stories260K.gguf");
    let mut p = open(
        dir.path(),
        "models/stories260K.gguf",
        &format!("context_size = 90\n{}", draft_model_section(&model)),
    );
    for prompt in STORY_PROMPTS {
        for settings in [FIXED_4, FIXED_7, TREE_7] {
            let o = assert_parity_with(&mut p, prompt, 400, &[], settings);
            assert_eq!(o.stop_reason, StopReason::ContextFull, "{prompt:?}");
        }
    }
}

/// Adaptive trees take the nodes that pay for their rows on the target's cost curve: all the
/// drafter offers when rows are nearly free, fewer when each row costs a quarter of a pass, a
/// probing node now and then when no tree pays — and the output is plain decoding's each way.
#[test]
fn tree_nodes_follow_the_cost_of_rows() {
    use specula_host::scheduler::budget::CostCurve;
    let dir = tempfile::tempdir().unwrap();
    let mut p = open_story_pair(dir.path());
    let adaptive_tree = SpecSettings {
        draft_min: 0,
        draft_max: 7,
        adaptive: true,
        tree: true,
    };
    let curves = [
        CostCurve::from_points(vec![(1, 1.0), (64, 1.0001)]),
        CostCurve::from_points(vec![(1, 1.0), (2, 1.25), (8, 2.75)]),
        // Each row as dear as a pass: no tree pays, but one node now and then still probes.
        CostCurve::from_points(vec![(1, 1.0), (2, 2.0)]),
    ];
    let mut nodes = Vec::new();
    for curve in curves {
        p.cost_curve = Some(curve);
        let mut stats = specula_host::spec::SpecStats::default();
        for prompt in STORY_PROMPTS {
            stats.merge(&assert_parity_with(&mut p, prompt, 96, &[], adaptive_tree).speculative);
        }
        assert!(stats.steps_with_drafts >= 4, "{stats:?}");
        nodes.push(stats.drafted as f64 / stats.steps_with_drafts as f64);
        if nodes.len() == 3 {
            assert!(stats.steps_with_drafts * 8 < stats.steps, "{stats:?}");
        }
    }
    eprintln!(
        "nodes per tree: flat {:.2}, steep {:.2}, prohibitive {:.2}",
        nodes[0], nodes[1], nodes[2]
    );
    assert!(nodes[0] > 6.5, "{nodes:?}");
    assert!(nodes[1] >= 1.0 && nodes[1] < 4.0, "{nodes:?}");
    assert_eq!(nodes[2], 1.0, "{nodes:?}");
}
