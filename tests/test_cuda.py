"""The CUDA paths, on a GPU only (`pytest -m cuda`; python -m benchmarks.gpu_check runs them). Skipped on CPU.

mhclite's exactness under every float32 matmul precision and bf16 autocast; compiled (inductor) =
eager for every variant; the fused connection kernels against residuals.py; fused AdamW; the step
benchmark's CUDA peak-memory path.
"""

import contextlib
import functools
import json

import pytest
import torch

import fused
from benchmarks import step as bench
from config import DEFAULT_COMPILE_MODE
from conftest import random_tokens, randomise, tiny_config
from model import GPT
from parallelize import apply_fused_connections, compile_model
from residuals import RESIDUALS, capture_connections

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m benchmarks.gpu_check runs it there)")]

VOCAB, BLOCK = 256, 64
DEVICE = "cuda"
tiny = functools.partial(tiny_config, vocab_size=VOCAB, block_size=BLOCK)  # tiny(residual, **overrides)
tokens = functools.partial(random_tokens, VOCAB, BLOCK, 4, device=DEVICE)  # tokens(seed=0): (4, BLOCK) on the GPU
# The options off the default path, marked so that `pytest -m` can pick them apart.
FUSED = pytest.param(True, marks=pytest.mark.fused)
BF16_STREAMS = pytest.param("bfloat16", marks=pytest.mark.bf16_streams)


def built(config, fused_connections=False):
    """The model on the GPU, its connections through the fused kernels when asked (res has none)."""
    model = GPT(config).to(DEVICE)
    if fused_connections:
        path = apply_fused_connections(model, torch.device(DEVICE))["path"]
        assert path == ("reference" if config.residual == "res" else "fused")
    return model


def off_init(model, scale=0.3):
    """Connection parameters moved off their init, so every coefficient path matters."""
    randomise(torch.nn.ModuleList(model.connections()), scale, seed=1)
    return model


@contextlib.contextmanager
def matmul_precision(allow_tf32, precision):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


@pytest.mark.parametrize("fused", [False, FUSED])
@pytest.mark.parametrize("allow_tf32, precision, autocast", [
    (False, "highest", False), (True, "high", False), (True, "medium", False), (True, "high", True)])
def test_mhclite_exact_whatever_the_matmul_precision(allow_tf32, precision, autocast, fused):
    torch.manual_seed(0)
    model = off_init(built(tiny("mhclite"), fused), scale=2.0)
    with matmul_precision(allow_tf32, precision), capture_connections(model) as records, torch.no_grad():
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            model(tokens())
    h = torch.cat([r["h_res"].flatten(0, -3) for r in records])
    assert h.dtype == torch.float32 and (h >= 0).all()
    assert (h.sum(-1) - 1).abs().max().item() < 1e-6
    assert (h.sum(-2) - 1).abs().max().item() < 1e-6


@pytest.mark.parametrize("stream_dtype", ["float32", BF16_STREAMS])
@pytest.mark.parametrize("fused", [False, FUSED])
@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_compiled_matches_eager(residual, fused, stream_dtype):
    """Inductor-compiled loss and gradients (train.py's default compile mode) as accurate as eager's,
    against the fp32 model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = off_init(built(tiny(residual, stream_dtype=stream_dtype), fused))
    losses, grads = [], []
    with matmul_precision(False, "highest"):
        for use_compile, autocast in [(False, False), (False, True), (True, True)]:  # blocks compile in place: eager first
            run = compile_model(model, DEFAULT_COMPILE_MODE, fullgraph=True) if use_compile else model
            model.zero_grad(set_to_none=True)
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                _, loss = run(tokens(), tokens(seed=1))
            loss.backward()
            losses.append(loss.detach())
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    fp32, eager, compiled = grads
    torch.testing.assert_close(losses[2], losses[1], rtol=2e-3, atol=2e-3)
    eager_error, compiled_error = ((g - fp32).norm() / fp32.norm() for g in (eager, compiled))
    assert compiled_error <= 1.25 * eager_error + 1e-3


def half_branch_with_weight(weight):
    return lambda u: torch.tanh(u) * weight


@pytest.mark.fused
@pytest.mark.parametrize("stream_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_fused_kernels_match_the_reference(residual, stream_dtype):
    torch.manual_seed(0)
    c, n = 96, 4
    module = RESIDUALS[residual](c, n, 1).to(DEVICE)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator).to(DEVICE))
    x = torch.randn(3, 37, n, c, generator=generator).to(DEVICE, stream_dtype)
    weight = torch.randn(c, generator=generator).to(DEVICE)
    grad = torch.randn(x.shape, generator=generator).to(DEVICE, stream_dtype)
    assert fused.supported(module, x)
    results = []
    for forward in (module, lambda x, branch: fused.connection_forward(module, x, branch)):
        inputs = [x.detach().requires_grad_(), weight.detach().requires_grad_(), *module.parameters()]
        out = forward(inputs[0], half_branch_with_weight(inputs[1]))
        results.append((out, torch.autograd.grad(out, inputs, grad)))
    (ref_out, ref_grads), (out, grads) = results
    tol = dict(rtol=1e-4, atol=1e-4) if stream_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert out.dtype == stream_dtype
    torch.testing.assert_close(out, ref_out, **tol)
    for got, expected in zip(grads, ref_grads):
        assert (got.float() - expected.float()).norm() <= tol["rtol"] * expected.float().norm() + tol["atol"]


def test_fused_adamw_steps_like_the_loop_implementation():
    torch.manual_seed(0)
    models = [off_init(GPT(tiny("mhclite")).to(DEVICE)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = models[0].configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda")
    assert fused.defaults["fused"]
    loop = models[1].configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")  # same groups, not fused
    assert not loop.defaults["fused"]
    # One step from equal weights and gradients: later steps would compare chaotic Adam updates of
    # near-zero gradients, where any rounding flips a sign.
    for model, optimizer in zip(models, (fused, loop)):
        model(tokens(), tokens(seed=1))[1].backward()
        optimizer.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_bench_reports_cuda_peak_memory_and_mfu(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--size", "tiny", "--device", "cuda", "--batch_size", "4", "--block_size", str(BLOCK),
                "--vocab_size", str(VOCAB), "--steps", "3", "--warmup", "2", "--compile", "off", "--json", str(out),
                "--peak_flops", "1e15"])
    result = json.loads(out.read_text())
    assert result["settings"]["dtype"] == "bfloat16"
    rows = result["variants"]
    assert list(rows) == ["res", "hc", "hc+recompute", "mhc", "mhc+recompute", "mhclite", "mhclite+recompute"]
    for name, row in rows.items():
        assert row["cuda_peak_bytes"] > row["params"] * 4, name  # at least the fp32 weights
        assert 0 < row["mfu"] < 1, name
    assert rows["mhclite+recompute"]["cuda_peak_bytes"] <= rows["mhclite"]["cuda_peak_bytes"]
