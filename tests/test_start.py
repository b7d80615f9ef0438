"""What a start does with the folder it finds (docs/training.md's table), for real: train.py as its own
process on a run folder whose newest checkpoint is missing, truncated or has a flipped bit resumes
from the newest one that verifies and ends on the uninterrupted run's steps; a folder where nothing
loads, a used folder started from scratch and changed data are each refused in one line, the folder
left byte for byte as it was; `python -m checkpoint verify` lists what a folder holds. The sharded
format's damaged shard: test_sharded.py; the files' digests themselves: test_digests.py."""
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

import train
from checkpoint import load_checkpoint
from config import REPO_DIR
from conftest import (RUN, assert_one_error_line, assert_uninterrupted, one_error_line, run_args, run_script,
                      snapshot, tiny_args, write_char_dataset)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kept_run(data_dir, tmp_path_factory):
    """conftest's run cut at step 6 (its schedule still ends at 8) with --keep_checkpoints=3: ckpt.pt
    (step 6), ckpt.4.pt and ckpt.3.pt, each with its digest record. Each test takes a copy."""
    out = tmp_path_factory.mktemp("kept") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference run
    try:
        train.main(run_args(data_dir, out, max_iters=6, keep_checkpoints=3))
    finally:
        torch.set_num_threads(threads)
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == ["ckpt.3.pt", "ckpt.4.pt", "ckpt.pt"]
    return out


def copy_of(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def remove(path):
    path.unlink()
    path.with_name(path.name + ".digest.json").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("damage", [remove, truncate, flip_a_bit], ids=["missing", "truncated", "bit-flipped"])
def test_a_missing_or_damaged_newest_checkpoint_falls_back_to_the_newest_good_one(kept_run, data_dir, tmp_path,
                                                                                 reference, damage):
    out = copy_of(kept_run, tmp_path)
    damage(out / "ckpt.pt")
    damaged = (out / "ckpt.pt").read_bytes() if damage is not remove else None
    proc = run_script("train.py", *run_args(data_dir, out, keep_checkpoints=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note:")]
    resumed = f"note: resuming from {out / 'ckpt.4.pt'} (step 4), the newest checkpoint in {out} that loads and " \
              f"verifies"
    if damage is remove:
        assert notes == [f"{resumed}; {out / 'ckpt.pt'} is missing"]
    else:
        why = "truncated to " if damage is truncate else "its bytes differ from those its save of step 6 wrote"
        assert notes[0].startswith(f"note: {out / 'ckpt.pt'} is damaged: ") and why in notes[0]
        assert notes[0].endswith("; skipping it (step 6)") and notes[1] == resumed
        assert notes[2] == f"note: set {out / 'ckpt.pt'} aside as {out / 'ckpt.pt.damaged'}"
        assert (out / "ckpt.pt.damaged").read_bytes() == damaged  # kept as it was, where no start takes it
    assert "resuming at step 4 of 8" in proc.stdout
    assert_uninterrupted(out, reference)


def test_a_folder_where_no_checkpoint_loads_is_refused_in_one_line_and_left_as_it_was(kept_run, data_dir, tmp_path):
    out = copy_of(kept_run, tmp_path)
    truncate(out / "ckpt.pt")
    flip_a_bit(out / "ckpt.4.pt")
    (out / "ckpt.3.pt.digest.json").unlink()  # as written before checkpoints carried digests: read as it is
    truncate(out / "ckpt.3.pt")
    before = snapshot(out)
    proc = run_script("train.py", *run_args(data_dir, out))
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_error_line(proc.stderr, f"no checkpoint in {out} loads", f"{out / 'ckpt.pt'} is damaged: truncated",
                          f"{out / 'ckpt.4.pt'} is damaged: its bytes differ",
                          f"{out / 'ckpt.3.pt'} is truncated, corrupt or not a checkpoint", "nothing was changed",
                          f"mv {out} {out}.unusable", alone=True)
    assert snapshot(out) == before


def test_scratch_on_a_folder_with_a_run_is_refused_naming_what_it_holds(kept_run, data_dir, tmp_path, capsys):
    out = copy_of(kept_run, tmp_path)
    before = snapshot(out)
    one_error_line(train.main, tiny_args(data_dir, out, **RUN), capsys,  # --init_from=scratch, the default
                   f"{out} holds a run (ckpt.pt, ckpt.4.pt, ckpt.3.pt, metrics.jsonl (steps up to 6))",
                   "--init_from=resume", f"mv {out} {out}.old")
    assert snapshot(out) == before
    for path in out.glob("ckpt*"):  # the checkpoints gone, the history still there
        path.unlink()
    before = snapshot(out)
    one_error_line(train.main, tiny_args(data_dir, out, **RUN), capsys,
                   "holds a run (metrics.jsonl (steps up to 6))")
    one_error_line(train.main, run_args(data_dir, out), capsys, "records training up to step 6",
                   "holds no checkpoint to continue it", f"mv {out} {out}.old")
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_resume_on_changed_data_is_refused_and_goes_on_when_allowed(data_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(data_dir / "toy", data / "toy")
    out = tmp_path / "run"
    train.main(run_args(data, out, max_iters=2, eval_interval=2))
    recorded = load_checkpoint(str(out / "ckpt.pt"))["data_files"]
    assert recorded.keys() == {"train.bin", "val.bin", "meta.json"}
    train_bin = data / "toy" / "train.bin"
    train_bin.write_bytes(train_bin.read_bytes()[:-200])  # another corpus, 100 tokens shorter
    before = snapshot(out)
    proc = run_script("train.py", *run_args(data, out, max_iters=4, eval_interval=2))
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, f"the data in {data / 'toy'} differs from what {out / 'ckpt.pt'} was trained on",
                          f"train.bin has {train_bin.stat().st_size:,} bytes, the run's had "
                          f"{recorded['train.bin']['bytes']:,}", "--data_dir", "--allow_data_change=True", alone=True)
    assert snapshot(out) == before

    capsys.readouterr()
    train.main(run_args(data, out, max_iters=4, eval_interval=2, allow_data_change=True))
    assert "note: going on with changed data (--allow_data_change=True, recorded in config.json): train.bin has" in \
        capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["allow_data_change"] is True
    saved = load_checkpoint(str(out / "ckpt.pt"))
    assert saved["step"] == 4 and saved["data_files"]["train.bin"]["bytes"] == train_bin.stat().st_size


def test_data_of_another_vocabulary_is_refused_even_when_changed_data_is_allowed(kept_run, tmp_path, capsys):
    out = copy_of(kept_run, tmp_path)
    (tmp_path / "data").mkdir()
    write_char_dataset(tmp_path / "data", "toy", "0123456789 \n" * 400)  # 12 characters, not the run's
    before = snapshot(out)
    one_error_line(train.main, run_args(tmp_path / "data", out, allow_data_change=True), capsys,
                   "holds a different model (vocab_size: checkpoint ", "vs run 12)",
                   "train on the run's data (its tokenizer sets vocab_size)", alone=False)
    assert snapshot(out) == before


def test_a_non_finite_loss_right_after_a_resume_says_the_checkpoint_verified(kept_run, data_dir, tmp_path, capsys,
                                                                             monkeypatch):
    out = copy_of(kept_run, tmp_path)
    real_step = train.train_step

    def step_with_weights_blown_up(train_model, model, *args):
        with torch.no_grad():
            next(model.parameters()).fill_(math.nan)
        return real_step(train_model, model, *args)

    monkeypatch.setattr(train, "train_step", step_with_weights_blown_up)
    with pytest.raises(SystemExit) as info:
        train.main(run_args(data_dir, out))
    assert info.value.code == 1
    assert_one_error_line(capsys.readouterr().err, "non-finite loss at step 7",
                          f"{out / 'ckpt.pt'} keeps the checkpoint this start resumed (step 6)",
                          "matched the digests recorded when it was saved: the checkpoint is intact")


def test_verify_lists_every_checkpoint_with_its_step_and_whether_it_verifies(kept_run, tmp_path):
    out = copy_of(kept_run, tmp_path)
    flip_a_bit(out / "ckpt.4.pt")
    (out / "ckpt.3.pt.digest.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "checkpoint", "verify", str(out)], cwd=REPO_DIR, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # one is damaged
    assert proc.stdout.splitlines() == [
        f"{out / 'ckpt.pt'}  step 6  verified",
        f"{out / 'ckpt.4.pt'}  step 4  damaged: {out / 'ckpt.4.pt'} is damaged: its bytes differ from those its save "
        f"of step 4 wrote (SHA-256 mismatch)",
        f"{out / 'ckpt.3.pt'}  step 3  not verified: no digests (written before checkpoints carried them)"]
