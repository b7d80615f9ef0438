"""One status line for the runs still training: steps done, latest train loss and the time left at
the latest logged step time (an estimate: evals are not counted). Runs not started (no config.json)
or finished (a `done` marker) are left out; scripts/demo.sh calls it periodically.

    python analysis/progress.py out/demo/mhc out/demo/res out/demo/hc out/demo/mhclite
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from analysis.common import AnalysisError, read_metrics


def format_duration(seconds):
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


def run_status(path):
    """'<name> <step>/<max_iters>, loss <loss>, ~<m:ss> left' for a run in progress, else None."""
    config_path, metrics_path = os.path.join(path, "config.json"), os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(config_path) or os.path.exists(os.path.join(path, "done")):
        return None
    name = os.path.basename(os.path.normpath(path))
    try:
        with open(config_path) as f:
            max_iters = json.load(f)["max_iters"]
    except (ValueError, KeyError, OSError):
        return None  # being written right now: the next call sees it whole
    train = read_metrics(metrics_path)[0] if os.path.isfile(metrics_path) else []
    if not train:
        return f"{name} starting"
    last = train[-1]
    step_ms = next((r["step_ms"] for r in reversed(train) if r.get("step_ms") is not None), None)
    if last["step"] >= max_iters:
        left = ", finishing"  # the last eval and checkpoint
    elif step_ms is None:
        left = ""
    else:
        left = f", ~{format_duration((max_iters - last['step']) * step_ms / 1000)} left"
    return f"{name} {last['step']}/{max_iters}, loss {last['train_loss']:.3f}{left}"


def progress_line(paths):
    return " | ".join(status for status in map(run_status, paths) if status is not None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (out_dir of train.py)")
    args = p.parse_args(argv)
    try:
        line = progress_line(args.runs)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if line:
        print(line)


if __name__ == "__main__":
    main()
