"""Tile sizes, warps and grid of each fused connection kernel, swept at the model's shapes: every
setting is run on the recorded launch's inputs, checked against the shipped setting's outputs
(which tests/test_cuda.py checks against residuals.py), then timed alone.

    python -m benchmarks.kernel_tiles --size M               # on a GPU
    TRITON_INTERPRET=1 python -m benchmarks.kernel_tiles --size tiny --device cpu --batch_size 1 \\
        --block_size 16 --quick                              # CPU dry run in Triton's interpreter

Each setting's outputs are poisoned with NaN before it runs, so an output it leaves unwritten fails
the check. The backward kernels are timed with the sums of their partials (grad scale and grad bias
per token block of pre_backward_grad_x, grad W per token split of pre_backward_weight).
"""

import argparse
import itertools
import os
import sys

import torch

from fused import ops
from fused.tools.launches import connection_launches
from config import STREAM_DTYPES

from .common import BenchError, add_shared_flag, environment, fmt, markdown_table, stream_dtype_list, write_json
from .kernels import DRY_RUN_NOTE, time_alone
from .kernels import resolve as resolve_kernel_flags

# The settings tried per kernel: tl.dot needs 16 or more tokens and channels in the pre kernels.
SWEEP = {
    "pre_kernel": dict(BLOCK_T=(16, 32, 64), BLOCK_C=(16, 32, 64), num_warps=(4, 8), STAGES=(1, 2, 3)),
    "post_kernel": dict(BLOCK_T=(4, 8, 16), BLOCK_C=(16, 64, 128, 256), num_warps=(4, 8)),
    "post_backward_kernel": dict(BLOCK_T=(4, 8, 16), BLOCK_C=(16, 64, 128, 256), num_warps=(4, 8)),
    "pre_backward_grad_x_kernel": dict(BLOCK_T=(16, 32), BLOCK_C=(32, 64, 128), num_warps=(4, 8), STAGES=(1, 2, 3)),
    "pre_backward_weight_kernel": dict(BLOCK_T=(32, 64), BLOCK_C=(16, 32, 64), num_warps=(4, 8), splits=(8, 16, 32)),
}
SPLIT_KERNELS = ("pre_backward_weight_kernel",)  # grid (channel blocks, token splits)
QUICK = {kernel: {key: values[:2] for key, values in sweep.items()} for kernel, sweep in SWEEP.items()}
OUTPUTS = {"pre_kernel": ("u_ptr", "h_pre_ptr", "h_post_ptr", "h_res_ptr", "z_ptr", "rms_inv_ptr"),
           "post_kernel": ("out_ptr",),
           "post_backward_kernel": ("grad_y_ptr", "grad_h_post_ptr"),
           "pre_backward_grad_x_kernel": ("grad_z_ptr", "grad_x_ptr", "grad_scale_ptr", "grad_bias_ptr"),
           "pre_backward_weight_kernel": ("grad_weight_ptr",)}
PARTIALS = ("grad_weight_ptr", "grad_scale_ptr", "grad_bias_ptr")  # one slice per token block or split
# ||setting - shipped|| / ||shipped|| allowed: fp32 outputs differ only in summation order; a bf16
# output can round the other way where the fp32 sum moved.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def settings_of(kernel, sweep):
    keys = list(sweep[kernel])
    return [dict(zip(keys, values)) for values in itertools.product(*(sweep[kernel][k] for k in keys))]


def shipped_setting(launch):
    setting = {k: launch.constexprs.get(k, 4 if k == "num_warps" else None) for k in ("BLOCK_T", "BLOCK_C",
                                                                                       "num_warps")}
    if launch.kernel in SPLIT_KERNELS:
        setting["splits"] = launch.grid[1]
    if "STAGES" in launch.constexprs:  # the software-pipelined loop's stages
        setting["STAGES"] = launch.constexprs["STAGES"]
    return setting


class Replay:
    """A recorded launch rerun with another setting, into fresh, NaN-poisoned outputs."""

    def __init__(self, launch, setting):
        self.launch, self.setting = launch, setting
        names = ops.kernel(launch.kernel).arg_names
        self.args = dict(zip(names, launch.args))
        tokens, width = self.args["T"], self.args["C"]
        blocks = -(-tokens // setting["BLOCK_T"])
        if launch.kernel == "post_kernel":
            self.grid = (blocks, -(-width // setting["BLOCK_C"]))
        elif launch.kernel in SPLIT_KERNELS:
            self.grid = (-(-width // setting["BLOCK_C"]), min(setting["splits"], blocks))
        else:
            self.grid = (blocks,)
        for name in OUTPUTS[launch.kernel]:
            shape = self.args[name].shape
            if name in PARTIALS:
                shape = (self.grid[-1], *shape[1:])
            self.args[name] = self.args[name].new_empty(shape)
        self.constexprs = dict(launch.constexprs, **{k: v for k, v in setting.items() if k != "splits"})

    def run(self):
        for name in OUTPUTS[self.launch.kernel]:
            self.args[name].fill_(float("nan"))
        self.call()
        return {name: self.args[name].sum(0) if name in PARTIALS else self.args[name].clone()
                for name in OUTPUTS[self.launch.kernel]}

    def call(self):
        ops.launch(self.launch.kernel, self.grid, self.launch.device, *self.args.values(), **self.constexprs)
        for name in OUTPUTS[self.launch.kernel]:
            if name in PARTIALS:
                self.args[name].sum(0)


def relative_error(outputs, reference):
    """The largest ||out - ref|| / ||ref|| over the outputs, over its tolerance (inf where an output
    has a NaN: unwritten)."""
    worst = 0.0
    for name, ref in reference.items():
        out = outputs[name]
        if not torch.isfinite(out).all():
            return float("inf")
        error = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
        worst = max(worst, error.item() / TOLERANCE[ref.dtype])
    return worst


def sweep_kernels(args, device):
    sweep = QUICK if args.quick else SWEEP
    rows = []
    for residual, stream_dtype in itertools.product(args.residual_list, args.stream_dtypes):
        launches = connection_launches(residual, stream_dtype, args.dtype == "bfloat16", args.shape["n_embd"],
                                       args.batch_size, args.block_size, device, n_streams=4, seed=args.seed)
        for launch in launches:
            if launch.kernel not in args.kernel_list:
                continue
            shipped = shipped_setting(launch)
            reference = Replay(launch, shipped).run()
            settings = settings_of(launch.kernel, sweep)
            settings = [shipped] + [s for s in settings if s != shipped]
            times = {}
            for setting in settings:
                replay = Replay(launch, setting)
                try:
                    error = relative_error(replay.run(), reference)
                except Exception as e:  # a setting the compiler refuses (shared memory, registers)
                    rows.append(dict(residual=residual, stream_dtype=stream_dtype, kernel=launch.kernel,
                                     setting=setting, ms=None, error=None, failed=f"{type(e).__name__}: {e}"[:200]))
                    print(f"{residual} {stream_dtype} {launch.kernel} {setting}: failed: {rows[-1]['failed']}",
                          flush=True)
                    continue
                ms = time_alone(replay.call, args.warmup, args.steps, device) if error <= 1 else None
                times[str(setting)] = ms
                rows.append(dict(residual=residual, stream_dtype=stream_dtype, kernel=launch.kernel,
                                 setting=setting, ms=ms, error=error, shipped=setting == shipped,
                                 x_shipped=ms / times[str(shipped)] if ms is not None else None))
                print(f"{residual} {stream_dtype} {launch.kernel} {setting}: error/tolerance {error:.2g}, "
                      f"{fmt(None if ms is None else 1000 * ms, '.1f')} us", flush=True)
        del launches
    return rows


def best_table(rows):
    """The shipped and the fastest checked setting per kernel."""
    groups = {}
    for r in rows:
        groups.setdefault((r["residual"], r["stream_dtype"], r["kernel"]), []).append(r)
    table = []
    for (residual, stream_dtype, kernel), group in groups.items():
        timed = [r for r in group if r["ms"] is not None]
        shipped = next(r for r in group if r.get("shipped"))
        best = min(timed, key=lambda r: r["ms"])
        failed = sum(r["ms"] is None for r in group)
        table.append([residual, stream_dtype, kernel.removesuffix("_kernel"), str(shipped["setting"]),
                      fmt(1000 * shipped["ms"], ".1f"), str(best["setting"]), fmt(1000 * best["ms"], ".1f"),
                      fmt(best["x_shipped"], ".2f"), str(failed)])
    return markdown_table(["variant", "streams", "kernel", "shipped", "us", "fastest", "us", "x shipped",
                           "failed or off"], table)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_tiles", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag in ("--size", "--batch_size", "--block_size", "--device", "--dtype", "--steps", "--warmup", "--seed"):
        add_shared_flag(parser, flag)
    parser.add_argument("--residuals", default="mhclite", help="the HC-family variants, comma-separated")
    parser.add_argument("--stream_dtypes", default=",".join(STREAM_DTYPES), help="comma-separated")
    parser.add_argument("--kernels", default=",".join(SWEEP), help="the kernels to sweep, comma-separated")
    parser.add_argument("--quick", action="store_true", help="two values per setting (the dry run)")
    parser.add_argument("--json", help="output path (default out/bench/<size>-<device>-kernel-tiles.json)")
    return parser.parse_args(argv)


def resolve(args):
    default_json = args.json is None
    resolve_kernel_flags(args)
    args.stream_dtypes = stream_dtype_list(args.stream_dtypes)
    args.kernel_list = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not args.kernel_list or any(k not in SWEEP for k in args.kernel_list):
        raise BenchError(f"--kernels must name some of {', '.join(SWEEP)}, got '{args.kernels}'")
    if default_json:
        args.json = os.path.join("out", "bench", f"{args.size}-{args.device_type}-kernel-tiles.json")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = resolve(parse_args(argv))
        device = torch.device(args.device_type)
        result = dict(environment(argv, device, "-m", "benchmarks.kernel_tiles"), mode="kernel_tiles",
                      tokens=args.batch_size * args.block_size, width=args.shape["n_embd"],
                      rows=sweep_kernels(args, device))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    dry_run = "" if device.type == "cuda" else DRY_RUN_NOTE
    print(f"\n## Kernel settings, {result['tokens']} tokens, C = {result['width']}, autocast {args.dtype}, "
          f"{result['device_name']}, median of {args.steps} after {args.warmup} warm-up{dry_run}\n\n"
          f"{best_table(result['rows'])}\n")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
