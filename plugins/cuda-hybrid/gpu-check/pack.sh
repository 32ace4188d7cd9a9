#!/usr/bin/env bash
# Packs what cuda-hybrid's GPU checks need into .gpu-kit/ (ignored by git), for a GPU machine
# with neither a Rust toolchain nor a network: the release `specula` binary and plugin
# libraries, the test executables that need a GPU (cuda-hybrid's `gpu` and `ptx`, the
# end-to-end `cuda`), the kernel benchmark (`benches/matmul.rs`), all stripped, and the shared
# models those tests read. About 40 MB.
#
# Run it here, from anywhere in the checkout; then on the GPU machine, from the repository
# root: plugins/cuda-hybrid/gpu-check/run.sh (see that file). With the device tool: carry
# `.gpu-kit` and run `plugins/cuda-hybrid/gpu-check/run.sh tests bench` (about 4 minutes on
# an H100; the logs come back as $OUT/logs.tgz).
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
shared="${SPECULA_SHARED:-$root/../shared}"
kit="$root/.gpu-kit"

cargo build --release --workspace
# The test executables cargo builds for the workspace, by target name.
executables=$(cargo test --release --workspace --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
')

kernel_bench=$(cargo bench -p specula-cuda-hybrid --bench matmul --no-run \
    --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        print(m["executable"])
')
[ -n "$kernel_bench" ] || { echo "pack.sh: no kernel benchmark executable" >&2; exit 1; }

[ -d "$kit" ] && chmod -R u+w "$kit"
rm -rf "$kit"
mkdir -p "$kit/target/release/deps" "$kit/shared/models"
release="$kit/target/release"
strip -o "$release/specula" target/release/specula
for lib in target/release/libspecula_*.so; do
    strip -o "$release/$(basename "$lib")" "$lib"
    # The tests load plugin libraries from beside their executable, in deps/.
    ln "$release/$(basename "$lib")" "$release/deps/$(basename "$lib")"
done
for name in gpu ptx cuda; do
    exe=$(awk -v n="$name" '$1 == n { print $2 }' <<<"$executables")
    [ -n "$exe" ] || { echo "pack.sh: no test executable named $name" >&2; exit 1; }
    strip -o "$release/deps/$name" "$exe"
done
strip -o "$release/deps/kernel-bench" "$kernel_bench"
cp -r "$shared/models/fixtures" "$shared/models/trained" "$shared/models/next-arch" \
    "$shared/models/llama2xs-281K.gguf" \
    "$shared/models/stories260K.gguf" \
    "$kit/shared/models/"
chmod -R u+w "$kit/shared"
# OLD_PLUGIN: an older build's libspecula_cuda_hybrid.so, which run.sh's benches run beside
# this one (the same host binary loads it by path).
if [ -n "${OLD_PLUGIN:-}" ]; then
    mkdir -p "$kit/old"
    strip -o "$kit/old/libspecula_cuda_hybrid.so" "$OLD_PLUGIN"
fi
{
    git rev-parse HEAD
    git status --porcelain --untracked-files=no | sed 's/^/changed: /'
} >"$kit/REVISION"
echo "packed $(du -sh "$kit" | cut -f1) into $kit at $(head -1 "$kit/REVISION")"
