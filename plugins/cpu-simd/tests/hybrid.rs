//! The Gated DeltaNet hybrids (qwen35, qwen3next): every fixture loads and generates, the MTP
//! heads chain, the trained qwen35 model tells its story and its MTP head agrees with the
//! trunk, and the snapshot ring costs what the formula says.

mod common;

use abi_stable::std_types::RVec;
use common::*;
use specula_cpu_simd::blocks::gdn::{BetaAlphaLayout, GdnShape, HeadMap};
use specula_gguf::{GgufFile, HParams, HybridParams};
use specula_plugin_api::{ForwardPass, LogitRows, SequenceCalls};

const LILY: &str = "Once upon a time, there was a little girl named Lily";

/// Every model file in `fixtures/` (dense and hybrid) loads and generates greedily with finite
/// logits; the hybrids report what they are.
#[test]
fn every_fixture_loads_and_generates() {
    let mut files: Vec<_> = std::fs::read_dir(models_dir().join("fixtures"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 6, "{files:?}");
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut backend = open(path, 2, 256);
        let ids = greedy(&mut backend, &[1, 300, 301], 24);
        assert_eq!(ids.len(), 24, "{name}");
        assert_eq!(backend.len(), 3 + 23, "{name}");
        let info = backend.info().clone();
        let caps = backend.caps();
        assert!(caps.hidden_state_export, "{name}");
        match HYBRID_FIXTURES.iter().find(|(f, _, _)| *f == name) {
            None => {
                assert_eq!(info.architecture.as_str(), "llama", "{name}");
                assert_eq!(caps.rollback_depth, u32::MAX);
                assert_eq!(caps.snapshot_bytes_per_slot, 0);
            }
            Some((_, arch, mtp)) => {
                assert_eq!(info.architecture.as_str(), *arch, "{name}");
                assert_eq!(info.has_mtp_head, *mtp, "{name}");
                assert_eq!(caps.mtp_head, *mtp, "{name}");
                assert_eq!(
                    (caps.max_verify_tokens, caps.rollback_depth),
                    (8, 8),
                    "{name}"
                );
                assert!(caps.snapshot_bytes_per_slot > 0, "{name}");
                // block_count counts the NextN block.
                let trunk = if name.contains("4l") { 4 } else { 2 };
                assert_eq!(info.n_layers, trunk + u32::from(*mtp), "{name}");
                assert_eq!(backend.mtp_len(), mtp.then_some(0), "{name}");
            }
        }
        // Hidden states of every evaluated row.
        let logits = eval(&mut backend, &[5, 6, 7], LogitRows::All);
        assert_eq!(logits.len(), 3 * 512);
        assert!(logits.iter().all(|v| v.is_finite()), "{name}");
        assert_eq!(backend.last_hidden_states().len(), 3 * 64, "{name}");
    }
}

/// On every fixture with a NextN block the MTP head steps through the prompt and then chains
/// several draft steps on its own hidden states, with finite logits; its cache follows the
/// positions.
#[test]
fn mtp_heads_chain_on_the_fixtures() {
    for (file, _, has_mtp) in HYBRID_FIXTURES {
        if !has_mtp {
            continue;
        }
        let path = fixture(file);
        let mut b = open(&path, 2, 128);
        let prompt = [1, 403, 261, 378, 13, 300];
        let logits = eval(&mut b, &prompt, LogitRows::All);
        let hidden = b.last_hidden_states().to_vec();
        for p in 0..prompt.len() - 1 {
            let (l, h) = mtp(&mut b, row(&hidden, p, 64), prompt[p + 1], p);
            assert_eq!((l.len(), h.len()), (512, 64), "{file}");
            assert!(l.iter().chain(&h).all(|v| v.is_finite()), "{file}");
        }
        assert_eq!(b.mtp_len(), Some(prompt.len() - 1));
        let last = prompt.len() - 1;
        let mut token = argmax(row(&logits, last, 512));
        let mut h = row(&hidden, last, 64).to_vec();
        let mut drafts = Vec::new();
        for step in 0..5 {
            let (l, next_h) = mtp(&mut b, &h, token, last + step);
            assert!(l.iter().chain(&next_h).all(|v| v.is_finite()), "{file}");
            token = argmax(&l);
            drafts.push(token);
            h = next_h;
        }
        assert_eq!(b.mtp_len(), Some(last + 5), "{file}");
        // A step at an earlier position cuts the speculative entries.
        mtp(&mut b, row(&hidden, 2, 64), prompt[3], 2);
        assert_eq!(b.mtp_len(), Some(3), "{file}");
        // Truncating the trunk cuts the head's cache with it.
        b.truncate_to(2).unwrap();
        assert_eq!(b.mtp_len(), Some(2), "{file}");
        eprintln!("{file}: MTP chain drafts {drafts:?}");
    }
}

/// The trained qwen35 model (F32 and Q8_0) greedy from BOS tells the teacher's story: this
/// validates the Gated DeltaNet, gated attention, IMROPE and FFN math end to end.
#[test]
fn trained_qwen35_tells_the_lily_story() {
    for ty in ["f32", "q8_0"] {
        let path = trained_qwen35(ty);
        let mut b = open(&path, 2, 0);
        let info = b.info().clone();
        assert_eq!(info.architecture.as_str(), "qwen35");
        assert_eq!((info.hidden_size, info.n_layers), (128, 5));
        assert!(info.has_mtp_head && b.caps().mtp_head);
        let ids = greedy(&mut b, &[1], 40);
        let text = decode(&ids, &vocabulary(&path));
        eprintln!("stories-qwen35 {ty}: {text}");
        assert!(text.starts_with(LILY), "{ty}: {text:?}");
    }
}

/// Both weight layouts (interleaved row groups, the default where the CPU has AVX2 or AVX-512,
/// and the file's rows) tell the same story from the Q8_0 model, with logits that differ only
/// by the summation order of the two kernels — and what that order moves downstream: an
/// activation value whose last bits differ can round to the neighbouring Q8_0 quant, which in
/// this 128-wide model moves a logit by up to about 0.5% of the largest (measured at AVX2 and
/// AVX-512 on token-dependent positions, and between either level and the scalar one).
#[test]
fn weight_layouts_agree_on_the_trained_model() {
    let path = trained_qwen35("q8_0");
    let mut interleaved = open_with(&path, 2, 0, 0, &[("weight_layout", "interleaved")]);
    let mut file = open_with(&path, 2, 0, 0, &[("weight_layout", "file")]);
    let a = greedy(&mut interleaved, &[1], 40);
    let b = greedy(&mut file, &[1], 40);
    assert_eq!(a, b);
    let mut tokens = vec![1u32];
    tokens.extend(&a[..12]);
    let la = eval(&mut interleaved, &tokens, LogitRows::All);
    let lb = eval(&mut file, &tokens, LogitRows::All);
    let scale = lb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = la
        .iter()
        .zip(&lb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-2 * scale,
        "largest logit difference {worst} (scale {scale})"
    );
}

/// A tied output's repacked copy is also where the embedding tables (the trunk's and the MTP
/// head's) look rows up, bit for bit as the file's rows decode: the file's pages of the
/// table, released once copied, then stay out of memory instead of faulting back in row by
/// row (on a file cached in huge pages, 2 MiB at a time).
#[test]
fn a_tied_embedding_is_looked_up_in_the_repacked_output() {
    use specula_cpu_simd::model::Model;
    use specula_kernels::{interleaved, simd, WeightType};
    use specula_plugin_api::testing;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tied-q8_0.gguf");
    rewrite_model(
        &trained_qwen35("f32"),
        &path,
        &Rewrite {
            matrix_type: Some(specula_gguf::GgmlType::Q8_0),
            drop_tensors: &["output.weight"],
            ..Default::default()
        },
    );
    let mut model = Model::load(&path).unwrap();
    model.interleave_weights(|_| true).unwrap();
    let graph = &model.graph;
    let mtp = graph.mtp().expect("the trained model has an MTP head");
    let tables = [graph.token_embd(), &mtp.embed];
    if !interleaved::pays_off(WeightType::Q8_0, simd::level()) {
        assert!(tables.iter().all(|t| t.interleaved.is_none()));
        return;
    }
    let copy = graph
        .output()
        .interleaved
        .as_ref()
        .expect("the output is repacked");
    for table in tables {
        let shared = table
            .interleaved
            .as_ref()
            .expect("the table shares the copy");
        assert!(std::sync::Arc::ptr_eq(shared, copy));
        let mut in_file = table.clone();
        in_file.interleaved = None;
        let (looked_up, from_file) = (
            table.view(&model.file).unwrap(),
            in_file.view(&model.file).unwrap(),
        );
        let mut a = vec![0f32; table.cols];
        let mut b = vec![0f32; table.cols];
        for token in [0, 1, 17, 255, 510, 511] {
            looked_up.dequantize_row(token, &mut a);
            from_file.dequantize_row(token, &mut b);
            assert_eq!(
                testing::bits(&a),
                testing::bits(&b),
                "row {token} of {}",
                table.name
            );
        }
    }
}

/// Greedy draft agreement of the trained MTP head with the trunk's own next greedy token,
/// over a 160-token greedy run from BOS; also the acceptance of 3-token chained drafts.
#[test]
fn trained_mtp_head_agrees_with_the_trunk() {
    const N: usize = 160;
    for ty in ["f32", "q8_0"] {
        let path = trained_qwen35(ty);
        let mut b = open(&path, 2, 512);
        // The trunk's greedy run: tokens t_0 = BOS, t_1 .. t_N and hidden states h_0 .. h_{N-1}.
        let mut tokens = vec![1u32];
        let mut hidden = Vec::new();
        for p in 0..N {
            let logits = eval(&mut b, &[tokens[p]], LogitRows::Last);
            hidden.push(b.last_hidden_states().to_vec());
            tokens.push(argmax(&logits));
        }
        // The head: one step per position (as a drafter keeps it in step), chained 3 deep.
        let mut agree = 0;
        let mut accepted = [0usize; 3];
        let positions = N - 3;
        for p in 0..positions {
            let (l1, h1) = mtp(&mut b, &hidden[p], tokens[p + 1], p);
            let d1 = argmax(&l1);
            let (l2, h2) = mtp(&mut b, &h1, d1, p + 1);
            let d2 = argmax(&l2);
            let (l3, _) = mtp(&mut b, &h2, d2, p + 2);
            let d3 = argmax(&l3);
            agree += usize::from(d1 == tokens[p + 2]);
            for (depth, ok) in [
                d1 == tokens[p + 2],
                d2 == tokens[p + 3],
                d3 == tokens[p + 4],
            ]
            .into_iter()
            .enumerate()
            {
                if !ok {
                    break;
                }
                accepted[depth] += 1;
            }
        }
        let rate = agree as f64 / positions as f64;
        let per_position: Vec<String> = accepted
            .iter()
            .map(|&a| format!("{:.3}", a as f64 / positions as f64))
            .collect();
        let mean_accepted: f64 = accepted.iter().sum::<usize>() as f64 / positions as f64;
        println!(
            "stories-qwen35 {ty}: MTP greedy draft agrees with the trunk's next token {agree}/{positions} = {:.1}%; \
             3-token chained drafts: acceptance by position {per_position:?}, {mean_accepted:.2} accepted per step",
            100.0 * rate
        );
        assert!(rate >= 0.6, "{ty}: MTP agreement {rate}");
    }
}

/// Bytes of one snapshot slot: per GDN layer, the conv state `(kernel - 1) × (2·Kd + Vd)` plus
/// `Hv` S×S matrices, in f32.
fn slot_formula(n_gdn: u64, kernel: u64, s: u64, hk: u64, hv: u64) -> u64 {
    n_gdn * ((kernel - 1) * (2 * s * hk + s * hv) + hv * s * s) * 4
}

/// Prints the snapshot-ring cost of every hybrid fixture, the trained model and a
/// Qwen3.5-27B-shaped model, and checks the formula.
#[test]
fn ring_bytes_per_slot() {
    let mut paths: Vec<_> = HYBRID_FIXTURES.iter().map(|(f, _, _)| fixture(f)).collect();
    paths.push(trained_qwen35("f32"));
    for path in &paths {
        let file = GgufFile::open(path).unwrap();
        let hp = HParams::from_gguf(&file).unwrap();
        let h = HybridParams::from_gguf(&file, &hp).unwrap();
        let n_gdn = h.recurrent.iter().filter(|&&r| r).count() as u64;
        let expected = slot_formula(
            n_gdn,
            h.conv_kernel.into(),
            h.state_size.into(),
            h.group_count.into(),
            h.time_step_rank.into(),
        );
        let b = open(path, 1, 64);
        let caps = b.caps();
        assert_eq!(caps.snapshot_bytes_per_slot, expected, "{}", path.display());
        println!(
            "{:<28} {n_gdn} GDN layers: {:>9} bytes per slot, ring of {} slots + live = {} bytes",
            path.file_name().unwrap().to_string_lossy(),
            caps.snapshot_bytes_per_slot,
            caps.rollback_depth,
            caps.snapshot_bytes_per_slot * u64::from(caps.rollback_depth + 1)
        );
    }

    // Qwen3.5-27B (same text config as Qwen3.6-27B, model_type qwen3_5; from the official
    // model card): hidden 5120, 64 layers as 16 × (3 Gated DeltaNet + 1 gated attention) =
    // 48 GDN layers, linear-attention heads 16 for Q/K and 48 for V, head dim 128; conv kernel
    // 4 (`linear_conv_kernel_dim`).
    let shape = GdnShape {
        n_embd: 5120,
        conv_kernel: 4,
        head_dim: 128,
        n_k_heads: 16,
        n_v_heads: 48,
        head_map: HeadMap::Tiled,
        beta_alpha: BetaAlphaLayout::Separate,
        eps: 1e-6,
    };
    let layout = shape.state_layout(48);
    let per_slot = layout.plane_bytes();
    assert_eq!(per_slot, slot_formula(48, 4, 128, 16, 48));
    assert_eq!(per_slot, 156_893_184);
    println!(
        "Qwen3.5-27B-shaped: 48 GDN layers × (conv 3 × 10240 + 48 × 128 × 128) f32 = {per_slot} bytes ({:.1} MiB) per slot; depth 8 = {:.2} GiB with the live state",
        per_slot as f64 / (1 << 20) as f64,
        (9 * per_slot) as f64 / (1u64 << 30) as f64
    );
}

/// The hybrid backend through the plugin's root module and the ABI-stable trait object:
/// capabilities, verify, hidden states, MTP steps, rollback.
#[test]
fn hybrid_through_the_plugin_module_and_trait_object() {
    use abi_stable::std_types::RVec;

    let module = specula_cpu_simd::plugin_module();
    let open_backend = module.open_backend().into_option().expect("open_backend");
    let mut p = params(&fixture("tiny-qwen3next-mtp.gguf"), 2, 64);
    p.max_verify_tokens = 4;
    let mut backend = open_backend(&p).into_result().unwrap();
    let seq = backend.seq_create().into_result().unwrap();
    let caps = backend.capabilities();
    assert_eq!((caps.max_verify_tokens, caps.rollback_depth), (4, 4));
    assert!(caps.hidden_state_export && caps.mtp_head);
    assert_eq!(caps.snapshot_bytes_per_slot, 5632);
    let info = backend.model_info();
    assert_eq!(info.architecture.as_str(), "qwen3next");
    assert!(info.has_mtp_head);

    let mut logits = RVec::new();
    backend
        .eval(seq, &[1, 403, 261, 378], LogitRows::All, &mut logits)
        .into_result()
        .unwrap();
    assert_eq!(logits.len(), 4 * 512);
    let mut hidden = RVec::new();
    backend
        .hidden_states(seq, &mut hidden)
        .into_result()
        .unwrap();
    assert_eq!(hidden.len(), 4 * 64);
    let (mut mtp_logits, mut mtp_hidden) = (RVec::new(), RVec::new());
    for position in 0..3 {
        backend
            .mtp_eval(
                seq,
                &hidden[position * 64..(position + 1) * 64],
                &[[403, 261, 378][position]],
                position,
                LogitRows::All,
                &mut mtp_logits,
                &mut mtp_hidden,
            )
            .into_result()
            .unwrap();
    }
    assert_eq!((mtp_logits.len(), mtp_hidden.len()), (512, 64));
    let kept = logits[512..1024].to_vec();
    backend.truncate(seq, 1).into_result().unwrap();
    assert_eq!(backend.seq_len(seq).unwrap(), 1);
    backend
        .eval(seq, &[403], LogitRows::Last, &mut logits)
        .into_result()
        .unwrap();
    assert_eq!(bits(&logits), bits(&kept));
    // Out-of-window truncation through the ABI: the default slow path.
    backend
        .eval(seq, &[5, 6, 7, 8, 9], LogitRows::None, &mut logits)
        .into_result()
        .unwrap();
    backend.truncate(seq, 1).into_result().unwrap();
    assert_eq!(backend.seq_len(seq).unwrap(), 1);
}

#[test]
fn batched_mtp_rows_are_bit_identical_to_one_row_calls() {
    for path in [
        fixture("tiny-qwen35-mtp.gguf"),
        fixture("tiny-qwen3next-mtp.gguf"),
        trained_qwen35("q8_0"),
    ] {
        let prompt = [1u32, 403, 261, 378, 300, 290, 13, 45, 400, 401, 402];
        let mut b = open(&path, 2, 64);
        eval(&mut b, &prompt, LogitRows::None);
        let hidden = b.last_hidden_states().to_vec();
        let e = hidden.len() / prompt.len();
        let n = prompt.len() - 1;
        let (mut batch_logits, mut batch_hidden) = (RVec::new(), RVec::new());
        b.mtp_eval_into(
            &hidden[..n * e],
            &prompt[1..],
            0,
            LogitRows::All,
            &mut batch_logits,
            &mut batch_hidden,
        )
        .unwrap();
        let vocab = batch_logits.len() / n;
        // Only the last row's logits: the same bits as the last row of All.
        let (mut last_logits, mut last_hidden) = (RVec::new(), RVec::new());
        b.mtp_eval_into(
            &hidden[..n * e],
            &prompt[1..],
            0,
            LogitRows::Last,
            &mut last_logits,
            &mut last_hidden,
        )
        .unwrap();
        assert_eq!(bits(&last_logits), bits(&batch_logits[(n - 1) * vocab..]));
        assert_eq!(bits(&last_hidden), bits(&batch_hidden));
        for i in 0..n {
            let (logits, out) = mtp(&mut b, row(&hidden, i, e), prompt[i + 1], i);
            assert_eq!(
                bits(&logits),
                bits(row(&batch_logits, i, vocab)),
                "{} row {i}",
                path.display()
            );
            assert_eq!(
                bits(&out),
                bits(row(&batch_hidden, i, e)),
                "{} row {i}",
                path.display()
            );
        }
    }
}

/// An MTP call over more rows than one pass holds (a re-evaluated conversation) runs in several
/// passes; each pass's rows keep their bits, and the logits asked for come from the pass that
/// computed them — also when the first passes compute none (`Last`, `None`).
#[test]
fn mtp_rows_beyond_one_pass_keep_their_bits() {
    for path in [fixture("tiny-qwen35-mtp.gguf"), trained_qwen35("q8_0")] {
        let mut rng = specula_plugin_api::testing::Rng::new(7);
        let mut b = open(&path, 2, 256);
        let vocab = b.model_info().vocab_size;
        let prompt = rng.tokens(150, vocab);
        eval(&mut b, &prompt, LogitRows::None);
        let hidden = b.last_hidden_states().to_vec();
        let e = hidden.len() / prompt.len();
        let n = prompt.len() - 1;
        let call = |b: &mut Solo, rows| {
            let (mut logits, mut out) = (RVec::new(), RVec::new());
            b.mtp_eval_into(
                &hidden[..n * e],
                &prompt[1..],
                0,
                rows,
                &mut logits,
                &mut out,
            )
            .unwrap();
            (logits.to_vec(), out.to_vec())
        };
        let (all_logits, all_hidden) = call(&mut b, LogitRows::All);
        let vocab = all_logits.len() / n;
        let (last_logits, last_hidden) = call(&mut b, LogitRows::Last);
        let (none_logits, none_hidden) = call(&mut b, LogitRows::None);
        assert_eq!(bits(&last_logits), bits(&all_logits[(n - 1) * vocab..]));
        assert!(none_logits.is_empty());
        for out in [&last_hidden, &none_hidden] {
            assert_eq!(bits(out), bits(&all_hidden), "{}", path.display());
        }
        // Rows of every pass against one-row calls (from the last: a call at `i` leaves the
        // head's cache `i + 1` long).
        for i in [n - 1, 100, 64, 63, 0] {
            let (logits, out) = mtp(&mut b, row(&hidden, i, e), prompt[i + 1], i);
            assert_eq!(bits(&logits), bits(row(&all_logits, i, vocab)), "row {i}");
            assert_eq!(bits(&out), bits(row(&all_hidden, i, e)), "row {i}");
        }
    }
}
