"""The larger-n study: mHC (Sinkhorn) against mHC-lite with all n! or K sampled permutation matrices
and KromHC (Kronecker products of small factors), at several stream counts n. From the runs of
scripts/larger_n_study.sh it reports per configuration, over seeds: val loss, median step time, the
connections' parameters and the row and column sums of H_res per matrix and over the product of all
wrappers; it writes larger_n.md, larger_n.png and
larger_n.json.

    python analysis/larger_n.py --runs out/larger_n/* --out docs
"""
import argparse
import json
import math
import os
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

from analysis.collect import collect
from analysis.colsum_box import sum_stats
from analysis.common import (VARIANT_COLORS, VARIANT_NAMES, AnalysisError, after_warmup, find_runs,
                             format_mean_std, machine_line, seed_summary)
from checkpoint import CheckpointError, find_checkpoint
from residuals import kronecker_factors
from sample import load_model

STUDY_VARIANTS = ("res", "mhc", "mhclite", "kromhc")
METRICS = ("val_loss", "step_ms", "matrix_col_dev", "matrix_row_dev", "product_col_dev", "product_row_dev")


def configuration(run):
    """(residual, n, K, sampling) of a run; K and sampling are None except for mhclite."""
    cfg = run.config
    if run.residual not in STUDY_VARIANTS:
        raise AnalysisError(f"run '{run.path}' is {run.residual}; the larger-n study compares "
                            f"{', '.join(STUDY_VARIANTS)}")
    if run.residual == "res":
        return ("res", 1, None, None)
    n = cfg["n_streams"]
    if run.residual in ("mhc", "kromhc"):
        return (run.residual, n, None, None)
    k = cfg.get("mhclite_perms") or math.factorial(n)
    sampling = "all" if k == math.factorial(n) else cfg.get("mhclite_perm_sampling", "uniform")
    return ("mhclite", n, k, sampling)


def label(config):
    residual, n, k, sampling = config
    if residual == "res":
        return VARIANT_NAMES["res"]
    if residual == "mhc":
        return f"{VARIANT_NAMES['mhc']} n={n}"
    if residual == "kromhc":
        return f"{VARIANT_NAMES['kromhc']} n={n} = {' x '.join(map(str, kronecker_factors(n)))}"
    return f"{VARIANT_NAMES['mhclite']} n={n} K={k}" + ("" if sampling in ("all", "uniform") else f" {sampling}")


def config_sort_key(config):
    residual, n, k, sampling = config
    return (n, STUDY_VARIANTS.index(residual), k or 0, sampling or "")


def measure_run(run, work_dir, num_seqs, seq_len, skip):
    """One row of the study: the run's configuration, losses, timing, parameters and H_res sums."""
    val_loss = run.evals["val_loss"]
    if len(val_loss) == 0:
        raise AnalysisError(f"run '{run.path}' has no evaluation in its metrics.jsonl")
    ckpt = find_checkpoint(run.path)
    model, _ = load_model(ckpt)
    row = dict(run=run.path, config=configuration(run), seed=run.seed, step=int(run.train["step"][-1]),
               val_loss=float(val_loss[-1]), step_ms=float(np.median(after_warmup(run, "step_ms", skip))),
               connection_params=model.parameter_counts()["connections"])
    if run.residual == "res":
        return {**row, **{m: math.nan for m in METRICS[2:]}}
    npz = os.path.join(work_dir, f"{len(os.listdir(work_dir))}.npz")
    collect(ckpt, npz, num_seqs, min(seq_len, model.config.block_size), batch_size=8)
    dev = sum_stats(npz)["max_dev"]
    return {**row, "matrix_col_dev": dev["per_matrix"]["col"], "matrix_row_dev": dev["per_matrix"]["row"],
            "product_col_dev": dev["product"]["col"], "product_row_dev": dev["product"]["row"]}


def summarise(rows):
    """Rows grouped by configuration: mean and std over seeds of every metric."""
    by_config = {}
    for row in rows:
        by_config.setdefault(row["config"], []).append(row)
    summary = []
    for config in sorted(by_config, key=config_sort_key):
        members = sorted(by_config[config], key=lambda r: r["seed"])
        entry = dict(config=config, label=label(config), seeds=[r["seed"] for r in members],
                     step=members[0]["step"], connection_params=members[0]["connection_params"])
        summary.append({**entry, **seed_summary(members, METRICS)})
    return summary


def fmt(entry, metric, digits=4, scientific=False):
    return format_mean_std(entry[metric], entry[metric + "_std"], entry[metric + "_n"], digits, scientific)


def table_markdown(summary):
    lines = ["| configuration | seeds | connection params | val loss | step ms (median) | "
             "max abs(colsum-1), per matrix | max abs(rowsum-1), per matrix | max abs(colsum-1), product |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in summary:
        lines.append(f"| {e['label']} | {len(e['seeds'])} | {e['connection_params']:,} | {fmt(e, 'val_loss')} | "
                     f"{fmt(e, 'step_ms', 1)} | {fmt(e, 'matrix_col_dev', scientific=True)} | "
                     f"{fmt(e, 'matrix_row_dev', scientific=True)} | {fmt(e, 'product_col_dev', scientific=True)} |")
    return "\n".join(lines) + "\n"


def plot(summary, path):
    """Three panels over the configurations: val loss, step time, max |colsum - 1| (log scale)."""
    labels = [e["label"] for e in summary]
    colors = [VARIANT_COLORS[e["config"][0]] for e in summary]
    x = np.arange(len(summary))
    fig, axes = plt.subplots(1, 3, figsize=(5 + 1.4 * len(summary), 4.2))
    panels = (("val_loss", "final val loss", False), ("step_ms", "median step time (ms)", False),
              ("matrix_col_dev", "max |colsum - 1| of H_res", True))
    for ax, (metric, title, log) in zip(axes, panels):
        values = np.array([e[metric] for e in summary])
        stds = np.array([e[metric + "_std"] for e in summary])
        shown = ~np.isnan(values)
        ax.bar(x[shown], values[shown], yerr=stds[shown] if len(summary[0]["seeds"]) > 1 else None,
               color=[c for c, s in zip(colors, shown) if s], capsize=3)
        if log:
            ax.set_yscale("log")
        else:
            lo, hi = values[shown].min(), values[shown].max()
            margin = max((hi - lo) * 0.5, abs(hi) * 0.01)
            ax.set_ylim(lo - margin if metric == "val_loss" else 0, hi + margin)
        ax.set_title(title)
        ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_study(run_paths, out_dir, command, num_seqs=64, seq_len=1024, skip=None, study_command=None):
    runs = find_runs(run_paths, exclude=out_dir, cell_of=lambda run: (*run.group, *configuration(run), run.seed))
    steps = sorted({int(run.train["step"][-1]) for run in runs if len(run.train["step"])})
    if len(steps) > 1:
        raise AnalysisError(f"the runs stopped at different steps ({', '.join(map(str, steps))}); "
                            "compare runs of the same length")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as work_dir:
        rows = [measure_run(run, work_dir, num_seqs, seq_len, skip) for run in runs]
    summary = summarise(rows)
    figure = os.path.join(out_dir, "larger_n.png")
    plot(summary, figure)
    with open(os.path.join(out_dir, "larger_n.json"), "w") as f:
        json.dump(dict(rows=rows, summary=summary), f, indent=1)

    first = runs[0].config
    md = ["# Larger n: mHC-lite with sampled permutations, and KromHC\n",
          "mHC-lite is exactly doubly stochastic with any set of permutation matrices, so for n > 5 it can "
          "use K of them instead of all n! (the paper's Sec. 6). The identity is always in the set; the rest "
          "are drawn without repetition by a seeded generator and stored in the checkpoint "
          "(`mhclite_perms`, `mhclite_perm_sampling`, `perm_seed`; see `residuals.permutations`). "
          "KromHC is exact too, with all the permutations of each of its small factors "
          "(`residuals.kronecker_factors`). "
          "mHC (20 Sinkhorn iterations) at the same n is the reference.\n",
          f"Setting: {first['dataset']}, size {first['size']}, {summary[0]['step']} steps, "
          f"batch {first['batch_size']} x block {first['block_size']}, {first['dtype']}, "
          f"compile={first['compile']}, seeds {sorted({s for e in summary for s in e['seeds']})}.\n",
          "Val loss is the last evaluation of each run; step time is the median logged step time "
          "after the first 10% of the steps; the column and row sums are measured on each final "
          f"checkpoint over {num_seqs} training sequences (all wrappers and tokens). With several "
          "seeds, values are mean ± std over seeds.\n",
          table_markdown(summary),
          f"![val loss, step time and column-sum error per configuration]({os.path.basename(figure)})\n",
          "## Reproduce\n",
          "```bash\n" + (study_command + "\n" if study_command else "") + command + "\n```\n",
          f"Measured on: {machine_line()}.\n"]
    path = os.path.join(out_dir, "larger_n.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path, summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run directories written by train.py")
    p.add_argument("--out", default="out/larger_n_report", help="folder for larger_n.md, .png and .json")
    p.add_argument("--num_seqs", type=int, default=64, help="training sequences collected per checkpoint")
    p.add_argument("--seq_len", type=int, default=1024, help="tokens per sequence (capped at the block size)")
    p.add_argument("--skip", type=int, default=None, help="logged warm-up steps left out of the step time "
                                                          "(default 10%%)")
    p.add_argument("--study_command", default=None, help="the command that trained the runs, quoted in the page")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    shown = [a for i, a in enumerate(argv)  # the page quotes --study_command on its own line
             if not a.startswith("--study_command") and not (i and argv[i - 1] == "--study_command")]
    command = "python analysis/larger_n.py " + shlex.join(shown)
    try:
        if args.num_seqs < 1 or args.seq_len < 1:
            raise AnalysisError("--num_seqs and --seq_len must be at least 1")
        path, summary = write_study(args.runs, args.out, command, args.num_seqs, args.seq_len, args.skip,
                                    args.study_command)
    except (AnalysisError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(table_markdown(summary))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
