"""python -m benchmarks.gpu_check: the CPU dry run of every part at tiny shapes (the GPU runs it at M),
its summary, and its flags."""

import json

import numpy as np
import pytest
import torch

from benchmarks import gpu_check
from conftest import one_error_line


def summary_rows(text):
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| ")]
    return {row[0]: row for row in rows if row[0] in gpu_check.PARTS}


def run_check(parts, out, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cpu", "--size", "tiny", "--out", str(out), *parts])
    return exit_info.value.code, capsys.readouterr().out


@pytest.mark.slow
def test_cpu_dry_run_runs_every_part_and_the_summary_comes_last(tmp_path, capsys):
    """Every part at tiny shapes on CPU, in two commands on one results folder: the second command's
    summary also covers the parts of the first."""
    out = tmp_path / "check"
    code, printed = run_check(["bench", "tests"], out, capsys)
    assert code == 0, printed
    statuses = {part: row[1] for part, row in summary_rows((out / "summary.md").read_text()).items()}
    assert statuses == {"tests": "ok", "bench": "ok", "train": "not run", "fused": "not run",
                        "kernels": "not run", "sharded": "not run"}
    assert printed.index("gpu_check: tests") < printed.index("gpu_check: bench")  # the parts' order

    code, printed = run_check(["train", "fused", "kernels", "sharded"], out, capsys)
    summary = (out / "summary.md").read_text()
    assert printed.rstrip().endswith(summary.rstrip())  # printed last
    assert code == 0, printed
    rows = summary_rows(summary)
    assert {part: row[1] for part, row in rows.items()} == dict.fromkeys(gpu_check.PARTS, "ok")
    for name in ["kernels.json", "latency.json", "predicted_times.json", *(f"{part}.log" for part in gpu_check.PARTS)]:
        assert (out / name).is_file(), name
    for name, _ in gpu_check.BENCH_RUNS:
        variants = json.loads(open(gpu_check.bench_json(str(out), name)).read())["variants"]
        assert variants["mhclite"]["time_ratio"] > 0
        assert variants["mhclite"]["connections"]["path"] == ("fused" if "fused" in name else "reference"), name
        assert f"{name} " in rows["bench"][4]
    assert "passed" in rows["tests"][4] and "32 skipped" in rows["tests"][4]  # test_cuda.py skips on CPU
    tokens = np.fromfile(out / "data" / "random" / "train.bin", dtype=np.uint16)
    assert tokens.max() < gpu_check.GPT2_TOKENS and len(np.unique(tokens[:100000])) > 40000
    for residual in gpu_check.VARIANTS:
        assert (out / f"train-{residual}" / "done").is_file()
        assert f"{residual} " in rows["train"][4]
    # the trained mhclite's H_res is exact; hc's is not doubly stochastic at all
    errors = {cell.split()[0]: cell.split()[-1] for cell in rows["train"][4].split("; ") if "sum" in cell}
    assert float(errors["mhclite"]) < 1e-6 < float(errors["hc"])
    assert rows["kernels"][4].startswith("x copy, us measured / predicted at M: hc float32 ")
    assert rows["kernels"][4].endswith("; no hardware counters (benchmarks.kernel_counters: kernels.log says why)")
    assert "skipped: no hardware counters here: needs a CUDA GPU and ncu" in (out / "kernels.log").read_text()
    # every kernel's prediction (python -m fused.tools.latency) is printed beside its time
    assert all(row["predicted_us_at_m"] > 0 for row in json.loads((out / "kernels.json").read_text())["kernels"]["rows"])
    # the fused part's training runs, each against the reference's losses; on CPU train.py takes the
    # reference path whatever fused_connections says, so only the bf16 streams move a loss
    training = gpu_check.fused_training(str(out))
    assert list(training) == [name for name, _, _ in gpu_check.FUSED_RUNS]
    assert all(f"{name} " in rows["fused"][4] for name in training)
    assert "connections: mhclite reference (fused_connections=True but:" in (out / "fused.log").read_text()
    assert "difference" not in training["res"] and training["reference"]["difference"] == 0.0
    assert training["fused"]["difference"] == 0.0 < training["fused + bf16 streams"]["difference"] < 1e-2
    assert all(run["path"]["path"] == "reference" and run["x_res"] > 0 for run in training.values())
    assert "; the default here: no fused kernels ran: fused_connections=True but: " in rows["fused"][4]
    # the sharded part: one process under torchrun, sharded, with and without activation checkpointing,
    # which recomputes the same forward: the same losses
    for name, _ in gpu_check.SHARDED_RUNS:
        run = out / gpu_check.sharded_dir(name)
        assert (run / "done").is_file() and (run / "ckpt.dcp").is_symlink(), name
        assert f"{name} " in rows["sharded"][4]
    losses = [[r["train_loss"] for r in map(json.loads, open(out / gpu_check.sharded_dir(name) / "metrics.jsonl"))
               if "train_loss" in r] for name, _ in gpu_check.SHARDED_RUNS]
    assert losses[0] == losses[1] and len(losses[0]) == 4  # every step of the dry run


@pytest.mark.parametrize("fused_ms, difference, path, verdict", [
    (50.0, 1e-4, "fused", "yes: faster (0.83 x the reference path), loss within 0.002"),
    (70.0, 1e-4, "fused", "no: slower (1.17 x the reference path), loss within 0.002"),
    (50.0, 3e-3, "fused", "no: faster (0.83 x the reference path), a loss 3.0e-03 off"),
    (50.0, 1e-4, "reference", "no fused kernels ran: why"),
])
def test_the_kernels_are_the_default_only_where_they_ran_faster_and_as_accurate(fused_ms, difference, path, verdict):
    def run(ms, difference, path):
        return dict(ms=ms, x_res=ms / 30.0, difference=difference, path=dict(path=path, why="why"))
    training = {"reference": run(60.0, 0.0, "reference"), "fused": run(fused_ms, difference, path),
                "fused + bf16 streams": run(40.0, 1e-2, "fused")}
    assert gpu_check.fused_verdict(training) == verdict


def test_help_says_what_each_part_verifies(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "minutes on one H100 at M" in printed
    for part in gpu_check.PARTS:
        assert f"  {part}  " in printed and f"  {gpu_check.H100_MINUTES[part]}  " in printed, part


@pytest.mark.parametrize("argv, message", [
    (["benchmark"], "error: unknown part 'benchmark'; valid: tests bench train fused kernels sharded"),
    (["--device", "cpu", "--size", "M"], "error: the CPU dry run is --device cpu --size tiny"),
    (["--size", "XL"], "error: argument --size: invalid choice: 'XL'"),
])
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
    out = tmp_path / "check"
    assert one_error_line(gpu_check.main, ["--device", "cpu", "--out", str(out), *argv], capsys).startswith(message)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_cuda_without_a_gpu_is_one_error_line(capsys):
    assert "no CUDA GPU is visible" in one_error_line(gpu_check.main, ["bench"], capsys)
