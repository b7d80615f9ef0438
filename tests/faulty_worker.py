"""train.py with a fault, for tests: run under torchrun in place of train.py, with the same
arguments. On torchrun's first launch (TORCHELASTIC_RESTART_COUNT=0) in a batch job's first start
(SLURM_RESTART_COUNT unset or 0), a run from scratch in every test that uses it (so the n-th step this
process takes is step n), just before optimizer step FAULT_BEFORE_STEP, the rank FAULT_RANK
kills itself with SIGKILL (FAULT=sigkill: an out-of-memory kill, a lost node), sends SIGTERM to
torchrun (FAULT=sigterm_launcher: what a scheduler does before a time limit), or waits until the
file HOLD_UNTIL exists (FAULT=hold: the step in flight when a test's stop request comes, at most 60
s; the file HOLD_UNTIL.held says the hold has begun, so every earlier step's save is done). Every later launch runs train.py untouched, rank 1 starting
RESTART_DELAY seconds late (default 0) so that the other ranks reach torchrun's store first."""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

FAULT = os.environ["FAULT"]
FAULT_RANK = int(os.environ["FAULT_RANK"])
FAULT_BEFORE_STEP = int(os.environ["FAULT_BEFORE_STEP"])
real_train_step = train.train_step
steps_taken = 0


def train_step_with_fault(*args):
    global steps_taken
    steps_taken += 1
    if steps_taken == FAULT_BEFORE_STEP and int(os.environ["RANK"]) == FAULT_RANK:
        if FAULT == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif FAULT == "sigterm_launcher":
            term_launcher_and_wait()
        elif FAULT == "hold":
            open(os.environ["HOLD_UNTIL"] + ".held", "w").close()
            wait_for_file(os.environ["HOLD_UNTIL"])
    return real_train_step(*args)


def term_launcher_and_wait():
    """SIGTERM to torchrun, then wait until torchrun's SIGTERM reaches this worker, so that the
    run stops at the end of this step however slowly the machine passes it on."""
    received = []
    handler = signal.getsignal(signal.SIGTERM)

    def record_and_pass_on(signum, frame):
        received.append(signum)
        if callable(handler):
            handler(signum, frame)

    signal.signal(signal.SIGTERM, record_and_pass_on)
    os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_for_file(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def first_launch():
    """torchrun's first launch in a batch job's first start; with FAULT_ONCE (a file's path) instead,
    the first launch anywhere, as restart counts differ between torchrun's nodes after a restart."""
    if "FAULT_ONCE" in os.environ:
        if int(os.environ["RANK"]) != FAULT_RANK:
            return True  # the fault is FAULT_RANK's alone
        try:
            os.close(os.open(os.environ["FAULT_ONCE"], os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False
    return os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"


if first_launch():
    train.train_step = train_step_with_fault
elif os.environ["RANK"] == "1":
    time.sleep(float(os.environ.get("RESTART_DELAY", "0")))
train.main()
