#!/usr/bin/env bash
# The GPU self-check, one command for a machine with an NVIDIA GPU:
#   1. the CUDA tests (pytest -m cuda): exact mHC-lite under every matmul precision, compiled = eager,
#      fused kernels = residuals.py, fused AdamW, bench.py's peak-memory path;
#   2. 20 compiled training steps of every variant at M (batch 16 x 1024, bf16) on random tokens;
#   3. bench.py --size M with its defaults, then with the fused kernels and/or bf16 streams;
#   4. a table: training tokens/s and MFU, bench step time and peak memory, max |row/col sum - 1|.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]    (default out/gpu_check; logs and JSON land there)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-out/gpu_check}
PYTHON=${PYTHON:-python}
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA GPU visible to $PYTHON; this check needs one (CPU users: bash scripts/test.sh)" >&2
    exit 2
fi
mkdir -p "$OUT"

echo "gpu_check: 1/4 CUDA tests"
"$PYTHON" -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log"

echo "gpu_check: 2/4 20 compiled steps of each variant at M"
"$PYTHON" scripts/gpu_check.py data "$OUT/data"
for residual in res hc mhc mhclite; do
    rm -rf "$OUT/train-$residual"
    "$PYTHON" train.py configs/M.py "configs/$residual.py" --dataset=random --data_dir="$OUT/data" \
        --out_dir="$OUT/train-$residual" --max_iters=20 --warmup_iters=5 --eval_interval=20 --eval_iters=2 \
        --log_interval=5 --batch_size=16 --gradient_accumulation_steps=1 --compile=true \
        2>&1 | tee "$OUT/train-$residual.log" | grep -E "^(step|eval|done|compiled|error)" || true
    [ -f "$OUT/train-$residual/done" ] || { echo "error: training $residual failed; see $OUT/train-$residual.log" >&2; exit 1; }
done

echo "gpu_check: 3/4 bench.py --size M (defaults)"
rm -f "$OUT/bench.json"
"$PYTHON" bench.py --size M --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -vE "it/s|s/it" || true
[ -f "$OUT/bench.json" ] || { echo "error: bench.py failed; see $OUT/bench.log" >&2; exit 1; }
# The two speed options against the same res, without the recompute rows and micro-benchmarks.
for option in "--fused_connections on" "--stream_dtype bfloat16" "--fused_connections on --stream_dtype bfloat16"; do
    name=$(echo "$option" | tr -d '-' | tr ' ' '_')
    "$PYTHON" bench.py --size M --recompute off --no-micro $option --json "$OUT/bench-$name.json" \
        2>&1 | tee "$OUT/bench-$name.log" | grep -vE "it/s|s/it" || true
done

echo "gpu_check: 4/4 summary"
"$PYTHON" scripts/gpu_check.py table "$OUT" | tee "$OUT/summary.md"
