"""Train a GPT with a switchable residual connection (res, hc, mhc, mhclite); the paper's setup.

One GPU or CPU:   python train.py configs/owt.py configs/S.py configs/mhclite.py
8 GPUs (DDP):     torchrun --standalone --nproc_per_node=8 train.py configs/owt.py configs/M.py configs/mhc.py
Resume:           the same command plus --init_from=resume (continues the exact trajectory)
All settings:     python train.py --help

Config files are applied left to right, then --key=value overrides (see config.py).

Data: every optimizer step draws its global batch, batch_size * gradient_accumulation_steps
sequences, from one generator seeded with `seed` that every rank advances identically; rank r
trains on rows [r * accum, (r + 1) * accum) of it, accum = gradient_accumulation_steps / world
size. So the global batch of a step is the same set of sequences on 1 GPU or 8, and the
generator state saved in the checkpoint is the data position for any world size. Evaluation uses
a fixed set of eval_iters batches per split, drawn once from their own seeded generators and
shared out over the ranks, so successive evals (and resumed runs) measure the same data.

Metrics: rank 0 writes one JSON line per step and per eval to <out_dir>/metrics.jsonl. Per-step
loss and grad norm stay on the device until every log_interval steps (and before each eval or
checkpoint), when they are copied to the host in one go; step_ms and tokens_per_s are the
wall-clock average over those steps, the only points where the host waits for the device.
The first optimizer step of every process (a fresh start or a resume) compiles the model under
torch.compile, so it is timed on its own, between two device synchronizations, and logged once
as {"step": s, "first_step_s": seconds, "compiled": bool} next to its step's ordinary record.
The window holding it averages its other steps only; a window holding nothing else (log_interval
1) logs null tokens_per_s, step_ms and mfu. The console shows the first step's time on its own line.

Stopping: SIGTERM or SIGINT lets the current step finish, saves a checkpoint and exits with code
128 + signal number (143 for SIGTERM, 130 for SIGINT), so a calling script can stop too. Under
torchrun the launcher passes the signal on, kills workers still saving after 30 s, and exits 1.
A non-finite loss or gradient norm (seen when the step metrics reach the host, at most
log_interval steps later; every checkpoint save waits for that check) stops the run with exit
code 1, so ckpt.pt stays the last good checkpoint. Bad input exits with code 2 and one `error:`
line. A finished run leaves the marker file <out_dir>/done.
"""

import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (CheckpointError, check_same_model, check_same_run, load_checkpoint, remove_stale_temp_files,
                        save_checkpoint)
from config import ConfigError, TrainConfig, load_config
from model import GPT, GPTConfig, compile_model, connection_path_line, model_shape

GPT2_PADDED_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 64
PREPARE_COMMANDS = {
    "openwebtext": "python prepare_openwebtext.py",
    "fineweb_edu": "python prepare_fineweb_edu.py",
    "shakespeare": "python prepare_shakespeare.py",
    "shakespeare_char": "python prepare_shakespeare.py --tokenizer char",
}
# Dense bf16 tensor-core peak FLOP/s for MFU, matched against the GPU name in this order.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
# Generator streams derived from the seed: training batches and the two fixed eval sets.
TRAIN_STREAM, EVAL_STREAMS = 0, {"train": 1, "val": 2}


class DataError(Exception):
    """Missing or unusable data files."""


class NonFiniteError(Exception):
    """The loss or gradient norm became NaN or infinite."""


# ----------------------------------------------------------------------------------------------
# Distributed setup and devices


def setup_distributed(cfg):
    """(ddp, rank, world_size, device) from torchrun's environment variables."""
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ["RANK"]) if ddp else 0
    world_size = int(os.environ["WORLD_SIZE"]) if ddp else 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    elif cfg.device == "cuda" and ddp:
        device = torch.device(f"cuda:{local_rank}")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{cfg.device}' asks for CUDA, which is not available here; use --device=cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return ddp, rank, world_size, device


@contextlib.contextmanager
def tf32_matmuls():
    """As nanoGPT: float32 matmuls and convolutions on CUDA run on TF32 tensor cores (10-bit
    mantissa operands, fp32 accumulation). That touches only float32 work outside bf16 autocast,
    e.g. --dtype=float32 on Ampere or newer. mhclite's H_res stays exactly doubly stochastic:
    residuals.py combines the permutation matrices without a matmul. The previous flags come
    back on exit, so an in-process caller (a test) keeps its own precision."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_context(cfg, device):
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "float32":
        return dtype, contextlib.nullcontext()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU does not support bfloat16; use --dtype=float32")
    return dtype, torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def peak_flops(cfg, device, dtype):
    """Peak FLOP/s of one device for MFU, or None where MFU is not reported (CPU, unknown GPU)."""
    if cfg.peak_flops is not None:
        return cfg.peak_flops
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS if key in name), None)


# ----------------------------------------------------------------------------------------------
# Data


def check_data(cfg):
    """Paths of the two splits and the model vocabulary size, or a DataError naming the fix."""
    folder = os.path.join(cfg.data_dir, cfg.dataset)
    paths = {split: os.path.join(folder, f"{split}.bin") for split in ("train", "val")}
    meta_path = os.path.join(folder, "meta.json")
    missing = [p for p in (paths["train"], paths["val"], meta_path) if not os.path.isfile(p)]
    if missing:
        command = PREPARE_COMMANDS.get(cfg.dataset, "a prepare script that writes nanoGPT-format data")
        raise DataError(f"missing data file {missing[0]}; run `{command}` (or set --data_dir)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        vocab_size = GPT2_PADDED_VOCAB if meta["tokenizer"] == "gpt2" else int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta_path} is not a valid meta.json ({type(e).__name__}: {e})") from None
    for path in paths.values():
        n_tokens = os.path.getsize(path) // 2
        if n_tokens < cfg.block_size + 1:
            raise DataError(f"{path} holds {n_tokens} tokens, fewer than block_size + 1 = {cfg.block_size + 1}; "
                            f"lower --block_size or use a larger corpus")
    return paths, vocab_size


def make_generator(seed, stream):
    """A CPU generator for one data stream of this seed (independent of rank and world size)."""
    derived = int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])
    return torch.Generator().manual_seed(derived)


def draw_offsets(generator, path, block_size, n_sequences):
    """Start positions of n_sequences random windows of block_size + 1 tokens."""
    n_tokens = os.path.getsize(path) // 2
    return torch.randint(n_tokens - block_size, (n_sequences,), generator=generator)


def step_offsets(generator, path, cfg, rank, world_size):
    """This rank's share of one optimizer step's global batch, as (micro-steps, batch_size)
    window starts. Every rank draws the whole global batch, so the generator advances the same
    way everywhere and the global batch does not depend on the world size."""
    accum = cfg.gradient_accumulation_steps // world_size
    offsets = draw_offsets(generator, path, cfg.block_size, cfg.gradient_accumulation_steps * cfg.batch_size)
    return offsets.view(cfg.gradient_accumulation_steps, cfg.batch_size)[rank * accum:(rank + 1) * accum]


def get_batch(path, offsets, block_size, device):
    """Inputs and next-token targets (B, block_size) for the windows starting at offsets."""
    data = np.memmap(path, dtype=np.uint16, mode="r")  # re-opened per batch: avoids a memmap leak
    starts = offsets.tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in starts])
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# ----------------------------------------------------------------------------------------------
# Schedule, evaluation, metrics


def get_lr(it, cfg):
    """Learning rate of optimizer step `it` (0-based): linear warmup, then cosine to min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def evaluate(model, eval_sets, cfg, ctx, device, ddp, rank, world_size):
    """Mean loss over each split's fixed eval batches; the ranks share the batches out."""
    model.eval()
    losses = {}
    for split, (path, offsets) in eval_sets.items():
        total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batch count
        for i in range(rank, cfg.eval_iters, world_size):
            x, y = get_batch(path, offsets[i], cfg.block_size, device)
            with ctx:
                _, loss = model(x, y)
            total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=device)])
        if ddp:
            dist.all_reduce(total)
        losses[split] = (total[0] / total[1]).item()
    model.train()
    return losses


class MetricsWriter:
    """metrics.jsonl on rank 0 (a no-op elsewhere), plus wandb when asked for."""

    def __init__(self, path, active, resume_step, wandb_run):
        self.path, self.active, self.wandb_run = path, active, wandb_run
        if not active:
            return
        kept = []
        if resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by a crash
                    if isinstance(record, dict) and record.get("step", math.inf) <= resume_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        tmp_path = path + ".tmp"
        with open(tmp_path, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp_path, path)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, records):
        if not self.active:
            return
        for record in records:
            self.file.write(json.dumps(record) + "\n")
            if self.wandb_run is not None:
                # nulls (mfu on CPU, a first step's window) are left out, not drawn as gaps
                self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None},
                                   step=record["step"])
        self.file.flush()

    def close(self):
        if self.active:
            self.file.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()


def flush_steps(pending, window_start, timed_steps, tokens_per_step, mfu_of):
    """Copy the pending per-step tensors to the host (one sync) and turn them into metrics
    records. The window's wall time since window_start covers `timed_steps` of the pending steps
    (all but a first step, which is timed on its own); with none, the timings are None.
    Returns (records, bad): bad is the first non-finite step's record (None if all are finite)
    and records are the steps before it, which are still worth writing."""
    values = torch.stack([torch.stack([loss.float(), norm.float()]) for _, _, loss, norm in pending]).tolist()
    step_s = (time.perf_counter() - window_start) / timed_steps if timed_steps else None
    timings = (dict(tokens_per_s=tokens_per_step / step_s, step_ms=1000 * step_s, mfu=mfu_of(step_s)) if step_s is not None
               else dict(tokens_per_s=None, step_ms=None, mfu=None))
    records = []
    for (step, lr, _, _), (loss, norm) in zip(pending, values):
        record = dict(step=step, train_loss=loss, lr=lr, grad_norm=norm, **timings)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return records, record
        records.append(record)
    return records, None


# ----------------------------------------------------------------------------------------------
# Checkpoints and signals


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


class StopFlag:
    """Records SIGTERM / SIGINT so the loop can stop at the next step boundary; all ranks agree
    on it through a CPU (gloo) all-reduce, which never waits for the GPU."""

    def __init__(self, ddp, device):
        self.signum = 0
        self.group = None
        if ddp:
            self.group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers need it
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self):
        if self.group is None:
            return self.signum
        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def restore(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


# ----------------------------------------------------------------------------------------------
# The run


def log(message):
    """Print a console line. The console may be a pipe whose reader died with us (tee under a
    Ctrl-C); a lost log line must not stop the checkpoint that follows it."""
    try:
        print(message, flush=True)
    except OSError:
        pass


def build_model_config(cfg, vocab_size):
    shape = model_shape(cfg.size)
    for key in ("n_layer", "n_head", "n_embd"):
        if getattr(cfg, key) is not None:
            shape[key] = getattr(cfg, key)
    return GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, dropout=cfg.dropout, bias=cfg.bias,
                     residual=cfg.residual, n_streams=cfg.n_streams, mhclite_perms=cfg.mhclite_perms,
                     mhclite_perm_sampling=cfg.mhclite_perm_sampling, perm_seed=cfg.perm_seed,
                     sinkhorn_iters=cfg.sinkhorn_iters, recompute_connections=cfg.recompute_connections,
                     stream_dtype=cfg.stream_dtype, fused_connections=cfg.fused_connections,
                     final_norm=cfg.final_norm, rms_eps=cfg.rms_eps, sinkhorn_order=cfg.sinkhorn_order,
                     init_stream=cfg.init_stream, init_stream_seed=cfg.seed if cfg.init_stream == "drawn" else 0,
                     connection_weight_decay=cfg.connection_weight_decay, h_res_dtype=cfg.h_res_dtype,
                     mixing_dtype=cfg.mixing_dtype, **shape)


def import_wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError("wandb_log=True needs wandb: pip install wandb") from None
    return wandb


def start_wandb(wandb, cfg):
    try:
        return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))
    except Exception as e:  # wandb has its own error types for no login, no network, bad settings
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"wandb.init failed ({reason}); set WANDB_MODE=offline to log locally, "
                          f"or drop --wandb_log") from None


def run(cfg):
    """Train according to cfg; returns the process exit code (0, or 128 + signal number)."""
    ddp, rank, world_size, device = setup_distributed(cfg)
    try:
        with tf32_matmuls():
            return train(cfg, ddp, rank, world_size, device)
    finally:
        if ddp:
            dist.destroy_process_group()


def train(cfg, ddp, rank, world_size, device):
    master = rank == 0
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible "
                          f"by the world size {world_size}")
    accum = cfg.gradient_accumulation_steps // world_size
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    paths, vocab_size = check_data(cfg)
    wandb = import_wandb() if cfg.wandb_log and master else None  # fail before any work
    dtype, ctx = autocast_context(cfg, device)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    done_path = os.path.join(cfg.out_dir, "done")

    ckpt = None
    if cfg.init_from == "resume":
        ckpt = load_checkpoint(ckpt_path)
        check_same_run(ckpt, asdict(cfg), ckpt_path)
        saved = ckpt["config"]
        if master and saved["lr_decay_iters"] != cfg.lr_decay_iters:
            log(f"note: resuming with lr_decay_iters={cfg.lr_decay_iters} (max_iters={cfg.max_iters}) where the "
                f"checkpoint's run had lr_decay_iters={saved['lr_decay_iters']} (max_iters={saved['max_iters']}): "
                f"the cosine schedule's horizon moves; pass --lr_decay_iters={saved['lr_decay_iters']} "
                f"to keep the old schedule")
    elif os.path.exists(ckpt_path):
        raise ConfigError(f"{ckpt_path} exists; continue it with --init_from=resume or pick another --out_dir")

    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)  # rank 0 initialises the model; DDP copies its weights
    try:
        raw_model = GPT(build_model_config(cfg, vocab_size))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_args = asdict(raw_model.config)
    if ckpt is not None:
        check_same_model(ckpt, model_args, ckpt_path)
        raw_model.load_state_dict(ckpt["model"])
    raw_model.to(device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                               device.type)
    train_generator = make_generator(cfg.seed, TRAIN_STREAM)
    step, best_val_loss = 0, math.inf
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        train_generator.set_state(ckpt["data_state"]["train_generator"])
        rng_states = ckpt["rng"]
        set_rng_state(rng_states[rank % len(rng_states)], device)
        step, best_val_loss = ckpt["step"], ckpt["best_val_loss"]
        del ckpt
    eval_sets = {split: (paths[split], draw_offsets(make_generator(cfg.seed, stream), paths[split],
                                                    cfg.block_size, cfg.eval_iters * cfg.batch_size)
                         .view(cfg.eval_iters, cfg.batch_size))
                 for split, stream in EVAL_STREAMS.items()}

    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and device.type == "cuda")
    model = compile_model(raw_model, cfg.compile_mode) if use_compile else raw_model
    train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if ddp else model

    peak = peak_flops(cfg, device, dtype)

    def mfu_of(step_s):
        return raw_model.estimate_mfu(tokens_per_step, step_s, peak * world_size) if peak else None

    connections = raw_model.connection_path(device)  # fused kernels or residuals.py, and why
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(asdict(cfg), connections=connections), f, indent=2)
        if os.path.exists(done_path) and step < cfg.max_iters:
            os.remove(done_path)
        removed, freed = remove_stale_temp_files(ckpt_path)
        if removed:
            log(f"removed {removed} stale checkpoint temp file(s) in {cfg.out_dir} ({freed / 1e6:.1f} MB), "
                f"left by a save that was killed")
        log(f"{cfg.residual} {cfg.size}: {raw_model.get_num_params() / 1e6:.2f}M parameters, "
            f"{tokens_per_step:,} tokens/step on {world_size} x {device.type} ({dtype}), "
            f"{'resuming at' if step else 'starting at'} step {step} of {cfg.max_iters} -> {cfg.out_dir}")
        log(connection_path_line(cfg.residual, connections))
    wandb_run = start_wandb(wandb, cfg) if wandb is not None else None
    metrics = MetricsWriter(os.path.join(cfg.out_dir, "metrics.jsonl"), master,
                            step if cfg.init_from == "resume" else None, wandb_run)
    stop = StopFlag(ddp, device)

    saved_step = step if cfg.init_from == "resume" else None  # step of the checkpoint on disk

    def save(step):
        states = [None] * world_size if ddp else None
        if ddp:
            dist.all_gather_object(states, rng_state(device))
        if master:
            save_checkpoint(ckpt_path, dict(
                model=raw_model.state_dict(), model_args=model_args, config=asdict(cfg),
                optimizer=optimizer.state_dict(), step=step, best_val_loss=best_val_loss,
                rng=states if ddp else [rng_state(device)],  # one entry per rank
                data_state=dict(train_generator=train_generator.get_state())))

    def kept_checkpoint():
        if saved_step is None:
            return "no checkpoint was saved"
        return f"{ckpt_path} keeps the last good checkpoint (step {saved_step})"

    def run_eval(step):
        nonlocal best_val_loss
        losses = evaluate(model, eval_sets, cfg, ctx, device, ddp, rank, world_size)
        if not all(math.isfinite(v) for v in losses.values()):
            raise NonFiniteError(f"non-finite eval loss at step {step} ({losses}); stopping, {kept_checkpoint()}")
        metrics.write([dict(step=step, eval_train_loss=losses["train"], val_loss=losses["val"])])
        if master:
            log(f"eval step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        improved = losses["val"] < best_val_loss
        best_val_loss = min(best_val_loss, losses["val"])
        if improved or cfg.always_save_checkpoint:
            save(step)
            return True
        return False

    try:
        if cfg.init_from == "scratch" and run_eval(0):
            saved_step = 0
        pending, untimed = [], 0  # untimed: 1 while the window holds the first step
        first_step = True
        window_start = time.perf_counter()
        while step < cfg.max_iters:
            if first_step:  # it compiles (and warms up): timed apart from the step timings
                synchronize(device)
                first_step_start = time.perf_counter()
            lr = get_lr(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = step_offsets(train_generator, paths["train"], cfg, rank, world_size)
            loss_sum = torch.zeros((), device=device)
            x, y = get_batch(paths["train"], rows[0], cfg.block_size, device)
            for micro in range(accum):
                last_micro = micro == accum - 1
                # DDP averages gradients over the ranks only on the last micro-step
                with train_model.no_sync() if ddp and not last_micro else contextlib.nullcontext():
                    with ctx:
                        _, loss = train_model(x, y)
                    if step + 1 == cfg.debug_nan_at_step:
                        loss = loss * float("nan")
                    if not last_micro:  # fetch the next micro-batch while the device works
                        x, y = get_batch(paths["train"], rows[micro + 1], cfg.block_size, device)
                    (loss / accum).backward()
                loss_sum += loss.detach().float()
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                                       cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ddp:
                dist.all_reduce(loss_sum)
            step += 1
            pending.append((step, lr, loss_sum / cfg.gradient_accumulation_steps, grad_norm))
            if first_step:
                synchronize(device)
                first_step_s = time.perf_counter() - first_step_start
                metrics.write([dict(step=step, first_step_s=first_step_s, compiled=use_compile)])
                if master:
                    log(f"first step {step}: {first_step_s:.2f} s{' (torch.compile included)' if use_compile else ''}; "
                        f"not counted in tok/s, ms/step and mfu")
                first_step, untimed = False, 1
                window_start = time.perf_counter()

            signum = stop.agreed()
            is_eval = step % cfg.eval_interval == 0 or step == cfg.max_iters
            if step % cfg.log_interval == 0 or is_eval or signum:
                records, bad = flush_steps(pending, window_start, len(pending) - untimed, tokens_per_step, mfu_of)
                metrics.write(records)
                if bad is not None:
                    raise NonFiniteError(f"non-finite loss at step {bad['step']} (train_loss={bad['train_loss']}, "
                                         f"grad_norm={bad['grad_norm']}); stopping, {kept_checkpoint()}")
                if master:
                    last = records[-1]
                    mfu = f" | mfu {100 * last['mfu']:.1f}%" if last["mfu"] is not None else ""
                    timing = ("first step only, timed above" if last["step_ms"] is None else
                              f"{last['tokens_per_s']:,.0f} tok/s | {last['step_ms']:.1f} ms/step{mfu}")
                    log(f"step {step}/{cfg.max_iters} | loss {last['train_loss']:.4f} | lr {lr:.2e} | "
                        f"grad norm {last['grad_norm']:.3f} | {timing}")
                pending, untimed = [], 0
                if is_eval and run_eval(step):
                    saved_step = step
                if signum:
                    if saved_step != step:
                        save(step)
                    if master:
                        log(f"stopped by signal {signum} after step {step}; checkpoint saved to {ckpt_path}; "
                            f"continue with --init_from=resume")
                    return 128 + signum
                window_start = time.perf_counter()
        if saved_step != step:
            save(step)
        if master:
            with open(done_path, "w", encoding="utf-8") as f:
                f.write(f"{step}\n")
            log(f"done: step {step}, best val loss {best_val_loss:.4f}, checkpoint {ckpt_path}")
        return 0
    finally:
        stop.restore()
        metrics.close()


def usage():
    lines = [__doc__.strip(), "", "Settings (--key=value) and defaults:"]
    lines += [f"  --{f.name}={f.default}" for f in fields(TrainConfig)]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage())
        return
    try:
        code = run(load_config(argv))
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
