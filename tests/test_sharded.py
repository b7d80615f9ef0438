"""The sharded mode (train.py --parallel=fsdp, parallelize.py) and its checkpoints (checkpoint/sharded.py)
on CPU with gloo: two sharded processes train as one process does, a sharded run cut by SIGTERM
resumes on two or one processes on its trajectory, its checkpoint serves sample.py, the export
and the collector, mhclite stays exact under the bf16 policy, and bad input, damaged or unsafe
checkpoints and failed saves are handled."""
import contextlib
import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import checkpoint
import export_hf
import sample
import train
from analysis.collect import collect
from checkpoint import (CheckpointError, CheckpointManager, ModelState, OptimizerState, RNGState, SaveError, TrainState,
                        files)
from config import REPO_DIR, load_config
from conftest import (assert_one_error_line, free_port, load_export, one_error_line, randomise, read_metrics,
                      tiny_args)
from devices import World
from model import GPT, GPTConfig
from parallelize import apply_fsdp, apply_fused_connections
from residuals import capture_connections
from sample import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

# 10 steps of 4 micro-batches, every gradient clipped (its norm stays above 0.3), evals at 0, 5 and
# 10 over 3 batches (one rank of two gets a padding batch).
SHARED = dict(n_layer=1, n_embd=32, batch_size=2, gradient_accumulation_steps=4, max_iters=10, lr_decay_iters=10,
              warmup_iters=2, eval_interval=5, eval_iters=3, log_interval=1, grad_clip=0.3)
RESIDUALS = ("res", "hc", "mhclite")
# float32 rounding: the ranks sum their halves of each gradient in another order than one process
# does (measured ~1e-7 relative), and AdamW's 10 steps carry it on; a gradient summed instead of
# averaged, an unsynchronised micro-step or a clip over one shard moves the loss by 1e-2 or more.
RELATIVE = 1e-5


def torchrun(n, data_dir, out, popen=False, **overrides):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            os.path.join(REPO_DIR, "train.py"), *tiny_args(data_dir, out, parallel="fsdp", **{**SHARED, **overrides})]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if popen:
        return subprocess.Popen(args, cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def one_process_world():
    """The environment torchrun gives a 1-process job, so that train.main runs in this process."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(free_port())).items():
            mp.setenv(key, value)
        yield


@pytest.fixture
def process_group():
    """A 1-process gloo group in this process (fully_shard and DCP need one)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """{residual: (one-process run, two-process sharded run)}; the sharded runs train side by side."""
    root = tmp_path_factory.mktemp("sharded")
    procs = {r: torchrun(2, data_dir, root / f"{r}-two", popen=True, residual=r) for r in RESIDUALS}
    for residual in RESIDUALS:
        train.main(tiny_args(data_dir, root / f"{residual}-one", residual=residual, **SHARED))
    for residual, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
        assert "2 x cpu" in stdout
    return {r: (root / f"{r}-one", root / f"{r}-two") for r in RESIDUALS}


def assert_same_trajectory(expected, actual, steps=None):
    """Equal per-step train loss, gradient norm and eval losses (the eval records by step)."""
    (train_a, eval_a), (train_b, eval_b) = read_metrics(expected), read_metrics(actual)
    assert [r["step"] for r in train_b] == list(range(1, SHARED["max_iters"] + 1))
    evals_b = {r["step"]: r for r in eval_b}
    for a, b in zip(train_a, train_b, strict=True):
        assert a["step"] == b["step"] and a["lr"] == b["lr"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=RELATIVE)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RELATIVE)
    for a in eval_a:
        for key in ("val_loss", "eval_train_loss"):
            assert evals_b[a["step"]][key] == pytest.approx(a[key], rel=RELATIVE)


@pytest.mark.slow
@pytest.mark.parametrize("residual", RESIDUALS)
def test_two_sharded_processes_train_as_one_process(runs, residual):
    one, two = runs[residual]
    assert_same_trajectory(one, two)
    train_records, _ = read_metrics(two)
    assert all(r["grad_norm"] > SHARED["grad_clip"] for r in train_records)  # every step clipped
    assert train_records[-1]["train_loss"] < train_records[0]["train_loss"]
    assert os.path.islink(two / "ckpt.dcp") and not (two / "ckpt.pt").exists()
    assert sorted(p.name for p in two.glob("ckpt.dcp.*")) == ["ckpt.dcp.10"]  # replaced ones removed


@pytest.mark.slow
def test_a_sharded_run_cut_by_sigterm_resumes_on_two_or_one_processes(runs, data_dir, tmp_path):
    out = tmp_path / "cut"
    proc = torchrun(2, data_dir, out, popen=True, residual="mhclite", max_iters=100000)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(read_metrics(out)[0]) >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to both workers
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # (torchrun itself reports the signal with a traceback; the workers stop cleanly)
    assert "stopped by signal" in stdout and "[rank0]: Traceback" not in stderr, stderr[-2000:]
    stop_step = checkpoint.load_sharded_run(str(out / "ckpt.dcp"))["step"]
    assert 3 <= stop_step < SHARED["max_iters"] and read_metrics(out)[0][-1]["step"] == stop_step
    shutil.copytree(out, tmp_path / "cut-copy", symlinks=True)

    resumed = torchrun(2, data_dir, out, residual="mhclite", init_from="auto")  # auto: a checkpoint, so resume
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_trajectory(runs["mhclite"][1], out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with one_process_world():  # auto on a finished run: nothing to do, nothing touched
        train.main(tiny_args(data_dir, out, residual="mhclite", parallel="fsdp", init_from="auto", **SHARED))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    with one_process_world():  # the same checkpoint continued by one process
        train.main(tiny_args(data_dir, tmp_path / "cut-copy", residual="mhclite", parallel="fsdp",
                             init_from="resume", **SHARED))
    assert_same_trajectory(runs["mhclite"][1], tmp_path / "cut-copy")


@pytest.mark.slow
def test_sample_export_and_collector_read_a_sharded_checkpoint(runs, data_dir, tmp_path, capsys):
    sharded_run = runs["mhclite"][1]
    single = tmp_path / "single"
    single.mkdir()
    checkpoint.main(["convert", str(sharded_run / "ckpt.dcp"), str(single / "ckpt.pt")])  # the documented conversion
    from_folder, meta = sample.load(str(sharded_run))
    from_file, _ = load_model(str(single / "ckpt.pt"))
    for key, value in from_file.state_dict().items():
        assert torch.equal(from_folder.state_dict()[key], value), key
    line = one_error_line(train.main, tiny_args(data_dir, single, residual="mhclite", init_from="resume", **SHARED),
                          capsys)
    assert "weights only" in line and "--parallel=fsdp" in line  # the written file is for reading, not resuming
    # the weights are the one-process run's, to the trajectory's rounding
    one_process, _ = load_model(str(runs["mhclite"][0] / "ckpt.pt"))
    for key, value in one_process.state_dict().items():
        assert torch.allclose(from_folder.state_dict()[key], value, atol=1e-3), key

    texts = []
    for run_dir in (sharded_run, single):
        sample.main(["--out_dir", str(run_dir), "--start=the", "--top_k=1", "--max_new_tokens=40", "--num_samples=1"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 40

    exported, _ = load_export(export_hf.export(str(sharded_run), str(tmp_path / "export")))
    tokens = torch.randint(0, from_folder.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = from_folder(tokens, torch.zeros_like(tokens))
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5

    collect(str(sharded_run / "ckpt.dcp"), str(tmp_path / "h.npz"), num_seqs=2, seq_len=16, batch_size=2)
    h_res = np.load(tmp_path / "h.npz")["h_res"]
    assert h_res.shape[0] == 2 and np.abs(h_res.sum(-1) - 1).max() < 1e-6 and np.abs(h_res.sum(-2) - 1).max() < 1e-6


def test_mhclite_stays_exact_and_equal_to_autocast_under_the_bf16_policy(process_group):
    config = GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, residual="mhclite")
    torch.manual_seed(0)
    plain = randomise(GPT(config), 0.1)
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(model):
        with torch.autocast("cpu", dtype=torch.bfloat16), capture_connections(model) as records:
            _, loss = model(tokens, tokens)
        loss.backward()
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1)
                 for name, p in model.named_parameters()}
        return loss.detach(), grads, records

    expected, expected_grads, _ = loss_and_grads(plain)
    sharded = GPT(config)
    sharded.load_state_dict(plain.state_dict())
    loss, grads, records = loss_and_grads(apply_fsdp(sharded, torch.bfloat16))
    for record in records:
        assert (record["h_res"].sum(-1) - 1).abs().max() < 1e-6 and (record["h_res"].sum(-2) - 1).abs().max() < 1e-6
    # only the GEMM weights are gathered in bf16, which autocast casts them to anyway: the same numbers
    assert torch.equal(loss, expected)
    assert all(torch.equal(grads[name], expected_grads[name].reshape(-1)) for name in grads)

    # negative control: the connections gathered in bf16 too compute other numbers than autocast
    naive = GPT(config)
    naive.load_state_dict(plain.state_dict())
    assert not torch.equal(loss_and_grads(shard_with_bf16_connections(naive))[0], expected)


def shard_with_bf16_connections(model):
    from parallelize import as_vectors
    as_vectors(model)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    for block in model.transformer.h:
        for module in (block.attn, block.mlp, block.attn_connection, block.mlp_connection):
            fully_shard(module, mp_policy=bf16)
        fully_shard(block)
    return fully_shard(model)


def test_fused_connections_shard_with_their_block(process_group, monkeypatch):
    import fused
    if not fused.TRITON_AVAILABLE or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused kernels run on CPU in Triton's interpreter only")
    monkeypatch.setattr(fused, "INTERPRET_ON_CPU", True)
    config = GPTConfig(block_size=8, vocab_size=40, n_layer=1, n_head=2, n_embd=32, residual="mhclite")
    torch.manual_seed(0)
    plain = randomise(GPT(config), 0.1)
    sharded = GPT(config)
    sharded.load_state_dict(plain.state_dict())
    for model in (plain, sharded):
        assert apply_fused_connections(model, torch.device("cpu"))["path"] == "fused"
    apply_fsdp(sharded)
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, sharded):
        _, loss = model(tokens, tokens)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        assert torch.equal(p.grad.reshape(-1), q.grad.full_tensor().reshape(-1)), name


def test_a_failed_or_killed_save_keeps_the_previous_checkpoint(process_group, tmp_path, monkeypatch):
    """Saved as train.py saves (CheckpointManager): a save that fails, in run.pt or in the shards,
    is one SaveError line and leaves the link on the previous checkpoint, and a killed save's
    folder is no checkpoint."""
    config = GPTConfig(block_size=16, vocab_size=40, n_layer=1, n_head=2, n_embd=32, residual="hc")
    model = apply_fsdp(randomise(GPT(config), 0.1))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    link = str(tmp_path / "ckpt.dcp")
    cfg = load_config(["--residual=hc", "--parallel=fsdp", f"--out_dir={tmp_path}"])
    world = World(distributed=True, rank=0, size=1, device=torch.device("cpu"), sharded=True)
    manager = CheckpointManager(cfg, world, log=lambda line: None)
    state = TrainState(torch.Generator())
    manager.restore(dict(model=ModelState(model), optimizer=OptimizerState(model, optimizer), train=state,
                         rng=RNGState(world)), None)

    def save(step):
        state.step = step
        manager.save(stopping=True)  # a stop's save: complete on return

    save(1)
    saved = {k: v.clone() for k, v in load_model(link)[0].state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    kept = f"{link} keeps the checkpoint of step 1"
    with monkeypatch.context() as mp:
        mp.setattr(checkpoint.sharded, "save_checkpoint", disk_full)  # run.pt, before any shard
        with pytest.raises(SaveError, match="the disk is full") as failed:
            save(2)
        assert kept in str(failed.value)
    with monkeypatch.context() as mp:
        mp.setattr(dcp.FileSystemWriter, "write_data", disk_full)  # fails while writing shards
        with pytest.raises(SaveError, match="the disk is full") as failed:
            save(3)
        assert kept in str(failed.value)
    # a save killed mid-way leaves a folder of shards and no index
    (tmp_path / "ckpt.dcp.4").mkdir()
    (tmp_path / "ckpt.dcp.4" / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert not checkpoint.has_checkpoint(str(tmp_path / "ckpt.dcp.4"))  # no index: not a checkpoint

    assert os.readlink(link) == "ckpt.dcp.1" and not (tmp_path / "ckpt.dcp.2").exists()
    reloaded, ckpt = load_model(link)
    assert ckpt["step"] == 1 and all(torch.equal(saved[k], v) for k, v in reloaded.state_dict().items())
    save(5)
    manager.close()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.dcp", "ckpt.dcp.5"]
    assert checkpoint.has_checkpoint(str(link)) and checkpoint.find_checkpoint(str(tmp_path)) == str(link)


def fail_the_second_shard_write(monkeypatch, code):
    """DCP's writer raises OSError(code) in the second save's shard write, as a full disk or quota
    does; returns the list of writes made."""
    real_write, writes = dcp.FileSystemWriter.write_data, []

    def write_data(self, *args, **kwargs):
        writes.append(self)
        if len(writes) == 2:
            raise OSError(code, os.strerror(code))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    return writes


@pytest.mark.slow
def test_a_failed_sharded_save_exits_3_with_one_line_and_the_run_resumes(runs, data_dir, tmp_path, monkeypatch,
                                                                        capsys):
    """The step-0 save goes through, the step-5 save hits a full disk while writing its shards:
    one line naming the kept checkpoint, exit 3, ckpt.dcp still the step-0 one; auto then resumes
    from it to the uninterrupted sharded run's trajectory, here with activation checkpointing,
    which shards and computes the same."""
    out = tmp_path / "run"
    fail_the_second_shard_write(monkeypatch, errno.ENOSPC)
    args = tiny_args(data_dir, out, residual="mhclite", parallel="fsdp", init_from="auto", **SHARED)
    with one_process_world(), pytest.raises(SystemExit) as info:
        train.main(args)
    assert info.value.code == 3
    assert_one_error_line(capsys.readouterr().err, "saving the checkpoint of step 5", "the disk is full (ENOSPC",
                          f"{out / 'ckpt.dcp'} keeps the checkpoint of step 0")
    assert checkpoint.load_sharded_run(str(out / "ckpt.dcp"))["step"] == 0
    assert sorted(p.name for p in out.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.0"]
    monkeypatch.undo()
    with one_process_world():  # with the blocks checkpointed as well: the same arithmetic
        train.main(args + ["--activation_checkpointing=True"])
    assert_same_trajectory(runs["mhclite"][1], out)


def test_a_pickle_planted_in_the_metadata_does_not_run(runs, tmp_path):
    folder = tmp_path / "ckpt.dcp"
    shutil.copytree(runs["res"][1] / "ckpt.dcp", folder)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    planted = pickle.dumps(Payload())
    pickle.loads(planted)  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    (folder / ".metadata").write_bytes(planted)
    with pytest.raises(CheckpointError, match="damaged"):  # its digest says so first
        load_model(str(folder))
    size, digest = files.file_digest(folder / ".metadata")
    files.write_record(folder / ".metadata", [dict(step=10, bytes=size, sha256=digest)])  # a planter can redo it
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(str(folder))
    assert not marker.exists()


def test_missing_or_damaged_sharded_checkpoints_are_one_line(runs, data_dir, tmp_path, capsys):
    with one_process_world(), pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(data_dir, tmp_path / "empty", residual="res", parallel="fsdp", init_from="resume",
                             **SHARED))
    assert exit_info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "checkpoint not found", "ckpt.dcp")

    damaged = tmp_path / "damaged"
    shutil.copytree(runs["res"][1], damaged, symlinks=True)
    for shard in (damaged / "ckpt.dcp").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    line = one_error_line(sample.main, ["--out_dir", str(damaged)], capsys)
    assert ".distcp is damaged: truncated to 100 of " in line
    (damaged / "ckpt.dcp" / ".metadata").unlink()
    assert "no .metadata" in one_error_line(sample.main, ["--out_dir", str(damaged)], capsys)
    line = one_error_line(checkpoint.main, ["convert", str(damaged / "ckpt.dcp"), str(tmp_path / "ckpt.pt")], capsys)
    assert "no .metadata" in line


def test_settings_the_sharded_mode_cannot_serve_are_one_line(data_dir, tmp_path, capsys):
    line = one_error_line(train.main, tiny_args(data_dir, tmp_path / "a", parallel="fsdp"), capsys)
    assert "torchrun" in line
    with one_process_world():
        line = one_error_line(train.main, tiny_args(data_dir, tmp_path / "b", parallel="fsdp", compile=True,
                                                    compile_mode="model"), capsys)
    assert "--compile_mode=blocks" in line and not (tmp_path / "b").exists()
    line = one_error_line(train.main, tiny_args(data_dir, tmp_path / "c", parallel="zero"), capsys)
    assert "parallel" in line


@pytest.mark.slow
@pytest.mark.parametrize("stager", ["reused", "one per save"])
def test_a_sharded_save_writes_while_training_goes_on(runs, data_dir, tmp_path, monkeypatch, stager):
    """The sharded save is asynchronous: the step-0 save's shards are written only once step 1 has
    begun (a synchronous save would wait here for the timeout), and the run still trains as the
    one-process run does, every checkpoint complete; with DCP's stager kept from save to save, and
    with a new one per save, as torch versions whose stager closes itself after one save need."""
    if stager == "one per save":
        monkeypatch.setattr(checkpoint.sharded, "STAGER_REUSE_TORCH", (99,))
    stepped, overlapped = threading.Event(), []
    real_write, real_step = dcp.FileSystemWriter.write_data, train.train_step

    def write_data(self, *args, **kwargs):
        overlapped.append(stepped.wait(timeout=10))
        return real_write(self, *args, **kwargs)

    def train_step(*args):
        stepped.set()
        return real_step(*args)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    monkeypatch.setattr(train, "train_step", train_step)
    out = tmp_path / "run"
    with one_process_world():
        train.main(tiny_args(data_dir, out, residual="res", parallel="fsdp", **SHARED))
    assert overlapped == [True] * 3  # steps 0, 5 and 10
    assert_same_trajectory(runs["res"][0], out)
    assert checkpoint.load_sharded_run(str(out / "ckpt.dcp"))["step"] == 10 and (out / "done").read_text() == "10\n"
    assert sorted(p.name for p in out.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.10"]


def continue_sharded(data_dir, out, **overrides):
    """Continue a sharded res run of `runs` in this process to step 12 (schedule unchanged)."""
    with one_process_world():
        train.main(tiny_args(data_dir, out, residual="res", parallel="fsdp", init_from="auto",
                             **dict(SHARED, max_iters=12, eval_interval=6, **overrides)))


@pytest.mark.slow
def test_a_sharded_run_copied_without_its_links_continues_and_saves(runs, data_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(runs["res"][1], copy)  # links followed, as `cp -rL` does: ckpt.dcp becomes a folder
    assert (copy / "ckpt.dcp").is_dir() and not (copy / "ckpt.dcp").is_symlink()
    capsys.readouterr()
    continue_sharded(data_dir, copy)
    printed = capsys.readouterr().out
    assert f"{copy / 'ckpt.dcp'} was a folder, not a link" in printed and "resuming at step 10 of 12" in printed
    assert os.readlink(copy / "ckpt.dcp") == "ckpt.dcp.12"
    assert sorted(p.name for p in copy.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.12"]
    assert checkpoint.load_sharded_run(str(copy / "ckpt.dcp"))["step"] == 12
    assert [r["step"] for r in read_metrics(copy)[0]] == list(range(1, 13))


def steps_of(out):
    """Every train and eval record of a run, without its timings."""
    train_records, eval_records = read_metrics(out)
    return ([(r["step"], r["lr"], r["train_loss"], r["grad_norm"]) for r in train_records],
            [(r["step"], r["eval_train_loss"], r["val_loss"]) for r in eval_records])


@pytest.mark.slow
def test_a_flipped_bit_in_a_shard_falls_back_to_the_kept_checkpoint_and_the_same_steps(runs, data_dir, tmp_path):
    """The two-process run continued by two processes to step 12, keeping ckpt.dcp.10 beside
    ckpt.dcp.12; a bit flipped in rank 1's shard of step 12: the next start finds it damaged by its
    digest, sets it aside, resumes from step 10, and trains steps 11 and 12 to the same floats."""
    out = tmp_path / "run"
    shutil.copytree(runs["res"][1], out, symlinks=True)
    settings = dict(residual="res", init_from="auto", keep_checkpoints=2, max_iters=12, eval_interval=6)
    assert torchrun(2, data_dir, out, **settings).returncode == 0
    uninterrupted = steps_of(out)
    (out / "done").unlink()
    shard = out / "ckpt.dcp.12" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    proc = torchrun(2, data_dir, out, **settings)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note:")]
    assert notes[0] == (f"note: {out / 'ckpt.dcp' / shard.name} is damaged: its bytes differ from those its save of "
                        f"step 12 wrote (SHA-256 mismatch); skipping it (step 12)")
    assert notes[1] == (f"note: resuming from {out / 'ckpt.dcp.10'} (step 10), the newest checkpoint in {out} that "
                        f"loads and verifies")
    assert notes[2] == f"note: set {out / 'ckpt.dcp'} aside as {out / 'ckpt.dcp.12.damaged'}"
    assert (out / "ckpt.dcp.12.damaged" / "__1_0.distcp").read_bytes() == data
    assert "resuming at step 10 of 12" in proc.stdout and steps_of(out) == uninterrupted
    assert sorted(p.name for p in out.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.10", "ckpt.dcp.12",
                                                             "ckpt.dcp.12.damaged"]


@pytest.mark.slow
def test_a_complete_folder_a_killed_save_left_unlinked_is_used_and_the_others_removed(runs, data_dir, tmp_path,
                                                                                     capsys):
    """--keep_checkpoints=2 keeps ckpt.dcp.10 beside ckpt.dcp.12; then a save killed between its
    write and the link swap is staged: the link back on ckpt.dcp.10, a newer folder without its
    index. The next start links ckpt.dcp.12 (the newest complete one) and removes the rest."""
    out = tmp_path / "run"
    shutil.copytree(runs["res"][1], out, symlinks=True)
    continue_sharded(data_dir, out, keep_checkpoints=2)
    assert sorted(p.name for p in out.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.10", "ckpt.dcp.12"]
    assert checkpoint.load_sharded_run(str(out / "ckpt.dcp.10"))["step"] == 10
    os.unlink(out / "ckpt.dcp")
    os.symlink("ckpt.dcp.10", out / "ckpt.dcp")
    (out / "ckpt.dcp.14").mkdir()
    (out / "ckpt.dcp.14" / "__0_0.distcp").write_bytes(b"\0" * 100)
    (out / "done").unlink()
    capsys.readouterr()
    continue_sharded(data_dir, out)
    printed = capsys.readouterr().out
    assert "using ckpt.dcp.12, the newest complete checkpoint" in printed and "resuming at step 12 of 12" in printed
    assert "removed 2 checkpoint folder(s)" in printed
    assert os.readlink(out / "ckpt.dcp") == "ckpt.dcp.12" and (out / "done").read_text() == "12\n"
    assert sorted(p.name for p in out.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.12"]


@pytest.mark.slow
def test_checkpoint_cost_measures_the_stall_of_sync_and_async_sharded_saves(tmp_path):
    """benchmarks/checkpoint_cost.py --sharded, which made docs/scaling.md's table of save stalls: two gloo
    processes, a row per mode with the time the loop was blocked and the time until published."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_cost", "--sharded", "--sizes", "tiny",
                           "--residual", "res", "--repeats", "1", "--out_dir", str(tmp_path)], cwd=REPO_DIR,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in proc.stdout.splitlines()[2:]]
    assert [row[:3] for row in rows] == [["tiny", "7M", "synchronous"], ["tiny", "7M", "asynchronous"]]
    assert all(0 < float(blocked) <= float(published) for _, _, _, blocked, published in rows)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_sharded_save_that_fails_in_the_background_is_one_line_at_the_next_save(data_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    """The step-5 save's shards fail to write while steps 6 to 10 train: the failure surfaces at the
    step-10 save, as one line naming step 5 and the step-0 checkpoint kept; nothing of step 5 or 10
    is left, and the link never moved."""
    writes = fail_the_second_shard_write(monkeypatch, errno.EDQUOT)
    out = tmp_path / "run"
    with one_process_world(), pytest.raises(SystemExit) as info:
        train.main(tiny_args(data_dir, out, residual="res", parallel="fsdp", **SHARED))
    assert info.value.code == 3 and len(writes) == 2
    assert_one_error_line(capsys.readouterr().err, "saving the checkpoint of step 5", "quota is used up (EDQUOT)",
                          f"{out / 'ckpt.dcp'} keeps the checkpoint of step 0")
    assert read_metrics(out)[0][-1]["step"] == 10  # the loop trained on while the save failed
    assert os.readlink(out / "ckpt.dcp") == "ckpt.dcp.0"
    assert sorted(p.name for p in out.glob("ckpt.dcp*")) == ["ckpt.dcp", "ckpt.dcp.0"] and not (out / "done").exists()


def construct_on_two_ranks(configs, folder=None):
    """tests/construction_worker.py under torchrun on 2 processes: [rank 0's line, rank 1's line]."""
    worker = os.path.join(REPO_DIR, "tests", "construction_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           worker, json.dumps(configs), *([str(folder)] if folder else [])], cwd=REPO_DIR,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda record: record["rank"])


def test_a_model_built_on_the_meta_device_and_sharded_gets_one_process_weights_bit_for_bit(tmp_path):
    """Every variant, the authors' drawn streams and a sampled permutation set: the shards of the
    two ranks put together are the weights GPT(config) draws in one process from the same seed."""
    shape = dict(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=12, bias=True)
    configs = [dict(shape, residual=r) for r in ("res", "hc", "mhc")] + [
        dict(shape, residual="mhclite", n_streams=6, mhclite_perms=8, init_stream="drawn", init_stream_seed=3)]
    construct_on_two_ranks(configs, tmp_path)
    for i, settings in enumerate(configs):
        torch.manual_seed(1)
        expected = GPT(GPTConfig(**settings)).state_dict()
        sharded = torch.load(tmp_path / f"{i}.pt")
        assert sharded.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(sharded[name].reshape(value.shape), value), (settings["residual"], name)


@pytest.mark.slow
def test_a_rank_holds_about_its_shard_while_a_large_model_is_built():
    """A 7B-shaped model (width 4096, 32 heads) with 2 layers on 2 processes: each rank's peak memory
    while it builds, shards and initialises the model is its shard plus about the largest parameter
    (the one being drawn), below the whole model: no rank ever holds all of it."""
    config = dict(block_size=64, vocab_size=256, n_layer=2, n_head=32, n_embd=4096, residual="mhclite")
    for record in construct_on_two_ranks([config]):
        assert record["shard"] == pytest.approx(record["whole"] / 2, rel=1e-3)
        assert record["peak"] < record["shard"] + 2 * record["largest"] < record["whole"], record
