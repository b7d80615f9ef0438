"""One writer per run folder. Rank 0 of a run records itself in <out_dir>/owner.json (host, pid,
job, since when) and touches the file every HEARTBEAT_S seconds while it runs; it removes the file
when it ends. A start on a folder whose owner is alive refuses with one error line; a folder whose
owner is gone (its process ended, on this host; its heartbeat older than STALE_S, on another host of
a shared filesystem) is taken over with a note. The ranks of one job are one writer, and so are the
starts of one job: torchrun's restarts (same TORCHELASTIC_RUN_ID) and SLURM's requeues (same
SLURM_JOB_ID) continue the run whatever the record says."""

import contextlib
import datetime
import json
import os
import socket
import threading
import time

import torch.distributed as dist

from checkpoint.single_file import CheckpointError

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
        return "its writer died"
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


def describe(record):
    if record.get("cut_short"):
        return "an owner whose record was cut short"
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
            except (CheckpointError, OSError) as e:
                outcome = [str(e) if isinstance(e, CheckpointError) else f"cannot claim {self.out_dir}: {e}"]
        if self.world.ddp:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
        return self

    def _claim(self):
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
            while True:
                record, age = self._read()
                if record is not None and (job is None or record.get("job") != job):
                    gone = owner_gone(record, age)
                    if gone is None:
                        raise CheckpointError(
                            f"{self.out_dir} is being written by a live run: {describe(record)}, heartbeat "
                            f"{age:.0f} s ago; wait for it to end, stop it, or pick another --out_dir (if it is "
                            f"in fact gone, remove {self.path})")
                    self.log(f"note: taking over {self.out_dir} from {describe(record)}: {gone}")
                if record is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path)
                try:
                    os.link(staged, self.path)  # fails if another start claimed the folder meanwhile
                    break
                except FileExistsError:
                    continue
        finally:
            os.remove(staged)
        self.heartbeat = threading.Thread(target=self._beat, daemon=True)
        self.heartbeat.start()

    def _read(self):
        """(the owner's record, seconds since its heartbeat), or (None, None) without an owner."""
        try:
            with open(self.path, encoding="utf-8") as f:
                record = json.load(f)
            return record, time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None, None
        except ValueError:  # a record cut short as its writer died
            return dict(host="?", pid="?", since="?", cut_short=True), 0.0

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
