"""scripts/gpu_check.py's data and table on CPU with a tiny model (the GPU runs it at M)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import bench
import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.py")
STAGES = ["tests", "bench", "train", "options", "kernels"]


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.slow
def test_random_data_trains_and_the_table_reports_every_variant(tmp_path):
    assert run_script("data", str(tmp_path / "data")).returncode == 0
    tokens = np.fromfile(tmp_path / "data" / "random" / "train.bin", dtype=np.uint16)
    assert tokens.max() < 50257 and len(np.unique(tokens[:100000])) > 40000
    for residual in ("res", "mhclite"):
        train.main(["--dataset=random", f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / f'train-{residual}'}",
                    "--size=tiny", f"--residual={residual}", "--n_layer=1", "--block_size=32", "--batch_size=2",
                    "--gradient_accumulation_steps=1", "--max_iters=6", "--warmup_iters=2", "--eval_interval=6",
                    "--eval_iters=1", "--log_interval=2", "--device=cpu", "--compile=false"])
    bench.main(["--size", "tiny", "--device", "cpu", "--batch_size", "2", "--block_size", "32", "--steps", "2",
                "--warmup", "1", "--residuals", "res,mhclite", "--recompute", "off", "--json", str(tmp_path / "bench.json")])
    result = run_script("table", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("| ") and "variant" not in line}
    assert set(rows) == {"res", "mhclite"}
    assert rows["res"][-1] == "-"  # no H_res in res
    assert float(rows["mhclite"][-1]) < 1e-6 and float(rows["mhclite"][-2]) < 1e-6  # exact, trained weights
    assert float(rows["mhclite"][1].replace(",", "")) > 0  # tokens/s
    assert float(rows["mhclite"][0]) > 0  # the first step's seconds
    assert json.loads((tmp_path / "bench.json").read_text())["variants"]["mhclite"]["time_ratio"] > 0


def run_check(*args, out):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--size", "tiny", "--out", str(out), *args],
                          capture_output=True, text=True, cwd=REPO, env=env)


def stage_statuses(summary):
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in summary.splitlines() if line.startswith("| ")]
    return {row[0]: row[2] for row in rows if row[0] in STAGES}


@pytest.mark.slow
def test_cpu_dry_run_runs_every_stage_and_the_summary_comes_last(tmp_path):
    """The whole GPU check at tiny shapes on CPU, in two commands on one results folder."""
    out = tmp_path / "check"
    first = run_check("bench", "tests", out=out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert stage_statuses((out / "summary.md").read_text()) == {
        "tests": "ok", "bench": "ok", "train": "not run", "options": "not run", "kernels": "not run"}
    assert first.stdout.index("gpu_check: tests") < first.stdout.index("gpu_check: bench")  # the planned order

    second = run_check("train", "options", "kernels", out=out)
    summary = (out / "summary.md").read_text()
    assert second.stdout.rstrip().endswith(summary.rstrip())  # printed last
    statuses = stage_statuses(summary)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert set(statuses.values()) == {"ok"}
    for name in ["bench.json", "micro.json", "kernels.json", "bench-stream_dtype_bfloat16.json", "bench-fused_connections_on_stream_dtype_bfloat16.json",
                 *(f"{s}.log" for s in STAGES)]:
        assert (out / name).is_file(), name
    rows = {line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ")}
    assert {"res", "hc", "mhc", "mhclite", "stream_dtype_bfloat16", "fused_connections_on_stream_dtype_bfloat16"} <= rows
    for residual in ("res", "hc", "mhc", "mhclite"):
        assert (out / f"train-{residual}" / "done").is_file()


def test_unknown_stage_is_one_error_line(tmp_path):
    result = run_check("benchmark", out=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown stage 'benchmark'; valid: tests bench train options kernels"
    assert not (tmp_path / "summary.md").exists()


def test_usage_errors_exit_2():
    assert run_script().returncode == 2
    assert run_script("plot", "x").returncode == 2
