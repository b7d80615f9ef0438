"""Memory and parallelism techniques applied from outside to a plain GPT (model.py), one small
function each, as torchtitan's parallelize does. train.py calls them in this order: build the GPT,
checkpoint its blocks' activations (apply_ac), compile it block by block, then shard it
(apply_fsdp) or wrap it in DDP. model.py and residuals.py never import this file: the model a user
copies stays a plain nn.Module.
"""

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


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
    before. A sharded checkpoint stores them so; checkpoint.py reads them back into plain models."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))
