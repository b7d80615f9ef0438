"""Every residual variant side by side: from the runs of scripts/variants_study.sh (res, hc, mhc, mhc with
DeepSeek-V4's epsilons, mhclite, kromhc, ihc under one setting) it measures per run what the depth study
measures (analysis/depth_study.py: final val loss, gradient norms and spikes, the row and column sums of
every H_res and of their product over depth on held-out text), adds the median step time of the training
and the activation bytes autograd saves for one batch, and writes variants_study.md with the mean and
spread over seeds and the ratios to res, its figures and variants_study.json.

    python analysis/variants_study.py --runs 'out/variants_study/*' --out docs
"""
import contextlib
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import torch

from analysis.common import (VARIANT_COLORS, VARIANT_NAMES, VARIANTS, AnalysisError, after_warmup, find_runs,
                             machine_line, seed_summary)
from analysis.depth_study import LINESTYLES, METRICS, MIXING, fmt, mean_and_noise, measure_run, study_arguments
from benchmarks.step import saved_activation_bytes
from checkpoint import CheckpointError
from sample import load_model

TIMING_ROUNDS = 10  # interleaved training steps timed per variant
SAME_SETTING = ("dataset", "max_iters", "n_layer", "n_embd", "batch_size", "block_size", "learning_rate")


def step_ms(run):
    """Median logged step time (ms) after warm-up (analysis.common.after_warmup: evaluations and first
    steps are not in it)."""
    return float(np.median(after_warmup(run, "step_ms")))


def training_batch(config, vocab_size, seed=0):
    """(x, y): one training batch of the runs' shape (batch_size x block_size) of random tokens, drawn
    with `seed`."""
    tokens = torch.randint(vocab_size, (config["batch_size"], config["block_size"] + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def interleaved_step_ms(models, batch, rounds, warmup=2):
    """{variant: median ms of one forward and backward of `batch`}, the variants timed in turn round
    after round (after `warmup` rounds not counted), so that whatever else loads the machine loads
    them alike."""
    times = {variant: [] for variant in models}
    for round_index in range(warmup + rounds):
        for variant, model in models.items():
            start = time.perf_counter()
            _, loss = model(*batch)
            loss.backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if round_index >= warmup:
                times[variant].append(elapsed)
    return {variant: 1000 * float(np.median(values)) for variant, values in times.items()}


def measure_variants(runs, timing_rounds):
    """{variant: (activation bytes, timed step ms)} from each variant's first run's final model: the
    bytes autograd saves in the forward of one training batch, parameters excluded (benchmarks.step),
    and interleaved_step_ms of a training step on that batch."""
    models = {}
    for run in sorted(runs, key=lambda run: run.seed):
        models.setdefault(run.variant, load_model(run.path)[0].train())
    batch = training_batch(runs[0].config, next(iter(models.values())).config.vocab_size)
    activations = {variant: saved_activation_bytes(model, *batch, contextlib.nullcontext())
                   for variant, model in models.items()}
    timed = interleaved_step_ms(models, batch, timing_rounds)
    return {variant: (activations[variant], timed[variant]) for variant in models}


def summarise(rows):
    """One entry per variant: mean and std over seeds of the depth study's metrics and the logged step
    time, the seeds' val-loss range, the activation bytes and timed step, and these two as ratios to res."""
    summary = []
    for variant in VARIANTS:
        members = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        if not members:
            continue
        losses = [r["val_loss"] for r in members if not math.isnan(r["val_loss"])]
        summary.append(dict(variant=variant, seeds=[r["seed"] for r in members],
                            diverged=sum(r["diverged"] for r in members),
                            val_loss_range=float(max(losses) - min(losses)) if losses else math.nan,
                            product_col_dev_worst=max((r["product_col_dev"] for r in members), default=math.nan),
                            activation_bytes=members[0]["activation_bytes"], timed_step_ms=members[0]["timed_step_ms"],
                            **seed_summary(members, (*METRICS, "step_ms"))))
    res = next((e for e in summary if e["variant"] == "res"), None)
    for e in summary:
        e["step_time_x_res"] = e["timed_step_ms"] / res["timed_step_ms"] if res else math.nan
        e["activation_x_res"] = e["activation_bytes"] / res["activation_bytes"] if res else math.nan
    return summary


def compare(rows, first, second):
    """Final val loss of variant `first` minus `second`: the difference of the means with twice its
    standard error from the seed-to-seed spread, and the per-seed differences (a seed's runs start
    from the same data order) with twice the standard error of their mean; None without both."""
    val = {v: {r["seed"]: r["val_loss"] for r in rows if r["variant"] == v and not math.isnan(r["val_loss"])}
           for v in (first, second)}
    if not val[first] or not val[second]:
        return None
    diff, noise = mean_and_noise(list(val[first].values()), list(val[second].values()))
    paired = [val[first][s] - val[second][s] for s in sorted(val[first]) if s in val[second]]
    paired_noise = 2 * float(np.std(paired, ddof=1)) / math.sqrt(len(paired)) if len(paired) > 1 else math.nan
    return dict(first=first, second=second, diff=diff, noise=noise, paired=paired, paired_noise=paired_noise)


def number(value, spec):
    return "-" if math.isnan(value) else format(value, spec)


def table_markdown(summary):
    lines = ["| variant | seeds | diverged | final val loss | range over seeds | spikes per run | max grad norm | "
             "median grad norm | max abs(colsum-1), per matrix | max abs(colsum-1), product | same, worst seed | "
             "step ms, training | step time x res | activation memory x res | mHC log(1/nu), median / max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in summary:
        nu = "-" if math.isnan(e["log_inv_nu_median"]) else f"{e['log_inv_nu_median']:.1f} / {e['log_inv_nu_max']:.1f}"
        lines.append(f"| {VARIANT_NAMES[e['variant']]} | {len(e['seeds'])} | {e['diverged']} | "
                     f"{fmt(e, 'val_loss', 4)} | {number(e['val_loss_range'], '.4f')} | {fmt(e, 'spikes', 1)} | "
                     f"{fmt(e, 'grad_norm_max', 2)} | {fmt(e, 'grad_norm_median', 3)} | "
                     f"{fmt(e, 'matrix_col_dev', scientific=True)} | {fmt(e, 'product_col_dev', scientific=True)} | "
                     f"{number(e['product_col_dev_worst'], '.1e')} | {fmt(e, 'step_ms', 0)} | "
                     f"{number(e['step_time_x_res'], '.2f')} | {number(e['activation_x_res'], '.2f')} | {nu} |")
    return "\n".join(lines) + "\n"


def plot_val_loss(rows, summary, path):
    """Final val loss per variant: a dot per seed and the mean over seeds as a bar."""
    fig, ax = plt.subplots(figsize=(1.3 * len(summary) + 1.5, 4.0))
    for i, e in enumerate(summary):
        values = [r["val_loss"] for r in rows if r["variant"] == e["variant"] and not math.isnan(r["val_loss"])]
        ax.bar(i, e["val_loss"], color=VARIANT_COLORS[e["variant"]], alpha=0.35, width=0.6)
        ax.scatter([i] * len(values), values, color=VARIANT_COLORS[e["variant"]], s=20, zorder=3)
    finite = [r["val_loss"] for r in rows if not math.isnan(r["val_loss"])]
    if len(set(finite)) > 1:  # the bars start below the lowest seed, so their differences show
        spread = max(finite) - min(finite)
        ax.set_ylim(min(finite) - spread, max(finite) + 0.5 * spread)
    ax.set_xticks(range(len(summary)), [VARIANT_NAMES[e["variant"]] for e in summary], rotation=20)
    ax.set_ylabel("final val loss (dots: seeds; bar: mean)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_colsum(rows, path):
    """Max |colsum - 1| of the product of all H_res per run, a dot per seed; log scale."""
    variants = [v for v in MIXING if any(r["variant"] == v and not math.isnan(r["product_col_dev"]) for r in rows)]
    fig, ax = plt.subplots(figsize=(1.3 * len(variants) + 1.5, 4.0))
    for i, variant in enumerate(variants):
        values = [r["product_col_dev"] for r in rows if r["variant"] == variant]
        ax.scatter([i] * len(values), values, color=VARIANT_COLORS[variant], s=25)
    ax.set_xticks(range(len(variants)), [VARIANT_NAMES[v] for v in variants], rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("max |colsum - 1| of the product of all H_res")
    ax.grid(alpha=0.3, which="both", axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grad_norm(rows, path):
    """Per-step gradient norms (before clipping): a panel per variant, a line style per seed; log scale."""
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    columns = min(4, len(variants))
    n_rows = math.ceil(len(variants) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(4.2 * columns, 3.2 * n_rows), squeeze=False, sharey=True)
    for ax, variant in zip(axes.flat, variants):
        runs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        for i, r in enumerate(runs):
            steps, norms = zip(*r["grad_norm_curve"])
            ax.plot(steps, norms, color=VARIANT_COLORS[variant], linestyle=LINESTYLES[i % len(LINESTYLES)],
                    linewidth=0.7, label=f"seed {r['seed']}")
        ax.set_yscale("log")
        ax.set_title(VARIANT_NAMES[variant])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    for ax in axes.flat[len(variants):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("gradient norm (before clipping)")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def comparison_sentence(c, question):
    """One finding: the difference, its two noise scales, and what they say."""
    within = abs(c["diff"]) <= c["noise"]
    text = (f"{question}: {VARIANT_NAMES[c['first']]} minus {VARIANT_NAMES[c['second']]} {c['diff']:+.4f}, "
            f"±{c['noise']:.4f} (2σ, seed spread): {'within' if within else 'outside'} it")
    if not math.isnan(c["paired_noise"]):
        paired_zero = abs(c["diff"]) <= c["paired_noise"]
        per_seed = ", ".join(f"{d:+.4f}" for d in c["paired"])
        text += (f"; per seed {per_seed}, whose mean has ±{c['paired_noise']:.4f} (2σ, paired): "
                 f"{'not ' if paired_zero else ''}distinguishable from zero")
    return text + "."


QUESTIONS = (  # (first, second, question): the comparisons the study was made for
    ("mhc-v4eps", "mhc", "Does DeepSeek-V4's epsilon change mHC's training"),
    ("kromhc", "mhclite", "KromHC against mHC-lite, both exactly doubly stochastic"),
    ("ihc", "mhclite", "Does mixing the streams matter (iHC has H_res = I)"),
    ("ihc", "hc", "iHC against HC"),
    ("mhclite", "res", "mHC-lite against the plain residual"),
)


def findings(rows, summary):
    """Sentences computed from the numbers."""
    lines = []
    finite = [e for e in summary if not math.isnan(e["val_loss"])]
    if finite:
        best = min(finite, key=lambda e: e["val_loss"])
        lines.append(f"Lowest mean final val loss: {VARIANT_NAMES[best['variant']]} {best['val_loss']:.4f}; the "
                     "seed-to-seed std of the variants ranges from "
                     f"{min(e['val_loss_std'] for e in finite):.4f} to {max(e['val_loss_std'] for e in finite):.4f}.")
    for first, second, question in QUESTIONS:
        c = compare(rows, first, second)
        if c:
            lines.append(comparison_sentence(c, question))
    exact = [e for e in summary if e["variant"] in MIXING and not math.isnan(e["product_col_dev"])]
    if exact:
        lines.append("Max |colsum - 1| of the product of all H_res (mean over seeds): " + ", ".join(
            f"{VARIANT_NAMES[e['variant']]} {e['product_col_dev']:.1e}" for e in exact) + "; iHC's H_res is I.")
    spikes = [e for e in summary if not math.isnan(e["spikes"])]
    lines.append("Gradient-norm spikes per run: " + ", ".join(
        f"{VARIANT_NAMES[e['variant']]} {e['spikes']:.1f}" for e in spikes) + ".")
    diverged = sum(r["diverged"] for r in rows)
    lines.append(f"{diverged} of {len(rows)} runs diverged." if diverged else
                 f"No run diverged: all {len(rows)} ended with finite losses below the unigram entropy.")
    return [f"- {line}" for line in lines]


def write_study(run_paths, out_dir, command, num_seqs=16, seq_len=128, spike_factor=3.0, spike_window=20,
                study_command=None, wall_s=None, timing_rounds=TIMING_ROUNDS):
    runs = find_runs(run_paths, exclude=out_dir)
    for key in SAME_SETTING:
        if len({run.config[key] for run in runs}) > 1:
            raise AnalysisError(f"the runs differ in {key}; compare runs of one setting")
    os.makedirs(out_dir, exist_ok=True)
    measured = measure_variants(runs, timing_rounds)  # the same model shape for every seed of a variant
    with tempfile.TemporaryDirectory() as work_dir:
        rows = [dict(measure_run(run, work_dir, num_seqs, seq_len, spike_factor, spike_window), step_ms=step_ms(run),
                     activation_bytes=measured[run.variant][0], timed_step_ms=measured[run.variant][1])
                for run in runs]
    summary = summarise(rows)
    figures = {name: os.path.join(out_dir, f"variants_study_{name}.png")
               for name in ("val_loss", "colsum", "grad_norm")}
    plot_val_loss(rows, summary, figures["val_loss"])
    plot_colsum(rows, figures["colsum"])
    plot_grad_norm(rows, figures["grad_norm"])
    comparisons = [c for c in (compare(rows, a, b) for a, b, _ in QUESTIONS) if c]
    with open(os.path.join(out_dir, "variants_study.json"), "w") as f:
        curves_left_out = [{k: v for k, v in r.items() if k != "grad_norm_curve"} for r in rows]  # in metrics.jsonl
        json.dump(dict(rows=curves_left_out, summary=summary, comparisons=comparisons, spike_factor=spike_factor,
                       spike_window=spike_window), f, indent=1)

    first = runs[0].config
    seeds = sorted({r["seed"] for r in rows})
    timing = [f"the trainings took {wall_s / 60:.1f} min of wall time"] if wall_s is not None else []
    md = ["# Every variant side by side\n",
          "res, hc, mhc, mhc with DeepSeek-V4's epsilons (`--mhc_eps=1e-6`), mhclite, kromhc and ihc, trained under "
          "one setting on the same data order per seed, and measured the same way.\n",
          f"Setting: {first['dataset']}, {first['n_layer']} layers, width {first['n_embd']}, {first['n_head']} heads, "
          f"{first['n_streams']} streams, {first['max_iters']} steps, batch {first['batch_size']} x block "
          f"{first['block_size']}, learning rate {first['learning_rate']:g} (warm-up {first['warmup_iters']} steps, "
          f"cosine to {first['min_lr']:g}), gradient clipping {first['grad_clip']}, {first['dtype']}, "
          f"compile={first['compile']}, seeds {seeds}.\n",
          "Final val loss: the last evaluation, on the same "
          f"{first['eval_iters']} x {first['batch_size']} x {first['block_size']} val tokens for every run of a seed. "
          f"Spikes: steps whose gradient norm (before clipping) exceeds {spike_factor:g} x the median of the "
          f"{spike_window} steps before it; max and median gradient norm over the steps after warm-up. Column sums: "
          "every H_res (per matrix) and the product of all H_res over depth, per token, on the first "
          f"{num_seqs} x {seq_len} tokens of the val split, from each final checkpoint (iHC's H_res is I: nothing to "
          "measure). Step ms, training: the median logged step time after warm-up, evaluations left out; the runs "
          "shared the machine with each other and with other work, so these are rough. Step time x res: timed "
          f"again here, one forward and backward of a training batch with each variant's final model (its first "
          f"seed), the variants in turn for {timing_rounds} rounds after 2 not counted, median, over res's. "
          "Activation memory x res: the bytes autograd saves in the forward of that batch, parameters excluded "
          "(a count, not a timing), over res's. log(1/nu): max - min of "
          "mHC's Sinkhorn logits per token. Values are mean ± std over seeds; the comparisons give twice the "
          "standard error of a difference.\n",
          "## Findings (computed from the runs)\n",
          *findings(rows, summary), "",
          "![final val loss per variant](variants_study_val_loss.png)\n",
          "![max |colsum - 1| of the product of all H_res per run](variants_study_colsum.png)\n",
          "![gradient norms](variants_study_grad_norm.png)\n",
          "## Table\n",
          table_markdown(summary),
          "## Reproduce\n",
          "```bash\n" + (study_command + "\n" if study_command else "") + command + "\n```\n",
          f"Measured on: {machine_line()}" + (f"; {'; '.join(timing)}." if timing else ".") + "\n"]
    path = os.path.join(out_dir, "variants_study.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path, rows, summary


def main(argv=None):
    args, command = study_arguments(__doc__, "variants_study.py", "out/variants_study_report", argv)
    try:
        path, _, summary = write_study(args.runs, args.out, command, args.num_seqs, args.seq_len, args.spike_factor,
                                       args.spike_window, args.study_command, args.wall_s)
    except (AnalysisError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(table_markdown(summary))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
