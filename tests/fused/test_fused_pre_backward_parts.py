"""python -m benchmarks.pre_backward_parts on CPU, in Triton's interpreter at tiny shapes: each
setting of pre_backward, with and without its grad-W partials, runs on the recorded launch's
arguments. The times are not checked (never a timed test)."""

import json

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import pre_backward_parts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("residual, stream_dtype", [("mhclite", "float32"), ("hc", "bfloat16")])
def test_each_setting_with_and_without_partials_gives_the_shipped_gradients(residual, stream_dtype, tmp_path,
                                                                              capsys):
    out = tmp_path / "parts.json"
    pre_backward_parts.main(["--device", DEVICE, "--residual", residual, "--stream_dtype", stream_dtype,
                             "--batch_size", "1", "--block_size", "32", "--width", "32", "--steps", "1",
                             "--warmup", "0", "--json", str(out)])
    parts = json.loads(out.read_text())["parts"]
    rows = {(r["block_t"], r["block_c"], r["num_warps"], r["programs"], r["partials"]): r for r in parts["rows"]}
    assert [r["shipped"] for r in parts["rows"]].count(True) == 1
    shipped = next(r for r in parts["rows"] if r["shipped"])
    assert shipped["grad_x_max_abs_diff"] == 0 and shipped["grad_weight_max_abs_diff"] == 0
    tolerance = 1e-5 if stream_dtype == "float32" else 1e-2  # bf16 streams: bf16 operands in the GEMMs
    for (block_t, block_c, warps, programs, partials), row in rows.items():
        assert row["ms"] > 0
        if partials:  # another tile sums in another order: grad W close, not equal
            assert row["grad_weight_max_abs_diff"] < tolerance
        else:  # skipping the partials leaves grad x exactly as with them
            twin = rows[(block_t, block_c, warps, programs, True)]
            assert row["grad_weight_max_abs_diff"] is None
            assert row["grad_x_max_abs_diff"] == twin["grad_x_max_abs_diff"]
    settings = {(r["block_t"], r["block_c"], r["num_warps"]) for r in parts["rows"]}
    assert set(pre_backward_parts.SETTINGS) <= settings
    assert parts["gemm"]["operands"] == ("bfloat16" if stream_dtype == "bfloat16" else "float32")
    assert parts["gemm"]["ms"] > 0
    assert "| grad-W partials |" in capsys.readouterr().out
