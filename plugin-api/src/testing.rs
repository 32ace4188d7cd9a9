//! Checks every backend's tests share (not part of the ABI).

use abi_stable::std_types::{RSlice, RVec};

use crate::{ErrorKind, ForwardPass, LogitRows, PanicFence, PluginError};

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
