"""One-file checkpoints (ckpt.pt): an atomic, locked write; the temporary files a killed write
left, removed; the older checkpoints kept beside it; loading with one-line errors. The file holds
only tensors and plain Python values, so it loads with torch.load(weights_only=True) and never
runs pickled code."""

import contextlib
import fcntl
import os
import re
import shutil
import tempfile

import torch

REQUIRED_KEYS = ("model", "model_args", "config", "step")
KEPT_FILE = re.compile(r"ckpt\.(\d+)\.pt")  # an older checkpoint kept beside ckpt.pt (--keep_checkpoints)


class CheckpointError(Exception):
    """A missing, truncated, corrupt or incompatible checkpoint, as one line."""


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
    fsync_dir(directory)  # make the rename itself durable


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


def fsync_dir(directory):
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
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
