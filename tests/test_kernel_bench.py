"""bench.py --kernels on CPU, in Triton's interpreter at tiny shapes: every recorded launch is
replayed alone and reported with the counted bytes. The times are not checked (never a timed test).

Triton reads TRITON_INTERPRET when it is imported: set here, while pytest collects this module, as
tests/test_fused_connections.py does."""

import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import bench  # noqa: E402
import fused_connections  # noqa: E402
from kernel_launches import connection_launches  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLAGS = ["--kernels", "--size", "tiny", "--device", DEVICE, "--batch_size", "1", "--block_size", "4", "--steps", "1",
         "--warmup", "0", "--seed", "0"]


def test_a_replayed_launch_recomputes_its_outputs(monkeypatch):
    """Each launch, replayed alone on its arguments as they were right after it ran, writes again
    what it wrote: zero one tensor argument at a time, replay, and an output comes back."""
    launch_and_run = fused_connections._launch
    right_after = []

    def snapshot(*launch, **constexprs):
        launch_and_run(*launch, **constexprs)
        right_after.append([a.detach().clone() for a in launch[3:] if isinstance(a, torch.Tensor)])

    monkeypatch.setattr(fused_connections, "_launch", snapshot)
    launches = connection_launches("mhclite", "float32", False, 8, 1, 4, DEVICE)
    monkeypatch.undo()
    assert len(launches) == len(right_after) > 0
    for launch, saved in zip(launches, right_after):
        tensors = [a for a in launch.args if isinstance(a, torch.Tensor)]
        written = 0
        with torch.no_grad():  # the arguments include views of leaves that require grad
            for index, tensor in enumerate(tensors):
                for t, s in zip(tensors, saved):
                    t.copy_(s)
                tensor.zero_()
                launch.replay()
                written += bool(saved[index].any()) and torch.equal(tensor, saved[index])
        assert written >= 1, launch.kernel


def test_kernels_table_has_every_launch_with_its_counted_bytes(tmp_path, capsys):
    recorded = {dtype: connection_launches("mhclite", dtype, False, 128, 1, 4, DEVICE, run=False)
                for dtype in ("float32", "bfloat16")}
    first = recorded["float32"][0].kernel
    counted = tmp_path / "bytes.json"
    counted.write_text(json.dumps({"mhclite": {"float32": {"kernels": {first: 3000}, "torch": 0, "forward": 0,
                                                           "backward": 0, "total": 0}}}))
    out = tmp_path / "kernels.json"
    bench.main(FLAGS + ["--residuals", "res,mhclite", "--dtype", "float32", "--kernel_bytes", str(counted),
                        "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["mode"] == "kernels"
    kernels = result["kernels"]
    assert kernels["dry_run"] == (DEVICE == "cpu") and kernels["tokens"] == 4 and kernels["width"] == 128
    rows = kernels["rows"]
    expected = [("mhclite", dtype, launch.kernel, launch.phase) for dtype in ("float32", "bfloat16")
                for launch in recorded[dtype]]
    assert [(r["residual"], r["stream_dtype"], r["kernel"], r["phase"]) for r in rows] == expected
    assert {r["phase"] for r in rows} == {"forward", "backward"}
    for r in rows:
        assert r["launches"] == 1 and r["ms"] > 0
        if (r["stream_dtype"], r["kernel"]) == ("float32", first):
            assert r["bytes_per_token"] == 3000
            assert r["gb_per_s"] == pytest.approx(3000 * 4 / r["ms"] / 1e6)
            assert r["copy_ratio"] == pytest.approx(r["gb_per_s"] / kernels["copies"]["float32"]["gb_per_s"])
        else:
            assert r["bytes_per_token"] is None and r["gb_per_s"] is None and r["copy_ratio"] is None
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        assert kernels["copies"][dtype]["bytes"] == 2 * 4 * 4 * 128 * size
    assert "CPU DRY RUN" in printed if DEVICE == "cpu" else "CPU DRY RUN" not in printed
    assert printed.count("| mhclite |") == len(rows)


def test_kernel_bytes_come_from_count_bytes_on_cpu_in_the_interpreter(tmp_path, monkeypatch):
    """Without --kernel_bytes, bench.py runs scripts/count_bytes.py (here a stand-in that checks
    its environment and arguments) and reads its JSON."""
    stand_in = tmp_path / "count_bytes.py"
    stand_in.write_text(
        "import json, os, sys\n"
        "assert os.environ['TRITON_INTERPRET'] == '1' and os.environ['CUDA_VISIBLE_DEVICES'] == ''\n"
        "args = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
        "assert args['--residuals'] == 'hc,mhclite' and args['--stream_dtypes'] == 'float32,bfloat16'\n"
        "json.dump({'hc': {'bfloat16': {'kernels': {'k': 7}}}}, open(args['--json'], 'w'))\n")
    monkeypatch.setattr(bench, "COUNT_BYTES_SCRIPT", str(stand_in))
    args = bench.resolve(bench.parse_args(FLAGS + ["--residuals", "res,hc,mhclite"]))
    assert bench.kernel_bytes(args, ["hc", "mhclite"]) == {"hc": {"bfloat16": {"kernels": {"k": 7}}}}
    stand_in.write_text("import sys; sys.exit('count_bytes: something broke')\n")
    with pytest.raises(bench.BenchError, match="count_bytes.py failed: count_bytes: something broke"):
        bench.kernel_bytes(args, ["hc"])
    monkeypatch.setattr(bench, "COUNT_BYTES_SCRIPT", str(tmp_path / "absent.py"))
    with pytest.raises(bench.BenchError, match="pass --kernel_bytes PATH"):
        bench.kernel_bytes(args, ["hc"])


@pytest.mark.parametrize("flags, interpret, message", [
    (["--device", "cpu"], False, "on CPU it runs only under TRITON_INTERPRET=1"),
    (["--device", "cpu", "--residuals", "res"], True, "--residuals has none of hc, mhc, mhclite"),
    (["--device", "cpu", "--n_sweep", "4"], True, "--kernels runs alone"),
    (["--device", "cpu", "--kernel_bytes", "absent.json"], True, "cannot read the kernel bytes absent.json"),
])
def test_kernels_bad_settings_give_one_error_line(flags, interpret, message, monkeypatch, capsys):
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--kernels", "--size", "tiny", "--batch_size", "1", "--block_size", "4", *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert sys.exc_info()[0] is None
