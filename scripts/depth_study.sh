#!/usr/bin/env bash
# The depth study on the built-in corpus (CPU): narrow models (width 64, 4 heads) at several depths,
# res, hc, mhc and mhclite, at two learning rates (the tiny default and one ten times higher, where
# res itself slows down), several seeds, Shakespeare characters, eager. A run whose loss turns
# non-finite is kept and counted as diverged. Writes out/depth_study/<run>/ and docs/depth_study.md.
#
#   bash scripts/depth_study.sh [--depths "2 6 12 24"] [--lrs "3e-3 3e-2"] [--seeds "0 1 2"]
#                               [--steps 200] [--jobs 2] [--out_root out/depth_study] [--doc_dir docs]
#                               [-- extra train.py overrides]
# --jobs runs that many trainings at once, one thread each. Finished runs are skipped on a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

depths="2 6 12 24"
lrs="3e-3 3e-2"
seeds="0 1 2"
steps=200
jobs=1
out_root="out/depth_study"
doc_dir="docs"
while [ $# -gt 0 ]; do
    case "$1" in
        --depths) depths="$2"; shift 2 ;;
        --lrs) lrs="$2"; shift 2 ;;
        --seeds) seeds="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --jobs) jobs="$2"; shift 2 ;;
        --out_root) out_root="$2"; shift 2 ;;
        --doc_dir) doc_dir="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown option '$1' (valid: --depths, --lrs, --seeds, --steps, --jobs, --out_root, --doc_dir," \
                "-- train.py overrides)" >&2
           exit 2 ;;
    esac
done
overrides=("$@")

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" prepare_shakespeare.py --tokenizer char

# 8 x 128 tokens per step; warm-up and evaluations scaled to the short runs; min lr = lr / 10.
common=(configs/shakespeare.py configs/tiny.py --n_embd=64 --n_head=4 --batch_size=8 --compile=false
        --max_iters="$steps" --warmup_iters=$((steps / 10)) --eval_interval=$((steps / 2)) --eval_iters=10
        --log_interval=10)

train_one() {  # residual depth lr seed
    local out_dir="$out_root/$1-L$2-lr$3-s$4"
    if [ -f "$out_dir/done" ] || [ -f "$out_dir/diverged" ]; then
        echo "skip $out_dir (finished)"
        return
    fi
    rm -rf "$out_dir"
    mkdir -p "$out_dir"
    local min_lr start=$SECONDS status=0
    min_lr=$("$PYTHON" -c "print($3 / 10)")
    "$PYTHON" train.py "${common[@]}" "configs/$1.py" --n_layer="$2" --learning_rate="$3" --min_lr="$min_lr" \
        --seed="$4" --out_dir="$out_dir" "${overrides[@]}" > "$out_dir/train.log" 2>&1 || status=$?
    echo "$((SECONDS - start))" > "$out_dir/wall_s"
    if [ "$status" -ne 0 ]; then
        if grep -q "non-finite" "$out_dir/train.log"; then  # train.py's stop on a NaN or inf: a result
            touch "$out_dir/diverged"
            echo "diverged $out_dir: $(grep 'non-finite' "$out_dir/train.log" | tail -n 1)"
            return
        fi
        tail -n 20 "$out_dir/train.log" >&2
        echo "failed: $out_dir" >&2
        return 1
    fi
    echo "finished $out_dir ($((SECONDS - start)) s): $(grep 'eval step' "$out_dir/train.log" | tail -n 1)"
}

# Deepest first, so the longest runs do not trail at the end.
sorted_depths=$(printf '%s\n' $depths | sort -rn)
total=$(( $(wc -w <<< "$seeds") * $(wc -w <<< "$lrs") * $(wc -w <<< "$depths") * 4 ))
launched=0 running=0 failed=0 start=$SECONDS
for depth in $sorted_depths; do
    for lr in $lrs; do
        for seed in $seeds; do
            for residual in mhc hc mhclite res; do
                train_one "$residual" "$depth" "$lr" "$seed" &
                launched=$((launched + 1)) running=$((running + 1))
                echo "[$launched/$total, $((SECONDS - start)) s] started $residual L$depth lr $lr seed $seed"
                if [ "$running" -ge "$jobs" ]; then
                    wait -n || failed=$((failed + 1))
                    running=$((running - 1))
                fi
            done
        done
    done
done
while [ "$running" -gt 0 ]; do
    wait -n || failed=$((failed + 1))
    running=$((running - 1))
done
if [ "$failed" -gt 0 ]; then
    echo "$failed runs failed (see the messages above); not writing the study" >&2
    exit 1
fi
wall_s=$((SECONDS - start))
echo "trainings: $wall_s s wall"

study_command="bash scripts/depth_study.sh --depths \"$depths\" --lrs \"$lrs\" --seeds \"$seeds\" --steps $steps --jobs $jobs"
if [ ${#overrides[@]} -gt 0 ]; then
    study_command+=" -- ${overrides[*]}"
fi
"$PYTHON" analysis/depth_study.py --runs "$out_root/*" --out "$doc_dir" --study_command "$study_command" \
    --wall_s "$wall_s"
