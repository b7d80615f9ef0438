"""Shared test setup: offline environment variables and the tiny char-level corpus fixture."""

import json
import os
import random

import numpy as np
import pytest
import torch

# Tests never touch the network and never need wandb.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

WORDS = ("the king and queen of a far land rode to the old castle where one bold knight kept "
         "watch over the river and the hills").split()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A ~25 KB char-level corpus in nanoGPT format: seeded random lines of a few words."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(450)) + "\n"
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    n_train = int(0.9 * len(ids))
    folder = root / "toy"
    folder.mkdir()
    ids[:n_train].tofile(folder / "train.bin")
    ids[n_train:].tofile(folder / "val.bin")
    meta = dict(dataset="toy", tokenizer="char", vocab_size=len(chars), train_tokens=n_train,
                val_tokens=len(ids) - n_train, dtype="uint16", source="test", split_seed=0, val_fraction=0.1,
                itos=chars)
    (folder / "meta.json").write_text(json.dumps(meta))
    return root


@pytest.fixture
def graph_counter():
    """A torch.compile backend that runs every graph dynamo hands it as traced and counts them
    (`.graphs`). torch._dynamo.testing has one, but importing it imports triton, which must wait
    until test_fused_connections.py has set TRITON_INTERPRET."""
    class GraphCounter:
        graphs = 0

        def __call__(self, graph_module, example_inputs):
            self.graphs += 1
            return graph_module.forward

    return GraphCounter()


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
