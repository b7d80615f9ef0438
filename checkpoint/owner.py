"""One writer per run folder. Rank 0 of a run records itself in <out_dir>/owner.json (host, pid,
job, since when) and touches the file every HEARTBEAT_S seconds while it runs; it removes the file
when it ends. A start on a folder whose owner is alive refuses with one error line; a folder whose
owner is gone (its process ended, on this host; its heartbeat older than STALE_S, on another host of
a shared filesystem) is taken over with a note, and so is a record that names no process (cut short
as its writer died, empty, or JSON of another shape). Taking over is atomic: of any number of starts
that find one gone owner, exactly one goes on and the others find its live record. The ranks of one
job are one writer, and so are the starts of one job: torchrun's restarts (same TORCHELASTIC_RUN_ID)
and SLURM's requeues (same SLURM_JOB_ID) continue the run whatever the record says."""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time

import torch.distributed as dist

from checkpoint.files import CheckpointError

OWNER_FILE = "owner.json"
HEARTBEAT_S = 30
STALE_S = 300  # ten heartbeats missed: a shared filesystem's attribute cache delays some by a minute


def current_job():
    """What identifies this process's job across its restarts, or None for a plain process."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun {os.environ['TORCHELASTIC_RUN_ID']}"
    return None


def process_start(pid):
    """When pid started (clock ticks since boot), which tells a reused pid apart; None if unknown,
    "ended" for a process that ended and was not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # "pid (comm) state ppid ...": fields 3 on
    return "ended" if fields[0] == "Z" else int(fields[19])


def owner_gone(record, heartbeat_age):
    """Why the owner of record is gone, or None while it may still write."""
    if record.get("cut_short"):
        return "its record names no process (a write cut short, or not an owner record)"
    if record["host"] == socket.gethostname():
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return "its process ended"
        except PermissionError:
            pass  # alive, another user's
        started = process_start(record["pid"])
        if started == "ended" or record.get("pid_start") is not None and started != record["pid_start"]:
            return "its process ended"
        return None
    if heartbeat_age > STALE_S:
        return f"no heartbeat for {heartbeat_age:.0f} s"
    return None


def parse_record(data):
    """The owner record in data (bytes), or one marked cut_short when data is no owner record: a
    write cut short, an empty file, or JSON of another shape ({}, [1, 2], null)."""
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: garbage nested deeper than the parser goes
        record = None
    if (isinstance(record, dict) and isinstance(record.get("host"), str) and type(record.get("pid")) is int
            and 0 < record["pid"] < 2**31 and isinstance(record.get("since"), str)):
        return record
    return dict(cut_short=True)


def describe(record):
    if record.get("cut_short"):
        return "an unreadable owner record"
    return f"pid {record['pid']} on {record['host']} since {record['since']}" + \
        (f" ({record['job']})" if record.get("job") else "")


class RunOwner:
    """`with RunOwner(out_dir, world):` around a run: rank 0 claims out_dir (or every rank raises
    the same CheckpointError), keeps the heartbeat, and gives the folder up at the end."""

    def __init__(self, out_dir, world, log=print):
        self.out_dir, self.world, self.log = out_dir, world, log
        self.path = os.path.join(out_dir, OWNER_FILE)
        self.made_folder = False
        self.stopped = threading.Event()
        self.heartbeat = None

    def __enter__(self):
        outcome = [None]
        if self.world.master:
            try:
                self._claim()
            except CheckpointError as e:
                outcome = [str(e)]
            except OSError as e:
                outcome = [cannot_write(self.out_dir, e)]
        if self.world.distributed:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
        return self

    def _claim(self):
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise CheckpointError(f"--out_dir={self.out_dir} is a file, not a folder: pick another --out_dir")
        self.made_folder = not os.path.isdir(self.out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        job = current_job()
        pid = os.getpid()
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        mine = dict(host=socket.gethostname(), pid=pid, pid_start=process_start(pid), job=job, since=since)
        staged = f"{self.path}.{pid}.tmp"
        with open(staged, "w", encoding="utf-8") as f:
            json.dump(mine, f)
        try:
            while not (self._link(staged) or self._take_over(staged, job)):
                pass  # the record changed while we looked: look again
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(staged)
        self.heartbeat = threading.Thread(target=self._beat, daemon=True)
        self.heartbeat.start()

    def _link(self, staged):
        """Claim a folder without an owner: the link fails if any record is there."""
        try:
            os.link(staged, self.path)
            return True
        except FileExistsError:
            return False

    def _take_over(self, staged, job):
        """Replace the record there if its owner is gone (or it is this job's), saying so; raise the
        live-owner error if not. Each start that found the record holds its flock in turn and checks
        that the record is still the one at the path, so of any number of starts taking over one
        gone owner, exactly one does and the others find its live record. False when the record
        changed meanwhile."""
        try:
            f = open(self.path, "r+b")
        except FileNotFoundError:
            return False
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino != os.fstat(f.fileno()).st_ino:
                    return False
            except FileNotFoundError:
                return False
            record = parse_record(f.read())
            age = time.time() - os.fstat(f.fileno()).st_mtime
            if job is None or record.get("job") != job:
                gone = owner_gone(record, age)
                if gone is None:
                    raise CheckpointError(
                        f"{self.out_dir} is being written by a live run: {describe(record)}, heartbeat {age:.0f} s "
                        f"ago; wait for it to end, stop it, or pick another --out_dir (if it is in fact gone, "
                        f"remove {self.path})")
                self.log(f"note: taking over {self.out_dir} from {describe(record)}: {gone}")
            os.replace(staged, self.path)
            return True

    def _beat(self):
        while not self.stopped.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a lost heartbeat only makes the record older
                os.utime(self.path)

    def __exit__(self, *exc):
        if self.heartbeat is None:
            return
        self.stopped.set()
        self.heartbeat.join()
        with contextlib.suppress(OSError):
            os.remove(self.path)
            if self.made_folder:
                os.rmdir(self.out_dir)  # only if the run left it empty


def cannot_write(out_dir, error):
    """The line for an OSError while claiming out_dir: what could not be written, and the fix."""
    where = error.filename or out_dir
    folder = os.path.dirname(os.path.abspath(where))
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write {where} (permission denied): make {folder} writable (chmod u+w) or pick another --out_dir"
    if error.errno == errno.EROFS:
        return f"cannot write {where}: {folder} is on a read-only filesystem; pick an --out_dir on a writable disk"
    if error.errno == errno.ENOSPC:
        return f"cannot write {where}: the disk is full; free space in {folder}, or pick another --out_dir"
    return f"cannot write {where} ({error.strerror or error}); make {folder} writable, or pick another --out_dir"
