"""Micro-benchmarks of the residual variants: one connection module alone, and H_res construction alone.

    python -m benchmarks.micro --size tiny --device cpu
    python -m benchmarks.micro --size M        # on a GPU: cuda, bf16 autocast, 16 x 1024

Interleaved as bench.py interleaves training steps; what each table measures: docs/benchmarks.md.
Markdown to stdout, JSON to --json (default out/bench/<size>-<device>-<dtype>-micro.json).
"""

import argparse
import math
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from devices import autocast_context, synchronize
from model import STREAM_DTYPES, GPTConfig
from parallelize import connection_path
from residuals import permutation_matrices, permutations, sinkhorn

from .common import (HC_FAMILY, BenchError, add_shared_flag, build_models, environment, fmt, interleaved_times,
                     kernels_where_asked, main_variants, markdown_table, resolve_shared_flags, summarise, write_json)


def half(u):
    """The cheap stand-in branch: what is left to time is the connection's own work."""
    return 0.5 * u


def connection_step(module, x, grad, ctx):
    """A step function: the module's forward on x with the cheap branch, and its backward."""
    inputs = [x, *module.parameters()]

    def step(r):
        with ctx:
            y = module(x, half)
        torch.autograd.grad(y, inputs, grad)

    return step


def micro_connections(variants, args, device):
    """Each variant's connection module alone, forward + backward at the model's (B, T, n, C): the
    first connection of a one-layer model, recomputed and fused as train.py would run it."""
    generator = torch.Generator().manual_seed(args.seed)
    ctx = autocast_context(args, device)[1]
    steps, paths = {}, {}
    for name, variant in variants.items():
        config = variant.config
        shape = (args.batch_size, args.block_size, config.n_streams, config.n_embd)
        dtype = STREAM_DTYPES[config.stream_dtype] if config.residual in HC_FAMILY else torch.float32
        x = torch.randn(shape, generator=generator).to(device, dtype).requires_grad_()
        grad = torch.randn(shape, generator=generator).to(device, dtype)
        model = build_models({name: variant}, args.seed, device)[name]
        steps[name] = connection_step(model.connections()[0], x, grad, ctx)
        paths[name] = connection_path(model, device, variant.fused_connections)
    times = interleaved_times(steps, args.warmup + args.steps, args.warmup, device, "micro: connections")
    summary = summarise(times, {name: "res" for name in variants})
    for name, row in summary.items():
        row["connections"] = paths[name]
    return summary


def h_res_steps(n, rows, iters, seed, device):
    """fwd + bwd of mhc's H_res (Sinkhorn on (rows, n, n) logits) and of mhclite's (softmax over
    (rows, n!) logits, weighting the permutation matrices as residuals.py does)."""
    generator = torch.Generator().manual_seed(seed)
    mhc_logits = torch.randn(rows, n, n, generator=generator).to(device).requires_grad_()
    perms = permutation_matrices(permutations(n)).flatten(1).to(device)
    lite_logits = torch.randn(rows, perms.shape[0], generator=generator).to(device).requires_grad_()
    grad = torch.randn(rows, n, n, generator=generator).to(device)

    def mhc(r):
        torch.autograd.grad(sinkhorn(mhc_logits, iters), mhc_logits, grad)

    def mhclite(r):
        h_res = (torch.softmax(lite_logits, dim=-1).unsqueeze(-1) * perms).sum(-2).unflatten(-1, (n, n))
        torch.autograd.grad(h_res, lite_logits, grad)

    return {"mhc": mhc, "mhclite": mhclite}


def count_ops(fn, device):
    """Kernels launched by fn on CUDA; on CPU the top-level aten ops (those not called by another
    aten op), forward and backward."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn(0)
        synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)

    def top_level(event):
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in events if e.name.startswith("aten::") and top_level(e))


def micro_h_res(args, device, n, iters):
    """mhc's and mhclite's H_res alone on B*T rows, interleaved, with their op counts."""
    rows = args.batch_size * args.block_size
    steps = h_res_steps(n, rows, iters, args.seed, device)
    times = interleaved_times(steps, args.warmup + args.steps, args.warmup, device, "micro: H_res")
    summary = summarise(times, {"mhc": "mhclite", "mhclite": "mhclite"})
    for name, fn in steps.items():
        summary[name]["ops"] = count_ops(fn, device)
    return dict(n_streams=n, rows=rows, sinkhorn_iters=iters, **summary,
                mhc_over_mhclite_time=summary["mhc"]["time_ratio"],
                mhc_over_mhclite_ops=summary["mhc"]["ops"] / summary["mhclite"]["ops"])


def connection_table(summary):
    rows = [[name, fmt(r["median_ms"], ".3f"), fmt(r["iqr_ms"], ".3f"), fmt(r["time_ratio"], ".2f")]
            for name, r in summary.items()]
    return markdown_table(["connection alone (fwd+bwd)", "ms", "IQR ms", "x res"], rows)


def h_res_table(h_res):
    n, iters = h_res["n_streams"], h_res["sinkhorn_iters"]
    labels = {"mhc": f"mhc: sinkhorn, {iters} iters",
              "mhclite": f"mhclite: softmax-weighted sum of {math.factorial(n)} permutations"}
    rows = [[label, fmt(h_res[name]["median_ms"], ".3f"), fmt(h_res[name]["iqr_ms"], ".3f"), str(h_res[name]["ops"]),
             fmt(h_res[name]["time_ratio"], ".2f")] for name, label in labels.items()]
    return markdown_table([f"H_res alone, {h_res['rows']} x n={n} (fwd+bwd)", "ms", "IQR ms", "ops", "x mhclite"],
                          rows)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag in ("--size", "--batch_size", "--block_size", "--device", "--dtype", "--residuals", "--recompute",
                 "--stream_dtype", "--fused_connections", "--steps", "--warmup", "--seed"):
        add_shared_flag(parser, flag)
    parser.add_argument("--json", help="output path (default out/bench/<size>-<device>-<dtype>-micro.json)")
    return parser.parse_args(argv)


def run(args, argv):
    device = torch.device(args.device_type)
    variants = main_variants(args.residual_list, args.recompute, dict(args.shape, n_layer=1), args.block_size,
                             vocab_size=1,  # the connections do not use it
                             stream_dtype=args.stream_dtype, fused_connections=args.fused_connections == "on")
    result = environment(argv, device, "-m", "benchmarks.micro")
    result["settings"] = dict(size=args.size, **args.shape, batch_size=args.batch_size, block_size=args.block_size,
                              dtype=args.dtype, steps=args.steps, warmup=args.warmup, recompute=args.recompute,
                              stream_dtype=args.stream_dtype, fused_connections=args.fused_connections == "on",
                              seed=args.seed)
    title = (f"{args.size}, batch {args.batch_size} x {args.block_size}, {args.dtype}, HC streams {args.stream_dtype}, "
             f"fused connections {args.fused_connections}, {result['device_name']}, torch {torch.__version__}, "
             f"{args.steps} rounds after {args.warmup} warm-up")
    result["connections"] = micro_connections(variants, args, device)
    print(f"## Micro: one connection module, branch 0.5*u, {title}\n\n{connection_table(result['connections'])}\n")
    result["h_res"] = micro_h_res(args, device, GPTConfig.n_streams, GPTConfig.sinkhorn_iters)
    print(f"## Micro: H_res construction\n\n{h_res_table(result['h_res'])}\n")
    json_path = args.json or os.path.join("out", "bench", f"{args.size}-{args.device_type}-{args.dtype}-micro.json")
    write_json(result, json_path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = resolve_shared_flags(parse_args(argv))
        with kernels_where_asked(args):
            run(args, argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
