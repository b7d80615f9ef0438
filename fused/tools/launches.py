"""The fused connection kernels' launches, captured from one forward + backward of a connection.

`recorded_launches` installs an ops.launch_hook for the length of a `with` block and keeps each
launch with its arguments, so that

  - resources.py compiles each kernel for a GPU without one, with the argument
    types, alignment and constexprs the model launches it with (recorded without running: no
    Triton interpreter needed, and the outputs stay uninitialised; jit_specialisation turns a
    launch into what triton's JIT would compile), and
  - benchmarks/kernels.py times each launch replayed alone (recorded while running).

`connection_launches` builds a connection as model.py does (`connection_setup`) and runs it the way
a training step does: the branch is a bias-free Linear like the sublayers' c_proj (bf16 output
under bf16 autocast), the incoming gradient has the stream dtype.
"""

import contextlib
from dataclasses import dataclass

import torch

from fused import connection_forward, ops
from config import STREAM_DTYPES
from model import GPTConfig, connection_options
from residuals import RESIDUALS


@dataclass
class Launch:
    kernel: str  # a name ops.kernel() knows
    phase: str  # "forward" or "backward"
    grid: tuple
    device: torch.device
    args: tuple
    constexprs: dict  # keyword arguments: constexprs and launch options such as num_warps

    def replay(self):
        ops.launch(self.kernel, self.grid, self.device, *self.args, **self.constexprs)


class LaunchRecorder:
    def __init__(self):
        self.launches = []
        self.phase = "forward"


@contextlib.contextmanager
def recorded_launches(run=True):
    """Yields a LaunchRecorder whose `launches` fill up with every kernel launch made inside the
    block, tagged with the recorder's current `phase`. run=False records without launching; then
    the ops choose their device-dependent constexprs as for CUDA whatever the tensors' device
    (ops._dot_operands picks the interpreter's stand-in on CPU otherwise)."""
    recorder = LaunchRecorder()

    def record(name, grid, device, args, constexprs, launch):
        recorder.launches.append(Launch(name, recorder.phase, grid, device, args, constexprs))
        if run:
            launch()

    with ops.launch_hook(record, operands_for_cuda=not run):
        yield recorder


def connection_setup(residual, stream_dtype, width, batch, time, device, n_streams=4, seed=0):
    """(connection 0 of a model with this residual, its branch, x, the incoming gradient) on device:
    the module and branch off their zero init, x and the gradient random in the stream dtype."""
    device = torch.device(device)
    config = GPTConfig(residual=residual, n_streams=n_streams, n_embd=width, n_head=1, stream_dtype=stream_dtype)
    generator = torch.Generator().manual_seed(seed)
    module = RESIDUALS[residual](width, n_streams, 0, **connection_options(config))
    branch = torch.nn.Linear(width, width, bias=False)
    with torch.no_grad():  # off the zero init, so that every output and gradient carries values
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
        branch.weight.copy_(torch.randn(width, width, generator=generator) / width ** 0.5)
    module.to(device), branch.to(device)
    shape = (batch, time, n_streams, width)
    x = torch.randn(shape, generator=generator).to(device, STREAM_DTYPES[stream_dtype]).requires_grad_()
    grad = torch.randn(shape, generator=generator).to(device, STREAM_DTYPES[stream_dtype])
    return module, branch, x, grad


def connection_launches(residual, stream_dtype, autocast, width, batch, time, device, run=True, n_streams=4, seed=0):
    """The launches (a list of Launch) of one forward + backward of connection_setup's connection on a
    (batch, time) batch, under bf16 autocast or in float32."""
    module, branch, x, grad = connection_setup(residual, stream_dtype, width, batch, time, device, n_streams, seed)
    with recorded_launches(run) as recorder:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = connection_forward(module, x, branch)
        recorder.phase = "backward"
        out.backward(grad)
    return recorder.launches


# ----------------------------------------------------------------------------------------------
# What triton's JIT compiles for a launch


TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1"}
DIVISIBILITY = [["tt.divisibility", 16]]


def specialise(value, specialize=True, align=True, is_const=False):
    """(type, divisible by 16 or None for a constexpr's value) of one non-constexpr argument, as
    triton's JIT specialises it (triton 3.6 to 3.9: native_specialize_impl and
    BaseBackend.get_*_specialization): a tensor is a pointer to its dtype, divisible when its address
    is 16-byte aligned; an int is i32 (i64 beyond, u64 from 2^63), divisible when it is a multiple
    of 16, and a constexpr when it equals 1; floats are fp32 and bools u1, never specialised."""
    if isinstance(value, torch.Tensor):
        return "*" + ("k" if is_const else "") + TRITON_DTYPES[value.dtype], (
            specialize and align and value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", None
        kind = "i32" if -2**31 <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
        return kind, specialize and align and value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    if value is None:
        return "constexpr", None
    raise TypeError(f"no JIT specialisation for an argument of type {type(value).__name__}")


def jit_specialisation(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) that triton's JIT builds for kernel[grid](*args,
    **kwargs) (runtime/jit.py: create_function_from_signature, JITFunction._pack_args), to pass to
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target, options): the
    signature by parameter name, constexprs and tt.divisibility attributes keyed by (index,),
    options the keyword arguments that are not parameters (num_warps, num_stages, ...)."""
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name] if param.name in values else param.default
        if param.is_constexpr:
            signature[param.name], constexprs[(index,)] = "constexpr", value
            continue
        kind, divisible = specialise(value, not param.do_not_specialize, not param.do_not_specialize_on_alignment,
                                     param.is_const)
        if param.annotation_type:  # the annotation names the type; ints equal to 1 stay arguments
            annotated = param.annotation_type
            unspecialised = annotated == "u1" or annotated[:2] in ("fp", "bf") or kind == "constexpr"
            kind, divisible = annotated, divisible and not unspecialised
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
        elif divisible:
            attrs[(index,)] = DIVISIBILITY
    return signature, constexprs, attrs, options
