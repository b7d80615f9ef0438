"""What the benchmarks share: the variants, built and stepped as train.py builds and steps its
model; the interleaved timing and its ratios; the flags that pick models, batches and rounds, with
their checks; and the output (Markdown tables, a result's JSON with the command and the machine)."""

import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from devices import synchronize
from model import GPT, GPT2_PADDED_VOCAB, GPTConfig, model_shape
from parallelize import apply_connection_recompute, apply_fused_connections
from residuals import RESIDUALS

HC_FAMILY = ("hc", "mhc", "mhclite")
RECOMPUTE_SUFFIX = "+recompute"
BLOCKS_SUFFIX = "/blocks"  # the variant compiled block by block, next to the whole-model compile
NUM_BATCHES = 4  # distinct random batches, cycled
DEFAULT_BATCH_BLOCK = {"tiny": (8, 128)}  # (batch_size, block_size) by size
PAPER_BATCH_BLOCK = (16, 1024)  # every other size


class BenchError(Exception):
    """Bad benchmark settings."""


# ----------------------------------------------------------------------------------------------
# Variants and models


@dataclass(frozen=True)
class Variant:
    """What a benchmark row runs: the model, and how its connections run (parallelize.py's
    recompute and fused kernels, applied from outside as train.py applies them)."""
    config: GPTConfig
    recompute_connections: bool = False
    fused_connections: bool = False


def main_variants(residuals, recompute, shape, block_size, vocab_size, fused_connections=False, **hc_options):
    """{name: Variant}; with recompute="both" every HC-family variant also appears as "<name>+recompute".
    hc_options (stream_dtype) and fused_connections go to the HC family; res stays nanoGPT."""
    variants = {}
    for residual in residuals:
        hc = residual in HC_FAMILY
        settings = ([False, True] if recompute == "both" else [recompute == "on"]) if hc else [False]
        for recompute_connections in settings:
            config = GPTConfig(block_size=block_size, vocab_size=vocab_size, residual=residual,
                               **(hc_options if hc else {}), **shape)
            variants[residual + (RECOMPUTE_SUFFIX if recompute_connections else "")] = Variant(
                config, recompute_connections, fused_connections and hc)
    return variants


def with_compile_modes(variants, modes):
    """({name: Variant}, {name: compile mode}); with both modes every variant appears as "<name>"
    (compiled as a whole model) and "<name>/blocks" (compiled block by block)."""
    if len(modes) == 1:
        return variants, {name: modes[0] for name in variants}
    named, compile_modes = {}, {}
    for name, variant in variants.items():
        for mode in modes:
            key = name + (BLOCKS_SUFFIX if mode == "blocks" else "")
            named[key], compile_modes[key] = variant, mode
    return named, compile_modes


def same_mode_baselines(names, baseline):
    """{name: the baseline compiled the same way}: "res" for whole-model rows, "res/blocks" for blocks rows."""
    return {name: baseline + (BLOCKS_SUFFIX if name.endswith(BLOCKS_SUFFIX) else "") for name in names}


def build_models(variants, seed, device):
    """{name: GPT} on device, every model initialised from the same seed as train.py does, its
    connections recomputed and fused as the variant says."""
    models = {}
    for name, variant in variants.items():
        torch.manual_seed(seed)
        try:
            models[name] = GPT(variant.config).to(device)
        except ValueError as e:
            raise BenchError(f"{name}: {e}") from None
        if variant.recompute_connections:
            apply_connection_recompute(models[name])
        if variant.fused_connections:
            apply_fused_connections(models[name], device)
    return models


def random_batches(count, batch_size, block_size, vocab_size, seed, device):
    """`count` fixed (inputs, targets) pairs of random token ids, targets shifted by one."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (count, batch_size, block_size + 1), generator=generator)
    return [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]


def make_optimizer(model, device):
    return model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.type)


def train_step(model, optimizer, x, y, ctx):
    """One training step as train.py takes it; `model` may be the compiled form of the optimizer's model."""
    with ctx:
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()

# ----------------------------------------------------------------------------------------------
# Interleaved timing


def interleaved_times(steps, rounds, warmup, device, desc):
    """{name: [ms per measured round]}; round r calls every step function as fn(r), in an order rotated by r."""
    names = list(steps)
    times = {name: [] for name in names}
    for r in tqdm(range(rounds), desc=desc, leave=False):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = time.perf_counter()
            steps[name](r)
            synchronize(device)
            if r >= warmup:
                times[name].append(1000 * (time.perf_counter() - start))
    return times


def summarise(times, baselines):
    """Median, IQR and the median per-round time ratio to each variant's baseline."""
    summary = {}
    for name, ms in times.items():
        quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
        baseline = baselines.get(name)
        ratio = (statistics.median(t / b for t, b in zip(ms, times[baseline]))
                 if baseline in times else None)
        summary[name] = dict(median_ms=statistics.median(ms), iqr_ms=quartiles[2] - quartiles[0],
                             time_ratio=ratio, step_ms=ms)
    return summary

# ----------------------------------------------------------------------------------------------
# Flags


SHARED_FLAGS = {
    "--size": dict(default="tiny", help="tiny, S, M, L, XL or 7B"),
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
    "--vocab_size": dict(type=int, default=GPT2_PADDED_VOCAB, help="of the random tokens and the model"),
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
    args.interpret_on_cpu = (getattr(args, "fused_connections", "off") != "off" and args.device_type == "cpu"
                             and os.environ.get("TRITON_INTERPRET") == "1")
    return args


def kernels_where_asked(args):
    """The context a benchmark runs in: on CPU under TRITON_INTERPRET=1 with the fused kernels asked
    for, they take CPU tensors in Triton's interpreter (a dry run: what surrounds the kernels is real,
    their times are not), until the benchmark ends."""
    if not args.interpret_on_cpu:
        return contextlib.nullcontext()
    import fused
    return fused.interpret_on_cpu()

# ----------------------------------------------------------------------------------------------
# Output


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def ratio(value, baseline_value):
    return value / baseline_value if value is not None and baseline_value else None


def environment(argv, device, *command):
    """The command line (`python *command *argv`) and the machine, for a result's JSON."""
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()}, {torch.backends.cpu.get_cpu_capability()})")
    return dict(command=shlex.join(["python", *command, *argv]), argv=argv,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, python=platform.python_version(), device=device.type, device_name=name,
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())


def write_json(result, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
