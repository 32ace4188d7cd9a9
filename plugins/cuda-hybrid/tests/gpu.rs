//! GPU tests: each starts with a runtime "is there a usable GPU?" check and is skipped, with a
//! message saying why, where there is none (no driver, no NVRTC, no device).
//!
//! Kernel level: every mat-vec type against a dequantising reference (Q4_K / Q6_K against
//! straight transcriptions of ggml's dequantisers) and the quantised ones against the CPU
//! kernels, row b of a k-row launch bit-identical to a one-row launch, activation quantisation
//! byte-equal to the CPU's, shared quantisation across matrices, expert mat-vecs, RMSNorm, the three RoPE variants and attention against
//! the CPU code, the Q8_0 cache's stores and attention against the CPU's Q8_0 cache. Model level (every architecture, several placements): verify rows
//! bit-identical to single-token evals, the rollback oracle (truncating inside the window
//! equals a run that never saw the rejected tokens), logits close to cpu-simd and greedy output
//! equal to it, MTP rows bit-identical to one-row calls, MTP drafting equal to plain decoding,
//! deep rollback, placement options, and passes replayed as CUDA graphs (`cuda_graphs`)
//! bit-identical to passes issued launch by launch.
//!
//! Where there is no GPU, the tests run on the host emulator of the kernels
//! ([`specula_cuda_hybrid::gpu::emulator`], built with the C++ compiler `$CXX` or `c++`) — the
//! same kernel sources and the same device path, with host memory for device memory — over a
//! smaller set of cases (`SPECULA_EMULATOR_FULL=1` runs all of them); where neither is
//! available they are skipped with a message.
//!
//! Tolerances against the CPU were checked on the emulator only (glibc's math stands in for
//! CUDA's, which may differ in the last bits); bit-identity checks are exact by design.

mod common;

use common::*;
use specula_cuda_hybrid::gpu::ops::{self, AttentionDims, DevRope, Heads, Q8Scratch};
use specula_cuda_hybrid::gpu::weights::{DevExperts, DevMatrix, DevVec};
use specula_cuda_hybrid::gpu::{replay, DevBuf, Gpu};
use specula_cuda_hybrid::CudaBackend;
use specula_engine::blocks::attention::AttentionShape;
use specula_engine::cpu::attention;
use specula_engine::kv_cache::KvType;
use specula_gguf::GgmlType;
use specula_kernels::{f16, Rope, RopeMode, RopeSections};
use specula_plugin_api::{ErrorKind, LogitRows};

const PROMPT: [u32; 6] = [1, 403, 261, 378, 13, 300];

/// The `n` chain rows from position `pos0` of sequence 0, read through the one block table
/// `table` (uploaded here with the row table, which the returned buffer keeps alive).
fn chain_rows_of_one_table(
    gpu: &Gpu,
    table: &DevBuf<u32>,
    pos0: usize,
    n: usize,
) -> (ops::AttentionRows, DevBuf<i32>) {
    let info = gpu.upload(&ops::chain_rows(0, pos0, n)).unwrap();
    let rows = ops::AttentionRows {
        info: info.ptr(),
        n,
        tables: table.ptr(),
        table_stride: 0,
        paths: 0,
        max_keys: pos0 + n,
    };
    (rows, info)
}

fn download(gpu: &Gpu, buf: &DevBuf<f32>) -> Vec<f32> {
    gpu.sync().unwrap();
    gpu.download(buf).unwrap()
}

// ---- reference dequantisers (ggml's loops, written out) ----------------------------------

fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn dequantize_q4_k(block: &[u8], y: &mut [f32]) {
    let d = f16::to_f32(u16::from_le_bytes([block[0], block[1]]));
    let dmin = f16::to_f32(u16::from_le_bytes([block[2], block[3]]));
    let scales = &block[4..16];
    let mut q = &block[16..144];
    let mut is = 0;
    let mut out = 0;
    for _ in 0..4 {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * f32::from(sc), dmin * f32::from(m));
        for l in 0..32 {
            y[out + l] = d1 * f32::from(q[l] & 0xF) - m1;
        }
        for l in 0..32 {
            y[out + 32 + l] = d2 * f32::from(q[l] >> 4) - m2;
        }
        out += 64;
        q = &q[32..];
        is += 2;
    }
}

fn dequantize_q6_k(block: &[u8], y: &mut [f32]) {
    let d = f16::to_f32(u16::from_le_bytes([block[208], block[209]]));
    let (mut ql, mut qh) = (&block[0..128], &block[128..192]);
    let mut sc: Vec<i8> = block[192..208].iter().map(|&b| b as i8).collect();
    let mut out = 0;
    for _ in 0..2 {
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[out + l] = d * f32::from(sc[is]) * q1 as f32;
            y[out + l + 32] = d * f32::from(sc[is + 2]) * q2 as f32;
            y[out + l + 64] = d * f32::from(sc[is + 4]) * q3 as f32;
            y[out + l + 96] = d * f32::from(sc[is + 6]) * q4 as f32;
        }
        out += 128;
        ql = &ql[64..];
        qh = &qh[32..];
        sc.drain(..8);
    }
}

/// Random weights of `ty` (`rows × cols`) as stored, and their dequantised values.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => {
            let (block_bytes, blocks) = (ty.block_bytes(), rows * cols / 256);
            let mut bytes: Vec<u8> = (0..block_bytes * blocks)
                .map(|_| rng.next_u64() as u8)
                .collect();
            let mut values = vec![0.0; rows * cols];
            for (b, block) in bytes.chunks_exact_mut(block_bytes).enumerate() {
                let y = &mut values[b * 256..(b + 1) * 256];
                if ty == GgmlType::Q4K {
                    let d = f16::from_f32(0.002 * (1.0 + rng.unit().abs()));
                    let dmin = f16::from_f32(0.001 * (1.0 + rng.unit().abs()));
                    block[0..2].copy_from_slice(&d.to_le_bytes());
                    block[2..4].copy_from_slice(&dmin.to_le_bytes());
                    dequantize_q4_k(block, y);
                } else {
                    let d = f16::from_f32(0.0005 * (1.0 + rng.unit().abs()));
                    block[208..210].copy_from_slice(&d.to_le_bytes());
                    dequantize_q6_k(block, y);
                }
            }
            (bytes, values)
        }
        _ => {
            let values: Vec<f32> = (0..rows * cols).map(|_| 0.1 * rng.unit()).collect();
            let bytes = specula_kernels::quantize(ty, &values);
            let back = specula_kernels::dequantize(ty, &bytes, values.len());
            (bytes, back)
        }
    }
}

fn dev_matrix(ty: GgmlType, rows: usize, cols: usize, bytes: &DevBuf<u8>) -> DevMatrix {
    DevMatrix {
        ty,
        rows,
        cols,
        row_bytes: ty.row_bytes(cols).unwrap(),
        ptr: bytes.ptr(),
    }
}

#[test]
fn matmul_matches_a_dequantising_reference_and_rows_are_independent() {
    let Some(device) =
        device_or_skip("matmul_matches_a_dequantising_reference_and_rows_are_independent")
    else {
        return;
    };
    let gpu = open_device(&device);
    let mut rng = Rng::new(5);
    let cases = [
        (GgmlType::F32, 172),
        (GgmlType::F32, 512),
        (GgmlType::F16, 300),
        (GgmlType::BF16, 512),
        (GgmlType::Q8_0, 512),
        (GgmlType::Q4_0, 352),
        (GgmlType::Q4K, 512),
        (GgmlType::Q5K, 768),
        (GgmlType::Q6K, 768),
        // Rows longer than the multi-row kernels' shared-memory tile of 64 units: a whole tile
        // then a part (2,304 values: 72 units), and one unit past a tile (2,080: 65).
        (GgmlType::Q4K, 2304),
        (GgmlType::Q8_0, 2080),
    ];
    let (rows, n) = (37, 11);
    for (ty, cols) in cases {
        let (bytes, w) = random_matrix(ty, rows, cols, &mut rng);
        let weight_type = specula_kernels::WeightType::from_ggml(ty).unwrap();
        let quantised = weight_type.activation() != specula_kernels::ActivationFormat::F32;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let dev_w = gpu.upload(&bytes).unwrap();
        let m = dev_matrix(ty, rows, cols, &dev_w);
        let dev_x = gpu.upload(&x).unwrap();
        let out = gpu.zeros::<f32>(n * rows).unwrap();
        let q8 = Q8Scratch::new(&gpu, (n * cols).next_multiple_of(32)).unwrap();
        ops::matmul(&gpu, &m, dev_x.ptr(), n, out.ptr(), &q8).unwrap();
        let got = download(&gpu, &out);
        for b in 0..n {
            for r in 0..rows {
                let reference: f64 = (0..cols)
                    .map(|i| f64::from(w[r * cols + i]) * f64::from(x[b * cols + i]))
                    .sum();
                let magnitude: f64 = (0..cols)
                    .map(|i| (f64::from(w[r * cols + i]) * f64::from(x[b * cols + i])).abs())
                    .sum();
                // The quantised types quantise the activations too (to 8 bits per value).
                let tol = if quantised {
                    0.01 * magnitude + 1e-4
                } else {
                    1e-5 * magnitude + 1e-6
                };
                let g = f64::from(got[b * rows + r]);
                assert!(
                    (g - reference).abs() <= tol,
                    "{ty:?} cols {cols}: row {r} of activation {b}: {g} vs {reference} (tol {tol})"
                );
            }
        }
        // Row b of an 11-row launch equals a one-row launch bit for bit, and so do the rows of
        // the 2-, 3- and 4-row launches (kernels of their own).
        let single = gpu.zeros::<f32>(rows).unwrap();
        for b in 0..n {
            ops::matmul(&gpu, &m, dev_x.at(b * cols), 1, single.ptr(), &q8).unwrap();
            assert_eq!(
                bits(&download(&gpu, &single)),
                bits(&got[b * rows..(b + 1) * rows]),
                "{ty:?}: activation row {b}"
            );
        }
        for few in 2..=4 {
            let few_out = gpu.zeros::<f32>(few * rows).unwrap();
            ops::matmul(&gpu, &m, dev_x.ptr(), few, few_out.ptr(), &q8).unwrap();
            assert_eq!(
                bits(&download(&gpu, &few_out)),
                bits(&got[..few * rows]),
                "{ty:?}: a {few}-row launch"
            );
        }
        if quantised {
            // The same activation quantisation and integer dots as the CPU kernels: their
            // results up to the order of the f32 sums.
            let view = specula_kernels::WeightMatrix::new(weight_type, rows, cols, &bytes).unwrap();
            let mut cpu = vec![0.0; n * rows];
            specula_kernels::matmul(&view, &x, &mut cpu, &mut Default::default());
            for (i, (&c, &g)) in cpu.iter().zip(&got).enumerate() {
                let (b, r) = (i / rows, i % rows);
                let magnitude: f32 = (0..cols)
                    .map(|k| (w[r * cols + k] * x[b * cols + k]).abs())
                    .sum();
                assert!(
                    (c - g).abs() <= 1e-5 * magnitude,
                    "{ty:?}: row {r} of activation {b}: GPU {g}, CPU {c}"
                );
            }
        }
    }
}

/// Matrices sharing activation rows (mixed types, as in a Q4_K_M file) give, through
/// `matmul_many` with its shared quantisation, the bits of one `matmul` each.
#[test]
fn matmul_many_equals_one_matmul_per_matrix() {
    let Some(device) = device_or_skip("matmul_many_equals_one_matmul_per_matrix") else {
        return;
    };
    let gpu = open_device(&device);
    let mut rng = Rng::new(23);
    let (cols, n) = (512, 3);
    let types = [
        (GgmlType::Q4K, 20),
        (GgmlType::Q6K, 12),
        (GgmlType::Q8_0, 9),
        (GgmlType::Q4K, 7),
        (GgmlType::F16, 5),
        (GgmlType::Q5K, 16),
    ];
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let dev_x = gpu.upload(&x).unwrap();
    let q8 = Q8Scratch::new(&gpu, n * cols).unwrap();
    let mut weights = Vec::new();
    let mut outs = Vec::new();
    for &(ty, rows) in &types {
        let (bytes, _) = random_matrix(ty, rows, cols, &mut rng);
        weights.push(gpu.upload(&bytes).unwrap());
        outs.push(gpu.zeros::<f32>(n * rows).unwrap());
    }
    let matrices: Vec<DevMatrix> = types
        .iter()
        .zip(&weights)
        .map(|(&(ty, rows), bytes)| dev_matrix(ty, rows, cols, bytes))
        .collect();
    let jobs: Vec<(&DevMatrix, u64)> = matrices
        .iter()
        .zip(&outs)
        .map(|(m, o)| (m, o.ptr()))
        .collect();
    ops::matmul_many(&gpu, dev_x.ptr(), n, &jobs, &q8).unwrap();
    for (i, m) in matrices.iter().enumerate() {
        let one = gpu.zeros::<f32>(n * m.rows).unwrap();
        ops::matmul(&gpu, m, dev_x.ptr(), n, one.ptr(), &q8).unwrap();
        assert_eq!(
            bits(&download(&gpu, &one)),
            bits(&download(&gpu, &outs[i])),
            "matrix {i} ({:?})",
            m.ty
        );
    }
}

/// Activation rows quantised on the device are the CPU's bytes: Q8_K (for the K-quants) and
/// Q8_0 (for Q8_0 and Q4_0 weights), on blocks built to hit the corner cases — the largest
/// magnitude twice with opposite signs (the first one wins), products exactly halfway between
/// two levels (ties to even for Q8_K, away from zero for Q8_0), an all-zero block, tiny values.
#[test]
fn activation_quantisation_matches_the_cpu_bytes() {
    let Some(device) = device_or_skip("activation_quantisation_matches_the_cpu_bytes") else {
        return;
    };
    let gpu = open_device(&device);
    let mut rng = Rng::new(17);
    let mut x: Vec<f32> = (0..6 * 256).map(|_| 3.0 * rng.unit()).collect();
    // Block 0: max magnitude 127 at index 40 (negative) and 200 (positive): iscale = 1, so
    // halves are exact ties.
    for (i, v) in x[..256].iter_mut().enumerate() {
        *v = (i % 97) as f32 * 0.5 - 24.0;
    }
    x[40] = -127.0;
    x[200] = 127.0;
    // Block 1: the positive one first.
    x[256 + 3] = 9.0;
    x[256 + 250] = -9.0;
    // Block 2: zero. Block 3: tiny values.
    x[512..768].fill(0.0);
    for v in &mut x[768..1024] {
        *v *= 1e-30;
    }
    let dev_x = gpu.upload(&x).unwrap();
    let q8 = Q8Scratch::new(&gpu, x.len()).unwrap();

    q8.quantize_for(&gpu, GgmlType::Q4K, dev_x.ptr(), x.len())
        .unwrap();
    gpu.sync().unwrap();
    let (q, d, sums) = (
        gpu.download(&q8.q).unwrap(),
        gpu.download(&q8.d).unwrap(),
        gpu.download(&q8.sums).unwrap(),
    );
    let mut cpu = vec![0u8; x.len() / 256 * specula_kernels::q8_k::BLOCK_BYTES];
    specula_kernels::q8_k::quantize_row_scalar(&x, &mut cpu);
    for (b, block) in cpu
        .chunks_exact(specula_kernels::q8_k::BLOCK_BYTES)
        .enumerate()
    {
        let want_d = f32::from_le_bytes(block[..4].try_into().unwrap());
        assert_eq!(d[b].to_bits(), want_d.to_bits(), "Q8_K block {b}: scale");
        for i in 0..256 {
            assert_eq!(
                q[b * 256 + i] as u8,
                block[4 + i],
                "Q8_K block {b}: quant {i}"
            );
        }
        for unit in 0..8 {
            let group =
                |g: usize| i32::from(i16::from_le_bytes([block[260 + 2 * g], block[261 + 2 * g]]));
            assert_eq!(
                sums[b * 8 + unit],
                group(2 * unit) + group(2 * unit + 1),
                "Q8_K block {b}: sum of unit {unit}"
            );
        }
    }

    q8.quantize_for(&gpu, GgmlType::Q4_0, dev_x.ptr(), x.len())
        .unwrap();
    gpu.sync().unwrap();
    let (q, d) = (gpu.download(&q8.q).unwrap(), gpu.download(&q8.d).unwrap());
    let mut cpu = vec![0u8; x.len() / 32 * specula_kernels::q8_0::BLOCK_BYTES];
    specula_kernels::q8_0::quantize_row(&x, &mut cpu);
    for (b, block) in cpu
        .chunks_exact(specula_kernels::q8_0::BLOCK_BYTES)
        .enumerate()
    {
        let want_d = f16::to_f32(u16::from_le_bytes([block[0], block[1]]));
        assert_eq!(d[b].to_bits(), want_d.to_bits(), "Q8_0 block {b}: scale");
        for i in 0..32 {
            assert_eq!(
                q[b * 32 + i] as u8,
                block[2 + i],
                "Q8_0 block {b}: quant {i}"
            );
        }
    }
}

#[test]
fn expert_matmul_equals_the_plain_matmul_of_each_pair() {
    let Some(device) = device_or_skip("expert_matmul_equals_the_plain_matmul_of_each_pair") else {
        return;
    };
    let gpu = open_device(&device);
    let mut rng = Rng::new(9);
    let (rows, cols, n_expert, pairs, k) = (24, 256, 3, 6, 2);
    for ty in [
        GgmlType::F32,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
    ] {
        let (bytes, _) = random_matrix(ty, rows * n_expert, cols, &mut rng);
        let dev_w = gpu.upload(&bytes).unwrap();
        let row_bytes = ty.row_bytes(cols).unwrap();
        let experts = DevExperts {
            ty,
            rows,
            cols,
            n_expert,
            row_bytes,
            matrix_bytes: row_bytes * rows,
            ptr: dev_w.ptr(),
        };
        let x: Vec<f32> = (0..(pairs / k) * cols).map(|_| rng.unit()).collect();
        let dev_x = gpu.upload(&x).unwrap();
        let ids: Vec<i32> = vec![2, 0, 1, 2, 0, 0];
        let dev_ids = gpu.upload(&ids).unwrap();
        let out = gpu.zeros::<f32>(pairs * rows).unwrap();
        let q8 = Q8Scratch::new(&gpu, pairs * cols).unwrap();
        ops::matmul_ids(
            &gpu,
            &experts,
            dev_ids.ptr(),
            pairs,
            dev_x.ptr(),
            pairs / k,
            k,
            out.ptr(),
            &q8,
        )
        .unwrap();
        let got = download(&gpu, &out);
        let single = gpu.zeros::<f32>(rows).unwrap();
        for p in 0..pairs {
            let m = DevMatrix {
                ty,
                rows,
                cols,
                row_bytes,
                ptr: dev_w.ptr() + (ids[p] as usize * row_bytes * rows) as u64,
            };
            ops::matmul(&gpu, &m, dev_x.at((p / k) * cols), 1, single.ptr(), &q8).unwrap();
            assert_eq!(
                bits(&download(&gpu, &single)),
                bits(&got[p * rows..(p + 1) * rows]),
                "{ty:?}: pair {p}"
            );
        }
    }
}

#[test]
fn norms_rope_and_attention_follow_the_cpu_code() {
    let Some(device) = device_or_skip("norms_rope_and_attention_follow_the_cpu_code") else {
        return;
    };
    let gpu = open_device(&device);
    let mut rng = Rng::new(21);
    // RMSNorm of 3 rows of 300.
    let x: Vec<f32> = (0..900).map(|_| 3.0 * rng.unit()).collect();
    let w: Vec<f32> = (0..300).map(|_| 1.0 + 0.1 * rng.unit()).collect();
    let (dx, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
    let out = gpu.zeros::<f32>(900).unwrap();
    let wv = DevVec {
        len: 300,
        ptr: dw.ptr(),
    };
    ops::rms_norm(&gpu, dx.ptr(), 300, &wv, 1e-6, 300, 3, out.ptr(), 300).unwrap();
    let got = download(&gpu, &out);
    for r in 0..3 {
        let mut cpu = vec![0.0; 300];
        specula_kernels::ops::rms_norm(&x[r * 300..(r + 1) * 300], &w, 1e-6, &mut cpu);
        let d = max_diff(&cpu, &got[r * 300..(r + 1) * 300]);
        assert!(d < 1e-5, "rms_norm row {r}: {d}");
    }

    // q/k norm + RoPE for the three modes, 2 rows of 4 heads of 16, at positions 37, 38.
    let (hd, heads, rows, pos0) = (16, 4, 2, 37);
    let modes = [
        RopeMode::Normal,
        RopeMode::NeoX,
        RopeMode::MultiSection(RopeSections {
            sections: [2, 1, 1, 0],
            interleaved: true,
        }),
        RopeMode::MultiSection(RopeSections {
            sections: [1, 1, 1, 1],
            interleaved: false,
        }),
    ];
    let norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.05 * rng.unit()).collect();
    let dnorm = gpu.upload(&norm).unwrap();
    let norm_v = DevVec {
        len: hd,
        ptr: dnorm.ptr(),
    };
    for mode in modes {
        let rope = Rope {
            mode,
            n_rot: 8,
            freq_base: 1e7,
            freq_scale: 1.0,
            freq_factors: None,
        };
        let data: Vec<f32> = (0..rows * heads * hd).map(|_| rng.unit()).collect();
        let dev = gpu.upload(&data).unwrap();
        let h = Heads {
            ptr: dev.ptr(),
            row_stride: heads * hd,
            head_stride: hd,
        };
        ops::qk_norm_rope(
            &gpu,
            h,
            h,
            heads,
            rows,
            hd,
            Some(&norm_v),
            1e-6,
            ops::Positions::From(pos0),
            0,
            &DevRope::new(&rope, None),
        )
        .unwrap();
        let got = download(&gpu, &dev);
        let mut cpu = data.clone();
        let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
        for r in 0..rows {
            let mut k = vec![0.0; hd];
            rope.angles(pos0 + r, &mut cos, &mut sin);
            attention::prepare_query_key(
                &rope,
                hd,
                1e-6,
                Some(&norm),
                Some(&norm),
                (&cos, &sin),
                &mut cpu[r * heads * hd..(r + 1) * heads * hd],
                &mut k,
            );
        }
        let d = max_diff(&cpu, &got);
        assert!(d < 1e-5, "{mode:?}: {d}");
    }

    // Attention of 3 rows over 133 cached positions, 4 query heads on 2 kv heads, over an f32
    // cache and an f16 one (against the CPU code over the same values widened to f32), paged:
    // the three blocks of 64 positions are stored out of order, read through a block table.
    // Heads of 16 (key rows read in 16-byte words) and of 12 keys (f16 rows a value at a time)
    // and 200 values (more than the block's 128 threads: two dimensions a thread).
    for (head_dim, value_dim) in [(16, 16), (12, 200)] {
        let shape = AttentionShape {
            n_head: 4,
            n_head_kv: 2,
            head_dim,
            value_dim,
        };
        let (n_ctx, rows, pos0) = (192, 3, 130);
        let table: [u32; 3] = [2, 0, 1];
        let paged = |logical: &[f32], width: usize| {
            let mut physical = vec![0.0; logical.len()];
            for (b, &at) in table.iter().enumerate() {
                let block = 64 * width;
                physical[at as usize * block..][..block]
                    .copy_from_slice(&logical[b * block..][..block]);
            }
            physical
        };
        let dtable = gpu.upload(&table).unwrap();
        let keys: Vec<f32> = (0..n_ctx * shape.k_width()).map(|_| rng.unit()).collect();
        let values: Vec<f32> = (0..n_ctx * shape.v_width()).map(|_| rng.unit()).collect();
        let q: Vec<f32> = (0..rows * shape.q_width()).map(|_| rng.unit()).collect();
        let dq = gpu.upload(&q).unwrap();
        let scores = gpu
            .zeros::<f32>(ops::ATTENTION_ROWS * shape.n_head * n_ctx)
            .unwrap();
        let dims = AttentionDims {
            n_head: 4,
            n_head_kv: 2,
            head_dim,
            value_dim,
            scale: shape.scale(),
        };
        let qh = Heads {
            ptr: dq.ptr(),
            row_stride: shape.q_width(),
            head_stride: head_dim,
        };
        let half = |x: &[f32]| x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<u16>>();
        let widen = |x: &[u16]| x.iter().map(|&h| f16::to_f32(h)).collect::<Vec<f32>>();
        let (half_keys, half_values) = (half(&keys), half(&values));
        let (paged_keys, paged_values) = (
            paged(&keys, shape.k_width()),
            paged(&values, shape.v_width()),
        );
        let (keys_f32, values_f32) = (
            gpu.upload(&paged_keys).unwrap(),
            gpu.upload(&paged_values).unwrap(),
        );
        let (keys_f16, values_f16) = (
            gpu.upload(&half(&paged_keys)).unwrap(),
            gpu.upload(&half(&paged_values)).unwrap(),
        );
        for kv in [KvType::F32, KvType::F16] {
            let (keys, values, dk, dv) = match kv {
                KvType::F32 => (
                    keys.clone(),
                    values.clone(),
                    keys_f32.ptr(),
                    values_f32.ptr(),
                ),
                KvType::F16 => (
                    widen(&half_keys),
                    widen(&half_values),
                    keys_f16.ptr(),
                    values_f16.ptr(),
                ),
                KvType::Q8_0 => unreachable!("cuda-hybrid has no q8_0 cache"),
            };
            let out = gpu.zeros::<f32>(rows * shape.out_width()).unwrap();
            let layer = ops::KvLayer {
                ty: kv,
                keys: dk,
                values: dv,
                table: dtable.ptr(),
            };
            let attend = |q: Heads, rows: ops::AttentionRows, out: u64| {
                ops::attention(&gpu, &dims, q, layer, rows, &scores, n_ctx, None, out).unwrap()
            };
            let (attention_rows, _info) = chain_rows_of_one_table(&gpu, &dtable, pos0, rows);
            attend(qh, attention_rows, out.ptr());
            let got = download(&gpu, &out);
            for r in 0..rows {
                let n_keys = pos0 + r + 1;
                let mut cpu = vec![0.0; shape.out_width()];
                attention::attend(
                    &shape,
                    &q[r * shape.q_width()..(r + 1) * shape.q_width()],
                    &keys[..n_keys * shape.k_width()],
                    &values[..n_keys * shape.v_width()],
                    &mut cpu,
                );
                let d = max_diff(
                    &cpu,
                    &got[r * shape.out_width()..(r + 1) * shape.out_width()],
                );
                assert!(d < 1e-5, "{kv:?} attention row {r}: {d}");
            }

            // Rows of two sequences in one launch: sequence 1 reads the same physical blocks
            // through its own table. Each row follows the CPU over its sequence's keys, and its
            // bits equal a launch of that row alone.
            let table_1: [u32; 3] = [1, 2, 0];
            let tables = gpu.upload(&[table, table_1].concat()).unwrap();
            let logical_block = |physical: u32| table.iter().position(|&t| t == physical).unwrap();
            let of_sequence_1 = |logical: &[f32], width: usize| {
                let block = 64 * width;
                table_1
                    .iter()
                    .flat_map(|&t| logical[logical_block(t) * block..][..block].to_vec())
                    .collect::<Vec<f32>>()
            };
            let rows_at = [(1, 70), (0, 131), (1, 3)];
            let info: Vec<i32> = rows_at
                .iter()
                .flat_map(|&(seq, pos)| ops::chain_rows(seq, pos, 1))
                .collect();
            let dinfo = gpu.upload(&info).unwrap();
            let mixed = ops::AttentionRows {
                info: dinfo.ptr(),
                n: rows_at.len(),
                tables: tables.ptr(),
                table_stride: table.len(),
                paths: 0,
                max_keys: 132,
            };
            let out = gpu.zeros::<f32>(rows * shape.out_width()).unwrap();
            attend(qh, mixed, out.ptr());
            let got = download(&gpu, &out);
            let alone = gpu.zeros::<f32>(shape.out_width()).unwrap();
            for (r, &(seq, pos)) in rows_at.iter().enumerate() {
                let row = &got[r * shape.out_width()..(r + 1) * shape.out_width()];
                let one = ops::AttentionRows {
                    info: dinfo.ptr() + (4 * ops::ROW_INFO * r) as u64,
                    n: 1,
                    ..mixed
                };
                let q_r = Heads {
                    ptr: qh.ptr + (4 * r * qh.row_stride) as u64,
                    ..qh
                };
                attend(q_r, one, alone.ptr());
                assert_eq!(
                    bits(&download(&gpu, &alone)),
                    bits(row),
                    "{kv:?}: row {r} (sequence {seq}) alone"
                );
                let (keys, values) = if seq == 0 {
                    (keys.clone(), values.clone())
                } else {
                    (
                        of_sequence_1(&keys, shape.k_width()),
                        of_sequence_1(&values, shape.v_width()),
                    )
                };
                let mut cpu = vec![0.0; shape.out_width()];
                attention::attend(
                    &shape,
                    &q[r * shape.q_width()..(r + 1) * shape.q_width()],
                    &keys[..(pos + 1) * shape.k_width()],
                    &values[..(pos + 1) * shape.v_width()],
                    &mut cpu,
                );
                let d = max_diff(&cpu, row);
                assert!(d < 1e-5, "{kv:?} row {r} of sequence {seq}: {d}");
            }
        }
    }
}

// ---- model level ---------------------------------------------------------------------------

/// The device's Q8_0 cache at kernel level: `kv_store_q8_0` writes each head row as the CPU's
/// quantiser does (the same bytes), and `attention_q8_0` over 130 positions in three paged
/// blocks follows cpu-simd's attention over a Q8_0 pool (its integer scores of the quantised
/// queries, dequantised values) to f32 rounding, row by row.
#[test]
fn q8_0_cache_kernels_follow_the_cpu_cache() {
    use specula_engine::kv_cache::{KvPool, SeqKv};
    let Some(device) = device_or_skip("q8_0_cache_kernels_follow_the_cpu_cache") else {
        return;
    };
    let gpu = open_device(&device);
    let mut rng = Rng::new(23);
    let shape = AttentionShape {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        value_dim: 32,
    };
    let (n_ctx, rows, pos0, width) = (130, 3, 127, shape.k_width());
    let keys: Vec<f32> = (0..n_ctx * width).map(|_| rng.unit()).collect();
    let values: Vec<f32> = (0..n_ctx * width).map(|_| rng.unit()).collect();
    let q: Vec<f32> = (0..rows * shape.q_width()).map(|_| rng.unit()).collect();

    let mut pool = KvPool::new(1, 3, &shape, KvType::Q8_0, false).unwrap();
    let mut seq = SeqKv::default();
    pool.reserve(&mut seq, 0, n_ctx).unwrap();
    pool.store(0, &seq, 0, &keys, &values);
    pool.set_len(&mut seq, n_ctx);
    let segment = attention::Segment {
        rows: 0..rows,
        first_len: pos0 + 1,
        keys: pool.keys(0, &seq, n_ctx),
        values: pool.values(0, &seq, n_ctx),
        tree: None,
    };
    let mut cpu = vec![0.0; rows * shape.out_width()];
    let mut scratch = attention::AttentionScratch::new();
    attention::attend_segments(&shape, &q, &[segment], &mut scratch, &mut cpu);

    // The device cache through a table of three blocks stored out of order.
    let table: [u32; 3] = [2, 0, 1];
    let dtable = gpu.upload(&table).unwrap();
    let row_units = KvType::Q8_0.row_bytes(width) / 2;
    let cache = |data: &[f32]| {
        let src = gpu.upload(data).unwrap();
        let dst = gpu.zeros::<u16>(3 * 64 * row_units).unwrap();
        let (all, _info) = chain_rows_of_one_table(&gpu, &dtable, 0, n_ctx);
        ops::kv_store(&gpu, KvType::Q8_0, src.ptr(), width, all, dst.ptr()).unwrap();
        gpu.sync().unwrap();
        dst
    };
    let (dk, dv) = (cache(&keys), cache(&values));
    let stored: Vec<u8> = gpu
        .download(&dk)
        .unwrap()
        .iter()
        .flat_map(|u: &u16| u.to_le_bytes())
        .collect();
    for p in 0..n_ctx {
        let mut want = vec![0u8; 2 * row_units];
        specula_kernels::q8_0::quantize_row(&keys[p * width..(p + 1) * width], &mut want);
        let slot = table[p / 64] as usize * 64 + p % 64;
        assert_eq!(
            &stored[slot * 2 * row_units..][..2 * row_units],
            &want[..],
            "key row {p}"
        );
    }

    let dq = gpu.upload(&q).unwrap();
    let scores = gpu
        .zeros::<f32>(ops::ATTENTION_ROWS * shape.n_head * n_ctx)
        .unwrap();
    let out = gpu.zeros::<f32>(rows * shape.out_width()).unwrap();
    let dims = AttentionDims {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        value_dim: 32,
        scale: shape.scale(),
    };
    let heads = Heads {
        ptr: dq.ptr(),
        row_stride: shape.q_width(),
        head_stride: 32,
    };
    let (query_rows, _info) = chain_rows_of_one_table(&gpu, &dtable, pos0, rows);
    let layer = ops::KvLayer {
        ty: KvType::Q8_0,
        keys: dk.ptr(),
        values: dv.ptr(),
        table: dtable.ptr(),
    };
    ops::attention(
        &gpu,
        &dims,
        heads,
        layer,
        query_rows,
        &scores,
        n_ctx,
        None,
        out.ptr(),
    )
    .unwrap();
    let got = download(&gpu, &out);
    for r in 0..rows {
        let range = r * shape.out_width()..(r + 1) * shape.out_width();
        let d = max_diff(&cpu[range.clone()], &got[range]);
        assert!(d < 1e-5, "q8_0 attention row {r}: {d}");
    }
}

fn cuda(device: &Device, path: &std::path::Path, options: &[(&str, &str)]) -> Solo<CudaBackend> {
    Solo::new(
        open_backend(device, path, options)
            .unwrap_or_else(|e| panic!("cuda-hybrid on {}: {e}", path.display())),
    )
}

/// Many sequences in one pass on the device: every row and every MTP row of an `eval_batch`
/// over up to 4 sequences — mixed lengths, prefill chunks beside verify rows, forks, frees and
/// truncations — is bit-identical to its sequence evaluated alone, for every model and
/// placement (the caches and rings of each sequence slot on the device, the host layers'
/// in the host pool).
#[test]
fn batched_sequences_are_bit_identical_to_each_sequence_alone() {
    let Some(device) = device_or_skip("batched_sequences_are_bit_identical_to_each_sequence_alone")
    else {
        return;
    };
    for path in gpu_models_with(&device, true) {
        for options in placements(&device) {
            assert_batched_rows_match_alone(&device, &path, options);
        }
    }
}

/// Every row of batches over 4 sequences of `path` (cuda-hybrid with `options`) equals its
/// sequence evaluated alone ([`assert_batches_match_sequences_alone`]).
fn assert_batched_rows_match_alone(
    device: &Device,
    path: &std::path::Path,
    options: &[(&str, &str)],
) {
    let name = format!("{} {options:?}", path.display());
    let open = || {
        open_backend_with(device, path, options, 4)
            .unwrap_or_else(|e| panic!("cuda-hybrid on {name}: {e}"))
    };
    let (mut batched, mut alone) = (open(), open());
    assert!(batched.executor().placement().uses_gpu(), "{name}");
    let rollback = (batched.caps().rollback_depth as usize).min(8);
    assert_batches_match_sequences_alone(&mut batched, &mut alone, 4, 6, rollback, 11, &name);
}

/// The device's attention caches live in the host pool's blocks: a fork shares its parent's
/// blocks and a write to a shared one copies it on the device too (parent and fork continue
/// as fresh sequences fed the same tokens would); the sequences together hold at most the
/// pool (`kv_tokens`), a pass needing more is refused as context-full and freeing a sequence
/// makes room; a repeated prompt is served from the prefix cache bit for bit. On the dense
/// llama, all on the GPU and split with the host.
#[test]
fn the_paged_device_cache_forks_is_bounded_and_serves_prefixes() {
    use abi_stable::std_types::{RSlice, RVec};
    use specula_plugin_api::{ForwardPass, SeqId, SequenceCalls};
    let Some(device) =
        device_or_skip("the_paged_device_cache_forks_is_bounded_and_serves_prefixes")
    else {
        return;
    };
    let open = |options: &[(&str, &str)], kv_tokens: u32| {
        let mut p = params(&stories(), 256, options);
        p.max_sequences = 4;
        p.kv_tokens = kv_tokens;
        let backend = match &device {
            Device::Cuda => specula_cuda_hybrid::open(&p),
            Device::Emulated(e) => {
                specula_cuda_hybrid::backend::open_emulated(&p, e.clone(), 1 << 34)
            }
        };
        backend.unwrap_or_else(|e| panic!("cuda-hybrid {options:?}: {e}"))
    };
    let run = |b: &mut CudaBackend, seq: SeqId, tokens: &[u32]| {
        let mut logits = RVec::new();
        b.eval(seq, tokens, LogitRows::Last, &mut logits)
            .into_result()
            .unwrap_or_else(|e| panic!("eval: {e}"));
        logits.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 500 + 1).collect();
    for options in [&[][..], &[("gpu_layers", "2")][..]] {
        let mut b = open(options, 0);
        assert!(b.executor().placement().uses_gpu(), "{options:?}");
        // Fork after 70 positions (a partial second block), then each writes that block.
        let parent = b.seq_create().into_result().unwrap();
        run(&mut b, parent, &prompt);
        let fork = b.seq_fork(parent).into_result().unwrap();
        let got_fork = run(&mut b, fork, &[7]);
        let got_parent = run(&mut b, parent, &[9]);
        let mut fresh = open(options, 0);
        for (tail, got) in [(7, &got_fork), (9, &got_parent)] {
            let seq = fresh.seq_create().into_result().unwrap();
            let mut tokens = prompt.clone();
            tokens.push(tail);
            assert_eq!(
                got,
                &run(&mut fresh, seq, &tokens),
                "{options:?}: after {tail}"
            );
        }

        // A repeated prompt takes the cached blocks and evaluates the rest.
        b.seq_free(fork).into_result().unwrap();
        b.seq_free(parent).into_result().unwrap();
        let again = b.seq_create().into_result().unwrap();
        let reused = b
            .seq_reuse_prefix(again, RSlice::from_slice(&prompt))
            .into_result()
            .unwrap();
        assert_eq!(reused, 64, "{options:?}: the full block");
        let got = run(&mut b, again, &prompt[reused..]);
        let seq = fresh.seq_create().into_result().unwrap();
        assert_eq!(
            got,
            run(&mut fresh, seq, &prompt),
            "{options:?}: from the prefix cache"
        );

        // Two blocks in all: the sequences share them.
        let mut small = open(options, 128);
        assert_eq!(small.capabilities().kv_tokens, 128);
        let seqs: Vec<SeqId> = (0..2)
            .map(|_| small.seq_create().into_result().unwrap())
            .collect();
        let first = run(&mut small, seqs[0], &prompt[..60]);
        run(&mut small, seqs[1], &prompt[..60]);
        let third = small.seq_create().into_result().unwrap();
        let mut logits = RVec::new();
        let err = small
            .eval(third, &prompt[..60], LogitRows::Last, &mut logits)
            .into_result()
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::ContextFull, "{options:?}: {err}");
        small.seq_free(seqs[1]).into_result().unwrap();
        assert_eq!(run(&mut small, third, &prompt[..60]), first, "{options:?}");
    }
}

/// Tree verification on the device (attention sees each row's path; a Gated DeltaNet row
/// starts from its parent's state in the device ring): every tree row bit-identical to its
/// path evaluated alone, beside another sequence's rows, and a kept path continuing exactly
/// as the path alone — all on the GPU and split with the host, dense and hybrid.
#[test]
fn tree_rows_are_bit_identical_to_their_paths_on_the_gpu() {
    let Some(device) = device_or_skip("tree_rows_are_bit_identical_to_their_paths_on_the_gpu")
    else {
        return;
    };
    for path in [
        fixture("tiny-llama.gguf"),
        stories(),
        fixture("tiny-qwen35-4l-mtp.gguf"),
        fixture("tiny-qwen3next-mtp.gguf"),
    ] {
        for options in [
            &[][..],
            &[("gpu_layers", "2")][..],
            &[("kv_type", "f32")][..],
        ] {
            let mut p = params(&path, 256, options);
            p.max_sequences = 4;
            let mut b = match &device {
                Device::Cuda => specula_cuda_hybrid::open(&p),
                Device::Emulated(e) => {
                    specula_cuda_hybrid::backend::open_emulated(&p, e.clone(), 1 << 34)
                }
            }
            .unwrap_or_else(|e| panic!("cuda-hybrid {options:?}: {e}"));
            assert!(b.executor().placement().uses_gpu(), "{options:?}");
            let name = format!("{} {options:?}", path.display());
            specula_plugin_api::testing::assert_tree_rows_match_their_paths(&mut b, 4, 9, &name);
        }
    }
}

/// Every case on a real GPU (or with `SPECULA_EMULATOR_FULL=1`); on the emulator by default a
/// smaller set — one model of each family, two placements — so the suite stays quick.
fn full(device: &Device) -> bool {
    matches!(device, Device::Cuda) || std::env::var_os("SPECULA_EMULATOR_FULL").is_some()
}

/// The models the model-level tests run.
/// (On the emulator by default: the two hybrid families, which between them use every
/// kernel; `with_dense` adds the dense llama.)
fn gpu_models_with(device: &Device, with_dense: bool) -> Vec<std::path::PathBuf> {
    if !full(device) {
        let mut models = vec![
            fixture("tiny-qwen35-4l-mtp.gguf"),
            fixture("tiny-qwen3next-mtp.gguf"),
        ];
        if with_dense {
            models.push(fixture("tiny-llama.gguf"));
            models.push(tiny_qwen2());
        }
        return models;
    }
    let mut models: Vec<_> = MODELS.iter().map(|m| fixture(m)).collect();
    models.push(tiny_qwen2());
    models.push(stories());
    models.push(trained_qwen35("q8_0"));
    models
}

fn gpu_models(device: &Device) -> Vec<std::path::PathBuf> {
    gpu_models_with(device, false)
}

/// Placements: automatic (everything on the GPU), split after the first layers (the last
/// layer on the GPU: on the hybrid fixtures an attention layer; the last two: a Gated DeltaNet
/// layer too, so both halves hold part of the ring), and all layers named explicitly. The
/// first split keeps its KV caches in f32 (`kv_type`), the others in the default f16.
fn placements(device: &Device) -> &'static [&'static [(&'static str, &'static str)]] {
    const ALL: [&[(&str, &str)]; 4] = [
        &[],
        &[("gpu_layers", "1"), ("kv_type", "f32")],
        &[("gpu_layers", "2")],
        &[("gpu_layers", "all")],
    ];
    if full(device) {
        &ALL
    } else {
        &ALL[..3]
    }
}

#[test]
fn verify_rows_are_bit_identical_to_single_token_evals() {
    let Some(device) = device_or_skip("verify_rows_are_bit_identical_to_single_token_evals") else {
        return;
    };
    for path in gpu_models(&device) {
        for options in placements(&device) {
            let name = format!("{} {options:?}", path.display());
            let mut batched = cuda(&device, &path, options);
            let mut single = cuda(&device, &path, options);
            assert!(batched.executor().placement().uses_gpu(), "{name}");
            let cap = batched.caps().max_verify_tokens as usize;
            let ks: Vec<usize> = if full(&device) {
                (1..=cap).collect()
            } else {
                vec![1, cap]
            };
            assert_verify_rows_match_single_evals(
                &mut batched,
                &mut single,
                &PROMPT,
                &ks,
                99,
                &name,
            );
        }
    }
}

/// Greedy decoding with speculation: every step verifies a draft of up to four tokens (the
/// plain continuation with every third token changed, so some drafts are accepted and some
/// rejected), keeps the accepted prefix plus the correction and rolls the rest back; the
/// output equals plain greedy decoding token for token, on every architecture.
#[test]
fn speculative_greedy_equals_plain_greedy() {
    let Some(device) = device_or_skip("speculative_greedy_equals_plain_greedy") else {
        return;
    };
    let n = 24;
    for path in gpu_models_with(&device, true) {
        let name = path.display().to_string();
        let plain = greedy(&mut cuda(&device, &path, &[]), &PROMPT, n);
        let mut b = cuda(&device, &path, &[]);
        let vocab = b.info().vocab_size;
        let mut out = vec![argmax(&eval(&mut b, &PROMPT, LogitRows::Last))];
        let (mut drafted, mut accepted) = (0, 0);
        while out.len() < n {
            let at = out.len();
            let draft: Vec<u32> = (at..(at + 4).min(n))
                .map(|i| match i % 3 {
                    2 => (plain[i] + 1) % vocab,
                    _ => plain[i],
                })
                .collect();
            let base = b.len();
            let mut rows = vec![*out.last().unwrap()];
            rows.extend(&draft);
            let logits = eval(&mut b, &rows, LogitRows::All);
            let mut kept = 0;
            for (i, &token) in draft.iter().enumerate() {
                let want = argmax(row(&logits, i, vocab as usize));
                out.push(want);
                if want != token {
                    break;
                }
                kept += 1;
            }
            if kept == draft.len() {
                out.push(argmax(row(&logits, kept, vocab as usize)));
            }
            drafted += draft.len();
            accepted += kept;
            truncate(&mut b, base + 1 + kept);
        }
        out.truncate(n);
        assert_eq!(out, plain, "{name}");
        assert!(
            accepted > 0 && accepted < drafted,
            "{name}: {accepted}/{drafted}"
        );
    }
}

/// Prompt, then `tokens`, then `after`, on a fresh backend: the logits of `after`.
fn clean_run(
    device: &Device,
    path: &std::path::Path,
    options: &[(&str, &str)],
    tokens: &[u32],
    after: &[u32],
) -> Vec<f32> {
    let mut b = cuda(device, path, options);
    eval(&mut b, &PROMPT, LogitRows::Last);
    if !tokens.is_empty() {
        eval(&mut b, tokens, LogitRows::All);
    }
    eval(&mut b, after, LogitRows::All)
}

#[test]
fn rollback_inside_the_window_equals_a_run_without_the_rejected_tokens() {
    let Some(device) =
        device_or_skip("rollback_inside_the_window_equals_a_run_without_the_rejected_tokens")
    else {
        return;
    };
    for path in gpu_models(&device) {
        for options in placements(&device) {
            let name = format!("{} {options:?}", path.display());
            let mut rng = Rng::new(4);
            let vocab = 512;
            let cases: &[(usize, usize)] = if full(&device) {
                &[(4, 0), (4, 2), (8, 7), (8, 8), (1, 0)]
            } else {
                &[(4, 2), (8, 8)]
            };
            for &(k, keep) in cases {
                let verify = rng.tokens(k, vocab);
                let after = rng.tokens(3, vocab);
                let mut b = cuda(&device, &path, options);
                eval(&mut b, &PROMPT, LogitRows::Last);
                eval(&mut b, &verify, LogitRows::All);
                truncate(&mut b, PROMPT.len() + keep);
                let got = eval(&mut b, &after, LogitRows::All);
                let want = clean_run(&device, &path, options, &verify[..keep], &after);
                assert_eq!(bits(&got), bits(&want), "{name}: k={k} keep={keep}");
                assert_eq!(b.slow_rollbacks(), 0, "{name}");
            }
        }
    }
}

#[test]
fn logits_are_close_to_cpu_simd_and_greedy_output_is_equal() {
    let Some(device) = device_or_skip("logits_are_close_to_cpu_simd_and_greedy_output_is_equal")
    else {
        return;
    };
    for path in gpu_models_with(&device, true) {
        gpu_logits_follow_cpu_simd(&device, &path, &[]);
    }
    // Trained models: the greedy continuations are the same.
    let (trained, n) = if full(&device) {
        (
            vec![stories(), trained_qwen35("f32"), trained_qwen35("q8_0")],
            48,
        )
    } else {
        (vec![trained_qwen35("q8_0")], 24)
    };
    for path in trained {
        let p = params(&path, 256, &[]);
        let want = greedy(&mut cpu_simd(&p), &[1], n);
        for options in placements(&device) {
            let got = greedy(&mut cuda(&device, &path, options), &[1], n);
            assert_eq!(got, want, "{} {options:?}", path.display());
        }
    }
}

/// The logits of `PROMPT` on cuda-hybrid (`options`) for `path`, checked to be within 2e-3 of
/// their scale of cpu-simd's with the same options.
fn gpu_logits_follow_cpu_simd(
    device: &Device,
    path: &std::path::Path,
    options: &[(&str, &str)],
) -> Vec<f32> {
    let a = eval(
        &mut cpu_simd(&params(path, 256, options)),
        &PROMPT,
        LogitRows::All,
    );
    let b = eval(&mut cuda(device, path, options), &PROMPT, LogitRows::All);
    let scale = a.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let d = max_diff(&a, &b);
    assert!(
        d <= 2e-3 * scale,
        "{} {options:?}: logits differ by {d} (scale {scale})",
        path.display()
    );
    b
}

/// Models in each quantised type (written here with rows of 256 values, so the projections,
/// FFNs and the tied LM head all take the type), through the whole device path: logits close
/// to cpu-simd's on the same file, and verify rows bit-identical to single-token evals.
///
/// Both backends quantise activations by the same rules and take exact integer dots (the
/// kernel test above holds them to f32 rounding), but the f32 sums around them run in
/// different orders, so now and then an activation lands on the other side of a rounding
/// boundary and one quant differs by a level; from there on, through the caches and the
/// recurrent state, the logits differ by up to ~1.4% of their scale here (Q5_K, from the
/// fourth position on; the other types agree to 8e-6). Multiplying f32 activations instead, as
/// the GPU did before, put them 12-27% apart — which the bound below rules out.
#[test]
fn quantised_models_follow_cpu_simd() {
    let Some(device) = device_or_skip("quantised_models_follow_cpu_simd") else {
        return;
    };
    use specula_host::genmodel::{preset, write_model, RandomWeights, SpmVocab, Vocab};
    let dir = tempfile::tempdir().unwrap();
    let vocab = Vocab::Spm(SpmVocab::synthetic(VOCAB));
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ] {
        let mut spec = preset("tiny-qwen35").unwrap();
        (spec.hidden, spec.ffn, spec.weight_type) = (256, 512, ty);
        let path = dir.path().join(format!("tiny-qwen35-{}.gguf", ty.name()));
        write_model(&spec, &vocab, &mut RandomWeights::new(3), &path).unwrap();

        let mut cpu = cpu_simd(&params(&path, 64, &[]));
        let mut gpu = cuda(&device, &path, &[]);
        let mut single = cuda(&device, &path, &[]);
        let a = eval(&mut cpu, &PROMPT, LogitRows::All);
        let b = eval(&mut gpu, &PROMPT, LogitRows::All);
        let scale = a.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let d = max_diff(&a, &b);
        eprintln!("{ty:?}: GPU and cpu-simd logits differ by {d} (scale {scale})");
        assert!(
            d <= 0.05 * scale,
            "{ty:?}: logits differ by {d} (scale {scale})"
        );
        for (i, &t) in PROMPT.iter().enumerate() {
            let r = eval(&mut single, &[t], LogitRows::Last);
            assert_eq!(bits(row(&b, i, VOCAB)), bits(&r), "{ty:?}: row {i}");
        }
    }
}

/// A Q8_0 KV cache on the device (`kv_type = "q8_0"`): on a dense qwen3 and a hybrid qwen35
/// with an MTP head (heads of 32 values), written here, logits close to cpu-simd's over its
/// own Q8_0 cache (the same quantiser; on AVX-512 the same integer scores), verify rows bit-identical to
/// single-token evals, and every row of a batch of sequences — forks, truncations, prefill
/// chunks beside verify rows — bit-identical to its sequence alone; all on the GPU and split
/// with the host.
#[test]
fn a_q8_0_cache_follows_cpu_simd_and_keeps_rows_bit_identical() {
    let Some(device) = device_or_skip("a_q8_0_cache_follows_cpu_simd_and_keeps_rows_bit_identical")
    else {
        return;
    };
    use specula_host::genmodel::{preset, write_model, RandomWeights, SpmVocab, Vocab};
    let dir = tempfile::tempdir().unwrap();
    let vocab = Vocab::Spm(SpmVocab::synthetic(VOCAB));
    let q8: &[(&str, &str)] = &[("kv_type", "q8_0")];
    for name in ["tiny-qwen3", "tiny-qwen35"] {
        let mut spec = preset(name).unwrap();
        spec.head_dim = 32;
        let path = dir.path().join(format!("{name}-heads32.gguf"));
        write_model(&spec, &vocab, &mut RandomWeights::new(5), &path).unwrap();

        let b = gpu_logits_follow_cpu_simd(&device, &path, q8);
        let mut single = cuda(&device, &path, q8);
        for (i, &t) in PROMPT.iter().enumerate() {
            let r = eval(&mut single, &[t], LogitRows::Last);
            assert_eq!(bits(row(&b, i, VOCAB)), bits(&r), "{name}: row {i}");
        }
        for split in [&[][..], &[("gpu_layers", "1")][..]] {
            let options: Vec<(&str, &str)> = q8.iter().chain(split).copied().collect();
            assert_batched_rows_match_alone(&device, &path, &options);
        }
    }
}

#[test]
fn mtp_rows_are_exact_and_mtp_drafting_equals_plain_decoding() {
    let Some(device) = device_or_skip("mtp_rows_are_exact_and_mtp_drafting_equals_plain_decoding")
    else {
        return;
    };
    let models = if full(&device) {
        vec![
            fixture("tiny-qwen35-mtp.gguf"),
            fixture("tiny-qwen3next-mtp.gguf"),
            trained_qwen35("f32"),
            trained_qwen35("q8_0"),
        ]
    } else {
        vec![fixture("tiny-qwen3next-mtp.gguf"), trained_qwen35("q8_0")]
    };
    for path in models {
        let name = path.display().to_string();
        let mut b = cuda(&device, &path, &[]);
        let e = b.info().hidden_size as usize;
        let vocab = b.info().vocab_size as usize;
        assert!(b.caps().mtp_head, "{name}");
        eval(&mut b, &PROMPT, LogitRows::All);
        let h = hidden(&b);
        let mut next = PROMPT[1..].to_vec();
        next.push(300);
        // Batched rows equal one-row calls.
        let (batch_logits, batch_hidden) = mtp(&mut b, &h, &next, 0);
        for i in 0..PROMPT.len() {
            let (l, o) = mtp(&mut b, row(&h, i, e), &next[i..i + 1], i);
            assert_eq!(
                bits(&l),
                bits(row(&batch_logits, i, vocab)),
                "{name}: MTP row {i}"
            );
            assert_eq!(
                bits(&o),
                bits(row(&batch_hidden, i, e)),
                "{name}: MTP hidden {i}"
            );
        }
        // Close to cpu-simd's head.
        let mut cpu = cpu_simd(&params(&path, 256, &[]));
        eval(&mut cpu, &PROMPT, LogitRows::All);
        let cpu_hidden = hidden(&cpu);
        let (cpu_logits, _) = mtp(&mut cpu, &cpu_hidden, &next, 0);
        let scale = cpu_logits.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let d = max_diff(&cpu_logits, &batch_logits);
        assert!(
            d <= 5e-3 * scale,
            "{name}: MTP logits differ from cpu-simd by {d}"
        );
    }
    // A greedy speculative loop drafting 3 tokens with the chained MTP head emits exactly
    // plain greedy decoding.
    let loop_placements = if full(&device) {
        placements(&device)
    } else {
        &placements(&device)[1..]
    };
    for options in loop_placements {
        let path = trained_qwen35("f32");
        let n_tokens = if full(&device) { 60 } else { 16 };
        let plain = greedy(&mut cuda(&device, &path, options), &[1], n_tokens);
        let mut b = cuda(&device, &path, options);
        let e = b.info().hidden_size as usize;
        let logits = eval(&mut b, &[1], LogitRows::All);
        let mut out = vec![argmax(&logits)];
        let mut h = hidden(&b);
        let mut len = 1; // tokens evaluated; out.last() is the certain next token
        let mut fed = 0; // MTP cache entries
        while out.len() < n_tokens {
            // Feed the head the accepted positions fed .. len - 1 (hidden rows of the last eval).
            let t0 = *out.last().unwrap();
            let rows = len - fed;
            let tokens: Vec<u32> = out[out.len() - rows..].to_vec();
            let (l, hs) = mtp(&mut b, &h[h.len() - rows * e..], &tokens, fed);
            fed = len;
            let mut drafts = vec![argmax(row(&l, rows - 1, 512))];
            let mut dh = row(&hs, rows - 1, e).to_vec();
            while drafts.len() < 3 {
                let position = len + drafts.len() - 1;
                let (l, o) = mtp(&mut b, &dh, &drafts[drafts.len() - 1..], position);
                drafts.push(argmax(&l));
                dh = o;
            }
            let mut batch = vec![t0];
            batch.extend_from_slice(&drafts);
            let verify = eval(&mut b, &batch, LogitRows::All);
            let all_hidden = hidden(&b);
            let mut accepted = 0;
            while accepted < drafts.len() && argmax(row(&verify, accepted, 512)) == drafts[accepted]
            {
                accepted += 1;
            }
            out.extend_from_slice(&drafts[..accepted]);
            out.push(argmax(row(&verify, accepted, 512)));
            len += 1 + accepted;
            truncate(&mut b, len);
            fed = fed.min(len);
            h = all_hidden[..(1 + accepted) * e].to_vec();
        }
        out.truncate(n_tokens);
        assert_eq!(out, plain, "{options:?}");
    }
}

#[test]
fn deep_rollback_re_decodes_or_is_refused_on_the_gpu() {
    let Some(device) = device_or_skip("deep_rollback_re_decodes_or_is_refused_on_the_gpu") else {
        return;
    };
    let path = fixture("tiny-qwen35-4l-mtp.gguf");
    let tokens = Rng::new(8).tokens(30, 512);
    for options in placements(&device) {
        let mut b = cuda(&device, &path, options);
        eval(&mut b, &tokens, LogitRows::Last);
        truncate(&mut b, 10);
        assert_eq!(b.slow_rollbacks(), 1);
        let got = eval(&mut b, &[7, 8], LogitRows::All);
        let mut clean = cuda(&device, &path, options);
        eval(&mut clean, &tokens[..10], LogitRows::Last);
        assert_eq!(bits(&got), bits(&eval(&mut clean, &[7, 8], LogitRows::All)));
    }
    let mut refusing = cuda(&device, &path, &[("deep_rollback", "refuse")]);
    eval(&mut refusing, &tokens, LogitRows::Last);
    let err = refusing.truncate_to(10).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
}

#[test]
fn placement_follows_the_options() {
    let Some(device) = device_or_skip("placement_follows_the_options") else {
        return;
    };
    let path = fixture("tiny-qwen35-4l-mtp.gguf");
    let all = cuda(&device, &path, &[]);
    assert_eq!(all.executor().placement().gpu_layers(), 4);
    assert!(all.executor().placement().head_on_gpu);
    let two = cuda(&device, &path, &[("gpu_layers", "2")]);
    assert_eq!(two.executor().placement().first_gpu_layer, 2);
    let none = cuda(&device, &path, &[("gpu_layers", "0")]);
    assert!(!none.executor().placement().uses_gpu());
    let err = open_backend(
        &device,
        &path,
        &[("gpu_layers", "all"), ("vram_budget", "1KiB")],
    )
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    assert!(err.message.contains("gpu_layers"), "{}", err.message);
    let tiny = cuda(&device, &path, &[("vram_budget", "1KiB")]);
    assert!(!tiny.executor().placement().uses_gpu());
    if matches!(device, Device::Cuda) {
        let err = specula_cuda_hybrid::open(&params(&path, 256, &[("device", "99")])).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
    }
}

/// The Gated DeltaNet recurrence and its gated norm against the CPU's scalar delta-rule step,
/// at the fixtures' state size (16) and the real models' (128): each token's output and the
/// state it leaves in its ring plane.
#[test]
fn gated_delta_net_recurrence_follows_the_cpu_step() {
    let Some(device) = device_or_skip("gated_delta_net_recurrence_follows_the_cpu_step") else {
        return;
    };
    let gpu = open_device(&device);
    for s in [16, 128] {
        let mut rng = Rng::new(s as u64);
        let (n_k, n_v, rows, n_planes, conv_len) = (2, 4, 3, 4, 8);
        let (key_dim, value_dim) = (n_k * s, n_v * s);
        let channels = 2 * key_dim + value_dim;
        let mut conv_out: Vec<f32> = (0..rows * channels).map(|_| rng.unit()).collect();
        // The kernel takes q and k L2-normalised (gdn_qk_l2norm runs before it).
        for t in 0..rows {
            for head in conv_out[t * channels..t * channels + 2 * key_dim].chunks_mut(s) {
                let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
                head.iter_mut().for_each(|x| *x /= norm);
            }
        }
        let beta: Vec<f32> = (0..rows * n_v).map(|_| 2.0 * rng.unit()).collect();
        let alpha: Vec<f32> = (0..rows * n_v).map(|_| 2.0 * rng.unit()).collect();
        let dt_bias: Vec<f32> = (0..n_v).map(|_| rng.unit()).collect();
        let ssm_a: Vec<f32> = (0..n_v).map(|_| -1.0 - rng.unit().abs()).collect();
        let norm: Vec<f32> = (0..s).map(|_| 1.0 + 0.1 * rng.unit()).collect();
        let z: Vec<f32> = (0..rows * value_dim).map(|_| rng.unit()).collect();
        let plane_len = conv_len + n_v * s * s;
        let start: Vec<f32> = (0..plane_len).map(|_| 0.1 * rng.unit()).collect();
        let mut planes = vec![0.0f32; n_planes * plane_len];
        planes[..plane_len].copy_from_slice(&start);

        let up = |v: &[f32]| gpu.upload(v).unwrap();
        let (d_conv, d_beta, d_alpha) = (up(&conv_out), up(&beta), up(&alpha));
        let (d_dt, d_a, d_norm, d_z) = (up(&dt_bias), up(&ssm_a), up(&norm), up(&z));
        let d_planes = up(&planes);
        let out = gpu.zeros::<f32>(rows * value_dim).unwrap();
        let inputs = ops::GdnInputs {
            conv_out: d_conv.ptr(),
            beta: d_beta.ptr(),
            alpha: d_alpha.ptr(),
            grouped: false,
            dt_bias: d_dt.ptr(),
            ssm_a: d_a.ptr(),
        };
        let dims = ops::GdnDims {
            channels,
            head_dim: s,
            n_k_heads: n_k,
            n_v_heads: n_v,
            head_map: 0,
            eps: 1e-6,
        };
        let ring = ops::RingSlot {
            planes: d_planes.ptr(),
            plane_len,
            n_planes,
            layer_offset: 0,
            conv_len,
        };
        let run = ops::GdnRun {
            planes: d_planes.ptr(),
            first: 0,
            rows,
            start: 0,
            write: None,
        };
        let table = gpu.upload(&run.words()).unwrap();
        let runs = ops::GdnRuns {
            table: table.ptr(),
            count: 1,
            max_rows: rows,
        };
        ops::gdn_recurrence(&gpu, &inputs, &dims, &ring, &runs, out.ptr()).unwrap();
        ops::gdn_gated_norm(&gpu, &dims, out.ptr(), d_z.ptr(), d_norm.ptr(), rows).unwrap();
        let got = download(&gpu, &out);
        let got_planes = download(&gpu, &d_planes);

        let mut state = start[conv_len..].to_vec();
        for t in 0..rows {
            let row = &conv_out[t * channels..(t + 1) * channels];
            let mut next = vec![0.0f32; state.len()];
            for h in 0..n_v {
                let kh = h % n_k;
                let softplus = |x: f32| if x > 20.0 { x } else { x.exp().ln_1p() };
                let g = softplus(alpha[t * n_v + h] + dt_bias[h]) * ssm_a[h];
                let x = specula_kernels::delta_rule::DeltaInputs {
                    q: &row[kh * s..(kh + 1) * s],
                    k: &row[key_dim + kh * s..key_dim + (kh + 1) * s],
                    v: &row[2 * key_dim + h * s..2 * key_dim + (h + 1) * s],
                    decay: g.exp(),
                    beta: 1.0 / (1.0 + (-beta[t * n_v + h]).exp()),
                };
                let mut o = vec![0.0f32; s];
                let head = h * s * s..(h + 1) * s * s;
                specula_kernels::delta_rule::step_scalar(
                    x,
                    &state[head.clone()],
                    &mut next[head],
                    &mut o,
                );
                let mean = (o.iter().map(|&v| f64::from(v * v)).sum::<f64>() / s as f64) as f32;
                let scale = 1.0 / (mean + 1e-6).sqrt();
                for j in 0..s {
                    let gate = z[t * value_dim + h * s + j];
                    let want = o[j] * scale * norm[j] * (gate / (1.0 + (-gate).exp()));
                    let have = got[t * value_dim + h * s + j];
                    assert!(
                        (want - have).abs() < 1e-4 * (1.0 + want.abs()),
                        "S = {s}, token {t}, head {h}, value {j}: GPU {have}, CPU {want}"
                    );
                }
            }
            let plane = (t + 1) % n_planes * plane_len + conv_len;
            let d = max_diff(&next, &got_planes[plane..plane + next.len()]);
            assert!(
                d < 1e-5,
                "S = {s}, token {t}: the state plane is off by {d}"
            );
            state = next;
        }
    }
}

/// A pass is left unrecorded for its longest sequence's rows, not its total: a batch of two
/// sequences of 20 rows each (40 in all) is recorded, one sequence's 40-row chunk is not.
#[test]
fn graphs_skip_a_long_chunk_but_not_a_batch_of_short_ones() {
    use specula_plugin_api::{EvalChunk, ForwardPass};
    let Some(device) = device_or_skip("graphs_skip_a_long_chunk_but_not_a_batch_of_short_ones")
    else {
        return;
    };
    let path = fixture("tiny-llama.gguf");
    let mut b = open_backend_with(&device, &path, &[("cuda_graphs", "true")], 2)
        .unwrap_or_else(|e| panic!("cuda-hybrid on {}: {e}", path.display()));
    let (one, two) = (
        specula_plugin_api::testing::new_seq(&mut b),
        specula_plugin_api::testing::new_seq(&mut b),
    );
    let short = (replay::MAX_ROWS / 2 + 4) as u32;
    let tokens: Vec<u32> = (0..2 * short).map(|i| 3 + i % 150).collect();
    let mut logits = abi_stable::std_types::RVec::new();
    let pass = |b: &mut CudaBackend, chunks: &[EvalChunk<'_>], logits: &mut _| {
        let before = b.executor().replay_stats().expect("graphs on");
        b.eval_batch(abi_stable::std_types::RSlice::from_slice(chunks), logits)
            .into_result()
            .unwrap_or_else(|e| panic!("eval_batch: {e}"));
        let after = b.executor().replay_stats().expect("graphs on");
        (
            after.passes - before.passes,
            after.unrecorded - before.unrecorded,
        )
    };
    let halves = [
        EvalChunk::chain(one, &tokens[..short as usize], LogitRows::Last),
        EvalChunk::chain(two, &tokens[short as usize..], LogitRows::Last),
    ];
    assert_eq!(
        pass(&mut b, &halves, &mut logits),
        (1, 0),
        "two sequences of {short} rows"
    );
    let long = [EvalChunk::chain(one, &tokens, LogitRows::Last)];
    assert_eq!(
        pass(&mut b, &long, &mut logits),
        (0, 1),
        "one sequence of {} rows",
        2 * short
    );
}

/// With `cuda_graphs = true` every pass is recorded and issued at its end — first as
/// recorded, a second time captured as a graph, then replayed from the graph (on the
/// emulator, the recorded work kept is issued again) — and every logit and hidden row equals
/// the backend's without graphs bit for bit, through plain steps (the ring's planes cycling,
/// the block table growing), verify passes of several sizes, rollbacks and MTP calls, on
/// the GPU alone and split with the host; and the graphs were replayed. A chunk of more than
/// `replay::MAX_ROWS` rows is not recorded, and equals it too.
#[test]
fn cuda_graphs_replay_passes_bit_for_bit() {
    let Some(device) = device_or_skip("cuda_graphs_replay_passes_bit_for_bit") else {
        return;
    };
    let models = [
        fixture("tiny-qwen3next-mtp.gguf"),
        fixture("tiny-llama.gguf"),
    ];
    for path in models {
        for placement in [&[][..], &[("gpu_layers", "2")][..]] {
            let name = format!("{} {placement:?}", path.display());
            let open = |graphs: &'static str| {
                let options: Vec<(&str, &str)> = placement
                    .iter()
                    .copied()
                    .chain([("cuda_graphs", graphs)])
                    .collect();
                cuda(&device, &path, &options)
            };
            let (mut graphs, mut plain) = (open("true"), open("false"));
            assert!(graphs.executor().placement().uses_gpu(), "{name}");
            assert_eq!(plain.executor().replay_stats(), None, "{name}");
            let info = graphs.info();
            let (vocab, mtp_head) = (info.vocab_size as usize, graphs.caps().mtp_head);
            let both = |graphs: &mut Solo<CudaBackend>,
                        plain: &mut Solo<CudaBackend>,
                        tokens: &[u32],
                        what: &str| {
                let (a, b) = (
                    eval(graphs, tokens, LogitRows::All),
                    eval(plain, tokens, LogitRows::All),
                );
                assert_eq!(bits(&a), bits(&b), "{name}: logits of {what}");
                assert_eq!(
                    bits(&hidden(graphs)),
                    bits(&hidden(plain)),
                    "{name}: hidden rows of {what}"
                );
                a
            };
            let e = info.hidden_size as usize;
            // The MTP head after the row at `position` (hidden `h`, the token after it `t`),
            // on both; its positions follow the trunk's without a gap.
            let head = |graphs: &mut Solo<CudaBackend>,
                        plain: &mut Solo<CudaBackend>,
                        h: &[f32],
                        tokens: &[u32],
                        position: usize| {
                if !mtp_head {
                    return;
                }
                let (a, ha) = mtp(graphs, h, tokens, position);
                let (b, hb) = mtp(plain, h, tokens, position);
                assert_eq!(bits(&a), bits(&b), "{name}: MTP logits at {position}");
                assert_eq!(bits(&ha), bits(&hb), "{name}: MTP hidden at {position}");
            };
            let logits = both(&mut graphs, &mut plain, &PROMPT, "the prompt");
            let mut next = argmax(row(&logits, PROMPT.len() - 1, vocab));
            let mut after: Vec<u32> = PROMPT[1..].to_vec();
            after.push(next);
            let h = hidden(&graphs);
            head(&mut graphs, &mut plain, &h, &after, 0);
            let mut len = PROMPT.len();
            for step in 0..60 {
                if step % 5 == 4 {
                    // A verify pass of 2-4 rows whose first draft is kept: the rest rolled
                    // back, the next token the first row's.
                    let k = 2 + step / 5 % 3;
                    let draft: Vec<u32> = (0..k as u32).map(|i| (next + 7 * i) % 200).collect();
                    let rows = both(&mut graphs, &mut plain, &draft, &format!("a {k}-row pass"));
                    let h = hidden(&graphs);
                    truncate(&mut graphs, len + 1);
                    truncate(&mut plain, len + 1);
                    next = argmax(row(&rows, 0, vocab));
                    head(&mut graphs, &mut plain, row(&h, 0, e), &[next], len);
                    len += 1;
                }
                let logits = both(&mut graphs, &mut plain, &[next], &format!("step {step}"));
                next = argmax(&logits);
                let h = hidden(&graphs);
                head(&mut graphs, &mut plain, &h, &[next], len);
                len += 1;
            }
            // A chunk of more rows than a recorded pass may have is issued as it comes.
            let chunk: Vec<u32> = (0..replay::MAX_ROWS as u32 + 8)
                .map(|i| 3 + i % 150)
                .collect();
            both(&mut graphs, &mut plain, &chunk, "a long chunk");
            let stats = graphs
                .executor()
                .replay_stats()
                .unwrap_or_else(|| panic!("{name}: no graphs with cuda_graphs = true"));
            assert_eq!(stats.unrecorded, 1, "{name}: {stats:?}");
            assert!(
                stats.replayed >= 10 && stats.captured >= 2 && stats.issued >= 2,
                "{name}: {stats:?}"
            );
            assert_eq!(stats.capture_failed, 0, "{name}: {stats:?}");
            assert_eq!(
                stats.passes,
                stats.replayed + stats.captured + stats.issued,
                "{name}: {stats:?}"
            );
        }
    }
}
