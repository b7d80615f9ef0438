"""Shared helpers for the analysis scripts: reading run directories and collected npz files,
grouping runs, moving statistics, display names."""
import ast
import functools
import glob
import json
import math
import os
import platform
import zipfile
from dataclasses import dataclass

import numpy as np

RESIDUALS = ("res", "hc", "mhc", "mhclite", "kromhc", "ihc")  # residuals.RESIDUALS, read without importing torch
V4_EPS = "mhc-v4eps"  # mhc with DeepSeek-V4's epsilons (mhc_eps > 0): a variant of its own here
# The variants a run can be, in the order tables and figures show them; the paper's four always appear.
VARIANTS = ("res", "hc", "mhc", V4_EPS, "mhclite", "kromhc", "ihc")
PAPER_VARIANTS = ("res", "hc", "mhc", "mhclite")
HC_FAMILY = ("hc", "mhc", V4_EPS, "mhclite", "kromhc", "ihc")
VARIANT_NAMES = {"res": "Residual", "hc": "HC", "mhc": "mHC", V4_EPS: "mHC (V4 eps)", "mhclite": "mHC-lite",
                 "kromhc": "KromHC", "ihc": "iHC"}
VARIANT_COLORS = {"res": "tab:gray", "hc": "tab:blue", "mhc": "tab:orange", V4_EPS: "tab:red", "mhclite": "tab:green",
                  "kromhc": "tab:purple", "ihc": "tab:brown"}
DATASET_NAMES = {"openwebtext": "OpenWebText", "fineweb_edu": "FineWeb-Edu",
                 "shakespeare": "Shakespeare", "shakespeare_char": "Shakespeare (char)"}
SIZE_ORDER = ("tiny", "S", "M", "L")
TRAIN_KEYS = ("step", "train_loss", "lr", "grad_norm", "tokens_per_s", "step_ms")
EVAL_KEYS = ("step", "eval_train_loss", "val_loss")
FIRST_STEP_KEYS = ("step", "first_step_s")
AUTHORS_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "authors.py")
SETTINGS_LABELS = ("paper", "authors", "mixed")


class AnalysisError(Exception):
    """Bad input (missing run, wrong variant, malformed file); the scripts print it as one line."""


@functools.cache
def authors_settings():
    """{key: value} of configs/authors.py, the settings where the authors' code differs from the
    paper as written (plain `key = literal` lines, read without importing the model)."""
    with open(AUTHORS_CONFIG, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)}


def variant_of(residual, mhc_eps=0.0):
    """The variant of a model: its residual, or V4_EPS for mhc with DeepSeek-V4's epsilons (a config.json
    from before mhc_eps existed: 0, the paper's)."""
    return V4_EPS if residual == "mhc" and mhc_eps else residual


def dataset_name(dataset):
    return DATASET_NAMES.get(dataset, dataset)


def group_label(group):
    dataset, size = group
    return f"{dataset_name(dataset)} {size}"


def group_slug(group):
    """File-name part for a (dataset, size) group, e.g. 'openwebtext-S'."""
    return f"{group[0]}-{group[1]}"


def size_sort_key(size):
    return (SIZE_ORDER.index(size) if size in SIZE_ORDER else len(SIZE_ORDER), size)


def group_sort_key(group):
    """Paper order: OpenWebText before FineWeb-Edu, then our datasets; sizes tiny, S, M, L."""
    dataset, size = group
    datasets = list(DATASET_NAMES)
    return (datasets.index(dataset) if dataset in datasets else len(datasets), dataset, *size_sort_key(size))


@dataclass
class Run:
    path: str
    config: dict
    train: dict  # TRAIN_KEYS -> float64 array over the logged training steps
    evals: dict  # EVAL_KEYS -> float64 array over the logged evaluations
    first_steps: dict  # FIRST_STEP_KEYS -> float64 array, one entry per start or resume of the run

    @property
    def name(self):
        return os.path.basename(os.path.normpath(self.path))

    @property
    def residual(self):
        return self.config["residual"]

    @property
    def variant(self):
        return variant_of(self.residual, self.config.get("mhc_eps", 0.0))

    @property
    def seed(self):
        return self.config["seed"]

    @property
    def group(self):
        return (self.config["dataset"], self.config["size"])

    @property
    def settings(self):
        """"paper" (none of configs/authors.py's values; a key missing from an older config.json
        is the paper's default), "authors" (all of them) or "mixed"."""
        theirs = [self.config.get(key) == value for key, value in authors_settings().items()]
        return "authors" if all(theirs) else "mixed" if any(theirs) else "paper"

    @property
    def label(self):
        """The variant's name, with the settings unless they are the paper's: "mHC-lite (authors)"."""
        name = VARIANT_NAMES[self.variant]
        return name if self.settings == "paper" else f"{name} ({self.settings})"


def latest_trajectory(records):
    """If a step appears twice (e.g. the evaluation at the step a run resumed from), the later
    record wins and replaces everything logged from that step on."""
    kept = []
    for rec in records:
        while kept and kept[-1]["step"] >= rec["step"]:
            kept.pop()
        kept.append(rec)
    return kept


def read_metrics(path):
    """metrics.jsonl -> (train records, eval records, first-step records), told apart by key; a
    first-step record holds the time of the first step of a start or resume (its compilation)."""
    with open(path) as f:
        lines = f.read().split("\n")
    train, evals, firsts = [], [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # a run killed mid-write leaves a partial last line
                continue
            raise AnalysisError(f"{path}:{lineno}: not a JSON object")
        if not isinstance(rec, dict) or "step" not in rec:
            raise AnalysisError(f"{path}:{lineno}: expected a JSON object with a 'step' key")
        if "train_loss" in rec:
            train.append(rec)
        elif "val_loss" in rec:
            evals.append(rec)
        elif "first_step_s" in rec:
            firsts.append(rec)
    return latest_trajectory(train), latest_trajectory(evals), latest_trajectory(firsts)


def as_arrays(records, keys):
    # null (e.g. mfu on CPU) and absent values become NaN
    return {k: np.array([np.nan if r.get(k) is None else r[k] for r in records], dtype=np.float64) for k in keys}


def load_run(path):
    config_path = os.path.join(path, "config.json")
    metrics_path = os.path.join(path, "metrics.jsonl")
    for p in (config_path, metrics_path):
        if not os.path.isfile(p):
            raise AnalysisError(f"run '{path}' has no {os.path.basename(p)}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise AnalysisError(f"{config_path}: not valid JSON ({e.msg})")
    for key in ("dataset", "size", "residual", "seed"):
        if key not in config:
            raise AnalysisError(f"{config_path} lacks the key '{key}'")
    if config["residual"] not in RESIDUALS:
        raise AnalysisError(f"{config_path}: unknown residual '{config['residual']}'; valid: {', '.join(RESIDUALS)}")
    train, evals, firsts = read_metrics(metrics_path)
    return Run(path, config, as_arrays(train, TRAIN_KEYS), as_arrays(evals, EVAL_KEYS),
               as_arrays(firsts, FIRST_STEP_KEYS))


def is_run_dir(path):
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in ("config.json", "metrics.jsonl"))


def default_cell(run):
    return (*run.group, run.variant, run.settings, run.seed)


def find_runs(paths, exclude=None, cell_of=default_cell):
    """Loads the run directories among `paths` (as a shell glob like out/* gives them). Other
    directories (e.g. a report folder next to the runs) are skipped with a note; `exclude` (the
    output folder) is skipped silently. Two runs with the same `cell_of(run)` are an error."""
    if not paths:
        raise AnalysisError("no run directories given (--runs)")
    skip_root = os.path.realpath(exclude) if exclude else None
    runs, cells = [], {}
    expanded = []
    for path in paths:  # a quoted glob reaches us unexpanded
        matches = sorted(glob.glob(path)) if not os.path.exists(path) and glob.has_magic(path) else [path]
        expanded += matches or [path]
    for path in dict.fromkeys(expanded):
        if not os.path.exists(path):
            raise AnalysisError(f"run directory '{path}' does not exist")
        real = os.path.realpath(path)
        if real == skip_root:
            continue
        if not is_run_dir(path):
            print(f"note: skipping '{path}': not a run directory (no config.json or metrics.jsonl)")
            continue
        run = load_run(path)
        cell = cell_of(run)
        if cell in cells:
            raise AnalysisError(f"runs '{cells[cell]}' and '{path}' are both {'/'.join(map(str, cell[:-1]))} "
                                f"seed {cell[-1]}; pass only one of them")
        cells[cell] = path
        runs.append(run)
    if not runs:
        raise AnalysisError(f"none of the {len(paths)} paths given is a run directory")
    return runs


def after_warmup(run, key, skip=None):
    """A run's logged `key` values without the first `skip` steps (10% of them by default) and
    without nulls: train.py logs null timings for a window that held only a process's first step,
    whose time (compilation included) it records apart, so no timing here includes a compile."""
    values = run.train[key]
    skip = len(values) // 10 if skip is None else skip
    kept = values[skip:]
    kept = kept[~np.isnan(kept)]
    if len(kept) == 0:
        raise AnalysisError(f"run '{run.path}' has {len(values)} logged steps, none with a {key} left after "
                            f"skipping {skip}")
    return kept


def group_runs(runs):
    """{(dataset, size): {variant: [runs sorted by seed]}}, groups in paper order."""
    groups = {}
    for run in runs:
        groups.setdefault(run.group, {}).setdefault(run.variant, []).append(run)
    for by_variant in groups.values():
        for variant_runs in by_variant.values():
            variant_runs.sort(key=lambda r: r.seed)
    return {g: groups[g] for g in sorted(groups, key=group_sort_key)}


def effective_window(window, n_points):
    """The moving-average window, shortened to a quarter of the run when the run is short."""
    return max(1, min(window, n_points // 4))


def moving_stats(values, window):
    """Trailing moving mean and std over full windows: entry i covers values[i : i + window]."""
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(values, dtype=np.float64), window)
    return windows.mean(axis=1), windows.std(axis=1)


def seed_stats(values):
    """(mean, std, count) of the values that are not NaN; std 0 below two values, mean NaN for none."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return math.nan, 0.0, 0
    return float(values.mean()), float(values.std()) if len(values) > 1 else 0.0, int(len(values))


def seed_summary(members, metrics):
    """{metric, metric_std, metric_n} over the rows `members` (one per seed), by seed_stats."""
    summary = {}
    for metric in metrics:
        summary[metric], summary[metric + "_std"], summary[metric + "_n"] = seed_stats([r[metric] for r in members])
    return summary


def format_mean_std(value, std, count, digits=4, scientific=False):
    """"2.2514 ± 0.0100" (or "5.94e-02 ± 1.2e-03"); the value alone for one seed, "-" for NaN."""
    if math.isnan(value):
        return "-"
    text = f"{value:.2e}" if scientific else f"{value:.{digits}f}"
    if count > 1:
        text += f" ± {std:.1e}" if scientific else f" ± {std:.{digits}f}"
    return text


def machine_line():
    """The machine in one line. It names the vector instructions torch's CPU kernels use (AVX2,
    AVX512, ...), since they choose the floating-point path and so the bits of a run."""
    import torch  # only the study pages need it; the other scripts stay torch-free at import
    return (f"{platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()} kernels), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


COLLECT_METADATA = ("residual", "dataset", "size", "run_seed", "n_layer", "n_streams", "step", "num_seqs",
                    "seq_len", "seed", "checkpoint")


def load_collected(path, arrays=("h_res",)):
    """The metadata (as Python scalars) and the named arrays of a collect.py npz; only those
    arrays are read, so an L model's file need not fit in memory at once."""
    if not os.path.isfile(path):
        raise AnalysisError(f"collected file '{path}' does not exist (run analysis/collect.py first)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in (*COLLECT_METADATA, "h_res") if k not in npz.files]
            if missing:
                raise AnalysisError(f"'{path}' is not a file written by analysis/collect.py (no {missing[0]})")
            data = {k: npz[k].item() for k in COLLECT_METADATA}
            # a file from before the mhc_eps setting holds the paper's mhc
            data["variant"] = npz["variant"].item() if "variant" in npz.files else data["residual"]
            for k in arrays:
                if k not in npz.files:
                    raise AnalysisError(f"'{path}' ({data['residual']}) has no '{k}' array")
                data[k] = npz[k]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise AnalysisError(f"'{path}' is not a readable npz file ({e})")
    return data
