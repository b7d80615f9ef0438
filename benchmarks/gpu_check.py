"""The GPU check for a short allocation: is this code correct on this GPU, and which of mhclite's
connection paths trains fastest here? One command:

    python -m benchmarks.gpu_check quick                              # on a GPU, at M
    python -m benchmarks.gpu_check quick --device cpu --size tiny     # the CPU dry run (the tests run it)

mhclite's four connection paths: residuals.py compiled by inductor (the reference path) and the
fused Triton kernels, each with fp32 and with bf16 streams. The parts, in order, each stopped at
its limit ({limits}) or when the check's --budget runs out, so that a hang cannot spend the
allocation; a part with less than {least} s of the budget left is skipped:
  tests   the CUDA tests (pytest -m cuda; on CPU they skip)
  bench   python bench.py in one process, interleaved: res, hc, mhc and mhclite on the reference path,
          and mhclite's other three paths (ms, IQR, x res, tokens/s, peak memory)
  train   {steps} steps of train.py of mhclite on each path from the same seed, on random tokens, the
          four runs at once: the largest difference of a step's loss from the reference path's, and
          the path each run took
  graphs  python bench.py again for res and mhclite on the reference path, each compiled with and
          without inductor's CUDA graphs (most of a connection's compiled kernels are tiny, so their
          launches may cost more than their work), and each +graphs row's largest difference of a
          step's loss from the same variant's without
The verdict closes the summary: the fastest path whose every step's loss is within {tolerance:g} of the
reference path's; then the paper's throughput ordering (mhclite above hc, mhc below hc), the fused
kernels' step time over the compiled path's, and what CUDA graphs did. OUT (--out, default out/gpu_check) holds summary.md,
gpu_check.log (every command and its output), results.json, bench.json and graphs.json; training
runs and their data go to a temporary folder. Exit code 1 if a part failed, was stopped or was
skipped, 2 for bad flags.
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import triton

from .common import fmt, markdown_table
from .step import GRAPHS_SUFFIX

PARTS = ("tests", "bench", "train", "graphs")
LIMITS = {"tests": 150, "bench": 300, "train": 195, "graphs": 150}  # seconds
BUDGET = 510  # seconds for all parts: inside the 9 minutes a short allocation's command gets
LEAST_PART_SECONDS = 30  # a part with less of the budget left is skipped
# Its commands run at once: train's runs check losses, not times, and compile on the CPU's cores meanwhile.
CONCURRENT_PARTS = ("train",)
# mhclite's paths: bench.py's row, train.py's flags.
PATHS = {"reference": ("mhclite", []),
         "reference + bf16 streams": ("mhclite+bf16", ["--stream_dtype=bfloat16"]),
         "fused": ("mhclite+fused", ["--fused_connections=True"]),
         "fused + bf16 streams": ("mhclite+fused+bf16", ["--fused_connections=True", "--stream_dtype=bfloat16"])}
PATHS_BY_ROW = {row: path for path, (row, _) in PATHS.items()}
LOSS_TOLERANCE = 2e-3  # the most a step's loss may differ from the reference path's
TRAIN_STEPS = 20
GPT2_TOKENS = 50257
SPLIT_TOKENS = {"train": 4_000_000, "val": 400_000}
GRAPHS_ROWS = "res,mhclite"
DRY_RUN = ["--batch_size", "1", "--block_size", "16", "--steps", "1", "--warmup", "0", "--vocab_size", "512"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error:` line (no usage block) and exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def part_commands(part, args, scratch):
    """[(label, command line)] of one part, in order."""
    at_m, python = args.size == "M", sys.executable
    if part == "tests":
        return [("CUDA tests", [python, "-m", "pytest", "-q", *(["-n", "4"] if at_m else []), "-m", "cuda",
                                "tests/test_cuda.py"])]
    if part == "bench":
        return [("bench.py, every path", [
            python, "bench.py", "--size", args.size, "--device", args.device, "--residuals", "res,hc,mhc,mhclite",
            "--path_rows", "mhclite", "--recompute", "off", "--compile_mode", "blocks", "--fused_connections", "both",
            "--stream_dtype", "both", *([] if at_m else DRY_RUN), "--json", os.path.join(args.out, "bench.json")])]
    if part == "graphs":
        return [("bench.py, CUDA graphs", [
            python, "bench.py", "--size", args.size, "--device", args.device, "--residuals", GRAPHS_ROWS,
            "--recompute", "off", "--compile", "on", "--compile_mode", "blocks", "--cuda_graphs", "both",
            *([] if at_m else DRY_RUN), "--json", os.path.join(args.out, "graphs.json")])]
    write_random_data(os.path.join(scratch, "data"))
    shape = ([f"--max_iters={TRAIN_STEPS}", f"--eval_interval={TRAIN_STEPS}", "--batch_size=16", "--warmup_iters=5"]
             if at_m else ["--max_iters=4", "--eval_interval=4", "--batch_size=2", "--warmup_iters=1", "--n_layer=1",
                           "--block_size=32"])
    return [(f"train.py, {path}", [
        python, "train.py", f"configs/{args.size}.py", "configs/mhclite.py", "--dataset=random",
        f"--data_dir={os.path.join(scratch, 'data')}", f"--out_dir={run_dir(scratch, path)}", f"--device={args.device}",
        "--gradient_accumulation_steps=1", "--eval_iters=2", "--compile_mode=blocks", "--log_interval=1", *shape,
        *flags]) for path, (_, flags) in PATHS.items()]


def run_dir(scratch, path):
    return os.path.join(scratch, path.replace(" + ", "-").replace(" ", "_"))


def write_random_data(data_dir):
    """Uniform random GPT-2 token ids (seeded) in nanoGPT's format, as dataset 'random'."""
    folder = os.path.join(data_dir, "random")
    os.makedirs(folder, exist_ok=True)
    generator = np.random.default_rng(0)
    for split, count in SPLIT_TOKENS.items():
        generator.integers(0, GPT2_TOKENS, count, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(dict(tokenizer="gpt2", vocab_size=GPT2_TOKENS, source="uniform random ids (benchmarks/gpu_check.py)",
                       train_tokens=SPLIT_TOKENS["train"], val_tokens=SPLIT_TOKENS["val"]), f, indent=2)


def run_part(part, args, scratch, log, env, limit):
    """Runs a part's commands for at most `limit` seconds, one after another, or all at once for a
    part in CONCURRENT_PARTS; their output goes to the log, a command's after it ends. Returns the
    part's status."""
    log.write(f"\n## {part} ({datetime.datetime.now().isoformat(timespec='seconds')})\n")
    deadline, failed, commands = time.time() + limit, [], part_commands(part, args, scratch)
    for batch in [commands] if part in CONCURRENT_PARTS else [[command] for command in commands]:
        running = []
        for label, command in batch:
            print(f"gpu_check: {label}", flush=True)
            output = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
            # its own process group, so that a stop also ends its children (pytest's workers)
            running.append((label, command, output, subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)))
        stopped = False
        for label, command, output, process in running:
            try:
                code = process.wait(timeout=max(deadline - time.time(), 0))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code, stopped = process.wait(), True
            output.seek(0)
            log.write(f"$ {' '.join(command)}\n{output.read()}exit code {code}\n")
            output.close()
            if code != 0 and not stopped:
                failed.append(f"{label} ({code})")
        log.flush()
        if stopped:
            log.write(f"stopped at the part's limit of {limit} s\n")
            return f"stopped at its limit ({limit} s)"
    return f"failed: {', '.join(failed)}" if failed else "ok"


# ----------------------------------------------------------------------------------------------
# What the parts left


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def bench_rows(path):
    """{row: dict(ms, IQR ms, x res, tokens/s, peak MB, path, why, losses)} of a bench.py JSON."""
    return {row: dict(ms=r["median_ms"], iqr_ms=r["iqr_ms"], x_res=r["time_ratio"], tokens_per_s=r["tokens_per_s"],
                      peak_mb=r["cuda_peak_bytes"] / 2**20 if r["cuda_peak_bytes"] else None,
                      path=r["connections"]["path"], why=r["connections"]["why"], losses=r["losses"])
            for row, r in read_json(path)["variants"].items()} if os.path.isfile(path) else {}


def graphs_rows(path):
    """bench_rows of the graphs part, each "+graphs" row with the largest difference of a step's loss
    from its row without graphs (the same weights and batches) and its time over plain res's."""
    rows = bench_rows(path)
    for row, r in rows.items():
        plain = rows.get(row.removesuffix(GRAPHS_SUFFIX))
        if row.endswith(GRAPHS_SUFFIX) and plain and len(plain["losses"]) == len(r["losses"]):
            r["difference"] = max(abs(a - b) for a, b in zip(r["losses"], plain["losses"]))
        r["x_plain_res"] = r["ms"] / rows["res"]["ms"] if "res" in rows else None
    return rows


def training(scratch):
    """{path: dict(the path the run took and why, the largest |loss - the reference path's|)} of the
    train part's finished runs."""
    losses, result = {}, {}
    for path in PATHS:
        run = run_dir(scratch, path)
        if os.path.isfile(os.path.join(run, "done")):
            with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
                losses[path] = {r["step"]: r["train_loss"] for r in map(json.loads, f) if "train_loss" in r}
            result[path] = dict(read_json(os.path.join(run, "config.json"))["connections"])
    reference = losses.get("reference")
    for path, run_losses in losses.items():
        if reference is not None and set(run_losses) == set(reference):
            result[path]["difference"] = max(abs(run_losses[step] - reference[step]) for step in reference)
    return result


def tests_result(log_text):
    """pytest's closing line."""
    return "; ".join(line.strip().strip("=").strip() for line in log_text.splitlines() if " in " in line and
                     any(word in line for word in ("passed", "failed", "skipped", "error")))


def verdict(results):
    """The fastest path that ran the code it asked for in the bench and the training, and trained
    within LOSS_TOLERANCE of the reference path; and why any other path is out."""
    bench, runs = results.get("bench", {}).get("rows", {}), results.get("train", {}).get("runs", {})
    if "reference" not in runs or PATHS["reference"][0] not in bench:
        return "no verdict: the bench and train parts must both finish, the reference path in both"
    within, out = {}, []
    for path, (row, _) in PATHS.items():
        row, run = bench.get(row), runs.get(path)
        took = next((r for r in (row, run) if r and r["path"] != path.split()[0]), None)  # fused or reference
        if row is None or run is None:
            out.append(f"{path}: did not finish")
        elif took:
            out.append(f"{path}: took the {took['path']} path ({took['why']})")
        elif run.get("difference", float("inf")) > LOSS_TOLERANCE:
            out.append(f"{path}: loss off by {fmt(run.get('difference'), '.1e')}")
        else:
            within[path] = row["x_res"]
    fastest = min(within, key=within.get)
    return "; ".join([f"run mhclite on this GPU with: {fastest} ({within[fastest]:.2f} x res, the fastest path "
                      f"whose every step's loss is within {LOSS_TOLERANCE:g} of the reference path's)", *out])


def throughput_ordering(results):
    """The paper's token-throughput claim (M, plain PyTorch): mhclite above hc, mhc below hc; here on
    the compiled reference path with fp32 streams."""
    rows = results.get("bench", {}).get("rows", {})
    if not all(name in rows for name in ("hc", "mhc", "mhclite")):
        return "not measured: the bench part did not finish"
    tokens = {name: rows[name]["tokens_per_s"] for name in ("mhclite", "hc", "mhc")}
    return (", ".join(f"{name} {value:,.0f}" for name, value in tokens.items()) + " tokens/s: mhclite above hc "
            + ("holds" if tokens["mhclite"] > tokens["hc"] else "does not hold") + ", mhc below hc "
            + ("holds" if tokens["mhc"] < tokens["hc"] else "does not hold"))


def kernels_against_compiled(results):
    """The fused kernels' step time over the reference path's with the same stream dtype, where the
    kernels ran: the figure that decides whether they stay (at least 5% faster) or go."""
    rows, said = results.get("bench", {}).get("rows", {}), []
    for fused, compiled in (("mhclite+fused", "mhclite"), ("mhclite+fused+bf16", "mhclite+bf16")):
        if fused in rows and compiled in rows:
            took = rows[fused]["path"] == "fused"
            said.append(f"{PATHS_BY_ROW[fused]} {rows[fused]['ms'] / rows[compiled]['ms']:.2f} x "
                        f"{PATHS_BY_ROW[compiled]}" if took else f"{PATHS_BY_ROW[fused]} did not run the kernels")
    return "; ".join(said) if said else "not measured: the bench part did not finish"


def graphs_verdict(results):
    """What CUDA graphs did for each variant of the graphs part: its time with them over without,
    and whether every step's loss stayed within LOSS_TOLERANCE of the same variant's without."""
    rows = results.get("graphs", {}).get("rows", {})
    said = []
    for row in GRAPHS_ROWS.split(","):
        graphed, plain = rows.get(row + GRAPHS_SUFFIX), rows.get(row)
        if not graphed or not plain:
            continue
        losses = ("its losses within " if graphed.get("difference", float("inf")) <= LOSS_TOLERANCE
                  else "its losses NOT within ") + f"{LOSS_TOLERANCE:g} ({fmt(graphed.get('difference'), '.1e')})"
        said.append(f"{row} {graphed['ms'] / plain['ms']:.2f} x its time without, {losses}")
    return "; ".join(said) if said else "not measured: the graphs part did not finish"


def summary(args, results):
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU dry run"
    parts = [[part, r["status"], f"{r['seconds'] / 60:.1f}", r.get("result", "-")] for part, r in results.items()]
    runs = results.get("train", {}).get("runs", {})
    rows = [[PATHS_BY_ROW.get(row, row), fmt(r["ms"], ".1f"), fmt(r["iqr_ms"], ".1f"), fmt(r["x_res"], ".2f"),
             fmt(r["tokens_per_s"], ",.0f"), fmt(r["peak_mb"], ",.0f"), f"{r['path']} ({r['why']})",
             fmt(runs.get(PATHS_BY_ROW.get(row), {}).get("difference"), ".1e")]
            for row, r in results.get("bench", {}).get("rows", {}).items()]
    graphs = [[row, fmt(r["ms"], ".1f"), fmt(r["iqr_ms"], ".1f"), fmt(r["x_res"], ".2f"), fmt(r["x_plain_res"], ".2f"),
               fmt(r["tokens_per_s"], ",.0f"), fmt(r["peak_mb"], ",.0f"), fmt(r.get("difference"), ".1e")]
              for row, r in results.get("graphs", {}).get("rows", {}).items()]
    return "\n\n".join([
        f"## GPU check: {name}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()} "
        f"(--device {args.device} --size {args.size}; logs in {args.out})",
        markdown_table(["part", "status", "minutes", "result"], parts),
        markdown_table(["row", "ms", "IQR ms", "x res", "tokens/s", "peak MB", "connections",
                        "max abs(loss - reference)"], rows),
        "CUDA graphs (the reference path compiled block by block, fp32 streams; x res: over res run the same "
        "way):",
        markdown_table(["row", "ms", "IQR ms", "x res", "x res without graphs", "tokens/s", "peak MB",
                        "max abs(loss - without graphs)"], graphs),
        f"**Verdict**: {verdict(results)}",
        f"**The paper's throughput ordering** (the bench's reference path, fp32 streams): {throughput_ordering(results)}",
        f"**Kernels against the compiled path** (step time): {kernels_against_compiled(results)}",
        f"**CUDA graphs**: {graphs_verdict(results)}"])


def parse_args(argv):
    limits = ", ".join(f"{p} {s / 60:g} min" for p, s in LIMITS.items())
    parser = OneLineParser(prog="python -m benchmarks.gpu_check", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=__doc__.format(limits=limits, least=LEAST_PART_SECONDS, steps=TRAIN_STEPS,
                                                      tolerance=LOSS_TOLERANCE))
    parser.add_argument("mode", nargs="?", default="quick", choices=["quick"], help="what to run (quick: all of it)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run (--size tiny)")
    parser.add_argument("--size", default="M", choices=["M", "tiny"], help="M: the paper's; tiny: a quick look")
    parser.add_argument("--out", default=os.path.join("out", "gpu_check"), help="results folder")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for all parts together")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    if args.device == "cpu" and args.size != "tiny":
        parser.error("the CPU dry run is --device cpu --size tiny")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; this check needs one (the CPU dry run: --device cpu --size tiny)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".cache/inductor")),
               TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", os.path.abspath(".cache/triton")),
               **({} if args.device == "cuda" else {"TRITON_INTERPRET": "1"}))  # the interpreter on CPU only
    log_path, results, end = os.path.join(args.out, "gpu_check.log"), {}, time.time() + args.budget
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch, open(log_path, "w", encoding="utf-8") as log:
        for part in PARTS:
            start, left = time.time(), round(end - time.time())
            if left < LEAST_PART_SECONDS:
                status = f"skipped: {max(left, 0)} s of the budget left"
                log.write(f"\n## {part}: {status}\n")
            else:
                status = run_part(part, args, scratch, log, env, min(LIMITS[part], left))
            log.flush()
            if status != "ok":
                print(f"gpu_check: {part}: {status}; gpu_check.log says why")
            results[part] = dict(status=status, seconds=time.time() - start)
            if part == "tests":
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    results[part]["result"] = tests_result(f.read())  # the log holds only the tests so far
            elif part == "bench":
                results[part]["rows"] = bench_rows(os.path.join(args.out, "bench.json"))
            elif part == "graphs":
                results[part]["rows"] = graphs_rows(os.path.join(args.out, "graphs.json"))
            else:
                results[part]["runs"] = training(scratch)
            with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
            with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
                f.write(summary(args, results) + "\n")
    print(f"\n{summary(args, results)}")
    sys.exit(0 if all(r["status"] == "ok" for r in results.values()) else 1)


if __name__ == "__main__":
    main()
