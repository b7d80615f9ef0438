#!/usr/bin/env bash
# Every residual variant side by side on the built-in corpus (CPU): res, hc, mhc, mhc with DeepSeek-V4's
# epsilons (--mhc_eps=1e-6), mhclite, kromhc and ihc at the demo's tiny setting (Shakespeare characters,
# 4 layers, width 128, 16 x 128 tokens per step), several seeds, every step's gradient norm logged. Writes
# out/variants_study/<variant>-s<seed>/ and, in --doc_dir, variants_study.md, its figures and json.
#
#   bash scripts/variants_study.sh [--variants "res hc mhc mhc-v4eps mhclite kromhc ihc"] [--seeds "0 1 2"]
#                                  [--steps 1000] [--jobs 2] [--out_root out/variants_study] [--doc_dir docs]
#                                  [--data_dir data] [-- extra train.py overrides]
# --jobs runs that many trainings at once, one thread each (step times then share the machine). The seeds
# run outermost, so a cut-short study has whole seeds; finished runs are skipped on a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

variants="res hc mhc mhc-v4eps mhclite kromhc ihc"
seeds="0 1 2"
steps=1000
jobs=1
out_root="out/variants_study"
doc_dir="docs"
data_dir="data"
while [ $# -gt 0 ]; do
    case "$1" in
        --variants) variants="$2"; shift 2 ;;
        --seeds) seeds="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --jobs) jobs="$2"; shift 2 ;;
        --out_root) out_root="$2"; shift 2 ;;
        --doc_dir) doc_dir="$2"; shift 2 ;;
        --data_dir) data_dir="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown option '$1' (valid: --variants, --seeds, --steps, --jobs, --out_root, --doc_dir," \
                "--data_dir, -- train.py overrides)" >&2
           exit 2 ;;
    esac
done
overrides=("$@")

# variant | residual config | its overrides; the slowest first, so that they do not trail at the end
known=(
    "mhc|mhc|"
    "mhc-v4eps|mhc|--mhc_eps=1e-6"
    "hc|hc|"
    "mhclite|mhclite|"
    "kromhc|kromhc|"
    "ihc|ihc|"
    "res|res|"
)
for variant in $variants; do
    if ! printf '%s\n' "${known[@]}" | grep -q "^$variant|"; then
        echo "unknown variant '$variant' (valid: res hc mhc mhc-v4eps mhclite kromhc ihc)" >&2
        exit 2
    fi
done

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" prepare_shakespeare.py --tokenizer char --data_dir "$data_dir"

# The demo's setting (configs/shakespeare.py + configs/tiny.py), longer; every step logged for the spikes.
common=(configs/shakespeare.py configs/tiny.py --data_dir="$data_dir" --max_iters="$steps"
        --eval_interval=$(( (steps + 1) / 2 )) --log_interval=1)

train_one() {  # variant residual overrides seed
    local out_dir="$out_root/$1-s$4" start=$SECONDS
    if [ -f "$out_dir/done" ]; then
        echo "skip $out_dir (finished)"
        return
    fi
    rm -rf "$out_dir"
    mkdir -p "$out_dir"
    # shellcheck disable=SC2086  # the overrides are words on purpose
    "$PYTHON" train.py "${common[@]}" "configs/$2.py" $3 --seed="$4" --out_dir="$out_dir" "${overrides[@]}" \
        > "$out_dir/train.log" 2>&1 || { tail -n 20 "$out_dir/train.log" >&2; echo "failed: $out_dir" >&2; return 1; }
    echo "$((SECONDS - start))" > "$out_dir/wall_s"
    echo "finished $out_dir ($((SECONDS - start)) s): $(grep 'eval step' "$out_dir/train.log" | tail -n 1)"
}

total=$(( $(wc -w <<< "$seeds") * $(wc -w <<< "$variants") ))
launched=0 running=0 failed=0 start=$SECONDS
for seed in $seeds; do
    for entry in "${known[@]}"; do
        IFS='|' read -r variant residual args <<< "$entry"
        if [[ " $variants " != *" $variant "* ]]; then
            continue
        fi
        train_one "$variant" "$residual" "$args" "$seed" &
        launched=$((launched + 1)) running=$((running + 1))
        echo "[$launched/$total, $((SECONDS - start)) s] started $variant seed $seed"
        if [ "$running" -ge "$jobs" ]; then
            wait -n || failed=$((failed + 1))
            running=$((running - 1))
        fi
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

study_command="bash scripts/variants_study.sh --variants \"$variants\" --seeds \"$seeds\" --steps $steps --jobs $jobs"
if [ ${#overrides[@]} -gt 0 ]; then
    study_command+=" -- ${overrides[*]}"
fi
"$PYTHON" analysis/variants_study.py --runs "$out_root/*" --out "$doc_dir" --study_command "$study_command" \
    --wall_s "$wall_s"
