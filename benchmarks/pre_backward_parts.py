"""What pre_backward's parts cost: its launch at the shipped settings against other tiles and program
counts, each with and without the in-kernel grad-W partials, and grad W computed instead as one GEMM
over the tokens (grad_z^T x). For deciding how to restructure the kernel, on a GPU.

    python -m benchmarks.pre_backward_parts --json out/pre_backward_parts.json        # on a GPU, at M
    TRITON_INTERPRET=1 python -m benchmarks.pre_backward_parts --device cpu --batch_size 1 --block_size 32 \
        --width 32 --json out/pbp.json                                                 # CPU dry run

mhclite (mhc and hc: --residual), n = 4, under bf16 autocast. The launch is recorded from one
forward + backward of a connection (launches.py); "without partials" is a copy of the kernel,
written to a temporary file, whose partials' load and store sit under a constexpr WEIGHT_GRAD set
False (the partials are only skipped: that variant computes no grad W). Each setting runs on the
recorded arguments, with its own partial buffers, and its grad x and grad W are compared with the
shipped launch's.
"""

import argparse
import importlib.util
import os
import sys
import tempfile

import torch

from fused import kernels, ops
from fused.tools.interpreter import fix_scalar_index
from fused.tools.launches import connection_launches

from .common import environment, fmt, markdown_table, write_json
from .kernels import time_alone

SETTINGS = ((16, 16, 8), (32, 32, 4))  # (BLOCK_T, BLOCK_C, num_warps) besides the shipped one
PROGRAMS = (128, 264)
PARTIALS = """                pair_slice = partial + pair[:, None] * D + depth[None, :]
                pair_slice_ok = pair_ok[:, None] & channel_ok[None, :]
                acc = tl.load(pair_slice, mask=later_block(pair_slice_ok, block, program), other=0.0)
                tl.store(pair_slice, dot_accumulate(tl.trans(grad_z_pair), rows, acc, OPERANDS), mask=pair_slice_ok)
                res_slice = partial + (2 * STREAMS + res[:, None]) * D + depth[None, :]
                res_slice_ok = res_ok[:, None] & channel_ok[None, :]
                acc = tl.load(res_slice, mask=later_block(res_slice_ok, block, program), other=0.0)
                tl.store(res_slice, dot_accumulate(tl.trans(grad_z_res), rows, acc, OPERANDS), mask=res_slice_ok)
"""
HC_PARTIALS = """                slice_ptr = partial + k[:, None] * C + channel[None, :]
                slice_ok = k_ok[:, None] & channel_ok[None, :]
                acc = tl.load(slice_ptr, mask=later_block(slice_ok, block, program), other=0.0)
                tl.store(slice_ptr, dot_accumulate(tl.trans(grad_z), rows, acc, OPERANDS), mask=slice_ok)
"""
SIGNATURE_END = """grad_x_ptr, grad_weight_ptr, grad_scale_ptr, grad_bias_ptr, T, C,
                        VARIANT: tl.constexpr, RES: tl.constexpr, ITERS: tl.constexpr, OPERANDS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, RES_BLOCK: tl.constexpr):"""


def guarded(block):
    return "                if WEIGHT_GRAD:\n" + "".join("    " + line for line in block.splitlines(keepends=True))


def kernel_with_switch(folder):
    """pre_backward_kernel with a WEIGHT_GRAD constexpr (default True), from fused/kernels.py's source."""
    source = open(kernels.__file__, encoding="utf-8").read()
    for old in (PARTIALS, HC_PARTIALS, SIGNATURE_END):
        if source.count(old) != 1:
            raise RuntimeError("fused/kernels.py's pre_backward_kernel changed: update pre_backward_parts.py")
    source = source.replace(PARTIALS, guarded(PARTIALS)).replace(HC_PARTIALS, guarded(HC_PARTIALS))
    source = source.replace(SIGNATURE_END, SIGNATURE_END[:-2] + ", WEIGHT_GRAD: tl.constexpr = True):")
    path = os.path.join(folder, "pre_backward_switch.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("pre_backward_switch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pre_backward_kernel


def measure(args, device, kernel):
    launch = next(launch for launch in connection_launches(args.residual, args.stream_dtype, True, args.width,
                                                           args.batch_size, args.block_size, device)
                  if launch.kernel == "pre_backward_kernel")
    recorded, shipped = list(launch.args), dict(launch.constexprs)
    tokens, weight = recorded[14], recorded[4]
    launch.replay()
    grad_x, grad_weight = recorded[10].clone(), recorded[11].sum(0)

    def run(a, constexprs, programs):
        ops.launch_function(kernel, (programs,), device, *a, **constexprs)

    shipped_setting = (shipped["BLOCK_T"], shipped["BLOCK_C"], shipped["num_warps"])
    rows = []
    for block_t, block_c, warps in dict.fromkeys((shipped_setting, *SETTINGS)):
        for programs in sorted({min(p, -(-tokens // block_t)) for p in (*PROGRAMS, launch.grid[0])}):
            for weight_grad in (True, False):
                a = list(recorded)
                a[10] = torch.empty_like(recorded[10])
                a[11], a[12], a[13] = (t.new_empty((programs, *t.shape[1:])) for t in recorded[11:14])
                constexprs = dict(shipped, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps, WEIGHT_GRAD=weight_grad)
                run(a, constexprs, programs)
                ms = time_alone(lambda: run(a, constexprs, programs), args.warmup, args.steps, device)
                rows.append(dict(block_t=block_t, block_c=block_c, num_warps=warps, programs=programs,
                                 partials=weight_grad, shipped=(block_t, block_c, warps) == shipped_setting
                                 and programs == launch.grid[0] and weight_grad, ms=ms,
                                 grad_x_max_abs_diff=(a[10].float() - grad_x.float()).abs().max().item(),
                                 grad_weight_max_abs_diff=((a[11].sum(0) - grad_weight).abs().max().item()
                                                           if weight_grad else None)))
    x = recorded[0].reshape(tokens, -1)
    grad_z = torch.randn(tokens, weight.shape[0], generator=torch.Generator().manual_seed(args.seed)).to(device)
    operands = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    gemm_ms = time_alone(lambda: grad_z.t().to(operands) @ x.to(operands), args.warmup, args.steps, device)
    return dict(rows=rows, tokens=tokens, gemm=dict(operands=str(operands).replace("torch.", ""), ms=gemm_ms))


def table(result):
    rows = [[f"{r['block_t']}, {r['block_c']}, {r['num_warps']}" + (" (shipped)" if r["shipped"] else ""),
             str(r["programs"]), "yes" if r["partials"] else "no", fmt(1000 * r["ms"], ",.1f"),
             fmt(r["grad_x_max_abs_diff"], ".1e"), fmt(r["grad_weight_max_abs_diff"], ".1e")] for r in result["rows"]]
    return markdown_table(["tokens, channels, warps", "programs", "grad-W partials", "us",
                           "max abs grad x - shipped", "max abs grad W - shipped"], rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: under TRITON_INTERPRET=1 (times mean nothing)")
    parser.add_argument("--residual", default="mhclite", choices=["hc", "mhc", "mhclite"])
    parser.add_argument("--stream_dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--width", type=int, default=768, help="C (M: 768)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join("out", "pre_backward_parts.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on CPU the kernels run only under TRITON_INTERPRET=1 (a dry run at tiny shapes)")
    if device.type == "cpu":
        fix_scalar_index()  # connection_forward is called directly: the kernels run whatever INTERPRET_ON_CPU
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 GEMM as the kernel's fp32 dot: no TF32
    with tempfile.TemporaryDirectory() as folder:
        result = dict(environment(argv, device, "-m", "benchmarks.pre_backward_parts"), mode="pre_backward_parts",
                      residual=args.residual, stream_dtype=args.stream_dtype,
                      parts=measure(args, device, kernel_with_switch(folder)))
    parts = result["parts"]
    print(f"## pre_backward of {args.residual}, {args.stream_dtype} streams, {parts['tokens']} tokens, C = "
          f"{args.width}, {result['device_name']}\n\n{table(parts)}\n\ngrad W as one GEMM (grad_z^T x, "
          f"{parts['gemm']['operands']} operands): {1000 * parts['gemm']['ms']:,.1f} us\n")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
