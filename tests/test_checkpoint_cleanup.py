"""Temporary checkpoint files: save_checkpoint holds a flock on its temp file while it writes, and
remove_stale_temp_files (run by train.py at start) deletes only the temp files no live writer holds."""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import torch

import checkpoint
import train
from checkpoint import load_checkpoint, remove_stale_temp_files, save_checkpoint
from config import REPO_DIR
from conftest import temp_files, tiny_args

# A child process that starts a real save_checkpoint and stalls inside torch.save, after writing
# part of the file: a writer caught mid-save, as a kill -9 would find it.
STALLED_WRITER = textwrap.dedent("""
    import sys, time
    import torch
    from checkpoint import files

    def stalled_save(obj, f):
        f.write(b"x" * 3_000_000)
        f.flush()
        print("saving", flush=True)
        time.sleep(600)

    torch.save = stalled_save
    files.save_checkpoint(sys.argv[1], {"step": 1})
""")


def start_stalled_writer(ckpt_path):
    proc = subprocess.Popen([sys.executable, "-c", STALLED_WRITER, str(ckpt_path)], cwd=REPO_DIR,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    return proc


def test_a_killed_writers_temp_file_is_removed_and_a_live_ones_is_kept(tmp_path):
    ckpt_path = tmp_path / "ckpt.pt"
    save_checkpoint(str(ckpt_path), {"step": 0})
    live = start_stalled_writer(ckpt_path)
    killed = start_stalled_writer(ckpt_path)
    try:
        assert len(temp_files(tmp_path)) == 2
        assert remove_stale_temp_files(str(ckpt_path)) == (0, 0)  # both writers are alive
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        removed, freed = remove_stale_temp_files(str(ckpt_path))
        assert (removed, freed) == (1, 3_000_000)
        assert len(temp_files(tmp_path)) == 1  # the live writer's file is still there
        assert remove_stale_temp_files(str(ckpt_path)) == (0, 0)
    finally:
        for proc in (live, killed):
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
    assert remove_stale_temp_files(str(ckpt_path)) == (1, 3_000_000)  # its writer is gone now
    assert temp_files(tmp_path) == []
    assert torch.load(ckpt_path, weights_only=True)["step"] == 0  # the checkpoint itself is untouched


def test_only_this_checkpoints_temp_files_are_candidates(tmp_path):
    names = ["ckpt.pt.k3j_x9ab.tmp", "ckpt.pt", "ckpt.pt.tmp", "metrics.jsonl.tmp", "other.pt.k3j_x9ab.tmp",
             "ckpt.pt.k3j_x9ab.tmp.bak", "xckpt.pt.k3j_x9ab.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"1234")
    (tmp_path / "ckpt.pt.folder.tmp").mkdir()
    assert remove_stale_temp_files(str(tmp_path / "ckpt.pt")) == (1, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {names[0]} | {"ckpt.pt.folder.tmp"})
    assert remove_stale_temp_files(str(tmp_path / "missing" / "ckpt.pt")) == (0, 0)


def test_a_save_leaves_no_temp_file_and_holds_its_lock_while_writing(tmp_path, monkeypatch):
    ckpt_path = str(tmp_path / "ckpt.pt")
    seen, real_save = [], torch.save

    def save_and_check(obj, f):
        seen.append(remove_stale_temp_files(ckpt_path))  # a cleaner during our own save
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_and_check)
    save_checkpoint(ckpt_path, {"step": 3})
    assert seen == [(0, 0)]
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.digest.json"]


def test_train_removes_stale_temp_files_at_start_and_says_so(tmp_path, capsys):
    data = tmp_path / "data" / "toy"
    data.mkdir(parents=True)
    rng = random.Random(0)
    text = "".join(rng.choice("abc de\n") for _ in range(4000))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    ids[:3000].tofile(data / "train.bin")
    ids[3000:].tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps(dict(tokenizer="char", vocab_size=len(chars), itos=chars)))
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt.abcd1234.tmp").write_bytes(b"\0" * 2_500_000)
    (out / "ckpt.pt.efgh5678.tmp").write_bytes(b"\0" * 500_000)
    train.main([f"--data_dir={tmp_path / 'data'}", "--dataset=toy", f"--out_dir={out}", "--size=tiny",
                "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2",
                "--gradient_accumulation_steps=1", "--max_iters=2", "--warmup_iters=0", "--eval_interval=2",
                "--eval_iters=1", "--device=cpu", "--dtype=float32", "--compile=false"])
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if "stale checkpoint temp file" in line]
    assert lines == [f"removed 2 stale checkpoint temp file(s) in {out} (3.0 MB), left by a save that was killed"]
    assert temp_files(out) == []
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 2


def test_a_writer_whose_fresh_temp_file_a_cleaner_deleted_takes_another(tmp_path, monkeypatch):
    """The gap between creating the temp file and locking it: a cleaner that wins it deletes the
    file, and the writer must notice (link count 0) instead of renaming a file that is gone."""
    real_mkstemp = tempfile.mkstemp
    calls = []

    def mkstemp_then_cleaner(**kwargs):
        fd, path = real_mkstemp(**kwargs)
        calls.append(path)
        if len(calls) == 1:
            assert remove_stale_temp_files(str(tmp_path / "ckpt.pt")) == (1, 0)  # not locked yet
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_cleaner)
    save_checkpoint(str(tmp_path / "ckpt.pt"), {"step": 5})
    assert len(calls) == 2 and not os.path.exists(calls[0])
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 5
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.digest.json"]


def test_keep_checkpoints_keeps_the_newest_files_beside_ckpt_pt(data_dir, tmp_path):
    """Saves at steps 0, 2, 4 and 6 with --keep_checkpoints=2: ckpt.pt holds step 6, ckpt.4.pt step 4
    (the file that was ckpt.pt, under a second name), each with its digest record, and nothing older
    stays."""
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, n_layer=1, n_embd=32, max_iters=6, eval_interval=2, keep_checkpoints=2))
    assert sorted(p.name for p in out.glob("ckpt*")) == ["ckpt.4.pt", "ckpt.4.pt.digest.json", "ckpt.pt",
                                                         "ckpt.pt.digest.json"]
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 6 and load_checkpoint(str(out / "ckpt.4.pt"))["step"] == 4


def test_the_low_space_warning_counts_each_file_on_disk_once(tmp_path, monkeypatch):
    """The next save needs room for one more checkpoint: the newest, read through the ckpt.dcp link
    once; the kept ones are named beside it, a file reached by two names counted once."""
    for name, size in (("ckpt.dcp.3", 1_000_000), ("ckpt.dcp.5", 2_000_000)):
        folder = tmp_path / name
        folder.mkdir()
        for file in (".metadata", "run.pt"):
            (folder / file).write_bytes(b"")
        (folder / "__0_0.distcp").write_bytes(b"\0" * size)
    os.symlink("ckpt.dcp.5", tmp_path / "ckpt.dcp")
    os.link(tmp_path / "ckpt.dcp.5" / "__0_0.distcp", tmp_path / "ckpt.dcp.5" / "second_name")
    link = str(tmp_path / "ckpt.dcp")
    assert checkpoint.checkpoint_bytes(link) == 2_000_000
    assert checkpoint.disk_bytes(checkpoint.run_checkpoints(str(tmp_path))) == 3_000_000
    monkeypatch.setattr(checkpoint.manager, "free_bytes", lambda directory: 1_500_000)
    assert checkpoint.low_space_warning(link) == (
        f"warning: {tmp_path} has 1.5 MB free, less than the 2.0 MB of {link} (with the checkpoints kept beside it, "
        f"3.0 MB); the next checkpoint save will fail with a full disk unless space is freed")
    monkeypatch.setattr(checkpoint.manager, "free_bytes", lambda directory: 2_000_000)
    assert checkpoint.low_space_warning(link) is None
