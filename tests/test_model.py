"""GPT with switchable residuals: nanoGPT equivalence, hc == res at init, gradients, sizes, compile."""

import functools

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import parallelize
from conftest import random_tokens, tiny_config
from model import GPT, GPTConfig, model_shape
from parallelize import compile_model, cpu_inductor_options, shares_compiled_sinkhorn
from residuals import capture_connections

VOCAB, BLOCK = 97, 32
tiny = functools.partial(tiny_config, vocab_size=VOCAB, block_size=BLOCK)  # tiny(residual, **overrides)
tokens = functools.partial(random_tokens, VOCAB, BLOCK, 2)  # tokens(seed=0): (2, BLOCK)


def test_res_block_is_nanogpt_block_bit_for_bit():
    torch.manual_seed(0)
    model = GPT(tiny("res"))
    block = model.transformer.h[1]
    x = torch.randn(2, BLOCK, 128)
    expected = x + block.attn(block.ln_1(x))  # nanoGPT's Block.forward, written out
    expected = expected + block.mlp(block.ln_2(expected))
    assert torch.equal(block(x.unsqueeze(-2)).squeeze(-2), expected)


def test_res_model_is_nanogpt_forward_bit_for_bit():
    torch.manual_seed(0)
    model = GPT(tiny("res"))
    idx = tokens()
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(BLOCK))
    for block in t.h:
        x = x + block.attn(block.ln_1(x))
        x = x + block.mlp(block.ln_2(x))
    expected = model.lm_head(t.ln_f(x))
    logits, _ = model(idx, idx)
    assert torch.equal(logits, expected)


def test_hc_at_init_equals_res_with_shared_weights():
    torch.manual_seed(0)
    res = GPT(tiny("res"))
    hc = GPT(tiny("hc"))
    missing, unexpected = hc.load_state_dict(res.state_dict(), strict=False)
    assert unexpected == []
    assert all("_connection." in key for key in missing)  # only the connection parameters differ
    idx = tokens()
    # Every hc stream carries exactly the res state, layer after layer.
    x_res = res.transformer.wte(idx) + res.transformer.wpe(torch.arange(BLOCK))
    x_hc = x_res.unsqueeze(-2).expand(-1, -1, 4, -1).contiguous()
    x_res = x_res.unsqueeze(-2)
    for block_res, block_hc in zip(res.transformer.h, hc.transformer.h):
        x_res, x_hc = block_res(x_res), block_hc(x_hc)
        torch.testing.assert_close(x_hc, x_res.expand_as(x_hc), rtol=1e-6, atol=1e-6)
    # The output sums the n equal streams; LayerNorm removes that factor n exactly but for its eps
    # (LN(n x; eps) = LN(x; eps / n^2)), so compare the logits with eps = 0 in both.
    res.transformer.ln_f.eps = hc.transformer.ln_f.eps = 0.0
    res_logits, res_loss = res(idx, idx)
    hc_logits, hc_loss = hc(idx, idx)
    torch.testing.assert_close(hc_logits, res_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hc_loss, res_loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("residual,n", [("res", 1), ("hc", 2), ("hc", 4), ("mhc", 2), ("mhc", 4),
                                        ("mhclite", 2), ("mhclite", 4)])
def test_forward_backward_finite_gradients_for_every_parameter(residual, n):
    torch.manual_seed(0)
    model = GPT(tiny(residual, n_streams=n))
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    idx = tokens()
    for step in range(2):  # the second pass runs with W_pre/W_post/W_res moved off zero
        optimizer.zero_grad()
        logits, loss = model(idx, idx)
        assert logits.shape == (2, BLOCK, VOCAB) and torch.isfinite(loss)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        optimizer.step()
    for m in model.connections():
        if residual != "res":
            assert m.proj.weight.abs().max() > 0


def test_logits_for_generation_are_last_position_only():
    model = GPT(tiny("mhclite"))
    logits, loss = model(tokens())
    assert logits.shape == (2, 1, VOCAB) and loss is None


@pytest.mark.parametrize("size,expected", [("S", 44.7e6), ("M", 124.0e6), ("L", 353.9e6), ("XL", 1.56e9), ("7B", 6.65e9)])
def test_parameter_counts_match_paper_sizes(size, expected):
    """The paper's S/M/L; past it, GPT-2 XL's 1.5B and GPT-3 6.7B's shapes with our padded vocabulary."""
    with torch.device("meta"):
        counts = {r: GPT(GPTConfig(residual=r, **model_shape(size))).parameter_counts()
                  for r in ("res", "hc", "mhc", "mhclite")}
    assert abs(counts["res"]["non_embedding"] - expected) / expected < 0.02
    assert counts["res"]["connections"] == 0
    for residual in ("hc", "mhc", "mhclite"):
        extra = counts[residual]["total"] - counts["res"]["total"]
        assert extra == counts[residual]["connections"] > 0
    # mhc and mhclite differ only in W_res/b_res: n^2 = 16 vs n! = 24 columns per wrapper.
    cfg = model_shape(size)
    per_column = 2 * cfg["n_layer"] * (4 * cfg["n_embd"] + 1)
    assert counts["mhclite"]["total"] - counts["mhc"]["total"] == (24 - 16) * per_column


def test_weight_decay_groups_follow_nanogpts_rule():
    model = GPT(tiny("hc"))
    decay, no_decay = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight", "proj.weight", "wte.weight",
                           "wpe.weight")) for n in decayed)
    assert "transformer.h.0.attn_connection.proj.weight" in decayed
    for never in ("static_alpha", "static_beta", "scale_alpha", "norm_gain", "ln_1.weight"):
        assert any(never in n for n in kept) and not any(never in n for n in decayed)
    mhclite = GPT(tiny("mhclite"))
    decay, no_decay = mhclite.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups
    kept = {n for n, p in mhclite.named_parameters() if any(p is q for q in no_decay["params"])}
    assert {"bias_res", "scale_res", "bias_pre", "norm_gain"} <= {n.split(".")[-1] for n in kept}


@pytest.mark.parametrize("overrides,message", [
    (dict(residual="resnet"), "unknown residual 'resnet'; valid: res, hc, mhc, mhclite"),
    (dict(residual="hc", n_streams=0), "n_streams must be >= 1"),
    (dict(n_embd=100, n_head=3), "not divisible"),
    (dict(residual="mhclite", n_streams=6), "needs a permutation budget mhclite_perms"),
    (dict(residual="hc", stream_dtype="float16"), "unknown stream_dtype 'float16'; valid: float32, bfloat16"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        GPT(GPTConfig(**{**model_shape("tiny"), "block_size": 8, "vocab_size": 11, **overrides}))
    assert "\n" not in str(error.value)


def test_unknown_size_names_valid_sizes():
    with pytest.raises(ValueError, match="unknown size 'XXL'; valid: tiny, S, M, L, XL, 7B"):
        model_shape("XXL")


def test_res_forces_one_stream():
    assert GPTConfig(residual="res", n_streams=4).n_streams == 1


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_model_capture_covers_every_wrapper_and_keeps_output(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual)).eval()
    idx = tokens()
    plain, _ = model(idx, idx)
    with capture_connections(model) as records:
        captured, _ = model(idx, idx)
    assert torch.equal(plain, captured)
    assert [r["wrapper"] for r in records] == list(range(8))
    assert all(r["h_res"].shape == (2, BLOCK, 4, 4) for r in records)


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_model_recompute_same_gradients(residual):
    """parallelize.apply_connection_recompute changes what backward keeps, not what it computes."""
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny(residual))
        if recompute:
            parallelize.apply_connection_recompute(model)
        _, loss = model(tokens(), tokens(seed=1))
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("residual", ["res", "hc", "mhc", "mhclite"])
def test_no_graph_breaks_under_dynamo(residual):
    torch._dynamo.reset()
    model = GPT(tiny(residual))
    explanation = torch._dynamo.explain(model)(tokens(), tokens(seed=1))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_compiled_graph_matches_eager(residual):
    """AOTAutograd traces the custom backward and mhc's reused Sinkhorn region like inductor does;
    the traced forward and backward must compute what eager computes. mhc at three Sinkhorn
    iterations: the same ops as twenty, in a sixth of the graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tiny(residual, sinkhorn_iters=3))
    results = []
    for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        model.zero_grad(set_to_none=True)
        _, loss = run(tokens(), tokens(seed=1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_bfloat16_streams_are_stored_in_bfloat16_and_track_float32(residual):
    """stream_dtype=bfloat16 stores every connection's input and output in bf16, computes in fp32
    inside, keeps mhclite exact, and stays close to the fp32-stream model."""
    results = {}
    for stream_dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = GPT(tiny(residual, stream_dtype=stream_dtype))
        seen = []
        hooks = [m.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
                 for m in model.connections()]
        with capture_connections(model) as records:
            _, loss = model(tokens(), tokens(seed=1))
        loss.backward()
        for hook in hooks:
            hook.remove()
        expected = getattr(torch, stream_dtype)
        assert seen and all(pair == (expected, expected) for pair in seen)
        if residual == "mhclite":
            h = torch.cat([r["h_res"].flatten(0, -3) for r in records])
            assert (h.sum(-1) - 1).abs().max() < 1e-6 and (h.sum(-2) - 1).abs().max() < 1e-6
        results[stream_dtype] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss32, grads32), (loss16, grads16) = results["float32"], results["bfloat16"]
    torch.testing.assert_close(loss16, loss32, rtol=1e-2, atol=1e-2)
    for name, grad in grads32.items():
        assert torch.isfinite(grads16[name]).all(), name
    name = "transformer.wte.weight"  # the tied LM head
    cosine = torch.nn.functional.cosine_similarity(grads16[name].flatten(), grads32[name].flatten(), dim=0)
    assert cosine > 0.99


def test_res_ignores_stream_dtype():
    torch.manual_seed(0)
    fp32 = GPT(tiny("res"))
    torch.manual_seed(0)
    bf16 = GPT(tiny("res", stream_dtype="bfloat16"))
    torch.testing.assert_close(bf16(tokens(), tokens(seed=1))[1], fp32(tokens(), tokens(seed=1))[1], rtol=0, atol=0)


@pytest.mark.parametrize("residual", ["hc", "mhc", "mhclite"])
def test_compiled_graph_matches_eager_under_autocast_with_bfloat16_streams(residual):
    """The bf16 projection GEMM (autocast's dtype read inside the connection) and bf16 streams
    trace without graph breaks and compute what eager computes. Connection parameters are moved
    off their init, where many of their gradients are zero. mhc at three Sinkhorn iterations, as above."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tiny(residual, stream_dtype="bfloat16", sinkhorn_iters=3))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (p for m in model.connections() for p in m.parameters()):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    runs = [(model, False), (model, True), (torch.compile(model, backend="aot_eager", fullgraph=True), True)]
    losses, grads = [], []
    for run, autocast in runs:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = run(tokens(), tokens(seed=1))
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    fp32, eager, compiled = grads
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-3, atol=1e-3)
    # bf16 rounding differs between any two op orders, so the compiled gradient is held to eager's
    # accuracy against the fp32 model rather than to eager's bits.
    eager_error, compiled_error = ((g - fp32).norm() / fp32.norm() for g in (eager, compiled))
    assert compiled_error <= 1.25 * eager_error + 1e-3


@pytest.mark.parametrize("residual", ["res", "hc", "mhc", "mhclite"])
def test_blocks_compile_one_graph_for_every_layer(residual, graph_counter):
    """Regional compilation: the per-layer constants of the connections (wrapper and stream index)
    are no guards, so one compiled Block serves all layers; the head is the only other graph."""
    torch._dynamo.reset()
    model = GPT(tiny(residual, n_layer=3))
    runner = compile_model(model, "blocks", backend=graph_counter, fullgraph=True)
    for seed in range(2):
        _, loss = runner(tokens(seed=seed), tokens(seed=seed + 1))
        loss.backward()
    assert graph_counter.graphs == 2  # one Block + the head, not one per layer


@pytest.mark.slow
@pytest.mark.parametrize("residual, recompute, compile_mode", [
    ("mhclite", False, "model"), ("mhc", False, "model"), ("mhc", True, "blocks"), ("hc", False, "blocks")])
def test_inductor_compiled_gradients_match_eager(residual, recompute, compile_mode):
    """Inductor itself, not only AOTAutograd: training's default (the whole model, no recompute) for
    mhclite and mhc, and each other setting once, with mhc, whose nested compile region is where
    the fault below showed, and hc (the whole model's graph differs from the blocks' only in where
    it is cut, not in a connection's ops). mhc's connections share one compiled Sinkhorn, a nested
    compile region; with inductor's buffer reuse on, torch 2.13 overwrites what that region saved
    for backward, and the gradients come out wrong (an error ~1e3 times their norm) while the loss
    matches. Three Sinkhorn iterations trace the same ops as twenty, show that fault as clearly, and
    compile in about half the time."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    n_layer = 2
    model = GPT(GPTConfig(block_size=16, vocab_size=64, residual=residual, n_layer=n_layer, n_head=2, n_embd=32,
                          sinkhorn_iters=3))
    if recompute:
        parallelize.apply_connection_recompute(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (p for m in model.connections() for p in m.parameters()):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []

    def step(run):
        model.zero_grad(set_to_none=True)
        _, loss = run(idx, idx)
        loss.backward()
        return loss

    losses.append(step(model).detach())  # "blocks" compiles the model in place: eager first
    grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    run = compile_model(model, compile_mode, fullgraph=True)
    loss, code = run_and_get_code(step, run)
    losses.append(loss.detach())
    grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert (grads[1] - grads[0]).norm() <= 1e-5 * grads[0].norm()
    if residual == "mhc" and shares_compiled_sinkhorn({}):  # one Sinkhorn, called by every connection
        generated = "\n".join(code)
        copies = 2 if recompute else 1  # the backward graph recomputes it with its own copy
        calls = 2 * n_layer if compile_mode == "model" else 2
        assert generated.count("def partitioned_fw_subgraph_0_0(") == copies
        assert generated.count("= partitioned_fw_subgraph_0_0(") == copies * calls
        assert "partitioned_fw_subgraph_1" not in generated


@pytest.mark.parametrize("residual, scalar", [("hc", True), ("mhc", False), ("res", False)])
def test_hc_compiles_to_scalar_cpu_code_before_torch_2_13(residual, scalar, monkeypatch):
    """Before torch 2.13 inductor's vectorised CPU code for hc's backward stores past a buffer;
    compile_model then asks for scalar code (cpp.simdlen 0), which computes it right."""
    model = GPT(GPTConfig(block_size=8, vocab_size=32, residual=residual, n_layer=1, n_head=2, n_embd=16))
    this_torch_scalar = scalar and torch.__version__ < parallelize.SCALAR_CPU_HC_BACKWARD_BEFORE
    assert cpu_inductor_options(model, {}) == ({"cpp.simdlen": 0} if this_torch_scalar else {})
    monkeypatch.setattr(parallelize, "SCALAR_CPU_HC_BACKWARD_BEFORE", (99, 0))  # as on an older torch
    assert cpu_inductor_options(model, {}) == ({"cpp.simdlen": 0} if scalar else {})
    assert cpu_inductor_options(model, {"backend": "aot_eager"}) == {}
    assert cpu_inductor_options(model.to("meta"), {}) == {}  # not on CPU
