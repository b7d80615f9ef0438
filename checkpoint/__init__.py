"""Checkpoints, along torchtitan's seams: the manager knows policy, the states say what a checkpoint
holds, the storage knows files.

    manager.py      CheckpointManager: how a run starts (scratch, resume from the newest checkpoint
                    that loads and verifies, finished), when to save, what to keep, the `done` marker
    states.py       the Stateful parts a checkpoint holds: model, optimizer, train state, RNG
    single_file.py  the one-file storage, ckpt.pt and the ckpt.<step>.pt kept beside it
    sharded.py      the sharded storage, ckpt.dcp (torch.distributed.checkpoint): async saves, the
                    link swap, repairs once a start has decided, safe loading
    files.py        every file of a checkpoint: atomic locked writes, digests recorded while writing
                    and verified before reading; damaged checkpoints set aside
    resume.py       what a resume may change, and what it refuses
    owner.py        one writer per run folder: a live run's folder refused, a gone owner's taken over
    reading.py      checkpoints for tools (find, read verified, weights into a module) and `python -m
                    checkpoint verify <run folder> | convert <ckpt.dcp> <ckpt.pt>`

It imports no model or training code: the states take any module and optimizer. Callers import
from the package: `from checkpoint import CheckpointManager, read_checkpoint`.
"""

from checkpoint.files import CheckpointError, Damaged, load_checkpoint, remove_stale_temp_files, save_checkpoint
from checkpoint.manager import (CheckpointManager, SaveError, checkpoint_bytes, disk_bytes, has_checkpoint,
                                low_space_warning, run_checkpoints, save_failure_line)
from checkpoint.owner import RunOwner
from checkpoint.reading import find_checkpoint, load_weights, main, read_checkpoint
from checkpoint.resume import model_args
from checkpoint.sharded import load_sharded_run
from checkpoint.states import ModelState, OptimizerState, RNGState, TrainState

__all__ = ["CheckpointError", "CheckpointManager", "Damaged", "ModelState", "OptimizerState", "RNGState", "RunOwner",
           "SaveError", "TrainState", "checkpoint_bytes", "disk_bytes", "find_checkpoint", "has_checkpoint",
           "load_checkpoint", "load_sharded_run", "load_weights", "low_space_warning", "main", "model_args",
           "read_checkpoint", "remove_stale_temp_files", "run_checkpoints", "save_checkpoint", "save_failure_line"]
