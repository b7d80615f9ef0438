"""Training throughput per variant from metrics.jsonl: mean tokens/s of each run after a warm-up
(`--skip` logged steps, default the first 10%), as a bar chart with the ratio to res, one per
(dataset, size) group. The first step of every start and resume (its compilation) is logged apart
by train.py, so it never enters the mean; it is printed next to the throughput. Runs compare only on
the same hardware; bench.py measures the variants side by side.

    python analysis/throughput.py --runs out/* --out out/analysis
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

from analysis.common import (VARIANT_COLORS, VARIANT_NAMES, VARIANTS, AnalysisError, after_warmup, find_runs,
                             group_label, group_runs, group_slug)


def run_throughput(run, skip=None):
    """Mean tokens/s of one run after dropping the first `skip` logged steps (10% by default)
    and the null timings of windows that held only a first step."""
    kept = after_warmup(run, "tokens_per_s", skip)
    return float(np.mean(kept)), len(kept)


def start_first_step_s(run):
    """Seconds of the first step of the run's start (compilation included), None if not logged."""
    steps, seconds = run.first_steps["step"], run.first_steps["first_step_s"]
    return float(seconds[0]) if len(steps) and steps[0] == 1 else None


def group_throughput(by_variant, skip=None):
    """{variant: {"mean", "std" (over seeds, 0 for one), "seeds", "steps", "ratio_to_res",
    "first_step_s" (mean over the runs that logged it, else None)}}."""
    stats = {}
    for variant in VARIANTS:
        if variant not in by_variant:
            continue
        per_run = [run_throughput(r, skip) for r in by_variant[variant]]
        means = [m for m, _ in per_run]
        first_steps = [s for s in map(start_first_step_s, by_variant[variant]) if s is not None]
        stats[variant] = {"mean": float(np.mean(means)), "std": float(np.std(means, ddof=1)) if len(means) > 1 else 0.0,
                          "seeds": len(means), "steps": sum(n for _, n in per_run),
                          "first_step_s": float(np.mean(first_steps)) if first_steps else None}
    for s in stats.values():
        s["ratio_to_res"] = s["mean"] / stats["res"]["mean"] if "res" in stats else None
    return stats


def format_stats(group, stats):
    lines = [f"{group_label(group)}: tokens/s (mean over steps after warm-up; +/- std over seeds)"]
    for variant, s in stats.items():
        ratio = "" if s["ratio_to_res"] is None else f"  x{s['ratio_to_res']:.3f} of res"
        first = "" if s["first_step_s"] is None else f"  first step {s['first_step_s']:.2f} s"
        lines.append(f"  {VARIANT_NAMES[variant]:9s} {s['mean']:12.1f} +/- {s['std']:.1f}"
                     f"  ({s['seeds']} run(s), {s['steps']} steps){ratio}{first}")
    if "res" not in stats:
        lines.append("  (no res run: no ratios)")
    return "\n".join(lines)


def plot_group(group, stats, out_dir):
    variants = list(stats)
    fig, ax = plt.subplots(figsize=(6, 4))
    means = [stats[v]["mean"] for v in variants]
    bars = ax.bar([VARIANT_NAMES[v] for v in variants], means, yerr=[stats[v]["std"] for v in variants],
                  color=[VARIANT_COLORS[v] for v in variants], capsize=4)
    for bar, v in zip(bars, variants):
        ratio = stats[v]["ratio_to_res"]
        text = f"{stats[v]['mean']:,.0f}" + ("" if ratio is None else f"\nx{ratio:.3f}")
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    xytext=(0, 2), textcoords="offset points", fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_ylim(0, max(means) * 1.25)
    ax.set_title(f"{group_label(group)}: training throughput" + (" (xN = ratio to res)" if "res" in stats else ""))
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"throughput_{group_slug(group)}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughputs(runs, out_dir, skip=None):
    """One bar chart per (dataset, size) group; returns [(group, path, stats, printed text)]."""
    results = []
    for group, by_variant in group_runs(runs).items():
        stats = group_throughput(by_variant, skip)
        results.append((group, plot_group(group, stats, out_dir), stats, format_stats(group, stats)))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run directories (config.json + metrics.jsonl)")
    p.add_argument("--out", default="out/analysis", help="folder for throughput_<dataset>-<size>.png")
    p.add_argument("--skip", type=int, default=None, help="warm-up: logged steps dropped per run (default 10%%)")
    args = p.parse_args(argv)
    try:
        if args.skip is not None and args.skip < 0:
            raise AnalysisError(f"--skip must be >= 0, got {args.skip}")
        runs = find_runs(args.runs, exclude=args.out)
        results = plot_throughputs(runs, args.out, args.skip)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for _, path, _, text in results:
        print(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
