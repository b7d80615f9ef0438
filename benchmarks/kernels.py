"""Each fused connection kernel alone: time, GB/s from the counted bytes per token, and the ratio to
a device-to-device copy of the streams, beside the time fused.tools.latency predicts at M; and a
connection's backward by its number of grad-W partials.

    python -m fused.tools.latency --machine cuda --predictions out/predicted_times.json
    python -m benchmarks.kernels --size M --predicted_times out/predicted_times.json   # on a GPU
    TRITON_INTERPRET=1 python -m benchmarks.kernels --size tiny --device cpu --batch_size 1 --block_size 16
                                                             # CPU dry run in Triton's interpreter (times mean nothing)

For each HC-family variant with fp32 and bf16 streams, the launches of one forward + backward of the
variant's connection are recorded (fused/tools/launches.py), then each is replayed alone and timed.
The bytes per token per kernel come from a JSON file written by `python -m fused.tools.count_bytes
--json PATH` on a CPU (default: fused/tools/kernel_bytes.json, which the tests keep equal to a fresh
count), so that nothing here runs Triton's interpreter on the GPU. The predicted times at M, when
given, come from python -m fused.tools.latency --predictions PATH, best run with --machine cuda on the
same machine (its SMs, L2, compute capability and triton); their DRAM terms are scaled here to the
copy measured beside the kernels. A second table times a connection's whole backward with each of SPLIT_COUNTS
grad-W token splits, each with its own grad-W partial.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from devices import synchronize
from fused import TRITON_AVAILABLE, connection_forward, ops, packed_parameters
from fused.tools.interpreter import fix_scalar_index
from fused.tools.latency import at_copy_bandwidth
from fused.tools.launches import connection_launches, connection_setup
from config import STREAM_DTYPES
from model import GPTConfig

from .common import (HC_FAMILY, BenchError, add_shared_flag, environment, fmt, interleaved_times, markdown_table,
                     ratio, resolve_shared_flags, write_json)

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fused", "tools")
KERNEL_BYTES = os.path.join(TOOLS, "kernel_bytes.json")
# Token splits of the backward's grad-W kernel (each with its own weight-sized partial) timed against
# the default, to choose between fewer partials and more of the GPU busy in the backward.
SPLIT_COUNTS = (4, 8, 16, 32)
DRY_RUN_NOTE = ", CPU DRY RUN in Triton's interpreter: the times are not GPU times"


def time_alone(fn, warmup, repeats, device, calls=10):
    """Median ms of one fn() call. On CUDA each repeat brackets `calls` back-to-back calls with
    events, so that launch overhead hides behind the kernels as in a training step."""
    calls = calls if device.type == "cuda" else 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            began = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def read_kernel_bytes(path, what="kernel bytes"):
    """{residual: {stream dtype: {"kernels": {kernel: bytes per token}}}} from count_bytes' JSON (or
    another of the tools' JSON files)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read the {what} {path}: {e}") from None


def kernel_bench(args, device):
    """Every kernel of every variant in args.residual_list, replayed alone at (B, T, n, C)."""
    counted = read_kernel_bytes(args.kernel_bytes)
    predicted = read_kernel_bytes(args.predicted_times, "predicted times") if args.predicted_times else {}
    if predicted and not {"kernels", "machine", "copy_bandwidth"} <= set(predicted):
        raise BenchError(f"{args.predicted_times} is not the output of python -m fused.tools.latency --predictions")
    n, width, tokens = GPTConfig.n_streams, args.shape["n_embd"], args.batch_size * args.block_size
    rows, copies = [], {}
    for stream_dtype, dtype in STREAM_DTYPES.items():
        source = torch.randn(tokens, n, width, generator=torch.Generator().manual_seed(args.seed)).to(device, dtype)
        target = torch.empty_like(source)
        copy_ms = time_alone(lambda: target.copy_(source), args.warmup, args.steps, device)
        copies[stream_dtype] = dict(ms=copy_ms, bytes=2 * source.nbytes, gb_per_s=2 * source.nbytes / copy_ms / 1e6)
        del source, target
        for residual in args.residual_list:
            launches = connection_launches(residual, stream_dtype, args.dtype == "bfloat16", width, args.batch_size,
                                           args.block_size, device, n_streams=n, seed=args.seed)
            synchronize(device)
            by_kernel = {}
            for launch in launches:
                row = by_kernel.setdefault(launch.kernel, dict(residual=residual, stream_dtype=stream_dtype,
                                                               kernel=launch.kernel, phase=launch.phase, launches=0,
                                                               ms=0.0))
                row["launches"] += 1
                row["ms"] += time_alone(launch.replay, args.warmup, args.steps, device)
            for row in by_kernel.values():
                per_token = counted.get(residual, {}).get(stream_dtype, {}).get("kernels", {}).get(row["kernel"])
                gb_per_s = per_token * tokens / row["ms"] / 1e6 if per_token is not None else None
                prediction = predicted.get("kernels", {}).get(residual, {}).get(stream_dtype, {}).get(row["kernel"])
                predicted_us = None if prediction is None else at_copy_bandwidth(
                    prediction, predicted["copy_bandwidth"], 1e9 * copies[stream_dtype]["gb_per_s"])
                rows.append(dict(row, bytes_per_token=per_token, gb_per_s=gb_per_s,
                                 copy_ratio=ratio(gb_per_s, copies[stream_dtype]["gb_per_s"]),
                                 predicted_us_at_m=predicted_us, measured_over_predicted=ratio(1000 * row["ms"],
                                                                                               predicted_us)))
            del launches
    prediction = {key: predicted[key] for key in ("machine", "triton", "step_latency_ns")} if predicted else {}
    return dict(rows=rows, copies=copies, tokens=tokens, n_streams=n, width=width, autocast=args.dtype,
                kernel_bytes=args.kernel_bytes, predicted_times=args.predicted_times, prediction=prediction,
                dry_run=device.type != "cuda")


def backward_by_splits(args, device):
    """A connection's whole backward (its backward kernels, the branch's backward, the sum of the
    grad-W partials) timed with each of SPLIT_COUNTS grad-W token splits (capped at the grad-W
    kernel's token blocks), interleaved round by round as the step benchmark's steps."""
    tokens = args.batch_size * args.block_size
    blocks = -(-tokens // ops.TILES["pre_backward_weight_kernel"]["BLOCK_T"])
    counts = sorted({min(splits, blocks) for splits in (*SPLIT_COUNTS, ops.WEIGHT_GRAD_SPLITS)})
    default = min(ops.WEIGHT_GRAD_SPLITS, blocks)
    rows, saved = [], ops.WEIGHT_GRAD_SPLITS
    for stream_dtype in STREAM_DTYPES:
        for residual in args.residual_list:
            module, branch, x, grad = connection_setup(residual, stream_dtype, args.shape["n_embd"], args.batch_size,
                                                       args.block_size, device, seed=args.seed)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                out = connection_forward(module, x, branch)
            inputs = [x, *module.parameters(), *branch.parameters()]
            per_split = ops.partial_bytes_per_split(packed_parameters(module)[1])

            def step_with(splits):
                def step(r):
                    ops.WEIGHT_GRAD_SPLITS = splits
                    torch.autograd.grad(out, inputs, grad, retain_graph=True)
                return step

            try:
                samples = interleaved_times({splits: step_with(splits) for splits in counts},
                                            args.warmup + args.steps, args.warmup, device,
                                            f"{residual} {stream_dtype}: backward by grad-W splits")
            finally:
                ops.WEIGHT_GRAD_SPLITS = saved
            times = {splits: statistics.median(ms) for splits, ms in samples.items()}
            for splits, ms in times.items():
                rows.append(dict(residual=residual, stream_dtype=stream_dtype, splits=splits, ms=ms,
                                 ratio=ratio(ms, times[default]), partial_bytes_per_token=per_split * splits / tokens))
    return dict(rows=rows, default_splits=default, tokens=tokens)


def splits_table(result):
    rows = [[r["residual"], r["stream_dtype"], str(r["splits"]), fmt(1000 * r["ms"], ".1f"), fmt(r["ratio"], ".3f"),
             fmt(r["partial_bytes_per_token"], ",.0f")] for r in result["rows"]]
    return markdown_table(["variant", "streams", "grad-W splits", "backward us", f"x {result['default_splits']} splits",
                           "grad-W partial bytes/token"], rows)


def kernel_table(result):
    rows = [[r["residual"], r["stream_dtype"], r["kernel"].removesuffix("_kernel"), r["phase"], str(r["launches"]),
             fmt(1000 * r["ms"], ".1f"), fmt(r["bytes_per_token"], ",.0f"), fmt(r["gb_per_s"], ".0f"),
             fmt(r["copy_ratio"], ".2f"), fmt(r["predicted_us_at_m"], ".1f"),
             fmt(r["measured_over_predicted"], ".2f")] for r in result["rows"]]
    copies = "; ".join(f"{dtype} streams {fmt(c['gb_per_s'], '.0f')} GB/s ({fmt(1000 * c['ms'], '.1f')} us for "
                       f"{c['bytes'] / 2**20:.1f} MiB read + written)" for dtype, c in result["copies"].items())
    table = markdown_table(["variant", "streams", "kernel", "phase", "launches", "us", "bytes/token", "GB/s",
                            "x copy", "predicted us at M", "measured / predicted"], rows)
    if not result["predicted_times"]:
        return f"{table}\n\ndevice-to-device copy of the streams: {copies}\nno prediction (--predicted_times)"
    p = result["prediction"]
    return (f"{table}\n\ndevice-to-device copy of the streams: {copies}\npredicted: python -m fused.tools.latency "
            f"({os.path.relpath(result['predicted_times'])}) for M's 16,384 tokens, C = 768, on {p['machine']['name']} "
            f"(sm_{p['machine']['cc']}, {p['machine']['sms']} SMs, triton {p['triton']}), the DRAM terms at the copy "
            f"above")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag in ("--size", "--batch_size", "--block_size", "--device", "--dtype", "--steps", "--warmup", "--seed"):
        add_shared_flag(parser, flag)
    parser.add_argument("--residuals", default=",".join(HC_FAMILY), help="the HC-family variants, comma-separated")
    parser.add_argument("--kernel_bytes", default=KERNEL_BYTES, help="python -m fused.tools.count_bytes --json output")
    parser.add_argument("--predicted_times", help="python -m fused.tools.latency --predictions output, printed "
                        "beside the times (none when not given)")
    parser.add_argument("--json", help="output path (default out/bench/<size>-<device>-<dtype>-kernels.json)")
    return parser.parse_args(argv)


def resolve(args):
    resolve_shared_flags(args)
    if any(r not in HC_FAMILY for r in args.residual_list):
        raise BenchError(f"--residuals must name some of {', '.join(HC_FAMILY)}, got '{args.residuals}'")
    if not TRITON_AVAILABLE:
        raise BenchError("needs triton")
    if args.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BenchError("times the Triton kernels on CUDA; on CPU it runs only under TRITON_INTERPRET=1 "
                         "(a dry run at tiny shapes)")
    if args.device_type == "cpu":
        fix_scalar_index()  # connection_forward is called directly: the kernels run whatever INTERPRET_ON_CPU
    if args.json is None:
        args.json = os.path.join("out", "bench", f"{args.size}-{args.device_type}-{args.dtype}-kernels.json")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = resolve(parse_args(argv))
        device = torch.device(args.device_type)
        result = dict(environment(argv, device, "-m", "benchmarks.kernels"), mode="kernels",
                      kernels=kernel_bench(args, device))
        result["splits"] = backward_by_splits(args, device)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    dry_run = "" if device.type == "cuda" else DRY_RUN_NOTE
    print(f"## Fused connection kernels alone, {args.batch_size} x {args.block_size} tokens, n = "
          f"{GPTConfig.n_streams}, C = {args.shape['n_embd']}, autocast {args.dtype}, {result['device_name']}, "
          f"median of {args.steps} after {args.warmup} warm-up{dry_run}\n\n{kernel_table(result['kernels'])}\n")
    print(f"## A connection's backward by the number of grad-W token splits (partials), same "
          f"shapes\n\n{splits_table(result['splits'])}\n")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
