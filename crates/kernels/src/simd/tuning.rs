//! What the kernels choose per CPU family: where and how far ahead the interleaved ones prefetch
//! a weight matrix they stream from memory ([`StreamPrefetch`]), how a multi-row Q4_K pass
//! scales its sub-block sums, and how far ahead the delta rule's chains prefetch the recurrent
//! state. The same bits either way; only the speed differs.
//!
//! A pass over an interleaved matrix reads it once, front to back, and computes long enough per
//! block that the hardware prefetchers fall behind the stream; so the kernels prefetch a fixed
//! distance ahead of the block they multiply. The first plan ([`StreamPrefetch::INTO_L1`]) was
//! measured on a Zen 4 EPYC in the project's first sessions, and every Xeon figure since was
//! taken with it; measured again on Zen 4, prefetching into L2 and nearer
//! ([`StreamPrefetch::INTO_L2`]) streams far better there (an L1 prefetch holds one of the
//! core's few L1 miss buffers until DRAM answers). AMD CPUs take the second plan and Zen 4's
//! choice of scaling instruction; the rest keep the first choices until they are measured on a
//! Xeon.

use std::sync::OnceLock;

/// Where and how far ahead the interleaved kernels prefetch a weight stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamPrefetch {
    /// Into L2 (`prefetcht1`) rather than L1 (`prefetcht0`).
    pub(crate) into_l2: bool,
    /// Bytes ahead of the block being multiplied, for the Q8_0 / Q4_0 kernels' passes of
    /// several rows (Q8_0 ones from [`q8_0_min_rows`](Self::q8_0_min_rows); a single row
    /// streams as fast without, see below). The AVX2 kernels prefetch every stream, a single
    /// row too (they compute more per byte; measured in `interleaved/avx2.rs`).
    pub(crate) block32_ahead: usize,
    /// The fewest activation rows whose AVX-512 Q8_0 passes prefetch at all: fewer rows compute
    /// so little per byte that the hardware prefetchers keep up with the stream. (Q4_0 passes,
    /// with a nibble decode per byte and not measured apart, prefetch from 2 rows.)
    pub(crate) q8_0_min_rows: usize,
    /// Bytes ahead for the K-quant kernels (Q4_K, Q5_K, Q6_K; every pass prefetches), each
    /// block's prefetches spread over its sub-blocks.
    pub(crate) k_quant_ahead: usize,
}

impl StreamPrefetch {
    /// Into L1: Q8_0 / Q4_0 12 KiB ahead (4096² Q8_0 from DRAM, 1 thread, 8 rows: 9.2 GB/s
    /// without, 22.8 / 33.1 GB/s 4 / 13 KiB ahead), a single row not at all (it streamed faster
    /// without); K-quants 16 KiB ahead (a 0.6B Q4_K model's 8-row forward pass 14.85 / 13.78 /
    /// 13.47 / 13.52 ms 8 / 12 / 16 / 24 KiB ahead).
    const INTO_L1: StreamPrefetch = StreamPrefetch {
        into_l2: false,
        block32_ahead: 12 << 10,
        q8_0_min_rows: 2,
        k_quant_ahead: 16 << 10,
    };

    /// Into L2, 8 KiB ahead. Measured on a Zen 4 EPYC (2 threads, 3072 × 1024 from DRAM, the
    /// plans taking turns in one process): Q4_K passes of 1 / 4 / 8 rows 6–28% / 22–30% /
    /// 8–18% cheaper than with [`INTO_L1`](Self::INTO_L1) (four runs), Q6_K 12–15% / 20–25% /
    /// 7–9% and Q8_0 passes of 4 / 8 rows 33–34% / 32–37% (two runs each); 6–10 KiB ahead
    /// alike, 2–4 KiB, 16 KiB or more and `prefetchnta` worse. In the models' passes (both
    /// plugins in one process, both orders), 8 rows: qwen3-0.6b Q8_0 12–22% cheaper, Q4_K_M
    /// 8–19%, Q6_K 20–23%, qwen35-0.8b Q8_0 17–23%; 4 rows: Q4_K 10–16%, Q4_K_M 10–18%, Q6_K
    /// 17–20%. Single Q8_0 rows prefetching too were 12% cheaper in the kernel alone but 3–6%
    /// dearer in qwen3-0.6b Q8_0's one-token pass, so they still do not; nor do passes of 2–4
    /// rows (the models' passes in one process, both orders, each plugin's pass against its
    /// own one-row pass: qwen3-0.6b Q8_0 cost(2) 1.13–1.22 → 1.03–1.07, cost(3) 1.19–1.24 →
    /// 1.14–1.15, cost(4) 1.125 → 1.06–1.07; qwen35-0.8b Q8_0 cost(2) 1.14–1.29 → 1.06,
    /// cost(3) 1.13–1.25 → 1.04–1.18, cost(4) 1.16–1.17 → 1.10; at 5 rows alike, at 8 rows
    /// 13–15% cheaper with).
    const INTO_L2: StreamPrefetch = StreamPrefetch {
        into_l2: true,
        block32_ahead: 8 << 10,
        q8_0_min_rows: 5,
        k_quant_ahead: 8 << 10,
    };
}

/// The kernels' choices for one CPU family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tuning {
    pub(crate) prefetch: StreamPrefetch,
    /// Whether a Q4_K pass of several rows scales a sub-block's two chains of sums by
    /// `vpaddd`, `vpmulld`, `vpaddd` (as single rows and Q5_K always do) rather than by two
    /// `vpdpwssd`. `vpmulld` issues at half `vpdpwssd`'s rate on an Emerald Rapids Xeon, which
    /// chose the pair there; on Zen 4 (both plugins in one process, both orders, qwen3-0.6b
    /// Q4_K) `vpmulld` made 8- and 16-row passes 5–7% / 6% cheaper, the hybrid's Q4_K 2–6%
    /// at 8 rows. (Packing the two chains' low words into one register for a single
    /// `vpdpwssd` measured as `vpmulld` there, within 3%.)
    pub(crate) q4k_scales_by_vpmulld: bool,
    /// How many state rows ahead of the ones it runs a delta-rule chain
    /// ([`crate::delta_rule::chain`]) prefetches the state it reads, into L1 (0: not at all).
    /// A chain carries a pair of state rows through all its steps at a time, long enough that
    /// the hardware prefetchers let the next rows' loads miss. On Zen 4 (2 threads, 1,024
    /// heads of 128 × 128 from DRAM, two runs each), 4 rows ahead made chains of 1 / 4 / 8
    /// steps 30–31% / 47–49% / 1–46% cheaper; 2–3 rows ahead alike, into L2 less. In
    /// qwen35-0.8b's passes (both plugins in one process, both orders; Q8_0 three pairs, Q4_K
    /// one): 4-row passes 1–7% cheaper in every run, 8-row 0.3–8%, one-row 2–7% on each
    /// pair's mean (the position in the pair alone swung them ±5%).
    pub(crate) state_rows_ahead: usize,
}

impl Tuning {
    /// AMD CPUs (measured on Zen 4).
    const AMD: Tuning = Tuning {
        prefetch: StreamPrefetch::INTO_L2,
        q4k_scales_by_vpmulld: true,
        state_rows_ahead: 4,
    };

    /// Every other CPU (the choices measured first, and on the Xeons).
    const OTHER: Tuning = Tuning {
        prefetch: StreamPrefetch::INTO_L1,
        q4k_scales_by_vpmulld: false,
        state_rows_ahead: 0,
    };
}

/// The choices for this CPU: [`Tuning::AMD`] on an AMD CPU, [`Tuning::OTHER`] on any other.
/// Decided once per process.
pub(crate) fn tuning() -> Tuning {
    #[cfg(test)]
    match tests::FORCED.load(std::sync::atomic::Ordering::SeqCst) {
        1 => return Tuning::AMD,
        2 => return Tuning::OTHER,
        _ => {}
    }
    static TUNING: OnceLock<Tuning> = OnceLock::new();
    *TUNING.get_or_init(|| match amd_cpu() {
        true => Tuning::AMD,
        false => Tuning::OTHER,
    })
}

/// Whether CPUID's vendor string is AMD's.
pub(crate) fn amd_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf = std::arch::x86_64::__cpuid_count(0, 0);
        let vendor: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
pub(crate) mod tests {
    use super::Tuning;
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::{Mutex, PoisonError};

    /// The tuning [`super::tuning`] answers while a test holds it: 0 none (the CPU's), 1
    /// [`Tuning::AMD`], 2 [`Tuning::OTHER`]. Tests running meanwhile may see it too, which is
    /// harmless: every tuning gives the same bits.
    pub(super) static FORCED: AtomicU8 = AtomicU8::new(0);

    /// Runs `check` under each family's tuning in turn, whatever this CPU is, so that a test
    /// covers the kernels' variants of every family.
    pub(crate) fn for_each_tuning(mut check: impl FnMut(Tuning)) {
        static SERIAL: Mutex<()> = Mutex::new(());
        let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        for (code, tuning) in [(1, Tuning::AMD), (2, Tuning::OTHER)] {
            FORCED.store(code, Ordering::SeqCst);
            check(tuning);
        }
        FORCED.store(0, Ordering::SeqCst);
    }
}
