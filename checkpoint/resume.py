"""What a resume may change: the settings that decide what a run is (refused when they differ),
those a resume keeps from the checkpoint (refused), those it takes from this run (said so), the
data files (refused when they changed, unless allowed), and the model (refused when it differs).
Every refusal is one line that names the fix."""

import contextlib

from checkpoint.files import CheckpointError

# Config keys that decide what a run is; resuming with another value would train a different model.
RUN_IDENTITY_KEYS = ("residual", "size", "n_streams")
# Settings a resume keeps from the checkpoint, and what each fixes.
KEPT_ON_RESUME = {"seed": "the eval batches and the model's seeded choices",
                  "dataset": "the corpus the data position refers to"}
# Settings a resume takes from this run, saying so: the optimizer's, the schedule's and the batch's.
APPLIED_ON_RESUME = ("learning_rate", "min_lr", "warmup_iters", "weight_decay", "beta1", "beta2", "grad_clip",
                     "batch_size", "gradient_accumulation_steps", "eval_iters")
# Keys that some checkpoints' model_args hold: how that model ran, which parallelize.py applies
# from the run's settings, not what the model is; a load drops them.
LEGACY_MODEL_ARGS = ("fused_connections", "recompute_connections")
# Model settings that no flag sets: the data's vocabulary, and the init seed that comes with --seed.
DERIVED_MODEL_ARGS = ("vocab_size", "init_stream_seed")


def model_args(ckpt):
    """The model settings a checkpoint was trained with, by name (its legacy keys dropped)."""
    return {k: v for k, v in ckpt["model_args"].items() if k not in LEGACY_MODEL_ARGS}


def check_same_run(ckpt, config, path):
    """Refuse to resume a checkpoint of another residual / size / n_streams: name both sides."""
    saved = ckpt["config"]
    differ = [k for k in RUN_IDENTITY_KEYS if saved.get(k) != config.get(k)]
    if differ:
        theirs = " ".join(f"{k}={saved.get(k)}" for k in RUN_IDENTITY_KEYS)
        ours = " ".join(f"{k}={config.get(k)}" for k in RUN_IDENTITY_KEYS)
        flags = " ".join(f"--{k}={saved.get(k)}" for k in differ)
        raise CheckpointError(f"{path} was trained with {theirs}, but this run asks for {ours}; continue it with "
                              f"{flags}, or pick another --out_dir for this run")


def check_same_data(ckpt, config, path):
    """Refuse to resume with another seed or dataset: both are what the run's data is (settings
    a checkpoint predates are not checked)."""
    saved = ckpt["config"]
    for key, fixes in KEPT_ON_RESUME.items():
        if key in saved and saved[key] != config.get(key):
            raise CheckpointError(f"{path} was trained with {key}={saved[key]}, but this run asks for "
                                  f"{key}={config.get(key)}; a resume keeps the {key} ({fixes}): pass "
                                  f"--{key}={saved[key]}, or start a new run in another --out_dir")


def data_changes(ckpt, data_files):
    """How this run's data files (dataloader.identify) differ from those the checkpoint recorded,
    one phrase per file; None for a checkpoint that recorded none (written before checkpoints did)."""
    saved = ckpt.get("data_files")
    if saved is None:
        return None
    changes = []
    for name, now in data_files.items():
        was = saved.get(name)
        if was is None:
            changes.append(f"{name} was not recorded")
        elif was["bytes"] != now["bytes"]:
            changes.append(f"{name} has {now['bytes']:,} bytes, the run's had {was['bytes']:,}")
        elif was["sampled_sha256"] != now["sampled_sha256"]:
            changes.append(f"{name} has other contents (sampled SHA-256 {now['sampled_sha256'][:12]}, the run's "
                           f"{was['sampled_sha256'][:12]})")
    return changes


def check_same_data_files(ckpt, data_files, data_dir, allowed, path):
    """Refuse to resume on data files other than the checkpoint's run read, unless allowed
    (--allow_data_change=True); returns the note lines to print."""
    changes = data_changes(ckpt, data_files)
    if changes is None:
        return [f"note: {path} records no data fingerprint (written before checkpoints did): the data in {data_dir} "
                f"is not checked against the run's"]
    if not changes:
        return []
    if not allowed:
        raise CheckpointError(f"the data in {data_dir} differs from what {path} was trained on: {'; '.join(changes)}; "
                              f"point --data_dir at the run's data, or pass --allow_data_change=True to go on with "
                              f"this data on purpose")
    return [f"note: going on with changed data (--allow_data_change=True, recorded in config.json): "
            f"{'; '.join(changes)}"]


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


def check_same_model(ckpt, settings, defaults, path):
    """Refuse a checkpoint of another model: its model settings against this run's (`settings`,
    by name); a setting added after the checkpoint was written takes its default (`defaults`, by
    name), which is what that run used."""
    saved = {**{k: v for k, v in defaults.items() if k not in ckpt["model_args"]}, **model_args(ckpt)}
    differ = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if differ:
        pairs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {settings.get(k)!r}" for k in differ)
        flags = " ".join(f"--{k}={saved.get(k)}" for k in differ if k not in DERIVED_MODEL_ARGS)
        fixes = ([f"pass {flags}"] if flags else []) + (
            ["train on the run's data (its tokenizer sets vocab_size)"] if "vocab_size" in differ else [])
        raise CheckpointError(f"{path} holds a different model ({pairs}); to continue it, {' and '.join(fixes)}, or "
                              f"pick another --out_dir for this run")


@contextlib.contextmanager
def optimizer_settings(optimizer):
    """Loading the optimizer's state inside keeps this run's weight decay and betas in every group,
    not the checkpoint's (resume_notes says which changed); the learning rate is set every step."""
    settings = [dict(weight_decay=group["weight_decay"], betas=group["betas"]) for group in optimizer.param_groups]
    yield
    for group, values in zip(optimizer.param_groups, settings):
        group.update(values)
