//! Deterministic mutation testing of the reader: thousands of damaged copies of the shared
//! models (bit flips in the header, metadata and tensor records, truncations, huge counts and
//! lengths, wrapped and overlapping offsets, absurd shapes and types) parsed in-process.
//! Every one must either be refused with an error or be accepted with every tensor inside the
//! file's data section — never a panic, never a tensor read from outside its bytes.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use specula_gguf::{GgufError, GgufFile, HParams, HybridParams, MoeParams};

fn shared(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
}

/// The files mutated: every fixture, the real llama models and the trained hybrid.
const SOURCES: [&str; 9] = [
    "models/stories260K.gguf",
    "models/llama2xs-281K.gguf",
    "models/fixtures/tiny-llama.gguf",
    "models/fixtures/tiny-qwen35.gguf",
    "models/fixtures/tiny-qwen35-mtp.gguf",
    "models/fixtures/tiny-qwen35-4l-mtp.gguf",
    "models/fixtures/tiny-qwen3next.gguf",
    "models/fixtures/tiny-qwen3next-mtp.gguf",
    "models/trained/stories-qwen35-mtp-q8_0.gguf",
];

const MUTANTS_PER_SOURCE: usize = 300;

/// SplitMix64: a fixed-seed generator, so every run builds the same mutants.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// Where the fields of a GGUF header are, found by walking it independently of the reader.
#[derive(Debug, Default)]
struct Layout {
    /// First byte of the metadata records, and of the tensor records.
    metadata_start: usize,
    tensors_start: usize,
    /// End of the tensor records (the data section starts at the next aligned byte).
    tensors_end: usize,
    /// Positions of u64 length / count fields inside the metadata and tensor records.
    lengths: Vec<usize>,
    /// Per tensor: positions of its dims, its type id and its offset.
    tensors: Vec<TensorFields>,
}

#[derive(Debug, Default)]
struct TensorFields {
    dims: Vec<usize>,
    type_id: usize,
    offset: usize,
    offset_value: u64,
}

fn u32_at(b: &[u8], pos: usize) -> u32 {
    u32::from_le_bytes(b[pos..pos + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], pos: usize) -> u64 {
    u64::from_le_bytes(b[pos..pos + 8].try_into().unwrap())
}

fn put_u64(b: &mut [u8], pos: usize, v: u64) {
    b[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(b: &mut [u8], pos: usize, v: u32) {
    b[pos..pos + 4].copy_from_slice(&v.to_le_bytes());
}

/// Walks one metadata value of type `ty` at `pos`, recording length fields; returns its end.
fn walk_value(b: &[u8], mut pos: usize, ty: u32, lengths: &mut Vec<usize>) -> usize {
    match ty {
        0 | 1 | 7 => pos + 1,
        2 | 3 => pos + 2,
        4..=6 => pos + 4,
        10..=12 => pos + 8,
        8 => {
            lengths.push(pos);
            pos + 8 + u64_at(b, pos) as usize
        }
        9 => {
            let elem = u32_at(b, pos);
            pos += 4;
            lengths.push(pos);
            let n = u64_at(b, pos);
            pos += 8;
            for _ in 0..n {
                pos = walk_value(b, pos, elem, lengths);
            }
            pos
        }
        other => panic!("the source file has a value type {other}"),
    }
}

fn layout(b: &[u8]) -> Layout {
    let mut l = Layout::default();
    let n_tensors = u64_at(b, 8);
    let n_kv = u64_at(b, 16);
    let mut pos = 24;
    l.metadata_start = pos;
    for _ in 0..n_kv {
        l.lengths.push(pos);
        pos += 8 + u64_at(b, pos) as usize;
        let ty = u32_at(b, pos);
        pos = walk_value(b, pos + 4, ty, &mut l.lengths);
    }
    l.tensors_start = pos;
    for _ in 0..n_tensors {
        l.lengths.push(pos);
        pos += 8 + u64_at(b, pos) as usize;
        let n_dims = u32_at(b, pos) as usize;
        pos += 4;
        let mut t = TensorFields {
            dims: (0..n_dims).map(|d| pos + 8 * d).collect(),
            ..Default::default()
        };
        pos += 8 * n_dims;
        t.type_id = pos;
        pos += 4;
        t.offset = pos;
        t.offset_value = u64_at(b, pos);
        pos += 8;
        l.tensors.push(t);
    }
    l.tensors_end = pos;
    l
}

/// Values that break length, count and offset arithmetic.
const HUGE: [u64; 9] = [
    u64::MAX,
    u64::MAX - 31,
    u64::MAX / 2 + 1,
    1 << 32,
    1 << 40,
    (1 << 61) + 32,
    0x7FFF_FFFF_FFFF_FFE0,
    0xFFFF_FFFF,
    1 << 56,
];

/// Applies one random mutation to `bytes`; returns a description of it.
fn mutate(bytes: &mut Vec<u8>, l: &Layout, rng: &mut Rng) -> String {
    let flip = |bytes: &mut Vec<u8>, rng: &mut Rng, lo: usize, hi: usize, region: &str| {
        let pos = lo + rng.below(hi - lo);
        let bit = rng.below(8);
        bytes[pos] ^= 1 << bit;
        format!("bit {bit} of byte {pos} ({region}) flipped")
    };
    match rng.below(11) {
        0 => flip(bytes, rng, 0, 24, "header"),
        1 => flip(bytes, rng, l.metadata_start, l.tensors_start, "metadata"),
        2 => flip(bytes, rng, l.tensors_start, l.tensors_end, "tensor records"),
        3 => {
            let len = rng.below(bytes.len());
            bytes.truncate(len);
            format!("truncated to {len} bytes")
        }
        4 => {
            let field = rng.pick(&[8usize, 16]);
            let v = rng.pick(&HUGE);
            put_u64(bytes, field, v);
            format!("count at byte {field} set to {v}")
        }
        5 => {
            let pos = rng.pick(&l.lengths);
            let v = rng.pick(&HUGE);
            put_u64(bytes, pos, v);
            format!("length at byte {pos} set to {v}")
        }
        6 => {
            let t = &l.tensors[rng.below(l.tensors.len())];
            // An offset that wraps the data section's start (to before it, or into the header).
            let back = 32 * (1 + rng.below(64) as u64);
            let v = rng.pick(&[0u64.wrapping_sub(back), u64::MAX - back + 1, 1 << 63]);
            put_u64(bytes, t.offset, v);
            format!("offset at byte {} set to {v}", t.offset)
        }
        7 => {
            // Point a tensor at another one's data (overlap), or somewhere else aligned.
            let t = &l.tensors[rng.below(l.tensors.len())];
            let other = &l.tensors[rng.below(l.tensors.len())];
            let v = if rng.below(2) == 0 {
                other.offset_value
            } else {
                other.offset_value + 32 * (1 + rng.below(16) as u64)
            };
            put_u64(bytes, t.offset, v);
            format!("offset at byte {} set to {v}", t.offset)
        }
        8 => {
            let t = &l.tensors[rng.below(l.tensors.len())];
            let pos = rng.pick(&t.dims);
            let v = rng.pick(&[0u64, 1, 2, 3, u64::MAX, 1 << 32, 1 << 62, 4096]);
            put_u64(bytes, pos, v);
            format!("dim at byte {pos} set to {v}")
        }
        9 => {
            let t = &l.tensors[rng.below(l.tensors.len())];
            let v = rng.below(40) as u32;
            put_u32(bytes, t.type_id, v);
            format!("type id at byte {} set to {v}", t.type_id)
        }
        _ => {
            let lo = l.tensors_end;
            if lo >= bytes.len() {
                return "unchanged".into();
            }
            flip(bytes, rng, lo, bytes.len(), "tensor data")
        }
    }
}

/// What an accepted file must satisfy: every tensor inside the data section, exactly its byte
/// size, and no two tensors sharing a byte. Computed in u128, independently of the reader.
fn check_accepted(file: &GgufFile) -> Result<(), String> {
    let len = file.file_len() as u128;
    let data = file.data_offset() as u128;
    if data > len {
        return Err(format!(
            "data section starts at {data}, past the end ({len})"
        ));
    }
    let mut ranges = Vec::new();
    for t in file.tensors() {
        let elements: u128 = t.dims.iter().map(|&d| d as u128).product();
        let bytes = elements / t.ty.block_size() as u128 * t.ty.block_bytes() as u128;
        let start = data + t.offset as u128;
        if start + bytes > len {
            return Err(format!(
                "tensor '{}' occupies bytes {start}..{} of a {len}-byte file",
                t.name,
                start + bytes
            ));
        }
        let view = file.tensor(&t.name).map_err(|e| e.to_string())?;
        if view.data.len() as u128 != bytes {
            return Err(format!(
                "tensor '{}' has {} bytes, not {bytes}",
                t.name,
                view.data.len()
            ));
        }
        if bytes > 0 {
            ranges.push((start, start + bytes, &t.name));
        }
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(format!("tensors '{}' and '{}' overlap", w[0].2, w[1].2));
        }
    }
    Ok(())
}

/// Reads the hyper-parameters an engine would read; errors are fine, panics are not.
fn read_hparams(file: &GgufFile) {
    if let Ok(hp) = HParams::from_gguf(file) {
        let _ = HybridParams::from_gguf(file, &hp);
        let _ = MoeParams::from_gguf(file, &hp);
    }
}

#[test]
fn thousands_of_mutants_are_refused_or_read_inside_the_file() {
    let mut rng = Rng(0x005E_C01A_2026);
    let (mut accepted, mut refused) = (0usize, 0usize);
    let mut failures = Vec::new();
    for source in SOURCES {
        let original = std::fs::read(shared(source)).unwrap();
        let l = layout(&original);
        assert!(!l.tensors.is_empty(), "{source} has no tensors");
        for i in 0..MUTANTS_PER_SOURCE {
            let mut bytes = original.clone();
            let mut what = vec![mutate(&mut bytes, &l, &mut rng)];
            // A third of the mutants carry a second mutation.
            if rng.below(3) == 0 && bytes.len() >= l.tensors_end {
                what.push(mutate(&mut bytes, &l, &mut rng));
            }
            let label = format!("{source} mutant {i}");
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                GgufFile::from_bytes(&label, bytes).map(|file| {
                    read_hparams(&file);
                    check_accepted(&file)
                })
            }));
            match outcome {
                Err(_) => failures.push(format!("{label} ({}): panicked", what.join("; "))),
                Ok(Err(e)) => {
                    refused += 1;
                    assert!(e.to_string().contains(&label), "{e} does not name the file");
                }
                Ok(Ok(Err(why))) => failures.push(format!("{label} ({}): {why}", what.join("; "))),
                Ok(Ok(Ok(()))) => accepted += 1,
            }
        }
    }
    eprintln!(
        "mutants: {accepted} accepted, {refused} refused, {} failed",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(accepted + refused >= 2000);
    // Both outcomes occur, or the mutations are not doing what they say.
    assert!(
        accepted > 100 && refused > 1000,
        "{accepted} accepted, {refused} refused"
    );
}

fn with_tensor_offset(source: &str, tensor: usize, offset: u64) -> (Vec<u8>, String) {
    let mut bytes = std::fs::read(shared(source)).unwrap();
    let l = layout(&bytes);
    let name = GgufFile::open(shared(source)).unwrap().tensors()[tensor]
        .name
        .clone();
    put_u64(&mut bytes, l.tensors[tensor].offset, offset);
    (bytes, name)
}

#[test]
fn an_offset_that_wraps_is_refused_naming_the_tensor() {
    // Read plainly, 2^64 - 32 added to the data start lands 32 bytes before it.
    let last = GgufFile::open(shared("models/stories260K.gguf"))
        .unwrap()
        .tensors()
        .len()
        - 1;
    for offset in [0u64.wrapping_sub(32), 0u64.wrapping_sub(19296)] {
        let (bytes, name) = with_tensor_offset("models/stories260K.gguf", last, offset);
        let err = GgufFile::from_bytes("stories260K.gguf", bytes).unwrap_err();
        assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("'{name}'")), "{text}");
    }
}

#[test]
fn overlapping_tensors_are_refused_naming_both() {
    let file = GgufFile::open(shared("models/fixtures/tiny-llama.gguf")).unwrap();
    let first = file.tensors()[0].clone();
    let second = file.tensors()[1].name.clone();
    let (bytes, _) = with_tensor_offset("models/fixtures/tiny-llama.gguf", 1, first.offset);
    let err = GgufFile::from_bytes("tiny-llama.gguf", bytes)
        .unwrap_err()
        .to_string();
    assert!(err.contains("overlap"), "{err}");
    assert!(err.contains(&first.name) && err.contains(&second), "{err}");
}

#[test]
fn a_misaligned_offset_is_refused() {
    let file = GgufFile::open(shared("models/fixtures/tiny-llama.gguf")).unwrap();
    let offset = file.tensors()[2].offset + 4;
    let (bytes, name) = with_tensor_offset("models/fixtures/tiny-llama.gguf", 2, offset);
    let err = GgufFile::from_bytes("tiny-llama.gguf", bytes)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&name) && err.contains("not aligned"), "{err}");
}
