"""Reading checkpoints outside training, with no model code (sample.load_model builds the model):
find a run's checkpoint, read its items verified against their digests, load its weights into a
module; list every checkpoint of a run folder with its step and whether it verifies; write a
sharded checkpoint as one file. `python -m checkpoint verify | convert` runs the last two."""

import argparse
import os
import sys

import torch

from checkpoint.files import CheckpointError, Damaged, Found, save_checkpoint, verify_file
from checkpoint.sharded import (RUN_STATE_FILE, ShardedStorage, read_model_items, read_weights, sharded_path,
                               verify_folder)
from checkpoint.single_file import SINGLE_NAME, OneFileStorage


def storages(out_dir):
    return OneFileStorage(out_dir), ShardedStorage(out_dir)


def find_checkpoint(path):
    """The checkpoint at path (a file, or a sharded checkpoint folder or its link), or the newest
    checkpoint of the run folder at path: ckpt.pt, else the sharded ckpt.dcp (complete or not:
    reading it says what is wrong), else the newest kept one; without any, the run folder's ckpt.pt,
    which read_checkpoint reports as not found."""
    if os.path.isfile(path) or any(os.path.isfile(os.path.join(path, name)) for name in (RUN_STATE_FILE, ".metadata")):
        return path
    for newest in (os.path.join(path, SINGLE_NAME), sharded_path(path)):
        if os.path.isfile(newest) or os.path.isdir(newest):
            return newest
    for storage in storages(path):
        found = storage.found()
        if found:
            return found[0].path
    return os.path.join(path, SINGLE_NAME)


def read_checkpoint(path):
    """The items of the checkpoint at path (a sharded one: all but the weights), every file
    verified against its digests first. A damaged checkpoint is a Damaged line that names the
    checkpoints kept beside it."""
    if not os.path.exists(path):
        raise Damaged(f"checkpoint not found: {path}; name a run folder that holds one (train.py's --out_dir) or a "
                      f"checkpoint in it")
    storage = ShardedStorage(os.path.dirname(path)) if os.path.isdir(path) else OneFileStorage(os.path.dirname(path))
    try:
        return storage.read(Found(path, None))[0]
    except Damaged as e:
        older = [f for s in storages(os.path.dirname(path)) for f in s.found() if f.path != path]
        if not older:
            raise
        raise Damaged(f"{e}; beside it: {', '.join(f.describe() for f in older)}: move {path} aside to read the "
                      f"newest of them (python -m checkpoint verify {os.path.dirname(path)} says which verify)"
                      ) from None


def load_weights(path, ckpt, module):
    """Load the weights of the checkpoint at path (ckpt: its items, from read_checkpoint) into a plain
    module in this process. A sharded run stores each 0-D parameter as a 1-element vector (and a
    checkpoint written from it as one file keeps them so): they are read into the module's 0-D ones."""
    if os.path.isdir(path):
        read_weights(path, module)
        return
    own = module.state_dict()
    module.load_state_dict({k: v.reshape(()) if k in own and own[k].dim() == 0 and v.shape == (1,) else v
                            for k, v in ckpt["model"].items()})


def verify_run(out_dir):
    """[(path, step, verdict)] for every checkpoint of the run folder, newest first: "verified",
    "not verified: ..." for one written before checkpoints carried digests (it loads), or
    "damaged: ..."."""
    rows = []
    for storage in storages(out_dir):
        for found in storage.found():
            step = found.step
            try:
                if os.path.isdir(found.path):
                    verified = verify_folder(found.path)
                else:
                    saved = verify_file(found.path)
                    verified = saved is not None
                    step = saved["step"] if verified and saved.get("step") is not None else step
                    if not verified:  # the old checkpoint loads, its tensors mapped, not read
                        step = torch.load(found.path, map_location="cpu", weights_only=True, mmap=True)["step"]
                verdict = "verified" if verified else \
                    "not verified: no digests (written before checkpoints carried them)"
            except Damaged as e:
                verdict = f"damaged: {e}"
            except Exception as e:  # torch raises many types for damaged files
                verdict = f"damaged: {found.path} is truncated, corrupt or not a checkpoint ({type(e).__name__})"
            rows.append((found.path, step, verdict))
    return rows


def write_single_file(sharded, path):
    """Write the weights and run state of the sharded checkpoint folder `sharded` as one ckpt.pt at
    `path`, for tools that want a file; it has no optimizer state: continue the run from the sharded
    checkpoint."""
    ckpt = read_checkpoint(sharded)
    save_checkpoint(path, dict(ckpt, model=read_model_items(sharded)))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m checkpoint", description="A run's checkpoints, outside training.")
    commands = p.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="list every checkpoint of a run folder with its step, and whether its "
                                                "bytes match the digests recorded when it was saved (exit 1 if one "
                                                "is damaged)")
    verify.add_argument("out_dir", help="the run folder, e.g. out/run")
    convert = commands.add_parser("convert", help="write a sharded checkpoint (a --parallel=fsdp run's ckpt.dcp) as "
                                                  "one ckpt.pt with its weights and run state, read in this one "
                                                  "process (0-D parameters as the 1-element vectors the sharded run "
                                                  "holds)")
    convert.add_argument("sharded", help="the sharded checkpoint folder, e.g. out/run/ckpt.dcp")
    convert.add_argument("single_file", help="the ckpt.pt to write, e.g. out/run-single/ckpt.pt")
    args = p.parse_args(argv)
    try:
        if args.command == "verify":
            rows = verify_run(args.out_dir)
            if not rows:
                raise CheckpointError(f"no checkpoint in {args.out_dir}; name a run folder (train.py's --out_dir)")
            for path, step, verdict in rows:
                print(f"{path}  step {'unknown' if step is None else step}  {verdict}")
            if any(verdict.startswith("damaged") for _, _, verdict in rows):
                sys.exit(1)
            return
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.single_file))):
            raise CheckpointError(f"no folder for {args.single_file}; create it first")
        write_single_file(args.sharded, args.single_file)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
