"""bf16 streams against fp32 streams: do HC, mHC and mHC-lite train the same when the n streams are
stored in bf16 (--stream_dtype=bfloat16)? From the runs of scripts/bf16_streams_study.sh it measures per
run what the depth study measures (analysis/depth_study.py: final val loss, gradient norms and spikes, the
row and column sums of every H_res and of their product over depth on held-out text), compares the final
val loss of bf16 streams with fp32 streams per variant against the seed-to-seed spread, and writes
bf16_streams.md, its figures and bf16_streams.json.

    python analysis/bf16_streams.py --runs 'out/bf16_streams/*' --out docs
"""
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

from analysis.common import VARIANT_NAMES, VARIANTS, AnalysisError, find_runs, machine_line, seed_summary
from analysis.depth_study import LINESTYLES, METRICS, fmt, mean_and_noise, measure_run, study_arguments
from checkpoint import CheckpointError

STREAM_DTYPES = ("float32", "bfloat16")
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}
DTYPE_COLORS = {"float32": "tab:blue", "bfloat16": "tab:red"}


def stream_dtype(run):
    return run.config.get("stream_dtype", "float32")


def summarise(rows):
    """One entry per (variant, stream dtype): mean and std over seeds of the depth study's metrics."""
    summary = []
    for variant in VARIANTS:
        for dtype in STREAM_DTYPES:
            members = sorted((r for r in rows if (r["variant"], r["stream_dtype"]) == (variant, dtype)),
                             key=lambda r: r["seed"])
            if members:
                summary.append(dict(variant=variant, stream_dtype=dtype, seeds=[r["seed"] for r in members],
                                    diverged=sum(r["diverged"] for r in members), **seed_summary(members, METRICS)))
    return summary


def compare(rows):
    """Per variant with both stream dtypes: final val loss bf16 minus fp32 (difference of the means),
    twice its standard error from the seed-to-seed spread (noise), the per-seed differences (a seed's
    two runs see the same batches) and twice the standard error of their mean (paired_noise), and the
    seed-to-seed spread (std over seeds, the larger of the two dtypes)."""
    comparisons = []
    for variant in VARIANTS:
        val = {d: {r["seed"]: r["val_loss"] for r in rows if (r["variant"], r["stream_dtype"]) == (variant, d)
                   and not math.isnan(r["val_loss"])} for d in STREAM_DTYPES}
        if not val["float32"] or not val["bfloat16"]:
            continue
        diff, noise = mean_and_noise(list(val["bfloat16"].values()), list(val["float32"].values()))
        one_seed = min(len(v) for v in val.values()) < 2
        paired = {s: val["bfloat16"][s] - val["float32"][s] for s in sorted(val["float32"]) if s in val["bfloat16"]}
        differences = list(paired.values())
        paired_noise = (2 * float(np.std(differences, ddof=1)) / math.sqrt(len(differences))
                        if len(differences) > 1 else math.nan)
        spread = max(float(np.std(list(v.values()), ddof=1)) if len(v) > 1 else math.nan for v in val.values())
        comparisons.append(dict(variant=variant, diff=diff, noise=math.nan if one_seed else noise, seed_spread=spread,
                                paired=paired, paired_noise=paired_noise,
                                within=None if one_seed else abs(diff) <= noise))
    return comparisons


def table_markdown(summary, comparisons):
    by_variant = {c["variant"]: c for c in comparisons}
    lines = ["| variant | streams | diverged | final val loss | bf16 - fp32 | 2σ, seeds | 2σ, paired | per seed | "
             "spikes | max grad norm | median grad norm | max abs(colsum-1), per matrix | "
             "max abs(colsum-1), product | median abs(colsum-1), product |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    two_sigma = lambda value: "-" if math.isnan(value) else f"±{value:.4f}"  # noqa: E731
    for e in summary:
        c = by_variant.get(e["variant"]) if e["stream_dtype"] == "bfloat16" else None
        diff = f"{c['diff']:+.4f} | {two_sigma(c['noise'])} | {two_sigma(c['paired_noise'])}" if c else " | | "
        paired = ", ".join(f"{d:+.4f}" for d in c["paired"].values()) if c else ""
        lines.append(f"| {VARIANT_NAMES[e['variant']]} | {DTYPE_NAMES[e['stream_dtype']]} | "
                     f"{e['diverged']}/{len(e['seeds'])} | {fmt(e, 'val_loss', 4)} | {diff} | {paired} | "
                     f"{fmt(e, 'spikes', 1)} | {fmt(e, 'grad_norm_max', 2)} | {fmt(e, 'grad_norm_median', 3)} | "
                     f"{fmt(e, 'matrix_col_dev', scientific=True)} | {fmt(e, 'product_col_dev', scientific=True)} | "
                     f"{fmt(e, 'product_col_dev_median', scientific=True)} |")
    return "\n".join(lines) + "\n"


def plot_grad_norm(rows, variants, path):
    """Per-step gradient norms (before clipping): a panel per variant, fp32 and bf16 streams in two
    colours, a line style per seed; log scale."""
    fig, axes = plt.subplots(1, len(variants), figsize=(4.6 * len(variants), 3.6), squeeze=False, sharey=True)
    for ax, variant in zip(axes[0], variants):
        seeds = sorted({r["seed"] for r in rows})
        for dtype in STREAM_DTYPES:
            for r in sorted((r for r in rows if (r["variant"], r["stream_dtype"]) == (variant, dtype)),
                            key=lambda r: r["seed"]):
                steps, norms = zip(*r["grad_norm_curve"])
                wide = dtype == "float32"  # drawn wide beneath the bf16 line, which often covers it
                ax.plot(steps, norms, color=DTYPE_COLORS[dtype], linewidth=2.0 if wide else 0.7,
                        alpha=0.45 if wide else 0.9,
                        linestyle=LINESTYLES[seeds.index(r["seed"]) % len(LINESTYLES)],
                        label=f"{DTYPE_NAMES[dtype]} streams, seed {r['seed']}")
        ax.set_yscale("log")
        ax.set_title(VARIANT_NAMES[variant])
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("gradient norm (before clipping)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_colsum(rows, variants, path):
    """Max |colsum - 1| of the product of all H_res per run: a column per (variant, stream dtype),
    a dot per seed; log scale."""
    fig, ax = plt.subplots(figsize=(1.6 * len(variants) * len(STREAM_DTYPES) + 1.5, 4.0))
    ticks, labels = [], []
    for i, variant in enumerate(variants):
        for j, dtype in enumerate(STREAM_DTYPES):
            x = i * (len(STREAM_DTYPES) + 1) + j
            values = [r["product_col_dev"] for r in rows if (r["variant"], r["stream_dtype"]) == (variant, dtype)
                      and not math.isnan(r["product_col_dev"])]
            ax.scatter([x] * len(values), values, color=DTYPE_COLORS[dtype], s=25,
                       label=f"{DTYPE_NAMES[dtype]} streams" if i == 0 else None)
            ticks.append(x)
            labels.append(f"{VARIANT_NAMES[variant]}\n{DTYPE_NAMES[dtype]}")
    ax.set_xticks(ticks, labels)
    ax.set_xlim(min(ticks) - 0.7, max(ticks) + 0.7)
    ax.set_yscale("log")
    ax.set_ylabel("max |colsum - 1| of the product of all H_res")
    ax.grid(alpha=0.3, which="both", axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def findings(comparisons, summary):
    """Sentences computed from the numbers."""
    lines = []
    for c in comparisons:
        name = VARIANT_NAMES[c["variant"]]
        if c["within"] is None:
            verdict = "(one seed: no seed spread to compare with)"
        else:
            verdict = (f"± {c['noise']:.4f} (2σ from the seed-to-seed spread, std {c['seed_spread']:.4f}): "
                       f"{'within' if c['within'] else 'outside'} it; ± {c['paired_noise']:.4f} (2σ of the seeds' "
                       f"paired differences): {'not ' if abs(c['diff']) <= c['paired_noise'] else ''}"
                       "distinguishable from zero")
        lines.append(f"- {name}: final val loss bf16 minus fp32 streams {c['diff']:+.4f} {verdict}; per seed "
                     f"{', '.join(f'{d:+.4f}' for d in c['paired'].values())}.")
    for variant in VARIANTS:
        es = {e["stream_dtype"]: e for e in summary if e["variant"] == variant}
        if len(es) == 2 and not math.isnan(es["float32"]["product_col_dev"]):
            a, b = es["float32"], es["bfloat16"]
            lines.append(f"- {VARIANT_NAMES[variant]}: max |colsum - 1| of the product of all H_res "
                         f"{a['product_col_dev']:.2e} with fp32 streams, {b['product_col_dev']:.2e} with bf16 streams "
                         f"(means over seeds); median gradient norm {a['grad_norm_median']:.3f} and "
                         f"{b['grad_norm_median']:.3f}, spikes per run {a['spikes']:.1f} and {b['spikes']:.1f}.")
    return lines


def write_study(run_paths, out_dir, command, num_seqs=16, seq_len=128, spike_factor=3.0, spike_window=20,
                study_command=None, wall_s=None):
    runs = find_runs(run_paths, exclude=out_dir, cell_of=lambda run: (*run.group, run.residual, stream_dtype(run),
                                                                      run.seed))
    for key in ("max_iters", "n_layer", "n_embd", "learning_rate"):
        if len({run.config[key] for run in runs}) > 1:
            raise AnalysisError(f"the runs differ in {key}; compare runs of one setting")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as work_dir:
        rows = [dict(measure_run(run, work_dir, num_seqs, seq_len, spike_factor, spike_window),
                     stream_dtype=stream_dtype(run)) for run in runs]
    summary = summarise(rows)
    comparisons = compare(rows)
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    figures = {name: os.path.join(out_dir, f"bf16_streams_{name}.png") for name in ("grad_norm", "colsum")}
    plot_grad_norm(rows, variants, figures["grad_norm"])
    plot_colsum(rows, [v for v in variants if v != "res"], figures["colsum"])
    with open(os.path.join(out_dir, "bf16_streams.json"), "w") as f:
        curves_left_out = [{k: v for k, v in r.items() if k != "grad_norm_curve"} for r in rows]  # in metrics.jsonl
        json.dump(dict(rows=curves_left_out, summary=summary,
                       comparisons=[dict(c, paired={str(s): d for s, d in c["paired"].items()}) for c in comparisons],
                       spike_factor=spike_factor, spike_window=spike_window), f, indent=1)

    first = runs[0].config
    seeds = sorted({r["seed"] for r in rows})
    timing = [f"the trainings took {wall_s / 60:.1f} min of wall time"] if wall_s is not None else []
    md = ["# bf16 streams against fp32 streams\n",
          "Storing the n streams in bf16 (`--stream_dtype=bfloat16`) nearly halves the bytes the connections "
          "move. Here each variant trains twice per seed, with fp32 and with bf16 streams, on the same batches, "
          "and the two are compared against the seed-to-seed spread.\n",
          f"Setting: {first['dataset']}, {first['n_layer']} layers, width {first['n_embd']}, {first['n_head']} "
          f"heads, {first['max_iters']} steps, batch {first['batch_size']} x block {first['block_size']}, "
          f"learning rate {first['learning_rate']:g} (warm-up {first['warmup_iters']} steps, cosine to "
          f"{first['min_lr']:g}), gradient clipping {first['grad_clip']}, {first['dtype']} compute, "
          f"compile={first['compile']}, seeds {seeds}.\n",
          "Final val loss: the last evaluation, on the same "
          f"{first['eval_iters']} x {first['batch_size']} x {first['block_size']} val tokens for both stream dtypes "
          "of a seed. bf16 - fp32: difference of the means over seeds; per seed: the difference of the seed's "
          "two runs; 2σ, seeds: twice the standard error of the difference of the means from the seed-to-seed "
          "spread (is bf16 - fp32 larger than what changing the seed does?); 2σ, paired: twice the standard error "
          "of the mean of the per-seed differences (is it distinguishable from zero?). Spikes: steps whose "
          f"gradient norm (before clipping) exceeds {spike_factor:g} x the median of the {spike_window} steps "
          "before it; max and median gradient norm over the steps after warm-up. Column sums: every H_res (per "
          f"matrix) and the product of all H_res over depth, per token, on the first {num_seqs} x {seq_len} tokens "
          "of the val split, from each final checkpoint, as in the depth study. Values are mean ± std over seeds.\n",
          "## Findings (computed from the runs)\n",
          *findings(comparisons, summary), "",
          "![gradient norms, fp32 and bf16 streams](bf16_streams_grad_norm.png)\n",
          "![max |colsum - 1| of the product of all H_res per run](bf16_streams_colsum.png)\n",
          "## Table\n",
          table_markdown(summary, comparisons),
          "## Reproduce\n",
          "```bash\n" + (study_command + "\n" if study_command else "") + command + "\n```\n",
          f"Measured on: {machine_line()}" + (f"; {'; '.join(timing)}." if timing else ".") + "\n"]
    path = os.path.join(out_dir, "bf16_streams.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path, rows, summary, comparisons


def main(argv=None):
    args, command = study_arguments(__doc__, "bf16_streams.py", "out/bf16_streams_report", argv)
    try:
        path, _, summary, comparisons = write_study(args.runs, args.out, command, args.num_seqs, args.seq_len,
                                                    args.spike_factor, args.spike_window, args.study_command,
                                                    args.wall_s)
    except (AnalysisError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(table_markdown(summary, comparisons))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
