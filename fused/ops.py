"""The fused connection as torch.library custom ops: connection_pre and connection_post, each with a
fake implementation (for torch.compile) and an autograd formula that calls a backward op.

connection_pre runs the RMS factor, the projection GEMM (bf16 operands under bf16 autocast, fp32
accumulation), the coefficient math in registers (hc's tanh, mhc's 20 log-space Sinkhorn
iterations, mhclite's softmax and exact combination of permutation matrices) and u = sum_j
h_pre[j] x[j]. connection_post computes x_next = h_res x + h_post y from x and stores it in x's
dtype. Backward: connection_post's backward kernel (before the branch's backward) makes grad y and
grad h_post; it hands the incoming gradient g on, untouched, as the gradient of `next_grad`, a
zero-storage output of connection_pre of x's shape, so that connection_pre's backward (after the
branch's backward) has g, grad u and x together, in two kernels: one over token blocks reduces
the coefficient gradients over the channels, runs the coefficient math backward in registers (mhc:
Sinkhorn recomputed from checkpoints), stores per token the projection's gradient grad z and
writes grad x once with the mixing, projection and RMS terms in it, from a re-read of its token
block that L2 serves; a grad-W kernel over channel blocks sums grad z^T x over each token split on
chip (the splits summed by one small torch reduction, in a fixed order). grad W has its own
kernel, which reads x once more, because a token block's program would need a weight-sized partial
of its own. No autograd add of two full-size gradients, no cast copy of x, no weight-sized partial
re-read per token block. Saved for backward: x and per token O(n^2) floats (z, rms_inv), nothing
n x C wide. Every kernel launch goes through `_launch`.
"""

import functools

import torch

from residuals import RMS_EPS

STREAMS = 4  # the kernels are written for n = 4 streams
MIN_SINKHORN_ITERS = 4  # the Sinkhorn backward keeps four checkpoints

# Each kernel's tile (constexprs: tokens per program or per loop step, channels per loop step or per
# program) and warps; none spills registers on sm_80 or sm_90 (tests/fused/test_fused_resources.py).
# pre and the grad-x kernel take 16 tokens, so that the resident programs' tiles stay in L2 for their
# re-read; pre 4 warps, which keep two CTAs per SM; the grad-x kernel 128 channels per step, the
# fewest serial steps without spills. tl.dot needs 16 or more tokens and channels. STAGES: how far
# ahead the software pipeline issues a loop's loads (cp.async into shared memory) in pre's u loop and
# the grad-x kernel's loops; triton pipelines on its own only the loops that feed tl.dot.
TILES = {"pre_kernel": dict(BLOCK_T=16, BLOCK_C=64, num_warps=4, STAGES=2),
         "post_kernel": dict(BLOCK_T=4, BLOCK_C=256, num_warps=4),
         "post_backward_kernel": dict(BLOCK_T=8, BLOCK_C=128, num_warps=4),
         "pre_backward_grad_x_kernel": dict(BLOCK_T=16, BLOCK_C=128, num_warps=8, STAGES=2),
         "pre_backward_weight_kernel": dict(BLOCK_T=64, BLOCK_C=32, num_warps=8)}
# Channels per step (pre) or per program (the backward's kernels) at a width that is not a multiple
# of 16: triton's JIT then cannot prove the rows aligned, every element gets its own 64-bit pointer,
# and the shipped tiles spill (the backward's under triton 3.6 on sm_80).
UNALIGNED_PRE_BLOCK_C = 32
UNALIGNED_BACKWARD_BLOCK_C = 16
# The grad-x kernel there spills at 4 warps (mhc and mhclite, sm_80 and sm_90).
UNALIGNED_GRAD_X_TILE = dict(num_warps=8, STAGES=1)
# pre spills at 4 warps at such a width and with fp32 operands (mhc and mhclite).
SPILL_PRONE_PRE_NUM_WARPS = 8
# fp32 x fp32 products (no bf16 autocast) need more registers: the grad-W kernel's spill at 32
# tokens per step with bf16 streams, pre's at 64 channels per step under triton 3.6, and the grad-x
# kernel's at 128 channels (with fp32 streams its staged tiles also overflow sm_80's shared memory).
FP32_OPERANDS_WEIGHT_BLOCK_T = 16
FP32_OPERANDS_PRE_BLOCK_C = 32
FP32_OPERANDS_GRAD_X_BLOCK_C = 64
# hc's pre projects (token, stream) rows, so tl.dot's 16 rows take 4 tokens; its lighter program
# keeps more of them resident per SM, so fewer tokens each keep their x tiles in L2 for the re-read.
HC_PRE_BLOCK_T = 8
# mhc's pre also runs the Sinkhorn iterations: at 64 channels per step triton 3.6 spills on sm_90.
MHC_PRE_BLOCK_C = 32
# Token splits of the grad-W kernel, each with its own weight-sized partial of grad W: a fixed
# number, so that the partials cost the same whatever the token count.
WEIGHT_GRAD_SPLITS = 16


# ----------------------------------------------------------------------------------------------
# Launching


@functools.cache
def _kernel_module():
    """kernels.py, imported at the first launch: importing this module never imports triton, so
    TRITON_INTERPRET, read when triton is imported, can still be set later."""
    from . import kernels
    return kernels


def kernel(kernel_name):
    """The Triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1) called kernel_name."""
    return getattr(_kernel_module(), kernel_name)


def _interpreted():
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel("pre_kernel"), InterpretedFunction)


def _launch(kernel_name, grid, device, *args, **constexprs):
    """Launch kernel_name on grid, on CUDA from the tensors' device (CPU tensors: only in the
    interpreter, see fused.unsupported_reason)."""
    fn = kernel(kernel_name)
    if device.type == "cuda":
        with torch.cuda.device(device):  # triton launches on the current device
            fn[grid](*args, **constexprs)
    else:
        fn[grid](*args, **constexprs)


def _cdiv(a, b):
    return -(-a // b)


def _power_of_two_at_least(n):
    return 1 << max(n - 1, 0).bit_length()


def _dot_operands(bf16_operands):
    """How the projection GEMMs multiply: "fp32", "bf16" (tensor cores), or "bf16_rounded":
    operands rounded to bf16 and multiplied in fp32, the same exact products, for Triton's
    interpreter, whose tl.dot multiplies bf16 tiles as their raw 16-bit patterns and whose bf16
    casts truncate."""
    if not bf16_operands:
        return "fp32"
    return "bf16_rounded" if _interpreted() else "bf16"


def _weight_operand(weight, bf16_operands):
    """The projection weight as the kernels' GEMMs read it: cast to bf16 once here, not by every
    program, when they take bf16 operands (it rounds as the kernels' own cast would)."""
    return (weight.to(torch.bfloat16) if bf16_operands else weight).contiguous()


def _variant_constexprs(variant, weight, bf16_operands, sinkhorn_iters):
    res = 0 if variant == "hc" else weight.shape[0] - 2 * STREAMS
    return dict(VARIANT=variant, RES=res, ITERS=sinkhorn_iters, OPERANDS=_dot_operands(bf16_operands),
                RES_BLOCK=max(16, _power_of_two_at_least(res)))


# ----------------------------------------------------------------------------------------------
# The ops. Each backward formula calls a backward op, never a kernel directly, so that AOT
# autograd (torch.compile) can trace the backward with fake tensors.


def _pre_outputs(x, weight, variant):
    """Empty (u, h_pre, h_post, h_res, z, rms_inv, next_grad) for connection_pre."""
    tokens, n, c = x.shape
    f32 = dict(dtype=torch.float32)
    if variant == "hc":
        z, rms_inv = x.new_empty((tokens, n, n + 2), **f32), x.new_empty((tokens, n), **f32)
    else:
        z, rms_inv = x.new_empty((tokens, weight.shape[0]), **f32), x.new_empty((tokens,), **f32)
    next_grad = x.new_zeros(()).expand(tokens, n, c)  # no storage: a gradient's way in (module docstring)
    return (x.new_empty((tokens, c), **f32), x.new_empty((tokens, n), **f32), x.new_empty((tokens, n), **f32),
            x.new_empty((tokens, n, n), **f32), z, rms_inv, next_grad)


@torch.library.custom_op("hcfused::connection_pre", mutates_args=())
def connection_pre(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                   perm_matrices: torch.Tensor, variant: str, sinkhorn_iters: int, bf16_operands: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    """For x (M, n, C) float32 or bfloat16 and the packed parameters (fused.packed_parameters), fp32:
    u (M, C), h_pre (M, n), h_post (M, n), h_res (M, n, n), z and rms_inv (the projection before
    the RMS factor and the factor, kept for the backward), and next_grad, a zero-storage tensor of
    x's shape whose gradient is the gradient of connection_post's output."""
    x = x.contiguous()
    outputs = _pre_outputs(x, weight, variant)
    u, h_pre, h_post, h_res, z, rms_inv, _ = outputs
    tokens = x.shape[0]
    if tokens > 0:
        perms = perm_matrices.contiguous() if perm_matrices.numel() else weight  # read only by mhclite
        tile = dict(TILES["pre_kernel"])
        if x.shape[2] % 16:
            tile["BLOCK_C"] = min(tile["BLOCK_C"], UNALIGNED_PRE_BLOCK_C)
        if variant == "hc":
            tile["BLOCK_T"] = min(tile["BLOCK_T"], HC_PRE_BLOCK_T)
        if variant == "mhc":
            tile["BLOCK_C"] = min(tile["BLOCK_C"], MHC_PRE_BLOCK_C)
        if not bf16_operands:
            tile["BLOCK_C"] = min(tile["BLOCK_C"], FP32_OPERANDS_PRE_BLOCK_C)
        if x.shape[2] % 16 or not bf16_operands:
            tile["num_warps"] = max(tile["num_warps"], SPILL_PRONE_PRE_NUM_WARPS)
        _launch("pre_kernel", (_cdiv(tokens, tile["BLOCK_T"]),), x.device, x, _weight_operand(weight, bf16_operands),
                scale, bias, perms, u, h_pre, h_post, h_res, z, rms_inv, tokens, x.shape[2], RMS_EPS, **tile,
                **_variant_constexprs(variant, weight, bf16_operands, sinkhorn_iters))
    return outputs


@connection_pre.register_fake
def _(x, weight, scale, bias, perm_matrices, variant, sinkhorn_iters, bf16_operands):
    return _pre_outputs(x, weight, variant)


@torch.library.custom_op("hcfused::connection_pre_backward", mutates_args=())
def connection_pre_backward(x: torch.Tensor, grad: torch.Tensor, grad_u: torch.Tensor, grad_h_post: torch.Tensor,
                            weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                            perm_matrices: torch.Tensor, z: torch.Tensor, rms_inv: torch.Tensor, variant: str,
                            sinkhorn_iters: int, bf16_operands: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x in x's dtype, grad weight, grad scale, grad bias) of the connection, from the
    gradient g of its output (grad), grad u and grad h_post (connection_post_backward): the grad-x
    kernel per token block, then the grad-W kernel per channel block and token split; grad W, grad
    scale and grad bias are sums of partials in a fixed order, the same bits on every run."""
    x, grad, grad_u, grad_h_post = (t.contiguous() for t in (x, grad, grad_u, grad_h_post))
    tokens, n, c = x.shape
    grad_x = torch.empty_like(x)
    grad_x_tile, weight_tile = dict(TILES["pre_backward_grad_x_kernel"]), dict(TILES["pre_backward_weight_kernel"])
    if c % 16:
        for tile in (grad_x_tile, weight_tile):
            tile["BLOCK_C"] = min(tile["BLOCK_C"], UNALIGNED_BACKWARD_BLOCK_C)
        grad_x_tile.update(UNALIGNED_GRAD_X_TILE)
    if not bf16_operands:
        grad_x_tile["BLOCK_C"] = min(grad_x_tile["BLOCK_C"], FP32_OPERANDS_GRAD_X_BLOCK_C)
        weight_tile["BLOCK_T"] = min(weight_tile["BLOCK_T"], FP32_OPERANDS_WEIGHT_BLOCK_T)
    blocks = _cdiv(tokens, grad_x_tile["BLOCK_T"])
    splits = min(WEIGHT_GRAD_SPLITS, _cdiv(tokens, weight_tile["BLOCK_T"]))
    # Every grad-x program and every grad-W program (splits <= token blocks) writes its whole slice: no zero fill.
    grad_weight = weight.new_empty((splits, *weight.shape))
    grad_scale = scale.new_empty((blocks, scale.numel()))
    grad_bias = bias.new_empty((blocks, bias.numel()))
    if tokens > 0:
        perms = perm_matrices.contiguous() if perm_matrices.numel() else weight
        grad_z = torch.empty_like(z)
        constexprs = _variant_constexprs(variant, weight, bf16_operands, sinkhorn_iters)
        _launch("pre_backward_grad_x_kernel", (blocks,), x.device, x, grad, grad_u, grad_h_post,
                _weight_operand(weight, bf16_operands), scale, bias, perms, z, rms_inv, grad_z, grad_x, grad_scale,
                grad_bias, tokens, c, **grad_x_tile, **constexprs)
        # The grad-W kernel takes all of mhc's and mhclite's logits as one tile.
        _launch("pre_backward_weight_kernel", (_cdiv(c, weight_tile["BLOCK_C"]), splits), x.device, x, grad_z,
                grad_weight, tokens, c, **weight_tile, VARIANT=variant, RES=constexprs["RES"],
                OPERANDS=constexprs["OPERANDS"], LOGITS_BLOCK=max(16, _power_of_two_at_least(weight.shape[0])))
    return grad_x, grad_weight.sum(0), grad_scale.sum(0).view(scale.shape), grad_bias.sum(0).view(bias.shape)


@connection_pre_backward.register_fake
def _(x, grad, grad_u, grad_h_post, weight, scale, bias, perm_matrices, z, rms_inv, variant, sinkhorn_iters,
      bf16_operands):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(scale), torch.empty_like(bias))


def _connection_pre_setup_context(ctx, inputs, output):
    x, weight, scale, bias, perm_matrices, variant, sinkhorn_iters, bf16_operands = inputs
    _, h_pre, _, h_res, z, rms_inv, _ = output
    ctx.variant, ctx.sinkhorn_iters, ctx.bf16_operands = variant, sinkhorn_iters, bf16_operands
    ctx.save_for_backward(x, weight, scale, bias, perm_matrices, z, rms_inv)
    # h_res reaches the loss only through connection_post, whose backward leaves its gradient
    # to connection_pre's backward (from next_grad's); h_pre only through u.
    ctx.mark_non_differentiable(h_pre, h_res, z, rms_inv)
    ctx.set_materialize_grads(False)


def _connection_pre_backward(ctx, grad_u, grad_h_pre, grad_h_post, grad_h_res, grad_z, grad_rms_inv, grad_next):
    x, weight, scale, bias, perm_matrices, z, rms_inv = ctx.saved_tensors
    tokens, n, c = x.shape
    grad_next = torch.zeros_like(x) if grad_next is None else grad_next
    grad_u = x.new_zeros((tokens, c), dtype=torch.float32) if grad_u is None else grad_u
    grad_h_post = x.new_zeros((tokens, n), dtype=torch.float32) if grad_h_post is None else grad_h_post
    grads = connection_pre_backward(x, grad_next, grad_u, grad_h_post, weight, scale, bias, perm_matrices, z,
                                    rms_inv, ctx.variant, ctx.sinkhorn_iters, ctx.bf16_operands)
    return *grads, None, None, None, None


connection_pre.register_autograd(_connection_pre_backward, setup_context=_connection_pre_setup_context)


@torch.library.custom_op("hcfused::connection_post", mutates_args=())
def connection_post(x: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor, y: torch.Tensor,
                    next_grad: torch.Tensor) -> torch.Tensor:
    """sum_j h_res[i, j] x[j] + h_post[i] y in fp32, stored in x's dtype: x (M, n, C), h_post (M, n)
    and h_res (M, n, n) fp32, y (M, C) in any float dtype; next_grad from connection_pre."""
    x, h_post, h_res, y = x.contiguous(), h_post.contiguous(), h_res.contiguous(), y.contiguous()
    tokens, n, c = x.shape
    out = torch.empty_like(x)
    if tokens > 0 and c > 0:
        tile = TILES["post_kernel"]
        _launch("post_kernel", (_cdiv(tokens, tile["BLOCK_T"]), _cdiv(c, tile["BLOCK_C"])), x.device,
                x, h_post, h_res, y, out, tokens, c, **tile)
    return out


@connection_post.register_fake
def _(x, h_post, h_res, y, next_grad):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("hcfused::connection_post_backward", mutates_args=())
def connection_post_backward(grad: torch.Tensor, h_post: torch.Tensor,
                             y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad y in y's dtype, grad h_post) of connection_post, one pass over grad and y."""
    grad, h_post, y = grad.contiguous(), h_post.contiguous(), y.contiguous()
    tokens, n, c = grad.shape
    grad_y = torch.empty_like(y)
    grad_h_post = torch.empty_like(h_post)
    if tokens > 0:
        tile = TILES["post_backward_kernel"]
        _launch("post_backward_kernel", (_cdiv(tokens, tile["BLOCK_T"]),), grad.device, grad, h_post, y, grad_y,
                grad_h_post, tokens, c, **tile)
    return grad_y, grad_h_post


@connection_post_backward.register_fake
def _(grad, h_post, y):
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            torch.empty_like(h_post, memory_format=torch.contiguous_format))


def _connection_post_setup_context(ctx, inputs, output):
    _, h_post, _, y, _ = inputs
    ctx.save_for_backward(h_post, y)


def _connection_post_backward(ctx, grad):
    h_post, y = ctx.saved_tensors
    grad_y, grad_h_post = connection_post_backward(grad, h_post, y)
    # x's and h_res's gradients are made by connection_pre's backward, which gets grad as next_grad's.
    return None, grad_h_post, None, grad_y, grad


connection_post.register_autograd(_connection_post_backward, setup_context=_connection_post_setup_context)
