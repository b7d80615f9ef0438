"""Reading a run's checkpoint in tools (sampling, export, analysis): find it, build the model from
it; and a sharded checkpoint written as one file (python -m checkpoint)."""

import argparse
import os
import sys

from checkpoint.sharded import load_sharded, load_sharded_run, sharded_path
from checkpoint.single_file import CheckpointError, load_checkpoint, save_checkpoint
from model import GPT, GPTConfig


def load_model(path, device="cpu"):
    """(GPT in eval mode with the checkpoint's weights, checkpoint dict). path: a ckpt.pt, or a
    sharded checkpoint folder (ckpt.dcp) read in this one process; its dict then has no "model"."""
    sharded = os.path.isdir(path)
    ckpt = load_sharded_run(path) if sharded else load_checkpoint(path)
    try:
        model = GPT(GPTConfig(**ckpt["model_args"]))
        if sharded:
            load_sharded(path, model)
        else:
            model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: cannot build the model from it ({reason})") from None
    model.to(device)
    model.eval()
    return model, ckpt


def find_checkpoint(out_dir):
    """The checkpoint of a run folder for reading: ckpt.pt, else the sharded ckpt.dcp if there is
    one (else ckpt.pt's path, which load_model reports as not found)."""
    single = os.path.join(out_dir, "ckpt.pt")
    return sharded_path(out_dir) if not os.path.isfile(single) and os.path.isdir(sharded_path(out_dir)) else single


def write_single_file(sharded, path):
    """Write the weights and run state of the sharded checkpoint folder `sharded` as one ckpt.pt
    at `path`, for tools that want a file; it has no optimizer state: continue the run from the
    sharded checkpoint."""
    model, ckpt = load_model(sharded)
    save_checkpoint(path, dict(ckpt, model=model.state_dict()))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m checkpoint",
                                description="Write a sharded checkpoint (a --parallel=fsdp run's ckpt.dcp) as one "
                                            "ckpt.pt with its weights and run state, read in this one process.")
    p.add_argument("sharded", help="the sharded checkpoint folder, e.g. out/run/ckpt.dcp")
    p.add_argument("single_file", help="the ckpt.pt to write, e.g. out/run-single/ckpt.pt")
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.single_file))):
            raise CheckpointError(f"no folder for {args.single_file}")
        write_single_file(args.sharded, args.single_file)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
