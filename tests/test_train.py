"""train.py and the checkpoint package end to end on CPU: a tiny model on a tiny char-level corpus written
into tmp_path. Covers the four variants, exact resume, 2-process DDP equivalence, SIGTERM, a
non-finite loss, damaged checkpoints and the one-line errors (what a start does with each folder it
finds: test_start.py)."""
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import dataloader
import train
from checkpoint import (CheckpointError, CheckpointManager, ModelState, OptimizerState, TrainState, load_checkpoint,
                        save_checkpoint)
from config import REPO_DIR, load_config
from conftest import (assert_one_error_line, one_error_line, read_all_metrics, read_metrics, run_script,
                      tiny_args)
from model import GPT, GPTConfig
from sample import load_model

TRAIN_KEYS = {"step", "train_loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "mfu"}
EVAL_KEYS = {"step", "eval_train_loss", "val_loss"}


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# Pieces


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = load_config(["--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=10", "--max_iters=110"])
    lrs = [train.get_lr(it, cfg) for it in range(130)]
    warmup = np.diff(lrs[:11])
    assert np.allclose(warmup, warmup[0]) and warmup[0] > 0
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[60] == pytest.approx(0.5 * (1e-3 + 1e-4))  # halfway through the cosine
    assert lrs[110:] == [pytest.approx(1e-4)] * 20


def test_global_batch_is_the_same_set_of_sequences_for_any_world_size(data_dir):
    path = str(data_dir / "toy" / "train.bin")
    cfg = load_config(["--batch_size=3", "--gradient_accumulation_steps=4", "--block_size=16"])
    shares = {}
    for world_size in (1, 2, 4):
        generators = [dataloader.make_generator(5, dataloader.TRAIN_STREAM) for _ in range(world_size)]
        shares[world_size] = [torch.cat([dataloader.step_offsets(g, path, cfg, rank, world_size)
                                         for rank, g in enumerate(generators)]) for _ in range(3)]
        # every rank's generator has advanced identically, so the data position is rank-free
        assert len({bytes(g.get_state().numpy()) for g in generators}) == 1
    for step in range(3):
        assert shares[1][step].shape == (4, 3)
        assert torch.equal(shares[1][step], shares[2][step]) and torch.equal(shares[1][step], shares[4][step])
    assert not torch.equal(shares[1][0], shares[1][1])
    other_seed = dataloader.step_offsets(dataloader.make_generator(6, dataloader.TRAIN_STREAM), path, cfg, 0, 1)
    assert not torch.equal(other_seed, shares[1][0])


def test_save_checkpoint_is_atomic(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"step": 1, "weights": torch.ones(3)})
    with pytest.raises(Exception):
        save_checkpoint(path, {"step": 2, "bad": lambda: None})  # fails while pickling
    assert torch.load(path, weights_only=True)["step"] == 1 and load_checkpoint(path, required=("step",))["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.digest.json"]


def test_the_states_continue_from_their_state_dicts():
    """The union of the states' state_dict() is what a checkpoint holds of the run, loadable with
    weights_only; load_state_dict() into other states continues it: the next step is the same step."""
    config = GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=16, residual="mhclite")
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))

    def fresh(seed):
        torch.manual_seed(seed)
        model = GPT(config)
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
        return dict(model=ModelState(model), optimizer=OptimizerState(model, optimizer),
                    train=TrainState(dataloader.make_generator(seed, dataloader.TRAIN_STREAM)))

    def train_step(states):
        model, optimizer, state = states["model"].model, states["optimizer"].optimizer, states["train"]
        model(tokens, tokens)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        return torch.randint(100, (4,), generator=state.train_generator)  # the data position moves

    states = fresh(0)
    train_step(states)
    states["train"].best_val_loss = 2.5
    buffer = io.BytesIO()
    torch.save({key: value for state in states.values() for key, value in state.state_dict().items()}, buffer)
    buffer.seek(0)
    resumed = fresh(1)
    ckpt = torch.load(buffer, weights_only=True)
    assert ckpt.keys() == {"model", "model_args", "optimizer", "step", "best_val_loss", "data_state"}
    for state in resumed.values():
        state.load_state_dict(ckpt)
    assert (resumed["train"].step, resumed["train"].best_val_loss) == (1, 2.5)
    assert torch.equal(train_step(resumed), train_step(states))
    for (name, p), q in zip(states["model"].model.named_parameters(), resumed["model"].model.parameters()):
        assert torch.equal(p, q), name


def test_damaged_or_foreign_files_are_one_clear_line(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_checkpoint(str(tmp_path / "none.pt"))
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint" * 100)
    for name in ("empty.pt", "junk.pt"):
        with pytest.raises(CheckpointError, match="truncated, corrupt or not a checkpoint"):
            load_checkpoint(str(tmp_path / name))
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a train.py checkpoint"):
        load_checkpoint(str(tmp_path / "other.pt"))


# ----------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["res", "hc", "mhc", "mhclite"])
def test_each_variant_trains_and_logs_metrics(data_dir, tmp_path, residual):
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, residual=residual))
    train_records, eval_records = read_metrics(out)
    assert [r["step"] for r in train_records] == list(range(1, 21))
    assert [r["step"] for r in eval_records] == [0, 10, 20]
    for r in train_records:
        assert set(r) == TRAIN_KEYS and r["mfu"] is None
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in TRAIN_KEYS - {"step", "mfu"})
    for r in eval_records:
        assert set(r) == EVAL_KEYS
    losses = [r["train_loss"] for r in train_records]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    assert eval_records[-1]["val_loss"] < eval_records[0]["val_loss"] - 0.3
    assert train_records[0]["lr"] < train_records[3]["lr"]  # warmup
    config = json.loads((out / "config.json").read_text())
    assert (config["residual"], config["max_iters"], config["out_dir"]) == (residual, 20, str(out))
    assert (out / "done").read_text().strip() == "20"
    model, ckpt = load_model(str(out / "ckpt.pt"))
    assert ckpt["step"] == 20 and ckpt["config"]["residual"] == residual
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert model.config.n_streams == (1 if residual == "res" else 4) and not model.training


@pytest.mark.slow
def test_resume_continues_the_exact_trajectory(data_dir, tmp_path):
    common = dict(residual="mhc", max_iters=16, lr_decay_iters=16, eval_interval=4)
    train.main(tiny_args(data_dir, tmp_path / "straight", **common))
    train.main(tiny_args(data_dir, tmp_path / "split", **dict(common, max_iters=8)))
    # a crash after the checkpoint at step 8 would have left later lines; resume drops them
    with open(tmp_path / "split" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "train_loss": 99.0}) + "\n" + '{"step": 10, "train_lo')
    train.main(tiny_args(data_dir, tmp_path / "split", init_from="resume", **common))

    straight_train, straight_eval = read_metrics(tmp_path / "straight")
    split_train, split_eval = read_metrics(tmp_path / "split")
    assert [r["step"] for r in split_train] == list(range(1, 17))
    assert [r["step"] for r in split_eval] == [0, 4, 8, 12, 16]
    for a, b in zip(straight_train, split_train, strict=True):
        assert a["step"] == b["step"] and a["lr"] == b["lr"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-6)
    for a, b in zip(straight_eval, split_eval, strict=True):
        assert a["step"] == b["step"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-6)
        assert a["eval_train_loss"] == pytest.approx(b["eval_train_loss"], abs=1e-6)
    a, b = load_checkpoint(str(tmp_path / "straight" / "ckpt.pt")), load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))
    assert all(torch.allclose(a["model"][k], b["model"][k], atol=1e-6) for k in a["model"])


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_double_accumulation(data_dir, tmp_path):
    args = dict(max_iters=6, eval_interval=3, gradient_accumulation_steps=4, log_interval=2)
    train.main(tiny_args(data_dir, tmp_path / "one", **args))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(REPO_DIR, "train.py"), *tiny_args(data_dir, tmp_path / "two", **args)],
                          cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 x cpu" in proc.stdout
    one_train, one_eval = read_metrics(tmp_path / "one")
    two_train, two_eval = read_metrics(tmp_path / "two")
    assert len(one_train) == len(two_train) == 6 and len(one_eval) == len(two_eval) == 3
    for a, b in zip(one_train + one_eval, two_train + two_eval):
        assert a["step"] == b["step"]
        for key in ("train_loss", "grad_norm", "val_loss", "eval_train_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5)
    assert two_train[-1]["train_loss"] < two_train[0]["train_loss"]


@pytest.mark.slow
def test_sigterm_saves_a_loadable_checkpoint_at_a_step_boundary(data_dir, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(data_dir, out, residual="hc", max_iters=100000, eval_interval=100000, log_interval=1,
                     gradient_accumulation_steps=1)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, os.path.join(REPO_DIR, "train.py"), *args], cwd=REPO_DIR, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(read_metrics(out)[0]) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "stopped by signal" in stdout
    ckpt = load_checkpoint(str(out / "ckpt.pt"))
    train_records, _ = read_metrics(out)
    assert ckpt["step"] == train_records[-1]["step"] >= 3
    assert [r["step"] for r in train_records] == list(range(1, ckpt["step"] + 1))
    assert not (out / "done").exists()
    # the saved run continues where it stopped, without gaps or duplicate lines
    stop_step = ckpt["step"]
    train.main(args + ["--init_from=resume", f"--max_iters={stop_step + 2}"])
    train_records, _ = read_metrics(out)
    assert [r["step"] for r in train_records] == list(range(1, stop_step + 3))


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(data_dir, tmp_path, capsys,
                                                                             monkeypatch):
    real_step, steps = train.train_step, []

    def step_with_weights_blown_up_at_7(train_model, model, *args):
        steps.append(1)  # a run from scratch: the n-th call is step n
        if len(steps) == 7:
            with torch.no_grad():
                next(model.parameters()).fill_(math.nan)
        return real_step(train_model, model, *args)

    monkeypatch.setattr(train, "train_step", step_with_weights_blown_up_at_7)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        train.main(tiny_args(data_dir, out, max_iters=10, eval_interval=4, log_interval=1))
    assert info.value.code == 1
    assert_one_error_line(capsys.readouterr().err, "non-finite loss at step 7", "step 4")
    model, ckpt = load_model(str(out / "ckpt.pt"))
    assert ckpt["step"] == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    train_records, _ = read_metrics(out)
    assert train_records[-1]["step"] == 6
    assert not (out / "done").exists()


# ----------------------------------------------------------------------------------------------
# Timing of the first step, TF32, schedule changes on resume


def slow_first_step(monkeypatch, seconds):
    """Make the first optimizer step of every train.main call `seconds` slower, as compiling does."""
    real = train.step_offsets
    calls = []

    def offsets(*args):
        if not calls:
            time.sleep(seconds)
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(train, "step_offsets", offsets)
    return calls


def test_the_first_step_is_timed_apart_and_kept_out_of_the_step_timings(data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    slow_first_step(monkeypatch, 2.0)
    train.main(tiny_args(data_dir, out, max_iters=10, log_interval=5, eval_interval=10))
    train_records, _, first_records = read_all_metrics(out)
    [first] = first_records
    assert first["step"] == 1 and first["compiled"] is False and first["first_step_s"] >= 2.0
    # the 2 s would add >= 400 ms to each step of a 5-step window: both windows are steps 2..10 only
    assert all(r["step_ms"] < 200 and r["tokens_per_s"] > 4 * 2 * 32 / 0.2 for r in train_records)
    assert train_records[0]["step_ms"] == train_records[4]["step_ms"] != train_records[5]["step_ms"]
    printed = capsys.readouterr().out
    assert f"first step 1: {first['first_step_s']:.2f} s; not counted in tok/s, ms/step and mfu" in printed

    # resumed, the first step of the new process (which recompiles under torch.compile) is timed apart too
    calls = slow_first_step(monkeypatch, 2.0)
    train.main(tiny_args(data_dir, out, max_iters=14, lr_decay_iters=10, log_interval=1, eval_interval=10,
                         init_from="resume"))
    assert len(calls) == 4
    train_records, _, first_records = read_all_metrics(out)
    assert [r["step"] for r in first_records] == [1, 11] and first_records[1]["first_step_s"] >= 2.0
    assert [r["step"] for r in train_records] == list(range(1, 15))
    resumed = train_records[10:]
    assert resumed[0]["step_ms"] is None and resumed[0]["tokens_per_s"] is None and resumed[0]["mfu"] is None
    assert all(r["step_ms"] < 200 for r in resumed[1:])
    assert "| first step only, timed above" in capsys.readouterr().out


def test_tf32_is_on_while_training_and_restored_after(monkeypatch):
    seen = []
    monkeypatch.setattr(train, "train", lambda *args: seen.append(
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)) or 0)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert train.run(load_config(["--device=cpu"])) == 0
    assert seen == [(True, True)]
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize("device, local_rank, expected", [("cuda", None, "cuda:0"), ("auto", None, "cuda:0"),
                                                        ("cuda", "1", "cuda:1"), ("cuda:2", None, "cuda:2")])
def test_a_cuda_run_in_one_process_gets_an_indexed_device(device, local_rank, expected, monkeypatch):
    """torch.cuda.set_device refuses a bare 'cuda': one process on a GPU gets cuda:<LOCAL_RANK or 0>
    (the CUDA calls replaced, so that this runs without a GPU)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    world = train.setup_distributed(load_config(["--dataset=toy", f"--device={device}"]))
    assert world.device == torch.device(expected) and chosen == [torch.device(expected)]
    assert not world.distributed and world.size == 1


def test_resume_that_moves_the_schedules_horizon_says_so(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=8, eval_interval=4))
    capsys.readouterr()
    train.main(tiny_args(data_dir, out, max_iters=12, eval_interval=4, init_from="resume"))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == ["note: resuming with lr_decay_iters=12 (max_iters=12) where the checkpoint's run had "
                     "lr_decay_iters=8 (max_iters=8): the cosine schedule's horizon moves; pass "
                     "--lr_decay_iters=8 to keep the old schedule"]
    # keeping the horizon: no note, and the steps past it run at min_lr
    train.main(tiny_args(data_dir, tmp_path / "kept", max_iters=8, eval_interval=4))
    capsys.readouterr()
    train.main(tiny_args(data_dir, tmp_path / "kept", max_iters=12, lr_decay_iters=8, eval_interval=4,
                         init_from="resume"))
    assert "note:" not in capsys.readouterr().out
    train_records, _ = read_metrics(tmp_path / "kept")
    assert [r["lr"] for r in train_records[8:]] == [3e-4] * 4
    moved, _ = read_metrics(out)
    assert all(r["lr"] > 3e-4 for r in moved[8:11])


# ----------------------------------------------------------------------------------------------
# One-line errors at the command line


@pytest.mark.slow
def test_resume_errors_are_one_line(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, residual="hc", max_iters=2, eval_interval=2))
    capsys.readouterr()

    one_error_line(train.main, tiny_args(data_dir, out, residual="mhc", init_from="resume"), capsys,
                   "residual=hc", "residual=mhc", alone=False)
    # from scratch over a finished run
    one_error_line(train.main, tiny_args(data_dir, out, residual="hc"), capsys, "--init_from=resume", alone=False)

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (out / "ckpt.pt").read_bytes()
    (truncated / "ckpt.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt or not a checkpoint"):
        load_checkpoint(str(truncated / "ckpt.pt"))
    one_error_line(train.main, tiny_args(data_dir, truncated, residual="hc", init_from="resume"), capsys,
                   "truncated, corrupt or not a checkpoint", alone=False)


def test_missing_data_names_the_prepare_script(tmp_path, capsys):
    one_error_line(train.main, tiny_args(tmp_path, tmp_path / "out", dataset="shakespeare_char"), capsys,
                   "missing data file", "prepare_shakespeare.py --tokenizer char", alone=False)


def test_corpus_smaller_than_one_block_is_one_line(data_dir, tmp_path, capsys):
    one_error_line(train.main, tiny_args(data_dir, tmp_path / "out", block_size=4096), capsys,
                   "fewer than block_size + 1 = 4097", alone=False)
    assert not (tmp_path / "out").exists()


def test_sweep_dry_run_lists_the_table1_runs_and_skips_or_resumes(tmp_path):
    script = os.path.join(REPO_DIR, "scripts", "sweep_table1.sh")

    def sweep(*args):
        return subprocess.run(["bash", script, "--out_root", str(tmp_path), *args], capture_output=True, text=True,
                              timeout=60)

    proc = sweep("--dry_run")
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.strip().splitlines()
    assert len(commands) == 24 and all("torch.distributed.run --standalone" in c for c in commands)
    for dataset in ("openwebtext", "fineweb_edu"):
        for size in ("S", "M", "L"):
            for residual in ("res", "hc", "mhc", "mhclite"):
                out_dir = f"--out_dir={tmp_path}/{dataset}-{size}-{residual}-s1337"
                assert sum(out_dir in c.split() for c in commands) == 1

    (tmp_path / "fineweb_edu-M-mhc-s2").mkdir()
    (tmp_path / "fineweb_edu-M-mhc-s2" / "done").write_text("10000\n")
    (tmp_path / "fineweb_edu-M-mhclite-s2").mkdir()
    (tmp_path / "fineweb_edu-M-mhclite-s2" / "ckpt.pt").write_bytes(b"")
    proc = sweep("--dry_run", "--nproc", "8", "--seeds", "1 2", "--datasets", "fineweb_edu", "--sizes", "M",
                 "--residuals", "mhc mhclite", "--", "--wandb_log=True")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[2] == f"skip (finished): {tmp_path}/fineweb_edu-M-mhc-s2"
    commands = [line for line in lines if "train.py" in line]
    for command in commands:
        assert "--nproc_per_node=8" in command and "configs/fineweb_edu.py configs/M.py" in command
        assert command.rstrip().endswith("--wandb_log=True")
    # the same command starts a new run and continues a cut one: train.py looks into out_dir
    assert all("--init_from=auto" in c.split() for c in commands)

    proc = sweep("--residuals", "foo")
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, "unknown residual 'foo'")


def test_resume_accepts_checkpoints_older_than_a_setting_and_a_fused_switch(data_dir, tmp_path):
    """A checkpoint written before stream_dtype existed resumes (it used its default);
    fused_connections may change on resume (same model); stream_dtype may not."""
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=2, eval_interval=2))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    del ckpt["model_args"]["stream_dtype"]
    save_checkpoint(str(out / "ckpt.pt"), ckpt)
    train.main(tiny_args(data_dir, out, max_iters=3, eval_interval=3, init_from="resume"))
    train.main(tiny_args(data_dir, out, max_iters=4, eval_interval=4, init_from="resume", fused_connections=True))
    proc = run_script("train.py", *tiny_args(data_dir, out, max_iters=5, init_from="resume", stream_dtype="bfloat16"))
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, "stream_dtype: checkpoint 'float32' vs run 'bfloat16'")


def test_authors_settings_are_saved_and_a_drawn_init_stream_resumes(data_dir, tmp_path):
    """configs/authors.py's settings reach config.json and the checkpoint; the drawn init streams
    come from the run's seed, so the checkpoint rebuilds the same model; a checkpoint written before
    the settings existed resumes with their defaults (the paper's)."""
    out = tmp_path / "run"
    train.main([os.path.join(REPO_DIR, "configs", "authors.py"),
                *tiny_args(data_dir, out, max_iters=2, eval_interval=2, seed=7)])
    saved = json.loads((out / "config.json").read_text())
    assert (saved["final_norm"], saved["init_stream"], saved["connection_weight_decay"]) == (
        "per_stream", "drawn", "authors")
    model, ckpt = load_model(str(out / "ckpt.pt"))
    assert ckpt["model_args"]["init_stream_seed"] == 7 and ckpt["model_args"]["rms_eps"] == 0.0
    drawn = torch.randint(4, (4,), generator=torch.Generator().manual_seed(7)).tolist()
    assert [c.stream_index for c in model.connections()] == drawn
    train.main([os.path.join(REPO_DIR, "configs", "authors.py"),
                *tiny_args(data_dir, out, max_iters=3, eval_interval=3, seed=7, init_from="resume")])

    old = tmp_path / "old"
    train.main(tiny_args(data_dir, old, max_iters=2, eval_interval=2))
    ckpt = torch.load(old / "ckpt.pt", weights_only=True)
    for key in ("final_norm", "rms_eps", "sinkhorn_order", "init_stream", "init_stream_seed",
                "connection_weight_decay", "h_res_dtype", "mixing_dtype"):
        del ckpt["model_args"][key]
    save_checkpoint(str(old / "ckpt.pt"), ckpt)
    train.main(tiny_args(data_dir, old, max_iters=3, eval_interval=3, init_from="resume"))
    proc = run_script("train.py", *tiny_args(data_dir, old, max_iters=4, init_from="resume", final_norm="per_stream"))
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, "final_norm: checkpoint 'after_sum' vs run 'per_stream'")


def test_sweep_authors_option_adds_the_config_and_its_own_run_directories(tmp_path):
    script = os.path.join(REPO_DIR, "scripts", "sweep_table1.sh")
    proc = subprocess.run(["bash", script, "--out_root", str(tmp_path), "--dry_run", "--authors", "--sizes", "S",
                           "--datasets", "openwebtext"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.strip().splitlines()
    assert len(commands) == 4
    for residual, command in zip(("res", "hc", "mhc", "mhclite"), commands):
        assert f"configs/{residual}.py configs/authors.py --seed=1337" in command
        assert f"--out_dir={tmp_path}/openwebtext-S-{residual}-authors-s1337" in command.split()


# ----------------------------------------------------------------------------------------------
# Resuming with changed settings: applied and said, or refused (docs/training.md's table)


@pytest.fixture(scope="module")
def two_step_run(data_dir, tmp_path_factory):
    """A finished 2-step run (one layer) to resume with other settings; each test resumes a copy."""
    out = tmp_path_factory.mktemp("changed") / "run"
    train.main(tiny_args(data_dir, out, n_layer=1, n_embd=32, max_iters=2, eval_interval=2))
    return out


def resume_copy(two_step_run, data_dir, tmp_path, **overrides):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    return tiny_args(data_dir, out, **dict(dict(n_layer=1, n_embd=32, max_iters=4, lr_decay_iters=2,
                                                 eval_interval=2, init_from="resume"), **overrides))


def notes(printed):
    return [line for line in printed.splitlines() if line.startswith("note:")]


def test_resumed_optimizer_settings_are_applied_and_said(two_step_run, data_dir, tmp_path, capsys, monkeypatch):
    """AdamW's state_dict carries its param groups' weight decay and betas: loading it alone would
    keep the checkpoint's 0.1 / (0.9, 0.95) while config.json says otherwise."""
    seen, real_restore = [], CheckpointManager.restore

    def restore(self, states, ckpt):
        real_restore(self, states, ckpt)
        groups = states["optimizer"].optimizer.param_groups
        seen.append([(group["weight_decay"], tuple(group["betas"])) for group in groups])

    monkeypatch.setattr(CheckpointManager, "restore", restore)
    saved_groups = load_checkpoint(str(two_step_run / "ckpt.pt"))["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"])) for g in saved_groups] == [(0.1, (0.9, 0.95)), (0.0, (0.9, 0.95))]
    capsys.readouterr()
    args = resume_copy(two_step_run, data_dir, tmp_path, weight_decay=0.5, beta1=0.8, beta2=0.99, grad_clip=0.5)
    train.main(args)
    assert seen == [[(0.5, (0.8, 0.99)), (0.0, (0.8, 0.99))]]
    assert notes(capsys.readouterr().out) == [
        "note: resuming with settings that differ from the checkpoint's run, applied from step 3 on: "
        "weight_decay=0.5 (was 0.1), beta1=0.8 (was 0.9), beta2=0.99 (was 0.95), grad_clip=0.5 (was 1.0)"]
    final = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert [(g["weight_decay"], tuple(g["betas"])) for g in final["optimizer"]["param_groups"]] == [
        (0.5, (0.8, 0.99)), (0.0, (0.8, 0.99))]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["weight_decay"] == 0.5


def test_resumed_schedule_and_batch_settings_are_applied_and_said(two_step_run, data_dir, tmp_path, capsys):
    capsys.readouterr()
    train.main(resume_copy(two_step_run, data_dir, tmp_path, learning_rate=2e-3, min_lr=1e-4, warmup_iters=1,
                           batch_size=2, gradient_accumulation_steps=1))
    printed = capsys.readouterr().out
    assert notes(printed) == [
        "note: resuming with settings that differ from the checkpoint's run, applied from step 3 on: "
        "learning_rate=0.002 (was 0.003), min_lr=0.0001 (was 0.0003), warmup_iters=1 (was 4), "
        "batch_size=2 (was 4), gradient_accumulation_steps=1 (was 2)"]
    assert "64 tokens/step" in printed  # 2 sequences of 32 tokens, one micro-step
    train_records, _ = read_metrics(tmp_path / "run")
    assert [r["lr"] for r in train_records[2:]] == [1e-4, 1e-4]  # past lr_decay_iters: the new min_lr


def test_resumed_execution_settings_change_silently(two_step_run, data_dir, tmp_path, capsys):
    """How the same model is computed (the connections recomputed in backward, the fused kernels,
    which CPU does not take, activation checkpointing) may change on resume: no refusal, no note."""
    capsys.readouterr()
    train.main(resume_copy(two_step_run, data_dir, tmp_path, recompute_connections=True, fused_connections=True,
                           activation_checkpointing=True))
    assert notes(capsys.readouterr().out) == []
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["step"] == 4


@pytest.mark.parametrize("overrides, words", [
    (dict(seed=7), ("seed=1337", "seed=7", "--seed=1337")),
    (dict(dataset="toy2"), ("dataset=toy", "dataset=toy2", "--dataset=toy")),
    (dict(n_layer=2), ("a different model", "n_layer: checkpoint 1 vs run 2")),
])
def test_resumed_seed_dataset_and_model_changes_are_refused_in_one_line(two_step_run, data_dir, tmp_path, capsys,
                                                                        overrides, words):
    if "dataset" in overrides:  # the same corpus under another name
        shutil.copytree(data_dir / "toy", tmp_path / "data" / "toy2")
        data_dir = tmp_path / "data"
    args = resume_copy(two_step_run, data_dir, tmp_path, **overrides)
    before = sorted(os.listdir(tmp_path / "run"))
    capsys.readouterr()
    one_error_line(train.main, args, capsys, *words, alone=False)
    assert sorted(os.listdir(tmp_path / "run")) == before
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(residual="kromhc", n_streams=8), dict(residual="ihc"),
                                       dict(residual="mhc", mhc_eps=1e-6)], ids=["kromhc-n8", "ihc", "mhc-v4eps"])
def test_the_variants_after_mhclite_resume_onto_the_exact_trajectory(data_dir, tmp_path, overrides):
    """A run stopped at step 4 and resumed gives the straight run's losses, gradient norms and final
    weights bit for bit (CPU): kromhc's derived permutation matrices, ihc's missing residual logits and
    mhc_eps travel through the checkpoint."""
    common = dict(max_iters=8, lr_decay_iters=8, eval_interval=4, **overrides)
    train.main(tiny_args(data_dir, tmp_path / "straight", **common))
    train.main(tiny_args(data_dir, tmp_path / "split", **dict(common, max_iters=4)))
    train.main(tiny_args(data_dir, tmp_path / "split", init_from="resume", **common))
    straight_train, straight_eval = read_metrics(tmp_path / "straight")
    split_train, split_eval = read_metrics(tmp_path / "split")
    assert [(r["step"], r["train_loss"], r["grad_norm"]) for r in split_train] == \
        [(r["step"], r["train_loss"], r["grad_norm"]) for r in straight_train]
    assert [(r["step"], r["val_loss"]) for r in split_eval] == [(r["step"], r["val_loss"]) for r in straight_eval]
    straight, split = (load_model(str(tmp_path / name / "ckpt.pt"))[0] for name in ("straight", "split"))
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), split.state_dict().values()))
    assert {key: getattr(split.config, key) for key in overrides} == overrides
