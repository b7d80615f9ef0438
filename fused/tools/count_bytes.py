"""Bytes per token per connection of the fused path, counted on CPU in Triton's interpreter.

    python -m fused.tools.count_bytes [--json PATH] [--residuals hc,mhc,mhclite] [--stream_dtypes float32,bfloat16]
    python -m fused.tools.count_bytes --reference      # the reference path (residuals.py), eager and compiled

Runs forward and backward of `connection_forward` at n = 4, C = 768 under bf16 autocast with a
bf16 branch output (as the model runs), with every kernel in Triton's interpreter at its shipped
tile, and counts:
  - per kernel launch (seen through ops.launch_hook), the bytes its loads and its stores move,
    each address once per launch and direction ("kernels", unique bytes: a read and a write of one
    address count both); every load and store as executed, repeats included ("executed"); the load
    instructions executed ("loads", the serial steps of fused.tools.latency); and the bytes of
    loads of an address the same program touched before, by reuse distance ("rereads", the input of
    the L2 model in fused.tools.latency): the bytes of the distinct addresses of its own the program
    touched in between (an LRU cache's stack distance), leaving out addresses other programs of the
    launch touch too (the weight, the per-logit parameters), which L2 holds once for all programs;
  - every aten op that runs outside the kernels (the connection's own torch code, inside the custom
    ops too), its inputs plus its outputs, leaving out views, metadata ops and allocations. The
    branch is a stand-in whose own forward and backward are not counted.
The per-token figure is the slope between two token counts (multiples of every tile's tokens), so
traffic once per launch (the grad-weight partials' sum) does not count per token, and traffic once
per token-block program (the weight each of pre's programs reads) does. Prints a markdown table; --json writes
{residual: {stream_dtype: {"kernels", "executed", "loads": {name: per token}, "rereads": {name:
{floor(log2(bytes between)): bytes per token}}, "torch", "forward", "backward", "total",
"executed_total", "per_split_at_m", "executed_per_split_at_m"}}}. What the backward moves once
per token split, not per token, is counted with one split and apart: the grad-W kernel's
weight-sized partial, written and summed ("per_split_at_m", unique, and executed).
One split's bytes are the difference between two splits and one on the same tokens; times the
shipped splits over M's 16,384 tokens per micro-step, they are bytes per token at M.
The reference path is counted twice: eager, every aten op as above; and compiled, every kernel
(a fused group of ops, or a GEMM) inductor's CUDA backend makes, scheduled as for an H100 without
one, its input and output buffers once each as the scheduler counts them (compiled_kernel_bytes).
"""

import argparse
import collections
import contextlib
import copy
import json
import os
import types
from unittest import mock

# Triton reads TRITON_INTERPRET when it is imported, which the ops do at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

import fused  # noqa: E402
from fused import ops  # noqa: E402
from fused.tools.interpreter import fix_scalar_index, version_problem  # noqa: E402
import residuals  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

VARIANTS = ("hc", "mhc", "mhclite")
STREAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
N_STREAMS, WIDTH = 4, 768
# Multiples of every kernel's BLOCK_T, so that per-block traffic (the weight read by each program) is in the slopes.
TOKEN_COUNTS = (64, 128)
# Enough tokens that inductor's CUDA backend makes the same kernels at both (it splits small reductions).
COMPILED_TOKEN_COUNTS = (2048, 4096)
M_SEQUENCE = 1024  # tokens per sequence at M: a Block's compiled count runs whole sequences
# Unique bytes only (the split bytes): tokens per program at most this, for few interpreted loop
# trips; a kernel's shipped BLOCK_T below it is kept, since its per-block outputs (pre_backward_grad_x's
# grad scale and grad bias) are unique bytes per block.
COUNTING_BLOCK_T = 32
M_TOKENS = 16 * 1024  # tokens per micro-step at M (16 x 1024), for the grad-W partials per token
PARTIAL_TOKENS = 64  # two blocks of COUNTING_BLOCK_T: two splits of one block each
# The backward's kernel that splits tokens, by the ops setting of its split count.
SPLIT_KERNELS = {"WEIGHT_GRAD_SPLITS": "pre_backward_weight_kernel"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
FILLS = {"new_zeros", "new_ones", "new_full", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like"}


def budget(stream_dtype, n=N_STREAMS, width=WIDTH):
    """The floor: the streams read and written once in the forward (3 nCs) and in the backward
    (4 nCs), plus a few C-wide vectors: 7 nCs + 16 C bytes per token (docs/kernels.md)."""
    return 7 * n * width * torch.finfo(stream_dtype).bits // 8 + 16 * width


def distinct(values):
    """How many different values: sorted and compared, which takes a fraction of the time of the
    hashing np.unique of recent numpy on arrays this large."""
    values = np.sort(values)
    return int(values.size and 1 + np.count_nonzero(values[1:] != values[:-1]))


class KernelBytes:
    """Counts Triton interpreter loads and stores, per launch: `with counter.launch(name):` around a
    launch adds to counter.bytes[name] that launch's unique read and written bytes (each address once
    per direction), to counter.executed[name] every load's and store's bytes as executed (repeats
    included), to counter.loads[name] the load instructions executed (all programs), and to
    counter.rereads[name][d] the bytes of loads of an address the same program had touched before,
    d = floor(log2(bytes of the distinct own addresses the program touched in between)), for the L2 model
    (fused.tools.latency.dram_bytes_per_token)."""

    def __init__(self):
        self.bytes = collections.Counter()
        self.executed = collections.Counter()
        self.loads = collections.Counter()
        self.rereads = collections.defaultdict(collections.Counter)
        self._launch = None  # [(direction, addresses, itemsize, program)] of the launch running, in order

    def _record(self, direction, ptrs, mask, program):
        if self._launch is None:
            raise RuntimeError("a load or store outside a counted launch")
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
        self._launch.append((direction, addresses, ptrs.get_element_ty().primitive_bitwidth // 8, program))

    @contextlib.contextmanager
    def launch(self, name):
        self._launch = []
        try:
            yield
        finally:
            launch, self._launch = self._launch, None
        for direction in ("read", "write"):
            by_size = collections.defaultdict(list)
            for access_direction, addresses, itemsize, _ in launch:
                if access_direction == direction:
                    by_size[itemsize].append(addresses)
            self.bytes[name] += sum(distinct(np.concatenate(a)) * size for size, a in by_size.items())
        self.executed[name] += sum(addresses.size * itemsize for _, addresses, itemsize, _ in launch)
        self.loads[name] += sum(direction == "read" for direction, *_ in launch)
        shared = shared_addresses(launch)
        by_program = collections.defaultdict(list)
        for access in launch:
            by_program[access[3]].append(access)
        for accesses in by_program.values():
            self.rereads[name].update(reuse_distances(accesses, shared))


    @contextlib.contextmanager
    def patched(self):
        """Counting on: loads and stores of the interpreter (create_load and create_store go through
        the masked ones), launches through ops.launch_hook; atomics refused."""
        from triton.runtime.interpreter import InterpreterBuilder
        counter = self
        masked_load, masked_store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

        # The trailing cache and eviction arguments differ between triton versions: passed on as they come.
        def create_masked_load(self, ptrs, mask, *rest):
            counter._record("read", ptrs, mask, self.grid_idx)
            return masked_load(self, ptrs, mask, *rest)

        def create_masked_store(self, ptrs, value, mask, *rest):
            counter._record("write", ptrs, mask, self.grid_idx)
            return masked_store(self, ptrs, value, mask, *rest)

        def refuse_atomic(self, *args, **kwargs):
            raise RuntimeError("count_bytes does not count atomics")

        def counted_launch(kernel_name, grid, device, args, constexprs, launch):
            # The interpreter's own torch ops (copying arguments to the host and back) are not the connection's.
            with counter.launch(kernel_name), _disable_current_modes():
                launch()

        patches = {"create_masked_load": create_masked_load, "create_masked_store": create_masked_store,
                   "create_atomic_rmw": refuse_atomic, "create_atomic_cas": refuse_atomic}
        saved = {name: getattr(InterpreterBuilder, name) for name in patches}
        try:
            for name, fn in patches.items():
                setattr(InterpreterBuilder, name, fn)
            with ops.launch_hook(counted_launch):
                yield self
        finally:
            for name, fn in saved.items():
                setattr(InterpreterBuilder, name, fn)


def shared_addresses(accesses):
    """The addresses (sorted) that more than one program among a launch's `accesses` touches."""
    if not accesses:
        return np.zeros(0, dtype=np.int64)
    programs = {}
    addresses = np.concatenate([a.astype(np.int64) for _, a, _, _ in accesses])
    owner = np.concatenate([np.full(a.size, programs.setdefault(p, len(programs)), dtype=np.int64)
                            for _, a, _, p in accesses])
    order = np.lexsort((owner, addresses))
    addresses, owner = addresses[order], owner[order]
    starts = np.flatnonzero(np.concatenate([[True], addresses[1:] != addresses[:-1]]))
    ends = np.concatenate([starts[1:], [addresses.size]]) - 1
    return addresses[starts][owner[starts] != owner[ends]]


def reuse_distances(accesses, shared=np.zeros(0, dtype=np.int64)):
    """{floor(log2(distance)): bytes} over the loads among one program's `accesses` (in order) of an
    address an earlier access touched; distance = the bytes of the distinct addresses the accesses
    between the two touched (at least 1; an LRU cache's stack distance: an address touched twice in
    between takes room once), leaving out the `shared` addresses (sorted)."""
    if not accesses:
        return {}
    addresses = np.concatenate([a.astype(np.int64) for _, a, _, _ in accesses])
    unique, ids = np.unique(addresses, return_inverse=True)
    own = np.ones(unique.size, dtype=bool)
    if shared.size:
        at = np.minimum(np.searchsorted(shared, unique), shared.size - 1)
        own = shared[at] != unique
    latest = np.full(unique.size, -1, dtype=np.int64)  # each address's latest access so far
    held = np.zeros(len(accesses), dtype=np.int64)  # own bytes whose latest access is access k
    counts = collections.Counter()
    offset = 0
    for k, (direction, access_addresses, itemsize, _) in enumerate(accesses):
        here = np.unique(ids[offset:offset + access_addresses.size])
        offset += access_addresses.size
        before = latest[here]
        seen = before >= 0
        if direction == "read" and seen.any():
            held_before = np.concatenate([[0], np.cumsum(held[:k])])
            between = np.maximum(held_before[k] - held_before[before[seen] + 1], 1)
            buckets, sizes = np.unique(np.floor(np.log2(between)).astype(np.int64), return_counts=True)
            counts.update({int(b): int(n) * itemsize for b, n in zip(buckets, sizes)})
        moved = here[seen & own[here]]
        np.subtract.at(held, latest[moved], itemsize)
        held[k] += np.count_nonzero(own[here]) * itemsize
        latest[here] = k
    return dict(sorted(counts.items()))


def tensor_bytes(t):
    """Bytes a tensor covers: expanded (stride 0) dimensions count once."""
    if t.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        elements *= size if stride != 0 else 1
    return elements * t.element_size()


class TorchBytes(TorchDispatchMode):
    """Adds up the input and output bytes of every aten op that runs (views, metadata ops and
    allocations left out; fills count their output only). The python bodies of our custom ops run
    under the mode, so their own torch ops count; their kernels are KernelBytes' business."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "hcfused":
            from torch._library.custom_ops import OPDEFS
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in ALLOCATIONS or name in ("detach", "alias", "lift_fresh", "_unsafe_view"):
            return out
        moved = out if name in FILLS else (args, kwargs, out)  # a fill reads nothing of its template
        tensors = [t for t in torch.utils._pytree.tree_leaves(moved) if isinstance(t, torch.Tensor)]
        op_bytes = sum(tensor_bytes(t) for t in tensors)
        self.bytes += op_bytes
        self.ops[name] += op_bytes
        return out


class StandInBranch(torch.autograd.Function):
    """The branch: u -> bf16 0.5 u, its forward and backward not counted (no aten op reaches the mode)."""

    @staticmethod
    def forward(ctx, u):
        with _disable_current_modes():
            return (0.5 * u).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_y):
        with _disable_current_modes():
            return 0.5 * grad_y.float()


def count_connection(residual, stream_dtype, tokens, n=N_STREAMS, width=WIDTH):
    """{"forward"/"backward": {"kernels", "executed", "loads": Counter by kernel, "rereads": {kernel:
    Counter}, "torch": bytes}} of one forward and backward."""
    generator = torch.Generator().manual_seed(0)
    module = RESIDUALS[residual](width, n, 1)
    x = torch.randn(tokens, 1, n, width, generator=generator).to(stream_dtype).requires_grad_()
    grad = torch.randn(tokens, 1, n, width, generator=generator).to(stream_dtype)
    phases = {}
    for phase in ("forward", "backward"):
        kernels = KernelBytes()
        with kernels.patched(), TorchBytes() as torch_bytes:
            if phase == "forward":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = fused.connection_forward(module, x, StandInBranch.apply)
            else:
                torch.autograd.grad(out, [x, *module.parameters()], grad)
        phases[phase] = {"kernels": kernels.bytes, "executed": kernels.executed, "loads": kernels.loads,
                         "rereads": kernels.rereads, "torch": torch_bytes.bytes}
    return phases


def reference_bytes_per_token(residual, stream_dtype, token_counts=TOKEN_COUNTS):
    """The reference path (residuals.py, as model.py runs it without the kernels) counted the same
    way: every aten op of one forward and backward under bf16 autocast, eager, its inputs plus its
    outputs, per token (slope between token_counts). Inductor fuses chains of pointwise ops into
    one kernel, so the compiled path moves less than this. Returns {"forward", "backward", "total":
    bytes, "ops": {aten op: bytes}} per token."""
    counts = {}
    for tokens in token_counts:
        generator = torch.Generator().manual_seed(0)
        module = RESIDUALS[residual](WIDTH, N_STREAMS, 1)
        x = torch.randn(tokens, 1, N_STREAMS, WIDTH, generator=generator).to(stream_dtype).requires_grad_()
        grad = torch.randn(tokens, 1, N_STREAMS, WIDTH, generator=generator).to(stream_dtype)
        with TorchBytes() as forward:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(x, StandInBranch.apply)
        with TorchBytes() as backward:
            torch.autograd.grad(out, [x, *module.parameters()], grad)
        ops_bytes = forward.ops + backward.ops
        counts[tokens] = dict(forward=forward.bytes, backward=backward.bytes, ops=ops_bytes)
    small, large = (counts[t] for t in token_counts)
    tokens = token_counts[1] - token_counts[0]
    entry = {phase: (large[phase] - small[phase]) / tokens for phase in ("forward", "backward")}
    entry["total"] = entry["forward"] + entry["backward"]
    entry["ops"] = {name: (large["ops"][name] - small["ops"][name]) / tokens
                    for name in sorted(large["ops"], key=large["ops"].get, reverse=True)}
    return entry


@torch.library.custom_op("count_bytes::stand_in_branch", mutates_args=())
def compiled_stand_in_branch(u: torch.Tensor) -> torch.Tensor:
    """The branch for compiled counts: u -> bf16 0.5 u in a kernel inductor cannot see into or fuse
    with, so the connection's kernels stay apart from it; its own kernels are left out of the count."""
    return (0.5 * u).to(torch.bfloat16)


@compiled_stand_in_branch.register_fake
def _(u):
    return torch.empty_like(u, dtype=torch.bfloat16)


@torch.library.custom_op("count_bytes::stand_in_branch_backward", mutates_args=())
def compiled_stand_in_branch_backward(grad_y: torch.Tensor) -> torch.Tensor:
    return 0.5 * grad_y.float()


@compiled_stand_in_branch_backward.register_fake
def _(grad_y):
    return torch.empty_like(grad_y, dtype=torch.float32)


compiled_stand_in_branch.register_autograd(lambda ctx, grad_y: compiled_stand_in_branch_backward(grad_y))


def _origin_ops(scheduler_node):
    """The aten ops a scheduler node (one generated kernel) was made from, in order, once each."""
    ops_seen = []
    for node in scheduler_node.get_nodes():
        for origin in sorted(getattr(node.node, "origins", None) or (), key=lambda o: o.name):
            name = str(origin.target).removeprefix("aten.").removesuffix(".default")
            if name not in ops_seen and not name.startswith("count_bytes."):
                ops_seen.append(name)
    return ops_seen


# What inductor's CUDA backend asks of the device while it schedules (an H100 SXM), so that it
# schedules for CUDA on a machine without one.
H100_PROPERTIES = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32, total_memory=80 * 2 ** 30,
    L2_cache_size=50 * 2 ** 20, shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=227 * 1024,
    shared_memory_per_multiprocessor=228 * 1024, gcnArchName="")


class _Scheduled(Exception):
    """Stops compiled_kernel_bytes where inductor has scheduled a graph's kernels (no code is
    generated) and where the compiled function would run (nothing runs)."""


def _shape_checked_scatter(inp, src, view_ops):
    """inductor's reinplace pass checks a scatter by a copy_ between fake tensors, which a CPU build
    of torch refuses for CUDA ones; the same check by shapes."""
    target = inp
    for view in view_ops:
        args, kwargs = torch.utils._pytree.tree_map(
            lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, (view.args, view.kwargs))
        target = view.target(target, *args, **kwargs)
    torch.broadcast_shapes(src.shape, target.shape)
    return inp


@contextlib.contextmanager
def _cuda_without_a_gpu():
    """torch.cuda's device queries answered as an H100 would answer them, for inductor's scheduler."""
    from torch._dynamo.device_interface import CudaInterface
    patches = [mock.patch("torch.cuda.get_device_properties", lambda *a, **k: H100_PROPERTIES),
               mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)),
               mock.patch("torch.cuda.is_available", lambda: True),
               mock.patch("torch.cuda.device_count", lambda: 1),
               mock.patch("torch.cuda.current_device", lambda: 0),
               mock.patch("torch.cuda.get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
               mock.patch("torch.cuda.set_rng_state", lambda *a, **k: None),
               mock.patch("torch.cuda._exchange_device", lambda index: -1),
               mock.patch("torch.cuda._maybe_exchange_device", lambda index: -1),
               mock.patch("torch._inductor.scheduler.has_triton", lambda: True),
               mock.patch("torch._inductor.fx_passes.reinplace._inplace_generalized_scatter", _shape_checked_scatter),
               mock.patch.object(CudaInterface, "get_compute_capability", staticmethod(lambda *a, **k: 90)),
               mock.patch.object(CudaInterface, "get_device_properties", staticmethod(lambda *a, **k: H100_PROPERTIES))]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _is_scheduled(error):
    """Whether error is, or wraps (inductor wraps what its passes raise), _Scheduled."""
    while error is not None and not isinstance(error, _Scheduled):
        error = getattr(error, "inner_exception", None) or error.__cause__
    return error is not None


def compiled_kernel_bytes(fn, *inputs):
    """[(phase, aten ops, bytes, library)] of every kernel inductor's CUDA backend makes for fn(*inputs)
    and, for inputs that require grad, its backward, each kernel's input and output buffers counted
    once, as its scheduler counts them; library: a call of a library kernel (a GEMM, attention) rather
    than a generated one; the stand-in branch's kernels left out. No GPU needed: each graph
    AOTAutograd partitions (forward, and backward at once) is copied with CUDA devices and CUDA fake
    inputs and lowered and scheduled by inductor as for an H100, up to code generation; nothing
    runs. Caches are off, so every graph is scheduled."""
    import torch._inductor.config as inductor_config
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.ir import MultiOutput
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode, Scheduler
    from torch._inductor.virtualized import V
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    kernels = []

    def count_and_stop(scheduler):
        phase = "backward" if V.graph.is_backward else "forward"
        for node in scheduler.nodes:
            if isinstance(node, NopKernelSchedulerNode) or isinstance(node.node, MultiOutput):
                continue  # a view, an alias or an output of a call: nothing is launched
            op = getattr(node.node, "op_overload", None)  # an op inductor calls, not generates
            if getattr(op, "namespace", None) != "count_bytes":
                library = isinstance(node, ExternKernelSchedulerNode)
                kernels.append((phase, _origin_ops(node), node.get_read_write_buffers_sizes(), library))
        raise _Scheduled()

    def schedule_for_cuda(graph_module, example_inputs, **kwargs):
        cuda_module = copy.deepcopy(graph_module)
        for node in cuda_module.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device):
                node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
        cuda_module.recompile()
        fake_mode = detect_fake_mode(example_inputs)
        with fake_mode:
            cuda_inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                           if isinstance(t, torch.Tensor) else t for t in example_inputs]
        with _cuda_without_a_gpu(), mock.patch.object(Scheduler, "codegen", count_and_stop):
            FakeTensorProp(cuda_module, fake_mode).propagate_dont_convert_inputs(*cuda_inputs)
            try:
                compile_fx.compile_fx_inner(cuda_module, cuda_inputs, **kwargs)
            except Exception as error:
                if not _is_scheduled(error):
                    raise
        return _never_run

    torch._dynamo.reset()
    with (inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True)):
        backend = lambda gm, example_inputs: compile_fx.compile_fx(gm, example_inputs,  # noqa: E731
                                                                   inner_compile=schedule_for_cuda)
        try:
            torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
        except Exception as error:
            if not _is_scheduled(error):
                raise
    torch._dynamo.reset()
    return kernels


def _never_run(*args):
    """What compiled_kernel_bytes compiles to: by the time the forward would run, both graphs are
    scheduled, so nothing runs."""
    raise _Scheduled()


def kernel_kind(moved, library, tokens, width=WIDTH):
    """"library" (a GEMM, or attention in a Block), "streaming" (a generated kernel that moves at least
    C bytes per token: it passes over the streams or a (T, C) tensor) or "tiny" (the rest: the
    (T, <= 32) coefficients and the parameters)."""
    if library:
        return "library"
    return "streaming" if moved >= width * tokens else "tiny"


def compiled_slope(build, token_counts=COMPILED_TOKEN_COUNTS):
    """{"forward", "backward", "total": bytes} per token of the compiled forward and backward of the
    fn(x) that build(tokens) -> (fn, x) makes, the reference path's streams mixed as on CUDA
    (residuals.mixes_elementwise), from the slope between token_counts; "kernels": [(phase, aten
    ops, bytes)] largest first, the kernels made from the same aten ops taken together (inductor
    orders kernels, and splits small reductions, differently at different sizes); "launches":
    {phase: {kind: kernels}} at the larger token count, by kernel_kind."""
    runs = []
    for tokens in token_counts:
        with mock.patch.object(residuals, "mixes_elementwise", lambda x: True):
            kernels = compiled_kernel_bytes(*build(tokens))
        by_origin = collections.Counter()
        launches = {"forward": collections.Counter(), "backward": collections.Counter()}
        for phase, made_from, moved, library in kernels:
            by_origin[phase, tuple(made_from)] += moved
            launches[phase][kernel_kind(moved, library, tokens)] += 1
        runs.append(by_origin)
    small, large = runs
    tokens = token_counts[1] - token_counts[0]
    slopes = {key: (large[key] - small[key]) / tokens for key in large | small}
    entry = {phase: sum(b for (p, _), b in slopes.items() if p == phase) for phase in ("forward", "backward")}
    entry["total"] = entry["forward"] + entry["backward"]
    entry["kernels"] = sorted(((phase, list(made_from), b) for (phase, made_from), b in slopes.items()),
                              key=lambda k: -k[2])
    entry["launches"] = {phase: dict(kinds) for phase, kinds in launches.items()}
    return entry


def compiled_bytes_per_token(residual, stream_dtype, n=N_STREAMS, width=WIDTH):
    """The reference path compiled (torch.compile, inductor) as it runs on CUDA: one connection's
    forward and backward under bf16 autocast, the branch the opaque stand-in, scheduled by inductor's
    CUDA backend (compiled_kernel_bytes), by compiled_slope."""
    def build(tokens):
        generator = torch.Generator().manual_seed(0)
        module = RESIDUALS[residual](width, n, 1)
        x = torch.randn(tokens, 1, n, width, generator=generator).to(stream_dtype).requires_grad_()

        def connection(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return module(x, compiled_stand_in_branch)
        return connection, x
    return compiled_slope(build)


def compiled_block_bytes_per_token(residual, stream_dtype):
    """compiled_bytes_per_token in context: one model.Block at M's sequence length (attention and MLP
    with their two connections; res for comparison), compiled whole, so inductor may fuse across the
    connections' edges; the sublayers' own kernels are counted too (attention: the CPU's
    scaled-dot-product op, scheduled as an opaque kernel like CUDA's)."""
    from model import Block, GPTConfig

    def build(tokens):
        torch.manual_seed(0)
        config = GPTConfig(residual=residual, stream_dtype=str(stream_dtype).removeprefix("torch."),
                           block_size=M_SEQUENCE)
        block = Block(config, 1)
        generator = torch.Generator().manual_seed(0)
        shape = (tokens // M_SEQUENCE, M_SEQUENCE, config.n_streams, config.n_embd)
        x = torch.randn(shape, generator=generator).to(stream_dtype).requires_grad_()

        def forward(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return block(x)
        return forward, x
    return compiled_slope(build)


@contextlib.contextmanager
def counting_setup(splits=None, shipped_tiles=True):
    """The interpreter for CPU tensors and one token split of each split kernel, or `splits`
    {ops setting: count} (one: what a split moves once is the same at both token counts and stays
    out of the slopes; split_bytes counts it). shipped_tiles False: one channel block over all of
    C and at most COUNTING_BLOCK_T tokens per program in every kernel, for the fewest interpreted
    loop trips when only unique bytes matter."""
    fix_scalar_index()
    tiles = dict(ops.TILES) if shipped_tiles else {
        kernel: dict(tile, BLOCK_T=min(tile["BLOCK_T"], COUNTING_BLOCK_T), BLOCK_C=1 << (WIDTH - 1).bit_length())
        for kernel, tile in ops.TILES.items()}
    splits = {setting: 1 for setting in SPLIT_KERNELS} | (splits or {})
    settings = [(fused, "INTERPRET_ON_CPU", True), (ops, "TILES", tiles),
                *((ops, setting, count) for setting, count in splits.items())]
    saved = [getattr(module, name) for module, name, _ in settings]
    for module, name, value in settings:
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name, _), value in zip(settings, saved):
            setattr(module, name, value)


def phase_bytes(counted, key="kernels"):
    """Unique ("kernels") or executed bytes of the kernels, plus the torch ops' bytes."""
    return sum(counted[key].values()) + counted["torch"]


def split_bytes(residual, stream_dtype, setting):
    """(unique, executed) bytes one more token split of the ops setting adds: the backward of
    PARTIAL_TOKENS tokens with two splits minus with one."""
    counts = {}
    for splits in (1, 2):
        with counting_setup({setting: splits}, shipped_tiles=False):
            counts[splits] = count_connection(residual, stream_dtype, PARTIAL_TOKENS)["backward"]
    return tuple(phase_bytes(counts[2], key) - phase_bytes(counts[1], key) for key in ("kernels", "executed"))


def splits_at_m(setting):
    """The token splits the ops setting gives its kernel at M's tokens per micro-step."""
    return min(getattr(ops, setting), M_TOKENS // ops.TILES[SPLIT_KERNELS[setting]]["BLOCK_T"])


def per_split_bytes_per_token_at_m(residual, stream_dtype):
    """(unique, executed) bytes per token at M's tokens per micro-step of what the split kernels move
    once per split, with the shipped split counts."""
    unique = executed = 0.0
    for setting in SPLIT_KERNELS:
        splits = splits_at_m(setting)
        one_unique, one_executed = split_bytes(residual, stream_dtype, setting)
        unique += splits * one_unique / M_TOKENS
        executed += splits * one_executed / M_TOKENS
    return unique, executed


def bytes_per_token(residual, stream_dtype):
    """The JSON entry of one variant and stream dtype: per-token slopes between TOKEN_COUNTS at the
    shipped tiles: unique bytes per kernel ("kernels"), executed bytes, load instructions, and
    re-read bytes by reuse distance ("rereads": {kernel: {floor(log2(bytes between)): bytes})."""
    with counting_setup():
        small, large = (count_connection(residual, stream_dtype, t) for t in TOKEN_COUNTS)
    tokens = TOKEN_COUNTS[1] - TOKEN_COUNTS[0]
    slope = lambda big, little: (big - little) / tokens  # noqa: E731
    keys = ("kernels", "executed", "loads")
    entry = {key: {} for key in keys} | {"torch": 0.0, "rereads": {}}
    for phase in ("forward", "backward"):
        names = list(large[phase]["kernels"])
        for key in keys:
            entry[key].update({name: slope(large[phase][key][name], small[phase][key][name]) for name in names})
        for name in names:
            big, little = large[phase]["rereads"][name], small[phase]["rereads"][name]
            by_distance = {str(d): slope(big[d], little[d]) for d in sorted(set(big) | set(little))}
            entry["rereads"][name] = {d: b for d, b in by_distance.items() if b}
        torch_share = slope(large[phase]["torch"], small[phase]["torch"])
        entry["torch"] += torch_share
        entry[phase] = sum(entry["kernels"][name] for name in names) + torch_share
    entry["total"] = entry["forward"] + entry["backward"]
    entry["executed_total"] = sum(entry["executed"].values()) + entry["torch"]
    return entry


def count_all(residuals=VARIANTS, stream_dtypes=tuple(STREAM_DTYPES)):
    """{residual: {stream dtype: entry}}; each entry also has per_split_at_m and
    executed_per_split_at_m, what the split kernels move once per token split (unique, executed),
    per token at M (weight-sized, so outside the slopes; the same whatever the streams, so counted
    once per variant, with fp32 streams)."""
    counts = {}
    for residual in residuals:
        unique, executed = per_split_bytes_per_token_at_m(residual, torch.float32)
        counts[residual] = {name: dict(bytes_per_token(residual, STREAM_DTYPES[name]),
                                       per_split_at_m=unique, executed_per_split_at_m=executed)
                            for name in stream_dtypes}
    return counts


M_LAYERS = 12  # Blocks at M: launches per step are a Block's kernels times this, per micro-step


def kernel_counts(entry):
    """(all, streaming, library, tiny) kernels of a compiled_slope entry, forward and backward together."""
    kinds = collections.Counter()
    for phase_kinds in entry["launches"].values():
        kinds.update(phase_kinds)
    return kinds.total(), kinds["streaming"], kinds["library"], kinds["tiny"]


def reference_markdown(residuals, stream_dtypes):
    """The reference path compiled: per connection (compiled_bytes_per_token) and per Block
    (compiled_block_bytes_per_token), its kernels by kind, the launches of a step at M, and the bytes
    per token, against the floor and res's Block; eager bytes (reference_bytes_per_token) for comparison."""
    kb = lambda b: f"{b / 1000:.1f}"  # noqa: E731
    lines = ["| residual | streams | kernels (streaming + GEMM + tiny) | launches per step at M | forward KB | "
             "backward KB | total KB | x floor | eager KB | largest compiled kernels KB (their aten ops) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for residual in residuals:
        for name in stream_dtypes:
            floor = budget(STREAM_DTYPES[name])
            eager = reference_bytes_per_token(residual, STREAM_DTYPES[name])
            e = compiled_bytes_per_token(residual, STREAM_DTYPES[name])
            kernels, streaming, library, tiny = kernel_counts(e)
            top = "; ".join(f"{phase} {kb(b)} ({', '.join(ops_made_from[:4])})"
                            for phase, ops_made_from, b in e["kernels"][:3])
            lines.append(f"| {residual} | {name} | {kernels} ({streaming} + {library} + {tiny}) | "
                         f"{kernels * 2 * M_LAYERS} | {kb(e['forward'])} | {kb(e['backward'])} | {kb(e['total'])} | "
                         f"{e['total'] / floor:.2f} | {kb(eager['total'])} | {top} |")
    lines += ["", "In context: one Block (attention, MLP and their two connections) at M's shape, compiled whole, "
              "against res's (fp32 stream); GEMM counts the library calls (the sublayers' GEMMs and attention too):",
              "", "| residual | streams | kernels (streaming + GEMM + tiny) | launches per step at M | forward KB | "
              "backward KB | total KB | x res | more than res per connection KB |",
              "|---|---|---|---|---|---|---|---|---|"]
    res = compiled_block_bytes_per_token("res", torch.float32)
    rows = [("res", "float32", res)] + [(residual, name, compiled_block_bytes_per_token(residual, STREAM_DTYPES[name]))
                                        for name in stream_dtypes for residual in residuals]
    for residual, name, e in rows:
        kernels, streaming, library, tiny = kernel_counts(e)
        lines.append(f"| {residual} | {name} | {kernels} ({streaming} + {library} + {tiny}) | {kernels * M_LAYERS} | "
                     f"{kb(e['forward'])} | {kb(e['backward'])} | {kb(e['total'])} | "
                     f"{e['total'] / res['total']:.2f} | {kb((e['total'] - res['total']) / 2)} |")
    return "\n".join(lines)


def markdown(counts):
    kb = lambda b: "-" if b is None else f"{b / 1000:.1f}"  # noqa: E731
    kernel_names = list(dict.fromkeys(k for per_dtype in counts.values() for e in per_dtype.values()
                                      for k in e["kernels"]))  # in launch order
    header = ["residual", "streams", "forward KB", "backward KB", "total KB", "floor KB", "executed KB",
              *[f"{k.removesuffix('_kernel')} KB, executed" for k in kernel_names], "torch KB",
              "once per split at M KB, executed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for residual, per_dtype in counts.items():
        for dtype_name, e in per_dtype.items():
            row = [residual, dtype_name, kb(e["forward"]), kb(e["backward"]), kb(e["total"]),
                   kb(budget(STREAM_DTYPES[dtype_name])), kb(e.get("executed_total")),
                   *[f"{kb(e['kernels'].get(k, 0))}, {kb(e.get('executed', {}).get(k))}" for k in kernel_names],
                   kb(e["torch"]), f"{kb(e['per_split_at_m'])}, {kb(e['executed_per_split_at_m'])}"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def comma_list(valid):
    def parse(text):
        items = [item for item in text.split(",") if item]
        unknown = [item for item in items if item not in valid]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(valid)}, got '{text}'")
        return tuple(items)
    return parse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the counts to this JSON file")
    parser.add_argument("--residuals", type=comma_list(VARIANTS), default=VARIANTS)
    parser.add_argument("--reference", action="store_true",
                        help="count the reference path (residuals.py: its aten ops eager, its kernels compiled) "
                             "instead of the fused kernels")
    parser.add_argument("--stream_dtypes", type=comma_list(tuple(STREAM_DTYPES)), default=tuple(STREAM_DTYPES))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("needs TRITON_INTERPRET=1 (unset, or set to 1)")
    import triton
    problem = version_problem(triton.__version__)
    if problem:
        parser.error(problem)
    if args.reference:
        print(f"The reference path per connection, n = {N_STREAMS}, C = {WIDTH}, bf16 autocast, compiled: every kernel "
              f"inductor's CUDA backend makes (streaming: >= C bytes per token; GEMM: a library call; tiny: the rest), "
              f"its input and output buffers once each, per token (1 KB = 1000 bytes; floor 7 nCs + 16 C); eager, "
              f"every aten op's inputs + outputs:\n")
        print(reference_markdown(args.residuals, args.stream_dtypes))
        return
    counts = count_all(args.residuals, args.stream_dtypes)
    print(f"Bytes per token per connection, n = {N_STREAMS}, C = {WIDTH}, bf16 autocast, bf16 branch output "
          f"(1 KB = 1000 bytes; floor 7 nCs + 16 C); unique (each address once per launch) and executed "
          f"(every load and store at the shipped tiles):\n")
    print(markdown(counts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(counts, f, indent=1)


if __name__ == "__main__":
    main()
