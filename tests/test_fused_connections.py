"""The fused connection ops (fused_connections.py) against torch formulas and residuals.py.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when it is imported, and fused_connections imports it only at its first kernel
launch, so setting the variable here, while pytest collects this module, is early enough even
though other test modules import model.py (and so fused_connections) before. With a GPU the
interpreter stays off (it is process-wide and would also run inductor's Triton kernels in the
other test modules) and the same tests run the compiled kernels on CUDA tensors.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import fused_connections  # noqa: E402
from fused_connections import (rms_projection, rms_projection_rows_backward, stream_mix,  # noqa: E402
                               stream_mix_backward, stream_post, stream_post_backward)
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS, RMS_EPS, Residual, capture_connections  # noqa: E402


@pytest.fixture(autouse=True)
def interpret_on_cpu(monkeypatch):
    monkeypatch.setattr(fused_connections, "INTERPRET_ON_CPU", True)


@pytest.fixture
def small_blocks(monkeypatch):
    """16-wide tiles, so that the test sizes need several programs, loop trips and masked tails."""
    for name in ("PROJECTION_BLOCK_ROWS", "PROJECTION_BLOCK_DEPTH", "BLOCK_CHANNELS"):
        monkeypatch.setattr(fused_connections, name, 16)


def generator(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=generator(seed))).to(device=DEVICE, dtype=dtype)


def round_bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def grads_of(outputs, inputs, cotangents):
    return torch.autograd.grad(outputs, inputs, cotangents)


def test_kernels_are_interpreted_on_cpu_and_compiled_on_cuda():
    kernel = fused_connections._kernels().stream_mix_forward_kernel
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(kernel, InterpretedFunction), "triton was imported before TRITON_INTERPRET=1 was set"
    else:
        assert isinstance(kernel, triton.runtime.JITFunction)


# ----------------------------------------------------------------------------------------------
# Each op alone


def reference_rms_projection(rows, weight, bf16_operands):
    """(p, z, rms_inv) in float64, the GEMM operands rounded to bf16 when bf16_operands."""
    operand = round_bf16 if bf16_operands else (lambda t: t)
    z = operand(rows).double() @ operand(weight).double().t()
    rms_inv = torch.rsqrt(rows.double().pow(2).mean(-1) + RMS_EPS)
    return z * rms_inv[:, None], z, rms_inv


@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize("bf16_operands", [False, True])
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_rms_projection_matches_torch(rows_dtype, bf16_operands, blocks, request):
    m, d, n = (13, 40, 10) if blocks == "default" else (37, 56, 20)
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    rows = randn(m, d, seed=0, dtype=rows_dtype).requires_grad_()
    weight = randn(n, d, seed=1, scale=0.2).requires_grad_()
    cotangents = (randn(m, n, seed=2), randn(m, n, seed=3), randn(m, seed=4))

    outputs = rms_projection(rows, weight, bf16_operands)
    grad_rows, grad_weight = grads_of(outputs, (rows, weight), cotangents)

    expected = reference_rms_projection(rows.detach(), weight.detach(), bf16_operands)
    for got, want in zip(outputs, expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert grad_rows.dtype == rows_dtype
    if bf16_operands:
        # The backward rounds the GEMM operands (grad_z, weight, rows) to bf16 as well.
        p, z, rms_inv = expected
        grad_p, grad_z, grad_rms_inv = (c.double() for c in cotangents)
        total_grad_z = round_bf16(grad_p * rms_inv[:, None] + grad_z)
        total_grad_r = (grad_p * z).sum(-1) + grad_rms_inv
        rows64, weight64 = rows.detach().double(), weight.detach().double()
        want_rows = total_grad_z @ round_bf16(weight64) - rows64 * (rms_inv.pow(3) / d * total_grad_r)[:, None]
        want_weight = total_grad_z.t() @ round_bf16(rows64)
    else:
        rows64 = rows.detach().double().requires_grad_()
        weight64 = weight.detach().double().requires_grad_()
        want_rows, want_weight = grads_of(reference_rms_projection(rows64, weight64, False), (rows64, weight64),
                                          tuple(c.double() for c in cotangents))
    fp32_tol, bf16_tol = dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_rows.double(), want_rows, **(fp32_tol if rows_dtype == torch.float32 else bf16_tol))
    # grad_weight with bf16 operands is a torch bf16 GEMM, whose output is bf16 (as in residuals.py).
    torch.testing.assert_close(grad_weight.double(), want_weight, **(bf16_tol if bf16_operands else fp32_tol))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_stream_mix_matches_torch(n, x_dtype, small_blocks):
    m, c = 7, 40
    x = randn(m, n, c, seed=0, dtype=x_dtype).requires_grad_()
    h_pre = randn(m, n, seed=1).requires_grad_()
    h_res = randn(m, n, n, seed=2).requires_grad_()
    cotangents = (randn(m, c, seed=3), randn(m, n, c, seed=4))

    u, mixed = stream_mix(x, h_pre, h_res)
    grads = grads_of((u, mixed), (x, h_pre, h_res), cotangents)

    inputs64 = [t.detach().double().requires_grad_() for t in (x, h_pre, h_res)]
    x64, h_pre64, h_res64 = inputs64
    u64 = torch.einsum("mj,mjc->mc", h_pre64, x64)
    mixed64 = torch.einsum("mij,mjc->mic", h_res64, x64)
    expected_grads = grads_of((u64, mixed64), inputs64, tuple(c.double() for c in cotangents))

    assert u.dtype == mixed.dtype == torch.float32 and grads[0].dtype == x_dtype
    torch.testing.assert_close(u.double(), u64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed.double(), mixed64, rtol=1e-5, atol=1e-5)
    x_tol = dict(rtol=1e-5, atol=1e-5) if x_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grads[0].double(), expected_grads[0], **x_tol)
    for got, want in zip(grads[1:], expected_grads[1:]):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_stream_post_matches_torch(n, out_dtype, y_dtype, small_blocks):
    m, c = 5, 24
    mixed = randn(m, n, c, seed=0).requires_grad_()
    h_post = randn(m, n, seed=1).requires_grad_()
    y = randn(m, c, seed=2, dtype=y_dtype).requires_grad_()
    cotangent = randn(m, n, c, seed=3, dtype=out_dtype)

    out = stream_post(mixed, h_post, y, out_dtype)
    grads = grads_of(out, (mixed, h_post, y), cotangent)

    inputs64 = [t.detach().double().requires_grad_() for t in (mixed, h_post, y)]
    out64 = inputs64[0] + inputs64[1][:, :, None] * inputs64[2][:, None, :]
    expected_grads = grads_of(out64, inputs64, cotangent.double())

    assert out.dtype == out_dtype and grads[0].dtype == torch.float32 and grads[2].dtype == y_dtype
    def tol(dtype):
        return dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)

    torch.testing.assert_close(out.double(), out64, **tol(out_dtype))
    torch.testing.assert_close(grads[0].double(), expected_grads[0], rtol=0, atol=0)  # the cotangent, widened
    torch.testing.assert_close(grads[1].double(), expected_grads[1], **tol(torch.float32))
    torch.testing.assert_close(grads[2].double(), expected_grads[2], **tol(y_dtype))


def opcheck_samples():
    """Every op with float32 and bfloat16 data; the forward ops' float32 inputs require grad."""
    bf16 = torch.bfloat16
    samples = {
        "rms_projection-fp32": (rms_projection, randn(9, 40, seed=0), randn(10, 40, seed=1), False),
        "rms_projection-bf16": (rms_projection, randn(9, 40, seed=0, dtype=bf16), randn(10, 40, seed=1), True),
        "stream_mix-fp32": (stream_mix, randn(6, 3, 24, seed=0), randn(6, 3, seed=1), randn(6, 3, 3, seed=2)),
        "stream_mix-bf16": (stream_mix, randn(6, 4, 24, seed=0, dtype=bf16), randn(6, 4, seed=1),
                            randn(6, 4, 4, seed=2)),
        "stream_post-fp32": (stream_post, randn(6, 4, 24, seed=0), randn(6, 4, seed=1), randn(6, 24, seed=2),
                             torch.float32),
        "stream_post-bf16": (stream_post, randn(6, 2, 24, seed=0), randn(6, 2, seed=1),
                             randn(6, 24, seed=2, dtype=bf16), bf16),
        "rms_projection_rows_backward-bf16": (rms_projection_rows_backward, randn(9, 40, seed=0, dtype=bf16),
                                              randn(10, 40, seed=1), randn(9, 10, seed=2), randn(9, seed=3), True),
        "stream_mix_backward-bf16": (stream_mix_backward, randn(6, 3, 24, seed=0, dtype=bf16), randn(6, 3, seed=1),
                                     randn(6, 3, 3, seed=2), randn(6, 24, seed=3), randn(6, 3, 24, seed=4)),
        "stream_post_backward-bf16": (stream_post_backward, randn(6, 4, 24, seed=0, dtype=bf16),
                                      randn(6, 4, seed=1), randn(6, 24, seed=2)),
    }
    return [pytest.param(op, args, id=name) for name, (op, *args) in samples.items()]


FORWARD_OPS = (rms_projection, stream_mix, stream_post)


@pytest.mark.parametrize("op, args", opcheck_samples())
def test_opcheck(op, args):
    """All of opcheck's default checks: schema, fake tensors, autograd registration and AOT
    dispatch with dynamic shapes (which runs the kernels and, for the forward ops, the backward)."""
    args = tuple(args)
    if op in FORWARD_OPS:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                     for a in args)
    torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------------------------
# connection_forward against the modules of residuals.py


def randomise(module, scale=0.3, seed=0):
    """Every parameter moved off its init, so that every coefficient path matters."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator(seed)).to(p.device))
    return module


class Branch(torch.nn.Module):
    """A stand-in sublayer with parameters: (B, T, C) -> (B, T, C)."""

    def __init__(self, width, seed=5):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(width, width, generator=generator(seed)) / width ** 0.5)
            self.linear.bias.copy_(torch.randn(width, generator=generator(seed + 1)))

    def forward(self, u):
        return torch.tanh(self.linear(u))


MODES = {  # stream dtype, autocast
    "fp32": (torch.float32, False),
    "bf16_streams": (torch.bfloat16, False),
    "autocast": (torch.float32, True),
    "autocast_bf16_streams": (torch.bfloat16, True),
}


def run_connection(forward, module, branch, x, cotangent, autocast):
    x = x.detach().clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = forward(module, x, branch)
    params = dict(module.named_parameters()) | {f"branch.{k}": v for k, v in branch.named_parameters()}
    grads = grads_of(out, (x, *params.values()), cotangent)
    return out, dict(zip(["x", *params], grads))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_connection_forward_matches_module(residual, n, mode):
    stream_dtype, autocast = MODES[mode]
    width = 24
    module = randomise(RESIDUALS[residual](width, n, 1)).to(DEVICE)
    branch = Branch(width).to(DEVICE)
    x = randn(2, 3, n, width, seed=1, dtype=stream_dtype)
    cotangent = randn(2, 3, n, width, seed=2, dtype=stream_dtype)

    assert fused_connections.supported(module, x)
    out, grads = run_connection(fused_connections.connection_forward, module, branch, x, cotangent, autocast)
    module_ref, branch_ref = copy.deepcopy(module), copy.deepcopy(branch)
    expected, expected_grads = run_connection(lambda m, x, f: m(x, f), module_ref, branch_ref, x, cotangent, autocast)

    assert out.dtype == expected.dtype == stream_dtype
    assert grads.keys() == expected_grads.keys()
    if mode == "fp32":
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"grad {name}: {m}")
    else:
        # bf16 somewhere (streams, or the branch and the projection GEMM under autocast): both sides
        # round, at different points (the reference rounds the GEMM outputs to bf16, the kernels
        # accumulate in fp32; a bf16 grad x here is the sum of two bf16 partial grads; the
        # interpreter's bf16 stores truncate where a GPU rounds to nearest). Errors are measured
        # against each tensor's largest entry, since parameter grads are sums with cancellation.
        assert_close_normwise(out, expected, 3e-2, "output")
        for name in grads:
            assert_close_normwise(grads[name], expected_grads[name], 3e-2, f"grad {name}")


def assert_close_normwise(got, want, tol, name):
    error = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert error <= tol * scale, f"{name}: max error {error:.3g} > {tol} * max |expected| {scale:.3g}"


@pytest.mark.parametrize("autocast", [False, True])
def test_mhclite_fused_h_res_is_doubly_stochastic(autocast):
    n, width, scale = 4, 16, 100.0
    module = randomise(RESIDUALS["mhclite"](width, n, 0), scale=scale).to(DEVICE)
    x = randn(2, 8, n, width, seed=1, scale=scale)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast), capture_connections() as records:
        fused_connections.connection_forward(module, x, torch.tanh)
    h_res = records[0]["h_res"].reshape(-1, n, n).double()
    assert (h_res.sum(-1) - 1).abs().max() < 1e-6
    assert (h_res.sum(-2) - 1).abs().max() < 1e-6


def test_compiled_connection_matches_eager():
    """fullgraph: no graph break; every op one node of the graph."""
    torch._dynamo.reset()
    module = randomise(RESIDUALS["mhclite"](16, 2, 1)).to(DEVICE)
    branch = Branch(16).to(DEVICE)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    compiled = torch.compile(fused_connections.connection_forward, fullgraph=True, backend=backend)
    x = randn(2, 3, 2, 16, seed=1)
    cotangent = randn(2, 3, 2, 16, seed=2)
    out, grads = run_connection(compiled, module, branch, x, cotangent, autocast=False)
    expected, expected_grads = run_connection(fused_connections.connection_forward, module, branch, x, cotangent,
                                              autocast=False)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-6, atol=1e-6)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    for op in ("rms_projection", "stream_mix", "stream_post"):
        assert sum(f"hcfused.{op}" in target for target in targets) == 1, targets


def test_model_with_fused_connections_matches_the_reference_path():
    config = dict(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, residual="mhc", n_streams=3)
    torch.manual_seed(0)
    models = [GPT(GPTConfig(**config, fused_connections=fused)).to(DEVICE) for fused in (True, False)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        for connection in model.connections():
            randomise(connection)
    idx = torch.randint(0, 32, (2, 8), generator=generator(1)).to(DEVICE)
    losses = [model(idx, idx)[1] for model in models]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


# ----------------------------------------------------------------------------------------------
# supported()


def test_supported_only_where_the_kernels_can_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    width, n = 8, 2
    module = RESIDUALS["mhc"](width, n, 0)
    x = torch.zeros(1, 3, n, width)
    assert fused_connections.supported(module, x)
    assert fused_connections.supported(RESIDUALS["hc"](width, n, 0), x.bfloat16())
    assert not fused_connections.supported(Residual(width, 1, 0), x[:, :, :1])
    assert not fused_connections.supported(module, x.half())
    assert not fused_connections.supported(module, x.double())
    assert not fused_connections.supported(module, x[..., :4])  # not this module's width
    assert not fused_connections.supported(module, x.to("meta"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not fused_connections.supported(module, x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_connections, "INTERPRET_ON_CPU", False)  # model.py's CPU runs: residuals.py
    assert not fused_connections.supported(module, x)
    monkeypatch.setattr(fused_connections, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fused_connections, "TRITON_AVAILABLE", False)
    assert not fused_connections.supported(module, x)


def test_imports_and_declines_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, fused_connections, residuals\n"
            "fused_connections.INTERPRET_ON_CPU = True\n"
            "assert not fused_connections.supported(residuals.HyperConnection(8, 2, 0), torch.zeros(1, 1, 2, 8))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
