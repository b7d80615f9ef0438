#!/usr/bin/env bash
# The test command: install requirements, then run the whole pytest suite (slow tests included) on a
# worker per core, at most four (pytest-xdist; the tests sharing an expensive fixture on one worker,
# tests/conftest.py). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
workers=$(nproc)
exec "$PYTHON" -m pytest -n "$(( workers < 4 ? workers : 4 ))" --dist loadgroup "$@"
