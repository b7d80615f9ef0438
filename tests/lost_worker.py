"""train.py with a lost worker, for tests: run under torchrun in place of train.py, with the same
arguments. On torchrun's first launch (TORCHELASTIC_RESTART_COUNT=0) the rank KILL_RANK kills
itself with SIGKILL just before optimizer step KILL_BEFORE_STEP, as an out-of-memory kill or a
lost node would; every later launch runs train.py untouched."""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

KILL_RANK = int(os.environ["KILL_RANK"])
KILL_BEFORE_STEP = int(os.environ["KILL_BEFORE_STEP"])
real_train_step = train.train_step


def train_step_or_die(train_model, state, *args):
    if state.step + 1 == KILL_BEFORE_STEP and int(os.environ["RANK"]) == KILL_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_train_step(train_model, state, *args)


if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    train.train_step = train_step_or_die
train.main()
