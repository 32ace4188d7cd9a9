//! Any byte string: the reader refuses it with an error, or accepts it with every tensor inside
//! the file and its hyper-parameters readable without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use specula_gguf::{GgufFile, HParams, HybridParams, MoeParams};

fuzz_target!(|bytes: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz input", bytes.to_vec()) else {
        return;
    };
    let len = u128::from(file.file_len());
    for t in file.tensors() {
        let view = file
            .tensor(&t.name)
            .expect("an accepted tensor is readable");
        let start = u128::from(file.data_offset()) + u128::from(t.offset);
        assert!(
            start + view.data.len() as u128 <= len,
            "tensor '{}' outside the file",
            t.name
        );
    }
    if let Ok(hp) = HParams::from_gguf(&file) {
        let _ = HybridParams::from_gguf(&file, &hp);
        let _ = MoeParams::from_gguf(&file, &hp);
    }
});
