#!/usr/bin/env bash
# cuda-hybrid's GPU checks, on a machine with an NVIDIA GPU, from the kit pack.sh made (no
# Rust toolchain or network needed there). From the repository root:
#
#   plugins/cuda-hybrid/gpu-check/run.sh tests   # the GPU tests: kernels against references,
#                                                # verify rows == single-token evals, rollback
#                                                # oracle, greedy == cpu-simd, MTP == plain
#   plugins/cuda-hybrid/gpu-check/run.sh kernels # the mat-vec / mat-mul kernels alone: time
#                                                # and weight GB/s per type, shape, k = 1..8
#   plugins/cuda-hybrid/gpu-check/run.sh bench   # a Qwen3.5-2B-shaped Q4_K model: plain and
#                                                # MTP decode, verify cost ratios k = 1..8;
#                                                # the trained qwen35 with its MTP head
#   plugins/cuda-hybrid/gpu-check/run.sh all     # all three (the default)
#
# Logs go to $OUT (the device tool's output folder) or ./gpu-check-out/. The exit status is
# the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../../.."
kit="$PWD/.gpu-kit"
bin="$kit/target/release/specula"
deps="$kit/target/release/deps"
out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
what="${1:-all}"
if [ ! -x "$bin" ]; then
    echo "run.sh: no kit at $kit: run plugins/cuda-hybrid/gpu-check/pack.sh first" >&2
    exit 100
fi

# The tests read the kit's models, fail rather than skip or fall back to the emulator when
# the GPU cannot be used, and share one PTX cache.
export SPECULA_SHARED="$kit/shared"
export SPECULA_REQUIRE_GPU=1
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
step() {
    local name=$1
    shift
    echo "== $name: $*"
    local started=$SECONDS
    if "$@" >"$out/$name.log" 2>&1; then
        echo "   ok in $((SECONDS - started)) s"
    else
        echo "   FAILED (status $?) in $((SECONDS - started)) s; the log's end:"
        tail -n 40 "$out/$name.log"
        failed=$((failed + 1))
    fi
    grep -E "^test result|SKIPPED|^NVRTC" "$out/$name.log" | sed 's/^/   /'
}

{
    echo "kit: $(head -1 "$kit/REVISION")$(grep -q changed "$kit/REVISION" && echo ' (with uncommitted changes)')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader
    echo "NVRTC: ${SPECULA_NVRTC_PATH:-the library search path}"
} | tee "$out/machine.txt"

if [ "$what" = tests ] || [ "$what" = all ]; then
    step ptx env CI=true "$deps/ptx" --nocapture  # CI set: NVRTC must load
    step gpu "$deps/gpu" --test-threads=1 --nocapture
    step cuda "$deps/cuda" --test-threads=1 --nocapture
fi

if [ "$what" = kernels ] || [ "$what" = all ]; then
    # Criterion keeps its history out of $OUT.
    step kernels env CRITERION_HOME=/tmp/specula-criterion "$deps/kernel-bench" --bench \
        --warm-up-time 0.5 --measurement-time 1
    grep -E "^[a-z0-9_]+/[a-z_]+/rows|thrpt" "$out/kernels.log"
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
    model=/tmp/qwen35-2b-q4_k.gguf
    [ -f "$model" ] || step gen-model "$bin" gen-model --preset qwen35-2b --out "$model"
    profile="$out/qwen35-2b-cuda-mtp.toml"
    printf '[target]\nbackend = "cuda-hybrid"\nmodel = "%s"\ncontext_size = 1024\n\n[drafter]\nplugin = "mtp"\n' \
        "$model" >"$profile"
    step bench "$bin" bench --profile "$profile" --runs 3 -n 128 --prompt-tokens 64 \
        --drafters profile,oracle --oracle-k 4
    cat "$out/bench.log"
    step bench-oracle-k8 "$bin" bench --profile "$profile" --runs 3 -n 128 --prompt-tokens 64 \
        --drafters oracle --oracle-k 8
    cat "$out/bench-oracle-k8.log"
    # The random 2B model's MTP head accepts nothing; the trained qwen35 shows real acceptance.
    trained="$out/stories-qwen35-cuda-mtp.toml"
    printf '[target]\nbackend = "cuda-hybrid"\nmodel = "%s"\ncontext_size = 1024\n\n[drafter]\nplugin = "mtp"\n' \
        "$kit/shared/models/trained/stories-qwen35-mtp-q8_0.gguf" >"$trained"
    step bench-trained "$bin" bench --profile "$trained" --runs 3 -n 128 --prompt-tokens 64 \
        --drafters profile,oracle
    cat "$out/bench-trained.log"
fi
echo "failed steps: $failed"
exit "$failed"
