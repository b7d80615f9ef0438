"""Every file a save writes carries the SHA-256 of the bytes it wrote, computed while writing
(checkpoint/files.py), and a load verifies it before it uses anything: a flipped bit or a cut file is
damaged, named with how; a file without a record (written before checkpoints carried digests) loads
unverified; a crash between a save's record and its rename leaves a file that still verifies."""
import hashlib
import json
import os
import re

import pytest
import torch

from checkpoint import Damaged, files, load_checkpoint, save_checkpoint
from checkpoint.single_file import keep_previous


def record_of(path):
    return json.loads((path.parent / (path.name + ".digest.json")).read_text())


def test_a_save_records_the_sha256_of_the_bytes_it_wrote(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(str(path), {"step": 3, "weights": torch.arange(1000.0)})
    data = path.read_bytes()
    assert record_of(path) == [dict(step=3, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())]
    assert files.verify_file(str(path))["step"] == 3


@pytest.mark.parametrize("damage, words", [
    (lambda data: data[:len(data) // 2], "is damaged: truncated to "),
    (lambda data: data + b"\0", "bytes where its save of step 3 wrote"),
    (lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:], "its bytes differ from those its save of step 3 "
                                                                      "wrote (SHA-256 mismatch)"),
])
def test_a_damaged_file_is_named_with_how_before_anything_in_it_is_read(tmp_path, damage, words, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(str(path), {"step": 3, "model": {}, "model_args": {}, "config": {}})
    path.write_bytes(damage(path.read_bytes()))
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("a damaged file was read"))
    with pytest.raises(Damaged, match=re.escape(words)):
        load_checkpoint(str(path))


def test_a_file_without_a_record_loads_unverified(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"step": 1, "model": {}, "model_args": {}, "config": {}}, path)  # as saved before digests
    assert files.verify_file(str(path)) is None and load_checkpoint(str(path))["step"] == 1
    save_checkpoint(str(path), {"step": 2})  # the next save: recorded from now on
    assert [save["step"] for save in record_of(path)] == [2]


def test_a_crash_between_the_record_and_the_rename_leaves_a_file_that_verifies(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(str(path), {"step": 1})
    real_replace = os.replace

    def crash_at_the_rename(source, target):
        if str(target) == str(path):
            raise KeyboardInterrupt  # the process dies: its record already names the new bytes
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", crash_at_the_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(path), {"step": 2})
    monkeypatch.undo()
    assert [save["step"] for save in record_of(path)] == [1, 2]
    assert files.verify_file(str(path))["step"] == 1 and load_checkpoint(str(path), required=("step",))["step"] == 1
    save_checkpoint(str(path), {"step": 3})
    assert [save["step"] for save in record_of(path)] == [3]


def test_a_kept_checkpoint_carries_its_own_record(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(str(path), {"step": 4})
    keep_previous(str(path), 4)
    save_checkpoint(str(path), {"step": 6})
    kept = tmp_path / "ckpt.4.pt"
    assert [save["step"] for save in record_of(kept)] == [4] and files.verify_file(str(kept))["step"] == 4
    assert files.verify_file(str(path))["step"] == 6
