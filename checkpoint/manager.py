"""The checkpoints of a training run: CheckpointManager decides how a run starts (from scratch, by
resuming the newest checkpoint that loads and verifies, or not at all for a finished run), restores
the run's states from it, saves them when due through the run's storage (one file, or sharded),
keeps the newest, says when the disk is too full for the next save, and writes the `done` marker.

A start never throws saved training away: it changes nothing in the folder before it has decided,
skips a missing or damaged newest checkpoint for the next older one (saying so), and refuses, in
one line, a folder it cannot continue or would overwrite.
"""

import contextlib
import dataclasses
import errno
import json
import os

import torch.distributed as dist

from checkpoint.files import CheckpointError, Damaged, Found
from checkpoint.resume import check_same_data, check_same_data_files, check_same_run, resume_notes
from checkpoint.sharded import ShardedStorage, is_complete_sharded, one_line, sharded_folders
from checkpoint.single_file import KEPT_FILE, OneFileStorage

DONE_FILE = "done"  # written into out_dir when a run reaches max_iters; it holds that step
METRICS_FILE = "metrics.jsonl"


class SaveError(Exception):
    """A checkpoint save that failed, as one line that names the checkpoint kept on disk."""


@dataclasses.dataclass
class Start:
    """What a start decided: its mode ("scratch", "resume" or "finished"), and for a resume the
    checkpoint it continues, whether its digests verified, the newer ones it skipped (each with
    why), and the lines rank 0 prints about it."""
    mode: str
    found: Found | None = None
    verified: bool = False
    skipped: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)


class CheckpointManager:
    """The checkpoints of one run in cfg.out_dir, for every rank of `world` (distributed, rank,
    size, device, sharded, master), through one storage: the one file ckpt.pt that rank 0 writes,
    or with world.sharded the sharded ckpt.dcp that every rank writes, asynchronously (the next
    save, the last one and a signal's wait for it). load() makes the start decision and reads the
    checkpoint; restore() takes the run's states (checkpoint/states.py) and continues them from it;
    save() after every step saves when an evaluation improved (or always_save_checkpoint), at
    ckpt_interval, on a signal and at the last step; finish() writes the `done` marker. Every
    checkpoint also records the run's settings and data_files, the identity of the data it was
    trained on (dataloader.identify), which a resume compares. A failed save is one SaveError line
    on every rank, naming the checkpoint kept."""

    def __init__(self, cfg, world, log=print, data_files=None, asynchronous=True):
        self.cfg, self.world, self.log, self.data_files = cfg, world, log, data_files
        self.asynchronous = asynchronous and world.sharded
        group = dist.new_group(backend="gloo") if self.asynchronous and world.distributed else None
        one_file = OneFileStorage(cfg.out_dir)
        sharded = ShardedStorage(cfg.out_dir, world.device, self.asynchronous, group)
        self.storage, self.other = (sharded, one_file) if world.sharded else (one_file, sharded)
        self.path = self.storage.path
        self.start = None  # the Start that load() decided
        self.states = None  # name -> Stateful, given by restore()
        self.finished = False  # auto on a run that already reached max_iters: nothing to do
        self.resumed_step = None  # the step this start resumed, until the first save after it
        self.saved_step = None  # the step of the newest published checkpoint
        self.started_step = None  # the step of the newest save started
        self.in_flight = None  # a sharded save still writing (ShardedSave)
        self.outcome = None  # (step, exception or None) of a sharded save finished on this rank, not yet shared

    # -- the start

    def load(self):
        """The checkpoint to continue (its items), checked against this run, or None for a fresh
        start (and for a finished run: then self.finished). Rank 0 decides, prints what it found,
        and tells the others, so that every rank goes the same way or raises the same error."""
        decision, ckpt = [None], None
        if self.world.master:
            try:
                start, ckpt = self._decide()
                decision = [(start, None)]
            except CheckpointError as e:
                decision = [(None, str(e))]
            except OSError as e:
                decision = [(None, f"cannot read {self.cfg.out_dir} ({one_line(e)}); make it readable, or pick "
                                   f"another --out_dir")]
        if self.world.distributed:
            dist.broadcast_object_list(decision, src=0)
        self.start, error = decision[0]
        if error is not None:
            raise CheckpointError(error)
        if self.world.master:
            for line in self.start.notes:
                self.log(line)
        self.finished = self.start.mode == "finished"
        if self.start.mode != "resume":
            return None
        if not self.world.master:  # rank 0 verified it
            ckpt, _ = self.storage.read(self.start.found, verify=False)
        return ckpt

    def _decide(self):
        """Rank 0: (the Start, the checkpoint's items for a resume). Reads the folder, writes nothing."""
        cfg, out_dir = self.cfg, self.cfg.out_dir
        if cfg.init_from == "auto":
            done = finished_step(out_dir)
            if done is not None and done >= cfg.max_iters:
                check_finished_run(out_dir, dataclasses.asdict(cfg))
                return Start("finished", notes=[f"nothing to do: {out_dir} finished at step {done} "
                                                f"(max_iters={cfg.max_iters})"]), None
        mine, theirs = self.storage.found(), self.other.found()
        last = logged_step(out_dir)
        if cfg.init_from == "scratch":
            used = [os.path.basename(f.path) for f in mine + theirs]
            used += [f"{METRICS_FILE} (steps up to {last})"] if last is not None else []
            if used:
                how = f" and --parallel={self.other.parallel}" if theirs and not mine else ""
                raise CheckpointError(f"{out_dir} holds a run ({', '.join(used)}); continue it with --init_from=resume "
                                      f"(or auto){how}, or start over elsewhere: another --out_dir, or this folder "
                                      f"moved aside (mv {out_dir} {out_dir}.old)")
            return Start("scratch"), None
        if not mine:
            if theirs:
                raise CheckpointError(f"{out_dir} holds checkpoints of a --parallel={self.other.parallel} run "
                                      f"({', '.join(os.path.basename(f.path) for f in theirs)}) and none of a "
                                      f"--parallel={self.storage.parallel} run: continue it with "
                                      f"--parallel={self.other.parallel}")
            if cfg.init_from == "resume":
                raise CheckpointError(f"checkpoint not found: {self.path}; start the run with --init_from=auto "
                                      f"(or scratch)")
            if last:  # past step 0: a run trained here (its first save comes before its first step)
                raise CheckpointError(f"{os.path.join(out_dir, METRICS_FILE)} records training up to step {last}, but "
                                      f"{out_dir} holds no checkpoint to continue it (nothing was changed); to start "
                                      f"over on purpose, move the folder aside (mv {out_dir} {out_dir}.old) and run "
                                      f"the same command again")
            return Start("scratch"), None
        skipped = []
        for found in mine:
            try:
                ckpt, verified = self.storage.read(found)
            except Damaged as e:
                skipped.append((found, str(e)))
                continue
            return self._resume(found, ckpt, verified, skipped), ckpt
        raise CheckpointError(f"no checkpoint in {out_dir} loads ({'; '.join(why for _, why in skipped)}); nothing "
                              f"was changed; to start over on purpose, move the folder aside (mv {out_dir} "
                              f"{out_dir}.unusable) and run the same command again")

    def _resume(self, found, ckpt, verified, skipped):
        """The Start of a resume from `found`, refused (CheckpointError) when it is another run's."""
        cfg, config = self.cfg, dataclasses.asdict(self.cfg)
        check_same_run(ckpt, config, found.path)
        check_same_data(ckpt, config, found.path)
        notes = [f"note: {why}; skipping it" + (f" (step {f.step})" if f.step is not None else "")
                 for f, why in skipped]
        missing = not os.path.lexists(self.path)
        if skipped or missing:
            notes.append(f"note: resuming from {found.path} (step {ckpt['step']}), the newest checkpoint in "
                         f"{cfg.out_dir} that loads{' and verifies' if verified else ''}"
                         + (f"; {self.path} is missing" if missing else ""))
        if not verified:
            notes.append(f"note: {found.path} has no digests to verify (written before checkpoints carried them): "
                         f"resuming from it unverified")
        if self.data_files is not None:
            notes += check_same_data_files(ckpt, self.data_files, os.path.join(cfg.data_dir, cfg.dataset),
                                           cfg.allow_data_change, found.path)
        return Start("resume", found, verified, skipped, notes + resume_notes(ckpt, cfg))

    def restore(self, states, ckpt):
        """Take the run's states (name -> Stateful: model, optimizer, train, rng) for every later save,
        and continue them from the checkpoint that load() read (None: a fresh start, nothing to
        load); refuses a checkpoint of another model, or one without optimizer state. Returns the
        step it continues from (None for a fresh start)."""
        self.states = states
        if ckpt is None:
            return None
        path = self.start.found.path
        states["model"].check(ckpt, path)  # before any weights are read
        ckpt = self.storage.load(self.start.found, ckpt, states)
        states["optimizer"].check(ckpt, path)  # a sharded checkpoint's come in with the load
        for state in states.values():
            state.load_state_dict(ckpt)
        self.resumed_step = self.saved_step = self.started_step = states["train"].step
        return self.resumed_step

    def prepare(self, step):
        """Rank 0, once the start has decided, before training from `step`: the damaged checkpoints
        it skipped set aside, the temporary files and folders of killed saves removed, a sharded
        checkpoint linked, no stale `done` marker, and a warning if the disk has no room for the
        next save."""
        done_path = os.path.join(self.cfg.out_dir, DONE_FILE)
        if os.path.exists(done_path) and step < self.cfg.max_iters:
            os.remove(done_path)
        for line in self.storage.prepare(self.start.found, self.start.skipped, self.cfg.keep_checkpoints):
            self.log(line)
        self.warn_if_low_space()

    # -- saving

    def due(self, step):
        """Whether ckpt_interval asks for a save after this step."""
        return self.cfg.ckpt_interval > 0 and step % self.cfg.ckpt_interval == 0

    def save(self, val_loss=None, stopping=False, force=False):
        """Every rank calls it after a step whose losses were checked (and after the first
        evaluation), with the step's val loss if it evaluated and whether the run stops here (a
        signal or a stop request). Saves when the val loss improved (or on always_save_checkpoint),
        at ckpt_interval, on a stop, at the last step or when forced; a stop's save and the last one
        are complete on return."""
        state = self.states["train"]
        improved = val_loss is not None and val_loss < state.best_val_loss
        if val_loss is not None:
            state.best_val_loss = min(state.best_val_loss, val_loss)
        last = state.step >= self.cfg.max_iters
        evaluated = val_loss is not None and (improved or self.cfg.always_save_checkpoint)
        if (evaluated or self.due(state.step) or stopping or last or force) and self.started_step != state.step:
            self._write(state.step)
        if stopping or last or not self.asynchronous:
            self.wait()
        elif self.in_flight is not None and self.in_flight.done():
            self._settle()  # publish it now: the link names the newest checkpoint as early as possible

    def _write(self, step):
        items = dict(config=dataclasses.asdict(self.cfg))
        if self.data_files is not None:
            items["data_files"] = self.data_files
        for state in self.states.values():  # the RNG state gathers every rank's
            items.update(state.state_dict())
        self.wait()  # the save before this one
        error = None
        try:
            self.in_flight = self.storage.start_save(items, step, self.cfg.keep_checkpoints, self.saved_step,
                                                     self.world.master)
        except Exception as e:  # torch's writer raises RuntimeError as well as OSError
            error = e
        self._raise_if_failed(error, step)
        self.started_step = step
        if self.in_flight is None:  # written in the call
            self._published(step)

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
        self.saved_step, self.resumed_step = step, None
        if self.world.master:
            self.warn_if_low_space()

    def _kept(self):
        """(path, step) of the newest good checkpoint on disk, or None before the first."""
        if self.saved_step is None:
            return None
        return (self.start.found.path if self.resumed_step is not None else self.path), self.saved_step

    def _raise_if_failed(self, error, step):
        """Share every rank's outcome of a save (error: its exception, or None): if any rank's part
        failed, every rank raises the same SaveError line, which names the checkpoint still on disk,
        so that all ranks stop together instead of waiting for the one that left."""
        line = None if error is None else save_failure_line(error, self.path, step, self._kept())
        lines = [line]
        if self.world.distributed:
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

    def finish(self):
        """After the last step: the final checkpoint complete, then rank 0 writes the `done` marker."""
        state = self.states["train"]
        if self.started_step != state.step:
            self._write(state.step)
        self.wait()
        if self.world.master:
            with open(os.path.join(self.cfg.out_dir, DONE_FILE), "w", encoding="utf-8") as f:
                f.write(f"{state.step}\n")
            self.log(f"done: step {state.step}, best val loss {state.best_val_loss:.4f}, checkpoint {self.path}")

    def kept(self):
        """What is kept after a failure in training (a save still writing completes first). A
        checkpoint this start resumed and has not saved over says whether its digests verified,
        so that a failure right after a resume is not taken for a damaged checkpoint."""
        with contextlib.suppress(SaveError):
            self.wait()
        kept = self._kept()
        if kept is None:
            return "no checkpoint was saved"
        path, step = kept
        if self.resumed_step is None:
            return f"{path} keeps the last good checkpoint (step {step})"
        if self.start.verified:
            return (f"{path} keeps the checkpoint this start resumed (step {step}), whose bytes matched the digests "
                    f"recorded when it was saved: the checkpoint is intact")
        return (f"{path} keeps the checkpoint this start resumed (step {step}), which has no digests to verify "
                f"(written before checkpoints carried them)")

    def close(self):
        """On any exit: a save still writing completes and is published if it can be, quietly."""
        if self.in_flight is not None:
            self._settle()
        self.storage.close()


# ----------------------------------------------------------------------------------------------
# The run folder


def has_checkpoint(path):
    """Whether a complete checkpoint is saved at path: a checkpoint file, or a sharded checkpoint
    folder (or its link) that is complete (a save in progress or killed is only a temp file, or a
    folder without its index)."""
    return os.path.isfile(path) or is_complete_sharded(path)


def finished_step(out_dir):
    """The step recorded in out_dir's `done` marker, or None when the run has not finished."""
    try:
        with open(os.path.join(out_dir, DONE_FILE), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def check_finished_run(out_dir, config):
    """A finished run of another variant in the folder is not this run's: refuse it by its config.json."""
    config_path = os.path.join(out_dir, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return  # written at every start; a kill may have cut it, and the marker came later
    if isinstance(saved, dict):
        check_same_run(dict(config=saved), config, config_path)


def logged_step(out_dir):
    """The highest step metrics.jsonl records, or None when it records none (a torn line is skipped)."""
    last = None
    with contextlib.suppress(FileNotFoundError):
        with open(os.path.join(out_dir, METRICS_FILE), encoding="utf-8", errors="replace") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and isinstance(record.get("step"), int):
                        last = max(record["step"], last if last is not None else record["step"])
    return last


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
    return [os.path.join(out_dir, name) for name in single + ["ckpt.dcp"] + sharded_folders(out_dir)]


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


def save_failure_line(error, path, step, kept):
    """One line for an exception raised while saving the checkpoint of `step` to path: what
    failed (a full disk found by the errno in the exception's chain, a denied permission, a
    vanished folder, or the exception's own first line), where, which checkpoint is kept (kept:
    its path and step, None before the first) and what to do."""
    directory = os.path.dirname(os.path.abspath(path))
    os_error = _os_error_in(error)
    code = os_error.errno if os_error is not None else None
    if code == errno.ENOSPC:
        why, fix = f"the disk is full (ENOSPC, no space left on device in {directory})", f"free space in {directory}"
    elif code == errno.EDQUOT:
        why, fix = f"the disk quota is used up (EDQUOT) in {directory}", "free space or raise the quota"
    elif code in (errno.EACCES, errno.EPERM):
        why, fix = f"permission denied writing to {directory}", f"make {directory} writable"
    elif code == errno.EROFS:
        why, fix = f"{directory} is on a read-only filesystem", "remount it writable"
    elif not os.path.isdir(directory):
        why, fix = f"the folder {directory} no longer exists", None
    else:
        shown = os_error if os_error is not None else error
        message = str(shown).strip().splitlines()[0][:200] if str(shown).strip() else ""
        why, fix = (f"{type(shown).__name__}: {message}" if message else type(shown).__name__), None
    then = f"{fix}, then " if fix else ""
    if kept is not None and has_checkpoint(kept[0]):
        return (f"saving the checkpoint of step {step} to {path} failed: {why}; {kept[0]} keeps the checkpoint of "
                f"step {kept[1]}; {then}continue from it with --init_from=auto")
    return f"saving the checkpoint of step {step} to {path} failed: {why}; no checkpoint is kept in {directory}"


def _os_error_in(error):
    """The first OSError in error's chain of causes and contexts, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
