"""Histograms of log(1/nu) of mHC's Sinkhorn inputs (paper Fig. "Distribution of log(1/nu)").
nu = min entry / max entry of exp(logits), so per token and wrapper log(1/nu) = max - min of
the n x n logits matrix collected by analysis/collect.py. Prints and annotates the fraction above
`--threshold` (30: 1/nu > 1e13, where 20 Sinkhorn iterations may not converge).

    python analysis/nu_hist.py --npz out/analysis/collect/*-mhc-*.npz --out out/analysis
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

from analysis.common import VARIANT_COLORS, VARIANT_NAMES, AnalysisError, dataset_name, load_collected


def log_inv_nu(logits):
    """(..., n, n) logits -> (...) max - min in float64 (max and min are exact in float32)."""
    flat = logits.reshape(*logits.shape[:-2], -1)
    return flat.max(axis=-1).astype(np.float64) - flat.min(axis=-1)


def load_mhc(path):
    data = load_collected(path, arrays=())
    if data["residual"] != "mhc":
        raise AnalysisError(f"'{path}' holds a {data['residual']} model; log(1/nu) is about the Sinkhorn input, "
                            "which only mhc has")
    return load_collected(path, arrays=("logits",))


def nu_stats(path, threshold=30.0):
    """{"path", "label", "values" (W * N log(1/nu) values), "count", "fraction_above", "median", "max"}."""
    data = load_mhc(path)
    values = log_inv_nu(data["logits"]).ravel()
    label = (f"{VARIANT_NAMES[data['variant']]} {dataset_name(data['dataset'])} {data['size']} "
             f"seed {data['run_seed']} ({data['n_layer']} layers, step {data['step']})")
    return {"path": path, "label": label,
            "values": values, "count": values.size, "fraction_above": float(np.mean(values > threshold)),
            "median": float(np.median(values)), "max": float(values.max()), "threshold": threshold}


def format_stats(stats):
    return (f"{stats['label']}: {100 * stats['fraction_above']:.2f}% of {stats['count']} Sinkhorn inputs have "
            f"log(1/nu) > {stats['threshold']:g}; median {stats['median']:.2f}, max {stats['max']:.2f}")


def plot_nu_hists(paths, out_dir, threshold=30.0, bins=100):
    """One panel per mhc npz in nu_hist.png; returns (path, [stats])."""
    all_stats = [nu_stats(p, threshold) for p in paths]
    fig, axes = plt.subplots(1, len(all_stats), figsize=(5.5 * len(all_stats), 4), squeeze=False)
    for ax, stats in zip(axes[0], all_stats):
        # log(1/nu) >= 0; the range reaches past the threshold so panels read alike
        upper = max(stats["max"], threshold) * 1.05
        ax.hist(stats["values"], bins=bins, range=(0.0, upper), color=VARIANT_COLORS["mhc"], alpha=0.85)
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1)
        ax.text(0.97, 0.95, f"{100 * stats['fraction_above']:.1f}% > {threshold:g}\n(1/nu > {math.exp(threshold):.1e})",
                transform=ax.transAxes, ha="right", va="top", fontsize=9,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.8))
        ax.set_xlabel("log(1/nu) = max - min of the Sinkhorn logits")
        ax.set_ylabel("count (tokens x wrappers)")
        ax.set_title(stats["label"], fontsize=10)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "nu_hist.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, all_stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--npz", nargs="+", required=True, help="collect.py files of mhc models")
    p.add_argument("--out", default="out/analysis", help="folder for nu_hist.png")
    p.add_argument("--threshold", type=float, default=30.0)
    p.add_argument("--bins", type=int, default=100)
    args = p.parse_args(argv)
    try:
        if args.bins < 1:
            raise AnalysisError(f"--bins must be at least 1, got {args.bins}")
        path, all_stats = plot_nu_hists(args.npz, args.out, args.threshold, args.bins)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for stats in all_stats:
        print(format_stats(stats))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
