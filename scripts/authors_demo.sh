#!/usr/bin/env bash
# The paper as written (defaults) against the paper as run (configs/authors.py) on the CPU demo:
# tiny models on Shakespeare characters, both settings for every variant and seed (same seed, same
# data order), then one loss table with both side by side (docs/faithfulness.md).
#   bash scripts/authors_demo.sh                                   # mhc mhclite hc, seeds 1 2 3
#   bash scripts/authors_demo.sh --variants "mhc mhclite" --seeds "1 2" -- --max_iters=250
# Runs go to out/authors_demo/<variant>-<paper|authors>-s<seed>/ (logs in logs/); two lanes, one core each:
# mhc (20 Sinkhorn iterations, the slowest) in one, the other variants in the other.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANTS="mhc mhclite hc"
SEEDS="1 2 3"
EXTRA=()
die() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --variants) [ $# -ge 2 ] || die "--variants needs a value"; VARIANTS=$2; shift 2 ;;
        --seeds) [ $# -ge 2 ] || die "--seeds needs a value"; SEEDS=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown option '$1'; valid: --variants --seeds --" ;;
    esac
done
for v in $VARIANTS; do
    case "$v" in res|hc|mhc|mhclite) ;; *) die "unknown variant '$v'; valid: res, hc, mhc, mhclite" ;; esac
done
for seed in $SEEDS; do [[ "$seed" =~ ^[0-9]+$ ]] || die "seeds must be integers, got '$seed'"; done

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" prepare_shakespeare.py --tokenizer char
OUT=out/authors_demo
rm -rf "$OUT"
mkdir -p "$OUT/logs"

train() {  # variant setting seed
    local run="$OUT/$1-$2-s$3" log="$OUT/logs/$1-$2-s$3.log" settings=()
    [ "$2" = authors ] && settings=(configs/authors.py)
    "$PYTHON" train.py configs/shakespeare.py configs/tiny.py "configs/$1.py" "${settings[@]}" --seed="$3" \
        --out_dir="$run" "${EXTRA[@]}" > "$log" 2>&1 || { tail -n 20 "$log" >&2; echo "failed: $run" >&2; return 1; }
    echo "$run: $(grep '^eval step' "$log" | tail -n 1)"
}
lane() {  # the variants of one lane, every seed and both settings
    local variant seed setting
    for seed in $SEEDS; do
        for variant in "$@"; do
            for setting in paper authors; do
                train "$variant" "$setting" "$seed"
            done
        done
    done
}
others=()
for v in $VARIANTS; do [ "$v" = mhc ] || others+=("$v"); done
lanes=()
if [[ " $VARIANTS " == *" mhc "* ]]; then lane mhc & lanes+=($!); fi
if [ ${#others[@]} -gt 0 ]; then lane "${others[@]}" & lanes+=($!); fi
trap 'kill "${lanes[@]}" 2>/dev/null || true' EXIT
status=0
for pid in "${lanes[@]}"; do wait "$pid" || status=1; done
trap - EXIT
[ "$status" = 0 ] || exit 1
"$PYTHON" analysis/loss_table.py --runs "$OUT"/*-s* --out "$OUT"
