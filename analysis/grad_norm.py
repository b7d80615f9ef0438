"""Gradient-norm curves as in the paper's figure: left all variants, right a zoom on mhc vs
mhclite; moving average over the last `--window` logged steps (default 200, shortened for short
runs) with a +/- one std band of the same window. One PNG per (dataset, size) group.

    python analysis/grad_norm.py --runs out/* --out out/analysis
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from analysis.common import (VARIANT_COLORS, VARIANT_NAMES, VARIANTS, AnalysisError, effective_window,
                             find_runs, group_label, group_runs, group_slug, moving_stats)

ZOOM_VARIANTS = ("mhc", "mhclite")
LINESTYLES = ("-", "--", ":", "-.")  # one per seed of a variant


def smoothed_curves(by_variant, window):
    """{variant: [(label, steps, mean, std)]} with one moving window for the whole group."""
    curves = {}
    for variant in VARIANTS:
        runs = by_variant.get(variant, [])
        for run in runs:
            mean, std = moving_stats(run.train["grad_norm"], window)
            label = VARIANT_NAMES[variant] + (f" (seed {run.seed})" if len(runs) > 1 else "")
            curves.setdefault(variant, []).append((label, run.train["step"][window - 1:], mean, std))
    return curves


def draw(ax, curves, variants):
    for variant in variants:
        for i, (label, steps, mean, std) in enumerate(curves.get(variant, [])):
            color = VARIANT_COLORS[variant]
            ax.plot(steps, mean, color=color, label=label, linewidth=1.2, linestyle=LINESTYLES[i % len(LINESTYLES)])
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (before clipping)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()


def plot_group(group, by_variant, out_dir, window=200):
    """Writes grad_norm_<dataset>-<size>.png; returns (path, window used)."""
    lengths = [len(r.train["grad_norm"]) for runs in by_variant.values() for r in runs]
    if min(lengths) == 0:
        raise AnalysisError(f"a {group_label(group)} run has no logged training steps")
    used = effective_window(window, min(lengths))
    if used != window:
        print(f"note: {group_label(group)}: moving-average window {window} -> {used} "
              f"(the shortest run has {min(lengths)} logged steps)")
    curves = smoothed_curves(by_variant, used)
    fig, (ax_all, ax_zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    draw(ax_all, curves, VARIANTS)
    ax_all.set_title("all variants")
    draw(ax_zoom, curves, ZOOM_VARIANTS)
    ax_zoom.set_title("zoom: mHC vs mHC-lite")
    if not ax_zoom.lines:
        ax_zoom.text(0.5, 0.5, "no mHC or mHC-lite runs", ha="center", va="center", transform=ax_zoom.transAxes)
    fig.suptitle(f"{group_label(group)}: gradient norm, {used}-step moving average, shaded +/- 1 std")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"grad_norm_{group_slug(group)}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, used


def plot_grad_norms(runs, out_dir, window=200, datasets=None, sizes=None):
    """One PNG per selected (dataset, size) group; returns [(group, path, window used)]."""
    results = []
    for group, by_variant in group_runs(runs).items():
        if (datasets and group[0] not in datasets) or (sizes and group[1] not in sizes):
            continue
        path, used = plot_group(group, by_variant, out_dir, window)
        results.append((group, path, used))
    if not results:
        raise AnalysisError("no run matches --datasets/--sizes")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run directories (config.json + metrics.jsonl)")
    p.add_argument("--out", default="out/analysis", help="folder for grad_norm_<dataset>-<size>.png")
    p.add_argument("--window", type=int, default=200, help="moving-average window in logged steps")
    p.add_argument("--datasets", nargs="+", help="only these datasets")
    p.add_argument("--sizes", nargs="+", help="only these sizes")
    args = p.parse_args(argv)
    try:
        if args.window < 1:
            raise AnalysisError(f"--window must be at least 1, got {args.window}")
        runs = find_runs(args.runs, exclude=args.out)
        results = plot_grad_norms(runs, args.out, args.window, args.datasets, args.sizes)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for _, path, _ in results:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
