#!/usr/bin/env bash
# bf16 streams against fp32 streams on the built-in corpus (CPU): hc, mhc and mhclite, each with
# --stream_dtype=float32 and --stream_dtype=bfloat16, several seeds, the depth study's narrow shape
# (width 64, 4 heads, batch 8 x 128), Shakespeare characters, eager, one run at a time. The two runs
# of a seed see the same batches, so only the streams' storage differs. Writes
# out/bf16_streams/<run>/ and, in --doc_dir, bf16_streams.md, its figures and bf16_streams.json.
#
#   bash scripts/bf16_streams_study.sh [--residuals "hc mhc mhclite"] [--seeds "0 1 2"] [--depth 6]
#                                      [--steps 1000] [--out_root out/bf16_streams] [--doc_dir docs]
#                                      [--data_dir data] [-- extra train.py overrides]
# Finished runs are skipped on a rerun; the seeds run outermost, so a cut-short study has whole seeds.
set -euo pipefail
cd "$(dirname "$0")/.."

residuals="hc mhc mhclite"
seeds="0 1 2"
depth=6
steps=1000
out_root="out/bf16_streams"
doc_dir="docs"
data_dir="data"
while [ $# -gt 0 ]; do
    case "$1" in
        --residuals) residuals="$2"; shift 2 ;;
        --seeds) seeds="$2"; shift 2 ;;
        --depth) depth="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --out_root) out_root="$2"; shift 2 ;;
        --doc_dir) doc_dir="$2"; shift 2 ;;
        --data_dir) data_dir="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown option '$1' (valid: --residuals, --seeds, --depth, --steps, --out_root, --doc_dir," \
                "-- train.py overrides)" >&2
           exit 2 ;;
    esac
done
overrides=("$@")

PYTHON=$(bash scripts/setup_env.sh | tail -n 1)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" prepare_shakespeare.py --tokenizer char --data_dir "$data_dir"

# Every step logged (the grad-norm curves); warm-up and evaluations scaled to the run; tiny's lr and min lr.
common=(configs/shakespeare.py configs/tiny.py --data_dir="$data_dir" --n_embd=64 --n_head=4 --batch_size=8
        --n_layer="$depth" --max_iters="$steps" --warmup_iters=$(( (steps + 9) / 10 ))
        --eval_interval=$(( (steps + 1) / 2 )) --eval_iters=20 --log_interval=1)

total=$(( $(wc -w <<< "$seeds") * $(wc -w <<< "$residuals") * 2 ))
done_runs=0 start=$SECONDS
for seed in $seeds; do
    for residual in $residuals; do
        for stream_dtype in float32 bfloat16; do
            done_runs=$((done_runs + 1))
            out_dir="$out_root/$residual-$stream_dtype-s$seed"
            if [ -f "$out_dir/done" ]; then
                echo "[$done_runs/$total] skip $out_dir (finished)"
                continue
            fi
            rm -rf "$out_dir"
            mkdir -p "$out_dir"
            run_start=$SECONDS
            "$PYTHON" train.py "${common[@]}" "configs/$residual.py" --stream_dtype="$stream_dtype" \
                --seed="$seed" --out_dir="$out_dir" "${overrides[@]}" > "$out_dir/train.log" 2>&1 \
                || { tail -n 20 "$out_dir/train.log" >&2; echo "failed: $out_dir" >&2; exit 1; }
            echo "$((SECONDS - run_start))" > "$out_dir/wall_s"
            echo "[$done_runs/$total, $((SECONDS - start)) s] $out_dir ($((SECONDS - run_start)) s):" \
                 "$(grep 'eval step' "$out_dir/train.log" | tail -n 1)"
        done
    done
done
wall_s=$((SECONDS - start))
echo "trainings: $wall_s s wall"

study_command="bash scripts/bf16_streams_study.sh --residuals \"$residuals\" --seeds \"$seeds\" --depth $depth"
study_command+=" --steps $steps"
if [ ${#overrides[@]} -gt 0 ]; then
    study_command+=" -- ${overrides[*]}"
fi
"$PYTHON" analysis/bf16_streams.py --runs "$out_root/*" --out "$doc_dir" --study_command "$study_command" \
    --wall_s "$wall_s"
