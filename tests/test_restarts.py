"""Runs that survive the cluster, on CPU: --init_from=auto as the one command for the first start
and every restart, a worker killed with SIGKILL under torchrun --max-restarts (with torchrun's shared
store, no workaround variable), SIGTERM to torchrun, a stop request, and saves that fail (a real full disk
on a small tmpfs, injected OSErrors, a vanished folder); the SLURM job script is tested on a real
SLURM in test_slurm.py. Every run is compared step by step with one uninterrupted run."""
import errno
import os
import shutil
import subprocess
import sys

import pytest

import checkpoint
import train
from checkpoint import files, load_checkpoint, save_failure_line
from config import REPO_DIR, load_config
from conftest import (assert_one_error_line, assert_uninterrupted, kill_process_tree, read_all_metrics,
                      read_all_metrics_lines, run_args, snapshot, temp_files, trajectory)
from model import GPT, GPT2_PADDED_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

EXIT_SAVE_FAILED = 3


# ----------------------------------------------------------------------------------------------
# --init_from=auto


@pytest.mark.slow
def test_auto_on_an_empty_folder_is_a_start_from_scratch(data_dir, tmp_path, reference, capsys):
    train.main(run_args(data_dir, tmp_path / "run"))
    assert "starting at step 0 of 8" in capsys.readouterr().out
    assert trajectory(tmp_path / "run") == trajectory(reference)
    assert (tmp_path / "run" / "done").read_text() == "8\n"


@pytest.mark.slow
def test_auto_on_a_cut_run_continues_the_exact_trajectory(data_dir, tmp_path, reference, capsys, monkeypatch):
    out = tmp_path / "run"
    real_step, steps = train.train_step, []

    def crash_before_step_6(*args):
        steps.append(1)  # a run from scratch: the n-th call is step n
        if len(steps) == 6:
            raise KeyboardInterrupt  # the process dies mid-run: no save, no `done`
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", crash_before_step_6)
    with pytest.raises(KeyboardInterrupt):
        train.main(run_args(data_dir, out))
    monkeypatch.undo()
    with open(out / "metrics.jsonl", "a") as f:  # a line half-written as the process died
        f.write('{"step": 6, "train_lo')
    (out / "ckpt.pt.x1y2z3ab.tmp").write_bytes(b"\0" * 1000)  # and a save it never finished
    assert [r["step"] for r in read_all_metrics_lines(out)][-1] == 5 and not (out / "done").exists()
    capsys.readouterr()
    train.main(run_args(data_dir, out))
    printed = capsys.readouterr().out
    assert "resuming at step 4 of 8" in printed and "removed 1 stale checkpoint temp file(s)" in printed
    assert trajectory(out) == trajectory(reference)  # exactly: same floats, step by step
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 8
    assert (out / "done").read_text() == "8\n" and temp_files(out) == []


def test_auto_on_a_finished_run_exits_0_and_changes_nothing(data_dir, reference, capsys):
    before = snapshot(reference)
    train.main(run_args(data_dir, reference))  # returns: exit status 0
    printed = capsys.readouterr()
    assert printed.out == f"nothing to do: {reference} finished at step 8 (max_iters=8)\n" and printed.err == ""
    assert snapshot(reference) == before

    # a finished run of another variant in the folder is not this run's
    with pytest.raises(SystemExit) as info:
        train.main(run_args(data_dir, reference, residual="hc"))
    assert info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "residual=mhclite", "residual=hc")
    assert snapshot(reference) == before


@pytest.mark.slow
def test_a_stop_request_saves_the_step_exits_0_and_the_run_continues_the_exact_trajectory(
        data_dir, tmp_path, reference, capsys, monkeypatch):
    """The file `stop` in the run folder, made during step 5 (the last checkpoint: step 4's): the run
    saves step 5 and returns 0, so that torchrun restarts nothing; the request is used up."""
    out = tmp_path / "run"
    real_step, steps = train.train_step, []

    def request_during_step_5(*args):
        steps.append(1)
        if len(steps) == 5:
            (out / "stop").touch()
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", request_during_step_5)
    train.main(run_args(data_dir, out))  # returns: exit status 0
    monkeypatch.undo()
    assert "stopped by the request stop in the run folder after step 5" in capsys.readouterr().out
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 5
    assert not (out / "stop").exists() and not (out / "done").exists()
    train.main(run_args(data_dir, out))
    assert "resuming at step 5 of 8" in capsys.readouterr().out
    assert trajectory(out) == trajectory(reference)


# ----------------------------------------------------------------------------------------------
# A lost worker


def torchrun(data_dir, out, script, max_restarts=0, **env):
    """Two CPU processes under torchrun, on train.py or tests/faulty_worker.py, with torchrun's
    defaults: its store shared with the workers (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
                             os.path.join(REPO_DIR, script), *run_args(data_dir, out)],
                            cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)  # workers run in sessions of their own
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_a_worker_killed_under_torchrun_is_restarted_and_the_run_ends_on_the_uninterrupted_losses(
        data_dir, tmp_path, reference):
    """Rank 1 dies by SIGKILL before step 6 (last checkpoint: step 4); torchrun restarts both
    workers with the same command, which resumes."""
    out = tmp_path / "run"
    proc = torchrun(data_dir, out, "tests/faulty_worker.py", max_restarts=1, FAULT="sigkill", FAULT_RANK="1",
                    FAULT_BEFORE_STEP="6", RESTART_DELAY="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # the kill happened
    assert "resuming at step 4 of 8" in proc.stdout and "taking over" not in proc.stdout  # one job, one writer
    assert_uninterrupted(out, reference)
    _, _, first_steps = read_all_metrics(out)
    assert [r["step"] for r in first_steps] == [1, 5]


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_the_same_command_finishes_the_uninterrupted_run(
        data_dir, tmp_path, reference):
    """A scheduler's SIGTERM before a time limit, sent to torchrun during step 5 (last checkpoint:
    step 4), which passes it to its workers: they save after step 5 and stop; the same command
    started again continues."""
    out = tmp_path / "run"
    proc = torchrun(data_dir, out, "tests/faulty_worker.py", FAULT="sigterm_launcher", FAULT_RANK="0",
                    FAULT_BEFORE_STEP="5")
    assert proc.returncode != 0 and "stopped by signal 15 after step 5" in proc.stdout, proc.stderr[-3000:]
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 5 and not (out / "done").exists()
    proc = torchrun(data_dir, out, "train.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming at step 5 of 8" in proc.stdout
    assert_uninterrupted(out, reference)


# ----------------------------------------------------------------------------------------------
# Saves that fail


def test_a_failed_save_is_one_line_that_says_why_and_what_is_kept(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, {"step": 4})
    try:  # how torch's zip writer reports a full disk: a RuntimeError raised while handling the OSError
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        torch_full = e
    cases = [
        (torch_full, f"the disk is full (ENOSPC, no space left on device in {tmp_path})"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "the disk quota is used up (EDQUOT)"),
        (PermissionError(errno.EACCES, "Permission denied"), f"permission denied writing to {tmp_path}"),
        (OSError(errno.EROFS, "Read-only file system"), "is on a read-only filesystem"),
        (RuntimeError("something else\nmore"), "failed: RuntimeError: something else;"),
    ]
    for error, why in cases:
        line = save_failure_line(error, path, 6, (path, 4))
        assert line.startswith(f"saving the checkpoint of step 6 to {path} failed: ") and why in line, line
        assert f"; {path} keeps the checkpoint of step 4; " in line
        assert line.endswith("continue from it with --init_from=auto") and "\n" not in line
    fixes = [save_failure_line(error, path, 6, (path, 4)) for error, _ in cases]
    assert f"free space in {tmp_path}, then continue" in fixes[0] and f"make {tmp_path} writable, then" in fixes[2]
    kept = str(tmp_path / "ckpt.4.pt")  # a resume from a kept checkpoint, before its first save
    checkpoint.save_checkpoint(kept, {"step": 4})
    assert f"{kept} keeps the checkpoint of step 4" in save_failure_line(torch_full, path, 6, (kept, 4))
    assert save_failure_line(torch_full, str(tmp_path / "none.pt"), 0, None).endswith(
        f"no checkpoint is kept in {tmp_path}")
    gone = tmp_path / "gone" / "ckpt.pt"
    assert f"the folder {tmp_path / 'gone'} no longer exists" in save_failure_line(
        FileNotFoundError(errno.ENOENT, "No such file or directory"), str(gone), 6, (str(gone), 4))


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs on a fresh folder; yields a function that mounts it with a size in bytes."""
    mounted = []

    def mount(size):
        folder = tmp_path / "disk"
        folder.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"a real full disk needs a tmpfs, which this machine cannot mount here "
                        f"({proc.stderr.strip() or 'mount failed'}); the injected ENOSPC test covers the handling")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.slow
def test_a_full_disk_warns_ahead_then_fails_the_save_in_one_line_and_keeps_the_last_checkpoint(
        data_dir, tmp_path, reference, small_disk, capsys):
    """A run cut at step 4 continues on a disk with room for its checkpoint and half another: a
    warning at the start, then the step-6 save hits ENOSPC (torch's writer says "unexpected pos")."""
    first = tmp_path / "first"
    train.main(run_args(data_dir, first, max_iters=4))
    size = os.path.getsize(first / "ckpt.pt")
    disk = small_disk(size + size // 2)
    out = disk / "run"
    shutil.copytree(first, out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        train.main(run_args(data_dir, out))
    assert info.value.code == EXIT_SAVE_FAILED
    printed = capsys.readouterr()
    warnings = [line for line in printed.out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"less than the {size / 1e6:.1f} MB of {out / 'ckpt.pt'}" in warnings[0]
    assert printed.out.index(warnings[0]) < printed.out.index("step 5/8")  # ahead of the failing step
    assert_one_error_line(printed.err, "saving the checkpoint of step 6", "the disk is full (ENOSPC",
                          f"{out / 'ckpt.pt'} keeps the checkpoint of step 4")
    assert temp_files(out) == [] and not (out / "done").exists()
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 4

    moved = tmp_path / "moved"  # the run moved off the full disk continues from the kept checkpoint
    shutil.copytree(out, moved)
    train.main(run_args(data_dir, moved))
    assert trajectory(moved) == trajectory(reference)


def fail_second_save(monkeypatch, fault, folder):
    """Let the first save_checkpoint through; in the second, once torch's writer has written 4 KB
    into the temporary file, call fault(folder) from inside its next write."""
    real_temp_file, calls = files._locked_temp_file, []

    class FaultyFile:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written >= 4096:
                fault(folder)
            self.written += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def temp_file(path):
        f, tmp_path = real_temp_file(path)
        calls.append(tmp_path)
        return (FaultyFile(f) if len(calls) == 2 else f), tmp_path

    monkeypatch.setattr(files, "_locked_temp_file", temp_file)


def disk_full(folder):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def permission_denied(folder):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def vanish(folder):
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("fault, why", [(disk_full, "the disk is full (ENOSPC"),
                                        (permission_denied, "permission denied writing to")])
def test_a_save_that_raises_an_oserror_exits_3_with_one_line_and_the_run_resumes(
        data_dir, tmp_path, reference, monkeypatch, capsys, fault, why):
    out = tmp_path / "run"
    fail_second_save(monkeypatch, fault, out)  # the step-0 save goes through, the step-3 save fails
    with pytest.raises(SystemExit) as info:
        train.main(run_args(data_dir, out))
    assert info.value.code == EXIT_SAVE_FAILED
    assert_one_error_line(capsys.readouterr().err, "saving the checkpoint of step 3", why,
                          f"{out / 'ckpt.pt'} keeps the checkpoint of step 0")
    assert temp_files(out) == [] and load_checkpoint(str(out / "ckpt.pt"))["step"] == 0
    monkeypatch.undo()
    train.main(run_args(data_dir, out))
    assert trajectory(out) == trajectory(reference)


@pytest.mark.slow
def test_a_folder_that_vanishes_during_a_save_is_one_line(data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    fail_second_save(monkeypatch, vanish, out)  # writes go on into the deleted folder; the rename fails
    with pytest.raises(SystemExit) as info:
        train.main(run_args(data_dir, out))
    assert info.value.code == EXIT_SAVE_FAILED
    assert_one_error_line(capsys.readouterr().err, "saving the checkpoint of step 3",
                          f"the folder {out} no longer exists", f"no checkpoint is kept in {out}")
    assert not out.exists()


def test_checkpoint_cost_measures_a_save_with_adamws_full_state(tmp_path, capsys):
    """benchmarks/checkpoint_cost.py, which made docs/training.md's tables: a row per size whose file
    holds the weights and AdamW's two moments (12 bytes per parameter in fp32), the digests' cost
    per GB, and no file left."""
    from benchmarks.checkpoint_cost import main
    main(["--sizes", "tiny", "--repeats", "1", "--residual", "res", "--out_dir", str(tmp_path)])
    row = capsys.readouterr().out.splitlines()[-1]
    size, params, gigabytes, save_s, load_s, hash_s, verify_s = (cell.strip() for cell in row.strip("|").split("|"))
    model = GPT(train.build_model_config(load_config(["--size=tiny", "--residual=res"]), GPT2_PADDED_VOCAB))
    n_params = sum(p.numel() for p in model.parameters())
    assert size == "tiny" and params == f"{n_params / 1e6:.0f}M"
    assert 12 * n_params / 1e9 - 0.01 <= float(gigabytes.split()[0]) <= 12 * n_params / 1e9 + 0.01
    assert all(float(seconds) > 0 for seconds in (save_s, load_s, hash_s, verify_s)) and os.listdir(tmp_path) == []
