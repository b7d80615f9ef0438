"""Memory and parallelism techniques applied to a plain GPT from outside, one small function each
(torchtitan's shape): train.py calls them in order on the model that model.py builds, so the model
a user copies stays a plain nn.Module.
"""

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
