"""--wandb_log=True: a short run logged offline (never the network) and read back from the run's
.wandb file; a missing or failing wandb is one error line."""
import json
import os
import struct
import subprocess
import sys

import pytest

import train
from config import REPO_DIR
from conftest import one_error_line, read_all_metrics, tiny_args

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of chunked records
# Chunk types: FULL (1) is a whole record; a record split across blocks is FIRST (2), MIDDLE (3)..., LAST (4).
FULL, LAST = 1, 4


def wandb_records(path):
    """The Record protobufs of a .wandb file: a 7-byte header (':W&B', magic, version), then
    records of chunks with a 7-byte chunk header (crc32c, length, chunk type); a block's last
    bytes, too short for a chunk header, are padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if kind == 0:  # padding up to the next block
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_history(path):
    """{step: {key: value}} of the history rows in a .wandb file (rows of one step merged)."""
    rows = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(items["_step"], {}).update(items)
    return rows


def wandb_config(path):
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "run":
            return {item.key: json.loads(item.value_json) for item in record.run.config.update}


def test_offline_wandb_run_holds_every_metric_at_its_step(data_dir, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true",
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO_DIR, "train.py"),
                           *tiny_args(data_dir, out, wandb_log=True, wandb_run_name="tiny-wandb")],
                          cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    train_records, eval_records, first_records = read_all_metrics(out)

    assert sorted(history) == list(range(0, 21))  # eval at 0, then every step
    for record in train_records:
        row = history[record["step"]]
        for key in ("train_loss", "grad_norm", "lr", "tokens_per_s", "step_ms"):
            assert row[key] == pytest.approx(record[key], rel=1e-12), (record["step"], key)
        assert "mfu" not in row  # null on CPU: left out
    for record in eval_records:
        row = history[record["step"]]
        assert row["val_loss"] == pytest.approx(record["val_loss"], rel=1e-12)
        assert row["eval_train_loss"] == pytest.approx(record["eval_train_loss"], rel=1e-12)
    assert [r["step"] for r in eval_records] == [0, 10, 20]
    assert "val_loss" not in history[5] and "train_loss" not in history[0]
    [first] = first_records
    assert history[1]["first_step_s"] == pytest.approx(first["first_step_s"]) and history[1]["compiled"] is False
    config = wandb_config(run_file)
    assert (config["residual"], config["max_iters"], config["wandb_run_name"]) == ("mhclite", 20, "tiny-wandb")


def test_missing_wandb_is_one_line_before_any_work(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    one_error_line(train.main, tiny_args(data_dir, tmp_path / "run", wandb_log=True), capsys,
                   "wandb_log=True needs wandb: pip install wandb", alone=False)
    assert not (tmp_path / "run").exists()


def test_a_failing_wandb_init_is_one_line(data_dir, tmp_path, monkeypatch, capsys):
    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setattr(wandb, "init", refuse)
    one_error_line(train.main, tiny_args(data_dir, tmp_path / "run", wandb_log=True), capsys,
                   "wandb.init failed (api_key not configured", "WANDB_MODE=offline", alone=False)


@pytest.mark.slow
def test_a_restarted_run_continues_its_wandb_run(data_dir, tmp_path):
    """A run stopped after step 1 (its stop request made before the start) and started again with
    the same command logs into one W&B run, whose id the run folder keeps."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true",
               HF_HUB_OFFLINE="1")

    def start(out):
        proc = subprocess.run([sys.executable, os.path.join(REPO_DIR, "train.py"),
                               *tiny_args(data_dir, out, wandb_log=True, init_from="auto", max_iters=4, eval_interval=2,
                                          log_interval=1)],
                              cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    out = tmp_path / "run"
    out.mkdir()
    (out / "stop").touch()
    assert "stopped by the request stop in the run folder after step 1" in start(out)
    run_id = (out / "wandb_run_id").read_text().strip()
    assert "resuming at step 1 of 4" in start(out)
    assert (out / "wandb_run_id").read_text().strip() == run_id
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [path.name for path in files] == [f"run-{run_id}.wandb"] * 2
    assert [sorted(wandb_history(path)) for path in files] == [[0, 1], [2, 3, 4]]


def test_a_start_from_scratch_begins_a_new_wandb_run(data_dir, tmp_path, monkeypatch):
    """Even in a folder that kept the id of an earlier training."""
    calls, real_init = [], wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or real_init(mode="disabled"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "wandb_run_id").write_text("earlier\n")
    train.main(tiny_args(data_dir, out, wandb_log=True, max_iters=1))
    [kwargs] = calls
    assert kwargs["resume"] == "allow" and kwargs["id"] not in ("earlier", None)
    assert (out / "wandb_run_id").read_text() == kwargs["id"] + "\n"
