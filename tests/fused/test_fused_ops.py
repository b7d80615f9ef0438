"""The fused connection ops (the fused package) against torch formulas and residuals.py.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET before triton is imported); with one, the same tests run the compiled kernels on
CUDA tensors.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

import fused  # noqa: E402
from authors import AUTHORS_CONNECTIONS  # noqa: E402
from conftest import randomise  # noqa: E402
from fused import ops  # noqa: E402
from fused.ops import (connection_post, connection_post_backward, connection_pre,  # noqa: E402
                       connection_pre_backward)
from model import GPT, GPTConfig  # noqa: E402
from parallelize import apply_fused_connections  # noqa: E402
from residuals import RESIDUALS, RMS_EPS, Residual, capture_connections, sinkhorn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3  # of the parameters' moves off their init (conftest.randomise)

N = ops.STREAMS


@pytest.fixture(autouse=True)
def interpret_on_cpu(monkeypatch):
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)


@pytest.fixture
def small_blocks(monkeypatch):
    """16-token, 16-channel tiles and two token splits of the backward's grad-W kernel, so that the
    test sizes need several programs, loop trips, a program with two token blocks and masked tails
    (tokens and channels)."""
    for kernel, tile in ops.TILES.items():
        monkeypatch.setitem(ops.TILES, kernel, dict(tile, BLOCK_T=16, BLOCK_C=16))
    monkeypatch.setattr(ops, "WEIGHT_GRAD_SPLITS", 2)


def generator(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=generator(seed))).to(device=DEVICE, dtype=dtype)


def round_bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def grads_of(outputs, inputs, cotangents):
    return torch.autograd.grad(outputs, inputs, cotangents)


def test_kernels_are_interpreted_on_cpu_and_compiled_on_cuda():
    kernel = ops.kernel("post_kernel")
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(kernel, InterpretedFunction), "triton was imported before TRITON_INTERPRET=1 was set"
    else:
        assert isinstance(kernel, triton.runtime.JITFunction)


# ----------------------------------------------------------------------------------------------
# Each op alone, against torch formulas in float64

VARIANTS = ("hc", "mhc", "mhclite")


def packed_parameters(residual, width, seed=0):
    """The packed fp32 (variant, weight, scale, bias, perm_matrices, iters) of a randomised module."""
    module = randomise(RESIDUALS[residual](width, N, 1), SCALE, seed=seed).to(DEVICE)
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in fused.packed_parameters(module))


def reference_pre(x, weight, scale, bias, perm_matrices, variant, iters, bf16_operands):
    """(u, h_pre, h_post, h_res, z, rms_inv) of connection_pre in float64, from the paper's formulas
    (Sec. 2, eq. skexp; Sec. 3.2); the GEMM operands rounded to bf16 when bf16_operands."""
    operand = round_bf16 if bf16_operands else (lambda t: t)
    x, weight, scale, bias, perm_matrices = (t.double() for t in (x, weight, scale, bias, perm_matrices))
    tokens, n, _ = x.shape
    rows = x if variant == "hc" else x.flatten(1)
    z = operand(rows) @ operand(weight).t()
    rms_inv = torch.rsqrt(rows.pow(2).mean(-1) + RMS_EPS)
    p = z * rms_inv[..., None]
    if variant == "hc":
        a = bias + scale * torch.tanh(p)
        h_pre, h_post, h_res = a[..., 0], a[..., n + 1], a[..., 1:n + 1].transpose(-1, -2)
    else:
        logits = scale * p + bias
        h_pre, h_post = torch.sigmoid(logits[:, :n]), 2 * torch.sigmoid(logits[:, n:2 * n])
        res = logits[:, 2 * n:]
        if variant == "mhc":
            h_res = sinkhorn(res.view(tokens, n, n), iters)
        else:
            h_res = (torch.softmax(res, -1)[..., None] * perm_matrices).sum(-2).view(tokens, n, n)
    u = torch.einsum("mj,mjc->mc", h_pre, x)
    return u, h_pre, h_post, h_res, z, rms_inv


def reference_pre_backward(x, grad, grad_u, grad_h_post, weight, scale, bias, perms, variant, iters,
                           bf16_operands):
    """The float64 gradients (x, weight, scale, bias) of sum(grad_u u) + sum(grad_h_post h_post) +
    sum(grad (h_res x)): what reaches x and the parameters through connection_pre and
    connection_post's mixing."""
    inputs64 = [t.detach().double().requires_grad_() for t in (x, weight, scale, bias)]
    u, _, h_post, h_res, _, _ = reference_pre(*inputs64, perms, variant, iters, bf16_operands)
    loss = ((grad_u.double() * u).sum() + (grad_h_post.double() * h_post).sum()
            + (grad.double() * torch.einsum("mij,mjc->mic", h_res, inputs64[0])).sum())
    return torch.autograd.grad(loss, inputs64)


@pytest.mark.parametrize("bf16_operands", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", VARIANTS)
def test_connection_pre_matches_torch(residual, x_dtype, bf16_operands, small_blocks):
    tokens, width = 21, 40
    variant, weight, scale, bias, perms, iters = packed_parameters(residual, width)
    x = randn(tokens, N, width, seed=1, dtype=x_dtype)
    outputs = connection_pre(x, weight, scale, bias, perms, variant, iters, bf16_operands)
    expected = reference_pre(x, weight, scale, bias, perms, variant, iters, bf16_operands)
    for name, got, want in zip(("u", "h_pre", "h_post", "h_res", "z", "rms_inv"), outputs, expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    next_grad = outputs[-1]
    assert next_grad.shape == x.shape and next_grad.dtype == x_dtype and next_grad.stride() == (0, 0, 0)


@pytest.mark.parametrize("x_dtype, bf16_operands", [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("residual", VARIANTS)
def test_connection_pre_backward_matches_torch(residual, x_dtype, bf16_operands, small_blocks):
    """Against float64 autograd (reference_pre_backward)."""
    tokens, width = 37, 40
    variant, weight, scale, bias, perms, iters = packed_parameters(residual, width, seed=3)
    x = randn(tokens, N, width, seed=1, dtype=x_dtype)
    grad, grad_u, grad_h_post = randn(tokens, N, width, seed=2, dtype=x_dtype), randn(tokens, width, seed=4), \
        randn(tokens, N, seed=5)
    _, _, _, _, z, rms_inv, _ = connection_pre(x, weight, scale, bias, perms, variant, iters, bf16_operands)
    got = connection_pre_backward(x, grad, grad_u, grad_h_post, weight, scale, bias, perms, z, rms_inv, variant,
                                  iters, bf16_operands)

    expected = reference_pre_backward(x, grad, grad_u, grad_h_post, weight, scale, bias, perms, variant, iters,
                                      bf16_operands)
    assert got[0].dtype == x_dtype and all(g.dtype == torch.float32 for g in got[1:])
    for name, g, want in zip(("x", "weight", "scale", "bias"), got, expected):
        assert g.shape == want.shape
        if bf16_operands or x_dtype == torch.bfloat16:
            # The kernels round the GEMM operands of the backward (grad z, x, weight) and bf16 grad x.
            assert_close_normwise(g, want, 2e-2, f"grad {name}")
        else:
            torch.testing.assert_close(g.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("residual, x_dtype, width", [("mhclite", torch.bfloat16, 768), ("mhc", torch.float32, 37)])
def test_connection_pre_backward_at_the_shipped_tiles_is_deterministic(residual, x_dtype, width, monkeypatch):
    """At C = 768 and an odd width with the shipped tiles (a partial token block; two token splits of
    the grad-W kernel, one of two blocks): the same bits twice, grad W included (its partials are
    summed in a fixed order), and close to float64. The order of the sum is the same for every
    variant; test_connection_pre_backward_matches_torch checks each variant's gradients."""
    monkeypatch.setattr(ops, "WEIGHT_GRAD_SPLITS", 2)
    tokens = 2 * ops.TILES["pre_backward_weight_kernel"]["BLOCK_T"] + 1
    bf16_operands = x_dtype == torch.bfloat16
    variant, weight, scale, bias, perms, iters = packed_parameters(residual, width, seed=3)
    x = randn(tokens, N, width, seed=1, dtype=x_dtype)
    grad, grad_u, grad_h_post = randn(tokens, N, width, seed=2, dtype=x_dtype), randn(tokens, width, seed=4), \
        randn(tokens, N, seed=5)
    _, _, _, _, z, rms_inv, _ = connection_pre(x, weight, scale, bias, perms, variant, iters, bf16_operands)
    runs = [connection_pre_backward(x, grad, grad_u, grad_h_post, weight, scale, bias, perms, z, rms_inv, variant,
                                    iters, bf16_operands) for _ in range(2)]
    assert ops._cdiv(tokens, ops.TILES["pre_backward_weight_kernel"]["BLOCK_T"]) == 3
    assert ops._cdiv(tokens, ops.TILES["pre_backward_grad_x_kernel"]["BLOCK_T"]) >= 3
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    expected = reference_pre_backward(x, grad, grad_u, grad_h_post, weight, scale, bias, perms, variant, iters,
                                      bf16_operands)
    for name, g, want in zip(("x", "weight", "scale", "bias"), runs[0], expected):
        assert_close_normwise(g, want, 2e-2 if bf16_operands else 1e-5, f"grad {name}")


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_connection_post_and_its_backward_match_torch(x_dtype, y_dtype, small_blocks):
    tokens, width = 21, 40
    x = randn(tokens, N, width, seed=0, dtype=x_dtype)
    h_post, h_res = randn(tokens, N, seed=1).requires_grad_(), randn(tokens, N, N, seed=2)
    y = randn(tokens, width, seed=3, dtype=y_dtype).requires_grad_()
    next_grad = x.new_zeros(()).expand(x.shape).requires_grad_()
    grad = randn(tokens, N, width, seed=4, dtype=x_dtype)

    out = connection_post(x, h_post, h_res, y, next_grad)
    grad_h_post, grad_y, grad_next = grads_of(out, (h_post, y, next_grad), grad)

    x64, h_post64, y64 = x.double(), h_post.detach().double(), y.detach().double()
    out64 = torch.einsum("mij,mjc->mic", h_res.double(), x64) + h_post64[..., None] * y64[:, None, :]
    assert out.dtype == x_dtype and grad_y.dtype == y_dtype
    def tol(dtype):
        return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)

    torch.testing.assert_close(out.double(), out64, **tol(x_dtype))
    torch.testing.assert_close(grad_h_post.double(), torch.einsum("mic,mc->mi", grad.double(), y64),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_y.double(), torch.einsum("mi,mic->mc", h_post64, grad.double()), **tol(y_dtype))
    assert grad_next is grad  # handed on untouched, for connection_pre's backward


def opcheck_samples():
    """Every op, each variant, with float32 and bfloat16 streams."""
    bf16 = torch.bfloat16
    samples = {}
    for residual in VARIANTS:
        variant, weight, scale, bias, perms, iters = packed_parameters(residual, 16)
        for x_dtype in (torch.float32, bf16):
            x = randn(5, N, 16, seed=0, dtype=x_dtype)
            samples[f"connection_pre-{residual}-{x_dtype}"] = (
                connection_pre, x.requires_grad_(x_dtype == torch.float32), weight.clone().requires_grad_(),
                scale.clone().requires_grad_(), bias.clone().requires_grad_(), perms, variant, iters,
                x_dtype == bf16)
        _, _, _, _, z, rms_inv, _ = connection_pre(x.detach(), weight, scale, bias, perms, variant, iters, True)
        samples[f"connection_pre_backward-{residual}-bf16"] = (
            connection_pre_backward, x.detach(), randn(5, N, 16, seed=1, dtype=bf16), randn(5, 16, seed=2),
            randn(5, N, seed=3), weight, scale, bias, perms, z, rms_inv, variant, iters, True)
    for x_dtype in (torch.float32, bf16):
        samples[f"connection_post-{x_dtype}"] = (
            connection_post, randn(5, N, 16, seed=0, dtype=x_dtype), randn(5, N, seed=1).requires_grad_(),
            randn(5, N, N, seed=2), randn(5, 16, seed=3, dtype=bf16).requires_grad_(),
            torch.zeros((), dtype=x_dtype, device=DEVICE).expand(5, N, 16).requires_grad_())
        samples[f"connection_post_backward-{x_dtype}"] = (
            connection_post_backward, randn(5, N, 16, seed=0, dtype=x_dtype), randn(5, N, seed=1),
            randn(5, 16, seed=2, dtype=bf16))
    return [pytest.param(op, args, id=name) for name, (op, *args) in samples.items()]


@pytest.mark.parametrize("op, args", opcheck_samples())
def test_opcheck(op, args):
    """All of opcheck's default checks: schema, fake tensors, autograd registration and AOT
    dispatch with dynamic shapes (which runs the kernels and, for the forward ops, the backward)."""
    torch.library.opcheck(op, tuple(args))


# ----------------------------------------------------------------------------------------------
# connection_forward against the modules of residuals.py


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
@pytest.mark.parametrize("residual", VARIANTS)
def test_connection_forward_matches_module(residual, mode, small_blocks):
    """Outputs and every gradient (x, the connection's parameters, the branch's), with an odd width,
    several token blocks (one backward program with two), masked tails; randomised parameters."""
    stream_dtype, autocast = MODES[mode]
    width = 24
    module = randomise(RESIDUALS[residual](width, N, 1), SCALE).to(DEVICE)
    branch = Branch(width).to(DEVICE)
    x = randn(2, 19, N, width, seed=1, dtype=stream_dtype)
    cotangent = randn(2, 19, N, width, seed=2, dtype=stream_dtype)

    assert fused.supported(module, x)
    out, grads = run_connection(fused.connection_forward, module, branch, x, cotangent, autocast)
    module_ref, branch_ref = copy.deepcopy(module), copy.deepcopy(branch)
    expected, expected_grads = run_connection(lambda m, x, f: m(x, f), module_ref, branch_ref, x, cotangent, autocast)

    assert out.dtype == expected.dtype == stream_dtype
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert grads[name].dtype == expected_grads[name].dtype, name
    if mode == "fp32":
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"grad {name}: {m}")
    else:
        # bf16 somewhere (streams, or the branch and the projection GEMM under autocast): both sides
        # round, at different points (the reference rounds the GEMM outputs to bf16, the kernels
        # accumulate in fp32; the interpreter's bf16 stores truncate where a GPU rounds to nearest).
        # Errors are measured against each tensor's largest entry, since parameter grads are sums
        # with cancellation.
        assert_close_normwise(out, expected, 3e-2, "output")
        for name in grads:
            assert_close_normwise(grads[name], expected_grads[name], 3e-2, f"grad {name}")


def assert_close_normwise(got, want, tol, name):
    error = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert error <= tol * scale, f"{name}: max error {error:.3g} > {tol} * max |expected| {scale:.3g}"


@pytest.mark.parametrize("autocast", [False, True])
def test_mhclite_fused_h_res_is_doubly_stochastic(autocast):
    n, width, scale = N, 16, 100.0
    module = randomise(RESIDUALS["mhclite"](width, n, 0), scale).to(DEVICE)
    x = randn(2, 9, n, width, seed=1, scale=scale)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast), capture_connections(module) as records:
        fused.connection_forward(module, x, torch.tanh)
    h_res = records[0]["h_res"].reshape(-1, n, n).double()
    assert (h_res.sum(-1) - 1).abs().max() < 1e-6
    assert (h_res.sum(-2) - 1).abs().max() < 1e-6


def test_compiled_connection_matches_eager():
    """fullgraph: no graph break; every op one node of the graph."""
    torch._dynamo.reset()
    module = randomise(RESIDUALS["mhclite"](16, N, 1), SCALE).to(DEVICE)
    branch = Branch(16).to(DEVICE)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    compiled = torch.compile(fused.connection_forward, fullgraph=True, backend=backend)
    x = randn(2, 3, N, 16, seed=1)
    cotangent = randn(2, 3, N, 16, seed=2)
    out, grads = run_connection(compiled, module, branch, x, cotangent, autocast=False)
    expected, expected_grads = run_connection(fused.connection_forward, module, branch, x, cotangent,
                                              autocast=False)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-6, atol=1e-6)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    for op in ("connection_pre", "connection_post"):
        assert sum(f"hcfused.{op}" in target for target in targets) == 1, targets


def test_model_with_fused_connections_matches_the_reference_path():
    config = GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, residual="mhc", n_streams=N)
    torch.manual_seed(0)
    models = [GPT(config).to(DEVICE) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    assert apply_fused_connections(models[0], torch.device(DEVICE))["path"] == "fused"
    for model in models:
        for connection in model.connections():
            randomise(connection, SCALE)
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
    width = 8
    module = RESIDUALS["mhc"](width, N, 0)
    x = torch.zeros(1, 3, N, width)
    reason = fused.unsupported_reason
    assert reason(module, x) is None and fused.supported(module, x)
    assert fused.supported(RESIDUALS["hc"](width, N, 0), x.bfloat16())
    assert fused.supported(RESIDUALS["mhclite"](width, N, 0, num_perms=10), x)
    assert "n_streams = 4" in reason(RESIDUALS["mhclite"](width, 2, 0), x[:, :, :2])
    assert "n_streams = 4" in reason(RESIDUALS["hc"](width, 2, 0), x[:, :, :2])
    assert "sinkhorn_iters" in reason(RESIDUALS["mhc"](width, N, 0, sinkhorn_iters=3), x)
    assert "HC-family" in reason(Residual(width, 1, 0), x[:, :, :1])
    # configs/authors.py's settings compute another function: those connections take residuals.py
    for residual, setting in [("hc", dict(rms_eps=0.0)), ("mhclite", dict(mixing_dtype="autocast")),
                              ("mhc", dict(sinkhorn_order="rows_then_cols")),
                              ("mhclite", dict(h_res_dtype="autocast"))]:
        assert reason(AUTHORS_CONNECTIONS[residual](width, N, 0, **setting), x) is not None, setting
    drawn_init = RESIDUALS["mhclite"](width, N, 0)
    drawn_init.stream_index = 3
    drawn_init.reset_parameters()
    assert reason(drawn_init, x) is None  # only an init value
    assert "float32 or bfloat16" in reason(module, x.half())
    assert "float32 or bfloat16" in reason(module, x.double())
    assert "(B, T, n, C)" in reason(module, x[..., :4])  # not this module's width
    assert "CUDA" in reason(module, x.to("meta"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not fused.supported(module, x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", False)  # a CPU run outside the tests: residuals.py
    assert "CUDA" in reason(module, x)
    with fused.interpret_on_cpu():
        assert fused.supported(module, x)
    assert not fused.INTERPRET_ON_CPU  # restored: nothing after the block takes the interpreter
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fused, "TRITON_AVAILABLE", False)
    assert reason(module, x) == "triton is not installed"


def test_imports_and_declines_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, fused, residuals\n"
            "fused.INTERPRET_ON_CPU = True\n"
            "assert not fused.supported(residuals.HyperConnection(8, 4, 0), torch.zeros(1, 1, 4, 8))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
