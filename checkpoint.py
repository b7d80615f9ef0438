"""Checkpoints: atomic save, cleanup of temporary files a killed save left, load with one-line
errors, what a run folder holds (a checkpoint, a finished run), a failed save as one line, model
loading for analysis and sampling, and CheckpointManager, which runs a training's checkpoints
(the start decision, restore, when to save, which to keep, the `done` marker), and StopFlag, which
stops a training at a step boundary for a signal or a stop request so that it saves first.

A checkpoint written by train.py is a dict with keys model (state dict without `_orig_mod.`),
model_args (GPTConfig as a dict), config (TrainConfig as a dict), optimizer, step,
best_val_loss, rng (one entry of RNG states per rank) and data_state (the state of the
training-batch generator). It holds only tensors and plain Python values, so it loads with
torch.load(weights_only=True) and never runs pickled code.

A sharded checkpoint (train.py --parallel=fsdp) is the folder <out_dir>/ckpt.dcp, a link to the
newest complete `ckpt.dcp.<step>` folder: torch.distributed.checkpoint's files, one per rank, with
the model and optimizer state ("model", "optimizer"), and run.pt with everything else of the dict
above; a folder is complete once it holds run.pt and DCP's index, .metadata (written last). It
loads on any number of processes, or into a plain model in one process (load_model); its pickled
index is read with an unpickler that builds only DCP's own metadata classes.
"""

import contextlib
import dataclasses
import errno
import fcntl
import functools
import io
import json
import math
import os
import pathlib
import pickle
import random
import re
import shutil
import signal
import tempfile
import threading
import warnings

import numpy as np
import torch
import torch.distributed as dist

from model import GPT, GPTConfig

# torch.distributed.checkpoint (DCP) is imported in the functions of sharded checkpoints only: it is
# slow to import, and sampling, export, analysis and unsharded runs all import this module.

REQUIRED_KEYS = ("model", "model_args", "config", "step")
SHARDED_NAME = "ckpt.dcp"  # the link to the newest complete sharded checkpoint in an out_dir
RUN_STATE_FILE = "run.pt"  # a sharded checkpoint's small items: settings, step, RNG states, data position
# Config keys that decide what a run is; resuming with another value would train a different model.
RUN_IDENTITY_KEYS = ("residual", "size", "n_streams")
# Model settings that change how the same model is computed, not what it is; free to change on resume.
EXECUTION_KEYS = ("fused_connections",)
# The marker file train.py writes into out_dir when a run reaches max_iters; it holds that step.
DONE_FILE = "done"
STOP_REQUEST_FILE = "stop"  # in out_dir: stop at the next step boundary, save, exit 0
STOP_REQUESTED = -1  # StopFlag.agreed() for the request file; signals are positive
KEPT_FILE = re.compile(r"ckpt\.(\d+)\.pt")  # an older checkpoint kept beside ckpt.pt (--keep_checkpoints)


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


def keep_previous(path, step):
    """Before ckpt.pt (path) is replaced, keep its checkpoint of `step` as ckpt.<step>.pt: a second
    name for the same file (a copy where the filesystem has no hard links)."""
    kept = os.path.join(os.path.dirname(os.path.abspath(path)), f"ckpt.{step}.pt")
    if os.path.isfile(path) and not os.path.exists(kept):
        try:
            os.link(path, kept)
        except OSError:
            shutil.copyfile(path, kept)


def remove_stale_kept(out_dir, keep):
    """Delete the ckpt.<step>.pt files beyond the newest keep - 1 (ckpt.pt is the newest)."""
    names = sorted((m for m in map(KEPT_FILE.fullmatch, os.listdir(out_dir)) if m), key=lambda m: int(m[1]))
    for m in names[:max(len(names) - (keep - 1), 0)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out_dir, m[0]))


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
    """Whether a complete checkpoint is saved at path: the file ckpt.pt, or a sharded ckpt.dcp whose
    link names a folder with DCP's index (a save in progress or killed is only a temp file, or a
    folder no link names)."""
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, ".metadata"))


def finished_step(out_dir):
    """The step recorded in out_dir's `done` marker, or None when the run has not finished."""
    try:
        with open(os.path.join(out_dir, DONE_FILE), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def disk_bytes(paths):
    """Bytes of the files at paths (files, or folders read through a link once), each file counted
    once however many names or links reach it: what the disk really holds for them."""
    seen, total = set(), 0
    for path in paths:
        if os.path.isdir(path):
            files = [entry.path for entry in os.scandir(os.path.realpath(path)) if entry.is_file()]
        else:
            files = [path] if os.path.isfile(path) else []
        for file in files:
            st = os.stat(file)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def checkpoint_bytes(path):
    """The size of the checkpoint at path, a file or a sharded folder (0 when there is none)."""
    return disk_bytes([path]) if has_checkpoint(path) else 0


def run_checkpoints(out_dir):
    """Every checkpoint kept in out_dir: ckpt.pt, ckpt.<step>.pt, ckpt.dcp and its ckpt.dcp.* folders."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    single = [name for name in names if name == "ckpt.pt" or KEPT_FILE.fullmatch(name)]
    return [os.path.join(out_dir, name) for name in single + [SHARDED_NAME] + sharded_folders(out_dir)]


def free_bytes(directory):
    """Bytes an unprivileged writer can still put into directory's filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def low_space_warning(path):
    """A warning line when the folder of path has less free space than the checkpoint there takes:
    the next save writes a new one beside the kept ones before the oldest goes, and would fail.
    None otherwise."""
    size = checkpoint_bytes(path)
    directory = os.path.dirname(os.path.abspath(path))
    free = free_bytes(directory)
    if free >= size:
        return None
    total = disk_bytes(run_checkpoints(directory))
    kept = f" (with the checkpoints kept beside it, {total / 1e6:.1f} MB)" if total > size else ""
    return (f"warning: {directory} has {free / 1e6:.1f} MB free, less than the {size / 1e6:.1f} MB of {path}{kept}; "
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


def load_checkpoint(path, required=REQUIRED_KEYS):
    """Load a train.py checkpoint onto the CPU; raises CheckpointError with one line."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for damaged files; all mean the same here
        reason = str(e).strip().split(". ")[0].splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is truncated, corrupt or not a checkpoint ({reason})") from None
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
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


# Settings a resume keeps from the checkpoint, and what each fixes.
KEPT_ON_RESUME = {"seed": "the eval batches and the model's seeded choices",
                  "dataset": "the corpus the data position refers to"}
# Settings a resume takes from this run, saying so: the optimizer's, the schedule's and the batch's.
APPLIED_ON_RESUME = ("learning_rate", "min_lr", "warmup_iters", "weight_decay", "beta1", "beta2", "grad_clip",
                     "batch_size", "gradient_accumulation_steps", "eval_iters")


def check_same_data(ckpt, config, path):
    """Refuse to resume with another seed or dataset: both are what the run's data is (settings
    a checkpoint predates are not checked)."""
    saved = ckpt["config"]
    for key, fixes in KEPT_ON_RESUME.items():
        if key in saved and saved[key] != config.get(key):
            raise CheckpointError(f"{path} was trained with {key}={saved[key]}, but this run asks for "
                                  f"{key}={config.get(key)}; a resume keeps the {key} ({fixes}): pass "
                                  f"--{key}={saved[key]}, or start a new run in another --out_dir")


def resume_notes(ckpt, cfg):
    """The lines a resume prints about settings that differ from the checkpoint's run: the
    schedule's horizon when lr_decay_iters moved, and the optimizer, schedule and batch settings
    that take this run's values from the next step on."""
    saved, notes = ckpt["config"], []
    if saved.get("lr_decay_iters", cfg.lr_decay_iters) != cfg.lr_decay_iters:
        notes.append(f"note: resuming with lr_decay_iters={cfg.lr_decay_iters} (max_iters={cfg.max_iters}) where the "
                     f"checkpoint's run had lr_decay_iters={saved['lr_decay_iters']} (max_iters={saved['max_iters']}): "
                     f"the cosine schedule's horizon moves; pass --lr_decay_iters={saved['lr_decay_iters']} "
                     f"to keep the old schedule")
    changed = [f"{key}={getattr(cfg, key)} (was {saved[key]})" for key in APPLIED_ON_RESUME
               if key in saved and saved[key] != getattr(cfg, key)]
    if changed:
        notes.append(f"note: resuming with settings that differ from the checkpoint's run, applied from step "
                     f"{ckpt['step'] + 1} on: {', '.join(changed)}")
    return notes


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
    """(GPT in eval mode with the checkpoint's weights, checkpoint dict). path: a ckpt.pt, or a
    sharded checkpoint folder (ckpt.dcp) read in this one process; its dict then has no "model"."""
    sharded = os.path.isdir(path)
    ckpt = load_sharded_run(path) if sharded else load_checkpoint(path)
    try:
        model = GPT(GPTConfig(**ckpt["model_args"]))
        if sharded:
            load_sharded(path, model)
        else:
            model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: cannot build the model from it ({reason})") from None
    model.to(device)
    model.eval()
    return model, ckpt


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint)


def sharded_path(out_dir):
    return os.path.join(out_dir, SHARDED_NAME)


def find_checkpoint(out_dir):
    """The checkpoint of a run folder for reading: ckpt.pt, else the sharded ckpt.dcp if there is
    one (else ckpt.pt's path, which load_model reports as not found)."""
    single = os.path.join(out_dir, "ckpt.pt")
    return sharded_path(out_dir) if not os.path.isfile(single) and os.path.isdir(sharded_path(out_dir)) else single


def save_sharded(path, model, optimizer, run_state, keep=1):
    """Save to the sharded checkpoint `path` (<out_dir>/ckpt.dcp) and wait until it is published.
    Every rank calls it (start_sharded_save says how); raises the first failure on the rank that
    met it. The caller syncs the ranks after it (CheckpointManager shares every rank's outcome)."""
    start_sharded_save(path, model, optimizer, run_state, keep).finish()


def start_sharded_save(path, model, optimizer, run_state, keep=1, group=None, stager=None):
    """Start a save to the sharded checkpoint `path`; returns the ShardedSave that publishes it.
    Every rank calls it: rank 0 writes run.pt (run_state: a checkpoint dict without model and
    optimizer) into a new folder `ckpt.dcp.<step>`, then each rank writes its own shards of the
    model (sharded by parallelize.apply_fsdp) and of its optimizer there. With a stager (DCP's
    AsyncStager, new_stager) the save is asynchronous: the stager copies the shards into CPU
    memory here, and a background thread writes them, its collectives going through `group` (a
    gloo group apart from training's); the model may train on meanwhile."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out_dir = os.path.dirname(os.path.abspath(path))
    names = [_fresh_folder_name(out_dir, run_state["step"]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names)
    folder, error = os.path.join(out_dir, names[0]), None
    if dist.get_rank() == 0:
        try:
            os.makedirs(folder)
            save_checkpoint(os.path.join(folder, RUN_STATE_FILE), run_state)
        except Exception as e:  # torch's writer raises RuntimeError as well as OSError
            error = e
    started = [error is None]
    dist.broadcast_object_list(started)  # no rank goes into DCP's collectives alone
    save = ShardedSave(out_dir, names[0], run_state["step"], keep)
    if not started[0]:
        save.remove_folder()
        raise error if error is not None else OSError("rank 0 could not start the checkpoint")
    try:
        fresh = not optimizer.state
        model_state, optimizer_state = get_state_dict(model, optimizer)
        if fresh:  # get_state_dict built the state with one zero-gradient step: AdamW's state before any step
            for param_state in optimizer.state.values():
                param_state["step"].zero_()
        state = dict(model=model_state, optimizer=optimizer_state)
        writer = dcp.FileSystemWriter(folder, sync_files=True)
        if stager is not None:
            save.future = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
        else:
            try:
                dcp.save(state, storage_writer=writer)
            except CheckpointException as e:  # a BaseException: raise the first rank's own exception instead
                raise first_exception(e) from None
    except BaseException:
        save.remove_folder()
        raise
    return save


STAGER_REUSE_TORCH = (2, 13)  # before it, DefaultStager closes itself after one stage (torch 2.11 does)


def new_stager(device):
    """DCP's stager for asynchronous saves: it keeps the CPU copy of each tensor from one save to
    the next (allocating it anew each time costs more than the copy), pinned for a GPU. Before
    STAGER_REUSE_TORCH a stager serves one save: the manager makes one per save there."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    # by position, as async_save builds its own (the last field's name differs between torch versions):
    # pinned memory, shared memory, staging in a thread, non-blocking copies
    return DefaultStager(StagingOptions(device.type == "cuda", False, False, False))


class ShardedSave:
    """A sharded save that has started: `future` (None when it was written in the call) says when
    every rank's shards and DCP's index, .metadata, are on disk; finish() waits for it, then rank 0
    points the link ckpt.dcp at the folder with an atomic rename and keeps the newest `keep`
    complete folders. A crash or a failure at any point before the rename leaves the link on the
    previous complete checkpoint; what the failed save wrote is removed."""

    def __init__(self, out_dir, name, step, keep, future=None):
        self.out_dir, self.name, self.step, self.keep, self.future = out_dir, name, step, keep, future

    def done(self):
        return self.future is None or self.future.done()

    def finish(self):
        """Wait for the write, then publish it; raises the first rank's exception if it failed."""
        from torch.distributed.checkpoint.api import CheckpointException
        linked = False
        try:
            if self.future is not None:
                try:
                    self.future.result()
                except CheckpointException as e:  # a BaseException: raise the first rank's own exception instead
                    raise first_exception(e) from None
            if dist.get_rank() == 0:
                _fsync_dir(os.path.join(self.out_dir, self.name))  # .metadata's rename made durable
                _point_link(self.out_dir, self.name)
                linked = True
                remove_stale_sharded(self.out_dir, self.keep)
        except BaseException:
            if not linked:
                self.remove_folder()
            raise

    def remove_folder(self):
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(self.out_dir, self.name), ignore_errors=True)


def first_exception(e):
    """The first rank's exception in DCP's CheckpointException (its errno tells a full disk), or
    an OSError with its line."""
    failures = [failure[0] for failure in e.failures.values()]
    if failures and isinstance(failures[0], Exception):
        return failures[0]
    return OSError(first_failure(e))


def first_failure(e):
    """The first rank's exception in DCP's CheckpointException, as one line."""
    failures = list(e.failures.values())
    return one_line(failures[0][0]) if failures else "CheckpointException"


def one_line(e):
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


def _fresh_folder_name(out_dir, step):
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    name, retry = f"{SHARDED_NAME}.{step}", 1
    while name in names:  # a folder of this step left by an earlier attempt, perhaps the live one
        name, retry = f"{SHARDED_NAME}.{step}-{retry}", retry + 1
    return name


def _point_link(out_dir, name):
    """Make the link ckpt.dcp name `name` (relative, so the run folder can move), atomically."""
    tmp_link = os.path.join(out_dir, f".{SHARDED_NAME}.link.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp_link)
    os.symlink(name, tmp_link)
    os.replace(tmp_link, sharded_path(out_dir))
    _fsync_dir(out_dir)


def _fsync_dir(directory):
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


SHARDED_FOLDER = re.compile(re.escape(SHARDED_NAME) + r"\.(\d+)(?:-(\d+))?")


def sharded_folders(out_dir):
    """The ckpt.dcp.<step>[-<retry>] folders of out_dir, oldest first (by step, then retry)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    matches = [m for m in map(SHARDED_FOLDER.fullmatch, names) if m and os.path.isdir(os.path.join(out_dir, m[0]))]
    return [m[0] for m in sorted(matches, key=lambda m: (int(m[1]), int(m[2] or 0)))]


def is_complete_sharded(folder):
    """Whether a sharded checkpoint folder holds its run.pt and DCP's index (written last)."""
    return all(os.path.isfile(os.path.join(folder, name)) for name in (RUN_STATE_FILE, ".metadata"))


def remove_stale_sharded(out_dir, keep=1):
    """Delete the ckpt.dcp.* folders beyond the link's and the keep - 1 complete ones before it:
    replaced checkpoints and what a killed or failed save wrote. Returns the number removed."""
    live = os.path.basename(os.path.realpath(sharded_path(out_dir)))
    folders = sharded_folders(out_dir)
    older = folders[:folders.index(live)] if live in folders else folders
    complete_older = [name for name in older if is_complete_sharded(os.path.join(out_dir, name))]
    kept = {live, *complete_older[max(len(complete_older) - (keep - 1), 0):]}
    stale = [name for name in folders if name not in kept]
    for name in stale:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return len(stale)


def recover_sharded(out_dir, keep=1):
    """Make out_dir's sharded checkpoints usable again at a start, before anything reads them;
    returns what it did, as lines. A ckpt.dcp that is a folder (a run copied with `cp -rL`, or
    to a filesystem without links) becomes the folder of its step, and the link names it; the
    newest complete ckpt.dcp.<step> folder becomes the linked one (a save killed after its write
    and before the link swap left it unlinked); folders beyond the kept ones are removed."""
    link, lines = sharded_path(out_dir), []
    if os.path.isdir(link) and not os.path.islink(link) and is_complete_sharded(link):
        step = load_checkpoint(os.path.join(link, RUN_STATE_FILE), required=("step",))["step"]
        same = os.path.join(out_dir, f"{SHARDED_NAME}.{step}")
        if is_complete_sharded(same):  # `cp -rL` copied the linked folder twice
            shutil.rmtree(link)
        else:
            os.rename(link, os.path.join(out_dir, _fresh_folder_name(out_dir, step)))
        lines.append(f"{link} was a folder, not a link (a copy that followed links): its checkpoint of step {step} "
                     f"is linked again")
    complete = [name for name in sharded_folders(out_dir) if is_complete_sharded(os.path.join(out_dir, name))]
    if os.path.isdir(link) and not os.path.islink(link):
        return lines  # an incomplete copy: not ours to touch; loading it says what is wrong
    live = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
    if complete and complete[-1] != live:
        if not lines:
            lines.append(f"using {complete[-1]}, the newest complete checkpoint in {out_dir}, which a killed save "
                         f"left unlinked")
        _point_link(out_dir, complete[-1])
    removed = remove_stale_sharded(out_dir, keep) if complete else 0
    if removed:
        lines.append(f"removed {removed} checkpoint folder(s) in {out_dir} beyond the {keep} kept, left by saves "
                     f"that were killed, failed or replaced")
    return lines


def load_sharded_run(path):
    """The run state of the sharded checkpoint folder `path` (its dict without model and
    optimizer); raises CheckpointError with one line."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is truncated, corrupt or not a sharded checkpoint (no .metadata)")
    return load_checkpoint(os.path.join(path, RUN_STATE_FILE), required=("model_args", "config", "step"))


def load_sharded(path, model, optimizer=None):
    """Read the weights (and the optimizer state, if given) of the sharded checkpoint folder `path`
    into model: one sharded by parallelize.apply_fsdp on any number of ranks (DCP reshards), or a
    plain GPT in one process. Raises CheckpointError with one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    reader, planner = _safe_reader_and_planner()
    plain = not any(hasattr(p, "device_mesh") for p in model.parameters())
    if plain:
        # the scalars were saved as the 1-element vectors apply_fsdp made of them: views share storage
        state = dict(model={k: v.view(1) if v.dim() == 0 else v for k, v in model.state_dict().items()})
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer if optimizer is not None else [])
        state = dict(model=model_state) if optimizer is None else dict(model=model_state, optimizer=optimizer_state)
    try:
        with warnings.catch_warnings():  # DCP warns that one process reads it, which is what we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader(path), planner=planner(),
                     no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        reason = first_failure(e) if isinstance(e, CheckpointException) else one_line(e)
        raise CheckpointError(f"{path} is truncated, corrupt or not a checkpoint of this model ({reason})") from None
    if plain:
        model.load_state_dict(model.state_dict())  # runs the load hooks: mhclite rebuilds its permutation matrices
    elif optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})


@functools.cache
def metadata_classes():
    """The classes a DCP .metadata file is built from (torch 2.13), and nothing else."""
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    classes = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
               for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    classes.update({("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
                    ("torch", "Size"): torch.Size,
                    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                    ("pathlib", "PosixPath"): pathlib.PosixPath})
    return classes


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds DCP's metadata classes, torch's dtypes and layouts, and refuses
    every other global, so a crafted .metadata cannot run code."""

    def find_class(self, module, name):
        if (module, name) in metadata_classes():
            return metadata_classes()[(module, name)]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


@functools.cache
def _safe_reader_and_planner():
    """DCP's FileSystemReader and DefaultLoadPlanner made safe, as (reader class, planner class):
    the reader reads the pickled metadata with MetadataUnpickler instead of pickle.load (the tensors
    it reads already go through torch.load(weights_only=True)); the planner loads the non-tensor
    items (the optimizer's settings) with torch.load(weights_only=True) instead of a plain
    unpickling. Built on first use, as DCP is imported then."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint._traverse import set_element

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                metadata = MetadataUnpickler(io.BytesIO(f.read())).load()
            if not isinstance(metadata, dcp_metadata.Metadata):
                raise pickle.UnpicklingError("the .metadata file holds no DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeFileSystemReader, SafeLoadPlanner


# ----------------------------------------------------------------------------------------------
# A run's checkpoints: the start decision, restoring, saving, keeping, the `done` marker


@dataclasses.dataclass
class TrainState:
    """The run's state: what a checkpoint holds besides the settings (the model, unwrapped, its
    optimizer, the training-batch generator as the data position, the optimizer steps done and
    the best val loss)."""
    model: GPT
    optimizer: torch.optim.Optimizer
    train_generator: torch.Generator
    step: int = 0
    best_val_loss: float = math.inf


class CheckpointManager:
    """The checkpoints of one run in cfg.out_dir, for every rank of `world` (ddp, rank, size,
    device, sharded, master): ckpt.pt written by rank 0, or with world.sharded the sharded ckpt.dcp
    that every rank writes, asynchronously (the next save, the last one and a signal's wait for
    it). load() makes the start decision and reads the checkpoint, restore() continues from it,
    save() after every step saves when an evaluation improved (or always_save_checkpoint), at
    ckpt_interval, on a signal and at the last step, and finish() writes the `done` marker. A
    failed save is one SaveError line on every rank, naming the checkpoint kept."""

    def __init__(self, cfg, world, log=print, asynchronous=True):
        self.cfg, self.world, self.log = cfg, world, log
        self.path = sharded_path(cfg.out_dir) if world.sharded else os.path.join(cfg.out_dir, "ckpt.pt")
        self.finished = False  # auto on a run that already reached max_iters: nothing to do
        self.saved_step = None  # the step of the newest published checkpoint
        self.started_step = None  # the step of the newest save started
        self.in_flight = None  # a sharded save still writing (ShardedSave)
        self.outcome = None  # (step, exception or None) of a sharded save finished on this rank, not yet shared
        self.asynchronous = asynchronous and world.sharded
        self.group = dist.new_group(backend="gloo") if self.asynchronous and world.ddp else None
        self.stager = new_stager(world.device) if self.asynchronous else None

    # -- the start

    def load(self):
        """The checkpoint to continue, checked against this run, or None for a fresh start (and
        for a finished run: then self.finished, and rank 0 said so)."""
        cfg = self.cfg
        mode = self._start_mode()
        if mode == "finished":
            self.finished = True
            if self.world.master:
                self.log(f"nothing to do: {cfg.out_dir} finished at step {finished_step(cfg.out_dir)} "
                         f"(max_iters={cfg.max_iters})")
            return None
        if mode == "scratch":
            for path, parallel in ((os.path.join(cfg.out_dir, "ckpt.pt"), "ddp"), (sharded_path(cfg.out_dir), "fsdp")):
                if os.path.lexists(path):
                    how = "" if parallel == cfg.parallel else f" and --parallel={parallel}"
                    raise CheckpointError(f"{path} exists; continue it with --init_from=resume (or auto){how} "
                                          f"or pick another --out_dir")
            return None
        ckpt = load_sharded_run(self.path) if self.world.sharded else load_checkpoint(self.path)
        check_same_run(ckpt, dataclasses.asdict(cfg), self.path)
        check_same_data(ckpt, dataclasses.asdict(cfg), self.path)
        if self.world.master:
            for line in resume_notes(ckpt, cfg):
                self.log(line)
        return ckpt

    def _start_mode(self):
        """"scratch", "resume", or "finished" (auto on a run whose `done` marker reached max_iters).
        Rank 0 first repairs the sharded checkpoints a copy or a killed save left (recover_sharded),
        then for auto looks into out_dir, and tells the others, so that every rank goes the same
        way, or raises the same error."""
        decision = [None]
        if self.world.master:
            try:
                if self.world.sharded and self.cfg.init_from != "scratch":
                    for line in recover_sharded(self.cfg.out_dir, self.cfg.keep_checkpoints):
                        self.log(line)
                mode = self._auto_start_mode() if self.cfg.init_from == "auto" else self.cfg.init_from
                decision = [(mode, None)]
            except CheckpointError as e:
                decision = [(None, str(e))]
            except OSError as e:
                decision = [(None, f"cannot repair the checkpoints in {self.cfg.out_dir}: {one_line(e)}")]
        if self.world.ddp:
            dist.broadcast_object_list(decision, src=0)
        mode, error = decision[0]
        if error is not None:
            raise CheckpointError(error)
        return mode

    def _auto_start_mode(self):
        cfg = self.cfg
        done = finished_step(cfg.out_dir)
        if done is not None and done >= cfg.max_iters:
            config_path = os.path.join(cfg.out_dir, "config.json")
            try:
                with open(config_path, encoding="utf-8") as f:
                    saved = json.load(f)
            except (OSError, ValueError):
                saved = None  # written at every start; a kill may have cut it, and the marker came later
            if isinstance(saved, dict):
                check_same_run(dict(config=saved), dataclasses.asdict(cfg), config_path)
            return "finished"
        return "resume" if has_checkpoint(self.path) else "scratch"

    def restore(self, state, ckpt):
        """Continue from a checkpoint whose weights the model already holds, or for a sharded model
        from the sharded checkpoint, read into its shards with the optimizer state; returns the step
        it continues from (None for a fresh start, ckpt None: nothing to do)."""
        if ckpt is None:
            return None
        settings = [dict(weight_decay=group["weight_decay"], betas=group["betas"])
                    for group in state.optimizer.param_groups]
        if self.world.sharded:
            load_sharded(self.path, state.model, state.optimizer)
        elif "optimizer" not in ckpt:
            raise CheckpointError(f"{self.path} holds weights only (written from a sharded checkpoint); continue "
                                  f"the run from its ckpt.dcp with --parallel=fsdp")
        else:
            state.optimizer.load_state_dict(ckpt["optimizer"])
        for group, values in zip(state.optimizer.param_groups, settings):
            group.update(values)  # this run's settings, not the checkpoint's (resume_notes says which changed)
        state.train_generator.set_state(ckpt["data_state"]["train_generator"])
        set_rng_state(ckpt["rng"][self.world.rank % len(ckpt["rng"])], self.world.device)  # the world size may change
        state.step, state.best_val_loss = ckpt["step"], ckpt["best_val_loss"]
        self.saved_step = self.started_step = state.step
        return state.step

    def prepare(self, step):
        """Rank 0, before training from `step`: no stale `done` marker, no temporary files or
        folders of killed saves, and a warning if the disk has no room for the next save."""
        done_path = os.path.join(self.cfg.out_dir, DONE_FILE)
        if os.path.exists(done_path) and step < self.cfg.max_iters:
            os.remove(done_path)
        removed, freed = remove_stale_temp_files(os.path.join(self.cfg.out_dir, "ckpt.pt"))
        if removed:
            self.log(f"removed {removed} stale checkpoint temp file(s) in {self.cfg.out_dir} ({freed / 1e6:.1f} MB), "
                     f"left by a save that was killed")
        self.warn_if_low_space()

    # -- saving

    def due(self, step):
        """Whether ckpt_interval asks for a save after this step."""
        return self.cfg.ckpt_interval > 0 and step % self.cfg.ckpt_interval == 0

    def save(self, state, val_loss=None, stopping=False, force=False):
        """Every rank calls it after a step whose losses were checked (and after the first
        evaluation), with the step's val loss if it evaluated and whether the run stops here (a
        signal or a stop request). Saves when the val loss improved (or on always_save_checkpoint),
        at ckpt_interval, on a stop, at the last step or when forced; a stop's save and the last one
        are complete on return."""
        improved = val_loss is not None and val_loss < state.best_val_loss
        if val_loss is not None:
            state.best_val_loss = min(state.best_val_loss, val_loss)
        last = state.step >= self.cfg.max_iters
        evaluated = val_loss is not None and (improved or self.cfg.always_save_checkpoint)
        if (evaluated or self.due(state.step) or stopping or last or force) and self.started_step != state.step:
            self._write(state)
        if stopping or last or not self.asynchronous:
            self.wait()
        elif self.in_flight is not None and self.in_flight.done():
            self._settle()  # publish it now: the link names the newest checkpoint as early as possible

    def _write(self, state):
        rng = [rng_state(self.world.device)]
        if self.world.ddp:
            rng = [None] * self.world.size
            dist.all_gather_object(rng, rng_state(self.world.device))
        run_state = dict(model_args=dataclasses.asdict(state.model.config), config=dataclasses.asdict(self.cfg),
                         step=state.step, best_val_loss=state.best_val_loss, rng=rng,
                         data_state=dict(train_generator=state.train_generator.get_state()))
        self.wait()  # the save before this one
        error = None
        try:
            if self.stager is not None and torch.__version__ < STAGER_REUSE_TORCH:
                self.stager.close()
                self.stager = new_stager(self.world.device)
            if self.world.sharded:
                self.in_flight = start_sharded_save(self.path, state.model, state.optimizer, run_state,
                                                    self.cfg.keep_checkpoints, self.group, self.stager)
            elif self.world.master:
                if self.cfg.keep_checkpoints > 1 and self.saved_step is not None:
                    keep_previous(self.path, self.saved_step)
                save_checkpoint(self.path, dict(model=state.model.state_dict(),
                                                 optimizer=state.optimizer.state_dict(), **run_state))
                remove_stale_kept(self.cfg.out_dir, self.cfg.keep_checkpoints)
        except Exception as e:  # torch's writer raises RuntimeError as well as OSError
            error = e
        self._raise_if_failed(error, state.step)
        self.started_step = state.step
        if not self.world.sharded:
            self._published(state.step)

    def _settle(self):
        """This rank: wait for the sharded save in flight and publish it; keep its outcome."""
        save, self.in_flight = self.in_flight, None
        try:
            save.finish()
            self.outcome = (save.step, None)
        except Exception as e:
            self.outcome = (save.step, e)

    def wait(self):
        """Every rank: the save in flight is complete and published, or every rank raises the
        SaveError of its failure, however late it was found."""
        if self.in_flight is not None:
            self._settle()
        if self.outcome is not None:
            (step, error), self.outcome = self.outcome, None
            self._raise_if_failed(error, step)
            self._published(step)

    def _published(self, step):
        self.saved_step = step
        if self.world.master:
            self.warn_if_low_space()

    def _raise_if_failed(self, error, step):
        """Share every rank's outcome of a save (error: its exception, or None): if any rank's part
        failed, every rank raises the same SaveError line, which names the checkpoint still on disk,
        so that all ranks stop together instead of waiting for the one that left."""
        line = None if error is None else save_failure_line(error, self.path, step, self.saved_step)
        lines = [line]
        if self.world.ddp:
            lines = [None] * self.world.size
            dist.all_gather_object(lines, line)
        failed = [line for line in lines if line is not None]
        if failed:
            raise SaveError(failed[0])

    def warn_if_low_space(self):
        """Rank 0: say before the next save whether it would run out of disk."""
        warning = low_space_warning(self.path)
        if warning:
            self.log(warning)

    # -- the end

    def finish(self, state):
        """After the last step: the final checkpoint complete, then rank 0 writes the `done` marker."""
        if self.started_step != state.step:
            self._write(state)
        self.wait()
        if self.world.master:
            with open(os.path.join(self.cfg.out_dir, DONE_FILE), "w", encoding="utf-8") as f:
                f.write(f"{state.step}\n")
            self.log(f"done: step {state.step}, best val loss {state.best_val_loss:.4f}, checkpoint {self.path}")

    def kept(self):
        """What is kept after a failure in training (a save still writing completes first)."""
        with contextlib.suppress(SaveError):
            self.wait()
        return ("no checkpoint was saved" if self.saved_step is None else
                f"{self.path} keeps the last good checkpoint (step {self.saved_step})")

    def close(self):
        """On any exit: a save still writing completes and is published if it can be, quietly."""
        if self.in_flight is not None:
            self._settle()
        if self.stager is not None:
            self.stager.close()


def rng_state(device):
    """This process's RNG states as tensors and plain values (loadable with weights_only)."""
    _, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    return dict(python=random.getstate(),
                numpy=dict(keys=torch.from_numpy(np_keys.astype(np.int64)), pos=np_pos,
                           has_gauss=np_has_gauss, cached_gaussian=np_cached),
                torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(state, device):
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def write_single_file(sharded, path):
    """Write the weights and run state of the sharded checkpoint folder `sharded` as one ckpt.pt
    at `path`, for tools that want a file; it has no optimizer state: continue the run from the
    sharded checkpoint."""
    model, ckpt = load_model(sharded)
    save_checkpoint(path, dict(ckpt, model=model.state_dict()))


# ----------------------------------------------------------------------------------------------
# Stopping at a step boundary, with a checkpoint


class StopFlag:
    """Stops the loop at the next step boundary, where it saves and exits, on SIGTERM or SIGINT
    (exit code 128 + the signal number; torchrun passes them on to its workers and itself exits
    with 1) or on a request: the file `stop` in out_dir, which rank 0 looks for at every step
    (scripts/slurm_train.sbatch writes it before the time limit). A request ends with exit code 0,
    so that torchrun does not restart the workers, and is removed once served. All ranks agree
    through a CPU (gloo) all-reduce, which never waits for the GPU."""

    def __init__(self, ddp, device, master, out_dir):
        self.signum = 0
        self.master = master
        self.request_path = os.path.join(out_dir, STOP_REQUEST_FILE) if master else None
        self.group = None
        if ddp:
            self.group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers need it
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self):
        """0 to go on; else the signal number, or STOP_REQUESTED for the request file."""
        requested = self.request_path is not None and os.path.exists(self.request_path)
        flag = torch.tensor([self.signum, int(requested)])
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        signum, requested = flag.tolist()
        return signum or (STOP_REQUESTED if requested else 0)

    def finish(self, stopped, step, path, log=print):
        """After the stop's save: says why the run stopped (rank 0) and returns the exit code; a
        served request is removed."""
        if self.master:
            cause = f"the request {STOP_REQUEST_FILE} in the run folder" if stopped == STOP_REQUESTED else \
                f"signal {stopped}"
            log(f"stopped by {cause} after step {step}; checkpoint saved to {path}; continue with --init_from=auto "
                f"(or resume)")
        if stopped != STOP_REQUESTED:
            return 128 + stopped
        if self.request_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.request_path)
        return 0

    def restore(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def main(argv=None):
    import argparse
    import sys
    p = argparse.ArgumentParser(description="Write a sharded checkpoint (a --parallel=fsdp run's ckpt.dcp) as "
                                            "one ckpt.pt with its weights and run state, read in this one process.")
    p.add_argument("sharded", help="the sharded checkpoint folder, e.g. out/run/ckpt.dcp")
    p.add_argument("single_file", help="the ckpt.pt to write, e.g. out/run-single/ckpt.pt")
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.single_file))):
            raise CheckpointError(f"no folder for {args.single_file}")
        write_single_file(args.sharded, args.single_file)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
