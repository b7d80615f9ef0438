"""Which code runs the connections: fused.unsupported_reason, and the path train.py, bench.py and
python -m benchmarks.micro report, checked against the path the forward takes (a spy on connection_forward).
The fused path runs on CPU only in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

import json
import os

import pytest
import torch

import fused
import train
from benchmarks import micro as micro_bench
from benchmarks import step as bench
from model import GPT, GPTConfig, connection_path_line
from residuals import RESIDUALS, Residual

needs_triton = pytest.mark.skipif(not fused.TRITON_AVAILABLE, reason="triton is not installed")
CPU = torch.device("cpu")


def test_unsupported_reason_names_each_failing_check(monkeypatch):
    """A reason (a non-empty string) for every check that fails, None when the kernels can run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)
    width, n = 8, 4
    module = RESIDUALS["mhclite"](width, n, 0)
    x = torch.zeros(1, 3, n, width)
    reason = fused.unsupported_reason
    assert reason(module, x) is None and reason(module, x.bfloat16()) is None
    assert fused.supported(module, x)
    failing = [(Residual(width, 1, 0), x[:, :, :1]), (module, x.half()), (module, x[..., :4]), (module, x.to("meta")),
               (RESIDUALS["hc"](width, 2, 0), torch.zeros(1, 3, 2, width))]  # n = 2: the kernels are for n = 4
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", False)
    failing.append((module, x))
    for args in failing:
        assert isinstance(reason(*args), str) and reason(*args), args
        assert not fused.supported(*args)
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fused, "TRITON_AVAILABLE", False)
    assert "triton" in reason(module, x)


TINY = dict(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16)


@pytest.mark.parametrize("fused_on, residual", [(False, "mhclite"), (True, "res"), (True, "mhc")])
def test_connection_path_line(fused_on, residual):
    model = GPT(GPTConfig(**TINY, residual=residual, fused_connections=fused_on))
    line = connection_path_line(residual, model.connection_path(CPU))
    if not fused_on:
        assert line == f"connections: {residual} reference (fused_connections=False)"
    else:  # CPU without the interpreter (INTERPRET_ON_CPU is off): the reference path
        x = torch.empty(0, 1, model.config.n_streams, 16)
        reason = fused.unsupported_reason(model.connections()[0], x)
        assert reason and line == f"connections: {residual} reference (fused_connections=True but: {reason})"


@needs_triton
@pytest.mark.parametrize("stream_dtype, interpret, expected", [
    ("float32", False, "connections: mhclite reference (fused_connections=True but: {reason})"),
    ("bfloat16", False, "connections: mhclite reference (fused_connections=True but: {reason})"),
    ("bfloat16", True, "connections: mhclite fused (Triton interpreter, n=4)")])
def test_connection_path_line_names_the_path_and_why(stream_dtype, interpret, expected, monkeypatch):
    """train.py's connections line: the fused kernels or residuals.py, and why."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", interpret)
    model = GPT(GPTConfig(**TINY, residual="mhclite", fused_connections=True, stream_dtype=stream_dtype))
    x = torch.empty(0, 1, 4, 16, dtype=getattr(torch, stream_dtype))
    reason = fused.unsupported_reason(model.connections()[0], x)
    assert connection_path_line("mhclite", model.connection_path(CPU)) == expected.format(reason=reason)


@pytest.fixture
def spy(monkeypatch):
    """Counts the connections that took the fused path."""
    calls = []
    forward = fused.connection_forward

    def counting(module, x, branch):
        calls.append(module)
        return forward(module, x, branch)

    monkeypatch.setattr(fused, "connection_forward", counting)
    return calls


CASES = {  # INTERPRET_ON_CPU, stream_dtype, n_streams: the expected path on CPU (the kernels are for n = 4)
    "no interpreter": (False, "float32", 4, "reference"),
    "interpreter": (True, "float32", 4, "fused"),
    "interpreter, bf16 streams": (True, "bfloat16", 4, "fused"),
    "interpreter, n = 2": (True, "float32", 2, "reference"),
}


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_train_reports_the_path_that_ran(case, data_dir, tmp_path, monkeypatch, capsys, spy, one_thread):
    interpret, stream_dtype, n_streams, expected = CASES[case]
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off here (a CUDA machine)")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", interpret)
    out = tmp_path / "run"
    settings = dict(dataset="toy", data_dir=data_dir, out_dir=out, size="tiny", residual="mhclite", n_layer=1,
                    n_head=2, n_embd=16, block_size=8, batch_size=2, gradient_accumulation_steps=1, max_iters=1,
                    warmup_iters=0, eval_interval=1, eval_iters=1, log_interval=1, device="cpu", dtype="float32",
                    compile=False, stream_dtype=stream_dtype, n_streams=n_streams, fused_connections=True)
    train.main([f"--{key}={value}" for key, value in settings.items()])
    path = json.loads((out / "config.json").read_text())["connections"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("connections:")]
    assert lines == [connection_path_line("mhclite", path)]
    assert path["path"] == expected
    assert path["path"] == ("fused" if spy else "reference")
    if expected == "reference":
        assert path["why"].startswith("fused_connections=True but: ")


@needs_triton
@pytest.mark.parametrize("interpret", [False, True])
def test_bench_and_micro_bench_record_the_path_that_ran_per_variant(interpret, tmp_path, monkeypatch, capsys, spy, one_thread):
    """bench.py --fused_connections on --device cpu is a dry run in the interpreter under
    TRITON_INTERPRET=1 (it turns INTERPRET_ON_CPU on), and takes residuals.py without it."""
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off here (a CUDA machine)")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", False)  # restored after the test
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "bench.json"
    bench.main(["--size", "tiny", "--device", "cpu", "--batch_size", "1", "--block_size", "8", "--vocab_size", "32",
                "--steps", "1", "--warmup", "0", "--residuals", "res,mhclite", "--recompute", "off",
                "--fused_connections", "on", "--json", str(out)])
    result = json.loads(out.read_text())
    paths = {name: row["connections"]["path"] for name, row in result["variants"].items()}
    assert paths == {"res": "reference", "mhclite": "fused" if interpret else "reference"}
    assert (len(spy) > 0) == interpret and fused.INTERPRET_ON_CPU == interpret
    assert bench.connections_line(result["variants"]) in capsys.readouterr().out
    spy.clear()
    micro_bench.main(["--size", "tiny", "--device", "cpu", "--batch_size", "1", "--block_size", "8", "--steps", "1",
                      "--warmup", "0", "--residuals", "res,mhclite", "--recompute", "off", "--fused_connections", "on",
                      "--json", str(tmp_path / "micro.json")])
    connections = json.loads((tmp_path / "micro.json").read_text())["connections"]
    assert {name: row["connections"]["path"] for name, row in connections.items()} == paths
    assert (len(spy) > 0) == interpret
