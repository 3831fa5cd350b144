#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs (it has no Rust) into .gpu/.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p kvcc-runtime --bin kvcc
# The GPU test binaries: tests/gpu.rs (kernels, encoders) and tests/gpu_live.rs (the live cache).
binary() {
  cargo test --release --test "$1" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]==sys.argv[1] and m.get("executable"): print(m["executable"])' "$1"
}
mkdir -p .gpu
cp target/release/kvcc .gpu/kvcc
cp "$(binary gpu)" .gpu/gpu-tests
cp "$(binary gpu_live)" .gpu/gpu-live-tests
# The random-spec corpus `run.sh corpus` benchmarks (a fixed seed).
rm -rf .gpu/corpus
KVCC_CORPUS_DIR="$PWD/.gpu/corpus" cargo test --release --test random_specs the_benchmark_corpus -q > /dev/null
ls -la .gpu
