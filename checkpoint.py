"""Checkpoints: atomic save, cleanup of temporary files a killed save left, load with one-line
errors, and model loading for analysis and sampling.

A checkpoint written by train.py is a dict with keys model (state dict without `_orig_mod.`),
model_args (GPTConfig as a dict), config (TrainConfig as a dict), optimizer, step,
best_val_loss, rng (one entry of RNG states per rank) and data_state (the state of the
training-batch generator). It holds only tensors and plain Python values, so it loads with
torch.load(weights_only=True) and never runs pickled code.
"""

import contextlib
import dataclasses
import fcntl
import os
import re
import tempfile

import torch

from model import GPT, GPTConfig

REQUIRED_KEYS = ("model", "model_args", "config", "step")
# Config keys that decide what a run is; resuming with another value would train a different model.
RUN_IDENTITY_KEYS = ("residual", "size", "n_streams")
# Model settings that change how the same model is computed, not what it is; free to change on resume.
EXECUTION_KEYS = ("fused_connections",)


class CheckpointError(Exception):
    """A missing, truncated, corrupt or incompatible checkpoint, as one line."""


def save_checkpoint(path, obj):
    """Write obj with torch.save to a temporary file `<path>.<random>.tmp` in the same directory,
    fsync it, then rename it over `path`: a crash at any moment leaves either the old file or the
    new one, whole. The writer holds an exclusive flock on the temporary file until it is renamed,
    so remove_stale_temp_files can tell a save in progress from one whose process died."""
    directory = os.path.dirname(os.path.abspath(path))
    f, tmp_path = _locked_temp_file(path)
    try:
        with f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp_path, path)  # still locked: never an unlocked file under a temp name
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _locked_temp_file(path):
    """(file open for writing, its path): a new temporary file next to `path`, flock-ed by us."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        fd, tmp_path = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
        f = os.fdopen(fd, "wb")
        fcntl.flock(f, fcntl.LOCK_EX)
        if os.fstat(f.fileno()).st_nlink:
            return f, tmp_path
        f.close()  # a cleaner removed it before we held the lock; take a fresh one


def remove_stale_temp_files(path):
    """Delete the temporary files that save_checkpoint(path, ...) left when its process died
    mid-save (kill -9, out of memory, a lost node); each is as large as a checkpoint. A file
    whose exclusive flock can be taken has no live writer; one still locked is kept. Returns
    (number of files removed, bytes freed)."""
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.\w+\.tmp")
    removed, freed = 0, 0
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    for name in names:
        tmp_path = os.path.join(directory, name)
        if not pattern.fullmatch(name) or not os.path.isfile(tmp_path):
            continue
        try:
            f = open(tmp_path, "rb")
        except OSError:
            continue  # gone already, or not ours to read
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer holds it
            size = os.fstat(f.fileno()).st_size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
                removed, freed = removed + 1, freed + size
    return removed, freed


def load_checkpoint(path):
    """Load a train.py checkpoint onto the CPU; raises CheckpointError with one line."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for damaged files; all mean the same here
        reason = str(e).strip().split(". ")[0].splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is truncated, corrupt or not a checkpoint ({reason})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a train.py checkpoint (missing {', '.join(missing)})")
    return ckpt


def check_same_run(ckpt, config, path):
    """Refuse to resume a checkpoint of another residual / size / n_streams (or any other model
    shape): name both sides."""
    saved = ckpt["config"]
    differ = [k for k in RUN_IDENTITY_KEYS if saved.get(k) != config.get(k)]
    if differ:
        theirs = " ".join(f"{k}={saved.get(k)}" for k in RUN_IDENTITY_KEYS)
        ours = " ".join(f"{k}={config.get(k)}" for k in RUN_IDENTITY_KEYS)
        raise CheckpointError(f"{path} was trained with {theirs}, but this run asks for {ours}")


def check_same_model(ckpt, model_args, path):
    # Settings added after a checkpoint was written take their defaults, which is what it used.
    saved = {**{f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name not in ckpt["model_args"]},
             **ckpt["model_args"]}
    differ = sorted(k for k in set(saved) | set(model_args)
                    if k not in EXECUTION_KEYS and saved.get(k) != model_args.get(k))
    if differ:
        pairs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {model_args.get(k)!r}" for k in differ)
        raise CheckpointError(f"{path} holds a different model ({pairs})")


def load_model(path, device="cpu"):
    """(GPT in eval mode with the checkpoint's weights, checkpoint dict)."""
    ckpt = load_checkpoint(path)
    try:
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: cannot build the model from it ({reason})") from None
    model.to(device)
    model.eval()
    return model, ckpt
