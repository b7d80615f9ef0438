"""Triton kernels for the HC-family connections (hc, mhc, mhclite), as torch.library custom ops.

residuals.py is the reference: `connection_forward(module, x, branch)` computes what
`module(x, branch)` computes (StreamConnection.forward), cut into four steps per token:

    p        = rms_projection(rows, weight)           Triton: RMS factor and projection GEMM, one pass
    coeffs   = module.coefficients_from_projection(p) torch (fp32): tanh/sigmoid/Sinkhorn/permutations
    u, mixed = stream_mix(x, h_pre, h_res)            Triton: u = sum_j h_pre[j] x[j],
                                                              mixed[i] = sum_j h_res[i, j] x[j]
    x_next   = stream_post(mixed, h_post, branch(u))  Triton: mixed[i] + h_post[i] * y, stored in x.dtype

The three ops are custom ops with Triton kernels, fake implementations and registered autograd
formulas whose Triton parts are custom ops too (rms_projection_rows_backward, stream_mix_backward,
stream_post_backward), so torch.compile(fullgraph=True) keeps every kernel as one opaque node in
the forward and in the backward graph. The coefficient math stays in torch: it is tiny (n^2 + 2n
numbers per token) and is the part that differs between variants.

Bytes moved per token (n streams of width C; s = bytes of an x element, 4 for float32 streams and 2
for bfloat16 streams; s_y = bytes of a branch output element; the O(n^2) coefficient and projection
logit traffic is left out):
  forward   rms_projection reads x                                      nCs
            stream_mix reads x, writes u and mixed (fp32)               nCs + 4C + 4nC
            stream_post reads mixed and y, writes x_next                4nC + s_y C + nCs
            total                                                       3nCs + 8nC + (4 + s_y)C
  backward  stream_post_backward reads grad x_next and y, writes grad y  nCs + 2 s_y C
            grad mixed = grad x_next widened to fp32 (torch; nothing     bf16 streams: nCs + 4nC
              for fp32 streams, where it is the same tensor)
            stream_mix_backward reads grad u, grad mixed and x,         4C + 4nC + 2nCs
              writes grad x
            rms_projection_rows_backward reads x, writes grad rows      2nCs
            grad weight GEMM (torch) reads x                            nCs, plus a cast copy of x
                                                                          when its dtype is not the
                                                                          GEMM operand dtype
            autograd adds the two grads of x (projection, mix)          3nCs
            total, fp32 streams                                         9nCs + 4nC + (4 + 2 s_y)C
            total, bf16 streams                                         10nCs + 8nC + (4 + 2 s_y)C
For n = 4, C = 768, bfloat16 streams and a bfloat16 branch: 47,616 bytes forward, 92,160 backward.

Memory: the ops save x (the caller's tensor, through views), y (C values per token) and the
coefficients; the fp32 `mixed` is freed once stream_post has run, since no backward needs it. So
the connection's `recompute` option (which checkpoints the coefficients and the mixing in
residuals.py) has nothing to save here and is not used on this path.

CUDA is the target. On CPU the same kernels run in Triton's interpreter, for tests only: a CPU
tensor takes this path only when INTERPRET_ON_CPU is set and TRITON_INTERPRET=1, which must be set
before triton is imported (this module imports it at its first kernel launch).
"""

import functools
import importlib.util
import os
import types

import torch

from residuals import RMS_EPS, StreamConnection, autocast_matmul_dtype, record_coefficients

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

# Tests set this to drive the kernels through Triton's interpreter on CPU tensors.
INTERPRET_ON_CPU = False

# Tile sizes (constexprs): rows and depth chunk of the projection, channel chunk of the mixing.
PROJECTION_BLOCK_ROWS = 32
PROJECTION_BLOCK_DEPTH = 128
BLOCK_CHANNELS = 256

STREAM_DTYPES = (torch.float32, torch.bfloat16)

# The one stream count the kernels are written for; None: any n.
KERNEL_N_STREAMS = None


def unsupported_reason(module, x) -> str | None:
    """Why connection_forward cannot run `module` on x here, or None when it can. The one place that
    says which connections, inputs and devices the kernels take (attribute checks only, traceable)."""
    if not TRITON_AVAILABLE:
        return "triton not installed"
    if not isinstance(module, StreamConnection):
        return "not an HC-family connection"
    if KERNEL_N_STREAMS is not None and module.n_streams != KERNEL_N_STREAMS:
        return f"n_streams={module.n_streams}: kernels are for n={KERNEL_N_STREAMS}"
    if x.dtype not in STREAM_DTYPES:
        return f"stream dtype {str(x.dtype).removeprefix('torch.')}"
    if x.dim() != 4 or x.shape[-2] != module.n_streams or x.shape[-1] != module.width:
        return "input is not (B, T, n, C) for this connection"
    if x.device.type == "cuda":
        return None
    if x.device.type != "cpu":
        return f"device {x.device.type}: the kernels run on CUDA"
    if not (INTERPRET_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"):
        return "CPU without the Triton interpreter"
    return None


def supported(module, x) -> bool:
    """Whether connection_forward can run `module` on x here."""
    return unsupported_reason(module, x) is None


def connection_forward(module, x, branch):
    """module(x, branch) for an HC-family connection, through the fused ops (x: (B, T, n, C))."""
    batch, time, n, width = x.shape
    tokens = batch * time
    bf16_operands = autocast_matmul_dtype(x.device.type) == torch.bfloat16
    with torch.autocast(x.device.type, enabled=False):
        rows = module.projection_rows(x)
        weight = module.projection_weight().float()
        p = rms_projection(rows.reshape(-1, rows.shape[-1]), weight, bf16_operands)[0]
        coeffs = module.coefficients_from_projection(p.view(*rows.shape[:-1], weight.shape[0]))
        branch_input, mixed = stream_mix(x.reshape(tokens, n, width), coeffs["h_pre"].reshape(tokens, n),
                                         coeffs["h_res"].reshape(tokens, n, n))
    record_coefficients(module, coeffs)
    y = branch(branch_input.view(batch, time, width))
    with torch.autocast(x.device.type, enabled=False):
        x_next = stream_post(mixed, coeffs["h_post"].reshape(tokens, n), y.reshape(tokens, width), x.dtype)
    return x_next.view(batch, time, n, width)


# ----------------------------------------------------------------------------------------------
# Launching


def kernel(name):
    """The Triton kernel `name` (a JITFunction; an InterpretedFunction under TRITON_INTERPRET=1)."""
    return getattr(_kernels(), name)


def _launch(name, grid, device, *args, **constexprs):
    """Every kernel launch goes through here (scripts/kernel_resources.py and bench.py --kernels
    record them)."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # triton launches on the current device
            kernel(name)[grid](*args, **constexprs)
    else:
        kernel(name)[grid](*args, **constexprs)  # CPU tensors: only under TRITON_INTERPRET=1 (see supported)


def _cdiv(a, b):
    return -(-a // b)


def _power_of_two_at_least(n):
    return 1 << max(n - 1, 0).bit_length()


def _streams_block(n):
    return _power_of_two_at_least(n)  # tensor dims are powers of two; the padding is masked


def _mix_channels_block(n):
    """The mixing kernels hold an (n, n, BLOCK_C) product tile: at most 4096 fp32 values."""
    return max(1, min(BLOCK_CHANNELS, 4096 // _streams_block(n) ** 2))


def _dot_operands(bf16_operands, device):
    """How the projection kernels multiply: "fp32", "bf16" (tensor cores), or "bf16_rounded":
    operands rounded to bf16 and multiplied in fp32, the same exact products, for Triton's
    interpreter, whose tl.dot multiplies bf16 tiles as their raw 16-bit patterns (triton 3.9)
    and whose bf16 casts truncate."""
    if not bf16_operands:
        return "fp32"
    return "bf16" if device.type == "cuda" else "bf16_rounded"


def _logits_block(n):
    return max(16, _power_of_two_at_least(n))  # tl.dot needs every dimension >= 16


# ----------------------------------------------------------------------------------------------
# Kernels


@functools.cache
def _kernels():
    """The Triton kernels, defined on first use: triton is imported only then, so importing this
    module (model.py does) never imports triton, and TRITON_INTERPRET, which triton reads when it
    is imported, can still be set by a test module collected after model.py's importers."""
    global triton, tl, round_to_bf16, dot_accumulate  # kernels find what they call among the module's globals
    import triton
    import triton.language as tl

    @triton.jit
    def round_to_bf16(x):
        """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32; by its bits, because the
        interpreter's fp32 -> bf16 conversion truncates."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def dot_accumulate(a, b, acc, OPERANDS: tl.constexpr):
        """acc + a @ b in fp32, the operands as _dot_operands says; fp32 means fp32, never TF32."""
        if OPERANDS == "bf16":
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
        elif OPERANDS == "bf16_rounded":
            out = tl.dot(round_to_bf16(a), round_to_bf16(b), acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc, input_precision="ieee")
        return out

    @triton.jit
    def rms_projection_forward_kernel(rows_ptr, weight_ptr, p_ptr, z_ptr, rms_inv_ptr, M, N, D, eps,
                                      OPERANDS: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        logit = tl.arange(0, BLOCK_N)
        row_ok = row < M
        logit_ok = logit < N
        row_start = row.to(tl.int64) * D
        z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            depth = start + tl.arange(0, BLOCK_D)
            depth_ok = depth < D
            rows = tl.load(rows_ptr + row_start[:, None] + depth[None, :],
                           mask=row_ok[:, None] & depth_ok[None, :], other=0.0).to(tl.float32)
            weight_t = tl.load(weight_ptr + logit[None, :] * D + depth[:, None],
                               mask=logit_ok[None, :] & depth_ok[:, None], other=0.0)
            sum_sq += tl.sum(rows * rows, axis=1)
            z = dot_accumulate(rows, weight_t, z, OPERANDS)
        rms_inv = tl.rsqrt(sum_sq / D + eps)
        out = row[:, None] * N + logit[None, :]
        out_ok = row_ok[:, None] & logit_ok[None, :]
        tl.store(z_ptr + out, z, mask=out_ok)
        tl.store(p_ptr + out, z * rms_inv[:, None], mask=out_ok)
        tl.store(rms_inv_ptr + row, rms_inv, mask=row_ok)

    @triton.jit
    def rms_projection_backward_kernel(rows_ptr, weight_ptr, grad_z_ptr, row_coef_ptr, grad_rows_ptr, M, N, D,
                                       OPERANDS: tl.constexpr, BLOCK_M: tl.constexpr,
                                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """grad_rows = grad_z @ weight + rows * row_coef, one pass over rows."""
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        logit = tl.arange(0, BLOCK_N)
        row_ok = row < M
        logit_ok = logit < N
        row_start = row.to(tl.int64) * D
        grad_z = tl.load(grad_z_ptr + row[:, None] * N + logit[None, :],
                         mask=row_ok[:, None] & logit_ok[None, :], other=0.0)
        row_coef = tl.load(row_coef_ptr + row, mask=row_ok, other=0.0)
        for start in range(0, D, BLOCK_D):
            depth = start + tl.arange(0, BLOCK_D)
            depth_ok = depth < D
            weight = tl.load(weight_ptr + logit[:, None] * D + depth[None, :],
                             mask=logit_ok[:, None] & depth_ok[None, :], other=0.0)
            tile = row_start[:, None] + depth[None, :]
            tile_ok = row_ok[:, None] & depth_ok[None, :]
            rows = tl.load(rows_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
            grad = dot_accumulate(grad_z, weight, rows * row_coef[:, None], OPERANDS)
            tl.store(grad_rows_ptr + tile, grad.to(grad_rows_ptr.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def stream_mix_forward_kernel(x_ptr, h_pre_ptr, h_res_ptr, u_ptr, mixed_ptr, C,
                                  N_STREAMS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        """One token, one channel chunk: u and every mixed stream from one read of x."""
        token = tl.program_id(0).to(tl.int64)
        channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        stream = tl.arange(0, BLOCK_S)  # padded to a power of two; the padding reads and writes nothing
        stream_ok = stream < N_STREAMS
        channel_ok = channel < C
        tile = token * N_STREAMS * C + stream[:, None] * C + channel[None, :]
        tile_ok = stream_ok[:, None] & channel_ok[None, :]
        x = tl.load(x_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        h_pre = tl.load(h_pre_ptr + token * N_STREAMS + stream, mask=stream_ok, other=0.0)
        h_res = tl.load(h_res_ptr + token * N_STREAMS * N_STREAMS + stream[:, None] * N_STREAMS + stream[None, :],
                        mask=stream_ok[:, None] & stream_ok[None, :], other=0.0)
        u = tl.sum(h_pre[:, None] * x, axis=0)
        mixed = tl.sum(h_res[:, :, None] * x[None, :, :], axis=1)
        tl.store(u_ptr + token * C + channel, u, mask=channel_ok)
        tl.store(mixed_ptr + tile, mixed, mask=tile_ok)

    @triton.jit
    def stream_mix_backward_kernel(x_ptr, h_pre_ptr, h_res_ptr, grad_u_ptr, grad_mixed_ptr,
                                   grad_x_ptr, grad_h_pre_ptr, grad_h_res_ptr, C,
                                   N_STREAMS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        """One token per program, looping over channels: grad x per chunk, coefficient grads summed."""
        token = tl.program_id(0).to(tl.int64)
        stream = tl.arange(0, BLOCK_S)
        stream_ok = stream < N_STREAMS
        pair = stream[:, None] * N_STREAMS + stream[None, :]
        pair_ok = stream_ok[:, None] & stream_ok[None, :]
        h_pre = tl.load(h_pre_ptr + token * N_STREAMS + stream, mask=stream_ok, other=0.0)
        h_res = tl.load(h_res_ptr + token * N_STREAMS * N_STREAMS + pair, mask=pair_ok, other=0.0)
        grad_h_pre = tl.zeros((BLOCK_S,), dtype=tl.float32)
        grad_h_res = tl.zeros((BLOCK_S, BLOCK_S), dtype=tl.float32)
        for start in range(0, C, BLOCK_C):
            channel = start + tl.arange(0, BLOCK_C)
            channel_ok = channel < C
            tile = token * N_STREAMS * C + stream[:, None] * C + channel[None, :]
            tile_ok = stream_ok[:, None] & channel_ok[None, :]
            x = tl.load(x_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
            grad_u = tl.load(grad_u_ptr + token * C + channel, mask=channel_ok, other=0.0).to(tl.float32)
            grad_mixed = tl.load(grad_mixed_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
            # grad_x[j] = h_pre[j] grad_u + sum_i h_res[i, j] grad_mixed[i]
            grad_x = h_pre[:, None] * grad_u[None, :] + tl.sum(h_res[:, :, None] * grad_mixed[:, None, :], axis=0)
            tl.store(grad_x_ptr + tile, grad_x.to(grad_x_ptr.dtype.element_ty), mask=tile_ok)
            grad_h_pre += tl.sum(x * grad_u[None, :], axis=1)
            grad_h_res += tl.sum(grad_mixed[:, None, :] * x[None, :, :], axis=2)
        tl.store(grad_h_pre_ptr + token * N_STREAMS + stream, grad_h_pre, mask=stream_ok)
        tl.store(grad_h_res_ptr + token * N_STREAMS * N_STREAMS + pair, grad_h_res, mask=pair_ok)

    @triton.jit
    def stream_post_forward_kernel(mixed_ptr, h_post_ptr, y_ptr, out_ptr, C,
                                   N_STREAMS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        stream = tl.arange(0, BLOCK_S)
        stream_ok = stream < N_STREAMS
        channel_ok = channel < C
        tile = token * N_STREAMS * C + stream[:, None] * C + channel[None, :]
        tile_ok = stream_ok[:, None] & channel_ok[None, :]
        mixed = tl.load(mixed_ptr + tile, mask=tile_ok, other=0.0)
        h_post = tl.load(h_post_ptr + token * N_STREAMS + stream, mask=stream_ok, other=0.0)
        y = tl.load(y_ptr + token * C + channel, mask=channel_ok, other=0.0).to(tl.float32)
        out = mixed + h_post[:, None] * y[None, :]
        tl.store(out_ptr + tile, out.to(out_ptr.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def stream_post_backward_kernel(grad_ptr, h_post_ptr, y_ptr, grad_h_post_ptr, grad_y_ptr, C,
                                    N_STREAMS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        stream = tl.arange(0, BLOCK_S)
        stream_ok = stream < N_STREAMS
        h_post = tl.load(h_post_ptr + token * N_STREAMS + stream, mask=stream_ok, other=0.0)
        grad_h_post = tl.zeros((BLOCK_S,), dtype=tl.float32)
        for start in range(0, C, BLOCK_C):
            channel = start + tl.arange(0, BLOCK_C)
            channel_ok = channel < C
            tile = token * N_STREAMS * C + stream[:, None] * C + channel[None, :]
            tile_ok = stream_ok[:, None] & channel_ok[None, :]
            grad = tl.load(grad_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + token * C + channel, mask=channel_ok, other=0.0).to(tl.float32)
            grad_h_post += tl.sum(grad * y[None, :], axis=1)
            grad_y = tl.sum(h_post[:, None] * grad, axis=0)
            tl.store(grad_y_ptr + token * C + channel, grad_y.to(grad_y_ptr.dtype.element_ty), mask=channel_ok)
        tl.store(grad_h_post_ptr + token * N_STREAMS + stream, grad_h_post, mask=stream_ok)

    return types.SimpleNamespace(**{name: kernel for name, kernel in locals().items() if name.endswith("_kernel")})


# ----------------------------------------------------------------------------------------------
# The ops. Each backward formula calls a backward op, never a kernel directly, so that AOT
# autograd (torch.compile) can trace the backward with fake tensors.


def _zeros_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad


@torch.library.custom_op("hcfused::rms_projection", mutates_args=())
def rms_projection(rows: torch.Tensor, weight: torch.Tensor,
                   bf16_operands: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, z, rms_inv) for rows (M, D) float32 or bfloat16 and weight (N, D) float32, all fp32:
    z = rows @ weight.T (operands rounded to bf16 when bf16_operands, fp32 accumulation),
    rms_inv = rsqrt(mean(rows^2) + RMS_EPS) and p = z * rms_inv. z and rms_inv are what the
    backward needs, so they are outputs."""
    rows, weight = rows.contiguous(), weight.contiguous()
    (m, d), n = rows.shape, weight.shape[0]
    p = rows.new_empty((m, n), dtype=torch.float32)
    z = torch.empty_like(p)
    rms_inv = rows.new_empty((m,), dtype=torch.float32)
    if m > 0:
        _launch("rms_projection_forward_kernel", (_cdiv(m, PROJECTION_BLOCK_ROWS),), rows.device,
                rows, weight, p, z, rms_inv, m, n, d, RMS_EPS, OPERANDS=_dot_operands(bf16_operands, rows.device),
                BLOCK_M=PROJECTION_BLOCK_ROWS, BLOCK_N=_logits_block(n), BLOCK_D=PROJECTION_BLOCK_DEPTH)
    return p, z, rms_inv


@rms_projection.register_fake
def _(rows, weight, bf16_operands):
    p = rows.new_empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
    return p, torch.empty_like(p), rows.new_empty((rows.shape[0],), dtype=torch.float32)


@torch.library.custom_op("hcfused::rms_projection_rows_backward", mutates_args=())
def rms_projection_rows_backward(rows: torch.Tensor, weight: torch.Tensor, grad_z: torch.Tensor,
                                 row_coef: torch.Tensor, bf16_operands: bool) -> torch.Tensor:
    """grad_z @ weight + rows * row_coef[:, None] in rows' dtype (the GEMM as in rms_projection)."""
    rows, weight, grad_z, row_coef = (t.contiguous() for t in (rows, weight, grad_z, row_coef))
    (m, d), n = rows.shape, weight.shape[0]
    grad_rows = torch.empty_like(rows)
    if m > 0:
        _launch("rms_projection_backward_kernel", (_cdiv(m, PROJECTION_BLOCK_ROWS),), rows.device,
                rows, weight, grad_z, row_coef, grad_rows, m, n, d, OPERANDS=_dot_operands(bf16_operands, rows.device),
                BLOCK_M=PROJECTION_BLOCK_ROWS, BLOCK_N=_logits_block(n), BLOCK_D=PROJECTION_BLOCK_DEPTH)
    return grad_rows


@rms_projection_rows_backward.register_fake
def _(rows, weight, grad_z, row_coef, bf16_operands):
    return torch.empty_like(rows, memory_format=torch.contiguous_format)


def _rms_projection_setup_context(ctx, inputs, output):
    rows, weight, bf16_operands = inputs
    _, z, rms_inv = output
    ctx.bf16_operands = bf16_operands
    ctx.save_for_backward(rows, weight, z, rms_inv)


def _rms_projection_backward(ctx, grad_p, grad_z, grad_rms_inv):
    """With p = z r and dr/drows = -r^3 rows / D, the total gradients reaching z and r are
        g_z = grad_p r + grad_z,   g_r = sum(grad_p z) + grad_rms_inv,
    so grad_rows = g_z @ weight - rows r^3 / D g_r and grad_weight = g_z.T @ rows."""
    rows, weight, z, rms_inv = ctx.saved_tensors
    grad_p = _zeros_if_none(grad_p, z)
    total_grad_z = grad_p * rms_inv[:, None] + _zeros_if_none(grad_z, z)
    total_grad_r = (grad_p * z).sum(-1) + _zeros_if_none(grad_rms_inv, rms_inv)
    grad_rows = grad_weight = None
    if ctx.needs_input_grad[0]:
        row_coef = total_grad_r * rms_inv.pow(3) / -rows.shape[-1]
        grad_rows = rms_projection_rows_backward(rows, weight, total_grad_z, row_coef, ctx.bf16_operands)
    if ctx.needs_input_grad[1]:
        operand_dtype = torch.bfloat16 if ctx.bf16_operands else torch.float32
        with torch.autocast(rows.device.type, enabled=False):
            grad_weight = (total_grad_z.t().to(operand_dtype) @ rows.to(operand_dtype)).to(weight.dtype)
    return grad_rows, grad_weight, None


rms_projection.register_autograd(_rms_projection_backward, setup_context=_rms_projection_setup_context)


@torch.library.custom_op("hcfused::stream_mix", mutates_args=())
def stream_mix(x: torch.Tensor, h_pre: torch.Tensor, h_res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, mixed) for x (M, n, C) float32 or bfloat16, h_pre (M, n) and h_res (M, n, n) fp32:
    u = sum_j h_pre[j] x[j] (M, C) and mixed[i] = sum_j h_res[i, j] x[j] (M, n, C), fp32."""
    x, h_pre, h_res = x.contiguous(), h_pre.contiguous(), h_res.contiguous()
    m, n, c = x.shape
    u = x.new_empty((m, c), dtype=torch.float32)
    mixed = x.new_empty((m, n, c), dtype=torch.float32)
    if m > 0 and c > 0:
        block_c = _mix_channels_block(n)
        _launch("stream_mix_forward_kernel", (m, _cdiv(c, block_c)), x.device,
                x, h_pre, h_res, u, mixed, c, N_STREAMS=n, BLOCK_S=_streams_block(n), BLOCK_C=block_c)
    return u, mixed


@stream_mix.register_fake
def _(x, h_pre, h_res):
    m, n, c = x.shape
    return x.new_empty((m, c), dtype=torch.float32), x.new_empty((m, n, c), dtype=torch.float32)


@torch.library.custom_op("hcfused::stream_mix_backward", mutates_args=())
def stream_mix_backward(x: torch.Tensor, h_pre: torch.Tensor, h_res: torch.Tensor, grad_u: torch.Tensor,
                        grad_mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x in x's dtype, grad_h_pre, grad_h_res) of stream_mix, one pass over x and the grads."""
    x, h_pre, h_res, grad_u, grad_mixed = (t.contiguous() for t in (x, h_pre, h_res, grad_u, grad_mixed))
    m, n, c = x.shape
    grad_x = torch.empty_like(x)
    grad_h_pre = torch.empty_like(h_pre)
    grad_h_res = torch.empty_like(h_res)
    if m > 0:
        _launch("stream_mix_backward_kernel", (m,), x.device, x, h_pre, h_res, grad_u, grad_mixed,
                grad_x, grad_h_pre, grad_h_res, c, N_STREAMS=n, BLOCK_S=_streams_block(n),
                BLOCK_C=_mix_channels_block(n))
    return grad_x, grad_h_pre, grad_h_res


@stream_mix_backward.register_fake
def _(x, h_pre, h_res, grad_u, grad_mixed):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, h_pre, h_res))


def _stream_mix_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _stream_mix_backward(ctx, grad_u, grad_mixed):
    x, h_pre, h_res = ctx.saved_tensors
    grad_u = _zeros_if_none(grad_u, x[:, 0].float())
    grad_mixed = _zeros_if_none(grad_mixed, x.float())
    return stream_mix_backward(x, h_pre, h_res, grad_u, grad_mixed)


stream_mix.register_autograd(_stream_mix_backward, setup_context=_stream_mix_setup_context)


@torch.library.custom_op("hcfused::stream_post", mutates_args=())
def stream_post(mixed: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """mixed[i] + h_post[i] * y in fp32, stored in out_dtype: mixed (M, n, C) fp32, h_post (M, n)
    fp32, y (M, C) in any float dtype."""
    mixed, h_post, y = mixed.contiguous(), h_post.contiguous(), y.contiguous()
    m, n, c = mixed.shape
    out = mixed.new_empty((m, n, c), dtype=out_dtype)
    if m > 0 and c > 0:
        _launch("stream_post_forward_kernel", (m, _cdiv(c, BLOCK_CHANNELS)), mixed.device,
                mixed, h_post, y, out, c, N_STREAMS=n, BLOCK_S=_streams_block(n), BLOCK_C=BLOCK_CHANNELS)
    return out


@stream_post.register_fake
def _(mixed, h_post, y, out_dtype):
    return mixed.new_empty(mixed.shape, dtype=out_dtype)


@torch.library.custom_op("hcfused::stream_post_backward", mutates_args=())
def stream_post_backward(grad: torch.Tensor, h_post: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_h_post, grad_y in y's dtype) of stream_post, one pass over grad and y."""
    grad, h_post, y = grad.contiguous(), h_post.contiguous(), y.contiguous()
    m, n, c = grad.shape
    grad_h_post = torch.empty_like(h_post)
    grad_y = torch.empty_like(y)
    if m > 0:
        _launch("stream_post_backward_kernel", (m,), grad.device, grad, h_post, y, grad_h_post, grad_y, c,
                N_STREAMS=n, BLOCK_S=_streams_block(n), BLOCK_C=BLOCK_CHANNELS)
    return grad_h_post, grad_y


@stream_post_backward.register_fake
def _(grad, h_post, y):
    return (torch.empty_like(h_post, memory_format=torch.contiguous_format),
            torch.empty_like(y, memory_format=torch.contiguous_format))


def _stream_post_setup_context(ctx, inputs, output):
    _, h_post, y, _ = inputs
    ctx.save_for_backward(h_post, y)


def _stream_post_backward(ctx, grad):
    h_post, y = ctx.saved_tensors
    grad_h_post, grad_y = stream_post_backward(grad, h_post, y)
    # grad_mixed is the incoming grad itself: no copy for fp32 streams, a widening for bf16 ones.
    return grad.float(), grad_h_post, grad_y, None


stream_post.register_autograd(_stream_post_backward, setup_context=_stream_post_setup_context)
