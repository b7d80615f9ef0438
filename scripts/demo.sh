#!/usr/bin/env bash
# The main job on the built-in corpus, CPU only: prepare Shakespeare (characters), train tiny
# models for all four variants with the same seed and data, then write out/demo/report.md.
# Extra arguments go to every train.py call, e.g. bash scripts/demo.sh --max_iters=100
# While training, one line every DEMO_PROGRESS_SECONDS (default 30) shows the variants in progress.
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
# Steps done, latest loss and time left of the runs in progress, from their metrics.jsonl.
show_progress() {
    local line
    while sleep "${DEMO_PROGRESS_SECONDS:-30}" >/dev/null 2>&1; do
        line=$("$PYTHON" analysis/progress.py out/demo/mhc out/demo/res out/demo/hc out/demo/mhclite) || true
        if [ -n "$line" ]; then echo "demo: $line"; fi
    done
}
# Two lanes, one core each: eager mhc (20 Sinkhorn iterations) takes about as long as the other three.
train mhc "$@" &
mhc_lane=$!
show_progress &
progress_lane=$!
trap 'kill "$mhc_lane" "$progress_lane" 2>/dev/null || true' EXIT
echo "demo: training mhc alongside res, hc, mhclite in turn; logs in out/demo/<variant>.log"
for residual in res hc mhclite; do
    train "$residual" "$@"
done
wait "$mhc_lane"
kill "$progress_lane" 2>/dev/null || true
"$PYTHON" analysis/report.py --runs out/demo/res out/demo/hc out/demo/mhc out/demo/mhclite --out out/demo
echo "report: out/demo/report.md"
