//! Checks and helpers every backend's tests share (not part of the ABI).

use abi_stable::std_types::{RSlice, RString, RVec, Tuple2};

use crate::{BackendParams, ErrorKind, ForwardPass, LogitRows, PanicFence, PluginError};

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
    backend
        .eval(RSlice::from_slice(&[1, 2]), LogitRows::Last, &mut logits)
        .into_result()
        .expect("a first eval");
    assert_eq!(backend.seq_len().into_result(), Ok(2));

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
    refused(backend.seq_len().into_result().map(|_| ()));
    refused(
        backend
            .eval(RSlice::from_slice(&[3]), LogitRows::Last, &mut logits)
            .into_result(),
    );
    refused(backend.truncate(1).into_result());
    let mut hidden = RVec::new();
    refused(backend.hidden_states(&mut hidden).into_result());
    let e = backend.model_info().hidden_size as usize;
    refused(
        backend
            .mtp_eval(
                RSlice::from_slice(&vec![0.0; e]),
                RSlice::from_slice(&[1]),
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

/// Evaluates `tokens` and returns the requested logits (panicking, naming the tokens, on an
/// error).
pub fn eval<B: ForwardPass>(b: &mut B, tokens: &[u32], rows: LogitRows) -> Vec<f32> {
    let mut logits = RVec::new();
    b.eval(RSlice::from(tokens), rows, &mut logits)
        .into_result()
        .unwrap_or_else(|e| panic!("eval of {tokens:?}: {e}"));
    logits.to_vec()
}

/// The hidden states of the last eval's rows.
pub fn hidden<B: ForwardPass>(b: &B) -> Vec<f32> {
    let mut out = RVec::new();
    b.hidden_states(&mut out)
        .into_result()
        .unwrap_or_else(|e| panic!("hidden_states: {e}"));
    out.to_vec()
}

/// Truncates the sequence to `len` tokens.
pub fn truncate<B: ForwardPass>(b: &mut B, len: usize) {
    b.truncate(len)
        .into_result()
        .unwrap_or_else(|e| panic!("truncate to {len}: {e}"));
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

/// Greedy decoding of `n` tokens after `prompt`, one token per eval.
pub fn greedy<B: ForwardPass>(b: &mut B, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut next = argmax(&eval(b, prompt, LogitRows::Last));
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        out.push(next);
        if out.len() == n {
            break;
        }
        let logits = eval(b, &[next], LogitRows::Last);
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
/// one model): `prompt` evaluated in one call gives every row's logits and hidden states bit
/// for bit as token-by-token evals, and so does a k-token eval of random tokens (seeded by
/// `seed`) for every k of `ks`; a k-token `Last` eval gives the last row of an `All` eval.
pub fn assert_verify_rows_match_single_evals<B: ForwardPass>(
    batched: &mut B,
    single: &mut B,
    prompt: &[u32],
    ks: &[usize],
    seed: u64,
    name: &str,
) {
    let info = batched.model_info();
    let (vocab, e) = (info.vocab_size as usize, info.hidden_size as usize);
    let prefill = eval(batched, prompt, LogitRows::All);
    let prefill_hidden = hidden(batched);
    for (i, &t) in prompt.iter().enumerate() {
        let r = eval(single, &[t], LogitRows::Last);
        assert_eq!(
            bits(row(&prefill, i, vocab)),
            bits(&r),
            "{name}: prompt row {i}"
        );
        assert_eq!(
            bits(row(&prefill_hidden, i, e)),
            bits(&hidden(single)),
            "{name}: prompt hidden {i}"
        );
    }
    let mut rng = Rng::new(seed);
    for &k in ks {
        let tokens = rng.tokens(k, vocab as u32);
        let all = eval(batched, &tokens, LogitRows::All);
        let all_hidden = hidden(batched);
        assert_eq!((all.len(), all_hidden.len()), (k * vocab, k * e), "{name}");
        for (i, &t) in tokens.iter().enumerate() {
            let r = eval(single, &[t], LogitRows::Last);
            assert!(r.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
            assert_eq!(
                bits(row(&all, i, vocab)),
                bits(&r),
                "{name}: k={k}, row {i} differs from the single-token eval"
            );
            assert_eq!(
                bits(row(&all_hidden, i, e)),
                bits(&hidden(single)),
                "{name}: k={k}, hidden row {i}"
            );
        }
        let last_tokens = rng.tokens(k, vocab as u32);
        let last = eval(batched, &last_tokens, LogitRows::Last);
        let reference = eval(single, &last_tokens, LogitRows::All);
        assert_eq!(
            bits(&last),
            bits(row(&reference, k - 1, vocab)),
            "{name}: k={k}, Last"
        );
    }
    assert_eq!(
        batched.seq_len().into_result(),
        single.seq_len().into_result(),
        "{name}"
    );
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
    let mut mtp = |b: &mut B, hidden: &[f32], tokens: &[u32], at, rows, fp: &mut Fnv| {
        if !info.has_mtp_head {
            return Ok(());
        }
        b.mtp_eval(
            RSlice::from_slice(hidden),
            RSlice::from_slice(tokens),
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
    b.eval(RSlice::from_slice(&prompt), LogitRows::All, &mut logits)
        .into_result()?;
    b.hidden_states(&mut hidden).into_result()?;
    fp.add(&logits);
    fp.add(&hidden);
    for rows in [LogitRows::All, LogitRows::Last] {
        mtp(b, &hidden, &prompt, 0, rows, &mut fp)?;
    }
    for step in 0..6u32 {
        let draft: Vec<u32> = (0..5).map(|i| (step * 101 + i * 13 + 7) % vocab).collect();
        let len = b.seq_len().into_result()?;
        b.eval(RSlice::from_slice(&draft), LogitRows::All, &mut logits)
            .into_result()?;
        b.hidden_states(&mut hidden).into_result()?;
        fp.add(&logits);
        fp.add(&hidden);
        mtp(b, &hidden, &draft, len, LogitRows::All, &mut fp)?;
        b.truncate(len + step as usize % 4).into_result()?;
    }
    b.truncate(10).into_result()?;
    b.eval(RSlice::from_slice(&[3, 4, 5]), LogitRows::Last, &mut logits)
        .into_result()?;
    fp.add(&logits);
    Ok(fp.0)
}
