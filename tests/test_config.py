"""config.py: defaults from the paper, file composition, overrides, type coercion, clear errors."""
import dataclasses
import glob
import os
import subprocess
import sys

import pytest

import train
from config import GROUPS, REPO_DIR, SIZES, ConfigError, Execution, ModelSettings, TrainConfig, load_config, read_config_file
from conftest import one_error_line
from model import GPTConfig


def write(path, text):
    path.write_text(text)
    return str(path)


def test_defaults_are_the_papers_setup():
    cfg = load_config([])
    assert (cfg.size, cfg.n_streams, cfg.block_size, cfg.dropout, cfg.bias) == ("M", 4, 1024, 0.0, False)
    assert (cfg.learning_rate, cfg.min_lr) == (6e-4, 6e-5)
    assert (cfg.max_iters, cfg.lr_decay_iters, cfg.warmup_iters) == (10000, 10000, 200)
    assert (cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.grad_clip) == (0.1, 0.9, 0.95, 1.0)
    assert (cfg.eval_interval, cfg.eval_iters, cfg.sinkhorn_iters) == (500, 200, 20)
    assert cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps == 131072


def assert_one_line_config_error(arg, words):
    with pytest.raises(ConfigError) as info:
        load_config([arg])
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("size, lr, min_lr", [("S", 1e-3, 1e-4), ("M", 6e-4, 6e-5), ("L", 3e-4, 3e-5),
                                               ("XL", 2e-4, 2e-5), ("7B", 1.2e-4, 1.2e-5)])
def test_size_files_and_size_override_give_the_papers_learning_rates(size, lr, min_lr):
    """S, M, L: the paper's; XL and 7B (ours) continue its rule with GPT-3's rates for those shapes."""
    from_file = load_config([os.path.join(REPO_DIR, "configs", f"{size}.py")])
    from_flag = load_config([f"--size={size}"])
    for cfg in (from_file, from_flag):
        assert (cfg.size, cfg.learning_rate, cfg.min_lr) == (size, lr, min_lr)


def test_every_config_file_loads_and_the_table1_combinations_compose():
    for path in glob.glob(os.path.join(REPO_DIR, "configs", "*.py")):
        load_config([path])
    configs = os.path.join(REPO_DIR, "configs")
    for data_file, dataset in (("owt.py", "openwebtext"), ("fineweb_edu.py", "fineweb_edu")):
        for residual in ("res", "hc", "mhc", "mhclite"):
            cfg = load_config([os.path.join(configs, data_file), os.path.join(configs, "L.py"),
                               os.path.join(configs, f"{residual}.py")])
            assert (cfg.dataset, cfg.size, cfg.residual) == (dataset, "L", residual)


def test_files_compose_left_to_right_and_overrides_win(tmp_path):
    a = write(tmp_path / "a.py", '"""doc"""\nbatch_size = 4\nmax_iters = 100\n')
    b = write(tmp_path / "b.py", "# comment\nbatch_size = 8\n")
    cfg = load_config([a, b])
    assert (cfg.batch_size, cfg.max_iters) == (8, 100)
    cfg = load_config([a, "--batch_size=2", b])  # order on the line is the order applied
    assert cfg.batch_size == 8
    cfg = load_config([a, b, "--batch_size=2"])
    assert cfg.batch_size == 2


def test_values_are_coerced_to_the_field_types():
    cfg = load_config(["--max_iters=1e4", "--learning_rate=3e-4", "--wandb_log=true", "--bias=1",
                       "--always_save_checkpoint=False", "--mhclite_perms=None", "--compile=False"])
    assert cfg.max_iters == 10000 and type(cfg.max_iters) is int
    assert cfg.learning_rate == 3e-4 and cfg.wandb_log is True and cfg.bias is True
    assert cfg.always_save_checkpoint is False and cfg.mhclite_perms is None and cfg.compile == "false"
    assert load_config(["--mhclite_perms=6"]).mhclite_perms == 6
    assert load_config(["--weight_decay=0"]).weight_decay == 0.0
    assert load_config(["--compile=auto"]).compile == "auto"


@pytest.mark.parametrize("arg, words", [
    ("--max_iters=1.5", ["max_iters", "int"]),
    ("--max_iters=ten", ["max_iters", "int"]),
    ("--learning_rate=fast", ["learning_rate", "float"]),
    ("--wandb_log=yes", ["wandb_log", "bool"]),
    ("--mhclite_perms=all", ["mhclite_perms", "int or None"]),
    ("--compile=sometimes", ["compile", "auto, True or False"]),
    ("--residual=foo", ["unknown residual 'foo'", "res, hc, mhc, mhclite"]),
    ("--size=XXL", ["unknown size 'XXL'", "tiny, S, M, L, XL, 7B"]),
    ("--init_from=latest", ["unknown init_from 'latest'", "scratch, resume, auto"]),
    ("--dtype=float16", ["unknown dtype", "float32, bfloat16"]),
    ("--device=tpu", ["unknown device 'tpu'"]),
    ("--batch_size=0", ["batch_size must be >= 1"]),
    ("--n_layers=4", ["unknown config key 'n_layers'", "valid keys:", "n_layer"]),
    ("max_iters=5", ["cannot parse argument"]),
])
def test_bad_values_give_one_clear_line(arg, words):
    assert_one_line_config_error(arg, words)


def test_unknown_key_or_bad_type_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path / "x.py", "n_layers = 4\n")
    with pytest.raises(ConfigError, match=r"x\.py: unknown config key 'n_layers'; valid keys: .*max_iters"):
        load_config([path])
    path = write(tmp_path / "y.py", "max_iters = 'many'\n")
    with pytest.raises(ConfigError, match=r"y\.py: max_iters must be int"):
        load_config([path])


def test_config_files_hold_only_literal_assignments(tmp_path):
    path = write(tmp_path / "code.py", "max_iters = 10\nimport os\n")
    with pytest.raises(ConfigError, match=r"code\.py line 2: only `name = literal`"):
        load_config([path])
    path = write(tmp_path / "expr.py", "max_iters = 10 * n\n")
    with pytest.raises(ConfigError, match=r"expr\.py line 1"):
        load_config([path])
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config([str(tmp_path / "missing.py")])


def test_conflicting_sizes_in_two_files_are_one_clear_line(tmp_path):
    s = os.path.join(REPO_DIR, "configs", "S.py")
    m = os.path.join(REPO_DIR, "configs", "M.py")
    with pytest.raises(ConfigError) as info:
        load_config([s, m])
    message = str(info.value)
    assert message.startswith("conflicting size:") and "S.py" in message and "M.py" in message
    assert "\n" not in message
    assert load_config([s, "--size=M"]).size == "M"  # an explicit override is not a conflict
    assert load_config([s, s]).size == "S"


def test_out_dir_default_and_explicit(tmp_path):
    cfg = load_config(["--dataset=fineweb_edu", "--size=S", "--residual=mhclite", "--seed=7"])
    assert cfg.out_dir == os.path.join(REPO_DIR, "out", "fineweb_edu-S-mhclite-s7")
    assert cfg.wandb_run_name == "fineweb_edu-S-mhclite-s7"
    assert cfg.data_dir == os.path.join(REPO_DIR, "data")
    assert load_config([f"--out_dir={tmp_path}"]).out_dir == str(tmp_path)


# A value other than the default for every setting, as a user writes it.
NON_DEFAULT = dict(
    residual="mhclite", n_streams=3, mhclite_perms=4, mhclite_perm_sampling="cover", perm_seed=5, sinkhorn_iters=7,
    mhc_eps=1e-6,
    block_size=64, n_layer=3, n_head=2, n_embd=48, bias=True, stream_dtype="bfloat16", final_norm="per_stream",
    rms_eps=0.0, sinkhorn_order="rows_then_cols", init_stream="drawn", connection_weight_decay="authors",
    h_res_dtype="autocast", mixing_dtype="autocast", fused_connections=True, dropout=0.25, recompute_connections=True,
    size="S", learning_rate=2e-3, min_lr=1e-5, weight_decay=0.05, beta1=0.8, beta2=0.99, grad_clip=0.5,
    warmup_iters=10, lr_decay_iters=500, max_iters=1000, dataset="shakespeare", data_dir="/data/corpora",
    allow_data_change=True, batch_size=4, gradient_accumulation_steps=2, out_dir="/runs/a", init_from="auto", seed=7,
    eval_interval=50, eval_iters=20, log_interval=5, always_save_checkpoint=False, ckpt_interval=100,
    keep_checkpoints=3, wandb_log=True, wandb_project="p", wandb_run_name="r", parallel="fsdp",
    activation_checkpointing=True, device="cuda:1", dtype="bfloat16", compile="true", compile_mode="blocks",
    peak_flops=1e15)


def test_every_setting_takes_its_value_from_the_command_line_and_from_a_file(tmp_path):
    """Each setting set to a value other than its default, as --key=value and as `key = value` in
    a config file, arrives as that value, of its field's type."""
    assert NON_DEFAULT.keys() == {f.name for f in dataclasses.fields(TrainConfig)}
    defaults = load_config([])
    assert [key for key, value in NON_DEFAULT.items() if getattr(defaults, key) == value] == []
    from_flags = load_config([f"--{key}={value}" for key, value in NON_DEFAULT.items()])
    from_file = load_config([write(tmp_path / "all.py", "".join(f"{k} = {v!r}\n" for k, v in NON_DEFAULT.items()))])
    for cfg in (from_flags, from_file):
        assert {key: getattr(cfg, key) for key in NON_DEFAULT} == NON_DEFAULT
        assert [key for key, value in NON_DEFAULT.items() if type(getattr(cfg, key)) is not type(value)] == []


@pytest.mark.parametrize("args, words", [
    (["--bogus=1"], ["unknown config key 'bogus'"]),
    (["--max_iters=abc"], ["max_iters must be int"]),
    (["configs/S.py", "configs/L.py"], ["conflicting size"]),
])
def test_train_cli_prints_one_error_line_and_exits_2(args, words, capsys):
    one_error_line(train.main, args, capsys, *words)


@pytest.mark.parametrize("arg, words", [
    ("--learning_rate=-1", ["learning_rate must be > 0", "-1.0"]),
    ("--learning_rate=0", ["learning_rate must be > 0"]),
    ("--learning_rate=nan", ["learning_rate must be a finite number"]),
    ("--learning_rate=inf", ["learning_rate must be a finite number"]),
    ("--learning_rate=1e38", ["learning_rate=1e+38 is too large", "(1 - beta1) exceeds the largest float32"]),
    ("--min_lr=-1e-5", ["min_lr must be >= 0"]),
    ("--min_lr=1e-2", ["min_lr=0.01 must be <= learning_rate=0.0006"]),
    ("--beta1=-0.1", ["beta1 must be in [0, 1)"]),
    ("--beta1=1", ["beta1 must be in [0, 1)"]),
    ("--beta2=1.5", ["beta2 must be in [0, 1)"]),
    ("--weight_decay=-0.1", ["weight_decay must be >= 0"]),
    ("--warmup_iters=-1", ["warmup_iters must be >= 0"]),
    ("--lr_decay_iters=0", ["lr_decay_iters must be >= 1"]),
    ("--lr_decay_iters=100", ["warmup_iters=200 must be < lr_decay_iters=100"]),
    ("--max_iters=0", ["max_iters must be >= 1"]),
    ("--eval_interval=0", ["eval_interval must be >= 1"]),
    ("--log_interval=-5", ["log_interval must be >= 1"]),
    ("--ckpt_interval=-1", ["ckpt_interval must be >= 0 (0: save only at evaluations)"]),
    ("--eval_iters=0", ["eval_iters must be >= 1"]),
    ("--gradient_accumulation_steps=0", ["gradient_accumulation_steps must be >= 1"]),
    ("--block_size=0", ["block_size must be >= 1"]),
    ("--dropout=1", ["dropout must be in [0, 1)"]),
    ("--dropout=-0.1", ["dropout must be in [0, 1)"]),
    ("--grad_clip=-1", ["grad_clip must be >= 0"]),
    ("--n_streams=0", ["n_streams must be >= 1"]),
    ("--sinkhorn_iters=0", ["sinkhorn_iters must be >= 1"]),
    ("--mhclite_perms=0", ["mhclite_perms must be >= 1"]),
    ("--n_layer=0", ["n_layer must be >= 1"]),
    ("--n_head=-2", ["n_head must be >= 1"]),
    ("--n_embd=0", ["n_embd must be >= 1"]),
    ("--peak_flops=0", ["peak_flops must be > 0"]),
    ("--seed=-1", ["seed must be in [0, 2**31)"]),
])
def test_numeric_settings_out_of_range_give_one_clear_line(arg, words):
    assert_one_line_config_error(arg, words)


def test_a_min_lr_left_at_the_size_default_says_so():
    with pytest.raises(ConfigError, match=r"min_lr=6e-05 \(the default for size M; set --min_lr\) must be <= "):
        load_config(["--learning_rate=1e-5"])
    assert load_config(["--learning_rate=1e-5", "--min_lr=1e-6"]).min_lr == 1e-6


@pytest.mark.parametrize("args", [
    ["--learning_rate=1e-3", "--min_lr=1e-3"],  # constant after warmup
    ["--min_lr=0", "--grad_clip=0", "--weight_decay=0", "--warmup_iters=0", "--beta1=0", "--dropout=0.5"],
    ["--max_iters=100"],  # a smoke run that never leaves the default 200-step warmup
    ["--warmup_iters=100", "--lr_decay_iters=101"],
    ["--mhclite_perms=None", "--peak_flops=None", "--seed=0", "--ckpt_interval=0"],
    ["--learning_rate=3e37", "--beta1=0.9"],  # a first AdamW step of 3e38 still fits a float32
])
def test_values_at_the_edges_of_their_ranges_are_accepted(args):
    cfg = load_config(args)
    for arg in args:
        key, text = arg[2:].split("=")
        assert getattr(cfg, key) == (None if text == "None" else float(text)), arg


def test_train_cli_rejects_a_negative_learning_rate_with_one_line():
    proc = subprocess.run([sys.executable, os.path.join(REPO_DIR, "train.py"), "configs/shakespeare.py",
                           "configs/tiny.py", "--learning_rate=-1"], cwd=REPO_DIR, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == "error: learning_rate must be > 0, got -1.0", proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("arg, words", [
    ("--final_norm=before", ["unknown final_norm 'before'", "after_sum, per_stream"]),
    ("--sinkhorn_order=rows", ["unknown sinkhorn_order 'rows'", "cols_then_rows, rows_then_cols"]),
    ("--init_stream=random", ["unknown init_stream 'random'", "wrapper_mod_n, drawn"]),
    ("--connection_weight_decay=all", ["unknown connection_weight_decay 'all'", "projections, authors"]),
    ("--h_res_dtype=bfloat16", ["unknown h_res_dtype 'bfloat16'", "float32, autocast"]),
    ("--mixing_dtype=bf16", ["unknown mixing_dtype 'bf16'", "float32, autocast"]),
    ("--rms_eps=-1e-6", ["rms_eps must be >= 0"]),
])
def test_bad_authors_settings_give_one_clear_line(arg, words):
    assert_one_line_config_error(arg, words)


def test_help_lists_every_setting_once_under_its_group_with_description_and_default(capsys):
    train.main(["--help"])
    printed = capsys.readouterr().out
    headings = [line for line in printed.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[-5:] == [f"{group}:" for group in GROUPS]
    sections = dict(zip(GROUPS, printed.split("\n\n")[-5:]))
    for f in dataclasses.fields(TrainConfig):
        section = sections[f.metadata["group"]]
        assert printed.count(f"  --{f.name}=") == 1 and f"  --{f.name}={f.default}" in section, f.name
        description = section.split(f"  --{f.name}={f.default}", 1)[1].split("\n  --", 1)[0].strip()
        assert description.startswith(f.metadata["help"]) and len(f.metadata["help"]) > 10, f.name
        for choice in f.metadata["choices"] or ():
            assert choice in description, (f.name, choice)


def test_every_model_setting_reaches_the_model_config_unchanged():
    """The run's model settings are model.ModelSettings itself (not a copy), and all of them reach
    the GPTConfig that train.py builds: a non-default value of each survives the trip. How the model
    runs (Execution) is not among them."""
    assert issubclass(TrainConfig, ModelSettings) and issubclass(TrainConfig, Execution)
    changed = dict(residual="mhclite", n_streams=3, mhclite_perms=4, mhclite_perm_sampling="cover", perm_seed=5,
                   sinkhorn_iters=7, mhc_eps=1e-6, block_size=64, n_layer=3, n_head=2, n_embd=48, dropout=0.25,
                   bias=True,
                   stream_dtype="bfloat16", final_norm="per_stream",
                   rms_eps=0.0, sinkhorn_order="rows_then_cols", init_stream="drawn",
                   connection_weight_decay="authors", h_res_dtype="autocast", mixing_dtype="autocast")
    assert changed.keys() == {f.name for f in dataclasses.fields(ModelSettings)}
    execution = dict(recompute_connections=True, fused_connections=True)
    cfg = load_config([f"--{k}={v}" for k, v in {**changed, **execution}.items()] + ["--seed=9"])
    config = train.build_model_config(cfg, 77)
    assert {key: getattr(config, key) for key in changed} == changed
    assert not any(hasattr(config, key) for key in execution)
    assert (config.vocab_size, config.init_stream_seed) == (77, 9)
    large = load_config(["--size=L", "--n_head=8"])  # the size's shape where the command line leaves it
    assert (large.n_layer, large.n_head, large.n_embd) == (24, 8, 1024)  # as config.json records it
    assert (train.build_model_config(large, 77).n_layer, GPTConfig().n_layer) == (24, 12)


@pytest.mark.parametrize("key, value", [("n_streams", 0), ("rms_eps", -1e-6), ("mixing_dtype", "bf16"),
                                        ("residual", "foo"), ("dropout", 1.0), ("mhclite_perm_sampling", "all")])
def test_a_model_setting_is_checked_once_the_same_from_the_command_line_and_in_code(key, value):
    with pytest.raises(ValueError) as in_code:
        GPTConfig(**{"residual": "mhc", key: value})
    with pytest.raises(ConfigError) as from_command_line:
        load_config(["--residual=mhc", f"--{key}={value}"])
    assert str(from_command_line.value) == str(in_code.value) and "\n" not in str(in_code.value)


def test_the_size_files_set_only_the_size():
    """A size's shape and learning rates live in model.SIZES only; the size files name the size."""
    for size in SIZES:
        assert [key for key, _ in read_config_file(os.path.join(REPO_DIR, "configs", f"{size}.py"))] == ["size"]
