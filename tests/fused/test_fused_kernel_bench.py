"""python -m benchmarks.kernels on CPU, in Triton's interpreter at tiny shapes: every recorded
launch is replayed alone and reported with the counted bytes. The times are not checked (never a
timed test)."""

import json

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import kernel_tiles  # noqa: E402
from benchmarks import kernels as bench_kernels  # noqa: E402
from benchmarks import step  # noqa: E402
from conftest import one_error_line  # noqa: E402
import fused  # noqa: E402
from fused import ops  # noqa: E402
from fused.tools.launches import connection_launches  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLAGS = ["--size", "tiny", "--device", DEVICE, "--batch_size", "1", "--block_size", "4", "--steps", "1",
         "--warmup", "0", "--seed", "0"]


def test_a_replayed_launch_recomputes_its_outputs():
    """Each launch, replayed alone on its arguments as they were right after it ran, writes again
    what it wrote: zero one tensor argument at a time, replay, and an output comes back."""
    right_after = []

    def snapshot(name, grid, device, args, constexprs, launch):
        launch()
        right_after.append([a.detach().clone() for a in args if isinstance(a, torch.Tensor)])

    with ops.launch_hook(snapshot):
        launches = connection_launches("mhclite", "float32", False, 8, 1, 4, DEVICE)
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
    # the prediction of one kernel: 300 us, 100 of them its DRAM bytes at 4 TB/s
    predicted = tmp_path / "predicted_times.json"
    predicted.write_text(json.dumps(dict(kernels={"mhclite": {"float32": {first: dict(us=300.0, dram_us=100.0)}}},
                                         machine=dict(name="GPU X", sms=132, l2_bytes=50_000_000, cc=90),
                                         copy_bandwidth=4e12, step_latency_ns=500.0, triton="3.6.0")))
    out = tmp_path / "kernels.json"
    bench_kernels.main(FLAGS + ["--residuals", "mhclite", "--dtype", "float32", "--kernel_bytes", str(counted),
                                "--predicted_times", str(predicted), "--json", str(out)])
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
            # the DRAM term moved from 4 TB/s to the copy measured here, the rest kept
            copy = 1e9 * kernels["copies"]["float32"]["gb_per_s"]
            assert r["predicted_us_at_m"] == pytest.approx(200.0 + 100.0 * 4e12 / copy)
            assert r["measured_over_predicted"] == pytest.approx(1000 * r["ms"] / r["predicted_us_at_m"])
        else:
            assert r["bytes_per_token"] is None and r["gb_per_s"] is None and r["copy_ratio"] is None
            assert r["predicted_us_at_m"] is None
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        assert kernels["copies"][dtype]["bytes"] == 2 * 4 * 4 * 128 * size
    assert "CPU DRY RUN" in printed if DEVICE == "cpu" else "CPU DRY RUN" not in printed
    assert "on GPU X (sm_90, 132 SMs, triton 3.6.0), the DRAM terms at the copy above" in printed
    splits = result["splits"]["rows"]
    assert [(r["stream_dtype"], r["splits"]) for r in splits] == [("float32", 1), ("bfloat16", 1)]
    assert printed.count("| mhclite |") == len(rows) + len(splits)


def test_the_backward_is_timed_with_each_split_count_capped_at_the_token_blocks(monkeypatch):
    """48 tokens are three grad-W blocks: split counts 1, 2 and 3 (every larger one capped at 3, the
    default's row), each with its partials' bytes, and the module's split count restored."""
    monkeypatch.setattr(bench_kernels, "SPLIT_COUNTS", (1, 2, 16))
    monkeypatch.setitem(ops.TILES, "pre_backward_weight_kernel", dict(ops.TILES["pre_backward_weight_kernel"], BLOCK_T=16))
    args = bench_kernels.resolve(bench_kernels.parse_args(
        ["--size", "tiny", "--device", DEVICE, "--batch_size", "1", "--block_size", "48", "--steps", "1",
         "--warmup", "0", "--residuals", "hc", "--dtype", "float32"]))
    default = ops.WEIGHT_GRAD_SPLITS
    result = bench_kernels.backward_by_splits(args, torch.device(DEVICE))
    assert ops.WEIGHT_GRAD_SPLITS == default
    assert result["default_splits"] == 3 and result["tokens"] == 48
    rows = result["rows"]
    assert [(r["stream_dtype"], r["splits"]) for r in rows] == [
        (dtype, splits) for dtype in ("float32", "bfloat16") for splits in (1, 2, 3)]
    module = RESIDUALS["hc"](args.shape["n_embd"], 4, 0)
    one_split = ops.partial_bytes_per_split(fused.packed_parameters(module)[1])
    for r in rows:
        assert r["ms"] > 0 and r["partial_bytes_per_token"] == r["splits"] * one_split / 48
        assert (r["ratio"] == 1) == (r["splits"] == 3)


def test_the_default_kernel_bytes_file_is_count_bytes_json():
    """The kernel benchmark reads bytes per token from a file (nothing runs the interpreter on a GPU
    machine); tests/fused/test_fused_bytes.py keeps that file equal to a fresh count."""
    args = bench_kernels.resolve(bench_kernels.parse_args(FLAGS))
    counted = bench_kernels.read_kernel_bytes(args.kernel_bytes)
    assert set(counted) == {"hc", "mhc", "mhclite"}
    assert all(set(counted[r]) == {"float32", "bfloat16"} for r in counted)


@pytest.mark.parametrize("flags, interpret, message", [
    (["--device", "cpu"], False, "on CPU it runs only under TRITON_INTERPRET=1"),
    (["--device", "cpu", "--residuals", "res"], True, "--residuals must name some of hc, mhc, mhclite"),
    (["--device", "cpu", "--steps", "0"], True, "--steps must be >= 1"),
    (["--device", "cpu", "--kernel_bytes", "absent.json"], True, "cannot read the kernel bytes absent.json"),
    (["--device", "cpu", "--predicted_times", "absent.json"], True, "cannot read the predicted times absent.json"),
    (["--device", "cpu", "--predicted_times", bench_kernels.KERNEL_BYTES], True,
     "is not the output of python -m fused.tools.latency --predictions"),
])
def test_kernels_bad_settings_give_one_error_line(flags, interpret, message, monkeypatch, capsys):
    if interpret:  # the checks after this one, also on a CUDA machine (nothing runs)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--size", "tiny", "--batch_size", "1", "--block_size", "4", *flags]
    assert message in one_error_line(bench_kernels.main, argv, capsys)


@pytest.mark.parametrize("flag, replacement", [("--kernels", "python -m benchmarks.kernels"),
                                               ("--kernel_bytes=x.json", "python -m benchmarks.kernels"),
                                               ("--compile_time", "python -m benchmarks.compile_time")])
def test_bench_flags_that_moved_name_their_command(flag, replacement, capsys):
    assert replacement in one_error_line(step.main, ["--size", "tiny", flag], capsys)


def test_kernel_tiles_checks_each_setting_against_the_shipped_one_then_times_it(tmp_path, capsys):
    """python -m benchmarks.kernel_tiles: the shipped setting first (x 1), every other setting run
    into NaN-poisoned outputs and timed only when its outputs match the shipped one's."""
    out = tmp_path / "tiles.json"
    kernel_tiles.main(FLAGS + ["--residuals", "mhclite", "--dtype", "float32", "--stream_dtypes", "float32",
                               "--kernels", "post_kernel,post_backward_kernel", "--quick", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    for kernel in ("post_kernel", "post_backward_kernel"):
        settings = [r["setting"] for r in rows if r["kernel"] == kernel]
        assert settings[0] == kernel_tiles.shipped_setting(next(
            launch for launch in connection_launches("mhclite", "float32", False, 128, 1, 4, DEVICE, run=False)
            if launch.kernel == kernel))
        assert len(settings) == len({str(s) for s in settings}) == 1 + len(kernel_tiles.settings_of(
            kernel, kernel_tiles.QUICK)) - (settings[0] in kernel_tiles.settings_of(kernel, kernel_tiles.QUICK))
    assert all(r["error"] <= 1 and r["ms"] > 0 for r in rows)
    assert [r["x_shipped"] for r in rows if r.get("shipped")] == [1.0, 1.0]
    assert "| mhclite | float32 | post |" in capsys.readouterr().out


def test_kernel_tiles_fails_an_unwritten_or_wrong_output():
    reference = {"out_ptr": torch.ones(4, 8)}
    assert kernel_tiles.relative_error({"out_ptr": torch.ones(4, 8)}, reference) == 0
    unwritten = torch.ones(4, 8)
    unwritten[3, 7] = float("nan")
    assert kernel_tiles.relative_error({"out_ptr": unwritten}, reference) == float("inf")
    assert kernel_tiles.relative_error({"out_ptr": torch.ones(4, 8) * (1 + 1e-3)}, reference) > 1
