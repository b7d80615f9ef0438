"""Boxplots of H_res column sums (the paper's figure) from collect.py files, for the HC family:
per matrix, and for the product over all wrappers in forward order (per token, float64: the map from
the input streams to the output streams). Box statistics use all values; only the drawn outliers are
a seeded subsample. Prints max |colsum - 1| and max |rowsum - 1|.

    python analysis/colsum_box.py --npz out/analysis/collect/*.npz --out out/analysis
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import cbook

from analysis.common import (HC_FAMILY, VARIANT_COLORS, VARIANT_NAMES, AnalysisError, group_label, group_slug,
                             group_sort_key, load_collected)

PANELS = ("per_matrix", "product")
PANEL_TITLES = {"per_matrix": "per matrix", "product": "product over all wrappers"}


def composite(h_res):
    """(W, N, n, n) -> (N, n, n) float64: H_{W-1} @ ... @ H_0 for every token."""
    product = h_res[0].astype(np.float64)
    for h in h_res[1:]:
        product = h.astype(np.float64) @ product
    return product


def sum_stats(path):
    """Column sums and max deviations of one collected model.
    {"variant", "group", "seed", "colsums": {panel: values}, "max_dev": {panel: {"col", "row"}}}"""
    data = load_collected(path)
    if data["variant"] not in HC_FAMILY:
        raise AnalysisError(f"'{path}' holds a {data['residual']} model, which has no H_res")
    h_res = data["h_res"]
    matrices = {"per_matrix": h_res, "product": composite(h_res)}
    colsums, max_dev = {}, {}
    for panel, m in matrices.items():
        col = m.sum(axis=-2, dtype=np.float64)  # column j: how much of input stream j is passed on
        row = m.sum(axis=-1, dtype=np.float64)
        colsums[panel] = col.ravel()
        max_dev[panel] = {"col": float(np.abs(col - 1).max()), "row": float(np.abs(row - 1).max())}
    return {"path": path, "variant": data["variant"], "group": (data["dataset"], data["size"]),
            "seed": data["run_seed"], "colsums": colsums, "max_dev": max_dev}


def format_stats(stats):
    d = stats["max_dev"]
    return (f"{group_label(stats['group'])} {box_label(stats, True)}: per matrix max|colsum-1| "
            f"{d['per_matrix']['col']:.3e} max|rowsum-1| {d['per_matrix']['row']:.3e}; product max|colsum-1| "
            f"{d['product']['col']:.3e} max|rowsum-1| {d['product']['row']:.3e}")


def box_label(stats, with_seed):
    name = VARIANT_NAMES[stats["variant"]]
    return f"{name} s{stats['seed']}" if with_seed else name


def box_stats(values, label, rng, max_fliers):
    """matplotlib box statistics of all values; the outliers kept for drawing are subsampled."""
    stats = cbook.boxplot_stats(values, labels=[label])[0]
    if len(stats["fliers"]) > max_fliers:
        stats["fliers"] = rng.choice(stats["fliers"], size=max_fliers, replace=False)
    return stats


def plot_group(group, members, out_dir, seed=0, max_fliers=2000, sharey=False):
    """members: sum_stats of one (dataset, size), any of the HC family; writes colsum_<group>.png
    with a row per panel (per matrix, product) and a column per model, each on its own y scale
    unless `sharey` (hc's spread would otherwise flatten the others)."""
    members = sorted(members, key=lambda s: (HC_FAMILY.index(s["variant"]), s["seed"]))
    variants = [s["variant"] for s in members]
    with_seed = len(set(variants)) < len(variants)
    rng = np.random.default_rng(seed)
    fig, axes = plt.subplots(len(PANELS), len(members), figsize=(1.5 + 2.6 * len(members), 7),
                             squeeze=False, sharey="row" if sharey else False)
    for row, panel in zip(axes, PANELS):
        for ax, stats in zip(row, members):
            box = box_stats(stats["colsums"][panel], box_label(stats, with_seed), rng, max_fliers)
            artists = ax.bxp([box], patch_artist=True, widths=0.5,
                             flierprops=dict(marker=".", markersize=2, alpha=0.4))
            artists["boxes"][0].set_facecolor(VARIANT_COLORS[stats["variant"]])
            artists["boxes"][0].set_alpha(0.6)
            ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
            ax.set_title(f"{PANEL_TITLES[panel]}\nmax|colsum-1| = {stats['max_dev'][panel]['col']:.2e}", fontsize=9,
                         pad=14)  # room for the axis offset text
        row[0].set_ylabel("column sum of H_res")
    fig.suptitle(f"{group_label(group)}: H_res column sums (all tokens; at most {max_fliers} outliers drawn per box)")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"colsum_{group_slug(group)}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_colsums(paths, out_dir, seed=0, max_fliers=2000, sharey=False):
    """One PNG per (dataset, size) among the npz files; returns [(group, path, [sum_stats])]."""
    groups = {}
    for path in paths:
        stats = sum_stats(path)
        groups.setdefault(stats["group"], []).append(stats)
    return [(g, plot_group(g, groups[g], out_dir, seed, max_fliers, sharey), groups[g])
            for g in sorted(groups, key=group_sort_key)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--npz", nargs="+", required=True, help="collect.py files of HC-family models")
    p.add_argument("--out", default="out/analysis", help="folder for colsum_<dataset>-<size>.png")
    p.add_argument("--seed", type=int, default=0, help="seed of the outlier subsample")
    p.add_argument("--max_fliers", type=int, default=2000, help="outliers drawn per box at most")
    p.add_argument("--sharey", action="store_true", help="one y scale per row instead of one per box")
    args = p.parse_args(argv)
    try:
        if args.max_fliers < 0:
            raise AnalysisError(f"--max_fliers must be >= 0, got {args.max_fliers}")
        results = plot_colsums(args.npz, args.out, args.seed, args.max_fliers, args.sharey)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for _, path, members in results:
        for stats in members:
            print(format_stats(stats))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
