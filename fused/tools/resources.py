"""Registers, stack (local memory), shared memory and resident CTAs per SM of every fused connection
kernel the model launches, compiled for sm_80 and sm_90 on a machine without a GPU.

    python -m fused.tools.resources                    # Markdown table
    python -m fused.tools.resources --json out/kernel_resources.json

For hc, mhc and mhclite (n = 4) at C = 768 and an odd width, with float32 and bfloat16 streams,
under bf16 autocast and in float32, the launches of one forward + backward of a connection are
recorded without running them (launches.py; a 2 x 16 batch: its token count is a multiple of
16 like a training batch's, so every int argument is specialised as at full size). Each launch
becomes the signature, constexprs and tt.divisibility attributes triton's JIT would build
(launches.jit_specialisation) and is compiled with triton.compile for GPUTarget("cuda", cc,
32); ptxas and cuobjdump ship in triton's wheel. `cuobjdump -res-usage` reads registers, stack
bytes (spills go there), local memory and static shared memory from the cubin; the dynamic shared
memory comes from the compiled kernel's metadata; the loads inside loops from its TTGIR: "plain", each a
round trip its loop step waits for, or "async", issued stages ahead by triton's software pipeline
(cp.async into shared memory; the kernels' STAGES, or the default for a loop that feeds tl.dot).
Each distinct compilation runs once.

CTAs/SM is the occupancy limit from registers (65536 per SM in four quarters, allocated per warp in
units of 256), threads (2048), CTAs (32) and shared memory (sm_80: 164 KB per SM, at most 163 KB per
CTA; sm_90: 228 / 227 KB; plus 1 KB the driver reserves per CTA). Exit code 1 if a kernel fails to
compile; 2 if triton, ptxas or cuobjdump is missing, or TRITON_INTERPRET=1 is set.
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings

from fused import TRITON_AVAILABLE, ops

from .launches import connection_launches, jit_specialisation
from .tables import fmt, markdown_table

RESIDUALS = ("hc", "mhc", "mhclite")
STREAM_DTYPES = ("float32", "bfloat16")
WIDTHS = (768, 257)
CCS = (80, 90)
AUTOCASTS = ("bfloat16", "off")  # bf16 autocast (training's default) and float32
BATCH, TIME = 2, 16
LIMITS = {  # per SM, and the most shared memory one CTA may use
    80: dict(registers=65536, threads=2048, ctas=32, shared=164 * 1024, shared_per_cta=163 * 1024),
    90: dict(registers=65536, threads=2048, ctas=32, shared=228 * 1024, shared_per_cta=227 * 1024),
}
RESERVED_SHARED_PER_CTA = 1024
REGISTER_UNIT = 256  # registers are allocated to a warp in units of this many
SM_QUARTERS = 4  # each quarter of an SM holds a quarter of the register file and its own warps
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def missing_tool():
    """Why kernels cannot be compiled here, or None."""
    if not TRITON_AVAILABLE:
        return "triton is not installed"
    import triton
    for tool in ("ptxas", "cuobjdump"):
        try:
            getattr(triton.knobs.nvidia, tool).path
        except (RuntimeError, OSError) as e:  # not found, or not executable
            return f"{tool} not found ({e})"
    return None


def exit_unless_compilable():
    """Exit with one error line where kernels cannot be compiled for a GPU here."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: TRITON_INTERPRET=1 is set; compiling needs triton's compiler: unset it", file=sys.stderr)
        sys.exit(2)
    reason = missing_tool()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        sys.exit(2)


def ctas_per_sm(registers, shared_bytes, num_warps, cc):
    """Resident CTAs per SM allowed by registers, threads, the CTA limit and shared memory."""
    limits = LIMITS[cc]
    if shared_bytes > limits["shared_per_cta"]:
        return 0
    registers_per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps_by_registers = limits["registers"] // SM_QUARTERS // max(registers_per_warp, 1) * SM_QUARTERS
    return min(limits["ctas"], warps_by_registers // num_warps, limits["threads"] // (32 * num_warps),
               limits["shared"] // (shared_bytes + RESERVED_SHARED_PER_CTA))


def cubin_resources(cubin, cuobjdump):
    with tempfile.TemporaryDirectory(prefix="kernel-resources-") as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    registers, stack, shared, local = (int(v) for v in RESOURCES.search(listing).groups())
    return dict(registers=registers, stack_bytes=stack, static_shared_bytes=shared, local_bytes=local)


def compile_kernel(name, specialisation, cc):
    """Resources of kernel `name` compiled for sm_<cc> with a launch's specialisation, or its error."""
    import triton
    from triton.backends.compiler import GPUTarget
    # triton 3.9 warns that fp fusion's default will change; the JIT compiles with the same default
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    signature, constexprs, attrs, options = specialisation
    source = triton.compiler.ASTSource(ops.kernel(name), signature, constexprs, attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(options))
    except Exception as e:  # the compiler's own error types; the last line of the message says what failed
        lines = str(e).strip().splitlines()
        return dict(error=f"{type(e).__name__}: {lines[-1] if lines else ''}")
    result = cubin_resources(compiled.asm["cubin"], triton.knobs.nvidia.cuobjdump.path)
    result.update(loop_loads(compiled.asm["ttgir"]))
    result["shared_bytes"] = compiled.metadata.shared + result["static_shared_bytes"]
    result["num_warps"] = compiled.metadata.num_warps
    result["ctas_per_sm"] = ctas_per_sm(result["registers"], result["shared_bytes"], result["num_warps"], cc)
    return result


def loop_loads(ttgir):
    """Global loads inside the kernel's loops (scf.for bodies) of its TTGIR: "async_loop_loads",
    issued stages ahead by the software pipeline (cp.async into shared memory), and
    "plain_loop_loads", each of which its loop step waits a whole round trip for."""
    counts = dict(async_loop_loads=0, plain_loop_loads=0)
    depth, loop_depths = 0, []  # brace depth; the depth each enclosing loop opened at
    for line in ttgir.splitlines():
        if loop_depths:
            counts["async_loop_loads"] += "ttg.async_copy_global_to_local " in line
            counts["plain_loop_loads"] += " = tt.load " in line
        if " scf.for " in line:
            loop_depths.append(depth)
        depth += line.count("{") - line.count("}")
        while loop_depths and depth <= loop_depths[-1]:
            loop_depths.pop()
    return counts


def compile_key(name, specialisation, cc):
    return (name, cc, *(json.dumps(sorted(map(list, d.items())), default=str) for d in specialisation))


def measure(residuals, stream_dtypes, widths, ccs, jobs, autocasts=AUTOCASTS):
    """One record per recorded launch, with its resources for every cc; each distinct compilation
    runs once, `jobs` at a time in worker processes. Returns (records, compilations)."""
    records, compilations = [], {}
    for residual in residuals:
        for width in widths:
            for stream_dtype in stream_dtypes:
                for autocast in autocasts:
                    for launch in connection_launches(residual, stream_dtype, autocast == "bfloat16", width, BATCH,
                                                      TIME, "cpu", run=False):
                        specialisation = jit_specialisation(ops.kernel(launch.kernel), launch.args,
                                                            launch.constexprs)
                        signature, constexprs, attrs, _ = specialisation
                        keys = {cc: compile_key(launch.kernel, specialisation, cc) for cc in ccs}
                        compilations.update({key: (launch.kernel, specialisation, cc) for cc, key in keys.items()})
                        records.append(dict(
                            kernel=launch.kernel, phase=launch.phase, residual=residual, stream_dtype=stream_dtype,
                            autocast=autocast, width=width, signature=signature,
                            constexprs={name: constexprs[(i,)] for i, name in enumerate(signature) if (i,) in constexprs},
                            divisible=[name for i, name in enumerate(signature) if (i,) in attrs], keys=keys))
    jobs_list = list(compilations.values())
    if jobs > 1:
        context = multiprocessing.get_context("spawn")  # a fresh process: no forked torch or MLIR threads
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            results = list(pool.map(compile_kernel, *zip(*jobs_list)))
    else:
        results = [compile_kernel(*job) for job in jobs_list]
    resources = dict(zip(compilations, results))
    for record in records:
        keys = record.pop("keys")
        record.update({f"sm_{cc}": resources[key] for cc, key in keys.items()})
    return records, len(compilations)


def table(records, ccs):
    """One row per distinct compilation, the variants that launch the same one sharing its row;
    ordered by width, autocast (bf16 first), stream dtype, then launch order."""
    rows = {}
    for index, r in enumerate(records):
        key = (r["kernel"], r["stream_dtype"], r["autocast"], r["width"],
               json.dumps([r["signature"], r["constexprs"], r["divisible"]], default=str))
        rows.setdefault(key, dict(r, residuals=[], index=index))["residuals"].append(r["residual"])
    widths = list(dict.fromkeys(r["width"] for r in records))
    order = {row_key: (widths.index(row["width"]), row["autocast"] != "bfloat16", row["stream_dtype"] != "float32",
                       row["index"]) for row_key, row in rows.items()}
    rows = {key: rows[key] for key in sorted(rows, key=order.get)}
    header = ["kernel", "variants", "streams", "autocast", "C"]
    for cc in ccs:
        header += [f"sm_{cc} regs", "stack B", "shared KB", "CTAs/SM", "loop loads plain, async"]
    lines = []
    for row in rows.values():
        line = [row["kernel"].removesuffix("_kernel"), ", ".join(row["residuals"]),
                row["stream_dtype"], row["autocast"], str(row["width"])]
        for cc in ccs:
            res = row[f"sm_{cc}"]
            if "error" in res:
                line += ["error: " + res["error"], "", "", "", ""]
            else:
                line += [str(res["registers"]), str(res["stack_bytes"] + res["local_bytes"]),
                         fmt(res["shared_bytes"] / 1024, ".1f"), str(res["ctas_per_sm"]),
                         f"{res['plain_loop_loads']}, {res['async_loop_loads']}"]
        lines.append(line)
    return markdown_table(header, lines)


def csv_list(text, cast=str):
    return [cast(v) for v in text.split(",") if v.strip()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every record (one per launch and configuration) here")
    parser.add_argument("--residuals", type=csv_list, default=list(RESIDUALS))
    parser.add_argument("--stream_dtypes", type=csv_list, default=list(STREAM_DTYPES))
    parser.add_argument("--widths", type=lambda t: csv_list(t, int), default=list(WIDTHS))
    parser.add_argument("--ccs", type=lambda t: csv_list(t, int), default=list(CCS), help="compute capabilities")
    parser.add_argument("--autocast", type=csv_list, default=list(AUTOCASTS), help="bfloat16 (autocast), off")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compilations at a time")
    args = parser.parse_args(argv)
    bad = ([f"residual '{r}'" for r in args.residuals if r not in RESIDUALS]
           + [f"stream dtype '{d}'" for d in args.stream_dtypes if d not in STREAM_DTYPES]
           + [f"cc {cc}" for cc in args.ccs if cc not in LIMITS]
           + [f"autocast '{a}'" for a in args.autocast if a not in AUTOCASTS])
    if bad:
        print(f"error: unknown {bad[0]}", file=sys.stderr)
        sys.exit(2)
    exit_unless_compilable()
    import triton
    start = time.perf_counter()
    records, compilations = measure(args.residuals, args.stream_dtypes, args.widths, args.ccs, args.jobs,
                                    args.autocast)
    seconds = time.perf_counter() - start
    print(f"Fused connection kernels compiled for {', '.join(f'sm_{cc}' for cc in args.ccs)} with triton "
          f"{triton.__version__} ({compilations} compilations, {seconds:.0f} s with {args.jobs} jobs); "
          f"stack B = stack + local bytes per thread, shared = dynamic + static\n")
    print(table(records, args.ccs))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(triton=triton.__version__, ccs=args.ccs, compilations=compilations, seconds=seconds,
                           jobs=args.jobs, records=records), f, indent=2, default=str)
        print(f"\nwrote {args.json}")
    failed = sum("error" in r[f"sm_{cc}"] for r in records for cc in args.ccs)
    if failed:
        print(f"error: {failed} launches failed to compile", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
