"""Compile time of each residual variant: cold (a fresh process on empty inductor and Triton caches,
a run's first start), then warm (a second fresh process on the caches the first filled: a resume, or
the next run of a sweep on the same machine).

    python -m benchmarks.compile_time --size tiny --device cpu --recompute off
    python -m benchmarks.compile_time --size tiny --device cpu --compile_mode both --steps 5
    TRITON_INTERPRET=1 python -m benchmarks.compile_time --size tiny --device cpu --fused_connections on ...

A probe takes 1 + --steps compiled training steps of one variant (the step benchmark's train_step, on its
random batches); compile s is the first step minus the median of the others. Markdown to stdout,
JSON to --json (default out/bench/<size>-<device>-<dtype>-compile-time.json).
"""

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

from devices import autocast_context, synchronize
from config import COMPILE_MODES, DEFAULT_COMPILE_MODE
from parallelize import compile_model

from .common import (NUM_BATCHES, BenchError, add_shared_flag, build_models, environment, fmt, kernels_where_asked,
                     main_variants, make_optimizer, markdown_table, random_batches, ratio, resolve_shared_flags,
                     same_mode_baselines, train_step, with_compile_modes, write_json)


def compile_probe(args, name):
    """In this process: (compile s, first step s, compiled step ms, graphs dynamo compiled) of variant `name`."""
    configs, modes = variant_configs(args)
    device = torch.device(args.device_type)
    batches = random_batches(NUM_BATCHES, args.batch_size, args.block_size, args.vocab_size, args.seed, device)
    ctx = autocast_context(args, device)[1]
    times = []
    with kernels_where_asked(args):
        model = build_models({name: configs[name]}, args.seed, device)[name]
        optimizer = make_optimizer(model, device)
        compiled = compile_model(model, modes[name])
        for i in range(1 + args.steps):
            x, y = batches[i % len(batches)]
            synchronize(device)
            start = time.perf_counter()
            train_step(compiled, optimizer, x, y, ctx)
            synchronize(device)
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times[1:])
    return dict(compile_s=times[0] - step_s, first_step_s=times[0], step_ms=1000 * step_s,
                graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def environment_variables(**variables):
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def probe_in_fresh_process(args, name, cache):
    """compile_probe in a new Python process (spawned: no torch state inherited) whose inductor and
    Triton caches are in `cache`."""
    with environment_variables(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton")):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(compile_probe, args, name).result()


def compile_times(args):
    """{variant: cold probe, plus warm_compile_s and warm_first_step_s of the second process}."""
    results = {}
    for name in variant_configs(args)[0]:
        with tempfile.TemporaryDirectory(prefix="compile-time-") as cache:
            cold = probe_in_fresh_process(args, name, cache)
            warm = probe_in_fresh_process(args, name, cache)
        results[name] = dict(cold, warm_compile_s=warm["compile_s"], warm_first_step_s=warm["first_step_s"])
    return results


def variant_configs(args):
    common = dict(shape=args.shape, block_size=args.block_size, vocab_size=args.vocab_size,
                  stream_dtype=args.stream_dtype, fused_connections=args.fused_connections == "on")
    return with_compile_modes(main_variants(args.residual_list, args.recompute, **common), args.compile_modes)


def compile_table(results):
    baselines = same_mode_baselines(results, "res")
    rows = [[name, fmt(r["compile_s"], ".1f"),
             fmt(ratio(r["compile_s"], results.get(baselines[name], {}).get("compile_s")), ".2f"),
             fmt(r["warm_compile_s"], ".1f"), fmt(r["first_step_s"], ".1f"), fmt(r["step_ms"], ".1f"),
             str(r["graphs"])] for name, r in results.items()]
    return markdown_table(["variant", "compile s", "x res", "warm-cache compile s", "first step s",
                           "compiled step ms", "graphs"], rows)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag in ("--size", "--batch_size", "--block_size", "--device", "--dtype", "--residuals", "--recompute",
                 "--stream_dtype", "--fused_connections", "--vocab_size", "--seed"):
        add_shared_flag(parser, flag)
    parser.add_argument("--compile_mode", default=DEFAULT_COMPILE_MODE, choices=[*COMPILE_MODES, "both"],
                        help="what torch.compile compiles; both: a row for each")
    parser.add_argument("--steps", type=int, default=5, help="ordinary compiled steps timed after the first")
    parser.add_argument("--json", help="output path (default out/bench/<size>-<device>-<dtype>-compile-time.json)")
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        resolve_shared_flags(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    args.compile_modes = list(COMPILE_MODES) if args.compile_mode == "both" else [args.compile_mode]
    json_path = args.json or os.path.join("out", "bench", f"{args.size}-{args.device_type}-{args.dtype}-compile-time.json")
    result = dict(environment(argv, torch.device(args.device_type), "-m", "benchmarks.compile_time"),
                  compile_time=compile_times(args))
    print(f"## Compile time: cold (fresh process and inductor cache per variant), then warm (a second "
          f"process on that cache)\n\n{compile_table(result['compile_time'])}\n")
    write_json(result, json_path)


if __name__ == "__main__":
    main()
