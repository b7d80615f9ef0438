"""Training configuration: one typed dataclass and a loader for the command line.

    python train.py configs/owt.py configs/S.py configs/mhclite.py --max_iters=2000 --seed=1

Config files are plain Python assignment files (`n_layer = 6`), applied left to right; then
`--key=value` overrides. Every value is coerced to its field's type and checked (the choices, and
the valid range of every numeric setting in RANGES), so a typo, a wrong type or a value out of
range is one clear `ConfigError` line instead of a failure deep inside training.
Config files may not set `dataset`, `size` or `residual` differently from an earlier file
(composing configs/S.py with configs/M.py is a mistake); a command-line override always wins.
"""

import ast
import math
import os
import re
import typing
from dataclasses import dataclass, fields

from authors import (CONNECTION_WEIGHT_DECAYS, FINAL_NORMS, H_RES_DTYPES, INIT_STREAMS, MIXING_DTYPES,
                     SINKHORN_ORDERS)
from model import MODEL_SIZES
from parallelize import COMPILE_MODES, DEFAULT_COMPILE_MODE
from residuals import RESIDUALS, RMS_EPS

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# (learning rate, minimum learning rate) per size, paper Appendix A. Ours: tiny (CPU demo), and XL
# and 7B, which continue the paper's rule (GPT-3's rates for the nearest of its sizes, min lr / 10).
SIZE_LEARNING_RATES = {"tiny": (1e-3, 1e-4), "S": (1e-3, 1e-4), "M": (6e-4, 6e-5), "L": (3e-4, 3e-5),
                       "XL": (2e-4, 2e-5), "7B": (1.2e-4, 1.2e-5)}

# Keys that name what a run is; two config files setting them differently is an error.
IDENTITY_KEYS = ("dataset", "size", "residual")

CHOICES = {
    "init_from": ("scratch", "resume", "auto"),
    "dtype": ("auto", "float32", "bfloat16"),
    "compile": ("auto", "true", "false"),
    "compile_mode": COMPILE_MODES,
    "parallel": ("ddp", "fsdp"),
    "stream_dtype": ("float32", "bfloat16"),
    "final_norm": FINAL_NORMS,
    "sinkhorn_order": SINKHORN_ORDERS,
    "init_stream": INIT_STREAMS,
    "connection_weight_decay": CONNECTION_WEIGHT_DECAYS,
    "h_res_dtype": H_RES_DTYPES,
    "mixing_dtype": MIXING_DTYPES,
}


FLOAT32_MAX = 3.4028234663852886e38

# Valid ranges of the numeric settings: (key, test, requirement as the error states it).
# Unset optional settings (None) are skipped.
RANGES = (
    ("n_streams", lambda v: v >= 1, ">= 1"),
    ("mhclite_perms", lambda v: v >= 1, ">= 1 (or None: all n! permutations)"),
    ("sinkhorn_iters", lambda v: v >= 1, ">= 1"),
    ("rms_eps", lambda v: v >= 0, ">= 0 (0: the authors' F.normalize)"),
    ("block_size", lambda v: v >= 1, ">= 1"),
    ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("n_layer", lambda v: v >= 1, ">= 1"),
    ("n_head", lambda v: v >= 1, ">= 1"),
    ("n_embd", lambda v: v >= 1, ">= 1"),
    ("learning_rate", lambda v: v > 0, "> 0"),
    ("min_lr", lambda v: v >= 0, ">= 0"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("grad_clip", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("warmup_iters", lambda v: v >= 0, ">= 0"),
    ("max_iters", lambda v: v >= 1, ">= 1"),
    ("lr_decay_iters", lambda v: v >= 1, ">= 1"),  # after max_iters, its default
    ("batch_size", lambda v: v >= 1, ">= 1"),
    ("gradient_accumulation_steps", lambda v: v >= 1, ">= 1"),
    ("eval_interval", lambda v: v >= 1, ">= 1"),
    ("eval_iters", lambda v: v >= 1, ">= 1"),
    ("log_interval", lambda v: v >= 1, ">= 1"),
    ("ckpt_interval", lambda v: v >= 0, ">= 0 (0: save only at evaluations)"),
    ("peak_flops", lambda v: v > 0, "> 0 (or None: looked up from the GPU name)"),
    ("seed", lambda v: 0 <= v < 2**31, "in [0, 2**31) (numpy seeds rank r with seed + r)"),
)


# Settings that no longer exist, and what replaces them.
REMOVED_KEYS = {
    "debug_nan_at_step": "it was a test-only hook; tests now make a step's loss non-finite by patching "
                         "train.train_step",
}


class ConfigError(ValueError):
    """A bad configuration; train.py prints it as `error: <message>` and exits 2."""


@dataclass
class TrainConfig:
    # data
    dataset: str = "openwebtext"
    data_dir: str = os.path.join(REPO_DIR, "data")
    # model
    size: str = "M"
    residual: str = "res"
    n_streams: int = 4
    mhclite_perms: typing.Optional[int] = None
    mhclite_perm_sampling: str = "uniform"
    perm_seed: int = 0
    sinkhorn_iters: int = 20
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = False
    recompute_connections: bool = False
    activation_checkpointing: bool = False  # recompute each block's forward in backward (parallelize.apply_ac)
    stream_dtype: str = "float32"  # the HC family's n streams stored in float32 or bfloat16
    fused_connections: bool = False  # Triton kernels for the HC family on CUDA; opt-in: slower than the reference path so far
    # the paper as written (defaults) or as the authors' code ran it (configs/authors.py, docs/faithfulness.md)
    final_norm: str = "after_sum"  # final LayerNorm after the stream sum, or "per_stream": on each, then the sum
    rms_eps: float = RMS_EPS  # inside the connections' RMS root; 0: F.normalize, the authors'
    sinkhorn_order: str = "cols_then_rows"  # mhc: rows exact; "rows_then_cols" (the authors'): columns exact
    init_stream: str = "wrapper_mod_n"  # the stream a wrapper reads at init; "drawn": seeded with `seed`
    connection_weight_decay: str = "projections"  # or "authors": every >= 2-D parameter in their layout
    h_res_dtype: str = "float32"  # mhclite; "autocast": the permutations combined in bf16 under autocast
    mixing_dtype: str = "float32"  # "autocast": u and h_res x with bf16 operands and result under autocast
    n_layer: typing.Optional[int] = None  # shape overrides of the size preset
    n_head: typing.Optional[int] = None
    n_embd: typing.Optional[int] = None
    # optimizer and schedule
    learning_rate: typing.Optional[float] = None  # None: the size's value from the paper
    min_lr: typing.Optional[float] = None  # None: the size's value from the paper
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    warmup_iters: int = 200
    lr_decay_iters: typing.Optional[int] = None  # None: max_iters
    max_iters: int = 10000
    # batch: tokens per step = batch_size * block_size * gradient_accumulation_steps, over all GPUs
    batch_size: int = 16  # sequences per GPU per micro-step
    gradient_accumulation_steps: int = 8  # micro-steps per optimizer step in total; divided by world size
    # evaluation and logging
    eval_interval: int = 500
    eval_iters: int = 200
    log_interval: int = 10
    always_save_checkpoint: bool = True
    ckpt_interval: int = 0  # also save every this many steps, without an evaluation; 0: only at evaluations
    # system
    parallel: str = "ddp"  # ddp: every process holds the whole model; fsdp: sharded (FSDP2, under torchrun)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (torchrun picks cuda:LOCAL_RANK)
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    compile: str = "auto"  # auto: on for cuda
    compile_mode: str = DEFAULT_COMPILE_MODE  # model: the whole model; blocks: one Block's code for all layers, and the head
    peak_flops: typing.Optional[float] = None  # for MFU; None: looked up from the GPU name
    seed: int = 1337
    out_dir: typing.Optional[str] = None  # None: out/<dataset>-<size>-<residual>-s<seed>
    init_from: str = "scratch"  # resume: continue out_dir's checkpoint; auto: resume if there is one, else scratch
    wandb_log: bool = False
    wandb_project: str = "mhc-lite"
    wandb_run_name: typing.Optional[str] = None  # None: the out_dir name


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
    if key in REMOVED_KEYS:
        raise ConfigError(f"{key} was removed: {REMOVED_KEYS[key]}")
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


def check_ranges(cfg, min_lr_from_size=False):
    """Every numeric setting inside its valid range, else one ConfigError line naming it."""
    for key, valid, requirement in RANGES:
        value = getattr(cfg, key)
        if value is None:  # an optional setting left unset
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        if not valid(value):
            raise ConfigError(f"{key} must be {requirement}, got {value}")
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
    """Fill the derived defaults and check the values that have a fixed set of choices."""
    if cfg.size not in MODEL_SIZES:
        raise ConfigError(f"unknown size '{cfg.size}'; valid: {', '.join(MODEL_SIZES)}")
    if cfg.residual not in RESIDUALS:
        raise ConfigError(f"unknown residual '{cfg.residual}'; valid: {', '.join(RESIDUALS)}")
    for key, choices in CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"unknown {key} '{getattr(cfg, key)}'; valid: {', '.join(choices)}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"unknown device '{cfg.device}'; valid: auto, cpu, cuda, cuda:N")
    default_lr, default_min_lr = SIZE_LEARNING_RATES[cfg.size]
    min_lr_from_size = cfg.min_lr is None
    if cfg.learning_rate is None:
        cfg.learning_rate = default_lr
    if cfg.min_lr is None:
        cfg.min_lr = default_min_lr
    if cfg.lr_decay_iters is None:
        cfg.lr_decay_iters = cfg.max_iters
    check_ranges(cfg, min_lr_from_size)
    if cfg.out_dir is None:
        cfg.out_dir = os.path.join(REPO_DIR, "out", f"{cfg.dataset}-{cfg.size}-{cfg.residual}-s{cfg.seed}")
    if cfg.wandb_run_name is None:
        cfg.wandb_run_name = os.path.basename(os.path.normpath(cfg.out_dir))
    return cfg

