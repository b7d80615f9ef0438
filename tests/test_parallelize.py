"""How a plain GPT runs, applied from outside it (parallelize.py): the connections' recompute and the
fused kernels' swap change nothing the model computes or saves, the console's `connections:` line
names the path that ran, and model.py and residuals.py import nothing about execution.
The fused path runs on CPU only in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

import ast
import json
import os

import pytest
import torch

import fused
import parallelize
import train
from conftest import randomise
from model import GPT, GPTConfig
from parallelize import apply_connection_recompute, apply_fused_connections, connection_path, connection_path_line
from residuals import RESIDUALS

needs_triton = pytest.mark.skipif(not fused.TRITON_AVAILABLE, reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton's interpreter is off here (a CUDA machine)")
CPU = torch.device("cpu")
TINY = dict(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_modules(filename):
    """The top-level names of every module a file imports, anywhere in it."""
    with open(os.path.join(REPO, filename)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


def test_the_model_and_its_connections_import_nothing_about_execution():
    assert imported_modules("residuals.py") <= {"contextlib", "itertools", "math", "torch"}
    assert imported_modules("authors.py") <= {"math", "torch", "residuals"}
    assert imported_modules("model.py") <= {"math", "re", "dataclasses", "torch", "authors", "residuals"}


def test_model_args_hold_no_execution_setting():
    saved = set(GPTConfig.__dataclass_fields__)
    assert not saved & {"fused_connections", "recompute_connections", "activation_checkpointing", "compile"}


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_connection_recompute_gives_the_same_outputs_and_gradients(residual):
    plain = randomise(RESIDUALS[residual](8, 4, 1), scale=0.3)
    recomputed = apply_connection_recompute(RESIDUALS[residual](8, 4, 1))
    recomputed.load_state_dict(plain.state_dict())
    assert plain.state_dict().keys() == recomputed.state_dict().keys()
    x = torch.randn(2, 5, 4, 8, generator=torch.Generator().manual_seed(0))
    branch = torch.nn.Linear(8, 8)
    results = []
    for module in (plain, recomputed):
        x_in = x.clone().requires_grad_()
        out = module(x_in, branch)
        out.square().sum().backward()
        results.append([out, x_in.grad] + [p.grad for p in module.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_connection_recompute_keeps_less_for_backward():
    """What autograd saves in one forward of mhc's connection: only x (and the branch's own
    activations) with recompute, every intermediate of the coefficient path without it."""
    def saved_bytes(module):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            module(torch.randn(2, 16, 4, 32, requires_grad=True), torch.nn.Identity())
        return sum(sizes)

    plain = RESIDUALS["mhc"](32, 4, 1)
    assert saved_bytes(apply_connection_recompute(RESIDUALS["mhc"](32, 4, 1))) < saved_bytes(plain) / 4


@pytest.mark.parametrize("fused_on, residual", [(False, "mhclite"), (True, "res"), (True, "mhc")])
def test_connection_path_line(fused_on, residual):
    model = GPT(GPTConfig(**TINY, residual=residual))
    line = connection_path_line(residual, connection_path(model, CPU, fused_on))
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
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", interpret)
    model = GPT(GPTConfig(**TINY, residual="mhclite", stream_dtype=stream_dtype))
    x = torch.empty(0, 1, 4, 16, dtype=getattr(torch, stream_dtype))
    reason = fused.unsupported_reason(model.connections()[0], x)
    assert connection_path_line("mhclite", connection_path(model, CPU, True)) == expected.format(reason=reason)


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


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_the_fused_swap_keeps_the_model_s_parameters_and_its_function(residual, monkeypatch, spy):
    """apply_fused_connections swaps the connections' forward from outside: the same state dict,
    the same class, and outputs and gradients that match residuals.py's."""
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**TINY, residual=residual))
    swapped = GPT(GPTConfig(**TINY, residual=residual))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    swapped.load_state_dict(reference.state_dict())
    assert apply_fused_connections(swapped, CPU)["path"] == "fused"
    assert swapped.state_dict().keys() == reference.state_dict().keys()
    assert [type(c) for c in swapped.connections()] == [type(c) for c in reference.connections()]
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in (reference, swapped):
        _, loss = model(idx, idx)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert len(spy) == 2  # both connections of the one block ran the kernels
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert (grads[1] - grads[0]).norm() <= 1e-4 * grads[0].norm()


def test_the_fused_swap_leaves_a_model_it_cannot_run_as_it_was():
    model = GPT(GPTConfig(**TINY, residual="mhclite", n_streams=2))
    path = apply_fused_connections(model, CPU)
    assert path["path"] == "reference" and not any(parallelize.is_fused(c) for c in model.connections())


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
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert "fused_connections" not in ckpt["model_args"]
