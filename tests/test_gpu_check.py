"""python -m benchmarks.gpu_check: the CPU dry run of quick at tiny shapes (a GPU runs it at M), a part
stopped at its limit, the budget, the verdicts, the flags."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from conftest import one_error_line

ROWS = gpu_check.PATHS_BY_ROW


def summary_rows(text):
    """{first cell: row} of the summary's tables."""
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| ")]
    return {row[0]: row for row in rows}


def run_check(out, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["quick", "--device", "cpu", "--size", "tiny", "--out", str(out)])
    return exit_info.value.code, capsys.readouterr().out


@pytest.mark.slow
def test_quick_dry_run_runs_every_part_and_judges_the_paths_that_ran(tmp_path, capsys):
    """On CPU the CUDA tests skip, bench.py runs the fused rows in Triton's interpreter, and train.py
    takes the reference path whatever fused_connections says: the verdict leaves the kernels out.
    The graphs rows compile with inductor's CUDA graphs, which it leaves out on CPU."""
    out = tmp_path / "check"
    code, printed = run_check(out, capsys)
    summary = (out / "summary.md").read_text()
    assert code == 0, printed
    assert printed.rstrip().endswith(summary.rstrip())  # printed last
    labels = ["CUDA tests", "bench.py, every path", *(f"train.py, {path}" for path in gpu_check.PATHS),
              "bench.py, CUDA graphs"]
    positions = [printed.index(f"gpu_check: {label}") for label in labels]
    assert positions == sorted(positions)
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "gpu_check.log", "graphs.json", "results.json",
                                                     "summary.md"]
    rows = summary_rows(summary)
    assert [rows[part][1] for part in gpu_check.PARTS] == ["ok"] * 4
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "tests/test_cuda.py"],
                               capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    selected = re.match(r"(\d+)", collected).group(1)  # "N tests collected" or "N/M tests collected (...)"
    assert rows["tests"][3].startswith(f"{selected} skipped in ")  # every CUDA test, none run here
    results = json.loads((out / "results.json").read_text())
    # one bench.py process: res, hc and mhc on the reference path, mhclite on each of its paths
    bench = results["bench"]["rows"]
    assert list(bench) == ["res", "hc", "mhc", *ROWS]
    assert {row: r["path"] for row, r in bench.items()} == {
        **dict.fromkeys(["res", "hc", "mhc", "mhclite", "mhclite+bf16"], "reference"),
        "mhclite+fused": "fused", "mhclite+fused+bf16": "fused"}
    assert all(r["x_res"] > 0 and r["tokens_per_s"] > 0 for r in bench.values())
    assert all(rows[ROWS.get(row, row)][3] == f"{r['x_res']:.2f}" for row, r in bench.items())
    # the same seed and batches on every path: only bf16 streams move a loss
    runs = results["train"]["runs"]
    assert list(runs) == list(gpu_check.PATHS) and all(run["path"] == "reference" for run in runs.values())
    assert runs["reference"]["difference"] == runs["fused"]["difference"] == 0.0
    assert 0 < runs["reference + bf16 streams"]["difference"] == runs["fused + bf16 streams"]["difference"] < 1e-2
    verdict = next(line for line in summary.splitlines() if line.startswith("**Verdict**"))
    assert verdict.startswith("**Verdict**: run mhclite on this GPU with: reference")
    assert "fused: took the reference path (fused_connections=True but: " in verdict
    # one more bench.py process: res and mhclite compiled with and without CUDA graphs
    graphs = results["graphs"]["rows"]
    assert list(graphs) == ["res", "res+graphs", "mhclite", "mhclite+graphs"]
    assert graphs["res+graphs"]["x_res"] == graphs["res"]["x_res"] == graphs["res"]["x_plain_res"] == 1.0
    assert graphs["res+graphs"]["difference"] == graphs["mhclite+graphs"]["difference"] == 0.0
    assert summary.splitlines()[-1].startswith("**CUDA graphs**: res ")
    assert f"ordering** (the bench's reference path, fp32 streams): mhclite {bench['mhclite']['tokens_per_s']:,.0f}, " \
           f"hc {bench['hc']['tokens_per_s']:,.0f}, mhc {bench['mhc']['tokens_per_s']:,.0f} tokens/s" in summary
    kernels = bench["mhclite+fused"]["ms"] / bench["mhclite"]["ms"]  # in Triton's interpreter here
    assert f"**Kernels against the compiled path** (step time): fused {kernels:.2f} x reference; " in summary
    assert f"mhclite {graphs['mhclite+graphs']['ms'] / graphs['mhclite']['ms']:.2f} x its time without, its losses " \
           f"within 0.002 (0.0e+00)" in summary


def test_a_part_stopped_at_its_limit_does_not_stop_the_next(tmp_path, capsys, monkeypatch):
    """Each part stops at its limit, with its children; the next part still runs, and the summary
    is written all the same."""
    monkeypatch.setattr(gpu_check, "LIMITS", dict.fromkeys(gpu_check.PARTS, 2))
    out = tmp_path / "check"
    code, printed = run_check(out, capsys)
    assert code == 1
    rows = summary_rows((out / "summary.md").read_text())
    assert [rows[part][1] for part in gpu_check.PARTS] == ["stopped at its limit (2 s)"] * 4
    assert "**Verdict**: no verdict: the bench and train parts must both finish" in printed
    assert "**CUDA graphs**: not measured: the graphs part did not finish" in printed
    assert (out / "gpu_check.log").read_text().count("stopped at the part's limit of 2 s") == 4
    running = [cmdline.read_bytes() for cmdline in Path("/proc").glob("[0-9]*/cmdline") if cmdline.is_file()]
    assert not [cmd for cmd in running if str(out).encode() in cmd]  # bench.py was stopped with its part


def test_parts_stop_when_the_budget_runs_out(tmp_path, capsys, monkeypatch):
    """A part gets at most what is left of --budget, and one left with less than LEAST_PART_SECONDS
    is skipped: the summary still comes before the allocation's own limit does."""
    monkeypatch.setattr(gpu_check, "LEAST_PART_SECONDS", 2)
    out = tmp_path / "check"
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["quick", "--device", "cpu", "--size", "tiny", "--out", str(out), "--budget", "3"])
    assert exit_info.value.code == 1
    rows = summary_rows((out / "summary.md").read_text())
    assert rows["tests"][1] in ("ok", "stopped at its limit (3 s)")
    assert [rows[part][1] for part in gpu_check.PARTS[2:]] == ["skipped: 0 s of the budget left"] * 2
    assert rows["bench"][1] in ("stopped at its limit (3 s)", "stopped at its limit (2 s)",
                                "skipped: 1 s of the budget left", "skipped: 0 s of the budget left")
    assert "gpu_check: bench.py, CUDA graphs" not in capsys.readouterr().out


def test_the_train_part_runs_its_commands_at_once_and_the_others_in_turn(tmp_path, monkeypatch):
    """Two commands that each wait for the other's file end only when run at the same time: they do
    in train (its runs check losses, not times), and are stopped at the limit in a part run in turn.
    Each command's output reaches the log whole, after the command."""
    def waiting(mine, theirs):
        return (mine, [sys.executable, "-c", f"import os, time; open({str(tmp_path / mine)!r}, 'w').close(); "
                       f"print('{mine} starts'); [time.sleep(0.05) for _ in iter(lambda: os.path.exists("
                       f"{str(tmp_path / theirs)!r}), True)]; print('{mine} ends')"])

    monkeypatch.setattr(gpu_check, "part_commands", lambda part, args, scratch: [waiting("a", "b"), waiting("b", "a")])
    env = dict(os.environ)
    with open(tmp_path / "train.log", "w+", encoding="utf-8") as log:
        assert gpu_check.run_part("train", None, str(tmp_path), log, env, limit=60) == "ok"
        log.seek(0)
        assert "a starts\na ends\nexit code 0\n$ " in log.read()
    for name in "ab":
        (tmp_path / name).unlink()
    with open(tmp_path / "bench.log", "w+", encoding="utf-8") as log:
        assert gpu_check.run_part("bench", None, str(tmp_path), log, env, limit=3) == "stopped at its limit (3 s)"
    assert not (tmp_path / "b").exists()  # the second command never started


def bench_row(x_res, path="reference", why="why"):
    return dict(ms=30.0 * x_res, x_res=x_res, path=path, why=why)


def results_with(fused_x_res=1.4, fused_difference=2e-4, fused_took="fused", bf16_difference=1.2e-2):
    """Bench and train results of mhclite's four paths: the reference path at 1.5 x res, bf16 streams
    at 1.35 (reference) and 1.2 (fused), the kernels with fp32 streams as given."""
    bench = {"res": bench_row(1.0), "mhclite": bench_row(1.5), "mhclite+bf16": bench_row(1.35),
             "mhclite+fused": bench_row(fused_x_res, fused_took, "the kernels' reason"),
             "mhclite+fused+bf16": bench_row(1.2, "fused")}
    runs = {"reference": dict(difference=0.0, path="reference", why="why"),
            "reference + bf16 streams": dict(difference=bf16_difference, path="reference", why="why"),
            "fused": dict(difference=fused_difference, path=fused_took, why="the kernels' reason"),
            "fused + bf16 streams": dict(difference=bf16_difference, path="fused", why="why")}
    return dict(bench=dict(rows=bench), train=dict(runs=runs))


@pytest.mark.parametrize("results, expected", [
    (results_with(), ["run mhclite on this GPU with: fused (1.40 x res", "fused + bf16 streams: loss off by 1.2e-02"]),
    # faster, but a loss too far from the reference path's
    (results_with(fused_difference=3e-3), ["with: reference (1.50 x res", "fused: loss off by 3.0e-03"]),
    # the run asked for the kernels and took the reference path: they are out
    (results_with(fused_took="reference"), ["with: reference (1.50 x res",
                                            "fused: took the reference path (the kernels' reason)"]),
    # bf16 streams within the tolerance, and the fastest
    (results_with(bf16_difference=1e-3), ["with: fused + bf16 streams (1.20 x res"]),
    ({"bench": dict(rows={"res": bench_row(1.0)})}, ["no verdict: the bench and train parts must both finish"]),
])
def test_the_verdict_picks_the_fastest_path_that_trains_as_the_reference_path_does(results, expected):
    verdict = gpu_check.verdict(results)
    for text in expected:
        assert text in verdict, verdict


@pytest.mark.parametrize("tokens, expected", [
    ((300.0, 200.0, 100.0), "mhclite 300, hc 200, mhc 100 tokens/s: mhclite above hc holds, mhc below hc holds"),
    ((190.0, 200.0, 210.0), "mhclite 190, hc 200, mhc 210 tokens/s: mhclite above hc does not hold, mhc below hc "
                            "does not hold"),
])
def test_the_papers_throughput_ordering_is_reported_as_measured(tokens, expected):
    rows = {name: dict(tokens_per_s=value) for name, value in zip(("mhclite", "hc", "mhc"), tokens)}
    assert gpu_check.throughput_ordering({"bench": {"rows": rows}}) == expected
    assert gpu_check.throughput_ordering({}) == "not measured: the bench part did not finish"


def test_the_kernels_are_compared_with_the_compiled_path_of_the_same_stream_dtype():
    rows = results_with(fused_x_res=1.8)["bench"]["rows"]
    assert gpu_check.kernels_against_compiled({"bench": {"rows": rows}}) == (
        "fused 1.20 x reference; fused + bf16 streams 0.89 x reference + bf16 streams")
    rows["mhclite+fused"]["path"] = "reference"
    assert gpu_check.kernels_against_compiled({"bench": {"rows": rows}}).startswith("fused did not run the kernels; ")


def graphs_row(ms, difference=None):
    return dict(ms=ms, **({} if difference is None else {"difference": difference}))


@pytest.mark.parametrize("rows, expected", [
    ({"res": graphs_row(30.0), "res+graphs": graphs_row(24.0, 0.0), "mhclite": graphs_row(60.0),
      "mhclite+graphs": graphs_row(45.0, 5e-4)},
     "res 0.80 x its time without, its losses within 0.002 (0.0e+00); mhclite 0.75 x its time without, its losses "
     "within 0.002 (5.0e-04)"),
    ({"res": graphs_row(30.0), "res+graphs": graphs_row(33.0, 1e-2), "mhclite": graphs_row(60.0)},
     "res 1.10 x its time without, its losses NOT within 0.002 (1.0e-02)"),
    ({}, "not measured: the graphs part did not finish"),
])
def test_the_graphs_verdict_says_what_cuda_graphs_did_to_time_and_losses(rows, expected):
    assert gpu_check.graphs_verdict({"graphs": {"rows": rows}}) == expected


@pytest.mark.parametrize("argv, message", [
    (["benchmark"], "error: argument mode: invalid choice: 'benchmark'"),
    (["--device", "cpu", "--size", "M"], "error: the CPU dry run is --device cpu --size tiny"),
    (["--size", "XL"], "error: argument --size: invalid choice: 'XL'"),
    (["--size", "tiny", "--budget", "0"], "error: --budget must be > 0 seconds, got 0"),
])
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
    out = tmp_path / "check"
    assert one_error_line(gpu_check.main, ["--device", "cpu", "--out", str(out), *argv], capsys).startswith(message)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_cuda_without_a_gpu_is_one_error_line(capsys):
    assert "no CUDA GPU is visible" in one_error_line(gpu_check.main, ["quick"], capsys)
