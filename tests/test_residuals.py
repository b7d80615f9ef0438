"""The connection modules against the paper's math (Sec. 2 and 3.2): exactness, Sinkhorn behaviour, init, capture."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import (ReducedPrecisionMatmuls, assert_doubly_stochastic, branch, connection_gradcheck, forward_and_grads,
                      randomise, reference_manifold, rms_norm, stream_state)

import residuals
from residuals import (RESIDUALS, HyperConnection, ManifoldHyperConnection, ManifoldHyperConnectionLite,
                       capture_connections, permutation_matrices, permutations, sinkhorn)


# ----------------------------------------------------------------------------------------------
# Literal transcriptions of the paper's equations (Sec. 2 and 3.2), one token at a time, as the reference
# (mhc's and mhclite's: conftest.reference_manifold).


def reference_hc(module, x):
    n = module.n_streams
    w_a, w_b = module.proj.weight.split([n + 1, 1], dim=0)
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xl = x[b, t]
            xbar = rms_norm(xl, module.norm_gain)  # per stream
            A = module.static_alpha + module.scale_alpha * torch.tanh(xbar @ w_a.t())  # (n, n+1)
            B = module.static_beta + module.scale_beta * torch.tanh(xbar @ w_b.t())[:, 0]  # (n,)
            u = sum(A[i, 0] * xl[i] for i in range(n))
            fu = branch(u)
            for j in range(n):  # HC: output stream j = sum_i A[i, 1+j] x_i + B_j f(u)
                out[b, t, j] = sum(A[i, 1 + j] * xl[i] for i in range(n)) + B[j] * fu
    return out


def test_mhc_matches_paper_formulas():
    module = randomise(ManifoldHyperConnection(8, 4, 1), scale=0.3)
    x = stream_state()
    expected = reference_manifold(module, x, lambda z: sinkhorn(z.view(4, 4), 20))
    torch.testing.assert_close(module(x, branch), expected, rtol=1e-5, atol=1e-5)


def test_mhclite_matches_paper_formulas():
    module = randomise(ManifoldHyperConnectionLite(8, 4, 2), scale=0.3)
    x = stream_state()
    P = permutation_matrices(permutations(4))
    expected = reference_manifold(module, x, lambda z: torch.einsum("k,kij->ij", torch.softmax(z, -1), P))
    torch.testing.assert_close(module(x, branch), expected, rtol=1e-5, atol=1e-5)


def test_hc_matches_paper_formulas():
    module = randomise(HyperConnection(8, 4, 3), scale=0.3)
    x = stream_state()
    torch.testing.assert_close(module(x, branch), reference_hc(module, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_gradients_match_finite_differences(residual):
    """The hand-written backward of the fused RMSNorm projection, and the rest of the path,
    against numerical derivatives for x and every parameter (float64)."""
    module = randomise(RESIDUALS[residual](6, 3, 1), scale=0.3).double()
    x = stream_state(b=2, t=3, n=3, c=6).double().requires_grad_()
    assert connection_gradcheck(module, x)


# ----------------------------------------------------------------------------------------------
# mhclite is exactly doubly stochastic


def mhclite_h_res(n=4, c=16, scale=100.0, autocast=False, seed=0, **kwargs):
    module = randomise(ManifoldHyperConnectionLite(c, n, 0, **kwargs), scale=scale, seed=seed)
    x = stream_state(b=4, t=16, n=n, c=c, seed=seed + 1) * scale
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), capture_connections(module) as records:
        module(x, branch)
    return records[0]["h_res"].reshape(-1, n, n)


@pytest.mark.parametrize("autocast", [False, True])
def test_mhclite_h_res_doubly_stochastic_for_large_logits(autocast):
    h = mhclite_h_res(scale=100.0, autocast=autocast)
    assert_doubly_stochastic(h)
    # Large logits really do make the weights peaky, so this is not the near-identity init.
    assert h.amax(dim=(-1, -2)).min() < 0.999 or h.std() > 0.1


def test_tf32_emulation_rounds_operands_like_tf32():
    values = torch.tensor([1.0, 1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-12])
    rounded = ReducedPrecisionMatmuls(10).round_operand(values)
    # 10 explicit mantissa bits: ties go to even, below half an ulp goes down.
    assert rounded.tolist() == [1.0, 1.0 + 2**-10, 1.0, 1.0 + 2**-9, 1.0]


@pytest.mark.parametrize("mantissa_bits", [10, 7])  # TF32, and bf16 ("medium" precision)
@pytest.mark.parametrize("n, budget", [(4, None), (6, 32)])
def test_mhclite_exact_under_reduced_precision_matmuls(mantissa_bits, n, budget):
    """H_res stays doubly stochastic to 1e-6 when float32 matmuls run at TF32 or bf16 precision
    (allow_tf32 on an H100, where a matmul combination of the permutations is off by 2.4e-4 in its
    row/column sums): the emulation runs the projection (and the mixing) with rounded operands, and
    the permutation combination uses no matmul."""
    mode = ReducedPrecisionMatmuls(mantissa_bits)
    with mode:
        h = mhclite_h_res(n=n, scale=3.0, num_perms=budget)
    assert mode.calls > 0  # the projection GEMM went through the emulated precision
    assert_doubly_stochastic(h)


def test_matmul_permutation_combination_fails_under_tf32_emulation():
    """The negative control: a combination as one GEMM (softmax weights @ stacked permutation
    matrices) loses exactness under emulated TF32 matmuls, so the test above can fail."""
    weights = torch.softmax(torch.randn(4096, 24, generator=torch.Generator().manual_seed(0)) * 3.0, dim=-1)
    perms = permutation_matrices(permutations(4)).flatten(1)
    with ReducedPrecisionMatmuls(10):
        h = (weights @ perms).unflatten(-1, (4, 4))
    error = max((h.sum(-1) - 1).abs().max().item(), (h.sum(-2) - 1).abs().max().item())
    assert error > 1e-5
    assert_doubly_stochastic((weights @ perms).unflatten(-1, (4, 4)))  # exact at full precision


def test_product_of_48_mhclite_matrices_stays_doubly_stochastic():
    h = mhclite_h_res(scale=100.0)
    product = torch.eye(4).expand_as(h[:1]).clone()
    for step in range(48):
        product = h.roll(step, dims=0) @ product  # 48 different per-token matrices per chain
    assert_doubly_stochastic(product)


def test_mhc_h_res_is_not_doubly_stochastic_for_large_logits():
    """The contrast that motivates mhclite: 20 SK iterations leave column error at large logits."""
    module = randomise(ManifoldHyperConnection(16, 4, 0), scale=100.0)
    with capture_connections(module) as records:
        module(stream_state(b=4, t=16, n=4, c=16) * 100.0, branch)
    h = records[0]["h_res"]
    assert (h.sum(-1) - 1).abs().max() < 1e-5  # rows are exact by construction of the iteration
    assert (h.sum(-2) - 1).abs().max() > 1e-3  # columns are not


# ----------------------------------------------------------------------------------------------
# Sinkhorn


def test_sinkhorn_rows_exact_after_20_iterations():
    logits = torch.randn(64, 4, 4) * 5
    h = sinkhorn(logits, 20)
    assert (h.sum(-1) - 1).abs().max() < 1e-6
    assert (h >= 0).all()


def test_sinkhorn_columns_converge_on_well_conditioned_input():
    logits = 0.5 * torch.randn(256, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    errors = [(sinkhorn(logits, iters).sum(-2) - 1).abs().max().item() for iters in (1, 3, 10, 20)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:]))
    assert errors[-1] < 1e-10


def test_sinkhorn_fails_to_converge_on_ill_conditioned_input():
    """The paper's example (Sec. 1): entries 1/2, 1 and alpha = 1e-13, so 1/nu ~ 1e13.

    We reproduce the paper's output matrix; its column sums are 1.82, 0.59, 0.59 (the paper's
    text says 1.92, which does not match its own matrix: 0.91 + 0.91 = 1.82).
    """
    alpha = 1e-13
    matrix = torch.tensor([[0.5, alpha, alpha], [0.5, alpha, alpha], [alpha, 1.0, 1.0]], dtype=torch.float64)
    h = sinkhorn(matrix.log(), 20)
    paper = torch.tensor([[0.91, 0.045, 0.045], [0.91, 0.045, 0.045], [0.0, 0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(h, paper, atol=0.005, rtol=0)
    torch.testing.assert_close(h.sum(-2), torch.tensor([1.82, 0.59, 0.59], dtype=torch.float64), atol=0.01, rtol=0)
    assert (h.sum(-1) - 1).abs().max() < 1e-12
    # With many more iterations it does get there: the failure is slow convergence, not a bug.
    assert (sinkhorn(matrix.log(), 3000).sum(-2) - 1).abs().max() < 1e-3


def test_sinkhorn_dtypes():
    logits = torch.randn(3, 4, 4)
    assert sinkhorn(logits.double()).dtype == torch.float64
    assert sinkhorn(logits).dtype == torch.float32
    assert sinkhorn(logits.bfloat16()).dtype == torch.float32
    torch.testing.assert_close(sinkhorn(logits.double()).float(), sinkhorn(logits), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Permutation sets (n > 4 with a budget of K permutations)


def test_all_permutations_identity_first_and_distinct():
    for n in range(1, 6):
        perms = permutations(n)
        assert perms.shape == (math.factorial(n), n)
        assert torch.equal(perms[0], torch.arange(n))
        assert len({tuple(p) for p in perms.tolist()}) == math.factorial(n)
        P = permutation_matrices(permutations(n))
        assert torch.equal(P.sum(-1), torch.ones(len(P), n)) and torch.equal(P.sum(-2), torch.ones(len(P), n))


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("budget", ["1", "n", "2n", "min(n!,64)"])
@pytest.mark.parametrize("sampling", ["uniform", "cover"])
def test_permutation_subsets_are_doubly_stochastic(n, budget, sampling):
    k = {"1": 1, "n": n, "2n": 2 * n, "min(n!,64)": min(math.factorial(n), 64)}[budget]
    k = min(k, math.factorial(n))
    if sampling == "cover" and k < n:
        with pytest.raises(ValueError, match="cover"):
            permutations(n, k, sampling=sampling)
        return
    perms = permutations(n, k, seed=3, sampling=sampling)
    assert perms.shape == (k, n)
    assert torch.equal(perms[0], torch.arange(n))
    assert len({tuple(p) for p in perms.tolist()}) == k
    assert torch.equal(perms, permutations(n, k, seed=3, sampling=sampling))
    assert_doubly_stochastic(mhclite_h_res(n=n, c=8, scale=30.0, num_perms=k, perm_sampling=sampling))


def test_permutation_subset_depends_on_seed():
    assert not torch.equal(permutations(8, 32, seed=0), permutations(8, 32, seed=1))
    assert not torch.equal(permutations(4, 8, seed=0), permutations(4, 8, seed=1))


@pytest.mark.parametrize("n", [3, 4, 6, 8])
def test_cover_sampling_reaches_every_entry(n):
    """With 'cover', every (i, j) position belongs to some permutation, so all of H_res can be nonzero."""
    P = permutation_matrices(permutations(n, n, seed=0, sampling="cover"))
    assert (P.sum(0) > 0).all()
    h = mhclite_h_res(n=n, c=8, scale=1.0, num_perms=2 * n, perm_sampling="cover")
    assert (h > 0).all()


def test_uniform_sampling_can_miss_entries():
    """Why 'cover' exists: n uniform draws reach every position only if they form a Latin square."""
    reached = [(permutation_matrices(permutations(8, 8, seed=s)).sum(0) > 0).all().item() for s in range(20)]
    assert not any(reached)


def test_permutation_errors():
    with pytest.raises(ValueError, match="mhclite_perms"):
        permutations(6)
    with pytest.raises(ValueError, match="1..3!"):
        permutations(3, 7)
    with pytest.raises(ValueError, match="sampling"):
        permutations(4, 4, sampling="sobol")


def test_full_budget_equals_full_construction():
    torch.manual_seed(0)
    full = randomise(ManifoldHyperConnectionLite(8, 4, 0), scale=0.5)
    budget = ManifoldHyperConnectionLite(8, 4, 0, num_perms=24)
    budget.load_state_dict(full.state_dict())
    x = stream_state()
    assert torch.equal(full(x, branch), budget(x, branch))


def test_permutation_set_travels_with_state_dict():
    trained = ManifoldHyperConnectionLite(8, 6, 0, num_perms=12, perm_seed=5)
    fresh = ManifoldHyperConnectionLite(8, 6, 0, num_perms=12, perm_seed=99)  # another set
    assert not torch.equal(trained.perms, fresh.perms)
    randomise(trained, scale=0.5)
    fresh.load_state_dict(trained.state_dict())
    assert torch.equal(fresh.perms, trained.perms)
    assert torch.equal(fresh.perm_matrices, trained.perm_matrices)
    x = stream_state(n=6)
    assert torch.equal(fresh(x, branch), trained(x, branch))


# ----------------------------------------------------------------------------------------------
# Init (paper Sec. 4, "Initialization")


def test_mhclite_init_concentrates_on_identity():
    module = ManifoldHyperConnectionLite(16, 4, 5)
    with capture_connections(module) as records:
        module(stream_state(c=16), branch)
    weights = records[0]["perm_weights"]
    expected_identity = 1 / (1 + 23 * math.exp(-8))  # b_res = 0 at the identity, -8 elsewhere
    torch.testing.assert_close(weights[..., 0], torch.full_like(weights[..., 0], expected_identity), atol=2e-4, rtol=0)
    assert weights[..., 0].min() > 0.99
    diagonal = records[0]["h_res"].diagonal(dim1=-2, dim2=-1)
    assert diagonal.min() > 0.99


def test_mhc_init_is_near_identity_and_pre_post_pick_stream_k():
    wrapper = 6
    module = ManifoldHyperConnection(16, 4, wrapper)
    with capture_connections(module) as records:
        module(stream_state(c=16), branch)
    rec = records[0]
    torch.testing.assert_close(rec["h_res"].diagonal(dim1=-2, dim2=-1), torch.full((2, 5, 4), 0.999), atol=2e-4, rtol=0)
    k = wrapper % 4
    expected_pre = torch.full((4,), torch.sigmoid(torch.tensor(-1.0)).item())
    expected_pre[k] = torch.sigmoid(torch.tensor(1.0)).item()
    torch.testing.assert_close(rec["h_pre"], expected_pre.expand(2, 5, 4), atol=5e-3, rtol=0)
    torch.testing.assert_close(rec["h_post"], (2 * expected_pre).expand(2, 5, 4), atol=1e-2, rtol=0)
    assert module.proj.weight.abs().max() == 0
    assert module.scale_pre.item() == module.scale_post.item() == module.scale_res.item() == pytest.approx(0.01)


def test_hc_init_reads_stream_k_and_is_identity_mixing():
    module = HyperConnection(16, 4, 7)
    x = stream_state(c=16)
    out = module(x, branch)
    fu = branch(x[..., 3, :])  # wrapper 7 reads stream 7 mod 4 = 3
    torch.testing.assert_close(out, x + fu.unsqueeze(-2))


# ----------------------------------------------------------------------------------------------
# Interface and capture


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_capture_records_documented_shapes_and_changes_nothing(residual):
    module = randomise(RESIDUALS[residual](8, 4, 3), scale=0.3)
    x = stream_state()
    plain = module(x, branch)
    with capture_connections(module) as records:
        captured = module(x, branch)
    assert torch.equal(plain, captured)
    assert len(records) == 1
    rec = records[0]
    assert rec["wrapper"] == 3 and rec["residual"] == residual
    assert rec["h_res"].shape == (2, 5, 4, 4) and rec["h_pre"].shape == rec["h_post"].shape == (2, 5, 4)
    assert ("logits" in rec) == (residual == "mhc")
    if residual == "mhc":
        torch.testing.assert_close(sinkhorn(rec["logits"]), rec["h_res"])
    with capture_connections(module) as outside_only:
        pass
    module(x, branch)
    assert outside_only == []


# ----------------------------------------------------------------------------------------------
# bf16 streams under bf16 autocast: the projection GEMMs read x as it is


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_bf16_streams_compute_exactly_what_fp32_streams_of_their_values_compute(residual):
    """fp32 streams cast x to bf16 for the projection GEMMs; bf16 streams give the GEMMs x itself.
    The arithmetic is the same bit for bit: the output and grad x differ only by their rounding to
    the stream dtype (grad x summed in fp32 first), the parameters' gradients not at all."""
    module = randomise(RESIDUALS[residual](8, 4, 1), scale=0.3)
    x = stream_state().bfloat16()
    grad_out = stream_state(seed=2).bfloat16()
    out, grads = forward_and_grads(module, x, grad_out)
    out_fp32, grads_fp32 = forward_and_grads(module, x.float(), grad_out)
    assert out.dtype == grads[0].dtype == torch.bfloat16
    assert torch.equal(out, out_fp32.bfloat16())
    assert torch.equal(grads[0], grads_fp32[0].bfloat16())
    for grad, grad_fp32 in zip(grads[1:], grads_fp32[1:]):
        assert torch.equal(grad, grad_fp32)


class Bf16CopiesOf(TorchDispatchMode):
    """Counts the casts (aten._to_copy) that write the values of `values` (bf16) in bf16, in any view."""

    def __init__(self, values):
        super().__init__()
        self.values, self.copies = values.flatten(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
                and out.numel() == self.values.numel() and torch.equal(out.flatten(), self.values)):
            self.copies += 1
        return out


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
@pytest.mark.parametrize("stream_dtype, copies", [(torch.float32, 1), (torch.bfloat16, 0)])
def test_projection_casts_x_to_bf16_only_for_fp32_streams(residual, stream_dtype, copies):
    """Forward and backward under bf16 autocast: fp32 streams make one bf16 copy of x, for the
    projection GEMM, which grad W's GEMM reads again; bf16 streams make none."""
    module = randomise(RESIDUALS[residual](8, 4, 1), scale=0.3)
    values = stream_state().bfloat16()
    with Bf16CopiesOf(values) as counter:
        forward_and_grads(module, values.to(stream_dtype), stream_state(seed=2))
    assert counter.copies == copies


# ----------------------------------------------------------------------------------------------
# The mixing's two forms: multiply-adds on CUDA, batched matmuls on CPU


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_cuda_form_of_the_mixing_computes_what_the_cpu_form_computes(residual, monkeypatch):
    """CUDA mixes the streams by multiply-adds, u and h_res x as two products; CPU by one batched
    matmul of the stacked (n + 1) x n coefficients. The CUDA form, run here on CPU, gives the same
    outputs and gradients to fp32 rounding."""
    module = randomise(RESIDUALS[residual](8, 4, 1), scale=0.3)
    x, grad_out = stream_state(), stream_state(seed=2)
    products = []  # the rows of each multiply-add product
    mix = residuals.mix_streams
    monkeypatch.setattr(residuals, "mix_streams", lambda mixer, x: products.append(mixer.shape[-2]) or mix(mixer, x))
    cpu_out, cpu_grads = forward_and_grads(module, x, grad_out)
    assert products == []
    monkeypatch.setattr(residuals, "mixes_elementwise", lambda x: True)
    cuda_out, cuda_grads = forward_and_grads(module, x, grad_out)
    assert products == [1, 4]
    torch.testing.assert_close(cuda_out, cpu_out, rtol=1e-6, atol=1e-6)
    for cuda_grad, cpu_grad in zip(cuda_grads, cpu_grads):
        torch.testing.assert_close(cuda_grad, cpu_grad, rtol=1e-5, atol=1e-6)


def compiled_forward_and_grads(module, x, grad_out, backend):
    """forward_and_grads with the connection compiled by torch.compile(backend, fullgraph=True)."""
    compiled = torch.compile(lambda x: module(x, branch), backend=backend, fullgraph=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    return out, torch.autograd.grad(out, [x, *module.parameters()], grad_out.to(out.dtype))


def assert_compiled_matches_eager(module, stream_dtype, backend):
    x, grad_out = stream_state().to(stream_dtype), stream_state(seed=2)
    eager_out, eager_grads = forward_and_grads(module, x, grad_out)
    compiled_out, compiled_grads = compiled_forward_and_grads(module, x, grad_out, backend)
    # bf16 streams: the output and grad x are rounded to bf16 once, from fp32 values equal to rounding.
    tolerance = dict(rtol=1e-5, atol=1e-6) if stream_dtype == torch.float32 else dict(rtol=2 ** -8, atol=2 ** -14)
    torch.testing.assert_close(compiled_out, eager_out, **tolerance)
    torch.testing.assert_close(compiled_grads[0], eager_grads[0], **tolerance)
    # The parameters' gradients are sums over every token in an order inductor's code chooses: their
    # fp32 rounding is that of the terms (up to about 1e-5 here), not of the result.
    atol = 1e-5 if backend == "inductor" else 1e-6
    for compiled_grad, eager_grad in zip(compiled_grads[1:], eager_grads[1:]):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("stream_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_cuda_form_traces_to_what_eager_computes(residual, stream_dtype, monkeypatch):
    """The CUDA form (its hand-written backwards included) traced whole by torch.compile (AOTAutograd's
    forward and backward graphs, run op by op) gives eager's outputs and gradients under bf16 autocast."""
    monkeypatch.setattr(residuals, "mixes_elementwise", lambda x: True)
    assert_compiled_matches_eager(randomise(RESIDUALS[residual](8, 4, 1), scale=0.3), stream_dtype, "aot_eager")


@pytest.mark.slow
def test_cuda_form_compiled_by_inductor_computes_what_eager_computes(monkeypatch):
    """mhclite's CUDA form compiled by inductor (its CPU backend: the fusions differ from CUDA's, the
    graphs are the same) gives eager's outputs and gradients under bf16 autocast: no bf16 rounding
    is lost in a fused kernel (inductor does not round intermediates it keeps in fp32)."""
    monkeypatch.setattr(residuals, "mixes_elementwise", lambda x: True)
    torch._dynamo.reset()
    assert_compiled_matches_eager(randomise(RESIDUALS["mhclite"](8, 4, 1), scale=0.3), torch.float32, "inductor")


def test_res_rejects_multiple_streams():
    with pytest.raises(ValueError, match="one stream"):
        RESIDUALS["res"](8, 4, 0)
