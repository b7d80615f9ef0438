"""Shared test setup: offline environment variables, Triton's interpreter without a GPU, the tiny
char-level corpus fixture, and helpers several test files use (`from conftest import ...`)."""

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
# Without a GPU the fused kernels run in Triton's interpreter, which triton reads when it is imported:
# set here, before any test module is collected. With a GPU it stays off (it is process-wide and would
# also run inductor's Triton kernels).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

WORDS = ("the king and queen of a far land rode to the old castle where one bold knight kept "
         "watch over the river and the hills").split()


FUSED_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused")


def pytest_collection_modifyitems(config, items):
    """Everything under tests/fused/ is marked `fused` (pytest -m fused runs the kernels' tests alone)."""
    for item in items:
        if str(item.path).startswith(FUSED_TESTS + os.sep):
            item.add_marker(pytest.mark.fused)


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
    (`.graphs`)."""
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


def randomise(module, scale, seed=0):
    """Every parameter of module moved off its init by scale * N(0, 1) (one seeded generator), so
    that every coefficient path matters and no setting hides behind a symmetric start."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    return module


def one_error_line(main, argv, capsys):
    """Runs a command line's main(argv), which must exit with code 2 after exactly one stderr line,
    `error: ...`, and no traceback; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err
