"""The one-file format (--parallel=ddp): ckpt.pt, written by rank 0 (checkpoint/files.py: atomic,
locked, with its digest record), and with --keep_checkpoints=K the K - 1 before it kept beside it
as ckpt.<step>.pt (a second name for the file that was ckpt.pt, no copy)."""

import contextlib
import os
import re
import shutil

from checkpoint.files import (Damaged, Found, load_checkpoint, read_record, record_path, remove_stale_temp_files,
                              save_checkpoint, set_aside, verify_file, write_record)

SINGLE_NAME = "ckpt.pt"
KEPT_FILE = re.compile(r"ckpt\.(\d+)\.pt")  # an older checkpoint kept beside ckpt.pt (--keep_checkpoints)


class OneFileStorage:
    """ckpt.pt and the checkpoints kept beside it, in out_dir."""
    parallel = "ddp"

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, SINGLE_NAME)

    def found(self):
        """Every checkpoint file in out_dir, newest first: ckpt.pt, then ckpt.<step>.pt by step."""
        names = os.listdir(self.out_dir) if os.path.isdir(self.out_dir) else []
        kept = sorted((m for m in map(KEPT_FILE.fullmatch, names) if m), key=lambda m: -int(m[1]))
        found = [Found(self.path, recorded_step(self.path))] if os.path.isfile(self.path) else []
        return found + [Found(os.path.join(self.out_dir, m[0]), int(m[1])) for m in kept
                        if os.path.isfile(os.path.join(self.out_dir, m[0]))]

    def read(self, found, verify=True):
        """(the checkpoint's items, whether its digests verified); Damaged when it cannot be used."""
        verified = verify and verify_file(found.path) is not None
        return load_checkpoint(found.path, verify=False), verified

    def load(self, found, ckpt, states):
        """The items to continue from: the one file holds all of them already."""
        return ckpt

    def start_save(self, items, step, keep, saved_step, master):
        """Rank 0 writes ckpt.pt, after keeping the one it replaces (of saved_step) as
        ckpt.<saved_step>.pt when keep > 1, and removes the kept ones beyond keep; done on return."""
        if master:
            if keep > 1 and saved_step is not None:
                keep_previous(self.path, saved_step)
            save_checkpoint(self.path, items)
            remove_stale_kept(self.out_dir, keep)
        return None

    def prepare(self, chosen, skipped, keep):
        """Rank 0, once a start has decided: the damaged checkpoints it skipped set aside, the
        temporary files of killed saves removed. Returns what it did, as lines."""
        lines = [f"note: set {damaged.path} aside as {set_aside(damaged.path)}" for damaged, _ in skipped]
        removed, freed = remove_stale_temp_files(self.path)
        if removed:
            lines.append(f"removed {removed} stale checkpoint temp file(s) in {self.out_dir} ({freed / 1e6:.1f} MB), "
                         f"left by a save that was killed")
        return lines

    def close(self):
        """Nothing to release: a save is complete on return."""


def recorded_step(path):
    """The step of the newest save in path's digest record, or None."""
    with contextlib.suppress(Damaged):
        saves = read_record(path)
        if saves is not None and isinstance(saves[-1].get("step"), int):
            return saves[-1]["step"]
    return None


def keep_previous(path, step):
    """Before ckpt.pt (path) is replaced, keep its checkpoint of `step` as ckpt.<step>.pt: a second
    name for the same file (a copy where the filesystem has no hard links), its digest record
    written first, so the kept file never goes without one."""
    kept = os.path.join(os.path.dirname(os.path.abspath(path)), f"ckpt.{step}.pt")
    if os.path.isfile(path) and not os.path.exists(kept):
        with contextlib.suppress(Damaged):
            saves = read_record(path)
            if saves is not None:
                write_record(kept, [save for save in saves if save.get("step") == step] or saves)
        try:
            os.link(path, kept)
        except OSError:
            shutil.copyfile(path, kept)


def remove_stale_kept(out_dir, keep):
    """Delete the ckpt.<step>.pt files (and their digest records) beyond the newest keep - 1
    (ckpt.pt is the newest)."""
    names = sorted((m for m in map(KEPT_FILE.fullmatch, os.listdir(out_dir)) if m), key=lambda m: int(m[1]))
    for m in names[:max(len(names) - (keep - 1), 0)]:
        for path in (os.path.join(out_dir, m[0]), record_path(os.path.join(out_dir, m[0]))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
