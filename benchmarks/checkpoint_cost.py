"""What one checkpoint costs a run: the bytes of ckpt.pt and the seconds train.py's save takes
(rank 0 writes the model, AdamW's two moments, the RNG states; temp file, fsync, rename), and
the seconds a resume takes to load it, for each size, on this machine's disk.

    python -m benchmarks.checkpoint_cost --sizes M L --residual mhclite --out_dir out/ckpt_cost

The numbers decide --ckpt_interval: a save every k steps costs save_s / k per step, and a lost
worker costs up to k steps (docs/training.md).
"""

import argparse
import os
import sys
import time

import torch

import train
from checkpoint import load_checkpoint
from config import load_config
from model import GPT


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["M", "L"], help="model sizes (tiny, S, M, L)")
    parser.add_argument("--residual", default="mhclite", help="res, hc, mhc or mhclite")
    parser.add_argument("--repeats", type=int, default=2, help="saves per size; each is printed")
    parser.add_argument("--out_dir", required=True, help="folder on the disk to measure (a file per size)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    world = train.World(ddp=False, rank=0, size=1, device=torch.device("cpu"))
    print("| size | parameters | ckpt.pt | save (s) | load (s) |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        cfg = load_config([f"--size={size}", f"--residual={args.residual}", "--device=cpu",
                           f"--out_dir={args.out_dir}"])
        torch.manual_seed(0)
        model = GPT(train.build_model_config(cfg, train.GPT2_PADDED_VOCAB))
        optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), "cpu")
        for p in model.parameters():  # one step on zero gradients creates AdamW's full state
            p.grad = torch.zeros_like(p)
        optimizer.step()
        state = train.TrainState(model, optimizer, train.make_generator(cfg.seed, train.TRAIN_STREAM), step=1)
        path = os.path.join(args.out_dir, f"ckpt-{size}.pt")
        saves = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            train.save_run(path, state, cfg, world)
            saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_checkpoint(path)
        load_s = time.perf_counter() - start
        print(f"| {size} | {model.get_num_params() / 1e6:.0f}M | {os.path.getsize(path) / 1e9:.2f} GB | "
              f"{' / '.join(f'{s:.1f}' for s in saves)} | {load_s:.1f} |", flush=True)
        os.remove(path)
        del model, optimizer, state


if __name__ == "__main__":
    main()
