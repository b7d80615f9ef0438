"""Triton kernels of the fused HC-family connections (n = 4 streams); ops.py launches them.

One connection, per token (x: n streams of width C, s bytes per stream element, s_y per branch
output element; VARIANT is "hc", "mhc" or "mhclite"):

    pre            x -> u, h_pre, h_post, h_res, z, rms_inv   RMS factor, projection GEMM, coefficient math, u
    (branch)       y = f(u)
    post           x, h_res, h_post, y -> x_next              x_next[i] = sum_j h_res[i, j] x[j] + h_post[i] y
    post_backward  g = grad x_next, y -> grad y, grad h_post  before the branch's backward
    pre_backward_grad_x  x, g, grad u, grad h_post ->        after it, per token block: coefficient grads,
                   grad x, grad z, and the block's grad       the coefficient-math backward in registers,
                   scale and grad bias                        then grad x from a re-read of the block
    pre_backward_weight  x, grad z -> the split's partial     per channel block and token split: grad W's
                   of grad W                                  slice summed on chip

Coefficient layouts (fp32, per token): h_pre (n), h_post (n), h_res (n, n) with x_next[i] =
sum_j h_res[i, j] x[j]. z is the projection before the RMS factor, rms_inv the RMS factor; with
them the backward recomputes every coefficient, so nothing n x C wide is saved besides x.
Projection logits: mhc and mhclite project a token's n*C entries onto [pre (n) | post (n) | res
(RES)] (the weight's rows); hc projects each stream's C entries onto [alpha (n + 1) | beta (1)].
The per-logit affine parameters come packed: mhc/mhclite scale[k], bias[k] for every logit k;
hc scale[k] and bias[i, k] = [static_alpha | static_beta][i, k].

Interpreter notes (TRITON_INTERPRET=1, tests on CPU): tl.dot of bf16 tiles multiplies their raw
bit patterns and fp32 -> bf16 casts truncate (triton 3.9), hence OPERANDS = "bf16_rounded".
"""

import triton
import triton.language as tl

STREAMS: tl.constexpr = tl.constexpr(4)
PAIR_LOGITS: tl.constexpr = tl.constexpr(16)  # mhc/mhclite pre and post logits (2n = 8), padded for tl.dot
HC_LOGITS: tl.constexpr = tl.constexpr(16)  # hc logits per stream (n + 2 = 6), padded for tl.dot


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32; by its bits, because the
    interpreter's fp32 -> bf16 conversion truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dot_accumulate(a, b, acc, OPERANDS: tl.constexpr):
    """acc + a @ b in fp32: operands "bf16" (tensor cores), "bf16_rounded" (the same exact products
    in fp32, for the interpreter) or "fp32" (never TF32); a and b fp32, or bf16 unless "fp32"."""
    if OPERANDS == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif OPERANDS == "bf16_rounded":
        out = tl.dot(round_to_bf16(a.to(tl.float32)), round_to_bf16(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision="ieee")
    return out


@triton.jit
def tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def columns(a, first):
    """a[..., first:first + n] of a (T, K) tile, as (T, n)."""
    k = tl.arange(0, a.shape[1])
    stream = tl.arange(0, STREAMS)
    pick = (k[None, None, :] == first + stream[None, :, None]).to(tl.float32)
    return tl.sum(a[:, None, :] * pick, axis=2)


@triton.jit
def to_columns(a, first, K: tl.constexpr):
    """The (T, n) tile a placed at columns first..first + n of a zero (T, K) tile."""
    k = tl.arange(0, K)
    stream = tl.arange(0, STREAMS)
    pick = (k[None, None, :] == first + stream[None, :, None]).to(tl.float32)
    return tl.sum(a[:, :, None] * pick, axis=1)


@triton.jit
def hc_columns(a, first):
    """a[t, i, first + j] of an hc coefficient tile (T, n, K), as (T, n, n) indexed [t, i, j]."""
    k = tl.arange(0, a.shape[2])
    stream = tl.arange(0, STREAMS)
    pick = (k[None, None, None, :] == first + stream[None, None, :, None]).to(tl.float32)
    return tl.sum(a[:, :, None, :] * pick, axis=3)


@triton.jit
def hc_to_columns(a, first, K: tl.constexpr):
    """The (T, n, n) tile a[t, i, j] placed at [t, i, first + j] of a zero (T, n, K) tile."""
    k = tl.arange(0, K)
    stream = tl.arange(0, STREAMS)
    pick = (k[None, None, None, :] == first + stream[None, None, :, None]).to(tl.float32)
    return tl.sum(a[:, :, :, None] * pick, axis=2)


# ----------------------------------------------------------------------------------------------
# Coefficient math (registers, fp32)


@triton.jit
def sinkhorn_step(log_p):
    """One Sinkhorn-Knopp iteration in log space on (T, n, n): columns to sum 1, then rows."""
    top = tl.max(log_p, axis=1)
    log_p = log_p - (top + tl.log(tl.sum(tl.exp(log_p - top[:, None, :]), axis=1)))[:, None, :]
    top = tl.max(log_p, axis=2)
    return log_p - (top + tl.log(tl.sum(tl.exp(log_p - top[:, :, None]), axis=2)))[:, :, None]


@triton.jit
def sinkhorn_steps(log_p, count):
    for _ in range(count):
        log_p = sinkhorn_step(log_p)
    return log_p


@triton.jit
def sinkhorn_backward(logits, grad_h, ITERS: tl.constexpr):
    """grad logits of h = exp(sinkhorn_steps(logits, ITERS)). The iterations are recomputed from
    four checkpoints kept in registers (iterations 0, S, 2S, 3S with S = ITERS // 4), so each
    backward step recomputes fewer than S + 3 of them: nothing per iteration is stored."""
    SEGMENT: tl.constexpr = ITERS // 4  # ITERS >= 4 (fused.unsupported_reason)
    start1 = sinkhorn_steps(logits, SEGMENT)
    start2 = sinkhorn_steps(start1, SEGMENT)
    start3 = sinkhorn_steps(start2, SEGMENT)
    grad = grad_h * tl.exp(sinkhorn_steps(start3, ITERS - 3 * SEGMENT))
    for back in range(ITERS):
        step = ITERS - 1 - back
        segment = tl.minimum(step // SEGMENT, 3)
        log_p = tl.where(segment == 0, logits, tl.where(segment == 1, start1, tl.where(segment == 2, start2, start3)))
        log_p = sinkhorn_steps(log_p, step - segment * SEGMENT)
        top = tl.max(log_p, axis=1)
        by_column = log_p - (top + tl.log(tl.sum(tl.exp(log_p - top[:, None, :]), axis=1)))[:, None, :]
        top = tl.max(by_column, axis=2)
        by_row = by_column - (top + tl.log(tl.sum(tl.exp(by_column - top[:, :, None]), axis=2)))[:, :, None]
        # Through l - logsumexp(l) along an axis: g - softmax(l) * sum(g) along it.
        grad = grad - tl.exp(by_row) * tl.sum(grad, axis=2)[:, :, None]
        grad = grad - tl.exp(by_column) * tl.sum(grad, axis=1)[:, None, :]
    return grad


@triton.jit
def manifold_coefficients(z_pair, z_res, rms_inv, scale_ptr, bias_ptr, perm_ptr,
                          VARIANT: tl.constexpr, RES: tl.constexpr, ITERS: tl.constexpr):
    """mhc / mhclite: (h_pre, h_post, h_res, sigmoids, res weights) from the projection (z_pair,
    z_res) and the RMS factor. res weights: mhclite's softmax over the permutations, mhc's logits."""
    pair = tl.arange(0, z_pair.shape[1])
    res = tl.arange(0, z_res.shape[1])
    pair_ok = pair < 2 * STREAMS
    res_ok = res < RES
    scale_pair = tl.load(scale_ptr + pair, mask=pair_ok, other=0.0)
    bias_pair = tl.load(bias_ptr + pair, mask=pair_ok, other=0.0)
    sig = tl.sigmoid(scale_pair[None, :] * (z_pair * rms_inv[:, None]) + bias_pair[None, :])
    h_pre = columns(sig, 0)
    h_post = 2 * columns(sig, STREAMS)
    scale_res = tl.load(scale_ptr + 2 * STREAMS + res, mask=res_ok, other=0.0)
    bias_res = tl.load(bias_ptr + 2 * STREAMS + res, mask=res_ok, other=0.0)
    logits = scale_res[None, :] * (z_res * rms_inv[:, None]) + bias_res[None, :]
    if VARIANT == "mhc":
        res_weights = logits
        h_res = tl.exp(sinkhorn_steps(tl.reshape(logits, (logits.shape[0], STREAMS, STREAMS)), ITERS))
    else:
        logits = tl.where(res_ok[None, :], logits, float("-inf"))
        weights = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        res_weights = weights / tl.sum(weights, axis=1)[:, None]
        # Exact 0/1 products and fp32 sums: h_res is doubly stochastic to fp32 rounding.
        perms = tl.load(perm_ptr + res[:, None] * (STREAMS * STREAMS) + tl.arange(0, STREAMS * STREAMS)[None, :],
                        mask=res_ok[:, None], other=0.0)
        h_res = tl.reshape(tl.dot(res_weights, perms, input_precision="ieee"), (logits.shape[0], STREAMS, STREAMS))
    return h_pre, h_post, h_res, sig, res_weights


@triton.jit
def hc_coefficients(z, rms_inv, scale_ptr, bias_ptr):
    """hc: (h_pre, h_post, h_res, tanh) from z (T, n, K) and rms_inv (T, n): per stream i,
    A[i] = bias[i] + scale * tanh(z[i] * rms_inv[i]); h_pre = A[:, 0], h_res[i, j] = A[j, 1 + i],
    h_post = A[:, n + 1]."""
    k = tl.arange(0, z.shape[2])
    stream = tl.arange(0, STREAMS)
    k_ok = k < STREAMS + 2
    scale = tl.load(scale_ptr + k, mask=k_ok, other=0.0)
    bias = tl.load(bias_ptr + stream[:, None] * (STREAMS + 2) + k[None, :], mask=k_ok[None, :], other=0.0)
    t = tanh(z * rms_inv[:, :, None])
    a = bias[None, :, :] + scale[None, None, :] * t
    h_pre = tl.sum(tl.where(k[None, None, :] == 0, a, 0.0), axis=2)
    h_post = tl.sum(tl.where(k[None, None, :] == STREAMS + 1, a, 0.0), axis=2)
    h_res = tl.permute(hc_columns(a, 1), (0, 2, 1))
    return h_pre, h_post, h_res, t


# ----------------------------------------------------------------------------------------------
# Forward


@triton.jit
def pre_kernel(x_ptr, weight_ptr, scale_ptr, bias_ptr, perm_ptr, u_ptr, h_pre_ptr, h_post_ptr, h_res_ptr,
               z_ptr, rms_inv_ptr, T, C, eps, VARIANT: tl.constexpr, RES: tl.constexpr, ITERS: tl.constexpr,
               OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, RES_BLOCK: tl.constexpr,
               STAGES: tl.constexpr):
    """BLOCK_T tokens: projection and RMS factor from one read of x, the coefficients in registers,
    then u from a re-read of the same tile, few enough tokens that the re-read comes from L2 with
    every program resident at once. The weight (bf16 when the GEMM takes bf16 operands, cast once
    by the caller) is read by every program, so L2 holds it once for all.
    Per token: reads x (nCs); writes u (4C), the coefficients, z and rms_inv (O(n^2) floats)."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < T
    stream = tl.arange(0, STREAMS)
    if VARIANT == "hc":
        row = tl.program_id(0) * BLOCK_T * STREAMS + tl.arange(0, BLOCK_T * STREAMS)  # (token, stream) rows
        row_ok = row < T * STREAMS
        k = tl.arange(0, HC_LOGITS)
        k_ok = k < STREAMS + 2
        z = tl.zeros((BLOCK_T * STREAMS, HC_LOGITS), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_T * STREAMS,), dtype=tl.float32)
        for start in range(0, C, BLOCK_C):
            channel = start + tl.arange(0, BLOCK_C)
            channel_ok = channel < C
            rows = tl.load(x_ptr + row.to(tl.int64)[:, None] * C + channel[None, :],
                           mask=row_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
            weight_t = tl.load(weight_ptr + k[None, :] * C + channel[:, None],
                               mask=k_ok[None, :] & channel_ok[:, None], other=0.0)
            sum_sq += tl.sum(rows * rows, axis=1)
            z = dot_accumulate(rows, weight_t, z, OPERANDS)
        rms_inv = tl.rsqrt(sum_sq / C + eps)
        tl.store(z_ptr + row[:, None] * (STREAMS + 2) + k[None, :], z, mask=row_ok[:, None] & k_ok[None, :])
        tl.store(rms_inv_ptr + row, rms_inv, mask=row_ok)
        h_pre, h_post, h_res, _ = hc_coefficients(tl.reshape(z, (BLOCK_T, STREAMS, HC_LOGITS)),
                                                  tl.reshape(rms_inv, (BLOCK_T, STREAMS)), scale_ptr, bias_ptr)
    else:
        depth_in_block = tl.arange(0, STREAMS * BLOCK_C)  # (stream, channel) within a channel block
        block_stream = depth_in_block // BLOCK_C
        block_channel = depth_in_block % BLOCK_C
        pair = tl.arange(0, PAIR_LOGITS)
        res = tl.arange(0, RES_BLOCK)
        pair_ok = pair < 2 * STREAMS
        res_ok = res < RES
        D = STREAMS * C
        base = token.to(tl.int64) * D
        z_pair = tl.zeros((BLOCK_T, PAIR_LOGITS), dtype=tl.float32)
        z_res = tl.zeros((BLOCK_T, RES_BLOCK), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for start in range(0, C, BLOCK_C):
            channel = start + block_channel
            channel_ok = channel < C
            depth = block_stream * C + channel
            rows = tl.load(x_ptr + base[:, None] + depth[None, :], mask=token_ok[:, None] & channel_ok[None, :],
                           other=0.0).to(tl.float32)
            weight_pair = tl.load(weight_ptr + pair[None, :] * D + depth[:, None],
                                  mask=pair_ok[None, :] & channel_ok[:, None], other=0.0)
            weight_res = tl.load(weight_ptr + (2 * STREAMS + res[None, :]) * D + depth[:, None],
                                 mask=res_ok[None, :] & channel_ok[:, None], other=0.0)
            sum_sq += tl.sum(rows * rows, axis=1)
            z_pair = dot_accumulate(rows, weight_pair, z_pair, OPERANDS)
            z_res = dot_accumulate(rows, weight_res, z_res, OPERANDS)
        rms_inv = tl.rsqrt(sum_sq / D + eps)
        logits = 2 * STREAMS + RES
        tl.store(z_ptr + token[:, None] * logits + pair[None, :], z_pair, mask=token_ok[:, None] & pair_ok[None, :])
        tl.store(z_ptr + token[:, None] * logits + 2 * STREAMS + res[None, :], z_res,
                 mask=token_ok[:, None] & res_ok[None, :])
        tl.store(rms_inv_ptr + token, rms_inv, mask=token_ok)
        h_pre, h_post, h_res, _, _ = manifold_coefficients(z_pair, z_res, rms_inv, scale_ptr, bias_ptr, perm_ptr,
                                                           VARIANT, RES, ITERS)
    coef = token[:, None] * STREAMS + stream[None, :]
    coef_ok = token_ok[:, None]
    tl.store(h_pre_ptr + coef, h_pre, mask=coef_ok)
    tl.store(h_post_ptr + coef, h_post, mask=coef_ok)
    pair_index = stream[:, None] * STREAMS + stream[None, :]
    tl.store(h_res_ptr + token[:, None, None] * (STREAMS * STREAMS) + pair_index[None, :, :], h_res,
             mask=token_ok[:, None, None])
    # u = sum_j h_pre[j] x[j], from a re-read of the tile just projected, last channels first: the
    # ones L2 most likely still holds.
    base = token.to(tl.int64) * (STREAMS * C)
    blocks = tl.cdiv(C, BLOCK_C)
    for step in tl.range(0, blocks, num_stages=STAGES):
        channel = (blocks - 1 - step) * BLOCK_C + tl.arange(0, BLOCK_C)
        channel_ok = channel < C
        x = tl.load(x_ptr + base[:, None, None] + stream[None, :, None] * C + channel[None, None, :],
                    mask=token_ok[:, None, None] & channel_ok[None, None, :], other=0.0).to(tl.float32)
        u = tl.sum(h_pre[:, :, None] * x, axis=1)
        tl.store(u_ptr + token[:, None] * C + channel[None, :], u, mask=token_ok[:, None] & channel_ok[None, :])


@triton.jit
def post_kernel(x_ptr, h_post_ptr, h_res_ptr, y_ptr, out_ptr, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """x_next[i] = sum_j h_res[i, j] x[j] + h_post[i] y, in fp32, stored in out's dtype.
    Per token: reads x (nCs), y (s_y C) and h_post, h_res (O(n^2) floats); writes x_next (nCs)."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < T
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channel < C
    stream = tl.arange(0, STREAMS)
    tile = token.to(tl.int64)[:, None, None] * (STREAMS * C) + stream[None, :, None] * C + channel[None, None, :]
    tile_ok = token_ok[:, None, None] & channel_ok[None, None, :]
    x = tl.load(x_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + token.to(tl.int64)[:, None] * C + channel[None, :],
                mask=token_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
    h_post = tl.load(h_post_ptr + token[:, None] * STREAMS + stream[None, :], mask=token_ok[:, None], other=0.0)
    pair_index = stream[:, None] * STREAMS + stream[None, :]
    h_res = tl.load(h_res_ptr + token[:, None, None] * (STREAMS * STREAMS) + pair_index[None, :, :],
                    mask=token_ok[:, None, None], other=0.0)
    out = tl.sum(h_res[:, :, :, None] * x[:, None, :, :], axis=2) + h_post[:, :, None] * y[:, None, :]
    tl.store(out_ptr + tile, out.to(out_ptr.dtype.element_ty), mask=tile_ok)


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
def post_backward_kernel(grad_ptr, h_post_ptr, y_ptr, grad_y_ptr, grad_h_post_ptr, T, C,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Before the branch's backward: grad y = sum_i h_post[i] g[i] (in y's dtype) and
    grad h_post[i] = <g[i], y>.
    Per token: reads g (nCs), y (s_y C) and h_post (n floats); writes grad y (s_y C) and grad h_post (n floats)."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < T
    stream = tl.arange(0, STREAMS)
    h_post = tl.load(h_post_ptr + token[:, None] * STREAMS + stream[None, :], mask=token_ok[:, None], other=0.0)
    grad_h_post = tl.zeros((BLOCK_T, STREAMS), dtype=tl.float32)
    for start in range(0, C, BLOCK_C):
        channel = start + tl.arange(0, BLOCK_C)
        channel_ok = channel < C
        tile = token.to(tl.int64)[:, None, None] * (STREAMS * C) + stream[None, :, None] * C + channel[None, None, :]
        grad = tl.load(grad_ptr + tile, mask=token_ok[:, None, None] & channel_ok[None, None, :],
                       other=0.0).to(tl.float32)
        vector = token.to(tl.int64)[:, None] * C + channel[None, :]
        vector_ok = token_ok[:, None] & channel_ok[None, :]
        y = tl.load(y_ptr + vector, mask=vector_ok, other=0.0).to(tl.float32)
        grad_h_post += tl.sum(grad * y[:, None, :], axis=2)
        grad_y = tl.sum(h_post[:, :, None] * grad, axis=1)
        tl.store(grad_y_ptr + vector, grad_y.to(grad_y_ptr.dtype.element_ty), mask=vector_ok)
    tl.store(grad_h_post_ptr + token[:, None] * STREAMS + stream[None, :], grad_h_post, mask=token_ok[:, None])


@triton.jit
def mixing_grads(x_ptr, grad_ptr, grad_u_ptr, token, token_ok, C, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """(grad h_pre, grad h_res) of the mixing: <grad u, x[j]> and <g[i], x[j]> over all channels."""
    stream = tl.arange(0, STREAMS)
    base = token.to(tl.int64) * (STREAMS * C)
    grad_h_pre = tl.zeros((token.shape[0], STREAMS), dtype=tl.float32)
    grad_h_res = tl.zeros((token.shape[0], STREAMS, STREAMS), dtype=tl.float32)
    for start in tl.range(0, C, BLOCK_C, num_stages=STAGES):
        channel = start + tl.arange(0, BLOCK_C)
        channel_ok = channel < C
        tile = base[:, None, None] + stream[None, :, None] * C + channel[None, None, :]
        tile_ok = token_ok[:, None, None] & channel_ok[None, None, :]
        x = tl.load(x_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        grad_u = tl.load(grad_u_ptr + token.to(tl.int64)[:, None] * C + channel[None, :],
                         mask=token_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
        grad_h_pre += tl.sum(x * grad_u[:, None, :], axis=2)
        for i in tl.static_range(STREAMS):  # stream by stream: (T, n, BLOCK_C) tiles, not (T, n, n, BLOCK_C)
            grad_i = tl.sum(tl.where(stream[None, :, None] == i, grad, 0.0), axis=1)  # g[:, i, :]
            grad_h_res += tl.where(stream[None, :, None] == i, tl.sum(grad_i[:, None, :] * x, axis=2)[:, None, :], 0.0)
    return grad_h_pre, grad_h_res


@triton.jit
def grad_x_terms(h_pre, h_res, row_term, grad, grad_u, x):
    """grad x[j] but the projection's term, for (T, n, BLOCK_C) tiles of g and x: h_pre[j] grad u +
    sum_i h_res[i, j] g[i] + r[j] x[j], with r the RMS factor's row term (T, n)."""
    stream = tl.arange(0, STREAMS)
    out = h_pre[:, :, None] * grad_u[:, None, :] + row_term[:, :, None] * x
    for i in tl.static_range(STREAMS):  # stream by stream: (T, n, BLOCK_C) tiles, not (T, n, n, BLOCK_C)
        grad_i = tl.sum(tl.where(stream[None, :, None] == i, grad, 0.0), axis=1)  # g[:, i, :]
        h_res_i = tl.sum(tl.where(stream[None, :, None] == i, h_res, 0.0), axis=1)  # h_res[:, i, :]
        out += h_res_i[:, :, None] * grad_i[:, None, :]
    return out


@triton.jit
def stream_channel_block(start, C, BLOCK_C: tl.constexpr):
    """The n * BLOCK_C columns (stream, channel) of a block of channels start.. of mhc's and mhclite's
    rows of n * C: each column's offset in a row and whether its channel exists."""
    depth_in_block = tl.arange(0, STREAMS * BLOCK_C)
    channel = start + depth_in_block % BLOCK_C
    return (depth_in_block // BLOCK_C) * C + channel, channel < C


@triton.jit
def pre_backward_grad_x_kernel(x_ptr, grad_ptr, grad_u_ptr, grad_h_post_ptr, weight_ptr, scale_ptr, bias_ptr,
                               perm_ptr, z_ptr, rms_inv_ptr, grad_z_ptr, grad_x_ptr, grad_scale_ptr, grad_bias_ptr,
                               T, C, VARIANT: tl.constexpr, RES: tl.constexpr, ITERS: tl.constexpr,
                               OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                               RES_BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """After the branch's backward, one program per BLOCK_T tokens, two passes over their channels.
    The first reduces the mixing's coefficient grads over the channels; then the coefficient math
    runs backward in registers (the coefficients recomputed from z and rms_inv) to the projection's
    gradient grad z (before the RMS factor, stored for the grad-W kernel) and the token block's
    grad scale and grad bias. The second writes grad x = h_pre grad u + h_res^T g + row term x +
    grad z W from a re-read of the same tiles, last channels first, so that the tiles read last in
    the first pass are re-read while L2 still holds them. The weight (bf16 when the GEMM takes bf16
    operands, cast once by the caller) is read by every program, so L2 holds it once for all.
    Per token: reads x and g (2 nCs) and grad u (4C) twice, the first time from DRAM; writes grad x
    (nCs) and O(n^2) floats."""
    program = tl.program_id(0)
    stream = tl.arange(0, STREAMS)
    token = program * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < T
    grad_h_pre, grad_h_res = mixing_grads(x_ptr, grad_ptr, grad_u_ptr, token, token_ok, C, BLOCK_C, STAGES)
    grad_h_post = tl.load(grad_h_post_ptr + token[:, None] * STREAMS + stream[None, :], mask=token_ok[:, None],
                          other=0.0)
    if VARIANT == "hc":
        k = tl.arange(0, HC_LOGITS)
        k_ok = k < STREAMS + 2
        scale = tl.load(scale_ptr + k, mask=k_ok, other=0.0)
        row = program * BLOCK_T * STREAMS + tl.arange(0, BLOCK_T * STREAMS)
        row_ok = row < T * STREAMS
        z = tl.load(z_ptr + row[:, None] * (STREAMS + 2) + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        rms_inv = tl.load(rms_inv_ptr + row, mask=row_ok, other=0.0)
        z3 = tl.reshape(z, (BLOCK_T, STREAMS, HC_LOGITS))
        rms_inv3 = tl.reshape(rms_inv, (BLOCK_T, STREAMS))
        h_pre, _, h_res, t = hc_coefficients(z3, rms_inv3, scale_ptr, bias_ptr)
        kk = k[None, None, :]
        grad_a = (tl.where(kk == 0, grad_h_pre[:, :, None], 0.0)
                  + tl.where(kk == STREAMS + 1, grad_h_post[:, :, None], 0.0)
                  + hc_to_columns(tl.permute(grad_h_res, (0, 2, 1)), 1, HC_LOGITS))
        tl.store(grad_scale_ptr + program * (STREAMS + 2) + k, tl.sum(tl.sum(grad_a * t, axis=1), axis=0), mask=k_ok)
        tl.store(grad_bias_ptr + program * STREAMS * (STREAMS + 2) + stream[:, None] * (STREAMS + 2) + k[None, :],
                 tl.sum(grad_a, axis=0), mask=k_ok[None, :])
        grad_zr = grad_a * scale[None, None, :] * (1 - t * t)
        row_term = -tl.sum(grad_zr * z3, axis=2) * rms_inv3 * rms_inv3 * rms_inv3 / C
        grad_z = tl.reshape(grad_zr * rms_inv3[:, :, None], (BLOCK_T * STREAMS, HC_LOGITS))
        tl.store(grad_z_ptr + row[:, None] * (STREAMS + 2) + k[None, :], grad_z, mask=row_ok[:, None] & k_ok[None, :])
    else:
        LOGITS: tl.constexpr = 2 * STREAMS + RES
        D = STREAMS * C
        pair = tl.arange(0, PAIR_LOGITS)
        res = tl.arange(0, RES_BLOCK)
        pair_ok = pair < 2 * STREAMS
        res_ok = res < RES
        scale_pair = tl.load(scale_ptr + pair, mask=pair_ok, other=0.0)
        scale_res = tl.load(scale_ptr + 2 * STREAMS + res, mask=res_ok, other=0.0)
        z_pair = tl.load(z_ptr + token[:, None] * LOGITS + pair[None, :], mask=token_ok[:, None] & pair_ok[None, :],
                         other=0.0)
        z_res = tl.load(z_ptr + token[:, None] * LOGITS + 2 * STREAMS + res[None, :],
                        mask=token_ok[:, None] & res_ok[None, :], other=0.0)
        rms_inv = tl.load(rms_inv_ptr + token, mask=token_ok, other=0.0)
        h_pre, _, h_res, sig, res_weights = manifold_coefficients(z_pair, z_res, rms_inv, scale_ptr, bias_ptr,
                                                                  perm_ptr, VARIANT, RES, ITERS)
        grad_sig = to_columns(grad_h_pre, 0, PAIR_LOGITS) + 2 * to_columns(grad_h_post, STREAMS, PAIR_LOGITS)
        grad_pair = grad_sig * sig * (1 - sig)
        if VARIANT == "mhc":
            logits3 = tl.reshape(res_weights, (BLOCK_T, STREAMS, STREAMS))
            grad_res = tl.reshape(sinkhorn_backward(logits3, grad_h_res, ITERS), (BLOCK_T, RES_BLOCK))
        else:
            perms_t = tl.load(perm_ptr + res[None, :] * (STREAMS * STREAMS) + tl.arange(0, STREAMS * STREAMS)[:, None],
                              mask=res_ok[None, :], other=0.0)
            grad_weights = tl.dot(tl.reshape(grad_h_res, (BLOCK_T, STREAMS * STREAMS)), perms_t,
                                  input_precision="ieee")
            grad_res = res_weights * (grad_weights - tl.sum(res_weights * grad_weights, axis=1)[:, None])
        own = program * LOGITS
        tl.store(grad_scale_ptr + own + pair, tl.sum(grad_pair * z_pair * rms_inv[:, None], axis=0), mask=pair_ok)
        tl.store(grad_bias_ptr + own + pair, tl.sum(grad_pair, axis=0), mask=pair_ok)
        tl.store(grad_scale_ptr + own + 2 * STREAMS + res, tl.sum(grad_res * z_res * rms_inv[:, None], axis=0),
                 mask=res_ok)
        tl.store(grad_bias_ptr + own + 2 * STREAMS + res, tl.sum(grad_res, axis=0), mask=res_ok)
        grad_pair = grad_pair * scale_pair[None, :]
        grad_res = grad_res * scale_res[None, :]
        grad_rms = tl.sum(grad_pair * z_pair, axis=1) + tl.sum(grad_res * z_res, axis=1)
        row_term = tl.broadcast_to((-grad_rms * rms_inv * rms_inv * rms_inv / D)[:, None], (BLOCK_T, STREAMS))
        grad_z_pair = grad_pair * rms_inv[:, None]
        grad_z_res = grad_res * rms_inv[:, None]
        tl.store(grad_z_ptr + token[:, None] * LOGITS + pair[None, :], grad_z_pair,
                 mask=token_ok[:, None] & pair_ok[None, :])
        tl.store(grad_z_ptr + token[:, None] * LOGITS + 2 * STREAMS + res[None, :], grad_z_res,
                 mask=token_ok[:, None] & res_ok[None, :])
    base = token.to(tl.int64) * (STREAMS * C)
    blocks = tl.cdiv(C, BLOCK_C)
    for step in tl.range(0, blocks, num_stages=STAGES):
        start = (blocks - 1 - step) * BLOCK_C  # last channels first: the tiles L2 most likely still holds
        channel = start + tl.arange(0, BLOCK_C)
        channel_ok = channel < C
        tile = base[:, None, None] + stream[None, :, None] * C + channel[None, None, :]
        tile_ok = token_ok[:, None, None] & channel_ok[None, None, :]
        x = tl.load(x_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        grad_u = tl.load(grad_u_ptr + token.to(tl.int64)[:, None] * C + channel[None, :],
                         mask=token_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
        terms = grad_x_terms(h_pre, h_res, row_term, grad, grad_u, x)
        if VARIANT == "hc":
            weight = tl.load(weight_ptr + k[:, None] * C + channel[None, :], mask=k_ok[:, None] & channel_ok[None, :],
                             other=0.0)
            grad_rows = dot_accumulate(grad_z, weight, tl.reshape(terms, (BLOCK_T * STREAMS, BLOCK_C)), OPERANDS)
        else:
            depth, depth_ok = stream_channel_block(start, C, BLOCK_C)
            weight_pair = tl.load(weight_ptr + pair[:, None] * D + depth[None, :],
                                  mask=pair_ok[:, None] & depth_ok[None, :], other=0.0)
            weight_res = tl.load(weight_ptr + (2 * STREAMS + res[:, None]) * D + depth[None, :],
                                 mask=res_ok[:, None] & depth_ok[None, :], other=0.0)
            grad_rows = dot_accumulate(grad_z_pair, weight_pair, tl.reshape(terms, (BLOCK_T, STREAMS * BLOCK_C)),
                                       OPERANDS)
            grad_rows = dot_accumulate(grad_z_res, weight_res, grad_rows, OPERANDS)
        tl.store(grad_x_ptr + tile, tl.reshape(grad_rows, (BLOCK_T, STREAMS, BLOCK_C)).to(grad_x_ptr.dtype.element_ty),
                 mask=tile_ok)


@triton.jit
def pre_backward_weight_kernel(x_ptr, grad_z_ptr, grad_weight_ptr, T, C, VARIANT: tl.constexpr, RES: tl.constexpr,
                               OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                               LOGITS_BLOCK: tl.constexpr):
    """grad W = grad z^T x, split over tokens: one program per BLOCK_C channels (of every stream) and
    token split sums grad z^T x over the split's token blocks (every num_programs(1)-th one) on chip
    and stores its slice of the split's weight-sized partial once (the caller sums the splits in a
    fixed order: the same bits on every run).
    Per token: reads x (nCs) and grad z (O(n^2) floats)."""
    channel_block = tl.program_id(0)
    split = tl.program_id(1)
    start = channel_block * BLOCK_C
    if VARIANT == "hc":
        k = tl.arange(0, HC_LOGITS)
        k_ok = k < STREAMS + 2
        channel = start + tl.arange(0, BLOCK_C)
        channel_ok = channel < C
        acc = tl.zeros((HC_LOGITS, BLOCK_C), dtype=tl.float32)
        for block in range(split, tl.cdiv(T, BLOCK_T), tl.num_programs(1)):
            row = block * BLOCK_T * STREAMS + tl.arange(0, BLOCK_T * STREAMS)  # (token, stream) rows
            row_ok = row < T * STREAMS
            grad_z = tl.load(grad_z_ptr + row[:, None] * (STREAMS + 2) + k[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            rows = tl.load(x_ptr + row.to(tl.int64)[:, None] * C + channel[None, :],
                           mask=row_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
            acc = dot_accumulate(tl.trans(grad_z), rows, acc, OPERANDS)
        tl.store(grad_weight_ptr + split.to(tl.int64) * (STREAMS + 2) * C + k[:, None] * C + channel[None, :], acc,
                 mask=k_ok[:, None] & channel_ok[None, :])
    else:
        LOGITS: tl.constexpr = 2 * STREAMS + RES
        D = STREAMS * C
        logit = tl.arange(0, LOGITS_BLOCK)  # every logit at once: [pre | post | res]
        logit_ok = logit < LOGITS
        depth, channel_ok = stream_channel_block(start, C, BLOCK_C)
        acc = tl.zeros((LOGITS_BLOCK, STREAMS * BLOCK_C), dtype=tl.float32)
        for block in range(split, tl.cdiv(T, BLOCK_T), tl.num_programs(1)):
            token = block * BLOCK_T + tl.arange(0, BLOCK_T)
            token_ok = token < T
            grad_z = tl.load(grad_z_ptr + token[:, None] * LOGITS + logit[None, :],
                             mask=token_ok[:, None] & logit_ok[None, :], other=0.0)
            rows = tl.load(x_ptr + token.to(tl.int64)[:, None] * D + depth[None, :],
                           mask=token_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
            acc = dot_accumulate(tl.trans(grad_z), rows, acc, OPERANDS)
        tl.store(grad_weight_ptr + split.to(tl.int64) * LOGITS * D + logit[:, None] * D + depth[None, :], acc,
                 mask=logit_ok[:, None] & channel_ok[None, :])
