"""Where a process runs: its place in the run (torchrun's rank and world size, the process group,
its device), its autocast, a synchronisation point for timing, and its peak FLOP/s for MFU. `cfg`
is anything with train.py's `parallel`, `device`, `dtype` and `peak_flops` settings (a TrainConfig,
or a benchmark's parsed flags). It sits below the config: a setting this machine cannot serve is a
DeviceError, which train.py reports as it reports a bad setting (one `error:` line, exit 2)."""

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DeviceError(ValueError):
    """This device cannot run what the settings ask for."""


# Dense bf16 tensor-core peak FLOP/s for MFU, matched against the GPU name in this order.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_context(cfg, device):
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "float32":
        return dtype, contextlib.nullcontext()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("this GPU does not support bfloat16; use --dtype=float32")
    return dtype, torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def peak_flops(cfg, device, dtype):
    """Peak FLOP/s of one device for MFU, or None where MFU is not reported (CPU, unknown GPU)."""
    if cfg.peak_flops is not None:
        return cfg.peak_flops
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS if key in name), None)



@dataclass(frozen=True)
class World:
    """This process's place in the run: under torchrun with a process group (distributed) or a
    plain process, its rank, the number of processes, its device, and whether the model is sharded
    (FSDP2) instead of replicated (DDP)."""
    distributed: bool
    rank: int
    size: int
    device: torch.device
    sharded: bool = False

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(cfg):
    """The World from torchrun's environment variables (one process without them)."""
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.parallel == "fsdp" and not distributed:
        raise DeviceError("--parallel=fsdp runs under torchrun, e.g. torchrun --standalone --nproc_per_node=1 "
                          "train.py ...")
    rank = int(os.environ["RANK"]) if distributed else 0
    world_size = int(os.environ["WORLD_SIZE"]) if distributed else 1
    if cfg.gradient_accumulation_steps % world_size:
        raise DeviceError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible "
                          f"by the world size {world_size}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    elif cfg.device == "cuda":  # set_device needs an index: torchrun's local rank, else the first GPU
        device = torch.device(f"cuda:{local_rank}")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device '{cfg.device}' asks for CUDA, which is not available here; use --device=cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if distributed:
        store = attempt_store(rank, world_size) if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size)
    return World(distributed, rank, world_size, device, sharded=cfg.parallel == "fsdp")


def attempt_store(rank, world_size):
    """torchrun's store, which it keeps across restarts and shares with the workers, seen under a
    key prefix of this attempt's own, so that restarted workers never read the gloo/NCCL addresses
    a previous attempt left there (pytorch/pytorch#135712). torchrun's restart counts can differ
    between nodes, so the ranks agree on the prefix through the store: rank 0 takes a new attempt
    number and gives it to every ticket the other ranks draw, until all of them have joined."""
    timeout = dist.default_pg_timeout
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    if rank == 0:
        attempt = store.add("attempts", 1)
        answered = store.add("answered_tickets", 0)
        deadline = time.monotonic() + timeout.total_seconds()
        while store.add(f"attempt{attempt}/joined", 0) < world_size - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {store.add(f'attempt{attempt}/joined', 0) + 1} of {world_size} ranks "
                                   f"joined attempt {attempt} in {timeout}")
            tickets = store.add("tickets", 0)  # stale tickets of dead processes get an answer nobody reads
            for ticket in range(answered + 1, tickets + 1):
                store.set(f"ticket{ticket}", str(attempt))
            answered = store.add("answered_tickets", tickets - answered)
            time.sleep(0.01)
    else:
        attempt = int(store.get(f"ticket{store.add('tickets', 1)}"))  # waits for rank 0's answer
        store.add(f"attempt{attempt}/joined", 1)
    return dist.PrefixStore(f"attempt{attempt}/", store)


@contextlib.contextmanager
def tf32_matmuls():
    """As nanoGPT: float32 matmuls on CUDA run on TF32 tensor cores, which touches only float32
    work outside bf16 autocast. mhclite's H_res stays exactly doubly stochastic: residuals.py
    combines the permutation matrices without a matmul. The previous flags come back on exit, so
    an in-process caller (a test) keeps its own precision."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
