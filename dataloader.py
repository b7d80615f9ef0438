"""The training data: nanoGPT's train.bin / val.bin / meta.json, checked at the start, identified for
the checkpoints, and drawn as seeded random windows.

The batches come from generators seeded by the run's seed (one stream for training, one per eval
split), never from the rank or the world size: every rank draws the whole global batch and keeps
its share, so the batch of a step, and the training generator's state that a checkpoint saves as
the data position, are the same on 1 process or 8. A resume must therefore read the same files:
identify() gives each file's size and a fingerprint of fixed sampled blocks, which a checkpoint
records and a resume compares (checkpoint/resume.py).
"""

import hashlib
import json
import os

import numpy as np
import torch

from model import GPT2_PADDED_VOCAB

PREPARE_COMMANDS = {
    "openwebtext": "python prepare_openwebtext.py",
    "fineweb_edu": "python prepare_fineweb_edu.py",
    "shakespeare": "python prepare_shakespeare.py",
    "shakespeare_char": "python prepare_shakespeare.py --tokenizer char",
}
# Generator streams derived from the seed: training batches and the two fixed eval sets.
TRAIN_STREAM, EVAL_STREAMS = 0, {"train": 1, "val": 2}
DATA_FILES = ("train.bin", "val.bin", "meta.json")
# The fingerprint reads this many blocks at fixed places (first and last included): 4 MiB of a
# 40 GB train.bin, a second on a slow network filesystem. A smaller file is hashed whole.
SAMPLED_BLOCKS, BLOCK_BYTES = 64, 64 * 1024


class DataError(Exception):
    """Missing or unusable data files."""


def check_data(cfg):
    """Paths of the two splits and the model vocabulary size, or a DataError naming the fix."""
    folder = os.path.join(cfg.data_dir, cfg.dataset)
    paths = {split: os.path.join(folder, f"{split}.bin") for split in ("train", "val")}
    meta_path = os.path.join(folder, "meta.json")
    missing = [p for p in (paths["train"], paths["val"], meta_path) if not os.path.isfile(p)]
    if missing:
        command = PREPARE_COMMANDS.get(cfg.dataset, "a prepare script that writes nanoGPT-format data")
        raise DataError(f"missing data file {missing[0]}; run `{command}` (or set --data_dir)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        vocab_size = GPT2_PADDED_VOCAB if meta["tokenizer"] == "gpt2" else int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta_path} is not a valid meta.json ({type(e).__name__}: {e})") from None
    for path in paths.values():
        n_tokens = os.path.getsize(path) // 2
        if n_tokens < cfg.block_size + 1:
            raise DataError(f"{path} holds {n_tokens} tokens, fewer than block_size + 1 = {cfg.block_size + 1}; "
                            f"lower --block_size or use a larger corpus")
    return paths, vocab_size


def fingerprint(path):
    """(size in bytes, SHA-256 of SAMPLED_BLOCKS blocks at fixed, evenly spaced offsets, or of the
    whole file when it is smaller than those blocks). A shorter, longer, re-tokenised or other
    corpus differs in the size or in nearly every block; a change inside unsampled bytes alone
    goes unnoticed."""
    size = os.path.getsize(path)
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLED_BLOCKS * BLOCK_BYTES:
            sha.update(f.read())
        else:
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1))
                sha.update(f.read(BLOCK_BYTES))
    return size, sha.hexdigest()


def identify(folder):
    """{file name: {"bytes", "sampled_sha256"}} of the dataset folder's DATA_FILES: what a
    checkpoint records of the data it was trained on."""
    identity = {}
    for name in DATA_FILES:
        size, digest = fingerprint(os.path.join(folder, name))
        identity[name] = dict(bytes=size, sampled_sha256=digest)
    return identity


def make_generator(seed, stream):
    """A CPU generator for one data stream of this seed (independent of rank and world size)."""
    derived = int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])
    return torch.Generator().manual_seed(derived)


def draw_offsets(generator, path, block_size, n_sequences):
    """Start positions of n_sequences random windows of block_size + 1 tokens."""
    n_tokens = os.path.getsize(path) // 2
    return torch.randint(n_tokens - block_size, (n_sequences,), generator=generator)


def step_offsets(generator, path, cfg, rank, world_size):
    """This rank's share of one optimizer step's global batch, as (micro-steps, batch_size)
    window starts. Every rank draws the whole global batch, so the generator advances the same
    way everywhere: the global batch, and the generator state a checkpoint saves as the data
    position, do not depend on the world size."""
    accum = cfg.gradient_accumulation_steps // world_size
    offsets = draw_offsets(generator, path, cfg.block_size, cfg.gradient_accumulation_steps * cfg.batch_size)
    return offsets.view(cfg.gradient_accumulation_steps, cfg.batch_size)[rank * accum:(rank + 1) * accum]


def eval_batches(cfg, paths):
    """{split: (path, window starts of eval_iters batches)}, drawn once from the split's own
    seeded generator, so successive evals and resumed runs measure the same data."""
    return {split: (paths[split], draw_offsets(make_generator(cfg.seed, stream), paths[split], cfg.block_size,
                                               cfg.eval_iters * cfg.batch_size).view(cfg.eval_iters, cfg.batch_size))
            for split, stream in EVAL_STREAMS.items()}


def get_batch(path, offsets, block_size, device):
    """Inputs and next-token targets (B, block_size) for the windows starting at offsets."""
    data = np.memmap(path, dtype=np.uint16, mode="r")  # re-opened per batch: avoids a memmap leak
    starts = offsets.tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in starts])
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y
