"""The fused connection kernels compile for sm_80 and sm_90 without a GPU, with the argument types,
alignment and constexprs the model launches them with (python -m fused.tools.resources), and the
specialisation we compile with is the one triton's JIT builds.

The compilation runs in a subprocess: triton's compiler cannot run where TRITON_INTERPRET=1 was set
before triton was imported (tests/conftest.py sets it on CPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from fused import ops  # noqa: E402
from fused.tools import resources  # noqa: E402
from fused.tools.launches import connection_launches, jit_specialisation, specialise  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SM80_SHARED_PER_CTA = 163 * 1024
DEFAULT_WIDTH = 768  # the model's width at M; the odd width checks that masked tails compile


def jit_of(name):
    """A JITFunction of the kernel's Python function, also when the kernels are interpreted here."""
    return triton.runtime.jit.JITFunction(ops.kernel(name).fn)


def jit_binder_specialisation(kernel, args, kwargs):
    """What triton's own JIT builds (its private binder), as (signature, constexprs, attrs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = triton.runtime.jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, {k: v for k, v in attrs.items() if v}


def probe(a_ptr, b_ptr, small, one, wide, scale, flag, BLOCK: triton.language.constexpr):
    pass


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # triton 3.9's notice of a future default
@pytest.mark.skipif(not hasattr(triton.runtime.jit, "create_function_from_signature")
                    or not hasattr(triton.runtime.jit.JITFunction, "_pack_args"),
                    reason="this triton has no create_function_from_signature / _pack_args to compare with")
def test_specialisation_is_the_jits():
    launches = [launch for residual in ("hc", "mhc", "mhclite") for width in (16, 20)
                for stream_dtype, autocast in (("float32", False), ("bfloat16", True))
                for launch in connection_launches(residual, stream_dtype, autocast, width, 2, 16, "cpu", run=False)]
    cases = [(jit_of(launch.kernel), launch.args, launch.constexprs) for launch in launches]
    data = torch.zeros(64)
    cases.append((triton.runtime.jit.JITFunction(probe), (data, data[1:], 48, 1, 2**31 + 16, 0.5, True),
                  dict(BLOCK=4, num_warps=8)))
    for kernel, args, kwargs in cases:
        signature, constexprs, attrs, options = jit_specialisation(kernel, args, kwargs)
        assert (signature, constexprs, attrs) == jit_binder_specialisation(kernel, args, kwargs), kernel.fn.__name__
    assert signature == dict(a_ptr="*fp32", b_ptr="*fp32", small="i32", one="constexpr", wide="i64", scale="fp32",
                             flag="u1", BLOCK="constexpr")
    assert constexprs == {(3,): 1, (7,): 4} and set(attrs) == {(0,), (2,), (4,)} and options == dict(num_warps=8)
    assert specialise(2**63) == ("u64", True) and specialise(2**63 + 1) == ("u64", False)
    assert specialise(16, align=False) == ("i32", False) and specialise(1, specialize=False) == ("i32", False)


def test_resident_ctas_per_sm():
    assert resources.ctas_per_sm(32, 0, 4, 80) == 16  # threads: 2048 / 128
    assert resources.ctas_per_sm(255, 0, 4, 80) == 2  # 8192 registers a warp, two warps a quarter
    assert resources.ctas_per_sm(78, 48 * 1024, 4, 80) == 3  # shared memory: 164 KB / 49 KB
    assert resources.ctas_per_sm(78, 48 * 1024, 4, 90) == 4  # 228 KB / 49 KB
    assert resources.ctas_per_sm(32, 164 * 1024, 4, 80) == 0  # more than a CTA may have
    assert resources.ctas_per_sm(16, 0, 1, 90) == 32  # the CTA limit


@pytest.mark.slow
def test_every_launched_kernel_compiles_for_sm80_and_sm90(tmp_path, triton_compile_cache):
    """The launches of training's default (bf16 autocast), every variant and stream dtype at the
    model's width for sm_90 (H100, H200) and sm_80 (A100), whose smaller shared memory and own code
    generation could fail; at the odd width, for its masked tails, mhclite's for sm_90 (the channel
    tail is handled alike in every variant, and triton's front end lowers it alike for both). Without
    autocast the kernels are checked in the interpreter only (python -m fused.tools.resources
    compiles every combination)."""
    reason = resources.missing_tool()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(triton_compile_cache)
    odd_width = next(w for w in resources.WIDTHS if w % 16)
    records = []
    for ccs, width, residuals in (((80, 90), DEFAULT_WIDTH, resources.RESIDUALS), ((90,), odd_width, ("mhclite",))):
        out = tmp_path / f"resources-{width}.json"
        proc = subprocess.run([sys.executable, "-m", "fused.tools.resources", "--json", str(out), "--jobs", "2",
                               "--ccs", ",".join(map(str, ccs)), "--widths", str(width), "--autocast", "bfloat16",
                               "--residuals", ",".join(residuals)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        compiled = json.loads(out.read_text())["records"]
        expected = [(residual, width, stream_dtype, "bfloat16", launch.kernel)
                    for residual in residuals for stream_dtype in resources.STREAM_DTYPES
                    for launch in connection_launches(residual, stream_dtype, True, width, 2, 16, "cpu", run=False)]
        got = [(r["residual"], r["width"], r["stream_dtype"], r["autocast"], r["kernel"]) for r in compiled]
        assert got == expected
        records += [(cc, r) for r in compiled for cc in ccs]
    assert DEFAULT_WIDTH in resources.WIDTHS
    for cc, r in records:
        name = f"{r['kernel']} {r['residual']} {r['stream_dtype']} streams, C={r['width']}"
        res = r[f"sm_{cc}"]
        assert "error" not in res, f"{name}, sm_{cc}: {res.get('error')}"
        assert res["shared_bytes"] <= SM80_SHARED_PER_CTA, f"{name}, sm_{cc}: {res['shared_bytes']} B shared"
        assert res["ctas_per_sm"] >= 1 and res["registers"] <= 255
        assert res["stack_bytes"] == 0 and res["local_bytes"] == 0, f"{name}, sm_{cc} spills: {res}"
        # Every loop's loads software-pipelined where rows are aligned (cp.async needs it), but
        # post_backward's: a streaming loop with many programs, at 0.93 x copy on the H200 without.
        if r["width"] == DEFAULT_WIDTH and r["kernel"] != "post_backward_kernel":
            assert res["plain_loop_loads"] == 0, f"{name}, sm_{cc}: loads a loop step waits for: {res}"
        assert res["async_loop_loads"] + res["plain_loop_loads"] > 0 or r["kernel"] == "post_kernel", name


def test_loop_loads_counts_the_loads_inside_loops_of_a_ttgir():
    ttgir = """
    %w = tt.load %p : tensor<16x!tt.ptr<f32>, #blocked>
    %r:2 = scf.for %i = %c0 to %n step %c1 iter_args(%a = %z) -> (tensor<16xf32, #ttg.slice<{dim = 1}>>) : i32 {
      %x = ttg.async_copy_global_to_local %q, %buf mask %m {contiguity = 2 : i32} : tensor<16x!tt.ptr<f32>>
      %s = "tt.reduce"(%x) <{axis = 0 : i32}> ({
      ^bb0(%l: f32, %k: f32):
        tt.reduce.return %l : f32
      }) : (tensor<16xf32>) -> f32
      %y = tt.load %q2 : tensor<16x!tt.ptr<f32>, #blocked>
      scf.yield %s : f32
    } {tt.num_stages = 2 : i32}
    %v = tt.load %p3 : tensor<16x!tt.ptr<f32>, #blocked>
"""
    assert resources.loop_loads(ttgir) == dict(async_loop_loads=1, plain_loop_loads=1)
