"""What a checkpoint holds, said by its parts (torchtitan's Stateful states): each state's
state_dict() gives its items of the checkpoint, and load_state_dict(checkpoint) continues from
them. A checkpoint is the union of its states' items, plus the run's settings (config) and its data
files' identity (data_files), which the manager adds. Only tensors and plain Python values, so a
one-file checkpoint loads with torch.load(weights_only=True). A sharded model's and optimizer's
items are DTensors, which the sharded format writes through DCP, each rank its shards.

    model      ModelState      the model's weights (unwrapped) and its settings (model_args)
    optimizer  OptimizerState  AdamW's state
    train      TrainState      the optimizer steps done, the best val loss, the data position
    rng        RNGState        every rank's RNG states
"""

import dataclasses
import math
import random

import numpy as np
import torch
import torch.distributed as dist

from checkpoint.files import CheckpointError
from checkpoint.resume import check_same_model, optimizer_settings


def is_sharded(model):
    """Whether the model's parameters are DTensors (parallelize.apply_fsdp)."""
    return any(hasattr(p, "device_mesh") for p in model.parameters())


class ModelState:
    """The model's weights and its settings: any nn.Module whose `config` is a dataclass."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        if is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            weights = get_model_state_dict(self.model)
        else:
            weights = self.model.state_dict()
        return dict(model=weights, model_args=dataclasses.asdict(self.model.config))

    def check(self, ckpt, path):
        """Refuse a checkpoint of another model; settings it predates take this model's defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self.model.config)}
        check_same_model(ckpt, dataclasses.asdict(self.model.config), defaults, path)

    def load_state_dict(self, ckpt):
        if is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            set_model_state_dict(self.model, ckpt["model"])
        else:
            self.model.load_state_dict(ckpt["model"])


class OptimizerState:
    """The optimizer's state. Loading it keeps this run's weight decay and betas (a resume may
    change them); a checkpoint without one (written from a sharded checkpoint for reading) is
    refused."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        if not is_sharded(self.model):
            return dict(optimizer=self.optimizer.state_dict())
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        fresh = not self.optimizer.state
        state = get_optimizer_state_dict(self.model, self.optimizer)
        if fresh:  # get_optimizer_state_dict built the state with one zero-gradient step: AdamW's state before any step
            for param_state in self.optimizer.state.values():
                param_state["step"].zero_()
        return dict(optimizer=state)

    def check(self, ckpt, path):
        if "optimizer" not in ckpt:
            raise CheckpointError(f"{path} holds weights only (written from a sharded checkpoint for reading); "
                                  f"continue the run from its ckpt.dcp with --parallel=fsdp")

    def load_state_dict(self, ckpt):
        with optimizer_settings(self.optimizer):
            if is_sharded(self.model):
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
                set_optimizer_state_dict(self.model, self.optimizer, ckpt["optimizer"])
            else:
                self.optimizer.load_state_dict(ckpt["optimizer"])


@dataclasses.dataclass
class TrainState:
    """The optimizer steps done, the best val loss, and the training-batch generator as the data
    position (data_state)."""
    train_generator: torch.Generator
    step: int = 0
    best_val_loss: float = math.inf

    def state_dict(self):
        return dict(step=self.step, best_val_loss=self.best_val_loss,
                    data_state=dict(train_generator=self.train_generator.get_state()))

    def load_state_dict(self, ckpt):
        self.train_generator.set_state(ckpt["data_state"]["train_generator"])
        self.step, self.best_val_loss = ckpt["step"], ckpt["best_val_loss"]


class RNGState:
    """Every rank's RNG states (Python, numpy, torch, CUDA), gathered to be saved; a rank continues
    from its own, or from rank % saved ranks when the world size changed."""

    def __init__(self, world):
        self.world = world

    def state_dict(self):
        states = [rng_state(self.world.device)]
        if self.world.distributed:
            states = [None] * self.world.size
            dist.all_gather_object(states, rng_state(self.world.device))
        return dict(rng=states)

    def load_state_dict(self, ckpt):
        set_rng_state(ckpt["rng"][self.world.rank % len(ckpt["rng"])], self.world.device)


def rng_state(device):
    """This process's RNG states as tensors and plain values (loadable with weights_only)."""
    _, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    return dict(python=random.getstate(),
                numpy=dict(keys=torch.from_numpy(np_keys.astype(np.int64)), pos=np_pos,
                           has_gauss=np_has_gauss, cached_gaussian=np_cached),
                torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(state, device):
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
