#!/usr/bin/env bash
# The main job on the built-in corpus, CPU only: prepare Shakespeare (characters), train tiny
# models for all four variants with the same seed and data, then write out/demo/report.md.
# Extra arguments go to every train.py call, e.g. bash scripts/demo.sh --max_iters=100
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PYTHON" prepare_shakespeare.py --tokenizer char
rm -rf out/demo
mkdir -p out/demo
train() {
    "$PYTHON" train.py configs/shakespeare.py configs/tiny.py "configs/$1.py" --out_dir="out/demo/$1" "${@:2}" \
        > "out/demo/$1.log" 2>&1 || { tail -n 20 "out/demo/$1.log" >&2; echo "demo: $1 failed" >&2; return 1; }
    echo "demo: $1 $(grep '^eval step' "out/demo/$1.log" | tail -n 1)"
}
# Two lanes, one core each: eager mhc (20 Sinkhorn iterations) takes about as long as the other three.
train mhc "$@" &
mhc_lane=$!
trap 'kill "$mhc_lane" 2>/dev/null || true' EXIT
echo "demo: training mhc alongside res, hc, mhclite in turn; logs in out/demo/<variant>.log"
for residual in res hc mhclite; do
    train "$residual" "$@"
done
wait "$mhc_lane"
"$PYTHON" analysis/report.py --runs out/demo/res out/demo/hc out/demo/mhc out/demo/mhclite --out out/demo
echo "report: out/demo/report.md"
