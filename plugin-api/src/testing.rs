//! Checks and helpers every backend's tests share (not part of the ABI).

use abi_stable::std_types::{RSlice, RString, RVec, Tuple2};

use crate::{
    BackendParams, ErrorKind, EvalChunk, ForwardPass, LogitRows, MtpChunk, PanicFence, PluginError,
    SeqId, SequenceCalls,
};

/// The parameters opening the model at `model_path` with `threads` threads, a context of
/// `context_size` tokens (0: the trained length), a verify capacity of `max_verify_tokens`
/// (0: the backend's default) and the backend `options`.
pub fn backend_params(
    model_path: &str,
    threads: u32,
    context_size: u32,
    max_verify_tokens: u32,
    options: &[(&str, &str)],
) -> BackendParams {
    BackendParams {
        model_path: RString::from(model_path),
        threads,
        context_size,
        max_verify_tokens,
        max_sequences: 0,
        kv_tokens: 0,
        options: options
            .iter()
            .map(|(k, v)| Tuple2(RString::from(*k), RString::from(*v)))
            .collect(),
    }
}

/// A small reproducible generator (SplitMix64) for test inputs: the same numbers on every
/// machine and in every backend's tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in `0 .. n`.
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n)) as u32
    }

    /// `n` token ids below `vocab`.
    pub fn tokens(&mut self, n: usize, vocab: u32) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab)).collect()
    }
}

/// Asserts the [`PanicFence`] contract on a backend that holds a sequence: once a call
/// through `fence` has panicked, every call that touches the sequence is refused with an
/// error naming `plugin` and the first panic, while what the model is stays answerable.
pub fn assert_refuses_every_call_after_a_panic<B: ForwardPass>(
    backend: &mut B,
    fence: &PanicFence,
    plugin: &str,
) {
    let mut logits = RVec::new();
    let seq = new_seq(backend);
    backend
        .eval(seq, &[1, 2], LogitRows::Last, &mut logits)
        .into_result()
        .expect("a first eval");
    assert_eq!(backend.seq_len(seq).into_result(), Ok(2));

    let panicked = fence
        .guard(plugin, || -> Result<(), PluginError> {
            panic!("injected for the test")
        })
        .into_result()
        .unwrap_err();
    assert_eq!(panicked.kind, ErrorKind::Panic);

    let refused = |result: Result<(), PluginError>| {
        let e = result.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Panic, "{e}");
        assert!(
            e.message.contains(plugin) && e.message.contains("injected for the test"),
            "{e}"
        );
    };
    refused(backend.seq_len(seq).into_result().map(|_| ()));
    refused(
        backend
            .eval(seq, &[3], LogitRows::Last, &mut logits)
            .into_result(),
    );
    refused(backend.truncate(seq, 1).into_result());
    refused(backend.seq_create().into_result().map(|_| ()));
    refused(backend.seq_fork(seq).into_result().map(|_| ()));
    refused(backend.seq_free(seq).into_result());
    refused(
        backend
            .seq_reuse_prefix(seq, RSlice::from_slice(&[1, 2]))
            .into_result()
            .map(|_| ()),
    );
    let mut hidden = RVec::new();
    refused(backend.hidden_states(seq, &mut hidden).into_result());
    let e = backend.model_info().hidden_size as usize;
    refused(
        backend
            .mtp_eval(
                seq,
                &vec![0.0; e],
                &[1],
                0,
                LogitRows::All,
                &mut logits,
                &mut hidden,
            )
            .into_result(),
    );
    // What the model is does not change.
    assert!(backend.model_info().vocab_size > 0);
    let _ = backend.capabilities();
}

/// A backend instance and one sequence of it: what single-sequence tests need. Derefs to the
/// backend for everything else.
pub struct Solo<B> {
    pub backend: B,
    pub seq: SeqId,
}

impl<B: ForwardPass> Solo<B> {
    /// `backend` with a new sequence.
    pub fn new(mut backend: B) -> Self {
        let seq = new_seq(&mut backend);
        Self { backend, seq }
    }

    /// Evaluates `tokens` after the sequence and returns the requested logits.
    pub fn eval(&mut self, tokens: &[u32], rows: LogitRows) -> Vec<f32> {
        eval(&mut self.backend, self.seq, tokens, rows)
    }

    /// [`SequenceCalls::eval`] on the sequence, errors returned.
    pub fn try_eval(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.backend
            .eval(self.seq, tokens, rows, logits)
            .into_result()
    }

    /// The hidden states of the sequence's last evaluated rows.
    pub fn hidden(&self) -> Vec<f32> {
        hidden(&self.backend, self.seq)
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        seq_len(&self.backend, self.seq)
    }

    /// Whether the sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cuts the sequence to `len` tokens, errors returned.
    pub fn truncate_to(&mut self, len: usize) -> Result<(), PluginError> {
        self.backend.truncate(self.seq, len).into_result()
    }

    /// [`SequenceCalls::mtp_eval`] on the sequence, errors returned.
    pub fn mtp_eval(
        &mut self,
        hidden: &[f32],
        tokens: &[u32],
        position: usize,
        rows: LogitRows,
        logits: &mut RVec<f32>,
        hidden_out: &mut RVec<f32>,
    ) -> Result<(), PluginError> {
        self.backend
            .mtp_eval(self.seq, hidden, tokens, position, rows, logits, hidden_out)
            .into_result()
    }
}

impl<B> std::ops::Deref for Solo<B> {
    type Target = B;
    fn deref(&self) -> &B {
        &self.backend
    }
}

impl<B> std::ops::DerefMut for Solo<B> {
    fn deref_mut(&mut self) -> &mut B {
        &mut self.backend
    }
}

/// A new sequence of `b` (panicking on an error).
pub fn new_seq<B: ForwardPass + ?Sized>(b: &mut B) -> SeqId {
    b.seq_create()
        .into_result()
        .unwrap_or_else(|e| panic!("seq_create: {e}"))
}

/// Evaluates `tokens` after `seq` and returns the requested logits (panicking, naming the
/// tokens, on an error).
pub fn eval<B: ForwardPass + ?Sized>(
    b: &mut B,
    seq: SeqId,
    tokens: &[u32],
    rows: LogitRows,
) -> Vec<f32> {
    let mut logits = RVec::new();
    b.eval(seq, tokens, rows, &mut logits)
        .into_result()
        .unwrap_or_else(|e| panic!("eval of {tokens:?} in {seq}: {e}"));
    logits.to_vec()
}

/// The hidden states of `seq`'s last evaluated rows.
pub fn hidden<B: ForwardPass + ?Sized>(b: &B, seq: SeqId) -> Vec<f32> {
    let mut out = RVec::new();
    b.hidden_states(seq, &mut out)
        .into_result()
        .unwrap_or_else(|e| panic!("hidden_states of {seq}: {e}"));
    out.to_vec()
}

/// Truncates `seq` to `len` tokens.
pub fn truncate<B: ForwardPass + ?Sized>(b: &mut B, seq: SeqId, len: usize) {
    b.truncate(seq, len)
        .into_result()
        .unwrap_or_else(|e| panic!("truncate {seq} to {len}: {e}"));
}

/// The length of `seq`.
pub fn seq_len<B: ForwardPass + ?Sized>(b: &B, seq: SeqId) -> usize {
    b.seq_len(seq)
        .into_result()
        .unwrap_or_else(|e| panic!("seq_len of {seq}: {e}"))
}

/// The index of the largest logit (the first of equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of `n` tokens after `prompt` in `seq`, one token per eval.
pub fn greedy<B: ForwardPass + ?Sized>(
    b: &mut B,
    seq: SeqId,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let mut next = argmax(&eval(b, seq, prompt, LogitRows::Last));
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        out.push(next);
        if out.len() == n {
            break;
        }
        let logits = eval(b, seq, &[next], LogitRows::Last);
        assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
        next = argmax(&logits);
    }
    out
}

/// The bit patterns of `values`, for exact comparisons with readable failures.
pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Row `i` of `values` stored as rows of `width`.
pub fn row(values: &[f32], i: usize, width: usize) -> &[f32] {
    &values[i * width..(i + 1) * width]
}

/// Asserts the verify-row contract of a backend (`batched` and `single` fresh instances of
/// one model, each with an empty sequence): `prompt` evaluated in one call gives every row's
/// logits and hidden states bit for bit as token-by-token evals, and so does a k-token eval of
/// random tokens (seeded by `seed`) for every k of `ks`; a k-token `Last` eval gives the last
/// row of an `All` eval.
pub fn assert_verify_rows_match_single_evals<B: ForwardPass>(
    batched: &mut Solo<B>,
    single: &mut Solo<B>,
    prompt: &[u32],
    ks: &[usize],
    seed: u64,
    name: &str,
) {
    let info = batched.model_info();
    let (vocab, e) = (info.vocab_size as usize, info.hidden_size as usize);
    let (bs, ss) = (batched.seq, single.seq);
    let (batched, single) = (&mut batched.backend, &mut single.backend);
    let prefill = eval(batched, bs, prompt, LogitRows::All);
    let prefill_hidden = hidden(batched, bs);
    for (i, &t) in prompt.iter().enumerate() {
        let r = eval(single, ss, &[t], LogitRows::Last);
        assert_eq!(
            bits(row(&prefill, i, vocab)),
            bits(&r),
            "{name}: prompt row {i}"
        );
        assert_eq!(
            bits(row(&prefill_hidden, i, e)),
            bits(&hidden(single, ss)),
            "{name}: prompt hidden {i}"
        );
    }
    let mut rng = Rng::new(seed);
    for &k in ks {
        let tokens = rng.tokens(k, vocab as u32);
        let all = eval(batched, bs, &tokens, LogitRows::All);
        let all_hidden = hidden(batched, bs);
        assert_eq!((all.len(), all_hidden.len()), (k * vocab, k * e), "{name}");
        for (i, &t) in tokens.iter().enumerate() {
            let r = eval(single, ss, &[t], LogitRows::Last);
            assert!(r.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
            assert_eq!(
                bits(row(&all, i, vocab)),
                bits(&r),
                "{name}: k={k}, row {i} differs from the single-token eval"
            );
            assert_eq!(
                bits(row(&all_hidden, i, e)),
                bits(&hidden(single, ss)),
                "{name}: k={k}, hidden row {i}"
            );
        }
        let last_tokens = rng.tokens(k, vocab as u32);
        let last = eval(batched, bs, &last_tokens, LogitRows::Last);
        let reference = eval(single, ss, &last_tokens, LogitRows::All);
        assert_eq!(
            bits(&last),
            bits(row(&reference, k - 1, vocab)),
            "{name}: k={k}, Last"
        );
    }
    assert_eq!(seq_len(batched, bs), seq_len(single, ss), "{name}");
}

/// One sequence of [`assert_batches_match_sequences_alone`]: its id in the batched instance
/// and in the reference instance.
#[derive(Debug, Clone, Copy)]
struct Pair {
    batched: SeqId,
    alone: SeqId,
}

/// Asserts the many-sequence contract (`batched` and `alone` fresh instances of one model,
/// each allowing `n_seqs` sequences): over `steps` rounds of random work (seeded by `seed`),
/// every row of an [`ForwardPass::eval_batch`] over up to `n_seqs` sequences of mixed lengths
/// — prefill chunks beside verify rows of mixed widths, some rows with logits and some
/// without — gets the logits and hidden states, bit for bit, that the same chunk evaluated
/// alone in its sequence gets; and so do the MTP head's rows of an
/// [`ForwardPass::mtp_eval_batch`] where the model has the head. Between rounds sequences are
/// truncated (within `rollback`), forked, freed and created.
pub fn assert_batches_match_sequences_alone<B: ForwardPass>(
    batched: &mut B,
    alone: &mut B,
    n_seqs: usize,
    steps: usize,
    rollback: usize,
    seed: u64,
    name: &str,
) {
    let info = batched.model_info();
    let (vocab, e) = (info.vocab_size as usize, info.hidden_size as usize);
    let context = info.context_size as usize;
    let mut rng = Rng::new(seed);
    let mut seqs: Vec<Pair> = Vec::new();
    let mut hidden_in: Vec<Vec<f32>> = Vec::new();
    for step in 0..steps {
        while seqs.len() < n_seqs.min(step + 1).max(1) {
            seqs.push(Pair {
                batched: new_seq(batched),
                alone: new_seq(alone),
            });
        }
        // Each sequence brings a prefill chunk (long, first) or a verify chunk of 1..=5 rows.
        let mut plan: Vec<(usize, Vec<u32>, LogitRows)> = Vec::new();
        for (i, pair) in seqs.iter().enumerate() {
            let len = seq_len(batched, pair.batched);
            let n = if len == 0 || rng.below(4) == 0 {
                1 + rng.below(40) as usize
            } else {
                1 + rng.below(5) as usize
            };
            if len + n + 8 > context || rng.below(8) == 0 {
                continue;
            }
            let rows = match rng.below(3) {
                0 => LogitRows::Last,
                1 if n > 1 => LogitRows::None,
                _ => LogitRows::All,
            };
            plan.push((i, rng.tokens(n, vocab as u32), rows));
        }
        if plan.is_empty() {
            continue;
        }
        let chunks: Vec<EvalChunk<'_>> = plan
            .iter()
            .map(|(i, tokens, rows)| EvalChunk::chain(seqs[*i].batched, tokens, *rows))
            .collect();
        let mut logits = RVec::new();
        batched
            .eval_batch(RSlice::from_slice(&chunks), &mut logits)
            .into_result()
            .unwrap_or_else(|e| panic!("{name}: step {step}: eval_batch: {e}"));
        let mut at = 0;
        hidden_in.clear();
        for (i, tokens, rows) in &plan {
            let pair = seqs[*i];
            let alone_logits = eval(alone, pair.alone, tokens, *rows);
            let count = rows.count(tokens.len()) * vocab;
            assert_eq!(
                bits(&logits[at..at + count]),
                bits(&alone_logits),
                "{name}: step {step}: logits of {} ({} tokens, {rows:?}) in a batch of {} chunks",
                pair.batched,
                tokens.len(),
                plan.len()
            );
            at += count;
            let h = hidden(batched, pair.batched);
            assert_eq!(
                bits(&h),
                bits(&hidden(alone, pair.alone)),
                "{name}: step {step}: hidden states of {}",
                pair.batched
            );
            hidden_in.push(h);
        }
        assert_eq!(at, logits.len(), "{name}: step {step}: logits returned");
        if info.has_mtp_head {
            let positions: Vec<usize> = plan
                .iter()
                .map(|(i, tokens, _)| seq_len(batched, seqs[*i].batched) - tokens.len())
                .collect();
            let chunks: Vec<MtpChunk<'_>> = plan
                .iter()
                .zip(&hidden_in)
                .zip(&positions)
                .map(|(((i, tokens, rows), h), &position)| MtpChunk {
                    seq: seqs[*i].batched,
                    hidden: RSlice::from_slice(h),
                    tokens: RSlice::from_slice(tokens),
                    position,
                    rows: *rows,
                })
                .collect();
            let (mut logits, mut hidden_out) = (RVec::new(), RVec::new());
            batched
                .mtp_eval_batch(RSlice::from_slice(&chunks), &mut logits, &mut hidden_out)
                .into_result()
                .unwrap_or_else(|e| panic!("{name}: step {step}: mtp_eval_batch: {e}"));
            let (mut at, mut hat) = (0, 0);
            for (((i, tokens, rows), h), &position) in plan.iter().zip(&hidden_in).zip(&positions) {
                let (mut l, mut ho) = (RVec::new(), RVec::new());
                alone
                    .mtp_eval(seqs[*i].alone, h, tokens, position, *rows, &mut l, &mut ho)
                    .into_result()
                    .unwrap_or_else(|e| panic!("{name}: step {step}: mtp_eval: {e}"));
                assert_eq!(
                    bits(&logits[at..at + l.len()]),
                    bits(&l),
                    "{name}: step {step}: MTP logits of {}",
                    seqs[*i].batched
                );
                assert_eq!(
                    bits(&hidden_out[hat..hat + ho.len()]),
                    bits(&ho),
                    "{name}: step {step}: MTP hidden states of {}",
                    seqs[*i].batched
                );
                at += l.len();
                hat += ho.len();
            }
            assert_eq!((at, hat), (logits.len(), tokens_rows(&plan) * e), "{name}");
        }
        // Between rounds: truncations within the rollback window, forks, frees.
        for (i, tokens, _) in &plan {
            let pair = seqs[*i];
            let back = (rng.below(tokens.len() as u32 + 1) as usize).min(rollback);
            let len = seq_len(batched, pair.batched) - back;
            truncate(batched, pair.batched, len);
            truncate(alone, pair.alone, len);
        }
        match rng.below(6) {
            0 if seqs.len() < n_seqs => {
                let from = seqs[rng.below(seqs.len() as u32) as usize];
                let fork = |b: &mut B, s| {
                    b.seq_fork(s)
                        .into_result()
                        .unwrap_or_else(|e| panic!("{name}: step {step}: seq_fork: {e}"))
                };
                seqs.push(Pair {
                    batched: fork(batched, from.batched),
                    alone: fork(alone, from.alone),
                });
            }
            1 if seqs.len() > 1 => {
                let gone = seqs.swap_remove(rng.below(seqs.len() as u32) as usize);
                for (b, s) in [(&mut *batched, gone.batched), (&mut *alone, gone.alone)] {
                    b.seq_free(s)
                        .into_result()
                        .unwrap_or_else(|e| panic!("{name}: step {step}: seq_free: {e}"));
                }
            }
            _ => {}
        }
    }
}

fn tokens_rows(plan: &[(usize, Vec<u32>, LogitRows)]) -> usize {
    plan.iter().map(|(_, tokens, _)| tokens.len()).sum()
}

/// FNV-1a over the bits of f32 values: [`fingerprint`]'s hash.
struct Fnv(u64);

impl Fnv {
    fn add(&mut self, values: &[f32]) {
        for byte in values.iter().flat_map(|v| v.to_bits().to_le_bytes()) {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// One hash of every f32 a backend computes over a fixed sequence of calls, to show that a
/// refactor changed no bit (compare the hash of the build before and after, on the same
/// machine and SIMD level).
///
/// The sequence: a 100-token prompt (all rows' logits and hidden states; longer than one pass
/// of 64 rows), the MTP head over it with every row's logits and with the last row's only,
/// six verify passes of five tokens each truncated back by 0..3 tokens (logits, hidden states,
/// and the MTP head's rows where the model has one), then a truncation to 10 tokens (a
/// re-decode on hybrids with a short ring) and three more tokens, the last row's logits.
pub fn fingerprint<B: ForwardPass>(b: &mut B) -> Result<u64, PluginError> {
    let info = b.model_info();
    let vocab = info.vocab_size;
    let mut fp = Fnv(0xcbf2_9ce4_8422_2325);
    let (mut logits, mut hidden) = (RVec::new(), RVec::new());
    let (mut mtp_logits, mut mtp_hidden) = (RVec::new(), RVec::new());
    let seq = b.seq_create().into_result()?;
    let mut mtp = |b: &mut B, hidden: &[f32], tokens: &[u32], at, rows, fp: &mut Fnv| {
        if !info.has_mtp_head {
            return Ok(());
        }
        b.mtp_eval(
            seq,
            hidden,
            tokens,
            at,
            rows,
            &mut mtp_logits,
            &mut mtp_hidden,
        )
        .into_result()?;
        fp.add(&mtp_logits);
        fp.add(&mtp_hidden);
        Ok::<(), PluginError>(())
    };

    let prompt: Vec<u32> = (0..100).map(|i| (i * 37 + 1) % vocab).collect();
    b.eval(seq, &prompt, LogitRows::All, &mut logits)
        .into_result()?;
    b.hidden_states(seq, &mut hidden).into_result()?;
    fp.add(&logits);
    fp.add(&hidden);
    for rows in [LogitRows::All, LogitRows::Last] {
        mtp(b, &hidden, &prompt, 0, rows, &mut fp)?;
    }
    for step in 0..6u32 {
        let draft: Vec<u32> = (0..5).map(|i| (step * 101 + i * 13 + 7) % vocab).collect();
        let len = b.seq_len(seq).into_result()?;
        b.eval(seq, &draft, LogitRows::All, &mut logits)
            .into_result()?;
        b.hidden_states(seq, &mut hidden).into_result()?;
        fp.add(&logits);
        fp.add(&hidden);
        mtp(b, &hidden, &draft, len, LogitRows::All, &mut fp)?;
        b.truncate(seq, len + step as usize % 4).into_result()?;
    }
    b.truncate(seq, 10).into_result()?;
    b.eval(seq, &[3, 4, 5], LogitRows::Last, &mut logits)
        .into_result()?;
    fp.add(&logits);
    Ok(fp.0)
}

/// A random tree of `n` rows in topological order: each row's parent is [`crate::TREE_ROOT`]
/// or an earlier row, deeper chains more likely than wide fans.
pub fn random_tree(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| match i {
            0 => crate::TREE_ROOT,
            _ if rng.below(6) == 0 => crate::TREE_ROOT,
            _ if rng.below(2) == 0 => i as u32 - 1,
            _ => rng.below(i as u32),
        })
        .collect()
}

/// The rows from a root of `parents` down to `row`.
pub fn tree_path(parents: &[u32], row: usize) -> Vec<u32> {
    let mut path = vec![row as u32];
    while let Some(&p) = parents
        .get(*path.last().unwrap() as usize)
        .filter(|&&p| p != crate::TREE_ROOT)
    {
        path.push(p);
    }
    path.reverse();
    path
}

/// Tree evaluations on `b` (which advertises `tree_verify`), `rounds` of them: every row of a
/// tree — evaluated alone or in one batch beside another sequence's prefill — gets the bits of
/// its path evaluated alone as a chain after the same prefix; after
/// [`ForwardPass::seq_keep_path`] the sequence continues (logits, hidden states, length) exactly
/// as the path evaluated alone does; the misuses are refused. Prefixes of random lengths (so
/// trees straddle cache blocks) and trees of 1 to 14 rows (at most `max_verify_tokens`). `b`
/// needs 4 sequences.
pub fn assert_tree_rows_match_their_paths<B: ForwardPass>(
    b: &mut B,
    rounds: usize,
    seed: u64,
    name: &str,
) {
    assert!(b.capabilities().tree_verify, "{name}: no tree_verify");
    let vocab = b.model_info().vocab_size as usize;
    let context = b.model_info().context_size as usize;
    let most_rows = b.capabilities().max_verify_tokens.clamp(1, 14);
    let mut rng = Rng::new(seed);
    for round in 0..rounds {
        let prefix_len = 1 + rng.below((context as u32 / 2).min(150)) as usize;
        let mut n = 1 + rng.below(most_rows) as usize;
        let prefix = rng.tokens(prefix_len, vocab as u32);
        // The first two rounds' tree has chains that start under the context and under an
        // earlier branch (a backend may evaluate such a run of rows together).
        let parents = match round {
            0 | 1 => {
                const R: u32 = crate::TREE_ROOT;
                let shape = [R, 0, R, 2, 3, 0, 5, 6];
                n = shape.len().min(most_rows as usize);
                shape[..n].to_vec()
            }
            _ => random_tree(&mut rng, n),
        };
        let tokens = rng.tokens(n, vocab as u32);
        let name = format!("{name}: round {round} (prefix {prefix_len}, tree {parents:?})");

        let base = new_seq(b);
        eval(b, base, &prefix, LogitRows::Last);
        let tree = b.seq_fork(base).into_result().unwrap();
        let beside = new_seq(b);
        // The second round's other sequence fills the pass but for three rows: the tree is
        // split over two passes, its later rows starting from states the first one wrote.
        let batch_rows = b.capabilities().max_batch_rows as usize;
        let n_other = match round {
            1 => batch_rows.saturating_sub(3).clamp(1, context - 1),
            _ => 1 + rng.below(20) as usize,
        };
        let other = rng.tokens(n_other, vocab as u32);
        let mut logits = RVec::new();
        let chunks = [
            EvalChunk::chain(beside, &other, LogitRows::Last),
            EvalChunk::tree(tree, &tokens, &parents, LogitRows::All),
        ];
        b.eval_batch(RSlice::from_slice(&chunks), &mut logits)
            .into_result()
            .unwrap_or_else(|e| panic!("{name}: tree eval: {e}"));
        let tree_logits = &logits[vocab..];
        b.seq_free(beside).into_result().unwrap();
        assert_eq!(seq_len(b, tree), prefix_len + n, "{name}");

        // Every row against its path alone.
        for row in 0..n {
            let path = tree_path(&parents, row);
            let chain: Vec<u32> = path.iter().map(|&r| tokens[r as usize]).collect();
            let alone = b.seq_fork(base).into_result().unwrap();
            let want = eval(b, alone, &chain, LogitRows::Last);
            b.seq_free(alone).into_result().unwrap();
            assert!(
                bits(self::row(tree_logits, row, vocab)) == bits(&want),
                "{name}: row {row} (path {path:?}) differs from its path evaluated alone"
            );
        }

        // Misuse: another eval, a truncation into the tree, a broken path.
        let err = b.eval(tree, &[1], LogitRows::Last, &mut logits);
        assert!(err.is_err(), "{name}: an eval on an unresolved tree");
        if n > 0 {
            assert!(
                b.truncate(tree, prefix_len + 1).is_err(),
                "{name}: a truncation into the tree"
            );
        }
        if let Some(child) = (0..n).find(|&r| parents[r] != crate::TREE_ROOT) {
            let bad = [child as u32];
            let err = b.seq_keep_path(tree, RSlice::from_slice(&bad));
            assert!(err.is_err(), "{name}: a path starting below a root");
        }

        // Keep a random leaf's path, or cut the whole tree off.
        if rng.below(5) == 0 {
            truncate(b, tree, prefix_len);
            assert_eq!(seq_len(b, tree), prefix_len, "{name}");
        } else {
            let leaf = rng.below(n as u32) as usize;
            let path = tree_path(&parents, leaf);
            b.seq_keep_path(tree, RSlice::from_slice(&path))
                .into_result()
                .unwrap_or_else(|e| panic!("{name}: keep {path:?}: {e}"));
            let chain: Vec<u32> = path.iter().map(|&r| tokens[r as usize]).collect();
            let alone = b.seq_fork(base).into_result().unwrap();
            eval(b, alone, &chain, LogitRows::All);
            assert_eq!(seq_len(b, tree), seq_len(b, alone), "{name}");
            assert!(
                bits(&hidden(b, tree)) == bits(&hidden(b, alone)),
                "{name}: hidden states after keeping {path:?}"
            );
            let n_next = 1 + rng.below(6) as usize;
            let next = rng.tokens(n_next, vocab as u32);
            let got = eval(b, tree, &next, LogitRows::All);
            let want = eval(b, alone, &next, LogitRows::All);
            assert!(
                bits(&got) == bits(&want),
                "{name}: continuing after keeping {path:?}"
            );
            b.seq_free(alone).into_result().unwrap();
        }
        b.seq_free(tree).into_result().unwrap();
        b.seq_free(base).into_result().unwrap();
    }
}
