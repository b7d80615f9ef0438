"""Collect the connection matrices of a trained HC-family model (paper Sec. 4.3): run the first
`--num_seqs` sequences of length `--seq_len` of the training split (or, with `--split val`, of
the held-out split) through the model under
residuals.capture_connections and save, per wrapper and per token, as float32 in an .npz:

  h_res (W, N, n, n)         x_next[i] = sum_j h_res[i, j] x[j]      (every variant but res; ihc: I)
  h_pre, h_post (W, N, n)
  logits (W, N, n, n)        mhc only: the Sinkhorn input is exp(logits)
  perm_weights (W, N, K)     mhclite only: the convex weights over the K permutations `perms` (K, n)
  factor_weights (W, N, R)   kromhc only: each factor's softmax weights over its p! permutations, in the
                             order of `factors` (R = sum of p!)

W = 2 * n_layer wrappers in forward order (wrapper w is the attention (w even) or MLP (w odd)
connection of layer w // 2). Token j of the N collected tokens is <split>.bin token
`token_index[j]` (sequence token_index // seq_len, position token_index % seq_len); without
--max_tokens that is all num_seqs * seq_len tokens in order, with it a seeded sorted subsample.
Metadata arrays: residual, variant (analysis.common.variant_of), dataset, size, split, run_seed
(training seed), n_layer, n_streams, step, wrapper, wrapper_layer, wrapper_sublayer, num_seqs, seq_len,
seed (subsample seed), checkpoint; perms (mhclite), factors (kromhc).

    python analysis/collect.py --ckpt out/shakespeare_char-tiny-mhc-s1/ckpt.pt --out out/analysis/mhc.npz
"""
import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import numpy as np
import torch
from tqdm import tqdm

from analysis.common import AnalysisError, variant_of
from checkpoint import CheckpointError
from residuals import capture_connections
from sample import load_model


def collect_shapes(model):
    """{array name: shape without the token axis} for the arrays this model's variant records."""
    cfg = model.config
    n, n_wrappers = cfg.n_streams, 2 * cfg.n_layer
    shapes = {"h_res": (n_wrappers, n, n), "h_pre": (n_wrappers, n), "h_post": (n_wrappers, n)}
    if cfg.residual == "mhc":
        shapes["logits"] = (n_wrappers, n, n)
    if cfg.residual == "mhclite":
        shapes["perm_weights"] = (n_wrappers, model.connections()[0].perms.shape[0])
    if cfg.residual == "kromhc":
        shapes["factor_weights"] = (n_wrappers, model.connections()[0].res_logits)
    return shapes


SPLITS = ("train", "val")


def split_tokens(ckpt, data_dir, num_seqs, seq_len, split="train"):
    """The first num_seqs * seq_len tokens of the run's <split>.bin (memory-mapped)."""
    if split not in SPLITS:
        raise AnalysisError(f"unknown split '{split}'; valid: {', '.join(SPLITS)}")
    config = ckpt["config"]
    path = os.path.join(data_dir or config["data_dir"], config["dataset"], f"{split}.bin")
    if not os.path.isfile(path):
        raise AnalysisError(f"{split} data not found: {path} (pass --data_dir)")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    need = num_seqs * seq_len
    if len(tokens) < need:
        raise AnalysisError(f"{path} has {len(tokens)} tokens, fewer than {num_seqs} x {seq_len}; "
                            "lower --num_seqs or --seq_len")
    return tokens[:need]


def write_npz_atomically(path, arrays):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp_path, path)
    except BaseException:
        os.unlink(tmp_path)
        raise


def collect(ckpt_path, out_path, num_seqs=64, seq_len=1024, batch_size=8, max_tokens=None, seed=0,
            data_dir=None, device="cpu", dtype="float32", split="train"):
    """Writes the npz described in the module docstring to out_path; returns its metadata."""
    for name, value in (("num_seqs", num_seqs), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value < 1:
            raise AnalysisError(f"--{name} must be at least 1, got {value}")
    if max_tokens is not None and max_tokens < 1:
        raise AnalysisError(f"--max_tokens must be at least 1, got {max_tokens}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise AnalysisError(f"unknown device '{device}'; valid: cpu, cuda, cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AnalysisError("--device cuda asked for, but CUDA is not available")
    model, ckpt = load_model(ckpt_path, device)
    cfg = model.config
    if cfg.residual == "res":
        raise AnalysisError(f"nothing to collect: '{ckpt_path}' is a res model, and res has no H_res")
    if seq_len > cfg.block_size:
        raise AnalysisError(f"--seq_len {seq_len} exceeds the model's block_size {cfg.block_size}")
    tokens = split_tokens(ckpt, data_dir, num_seqs, seq_len, split)

    total = num_seqs * seq_len
    if max_tokens is None or max_tokens >= total:
        token_index = np.arange(total)
    else:
        token_index = np.sort(np.random.default_rng(seed).choice(total, size=max_tokens, replace=False))
    shapes = collect_shapes(model)
    n_wrappers = 2 * cfg.n_layer

    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    # Per-batch results go into memory-mapped arrays, so memory stays bounded for L models.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        arrays = {name: np.lib.format.open_memmap(os.path.join(tmp, name + ".npy"), mode="w+", dtype=np.float32,
                                                  shape=(shape[0], len(token_index), *shape[1:]))
                  for name, shape in shapes.items()}
        for first in tqdm(range(0, num_seqs, batch_size), desc="collect", unit="batch"):
            last = min(first + batch_size, num_seqs)
            batch = torch.from_numpy(tokens[first * seq_len: last * seq_len].astype(np.int64))
            autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
            with torch.no_grad(), autocast, capture_connections(model) as records:
                model(batch.view(-1, seq_len).to(device))
            if [r["wrapper"] for r in records] != list(range(n_wrappers)):
                raise AnalysisError(f"expected one record per wrapper 0..{n_wrappers - 1} in forward order, "
                                    f"got {[r['wrapper'] for r in records]}")
            lo, hi = np.searchsorted(token_index, [first * seq_len, last * seq_len])
            keep = torch.from_numpy(token_index[lo:hi] - first * seq_len).to(device)
            for w, record in enumerate(records):
                for name, shape in shapes.items():
                    values = record[name].reshape(-1, *shape[1:])[keep]
                    arrays[name][w, lo:hi] = values.cpu().numpy()
        metadata = {
            "residual": cfg.residual, "variant": variant_of(cfg.residual, cfg.mhc_eps),
            "dataset": ckpt["config"]["dataset"], "size": ckpt["config"]["size"],
            "split": split, "run_seed": ckpt["config"]["seed"],
            "n_layer": cfg.n_layer, "n_streams": cfg.n_streams, "step": int(ckpt["step"]),
            "wrapper": np.arange(n_wrappers), "wrapper_layer": np.arange(n_wrappers) // 2,
            "wrapper_sublayer": np.array(["attn", "mlp"] * cfg.n_layer),
            "token_index": token_index, "num_seqs": num_seqs, "seq_len": seq_len, "seed": seed,
            "checkpoint": os.path.abspath(ckpt_path),
        }
        if cfg.residual == "mhclite":
            metadata["perms"] = model.connections()[0].perms.cpu().numpy()
        if cfg.residual == "kromhc":
            metadata["factors"] = np.array(model.connections()[0].factors)
        write_npz_atomically(out_path, {**arrays, **metadata})
    return metadata


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True,
                   help="checkpoint written by train.py (ckpt.pt, or a sharded run's ckpt.dcp folder)")
    p.add_argument("--out", required=True, help="output .npz path")
    p.add_argument("--num_seqs", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--max_tokens", type=int, default=None, help="keep a seeded random subset of this many tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the --max_tokens subsample")
    p.add_argument("--split", default="train", choices=SPLITS, help="val: held-out text")
    p.add_argument("--data_dir", default=None, help="folder holding <dataset>/<split>.bin (default: the run's data_dir)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="bfloat16: autocast as in GPU training (the coefficients are fp32 either way)")
    args = p.parse_args(argv)
    try:
        collect(args.ckpt, args.out, args.num_seqs, args.seq_len, args.batch_size, args.max_tokens,
                args.seed, args.data_dir, args.device, args.dtype, args.split)
    except (AnalysisError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
