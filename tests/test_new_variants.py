"""The variants after mHC-lite against their math: kromhc (KromHC: H_res a Kronecker product of small
exactly doubly stochastic factors), ihc (H_res = I) and mhc with DeepSeek-V4's epsilons (mhc_eps), each
against a transcription of its formulas written here; their parameter counts; the one-line refusals."""

import functools
import itertools
import math

import pytest
import torch

from conftest import (ReducedPrecisionMatmuls, assert_doubly_stochastic, branch, connection_gradcheck, forward_and_grads,
                      random_model, randomise, reference_manifold, rms_norm, stream_state)

import authors
import fused
import residuals
import sample
from model import GPT, GPTConfig, connection_options
from residuals import (RESIDUALS, IdentityHyperConnection, KroneckerHyperConnection, ManifoldHyperConnection,
                       ManifoldHyperConnectionLite, capture_connections, kronecker_factors, sinkhorn)


def record(module, x, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), capture_connections(module) as records:
        out = module(x, branch)
    return out, records[0]


# ----------------------------------------------------------------------------------------------
# kromhc


def all_permutation_matrices(p):
    """The p! permutation matrices of p items, identity first, written out here: P[i, perm[i]] = 1."""
    return [torch.eye(p, dtype=torch.float64)[list(perm)] for perm in itertools.permutations(range(p))]


def reference_kromhc(module, x):
    """(h_res (B, T, n, n), output) per token from KromHC's formulas, float64: the logits of the shared
    projection split per factor, U_k = sum_r softmax(logits_k)_r P_r, H = U_1 kron U_2 kron ...
    (torch.kron), then x_next[i] = sum_j H[i, j] x[j] + h_post[i] f(u)."""
    matrices = []

    def kronecker_h_res(logits):
        factors, start = [], 0
        for p in kronecker_factors(module.n_streams):
            weights = torch.softmax(logits[start: start + math.factorial(p)], dim=-1)
            factors.append(sum(w * P for w, P in zip(weights, all_permutation_matrices(p))))
            start += math.factorial(p)
        matrices.append(functools.reduce(torch.kron, factors))
        return matrices[-1]

    out = reference_manifold(module, x, kronecker_h_res)
    return torch.stack(matrices).view(*x.shape[:2], module.n_streams, module.n_streams), out


@pytest.mark.parametrize("n, factors", [(2, [2]), (3, [3]), (4, [2, 2]), (6, [2, 3]), (8, [2, 2, 2]),
                                        (9, [3, 3]), (12, [2, 2, 3]), (16, [2, 2, 2, 2]), (20, [2, 2, 5])])
def test_kromhc_factors_are_the_prime_factors_2s_first(n, factors):
    assert kronecker_factors(n) == factors
    assert KroneckerHyperConnection(4, n, 0).res_logits == sum(math.factorial(p) for p in factors)


@pytest.mark.parametrize("n, words", [(1, ">= 2"), (0, ">= 2"), (7, "7"), (14, "2 x 7"), (11, "11")])
def test_kromhc_refuses_n_without_small_factors_in_one_line(n, words):
    with pytest.raises(ValueError, match="kromhc needs n_streams") as error:
        RESIDUALS["kromhc"](8, n, 0)
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("n", [2, 4, 6, 8, 16])
def test_kromhc_h_res_is_doubly_stochastic_in_float64(n):
    """Random weights, the residual biases off their -8 init too, so that the factors are far from
    the identity on average; float64 throughout."""
    module = randomise(KroneckerHyperConnection(4, n, 1), scale=1.0).double()
    with torch.no_grad():
        module.bias_res.copy_(2 * torch.randn(module.res_logits, generator=torch.Generator().manual_seed(n)))
    h = module.coefficients(stream_state(b=2, t=3, n=n, c=4).double())["h_res"]
    assert h.dtype == torch.float64 and (h >= 0).all()
    assert (h.sum(-1) - 1).abs().max() < 1e-12 and (h.sum(-2) - 1).abs().max() < 1e-12
    assert (h - torch.eye(n)).abs().amax(dim=(-1, -2)).mean() > 0.1  # not near the identity


@pytest.mark.parametrize("n", [4, 6, 8])
def test_kromhc_equals_the_kronecker_product_of_its_factors(n):
    module = randomise(KroneckerHyperConnection(4, n, 2), scale=0.5).double()
    x = stream_state(b=2, t=3, n=n, c=4).double()
    expected_h, expected_out = reference_kromhc(module, x)
    out = module(x, branch)
    torch.testing.assert_close(module.coefficients(x)["h_res"], expected_h, rtol=0, atol=1e-13)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_kromhc_h_res_is_doubly_stochastic_to_fp32_rounding_under_bf16_autocast_and_tf32(n):
    """The projection GEMM runs in bf16 (autocast) or with TF32-rounded operands; the factors and
    their Kronecker product are exact 0/1 products and elementwise products in fp32. A matmul of the
    weights with the permutation matrices in bf16, as the contrast, is off by far more."""
    module = randomise(KroneckerHyperConnection(16, n, 0), scale=1.0)
    x = stream_state(b=4, t=16, n=n, c=16)
    _, rec = record(module, x, autocast=True)
    assert_doubly_stochastic(rec["h_res"].reshape(-1, n, n))
    weights = rec["factor_weights"]
    assert ((weights > 0.01) & (weights < 0.99)).float().mean() > 0.05  # mixtures, not saturated 0s and 1s
    with ReducedPrecisionMatmuls(10) as mode:
        _, rec_tf32 = record(module, x)
    assert mode.calls > 0
    assert_doubly_stochastic(rec_tf32["h_res"].reshape(-1, n, n))
    two_by_two = torch.stack(all_permutation_matrices(2)).flatten(1).bfloat16()
    in_bf16 = (rec["factor_weights"][..., :2].bfloat16() @ two_by_two).float().unflatten(-1, (2, 2))
    assert (in_bf16.sum(-2) - 1).abs().max() > 1e-4


@pytest.mark.parametrize("n", [4, 6, 8])
def test_kromhc_init_is_the_identity_up_to_the_bias_leakage_and_h_pre_post_are_mhclites(n):
    """Each factor's identity has bias 0 and its p! - 1 others -8: a factor leaks a weight below
    (p! - 1) e^-8 off its identity, and H_res at most the sum of its factors' leaks."""
    wrapper = 5
    kromhc = KroneckerHyperConnection(16, n, wrapper)
    x = stream_state(n=n, c=16)
    _, rec = record(kromhc, x)
    leakage = sum((math.factorial(p) - 1) * math.exp(-8) for p in kronecker_factors(n))
    assert 0 < (rec["h_res"] - torch.eye(n)).abs().max() <= leakage
    mhclite = ManifoldHyperConnectionLite(16, n, wrapper, num_perms=None if n <= 5 else 8)
    _, rec_lite = record(mhclite, x)
    assert torch.equal(rec["h_pre"], rec_lite["h_pre"]) and torch.equal(rec["h_post"], rec_lite["h_post"])
    assert kromhc.proj.weight.abs().max() == 0


def test_kromhc_records_its_factor_weights():
    module = randomise(KroneckerHyperConnection(8, 6, 0), scale=0.5)
    _, rec = record(module, stream_state(n=6, c=8))
    assert rec["factor_weights"].shape == (2, 5, 2 + 6)
    torch.testing.assert_close(rec["factor_weights"][..., :2].sum(-1), torch.ones(2, 5))
    torch.testing.assert_close(rec["factor_weights"][..., 2:].sum(-1), torch.ones(2, 5))


# ----------------------------------------------------------------------------------------------
# ihc


def test_ihc_mixes_nothing_and_computes_h_pre_and_h_post_as_mhc():
    """x_next = x + h_post f(u), with h_pre and h_post from mhc's formulas (here: mhc's own, with
    its pre and post projection rows copied)."""
    ihc = randomise(IdentityHyperConnection(8, 4, 1), scale=0.5)
    mhc = ManifoldHyperConnection(8, 4, 1)
    with torch.no_grad():
        mhc.proj.weight[:8].copy_(ihc.proj.weight)
        for name in ("norm_gain", "bias_pre", "bias_post", "scale_pre", "scale_post"):
            getattr(mhc, name).copy_(getattr(ihc, name))
    x = stream_state()
    out, rec = record(ihc, x)
    _, rec_mhc = record(mhc, x)
    torch.testing.assert_close(rec["h_pre"], rec_mhc["h_pre"])  # one GEMM of another width: fp32 rounding
    torch.testing.assert_close(rec["h_post"], rec_mhc["h_post"])
    assert torch.equal(rec["h_res"], torch.eye(4).expand(2, 5, 4, 4))
    u = (rec["h_pre"].unsqueeze(-1) * x).sum(-2)
    torch.testing.assert_close(out, x + rec["h_post"].unsqueeze(-1) * branch(u).unsqueeze(-2))
    assert {name for name, _ in ihc.named_parameters()} == {"norm_gain", "proj.weight", "bias_pre", "bias_post",
                                                            "scale_pre", "scale_post"}
    assert ihc.proj.weight.shape == (2 * 4, 4 * 8)  # no residual logits


def test_ihc_cuda_form_computes_what_the_cpu_form_computes(monkeypatch):
    module = randomise(IdentityHyperConnection(8, 4, 1), scale=0.3)
    x, grad_out = stream_state(), stream_state(seed=2)
    cpu_out, cpu_grads = forward_and_grads(module, x, grad_out)
    monkeypatch.setattr(residuals, "mixes_elementwise", lambda x: True)
    cuda_out, cuda_grads = forward_and_grads(module, x, grad_out)
    torch.testing.assert_close(cuda_out, cpu_out, rtol=1e-6, atol=1e-6)
    for cuda_grad, cpu_grad in zip(cuda_grads, cpu_grads):
        torch.testing.assert_close(cuda_grad, cpu_grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# mhc with DeepSeek-V4's epsilons


def reference_v4(module, x, eps, iters=20):
    """DeepSeek-V4's hc_pre / hc_split_sinkhorn / hc_post, transcribed per token in its own layout:
    comb[source, target] (our h_res transposed), pre = sigmoid + eps, a softmax over each source's row
    plus eps, then the column sums plus eps, then iters - 1 times rows and columns; the output stream
    t = sum_s comb[s, t] x[s] + post[t] f(u)."""
    n, c = module.n_streams, module.width
    w_pre, w_post, w_res = module.proj.weight.split([n, n, n * n], dim=0)
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xl = x[b, t]
            xh = rms_norm(xl.reshape(n * c), module.norm_gain)
            pre = torch.sigmoid(module.scale_pre * (xh @ w_pre.t()) + module.bias_pre) + eps
            post = 2 * torch.sigmoid(module.scale_post * (xh @ w_post.t()) + module.bias_post)
            comb = (module.scale_res * (xh @ w_res.t()) + module.bias_res).view(n, n).t()
            comb = torch.softmax(comb, dim=-1) + eps
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
            for _ in range(iters - 1):
                comb = comb / (comb.sum(-1, keepdim=True) + eps)
                comb = comb / (comb.sum(-2, keepdim=True) + eps)
            u = sum(pre[i] * xl[i] for i in range(n))
            out[b, t] = comb.t() @ xl + post[:, None] * branch(u)
    return out


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_mhc_with_v4_epsilons_equals_deepseek_v4s_formulas_in_float64(scale):
    module = randomise(ManifoldHyperConnection(8, 4, 1, mhc_eps=1e-6), scale=scale).double()
    x = stream_state(b=2, t=3).double()
    torch.testing.assert_close(module(x, branch), reference_v4(module, x, 1e-6), rtol=0, atol=1e-12)


def test_v4s_formulas_without_epsilons_are_the_papers_mhc():
    module = randomise(ManifoldHyperConnection(8, 4, 1), scale=0.5).double()
    x = stream_state(b=2, t=3).double()
    torch.testing.assert_close(module(x, branch), reference_v4(module, x, 0.0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale, spread, difference", [(0.5, (11, 14), 4.3e-5), (1.0, (28, 38), 1.6),
                                                      (1.5, (74, 117), 4.0)])
def test_v4s_epsilons_move_the_output_more_the_wider_the_logits_spread(scale, spread, difference):
    """docs/faithfulness.md's figures: one connection (width 32, float64, x ~ N(0, 1) of shape
    (3, 16, 4, 32)), the paper's mhc against the same weights with mhc_eps = 1e-6; the logits' spread
    (max - min per token: median, max) and the output's max abs difference."""
    paper = randomise(ManifoldHyperConnection(32, 4, 1), scale=scale).double()
    v4 = ManifoldHyperConnection(32, 4, 1, mhc_eps=1e-6).double()
    v4.load_state_dict(paper.state_dict())
    x = torch.randn(3, 16, 4, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, records = record(paper, x)
    spreads = records["logits"].amax((-1, -2)) - records["logits"].amin((-1, -2))
    assert (round(spreads.median().item()), round(spreads.max().item())) == spread
    assert (paper(x, branch) - v4(x, branch)).abs().max().item() == pytest.approx(difference, rel=0.05)


def test_v4s_epsilons_move_h_res_by_order_one_once_the_logits_spread_wide():
    paper = randomise(ManifoldHyperConnection(8, 4, 1), scale=30.0)
    v4 = ManifoldHyperConnection(8, 4, 1, mhc_eps=1e-6)
    v4.load_state_dict(paper.state_dict())
    x = stream_state()
    _, rec_paper = record(paper, x)
    _, rec_v4 = record(v4, x)
    spread = (rec_paper["logits"].amax((-1, -2)) - rec_paper["logits"].amin((-1, -2))).median()
    assert spread > 30
    torch.testing.assert_close(rec_v4["h_pre"], rec_paper["h_pre"] + 1e-6)
    assert (rec_v4["h_res"] - rec_paper["h_res"]).abs().max() > 0.1
    torch.testing.assert_close(rec_paper["h_res"], sinkhorn(rec_paper["logits"]))


def transformers_v4_connection(module, eps):
    """transformers' DeepseekV4HyperConnection (skipped where transformers has no DeepSeek-V4) in float64,
    holding module's weights in its layout: fn = our projection with the norm gain folded in, rows
    [pre | post | comb], comb[source, target] at row 2n + s n + t (our h_res[target, source] at 2n + t n + s);
    base = [b_pre | b_post | b_res transposed]; scale = [s_pre, s_post, s_res]."""
    deepseek_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    n = module.n_streams
    config = deepseek_v4.DeepseekV4Config(hc_mult=n, hidden_size=module.width, hc_eps=eps, hc_sinkhorn_iters=20,
                                          rms_norm_eps=residuals.RMS_EPS)
    theirs = deepseek_v4.DeepseekV4HyperConnection(config).double()
    pre, post, res = module.projection_weight().detach().split([n, n, n * n])
    with torch.no_grad():
        theirs.fn.copy_(torch.cat([pre, post, res.unflatten(0, (n, n)).transpose(0, 1).flatten(0, 1)]))
        theirs.base.copy_(torch.cat([module.bias_pre, module.bias_post, module.bias_res.view(n, n).t().flatten()]))
        theirs.scale.copy_(torch.stack([module.scale_pre, module.scale_post, module.scale_res]))
    return theirs


@pytest.mark.parametrize("eps, scale", [(1e-6, 0.5), (1e-6, 3.0), (1e-6, 30.0), (0.0, 3.0)])
def test_mhc_equals_transformers_deepseek_v4_hyper_connection_in_float64(eps, scale, monkeypatch):
    """An implementation that is not ours: transformers' port of DeepSeek-V4's mHC computes our mhc with
    mhc_eps = its hc_eps (with hc_eps = 0, the paper's mhc), also once the logits spread wide. Its output
    streams are comb^T x + post f(collapsed); its .float() casts are made identities to stay in float64."""
    module = randomise(ManifoldHyperConnection(8, 4, 1, mhc_eps=eps), scale=scale).double()
    theirs = transformers_v4_connection(module, eps)
    x = stream_state(b=2, t=3).double()
    monkeypatch.setattr(torch.Tensor, "float", lambda tensor: tensor)
    post, comb, collapsed = theirs(x)
    monkeypatch.undo()
    expected = comb.transpose(-1, -2) @ x + post.unsqueeze(-1) * branch(collapsed).unsqueeze(-2)
    assert expected.dtype == torch.float64
    torch.testing.assert_close(module(x, branch), expected, rtol=0, atol=1e-12)


def test_v4_epsilons_refuse_the_authors_sinkhorn_in_one_line():
    for setting in (dict(sinkhorn_order="rows_then_cols"), dict(mixing_dtype="autocast")):
        with pytest.raises(ValueError, match="does not combine with the authors'"):
            connection_options(GPTConfig(residual="mhc", mhc_eps=1e-6, **setting))
    assert connection_options(GPTConfig(residual="mhc", mhc_eps=1e-6, rms_eps=0.0))["mhc_eps"] == 1e-6


# ----------------------------------------------------------------------------------------------
# All three


NEW_VARIANTS = {"kromhc": ("kromhc", {}), "ihc": ("ihc", {}), "mhc-v4eps": ("mhc", dict(mhc_eps=1e-6))}


@pytest.mark.parametrize("name", NEW_VARIANTS)
def test_gradients_match_finite_differences(name):
    """x and every parameter against numerical derivatives (float64); kromhc with a 2 x 3 product."""
    residual, options = NEW_VARIANTS[name]
    n = 6 if residual == "kromhc" else 3
    module = randomise(RESIDUALS[residual](3, n, 1, **options), scale=0.3).double()
    x = stream_state(b=1, t=2, n=n, c=3).double().requires_grad_()
    assert connection_gradcheck(module, x)


@pytest.mark.parametrize("name", NEW_VARIANTS)
def test_bf16_streams_compute_what_fp32_streams_of_their_values_compute(name):
    residual, options = NEW_VARIANTS[name]
    module = randomise(RESIDUALS[residual](8, 4, 1, **options), scale=0.3)
    x, grad_out = stream_state().bfloat16(), stream_state(seed=2).bfloat16()
    out, grads = forward_and_grads(module, x, grad_out)
    out_fp32, grads_fp32 = forward_and_grads(module, x.float(), grad_out)
    assert torch.equal(out, out_fp32.bfloat16()) and torch.equal(grads[0], grads_fp32[0].bfloat16())
    for grad, grad_fp32 in zip(grads[1:], grads_fp32[1:]):
        assert torch.equal(grad, grad_fp32)


def connection_parameters(residual, n, c):
    """Per connection, from the formulas: hc's gain, fused [W_a | W_b], static alpha and beta, 2
    scales; the others' gain over n*C, projection to [pre | post | res logits], pre and post biases,
    and, with residual logits, their bias and scale."""
    if residual == "hc":
        return c + c * (n + 2) + n * (n + 1) + n + 2
    res_logits = {"mhc": n * n, "mhclite": math.factorial(n), "ihc": 0,
                  "kromhc": sum(math.factorial(p) for p in kronecker_factors(n))}[residual]
    return n * c + n * c * (2 * n + res_logits) + 2 * n + 2 + (res_logits + 1 if res_logits else 0)


@pytest.mark.parametrize("residual, n", [("hc", 4), ("mhc", 4), ("mhclite", 4), ("kromhc", 4), ("kromhc", 8),
                                         ("kromhc", 16), ("ihc", 4)])
def test_parameter_counts_per_variant(residual, n):
    config = GPTConfig(residual=residual, n_streams=n, n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    model = GPT(config)
    assert model.parameter_counts()["connections"] == 2 * 2 * connection_parameters(residual, n, 16)
    res = GPT(GPTConfig(residual="res", n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    counts = model.parameter_counts()
    assert counts["total"] == res.parameter_counts()["total"] + counts["connections"]


@pytest.mark.parametrize("residual", ["kromhc", "ihc"])
def test_the_authors_weight_decay_takes_the_projection_only(residual):
    """connection_weight_decay="authors" decays every >= 2-D parameter of the authors' layout: KromHC's
    code has mhclite's (the projections 2-D, the static biases 1-D); ihc gets the same rule on ours."""
    connection = RESIDUALS[residual](8, 4, 0)
    assert [(id(p), rows) for p, rows in authors.decayed(connection)] == [(id(connection.proj.weight), None)]


@pytest.mark.parametrize("name, reason", [("kromhc", "written for hc, mhc and mhclite, not kromhc"),
                                          ("ihc", "written for hc, mhc and mhclite, not ihc"),
                                          ("mhc-v4eps", "not DeepSeek-V4's epsilons")])
def test_the_fused_kernels_refuse_them_in_one_line(name, reason, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fused, "TRITON_AVAILABLE", True)
    residual, options = NEW_VARIANTS[name]
    x = torch.zeros(1, 3, 4, 8)
    assert reason in fused.unsupported_reason(RESIDUALS[residual](8, 4, 0, **options), x)
    assert fused.unsupported_reason(RESIDUALS["mhc"](8, 4, 0), x) is None  # the paper's mhc runs there


@pytest.mark.parametrize("name", NEW_VARIANTS)
def test_cached_greedy_sampling_equals_uncached(name):
    """sample.py's KV cache with the new variants: the connections act per token, so cached and
    recomputed greedy tokens agree, past the block size too."""
    residual, options = NEW_VARIANTS[name]
    model = random_model(residual, n_streams=8 if residual == "kromhc" else 4, **options)
    prompt = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    new_tokens = 2 * model.config.block_size
    cached = sample.generate(model, prompt, new_tokens, top_k=1, kv_cache=True)
    assert torch.equal(cached, sample.generate(model, prompt, new_tokens, top_k=1, kv_cache=False))
