#!/usr/bin/env bash
# The main job on the built-in corpus, CPU only: prepare Shakespeare (characters), train tiny
# models for all four variants with the same seed and data, then write out/demo/report/report.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PYTHON" prepare_shakespeare.py --tokenizer char
rm -rf out/demo
for residual in res hc mhc mhclite; do
    "$PYTHON" train.py configs/shakespeare.py configs/tiny.py "configs/$residual.py" --out_dir="out/demo/$residual" "$@"
done
"$PYTHON" analysis/report.py --runs out/demo/res out/demo/hc out/demo/mhc out/demo/mhclite --out out/demo/report
echo "report: out/demo/report/report.md"
