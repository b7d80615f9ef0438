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
                "--warmup", "1", "--residuals", "res,mhclite", "--recompute", "off", "--no-micro",
                "--json", str(tmp_path / "bench.json")])
    result = run_script("table", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("| ") and "variant" not in line}
    assert set(rows) == {"res", "mhclite"}
    assert rows["res"][-1] == "-"  # no H_res in res
    assert float(rows["mhclite"][-1]) < 1e-6 and float(rows["mhclite"][-2]) < 1e-6  # exact, trained weights
    assert float(rows["mhclite"][0].replace(",", "")) > 0  # tokens/s
    assert json.loads((tmp_path / "bench.json").read_text())["variants"]["mhclite"]["time_ratio"] > 0


def test_usage_errors_exit_2():
    assert run_script().returncode == 2
    assert run_script("plot", "x").returncode == 2
