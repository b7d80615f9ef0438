"""The authors' training code (FFTYYY/mhc-lite), where it differs from the paper as written.

Each difference is one model setting (model.AuthorsSwitches) whose default is the paper's;
configs/authors.py sets them all to the authors' values. docs/faithfulness.md says where each is in
their code and what it changes.
residuals.py stays the paper; the connection subclasses here add the authors' arithmetic.
"""

import math

import torch
import torch.nn.functional as F

from residuals import (RESIDUALS, RMS_EPS, HyperConnection, ManifoldHyperConnection, ManifoldHyperConnectionLite,
                       RMSProjection, autocast_matmul_dtype, mix_streams)

# key: (the paper's value, the authors' value); rms_eps takes any value >= 0.
SETTINGS = {
    "final_norm": ("after_sum", "per_stream"),  # their ln_f on every stream, then the sum
    "rms_eps": (RMS_EPS, 0.0),  # their RMSNorm is F.normalize(x) * sqrt(D): no epsilon
    "sinkhorn_order": ("cols_then_rows", "rows_then_cols"),  # mhc: their Sinkhorn on the transposed matrix
    "init_stream": ("wrapper_mod_n", "drawn"),  # the stream a wrapper reads at init: their randrange
    "connection_weight_decay": ("projections", "authors"),  # theirs: every >= 2-D parameter of their layout
    "h_res_dtype": ("float32", "autocast"),  # mhclite: their permutation einsum in bf16 under autocast
    "mixing_dtype": ("float32", "autocast"),  # their projection, coefficients and mixing in bf16 under autocast
}
# The two that act on training only (the init and the optimizer), not on what the model computes.
TRAINING_ONLY = ("init_stream", "connection_weight_decay")
# The settings that change a connection's arithmetic, and the variants they act on.
ARITHMETIC = {"rms_eps": ("hc", "mhc", "mhclite"), "mixing_dtype": ("hc", "mhc", "mhclite"),
              "sinkhorn_order": ("mhc",), "h_res_dtype": ("mhclite",)}
# F.normalize's floor on the L2 norm; as a floor on mean(x^2) it is this squared over the width.
NORMALIZE_NORM_FLOOR = 1e-12


def arithmetic(config) -> dict:
    """The connection settings of config that act on its variant and differ from the paper."""
    return {key: getattr(config, key) for key, variants in ARITHMETIC.items()
            if config.residual in variants and getattr(config, key) != SETTINGS[key][0]}


def connection_class(config):
    """residuals.py's class for config.residual, or the authors' subclass when a setting needs it."""
    return AUTHORS_CONNECTIONS[config.residual] if arithmetic(config) else RESIDUALS[config.residual]


def init_streams(config) -> list[int | None]:
    """The stream each of the 2L wrappers reads at init: None (the paper's wrapper index mod n), or
    drawn as the authors' code does (randrange, unseeded there) from a generator seeded with
    init_stream_seed, so that a run and its resume draw the same streams."""
    n_wrappers = 2 * config.n_layer
    if config.init_stream == "wrapper_mod_n" or config.residual == "res":
        return [None] * n_wrappers
    generator = torch.Generator().manual_seed(config.init_stream_seed)
    return torch.randint(config.n_streams, (n_wrappers,), generator=generator, device="cpu").tolist()


def decayed(connection) -> list:
    """What the authors' optimizer decays of one connection: every parameter with two or more
    dimensions in their layout (hyper_conn/*.py), as (parameter, rows) pairs, rows None for all."""
    n = connection.n_streams
    if connection.name == "hc":  # static_alpha and dynamic_alpha_fn (W_a); dynamic_beta_fn (W_b) is 1-D there
        return [(connection.static_alpha, None), (connection.proj.weight, slice(0, n + 1))]
    if connection.name == "mhc":  # dynamic_alpha_fn, dynamic_beta_fn and static_alpha = [b_pre | b_res] (n, 1 + n)
        return [(connection.proj.weight, None), (connection.bias_pre, None), (connection.bias_res, None)]
    if connection.name == "mhclite":  # its static_alpha is 1-D: the projections only, as ours
        return [(connection.proj.weight, None)]
    if connection.name in ("kromhc", "ihc"):  # KromHC's code has mhclite's layout; ihc: the rule on ours
        return [(connection.proj.weight, None)]
    return []


# ----------------------------------------------------------------------------------------------
# The connections with the authors' arithmetic


class AuthorsArithmetic:
    """The settings of ARITHMETIC on top of one of residuals.py's connections.

    rms_eps: the RMS factor rsqrt(max(mean(x^2) + rms_eps, floor)); 0 with F.normalize's floor is
    their F.normalize(x) * sqrt(D). mixing_dtype="autocast", under autocast, computes what their
    code computes there: the projection as their matmul (the normalised rows times the gain
    rounded to the autocast dtype, the output in it), the dynamic coefficients from it with their
    type promotion (below), and the mixing as their einsum: h_pre, h_res and x rounded to the
    autocast dtype, the sums in fp32, u and h_res x rounded to it. Their post einsum is a product
    without a sum, which autocast leaves in fp32, so the streams keep their dtype.
    `autocast_dtype` is the autocast dtype of the current forward (None outside autocast), which
    the coefficients, h_res and the mixing round to.
    """

    def __init__(self, *args, rms_eps=RMS_EPS, mixing_dtype="float32", **kwargs):
        super().__init__(*args, **kwargs)
        self.rms_eps, self.mixing_dtype = rms_eps, mixing_dtype
        self.autocast_dtype = None

    def pre(self, x):
        # Read here: the paper's pre computes everything after this with autocast off.
        self.autocast_dtype = autocast_matmul_dtype(x.device.type)
        return super().pre(x)

    def rounds(self, dtype):
        return self.mixing_dtype == "autocast" and dtype is not None

    def projection(self, x, matmul_dtype=None, operand=None):
        rows = self.projection_rows(x)
        if not self.rounds(matmul_dtype):
            # rsqrt(max(mean(x^2) + rms_eps, floor)): with rms_eps 0, F.normalize's factor.
            mean_square = torch.linalg.vector_norm(rows.detach(), dim=-1, keepdim=True).square() / rows.shape[-1]
            rms_inv = torch.rsqrt((mean_square + self.rms_eps).clamp_min(NORMALIZE_NORM_FLOOR**2 / rows.shape[-1]))
            return RMSProjection.apply(rows, self.projection_weight(), rms_inv, matmul_dtype,
                                       None if operand is None else self.projection_rows(operand))
        # Their RMSNorm output, not x, is the GEMM's operand that autocast rounds.
        if self.rms_eps == 0:
            normed = F.normalize(rows, dim=-1, eps=NORMALIZE_NORM_FLOOR) * math.sqrt(rows.shape[-1])
        else:
            normed = rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + self.rms_eps)
        normed = normed * self.norm_gain
        return normed.to(matmul_dtype) @ self.proj.weight.t().to(matmul_dtype)

    def pre_aggregate(self, h_pre, h_res, x):
        if not self.rounds(self.autocast_dtype):
            return super().pre_aggregate(h_pre, h_res, x)
        dtype = self.autocast_dtype
        u, mixed = (mix_streams(mixer.to(dtype).float(), x.to(dtype).float()).to(dtype).float()
                    for mixer in (h_pre.unsqueeze(-2), h_res))
        return u.squeeze(-2), mixed


def rounded_product(values, scale, dtype=None):
    """values * scale computed in fp32 and rounded once to dtype (default: values'), as torch
    multiplies a bf16 tensor by a 0-dim fp32 tensor: the result takes the tensor's dtype."""
    return (values.float() * scale).to(dtype or values.dtype)


class AuthorsHyperConnection(AuthorsArithmetic, HyperConnection):
    def coefficients_from_projection(self, p):
        if not self.rounds(self.autocast_dtype):
            return super().coefficients_from_projection(p)
        # Their tanh of the bf16 projection stays bf16, and so does its product with a 0-dim
        # scale (type promotion); the static part is added in fp32.
        n = self.n_streams
        p = torch.tanh(p)
        alpha = self.static_alpha + rounded_product(p[..., : n + 1], self.scale_alpha)
        beta = self.static_beta + rounded_product(p[..., n + 1], self.scale_beta)
        return {"h_pre": alpha[..., 0], "h_post": beta, "h_res": alpha[..., 1:].transpose(-1, -2)}


class AuthorsManifoldCoefficients(AuthorsArithmetic):
    def coefficients_from_projection(self, p):
        if not self.rounds(self.autocast_dtype):
            return super().coefficients_from_projection(p)
        # Their pre and res scales are 1-element vectors, so type promotion makes those products
        # fp32; their post scale is 0-dim, so the post product stays bf16.
        n = self.n_streams
        pre, post, res = p.float().split([n, n, self.res_logits], dim=-1)
        coeffs = self.residual_matrix(self.scale_res * res + self.bias_res)
        coeffs["h_pre"] = torch.sigmoid(self.scale_pre * pre + self.bias_pre)
        coeffs["h_post"] = 2 * torch.sigmoid(rounded_product(post, self.scale_post, p.dtype) + self.bias_post)
        return coeffs


class AuthorsManifoldHyperConnection(AuthorsManifoldCoefficients, ManifoldHyperConnection):
    """sinkhorn_order="rows_then_cols": their Sinkhorn (columns, then rows) runs on their matrix
    M[source, target], our h_res transposed, so on ours the columns are exact."""

    def __init__(self, *args, sinkhorn_order="cols_then_rows", **kwargs):
        super().__init__(*args, **kwargs)
        self.sinkhorn_order = sinkhorn_order

    def residual_matrix(self, logits):
        if self.sinkhorn_order == "cols_then_rows":
            return super().residual_matrix(logits)
        logits = logits.unflatten(-1, (self.n_streams, self.n_streams))
        h_res = self.sinkhorn_fn(logits.transpose(-1, -2), self.sinkhorn_iters).transpose(-1, -2)
        return {"h_res": h_res, "logits": logits}


class AuthorsManifoldHyperConnectionLite(AuthorsManifoldCoefficients, ManifoldHyperConnectionLite):
    """h_res_dtype="autocast": their einsum of the weights with the permutation matrices is a matmul
    in the autocast dtype, whose bf16 h_res is doubly stochastic only to bf16 rounding."""

    def __init__(self, *args, h_res_dtype="float32", **kwargs):
        super().__init__(*args, **kwargs)
        self.h_res_dtype = h_res_dtype

    def residual_matrix(self, logits):
        if self.h_res_dtype == "float32" or self.autocast_dtype is None:
            return super().residual_matrix(logits)
        weights = torch.softmax(logits, dim=-1)
        dtype = self.autocast_dtype
        h_res = (weights.to(dtype) @ self.perm_matrices.to(dtype)).to(weights.dtype)
        return {"h_res": h_res.unflatten(-1, (self.n_streams, self.n_streams)), "perm_weights": weights}


AUTHORS_CONNECTIONS = {
    "hc": AuthorsHyperConnection,
    "mhc": AuthorsManifoldHyperConnection,
    "mhclite": AuthorsManifoldHyperConnectionLite,
}
