#!/usr/bin/env bash
# cuda-hybrid's GPU checks, on a machine with an NVIDIA GPU, from the kit pack.sh made (no
# Rust toolchain or network needed there). From the repository root:
#
#   plugins/cuda-hybrid/gpu-check/run.sh tests   # the GPU tests: kernels against references,
#                                                # verify rows == single-token evals, rollback
#                                                # oracle, greedy == cpu-simd, MTP == plain
#   plugins/cuda-hybrid/gpu-check/run.sh kernels # the mat-vec / mat-mul kernels alone: time
#                                                # and weight GB/s per type, shape, k = 1, 2, 4, 8
#   plugins/cuda-hybrid/gpu-check/run.sh bench   # specula bench: Qwen3.5-2B-shaped Q4_K on the
#                                                # GPU and half on the CPU, Qwen3-0.6B-shaped
#                                                # Q8_0 (and many sequences), the trained qwen35;
#                                                # the GPU-only ones again with cuda_graphs = false,
#                                                # each right after its run with graphs
#   plugins/cuda-hybrid/gpu-check/run.sh profile # ncu: each kernel's time over a few decode
#                                                # steps of the 2B and 0.6B models, by grid,
#                                                # and over the 2B's passes of 1-8 rows; the
#                                                # 1- and 4-row Q4_K kernels in detail
#   plugins/cuda-hybrid/gpu-check/run.sh all     # tests, kernels, bench (the default)
#
# Several at once: `run.sh tests bench`. With a kit packed by `OLD_PLUGIN=... pack.sh`, every
# bench runs that older cuda-hybrid library too, right after the new one, on the same machine.
#
# Logs go to $OUT (the device tool's output folder, as one logs.tgz plus the summary) or
# ./gpu-check-out/. Every step has a time limit. The exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../../.."
kit="$PWD/.gpu-kit"
bin="$kit/target/release/specula"
deps="$kit/target/release/deps"
old_plugin="$kit/old/libspecula_cuda_hybrid.so"
if [ -n "${OUT:-}" ]; then
    # The device tool brings back only a few files: everything goes into one archive, packed
    # again after every step (so a run stopped at the tool's time limit still returns its logs).
    out=$(mktemp -d /tmp/gpu-check.XXXX)
    archive() { tar czf "$OUT/logs.tgz" -C "$out" . 2>/dev/null; }
    trap archive EXIT INT TERM
else
    out="$PWD/gpu-check-out"
    mkdir -p "$out"
    archive() { :; }
fi
what="${*:-all}"
wants() { [[ " $what " == *" $1 "* ]] || [[ " $what " == *" all "* && $1 != profile ]]; }
if [ ! -x "$bin" ]; then
    echo "run.sh: no kit at $kit: run plugins/cuda-hybrid/gpu-check/pack.sh first" >&2
    exit 100
fi

# The tests read the kit's models, fail rather than skip or fall back to the emulator when
# the GPU cannot be used, and share one PTX cache.
export SPECULA_SHARED="$kit/shared"
# The end-to-end tests run the kit's binary (their compiled-in path is the build machine's).
export SPECULA_BIN="$bin"
export SPECULA_HOME="${SPECULA_HOME:-/tmp/specula-home}"
# NVRTC: the loader's path first (cudarc looks there), else the CUDA toolkit's or a Python
# wheel's copy, CUDA 13's or 12's.
if [ -z "${SPECULA_NVRTC_PATH:-}" ]; then
    for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import os, nvidia
print(" ".join(os.path.join(p, s) for p in nvidia.__path__ for s in ("cu13/lib", "cuda_nvrtc/lib")))' 2>/dev/null); do
        if ls "$dir"/libnvrtc.so.1[23] >/dev/null 2>&1; then
            export SPECULA_NVRTC_PATH="$dir"
            break
        fi
    done
fi

failed=0
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output in NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local started=$SECONDS
    if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
        echo "   ok in $((SECONDS - started)) s"
    else
        echo "   FAILED (status $?) in $((SECONDS - started)) s; the log's end:"
        tail -n 40 "$out/$name.log"
        failed=$((failed + 1))
    fi
    grep -E "^test result|SKIPPED|^NVRTC" "$out/$name.log" | sed 's/^/   /'
    archive
}

{
    echo "kit: $(head -1 "$kit/REVISION")$(grep -q changed "$kit/REVISION" && echo ' (with uncommitted changes)')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader
    echo "NVRTC: ${SPECULA_NVRTC_PATH:-the library search path}"
    echo "CPU threads: $(nproc)"
} | tee "$out/machine.txt"

# The benchmark models are written in the background while the tests run.
q2b=/tmp/qwen35-2b-q4_k.gguf
q06=/tmp/qwen3-0.6b-q8_0.gguf
gen_pid=
if wants bench || wants profile; then
    (
        [ -f "$q2b" ] || timeout 300 "$bin" gen-model --preset qwen35-2b --out "$q2b" &&
            { [ -f "$q06" ] || timeout 120 "$bin" gen-model --preset qwen3-0.6b --type q8_0 --out "$q06"; }
    ) >"$out/gen-model.log" 2>&1 &
    gen_pid=$!
fi

if wants tests; then
    export SPECULA_REQUIRE_GPU=1
    step ptx 120 env CI=true "$deps/ptx" --nocapture  # CI set: NVRTC must load
    step gpu 300 "$deps/gpu" --test-threads=1 --nocapture
    step cuda 120 "$deps/cuda" --test-threads=1 --nocapture
    unset SPECULA_REQUIRE_GPU
fi

if wants kernels; then
    # Criterion keeps its history out of $OUT. KERNELS_FILTER (e.g. q4_K) picks benchmarks.
    # SPECULA_REQUIRE_GPU: without a GPU the benchmark fails instead of skipping.
    step kernels 240 env CRITERION_HOME=/tmp/specula-criterion SPECULA_REQUIRE_GPU=1 \
        "$deps/kernel-bench" --bench \
        --warm-up-time 0.3 --measurement-time 0.6 ${KERNELS_FILTER:-}
    grep -E "^[a-zA-Z0-9_]+/[a-z_]+/rows|time:" "$out/kernels.log" | grep -v Benchmarking
fi

if [ -n "$gen_pid" ] && ! wait "$gen_pid"; then
    echo "== gen-model FAILED; its log:"
    tail -n 20 "$out/gen-model.log"
    failed=$((failed + 1))
fi
# profile NAME BACKEND MODEL GPU_LAYERS [DRAFTER]: a profile for the benches (with the
# target option line in $TARGET_OPTION, if set).
profile() {
    local drafter=${5:-mtp}
    printf '[target]\nbackend = "%s"\nmodel = "%s"\ncontext_size = 1024\nthreads = %s\n\n[target.options]\ngpu_layers = "%s"\n%s\n[drafter]\nplugin = "%s"\n' \
        "$2" "$3" "$(( $(nproc) < 8 ? $(nproc) : 8 ))" "$4" "${TARGET_OPTION:-}" "$drafter" >"$out/$1.toml"
    echo "$out/$1.toml"
}
# bench NAME MODEL GPU_LAYERS BENCH-ARGS...: the bench with this kit's plugin, then the old one.
bench() {
    local name=$1 model=$2 layers=$3
    shift 3
    step "bench-$name" 120 "$bin" bench --profile "$(profile "$name" cuda-hybrid "$model" "$layers")" "$@"
    grep -vE "^(tensor types|AMX|peak|memory read|  with the KV)" "$out/bench-$name.log"
    if [ -f "$old_plugin" ]; then
        step "bench-$name-old" 120 "$bin" bench \
            --profile "$(profile "$name-old" "$old_plugin" "$model" "$layers")" "$@"
        grep -vE "^(tensor types|AMX|peak|memory read|  with the KV)" "$out/bench-$name-old.log"
    fi
}

# without_graphs COMMAND...: COMMAND with the option cuda_graphs = false (each launch issued on
# its own), run right after the same bench with graphs (the default) for a side-by-side pair.
without_graphs() {
    TARGET_OPTION='cuda_graphs = "false"' "$@"
}

if wants bench; then
    short=(--runs 3 -n 64 --prompt-tokens 64)
    trained="$kit/shared/models/trained/stories-qwen35-mtp-q8_0.gguf"
    bench qwen35-2b-gpu "$q2b" all "${short[@]}" --drafters oracle --oracle-k 4
    without_graphs bench qwen35-2b-gpu-no-graphs "$q2b" all "${short[@]}" --drafters oracle --oracle-k 4
    bench qwen35-2b-gpu-k8 "$q2b" all "${short[@]}" --drafters oracle --oracle-k 8
    bench qwen35-2b-half "$q2b" 12 "${short[@]}" --drafters oracle --oracle-k 4
    bench qwen3-0.6b-gpu "$q06" all "${short[@]}" --drafters oracle --oracle-k 8
    without_graphs bench qwen3-0.6b-gpu-no-graphs "$q06" all "${short[@]}" --drafters oracle --oracle-k 8
    bench qwen3-0.6b-sequences "$q06" all --concurrency 1,4,8 -n 32
    # The random models' MTP heads accept nothing; the trained qwen35 shows real acceptance.
    bench trained "$trained" all --runs 3 -n 128 --prompt-tokens 64 --drafters profile,oracle
    without_graphs bench trained-no-graphs "$trained" all \
        --runs 3 -n 128 --prompt-tokens 64 --drafters profile,oracle
fi

# ncu_profile NAME MODEL SKIP COUNT COMMAND-ARGS...: each kernel's time (ncu) over launches
# SKIP to SKIP + COUNT - 1 of `specula COMMAND-ARGS... --profile P`, P running MODEL fully on
# the GPU without graphs (ncu times each launch alone). Prints the kernels by total time.
ncu_profile() {
    local name=$1 model=$2 skip=$3 count=$4
    shift 4
    step "$name" 150 "$ncu" --csv --metrics gpu__time_duration.sum,launch__grid_size \
        --launch-skip "$skip" --launch-count "$count" --log-file "$out/$name.csv" \
        "$bin" "$@" --profile "$(without_graphs profile "$name" cuda-hybrid "$model" all)"
    [ -s "$out/$name.csv" ] || return 0
    python3 - "$out/$name.csv" <<'EOF'
import collections, csv, sys
rows = [r for r in csv.DictReader(line for line in open(sys.argv[1]) if line.startswith('"'))
        if r["Metric Name"] == "gpu__time_duration.sum"]
total = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    key = (r["Kernel Name"], r["Grid Size"])
    total[key][0] += 1
    total[key][1] += float(r["Metric Value"].replace(",", ""))
ns = sum(t for _, t in total.values())
print(f"   {len(rows)} launches, {ns / 1e3:.0f} us of kernel time")
for (name, grid), (n, t) in sorted(total.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"   {name:28} grid {grid:>14} x{n:<5} {t / n / 1e3:8.2f} us each {100 * t / ns:5.1f}%")
EOF
}

if wants profile; then
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # Plain decode steps of both models (the first 1500 launches, the load and the prefill,
    # skipped), then the 2B's passes of 1 to 8 rows: the first 6000 launches of a bench hold
    # its prefill and the verify-cost measurement's untimed first round (k = 1..8 in turn).
    run=(run -n 16 --temp 0 --no-spec "Once upon a time there was a")
    ncu_profile profile-qwen35-2b-q4_k "$q2b" 1500 2000 "${run[@]}"
    ncu_profile profile-qwen3-0.6b-q8_0 "$q06" 1500 2000 "${run[@]}"
    ncu_profile profile-qwen35-2b-q4_k-rows "$q2b" 0 6000 \
        bench --runs 1 -n 8 --prompt-tokens 16 --drafters oracle --oracle-k 4
    # Why the Q4_K kernels of 1 and 4 rows take what they take: occupancy, registers, where
    # the warps stall and what the memory system served, for three launches of each in the
    # same bench (its launch table says each one's grid, i.e. which matrix).
    for kernel in matvec_q4_k matmul4_q4_k; do
        step "details-$kernel" 150 "$ncu" --kernel-name "$kernel" --launch-skip 40 \
            --launch-count 3 --section LaunchStats --section Occupancy \
            --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
            --section ComputeWorkloadAnalysis --log-file "$out/details-$kernel.txt" \
            "$bin" bench --runs 1 -n 8 --prompt-tokens 16 --drafters oracle --oracle-k 4 \
            --profile "$(without_graphs profile "details-$kernel" cuda-hybrid "$q2b" all)"
        grep -E "q4_k|Grid Size|Duration|Registers Per|Occupancy|Warp Cycles Per Issued|Eligible|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Issue Slots Busy" \
            "$out/details-$kernel.txt" | sed 's/^/   /'
    done
fi
echo "failed steps: $failed"
exit "$failed"
