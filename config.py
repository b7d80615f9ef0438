"""Training configuration: one typed dataclass, grouped and described, and a loader for the command line.

    python train.py configs/owt.py configs/S.py configs/mhclite.py --max_iters=2000 --seed=1

Every setting is a field made by setting(): its one-line description, its --help group and its
check. The model's settings and the sizes live beside the model (model.ModelSettings, model.SIZES: a
size is a shape and its learning rates); Execution says how the model runs (parallelize.py), and
TrainConfig adds those and the training settings. Config files are
plain Python assignment files (`n_layer = 6`), applied left to right; then `--key=value`
overrides. Every value is coerced to its field's type and checked, so a typo, a wrong type or a
value out of range is one clear `ConfigError` line instead of a failure deep inside training.
Config files may not set `dataset`, `size` or `residual` differently from an earlier file
(composing configs/S.py with configs/M.py is a mistake); a command-line override always wins.
"""

import ast
import os
import typing
from dataclasses import dataclass, fields

from model import DEFAULT_SIZE, SIZES, ModelSettings, at_least, check_settings, in_unit_interval, setting

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# The --help groups, in the order printed.
GROUPS = ("model", "optimizer and schedule", "data", "run and checkpoints", "parallelism")
OPTIMIZER, DATA, RUN, PARALLEL = GROUPS[1:]

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
class Execution:
    """How the same model is computed (speed, memory): applied by parallelize.py, free to change
    when a run resumes, and not part of the model's settings that a checkpoint saves."""
    fused_connections: bool = setting(False, "Triton kernels for the HC family on CUDA (opt-in: slower so far)",
                                      PARALLEL)
    recompute_connections: bool = setting(False, "recompute the connections' internals in backward (memory)",
                                          PARALLEL)


@dataclass
class TrainConfig(Execution, ModelSettings):
    """The model settings (inherited), then what training adds."""
    size: str = setting(DEFAULT_SIZE, "shape and learning rates (model.SIZES; n_layer, n_head, n_embd override the "
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
    allow_data_change: bool = setting(False, "resume on data files other than those the checkpoint's run read (by "
                                      "size or sampled fingerprint); False: refused", DATA)
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
