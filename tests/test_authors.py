"""The settings of configs/authors.py (the paper as the authors' code ran it): each one against the
authors' formula written out here, and the defaults left as they were. docs/faithfulness.md has the
float64 comparison with their code itself."""

import math

import pytest
import torch
import torch.nn.functional as F

import authors
from authors import AUTHORS_CONNECTIONS
from config import REPO_DIR, load_config
from conftest import randomise
from model import GPT, GPTConfig
from parallelize import connection_path
from residuals import RESIDUALS, capture_connections, permutation_matrices, permutations, rms_projection, sinkhorn

N, C = 4, 8


def tiny_gpt(residual, **settings):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=C, residual=residual,
                         n_streams=N, **settings))


def test_authors_config_composes_with_the_paper_run_and_sets_every_setting():
    paths = [f"{REPO_DIR}/configs/{name}.py" for name in ("owt", "M", "mhclite", "authors")]
    cfg = load_config(paths)
    assert (cfg.final_norm, cfg.rms_eps, cfg.sinkhorn_order, cfg.init_stream, cfg.connection_weight_decay,
            cfg.h_res_dtype, cfg.mixing_dtype, cfg.stream_dtype) == (
        "per_stream", 0.0, "rows_then_cols", "drawn", "authors", "autocast", "autocast", "float32")
    defaults = load_config([])
    assert (defaults.final_norm, defaults.rms_eps, defaults.sinkhorn_order, defaults.init_stream,
            defaults.connection_weight_decay, defaults.h_res_dtype, defaults.mixing_dtype) == (
        "after_sum", 1e-6, "cols_then_rows", "wrapper_mod_n", "projections", "float32", "float32")


def test_fused_kernels_decline_the_authors_arithmetic_and_say_why():
    path = connection_path(tiny_gpt("mhc", sinkhorn_order="rows_then_cols"), torch.device("cpu"), fused_connections=True)
    assert path["path"] == "reference"
    assert path["why"].startswith("fused_connections=True but: ") and "authors' arithmetic" in path["why"]


def test_per_stream_final_norm_is_layernorm_of_each_stream_then_the_sum():
    model = tiny_gpt("mhc", final_norm="per_stream").double()
    randomise(model, 0.5)
    idx = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(1))
    logits, _ = model(idx, idx)
    t = model.transformer
    x = (t.wte(idx) + t.wpe(torch.arange(8))).unsqueeze(-2).expand(-1, -1, N, -1)
    for block in t.h:
        x = block(x)
    # theirs: ln_f on the (b s) t d layout, then the sum over s
    expected = model.lm_head(sum(F.layer_norm(x[:, :, s], (C,), t.ln_f.weight, None, 1e-5) for s in range(N)))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    default = tiny_gpt("mhc").double()
    default.load_state_dict(model.state_dict())
    assert (default(idx, idx)[0] - logits).abs().max() > 1e-2  # the two choices are different functions


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_rms_eps_zero_is_the_authors_f_normalize(residual):
    connection = AUTHORS_CONNECTIONS[residual](C, N, 1, rms_eps=0.0).double()
    randomise(connection, 0.5)
    x = 1e-3 * torch.randn(2, 3, N, C, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # small
    # rows, where 1e-6 would matter
    rows = connection.projection_rows(x)
    # theirs: F.normalize(x) * sqrt(D) * (1 + gamma), then the projection
    normed = F.normalize(rows, dim=-1) * math.sqrt(rows.shape[-1]) * connection.norm_gain
    expected = connection.coefficients_from_projection(normed @ connection.proj.weight.t())
    ours = connection.coefficients(x)
    for key in ("h_pre", "h_post", "h_res"):
        torch.testing.assert_close(ours[key], expected[key], rtol=1e-12, atol=1e-12)
    default = RESIDUALS[residual](C, N, 1).double()
    default.load_state_dict(connection.state_dict())
    assert (default.coefficients(x)["h_pre"] - expected["h_pre"]).abs().max() > 1e-6
    zero_rows = connection.coefficients(torch.zeros_like(x))  # F.normalize of 0 is 0, not NaN
    zero_projection = connection.coefficients_from_projection(
        torch.zeros(*rows.shape[:-1], connection.proj.weight.shape[0], dtype=torch.float64))
    assert torch.equal(zero_rows["h_pre"], zero_projection["h_pre"])


def authors_sinkhorn(log_alpha, iters):
    """Their sinkhorn_knopps (columns then rows) on their matrix M[source, target] = our H transposed."""
    for _ in range(iters):
        log_alpha = log_alpha - torch.logsumexp(log_alpha, dim=-2, keepdim=True)
        log_alpha = log_alpha - torch.logsumexp(log_alpha, dim=-1, keepdim=True)
    return log_alpha.exp()


def test_rows_then_cols_sinkhorn_is_the_authors_on_the_transposed_matrix():
    logits = 6 * torch.randn(5, N, N, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    connection = AUTHORS_CONNECTIONS["mhc"](C, N, 1, sinkhorn_order="rows_then_cols")
    ours = connection.residual_matrix(logits.flatten(-2))["h_res"]
    torch.testing.assert_close(ours, authors_sinkhorn(logits.transpose(-1, -2), 20).transpose(-1, -2),
                               rtol=0, atol=1e-15)
    assert (ours.sum(-2) - 1).abs().max() < 1e-14  # their columns are exact ...
    assert (ours.sum(-1) - 1).abs().max() > 1e-6  # ... and the rows carry the error on wide logits
    paper = sinkhorn(logits, 20)
    assert (paper.sum(-1) - 1).abs().max() < 1e-14 and (paper - ours).abs().max() > 1e-3


def test_drawn_init_stream_is_seeded_and_sets_the_init():
    def streams(**settings):
        return [c.stream_index for c in tiny_gpt("mhc", **settings).connections()]

    assert streams() == [0, 1, 2, 3]
    drawn = streams(init_stream="drawn", init_stream_seed=5)
    assert drawn == torch.randint(N, (4,), generator=torch.Generator().manual_seed(5)).tolist()
    assert drawn == streams(init_stream="drawn", init_stream_seed=5)
    assert len({tuple(streams(init_stream="drawn", init_stream_seed=s)) for s in range(4)}) > 1
    for residual in ("hc", "mhc", "mhclite"):
        model = tiny_gpt(residual, init_stream="drawn", init_stream_seed=5)
        for connection in model.connections():
            if residual == "hc":
                read = connection.static_alpha[:, 0]
            else:
                read = connection.bias_pre
            assert int(read.argmax()) == connection.stream_index


# Every >= 2-D parameter of the authors' layout (hyper_conn/*.py), in ours: (name, rows) with rows None for all.
AUTHORS_DECAYED = {
    "hc": {("static_alpha", None), ("proj.weight", (0, N + 1))},  # dynamic_beta_fn, W_b's row, is 1-D there
    "mhc": {("proj.weight", None), ("bias_pre", None), ("bias_res", None)},  # static_alpha (n, 1 + n)
    "mhclite": {("proj.weight", None)},  # static_alpha is 1-D there
}


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
@pytest.mark.parametrize("setting", ["projections", "authors"])
def test_connection_weight_decay_per_variant(residual, setting):
    model = tiny_gpt(residual, connection_weight_decay=setting)
    randomise(model, 0.5)
    lr, decay = 0.1, 0.5
    optimizer = model.configure_optimizers(decay, lr, (0.9, 0.95), "cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam's step is then 0: only the decoupled decay moves a parameter
    optimizer.step()
    expected = AUTHORS_DECAYED[residual] if setting == "authors" else {("proj.weight", None)}
    for connection_name in ("transformer.h.0.attn_connection", "transformer.h.1.mlp_connection"):
        for name, p in model.get_submodule(connection_name).named_parameters():
            old = before[f"{connection_name}.{name}"]
            want = old.clone()
            for decayed, rows in expected:
                if decayed == name:
                    want[slice(*rows) if rows else ...] *= 1 - lr * decay
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0)
    assert model.transformer.ln_f.weight.equal(before["transformer.ln_f.weight"])
    torch.testing.assert_close(model.lm_head.weight.detach(), before["transformer.wte.weight"] * (1 - lr * decay))
    connection = model.transformer.h[0].attn_connection
    names = {id(q): n for n, q in connection.named_parameters()}
    assert {(names[id(q)], rows and (rows.start, rows.stop)) for q, rows in authors.decayed(connection)} == \
        AUTHORS_DECAYED[residual]


def test_h_res_autocast_is_the_authors_permutation_einsum():
    connection = AUTHORS_CONNECTIONS["mhclite"](C, N, 1, h_res_dtype="autocast")
    randomise(connection, 2.0)
    x = torch.randn(2, 5, N, C, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", torch.bfloat16), capture_connections(connection) as records:
        connection(x, lambda u: u)
    weights, h_res = records[0]["perm_weights"], records[0]["h_res"]
    with torch.autocast("cpu", torch.bfloat16):
        theirs = torch.einsum("...k,kij->...ij", weights, permutation_matrices(permutations(N)))
    assert theirs.dtype == torch.bfloat16 and torch.equal(h_res, h_res.bfloat16().float())
    torch.testing.assert_close(h_res, theirs.float(), rtol=0, atol=2**-8)
    assert (h_res.sum(-1) - 1).abs().max() > 1e-5  # doubly stochastic only to bf16 rounding
    default = RESIDUALS["mhclite"](C, N, 1)
    default.load_state_dict(connection.state_dict())
    with torch.autocast("cpu", torch.bfloat16), capture_connections(default) as records:
        default(x, lambda u: u)
    assert (records[0]["h_res"].sum(-1) - 1).abs().max() < 1e-6


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_mixing_autocast_is_the_authors_bf16_einsum(residual):
    """Their width connection: mix_h = einsum(alpha, x) under autocast (bf16 operands, bf16 result);
    their depth connection adds h_post * f(u) in fp32 (a product without a sum stays fp32)."""
    connection = AUTHORS_CONNECTIONS[residual](C, N, 1, mixing_dtype="autocast")
    randomise(connection, 0.5)
    x = torch.randn(2, 5, N, C, generator=torch.Generator().manual_seed(0))
    branch = torch.nn.Linear(C, C)
    with torch.autocast("cpu", torch.bfloat16), capture_connections(connection) as records:
        out = connection(x, branch)
    c = records[0]
    with torch.autocast("cpu", torch.bfloat16):
        alpha = torch.cat([c["h_pre"].unsqueeze(-1), c["h_res"].transpose(-1, -2)], dim=-1)  # their [s, t]
        mix_h = torch.einsum("abst,absd->abtd", alpha, x)
        y = branch(mix_h[..., 0, :])
        expected = torch.einsum("abd,abs->absd", y, c["h_post"]) + mix_h[..., 1:, :]
    assert mix_h.dtype == torch.bfloat16 and expected.dtype == torch.float32 and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7)  # to a bf16 rounding of unit-size values
    with torch.autocast("cpu", torch.bfloat16):
        zero_branch_out = connection(x, lambda u: torch.zeros_like(u))
    assert torch.equal(zero_branch_out, zero_branch_out.bfloat16().float())  # h_res x rounded to bf16
    default = RESIDUALS[residual](C, N, 1)
    default.load_state_dict(connection.state_dict())
    with torch.autocast("cpu", torch.bfloat16):
        default_out = default(x, lambda u: torch.zeros_like(u))
    assert not torch.equal(default_out, default_out.bfloat16().float())


def autocast_coefficients(connection, x):
    with torch.autocast("cpu", torch.bfloat16), capture_connections(connection) as records:
        connection(x, lambda u: u)
    return records[0]


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_mixing_autocast_projection_is_the_authors_bf16_matmul_of_their_rmsnorm(residual):
    connection = AUTHORS_CONNECTIONS[residual](C, N, 1, rms_eps=0.0, mixing_dtype="autocast")
    randomise(connection, 0.5)
    x = torch.randn(2, 5, N, C, generator=torch.Generator().manual_seed(0))
    rows = connection.projection_rows(x)
    with torch.autocast("cpu", torch.bfloat16):  # theirs: RMSNorm(x) @ W, the operand rounded by autocast
        theirs = (F.normalize(rows, dim=-1) * math.sqrt(rows.shape[-1]) * connection.norm_gain) @ \
            connection.proj.weight.t()
    ours = connection.projection(x, torch.bfloat16)
    assert theirs.dtype == ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    # residuals.py's order rounds x and the gain-folded weight, and applies the RMS factor after the GEMM
    paper_order = rms_projection(rows, connection.projection_weight(), torch.bfloat16, 0.0).bfloat16()
    assert not torch.equal(ours, paper_order)


def test_mixing_autocast_rounds_hc_dynamic_coefficients_as_the_authors_tanh():
    """Their hc: tanh of the bf16 projection, times a 0-dim scale (still bf16), plus the static part."""
    connection = AUTHORS_CONNECTIONS["hc"](C, N, 1, mixing_dtype="autocast")
    randomise(connection, 0.5)
    x = torch.randn(2, 5, N, C, generator=torch.Generator().manual_seed(0))
    p = connection.projection(x, torch.bfloat16)  # their `normed @ dynamic_alpha_fn` comes out in bf16
    dynamic_alpha = torch.tanh(p[..., : N + 1]) * connection.scale_alpha
    dynamic_beta = torch.tanh(p[..., N + 1]) * connection.scale_beta
    assert p.dtype == dynamic_alpha.dtype == dynamic_beta.dtype == torch.bfloat16
    alpha, beta = dynamic_alpha + connection.static_alpha, dynamic_beta + connection.static_beta
    ours = autocast_coefficients(connection, x)
    assert torch.equal(ours["h_pre"], alpha[..., 0]) and torch.equal(ours["h_post"], beta)
    assert torch.equal(ours["h_res"], alpha[..., 1:].transpose(-1, -2))
    unrounded = connection.static_beta + connection.scale_beta * torch.tanh(p[..., N + 1].float())
    assert not torch.equal(ours["h_post"], unrounded)


@pytest.mark.parametrize("residual", ["mhc", "mhclite"])
def test_mixing_autocast_rounds_the_post_product_as_the_authors_0_dim_scale(residual):
    """Their mhc/mhclite: the bf16 projection times the 1-element pre and res scales is fp32, times
    the 0-dim post scale is bf16, before the static parts are added."""
    connection = AUTHORS_CONNECTIONS[residual](C, N, 1, mixing_dtype="autocast")
    randomise(connection, 0.5)
    x = torch.randn(2, 5, N, C, generator=torch.Generator().manual_seed(0))
    p = connection.projection(x, torch.bfloat16)
    dynamic_pre = p[..., :N] * connection.scale_pre.reshape(1)  # their pre_branch_scale: shape (1,)
    dynamic_post = p[..., N: 2 * N] * connection.scale_post  # their h_post_scale: shape ()
    assert (p.dtype, dynamic_pre.dtype, dynamic_post.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    ours = autocast_coefficients(connection, x)
    torch.testing.assert_close(ours["h_pre"], (dynamic_pre + connection.bias_pre).sigmoid(), rtol=1e-6, atol=0)
    assert torch.equal(ours["h_post"], (dynamic_post + connection.bias_post).sigmoid() * 2)
    unrounded = (p[..., N: 2 * N].float() * connection.scale_post + connection.bias_post).sigmoid() * 2
    assert not torch.equal(ours["h_post"], unrounded)
