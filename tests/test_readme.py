"""The README's example of residuals.py in a model of one's own, run as written.

The code block is read from README.md, so the README and this test cannot drift apart. The test
supplies what the README leaves to the reader (the sublayers and a nanoGPT-style global init) and
checks the claim next to the code: after the host's init the connections hold the paper's init,
which the host's init alone would have overwritten.
"""

import itertools
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from residuals import RESIDUALS

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- tests/test_readme.py runs the next code block -->"
VOCAB, WIDTH, N_LAYER, N_STREAMS = 16, 32, 2, 4
STREAM_VARIANTS = ("hc", "mhc", "mhclite")


def readme_code():
    text = README.read_text()
    assert text.count(MARKER) == 1, "README.md lost the marker before its residuals.py example"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER)[1], re.S)
    assert block, "the marker in README.md must be followed by a ```python block"
    return block.group(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, width, n_head=2):
        super().__init__()
        self.n_head = n_head
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, u):
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in self.qkv(u).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, u):
        return self.net(u)


def init_weights(module):
    """nanoGPT's global init: every Linear and Embedding drawn from N(0, 0.02), biases zero."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def readme_model(residual, n_streams=N_STREAMS, seed=0):
    namespace = {"CausalSelfAttention": CausalSelfAttention, "MLP": MLP, "init_weights": init_weights}
    exec(compile(readme_code(), str(README), "exec"), namespace)
    torch.manual_seed(seed)
    return namespace["Model"](VOCAB, WIDTH, N_LAYER, n_streams=n_streams, residual=residual)


def connections(model):
    found = [m for m in model.modules() if isinstance(m, tuple(RESIDUALS.values()))]
    assert len(found) == 2 * N_LAYER
    return found


def paper_init_output(residual, n, wrapper_index, x):
    """What a connection at the paper's init (Sec. 4, Initialization) computes with the identity as branch.
    Zero projections leave only the biases and static parts: stream k = wrapper_index mod n is read,
    h_res is the identity (hc), Sinkhorn of exp(0 on the diagonal, -8 off it) (mhc), or the
    softmax over permutations with logit 0 for the identity and -8 for the rest (mhclite)."""
    k = wrapper_index % n
    picks_k = torch.full((n,), -1.0, dtype=torch.float64)
    picks_k[k] = 1.0
    if residual == "hc":
        h_res, h_pre, h_post = torch.eye(n, dtype=torch.float64), F.one_hot(torch.tensor(k), n).double(), torch.ones(n)
    else:
        h_pre, h_post = torch.sigmoid(picks_k), 2 * torch.sigmoid(picks_k)
        if residual == "mhc":  # equal row and column sums: Sinkhorn only divides by them
            e = torch.full((n, n), math.exp(-8), dtype=torch.float64).fill_diagonal_(1.0)
            h_res = e / e.sum(0)
        else:
            perms = list(itertools.permutations(range(n)))  # identity first
            weights = torch.softmax(torch.tensor([0.0] + [-8.0] * (len(perms) - 1), dtype=torch.float64), 0)
            h_res = sum(w * torch.eye(n, dtype=torch.float64)[list(p)] for w, p in zip(weights, perms))
    x = x.double()
    u = torch.einsum("j,btjc->btc", h_pre, x)
    return torch.einsum("ij,btjc->btic", h_res, x) + h_post.double()[:, None] * u.unsqueeze(-2)


def assert_paper_init(residual, model, x):
    for index, connection in enumerate(connections(model)):
        projections = [m.weight for m in connection.modules() if isinstance(m, nn.Linear)]
        assert projections and all(torch.count_nonzero(w) == 0 for w in projections)
        scales = [p for p in connection.parameters() if p.dim() == 0]
        assert scales and all(p.item() == pytest.approx(0.01) for p in scales)
        with torch.no_grad():
            out = connection(x, lambda u: u)
        torch.testing.assert_close(out.double(), paper_init_output(residual, N_STREAMS, index, x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("residual", STREAM_VARIANTS)
def test_readme_model_starts_from_the_paper_init_after_its_own(residual):
    model = readme_model(residual)
    x = torch.randn(2, 5, N_STREAMS, WIDTH, generator=torch.Generator().manual_seed(1))
    assert_paper_init(residual, model, x)
    assert torch.count_nonzero(model.head.weight) > 0  # the host's init did run on the host's layers


@pytest.mark.parametrize("residual", STREAM_VARIANTS)
def test_without_the_reset_the_host_init_overwrites_the_connections(residual):
    """The negative control: the host's init alone (no reset after it) draws the projections, and
    the connections no longer compute what the paper's init computes."""
    model = readme_model(residual)
    model.apply(init_weights)
    x = torch.randn(2, 5, N_STREAMS, WIDTH, generator=torch.Generator().manual_seed(1))
    for index, connection in enumerate(connections(model)):
        assert all(torch.count_nonzero(m.weight) > 0 for m in connection.modules() if isinstance(m, nn.Linear))
        with torch.no_grad():
            out = connection(x, lambda u: u).double()
        assert (out - paper_init_output(residual, N_STREAMS, index, x)).abs().max() > 1e-4
    for connection in connections(model):
        connection.reset_parameters()
    assert_paper_init(residual, model, x)


def next_token_batch(generator, batch=8, length=16):
    """Sequences that count up modulo the vocabulary from random starts: learnable in a few steps."""
    starts = torch.randint(VOCAB, (batch, 1), generator=generator)
    return (starts + torch.arange(length + 1)) % VOCAB


@pytest.mark.parametrize("residual", ("res", *STREAM_VARIANTS))
def test_readme_model_trains(residual, one_thread):
    n_streams = 1 if residual == "res" else N_STREAMS
    model = readme_model(residual, n_streams)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(30):
        tokens = next_token_batch(generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)  # untrained: about uniform
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]
    if residual != "res":  # training reached the connections' projections
        assert all(torch.count_nonzero(m.weight) > 0
                   for c in connections(model) for m in c.modules() if isinstance(m, nn.Linear))

