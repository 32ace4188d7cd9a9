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
