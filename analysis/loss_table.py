"""Table 1 of the paper from run directories: final train loss (mean of the last 200 logged
train_loss values) and validation loss (last val_loss) per variant, dataset and size, as
Markdown and LaTeX (booktabs). Several seeds give mean +/- std; missing runs stay blank. Runs with
the settings of configs/authors.py (the paper as the authors' code ran it) get rows of their own,
e.g. "mHC-lite (authors)" under "mHC-lite".

    python analysis/loss_table.py --runs out/* --out out/analysis
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import numpy as np

from analysis.common import (PAPER_VARIANTS, SETTINGS_LABELS, VARIANT_NAMES, VARIANTS, AnalysisError,
                             authors_settings, dataset_name, find_runs, group_runs, size_sort_key)

METRICS = ("train", "val")


def final_losses(run, last=200):
    """(train, val) of one run: mean of the last `last` logged train losses, last val loss;
    None where the run logged none."""
    train_loss = run.train["train_loss"]
    val_loss = run.evals["val_loss"]
    train = float(np.mean(train_loss[-last:])) if len(train_loss) else None
    val = float(val_loss[-1]) if len(val_loss) else None
    return train, val


def build_table(runs, last=200, datasets=None, sizes=None):
    """{"columns": [(dataset, size)], "cells": {(row, dataset, size, metric): [values over seeds]},
    "rows": [row], "runs": [(run, train, val)]}, a row being a variant ("mhclite") or a variant with
    settings other than the paper's ("mhclite (authors)"). Columns are the groups present, or datasets x sizes in the order
    given (e.g. the paper's openwebtext fineweb_edu x S M L, blank where no run exists)."""
    groups = group_runs(runs)  # in paper order
    if datasets or sizes:  # the given order; what is not given comes from the runs
        datasets = datasets or list(dict.fromkeys(d for d, _ in groups))
        sizes = sizes or sorted({s for _, s in groups}, key=size_sort_key)
        columns = [(d, s) for d in datasets for s in sizes]
    else:
        columns = list(groups)
    cells, used = {}, []
    for group, by_variant in groups.items():
        for variant, variant_runs in by_variant.items():
            for run in variant_runs:
                train, val = final_losses(run, last)
                used.append((run, train, val))
                for metric, value in zip(METRICS, (train, val)):
                    if value is not None:
                        cells.setdefault((row_key(variant, run.settings), *group, metric), []).append(value)
    # the paper's variants' paper rows (blank without runs), then every other row where there are runs
    rows = [row_key(v, s) for v in VARIANTS for s in SETTINGS_LABELS
            if (s == "paper" and v in PAPER_VARIANTS) or any(r.variant == v and r.settings == s for r, _, _ in used)]
    return {"columns": columns, "cells": cells, "rows": rows, "runs": used, "last": last}


def row_key(variant, settings):
    return variant if settings == "paper" else f"{variant} ({settings})"


def cell_text(values, digits):
    """'3.471' for one seed, '3.471 ± 0.002' (sample std) for several, '' for none."""
    if not values:
        return ""
    mean = f"{np.mean(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ± {np.std(values, ddof=1):.{digits}f}"


def best_variants(table, column, metric, digits):
    """Rows whose mean equals the lowest mean of the column at the shown precision."""
    means = {v: round(float(np.mean(table["cells"][(v, *column, metric)])), digits)
             for v in table["rows"] if (v, *column, metric) in table["cells"]}
    finite = [m for m in means.values() if np.isfinite(m)]
    return {v for v, m in means.items() if finite and m == min(finite)}


def table_rows(table, digits, bold):
    """Per row: the name and the cell texts, best cells wrapped by `bold`."""
    best = {(c, m): best_variants(table, c, m, digits) for c in table["columns"] for m in METRICS}
    rows = []
    for v in table["rows"]:
        texts = []
        for column in table["columns"]:
            for metric in METRICS:
                text = cell_text(table["cells"].get((v, *column, metric), []), digits)
                texts.append(bold(text) if text and v in best[(column, metric)] else text)
        variant, _, settings = v.partition(" ")
        rows.append((" ".join(filter(None, (VARIANT_NAMES[variant], settings))), texts))
    return rows


def to_markdown(table, digits=3):
    header = ["Variant"] + [f"{dataset_name(d)} {s} {m}" for d, s in table["columns"] for m in METRICS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, texts in table_rows(table, digits, lambda t: f"**{t}**"):
        lines.append("| " + " | ".join([name] + texts) + " |")
    return "\n".join(lines) + "\n"


def latex_escape(text):
    return text.replace("_", r"\_").replace("&", r"\&").replace("%", r"\%")


def to_latex(table, digits=3):
    columns = table["columns"]
    datasets = list(dict.fromkeys(d for d, _ in columns))
    spans = [(d, sum(1 for c in columns if c[0] == d)) for d in datasets]
    lines = [r"\begin{tabular}{l" + " cc" * len(columns) + "}", r"\toprule"]
    lines.append("Dataset & " + " & ".join(
        rf"\multicolumn{{{2 * n}}}{{c}}{{\texttt{{{latex_escape(dataset_name(d))}}}}}" for d, n in spans) + r" \\")
    first, rules = 2, []
    for _, n in spans:
        rules.append(rf"\cmidrule(lr){{{first}-{first + 2 * n - 1}}}")
        first += 2 * n
    lines.append("".join(rules))
    lines.append("Model Scale & " + " & ".join(
        rf"\multicolumn{{2}}{{c}}{{\textsf{{{latex_escape(s)}}}}}" for _, s in columns) + r" \\")
    lines.append("".join(rf"\cmidrule(lr){{{2 + 2 * i}-{3 + 2 * i}}}" for i in range(len(columns))))
    lines.append(" & " + " & ".join(["Train & Val"] * len(columns)) + r" \\")
    lines.append(r"\midrule")
    for name, texts in table_rows(table, digits, lambda t: rf"\textbf{{{t}}}"):
        cells = [t.replace("±", r"$\pm$") for t in texts]
        lines.append(" & ".join([name] + cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def runs_markdown(table):
    """Which run gave which numbers, so every cell can be traced to a directory."""
    lines = ["| run | dataset | size | variant | settings | seed | last step | train values averaged | train | val |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run, train, val in table["runs"]:
        steps = run.train["step"]
        last_step = int(steps[-1]) if len(steps) else ""
        averaged = min(len(steps), table["last"])
        train_text, val_text = ("" if x is None else f"{x:.4f}" for x in (train, val))
        lines.append(f"| {run.name} | {run.group[0]} | {run.group[1]} | {run.variant} | {run.settings} | "
                     f"{run.seed} | {last_step} | {averaged} | {train_text} | {val_text} |")
    return "\n".join(lines) + "\n"


def settings_markdown(runs):
    """Each run's value of every setting configs/authors.py changes (docs/faithfulness.md), from its
    config.json; a setting its config.json lacks predates the setting and had the paper's value.
    Empty when every run has the paper's settings."""
    if all(run.settings == "paper" for run in runs):
        return ""
    keys = list(authors_settings())
    lines = ["| run | settings | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for run in runs:
        values = [repr(run.config[k]) if k in run.config else "(paper's, not recorded)" for k in keys]
        lines.append(f"| {run.name} | {run.settings} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def write_loss_table(runs, out_dir, last=200, digits=3, datasets=None, sizes=None):
    """Writes loss_table.md (table + run list) and loss_table.tex; returns (table, markdown table)."""
    table = build_table(runs, last, datasets, sizes)
    markdown = to_markdown(table, digits)
    short = [r.name for r, _, _ in table["runs"] if len(r.train["step"]) < last]
    note = (f"Train = mean of the last {last} logged train losses; Val = last logged val loss; "
            "best per column in bold; mean ± std over seeds where several.\n")
    if short:
        note += f"Runs with fewer than {last} logged steps (mean over all of them): {', '.join(short)}.\n"
    os.makedirs(out_dir, exist_ok=True)
    settings = settings_markdown([run for run, _, _ in table["runs"]])
    with open(os.path.join(out_dir, "loss_table.md"), "w") as f:
        f.write(markdown + "\n" + note + "\n" + runs_markdown(table) + (settings and "\n" + settings))
    with open(os.path.join(out_dir, "loss_table.tex"), "w") as f:
        f.write(to_latex(table, digits))
    return table, markdown + "\n" + note


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run directories (config.json + metrics.jsonl)")
    p.add_argument("--out", default="out/analysis", help="folder for loss_table.md and loss_table.tex")
    p.add_argument("--last", type=int, default=200, help="train loss = mean of this many last logged values")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--datasets", nargs="+", help="fixed column layout, e.g. openwebtext fineweb_edu")
    p.add_argument("--sizes", nargs="+", help="fixed column layout, e.g. S M L")
    args = p.parse_args(argv)
    try:
        if args.last < 1:
            raise AnalysisError(f"--last must be at least 1, got {args.last}")
        runs = find_runs(args.runs, exclude=args.out)
        _, markdown = write_loss_table(runs, args.out, args.last, args.digits, args.datasets, args.sizes)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(markdown, end="")
    print(f"wrote {os.path.join(args.out, 'loss_table.md')} and {os.path.join(args.out, 'loss_table.tex')}")


if __name__ == "__main__":
    main()
