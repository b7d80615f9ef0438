"""The fused kernels compile for sm_80 (A100) and sm_90 (H100, H200) on a machine without a GPU, as
triton's JIT compiles the launches of a training step, and none spills registers or asks for more
shared memory than an sm_80 CTA may have.

The compilation runs in a subprocess, this file run as a script: triton's compiler cannot run where
TRITON_INTERPRET=1 was set before triton was imported (tests/conftest.py sets it on CPU). There a
stand-in driver names the target GPU, and each launch of one connection's forward + backward
becomes kernel.warmup, which compiles the kernel with the specialisation triton's JIT builds for
those arguments (types, alignment, constexprs) and runs nothing."""

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SM80_SHARED_PER_CTA = 163 * 1024
KERNELS = ["pre_kernel", "post_kernel", "post_backward_kernel", "pre_backward_grad_x_kernel",
           "pre_backward_weight_kernel"]  # one connection's forward + backward, in launch order
STREAM_DTYPES = ("float32", "bfloat16")
# (compute capabilities, width, variants): every variant at M's width, and at an odd width, for its
# masked channel tails, mhclite's (the tail is the same code in every variant) for sm_90.
BUILDS = [((80, 90), 768, ("hc", "mhc", "mhclite")), ((90,), 257, ("mhclite",))]
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def missing_tool():
    """Why the kernels cannot be compiled for a GPU here, or None."""
    for tool in ("ptxas", "cuobjdump"):
        try:
            getattr(triton.knobs.nvidia, tool).path
        except (RuntimeError, OSError) as e:  # not found, or not executable
            return f"{tool} not found ({e})"
    return None


@pytest.mark.slow
def test_every_launched_kernel_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    """Training's default, bf16 autocast, at a 2 x 16 batch: a token count that is a multiple of 16
    like a training batch's, so every int argument is specialised as at full size."""
    reason = missing_tool()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=REPO)  # an empty cache: compiled for real
    out = tmp_path / "compiled.json"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    expected = [(cc, width, residual, stream_dtype, kernel) for ccs, width, residuals in BUILDS for cc in ccs
                for residual in residuals for stream_dtype in STREAM_DTYPES for kernel in KERNELS]
    assert [(r["cc"], r["width"], r["residual"], r["stream_dtype"], r["kernel"]) for r in records] == expected
    for r in records:
        name = f"{r['kernel']} {r['residual']} {r['stream_dtype']} streams, C={r['width']}, sm_{r['cc']}"
        assert r["stack_bytes"] == 0 and r["local_bytes"] == 0, f"{name} spills: {r}"
        assert r["shared_bytes"] <= SM80_SHARED_PER_CTA, f"{name}: {r['shared_bytes']} B of shared memory"


# ----------------------------------------------------------------------------------------------
# The subprocess


class TargetDriver:
    """The part of triton's driver that kernel.warmup asks: the device, its stream, and the target
    GPU (one device per compute capability, so that each gets its own compiled kernels)."""

    def __init__(self, cc):
        self.cc = cc

    def get_current_device(self):
        return self.cc

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.cc, 32)


def cubin_resources(cubin):
    """Registers, stack (where spills go), static shared and local bytes, as cuobjdump reads them."""
    with tempfile.TemporaryDirectory(prefix="kernel-resources-") as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True,
                                 text=True, check=True).stdout
    registers, stack, shared, local = (int(v) for v in RESOURCES.search(listing).groups())
    return dict(registers=registers, stack_bytes=stack, static_shared_bytes=shared, local_bytes=local)


def compiled_launches(cc, residual, stream_dtype, width):
    """[(kernel name, compiled kernel)] of one forward + backward of a connection, compiled for sm_<cc>."""
    from fused import connection_forward, ops
    from residuals import RESIDUALS
    compiled = []

    def compile_instead(kernel_name, grid, device, *args, **constexprs):
        compiled.append((kernel_name, ops.kernel(kernel_name).warmup(*args, grid=grid, **constexprs)))

    triton.runtime.driver.set_active(TargetDriver(cc))
    ops._launch = compile_instead  # this process only compiles
    module = RESIDUALS[residual](width, ops.STREAMS, 1)
    x = torch.zeros(2, 16, ops.STREAMS, width, dtype=getattr(torch, stream_dtype), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = connection_forward(module, x, torch.nn.Linear(width, width, bias=False))
    out.backward(torch.zeros_like(out))  # on outputs never written: nothing runs
    return compiled


def main(out):
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # triton 3.9's notice of a future default
    records = []
    for ccs, width, residuals in BUILDS:
        for cc in ccs:
            for residual in residuals:
                for stream_dtype in STREAM_DTYPES:
                    for kernel, compiled in compiled_launches(cc, residual, stream_dtype, width):
                        resources = cubin_resources(compiled.asm["cubin"])
                        records.append(dict(cc=cc, width=width, residual=residual, stream_dtype=stream_dtype,
                                            kernel=kernel, **resources,
                                            shared_bytes=compiled.metadata.shared + resources["static_shared_bytes"]))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
