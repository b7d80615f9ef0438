"""SLURM on one machine, for tests (no cluster here), behaving as SLURM does by its source and
manual: `submit` is sbatch (the script's #SBATCH header, read up to its first command, with
command-line options over it; the batch shell in a session of its own; SLURM_* variables), and
Job.signal_time_limit sends what `#SBATCH --signal=[B:]SIG@T` asks for: with B: to the batch shell
only, without it to every process of every job step (not the shell, not srun). srun and scontrol
stand-ins live beside this file. SLURM finds a step's processes by cgroup; here they are the tasks
and their descendants by parent pid."""
import contextlib
import os
import re
import signal
import subprocess
import time

BIN = os.path.dirname(os.path.abspath(__file__))
SBATCH_LINE = re.compile(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?")


def descendants(pids):
    """pids and every process below them."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # exited meanwhile
            parent = int(stat[stat.rindex(")") + 2:].split()[1])  # "pid (comm) state ppid ..."
            children.setdefault(parent, []).append(int(name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def signal_all(pids, signum):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def sbatch_options(script):
    """{option: value} of the #SBATCH lines before the script's first command, as sbatch reads them."""
    options = {}
    with open(script, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                break
            match = SBATCH_LINE.match(line)
            if match:
                options[match[1]] = match[2]
    return options


def signal_number(name):
    return int(name) if name.isdigit() else getattr(signal, name if name.startswith("SIG") else "SIG" + name)


class Job:
    """One start of a batch job: the script run by bash as SLURM's batch step."""

    def __init__(self, script, args, options, env, submit_dir, log_dir, job_id, restart_count):
        self.script, self.args, self.options, self.log_dir = script, args, options, log_dir
        self.submit_dir = submit_dir
        self.job_id, self.restart_count, self.env = job_id, restart_count, env
        path = f"{BIN}:{env['PATH']}"
        environment = dict(env, PATH=path, SLURM_STANDIN_PATH=path, SLURM_STANDIN_LOG=str(log_dir),
                           SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME=options["job-name"],
                           SLURM_JOB_NODELIST=options["nodelist"], SLURM_JOB_NUM_NODES=options["nodes"],
                           SLURM_NNODES=options["nodes"], SLURM_RESTART_COUNT=str(restart_count),
                           SLURM_SUBMIT_DIR=str(submit_dir))
        if "cpus-per-task" in options:
            environment["SLURM_CPUS_PER_TASK"] = options["cpus-per-task"]
        if "gpus-per-node" in options:
            environment["SLURM_GPUS_ON_NODE"] = options["gpus-per-node"]
        self.requeues_before = self.requeues()
        output = open(os.path.join(log_dir, f"job-{job_id}.out"), "a")  # --open-mode=append
        self.shell = subprocess.Popen(["bash", script, *args], cwd=submit_dir, env=environment, stdout=output,
                                      stderr=output, start_new_session=True)
        output.close()

    def requeues(self):
        """How many `scontrol requeue` of this job were made so far."""
        path = os.path.join(self.log_dir, "scontrol")
        if not os.path.exists(path):
            return 0
        with open(path, encoding="utf-8") as f:
            return sum(line.split() == ["requeue", str(self.job_id)] for line in f)

    def signal_time_limit(self):
        """What `#SBATCH --signal=[B:]SIG@T` sends T seconds before the time limit."""
        spec, _ = self.options["signal"].split("@")
        if spec.startswith("B:"):
            os.kill(self.shell.pid, signal_number(spec[2:]))
            return
        sruns = [pid for pid in descendants([self.shell.pid])[1:] if is_srun(pid)]
        steps = [pid for srun in sruns for pid in descendants([srun])[1:]]
        signal_all(steps, signal_number(spec))

    def wait(self, timeout):
        """The batch script's exit code, and how many times it requeued this job. Past the timeout
        every process of the job is killed, as at a time limit, and TimeoutExpired raised."""
        try:
            code = self.shell.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_all(descendants([self.shell.pid]), signal.SIGKILL)
            raise
        return code, self.requeues() - self.requeues_before

    def start_requeued(self):
        """The job as SLURM starts it again after a requeue: same id, SLURM_RESTART_COUNT + 1."""
        return Job(self.script, self.args, self.options, self.env, self.submit_dir, self.log_dir, self.job_id,
                   self.restart_count + 1)


def is_srun(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.join(BIN, "srun").encode() in f.read()
    except OSError:
        return False


def submit(script, args=(), env=None, submit_dir=".", log_dir=".", job_id=4242, **options):
    """sbatch [--option=value ...] script args, run from submit_dir: options (underscores for dashes)
    over the #SBATCH header; nodelist: the nodes SLURM allocated, as SLURM_JOB_NODELIST writes them."""
    merged = dict(sbatch_options(script), **{key.replace("_", "-"): str(value) for key, value in options.items()})
    return Job(script, list(args), merged, dict(os.environ if env is None else env), submit_dir, log_dir, job_id, 0)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.05)
