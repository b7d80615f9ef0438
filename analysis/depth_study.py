"""The depth study: do the HC family's deviations from doubly stochastic grow with depth, and does
training turn unstable? From the runs of scripts/depth_study.sh it measures per run the val loss,
divergence, gradient-norm spikes and the row and column sums of every H_res and of their product over
depth (on held-out text), and writes depth_study.md with the mean and std over seeds, its figures and
depth_study.json.

    python analysis/depth_study.py --runs 'out/depth_study/*' --out docs
"""
import argparse
import functools
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
from analysis.colsum_box import composite
from analysis.common import (HC_FAMILY, VARIANT_COLORS, VARIANT_NAMES, VARIANTS, AnalysisError, find_runs,
                             format_mean_std, load_collected, machine_line, seed_summary)
from analysis.nu_hist import log_inv_nu
from checkpoint import CheckpointError, find_checkpoint
from dataprep import unigram_entropy
from sample import load_model

MIXING = tuple(v for v in HC_FAMILY if v != "ihc")  # the variants whose H_res is learned
DEVIATIONS = ("matrix_col_dev", "matrix_row_dev", "product_col_dev", "product_col_dev_median", "product_row_dev")
METRICS = ("val_loss", "spikes", "grad_norm_max", "grad_norm_median", *DEVIATIONS, "log_inv_nu_median",
           "log_inv_nu_max")
LINESTYLES = ("-", "--", ":", "-.")  # one per seed


def setting(run):
    """(variant, depth, learning rate) of a run."""
    return (run.variant, int(run.config["n_layer"]), float(run.config["learning_rate"]))


def count_spikes(grad_norm, factor, window):
    """Steps t >= window with grad_norm[t] > factor * median(grad_norm[t - window : t])."""
    g = np.asarray(grad_norm, dtype=np.float64)
    if len(g) <= window:
        return 0
    medians = np.median(np.lib.stride_tricks.sliding_window_view(g[:-1], window), axis=1)
    return int(np.sum(g[window:] > factor * medians))


@functools.cache
def file_entropy(path):
    return unigram_entropy(np.memmap(path, dtype=np.uint16, mode="r"))


def val_entropy(run):
    """Unigram entropy (nats/token) of the run's val split, read from its val.bin."""
    path = os.path.join(run.config["data_dir"], run.config["dataset"], "val.bin")
    if not os.path.isfile(path):
        raise AnalysisError(f"val data of run '{run.path}' not found: {path}")
    return file_entropy(path)


def deviations(npz):
    """Row and column sums of every H_res and of their product over depth, and mhc's log(1/nu)."""
    is_mhc = load_collected(npz, arrays=())["residual"] == "mhc"
    data = load_collected(npz, arrays=("h_res", "logits") if is_mhc else ("h_res",))
    h_res = data["h_res"]
    product = composite(h_res)
    dev = lambda m, axis: np.abs(m.sum(axis=axis, dtype=np.float64) - 1)  # noqa: E731
    row = dict(matrix_col_dev=float(dev(h_res, -2).max()), matrix_row_dev=float(dev(h_res, -1).max()),
               product_col_dev=float(dev(product, -2).max()),
               product_col_dev_median=float(np.median(dev(product, -2))),
               product_row_dev=float(dev(product, -1).max()),
               log_inv_nu_median=math.nan, log_inv_nu_max=math.nan)
    if is_mhc:
        nu = log_inv_nu(data["logits"])
        row.update(log_inv_nu_median=float(np.median(nu)), log_inv_nu_max=float(nu.max()))
    return row


def measure_run(run, work_dir, num_seqs, seq_len, spike_factor, spike_window):
    """One row: the run's setting, outcome, gradient norms and H_res sums on held-out text."""
    variant, depth, lr = setting(run)
    losses = np.concatenate([run.train["train_loss"], run.train["grad_norm"]])
    val_loss = run.evals["val_loss"]
    entropy = val_entropy(run)
    finished = os.path.exists(os.path.join(run.path, "done"))
    non_finite = not np.all(np.isfinite(losses)) or os.path.exists(os.path.join(run.path, "diverged"))
    if not finished and not non_finite:
        raise AnalysisError(f"run '{run.path}' is unfinished (no 'done' marker and no non-finite loss); "
                            "finish it or leave it out")
    final_val = float(val_loss[-1]) if len(val_loss) else math.nan
    reason = ("non-finite loss" if non_finite else
              f"val loss {final_val:.3f} > unigram entropy {entropy:.3f}" if not final_val <= entropy else None)
    warmup = int(run.config["warmup_iters"])
    grad_norm = run.train["grad_norm"]
    after = grad_norm[(run.train["step"] > warmup) & np.isfinite(grad_norm)]
    wall_path = os.path.join(run.path, "wall_s")
    row = dict(run=run.path, variant=variant, depth=depth, lr=lr, seed=run.seed,
               steps=int(run.train["step"][-1]) if len(run.train["step"]) else 0,
               max_iters=int(run.config["max_iters"]), diverged=reason is not None, diverged_reason=reason,
               val_loss=final_val if reason is None else math.nan,
               spikes=count_spikes(grad_norm[np.isfinite(grad_norm)], spike_factor, spike_window),
               grad_norm_max=float(after.max()) if len(after) else math.nan,
               grad_norm_median=float(np.median(after)) if len(after) else math.nan,
               wall_s=float(open(wall_path).read()) if os.path.isfile(wall_path) else math.nan,
               grad_norm_curve=[[int(s), float(g)] for s, g in zip(run.train["step"], grad_norm)])
    ckpt = find_checkpoint(run.path)
    if variant not in MIXING or not os.path.exists(ckpt):  # res has no H_res, ihc's is I
        return {**row, **{m: math.nan for m in DEVIATIONS + ("log_inv_nu_median", "log_inv_nu_max")}}
    model, _ = load_model(ckpt)
    npz = os.path.join(work_dir, f"{len(os.listdir(work_dir))}.npz")
    collect(ckpt, npz, num_seqs, min(seq_len, model.config.block_size), batch_size=8, split="val")
    return {**row, **deviations(npz)}


def summarise(rows):
    """Rows grouped by (variant, depth, lr): mean and std over seeds; val loss over the runs that
    did not diverge."""
    by_setting = {}
    for row in rows:
        by_setting.setdefault((row["variant"], row["depth"], row["lr"]), []).append(row)
    summary = []
    for key in sorted(by_setting, key=lambda k: (k[2], VARIANTS.index(k[0]), k[1])):
        members = sorted(by_setting[key], key=lambda r: r["seed"])
        entry = dict(variant=key[0], depth=key[1], lr=key[2], seeds=[r["seed"] for r in members],
                     diverged=sum(r["diverged"] for r in members))
        summary.append({**entry, **seed_summary(members, METRICS)})
    return summary


def fmt(entry, metric, digits=3, scientific=False):
    return format_mean_std(entry[metric], entry[metric + "_std"], entry[metric + "_n"], digits, scientific)


def lr_label(lr):
    return f"lr {lr:g}"


def table_markdown(summary, lr):
    lines = ["| variant | depth | diverged | val loss | spikes | max grad norm | median grad norm | "
             "max abs(colsum-1), per matrix | max abs(rowsum-1), per matrix | max abs(colsum-1), product | "
             "median abs(colsum-1), product | mHC log(1/nu), median / max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in (e for e in summary if e["lr"] == lr):
        nu = "-" if math.isnan(e["log_inv_nu_median"]) else f"{e['log_inv_nu_median']:.1f} / {e['log_inv_nu_max']:.1f}"
        lines.append(f"| {VARIANT_NAMES[e['variant']]} | {e['depth']} | {e['diverged']}/{len(e['seeds'])} | "
                     f"{fmt(e, 'val_loss')} | {fmt(e, 'spikes', 1)} | {fmt(e, 'grad_norm_max', 2)} | "
                     f"{fmt(e, 'grad_norm_median', 2)} | {fmt(e, 'matrix_col_dev', scientific=True)} | "
                     f"{fmt(e, 'matrix_row_dev', scientific=True)} | {fmt(e, 'product_col_dev', scientific=True)} | "
                     f"{fmt(e, 'product_col_dev_median', scientific=True)} | {nu} |")
    return "\n".join(lines) + "\n"


def entries(summary, variant, lr):
    return sorted((e for e in summary if e["variant"] == variant and e["lr"] == lr), key=lambda e: e["depth"])


def plot_colsum(rows, summary, lrs, path):
    """Max |colsum - 1| of the product over depth against depth, one panel per learning rate,
    every seed a dot and the median over seeds a line (robust on a log scale); log scales."""
    fig, axes = plt.subplots(1, len(lrs), figsize=(5.5 * len(lrs), 4.2), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for variant in MIXING:
            es = [e for e in entries(summary, variant, lr) if not math.isnan(e["product_col_dev"])]
            if not es:
                continue
            color = VARIANT_COLORS[variant]
            dots = [(r["depth"], r["product_col_dev"]) for r in rows
                    if r["variant"] == variant and r["lr"] == lr and not math.isnan(r["product_col_dev"])]
            medians = [np.median([v for d, v in dots if d == e["depth"]]) for e in es]
            ax.plot([e["depth"] for e in es], medians, color=color, label=VARIANT_NAMES[variant], marker="o")
            ax.scatter(*zip(*dots), color=color, s=12, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlim(min(e["depth"] for e in summary) / 1.4, max(e["depth"] for e in summary) * 1.4)
        ax.set_xticks(sorted({e["depth"] for e in summary}), [str(d) for d in sorted({e["depth"] for e in summary})])
        ax.set_xlabel("depth (layers)")
        ax.set_ylabel("max |colsum - 1| of the product of all H_res")
        ax.set_title(lr_label(lr))
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grad_norm(rows, lrs, depth, path):
    """Per-step gradient norms (before clipping) of every run at `depth`: a row of panels per
    learning rate, a panel per variant that ran, a line per seed; one y scale per row."""
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    fig, axes = plt.subplots(len(lrs), len(variants), figsize=(3.6 * len(variants), 3.0 * len(lrs)),
                             squeeze=False, sharex=True, sharey="row")
    for ax_row, lr in zip(axes, lrs):
        for ax, variant in zip(ax_row, variants):
            runs = sorted((r for r in rows if r["variant"] == variant and r["lr"] == lr and r["depth"] == depth),
                          key=lambda r: r["seed"])
            for i, r in enumerate(runs):
                steps, norms = zip(*r["grad_norm_curve"])
                ax.plot(steps, norms, color=VARIANT_COLORS[variant], linestyle=LINESTYLES[i % len(LINESTYLES)],
                        linewidth=0.9, label=f"seed {r['seed']}")
            ax.set_yscale("log")
            ax.set_title(f"{VARIANT_NAMES[variant]}, {depth} layers, {lr_label(lr)}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if runs:
                ax.legend(fontsize=7)
        ax_row[0].set_ylabel("gradient norm\n(before clipping)")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_val_loss(rows, summary, lrs, path):
    """Final val loss against depth per learning rate: mean and std over the seeds that did not
    diverge; a cross at the top of the panel for every diverged run."""
    fig, axes = plt.subplots(1, len(lrs), figsize=(5.5 * len(lrs), 4.2), squeeze=False)
    depths = sorted({e["depth"] for e in summary})
    for ax, lr in zip(axes[0], lrs):
        finite = [e["val_loss"] for e in summary if e["lr"] == lr and not math.isnan(e["val_loss"])]
        top = max(finite) if finite else 1.0
        any_diverged = False
        for k, variant in enumerate(VARIANTS):
            es = [e for e in entries(summary, variant, lr) if not math.isnan(e["val_loss"])]
            offset = 1 + 0.03 * (k - 1.5)  # side by side, so the error bars do not hide each other
            color = VARIANT_COLORS[variant]
            if es:
                ax.errorbar([e["depth"] * offset for e in es], [e["val_loss"] for e in es],
                            yerr=[e["val_loss_std"] for e in es], color=color, marker="o", capsize=3,
                            label=VARIANT_NAMES[variant])
            bad = [r["depth"] * offset for r in rows if r["variant"] == variant and r["lr"] == lr and r["diverged"]]
            if bad:
                ax.scatter(bad, [top] * len(bad), color=color, marker="x", s=40)
                any_diverged = True
        if any_diverged:
            ax.scatter([], [], color="black", marker="x", label="diverged (drawn at the top)")
        ax.set_xscale("log", base=2)
        ax.set_xlim(depths[0] / 1.4, depths[-1] * 1.4)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_xlabel("depth (layers)")
        ax.set_ylabel("final val loss (mean ± std over seeds)")
        ax.set_title(lr_label(lr))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def per_run(rows, variant, lr, key, depth=None):
    return [r[key] for r in rows if r["variant"] == variant and r["lr"] == lr and depth in (None, r["depth"])]


def mean_and_noise(a, b):
    """(mean a - mean b, twice the standard error of the difference) of two lists of values."""
    se = math.sqrt(np.var(a) / len(a) + np.var(b) / len(b))
    return float(np.mean(a) - np.mean(b)), 2 * se


def reading(rows, summary, lrs, depths):
    """A plain-language reading, each sentence conditional on the numbers."""
    shallow, deep = depths[0], depths[-1]
    lines = []
    if len(depths) > 1:
        for variant in MIXING:
            growth, matrix = [], {}
            for lr in lrs:
                es = {e["depth"]: e for e in entries(summary, variant, lr)}
                if shallow in es and deep in es and not math.isnan(es[shallow]["product_col_dev"]):
                    growth.append(f"x{es[deep]['product_col_dev'] / es[shallow]['product_col_dev']:.3g} at "
                                  f"{lr_label(lr)}")
                    matrix[lr] = es[deep]["matrix_col_dev"] / es[shallow]["matrix_col_dev"]
            if not growth:
                continue
            worst = max(r["product_col_dev"] for r in rows if r["variant"] == variant)
            text = (f"{VARIANT_NAMES[variant]}: the product's column-sum error grows from {shallow} to {deep} layers "
                    f"({', '.join(growth)}; worst run {worst:.2g})")
            ratios = ", ".join(f"{m:.2f} at {lr_label(lr)}" for lr, m in matrix.items())
            flat = [lr_label(lr) for lr, m in matrix.items() if m < 2]  # "grows": at least doubles
            grows = [lr_label(lr) for lr, m in matrix.items() if m >= 2]
            if worst < 1e-5:
                text += ", at the level of fp32 rounding: it stays doubly stochastic to about 1e-6 at every depth"
            elif len(flat) == len(matrix):
                text += (f", while the per-matrix error does not grow (deep / shallow {ratios}): the growth is "
                         "accumulation through the layers")
            elif flat:
                text += (f"; the per-matrix error (deep / shallow {ratios}) does not grow at {', '.join(flat)}, "
                         f"where the growth is accumulation through the layers, and grows at {', '.join(grows)}")
            else:
                text += f"; the per-matrix error grows too (deep / shallow {ratios})"
            lines.append(text + ".")
    diverged = sum(r["diverged"] for r in rows)
    lines.append(f"Divergence: {diverged} of {len(rows)} runs diverged." if diverged else
                 f"No instability in the sense of divergence appeared at these sizes: none of the {len(rows)} runs "
                 "produced a non-finite loss or ended above the unigram entropy, at either learning rate.")
    for lr in lrs:
        spikes = {v: per_run(rows, v, lr, "spikes") for v in VARIANTS}
        text = (f"Gradient-norm spikes per run at {lr_label(lr)}, pooled over depths and seeds: " +
                ", ".join(f"{VARIANT_NAMES[v]} {np.mean(c):.1f}" for v, c in spikes.items() if c))
        if spikes["mhc"] and spikes["mhclite"]:
            diff, noise = mean_and_noise(spikes["mhc"], spikes["mhclite"])
            text += (f"; mHC minus mHC-lite {diff:+.1f} ± {noise:.1f} (2σ), "
                     f"{'within' if abs(diff) <= noise else 'outside'} seed noise")
        lines.append(text + ".")
    for lr in lrs:
        outside, inside = [], []
        for depth in depths:
            res = [v for v in per_run(rows, "res", lr, "val_loss", depth) if not math.isnan(v)]
            for variant in HC_FAMILY:
                other = [v for v in per_run(rows, variant, lr, "val_loss", depth) if not math.isnan(v)]
                if res and other:
                    diff, noise = mean_and_noise(other, res)
                    (outside if abs(diff) > noise else inside).append(
                        f"{VARIANT_NAMES[variant]} at {depth} layers ({diff:+.3f})")
        if not outside:
            verdict = "every difference is within seed noise."
        elif len(outside) <= len(inside):
            verdict = f"outside seed noise only {', '.join(outside)}; every other difference is within it."
        else:
            verdict = (f"within seed noise only {', '.join(inside) or 'none'}; every other difference is outside it "
                       f"({', '.join(outside)}).")
        lines.append(f"Val loss against res at {lr_label(lr)} (2σ): " + verdict)
    lines.append("Scale: these are narrow models trained briefly, so the study shows how the mechanism grows "
                 "with depth, not what happens at the paper's widths, lengths or 1,000 layers.")
    return [f"- {line}" for line in lines]


def findings(rows, summary, lrs, depths):
    """Sentences computed from the summary: growth with depth, divergence, spikes, val loss."""
    lines = []
    shallow, deep = depths[0], depths[-1]
    for variant in MIXING if len(depths) > 1 else ():
        for lr in lrs:
            es = {e["depth"]: e for e in entries(summary, variant, lr)}
            if shallow not in es or deep not in es or math.isnan(es[shallow]["product_col_dev"]):
                continue
            a, b = es[shallow], es[deep]
            low = [r["product_col_dev"] for r in rows if (r["variant"], r["depth"], r["lr"]) == (variant, shallow, lr)]
            high = [r["product_col_dev"] for r in rows if (r["variant"], r["depth"], r["lr"]) == (variant, deep, lr)]
            separated = min(high) > max(low)
            lines.append(f"- {VARIANT_NAMES[variant]}, {lr_label(lr)}: max |colsum - 1| of the product "
                         f"{a['product_col_dev']:.2e} ± {a['product_col_dev_std']:.1e} at {shallow} layers, "
                         f"{b['product_col_dev']:.2e} ± {b['product_col_dev_std']:.1e} at {deep} "
                         f"(x{b['product_col_dev'] / a['product_col_dev']:.1f}; every seed at {deep} above every seed "
                         f"at {shallow}: {'yes' if separated else 'no'}); per matrix {a['matrix_col_dev']:.2e} and "
                         f"{b['matrix_col_dev']:.2e}.")
    for lr in lrs if len(depths) > 1 else ():
        es = {e["depth"]: e for e in entries(summary, "mhc", lr)}
        if shallow in es and deep in es and not math.isnan(es[shallow]["log_inv_nu_max"]):
            a, b = es[shallow], es[deep]
            lines.append(f"- mHC's Sinkhorn inputs, {lr_label(lr)}: log(1/nu) median {a['log_inv_nu_median']:.1f}, "
                         f"max {a['log_inv_nu_max']:.1f} at {shallow} layers; median {b['log_inv_nu_median']:.1f}, "
                         f"max {b['log_inv_nu_max']:.1f} at {deep} (means over seeds).")
    diverged = [r for r in rows if r["diverged"]]
    if diverged:
        for r in sorted(diverged, key=lambda r: (r["lr"], VARIANTS.index(r["variant"]), r["depth"], r["seed"])):
            lines.append(f"- Diverged: {VARIANT_NAMES[r['variant']]}, {r['depth']} layers, {lr_label(r['lr'])}, "
                         f"seed {r['seed']} ({r['diverged_reason']}).")
    else:
        lines.append(f"- No run diverged: all {len(rows)} ended with finite losses below the unigram entropy.")
    for lr in lrs:
        counts = {v: [r["spikes"] for r in rows if r["variant"] == v and r["lr"] == lr] for v in VARIANTS}
        lines.append(f"- Gradient-norm spikes at {lr_label(lr)}, summed over depths and seeds: " +
                     ", ".join(f"{VARIANT_NAMES[v]} {sum(c)} (over {len(c)} runs)" for v, c in counts.items() if c) + ".")
    for lr in lrs:
        for depth in depths:
            res = [v for v in per_run(rows, "res", lr, "val_loss", depth) if not math.isnan(v)]
            if not res:
                continue
            parts = []
            for variant in HC_FAMILY:
                other = [v for v in per_run(rows, variant, lr, "val_loss", depth) if not math.isnan(v)]
                if not other:
                    continue
                diff, noise = mean_and_noise(other, res)
                parts.append(f"{VARIANT_NAMES[variant]} {diff:+.3f} (±{noise:.3f}"
                             f"{', within seed noise' if abs(diff) <= noise else ''})")
            if parts:
                lines.append(f"- Val loss against res, {depth} layers, {lr_label(lr)}: " + ", ".join(parts) + ".")
    return lines


def write_study(run_paths, out_dir, command, num_seqs=16, seq_len=128, spike_factor=3.0, spike_window=20,
                study_command=None, wall_s=None):
    runs = find_runs(run_paths, exclude=out_dir, cell_of=lambda run: (*run.group, *setting(run), run.seed))
    iters = sorted({int(run.config["max_iters"]) for run in runs})
    if len(iters) > 1:
        raise AnalysisError(f"the runs were set to different lengths ({', '.join(map(str, iters))} steps); "
                            "compare runs of the same length")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as work_dir:
        rows = [measure_run(run, work_dir, num_seqs, seq_len, spike_factor, spike_window) for run in runs]
    summary = summarise(rows)
    lrs = sorted({r["lr"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    figures = {name: os.path.join(out_dir, f"depth_study_{name}.png") for name in ("colsum", "grad_norm", "val_loss")}
    plot_colsum(rows, summary, lrs, figures["colsum"])
    plot_grad_norm(rows, lrs, depths[-1], figures["grad_norm"])
    plot_val_loss(rows, summary, lrs, figures["val_loss"])
    with open(os.path.join(out_dir, "depth_study.json"), "w") as f:
        curves_left_out = [{k: v for k, v in r.items() if k != "grad_norm_curve"} for r in rows]  # in metrics.jsonl
        json.dump(dict(rows=curves_left_out, summary=summary, spike_factor=spike_factor, spike_window=spike_window),
                  f, indent=1)

    first = runs[0].config
    seeds = sorted({r["seed"] for r in rows})
    run_seconds = [r["wall_s"] for r in rows if not math.isnan(r["wall_s"])]
    timing = []
    if wall_s is not None:
        timing.append(f"the trainings took {wall_s / 60:.1f} min of wall time")
    if run_seconds:
        timing.append(f"the {len(run_seconds)} runs {sum(run_seconds) / 60:.1f} min in all, one thread each")
    md = ["# Depth study: deviations from doubly stochastic, and stability, against depth\n",
          "The paper argues that mHC's per-layer deviations from doubly stochastic accumulate through depth, "
          "and that mHC-lite removes the instabilities of HC and mHC. Here narrow models are trained at "
          "several depths and learning rates, every variant on the same data and seeds, and measured.\n",
          f"Setting: {first['dataset']}, width {first['n_embd']}, {first['n_head']} heads, depths "
          f"{', '.join(map(str, depths))}, {iters[0]} steps, batch {first['batch_size']} x block "
          f"{first['block_size']}, warm-up {first['warmup_iters']} steps, cosine to lr / 10, gradient clipping "
          f"{first['grad_clip']}, {first['dtype']}, compile={first['compile']}, learning rates "
          f"{', '.join(f'{lr:g}' for lr in lrs)}, seeds {seeds}.\n",
          "Val loss: last evaluation. Diverged: a non-finite loss or gradient norm (train.py stops the run), or a "
          "final val loss above the unigram entropy of the val split. Spikes: steps whose gradient norm (before "
          f"clipping) exceeds {spike_factor:g} x the median of the {spike_window} steps before it. Max and median "
          "gradient norm: the steps after warm-up. Column and row sums: every H_res (per matrix) and the product "
          f"of all H_res over depth, per token, on the first {num_seqs} x {seq_len} tokens of the val split "
          "(held-out text), from each final checkpoint. Values are mean ± std over seeds; val loss over the runs "
          "that did not diverge. The 2σ in the findings is twice the standard error of a difference of means.\n",
          "## Reading (computed from the runs)\n",
          *reading(rows, summary, lrs, depths), "",
          "## Findings (computed from the runs)\n",
          *findings(rows, summary, lrs, depths), "",
          f"![max |colsum - 1| of the product against depth (dots: seeds; line: median over seeds)]"
          f"({os.path.basename(figures['colsum'])})\n",
          f"![gradient norms at {depths[-1]} layers]({os.path.basename(figures['grad_norm'])})\n",
          f"![val loss against depth]({os.path.basename(figures['val_loss'])})\n",
          "## Tables\n"]
    for lr in lrs:
        md += [f"### {lr_label(lr)}\n", table_markdown(summary, lr)]
    md += ["## Reproduce\n",
           "```bash\n" + (study_command + "\n" if study_command else "") + command + "\n```\n",
           f"Measured on: {machine_line()}" + (f"; {'; '.join(timing)}." if timing else ".") + "\n",
           "## Where the result depends on the machine\n",
           "Every run is seeded, so a rerun on the same machine is bit-identical. Another CPU can take another "
           "floating-point path (other vector instructions, other reduction orders), and at a high learning rate "
           "that can move a single run about as much as the seed does: the statements across seeds (means, seed "
           "spread, differences against it) are the result, a single run is one draw.\n"]
    path = os.path.join(out_dir, "depth_study.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path, rows, summary


def study_arguments(doc, script, default_out, argv):
    """The command line a study page shares (depth, bf16 streams): (args, the command quoted in the page)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run directories written by train.py")
    p.add_argument("--out", default=default_out, help="folder for the page, the PNGs and json")
    p.add_argument("--num_seqs", type=int, default=16, help="val sequences collected per checkpoint")
    p.add_argument("--seq_len", type=int, default=128, help="tokens per sequence (capped at the block size)")
    p.add_argument("--spike_factor", type=float, default=3.0, help="a spike exceeds this times the running median")
    p.add_argument("--spike_window", type=int, default=20, help="steps in the running median")
    p.add_argument("--study_command", default=None, help="the command that trained the runs, quoted in the page")
    p.add_argument("--wall_s", type=float, default=None, help="wall time of the trainings, stated in the page")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    quoted = ("--study_command", "--wall_s")  # the page states these apart
    shown = [a for i, a in enumerate(argv)
             if not a.startswith(quoted) and not (i and argv[i - 1] in quoted)]
    if args.num_seqs < 1 or args.seq_len < 1 or args.spike_window < 1 or args.spike_factor <= 1:
        p.error("--num_seqs, --seq_len and --spike_window must be at least 1, --spike_factor above 1")
    return args, f"python analysis/{script} " + shlex.join(shown)


def main(argv=None):
    args, command = study_arguments(__doc__, "depth_study.py", "out/depth_study_report", argv)
    try:
        path, _, summary = write_study(args.runs, args.out, command, args.num_seqs, args.seq_len, args.spike_factor,
                                       args.spike_window, args.study_command, args.wall_s)
    except (AnalysisError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for lr in sorted({e["lr"] for e in summary}):
        print(f"{lr_label(lr)}\n{table_markdown(summary, lr)}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
