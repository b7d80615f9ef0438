"""Each fused connection kernel's hardware counters on this GPU, read by Nsight Compute (ncu): DRAM
bytes, L2 traffic, global loads and stores as executed, registers and achieved occupancy, per
token, beside what the CPU proxies say of the same launch at M (python -m fused.tools.latency
--json: the L2 model's DRAM bytes, the executed and unique bytes, the compiled registers).

    python -m fused.tools.latency --machine cuda --json out/latency.json       # on the GPU, first
    python -m benchmarks.kernel_counters --size M --latency out/latency.json    # then this, where ncu is

It runs itself under ncu with --launches FILE: that process records one forward + backward of each
variant's connection (fused/tools/launches.py), replays each launch twice (the first compiles it)
and lists the launches in FILE; ncu profiles every launch of the connection kernels, and this reads
the second of each replayed pair. Where ncu is missing or may not read the GPU's counters (seen on
gVisor machines), it says so and exits 0: the counters are a check of the proxies, not of the code.
"""

import argparse
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

from devices import synchronize
from fused import ops
from fused.tools.launches import connection_launches
from config import STREAM_DTYPES
from model import GPTConfig

from .common import BenchError, add_shared_flag, environment, fmt, markdown_table, stream_dtype_list, write_json
from .kernels import resolve as resolve_kernel_flags

# The counters read, by what they say of a launch. A metric this ncu does not know is left out (and
# named), except the launch attributes, which every ncu has.
METRICS = {
    "time": ["gpu__time_duration.sum"],
    "dram": ["dram__bytes_read.sum", "dram__bytes_write.sum"],
    "l2": ["lts__t_bytes.sum"],
    "global": ["l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
               "l1tex__t_bytes_pipe_lsu_mem_global_op_ldgsts_cache_access.sum",
               "l1tex__t_bytes_pipe_lsu_mem_global_op_ldgsts_cache_bypass.sum"],
    "registers": ["launch__registers_per_thread"],
    "occupancy": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
}
ALWAYS_KNOWN = ("launch__",)
UNIT_SCALE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6,
              "msecond": 1e-3, "second": 1}
# What ncu prints where it may not read this GPU's counters.
NO_COUNTERS = ("ERR_NVGPUCTRPERM", "LibraryNotLoaded", "Failed to initialize the profiler")
REPLAYS = 2  # each launch replayed twice: the first compiles it, ncu's reading of the second is kept


class NoCounters(Exception):
    """ncu cannot read this machine's counters: nothing to measure here, not a failure."""


# ----------------------------------------------------------------------------------------------
# Under ncu: the launches, replayed


def replay_launches(args, device):
    """Records each variant's connection launches and replays each REPLAYS times; returns the list
    of launches in the order they ran, recording included: [(residual, stream dtype, kernel, kept)]."""
    ran = []
    for stream_dtype in args.stream_dtypes:
        for residual in args.residual_list:
            launches = connection_launches(residual, stream_dtype, args.dtype == "bfloat16", args.shape["n_embd"],
                                           args.batch_size, args.block_size, device, n_streams=GPTConfig.n_streams,
                                           seed=args.seed)
            ran += [(residual, stream_dtype, launch.kernel, False) for launch in launches]  # while recording
            for launch in launches:
                for replay in range(REPLAYS):
                    launch.replay()
                    ran.append((residual, stream_dtype, launch.kernel, replay == REPLAYS - 1))
            synchronize(device)
            del launches
    return ran


# ----------------------------------------------------------------------------------------------
# ncu: what it knows, running it, reading its CSV


def find_ncu():
    """ncu on the PATH, else the newest under /opt/nvidia (where the CUDA toolkit installs it)."""
    installed = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return shutil.which("ncu") or (installed[-1] if installed else None)


def known_metrics(query_output):
    """The base metric names (`dram__bytes_read`) that `ncu --query-metrics` lists."""
    return set(re.findall(r"^([a-z0-9]+__[a-z0-9_]+)\s", query_output, flags=re.MULTILINE))


def usable_metrics(known):
    """(the METRICS this ncu knows, the ones it does not)."""
    wanted = [m for names in METRICS.values() for m in names]
    usable = [m for m in wanted if m.startswith(ALWAYS_KNOWN) or m.split(".")[0] in known]
    return usable, [m for m in wanted if m not in usable]


def number(text):
    """A value of ncu's CSV: thousands may be separated by commas."""
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return float(text)


def read_ncu_csv(text):
    """The launches of ncu's CSV (ncu's own `==PROF==` lines skipped), each {"kernel": name, metric:
    value in bytes, seconds or as printed}: the raw page (a row per launch, a column per metric,
    then a units row) or the details page (a row per metric of a launch, with its unit)."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if not rows:
        return []
    header, body = rows[0], [dict(zip(rows[0], row)) for row in rows[1:]]
    launches = {}
    if "Metric Name" in header:
        for cells in body:
            launch = launches.setdefault(cells["ID"], {"kernel": cells["Kernel Name"]})
            add_value(launch, cells["Metric Name"], cells["Metric Value"], cells["Metric Unit"])
        return list(launches.values())
    units = body.pop(0) if body and body[0]["ID"] == "" else {}
    for index, cells in enumerate(body):
        launch = launches.setdefault(index, {"kernel": cells["Kernel Name"]})
        for name, value in cells.items():
            if "__" in name:
                add_value(launch, name, value, units.get(name, ""))
    return list(launches.values())


def add_value(launch, metric, value, unit):
    if value not in ("", "n/a"):
        launch[metric] = number(value) * UNIT_SCALE.get(unit, 1)


def kept_launches(ran, profiled):
    """The profiled launches that ran last of each replayed pair, with their variant, stream dtype
    and kernel; the two lists must name the same kernels in the same order."""
    names = [kernel for _, _, kernel, _ in ran]
    if [p["kernel"] for p in profiled] != names:
        raise BenchError(f"ncu profiled {len(profiled)} launches ({', '.join(p['kernel'] for p in profiled[:6])}"
                         f"{', ...' if len(profiled) > 6 else ''}), this process ran {len(names)}")
    return [dict(p, residual=residual, stream_dtype=stream_dtype)
            for (residual, stream_dtype, _, kept), p in zip(ran, profiled) if kept]


def child_argv(args):
    """The flags that make the process under ncu replay the launches args asks for."""
    return ["--size", args.size, "--batch_size", str(args.batch_size), "--block_size", str(args.block_size),
            "--device", args.device_type, "--dtype", args.dtype, "--seed", str(args.seed),
            "--residuals", ",".join(args.residual_list), "--stream_dtypes", ",".join(args.stream_dtypes)]


def run_under_ncu(ncu, argv, workdir):
    """Runs this module under ncu with argv and --launches; returns (what ran, ncu's launches, the
    metrics left out)."""
    query = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True)
    output = query.stdout + query.stderr
    if query.returncode != 0 or any(s in output for s in NO_COUNTERS):
        raise NoCounters(f"ncu --query-metrics: {output.strip()[-300:]}")
    usable, missing = usable_metrics(known_metrics(output))
    ran_path, csv_path = os.path.join(workdir, "launches.json"), os.path.join(workdir, "ncu.csv")
    command = [ncu, "--target-processes", "all", "--clock-control", "none", "--cache-control", "all",
               "--kernel-name-base", "function",
               "--kernel-name", f"regex:^({'|'.join(ops.TILES)})$", "--metrics", ",".join(usable), "--csv",
               "--page", "raw", "--print-units", "base", "--print-metric-name", "name", "--log-file", csv_path,
               sys.executable, "-m", "benchmarks.kernel_counters", *argv, "--launches", ran_path]
    child = subprocess.run(command)
    with open(csv_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if any(s in text for s in NO_COUNTERS):
        raise NoCounters(next(line for line in text.splitlines() if any(s in line for s in NO_COUNTERS)))
    if child.returncode != 0:
        raise BenchError(f"the profiled process exited {child.returncode}; ncu's log: {text.strip()[-500:]}")
    with open(ran_path, encoding="utf-8") as f:
        ran = [tuple(r) for r in json.load(f)]
    return ran, read_ncu_csv(text), missing


# ----------------------------------------------------------------------------------------------
# Measured beside the proxies


def per_token_row(launch, tokens, profile):
    """One kept launch's counters per token, beside its profile from fused.tools.latency (or None)."""
    def total(kind):
        present = [launch[m] for m in METRICS[kind] if m in launch]
        return sum(present) if present else None

    def per_token(value):
        return None if value is None else value / tokens

    p = profile or {}
    dram = per_token(total("dram"))
    return dict(residual=launch["residual"], stream_dtype=launch["stream_dtype"], kernel=launch["kernel"],
                us=None if total("time") is None else 1e6 * total("time"),
                dram_per_token=dram, predicted_dram_per_token=p.get("dram_per_token"),
                dram_over_predicted=None if dram is None or not p.get("dram_per_token") else dram / p["dram_per_token"],
                l2_per_token=per_token(total("l2")), global_per_token=per_token(total("global")),
                executed_per_token=p.get("executed_per_token"), unique_per_token=p.get("unique_per_token"),
                registers=total("registers"), compiled_registers=p.get("registers"),
                achieved_occupancy_pct=total("occupancy"))


def compare(kept, tokens, profiles):
    by_launch = {(p["residual"], p["stream_dtype"], p["kernel"]): p for p in profiles}
    return [per_token_row(k, tokens, by_launch.get((k["residual"], k["stream_dtype"], k["kernel"]))) for k in kept]


def counters_table(rows):
    def kb(value):
        return fmt(None if value is None else value / 1000, ".1f")

    table = [[r["residual"], r["stream_dtype"], r["kernel"].removesuffix("_kernel"), fmt(r["us"], ".1f"),
              kb(r["dram_per_token"]), kb(r["predicted_dram_per_token"]), fmt(r["dram_over_predicted"], ".2f"),
              kb(r["l2_per_token"]), kb(r["global_per_token"]), kb(r["executed_per_token"]), kb(r["unique_per_token"]),
              f"{fmt(r['registers'], '.0f')} / {fmt(r['compiled_registers'], '.0f')}",
              fmt(r["achieved_occupancy_pct"], ".0f")] for r in rows]
    return markdown_table(["variant", "streams", "kernel", "us (under ncu)", "DRAM KB/token", "L2 model KB/token",
                           "x model", "L2 traffic KB/token", "global ld+st KB/token", "executed, counted",
                           "unique, counted", "registers, measured / compiled", "achieved occupancy %"], table)


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_counters", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag in ("--size", "--batch_size", "--block_size", "--device", "--dtype", "--seed"):
        add_shared_flag(parser, flag)
    parser.add_argument("--residuals", default="mhclite", help="the HC-family variants, comma-separated")
    parser.add_argument("--stream_dtypes", default=",".join(STREAM_DTYPES), help="comma-separated")
    parser.add_argument("--latency", help="python -m fused.tools.latency --json output to compare with (best made "
                        "with --machine cuda on this machine)")
    parser.add_argument("--launches", help=argparse.SUPPRESS)  # the process ncu profiles writes what ran here
    parser.add_argument("--json", help="output path (default out/bench/<size>-<device>-kernel-counters.json)")
    return parser.parse_args(argv)


def resolve(args):
    default_json = args.json is None
    args.steps, args.warmup = 1, 0  # resolve_kernel_flags checks them; nothing is timed here
    resolve_kernel_flags(args)
    args.stream_dtypes = stream_dtype_list(args.stream_dtypes)
    if default_json:
        args.json = os.path.join("out", "bench", f"{args.size}-{args.device_type}-kernel-counters.json")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = resolve(parse_args(argv))
        device = torch.device(args.device_type)
        if args.launches:  # the process under ncu
            with open(args.launches, "w", encoding="utf-8") as f:
                json.dump(replay_launches(args, device), f)
            return
        ncu = find_ncu()
        if device.type != "cuda" or ncu is None:
            raise NoCounters("needs a CUDA GPU and ncu" + ("" if device.type != "cuda" else " (not found)"))
        profiles = []
        if args.latency:
            with open(args.latency, encoding="utf-8") as f:
                profiles = json.load(f)["profiles"]
        with tempfile.TemporaryDirectory() as workdir:
            ran, profiled, missing = run_under_ncu(ncu, child_argv(args), workdir)
        tokens = args.batch_size * args.block_size
        result = dict(environment(argv, device, "-m", "benchmarks.kernel_counters"), mode="kernel_counters",
                      tokens=tokens, width=args.shape["n_embd"], metrics_left_out=missing, latency=args.latency,
                      rows=compare(kept_launches(ran, profiled), tokens, profiles))
    except NoCounters as e:
        print(f"skipped: no hardware counters here: {e}")
        return
    except (BenchError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    left_out = f"; metrics this ncu does not know, left out: {', '.join(missing)}" if missing else ""
    print(f"## Fused connection kernels' counters (ncu), {tokens:,} tokens, C = {args.shape['n_embd']}, autocast "
          f"{args.dtype}, {result['device_name']}{left_out}\n\n{counters_table(result['rows'])}\n")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
