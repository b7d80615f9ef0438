#!/usr/bin/env bash
# The paper's Table 1 runs: {openwebtext, fineweb_edu} x {S, M, L} x {res, hc, mhc, mhclite}, per seed.
#   bash scripts/sweep_table1.sh --nproc 8                        # all 24 runs, one 8-GPU node
#   bash scripts/sweep_table1.sh --nproc 1 --datasets openwebtext --sizes S --seeds "1337 1338"
#   bash scripts/sweep_table1.sh --residuals "mhc mhclite" --dry_run   # print the commands only
#   bash scripts/sweep_table1.sh --nproc 8 -- --wandb_log=True    # settings after -- go to train.py
#   bash scripts/sweep_table1.sh --nproc 8 --authors              # the paper as the authors' code ran it
#   bash scripts/sweep_table1.sh --nproc 8 --hellaswag            # and score each finished run on HellaSwag
# Each run writes <out_root>/<dataset>-<size>-<residual>-s<seed>/ with its train.log (--out_root
# DIR, default out/ in the repository); --authors adds configs/authors.py (docs/faithfulness.md) to
# every run and writes <dataset>-<size>-<residual>-authors-s<seed>/. A run with a `done` marker is
# skipped; every other run starts with --init_from=auto, so a run cut short continues from its
# checkpoint and a new one starts from scratch. --hellaswag runs analysis/hellaswag.py on every finished run that has no
# hellaswag.json yet (--hellaswag_data FILE: a local copy of the items instead of the hub's).
# A failed run is reported and the sweep goes on (exit status 1 at the end). Ctrl-C, or SIGTERM
# to the process group (kill -TERM -- -PGID, as schedulers do): the running job saves a
# checkpoint and exits, then the sweep stops; rerun the same command to resume.
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
NPROC=1
SEEDS="1337"
DATASETS="openwebtext fineweb_edu"
SIZES="S M L"
RESIDUALS="res hc mhc mhclite"
OUT_ROOT=$PWD/out
DRY_RUN=0
AUTHORS=0
HELLASWAG=0
HELLASWAG_DATA=Rowan/hellaswag
EXTRA=()

die() { echo "error: $*" >&2; exit 2; }
value_of() { [ $# -ge 2 ] || die "$1 needs a value"; echo "$2"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) NPROC=$(value_of "$@"); shift 2 ;;
        --seeds) SEEDS=$(value_of "$@"); shift 2 ;;
        --datasets) DATASETS=$(value_of "$@"); shift 2 ;;
        --sizes) SIZES=$(value_of "$@"); shift 2 ;;
        --residuals) RESIDUALS=$(value_of "$@"); shift 2 ;;
        --out_root) OUT_ROOT=$(value_of "$@"); shift 2 ;;
        --dry_run) DRY_RUN=1; shift ;;
        --authors) AUTHORS=1; shift ;;
        --hellaswag) HELLASWAG=1; shift ;;
        --hellaswag_data) HELLASWAG_DATA=$(value_of "$@"); shift 2 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown option '$1'; valid: --nproc --seeds --datasets --sizes --residuals --out_root --dry_run --authors --hellaswag --hellaswag_data --" ;;
    esac
done

[[ "$OUT_ROOT" = /* ]] || OUT_ROOT="$CALLER_DIR/$OUT_ROOT"  # relative to where the sweep was started
# a local HellaSwag file relative to where the sweep was started; anything else is a hub dataset name
if [[ "$HELLASWAG_DATA" != /* && -e "$CALLER_DIR/$HELLASWAG_DATA" ]]; then HELLASWAG_DATA="$CALLER_DIR/$HELLASWAG_DATA"; fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$NPROC'"
dataset_config() {
    case "$1" in
        openwebtext) echo configs/owt.py ;;
        fineweb_edu) echo configs/fineweb_edu.py ;;
        *) die "unknown dataset '$1'; valid: openwebtext, fineweb_edu" ;;
    esac
}
for d in $DATASETS; do dataset_config "$d" >/dev/null; done
for s in $SIZES; do
    case "$s" in tiny|S|M|L) ;; *) die "unknown size '$s'; valid: S, M, L (or tiny)" ;; esac
done
for r in $RESIDUALS; do
    case "$r" in res|hc|mhc|mhclite) ;; *) die "unknown residual '$r'; valid: res, hc, mhc, mhclite" ;; esac
done
for seed in $SEEDS; do [[ "$seed" =~ ^[0-9]+$ ]] || die "seeds must be integers, got '$seed'"; done

SETTINGS=()
RUN_SUFFIX=""
if [ "$AUTHORS" = 1 ]; then SETTINGS=(configs/authors.py); RUN_SUFFIX=-authors; fi

failed=()
# HellaSwag of a finished run, once (its hellaswag.json marks it done)
score_hellaswag() {
    local out=$1
    [ "$HELLASWAG" = 1 ] && [ ! -f "$out/hellaswag.json" ] || return 0
    local score=("$PYTHON" analysis/hellaswag.py "--out_dir=$out" "--data=$HELLASWAG_DATA")
    if [ "$DRY_RUN" = 1 ]; then
        printf '%q ' "${score[@]}"
        echo
        return 0
    fi
    "${score[@]}" 2>&1 | tee -a "$out/train.log" || failed+=("$out: hellaswag")
}
# bash runs a trap once the foreground job is over, i.e. after train.py has saved its checkpoint
trap 'echo "sweep stopped by SIGINT; rerun the same command to resume" >&2; exit 130' INT
trap 'echo "sweep stopped by SIGTERM; rerun the same command to resume" >&2; exit 143' TERM
for seed in $SEEDS; do
    for dataset in $DATASETS; do
        for size in $SIZES; do
            for residual in $RESIDUALS; do
                out="$OUT_ROOT/$dataset-$size-$residual$RUN_SUFFIX-s$seed"
                if [ -f "$out/done" ]; then
                    echo "skip (finished): $out"
                    score_hellaswag "$out"
                    continue
                fi
                cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py
                     "$(dataset_config "$dataset")" "configs/$size.py" "configs/$residual.py")
                cmd+=("${SETTINGS[@]}")
                cmd+=("--seed=$seed" "--out_dir=$out" --init_from=auto)
                cmd+=("${EXTRA[@]}")
                if [ "$DRY_RUN" = 1 ]; then
                    printf '%q ' "${cmd[@]}"
                    echo
                    score_hellaswag "$out"
                    continue
                fi
                mkdir -p "$out"
                echo "=== $out"
                rc=0
                # the logger ignores SIGINT / SIGTERM so it records train.py's last lines as it saves
                "${cmd[@]}" 2>&1 | (trap '' TERM; exec tee -i -a "$out/train.log") || rc=$?
                if [ "$rc" = 0 ]; then score_hellaswag "$out"; else failed+=("$out (exit $rc)"); fi
            done
        done
    done
done

if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
