"""python -m benchmarks.micro: one connection module alone and H_res construction alone, interleaved
as the step benchmark measures steps. Nothing here is timed."""

import json

import pytest
import torch

from benchmarks import common
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


def test_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        micro_bench.main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    flags = ["--size", "--batch_size", "--block_size", "--device", "--dtype", "--residuals", "--recompute",
             "--stream_dtype", "--fused_connections", "--steps", "--warmup", "--seed", "--json"]
    assert all(f"  {flag} " in printed for flag in flags)
    assert "--vocab_size" not in printed  # the connections and H_res do not depend on it
    assert all(common.SHARED_FLAGS[flag].get("help") for flag in flags[:-1])
