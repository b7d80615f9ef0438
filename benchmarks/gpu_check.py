"""The GPU check: is this code correct on this GPU, and how fast is it here? One command, in parts.

    python -m benchmarks.gpu_check                     # every part, on the GPU, at M
    python -m benchmarks.gpu_check fused kernels       # some parts (run the others later: same --out)
    python -m benchmarks.gpu_check --device cpu --size tiny   # the CPU dry run at tiny shapes (CI runs it)

Parts, in the order they run, with what each verifies and its minutes on one H100 at M with cold
caches (measured, docs/benchmarks.md; the CPU tests of the tests part were not timed there):
  tests    3+   the CUDA tests (mhclite exact under every matmul precision, compiled = eager for every
                variant with and without the fused kernels and bf16 streams, the kernels against
                residuals.py, fused AdamW, the step benchmark's peak memory), then the fast CPU tests
                here, which also run the kernel tests on this GPU
  bench    8    the step benchmark (python bench.py) at M for res and mhclite: the reference path with and
                without recompute, the fused kernels, bf16 streams, and both: time, peak memory, MFU
  train    4    20 steps of train.py per variant at M on random tokens, compiled block by block (the
                first step's time is the cold compile); the trained H_res's row and column sums
  fused    ?    should the fused kernels be this GPU's default? Their tests compiled here (every kernel
                against residuals.py), then 20 steps of train.py at M for res, and for mhclite on the
                reference path, with the kernels, and with the kernels and bf16 streams: ms per step, x
                res, and each step's loss against the reference path's. Yes where the kernels' step is
                faster and no step's loss is more than {tolerance:g} off
  kernels  1+   each fused kernel alone (python -m benchmarks.kernels): GB/s from the counted bytes per
                token against a device-to-device copy, beside the time python -m fused.tools.latency
                predicts for this GPU; where Nsight Compute reads this GPU's counters (python -m
                benchmarks.kernel_counters), each kernel's DRAM and L2 bytes beside the CPU proxies'
  sharded  ?    train.py's sharded mode on this one GPU: mhclite at M under torchrun with --parallel=fsdp
                (NCCL, fused AdamW on the sharded parameters, compiled block by block), then the same with
                activation checkpointing; the steps' tokens/s and the last loss of each (not timed yet)
A failing part does not stop the next. Each part logs to OUT/<part>.log and leaves its JSON in OUT
(default out/gpu_check); OUT/parts.json remembers every part run into OUT, so the summary printed last
covers the parts of earlier commands too. Exit code 1 if a part failed, 2 for bad flags.
The CPU dry run runs every part at tiny shapes, eagerly, with Triton's interpreter where the
kernels run (its tests part runs one CPU test: CI runs the rest). Inductor and Triton caches are kept
in .cache/ (ignored by git), so a later command reuses earlier compiles.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from checkpoint import load_model
from residuals import capture_connections

from .common import fmt

PARTS = ("tests", "bench", "train", "fused", "kernels", "sharded")
# measured at M, cold caches; kernels: before its counters were added
H100_MINUTES = {"tests": "3+", "bench": "8", "train": "4", "fused": "?", "kernels": "1+", "sharded": "?"}
# The sharded part's runs: (name, flags), both --parallel=fsdp on one process.
SHARDED_RUNS = (("fsdp", []), ("fsdp + activation checkpointing", ["--activation_checkpointing=True"]))
VARIANTS = ("res", "hc", "mhc", "mhclite")
# The step benchmark's runs of the bench part: (name, flags); res stays nanoGPT's in every one.
BENCH_RUNS = (("reference", []),
              ("fused", ["--recompute", "off", "--fused_connections", "on"]),
              ("bf16 streams", ["--recompute", "off", "--stream_dtype", "bfloat16"]),
              ("fused + bf16 streams", ["--recompute", "off", "--fused_connections", "on",
                                        "--stream_dtype", "bfloat16"]))
# The fused part's training runs: (name, variant, flags); res for the step's ratio, and mhclite, whose
# losses are compared with its reference path's.
FUSED_RUNS = (("res", "res", []), ("reference", "mhclite", []), ("fused", "mhclite", ["--fused_connections=True"]),
              ("fused + bf16 streams", "mhclite", ["--fused_connections=True", "--stream_dtype=bfloat16"]))
# The most any step's train loss of the fused run (fp32 streams) may differ from the reference path's
# for the kernels to be the default: the two round differently, by far less (docs/benchmarks.md).
FUSED_LOSS_TOLERANCE = 2e-3
GPT2_TOKENS = 50257
SPLIT_TOKENS = {"train": 4_000_000, "val": 400_000}
COLSUM_SEQUENCES = 4  # of the model's block_size, for the row/column-sum check
DRY_RUN_SHAPE = ["--batch_size", "1", "--block_size", "16"]  # the fewest kernel programs
DRY_RUN = [*DRY_RUN_SHAPE, "--steps", "1", "--warmup", "0"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error:` line (no usage block) and exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------------
# The parts: each a list of (label, command line, extra environment)


def python(*args):
    return [sys.executable, *args]


def part_commands(part, args):
    """The commands of one part, in order."""
    at_m = args.size == "M"
    fused_env = {} if args.device == "cuda" else {"TRITON_INTERPRET": "1"}  # the interpreter on CPU only
    shape = [] if at_m else DRY_RUN
    if part == "tests":
        cpu_tests = ["tests"] if at_m else ["tests/test_gpu_check.py::test_help_says_what_each_part_verifies"]
        workers = ["-n", "4"] if at_m else []  # four test processes share the GPU
        return [("CUDA tests", python("-m", "pytest", "-q", *workers, "-m", "cuda", "tests/test_cuda.py"), {}),
                ("fast CPU tests", python("-m", "pytest", "-q", *workers, "-m", "not slow and not cuda", *cpu_tests),
                 {})]
    if part == "bench":
        return [(f"bench.py, {name}", python("bench.py", "--size", args.size, "--device", args.device,
                                             "--residuals", "res,mhclite", *flags, *shape,
                                             *([] if at_m else ["--vocab_size", "512"]),
                                             "--json", bench_json(args.out, name)),
                 fused_env if "--fused_connections" in flags else {})
                for name, flags in BENCH_RUNS]
    if part == "train":
        return [(f"train.py, {residual}", python("train.py", *train_flags(args, residual, f"train-{residual}")), {})
                for residual in VARIANTS]
    if part == "fused":
        kernel_tests = (["tests/fused/test_fused_ops.py", "tests/test_cuda.py"] if at_m else
                        ["tests/fused/test_fused_ops.py::test_kernels_are_interpreted_on_cpu_and_compiled_on_cuda"])
        workers = ["-n", "4"] if at_m else []
        return [("kernel tests", python("-m", "pytest", "-q", *workers, "-m", "fused", *kernel_tests), {}),
                *[(f"train.py, {name}", python("train.py", *train_flags(args, residual, fused_dir(name)), *flags),
                   fused_env if flags else {}) for name, residual, flags in FUSED_RUNS]]
    if part == "sharded":
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
        return [(f"train.py under torchrun, {name}", python(
            *torchrun, *train_flags(args, "mhclite", sharded_dir(name)), "--parallel=fsdp", *flags), {})
            for name, flags in SHARDED_RUNS]
    # The predictions for this GPU and its triton (compiled, never interpreted), then each kernel's
    # time beside them, then its hardware counters beside the proxies.
    predictions = os.path.join(args.out, "predicted_times.json")
    machine = "cuda" if args.device == "cuda" else "h200"
    counted_shape = [] if at_m else DRY_RUN_SHAPE
    return [("fused.tools.latency", python("-m", "fused.tools.latency", "--machine", machine, "--predictions",
                                           predictions, "--json", os.path.join(args.out, "latency.json")),
             {"TRITON_INTERPRET": "0"}),
            ("benchmarks.kernels", python("-m", "benchmarks.kernels", "--size", args.size, "--device", args.device,
                                          *shape, "--predicted_times", predictions,
                                          "--json", os.path.join(args.out, "kernels.json")), fused_env),
            ("benchmarks.kernel_counters", python("-m", "benchmarks.kernel_counters", "--size", args.size, "--device",
                                                  args.device, *counted_shape, "--latency",
                                                  os.path.join(args.out, "latency.json"),
                                                  "--json", os.path.join(args.out, "counters.json")), fused_env)]


def train_flags(args, residual, run_name):
    """train.py's arguments for a few steps of `residual` on the random data, into OUT/run_name."""
    size_flags = (["--batch_size=16", "--max_iters=20", "--warmup_iters=5", "--eval_interval=20",
                   "--log_interval=5"] if args.size == "M" else
                  ["--n_layer=1", "--batch_size=2", "--block_size=32", "--max_iters=4", "--warmup_iters=1",
                   "--eval_interval=4", "--log_interval=2"])
    return [f"configs/{args.size}.py", f"configs/{residual}.py", "--dataset=random",
            f"--data_dir={os.path.join(args.out, 'data')}", f"--out_dir={os.path.join(args.out, run_name)}",
            f"--device={args.device}", "--gradient_accumulation_steps=1", "--eval_iters=2", "--compile_mode=blocks",
            *size_flags]


def fused_dir(name):
    return "fused-" + name.replace(" + ", "-").replace(" ", "_")


def sharded_dir(name):
    return "sharded-" + name.replace(" + ", "-").replace(" ", "_")


def bench_json(out, name):
    return os.path.join(out, f"bench-{name.replace(' + ', '-').replace(' ', '_')}.json")


def run_part(part, args):
    """Runs a part's commands (all of them, even after one fails), logging to OUT/<part>.log; returns
    (status, seconds)."""
    if part in ("train", "fused", "sharded"):
        runs = {"train": [f"train-{residual}" for residual in VARIANTS],
                "fused": [fused_dir(name) for name, _, _ in FUSED_RUNS],
                "sharded": [sharded_dir(name) for name, _ in SHARDED_RUNS]}[part]
        for run in runs:  # every run starts afresh
            shutil.rmtree(os.path.join(args.out, run), ignore_errors=True)
        write_random_data(os.path.join(args.out, "data"))
    start, failed = time.time(), []
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".cache/inductor")),
               TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", os.path.abspath(".cache/triton")))
    with open(os.path.join(args.out, f"{part}.log"), "w", encoding="utf-8") as log:
        for label, command, extra in part_commands(part, args):
            print(f"gpu_check: {part}: {label}", flush=True)
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env, **extra)).returncode
            log.write(f"exit code {code}\n")
            if code != 0:
                failed.append(f"{label} ({code})")
    if failed:
        print(f"gpu_check: {part} failed: {', '.join(failed)}; the end of {log.name}:\n{tail(log.name)}")
    return ("failed: " + ", ".join(failed) if failed else "ok"), time.time() - start


def tail(path, lines=30):
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# ----------------------------------------------------------------------------------------------
# Random training data, and what the parts left in OUT


def write_random_data(data_dir):
    """Uniform random GPT-2 token ids (seeded) in nanoGPT's format, as dataset 'random'."""
    folder = os.path.join(data_dir, "random")
    os.makedirs(folder, exist_ok=True)
    generator = np.random.default_rng(0)
    for split, count in SPLIT_TOKENS.items():
        generator.integers(0, GPT2_TOKENS, count, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    meta = dict(tokenizer="gpt2", vocab_size=GPT2_TOKENS, source="uniform random ids (benchmarks/gpu_check.py)",
                train_tokens=SPLIT_TOKENS["train"], val_tokens=SPLIT_TOKENS["val"])
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def read_json(path):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def median_window(run_dir, key="tokens_per_s"):
    """Median of a timing (tokens/s, ms per step) over the logged windows after the first (which compiles)."""
    windows = [r[key] for r in metrics(run_dir) if r.get(key) is not None]
    return statistics.median(windows[1:] or windows) if windows else None


def train_losses(run_dir):
    """{step: train loss} of every step."""
    return {r["step"]: r["train_loss"] for r in metrics(run_dir) if "train_loss" in r}


@torch.no_grad()
def stochasticity_error(run_dir, device):
    """max |row or column sum - 1| of every H_res the trained model makes on a random batch, under
    bf16 autocast as in training (None for res)."""
    model, _ = load_model(os.path.join(run_dir, "ckpt.pt"), device)
    if model.config.residual == "res":
        return None
    shape = (COLSUM_SEQUENCES, model.config.block_size)
    idx = torch.randint(0, GPT2_TOKENS, shape, generator=torch.Generator().manual_seed(0)).to(device)
    with capture_connections(model) as records, torch.autocast(device.type, dtype=torch.bfloat16):
        model(idx)
    h = torch.cat([r["h_res"].flatten(0, -3) for r in records])
    return max((h.sum(-1) - 1).abs().max().item(), (h.sum(-2) - 1).abs().max().item())


def tests_result(out):
    """pytest's closing line of each command in tests.log."""
    with open(os.path.join(out, "tests.log"), encoding="utf-8", errors="replace") as f:
        lines = [line.strip().strip("=").strip() for line in f if " in " in line and
                 any(word in line for word in ("passed", "failed", "skipped", "error"))]
    return "; ".join(lines)


def bench_result(out):
    """mhclite against res in each run of the step benchmark."""
    cells = []
    for name, _ in BENCH_RUNS:
        result = read_json(bench_json(out, name))
        if result:
            lite = result["variants"]["mhclite"]
            peak = f", peak x {fmt(lite['cuda_peak_ratio'], '.2f')}" if lite.get("cuda_peak_ratio") else ""
            cells.append(f"{name} {fmt(lite['time_ratio'], '.2f')}{peak} ({lite['connections']['path']})")
    return "mhclite x res: " + "; ".join(cells) if cells else "-"


def train_result(out, device):
    cells = []
    for residual in VARIANTS:
        run_dir = os.path.join(out, f"train-{residual}")
        if os.path.isfile(os.path.join(run_dir, "done")):
            error = stochasticity_error(run_dir, device)
            sums = f", max abs(sum - 1) {error:.1e}" if error is not None else ""
            cells.append(f"{residual} {fmt(median_window(run_dir), ',.0f')} tok/s{sums}")
    return "; ".join(cells) or "-"


def sharded_result(out):
    """Each sharded run's tokens/s and last logged train loss."""
    cells = []
    for name, _ in SHARDED_RUNS:
        run_dir = os.path.join(out, sharded_dir(name))
        if os.path.isfile(os.path.join(run_dir, "done")):
            losses = list(train_losses(run_dir).values())
            cells.append(f"{name} {fmt(median_window(run_dir), ',.0f')} tok/s, last loss {losses[-1]:.4f}")
    return "; ".join(cells) or "-"


def fused_training(out):
    """{run name: dict(ms per step, x res, the connections' path as train.py logged it, and for
    mhclite the largest |train loss - its reference path's| over the same steps)} of the fused
    part's finished runs."""
    done = {name: (residual, os.path.join(out, fused_dir(name))) for name, residual, _ in FUSED_RUNS
            if os.path.isfile(os.path.join(out, fused_dir(name), "done"))}
    reference = train_losses(done["reference"][1]) if "reference" in done else None
    res_ms = median_window(done["res"][1], "step_ms") if "res" in done else None
    result = {}
    for name, (residual, run) in done.items():
        ms = median_window(run, "step_ms")
        result[name] = dict(ms=ms, x_res=ms / res_ms if res_ms else None,
                            path=read_json(os.path.join(run, "config.json"))["connections"])
        if residual == "mhclite" and reference is not None:
            losses = train_losses(run)
            if set(losses) != set(reference):
                raise ValueError(f"{run} logged steps {sorted(losses)}, the reference {sorted(reference)}")
            result[name]["difference"] = max(abs(losses[step] - reference[step]) for step in reference)
    return result


def fused_verdict(training):
    """Whether the fused kernels should be the default here: their step (fp32 streams) faster than the
    reference path's and every loss within FUSED_LOSS_TOLERANCE of it."""
    fused = training.get("fused")
    if fused is None or "reference" not in training:
        return "no fused and reference training runs"
    if fused["path"]["path"] != "fused":
        return f"no fused kernels ran: {fused['path']['why']}"
    faster, close = fused["ms"] < training["reference"]["ms"], fused["difference"] <= FUSED_LOSS_TOLERANCE
    reasons = [f"{'faster' if faster else 'slower'} ({fused['ms'] / training['reference']['ms']:.2f} x the reference "
               "path)", f"loss within {FUSED_LOSS_TOLERANCE:g}" if close else f"a loss {fused['difference']:.1e} off"]
    return f"{'yes' if faster and close else 'no'}: {', '.join(reasons)}"


def counters_result(out):
    """Each kernel's DRAM bytes, read by ncu, over the L2 model's, per stream dtype (mhclite)."""
    result = read_json(os.path.join(out, "counters.json"))
    if not result:
        return "no hardware counters (benchmarks.kernel_counters: kernels.log says why)"
    by_dtype = {}
    for row in result["rows"]:
        by_dtype.setdefault(row["stream_dtype"], []).append(
            f"{row['kernel'].removesuffix('_kernel')} {fmt(row['dram_over_predicted'], '.2f')}")
    return "DRAM measured / L2 model: " + "; ".join(f"{dtype} {', '.join(cells)}" for dtype, cells in by_dtype.items())


def fused_result(out):
    training = fused_training(out)
    steps = "; ".join(
        f"{name} {fmt(run['ms'], '.1f')} ms/step, {fmt(run['x_res'], '.2f')} x res ({run['path']['path']})"
        + (f", max abs(loss - reference) {run['difference']:.1e}" if "difference" in run else "")
        for name, run in training.items())
    return f"{steps or 'no training run finished'}; the default here: {fused_verdict(training)}"


def kernels_result(out):
    """Per variant and stream dtype: the kernels' counted bytes over their summed time, against a copy,
    and their summed time against the time fused.tools.latency predicts at M."""
    result = read_json(os.path.join(out, "kernels.json"))
    if not result:
        return "-"
    groups = {}
    for row in result["kernels"]["rows"]:
        group = groups.setdefault((row["residual"], row["stream_dtype"]), dict(bytes=0.0, ms=0.0, predicted_us=0.0))
        group["bytes"] += (row["bytes_per_token"] or 0) * result["kernels"]["tokens"]
        group["ms"] += row["ms"]
        group["predicted_us"] += row.get("predicted_us_at_m") or 0
    copies = result["kernels"]["copies"]
    return "x copy, us measured / predicted at M: " + "; ".join(
        f"{residual} {dtype} {fmt(g['bytes'] / g['ms'] / 1e6 / copies[dtype]['gb_per_s'], '.2f')}, "
        f"{fmt(1000 * g['ms'], ',.0f')} / {fmt(g['predicted_us'] or None, ',.0f')}"
        for (residual, dtype), g in groups.items())


def summary(args, parts):
    device = torch.device(args.device)
    results = {"tests": lambda: tests_result(args.out), "bench": lambda: bench_result(args.out),
               "train": lambda: train_result(args.out, device), "fused": lambda: fused_result(args.out),
               "kernels": lambda: f"{kernels_result(args.out)}; {counters_result(args.out)}",
               "sharded": lambda: sharded_result(args.out)}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run"
    lines = [f"## GPU check: {name}, torch {torch.__version__} (--device {args.device} --size {args.size}, "
             f"results and logs in {args.out})", "",
             "| part | status | minutes | minutes on one H100 at M | result |",
             "|---|---|---|---|---|"]
    for part in PARTS:
        if part in parts:
            status, seconds = parts[part]["status"], fmt(parts[part]["seconds"] / 60, ".1f")
            result = results[part]() if os.path.isfile(os.path.join(args.out, f"{part}.log")) else "-"
        else:
            status, seconds, result = "not run", "-", "-"
        lines.append(f"| {part} | {status} | {seconds} | {H100_MINUTES[part]} | {result} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    parser = OneLineParser(prog="python -m benchmarks.gpu_check",
                           description=__doc__.format(tolerance=FUSED_LOSS_TOLERANCE),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"some of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run (--size tiny)")
    parser.add_argument("--size", default="M", choices=["M", "tiny"], help="M: the paper's; tiny: a quick look")
    parser.add_argument("--out", default=os.path.join("out", "gpu_check"), help="results folder")
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part '{unknown[0]}'; valid: {' '.join(PARTS)}")
    if args.device == "cpu" and args.size != "tiny":
        parser.error("the CPU dry run is --device cpu --size tiny")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; this check needs one (the CPU dry run: --device cpu --size tiny)")
    args.parts = [part for part in PARTS if part in args.parts] or list(PARTS)
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    os.makedirs(args.out, exist_ok=True)
    state = os.path.join(args.out, "parts.json")
    parts = read_json(state) or {}
    for part in args.parts:
        status, seconds = run_part(part, args)
        parts[part] = dict(status=status, seconds=seconds)
        with open(state, "w", encoding="utf-8") as f:
            json.dump(parts, f, indent=2)
    table = summary(args, parts)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    print(f"\n{table}")
    sys.exit(1 if any(parts[part]["status"] != "ok" for part in args.parts) else 0)


if __name__ == "__main__":
    main()
