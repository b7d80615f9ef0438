"""The checkpoints of a training run: the state they hold (TrainState), and CheckpointManager,
which decides how a run starts (scratch, resume, or finished), restores it, saves when due, keeps
the newest, says when the disk is too full for the next save and writes the `done` marker."""

import contextlib
import dataclasses
import errno
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from checkpoint.resume import (check_format_matches, check_same_data, check_same_model, check_same_run,
                               optimizer_settings, resume_notes)
from checkpoint.sharded import (SHARDED_NAME, STAGER_REUSE_TORCH, is_complete_sharded, load_sharded, load_sharded_run,
                                new_stager, one_line, recover_sharded, sharded_folders, sharded_path,
                                start_sharded_save)
from checkpoint.single_file import (KEPT_FILE, CheckpointError, keep_previous, load_checkpoint, remove_stale_kept,
                                    remove_stale_temp_files, save_checkpoint)
from model import GPT

# The marker file train.py writes into out_dir when a run reaches max_iters; it holds that step.
DONE_FILE = "done"


class SaveError(Exception):
    """A checkpoint save that failed, as one line that names the checkpoint kept on disk."""


def has_checkpoint(path):
    """Whether a complete checkpoint is saved at path: the file ckpt.pt, or a sharded ckpt.dcp whose
    link names a complete folder (a save in progress or killed is only a temp file, or a folder no
    link names)."""
    return os.path.isfile(path) or is_complete_sharded(path)


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


@dataclasses.dataclass
class TrainState:
    """The run's state, which a checkpoint holds with the run's settings (config) and each rank's
    RNG states (rng), both added by CheckpointManager. state_dict() says what it holds: the model
    (unwrapped) and its optimizer, the model's settings (model_args, which rebuild it), the
    optimizer steps done, the best val loss, and the training-batch generator as the data position
    (data_state). Only tensors and plain Python values, so a checkpoint loads with
    torch.load(weights_only=True) and never runs pickled code. A sharded checkpoint writes the
    model and optimizer through DCP, the rest as its run.pt."""
    model: GPT
    optimizer: torch.optim.Optimizer
    train_generator: torch.Generator
    step: int = 0
    best_val_loss: float = math.inf

    def state_dict(self, weights=True):
        """The checkpoint's items of this state; weights=False leaves out model and optimizer."""
        state = dict(model_args=dataclasses.asdict(self.model.config), step=self.step, best_val_loss=self.best_val_loss,
                     data_state=dict(train_generator=self.train_generator.get_state()))
        if weights:
            state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        return state

    def load_state_dict(self, state, weights=True):
        """Continue from a checkpoint's items (weights=False: the model and optimizer hold theirs
        already, as a sharded checkpoint's come in through DCP)."""
        if weights:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.train_generator.set_state(state["data_state"]["train_generator"])
        self.step, self.best_val_loss = state["step"], state["best_val_loss"]


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
        """Continue from the checkpoint that load() read (None: a fresh start, nothing to do), or
        for a sharded model from the sharded checkpoint, read into its shards with the optimizer
        state; refuses a checkpoint of another model. Returns the step it continues from (None for
        a fresh start)."""
        if ckpt is None:
            return None
        check_same_model(ckpt, dataclasses.asdict(state.model.config), self.path)
        check_format_matches(ckpt, self.world.sharded, self.path)
        with optimizer_settings(state.optimizer):
            if self.world.sharded:
                load_sharded(self.path, state.model, state.optimizer)
            state.load_state_dict(ckpt, weights=not self.world.sharded)
        set_rng_state(ckpt["rng"][self.world.rank % len(ckpt["rng"])], self.world.device)  # the world size may change
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
        added = dict(config=dataclasses.asdict(self.cfg), rng=rng)  # what a checkpoint holds besides the state
        self.wait()  # the save before this one
        error = None
        try:
            if self.stager is not None and torch.__version__ < STAGER_REUSE_TORCH:
                self.stager.close()
                self.stager = new_stager(self.world.device)
            if self.world.sharded:
                self.in_flight = start_sharded_save(self.path, state.model, state.optimizer,
                                                    dict(state.state_dict(weights=False), **added),
                                                    self.cfg.keep_checkpoints, self.group, self.stager)
            elif self.world.master:
                if self.cfg.keep_checkpoints > 1 and self.saved_step is not None:
                    keep_previous(self.path, self.saved_step)
                save_checkpoint(self.path, dict(state.state_dict(), **added))
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
