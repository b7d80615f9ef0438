"""The HC-family connections (hc, mhc, mhclite) through Triton kernels, a package a user can ignore:
parallelize.apply_fused_connections (train.py's fused_connections=True) swaps connection_forward in
for the connections' own forward, from outside the model.

`connection_forward(module, x, branch)` computes what `module(x, branch)` computes in residuals.py
(StreamConnection.forward) for n = 4 streams, in two custom ops around the branch (ops.py), each
with one forward kernel and its backward kernels (kernels.py; connection_pre's backward takes three):

    u, h_pre, h_post, h_res, z, rms_inv, next_grad = connection_pre(x, weight, scale, bias, ...)
    y      = branch(u)
    x_next = connection_post(x, h_post, h_res, y, next_grad)

CUDA is the target. On CPU the same kernels run in Triton's interpreter, for tests and dry runs
only: a CPU tensor takes this path only inside `interpret_on_cpu()` (or with INTERPRET_ON_CPU set)
and with TRITON_INTERPRET=1, which must be set before triton is imported (kernels.py, imported at
the first kernel launch, imports it).
"""

import contextlib
import importlib.util
import os

import torch

from residuals import RESIDUALS, HyperConnection, ManifoldHyperConnection, StreamConnection, autocast_matmul_dtype

from .ops import MIN_SINKHORN_ITERS, STREAMS, connection_post, connection_pre

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

# Set inside interpret_on_cpu(): the kernels take CPU tensors, in Triton's interpreter.
INTERPRET_ON_CPU = False

STREAM_DTYPES = (torch.float32, torch.bfloat16)


def papers_connection_reason(module) -> str | None:
    """Why `module` is not the paper's connection the kernels compute, or None when it is."""
    if type(module) not in RESIDUALS.values():
        return "the kernels compute residuals.py's connections, not the authors' arithmetic (authors.py)"
    return None


def unsupported_reason(module, x) -> str | None:
    """Why connection_forward cannot run `module` on x here, or None when it can (traceable)."""
    if not TRITON_AVAILABLE:
        return "triton is not installed"
    if not isinstance(module, StreamConnection):
        return "not an HC-family connection"
    if module.name not in ("hc", "mhc", "mhclite"):
        return f"the kernels are written for hc, mhc and mhclite, not {module.name}"
    if isinstance(module, ManifoldHyperConnection) and module.mhc_eps:
        return "the kernels compute the paper's mhc, not DeepSeek-V4's epsilons (mhc_eps > 0)"
    if module.n_streams != STREAMS:
        return "the kernels are written for n_streams = 4"
    if isinstance(module, ManifoldHyperConnection) and module.sinkhorn_iters < MIN_SINKHORN_ITERS:
        return "the kernels need sinkhorn_iters >= 4"
    reason = papers_connection_reason(module)
    if reason is not None:
        return reason
    if x.dtype not in STREAM_DTYPES:
        return "the kernels take float32 or bfloat16 streams"
    if x.dim() != 4 or x.shape[-2] != module.n_streams or x.shape[-1] != module.width:
        return "x is not (B, T, n, C) for this connection"
    if x.device.type == "cuda":
        return None
    if x.device.type == "cpu" and INTERPRET_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "the kernels run on CUDA tensors (on CPU only in Triton's interpreter, for tests)"


@contextlib.contextmanager
def interpret_on_cpu():
    """Inside the block connection_forward takes CPU tensors, run in Triton's interpreter under
    TRITON_INTERPRET=1 (a dry run: what surrounds the kernels is real, their times are not)."""
    global INTERPRET_ON_CPU
    saved, INTERPRET_ON_CPU = INTERPRET_ON_CPU, True
    try:
        yield
    finally:
        INTERPRET_ON_CPU = saved


def supported(module, x) -> bool:
    """Whether connection_forward can run `module` on x here."""
    return unsupported_reason(module, x) is None


def connection_forward(module, x, branch):
    """module(x, branch) for an HC-family connection, through the fused ops (x: (B, T, n, C))."""
    batch, time, n, width = x.shape
    rows = x.reshape(batch * time, n, width)
    bf16_operands = autocast_matmul_dtype(x.device.type) == torch.bfloat16
    with torch.autocast(x.device.type, enabled=False):
        variant, weight, scale, bias, perm_matrices, iters = packed_parameters(module)
        u, h_pre, h_post, h_res, z, rms_inv, next_grad = connection_pre(rows, weight, scale, bias, perm_matrices,
                                                                        variant, iters, bf16_operands)
    record_coefficients(module, (batch, time), h_pre, h_post, h_res, z, rms_inv)
    y = branch(u.view(batch, time, width))
    with torch.autocast(x.device.type, enabled=False):
        x_next = connection_post(rows, h_post, h_res, y.reshape(batch * time, width), next_grad)
    return x_next.view(batch, time, n, width)


def packed_parameters(module):
    """(variant, weight, scale, bias, perm_matrices, sinkhorn_iters) as the kernels read them (fp32):
    mhc/mhclite logits l[k] = scale[k] p[k] + bias[k] over [pre | post | res];
    hc A[i, k] = bias[i, k] + scale[k] tanh(p[i, k]) with bias = [static_alpha | static_beta]."""
    n = module.n_streams
    weight = module.projection_weight().float()
    empty = weight.new_empty((0, n * n))
    if isinstance(module, HyperConnection):
        scale = torch.cat([module.scale_alpha.expand(n + 1), module.scale_beta.expand(1)])
        bias = torch.cat([module.static_alpha, module.static_beta[:, None]], dim=1)
        return "hc", weight, scale.float(), bias.float(), empty, 0
    res = module.res_logits
    scale = torch.cat([module.scale_pre.expand(n), module.scale_post.expand(n), module.scale_res.expand(res)])
    bias = torch.cat([module.bias_pre, module.bias_post, module.bias_res])
    if isinstance(module, ManifoldHyperConnection):
        return "mhc", weight, scale.float(), bias.float(), empty, module.sinkhorn_iters
    return "mhclite", weight, scale.float(), bias.float(), module.perm_matrices, 0


def record_coefficients(module, leading, h_pre, h_post, h_res, z, rms_inv):
    """Hand the kernels' coefficients (and the variant's extras, recomputed in torch from the
    projection) to the residuals.capture_connections() context that set module.recorder, if any."""
    if module.recorder is None:
        return
    with torch.no_grad():
        p = z * (rms_inv[..., None] if z.dim() == 3 else rms_inv[:, None])
        coeffs = module.coefficients_from_projection(p.view(*leading, *p.shape[1:]))
        coeffs.update(h_pre=h_pre.view(*leading, -1), h_post=h_post.view(*leading, -1),
                      h_res=h_res.view(*leading, *h_res.shape[1:]))
        module.record(coeffs)
