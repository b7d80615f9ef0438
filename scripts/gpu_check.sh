#!/usr/bin/env bash
# The GPU check in stages, each planned to fit one 10-minute GPU command (the estimates beside each
# stage are for an H100 at M; how they were made: docs/benchmarks.md#the-gpu-check-in-stages).
#
#   bash scripts/gpu_check.sh [--device cuda|cpu] [--size M|tiny] [--out DIR] [STAGE...]
#
# Stages, in the order they run (all of them when none is named):
#   tests    ~4.5 min  CUDA tests of the default path (fp32 streams, torch connections), then the fast CPU
#                      tests here, so that a torch/triton version difference shows in the first minutes
#   bench    ~3.5 min  bench.py --size M for res and mhclite with its defaults (recompute rows), then
#                      scripts/micro_bench.py (one connection module alone, H_res construction alone)
#   train    ~4 min    20 training steps of every variant at M on random tokens, compiled block by block
#                      (the first step's time is the cold compile of that mode)
#   options  ~5.5 min  CUDA tests with bf16 streams; bench.py --size M for res and mhclite with bf16 streams,
#                      and with the fused connections and bf16 streams
#   kernels  ~5.5 min  CUDA tests of the Triton kernels, then python -m fused.bench_kernels (per-kernel timings;
#                      bytes per token from fused/kernel_bytes.json, counted on a CPU: no interpreter here)
# Every stage runs (a failing one does not stop the next) under a time limit (STAGE_LIMIT_S, 480 s),
# logs to DIR/<stage>.log and leaves its results in DIR (default out/gpu_check); the summary, printed
# last, says which stages ran, failed or did not run (in this or an earlier command on the same DIR),
# then the results table. Exit code 1 if a stage failed.
# The CPU dry run, `--device cpu --size tiny`, runs the same stages at tiny shapes without CUDA
# (Triton in its interpreter where a stage uses the kernels: on the CPU only, never with --device cuda);
# tests/test_gpu_check.py runs it.
# Inductor and Triton caches live in .cache/ (ignored), so a later command reuses earlier compiles.
set -euo pipefail
cd "$(dirname "$0")/.."

STAGES=(tests bench train options kernels)
declare -A ESTIMATE_MIN=([tests]=4.5 [bench]=3.5 [train]=4 [options]=5.5 [kernels]=5.5)
DEVICE=cuda SIZE=M OUT=out/gpu_check
requested=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
        --size) SIZE=${2:?--size needs M or tiny}; shift 2 ;;
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "error: unknown option '$1'; valid: --device, --size, --out" >&2; exit 2 ;;
        *) [ -n "${ESTIMATE_MIN[$1]:-}" ] || { echo "error: unknown stage '$1'; valid: ${STAGES[*]}" >&2; exit 2; }
           requested+=("$1"); shift ;;
    esac
done
[ ${#requested[@]} -gt 0 ] || requested=("${STAGES[@]}")
case "$DEVICE:$SIZE" in
    cuda:M|cuda:tiny|cpu:tiny) ;;
    *) echo "error: --device $DEVICE --size $SIZE is not a planned check; use cuda with M (or tiny), or cpu with tiny" >&2
       exit 2 ;;
esac

export PYTHON=${PYTHON:-python} DEVICE SIZE OUT
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}
if [ "$DEVICE" = cuda ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA GPU visible to $PYTHON; this check needs one (the CPU dry run: --device cpu --size tiny)" >&2
    exit 2
fi
if [ "$SIZE" = M ]; then
    # The paper's shape: bench.py's defaults (16 x 1024, 20 rounds after 3 warm-up), train.py at batch 16.
    export BENCH_ARGS="" MICRO_ARGS="" KERNEL_ARGS="" TRAIN_ARGS="--batch_size=16 --max_iters=20 --warmup_iters=5 --eval_interval=20 --log_interval=5"
    export CPU_TESTS=tests INTERPRET=0
else
    export KERNEL_ARGS="--batch_size 2 --block_size 32 --steps 2 --warmup 1"
    export BENCH_ARGS="$KERNEL_ARGS --vocab_size 512" MICRO_ARGS=$KERNEL_ARGS
    export TRAIN_ARGS="--batch_size=2 --block_size=32 --max_iters=4 --warmup_iters=1 --eval_interval=4 --log_interval=2"
    export CPU_TESTS=tests/test_gpu_check.py::test_usage_errors_exit_2 INTERPRET=1  # CI runs all the others
fi
mkdir -p "$OUT"
failed=0

# Each stage runs in its own bash (errexit on) so that a failing command ends that stage only.
stage_tests() {
    "$PYTHON" -m pytest -q -m "cuda and not fused and not bf16_streams" tests/test_cuda.py
    "$PYTHON" -m pytest -q -m "not slow and not cuda" $CPU_TESTS
}

stage_bench() {
    "$PYTHON" bench.py --size "$SIZE" --device "$DEVICE" --residuals res,mhclite $BENCH_ARGS --json "$OUT/bench.json"
    "$PYTHON" scripts/micro_bench.py --size "$SIZE" --device "$DEVICE" --residuals res,mhclite $MICRO_ARGS \
        --json "$OUT/micro.json"
}

stage_train() {
    "$PYTHON" scripts/gpu_check.py data "$OUT/data"
    for residual in res hc mhc mhclite; do
        rm -rf "$OUT/train-$residual"
        "$PYTHON" train.py "configs/$SIZE.py" "configs/$residual.py" --dataset=random --data_dir="$OUT/data" \
            --out_dir="$OUT/train-$residual" --device="$DEVICE" --gradient_accumulation_steps=1 --eval_iters=2 \
            --compile_mode=blocks $TRAIN_ARGS
    done
}

stage_options() {
    "$PYTHON" -m pytest -q -m "cuda and bf16_streams and not fused" tests/test_cuda.py
    # bf16 streams against fp32 (bench stage), and the fused kernels on top of bf16 streams
    for option in "--stream_dtype bfloat16" "--fused_connections on --stream_dtype bfloat16"; do
        name=$(echo "$option" | tr -d '-' | tr ' ' '_')
        TRITON_INTERPRET=$INTERPRET "$PYTHON" bench.py --size "$SIZE" --device "$DEVICE" --residuals res,mhclite \
            --recompute off $option $BENCH_ARGS --json "$OUT/bench-$name.json"
    done
}

stage_kernels() {
    "$PYTHON" -m pytest -q -m "cuda and fused" tests/test_cuda.py
    TRITON_INTERPRET=$INTERPRET "$PYTHON" -m fused.bench_kernels --size "$SIZE" --device "$DEVICE" $KERNEL_ARGS \
        --json "$OUT/kernels.json"
}
export -f "${STAGES[@]/#/stage_}"

for stage in "${STAGES[@]}"; do
    [[ " ${requested[*]} " == *" $stage "* ]] || continue
    echo "gpu_check: $stage (estimate ${ESTIMATE_MIN[$stage]} min on an H100 at M, limit ${STAGE_LIMIT_S:-480} s)"
    start=$(date +%s)
    set +e
    timeout -k 30 "${STAGE_LIMIT_S:-480}" bash -euo pipefail -c "stage_$stage" 2>&1 | tee "$OUT/$stage.log" |
        grep --line-buffered -vE "it/s|s/it"
    code=${PIPESTATUS[0]}
    set -e
    case $code in 0) status=ok ;; 124|137) status="timed out" ;; *) status="failed ($code)" ;; esac
    [ "$code" = 0 ] || failed=1
    printf '%s\t%s\t%s\t%s\n' "$stage" "$status" "$(( $(date +%s) - start ))" "$(date -u +%FT%TZ)" >> "$OUT/stages.tsv"
done

{
    echo "## gpu_check: stages (--device $DEVICE --size $SIZE, results in $OUT)"
    echo
    echo "| stage | estimate min | status | seconds | finished |"
    echo "|---|---|---|---|---|"
    for stage in "${STAGES[@]}"; do
        last=$(awk -F '\t' -v s="$stage" '$1 == s { line = $0 } END { print line }' "$OUT/stages.tsv" 2>/dev/null)
        if [ -z "$last" ]; then
            echo "| $stage | ${ESTIMATE_MIN[$stage]} | not run | - | - |"
        else
            IFS=$'\t' read -r _ status seconds finished <<< "$last"
            echo "| $stage | ${ESTIMATE_MIN[$stage]} | $status | $seconds | $finished |"
        fi
    done
    echo
    "$PYTHON" scripts/gpu_check.py table "$OUT" || echo "(no results table: scripts/gpu_check.py table failed)"
} | tee "$OUT/summary.md"
exit $failed
