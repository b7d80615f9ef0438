"""The GPU check: is this code correct on this GPU, and which of mhclite's connection paths is fastest
here? One command, in parts:

    python -m benchmarks.gpu_check quick          # the parts that compare the connection paths, within {budget} minutes
    python -m benchmarks.gpu_check                # every part, at M
    python -m benchmarks.gpu_check tests sharded  # some parts (a later command into the same --out adds to it)
    python -m benchmarks.gpu_check quick --device cpu --size tiny   # the CPU dry run (CI runs it)

mhclite's four connection paths: residuals.py compiled by inductor (the reference path) and the fused
Triton kernels, each with fp32 and with bf16 streams. The parts, in the order they run:
  tests    quick: every fused kernel against residuals.py on this GPU, fp32 and bf16 streams;
           otherwise every CUDA test, then the fast CPU tests
  bench    python bench.py in one process: res and mhclite on each path, interleaved (ms, IQR, x res,
           peak memory, tokens/s)
  train    20 steps of train.py of mhclite on each path from the same seed, on random tokens: the
           largest difference of a step's loss from the reference path's, the path each run took (its
           config.json), and the trained H_res's largest |row or column sum - 1|
  others   hc and mhc beside res (python bench.py) on the fp32 path the verdict picks
  kernels  each fused kernel alone against a copy and the time fused.tools.latency predicts for this
           GPU; where Nsight Compute reads this GPU's counters, each kernel's DRAM and L2 bytes
  sharded  train.py's sharded mode on this GPU: mhclite under torchrun with --parallel=fsdp, with and
           without activation checkpointing (not in quick)
The verdict closes the summary: the fastest path with fp32 streams whose every step's loss is within
{tolerance:g} of the reference path's; whether the kernels are at least {margin:.0%} faster than the
reference path with the same streams; mhclite's step against the targets (x res at most {targets}).
quick runs the parts but sharded (tests only the kernel tests), others and kernels only while its
{budget} minutes last; each part of quick stops at its limit, and a part that fails or is stopped does
not stop the next. OUT (--out, default out/gpu_check) holds at most eight files: summary.md, rewritten
as each part ends; gpu_check.log, every command and its output; results.json, each part's status,
minutes and results (a later command into OUT adds to it); and the JSON of bench, others and kernels.
Training runs and their data go to a temporary folder. Exit code 1 if a part failed or was stopped,
2 for bad flags. Inductor and Triton caches are kept in .cache/ (ignored by git).
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import triton

from checkpoint import load_model
from residuals import capture_connections

from .common import fmt

PARTS = ("tests", "bench", "train", "others", "kernels", "sharded")
# quick's parts, each with its limit in seconds, within QUICK_MINUTES; a part starts only while
# MIN_PART_SECONDS remain, which leaves others and kernels out when the first three took the time.
QUICK_LIMITS = {"tests": 75, "bench": 210, "train": 195, "others": 90, "kernels": 120}
QUICK_MINUTES = 8
MIN_PART_SECONDS = 60
# mhclite's connection paths, those with fp32 streams (the verdict's choice) first: its row in
# bench.py's output and train.py's flags.
PATHS = {"reference": ("mhclite", []),
         "fused": ("mhclite+fused", ["--fused_connections=True"]),
         "reference + bf16 streams": ("mhclite+bf16", ["--stream_dtype=bfloat16"]),
         "fused + bf16 streams": ("mhclite+fused+bf16", ["--fused_connections=True", "--stream_dtype=bfloat16"])}
LOSS_TOLERANCE = 2e-3  # the most a step's loss may differ from the reference path's (fp32 streams)
KERNEL_MARGIN = 0.05  # how much faster than the reference path the kernels must be to be worth their code
TARGETS = {"fp32 streams": 1.5, "bf16 streams": 1.3}  # mhclite's step over res's at M that we aim for
# The sharded part's runs: (name, flags), both --parallel=fsdp on one process.
SHARDED_RUNS = (("fsdp", []), ("fsdp + activation checkpointing", ["--activation_checkpointing=True"]))
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


def streams(path):
    return "bf16 streams" if "bf16" in path else "fp32 streams"


def kind(path):
    """The connection code a path asks for, as train.py and bench.py report it: fused or reference."""
    return path.split()[0]


def named(code, dtype):
    """The path of `code` (fused or reference) with `dtype` streams."""
    return code if dtype == "fp32 streams" else f"{code} + {dtype}"


def bench_command(args, residuals, flags, json_name):
    shape = [] if args.size == "M" else [*DRY_RUN, "--vocab_size", "512"]
    return python("bench.py", "--size", args.size, "--device", args.device, "--residuals", residuals,
                  "--recompute", "off", "--compile_mode", "blocks", *flags, *shape,
                  "--json", os.path.join(args.out, json_name))


def part_commands(part, args, scratch, results):
    """The commands of one part, in order."""
    at_m = args.size == "M"
    if part == "tests":
        workers = ["-n", "4"] if at_m else []  # test processes sharing the GPU
        kernel_tests = "tests/test_cuda.py::test_fused_kernels_match_the_reference"
        if args.quick:  # on CPU the CUDA tests skip and the kernel check runs in the interpreter
            return [("kernel tests", python("-m", "pytest", "-q", *workers, kernel_tests,
                                            "tests/fused/test_fused_ops.py::test_kernels_are_interpreted_on_cpu_and_"
                                            "compiled_on_cuda"), {})]
        cpu_tests = ["tests"] if at_m else ["tests/test_gpu_check.py::test_bad_input_is_one_error_line"]
        return [("CUDA tests", python("-m", "pytest", "-q", *workers, "-m", "cuda", "tests/test_cuda.py"), {}),
                ("fast CPU tests", python("-m", "pytest", "-q", *workers, "-m", "not slow and not cuda", *cpu_tests),
                 {})]
    if part == "bench":
        return [("bench.py, every path", bench_command(args, "res,mhclite", ["--fused_connections", "both",
                                                                               "--stream_dtype", "both"],
                                                       "bench.json"), {})]
    if part == "train":
        write_random_data(os.path.join(scratch, "data"))
        return [(f"train.py, {path}", python("train.py", *train_flags(args, "mhclite", scratch, path), *flags), {})
                for path, (_, flags) in PATHS.items()]
    if part == "others":
        fused = kind(fastest_correct_path(results) or "reference") == "fused"
        return [("bench.py, hc and mhc", bench_command(args, "res,hc,mhc", ["--fused_connections",
                                                                            "on" if fused else "off"],
                                                       "others.json"), {})]
    if part == "sharded":
        write_random_data(os.path.join(scratch, "data"))
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
        return [(f"train.py under torchrun, {name}", python(
            *torchrun, *train_flags(args, "mhclite", scratch, name), "--parallel=fsdp", *flags), {})
            for name, flags in SHARDED_RUNS]
    # The predictions for this GPU and its triton (compiled, never interpreted), then each kernel's
    # time beside them, then its hardware counters beside the proxies.
    predictions = os.path.join(scratch, "predicted_times.json")
    machine = "cuda" if args.device == "cuda" else "h200"
    counted_shape = [] if at_m else DRY_RUN_SHAPE
    return [("fused.tools.latency", python("-m", "fused.tools.latency", "--machine", machine, "--predictions",
                                           predictions, "--json", os.path.join(args.out, "latency.json")),
             {"TRITON_INTERPRET": "0"}),
            ("benchmarks.kernels", python("-m", "benchmarks.kernels", "--size", args.size, "--device", args.device,
                                          *([] if at_m else DRY_RUN), "--predicted_times", predictions,
                                          "--json", os.path.join(args.out, "kernels.json")), {}),
            ("benchmarks.kernel_counters", python("-m", "benchmarks.kernel_counters", "--size", args.size, "--device",
                                                  args.device, *counted_shape, "--latency",
                                                  os.path.join(args.out, "latency.json"),
                                                  "--json", os.path.join(args.out, "counters.json")), {})]


def run_dir(scratch, name):
    return os.path.join(scratch, name.replace(" + ", "-").replace(" ", "_"))


def train_flags(args, residual, scratch, name):
    """train.py's arguments for a few steps of `residual` on the random data, every step logged."""
    size_flags = (["--batch_size=16", "--max_iters=20", "--warmup_iters=5", "--eval_interval=20"] if args.size == "M"
                  else ["--n_layer=1", "--batch_size=2", "--block_size=32", "--max_iters=4", "--warmup_iters=1",
                        "--eval_interval=4"])
    return [f"configs/{args.size}.py", f"configs/{residual}.py", "--dataset=random",
            f"--data_dir={os.path.join(scratch, 'data')}", f"--out_dir={run_dir(scratch, name)}",
            f"--device={args.device}", "--gradient_accumulation_steps=1", "--eval_iters=2", "--compile_mode=blocks",
            "--log_interval=1", *size_flags]


def run_commands(commands, log, env, limit):
    """Runs the commands in order, all of them unless the part's `limit` (seconds, or None) runs out;
    returns the failures ("label (exit code)") and whether the limit stopped one."""
    deadline, failed = time.time() + (limit or float("inf")), []
    for label, command, extra in commands:
        print(f"gpu_check: {label}", flush=True)
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        # its own process group, so that a stop also ends its children (pytest's workers, torchrun's)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env, **extra),
                                   start_new_session=True)
        try:
            code = process.wait(timeout=max(deadline - time.time(), 0) if limit else None)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.write(f"stopped at the part's limit of {limit:.0f} s\n")
            return failed, True
        log.write(f"exit code {code}\n")
        if code != 0:
            failed.append(f"{label} ({code})")
    return failed, False


def run_part(part, args, results, limit):
    """Runs a part's commands, appending their output to OUT/gpu_check.log, and returns its record:
    status, seconds, limit, and its results (read while its runs are in the temporary folder)."""
    start = time.time()
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".cache/inductor")),
               TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", os.path.abspath(".cache/triton")),
               **({} if args.device == "cuda" else {"TRITON_INTERPRET": "1"}))  # the interpreter on CPU only
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch, \
            open(os.path.join(args.out, "gpu_check.log"), "a", encoding="utf-8") as log:
        log.write(f"\n## {part} ({datetime.datetime.now().isoformat(timespec='seconds')})\n")
        failed, stopped = run_commands(part_commands(part, args, scratch, results), log, env, limit)
        try:
            record = part_results(part, args, scratch)
        except Exception as e:  # noqa: BLE001 (a result that cannot be read must not cost the next parts)
            record, failed = dict(result="-"), [*failed, f"reading its results ({type(e).__name__}: {e})"]
    status = "; ".join(([f"failed: {', '.join(failed)}"] if failed else [])
                       + ([f"stopped at its limit ({limit:.0f} s)"] if stopped else [])) or "ok"
    if status != "ok":
        print(f"gpu_check: {part}: {status}; gpu_check.log says why")
    return dict(status=status, seconds=time.time() - start, limit=limit, **record)


# ----------------------------------------------------------------------------------------------
# Random training data, and what the parts left


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


def metrics(run):
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def median_window(run, key):
    """Median of a timing (tokens/s, ms per step) over the logged windows after the first (which compiles)."""
    windows = [r[key] for r in metrics(run) if r.get(key) is not None]
    return statistics.median(windows[1:] or windows) if windows else None


def train_losses(run):
    """{step: train loss} of every logged step."""
    return {r["step"]: r["train_loss"] for r in metrics(run) if "train_loss" in r}


@torch.no_grad()
def stochasticity_error(run, device):
    """max |row or column sum - 1| of every H_res the trained model makes on a random batch, under
    bf16 autocast as in training."""
    model, _ = load_model(os.path.join(run, "ckpt.pt"), device)
    shape = (COLSUM_SEQUENCES, model.config.block_size)
    idx = torch.randint(0, GPT2_TOKENS, shape, generator=torch.Generator().manual_seed(0)).to(device)
    with capture_connections(model) as records, torch.autocast(device.type, dtype=torch.bfloat16):
        model(idx)
    h = torch.cat([r["h_res"].flatten(0, -3) for r in records])
    return max((h.sum(-1) - 1).abs().max().item(), (h.sum(-2) - 1).abs().max().item())


def training(scratch, device):
    """{path: dict(ms per step, the path the run took and why, the largest |loss - the reference
    path's| over the same steps, H_res's largest |sum - 1|)} of the train part's finished runs."""
    runs = {path: run_dir(scratch, path) for path in PATHS}
    done = {path: run for path, run in runs.items() if os.path.isfile(os.path.join(run, "done"))}
    reference = train_losses(done["reference"]) if "reference" in done else None
    result = {}
    for path, run in done.items():
        connections = read_json(os.path.join(run, "config.json"))["connections"]  # the path the run took
        result[path] = dict(ms=median_window(run, "step_ms"), **connections,
                            h_res_error=stochasticity_error(run, device))
        if reference is not None:
            losses = train_losses(run)
            if set(losses) != set(reference):
                raise ValueError(f"{run} logged steps {sorted(losses)}, the reference {sorted(reference)}")
            result[path]["difference"] = max(abs(losses[step] - reference[step]) for step in reference)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next parts' processes get the memory back
    return result


def bench_rows(out, name):
    """{row: dict(ms, IQR ms, x res, peak MB, tokens/s, path)} of a bench.py JSON in OUT."""
    result = read_json(os.path.join(out, name))
    return {row: dict(ms=r["median_ms"], iqr_ms=r["iqr_ms"], x_res=r["time_ratio"], tokens_per_s=r["tokens_per_s"],
                      peak_mb=r["cuda_peak_bytes"] / 2**20 if r["cuda_peak_bytes"] else None,
                      path=r["connections"]["path"], why=r["connections"]["why"])
            for row, r in result["variants"].items()} if result else {}


def tests_result(log_text):
    """pytest's closing line of each command."""
    return "; ".join(line.strip().strip("=").strip() for line in log_text.splitlines() if " in " in line and
                     any(word in line for word in ("passed", "failed", "skipped", "error")))


def counters_result(out):
    """Each kernel's DRAM bytes, read by ncu, over the L2 model's, per stream dtype (mhclite)."""
    result = read_json(os.path.join(out, "counters.json"))
    if not result:
        return "no hardware counters (benchmarks.kernel_counters: gpu_check.log says why)"
    by_dtype = {}
    for row in result["rows"]:
        by_dtype.setdefault(row["stream_dtype"], []).append(
            f"{row['kernel'].removesuffix('_kernel')} {fmt(row['dram_over_predicted'], '.2f')}")
    return "DRAM measured / L2 model: " + "; ".join(f"{dtype} {', '.join(cells)}" for dtype, cells in by_dtype.items())


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


def part_results(part, args, scratch):
    """{"result": one line for the summary, and for bench and train the numbers the verdict reads}."""
    if part == "tests":
        with open(os.path.join(args.out, "gpu_check.log"), encoding="utf-8", errors="replace") as f:
            return dict(result=tests_result(f.read().rsplit("\n## tests (", 1)[-1]))
    if part in ("bench", "others"):
        rows = bench_rows(args.out, f"{part}.json")
        names = {row: path for path, (row, _) in PATHS.items()} if part == "bench" else {}
        cells = [f"{names.get(row, row)} {fmt(r['ms'], '.1f')} ms, IQR {fmt(r['iqr_ms'], '.1f')}, "
                 f"{fmt(r['x_res'], '.2f')} x res, {fmt(r['tokens_per_s'], ',.0f')} tok/s"
                 + (f", peak {r['peak_mb']:,.0f} MB" if r["peak_mb"] else "") + f" ({r['path']})"
                 for row, r in rows.items()]
        return dict(result="; ".join(cells) or "-", rows={names.get(row, row): r for row, r in rows.items()})
    if part == "train":
        runs = training(scratch, torch.device(args.device))
        return dict(result="; ".join(
            f"{path} {fmt(r['ms'], '.1f')} ms/step ({r['path']}), max abs(loss - reference) "
            f"{fmt(r.get('difference'), '.1e')}, max abs(H_res sum - 1) {r['h_res_error']:.1e}"
            for path, r in runs.items()) or "-", runs=runs)
    if part == "sharded":
        runs = {name: dict(tokens_per_s=median_window(run, "tokens_per_s"), losses=list(train_losses(run).values()))
                for name, run in ((name, run_dir(scratch, name)) for name, _ in SHARDED_RUNS)
                if os.path.isfile(os.path.join(run, "done"))}
        return dict(result="; ".join(f"{name} {fmt(r['tokens_per_s'], ',.0f')} tok/s, last loss {r['losses'][-1]:.4f}"
                                     for name, r in runs.items()) or "-", runs=runs)
    return dict(result=f"{kernels_result(args.out)}; {counters_result(args.out)}")


# ----------------------------------------------------------------------------------------------
# The verdict and the summary


def usable_paths(results):
    """{path: (its bench row, its training run)} of the paths that ran the code they asked for in both."""
    bench, runs = results.get("bench", {}).get("rows", {}), results.get("train", {}).get("runs", {})
    return {path: (bench[path], runs[path]) for path in PATHS if path in bench and path in runs
            and bench[path]["path"] == runs[path]["path"] == kind(path)}


def fastest_correct_path(results):
    """The fastest path with fp32 streams whose every loss is within LOSS_TOLERANCE of the reference
    path's, or None before the bench and train parts have run."""
    correct = {path: row["x_res"] for path, (row, run) in usable_paths(results).items()
               if streams(path) == "fp32 streams" and run.get("difference", float("inf")) <= LOSS_TOLERANCE}
    return min(correct, key=correct.get) if correct else None


def verdict(results):
    """One line to act on: the path to run on this GPU, the kernels against the reference path with
    the same streams, and mhclite's step against the targets."""
    paths, chosen = usable_paths(results), fastest_correct_path(results)
    if chosen is None:
        return "no verdict: the bench and train parts must both finish, the reference path in both"
    cells = [f"run on this GPU: {chosen} (the fastest with fp32 streams whose losses are within "
             f"{LOSS_TOLERANCE:g} of the reference path's)"]
    for dtype, target in TARGETS.items():
        fused, reference = named("fused", dtype), named("reference", dtype)
        if fused not in paths:
            runs = [results.get("bench", {}).get("rows", {}).get(fused),
                    results.get("train", {}).get("runs", {}).get(fused)]
            why = next((run["why"] for run in runs if run and run["path"] != "fused"), "no run finished")
            cells.append(f"kernels, {dtype}: did not run ({why})")
        elif reference in paths:
            speed = paths[fused][0]["x_res"] / paths[reference][0]["x_res"]
            cells.append(f"kernels / reference path, {dtype}: {speed:.2f} (at least {KERNEL_MARGIN:.0%} faster: "
                         f"{'yes' if speed <= 1 - KERNEL_MARGIN else 'no'})")
        # the fastest with these streams: with fp32 streams the chosen path, which trains within the tolerance
        fastest = chosen if dtype == "fp32 streams" else min(
            (path for path in paths if streams(path) == dtype), key=lambda path: paths[path][0]["x_res"], default=None)
        if fastest is not None:
            ratio = paths[fastest][0]["x_res"]
            cells.append(f"mhclite, {fastest}: {ratio:.2f} x res (target {target:g}: "
                         f"{'met' if ratio <= target else 'missed'}), max abs(loss - reference) "
                         f"{fmt(paths[fastest][1].get('difference'), '.1e')}")
    return "; ".join(cells)


def summary(args, results):
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU dry run"
    lines = [f"## GPU check: {name}, torch {torch.__version__}, triton {triton.__version__}, "
             f"{datetime.date.today()} (--device {args.device} --size {args.size}; results and logs in {args.out})",
             "", "| part | status | minutes | limit, minutes | result |", "|---|---|---|---|---|"]
    for part in PARTS:
        record = results.get(part)
        if record is None:
            lines.append(f"| {part} | not run | - | - | - |")
        else:
            limit = fmt(record["limit"] / 60 if record["limit"] else None, ".1f")
            lines.append(f"| {part} | {record['status']} | {record['seconds'] / 60:.1f} | {limit} | "
                         f"{record.get('result', '-')} |")
    return "\n".join(lines + ["", f"**Verdict**: {verdict(results)}"])


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    parser = OneLineParser(prog="python -m benchmarks.gpu_check", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=__doc__.format(budget=QUICK_MINUTES, tolerance=LOSS_TOLERANCE,
                                                      margin=KERNEL_MARGIN, targets=", ".join(
                                                          f"{v:g} with {k}" for k, v in TARGETS.items())))
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"quick, or some of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run (--size tiny)")
    parser.add_argument("--size", default="M", choices=["M", "tiny"], help="M: the paper's; tiny: a quick look")
    parser.add_argument("--out", default=os.path.join("out", "gpu_check"), help="results folder")
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts if part not in (*PARTS, "quick")]
    if unknown:
        parser.error(f"unknown part '{unknown[0]}'; valid: quick {' '.join(PARTS)}")
    args.quick = "quick" in args.parts
    if args.quick and len(args.parts) > 1:
        parser.error("quick runs alone")
    if args.device == "cpu" and args.size != "tiny":
        parser.error("the CPU dry run is --device cpu --size tiny")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; this check needs one (the CPU dry run: --device cpu --size tiny)")
    args.parts = list(QUICK_LIMITS) if args.quick else [part for part in PARTS if part in args.parts] or list(PARTS)
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    os.makedirs(args.out, exist_ok=True)
    state = os.path.join(args.out, "results.json")
    results = read_json(state) or {}
    deadline = time.time() + 60 * QUICK_MINUTES
    for part in args.parts:
        limit = min(QUICK_LIMITS[part], deadline - time.time()) if args.quick else None
        if limit is not None and limit < MIN_PART_SECONDS:
            results[part] = dict(status="skipped: quick's minutes were spent", seconds=0, limit=None)
        else:
            results[part] = run_part(part, args, results, limit)
        with open(state, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
            f.write(summary(args, results) + "\n")
    with open(os.path.join(args.out, "summary.md"), encoding="utf-8") as f:
        print(f"\n{f.read()}", end="")
    sys.exit(1 if any(results[part]["status"] not in ("ok", "skipped: quick's minutes were spent")
                      for part in args.parts) else 0)


if __name__ == "__main__":
    main()
