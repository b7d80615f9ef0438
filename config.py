"""Training configuration: one typed dataclass, grouped and described, and a loader for the command line.

    python train.py configs/owt.py configs/S.py configs/mhclite.py --max_iters=2000 --seed=1

Every setting is a field made by setting(): its one-line description, its --help group and its
check. The model's settings come in four groups (Architecture, AuthorsSwitches, Execution,
ModelTraining; ModelSettings holds them all, model.GPTConfig adds the vocabulary); TrainConfig
adds the training settings. A size (SIZES) is a shape and its learning rates. Config files are
plain Python assignment files (`n_layer = 6`), applied left to right; then `--key=value`
overrides. Every value is coerced to its field's type and checked, so a typo, a wrong type or a
value out of range is one clear `ConfigError` line instead of a failure deep inside training.
Config files may not set `dataset`, `size` or `residual` differently from an earlier file
(composing configs/S.py with configs/M.py is a mistake); a command-line override always wins.
"""

import ast
import math
import os
import re
import typing
from dataclasses import dataclass, field, fields

import torch

import authors
from residuals import PERM_SAMPLINGS, RESIDUALS, RMS_EPS

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# The --help groups, in the order printed.
GROUPS = ("model", "optimizer and schedule", "data", "run and checkpoints", "parallelism")
OPTIMIZER, DATA, RUN, PARALLEL = GROUPS[1:]

# ----------------------------------------------------------------------------------------------
# Settings that describe and check themselves


def setting(default, help, group="model", choices=None, valid=None, requirement=None, pattern=None):
    """A dataclass field that describes itself: `help`, the one line --help prints; `group`, the
    heading it is listed under; its check, `choices` (or a `pattern` they name) or a predicate
    `valid` with its `requirement` as the error states it."""
    return field(default=default, metadata=dict(help=help, group=group, choices=choices, valid=valid,
                                                requirement=requirement, pattern=pattern))


def check_settings(settings):
    """Check every field of a dataclass built with setting() against its own check; the first bad
    value is one ValueError line. Unset optional settings (None) are not checked."""
    for f in fields(settings):
        value, meta = getattr(settings, f.name), f.metadata
        if value is None or not meta:
            continue
        if meta["pattern"] is not None and not re.fullmatch(meta["pattern"], value) or (
                meta["pattern"] is None and meta["choices"] is not None and value not in meta["choices"]):
            raise ValueError(f"unknown {f.name} '{value}'; valid: {', '.join(meta['choices'])}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
        if meta["valid"] is not None and not meta["valid"](value):
            raise ValueError(f"{f.name} must be {meta['requirement']}, got {value}")


def at_least(bound, note=""):
    return dict(valid=lambda v: v >= bound, requirement=f">= {bound}{note}")


def in_unit_interval():
    return dict(valid=lambda v: 0 <= v < 1, requirement="in [0, 1)")


# ----------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Size:
    """A model size: its shape, its peak learning rate and the cosine's end (min_lr)."""
    n_layer: int
    n_head: int
    n_embd: int
    learning_rate: float
    min_lr: float

    def shape(self) -> dict:
        return dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)


SIZES = {
    # ours: the CPU demo and test model; 3e-3 trains it better than the paper's rule (docs/results.md)
    "tiny": Size(n_layer=4, n_head=4, n_embd=128, learning_rate=3e-3, min_lr=3e-4),
    # the paper's (Appendix A): GPT-2 small, medium and large
    "S": Size(n_layer=6, n_head=8, n_embd=512, learning_rate=1e-3, min_lr=1e-4),
    "M": Size(n_layer=12, n_head=12, n_embd=768, learning_rate=6e-4, min_lr=6e-5),
    "L": Size(n_layer=24, n_head=16, n_embd=1024, learning_rate=3e-4, min_lr=3e-5),
    # ours past the paper: GPT-2 XL's shape and GPT-3 6.7B's (sharded on 8 x 80 GB), with the paper's
    # rule for the rates: GPT-3's for the nearest of its sizes, min lr / 10
    "XL": Size(n_layer=48, n_head=25, n_embd=1600, learning_rate=2e-4, min_lr=2e-5),
    "7B": Size(n_layer=32, n_head=32, n_embd=4096, learning_rate=1.2e-4, min_lr=1.2e-5),
}
DEFAULT_SIZE = "M"


def model_shape(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown size '{size}'; valid: {', '.join(SIZES)}")
    return SIZES[size].shape()


# ----------------------------------------------------------------------------------------------
# The model's settings

STREAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Architecture:
    """What the model is: its residual connection and its shape (the Hugging Face export keeps these)."""
    residual: str = setting("res", "the residual connection", choices=tuple(RESIDUALS))
    n_streams: int = setting(4, "residual streams n of hc, mhc and mhclite (res has 1)", **at_least(1))
    mhclite_perms: int | None = setting(None, "mhclite: permutations K in H_res; None: all n! (n <= 5)",
                                        **at_least(1, " (or None: all n! permutations)"))
    mhclite_perm_sampling: str = setting("uniform", "mhclite: how K < n! permutations are drawn (cover: the n "
                                         "shifts first)", choices=PERM_SAMPLINGS)
    perm_seed: int = setting(0, "mhclite: seed of the permutation draw")
    sinkhorn_iters: int = setting(20, "mhc: Sinkhorn-Knopp iterations", **at_least(1))
    block_size: int = setting(1024, "context length in tokens", **at_least(1))
    n_layer: int | None = setting(None, "transformer blocks; None: the size's", **at_least(1))
    n_head: int | None = setting(None, "attention heads; None: the size's", **at_least(1))
    n_embd: int | None = setting(None, "width C; None: the size's", **at_least(1))
    bias: bool = setting(False, "biases in the Linear and LayerNorm layers")
    stream_dtype: str = setting("float32", "storage of the HC family's n streams", choices=tuple(STREAM_DTYPES))


@dataclass
class AuthorsSwitches:
    """The paper as written (the defaults) or as the authors' code ran it (authors.py sets out both
    values of each; configs/authors.py sets them all to the authors'). All but the two of
    authors.TRAINING_ONLY change what the model computes."""
    final_norm: str = setting("after_sum", "final LayerNorm after the stream sum, or on each stream, then the "
                              "sum", choices=authors.SETTINGS["final_norm"])
    rms_eps: float = setting(RMS_EPS, "inside the connections' RMS root; 0: F.normalize, the authors'",
                             **at_least(0, " (0: the authors' F.normalize)"))
    sinkhorn_order: str = setting("cols_then_rows", "mhc: rows exact, or columns (the authors')",
                                  choices=authors.SETTINGS["sinkhorn_order"])
    init_stream: str = setting("wrapper_mod_n", "the stream a wrapper reads at init; drawn (the authors'): "
                               "seeded with seed", choices=authors.SETTINGS["init_stream"])
    connection_weight_decay: str = setting("projections", "decayed connection parameters; authors: every >= 2-D "
                                           "one", choices=authors.SETTINGS["connection_weight_decay"])
    h_res_dtype: str = setting("float32", "mhclite: the permutations combined in fp32, or in bf16 under "
                               "autocast (the authors')", choices=authors.SETTINGS["h_res_dtype"])
    mixing_dtype: str = setting("float32", "u and h_res x in fp32, or with bf16 operands and result under "
                                "autocast (the authors')", choices=authors.SETTINGS["mixing_dtype"])


@dataclass
class Execution:
    """How the same model is computed (speed, memory): free to change when a run resumes."""
    fused_connections: bool = setting(False, "Triton kernels for the HC family on CUDA (opt-in: slower so "
                                      "far)")
    recompute_connections: bool = setting(False, "recompute the connections' internals in backward (memory)")


@dataclass
class ModelTraining:
    """The model's settings that act on training only (regularisation)."""
    dropout: float = setting(0.0, "dropout probability", **in_unit_interval())


@dataclass
class ModelSettings(ModelTraining, Execution, AuthorsSwitches, Architecture):
    """Every model setting, as a user sets it (train.py's "model" group), flat: a checkpoint saves
    them by name (model_args)."""


# ----------------------------------------------------------------------------------------------
# The training configuration

COMPILE_MODES = ("model", "blocks")
DEFAULT_COMPILE_MODE = "model"  # train.py's and bench.py's
FLOAT32_MAX = 3.4028234663852886e38
# Keys that name what a run is; two config files setting them differently is an error.
IDENTITY_KEYS = ("dataset", "size", "residual")


class ConfigError(ValueError):
    """A bad configuration; train.py prints it as `error: <message>` and exits 2."""


@dataclass
class TrainConfig(ModelSettings):
    """The model settings (inherited), then what training adds."""
    size: str = setting(DEFAULT_SIZE, "shape and learning rates (config.SIZES; n_layer, n_head, n_embd override the "
                        "shape)", choices=tuple(SIZES))
    # optimizer and schedule
    learning_rate: typing.Optional[float] = setting(None, "peak learning rate; None: the size's (paper Appendix A)",
                                                    OPTIMIZER, valid=lambda v: v > 0, requirement="> 0")
    min_lr: typing.Optional[float] = setting(None, "the cosine's end; None: the size's", OPTIMIZER, **at_least(0))
    weight_decay: float = setting(0.1, "AdamW's, on the 2-D projection weights only", OPTIMIZER, **at_least(0))
    beta1: float = setting(0.9, "AdamW's beta1", OPTIMIZER, **in_unit_interval())
    beta2: float = setting(0.95, "AdamW's beta2", OPTIMIZER, **in_unit_interval())
    grad_clip: float = setting(1.0, "gradient norm clip; 0 disables clipping (the norm is still logged)", OPTIMIZER,
                               **at_least(0, " (0 disables clipping)"))
    warmup_iters: int = setting(200, "steps of linear warmup", OPTIMIZER, **at_least(0))
    lr_decay_iters: typing.Optional[int] = setting(None, "step where the cosine reaches min_lr; None: max_iters",
                                                   OPTIMIZER, **at_least(1))
    max_iters: int = setting(10000, "optimizer steps in all", OPTIMIZER, **at_least(1))
    # data; tokens per step = batch_size * block_size * gradient_accumulation_steps, over all GPUs
    dataset: str = setting("openwebtext", "folder under data_dir holding train.bin, val.bin and meta.json", DATA)
    data_dir: str = setting(os.path.join(REPO_DIR, "data"), "where the datasets are", DATA)
    batch_size: int = setting(16, "sequences per GPU per micro-step", DATA, **at_least(1))
    gradient_accumulation_steps: int = setting(8, "micro-steps per optimizer step in total; divided by world size",
                                               DATA, **at_least(1))
    # run, evaluation, logging and checkpoints
    out_dir: typing.Optional[str] = setting(None, "run folder; None: out/<dataset>-<size>-<residual>-s<seed>", RUN)
    init_from: str = setting("scratch", "resume: continue out_dir's checkpoint; auto: resume if there is one, "
                             "else scratch", RUN, choices=("scratch", "resume", "auto"))
    seed: int = setting(1337, "seeds the init, the data order and dropout", RUN,
                        valid=lambda v: 0 <= v < 2**31, requirement="in [0, 2**31) (numpy seeds rank r with seed + r)")
    eval_interval: int = setting(500, "evaluate (and save) every this many steps", RUN, **at_least(1))
    eval_iters: int = setting(200, "batches per evaluation and split", RUN, **at_least(1))
    log_interval: int = setting(10, "log every this many steps", RUN, **at_least(1))
    always_save_checkpoint: bool = setting(True, "save at every evaluation; False: only when val loss improved", RUN)
    ckpt_interval: int = setting(0, "also save every this many steps, without an evaluation; 0: only at evaluations",
                                 RUN, **at_least(0, " (0: save only at evaluations)"))
    keep_checkpoints: int = setting(1, "the newest this many complete checkpoints stay on disk (older: ckpt.<step>.pt, "
                                    "ckpt.dcp.<step>)", RUN, **at_least(1))
    wandb_log: bool = setting(False, "log to Weights & Biases as well", RUN)
    wandb_project: str = setting("mhc-lite", "its project", RUN)
    wandb_run_name: typing.Optional[str] = setting(None, "its run name; None: the out_dir name", RUN)
    # parallelism and devices
    parallel: str = setting("ddp", "ddp: every process holds the whole model; fsdp: sharded (FSDP2, under torchrun)",
                            PARALLEL, choices=("ddp", "fsdp"))
    activation_checkpointing: bool = setting(False, "recompute each block's forward in backward "
                                             "(parallelize.apply_ac)", PARALLEL)
    device: str = setting("auto", "auto | cpu | cuda | cuda:N (torchrun picks cuda:LOCAL_RANK)", PARALLEL,
                          choices=("auto", "cpu", "cuda", "cuda:N"), pattern=r"auto|cpu|cuda(:\d+)?")
    dtype: str = setting("auto", "autocast; auto: bfloat16 on cuda, float32 on cpu", PARALLEL,
                         choices=("auto", "float32", "bfloat16"))
    compile: str = setting("auto", "torch.compile; auto: on for cuda", PARALLEL, choices=("auto", "true", "false"))
    compile_mode: str = setting(DEFAULT_COMPILE_MODE, "model: the whole model; blocks: one Block's code for all "
                                "layers, and the head", PARALLEL, choices=COMPILE_MODES)
    peak_flops: typing.Optional[float] = setting(None, "one device's peak FLOP/s for MFU; None: looked up from the "
                                                 "GPU name", PARALLEL, valid=lambda v: v > 0,
                                                 requirement="> 0 (or None: looked up from the GPU name)")


FIELD_TYPES = typing.get_type_hints(TrainConfig)


def _type_name(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return f"{args[0].__name__} or None"
    return tp.__name__


def _parse_bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value in ("True", "true", "1", "False", "false", "0"):
        return value in ("True", "true", "1")
    raise ValueError


def _parse_int(value):
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            value = float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError


def _parse_float(value):
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value)
    raise ValueError


def _parse_str(value):
    if isinstance(value, str):
        return value
    raise ValueError


PARSERS = {bool: _parse_bool, int: _parse_int, float: _parse_float, str: _parse_str}


def coerce(key, value):
    """Convert `value` (a string from the command line or a literal from a file) to the type of
    field `key`; raises ConfigError naming the field and the expected type."""
    if key not in FIELD_TYPES:
        valid = ", ".join(f.name for f in fields(TrainConfig))
        raise ConfigError(f"unknown config key '{key}'; valid keys: {valid}")
    tp = FIELD_TYPES[key]
    optional = type(None) in typing.get_args(tp)
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
    if optional and (value is None or value == "None"):
        return None
    if key == "compile" and not (isinstance(value, str) and value == "auto"):
        try:
            return str(_parse_bool(value)).lower()
        except ValueError:
            raise ConfigError(f"compile must be auto, True or False, got {value!r}") from None
    try:
        return PARSERS[base](value)
    except ValueError:
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}") from None


def read_config_file(path):
    """The `name = literal` assignments of a config file, in order, as (key, value) pairs."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise ConfigError(f"{path} line {e.lineno}: invalid Python syntax") from None
    pairs = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        ok = isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        try:
            value = ast.literal_eval(node.value) if ok else None
        except (ValueError, TypeError, SyntaxError):
            ok = False
        if not ok:
            raise ConfigError(f"{path} line {node.lineno}: only `name = literal` assignments are allowed")
        pairs.append((node.targets[0].id, value))
    return pairs


def parse_override(arg):
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError(f"cannot parse argument '{arg}'; use a config file path or --key=value")
    key, value = arg[2:].split("=", 1)
    return key, value


def load_config(argv):
    """Build the TrainConfig from config files and --key=value overrides (left to right)."""
    values = {}
    set_by_file = {}
    for arg in argv:
        if arg.startswith("-") or ("=" in arg and not os.path.exists(arg)):
            key, value = parse_override(arg)
            values[key] = coerce(key, value)
            continue
        for key, value in read_config_file(arg):
            try:
                value = coerce(key, value)
            except ConfigError as e:
                raise ConfigError(f"{arg}: {e}") from None
            if key in IDENTITY_KEYS and key in set_by_file and set_by_file[key][1] != value:
                earlier, old = set_by_file[key]
                raise ConfigError(f"conflicting {key}: {earlier} sets '{old}' but {arg} sets '{value}'")
            if key in IDENTITY_KEYS:
                set_by_file[key] = (arg, value)
            values[key] = value
    cfg = TrainConfig(**values)
    resolve(cfg)
    return cfg


def check_together(cfg, min_lr_from_size=False):
    """The settings that depend on each other (each one alone is checked by its field)."""
    if cfg.learning_rate / (1 - cfg.beta1) > FLOAT32_MAX:
        # AdamW's first update scales by lr / (1 - beta1), which must be a float32
        raise ConfigError(f"learning_rate={cfg.learning_rate} is too large: AdamW's first step size "
                          f"learning_rate / (1 - beta1) exceeds the largest float32")
    if cfg.min_lr > cfg.learning_rate:
        origin = f" (the default for size {cfg.size}; set --min_lr)" if min_lr_from_size else ""
        raise ConfigError(f"min_lr={cfg.min_lr}{origin} must be <= learning_rate={cfg.learning_rate}")
    if cfg.lr_decay_iters <= cfg.warmup_iters < cfg.max_iters:
        # a run that never leaves warmup (a short smoke test) is fine; past it, the lr would jump
        raise ConfigError(f"warmup_iters={cfg.warmup_iters} must be < lr_decay_iters={cfg.lr_decay_iters}: "
                          f"after warmup the lr would drop straight to min_lr with no cosine decay")


def resolve(cfg):
    """Check every value, each against its field's check (setting()), and fill the derived
    defaults; the first bad value is one ConfigError line naming it."""
    try:
        check_settings(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    size = SIZES[cfg.size]
    for key, value in size.shape().items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    min_lr_from_size = cfg.min_lr is None
    if cfg.learning_rate is None:
        cfg.learning_rate = size.learning_rate
    if cfg.min_lr is None:
        cfg.min_lr = size.min_lr
    if cfg.lr_decay_iters is None:
        cfg.lr_decay_iters = cfg.max_iters
    check_together(cfg, min_lr_from_size)
    if cfg.out_dir is None:
        cfg.out_dir = os.path.join(REPO_DIR, "out", f"{cfg.dataset}-{cfg.size}-{cfg.residual}-s{cfg.seed}")
    if cfg.wandb_run_name is None:
        cfg.wandb_run_name = os.path.basename(os.path.normpath(cfg.out_dir))
    return cfg


def model_settings(settings) -> dict:
    """The model settings (ModelSettings) of a TrainConfig or a GPTConfig, by name."""
    return {f.name: getattr(settings, f.name) for f in fields(ModelSettings)}


def help_text():
    """Every setting under its group: --key=default, then its description."""
    own = {f.name for f in fields(TrainConfig)} - {f.name for f in fields(ModelSettings)}
    ordered = sorted(fields(TrainConfig), key=lambda f: (GROUPS.index(f.metadata["group"]), f.name not in own))
    lines = []
    for group in GROUPS:
        lines += ["", f"{group}:"]
        for f in ordered:
            if f.metadata["group"] == group:
                flag, text = f"--{f.name}={f.default}", f.metadata["help"]
                if f.metadata["choices"] and not f.metadata["pattern"]:
                    text += f" [{' | '.join(f.metadata['choices'])}]"
                lines.append(f"  {flag:<34} {text}" if len(flag) <= 34 else f"  {flag}\n  {'':<34} {text}")
    return "\n".join(lines)
