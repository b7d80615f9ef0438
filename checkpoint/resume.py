"""What a resume may change: the settings that decide what a run is (refused when they differ),
those a resume keeps from the checkpoint (refused), those it takes from this run (said so), the
model's (refused when they differ, but for the execution settings), and the format (a ckpt.pt
continues without sharding, a ckpt.dcp with it)."""

import contextlib
import dataclasses

from checkpoint.single_file import CheckpointError
from config import Execution
from model import GPTConfig

# Config keys that decide what a run is; resuming with another value would train a different model.
RUN_IDENTITY_KEYS = ("residual", "size", "n_streams")
# Model settings that change how the same model is computed, not what it is; free to change on resume.
EXECUTION_KEYS = tuple(f.name for f in dataclasses.fields(Execution))
# Settings a resume keeps from the checkpoint, and what each fixes.
KEPT_ON_RESUME = {"seed": "the eval batches and the model's seeded choices",
                  "dataset": "the corpus the data position refers to"}
# Settings a resume takes from this run, saying so: the optimizer's, the schedule's and the batch's.
APPLIED_ON_RESUME = ("learning_rate", "min_lr", "warmup_iters", "weight_decay", "beta1", "beta2", "grad_clip",
                     "batch_size", "gradient_accumulation_steps", "eval_iters")


def check_same_run(ckpt, config, path):
    """Refuse to resume a checkpoint of another residual / size / n_streams (or any other model
    shape): name both sides."""
    saved = ckpt["config"]
    differ = [k for k in RUN_IDENTITY_KEYS if saved.get(k) != config.get(k)]
    if differ:
        theirs = " ".join(f"{k}={saved.get(k)}" for k in RUN_IDENTITY_KEYS)
        ours = " ".join(f"{k}={config.get(k)}" for k in RUN_IDENTITY_KEYS)
        raise CheckpointError(f"{path} was trained with {theirs}, but this run asks for {ours}")


def check_same_data(ckpt, config, path):
    """Refuse to resume with another seed or dataset: both are what the run's data is (settings
    a checkpoint predates are not checked)."""
    saved = ckpt["config"]
    for key, fixes in KEPT_ON_RESUME.items():
        if key in saved and saved[key] != config.get(key):
            raise CheckpointError(f"{path} was trained with {key}={saved[key]}, but this run asks for "
                                  f"{key}={config.get(key)}; a resume keeps the {key} ({fixes}): pass "
                                  f"--{key}={saved[key]}, or start a new run in another --out_dir")


def resume_notes(ckpt, cfg):
    """The lines a resume prints about settings that differ from the checkpoint's run: the
    schedule's horizon when lr_decay_iters moved, and the optimizer, schedule and batch settings
    that take this run's values from the next step on."""
    saved, notes = ckpt["config"], []
    if saved.get("lr_decay_iters", cfg.lr_decay_iters) != cfg.lr_decay_iters:
        notes.append(f"note: resuming with lr_decay_iters={cfg.lr_decay_iters} (max_iters={cfg.max_iters}) where the "
                     f"checkpoint's run had lr_decay_iters={saved['lr_decay_iters']} (max_iters={saved['max_iters']}): "
                     f"the cosine schedule's horizon moves; pass --lr_decay_iters={saved['lr_decay_iters']} "
                     f"to keep the old schedule")
    changed = [f"{key}={getattr(cfg, key)} (was {saved[key]})" for key in APPLIED_ON_RESUME
               if key in saved and saved[key] != getattr(cfg, key)]
    if changed:
        notes.append(f"note: resuming with settings that differ from the checkpoint's run, applied from step "
                     f"{ckpt['step'] + 1} on: {', '.join(changed)}")
    return notes


def check_same_model(ckpt, model_args, path):
    # Settings added after a checkpoint was written take their defaults, which is what it used.
    saved = {**{f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name not in ckpt["model_args"]},
             **ckpt["model_args"]}
    differ = sorted(k for k in set(saved) | set(model_args)
                    if k not in EXECUTION_KEYS and saved.get(k) != model_args.get(k))
    if differ:
        pairs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {model_args.get(k)!r}" for k in differ)
        raise CheckpointError(f"{path} holds a different model ({pairs})")


def check_format_matches(ckpt, sharded, path):
    """A ckpt.pt written from a sharded checkpoint holds the weights only: continue the sharded one.
    (A sharded run reads ckpt.dcp, an unsharded one ckpt.pt, so the paths already differ.)"""
    if not sharded and "optimizer" not in ckpt:
        raise CheckpointError(f"{path} holds weights only (written from a sharded checkpoint); continue "
                              f"the run from its ckpt.dcp with --parallel=fsdp")


@contextlib.contextmanager
def optimizer_settings(optimizer):
    """Loading the optimizer's state inside keeps this run's weight decay and betas in every group,
    not the checkpoint's (resume_notes says which changed); the learning rate is set every step."""
    settings = [dict(weight_decay=group["weight_decay"], betas=group["betas"]) for group in optimizer.param_groups]
    yield
    for group, values in zip(optimizer.param_groups, settings):
        group.update(values)
