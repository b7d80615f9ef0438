"""scripts/slurm_train.sbatch on a real SLURM: the one-node cluster that scripts/slurm_cluster.sh
starts (this machine's cores, and two GPUs that are /dev/null files), the script submitted with the
real sbatch, its #SBATCH header overridden on sbatch's command line for that node, tiny mhclite runs
on 2 CPU processes under torchrun compared step by step with one uninterrupted run. Without a cluster
the tests skip and say how to start one; under CI=true that is a failure. A job takes both cores of
the node, so the tests run one after another (one xdist group). What one node cannot show: a
rendezvous across nodes."""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from checkpoint import load_checkpoint
from config import REPO_DIR
from conftest import RUN, assert_uninterrupted, free_port, read_all_metrics, read_all_metrics_lines, snapshot, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = os.path.join(REPO_DIR, "scripts", "slurm_train.sbatch")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


class Cluster:
    """sbatch, scancel and scontrol on the cluster named by env's SLURM_CONF; every job submitted
    is cancelled at the end of the test that submitted it, so that none holds the node."""

    def __init__(self, env, folder):
        self.env, self.folder, self.jobs = env, folder, []

    def command(self, *args):
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60, check=True).stdout

    def submit(self, args=(), gpus=2, **env):
        """scripts/slurm_train.sbatch [args] on one node (gpus=0: a job without GPUs), its
        environment this process's with env over it; the job's id."""
        job_env = dict(self.env, OMP_NUM_THREADS="1", RDZV_PORT=str(free_port()), **env)
        job_env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        output = self.folder / f"job-{len(self.jobs)}.out"
        job_id = subprocess.run(
            ["sbatch", "--parsable", "--job-name=mhclite-test", "--nodes=1", f"--gpus-per-node={gpus}",
             "--cpus-per-task=2", "--time=60", f"--output={output}", SCRIPT, *args],
            cwd=REPO_DIR, env=job_env, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        self.jobs.append((job_id, output))
        return job_id

    def output(self, job_id):
        path = dict(self.jobs)[job_id]
        return path.read_text() if path.exists() else ""

    def state(self, job_id):
        """{JobState, Restarts, ExitCode} as slurmctld reports them."""
        text = self.command("scontrol", "show", "job", "--oneliner", job_id)
        return {key: re.search(rf"\b{key}=(\S+)", text)[1] for key in ("JobState", "Restarts", "ExitCode")}

    def wait(self, job_id, until=None, timeout=240):
        """The job's state once it ended, or (until) once until() holds while the job still runs."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if until is not None and until():
                return state
            if state["JobState"] in ENDED:
                assert until is None, f"job {job_id} ended first: {state}\n{self.output(job_id)[-3000:]}"
                return state
            assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
            time.sleep(0.2)

    def cancel_all(self):
        for job_id, _ in self.jobs:
            subprocess.run(["scancel", job_id], env=self.env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def slurm_env():
    """os.environ with SLURM_CONF naming scripts/slurm_cluster.sh's cluster (unless set) and this
    Python's bin first in PATH (torchrun), once the node answers."""
    folder = os.environ.get("SLURM_CLUSTER_DIR", os.path.join(tempfile.gettempdir(), "slurm-one-node"))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.setdefault("SLURM_CONF", os.path.join(folder, "slurm.conf"))
    if shutil.which("sbatch") is None:
        reason = "SLURM is not installed"
    elif not os.path.exists(env["SLURM_CONF"]):
        reason = f"no SLURM configuration at {env['SLURM_CONF']}"
    else:
        try:
            answer = subprocess.run(["sinfo", "--noheader", "--responding", "--format=%T"], env=env,
                                    capture_output=True, text=True, timeout=20)
            reason = None if answer.returncode == 0 and answer.stdout.strip() else \
                f"no node answers at SLURM_CONF={env['SLURM_CONF']}"
        except subprocess.TimeoutExpired:
            reason = f"slurmctld does not answer at SLURM_CONF={env['SLURM_CONF']}"
    if reason is not None:
        message = f"{reason}: start a one-node SLURM with `bash scripts/slurm_cluster.sh start` (root, Debian)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return env


@pytest.fixture
def slurm(slurm_env, tmp_path):
    cluster = Cluster(slurm_env, tmp_path)
    yield cluster
    cluster.cancel_all()


def evaluated_step_4(out):
    return lambda: (out / "metrics.jsonl").exists() and any(
        r.get("step") == 4 and "val_loss" in r for r in read_all_metrics_lines(out))


# ----------------------------------------------------------------------------------------------
# Training runs


@pytest.mark.slow
def test_a_stop_asked_at_a_chosen_step_saves_it_requeues_once_and_the_job_ends_on_the_uninterrupted_losses(
        slurm, data_dir, tmp_path, reference):
    """USR1 to the batch shell alone (`scancel --batch --signal=USR1`, what `#SBATCH
    --signal=B:USR1@600` sends before the time limit; slurmctld looks at that timer only about every
    30 s) during step 5, the last checkpoint step 4's: rank 0 holds step 5 until the request reaches
    the run folder. The run saves step 5 and exits 0, the job requeues itself once, and the same job
    resumes at step 5 and finishes on the uninterrupted run's losses, each step once."""
    out = tmp_path / "run"
    job = slurm.submit(["tests/faulty_worker.py", *tiny_args(data_dir, out, **RUN)], OUT_DIR=str(out), FAULT="hold",
                       FAULT_RANK="0", FAULT_BEFORE_STEP="5", HOLD_UNTIL=str(out / "stop"))
    slurm.wait(job, until=evaluated_step_4(out))
    slurm.command("scancel", "--batch", "--signal=USR1", job)
    state = slurm.wait(job)
    output = slurm.output(job)
    assert state == dict(JobState="COMPLETED", Restarts="1", ExitCode="0:0"), output[-3000:]
    assert "stopped by the request stop in the run folder after step 5" in output
    assert f"saved a checkpoint; requeueing job {job}" in output
    assert "resuming at step 5 of 8" in output
    assert [r["step"] for r in read_all_metrics(out)[2]] == [1, 6]  # each start's first step
    assert_uninterrupted(out, reference)


@pytest.mark.slow
def test_a_cancelled_job_saves_and_a_resubmission_on_a_partition_without_gpus_continues_from_the_saved_step(
        slurm, data_dir, tmp_path, reference):
    """scancel (SIGTERM to every process of the job) while rank 0 holds step 5: the workers save the
    step they are on and stop; the same command submitted again, without GPUs and with
    NPROC_PER_NODE=2, resumes there and ends on the uninterrupted run's losses."""
    out = tmp_path / "run"
    args = tiny_args(data_dir, out, **RUN)
    job = slurm.submit(["tests/faulty_worker.py", *args], OUT_DIR=str(out), FAULT="hold", FAULT_RANK="0",
                       FAULT_BEFORE_STEP="5", HOLD_UNTIL=str(tmp_path / "go"))
    slurm.wait(job, until=evaluated_step_4(out))
    slurm.command("scancel", job)
    (tmp_path / "go").touch()
    assert slurm.wait(job)["JobState"] == "CANCELLED"
    saved = load_checkpoint(str(out / "ckpt.pt"))["step"]
    assert saved >= 5 and not (out / "done").exists(), slurm.output(job)[-3000:]

    job = slurm.submit(["train.py", *args], gpus=0, OUT_DIR=str(out), NPROC_PER_NODE="2")
    state = slurm.wait(job)
    output = slurm.output(job)
    assert state == dict(JobState="COMPLETED", Restarts="0", ExitCode="0:0"), output[-3000:]
    assert f"resuming at step {saved} of 8" in output and "on 2 x cpu" in output
    assert_uninterrupted(out, reference)


@pytest.mark.slow
def test_a_finished_run_resubmitted_does_nothing(slurm, data_dir, reference):
    before = snapshot(reference)
    job = slurm.submit(["train.py", *tiny_args(data_dir, reference, **RUN)], OUT_DIR=str(reference))
    state = slurm.wait(job)
    output = slurm.output(job)
    assert state == dict(JobState="COMPLETED", Restarts="0", ExitCode="0:0"), output[-3000:]
    assert f"nothing to do: {reference} finished at step 8 (max_iters=8)" in output
    assert snapshot(reference) == before


# ----------------------------------------------------------------------------------------------
# The script's own logic, with a torchrun that only plays its part


def readme_multinode_command():
    """The README's multi-node torchrun command, its continuation lines joined."""
    text = open(os.path.join(REPO_DIR, "README.md"), encoding="utf-8").read()
    start = text.index("torchrun --nnodes=")
    end = text.index("\n```", start)
    return " ".join(text[start:end].replace("\\\n", " ").split())


@pytest.fixture
def fake_torchrun(tmp_path):
    """A folder with a torchrun that appends its command line to $LOG/torchrun; FAKE=finish writes
    `done`, FAKE=fail exits 3 two seconds after it started, FAKE=serve waits for the stop request
    and exits 0, as train.py does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\n"
        'echo "$*" >> "$LOG/torchrun"\n'
        'case "$FAKE" in\n'
        '  finish) mkdir -p "$OUT_DIR"; echo 10000 > "$OUT_DIR/done" ;;\n'
        '  fail) touch "$LOG/started"; sleep 2; exit 3 ;;\n'
        '  serve) touch "$LOG/started"; while [ ! -f "$OUT_DIR/stop" ]; do sleep 0.05; done ;;\n'
        "esac\n")
    (bin_dir / "torchrun").chmod(0o755)
    return bin_dir


def test_the_script_runs_the_readmes_command_and_requeues_only_a_run_that_served_the_stop(
        slurm, fake_torchrun, tmp_path):
    out = tmp_path / "out"

    def submit(name, fake, gpus=2, **env):
        log = tmp_path / name
        log.mkdir()
        job = slurm.submit(gpus=gpus, PATH=f"{fake_torchrun}{os.pathsep}{slurm.env['PATH']}", OUT_DIR=str(out),
                           FAKE=fake, LOG=str(log), **env)
        return log, job

    def started(log):
        return (log / "started").exists

    log, job = submit("finished", "finish", NPROC_PER_NODE="3")  # the job's GPUs win
    assert slurm.wait(job) == dict(JobState="COMPLETED", Restarts="0", ExitCode="0:0")
    command = readme_multinode_command().split()[1:]
    port = re.search(r"--rdzv_endpoint=\S+:(\d+)", (log / "torchrun").read_text())[1]
    expected = " ".join(command).replace("--nnodes=2", "--nnodes=1").replace("--nproc_per_node=8", "--nproc_per_node=2") \
        .replace("$HEAD_NODE:29500", f"{socket.gethostname()}:{port}").replace("--rdzv_id=owt-M", "--rdzv_id=mhclite-test")
    assert (log / "torchrun").read_text() == f"{expected} --out_dir={out}\n"

    log, job = submit("without_gpus", "finish", gpus=0, NPROC_PER_NODE="3")
    assert slurm.wait(job)["JobState"] == "COMPLETED"
    assert "--nproc_per_node=3 " in (log / "torchrun").read_text()

    log, job = submit("without_gpus_or_count", "finish", gpus=0)
    assert slurm.wait(job) == dict(JobState="FAILED", Restarts="0", ExitCode="2:0")
    assert slurm.output(job).startswith("error: this job has no GPUs (SLURM_GPUS_ON_NODE is not set); ")
    assert len(slurm.output(job).splitlines()) == 1 and not (log / "torchrun").exists()

    (out / "done").unlink()
    (out / "stop").touch()  # a request that a killed job left behind
    log, job = submit("failed", "fail")
    assert slurm.wait(job) == dict(JobState="FAILED", Restarts="0", ExitCode="3:0")
    assert not (out / "stop").exists()  # removed before the start

    log, job = submit("failed_after_the_request", "fail")
    slurm.wait(job, until=started(log))
    slurm.command("scancel", "--batch", "--signal=USR1", job)
    assert slurm.wait(job) == dict(JobState="FAILED", Restarts="0", ExitCode="3:0")  # could not serve the stop
    assert "time limit near: asked" in slurm.output(job)
