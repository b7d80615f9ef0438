"""Checkpoints: atomic save, cleanup of temporary files a killed save left, load with one-line
errors, what a run folder holds (a checkpoint, a finished run), a failed save as one line, and
model loading for analysis and sampling.

A checkpoint written by train.py is a dict with keys model (state dict without `_orig_mod.`),
model_args (GPTConfig as a dict), config (TrainConfig as a dict), optimizer, step,
best_val_loss, rng (one entry of RNG states per rank) and data_state (the state of the
training-batch generator). It holds only tensors and plain Python values, so it loads with
torch.load(weights_only=True) and never runs pickled code.
"""

import contextlib
import dataclasses
import errno
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
# The marker file train.py writes into out_dir when a run reaches max_iters; it holds that step.
DONE_FILE = "done"


class CheckpointError(Exception):
    """A missing, truncated, corrupt or incompatible checkpoint, as one line."""


class SaveError(Exception):
    """A checkpoint save that failed, as one line that names the checkpoint kept on disk."""


def save_checkpoint(path, obj):
    """Write obj with torch.save to a temporary file `<path>.<random>.tmp` in the same directory,
    fsync it, then rename it over `path`: a crash at any moment leaves either the old file or the
    new one, whole. The writer holds an exclusive flock on the temporary file until it is renamed,
    so remove_stale_temp_files can tell a save in progress from one whose process died. When a
    write fails (a full disk), the OSError is raised, not the RuntimeError torch's writer makes of it."""
    directory = os.path.dirname(os.path.abspath(path))
    f, tmp_path = _locked_temp_file(path)
    writer = _ErrorKeepingWriter(f)
    try:
        with f:
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp_path, path)  # still locked: never an unlocked file under a temp name
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        if writer.error is not None and writer.error is not e:
            raise writer.error from None
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


class _ErrorKeepingWriter:
    """The file object torch.save writes through: it keeps the first OSError of a write (its errno
    says why), which torch's zip writer would otherwise turn into "unexpected pos"."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self):
        self.f.flush()


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


def has_checkpoint(path):
    """Whether a checkpoint is saved at path (a save in progress or killed is only a temp file)."""
    return os.path.isfile(path)


def finished_step(out_dir):
    """The step recorded in out_dir's `done` marker, or None when the run has not finished."""
    try:
        with open(os.path.join(out_dir, DONE_FILE), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def checkpoint_bytes(path):
    """The size of the checkpoint at path (0 when there is none)."""
    return os.path.getsize(path) if has_checkpoint(path) else 0


def free_bytes(directory):
    """Bytes an unprivileged writer can still put into directory's filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def low_space_warning(path):
    """A warning line when the folder of path has less free space than the checkpoint there takes:
    the next save writes a new one beside it before the old one goes, and would fail. None otherwise."""
    size = checkpoint_bytes(path)
    directory = os.path.dirname(os.path.abspath(path))
    free = free_bytes(directory)
    if free >= size:
        return None
    return (f"warning: {directory} has {free / 1e6:.1f} MB free, less than the {size / 1e6:.1f} MB of {path}; "
            f"the next checkpoint save will fail with a full disk unless space is freed")


def save_failure_line(error, path, step, kept_step):
    """One line for an exception raised while saving the checkpoint of `step` to path: what
    failed (a full disk found by the errno in the exception's chain, a denied permission, a
    vanished folder, or the exception's own first line), where, and which checkpoint is kept
    (kept_step, the step of the last good save; None before the first)."""
    directory = os.path.dirname(os.path.abspath(path))
    os_error = _os_error_in(error)
    code = os_error.errno if os_error is not None else None
    if code == errno.ENOSPC:
        why = f"the disk is full (ENOSPC, no space left on device in {directory})"
    elif code == errno.EDQUOT:
        why = f"the disk quota is used up (EDQUOT) in {directory}"
    elif code in (errno.EACCES, errno.EPERM):
        why = f"permission denied writing to {directory}"
    elif code == errno.EROFS:
        why = f"{directory} is on a read-only filesystem"
    elif not os.path.isdir(directory):
        why = f"the folder {directory} no longer exists"
    else:
        shown = os_error if os_error is not None else error
        message = str(shown).strip().splitlines()[0][:200] if str(shown).strip() else ""
        why = f"{type(shown).__name__}: {message}" if message else type(shown).__name__
    if has_checkpoint(path) and kept_step is not None:
        kept = f"{path} keeps the checkpoint of step {kept_step}; continue from it with --init_from=auto"
    else:
        kept = f"no checkpoint is kept in {directory}"
    return f"saving the checkpoint of step {step} to {path} failed: {why}; {kept}"


def _os_error_in(error):
    """The first OSError in error's chain of causes and contexts, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


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
