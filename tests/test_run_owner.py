"""One writer per run folder (checkpoint/owner.py): a second start on the folder of a live run is refused
and the live run ends exactly as an uninterrupted one; an owner that is gone (SIGKILLed here, or
silent for long on another host) is taken over with a note, and so is a record that names no owner,
without a traceback or a hang; of starts released at once onto a gone owner, exactly one goes on;
the starts of one job (torchrun's restarts: test_restarts.py; SLURM's requeues: test_slurm.py and
below) continue the run; a folder that cannot be written is one line that names the fix."""
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from checkpoint import owner as run_owner
import train
from checkpoint import CheckpointError
from config import REPO_DIR
from conftest import assert_one_error_line, assert_uninterrupted, one_error_line, run_args

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    """The tests' processes belong to no SLURM or torchrun job, wherever pytest runs."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def start_held_run(data_dir, out, hold_until):
    """train.py on out as its own process, holding step 5 (the last checkpoint: step 4's) until
    the file hold_until exists; returns the process once the hold has begun (step 4 saved)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", FAULT="hold", FAULT_RANK="0", FAULT_BEFORE_STEP="5",
               HOLD_UNTIL=str(hold_until), FAULT_ONCE=str(hold_until) + ".once")
    proc = subprocess.Popen([sys.executable, "tests/faulty_worker.py", *run_args(data_dir, out)], cwd=REPO_DIR,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held = Path(str(hold_until) + ".held")
    deadline = time.monotonic() + 120
    while not held.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "step 5 not reached in 120 s"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_a_second_start_on_a_live_runs_folder_is_refused_and_the_live_run_ends_exactly(
        data_dir, tmp_path, reference):
    out = tmp_path / "run"
    live = start_held_run(data_dir, out, tmp_path / "go")
    try:
        second = subprocess.run([sys.executable, "train.py", *run_args(data_dir, out)], cwd=REPO_DIR,
                                capture_output=True, text=True, timeout=120)
    finally:
        (tmp_path / "go").touch()
        stdout, stderr = live.communicate(timeout=120)
    assert second.returncode == 2 and second.stdout == ""
    line = assert_one_error_line(second.stderr, f"{out} is being written by a live run",
                                 f"pid {live.pid} on {socket.gethostname()} since ", alone=True)
    assert "remove" in line and "--out_dir" in line
    assert live.returncode == 0, stderr[-3000:]
    assert "resuming" not in stdout
    assert_uninterrupted(out, reference)
    assert not (out / run_owner.OWNER_FILE).exists()  # given up at the end


@pytest.mark.slow
def test_a_sigkilled_owner_is_taken_over_with_a_note_and_the_run_continues_exactly(
        data_dir, tmp_path, reference, capsys):
    out = tmp_path / "run"
    killed = start_held_run(data_dir, out, tmp_path / "go")
    killed.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, killed.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: its pid still answers
    assert json.loads((out / run_owner.OWNER_FILE).read_text())["pid"] == killed.pid  # left behind
    train.main(run_args(data_dir, out))
    killed.communicate(timeout=60)
    printed = capsys.readouterr().out
    assert f"note: taking over {out} from pid {killed.pid} on {socket.gethostname()} since " in printed
    assert "its process ended" in printed and "resuming at step 4 of 8" in printed
    assert_uninterrupted(out, reference)


def write_owner(out, host, age_s, job=None, pid=4321):
    """The owner record as a run on host would have left it, its last heartbeat age_s ago."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / run_owner.OWNER_FILE
    path.write_text(json.dumps(dict(host=host, pid=pid, pid_start=None, job=job, since="2026-01-02 03:04:05 UTC")))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_an_owner_on_another_host_is_live_while_its_heartbeat_is_fresh_and_taken_over_once_stale(
        data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = run_args(data_dir, out, max_iters=2, lr_decay_iters=2, eval_interval=2)
    write_owner(out, "gpu-node-07", age_s=run_owner.HEARTBEAT_S)
    with pytest.raises(SystemExit) as info:
        train.main(args)
    assert info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "pid 4321 on gpu-node-07 since 2026-01-02 03:04:05 UTC",
                          f"heartbeat {run_owner.HEARTBEAT_S} s ago", alone=True)
    assert sorted(os.listdir(out)) == [run_owner.OWNER_FILE]  # nothing written

    write_owner(out, "gpu-node-07", age_s=run_owner.STALE_S + 60)
    train.main(args)
    printed = capsys.readouterr().out
    assert printed.startswith(f"note: taking over {out} from pid 4321 on gpu-node-07 since 2026-01-02 03:04:05 UTC: "
                              f"no heartbeat for {run_owner.STALE_S + 60} s\n")
    assert "starting at step 0 of 2" in printed and (out / "done").read_text() == "2\n"
    assert not (out / run_owner.OWNER_FILE).exists()


def test_a_requeued_slurm_job_continues_its_own_run_whatever_the_record_says(
        data_dir, tmp_path, monkeypatch, capsys):
    """A requeue after a node failure: the record of the job's earlier start is still there, fresh,
    from another host; the same job id is the same writer."""
    out = tmp_path / "run"
    write_owner(out, "gpu-node-07", age_s=0, job="slurm job 77")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    train.main(run_args(data_dir, out, max_iters=2, lr_decay_iters=2, eval_interval=2))
    printed = capsys.readouterr().out
    assert "note:" not in printed and (out / "done").read_text() == "2\n"

    write_owner(out, "gpu-node-07", age_s=0, job="slurm job 76")  # another job's live run: refused
    with pytest.raises(SystemExit):
        train.main(run_args(data_dir, out, max_iters=2, lr_decay_iters=2, eval_interval=2))
    assert_one_error_line(capsys.readouterr().err, "(slurm job 76)", alone=True)


def test_a_start_that_fails_leaves_no_folder_behind(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        train.main(run_args(tmp_path / "no-data", out))
    capsys.readouterr()
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Records that are no owner record, starts released at once, folders that cannot be written

CLAIM = textwrap.dedent("""
    import sys, types
    from checkpoint import RunOwner
    with RunOwner(sys.argv[1], types.SimpleNamespace(master=True, distributed=False)):
        print("claimed", flush=True)
""")


@pytest.mark.parametrize("record", ["{}", "[1, 2]", "null", "\x00garbage{", ""],
                         ids=["empty object", "list", "null", "garbage", "empty file"])
def test_a_record_that_names_no_owner_is_taken_over_with_a_note(tmp_path, record):
    out = tmp_path / "run"
    out.mkdir()
    (out / run_owner.OWNER_FILE).write_text(record)
    proc = subprocess.run([sys.executable, "-c", CLAIM, str(out)], cwd=REPO_DIR, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == (f"note: taking over {out} from an unreadable owner record: its record names no process "
                           f"(a write cut short, or not an owner record)\nclaimed\n")
    assert os.listdir(out) == []  # given up at the end


def claim_at_the_barrier(out, barrier, results, release):
    """One start: claim out once every start is at the barrier; report, then hold a won claim until released."""
    barrier.wait()
    try:
        world = types.SimpleNamespace(master=True, distributed=False)
        owner = run_owner.RunOwner(str(out), world, log=lambda line: None).__enter__()
    except CheckpointError as e:
        results.put(("refused", str(e)))
        return
    results.put(("claimed", os.getpid()))
    release.wait()
    owner.__exit__(None, None, None)


def test_of_starts_released_at_once_onto_a_gone_owner_exactly_one_goes_on(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    out, context, starts = tmp_path / "run", multiprocessing.get_context("fork"), 4
    for _ in range(50):  # the takeover without its lock let two starts on in 1 of about 10 rounds
        write_owner(out, socket.gethostname(), age_s=0, pid=gone.pid)
        barrier, results, release = context.Barrier(starts), context.Queue(), context.Event()
        procs = [context.Process(target=claim_at_the_barrier, args=(out, barrier, results, release))
                 for _ in range(starts)]
        for proc in procs:
            proc.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        release.set()
        for proc in procs:
            proc.join(timeout=60)
        (winner,) = [pid for outcome, pid in outcomes if outcome == "claimed"]
        assert [outcome for outcome, _ in outcomes].count("refused") == starts - 1
        for _, line in outcomes[1:]:
            assert f"{out} is being written by a live run: pid {winner} on {socket.gethostname()}" in line
        assert not (out / run_owner.OWNER_FILE).exists()


def test_an_out_dir_that_is_a_file_is_one_line_with_the_fix(data_dir, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    one_error_line(train.main, run_args(data_dir, notes), capsys,
                   f"--out_dir={notes} is a file, not a folder: pick another --out_dir")
    assert notes.read_text() == "mine"


def test_an_out_dir_on_a_read_only_disk_is_one_line_with_the_fix(data_dir, tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("a read-only disk needs a tmpfs, which this machine cannot mount here")
    try:
        one_error_line(train.main, run_args(data_dir, disk / "run"), capsys,
                       f"cannot write {disk / 'run'}: {disk} is on a read-only filesystem; pick an --out_dir on a "
                       f"writable disk")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
