"""python -m benchmarks.gpu_check: the CPU dry run of quick at tiny shapes (the GPU runs it at M), then
the other parts into the same folder; the verdict; the parts' limits; the flags."""

import json
import os
from pathlib import Path

import pytest
import torch

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

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
def test_quick_dry_run_then_the_other_parts_into_the_same_folder(tmp_path, capsys, monkeypatch, triton_compile_cache):
    """quick at tiny shapes on CPU: every part of it in order, at most eight files, the numbers the
    verdict reads; then the parts quick leaves out, into the same folder, whose summary covers both."""
    # The suite's caches: kernels already compiled for sm_90 (test_fused_resources.py) and inductor's graphs.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_compile_cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    # The limits are an H100's at M; this shared CPU is slower. test_a_part_stopped_... tests them.
    monkeypatch.setattr(gpu_check, "QUICK_LIMITS", {part: 10 * s for part, s in gpu_check.QUICK_LIMITS.items()})
    monkeypatch.setattr(gpu_check, "QUICK_MINUTES", 10 * gpu_check.QUICK_MINUTES)
    out = tmp_path / "check"
    code, printed = run_check(["quick"], out, capsys)
    summary = (out / "summary.md").read_text()
    assert code == 0, printed
    assert printed.rstrip().endswith(summary.rstrip())  # printed last
    labels = ["kernel tests", "bench.py, every path", "train.py, reference", "bench.py, hc and mhc",
              "fused.tools.latency"]
    assert [printed.index(f"gpu_check: {label}") for label in labels] == sorted(
        printed.index(f"gpu_check: {label}") for label in labels)  # the parts' order
    # no hardware counters without a GPU, so seven of the eight files
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "gpu_check.log", "kernels.json", "latency.json",
                                                      "others.json", "results.json", "summary.md"]
    rows = summary_rows(summary)
    assert {part: row[1] for part, row in rows.items()} == {**dict.fromkeys(gpu_check.QUICK_LIMITS, "ok"),
                                                             "sharded": "not run"}
    assert rows["tests"][4].startswith("1 passed, 6 skipped in ")  # test_cuda.py's kernel tests skip on CPU
    results = json.loads((out / "results.json").read_text())
    # bench.py ran res and mhclite on every path in one process: the fused rows in Triton's interpreter
    bench = results["bench"]["rows"]
    assert set(bench) == {"res", *gpu_check.PATHS}
    assert {path: row["path"] for path, row in bench.items()} == {
        "res": "reference", "reference": "reference", "reference + bf16 streams": "reference", "fused": "fused",
        "fused + bf16 streams": "fused"}
    assert all(row["x_res"] > 0 and row["tokens_per_s"] > 0 for row in bench.values())
    # train.py takes the reference path on CPU whatever fused_connections says: only bf16 streams move a
    # loss, and the trained H_res is exact on every path
    runs = results["train"]["runs"]
    assert list(runs) == list(gpu_check.PATHS) and all(run["path"] == "reference" for run in runs.values())
    assert runs["reference"]["difference"] == runs["fused"]["difference"] == 0.0
    assert 0 < runs["reference + bf16 streams"]["difference"] == runs["fused + bf16 streams"]["difference"] < 1e-2
    assert all(run["h_res_error"] < 1e-6 for run in runs.values())
    assert list(results["others"]["rows"]) == ["res", "hc", "mhc"]
    verdict = summary.splitlines()[-1]
    assert verdict.startswith("**Verdict**: run on this GPU: reference (")
    assert "kernels, fp32 streams: did not run (fused_connections=True but: " in verdict
    # every kernel's prediction (python -m fused.tools.latency) is printed beside its time
    kernel_rows = json.loads((out / "kernels.json").read_text())["kernels"]["rows"]
    assert {row["residual"] for row in kernel_rows} == {"hc", "mhc", "mhclite"}
    assert all(row["predicted_us_at_m"] > 0 for row in kernel_rows)
    assert rows["kernels"][4].endswith("; no hardware counters (benchmarks.kernel_counters: gpu_check.log says why)")
    assert "skipped: no hardware counters here: needs a CUDA GPU and ncu" in (out / "gpu_check.log").read_text()

    code, printed = run_check(["tests", "sharded"], out, capsys)
    assert code == 0, printed
    rows = summary_rows((out / "summary.md").read_text())
    assert {part: row[1] for part, row in rows.items()} == dict.fromkeys(gpu_check.PARTS, "ok")
    assert "32 skipped" in rows["tests"][4] and "passed" in rows["tests"][4]  # test_cuda.py skips on CPU
    assert rows["train"][4] == summary_rows(summary)["train"][4]  # quick's results stay
    # one process under torchrun, sharded, with and without activation checkpointing, which recomputes
    # the same forward: the same losses at every step
    sharded = json.loads((out / "results.json").read_text())["sharded"]["runs"]
    losses = [run["losses"] for run in sharded.values()]
    assert list(sharded) == [name for name, _ in gpu_check.SHARDED_RUNS] and losses[0] == losses[1]
    assert len(losses[0]) == 4


def test_a_part_stopped_at_its_limit_does_not_stop_the_next(tmp_path, capsys, monkeypatch):
    """Each part of quick stops at its limit, with its children; the next part still starts, until
    fewer than MIN_PART_SECONDS of quick's minutes are left; the summary is written all the same."""
    monkeypatch.setattr(gpu_check, "QUICK_LIMITS", {"tests": 2, "others": 2, "kernels": 60})
    monkeypatch.setattr(gpu_check, "QUICK_MINUTES", 5 / 60)
    monkeypatch.setattr(gpu_check, "MIN_PART_SECONDS", 1)
    out = tmp_path / "check"
    code, printed = run_check(["quick"], out, capsys)
    assert code == 1
    rows = summary_rows((out / "summary.md").read_text())
    assert {part: row[1] for part, row in rows.items()} == {
        "tests": "stopped at its limit (2 s)", "bench": "not run", "train": "not run",
        "others": "stopped at its limit (2 s)", "kernels": "skipped: quick's minutes were spent", "sharded": "not run"}
    assert "**Verdict**: no verdict: the bench and train parts must both finish" in printed
    assert (out / "gpu_check.log").read_text().count("stopped at the part's limit of 2 s") == 2
    running = [cmdline.read_bytes() for cmdline in Path("/proc").glob("[0-9]*/cmdline") if cmdline.is_file()]
    assert not [cmd for cmd in running if str(out).encode() in cmd]  # bench.py was stopped with the part


def bench_row(x_res, path="reference", why="why"):
    return dict(ms=30.0 * x_res, x_res=x_res, path=path, why=why)


def train_run(difference, path="reference", why="why"):
    return dict(difference=difference, path=path, why=why)


def results_with(fused_x_res=1.4, fused_difference=2e-4, fused_took="fused", bf16_fused_x_res=1.2):
    """Bench and train results of the four paths: the reference path at 1.5 x res (fp32 streams) and 1.35
    (bf16 streams), the kernels as given."""
    bench = {"res": bench_row(1.0), "reference": bench_row(1.5), "reference + bf16 streams": bench_row(1.35),
             "fused": bench_row(fused_x_res, fused_took, "the kernels' reason"),
             "fused + bf16 streams": bench_row(bf16_fused_x_res, "fused")}
    runs = {"reference": train_run(0.0), "reference + bf16 streams": train_run(1.2e-2),
            "fused": train_run(fused_difference, fused_took, "the kernels' reason"),
            "fused + bf16 streams": train_run(1.2e-2, "fused")}
    return dict(bench=dict(rows=bench), train=dict(runs=runs))


@pytest.mark.parametrize("results, expected", [
    (results_with(), ["run on this GPU: fused (", "kernels / reference path, fp32 streams: 0.93 (at least 5% faster: "
                      "yes)", "mhclite, fused: 1.40 x res (target 1.5: met), max abs(loss - reference) 2.0e-04",
                      "kernels / reference path, bf16 streams: 0.89 (at least 5% faster: yes)",
                      "mhclite, fused + bf16 streams: 1.20 x res (target 1.3: met), max abs(loss - reference) "
                      "1.2e-02"]),
    # faster, but a loss too far from the reference path's: the reference path is still the one to run
    (results_with(fused_difference=3e-3), ["run on this GPU: reference (", "mhclite, reference: 1.50 x res (target "
                                           "1.5: met)", "fp32 streams: 0.93 (at least 5% faster: yes)"]),
    # faster by less than the margin: chosen all the same, and the verdict says so
    (results_with(fused_x_res=1.45), ["run on this GPU: fused (", "fp32 streams: 0.97 (at least 5% faster: no)"]),
    # the run asked for the kernels and took the reference path: no kernels to judge
    (results_with(fused_took="reference"), ["run on this GPU: reference (", "kernels, fp32 streams: did not run (the "
                                            "kernels' reason)"]),
    # the fastest path with bf16 streams misses its target
    (results_with(bf16_fused_x_res=1.38), ["mhclite, reference + bf16 streams: 1.35 x res (target 1.3: missed)",
                                           "bf16 streams: 1.02 (at least 5% faster: no)"]),
    ({"bench": dict(rows={"res": bench_row(1.0)})}, ["no verdict: the bench and train parts must both finish"]),
])
def test_the_verdict_picks_the_fastest_path_that_trains_as_the_reference_path_does(results, expected):
    verdict = gpu_check.verdict(results)
    for text in expected:
        assert text in verdict, verdict


@pytest.mark.parametrize("argv, message", [
    (["benchmark"], "error: unknown part 'benchmark'; valid: quick tests bench train others kernels sharded"),
    (["quick", "sharded"], "error: quick runs alone"),
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
