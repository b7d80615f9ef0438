"""Train a GPT with a switchable residual connection: res, hc, mhc, mhclite, kromhc or ihc.

One GPU or CPU:  python train.py configs/owt.py configs/S.py configs/mhclite.py
8 GPUs (DDP):    torchrun --standalone --nproc_per_node=8 train.py configs/owt.py configs/M.py configs/mhc.py
8 GPUs, sharded: the same with --parallel=fsdp --compile_mode=blocks (FSDP2; checkpoint ckpt.dcp)
Resume:          the same command plus --init_from=resume (continues the exact trajectory)
Start or resume: --init_from=auto resumes out_dir's newest checkpoint that loads and verifies, starts from
                 scratch in a folder without a run, and exits at once if the run already finished: one
                 command for the first start and every restart (torchrun --max-restarts, a requeued job)

Config files apply left to right, then --key=value overrides (config.py); the batches come from
dataloader.py, the checkpoints go through checkpoint/. Rank 0 writes <out_dir>/metrics.jsonl, ckpt.pt
(with its digest record) and, when finished, the marker file `done`. Exit codes: 0 done (or
nothing to do), 1 non-finite loss, 2 bad input, 3 a checkpoint save failed (a full disk, permissions;
the last good checkpoint is kept), 128 + signal number after SIGTERM or SIGINT (checkpoint saved).
The file `stop` in out_dir stops the run at the next step with a checkpoint and exit code 0.
"""

import contextlib
import json
import math
import os
import random
import secrets
import signal
import sys
import threading
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import (CheckpointError, CheckpointManager, ModelState, OptimizerState, RNGState, RunOwner, SaveError,
                        TrainState)
from config import ConfigError, help_text, load_config, model_settings
from dataloader import (TRAIN_STREAM, DataError, check_data, eval_batches, get_batch, identify, make_generator,
                        step_offsets)
from devices import DeviceError, autocast_context, peak_flops, setup_distributed, synchronize, tf32_matmuls
from model import GPT, GPTConfig
from parallelize import connection_path, connection_path_line, materialise, parallelize

WANDB_ID_FILE = "wandb_run_id"  # in out_dir: the W&B run that restarts continue
STOP_REQUEST_FILE = "stop"  # in out_dir: stop at the next step boundary, save, exit 0
STOP_REQUESTED = -1  # StopFlag.agreed() for the request file; signals are positive


class NonFiniteError(Exception):
    """The loss or gradient norm became NaN or infinite."""


# ----------------------------------------------------------------------------------------------
# The training step


def get_lr(it, cfg):
    """Learning rate of optimizer step `it` (0-based): linear warmup, then cosine to min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def train_step(train_model, model, optimizer, path, offsets, lr, ctx, cfg, world):
    """One optimizer step on this rank's micro-batches (window starts `offsets`): forward and
    backward with gradient accumulation through train_model (parallelized), clipping over the
    plain model's parameters, the update. Returns the step's mean loss over all ranks and the
    gradient norm before clipping, both left on the device."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    accum = len(offsets)
    loss_sum = torch.zeros((), device=world.device)
    x, y = get_batch(path, offsets[0], cfg.block_size, world.device)
    for micro in range(accum):
        last_micro = micro == accum - 1
        with gradient_sync(train_model, world, last_micro):
            with ctx:
                _, loss = train_model(x, y)
            if not last_micro:  # fetch the next micro-batch while the device works
                x, y = get_batch(path, offsets[micro + 1], cfg.block_size, world.device)
            (loss / accum).backward()
        loss_sum += loss.detach().float()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if world.sharded:  # the norm over every rank's shard, as a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world.distributed:
        dist.all_reduce(loss_sum)
    return loss_sum / cfg.gradient_accumulation_steps, grad_norm


def gradient_sync(train_model, world, last_micro):
    """The context of one micro-step's forward and backward: DDP averages the gradients over the
    ranks, and FSDP reduce-scatters them into each rank's shard, on the last micro-step only."""
    if world.sharded:
        train_model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()
    return train_model.no_sync() if world.distributed and not last_micro else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Evaluation and checkpoints


@torch.no_grad()
def evaluate(model, eval_sets, ctx, cfg, world):
    """Mean loss over each split's fixed eval batches; the ranks share the batches out. A sharded
    model gathers its weights with every rank at each forward, so there every rank runs the same
    number of forwards, a rank without a batch left repeating one and not counting it."""
    model.eval()
    losses = {}
    end = math.ceil(cfg.eval_iters / world.size) * world.size if world.sharded else cfg.eval_iters
    for split, (path, offsets) in eval_sets.items():
        total = torch.zeros(2, dtype=torch.float64, device=world.device)  # loss sum, batch count
        for i in range(world.rank, end, world.size):
            x, y = get_batch(path, offsets[i % cfg.eval_iters], cfg.block_size, world.device)
            with ctx:
                _, loss = model(x, y)
            if i < cfg.eval_iters:
                total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=world.device)])
        if world.distributed:
            dist.all_reduce(total)
        losses[split] = (total[0] / total[1]).item()
    model.train()
    return losses


def evaluate_and_log(model, eval_sets, step, ctx, cfg, world, metrics):
    """Evaluate at `step`, log it, and return the val loss (NonFiniteError if a loss is not finite)."""
    losses = evaluate(model, eval_sets, ctx, cfg, world)
    if not all(math.isfinite(v) for v in losses.values()):
        raise NonFiniteError(f"non-finite eval loss at step {step} ({losses})")
    metrics.write([dict(step=step, eval_train_loss=losses["train"], val_loss=losses["val"])])
    if world.master:
        log(f"eval step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    return losses["val"]


# ----------------------------------------------------------------------------------------------
# Metrics, console and signals


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


def flush_steps(pending, window_start, first_step, tokens_per_step, model, peak, metrics):
    """Copy the pending (step, lr, loss, grad norm) tensors to the host in one go, the only point
    where the host waits for the device, and write them as metrics records; returns the last.
    The wall time since window_start, averaged over the window's steps except the process's first
    step (timed on its own), gives the timings; a window of only that step has None. peak: the
    FLOP/s of all ranks, None for no MFU. A non-finite loss or gradient norm raises
    NonFiniteError after the steps before it are written."""
    values = torch.stack([torch.stack([loss.float(), norm.float()]) for _, _, loss, norm in pending]).tolist()
    timed_steps = sum(step != first_step for step, _, _, _ in pending)
    step_s = (time.perf_counter() - window_start) / timed_steps if timed_steps else None
    if step_s is None:
        timings = dict(tokens_per_s=None, step_ms=None, mfu=None)
    else:
        timings = dict(tokens_per_s=tokens_per_step / step_s, step_ms=1000 * step_s,
                       mfu=model.estimate_mfu(tokens_per_step, step_s, peak) if peak else None)
    records = [dict(step=step, train_loss=loss, lr=lr, grad_norm=norm, **timings)
               for (step, lr, _, _), (loss, norm) in zip(pending, values)]
    for i, record in enumerate(records):
        if not (math.isfinite(record["train_loss"]) and math.isfinite(record["grad_norm"])):
            metrics.write(records[:i])
            raise NonFiniteError(f"non-finite loss at step {record['step']} (train_loss={record['train_loss']}, "
                                 f"grad_norm={record['grad_norm']})")
    metrics.write(records)
    return records[-1]


def report_first_step(step, start, compiled, metrics, world):
    """The process's first step (a fresh start or a resume) compiles the model under
    torch.compile: log its time, from `start` to the end of its device work, on its own. Returns
    the start of the next timing window."""
    synchronize(world.device)
    seconds = time.perf_counter() - start
    metrics.write([dict(step=step, first_step_s=seconds, compiled=compiled)])
    if world.master:
        log(f"first step {step}: {seconds:.2f} s{' (torch.compile included)' if compiled else ''}; "
            f"not counted in tok/s, ms/step and mfu")
    return time.perf_counter()


class StopFlag:
    """Stops the loop at the next step boundary, where it saves and exits, on SIGTERM or SIGINT
    (exit code 128 + the signal number; torchrun passes them on to its workers and itself exits
    with 1) or on a request: the file `stop` in out_dir, which rank 0 looks for at every step
    (scripts/slurm_train.sbatch writes it before the time limit). A request ends with exit code 0,
    so that torchrun does not restart the workers, and is removed once served. All ranks agree
    through a CPU (gloo) all-reduce, which never waits for the GPU."""

    def __init__(self, distributed, device, master, out_dir):
        self.signum = 0
        self.master = master
        self.request_path = os.path.join(out_dir, STOP_REQUEST_FILE) if master else None
        self.group = None
        if distributed:
            self.group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers need it
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self):
        """0 to go on; else the signal number, or STOP_REQUESTED for the request file."""
        requested = self.request_path is not None and os.path.exists(self.request_path)
        flag = torch.tensor([self.signum, int(requested)])
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        signum, requested = flag.tolist()
        return signum or (STOP_REQUESTED if requested else 0)

    def finish(self, stopped, step, path, log=print):
        """After the stop's save: says why the run stopped (rank 0) and returns the exit code; a
        served request is removed."""
        if self.master:
            cause = f"the request {STOP_REQUEST_FILE} in the run folder" if stopped == STOP_REQUESTED else \
                f"signal {stopped}"
            log(f"stopped by {cause} after step {step}; checkpoint saved to {path}; continue with --init_from=auto "
                f"(or resume)")
        if stopped != STOP_REQUESTED:
            return 128 + stopped
        if self.request_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.request_path)
        return 0

    def restore(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def log_step(record, max_iters):
    mfu = f" | mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
    timing = ("first step only, timed above" if record["step_ms"] is None else
              f"{record['tokens_per_s']:,.0f} tok/s | {record['step_ms']:.1f} ms/step{mfu}")
    log(f"step {record['step']}/{max_iters} | loss {record['train_loss']:.4f} | lr {record['lr']:.2e} | "
        f"grad norm {record['grad_norm']:.3f} | {timing}")


def log(message):
    """Print a console line. The console may be a pipe whose reader died with us (tee under a
    Ctrl-C); a lost log line must not stop the checkpoint that follows it."""
    try:
        print(message, flush=True)
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------
# Set-up


def build_model_config(cfg, vocab_size):
    """The GPTConfig of a run: its model settings (the size's shape filled in by load_config), the
    data's vocabulary, and the run's seed for drawn init streams."""
    return GPTConfig(**model_settings(cfg), vocab_size=vocab_size,
                     init_stream_seed=cfg.seed if cfg.init_stream == "drawn" else 0)


def compile_mode(cfg, world):
    """The run's torch.compile mode, or None to run eager (compile=auto: compiled on CUDA)."""
    if not (cfg.compile == "true" or (cfg.compile == "auto" and world.device.type == "cuda")):
        return None
    if world.sharded and cfg.compile_mode == "model":
        raise ConfigError("--parallel=fsdp compiles block by block: add --compile_mode=blocks (or --compile=False)")
    return cfg.compile_mode


def build_model(cfg, vocab_size, resuming, world, dtype):
    """The GPT on its device, parallelized (parallelize.py): (the plain model, the one to evaluate,
    the one to train). Initialised from the seed (rank 0's weights are the ones DDP broadcasts); a
    model to be sharded is built on the meta device, holding nothing, then each rank draws its
    shard of rank 0's weights (parallelize.materialise). A resumed run's weights come in when the
    checkpoint manager restores it."""
    random.seed(cfg.seed + world.rank)
    np.random.seed(cfg.seed + world.rank)
    torch.manual_seed(cfg.seed + world.rank)
    try:
        with torch.device("meta") if world.sharded else contextlib.nullcontext():
            model = GPT(build_model_config(cfg, vocab_size))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not world.sharded:
        model.to(world.device)
    eval_model, train_model = parallelize(model, world.device, cfg.activation_checkpointing, compile_mode(cfg, world),
                                          shard=world.sharded, replicate=world.distributed and not world.sharded,
                                          compute_dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32,
                                          recompute_connections=cfg.recompute_connections,
                                          fused_connections=cfg.fused_connections)
    if world.sharded:
        materialise(model, world.device, None if resuming else cfg.seed)
    return model, eval_model, train_model


def start_out_dir(cfg, model, step, tokens_per_step, dtype, world, checkpoints):
    """Rank 0: config.json, the checkpoints' folder made ready, the run's header lines."""
    connections = connection_path(model, world.device, cfg.fused_connections)  # fused kernels or residuals.py, and why
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(asdict(cfg), connections=connections), f, indent=2)
    checkpoints.prepare(step)
    log(f"{cfg.residual} {cfg.size}: {model.get_num_params() / 1e6:.2f}M parameters, "
        f"{tokens_per_step:,} tokens/step on {world.size} x {world.device.type} ({dtype}), "
        f"{'resuming at' if step else 'starting at'} step {step} of {cfg.max_iters} -> {cfg.out_dir}")
    log(connection_path_line(cfg.residual, connections))


def import_wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError("wandb_log=True needs wandb: pip install wandb") from None
    return wandb


def start_wandb(wandb, cfg, resuming):
    """Rank 0: the W&B run of this training. Its id is kept in out_dir, so that every restart and
    requeue of a resumed run continues the same W&B run; a start from scratch begins a new one."""
    id_path = os.path.join(cfg.out_dir, WANDB_ID_FILE)
    run_id = None
    if resuming and os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip() or None  # empty: a write cut short
    if run_id is None:
        run_id = secrets.token_hex(8)  # an identifier, not a modelling choice: nothing to seed
        with open(id_path + ".tmp", "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
        os.replace(id_path + ".tmp", id_path)
    try:
        return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg), id=run_id,
                          resume="allow")
    except Exception as e:  # wandb has its own error types for no login, no network, bad settings
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"wandb.init failed ({reason}); set WANDB_MODE=offline to log locally, "
                          f"or drop --wandb_log") from None


# ----------------------------------------------------------------------------------------------
# The run


def run(cfg):
    """Train according to cfg; returns the process exit code (0, or 128 + signal number)."""
    world = setup_distributed(cfg)
    try:
        with tf32_matmuls(), RunOwner(cfg.out_dir, world, log):  # one writer per run folder
            return train(cfg, world)
    finally:
        if world.distributed:
            dist.destroy_process_group()


def train(cfg, world):
    """Set up, then train to max_iters; returns the exit code (0, or 128 + signal number)."""
    compiled = compile_mode(cfg, world) is not None
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    paths, vocab_size = check_data(cfg)
    wandb = import_wandb() if cfg.wandb_log and world.master else None  # fail before any work
    dtype, ctx = autocast_context(cfg, world.device)
    checkpoints = CheckpointManager(cfg, world, log, identify(os.path.dirname(paths["train"])))
    ckpt = checkpoints.load()  # None: a fresh start
    if checkpoints.finished:
        return 0
    raw_model, model, train_model = build_model(cfg, vocab_size, ckpt is not None, world, dtype)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                               world.device.type)
    state = TrainState(make_generator(cfg.seed, TRAIN_STREAM))  # the step, best val loss and data position
    states = dict(model=ModelState(raw_model), optimizer=OptimizerState(raw_model, optimizer), train=state,
                  rng=RNGState(world))
    resume_step = checkpoints.restore(states, ckpt)  # None: a fresh start
    del ckpt
    eval_sets = eval_batches(cfg, paths)
    peak = peak_flops(cfg, world.device, dtype)
    peak = peak * world.size if peak else None
    if world.master:
        start_out_dir(cfg, raw_model, state.step, tokens_per_step, dtype, world, checkpoints)
    metrics = MetricsWriter(os.path.join(cfg.out_dir, "metrics.jsonl"), world.master, resume_step,
                            start_wandb(wandb, cfg, resume_step is not None) if wandb is not None else None)
    stop = StopFlag(world.distributed, world.device, world.master, cfg.out_dir)
    first_step = state.step + 1  # it compiles under torch.compile: timed apart from the others
    try:
        if resume_step is None:
            checkpoints.save(evaluate_and_log(model, eval_sets, 0, ctx, cfg, world, metrics))
        pending = []  # (step, lr, loss, grad norm) on the device until the next log point
        synchronize(world.device)
        window_start = time.perf_counter()
        while state.step < cfg.max_iters:
            lr = get_lr(state.step, cfg)
            offsets = step_offsets(state.train_generator, paths["train"], cfg, world.rank, world.size)
            loss, grad_norm = train_step(train_model, raw_model, optimizer, paths["train"], offsets, lr, ctx, cfg,
                                         world)
            state.step += 1
            pending.append((state.step, lr, loss, grad_norm))
            if state.step == first_step:
                window_start = report_first_step(state.step, window_start, compiled, metrics, world)

            signum = stop.agreed()
            is_eval = state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters
            if state.step % cfg.log_interval == 0 or is_eval or checkpoints.due(state.step) or signum:
                # every loss is checked before any save, so the checkpoint stays the last good one
                last = flush_steps(pending, window_start, first_step, tokens_per_step, raw_model, peak, metrics)
                if world.master:
                    log_step(last, cfg.max_iters)
                pending = []
                val_loss = evaluate_and_log(model, eval_sets, state.step, ctx, cfg, world, metrics) if is_eval else None
                checkpoints.save(val_loss, stopping=bool(signum))
                if signum:
                    return stop.finish(signum, state.step, checkpoints.path, log)
                window_start = time.perf_counter()
        checkpoints.finish()
        return 0
    except NonFiniteError as e:
        raise NonFiniteError(f"{e}; stopping, {checkpoints.kept()}") from None
    finally:
        checkpoints.close()
        stop.restore()
        metrics.close()


def usage():
    return "\n".join([__doc__.strip(), "", "Settings (--key=value, or `key = value` in a config file), by group:",
                      help_text()])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage())
        return
    try:
        code = run(load_config(argv))
    except (ConfigError, DeviceError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except SaveError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
