"""The step benchmark: training steps of the residual variants (res, hc, mhc, mhclite) side by side.
Its command is the top-level bench.py:

    python bench.py --size tiny --device cpu
    python bench.py --size M        # on a GPU: cuda, bf16, compiled, 16 x 1024, with and without recompute
    python bench.py --size tiny --device cpu --n_sweep 4,6,8 --k_sweep 8,32,128   # mhclite (K perms) vs mhc per n
    python bench.py --size tiny --device cpu --compile on --compile_mode both     # whole model vs block by block
    python bench.py --size S --device cpu --activation_checkpointing both         # what checkpointing costs and saves
    python bench.py --size M --recompute off --fused_connections both --stream_dtype both   # every connection path
    python bench.py --size M --residuals res,mhclite --recompute off --cuda_graphs both    # with CUDA graphs

Every variant lives in this one process. Round r runs one training step (train.py's) of every
variant in an order rotated by r, and a variant's ratio is the median over rounds of its step time
over its baseline's in the same round, so that drifts of a busy machine hit all variants alike.
Every variant starts from the same seeded weights and takes the same batches in the same order, so
the JSON's per-step losses of two ways to run one variant can be compared step by step.
The columns and how each is measured: docs/benchmarks.md. Markdown to stdout, JSON to --json.
"""

import argparse
import gc
import math
import os
import statistics
import sys

import torch
from tqdm import tqdm

from devices import autocast_context, peak_flops, synchronize
from model import STREAM_DTYPES, GPTConfig
from config import COMPILE_MODES, DEFAULT_COMPILE_MODE
from parallelize import apply_ac, compile_model, connection_path
from residuals import RESIDUALS

from .common import (BLOCKS_SUFFIX, NUM_BATCHES, SHARED_FLAGS, BenchError, Variant, build_models, environment, fmt,
                     interleaved_times, kernels_where_asked, main_variants, make_optimizer, markdown_table,
                     random_batches, ratio, resolve_shared_flags, same_mode_baselines, summarise, train_step,
                     with_compile_modes, write_json)

AC_SUFFIX = "+ac"  # the variant with activation checkpointing (parallelize.apply_ac)
GRAPHS_SUFFIX = "+graphs"  # the variant compiled with inductor's CUDA graphs
# What torch.compile(mode="reduce-overhead") sets; as an inductor option it leaves compile_model's own.
CUDA_GRAPHS_OPTIONS = {"triton.cudagraphs": True}
# With "both", the HC family's rows with the kernels or bf16 streams carry these suffixes.
PATH_FLAGS = {"--fused_connections": "+fused", "--stream_dtype": "+bf16"}
MEMORY_STEPS = 2  # steps measured for a variant's peak memory, after one warm-up step
MEMORY_BUDGET_FRACTION = 0.85  # of the free GPU memory, for the variants timed side by side
# Flags that moved out of bench.py, and the command that has them now.
MOVED_FLAGS = {"--compile_time": "python -m benchmarks.compile_time",
               "--compile_probe": "python -m benchmarks.compile_time",
               "--micro": "python -m benchmarks.micro", "--no-micro": "python -m benchmarks.micro"}


# ----------------------------------------------------------------------------------------------
# Variants


def sweep_variants(n_values, k_values, recompute, shape, block_size, vocab_size, fused_connections=False,
                   **hc_options):
    """({name: Variant}, {name: baseline}) for the n/K sweep: mhc with n streams, then mhclite with
    each K <= n! (plus all n! permutations for n <= 5), each compared to that mhc."""
    variants, baselines = {}, {}
    for n in n_values:
        common = dict(block_size=block_size, vocab_size=vocab_size, n_streams=n, **hc_options, **shape)
        running = dict(recompute_connections=recompute == "on", fused_connections=fused_connections)
        baseline = f"mhc n={n}"
        variants[baseline] = Variant(GPTConfig(residual="mhc", **common), **running)
        budgets = [k for k in k_values if k <= math.factorial(n)] + ([None] if n <= 5 else [])
        if not budgets:
            raise BenchError(f"no mhclite permutation budget K <= {n}! = {math.factorial(n)} in --k_sweep "
                             f"{','.join(map(str, k_values))}")
        for k in dict.fromkeys(None if k == math.factorial(n) else k for k in budgets):  # K = n! is "all"
            variants[f"mhclite n={n} K={k or math.factorial(n)}"] = Variant(
                GPTConfig(residual="mhclite", mhclite_perms=k, **common), **running)
        baselines.update({name: baseline for name in variants if name not in baselines})
    return variants, baselines


class Built:
    """A model, its optimizer and what a step calls (the model or its compiled form), built once."""

    def __init__(self, model, optimizer, runner, cuda_graphs=False):
        self.model, self.optimizer, self.runner, self.cuda_graphs = model, optimizer, runner, cuda_graphs

    def step(self, x, y, ctx):
        """One training step; its loss as a float."""
        if self.cuda_graphs:  # a new iteration: the graphs may reuse the last step's outputs' memory
            torch.compiler.cudagraph_mark_step_begin()
        return train_step(self.runner, self.optimizer, x, y, ctx).item()

    def to(self, device):
        """Weights and optimizer state to device (the compiled code stays valid for its device)."""
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    state[key] = value.to(device)


def path_variants(args, **common):
    """{name: Variant} of main_variants on each connection path asked for: --fused_connections both
    and --stream_dtype both add a "+fused" and a "+bf16" (streams) row per HC-family variant of
    --path_rows."""
    fused = [False, True] if args.fused_connections == "both" else [args.fused_connections == "on"]
    stream_dtypes = list(STREAM_DTYPES) if args.stream_dtype == "both" else [args.stream_dtype]
    configs = {}
    for fused_connections in fused:
        for stream_dtype in stream_dtypes:
            suffix = ((PATH_FLAGS["--fused_connections"] if fused_connections and len(fused) > 1 else "")
                      + (PATH_FLAGS["--stream_dtype"] if stream_dtype == "bfloat16" and len(stream_dtypes) > 1 else ""))
            residuals = [r for r in args.residual_list if not suffix or r in args.path_rows]
            for name, variant in main_variants(residuals, args.recompute, stream_dtype=stream_dtype,
                                               fused_connections=fused_connections, **common).items():
                configs.setdefault(name if variant.config.residual == "res" else name + suffix, variant)
    return configs


def with_setting(configs, setting, suffix):
    """({name: Variant}, names run with an on/off setting of how they run): "on" for every variant,
    "both" adds "<name><suffix>" next to each (AC_SUFFIX: activation checkpointing, GRAPHS_SUFFIX:
    CUDA graphs)."""
    if setting == "off":
        return configs, set()
    if setting == "on":
        return configs, set(configs)
    named = {}
    for name, config in configs.items():
        named[name], named[name + suffix] = config, config
    return named, {name for name in named if name.endswith(suffix)}


def same_kind_baselines(names, baseline):
    """{name: the baseline run the same way}: res, with "+ac", "+graphs" and "/blocks" where the row
    has them."""
    bases = same_mode_baselines(names, baseline)
    return {name: base.replace(baseline, baseline + "".join(s for s in (AC_SUFFIX, GRAPHS_SUFFIX) if s in name), 1)
            for name, base in bases.items()}


# ----------------------------------------------------------------------------------------------
# Measurements


def saved_activation_bytes(model, x, y, ctx):
    """Bytes of the unique storages autograd saves for backward in one forward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage  # alive until counted, so no address is reused
        # The graph keeps nothing: had it kept its own outputs here, it would sit in a reference
        # cycle through autograd's C++ nodes that Python's collector cannot see, never freed.

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: None), ctx:
        model(x, y)  # forward only: nothing is unpacked
    return sum(storage.nbytes() for storage in storages.values())


def state_bytes(model, optimizer):
    """Bytes of the weights and the optimizer state that a model keeps between steps."""
    tensors = list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values()
                                          if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def blocks_and_whole(summary):
    """(variant, its whole-model row, its "/blocks" row) for every variant compiled both ways."""
    return [(name[:-len(BLOCKS_SUFFIX)], summary[name[:-len(BLOCKS_SUFFIX)]], row) for name, row in summary.items()
            if name.endswith(BLOCKS_SUFFIX) and name[:-len(BLOCKS_SUFFIX)] in summary]


def add_blocks_over_model(summary):
    """blocks_over_model on each "/blocks" row: the median per-round ratio of its step time to the
    whole-model compile's (the ratio of the medians where the two were timed in different groups)."""
    for _, whole, row in blocks_and_whole(summary):
        if whole["timing_group"] == row["timing_group"]:
            row["blocks_over_model"] = statistics.median(b / m for b, m in zip(row["step_ms"], whole["step_ms"]))
        else:
            row["blocks_over_model"] = row["median_ms"] / whole["median_ms"]


def measures_memory(device):
    """Whether bench_models measures each variant's peak memory (CUDA's allocator statistics)."""
    return device.type == "cuda"


def step_memory(variant, batches, ctx, device):
    """(state bytes, peak extra bytes of a step) of one variant alone on the GPU: the most a step
    allocates on top of the weights and AdamW state, over MEMORY_STEPS steps after one that compiles."""
    extra = 0
    for i in range(1 + MEMORY_STEPS):
        x, y = batches[i % len(batches)]
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        variant.step(x, y, ctx)
        synchronize(device)
        if i > 0:
            extra = max(extra, torch.cuda.max_memory_allocated(device) - base)
    return state_bytes(variant.model, variant.optimizer), extra


def timing_groups(names, baselines, memory, budget):
    """Variants timed together: all of them when their states plus the largest step fit in the budget,
    else each variant with its baseline, so that every ratio still comes from one interleaved group."""
    def fits(group):
        return sum(memory[n][0] for n in group) + max(memory[n][1] for n in group) <= budget

    if not memory or fits(names):
        return [list(names)]
    groups = []
    for name in names:
        base = baselines.get(name)
        if base == name or base is None:
            continue
        group = [base, name]
        if not fits(group):
            raise BenchError(f"{name} and its baseline {base} do not fit in {budget / 2**30:.1f} GiB together; "
                             f"lower --batch_size")
        groups.append(group)
    return groups or [list(names)]


def to_host(variants, device):
    """Weights and optimizer state of `variants` to host memory, freeing the device's."""
    for variant in variants:
        variant.to(torch.device("cpu"))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_models(configs, baselines, compile_modes, args, device, checkpointed=frozenset(), graphed=frozenset()):
    """Time, tokens/s, MFU, memory and per-step losses of every variant, built and compiled once
    (with CUDA graphs for the names in graphed). On CUDA each variant's memory is measured alone
    first; the timing then runs in as few groups as fit on the GPU."""
    measure = measures_memory(device)
    batches = random_batches(NUM_BATCHES, args.batch_size, args.block_size, args.vocab_size, args.seed, device)
    ctx = autocast_context(args, device)[1]
    variants, memory = {}, {}
    for name in tqdm(configs, desc="build" + (", memory one variant at a time" if measure else ""), leave=False):
        model = build_models({name: configs[name]}, args.seed, device)[name]
        if name in checkpointed:
            apply_ac(model)
        options = {"options": dict(CUDA_GRAPHS_OPTIONS)} if name in graphed else {}
        runner = compile_model(model, compile_modes[name], **options) if args.use_compile else model
        variants[name] = Built(model, make_optimizer(model, device), runner, cuda_graphs=name in graphed)
        if measure:
            memory[name] = step_memory(variants[name], batches, ctx, device)
            to_host([variants[name]], device)
    budget = MEMORY_BUDGET_FRACTION * torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else math.inf
    groups = timing_groups(list(configs), baselines, memory, budget)
    tokens_per_step = args.batch_size * args.block_size
    summary, losses = {}, {}
    for index, group in enumerate(groups):
        for name in group:
            variants[name].to(device)

        def step_of(name):
            losses[name] = []  # anew per group: a baseline timed again keeps its first group's row

            def step(r):
                losses[name].append(variants[name].step(*batches[r % len(batches)], ctx))
            return step

        desc = "train steps" + (f", group {index + 1}/{len(groups)}" if len(groups) > 1 else "")
        times = interleaved_times({name: step_of(name) for name in group}, args.warmup + args.steps,
                                  args.warmup, device, desc)
        for name, row in summarise(times, baselines).items():
            if name in summary:
                continue  # a baseline timed again in a later group keeps its first row
            model, variant, seconds = variants[name].model, configs[name], row["median_ms"] / 1000
            config = variant.config
            row.update(residual=config.residual, n_streams=config.n_streams, mhclite_perms=config.mhclite_perms,
                       recompute=variant.recompute_connections, stream_dtype=config.stream_dtype,
                       fused_connections=variant.fused_connections, compile_mode=compile_modes[name],
                       activation_checkpointing=name in checkpointed, cuda_graphs=name in graphed,
                       params=model.get_num_params(), timing_group=index, tokens_per_s=tokens_per_step / seconds,
                       mfu=model.estimate_mfu(tokens_per_step, seconds, args.peak) if args.peak else None,
                       saved_activation_bytes=saved_activation_bytes(model, *batches[0], ctx),
                       cuda_peak_bytes=sum(memory[name]) if measure else None,
                       connections=connection_path(model, device, variant.fused_connections),
                       losses=losses[name])
            summary[name] = row
        if measure:
            to_host([variants[name] for name in group], device)
    summary = {name: summary[name] for name in configs}
    for name, row in summary.items():
        base = summary.get(baselines.get(name), {})
        row["activation_ratio"] = ratio(row["saved_activation_bytes"], base.get("saved_activation_bytes"))
        row["cuda_peak_ratio"] = ratio(row["cuda_peak_bytes"], base.get("cuda_peak_bytes"))
    return summary


# ----------------------------------------------------------------------------------------------
# Output


def model_table(summary, baseline_label, cuda):
    header = ["variant", "params M", "ms", "IQR ms", "tokens/s", "MFU", f"x {baseline_label}",
              "act MB", f"act x {baseline_label}"] + (["peak MB", f"peak x {baseline_label}"] if cuda else [])
    rows = []
    for name, r in summary.items():
        row = [name, fmt(r["params"] / 1e6, ".2f"), fmt(r["median_ms"], ".1f"), fmt(r["iqr_ms"], ".1f"),
               fmt(r["tokens_per_s"], ",.0f"), fmt(r["mfu"], ".1%"), fmt(r["time_ratio"], ".3f"),
               fmt(r["saved_activation_bytes"] / 2**20, ".1f"), fmt(r["activation_ratio"], ".3f")]
        if cuda:
            row += [fmt(r["cuda_peak_bytes"] / 2**20, ".0f"), fmt(r["cuda_peak_ratio"], ".3f")]
        rows.append(row)
    return markdown_table(header, rows)


def connections_line(summary):
    """Which code ran each variant's connections: fused kernels or residuals.py, and why."""
    return "connections: " + "; ".join(f"{name} {r['connections']['path']} ({r['connections']['why']})"
                                       for name, r in summary.items())


def checkpointing_table(summary):
    """Each variant with activation checkpointing against itself without: step time (median of the
    per-round ratios) and saved activations."""
    rows = []
    for name, row in summary.items():
        plain = summary.get(name.replace(AC_SUFFIX, "", 1)) if AC_SUFFIX in name else None
        if plain is None:
            continue
        same_round = plain["timing_group"] == row["timing_group"]
        time_ratio = (statistics.median(a / b for a, b in zip(row["step_ms"], plain["step_ms"])) if same_round
                      else row["median_ms"] / plain["median_ms"])
        rows.append([name, fmt(plain["median_ms"], ".1f"), fmt(row["median_ms"], ".1f"), fmt(time_ratio, ".3f"),
                     fmt(plain["saved_activation_bytes"] / 2**20, ".1f"), fmt(row["saved_activation_bytes"] / 2**20, ".1f"),
                     fmt(ratio(row["saved_activation_bytes"], plain["saved_activation_bytes"]), ".3f")])
    return markdown_table(["variant", "without ms", "with ms", "time x without", "act MB without", "act MB with",
                           "act x without"], rows)


def blocks_table(summary):
    """Compiled step time by blocks against the whole-model compile of the same variant."""
    rows = [[name, fmt(whole["median_ms"], ".1f"), fmt(row["median_ms"], ".1f"), fmt(row["blocks_over_model"], ".3f")]
            for name, whole, row in blocks_and_whole(summary)]
    return markdown_table(["variant", "whole model ms", "blocks ms", "blocks / whole model"], rows)


# ----------------------------------------------------------------------------------------------
# Command line


def int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got '{text}'")
    return values


def parse_args(argv):
    moved = next((flag.split("=")[0] for flag in argv if flag.split("=")[0] in MOVED_FLAGS), None)
    if moved:
        raise BenchError(f"{moved} moved out of bench.py: use {MOVED_FLAGS[moved]}")
    parser = argparse.ArgumentParser(description="Side-by-side benchmark of res, hc, mhc and mhclite.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag, options in SHARED_FLAGS.items():
        if flag in PATH_FLAGS:  # the paths side by side
            options = dict(options, choices=[*options["choices"], "both"], help=f"{options['help']}; both: a row each")
        parser.add_argument(flag, **options)
    parser.add_argument("--compile", default="auto", nargs="?", const="on", choices=["auto", "on", "off"],
                        help="torch.compile every model; auto: on for cuda, off on cpu")
    parser.add_argument("--compile_mode", default=DEFAULT_COMPILE_MODE, choices=[*COMPILE_MODES, "both"],
                        help="what torch.compile compiles: the whole model, or each transformer block and the head "
                             "(regional: one compiled block serves every layer); both: a row for each")
    parser.add_argument("--activation_checkpointing", default="off", choices=["off", "on", "both"],
                        help="recompute each block in backward (train.py's --activation_checkpointing); both: a "
                             "'+ac' row next to each variant")
    parser.add_argument("--cuda_graphs", default="off", choices=["off", "on", "both"],
                        help="compile with inductor's CUDA graphs (torch.compile's reduce-overhead): a step replays "
                             "its recorded kernel launches; both: a '+graphs' row next to each variant, against res "
                             "with CUDA graphs (on CPU, inductor compiles without them)")
    parser.add_argument("--path_rows", default="hc,mhc,mhclite",
                        help="the variants that get a row per connection path with --fused_connections both or "
                             "--stream_dtype both (the others: one row, on the first path)")
    parser.add_argument("--n_sweep", type=int_list, help="stream counts n: mhclite vs mhc per n (e.g. 4,6,8)")
    parser.add_argument("--k_sweep", type=int_list, default=[8, 32, 128],
                        help="mhclite permutation budgets K for --n_sweep (K <= n!; all n! added for n <= 5)")
    parser.add_argument("--peak_flops", type=float, help="peak FLOP/s for MFU (default: by GPU name)")
    parser.add_argument("--json", help="output path (default out/bench/<size>-<device>-<dtype>[-compiled][-sweep].json)")
    return parser.parse_args(argv)


def resolve(args):
    """Checks the settings and fills in the derived ones (or raises BenchError)."""
    resolve_shared_flags(args)
    args.use_compile = args.compile == "on" or (args.compile == "auto" and args.device_type == "cuda")
    args.path_rows = [r.strip() for r in args.path_rows.split(",") if r.strip()]
    unknown = [r for r in args.path_rows if r not in RESIDUALS]
    if unknown:
        raise BenchError(f"unknown residual '{unknown[0]}' in --path_rows; valid: {', '.join(RESIDUALS)}")
    args.compile_modes = list(COMPILE_MODES) if args.compile_mode == "both" else [args.compile_mode]
    if args.compile_mode == "both" and args.n_sweep:
        raise BenchError("--compile_mode both compares the --residuals variants; run it without --n_sweep")
    if "both" in (args.fused_connections, args.stream_dtype) and args.n_sweep:
        raise BenchError("--fused_connections both and --stream_dtype both compare the --residuals variants; "
                         "run them without --n_sweep")
    if args.activation_checkpointing != "off" and args.n_sweep:
        raise BenchError("--activation_checkpointing compares the --residuals variants; run it without --n_sweep")
    if args.cuda_graphs != "off" and (args.n_sweep or not args.use_compile):
        raise BenchError("--cuda_graphs compares the --residuals variants compiled: run it with --compile on (the "
                         "default on cuda) and without --n_sweep")
    args.peak = peak_flops(args, torch.device(args.device_type), args.dtype)
    if args.json is None:
        suffix = ("-compiled" if args.use_compile else "") + ("-sweep" if args.n_sweep else "")
        args.json = os.path.join("out", "bench", f"{args.size}-{args.device_type}-{args.dtype}{suffix}.json")
    return args


def run(args, argv):
    device, cuda = torch.device(args.device_type), args.device_type == "cuda"
    common = dict(shape=args.shape, block_size=args.block_size, vocab_size=args.vocab_size)
    result = environment(argv, device, "bench.py")
    result["settings"] = dict(size=args.size, **args.shape, batch_size=args.batch_size, block_size=args.block_size,
                              tokens_per_step=args.batch_size * args.block_size, dtype=args.dtype,
                              compile=args.use_compile, compile_mode=args.compile_mode, steps=args.steps,
                              warmup=args.warmup, recompute=args.recompute, stream_dtype=args.stream_dtype,
                              activation_checkpointing=args.activation_checkpointing,
                              cuda_graphs=args.cuda_graphs, fused_connections=args.fused_connections, vocab_size=args.vocab_size,
                              seed=args.seed, peak_flops=args.peak)
    title = (f"{args.size} ({args.shape['n_layer']}L, {args.shape['n_embd']}d), batch {args.batch_size} x "
             f"{args.block_size}, {args.dtype}, {f'compiled ({args.compile_mode})' if args.use_compile else 'eager'}, "
             f"HC streams {args.stream_dtype}, fused connections {args.fused_connections}, "
             f"{'' if args.cuda_graphs == 'off' else f'CUDA graphs {args.cuda_graphs}, '}"
             f"{result['device_name']}, torch {torch.__version__}, {args.steps} rounds after {args.warmup} warm-up")
    if args.n_sweep:
        configs, baselines = sweep_variants(args.n_sweep, args.k_sweep, args.recompute, stream_dtype=args.stream_dtype,
                                            fused_connections=args.fused_connections == "on", **common)
        modes, checkpointed, graphed = {name: args.compile_mode for name in configs}, set(), set()
        result.update(mode="n_sweep", baseline="mhc with the same n")
        heading, baseline_label = "n/K sweep: mhclite vs mhc", "mhc"
    else:
        configs, checkpointed = with_setting(path_variants(args, **common), args.activation_checkpointing, AC_SUFFIX)
        configs, graphed = with_setting(configs, args.cuda_graphs, GRAPHS_SUFFIX)
        checkpointed = {name for name in configs if name.removesuffix(GRAPHS_SUFFIX) in checkpointed}
        configs, modes = with_compile_modes(configs, args.compile_modes if args.use_compile else COMPILE_MODES[:1])
        checkpointed = {name for name in configs if name.removesuffix(BLOCKS_SUFFIX) in checkpointed}
        graphed = {name for name in configs if name.removesuffix(BLOCKS_SUFFIX) in graphed}
        baselines = same_kind_baselines(configs, "res")
        result.update(mode="variants", baseline="res")
        heading, baseline_label = "Training step", "res"
    result["variants"] = bench_models(configs, baselines, modes, args, device, checkpointed, graphed)
    print(f"## {heading}, {title}\n\n{model_table(result['variants'], baseline_label, cuda)}\n")
    print(connections_line(result["variants"]) + "\n")
    if args.activation_checkpointing == "both":
        print(f"## Activation checkpointing against the same variant without\n\n"
              f"{checkpointing_table(result['variants'])}\n")
    if len(set(modes.values())) > 1:
        add_blocks_over_model(result["variants"])
        print(f"## Compiled block by block against the whole model\n\n{blocks_table(result['variants'])}\n")
    write_json(result, args.json)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = resolve(parse_args(argv))
        with kernels_where_asked(args):
            run(args, argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
