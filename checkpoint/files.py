"""The files of a checkpoint, whichever its format: each written atomically under an exclusive lock,
with the SHA-256 of its bytes computed while they are written and recorded beside it in
<file>.digest.json; each verified against that record before anything in it is used.

A record is the list of saves whose bytes the file may hold, each with its step, size and SHA-256:
one, or two while a save replaces ckpt.pt (the record names the new bytes before the rename and
drops the old ones after it, so a crash in between leaves a file that still verifies). A file whose
bytes match no save in its record is damaged; a file without a record was written before
checkpoints carried digests, and is read unverified. A checkpoint file holds only tensors and plain
Python values, so it loads with torch.load(weights_only=True) and never runs pickled code. A
checkpoint found in a run folder is a Found; a damaged one is set aside, never deleted.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import tempfile

import torch

REQUIRED_KEYS = ("model", "model_args", "config", "step")
DIGEST_SUFFIX = ".digest.json"
READ_CHUNK = 8 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint that cannot be used for this run (missing, damaged or another run's), as one line."""


class Damaged(CheckpointError):
    """A checkpoint that cannot be used as it was saved: missing, truncated, corrupt, or holding bytes
    other than those its save wrote. A start falls back to an older one."""


# ----------------------------------------------------------------------------------------------
# Writing


class DigestingWriter:
    """The file object a save writes through: it hashes every byte on its way to the file, and
    keeps the first OSError of a write (its errno says why), which torch's zip writer would
    otherwise turn into "unexpected pos"."""

    def __init__(self, f):
        self.f, self.sha, self.bytes, self.error = f, hashlib.sha256(), 0, None

    def write(self, data):
        try:
            written = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(data)
        self.bytes += written
        return written

    def tell(self):
        return self.f.tell()

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()

    def save(self, step):
        """The record of what went through, as the save of `step`."""
        return dict(step=step, bytes=self.bytes, sha256=self.sha.hexdigest())


def save_checkpoint(path, obj):
    """Write obj with torch.save to a temporary file `<path>.<random>.tmp` in the same directory,
    hashing it on the way, fsync it, record its digest, then rename it over `path`: a crash at any
    moment leaves either the old file or the new one, whole, and a record that names its bytes. The
    writer holds an exclusive flock on the temporary file until it is renamed, so
    remove_stale_temp_files can tell a save in progress from one whose process died. When a write
    fails (a full disk), the OSError is raised, not the RuntimeError torch's writer makes of it."""
    directory = os.path.dirname(os.path.abspath(path))
    before = previous_saves(path)
    f, tmp_path = _locked_temp_file(path)
    writer = DigestingWriter(f)
    try:
        with f:
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
            saved = writer.save(obj.get("step") if isinstance(obj, dict) else None)
            write_record(path, before + [saved])
            os.replace(tmp_path, path)  # still locked: never an unlocked file under a temp name
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        if writer.error is not None and writer.error is not e:
            raise writer.error from None
        raise
    write_record(path, [saved])
    fsync_dir(directory)  # make the renames themselves durable


def previous_saves(path):
    """The saves the file at path may hold now, which its record must keep naming until a new
    save has replaced it: its record's, or its digest computed now for a file written before
    checkpoints carried digests (none when there is no file)."""
    try:
        saves = read_record(path)
    except Damaged:
        saves = None  # an unreadable record verifies nothing; the new one replaces it
    if saves is not None:
        return saves
    if not os.path.isfile(path):
        return []
    size, digest = file_digest(path)
    return [dict(step=None, bytes=size, sha256=digest)]


def record_path(path):
    return os.fspath(path) + DIGEST_SUFFIX


def write_record(path, saves):
    """Record `saves` for the file at path, atomically (a temporary file renamed over the record)."""
    record = record_path(path)
    with open(record + ".tmp", "w", encoding="utf-8") as f:
        json.dump(saves, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(record + ".tmp", record)


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


# ----------------------------------------------------------------------------------------------
# Verifying and reading


def read_record(path):
    """The saves recorded for the file at path, or None when it has no record; Damaged when the
    record itself cannot be read."""
    record = record_path(path)
    try:
        with open(record, encoding="utf-8") as f:
            saves = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Damaged(f"{record}, the digest record of {path}, is unreadable ({type(e).__name__})") from None
    if not (isinstance(saves, list) and saves and all(
            isinstance(s, dict) and isinstance(s.get("bytes"), int) and isinstance(s.get("sha256"), str)
            for s in saves)):
        raise Damaged(f"{record}, the digest record of {path}, is unreadable (not a list of saves)")
    return saves


def file_digest(path):
    """(size in bytes, SHA-256) of the file at path."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def verify_file(path):
    """The recorded save whose bytes the file at path holds, or None when it has no record (written
    before checkpoints carried digests); Damaged, saying how, when it matches no recorded save."""
    saves = read_record(path)
    if saves is None:
        return None
    if not os.path.isfile(path):
        raise Damaged(f"{path} is missing (its digest record is there)")
    size, digest = file_digest(path)
    match = next((save for save in saves if save["sha256"] == digest), None)
    if match is not None:
        return match
    newest = saves[-1]
    saved = f"its save{'' if newest.get('step') is None else ' of step ' + str(newest['step'])}"
    if size < newest["bytes"]:
        raise Damaged(f"{path} is damaged: truncated to {size:,} of the {newest['bytes']:,} bytes {saved} wrote")
    if size > newest["bytes"]:
        raise Damaged(f"{path} is damaged: {size:,} bytes where {saved} wrote {newest['bytes']:,}")
    raise Damaged(f"{path} is damaged: its bytes differ from those {saved} wrote (SHA-256 mismatch)")


def load_checkpoint(path, required=REQUIRED_KEYS, verify=True):
    """Load a train.py checkpoint file onto the CPU, verified against its digest record first
    (verify=False: a caller that verified it already); raises Damaged with one line."""
    if not os.path.isfile(path):
        raise Damaged(f"checkpoint not found: {path}")
    if verify:
        verify_file(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for damaged files; all mean the same here
        reason = str(e).strip().split(". ")[0].splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise Damaged(f"{path} is truncated, corrupt or not a checkpoint ({reason})") from None
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise Damaged(f"{path} is not a train.py checkpoint (missing {', '.join(missing)})")
    return ckpt


# ----------------------------------------------------------------------------------------------
# Checkpoints in a run folder


@dataclasses.dataclass
class Found:
    """A checkpoint in a run folder: its path (a file, or a sharded folder or its link), and its step
    when its name or its digest record says it (None: only its contents do)."""
    path: str
    step: int | None

    def describe(self):
        return f"{self.path} (step {'unknown' if self.step is None else self.step})"


def set_aside(path):
    """Rename a damaged checkpoint (file or folder) and its digest record to <name>.damaged (or
    .damaged.<n>), where no start, save or cleanup takes it for a checkpoint; returns the new path."""
    aside, n = f"{path}.damaged", 1
    while os.path.lexists(aside):
        n += 1
        aside = f"{path}.damaged.{n}"
    if os.path.lexists(record_path(path)):
        os.replace(record_path(path), record_path(aside))
    os.replace(path, aside)
    return aside
