#!/usr/bin/env bash
# The larger-n study on the built-in corpus (CPU): tiny mhc and mhclite models at n = 4 and n = 8,
# mhclite at n = 8 with K = 8, 32, 128 sampled permutations (uniform) and K = 8 "cover", kromhc at n = 8,
# and at n = 16 mhc, mhclite with K = 32 and kromhc, plus res as the reference; same data, steps and
# seeds. Writes out/larger_n/<run>/ and the page docs/larger_n.md.
#
#   bash scripts/larger_n_study.sh [--seeds "0 1"] [--jobs 2] [--configurations "kromhc-n8 kromhc-n16"]
#                                  [--out_root out/larger_n] [--doc_dir docs] [-- extra train.py overrides]
# --jobs runs that many trainings at once, one thread each (step times then share the machine).
# --configurations trains only those (names below); the page covers every run in --out_root.
set -euo pipefail
cd "$(dirname "$0")/.."

seeds="0"
jobs=1
configurations=""
out_root="out/larger_n"
doc_dir="docs"
while [ $# -gt 0 ]; do
    case "$1" in
        --seeds) seeds="$2"; shift 2 ;;
        --jobs) jobs="$2"; shift 2 ;;
        --configurations) configurations="$2"; shift 2 ;;
        --out_root) out_root="$2"; shift 2 ;;
        --doc_dir) doc_dir="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown option '$1' (valid: --seeds, --jobs, --configurations, --out_root, --doc_dir," \
                "-- train.py overrides)" >&2
           exit 2 ;;
    esac
done
overrides=("$@")

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" prepare_shakespeare.py --tokenizer char

# name | residual config | overrides
studies=(
    "res|res|"
    "mhc-n4|mhc|--n_streams=4"
    "mhclite-n4-all|mhclite|--n_streams=4"
    "mhc-n8|mhc|--n_streams=8"
    "mhclite-n8-K8|mhclite|--n_streams=8 --mhclite_perms=8"
    "mhclite-n8-K8-cover|mhclite|--n_streams=8 --mhclite_perms=8 --mhclite_perm_sampling=cover"
    "mhclite-n8-K32|mhclite|--n_streams=8 --mhclite_perms=32"
    "mhclite-n8-K128|mhclite|--n_streams=8 --mhclite_perms=128"
    "kromhc-n8|kromhc|--n_streams=8"
    "mhc-n16|mhc|--n_streams=16"
    "mhclite-n16-K32|mhclite|--n_streams=16 --mhclite_perms=32"
    "kromhc-n16|kromhc|--n_streams=16"
)

for name in $configurations; do
    if ! printf '%s\n' "${studies[@]}" | grep -q "^$name|"; then
        echo "unknown configuration '$name' (valid: $(printf '%s\n' "${studies[@]}" | cut -d'|' -f1 | xargs))" >&2
        exit 2
    fi
done

train_one() {  # name residual overrides seed
    local out_dir="$out_root/$1-s$4"
    if [ -f "$out_dir/done" ]; then
        echo "skip $out_dir (finished)"
        return
    fi
    rm -rf "$out_dir"
    mkdir -p "$out_dir"
    # shellcheck disable=SC2086  # the overrides are words on purpose
    "$PYTHON" train.py configs/shakespeare.py configs/tiny.py "configs/$2.py" $3 --seed="$4" \
        --out_dir="$out_dir" "${overrides[@]}" > "$out_dir/train.log" 2>&1 \
        || { tail -n 20 "$out_dir/train.log" >&2; echo "failed: $out_dir" >&2; return 1; }
    touch "$out_dir/done"
    echo "finished $out_dir: $(grep 'eval step' "$out_dir/train.log" | tail -n 1)"
}

running=0
for seed in $seeds; do
    for study in "${studies[@]}"; do
        IFS='|' read -r name residual args <<< "$study"
        if [ -n "$configurations" ] && [[ " $configurations " != *" $name "* ]]; then
            continue
        fi
        train_one "$name" "$residual" "$args" "$seed" &
        running=$((running + 1))
        if [ "$running" -ge "$jobs" ]; then
            wait -n
            running=$((running - 1))
        fi
    done
done
while [ "$running" -gt 0 ]; do
    wait -n
    running=$((running - 1))
done

study_command="bash scripts/larger_n_study.sh --seeds \"$seeds\" --jobs $jobs"
if [ -n "$configurations" ]; then
    study_command+=" --configurations \"$configurations\""
fi
if [ ${#overrides[@]} -gt 0 ]; then
    study_command+=" -- ${overrides[*]}"
fi
"$PYTHON" analysis/larger_n.py --runs "$out_root/*" --out "$doc_dir" --study_command "$study_command"
