"""The residual connections of the HC family for a pre-norm transformer (RESIDUALS): the paper's res,
hc, mhc and mhclite, and the field's kromhc (KromHC) and ihc (mHC's identity-H_res ablation).

A connection wraps one sublayer f: `Connection(width, n_streams, wrapper_index)(x, f)`, with the
residual state x of shape (B, T, n, C) and f mapping (B, T, C) -> (B, T, C). Per token, the HC
family computes (the paper's section 2, Background)

    u         = sum_j h_pre[j] x[j]                        (the branch input)
    x_next[i] = sum_j h_res[i, j] x[j] + h_post[i] f(u)

from an RMS-normalised projection of x; the variants differ in how they make h_pre, h_post, h_res.
Depends on torch only, to be copied into other models: a host model's own weight init overwrites
the connections' init, so call `reset_parameters()` on every connection after it.
"""

import contextlib
import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

RMS_EPS = 1e-6  # inside the connections' RMSNorm root

# ----------------------------------------------------------------------------------------------
# Building blocks


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or unchanged when it is float64 (for float64 checks of the same code)."""
    return x if x.dtype == torch.float64 else x.float()


def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(logits) over the last two dims, computed in log space.

    Each iteration normalises every column to sum 1, then every row (the paper's worked example),
    so the rows are exact and the column sums carry the approximation error. Runs in fp32 (or
    float64 when given float64) and returns that dtype.
    """
    log_p = at_least_fp32(logits)
    for _ in range(iters):
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return log_p.exp()


def sinkhorn_floored(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp as DeepSeek-V4's code and its ports compute it (hc_split_sinkhorn), on our layout:
    a softmax over every column plus eps, then rows and columns in turn divided by their sum plus eps,
    rows first and last: the same 2 * iters normalisations as `sinkhorn`, which it equals for eps = 0 up
    to rounding. Once the logits spread wide, the floor moves h_res far from `sinkhorn`'s: entries that
    exp(logits) makes vanishingly small stay at about eps. fp32 (or float64), as `sinkhorn`."""
    h = torch.softmax(at_least_fp32(logits), dim=-2) + eps
    h = h / (h.sum(-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        h = h / (h.sum(-2, keepdim=True) + eps)
        h = h / (h.sum(-1, keepdim=True) + eps)
    return h


PERM_SAMPLINGS = ("uniform", "cover")
_ENUMERATE_LIMIT = 8  # up to 8! = 40320 permutations are enumerated; beyond that, sampled


def permutations(n: int, k: int | None = None, seed: int = 0, sampling: str = "uniform") -> torch.Tensor:
    """A set of k distinct permutations of n items as an index tensor (k, n), identity first.

    Row p maps output stream i to input stream perm[p, i], i.e. matrix P[i, perm[p, i]] = 1.
    k=None or k=n! gives all n! in lexicographic order. Otherwise the identity plus k-1 others drawn
    without repetition by a generator seeded with `seed`:
      "uniform": uniformly from the other n! - 1 permutations;
      "cover":   the n cyclic shifts first (together they cover every (i, j) position once, so
                 every entry of H_res can become nonzero), then uniform draws; needs k >= n.
    """
    if n < 1:
        raise ValueError(f"n_streams must be >= 1, got {n}")
    if sampling not in PERM_SAMPLINGS:
        raise ValueError(f"unknown permutation sampling '{sampling}'; valid: {', '.join(PERM_SAMPLINGS)}")
    total = math.factorial(n)
    if k is None and n > 5:
        raise ValueError(f"mhclite with n_streams={n} needs a permutation budget mhclite_perms "
                         f"(all {n}! = {total} permutations only for n <= 5)")
    if k is not None and not 1 <= k <= total:
        raise ValueError(f"mhclite_perms must be in 1..{n}! = {total}, got {k}")
    if k is None or k == total:
        return torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long)
    if sampling == "cover" and k < n:
        raise ValueError(f"'cover' permutation sampling needs mhclite_perms >= n_streams = {n}, got {k}")

    generator = torch.Generator().manual_seed(seed)
    chosen = [tuple(range(n))]
    if sampling == "cover":
        chosen += [tuple((i + shift) % n for i in range(n)) for shift in range(1, n)]
    if n <= _ENUMERATE_LIMIT:
        taken = set(chosen)
        rest = [p for p in itertools.permutations(range(n)) if p not in taken]
        order = torch.randperm(len(rest), generator=generator, device="cpu")[: k - len(chosen)]
        chosen += [rest[i] for i in order.tolist()]
    else:
        taken = set(chosen)
        while len(chosen) < k:
            p = tuple(torch.randperm(n, generator=generator, device="cpu").tolist())
            if p not in taken:
                taken.add(p)
                chosen.append(p)
    return torch.tensor(chosen[:k], dtype=torch.long)


def permutation_matrices(perms: torch.Tensor) -> torch.Tensor:
    """The 0/1 matrices (k, n, n) of an index set (k, n) from `permutations`: P[p, i, perms[p, i]] = 1."""
    return F.one_hot(perms, perms.shape[-1]).float()


KRONECKER_FACTOR_LIMIT = 5  # a factor p uses all its p! permutations, as mhclite does for n <= 5


def kronecker_factors(n: int) -> list[int]:
    """kromhc's factors of n: its prime factors, 2s first, in ascending order (n = 12: [2, 2, 3])."""
    if n < 2:
        raise ValueError(f"kromhc needs n_streams >= 2 (a Kronecker product of at least one factor), got {n}")
    factors, rest, p = [], n, 2
    while rest > 1:
        while rest % p == 0:
            factors.append(p)
            rest //= p
        p += 1
    if factors[-1] > KRONECKER_FACTOR_LIMIT:
        raise ValueError(f"kromhc needs n_streams whose prime factors are at most {KRONECKER_FACTOR_LIMIT} (each "
                         f"factor p mixes all p! permutations), got {n} = {' x '.join(map(str, factors))}")
    return factors


def kronecker(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a ⊗ b over the last two dims, batched: (..., A, A) and (..., B, B) -> (..., A B, A B), entry
    [i B + k, j B + l] = a[i, j] b[k, l]; elementwise products, no matmul."""
    return (a[..., :, None, :, None] * b[..., None, :, None, :]).flatten(-2).flatten(-3, -2)


def expand_streams(x: torch.Tensor, n_streams: int) -> torch.Tensor:
    """(B, T, C) -> (B, T, n, C): the embedding copied into every stream."""
    x = x.unsqueeze(-2)
    return x if n_streams == 1 else x.expand(-1, -1, n_streams, -1).contiguous()


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """(B, T, n, C) -> (B, T, C): the streams summed (in fp32 for bf16 streams)."""
    return x.sum(dim=-2, dtype=at_least_fp32(x).dtype)


def autocast_matmul_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast would give a matmul on this device now, or None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# ----------------------------------------------------------------------------------------------
# The variants


class Residual(nn.Module):
    """res: x + f(x), the plain pre-norm residual (one stream)."""

    def __init__(self, width: int, n_streams: int, wrapper_index: int):
        super().__init__()
        if n_streams != 1:
            raise ValueError(f"res has exactly one stream, got n_streams={n_streams}")
        self.width, self.n_streams, self.wrapper_index = width, n_streams, wrapper_index

    def reset_parameters(self):
        pass

    def forward(self, x, branch):
        return x + branch(x[..., 0, :]).unsqueeze(-2)

    def mixing_flops_per_token(self) -> int:
        return self.width  # the residual add


class StreamConnection(nn.Module):
    """Shared part of the HC family (every variant but res): the projection, the pre-aggregation and the mixing.

    Subclasses define a projection `proj` with its norm gain `norm_gain`, `projection_rows(x)` (the
    rows that are RMS-normalised and projected) and `coefficients_from_projection(p) -> dict` with
    fp32 "h_pre" (B, T, n), "h_post" (B, T, n), "h_res" (B, T, n, n) and any extra entries worth
    recording for analysis. `stream_index` is the stream this wrapper reads at init (reset_parameters
    reads it); `recorder` is the list capture_connections() fills, or None. The steps a variation of
    the arithmetic overrides: `projection`, `pre_aggregate`, `pre` (all that comes before the branch)
    and, in the ManifoldConnectionBase variants, `residual_matrix`.
    Under bf16 autocast only the projection GEMM runs in bf16, the rest in fp32 (so mhclite's h_res
    is doubly stochastic to fp32 rounding); the output keeps the dtype of x.
    """

    name = ""

    def __init__(self, width: int, n_streams: int, wrapper_index: int):
        super().__init__()
        if n_streams < 1:
            raise ValueError(f"n_streams must be >= 1, got {n_streams}")
        self.width, self.n_streams, self.wrapper_index = width, n_streams, wrapper_index
        self.stream_index = wrapper_index % n_streams
        self.recorder = None

    def projection_weight(self):
        """The projection with the RMSNorm gain folded in (every subclass has `proj` and `norm_gain`)."""
        return self.proj.weight * self.norm_gain

    def projection(self, x, matmul_dtype=None, operand=None):
        """p = RMSNorm(projection_rows(x)) @ W^T (fp32); the GEMM in matmul_dtype when given, reading
        `operand` (x's values in matmul_dtype, not differentiated) when given."""
        operand_rows = None if operand is None else self.projection_rows(operand)
        return rms_projection(self.projection_rows(x), self.projection_weight(), matmul_dtype, operand=operand_rows)

    def coefficients(self, x, matmul_dtype=None, operand=None):
        """The coefficients of x (fp32); the projection GEMM in matmul_dtype when given (on operand)."""
        return self.coefficients_from_projection(self.projection(x, matmul_dtype, operand))

    def pre_aggregate(self, h_pre, h_res, x):
        """The branch input u = sum_j h_pre[j] x[j] and the mixed streams h_res x (fp32)."""
        return pre_aggregate(h_pre, h_res, x)

    def pre(self, x):
        """The coefficients, the branch input u and the mixed streams h_res x (all fp32)."""
        matmul_dtype = autocast_matmul_dtype(x.device.type)
        # Streams already in the GEMM's dtype are its operand as they are, not a cast of the fp32 copy;
        # the fp32 copy stays the input that gradients reach, so grad x is summed in fp32.
        operand = x.detach() if x.dtype == matmul_dtype else None
        with torch.autocast(x.device.type, enabled=False):
            x = at_least_fp32(x)
            coeffs = self.coefficients(x, matmul_dtype, operand)
            branch_input, mixed = self.pre_aggregate(coeffs["h_pre"], coeffs["h_res"], x)
        return coeffs, branch_input, mixed

    def forward(self, x, branch):
        coeffs, branch_input, mixed = self.pre(x)
        if self.recorder is not None:
            self.record(coeffs)
        y = branch(branch_input)
        with torch.autocast(x.device.type, enabled=False):
            return torch.addcmul(mixed, coeffs["h_post"].unsqueeze(-1), y.unsqueeze(-2)).to(x.dtype)

    def mixing_flops_per_token(self) -> int:
        """Forward FLOPs per token besides the projection (whose weights count in 6N):
        norm 2nC, pre-aggregation 2nC, h_res mixing 2n^2C, post scale and add 2nC."""
        n, c = self.n_streams, self.width
        return 2 * n * n * c + 6 * n * c

    def record(self, coeffs):
        """Hand the coefficients to the capture_connections() context that set `recorder`."""
        self.recorder.append({"wrapper": self.wrapper_index, "residual": self.name,
                              **{key: value.detach().float() for key, value in coeffs.items()}})


class HyperConnection(StreamConnection):
    """hc: dynamic Hyper-Connections (Zhu et al. 2024) with tanh.

    Per stream i with RMS-normalised x_bar_i:
      A_i = static_alpha[i] + s_a * tanh(x_bar_i W_a)  in R^{n+1}: column 0 = pre weight,
                                                         columns 1.. = weights into output streams
      B_i = static_beta[i]  + s_b * tanh(x_bar_i W_b)  (post weight)
    so h_pre = A[:, 0], h_res = A[:, 1:] transposed (ours is [out, in]), h_post = B.
    """

    name = "hc"

    def __init__(self, width, n_streams, wrapper_index):
        super().__init__(width, n_streams, wrapper_index)
        n = n_streams
        self.norm_gain = nn.Parameter(torch.ones(width))
        self.proj = nn.Linear(width, n + 2, bias=False)  # [W_a | W_b] fused
        self.static_alpha = nn.Parameter(torch.zeros(n, n + 1))
        self.static_beta = nn.Parameter(torch.ones(n))
        self.scale_alpha = nn.Parameter(torch.tensor(0.01))
        self.scale_beta = nn.Parameter(torch.tensor(0.01))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        n = self.n_streams
        self.norm_gain.fill_(1.0)
        self.proj.weight.zero_()
        self.static_alpha.zero_()
        self.static_alpha[self.stream_index, 0] = 1.0
        self.static_alpha[:, 1:] = torch.eye(n)
        self.static_beta.fill_(1.0)
        self.scale_alpha.fill_(0.01)
        self.scale_beta.fill_(0.01)

    def projection_rows(self, x):
        return x  # every stream normalised and projected on its own: (B, T, n, C)

    def coefficients_from_projection(self, p):
        n = self.n_streams
        p = torch.tanh(p)  # (B, T, n, n+2)
        alpha = self.static_alpha + self.scale_alpha * p[..., : n + 1]
        beta = self.static_beta + self.scale_beta * p[..., n + 1]
        return {"h_pre": alpha[..., 0], "h_post": beta, "h_res": alpha[..., 1:].transpose(-1, -2)}


class ManifoldConnectionBase(StreamConnection):
    """Shared part of mhc, mhclite, kromhc and ihc (the paper's sections 2 and 3.2): one RMSNorm over all
    n*C entries and one fused projection p = [p_pre | p_post | p_res], then
      h_pre  = sigmoid(s_pre * p_pre + b_pre),   h_post = 2 sigmoid(s_post * p_post + b_post),
      logits = s_res * p_res + b_res,            which subclasses turn into h_res.
    With res_logits = 0 (ihc) there is no p_res, s_res or b_res."""

    def __init__(self, width, n_streams, wrapper_index, res_logits=0):
        super().__init__(width, n_streams, wrapper_index)
        n = n_streams
        self.res_logits = res_logits
        self.norm_gain = nn.Parameter(torch.ones(n * width))
        self.proj = nn.Linear(n * width, 2 * n + res_logits, bias=False)
        # Registered in this order, which state dicts and optimizer states follow.
        self.bias_pre = nn.Parameter(torch.zeros(n))
        self.bias_post = nn.Parameter(torch.zeros(n))
        if res_logits:
            self.bias_res = nn.Parameter(torch.zeros(res_logits))
        self.scale_pre = nn.Parameter(torch.tensor(0.01))
        self.scale_post = nn.Parameter(torch.tensor(0.01))
        if res_logits:
            self.scale_res = nn.Parameter(torch.tensor(0.01))

    def logit_groups(self):
        """(scale, bias) of each group of p, in its order: pre, post and, with residual logits, res."""
        groups = [(self.scale_pre, self.bias_pre), (self.scale_post, self.bias_post)]
        return groups + [(self.scale_res, self.bias_res)] if self.res_logits else groups

    @torch.no_grad()
    def reset_parameters(self):
        self.norm_gain.fill_(1.0)
        self.proj.weight.zero_()
        for bias in (self.bias_pre, self.bias_post):
            bias.fill_(-1.0)
            bias[self.stream_index] = 1.0
        for scale, _ in self.logit_groups():
            scale.fill_(0.01)

    def projection_rows(self, x):
        return x.flatten(-2)  # one RMSNorm over all n*C entries: (B, T, n*C)

    def coefficients_from_projection(self, p):
        pre, post, *res = scaled_groups(p, *zip(*self.logit_groups()))
        coeffs = self.residual_matrix(*res)
        coeffs["h_pre"] = torch.sigmoid(pre)
        coeffs["h_post"] = 2 * torch.sigmoid(post)
        return coeffs


class ManifoldHyperConnection(ManifoldConnectionBase):
    """mhc: h_res = Sinkhorn-Knopp(exp(mat(logits))) with a fixed number of iterations.

    `sinkhorn_fn` is the Sinkhorn it calls: `sinkhorn`, or the same function compiled once for
    every connection (parallelize.compile_model sets it). mhc_eps > 0 computes mhc as DeepSeek-V4's
    code does (its hc_eps, 1e-6 there): h_pre = sigmoid(...) + mhc_eps and `sinkhorn_floored`."""

    name = "mhc"

    def __init__(self, width, n_streams, wrapper_index, sinkhorn_iters: int = 20, mhc_eps: float = 0.0):
        super().__init__(width, n_streams, wrapper_index, res_logits=n_streams * n_streams)
        self.sinkhorn_iters = sinkhorn_iters
        self.mhc_eps = mhc_eps
        self.sinkhorn_fn = sinkhorn
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        n = self.n_streams
        self.bias_res.copy_(torch.full((n, n), -8.0).fill_diagonal_(0.0).flatten())

    def coefficients_from_projection(self, p):
        coeffs = super().coefficients_from_projection(p)
        if self.mhc_eps:
            coeffs["h_pre"] = coeffs["h_pre"] + self.mhc_eps
        return coeffs

    def residual_matrix(self, logits):
        logits = logits.unflatten(-1, (self.n_streams, self.n_streams))
        if self.mhc_eps:
            return {"h_res": sinkhorn_floored(logits, self.sinkhorn_iters, self.mhc_eps), "logits": logits}
        return {"h_res": self.sinkhorn_fn(logits, self.sinkhorn_iters), "logits": logits}


class ManifoldHyperConnectionLite(ManifoldConnectionBase):
    """mhclite: h_res = sum_k softmax(logits)_k P_k over a set of permutation matrices.

    Exactly doubly stochastic by construction (Birkhoff-von Neumann): every P_k is, and the
    weights are a convex combination. All n! permutations by default (n <= 5), else a seeded
    subset of `num_perms` that always includes the identity.
    """

    name = "mhclite"

    def __init__(self, width, n_streams, wrapper_index, num_perms: int | None = None,
                 perm_sampling: str = "uniform", perm_seed: int = 0):
        perms = permutations(n_streams, num_perms, perm_seed, perm_sampling)
        super().__init__(width, n_streams, wrapper_index, res_logits=len(perms))
        # The index set is saved with the weights, so a loaded model uses the permutations its
        # W_res columns were trained for; the 0/1 matrix is derived from it and not saved.
        self.register_buffer("perms", perms)
        self.register_buffer("perm_matrices", permutation_matrices(perms).flatten(1), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible_keys: module.rebuild_permutation_matrices())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.bias_res.fill_(-8.0)
        self.bias_res[0] = 0.0  # the identity permutation comes first

    def residual_matrix(self, logits):
        weights = torch.softmax(logits, dim=-1)
        # Exact 0/1 products and fp32 sums; a matmul here would round the weights under TF32.
        h_res = (weights.unsqueeze(-1) * self.perm_matrices).sum(-2)
        return {"h_res": h_res.unflatten(-1, (self.n_streams, self.n_streams)), "perm_weights": weights}

    @torch.no_grad()
    def rebuild_permutation_matrices(self):
        """The 0/1 matrices from the loaded index set, on its device: they are derived, not saved."""
        self.perm_matrices = permutation_matrices(self.perms).flatten(1)


class KroneckerHyperConnection(ManifoldConnectionBase):
    """kromhc (KromHC, Zhou et al. 2026): h_res = U_1 ⊗ ... ⊗ U_K over the factors p_k of n
    (`kronecker_factors`), each U_k = sum_r softmax(logits_k)_r P_r over all p_k! permutation matrices
    of p_k items, identity first.

    Exactly doubly stochastic by construction, as mhclite (a Kronecker product of doubly stochastic
    matrices is one), from sum_k p_k! logits instead of n!: 2 log2(n) for n a power of 2. For n prime it
    is mhclite with all n! permutations. At init each factor's identity has bias 0 and its other
    permutations -8, so h_res starts near the identity.
    """

    name = "kromhc"

    def __init__(self, width, n_streams, wrapper_index):
        factors = kronecker_factors(n_streams)
        super().__init__(width, n_streams, wrapper_index, res_logits=sum(math.factorial(p) for p in factors))
        self.factors = factors
        # Derived from n alone, so not saved; one 0/1 matrix set per distinct factor.
        for p in sorted(set(factors)):
            self.register_buffer(f"perm_matrices_{p}", permutation_matrices(permutations(p)).flatten(1),
                                 persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def rebuild_permutation_matrices(self):
        """The 0/1 matrices again, on the projection's device, for a loader that leaves buffers it does not
        load unset (transformers)."""
        for p in set(self.factors):
            matrices = permutation_matrices(permutations(p)).flatten(1)
            setattr(self, f"perm_matrices_{p}", matrices.to(self.proj.weight.device))

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.bias_res.fill_(-8.0)
        start = 0
        for p in self.factors:
            self.bias_res[start] = 0.0  # each factor's identity permutation comes first
            start += math.factorial(p)

    def residual_matrix(self, logits):
        weights = [torch.softmax(part, dim=-1) for part in logits.split([math.factorial(p) for p in self.factors], -1)]
        h_res = None
        for p, factor_weights in zip(self.factors, weights):
            # Exact 0/1 products and fp32 sums, as mhclite's; the Kronecker products are elementwise.
            factor = (factor_weights.unsqueeze(-1) * getattr(self, f"perm_matrices_{p}")).sum(-2).unflatten(-1, (p, p))
            h_res = factor if h_res is None else kronecker(h_res, factor)
        return {"h_res": h_res, "factor_weights": torch.cat(weights, dim=-1)}


class IdentityHyperConnection(ManifoldConnectionBase):
    """ihc: h_res = I, the identity-H_res ablation of DeepSeek's mHC paper: h_pre and h_post as in mhc,
    no residual logits, the streams never mixed with each other."""

    name = "ihc"

    def __init__(self, width, n_streams, wrapper_index):
        super().__init__(width, n_streams, wrapper_index)
        self.reset_parameters()

    def residual_matrix(self):
        return {}

    def coefficients_from_projection(self, p):
        coeffs = super().coefficients_from_projection(p)
        # Recorded for analysis as every variant's h_res is; the mixing itself skips it.
        coeffs["h_res"] = torch.eye(self.n_streams, dtype=p.dtype, device=p.device).expand(*p.shape[:-1], -1, -1)
        return coeffs

    def pre_aggregate(self, h_pre, h_res, x):
        return mix_streams(h_pre.unsqueeze(-2), x).squeeze(-2), x

    def mixing_flops_per_token(self) -> int:
        """norm 2nC, pre-aggregation 2nC, post scale and add 2nC: no h_res mixing."""
        return 6 * self.n_streams * self.width


RESIDUALS = {
    "res": Residual,
    "hc": HyperConnection,
    "mhc": ManifoldHyperConnection,
    "mhclite": ManifoldHyperConnectionLite,
    "kromhc": KroneckerHyperConnection,
    "ihc": IdentityHyperConnection,
}


# ----------------------------------------------------------------------------------------------
# Speed only: the same arithmetic in the forms that run fastest, eager on CPU and compiled on CUDA.


def mixes_elementwise(x: torch.Tensor) -> bool:
    """Whether the streams of x are mixed by multiply-adds, which inductor fuses (CUDA: a matmul with
    n = 4 is a tiny-matrix bmm, slow, and TF32 would round the coefficients), or by batched matmuls
    (CPU, where they are fastest)."""
    return x.device.type == "cuda"


def mix_streams(mixer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_j mixer[..., r, j] * x[..., j, :] for mixer (..., R, n) and x (..., n, C): (..., R, C)."""
    if not mixes_elementwise(x):
        return mixer @ x
    out = mixer[..., :, 0, None] * x[..., None, 0, :]
    for j in range(1, x.shape[-2]):
        out = torch.addcmul(out, mixer[..., :, j, None], x[..., None, j, :])
    return out


def pre_aggregate(h_pre: torch.Tensor, h_res: torch.Tensor, x: torch.Tensor):
    """(u, h_res x) for h_pre (..., n), h_res (..., n, n) and x (..., n, C): u = sum_j h_pre[j] x[j]."""
    if mixes_elementwise(x):
        # Two products: compiled, the backward then reads grad u and g as they are, where one product
        # of the stacked coefficients concatenates their gradients and reads the result twice more.
        return mix_streams(h_pre.unsqueeze(-2), x).squeeze(-2), mix_streams(h_res, x)
    # One batched matmul of the stacked (n + 1) x n coefficients makes u, h_res x and, backward, both
    # their gradients in one pass each: on CPU faster than two products.
    mixer = torch.cat([h_pre.unsqueeze(-2), h_res], dim=-2)
    branch_input, mixed = (mixer @ x).split([1, x.shape[-2]], dim=-2)
    # A copy of u, so that the branch (which saves its input) does not keep the whole product alive.
    return branch_input.squeeze(-2).contiguous(), mixed


def scaled_groups(p: torch.Tensor, scales, biases) -> list[torch.Tensor]:
    """[s_g * p_g + b_g for each group g] of p's last dim, split as the biases are, for scalar scales
    s_g: one multiply-add over p, whose backward makes every scale's and bias's gradient in one
    reduction over the tokens, where one per group makes a kernel or two each."""
    sizes = [bias.shape[-1] for bias in biases]
    scale = torch.cat([s.expand(size) for s, size in zip(scales, sizes)])
    return (p * scale + torch.cat(biases)).split(sizes, dim=-1)


def rms_projection(x, w, matmul_dtype=None, eps=RMS_EPS, operand=None):
    """(x @ w.T) * rsqrt(mean(x^2) + eps) over the last dim (RMSProjection).
    operand: x's values in matmul_dtype, which the GEMMs then read instead of casting x (the
    gradient still flows into x)."""
    return RMSProjection.apply(x, w, rms_inverse(x, eps), matmul_dtype, operand)


def rms_inverse(x, eps=RMS_EPS):
    """rsqrt(mean(x^2) + eps) over the last dim, without a gradient: RMSProjection's backward makes it."""
    x = x.detach()
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + eps)


class RMSProjection(torch.autograd.Function):
    """(x @ w.T) * rms_inv, rms_inv = rsqrt(mean(x^2) + eps) (rms_inverse), with a hand-written backward.

    This is RMSNorm(x; gain) @ weight.T with the gain folded into w = weight * gain. The normalised
    copy of x is never materialised, and the backward makes one matmul and one fused multiply-add
    over x, where autograd's backward of the norm alone makes several full passes. The two GEMMs
    run in matmul_dtype when given (bf16 under autocast), on `operand` when given (the same values,
    already in matmul_dtype: no cast, and it is saved in place of x), rms_inv from x itself;
    the forward's cast of x is saved for grad W's GEMM rather than made again. With
    y = z * r, z = x w^T, r = rsqrt(mean(x^2) + eps) and dr/dx = -r^3 x / D:
        grad_w = (grad_y * r)^T x,   grad_x = (grad_y * r) w - x * r^3 / D * sum(grad_y * z).
    """

    @staticmethod
    def forward(ctx, x, w, rms_inv, matmul_dtype, operand):
        x_values = x if operand is None else operand
        gemm_operand = x_values if matmul_dtype is None else x_values.to(matmul_dtype)
        z = _matmul(gemm_operand, w.t(), matmul_dtype, x.dtype)
        ctx.matmul_dtype = matmul_dtype
        ctx.save_for_backward(x_values, gemm_operand, w, z, rms_inv)
        return z * rms_inv

    @staticmethod
    def backward(ctx, grad_y):
        x, gemm_operand, w, z, rms_inv = ctx.saved_tensors  # x: x's values, in x's dtype or the operand's
        grad_z = grad_y * rms_inv
        grad_w = _matmul(grad_z.reshape(-1, grad_z.shape[-1]).t(), gemm_operand.reshape(-1, x.shape[-1]),
                         ctx.matmul_dtype, w.dtype)
        grad_rms_inv = (grad_y * z).sum(-1, keepdim=True)
        # A bf16 operand promotes exactly to z's dtype: grad x keeps x's dtype and arithmetic.
        grad_x = torch.addcmul(_matmul(grad_z, w, ctx.matmul_dtype, z.dtype), x,
                               grad_rms_inv * rms_inv.pow(3) / -x.shape[-1])
        return grad_x, grad_w, None, None, None


def _matmul(a, b, operand_dtype, out_dtype):
    """a @ b with both operands in operand_dtype (None: as they are), returned in out_dtype."""
    if operand_dtype is None:
        return a @ b
    return (a.to(operand_dtype) @ b.to(operand_dtype)).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Capture for analysis: what every connection computed during an ordinary forward.


@contextlib.contextmanager
def capture_connections(module: nn.Module):
    """Record the coefficients of every HC-family connection in `module` (a model or one
    connection) during forward passes in this context.

    Yields a list that receives one dict per connection call, in forward order, with
    "wrapper" (index over the 2L wrappers), "residual" (name), "h_res" (B, T, n, n) with
    x_next[i] = sum_j h_res[i, j] x[j], "h_pre" and "h_post" (B, T, n), and for mhc "logits"
    (B, T, n, n), the Sinkhorn input's logarithm, for mhclite "perm_weights" (B, T, K) and for
    kromhc "factor_weights" (B, T, sum_k p_k!), every factor's softmax weights in factor order.
    Tensors are detached fp32 copies on the model's device. Outside the context nothing is
    recorded and nothing is computed for it.
    """
    records = []
    connections = [m for m in module.modules() if isinstance(m, StreamConnection)]
    previous = [connection.recorder for connection in connections]
    for connection in connections:
        connection.recorder = records
    try:
        yield records
    finally:
        for connection, recorder in zip(connections, previous):
            connection.recorder = recorder
