#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs (it has no Rust) into .gpu/.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p kvcc-runtime --bin kvcc
test=$(cargo test --release --test gpu --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="gpu" and m.get("executable"): print(m["executable"])')
mkdir -p .gpu
cp target/release/kvcc .gpu/kvcc
cp "$test" .gpu/gpu-tests
ls -la .gpu
