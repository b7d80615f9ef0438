"""How a plain GPT (model.py) runs: techniques applied to it from outside, as torchtitan's
parallelize applies them and Liger-Kernel swaps in its kernels. `parallelize` applies, in this
order: the connections' recompute (apply_connection_recompute), activation checkpointing per block
(apply_ac), the fused Triton kernels (apply_fused_connections), torch.compile (compile_model), then
FSDP2 sharding (apply_fsdp) or DDP. A model too large for one device is built on the meta device,
sharded, then given its weights shard by shard (materialise). model.py and residuals.py never
import this file: the model a user copies stays a plain nn.Module, and none of these settings is
part of what a checkpoint saves as the model.
"""

import functools
import types

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from config import COMPILE_MODES
from model import STREAM_DTYPES
from residuals import HyperConnection, ManifoldHyperConnection, StreamConnection, sinkhorn

SHARED_SINKHORN_TORCH = (2, 13)  # checked against eager there (tests/test_model.py)

# residuals.sinkhorn as a nested compile region: torch.compile compiles it once and every mhc
# connection calls that code, instead of one copy of its 40 log-sum-exps per connection. Eager it
# is plain sinkhorn. Inductor must not reuse buffers around it: it does not know that the region's
# saved-for-backward outputs alias its inputs, and would return wrong gradients.
shared_sinkhorn = torch.compiler.nested_compile_region(sinkhorn)


def shares_compiled_sinkhorn(options) -> bool:
    """Whether compile_model with these torch.compile options gives mhc one compiled Sinkhorn: it
    needs inductor's own options (no `mode`, which excludes them) and a torch where it was checked."""
    return (options.get("backend", "inductor") == "inductor" and "mode" not in options
            and torch.__version__ >= SHARED_SINKHORN_TORCH)


SCALAR_CPU_HC_BACKWARD_BEFORE = (2, 13)  # torch versions before this get cpu_inductor_options (docs/kernels.md)


def cpu_inductor_options(model, options, device=None) -> dict:
    """Inductor options compile_model adds: for hc on CPU before torch 2.13, scalar C++
    (cpp.simdlen 0), because the vectorised code inductor writes for hc's backward there stores
    past a buffer (heap corruption) and scalar code computes it right. device: where the model
    runs (default: where its parameters are)."""
    on_cpu = (device or next(model.parameters()).device).type == "cpu"
    uses_hc = any(isinstance(m, HyperConnection) for m in model.connections())
    if (on_cpu and uses_hc and torch.__version__ < SCALAR_CPU_HC_BACKWARD_BEFORE
            and options.get("backend", "inductor") == "inductor" and "mode" not in options):
        return {"cpp.simdlen": 0}
    return {}


def compile_model(model, mode, device=None, **options):
    """torch.compile the whole model ("model"), or each transformer Block and the output head
    ("blocks", regional compilation). Every Block runs the same code on same-shaped inputs, and its
    per-layer differences are parameter values, so all layers share the code compiled for the first:
    compile time no longer grows with the number of layers. With inductor, mhc's reference-path
    connections also share one compiled Sinkhorn (shared_sinkhorn), with inductor's buffer reuse
    off, which that needs. device: where the model runs (default: where its parameters are; a
    model on the meta device runs elsewhere). options go to torch.compile. Returns what to call
    for forward."""
    device = device or next(model.parameters()).device
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode '{mode}'; valid: {', '.join(COMPILE_MODES)}")
    sinkhorn_users = [m for m in model.connections() if isinstance(m, ManifoldHyperConnection) and not is_fused(m)]
    if sinkhorn_users and shares_compiled_sinkhorn(options):
        for connection in sinkhorn_users:
            connection.sinkhorn_fn = shared_sinkhorn
        options["options"] = {**options.get("options", {}), "allow_buffer_reuse": False}
    scalar_cpu_code = cpu_inductor_options(model, options, device)
    if scalar_cpu_code:
        options["options"] = {**options.get("options", {}), **scalar_cpu_code}
    if mode == "model":
        return torch.compile(model, **options)
    for block in model.transformer.h:
        block.compile(**options)
    model.head = torch.compile(model.head, **options)
    return model


def parallelize(model, device, activation_checkpointing=False, compile_mode=None, shard=False, replicate=False,
                compute_dtype=torch.float32, recompute_connections=False, fused_connections=False):
    """Apply to a plain GPT, in this order: the connections' recompute, activation checkpointing,
    the fused kernels where they can run (connection_path says whether and why), torch.compile
    (compile_mode "model" or "blocks"; None: eager), then FSDP2 sharding in place (shard) or DDP
    (replicate, under a process group). Returns (model, train_model): what evaluation calls, and
    what a training step calls (DDP's wrapper, whose gradient averaging evaluation does not need)."""
    if recompute_connections:
        apply_connection_recompute(model)
    if activation_checkpointing:
        apply_ac(model)
    if fused_connections:
        apply_fused_connections(model, device)
    runner = compile_model(model, compile_mode, device=device) if compile_mode else model
    if shard:  # in place: model's parameters become this rank's shards
        apply_fsdp(model, compute_dtype)
    if replicate:
        return runner, DDP(runner, device_ids=[device.index] if device.type == "cuda" else None)
    return runner, runner


def apply_connection_recompute(model):
    """Each HC-family connection in model (a GPT, or one connection) keeps only its input x for
    backward: its coefficients and the pre-aggregation (StreamConnection.pre) are recomputed there.
    Less memory, the same numbers."""
    for connection in model.modules():
        if isinstance(connection, StreamConnection):
            connection.pre = types.MethodType(_recomputed_pre, connection)
    return model


def _recomputed_pre(connection, x):
    pre = functools.partial(type(connection).pre, connection)
    if torch.is_grad_enabled():
        return checkpoint(pre, x, use_reentrant=False)
    return pre(x)


def connection_path(model, device, fused_connections) -> dict:
    """Which code runs the model's connections on `device`: {"path": "fused" or "reference",
    "why": the reason}, decided from a stream tensor of the dtype the model's forward gives them."""
    if not fused_connections:
        return dict(path="reference", why="fused_connections=False")
    import fused  # the kernels' package, imported only when asked for
    config = model.config
    dtype = STREAM_DTYPES[config.stream_dtype] if config.residual != "res" else torch.float32
    x = torch.empty(0, 1, config.n_streams, config.n_embd, dtype=dtype, device=device)
    reason = fused.unsupported_reason(model.connections()[0], x)
    if reason is not None:
        return dict(path="reference", why=f"fused_connections=True but: {reason}")
    engine = "Triton" if x.device.type == "cuda" else "Triton interpreter"
    return dict(path="fused", why=f"{engine}, n={config.n_streams}")


def connection_path_line(residual, path) -> str:
    """One console line, e.g. `connections: mhclite fused (Triton, n=4)`."""
    return f"connections: {residual} {path['path']} ({path['why']})"


def apply_fused_connections(model, device) -> dict:
    """Swap every connection's forward for the fused kernels' (fused.connection_forward) when
    connection_path finds that they can run here; the parameters, and so the state dict, stay the
    connection's own. A call the kernels cannot take (another dtype, say) runs residuals.py's
    forward. Returns connection_path's answer."""
    path = connection_path(model, device, fused_connections=True)
    if path["path"] == "fused":
        for connection in model.connections():
            connection.forward = types.MethodType(_fused_forward, connection)
    return path


def _fused_forward(connection, x, branch):
    import fused
    if fused.supported(connection, x):
        return fused.connection_forward(connection, x, branch)
    return type(connection).forward(connection, x, branch)


def is_fused(connection) -> bool:
    """Whether apply_fused_connections swapped this connection's forward."""
    return "forward" in vars(connection)


def apply_ac(model):
    """Activation checkpointing per transformer block: a block keeps only its input for backward
    and recomputes the rest of its forward there. Non-reentrant checkpointing (works under
    torch.compile and FSDP2), with the RNG state replayed so that dropout draws the same masks.
    The wrapper leaves the state dict's keys as they were, so checkpoints do not depend on it."""
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def apply_fsdp(model, compute_dtype=torch.float32):
    """Shard model in place with FSDP2 over the default process group: each rank keeps 1/world of
    every parameter, its gradient and (once the optimizer is built on the sharded parameters) its
    AdamW moments. Returns model.

    Groups, each gathered whole just before it runs: every Block's attention and MLP, the rest of
    the Block (its LayerNorms and its two connections, fused or not: they shard with their block),
    and the root (embeddings, final LayerNorm, LM head). Master weights and the gradient
    reduce-scatter stay float32. With compute_dtype=bfloat16 (train.py keeps bf16 autocast on as
    well) only the attention and MLP weights are gathered in bf16, the operands autocast would give
    their GEMMs anyway, so the arithmetic is autocast's: the connections, the LayerNorms, the
    embeddings and the residual stream keep their float32 parameters and paths, and mhclite's H_res
    stays doubly stochastic to float32 rounding. FSDP casts no activations (cast_forward_inputs off)."""
    # Imported here: FSDP and DTensor are slow to import, and most runs shard nothing.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    keep_fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False)
    gemm_weights = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)
    as_vectors(model)
    # A connection's projection has few rows (n + 2, or 2n + K) and wide ones (C or nC): split by
    # columns, every rank holds whole rows, which the authors' weight decay of some rows needs.
    by_columns = {id(c.proj.weight) for c in model.connections() if hasattr(c, "proj")}

    def placement(param):
        return Shard(1) if id(param) in by_columns else None

    for block in model.transformer.h:
        fully_shard(block.attn, mp_policy=gemm_weights)
        fully_shard(block.mlp, mp_policy=gemm_weights)
        fully_shard(block, mp_policy=keep_fp32, shard_placement_fn=placement)
    fully_shard(model, mp_policy=keep_fp32)
    return model


def as_vectors(model):
    """fully_shard shards 1-D and larger parameters only: each 0-D parameter (the connections'
    scales) becomes a 1-element vector with the same value, which every use broadcasts exactly as
    before. A sharded checkpoint stores them so; checkpoint/sharded.py reads them back into plain models."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def materialise(model, device, seed=None):
    """Give a model built on the meta device and sharded (apply_fsdp) its storage on `device`, its
    buffers, and with a seed the weights one process draws for GPT(config) after
    torch.manual_seed(seed), bit for bit, without ever holding the whole model: each parameter's
    whole value is drawn on the CPU in the order one process draws it, and only this rank's shard
    is kept (peak memory: the shards and the largest parameter). Without a seed (a resume, whose
    checkpoint fills the shards next) nothing is drawn. torch's generator is left as it was."""
    from torch.distributed.tensor import DTensor
    filled = set()

    def keep_shard(param, whole):
        filled.add(id(param))
        whole = whole.reshape(param.shape)  # as_vectors made the 0-D parameters 1-element vectors
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(param, DTensor):  # every rank has the whole value: take its chunk, no communication
            (placement,) = param.placements  # FSDP2 shards one dimension with torch.chunk's split
            chunks = whole.chunk(param.device_mesh.size(), placement.dim)
            rank = param.device_mesh.get_local_rank()
            whole = chunks[rank] if rank < len(chunks) else whole.new_empty(local.shape)
        local.copy_(whole)

    def keep_module(module, built):
        for name, param in built.named_parameters():
            keep_shard(module.get_parameter(name), param)

    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        fresh = model.fresh_connections()  # their proj Linears draw: before the seed
        for connection, built in zip(model.connections(), fresh):
            for name, buffer in built.named_buffers():
                connection.get_buffer(name).copy_(buffer)
        if seed is None:
            return model
        torch.manual_seed(seed)
        for module in model.modules():  # the constructors' values, drawn in their order
            if isinstance(module, nn.Linear):
                built = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            elif isinstance(module, nn.Embedding):
                built = nn.Embedding(module.num_embeddings, module.embedding_dim)
            elif isinstance(module, nn.LayerNorm):
                built = nn.LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                                     bias=module.bias is not None)
            else:
                continue
            keep_module(module, built)
            del built  # before the next one is drawn
        fresh = dict(zip(map(id, model.connections()), fresh))
        for target, init in model.init_steps():
            if isinstance(target, nn.Module):  # a connection: the paper's init, from its fresh copy
                keep_module(target, fresh[id(target)])
            else:
                whole = torch.empty(target.shape, dtype=target.dtype)
                init(whole)
                keep_shard(target, whole)
                del whole  # before the next one is drawn
        missed = [name for name, param in model.named_parameters() if id(param) not in filled]
        if missed:
            raise ValueError(f"materialise does not know how {missed[0]} is initialised")
    return model
