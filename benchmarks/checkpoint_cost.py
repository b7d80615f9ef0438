"""What one checkpoint costs a run, on this machine's disk, through the run's own checkpoint manager
(checkpoint.CheckpointManager, as train.py saves).

    python -m benchmarks.checkpoint_cost --sizes M L --residual mhclite --out_dir out/ckpt_cost

One process: the bytes of ckpt.pt, the seconds a save takes (rank 0 writes the model, AdamW's two
moments, the RNG states, hashing them as they go; temp file, fsync, digest record, rename) and the
seconds a resume takes to verify and load it, and what the digests cost per GB: SHA-256 of the bytes
in memory (what a save adds) and the file read and hashed again (what a load adds, from the page
cache right after the save).

    python -m benchmarks.checkpoint_cost --sharded --sizes S --out_dir out/ckpt_cost

Two gloo processes on CPU, the model sharded (parallelize.apply_fsdp): how long a sharded save
(ckpt.dcp) blocks the training loop, synchronous against asynchronous, and how long until the
checkpoint is published; the slowest rank of each save.

The numbers decide --ckpt_interval: a save every k steps costs its stall / k per step, and a lost
worker costs up to k steps (docs/training.md).
"""

import argparse
import hashlib
import os
import shutil
import socket
import sys
import time
import types

import torch
import torch.distributed as dist

from checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, TrainState, load_checkpoint
from checkpoint.files import file_digest
from config import load_config
from model import GPT, GPTConfig, model_shape


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["M", "L"], help="model sizes (tiny, S, M, L)")
    parser.add_argument("--residual", default="mhclite", help="res, hc, mhc or mhclite")
    parser.add_argument("--repeats", type=int, default=2, help="saves per size (and mode); each is printed")
    parser.add_argument("--sharded", action="store_true", help="two sharded processes: the stall of a sharded save, "
                                                               "synchronous and asynchronous")
    parser.add_argument("--out_dir", required=True, help="folder on the disk to measure (a folder per size)")
    return parser.parse_args(argv)


def run_state(size, residual, out_dir, sharded, world):
    """The config and the states a checkpoint holds: the model with AdamW's full state (one step on
    zero gradients), its TrainState and the RNG states."""
    cfg = load_config([f"--size={size}", f"--residual={residual}", "--device=cpu", f"--out_dir={out_dir}",
                       f"--parallel={'fsdp' if sharded else 'ddp'}"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(residual=cfg.residual, n_streams=cfg.n_streams, block_size=cfg.block_size,
                          **model_shape(size)))
    if sharded:
        from parallelize import apply_fsdp
        apply_fsdp(model)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), "cpu")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return cfg, dict(model=ModelState(model), optimizer=OptimizerState(model, optimizer),
                     train=TrainState(torch.Generator().manual_seed(cfg.seed)), rng=RNGState(world))


def to_stderr(line):
    print(line, file=sys.stderr, flush=True)


def single_file(args):
    world = types.SimpleNamespace(distributed=False, rank=0, size=1, device=torch.device("cpu"), sharded=False,
                                  master=True)
    print("| size | parameters | ckpt.pt | save (s) | load (s) | SHA-256 in memory (s/GB) | file read and hashed "
          "(s/GB) |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        folder = os.path.join(args.out_dir, size)
        cfg, states = run_state(size, args.residual, folder, False, world)
        os.makedirs(folder, exist_ok=True)
        checkpoints = CheckpointManager(cfg, world, to_stderr)
        checkpoints.restore(states, None)
        saves = []
        for repeat in range(args.repeats):
            states["train"].step = repeat + 1
            start = time.perf_counter()
            checkpoints.save(force=True)
            saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_checkpoint(checkpoints.path)
        load_s = time.perf_counter() - start
        gigabytes = os.path.getsize(checkpoints.path) / 1e9
        print(f"| {size} | {states['model'].model.get_num_params() / 1e6:.0f}M | {gigabytes:.2f} GB | "
              f"{' / '.join(f'{s:.2g}' for s in saves)} | {load_s:.2g} | {digest_seconds(checkpoints.path)} |",
              flush=True)
        shutil.rmtree(folder)


def digest_seconds(path):
    """"<in memory> | <file read and hashed>", in seconds per GB, for the file at path."""
    with open(path, "rb") as f:
        data = f.read()
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    in_memory = time.perf_counter() - start
    start = time.perf_counter()
    file_digest(path)
    from_file = time.perf_counter() - start
    gigabytes = len(data) / 1e9
    return f"{in_memory / gigabytes:.2f} | {from_file / gigabytes:.2f}"


def sharded_worker(rank, args, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    world = types.SimpleNamespace(distributed=True, rank=rank, size=2, device=torch.device("cpu"), sharded=True,
                                  master=rank == 0)
    if rank == 0:
        print("| size | parameters | mode | loop blocked (s) | until published (s) |")
        print("|---|---|---|---|---|")
    for size in args.sizes:
        for asynchronous in (False, True):
            folder = os.path.join(args.out_dir, size)
            cfg, states = run_state(size, args.residual, folder, True, world)
            if rank == 0:
                os.makedirs(folder, exist_ok=True)
            dist.barrier()
            checkpoints = CheckpointManager(cfg, world, to_stderr, asynchronous=asynchronous)
            checkpoints.restore(states, None)
            for repeat in range(args.repeats):
                states["train"].step = repeat + 1
                dist.barrier()
                start = time.perf_counter()
                checkpoints.save(force=True)  # what the loop waits for
                blocked = time.perf_counter() - start
                checkpoints.wait()
                published = time.perf_counter() - start
                times = torch.tensor([blocked, published], dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                if rank == 0:
                    print(f"| {size} | {states['model'].model.get_num_params() / 1e6:.0f}M | "
                          f"{'asynchronous' if asynchronous else 'synchronous'} | {times[0]:.2f} | {times[1]:.2f} |",
                          flush=True)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder)
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if not args.sharded:
        single_file(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(sharded_worker, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
