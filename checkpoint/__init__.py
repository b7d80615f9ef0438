"""Checkpoints, along torchtitan's seams:

    manager.py      CheckpointManager: how a run starts (scratch, resume, finished), when to save,
                    what to keep, the `done` marker; TrainState: what a checkpoint holds
    single_file.py  the one-file format, ckpt.pt: atomic locked writes, cleanup after killed saves
    sharded.py      the sharded format, ckpt.dcp (torch.distributed.checkpoint): async saves, the
                    link swap, recovery at a start, safe loading
    resume.py       what a resume may change, and what it refuses
    owner.py        one writer per run folder: a live run's folder refused, a gone owner's taken over
    reading.py      a run's model for tools (sampling, export, analysis); `python -m checkpoint
                    <ckpt.dcp> <ckpt.pt>` writes a sharded checkpoint as one file

Callers import from the package: `from checkpoint import CheckpointManager, load_model`.
"""

from checkpoint.manager import (CheckpointManager, SaveError, TrainState, checkpoint_bytes, disk_bytes, has_checkpoint,
                                low_space_warning, run_checkpoints, save_failure_line)
from checkpoint.owner import RunOwner
from checkpoint.reading import find_checkpoint, load_model, main
from checkpoint.sharded import load_sharded_run
from checkpoint.single_file import CheckpointError, load_checkpoint, remove_stale_temp_files, save_checkpoint
