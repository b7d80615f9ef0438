"""What the benchmark scripts share: the flags that pick the models, batches and rounds, their checks,
and the output (Markdown tables, a result's JSON with the command and the machine). Used by bench.py,
scripts/compile_time.py, scripts/micro_bench.py and fused/bench_kernels.py."""

import datetime
import json
import os
import platform
import shlex

import torch

from model import model_shape
from residuals import RESIDUALS

DEFAULT_BATCH_BLOCK = {"tiny": (8, 128)}  # (batch_size, block_size) by size
PAPER_BATCH_BLOCK = (16, 1024)  # every other size


class BenchError(Exception):
    """Bad benchmark settings."""


SHARED_FLAGS = {
    "--size": dict(default="tiny", help="tiny, S, M or L"),
    "--batch_size": dict(type=int, help="default 8 for tiny, 16 otherwise"),
    "--block_size": dict(type=int, help="default 128 for tiny, 1024 otherwise"),
    "--device": dict(default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available"),
    "--dtype": dict(default="auto", choices=["auto", "float32", "bfloat16"],
                    help="autocast dtype; auto: bfloat16 on cuda (train.py's default), float32 on cpu"),
    "--residuals": dict(default="res,hc,mhc,mhclite", help="the variants, comma-separated"),
    "--recompute": dict(default="both", choices=["both", "on", "off"],
                        help="recompute_connections for the HC family; both: a row with and without"),
    "--stream_dtype": dict(default="float32", choices=["float32", "bfloat16"],
                           help="storage of the HC family's streams (res keeps nanoGPT's fp32 residual)"),
    "--fused_connections": dict(default="off", choices=["on", "off"],
                                help="Triton kernels (the fused package) for the HC family where they can run "
                                     "(CUDA; on CPU under TRITON_INTERPRET=1 in the interpreter: a dry run whose "
                                     "step times mean nothing)"),
    "--vocab_size": dict(type=int, default=50304, help="of the random tokens and the model"),
    "--steps": dict(type=int, default=20, help="measured rounds"),
    "--warmup": dict(type=int, default=3, help="unmeasured rounds first"),
    "--seed": dict(type=int, default=0, help="of the models' init and the random data"),
}


def add_shared_flag(parser, flag):
    parser.add_argument(flag, **SHARED_FLAGS[flag])


def resolve_shared_flags(args):
    """Checks the SHARED_FLAGS a script has and fills in the derived settings (or raises BenchError)."""
    try:
        args.shape = model_shape(args.size)
    except ValueError as e:
        raise BenchError(str(e)) from None
    default_batch, default_block = DEFAULT_BATCH_BLOCK.get(args.size, PAPER_BATCH_BLOCK)
    args.batch_size = default_batch if args.batch_size is None else args.batch_size
    args.block_size = default_block if args.block_size is None else args.block_size
    for key, least in (("batch_size", 1), ("block_size", 1), ("steps", 1), ("vocab_size", 1), ("warmup", 0)):
        if getattr(args, key, least) < least:
            raise BenchError(f"--{key} must be >= {least}, got {getattr(args, key)}")
    args.residual_list = list(dict.fromkeys(r.strip() for r in args.residuals.split(",") if r.strip()))
    unknown = [r for r in args.residual_list if r not in RESIDUALS]
    if unknown or not args.residual_list:
        problem = f"unknown residual '{unknown[0]}'" if unknown else "--residuals is empty"
        raise BenchError(f"{problem}; valid: {', '.join(RESIDUALS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA device is available")
    args.device_type = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device_type == "cuda" else "float32"
    if args.device_type == "cuda" and args.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise BenchError("this GPU does not support bfloat16; use --dtype float32")
    args.interpret_on_cpu = (getattr(args, "fused_connections", "off") == "on" and args.device_type == "cpu"
                             and os.environ.get("TRITON_INTERPRET") == "1")
    if args.interpret_on_cpu:
        import fused
        fused.INTERPRET_ON_CPU = True  # a dry run: inductor's work around the kernels is real, times are not
    return args


def ratio(value, baseline_value):
    return value / baseline_value if value is not None and baseline_value else None


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def environment(argv, device, script):
    """The command line and the machine, for a result's JSON."""
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()}, {torch.backends.cpu.get_cpu_capability()})")
    return dict(command=shlex.join(["python", script, *argv]), argv=argv,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, python=platform.python_version(), device=device.type, device_name=name,
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())


def write_json(result, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
