"""A latency and occupancy model of the fused connection kernels on an H100/H200 (sm_90), from a CPU:
what each kernel at its shipped tile should cost at M, and why.

    python -m fused.tools.latency                       # Markdown: per kernel, then the calibration
    python -m fused.tools.latency --json out/latency.json
    python -m fused.tools.latency --machine cuda --predictions out/predicted_times.json   # on a GPU machine
    python -m fused.tools.latency --add_calibration out/gpu_check   # its kernel times join the calibration

Per kernel launch of one connection at M (16,384 tokens, C = 768, bf16 autocast), from
  - fused/tools/kernel_bytes.json (python -m fused.tools.count_bytes, Triton's interpreter at the
    shipped tiles): unique, executed and re-read bytes per token and load instructions per token;
  - the launch recorded at M without running (launches.py) and compiled for the GPU's architecture
    with the installed triton (resources.compile_kernel): registers, stack bytes, warps, CTAs per SM;
it derives
  - resident programs: min(grid, CTAs/SM x SMs);
  - DRAM bytes (the L2 model): unique bytes, plus every re-read (a load of an address its program had
    touched before) whose reuse distance (bytes of the distinct addresses of its own the program
    touched in between; what every program reads, such as the weight, L2 holds once for all) times
    the resident programs exceeds the L2: the other programs' traffic has evicted it;
  - serial steps per program: its load instructions, one after another (no pipelining between
    dependent loop steps), and the waves of programs;
  - bytes in flight per SM: resident CTAs per SM x executed bytes per load instruction;
  - predicted time = DRAM bytes / COPY_BANDWIDTH + waves x steps per program x STEP_LATENCY: the
    bytes, plus the serial round trips of the programs that too few bytes in flight per SM leave
    unhidden (Little's law); "bound" names the larger of the two.
Every load counts as a round trip, also the loads of a software-pipelined loop ("async" in the
table's loop loads, from the compiled TTGIR), which are issued stages ahead: no GPU time of a
pipelined loop of ours has been measured to fit what that hides, so for those kernels the
latency term is an upper bound.
The machine is the H200 of the calibration (132 SMs, 50 MB of L2, sm_90), or with --machine cuda
the visible GPU's SMs, L2 and compute capability, compiled with this machine's triton: the benchmark
(python -m benchmarks.kernels) then scales each prediction's DRAM term to the copy it measures there.
COPY_BANDWIDTH is the copy measured on the H200; STEP_LATENCY the one free parameter, fitted
(least squares on log time) to the GPU times of docs/benchmarks.md, each kept with the CPU profile
of the kernel that ran and the copy bandwidth of its GPU (calibration.json: the kernels before
pre_backward was split up, and every GPU check added since with --add_calibration, whose profiles
come from this tool's --json run on that machine), against which the tool prints every prediction,
with the rank-order agreement. Exit code 2 without triton, ptxas or
cuobjdump, or with TRITON_INTERPRET=1 (compiling needs triton's compiler).
"""

import argparse
import json
import math
import os
import sys
from typing import NamedTuple

from fused import ops

from .launches import connection_launches, jit_specialisation
from .resources import LIMITS, RESIDUALS, STREAM_DTYPES, compile_kernel, exit_unless_compilable
from .tables import fmt, markdown_table

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_BYTES = os.path.join(HERE, "kernel_bytes.json")
# The GPU times the model is fitted to, each with the CPU profile of the kernel that ran (calibration.json's note).
CALIBRATION = os.path.join(HERE, "calibration.json")
M_BATCH, M_TIME = 16, 1024
WIDTH = 768
COPY_BANDWIDTH = 4.1e12  # bytes/s, a device-to-device copy of the streams on the H200 (read + written)


class Machine(NamedTuple):
    """What the model needs of a GPU besides the copy's bandwidth."""
    name: str
    sms: int
    l2_bytes: int
    cc: int  # compute capability, 90 for sm_90


H200 = Machine("H200", sms=132, l2_bytes=50 * 1000 ** 2, cc=90)  # the calibration's; an H100 SXM alike


def this_gpu():
    """The visible GPU as a Machine (its SMs, L2 and compute capability)."""
    import torch
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Machine(props.name, props.multi_processor_count, props.L2_cache_size, 10 * props.major + props.minor)


def dram_bytes_per_token(counts, kernel, resident, l2_bytes=H200.l2_bytes):
    """Unique bytes plus the re-reads the L2 model says miss, per token."""
    misses = sum(b for distance, b in counts["rereads"].get(kernel, {}).items()
                 if 2 ** (int(distance) + 0.5) * resident > l2_bytes)  # the bucket's geometric middle
    return counts["kernels"][kernel] + misses


def programs_of(grid):
    return math.prod(grid)


def profile(counts, kernel, grid, resources, tokens, machine=H200):
    """The model's quantities for one launch: counts (a kernel_bytes.json entry), its grid at M and its
    resources compiled for the machine; the time is left to predict() (it needs STEP_LATENCY)."""
    programs = programs_of(grid)
    slots = resources["ctas_per_sm"] * machine.sms
    resident = min(programs, slots)
    loads = counts["loads"][kernel]
    executed = counts["executed"][kernel]
    return dict(kernel=kernel, grid=list(grid), programs=programs, registers=resources["registers"],
                stack_bytes=resources["stack_bytes"] + resources["local_bytes"], num_warps=resources["num_warps"],
                ctas_per_sm=resources["ctas_per_sm"], warps_per_sm=resources["ctas_per_sm"] * resources["num_warps"],
                resident=resident, waves=programs / resident if programs <= slots else programs / slots,
                unique_per_token=counts["kernels"][kernel], executed_per_token=executed,
                dram_per_token=dram_bytes_per_token(counts, kernel, resident, machine.l2_bytes),
                steps_per_program=loads * tokens / programs,
                in_flight_per_sm=min(resources["ctas_per_sm"], programs / machine.sms) * executed / loads,
                tokens=tokens, copy_bandwidth=COPY_BANDWIDTH)


def dram_seconds(p):
    """A profile's DRAM bytes at its copy bandwidth: its time with no latency at all."""
    return p["dram_per_token"] * p["tokens"] / p["copy_bandwidth"]


def predict(p, step_latency):
    """(predicted seconds, what binds it) of a profile: the DRAM bytes at the copy's bandwidth plus
    the serial round trips of the programs that the bytes in flight do not hide; bound "latency"
    when the round trips take longer than the bytes."""
    dram = dram_seconds(p)
    round_trips = max(p["waves"], 1.0) * p["steps_per_program"] * step_latency
    return dram + round_trips, ("latency" if round_trips > dram else "DRAM")


def fit_step_latency(pairs):
    """The STEP_LATENCY minimising the squared log error of predicted against measured times over
    pairs [(profile, measured seconds)], by a scan (the model is piecewise in it)."""
    candidates = [1e-9 * 1.02 ** k for k in range(400)]  # 1 ns to 2.7 us

    def error(latency):
        return sum(math.log(predict(p, latency)[0] / measured) ** 2 for p, measured in pairs)

    return min(candidates, key=error)


def spearman(xs, ys):
    rank = lambda v: {i: r for r, i in enumerate(sorted(range(len(v)), key=v.__getitem__))}  # noqa: E731
    rx, ry = rank(xs), rank(ys)
    n = len(xs)
    return 1 - 6 * sum((rx[i] - ry[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def m_launches(residual, stream_dtype):
    """The launches of one connection's forward + backward at M, recorded without running."""
    return connection_launches(residual, stream_dtype, True, WIDTH, M_BATCH, M_TIME, "cpu", run=False)


def compiled(launch, compilations, cc=H200.cc):
    """sm_<cc> resources of a recorded launch, each distinct compilation once."""
    specialisation = jit_specialisation(ops.kernel(launch.kernel), launch.args, launch.constexprs)
    key = json.dumps([launch.kernel, [sorted(map(list, d.items())) for d in specialisation]], default=str)
    if key not in compilations:
        resources = compile_kernel(launch.kernel, specialisation, cc)
        if "error" in resources:
            raise RuntimeError(f"{launch.kernel} failed to compile: {resources['error']}")
        if resources["ctas_per_sm"] == 0:
            raise RuntimeError(f"{launch.kernel} at its tile fits no CTA on an SM of sm_{cc} ({resources['registers']} "
                               f"registers per thread, {resources['shared_bytes'] / 1024:.1f} KB of shared memory)")
        compilations[key] = resources
    return compilations[key]


def model(residuals=RESIDUALS, stream_dtypes=STREAM_DTYPES, kernel_bytes=KERNEL_BYTES, calibration=CALIBRATION,
          machine=H200):
    """{"profiles": [profile per residual, stream dtype and kernel launch on the machine], "calibration":
    [measured times with their profiles], "step_latency": fitted seconds} (times not yet predicted)."""
    import triton  # compile_kernel needs it too; imported here so that at_copy_bandwidth's users need not
    with open(kernel_bytes, encoding="utf-8") as f:
        counts = json.load(f)
    with open(calibration, encoding="utf-8") as f:
        calibration_data = json.load(f)
    rows = calibration_data["rows"]
    tokens = M_BATCH * M_TIME
    compilations, profiles = {}, []
    for residual in residuals:
        for stream_dtype in stream_dtypes:
            for launch in m_launches(residual, stream_dtype):
                resources = compiled(launch, compilations, machine.cc)
                p = profile(counts[residual][stream_dtype], launch.kernel, launch.grid, resources, tokens, machine)
                profiles.append(dict(p, residual=residual, stream_dtype=stream_dtype, phase=launch.phase,
                                     plain_loop_loads=resources["plain_loop_loads"],
                                     async_loop_loads=resources["async_loop_loads"]))
    step_latency = fit_step_latency([(r["profile"], 1e-6 * r["us"]) for r in rows])
    return dict(profiles=profiles, calibration=rows, steps=calibration_data["steps"], step_latency=step_latency,
                compilations=len(compilations), machine=machine._asdict(), triton=triton.__version__)


def with_predictions(result):
    for p in [*result["profiles"], *(r["profile"] for r in result["calibration"])]:
        seconds, bound = predict(p, result["step_latency"])
        p.update(predicted_us=1e6 * seconds, dram_us=1e6 * dram_seconds(p), bound=bound)
    measured = [r["us"] for r in result["calibration"]]
    predicted = [r["profile"]["predicted_us"] for r in result["calibration"]]
    ratios = [p / m for p, m in zip(predicted, measured)]
    result["step_predictions"] = step_predictions(result)
    result["agreement"] = dict(spearman=spearman(predicted, measured), ratio_min=min(ratios),
                               ratio_max=max(ratios),
                               ratio_geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)))
    return result


def predicted_times(result):
    """{"kernels": {residual: {stream dtype: {kernel: {"us": predicted us at M, "dram_us": its DRAM
    term}}}}, the machine, the copy bandwidth the DRAM terms assume, the step latency and triton's
    version}: what python -m benchmarks.kernels prints beside its times."""
    times = {}
    for p in result["profiles"]:
        times.setdefault(p["residual"], {}).setdefault(p["stream_dtype"], {})[p["kernel"]] = dict(
            us=round(p["predicted_us"], 1), dram_us=round(p["dram_us"], 1))
    return dict(kernels=times, machine=result["machine"], copy_bandwidth=COPY_BANDWIDTH,
                step_latency_ns=round(1e9 * result["step_latency"], 1), triton=result["triton"])


def at_copy_bandwidth(prediction, assumed_bandwidth, bandwidth):
    """A predicted_times entry's us with its DRAM term moved from the assumed copy bandwidth to another
    (the copy measured on the GPU at hand); the round trips stay."""
    return prediction["us"] + prediction["dram_us"] * (assumed_bandwidth / bandwidth - 1)


def step_predictions(result):
    """mhclite's fused training step at M per stream dtype: the measured fused step with the measured
    connection kernels of the calibration (the kernels then) replaced by the predicted ones of now;
    and, as the least the kernels' bytes allow, by their DRAM bytes alone at COPY_BANDWIDTH."""
    steps, predictions = result["steps"], []
    for stream_dtype, fused_ms in steps["fused_ms"].items():
        then = sum(r["us"] for r in result["calibration"]
                   if r["run"] == steps["run"] and r["stream_dtype"] == stream_dtype and "tile" not in r)
        now = [p for p in result["profiles"] if p["residual"] == "mhclite" and p["stream_dtype"] == stream_dtype]
        predicted = sum(p["predicted_us"] for p in now)
        at_dram = sum(1e6 * dram_seconds(p) for p in now)
        step_ms = fused_ms + steps["connections_per_step"] * (predicted - then) / 1000
        step_ms_at_dram = fused_ms + steps["connections_per_step"] * (at_dram - then) / 1000
        predictions.append(dict(stream_dtype=stream_dtype, connection_us_then=then, connection_us_predicted=predicted,
                                step_ms_then=fused_ms, step_ms_predicted=step_ms,
                                x_res=step_ms / steps["res_ms"], x_reference=step_ms / steps["reference_ms"],
                                connection_us_at_dram=at_dram, step_ms_at_dram=step_ms_at_dram,
                                x_res_at_dram=step_ms_at_dram / steps["res_ms"]))
    return predictions


def steps_table(predictions):
    rows = [[p["stream_dtype"], fmt(p["connection_us_then"], ",.0f"), fmt(p["connection_us_predicted"], ",.0f"),
             fmt(p["step_ms_then"], ".1f"), fmt(p["step_ms_predicted"], ".1f"), fmt(p["x_res"], ".2f"),
             fmt(p["x_reference"], ".2f"), fmt(p["connection_us_at_dram"], ",.0f"), fmt(p["step_ms_at_dram"], ".1f"),
             fmt(p["x_res_at_dram"], ".2f")] for p in predictions]
    return markdown_table(["streams", "connection kernels us, measured then", "predicted now",
                           "fused step ms, measured then", "predicted now", "x res", "x reference path",
                           "connection us at DRAM bytes alone", "step ms", "x res"], rows)


def profiles_table(profiles):
    kb = lambda b: fmt(b / 1000, ".1f")  # noqa: E731
    rows = [[p["residual"], p["stream_dtype"], p["kernel"].removesuffix("_kernel"), str(p["programs"]),
             f"{p['registers']}, {p['stack_bytes']}", f"{p['ctas_per_sm']} / {p['warps_per_sm']}",
             kb(p["unique_per_token"]), kb(p["executed_per_token"]), kb(p["dram_per_token"]),
             fmt(p["steps_per_program"], ",.0f"), f"{p['plain_loop_loads']}, {p['async_loop_loads']}",
             kb(p["in_flight_per_sm"]), fmt(p["predicted_us"], ",.1f"), p["bound"]] for p in profiles]
    return markdown_table(["residual", "streams", "kernel", "programs", "regs, stack B", "CTAs / warps per SM",
                           "unique KB/token", "executed KB/token", "DRAM KB/token", "steps/program",
                           "loop loads plain, async", "in flight KB/SM", "predicted us", "bound"], rows)


def calibration_table(calibration):
    rows = []
    for r in calibration:
        p = r["profile"]
        tile = r.get("tile")
        setting = f"{', '.join(map(str, tile))}; {p['programs']}" if tile else f"then shipped; {p['programs']}"
        rows.append([r["run"], r["residual"], r["kernel"].removesuffix("_kernel"), r["stream_dtype"],
                     setting, fmt(r["us"], ",.1f"), fmt(p["predicted_us"], ",.1f"),
                     fmt(p["predicted_us"] / r["us"], ".2f"), p["bound"]])
    return markdown_table(["run", "variant", "kernel", "streams", "tile; programs", "measured us", "predicted us",
                           "predicted / measured", "bound"], rows)


class CalibrationError(Exception):
    pass


def measured_rows(kernels, profiles, run):
    """Calibration rows from a GPU check's folder: the times of benchmarks.kernels' JSON (`kernels`,
    at M) with the profiles fused.tools.latency made on the same machine (`profiles`, its --json),
    each profile's DRAM term at the copy measured beside the kernels."""
    timed = kernels["kernels"]
    at_m = timed["tokens"] == M_BATCH * M_TIME and timed["width"] == WIDTH and timed["autocast"] == "bfloat16"
    if timed["dry_run"] or not at_m:
        raise CalibrationError(f"the kernels were not timed on a GPU at M ({M_BATCH} x {M_TIME} tokens, C = {WIDTH}, "
                               "bf16 autocast)")
    by_launch = {(p["residual"], p["stream_dtype"], p["kernel"]): p for p in profiles}
    rows = []
    for row in timed["rows"]:
        p = by_launch.get((row["residual"], row["stream_dtype"], row["kernel"]))
        if p is None or row["launches"] != 1:
            raise CalibrationError(f"no profile of one {row['residual']} {row['stream_dtype']} {row['kernel']} launch")
        copy = 1e9 * timed["copies"][row["stream_dtype"]]["gb_per_s"]
        rows.append(dict(kernel=row["kernel"], stream_dtype=row["stream_dtype"], residual=row["residual"],
                         us=1000 * row["ms"], run=run, profile=dict(p, copy_bandwidth=copy)))
    return rows


def add_calibration(folder, calibration=CALIBRATION):
    """Adds (or replaces) the run in a GPU check's folder (kernels.json and latency.json) to the
    calibration file; returns (run, rows added)."""
    try:
        with open(os.path.join(folder, "kernels.json"), encoding="utf-8") as f:
            kernels = json.load(f)
        with open(os.path.join(folder, "latency.json"), encoding="utf-8") as f:
            predicted = json.load(f)
        with open(calibration, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CalibrationError(str(e)) from None
    run = f"{kernels['device_name']}, {kernels['date'][:10]}, triton {predicted['triton']}"
    rows = measured_rows(kernels, predicted["profiles"], run)
    if predicted["machine"]["name"] != kernels["device_name"]:
        raise CalibrationError(f"latency.json models {predicted['machine']['name']}, the kernels ran on "
                               f"{kernels['device_name']}: run it with --machine cuda there")
    data["rows"] = [r for r in data["rows"] if r["run"] != run] + rows
    with open(calibration, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return run, len(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every profile and the calibration here")
    parser.add_argument("--kernel_bytes", default=KERNEL_BYTES)
    parser.add_argument("--calibration", default=CALIBRATION)
    parser.add_argument("--machine", choices=("h200", "cuda"), default="h200",
                        help="the H200 of the calibration, or the visible GPU's SMs, L2 and compute capability")
    parser.add_argument("--predictions", help="also write the predicted times per kernel here "
                        "(python -m benchmarks.kernels --predicted_times reads them)")
    parser.add_argument("--add_calibration", metavar="OUT", help="first add the kernel times of the GPU check in OUT "
                        "(its kernels.json and latency.json) to the calibration file, with the profiles made there")
    args = parser.parse_args(argv)
    if args.add_calibration:
        try:
            run, added = add_calibration(args.add_calibration, args.calibration)
        except CalibrationError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(f"{args.calibration}: {added} times of {run}\n")
    exit_unless_compilable()
    if args.machine == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("error: --machine cuda needs a visible GPU", file=sys.stderr)
            sys.exit(2)
    machine = this_gpu() if args.machine == "cuda" else H200
    if machine.cc not in LIMITS:
        print(f"error: {machine.name} is sm_{machine.cc}; the model knows the SM limits of sm_"
              f"{' and sm_'.join(map(str, LIMITS))}", file=sys.stderr)
        sys.exit(2)
    try:
        result = with_predictions(model(kernel_bytes=args.kernel_bytes, calibration=args.calibration, machine=machine))
    except RuntimeError as e:  # a kernel that does not compile, or fits no CTA
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    a = result["agreement"]
    print(f"Predicted per launch at M ({M_BATCH * M_TIME:,} tokens, C = {WIDTH}, bf16 autocast) on {machine.name}, "
          f"sm_{machine.cc} ({machine.sms} SMs, L2 {machine.l2_bytes / 1e6:.0f} MB, copy "
          f"{COPY_BANDWIDTH / 1e12:.1f} TB/s); fitted step latency {1e9 * result['step_latency']:.0f} ns\n")
    print(profiles_table(result["profiles"]))
    runs = len({r["run"] for r in result["calibration"]})
    print(f"\nCalibration, {len(result['calibration'])} GPU times of {runs} run(s): rank correlation "
          f"{a['spearman']:.2f}, predicted / measured {a['ratio_min']:.2f} to {a['ratio_max']:.2f} (geometric mean "
          f"{a['ratio_geomean']:.2f})\n")
    print(calibration_table(result["calibration"]))
    print("\nmhclite's fused step at M: the measured step with its connection kernels' measured times replaced by "
          "the predicted ones, and by their DRAM bytes at the copy's bandwidth alone (no latency)\n")
    print(steps_table(result["step_predictions"]))
    if args.predictions:
        with open(args.predictions, "w", encoding="utf-8") as f:
            json.dump(predicted_times(result), f, indent=1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
