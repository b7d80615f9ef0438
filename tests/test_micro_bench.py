"""python -m benchmarks.micro: one connection module alone and H_res construction alone, interleaved
as the step benchmark measures steps. Nothing here is timed."""

import argparse
import json

import pytest
import torch

from benchmarks import micro as micro_bench
from conftest import one_error_line

DEVICE = torch.device("cpu")
FLAGS = ["--size", "tiny", "--device", "cpu", "--batch_size", "2", "--block_size", "16", "--steps", "2",
         "--warmup", "1", "--seed", "3"]


def test_sinkhorn_launches_more_ops_than_mhclite():
    steps = micro_bench.h_res_steps(4, 32, 20, 3, DEVICE)
    ops = {name: micro_bench.count_ops(fn, DEVICE) for name, fn in steps.items()}
    assert 0 < ops["mhclite"] < ops["mhc"]
    assert ops["mhc"] >= 4 * 20  # per iteration at least two logsumexps and two subtractions


def test_main_writes_each_connection_with_ratios_to_res_and_h_res_with_op_counts(tmp_path, capsys, one_thread):
    out = tmp_path / "micro.json"
    micro_bench.main(FLAGS + ["--json", str(out)])
    result = json.loads(out.read_text())
    names = ["res", "hc", "hc+recompute", "mhc", "mhc+recompute", "mhclite", "mhclite+recompute"]
    assert list(result["connections"]) == names
    assert result["connections"]["res"]["time_ratio"] == 1.0
    for name in names:
        row = result["connections"][name]
        assert len(row["step_ms"]) == 2 and row["time_ratio"] > 0
        assert row["connections"]["path"] == "reference"
    h_res = result["h_res"]
    assert h_res["n_streams"] == 4 and h_res["rows"] == 2 * 16 and h_res["sinkhorn_iters"] == 20
    assert h_res["mhc"]["ops"] > h_res["mhclite"]["ops"] > 0
    assert h_res["mhc_over_mhclite_ops"] == h_res["mhc"]["ops"] / h_res["mhclite"]["ops"]
    assert h_res["mhclite"]["time_ratio"] == 1.0
    assert result["command"].startswith("python -m benchmarks.micro --size tiny")
    assert result["settings"]["batch_size"] == 2
    printed = capsys.readouterr().out
    assert "| mhclite+recompute |" in printed and "| H_res alone, 32 x n=4 (fwd+bwd) |" in printed
    assert f"wrote {out}" in printed


@pytest.mark.parametrize("flags, message", [
    (["--residuals", "res,foo"], "error: unknown residual 'foo'; valid: res, hc, mhc, mhclite"),
    (["--size", "XXL"], "error: unknown size 'XXL'"),
    (["--steps", "0"], "error: --steps must be >= 1"),
    (["--warmup", "-1"], "error: --warmup must be >= 0"),
])
def test_bad_input_is_one_error_line(flags, message, tmp_path, capsys):
    assert one_error_line(micro_bench.main, FLAGS + flags + ["--json", str(tmp_path / "x.json")],
                          capsys).startswith(message)
    assert not (tmp_path / "x.json").exists()


def test_every_flag_explains_itself_and_none_is_idle(monkeypatch):
    """Each flag has a description in --help, and no flag sets what the benchmark does not use."""
    parsers = []
    parse_args = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *a, **k: parsers.append(self) or parse_args(self, *a, **k))
    micro_bench.parse_args(FLAGS)
    flags = [action for action in parsers[0]._actions if action.dest != "help"]
    assert flags and all(action.help and len(action.help) > 10 for action in flags), \
        [action.option_strings for action in flags if not action.help]
    assert "--vocab_size" not in {s for action in flags for s in action.option_strings}  # H_res ignores it