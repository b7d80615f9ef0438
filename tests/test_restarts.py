"""Runs that survive the cluster, on CPU: --init_from=auto as the one command for the first start
and every restart, a worker killed with SIGKILL under torchrun --max-restarts (with torchrun's shared
store, no workaround variable), SIGTERM to torchrun, a stop request, saves that fail (a real full disk
on a small tmpfs, injected OSErrors, a vanished folder), and the SLURM job script under stand-ins
that behave as SLURM does (tests/slurm). Every run is compared step by step with one uninterrupted
run."""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

import checkpoint
import train
from checkpoint import load_checkpoint, save_failure_line, single_file
from config import REPO_DIR, load_config
from conftest import assert_one_error_line
from slurm import standin as slurm
from test_train import read_all_metrics, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

# Saves at steps 0, 3 (interval), 4 (eval), 6 (interval) and 8 (eval, end); the schedule's
# horizon is fixed, so a shorter first leg follows the same lr.
RUN = dict(n_layer=1, n_embd=32, max_iters=8, lr_decay_iters=8, warmup_iters=2, eval_interval=4,
           log_interval=1, ckpt_interval=3)
EXIT_SAVE_FAILED = 3


def run_args(data_dir, out_dir, **overrides):
    return tiny_args(data_dir, out_dir, **dict(RUN, init_from="auto", **overrides))


def trajectory(out_dir):
    """(train records, eval records) without the timings, each step once or the test fails."""
    train_records, eval_records, _ = read_all_metrics(out_dir)
    for records in (train_records, eval_records):
        steps = [r["step"] for r in records]
        assert len(steps) == len(set(steps)), steps
    return ([(r["step"], r["lr"], r["train_loss"], r["grad_norm"]) for r in train_records],
            [(r["step"], r["eval_train_loss"], r["val_loss"]) for r in eval_records])


def read_all_metrics_lines(out_dir):
    """Every whole record of metrics.jsonl, in order."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def temp_files(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def snapshot(folder):
    """Every file's modification time and bytes: what 'nothing changed on disk' compares."""
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One uninterrupted run from scratch: its folder."""
    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every run compared with it
    try:
        train.main(tiny_args(data_dir, out, **dict(RUN, init_from="scratch")))
    finally:
        torch.set_num_threads(threads)
    return out


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
    real_step = train.train_step

    def crash_before_step_6(train_model, state, *args):
        if state.step + 1 == 6:
            raise KeyboardInterrupt  # the process dies mid-run: no save, no `done`
        return real_step(train_model, state, *args)

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
    real_step = train.train_step

    def request_during_step_5(train_model, state, *args):
        if state.step + 1 == 5:
            (out / "stop").touch()
        return real_step(train_model, state, *args)

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
        slurm.signal_all(slurm.descendants([proc.pid]), signal.SIGKILL)  # workers run in sessions of their own
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def assert_uninterrupted(out, reference):
    """The run's per-step records equal the uninterrupted run's exactly: with two micro-batches,
    two ranks' gradient sum and one process's sum of halves are the same floats (halving is
    exact), so an interruption is the only difference left."""
    train_steps, eval_steps = trajectory(out)
    assert [s[0] for s in train_steps] == list(range(1, 9)) and [s[0] for s in eval_steps] == [0, 4, 8]
    assert (train_steps, eval_steps) == trajectory(reference)
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 8
    assert (out / "done").read_text() == "8\n" and temp_files(out) == []


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
    assert "resuming at step 4 of 8" in proc.stdout
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
        line = save_failure_line(error, path, 6, 4)
        assert line.startswith(f"saving the checkpoint of step 6 to {path} failed: ") and why in line, line
        assert line.endswith(f"{path} keeps the checkpoint of step 4; continue from it with --init_from=auto")
        assert "\n" not in line
    assert save_failure_line(torch_full, str(tmp_path / "none.pt"), 0, None).endswith(
        f"no checkpoint is kept in {tmp_path}")
    gone = tmp_path / "gone" / "ckpt.pt"
    assert f"the folder {tmp_path / 'gone'} no longer exists" in save_failure_line(
        FileNotFoundError(errno.ENOENT, "No such file or directory"), str(gone), 6, 4)


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
    real_temp_file, calls = single_file._locked_temp_file, []

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

    monkeypatch.setattr(single_file, "_locked_temp_file", temp_file)


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
    """benchmarks/checkpoint_cost.py, which made docs/training.md's table: a row per size whose file
    holds the weights and AdamW's two moments (12 bytes per parameter in fp32), and no file left."""
    from benchmarks.checkpoint_cost import main
    main(["--sizes", "tiny", "--repeats", "1", "--residual", "res", "--out_dir", str(tmp_path)])
    row = capsys.readouterr().out.splitlines()[-1]
    size, params, gigabytes, save_s, load_s = (cell.strip() for cell in row.strip("|").split("|"))
    model = train.GPT(train.build_model_config(load_config(["--size=tiny", "--residual=res"]), train.GPT2_PADDED_VOCAB))
    n_params = sum(p.numel() for p in model.parameters())
    assert size == "tiny" and params == f"{n_params / 1e6:.0f}M"
    assert 12 * n_params / 1e9 - 0.01 <= float(gigabytes.split()[0]) <= 12 * n_params / 1e9 + 0.01
    assert float(save_s) > 0 and float(load_s) > 0 and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# The SLURM job: tests/slurm's stand-ins for sbatch, srun and scontrol behave as SLURM does


SLURM_SCRIPT = os.path.join(REPO_DIR, "scripts", "slurm_train.sbatch")


def readme_multinode_command():
    """The README's multi-node torchrun command, its continuation lines joined."""
    text = open(os.path.join(REPO_DIR, "README.md"), encoding="utf-8").read()
    start = text.index("torchrun --nnodes=")
    end = text.index("\n```", start)
    return " ".join(text[start:end].replace("\\\n", " ").split())


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_the_srun_stand_in_kills_the_step_on_sigterm_and_forwards_usr1(tmp_path):
    """What the SLURM tests rest on: srun passes USR1 to every process of its step, a task's
    children included, and on SIGTERM SIGKILLs them all (a task's own TERM trap never runs)."""
    task = tmp_path / "task.sh"
    task.write_text(
        "#!/usr/bin/env bash\n"
        "trap 'echo USR1 >> \"$DIR/task-$SLURM_PROCID\"' USR1\n"
        "trap 'echo TERM >> \"$DIR/task-$SLURM_PROCID\"' TERM\n"
        "bash -c 'trap \"echo USR1 >> $DIR/child-$SLURM_PROCID\" USR1; touch $DIR/ready-$SLURM_PROCID; "
        "while true; do sleep 0.1; done' &\n"
        "while true; do sleep 0.1; done\n")
    task.chmod(0o755)
    env = dict(os.environ, PATH=f"{slurm.BIN}:{os.environ['PATH']}", SLURM_STANDIN_LOG=str(tmp_path),
               SLURM_JOB_NUM_NODES="2", DIR=str(tmp_path))
    proc = subprocess.Popen(["srun", "--kill-on-bad-exit=1", str(task)], env=env)
    slurm.wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2, 30, "two tasks with a child each")
    step = slurm.descendants([proc.pid])[1:]
    proc.send_signal(signal.SIGUSR1)
    received = [tmp_path / f"{who}-{rank}" for who in ("task", "child") for rank in (0, 1)]
    slurm.wait_for(lambda: all(path.exists() for path in received), 30, "USR1 in every task and child")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    assert [path.read_text() for path in received] == ["USR1\n"] * 4  # no TERM trap ran
    slurm.wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in step), 10, "the step's processes gone")


def fake_torchrun(bin_dir):
    """torchrun for the script's own logic: records its command line and each start; FAKE=finish
    writes `done`, FAKE=fail exits 3, FAKE=serve waits for the stop request and exits 0, as
    train.py does."""
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\n"
        'echo "$*" >> "$SLURM_STANDIN_LOG/torchrun"\n'
        'case "$FAKE" in\n'
        '  finish) mkdir -p "$OUT_DIR"; echo 10000 > "$OUT_DIR/done" ;;\n'
        '  fail) touch "$SLURM_STANDIN_LOG/started"; sleep 1; exit 3 ;;\n'
        '  serve) touch "$SLURM_STANDIN_LOG/started"; while [ ! -f "$OUT_DIR/stop" ]; do sleep 0.05; done ;;\n'
        "esac\n")
    (bin_dir / "torchrun").chmod(0o755)


def test_the_slurm_script_runs_the_readmes_multinode_command_and_requeues_only_a_run_stopped_for_the_time_limit(
        tmp_path):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    fake_torchrun(bin_dir)

    def submit(name, fake, **options):
        options.setdefault("nodelist", "gpu-node-[07-08]")
        logs = tmp_path / name
        logs.mkdir()
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT_DIR=str(out), FAKE=fake)
        return logs, slurm.submit(SLURM_SCRIPT, env=env, submit_dir=REPO_DIR, log_dir=logs, **options)

    logs, job = submit("finished", "finish")
    assert job.wait(timeout=60) == (0, 0)
    [srun] = (logs / "srun").read_text().splitlines()
    assert srun.startswith("--kill-on-bad-exit=1 --cpus-per-task=32 torchrun ")
    readme = readme_multinode_command().replace("$HEAD_NODE", "gpu-node-07").split()[1:] + [f"--out_dir={out}"]
    assert [line.split() for line in (logs / "torchrun").read_text().splitlines()] == [readme, readme]  # 2 nodes
    assert (logs / "scontrol").read_text().splitlines() == ["show hostnames gpu-node-[07-08]"]

    (out / "done").unlink()
    logs, job = submit("time_limit", "serve")
    slurm.wait_for((logs / "started").exists, 30, "the run")
    job.signal_time_limit()
    assert job.wait(timeout=60) == (0, 1)

    one_node = dict(nodes=1, nodelist="gpu-node-07")  # one task: its exit code is srun's
    logs, job = submit("failed", "fail", **one_node)
    assert job.wait(timeout=60) == (3, 0)
    assert not (out / "stop").exists()  # the stale request was removed before the start

    logs, job = submit("failed_after_the_request", "fail", **one_node)
    slurm.wait_for((logs / "started").exists, 30, "the run")
    job.signal_time_limit()
    assert job.wait(timeout=60) == (3, 0)  # a run that could not serve the stop is not requeued

    logs, job = submit("signal_without_b", "serve", signal="USR1@600", **one_node)
    slurm.wait_for((logs / "started").exists, 30, "the run")
    job.signal_time_limit()  # to the step's processes, which USR1 kills (torchrun's agent too), not the shell
    assert job.wait(timeout=60) == (128 + signal.SIGUSR1, 0)


@pytest.mark.slow
def test_the_slurm_time_limit_saves_the_step_in_flight_and_the_requeued_job_ends_on_the_uninterrupted_losses(
        data_dir, tmp_path, reference):
    """The batch script on one node with two CPU processes under real torchrun: SLURM's time-limit
    signal comes during step 5 (the last checkpoint: step 4's), which rank 0 holds until the request
    reaches the run folder. The run saves step 5 and exits 0, the job requeues itself once, and the
    requeued start finishes with the uninterrupted run's losses, each step once."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT_DIR=str(out), RDZV_PORT=str(free_port()), FAULT="hold",
               FAULT_RANK="0", FAULT_BEFORE_STEP="5", HOLD_UNTIL=str(out / "stop"))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    args = ["tests/faulty_worker.py", *tiny_args(data_dir, out, **RUN)]
    job = slurm.submit(SLURM_SCRIPT, args, env=env, submit_dir=REPO_DIR, log_dir=tmp_path, nodes=1, gpus_per_node=2,
                       cpus_per_task=2, nodelist="localhost")

    def evaluated_step_4():
        return (out / "metrics.jsonl").exists() and any(
            r.get("step") == 4 and "val_loss" in r for r in read_all_metrics_lines(out))

    slurm.wait_for(evaluated_step_4, 120, "the evaluation of step 4")
    job.signal_time_limit()
    code, requeues = job.wait(timeout=120)
    output = (tmp_path / "job-4242.out").read_text()
    assert (code, requeues) == (0, 1), output[-3000:]
    assert "stopped by the request stop in the run folder after step 5" in output
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 5 and not (out / "done").exists()
    assert not (out / "stop").exists()

    code, requeues = job.start_requeued().wait(timeout=120)
    output = (tmp_path / "job-4242.out").read_text()
    assert (code, requeues) == (0, 0), output[-3000:]
    assert "resuming at step 5 of 8" in output
    assert_uninterrupted(out, reference)
