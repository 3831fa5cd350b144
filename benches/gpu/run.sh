#!/usr/bin/env bash
# One call on the GPU machine: correctness, sanitizers, DRAM bytes, benchmark.
# Binaries are built on a CPU machine and carried in .gpu/ (see build.sh):
#   .gpu/kvcc, .gpu/gpu-tests and .gpu/gpu-live-tests (tests/gpu.rs, tests/gpu_live.rs); wheels in .whl/.
# Usage: benches/gpu/run.sh STEP...
#   STEP: env | test | sanitize | ncu | baseline | bench | live-baseline | live-bench | live-select | tune | tuned-bench | shipped
#         | ncu-bound | untuned | corpus | shipped-tune | before-after
# live-baseline / live-bench: the serving loop (append one token per sequence, then decode) of
# benches/gpu/live_baseline.py (SDPA, FlashInfer f16/fp8) and of `kvcc bench --live`.
# live-select: the serving loop of the selecting specs (benches/gpu/select) beside full decode of
# the same pages (dense_f16, kivi), against the live-baseline step's SDPA.
# before-after: benches the build in $KVCC_BEFORE (default .gpu/before, built by build.sh from an
# older commit) and .gpu/ alternately, three runs each, and fails if a tier is over 2 % slower.
# shipped: imports the tune cache exported by an earlier call on another machine
# ($KVCC_SHIPPED, default .gpu/tune-export-h200.json) into a fresh cache, then
# tunes: entries for unchanged kernels are hits, entries for changed ones stale.
# KVCC_BENCH_CTX: contexts of bench/tune (bench default 8192,32768,131072; tune 8192,32768).
# KVCC_TUNE_SPECS: specs tune sweeps (default: every bundled spec).
# Logs and JSON go to $OUT (or ./gpu-out when OUT is unset).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export KVCC_REQUIRE_GPU=1
status=0
step() { echo "=== $1"; }
for s in "$@"; do
  case "$s" in
    env)
      step env
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/env.txt"
      ;;
    test)
      step "GPU equivalence tests"
      for bin in gpu-tests gpu-live-tests; do
        .gpu/$bin --test-threads 1 --nocapture 2>&1 | tee "$out/$bin.log" | grep -E "^test |test result|SKIPPED|panicked|KVCC_TEST_SEED" || status=1
        grep -q "test result: ok" "$out/$bin.log" || status=1
      done
      ;;
    sanitize)
      step "compute-sanitizer memcheck + racecheck"
      # The bundled tiers at the defaults, the formats whose key codebooks are read directly,
      # then the tuning space's other configurations (pipelined ones too); the page encoders
      # and the live cache (append, compress, decode over exact and compressed pages).
      # KVCC_SANITIZE: a space-separated subset of bin:test pairs.
      tests=${KVCC_SANITIZE:-"gpu-tests:gpu_matches_interpreter_on_every_bundled_tier gpu-tests:gpu_matches_interpreter_on_direct_codebook_formats gpu-tests:gpu_tuning_space_matches_interpreter_and_page_size_is_enforced gpu-tests:gpu_encoders_match_cpu_encoder_on_every_bundled_tier gpu-live-tests:gpu_live_cache_matches_the_cpu_live_cache_on_every_bundled_format gpu-live-tests:gpu_live_cache_selects_the_pages_the_cpu_live_cache_selects"}
      for pair in $tests; do
        bin=${pair%%:*}; t=${pair#*:}
        for tool in memcheck racecheck; do
          compute-sanitizer --tool "$tool" --error-exitcode 9 ".gpu/$bin" "$t" --test-threads 1 \
            > "$out/sanitize-$tool-$t.log" 2>&1
          rc=$?
          echo "$tool $t exit $rc: $(grep -E 'SUMMARY|test result' "$out/sanitize-$tool-$t.log" | tr '\n' ' ')"
          [ "$rc" -eq 0 ] || status=1
        done
      done
      ;;
    ncu)
      step "ncu DRAM bytes read (one 32K decode step per spec)"
      ncu --metrics dram__bytes_read.sum --clock-control none --csv --kernel-name regex:kvcc_ --log-file "$out/ncu.csv" \
        .gpu/kvcc bench --ctx 32768 --warmup 0 --iters 1 --json > "$out/ncu-bench.json" 2> "$out/ncu.err"
      echo "ncu exit $?"; python3 benches/gpu/ncu_bytes.py "$out/ncu.csv" "$out/ncu-bench.json" || status=1
      ;;
    ncu-bound)
      step "ncu: what bounds each decode kernel (one 32K step per bundled spec, the configurations a fresh clone runs)"
      metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
      metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
      metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
      metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active
      KVCC_TUNE_CACHE=/tmp/no-tune-cache.json ncu --metrics "$metrics" --csv --kernel-name regex:_decode\$ --log-file "$out/ncu-bound.csv" \
        .gpu/kvcc bench --ctx 32768 --warmup 0 --iters 1 --json > "$out/ncu-bound-bench.json" 2> "$out/ncu-bound.err"
      echo "ncu exit $?"; python3 benches/gpu/ncu_bound.py "$out/ncu-bound.csv" --json "$out/ncu-bound.json" || status=1
      ;;
    baseline)
      step "dense baselines (SDPA, FlashInfer)"
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
      PYTHONUNBUFFERED=1 python3 benches/gpu/baseline.py --json "$out/baseline.json" 2>&1 | tail -12
      ;;
    live-baseline)
      step "dense serving loops (SDPA, FlashInfer f16 and fp8)"
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
      PYTHONUNBUFFERED=1 python3 benches/gpu/live_baseline.py --ctx "${KVCC_BENCH_CTX:-8192,32768,131072}" --json "$out/live-baseline.json" 2>&1 | tail -12
      ;;
    live-bench)
      step "kvcc bench --live"
      .gpu/kvcc bench --live --baseline "$out/live-baseline.json" --ctx "${KVCC_BENCH_CTX:-8192,32768,131072}" \
        ${KVCC_BENCH_ONLY:+--only "$KVCC_BENCH_ONLY"} --save "$out/live-bench.json" > "$out/live-bench.txt" 2> "$out/live-bench.err" \
        || { status=1; tail -5 "$out/live-bench.err"; }
      cat "$out/live-bench.txt"
      ;;
    live-select)
      step "kvcc bench --live: page selection (benches/gpu/select) and full decode of the same pages"
      for what in select full; do
        flags=(--specs benches/gpu/select); [ "$what" = full ] && flags=(--only dense_f16,kivi)
        .gpu/kvcc bench --live "${flags[@]}" --batch "${KVCC_BENCH_BATCH:-8}" --baseline "$out/live-baseline.json" \
          --ctx "${KVCC_BENCH_CTX:-32768,131072,524288}" --save "$out/live-$what.json" > "$out/live-$what.txt" 2> "$out/live-$what.err" \
          || { status=1; tail -5 "$out/live-$what.err"; }
        cat "$out/live-$what.txt"
      done
      ;;
    bench)
      step "kvcc bench"
      .gpu/kvcc bench --baseline "$out/baseline.json" --ctx "${KVCC_BENCH_CTX:-8192,32768,131072}" --save "$out/bench.json" \
        > "$out/bench.txt" 2> "$out/bench.err" || { status=1; tail -5 "$out/bench.err"; }
      cat "$out/bench.txt"
      ;;
    tune)
      step "kvcc tune (sweep, then a second run that must hit the cache, then export)"
      export KVCC_TUNE_CACHE="$out/tune-cache.json"
      specs=${KVCC_TUNE_SPECS:-dense_f16,spherical,kivi,subspace,shard,mosaic,fp8,kivi2}
      .gpu/kvcc tune --spec "$specs" --ctx "${KVCC_BENCH_CTX:-8192,32768}" --save "$out/tune.json" > "$out/tune.txt" 2> "$out/tune.err" \
        || { status=1; tail -5 "$out/tune.err"; }
      start=$(date +%s%N)
      .gpu/kvcc tune --spec "$specs" --ctx "${KVCC_BENCH_CTX:-8192,32768}" --json > "$out/tune-again.json" 2> "$out/tune-again.err" || status=1
      python3 -c 'import json,sys,time; r=json.load(open(sys.argv[1]))["results"]; c=sum(x["origin"]=="cached" for x in r); print(f"second tune run: {c} of {len(r)} tier/context results from the cache, {len(r)-c} sweeps, {(time.time_ns()-int(sys.argv[2]))/1e9:.1f} s wall"); sys.exit(c != len(r))' \
        "$out/tune-again.json" "$start" || status=1
      .gpu/kvcc tune-cache export "$out/tune-export.json"
      unset KVCC_TUNE_CACHE
      sed -n '/tune cache/,$p' "$out/tune.txt"
      ;;
    tuned-bench)
      step "kvcc bench: defaults, then the exported tune results imported into a fresh cache"
      export KVCC_TUNE_CACHE=/tmp/imported-tune-cache.json
      rm -f "$KVCC_TUNE_CACHE"
      .gpu/kvcc tune-cache import "$out/tune-export.json"
      base=(.gpu/kvcc bench --ctx "${KVCC_BENCH_CTX:-8192,32768}")
      [ -f "$out/baseline.json" ] && base+=(--baseline "$out/baseline.json")
      "${base[@]}" --no-tune --save "$out/bench-default.json" > "$out/bench-default.txt" 2> "$out/bench-default.err" || status=1
      "${base[@]}" --save "$out/bench-tuned.json" > "$out/bench-tuned.txt" 2> "$out/bench-tuned.err" || status=1
      cat "$out/bench-default.txt" "$out/bench-tuned.txt"
      python3 benches/gpu/tuned_vs_default.py "$out/bench-default.json" "$out/bench-tuned.json" | tee "$out/tuned-vs-default.txt" || status=1
      unset KVCC_TUNE_CACHE
      ;;
    shipped)
      step "a tune cache exported on another machine, imported here"
      export KVCC_TUNE_CACHE=/tmp/shipped-tune-cache.json
      rm -f "$KVCC_TUNE_CACHE"
      .gpu/kvcc tune-cache import "${KVCC_SHIPPED:-.gpu/tune-export-h200.json}" || status=1
      .gpu/kvcc tune --spec "${KVCC_TUNE_SPECS:-dense_f16,spherical,kivi,subspace,shard,mosaic,fp8,kivi2}" --ctx "${KVCC_BENCH_CTX:-8192,32768}" \
        --save "$out/shipped-tune.json" > "$out/shipped-tune.txt" 2> "$out/shipped-tune.err" || status=1
      python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["results"]; c=[x for x in r if x["origin"]=="cached"]; s=[x for x in r if x["origin"]=="replaced_stale"]; print(f"after import: {len(c)} of {len(r)} tier/context results served from the shipped cache, {len(s)} swept again because their entry was stale (codegen changed), {len(r)-len(c)-len(s)} swept without an entry")' "$out/shipped-tune.json"
      unset KVCC_TUNE_CACHE
      ;;
    untuned)
      step "kvcc bench as a fresh clone runs it (no tune cache: shipped results, else the cost model), then the cost model alone; batch 1 and 8"
      export KVCC_TUNE_CACHE=/tmp/no-tune-cache.json
      rm -f "$KVCC_TUNE_CACHE"
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site
      for b in ${KVCC_BENCH_BATCHES:-8 1}; do
        PYTHONUNBUFFERED=1 python3 benches/gpu/baseline.py --batch "$b" --ctx "${KVCC_BENCH_CTX:-32768,131072}" --json "$out/baseline-b$b.json" 2>&1 | tail -4
        for mode in fresh model; do
          flag=(); [ "$mode" = model ] && flag=(--no-tune)
          .gpu/kvcc bench --batch "$b" --ctx "${KVCC_BENCH_CTX:-32768,131072}" "${flag[@]}" --baseline "$out/baseline-b$b.json" \
            --save "$out/untuned-$mode-b$b.json" > "$out/untuned-$mode-b$b.txt" 2> "$out/untuned-$mode-b$b.err" || { status=1; tail -5 "$out/untuned-$mode-b$b.err"; }
          tail -n +3 "$out/untuned-$mode-b$b.txt"
        done
      done
      unset KVCC_TUNE_CACHE
      ;;
    corpus)
      step "the random-spec corpus (.gpu/corpus, written by build.sh): the cost model's defaults, checked against the interpreter"
      .gpu/kvcc bench --specs .gpu/corpus --no-tune --ctx "${KVCC_BENCH_CTX:-32768}" --save "$out/corpus.json" \
        > "$out/corpus.txt" 2> "$out/corpus.err" || { status=1; tail -5 "$out/corpus.err"; }
      tail -n +3 "$out/corpus.txt"
      ;;
    shipped-tune)
      step "kvcc tune of the bundled specs at the shipped shapes (batch 8 at 32K, batch 1 at 128K and 32K): runtime/tune-cache/shipped.json"
      export KVCC_TUNE_CACHE="$out/shipped.json"
      rm -f "$KVCC_TUNE_CACHE"
      specs=dense_f16,spherical,kivi,kivi2,subspace,shard,mosaic,fp8
      search=(--search descent --iters 15 --warmup 3)
      .gpu/kvcc tune --spec "$specs" --batch 8 --ctx 32768 "${search[@]}" > "$out/shipped-b8.txt" 2>&1 || status=1
      .gpu/kvcc tune --spec "$specs" --batch 1 --ctx 131072 "${search[@]}" > "$out/shipped-b1.txt" 2>&1 || status=1
      .gpu/kvcc tune --spec "$specs" --batch 1 --ctx 32768 "${search[@]}" > "$out/shipped-b1-32k.txt" 2>&1 || status=1
      sed -n '/tune cache/,$p' "$out/shipped-b8.txt" "$out/shipped-b1.txt" "$out/shipped-b1-32k.txt"
      unset KVCC_TUNE_CACHE
      ;;
    before-after)
      step "kvcc bench: the build in ${KVCC_BEFORE:-.gpu/before} against .gpu/, alternating"
      before=()
      after=()
      for i in 1 2 3; do
        for build in before after; do
          bin=.gpu/kvcc
          [ "$build" = before ] && bin=${KVCC_BEFORE:-.gpu/before}/kvcc
          "$bin" bench --ctx "${KVCC_BENCH_CTX:-32768}" --save "$out/bench-$build-$i.json" \
            > "$out/bench-$build-$i.txt" 2> "$out/bench-$build-$i.err" || { status=1; tail -5 "$out/bench-$build-$i.err"; }
          if [ "$build" = before ]; then before+=("$out/bench-$build-$i.json"); else after+=("$out/bench-$build-$i.json"); fi
        done
      done
      python3 benches/gpu/before_after.py 0.02 "${before[@]}" -- "${after[@]}" | tee "$out/before-after.txt" || status=1
      ;;
  esac
done
exit $status
