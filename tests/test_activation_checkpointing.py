"""Activation checkpointing per block (parallelize.apply_ac): the same losses and gradients as
without it, less kept for backward, the same checkpoints, under torch.compile too; and
benchmarks/memory.py's depth and length formula against a full count."""
import copy

import pytest
import torch

import train
from conftest import randomise, read_metrics, tiny_args
from model import GPT, GPTConfig
from parallelize import compile_model
from parallelize import apply_ac
from residuals import RESIDUALS
from benchmarks import memory as memory_table
from benchmarks.step import saved_activation_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


def small(residual, **overrides):
    settings = dict(block_size=32, vocab_size=64, n_layer=3, n_head=2, n_embd=32, residual=residual)
    return GPTConfig(**{**settings, **overrides})


def loss_and_grads(model, idx, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout's masks
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {name.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for name, p in model.named_parameters()}


@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_checkpointed_blocks_give_the_same_loss_and_gradients_and_keep_less(residual):
    """With dropout on, so the recomputed forward must replay the RNG to draw the same masks."""
    torch.manual_seed(0)
    plain = randomise(GPT(small(residual, dropout=0.1)), 0.1)
    checkpointed = apply_ac(copy.deepcopy(plain))
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(plain, idx, seed=2)
    ac_loss, ac_grads = loss_and_grads(checkpointed, idx, seed=2)
    torch.testing.assert_close(ac_loss, loss, rtol=0, atol=0)
    assert ac_grads.keys() == grads.keys()
    for name in grads:  # the same ops on the same inputs: equal to the bit on CPU
        torch.testing.assert_close(ac_grads[name], grads[name], rtol=0, atol=0, msg=name)
    kept = saved_activation_bytes(plain, idx, idx, torch.enable_grad())
    ac_kept = saved_activation_bytes(checkpointed, idx, idx, torch.enable_grad())
    assert ac_kept < 0.5 * kept
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()  # checkpoints do not depend on it


@pytest.mark.parametrize("residual", ["mhc", "mhclite"])
def test_checkpointed_blocks_compile_block_by_block_with_the_same_gradients(residual):
    """Dynamo traces the checkpointed block as one region and AOTAutograd recomputes it in the
    backward graph; the aot_eager backend runs that graph without inductor's code generation."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = randomise(GPT(small(residual, n_layer=2, block_size=16)), 0.3)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(model, idx, seed=0)
    runner = compile_model(apply_ac(model), "blocks", backend="aot_eager", fullgraph=True)
    ac_loss, ac_grads = loss_and_grads(runner, idx, seed=0)
    torch.testing.assert_close(ac_loss, loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(ac_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_memory_formula_equals_a_full_count(monkeypatch):
    """Saved bytes are affine in depth and length: fitted at 1-2 layers and two short lengths,
    the formula gives the full-depth, full-length count exactly."""
    monkeypatch.setattr(memory_table, "SHORT_LENGTHS", (16, 32))
    for residual in ("res", "mhc"):
        for checkpointed in (False, True):
            formula = memory_table.activation_formula("tiny", residual, 96, "float32", checkpointed)
            full = memory_table.counted("tiny", residual, 4, 80, 96, "float32", checkpointed)
            assert formula(4, 80) == full


@pytest.mark.slow
def test_training_with_checkpointed_blocks_follows_the_same_trajectory_and_resumes_without(data_dir, tmp_path):
    """train.py --activation_checkpointing: the same per-step losses and gradient norms as without;
    it is a way to compute, not part of the run, so its checkpoint resumes without it."""
    common = dict(residual="mhclite", max_iters=6, lr_decay_iters=6, eval_interval=3, log_interval=1)
    train.main(tiny_args(data_dir, tmp_path / "plain", **common))
    train.main(tiny_args(data_dir, tmp_path / "ac", activation_checkpointing=True, **dict(common, max_iters=3)))
    train.main(tiny_args(data_dir, tmp_path / "ac", init_from="resume", **common))
    plain, _ = read_metrics(tmp_path / "plain")
    checkpointed, _ = read_metrics(tmp_path / "ac")
    assert [r["step"] for r in checkpointed] == list(range(1, 7))
    for a, b in zip(plain, checkpointed, strict=True):
        assert (a["train_loss"], a["grad_norm"]) == (b["train_loss"], b["grad_norm"])
