"""A checkpoint written by an earlier main still loads, resumes exactly and exports.

tests/fixtures/run_0d41fda/ holds the step-4 checkpoint of a tiny mhclite run trained to step 8 by
commit 0d41fda, whose model_args still carried the execution settings (fused_connections,
recompute_connections), the run's config.json and that run's own records of steps 5 to 8
(metrics_after_step_4.jsonl). The corpus is conftest's `data_dir`, rebuilt from its seed.
"""
import json
import os
import shutil

import pytest
import torch

import export_hf
import sample
import train
from conftest import read_metrics

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "run_0d41fda")


def fixture_run_args(data_dir, out_dir, **overrides):
    """The fixture run's command line, from its config.json, onto this test's folders."""
    with open(os.path.join(FIXTURE, "config.json")) as f:
        saved = json.load(f)
    keys = ("dataset", "size", "residual", "n_layer", "n_head", "n_embd", "block_size", "batch_size",
            "gradient_accumulation_steps", "max_iters", "warmup_iters", "learning_rate", "min_lr", "eval_interval",
            "eval_iters", "log_interval", "device", "dtype", "compile", "seed")
    settings = {key: saved[key] for key in keys}
    settings.update(data_dir=data_dir, out_dir=out_dir, **overrides)
    return [f"--{key}={value}" for key, value in settings.items()]


@pytest.fixture
def old_run(tmp_path, data_dir):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    shutil.copy(os.path.join(FIXTURE, "ckpt.pt"), out_dir / "ckpt.pt")
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    config.update(data_dir=str(data_dir), out_dir=str(out_dir))
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def test_the_fixture_predates_the_split_of_execution_settings():
    ckpt = torch.load(os.path.join(FIXTURE, "ckpt.pt"), weights_only=True)
    assert {"fused_connections", "recompute_connections"} <= set(ckpt["model_args"])


def test_an_old_checkpoint_resumes_on_the_old_code_s_own_trajectory(old_run, data_dir):
    train.main(fixture_run_args(data_dir, str(old_run), init_from="resume"))
    train_records, eval_records = read_metrics(old_run)
    with open(os.path.join(FIXTURE, "metrics_after_step_4.jsonl")) as f:
        expected = [json.loads(line) for line in f]
    resumed = {r["step"]: r for r in train_records if r["step"] > 4}
    for record in (r for r in expected if "train_loss" in r):
        got = resumed[record["step"]]
        assert (got["train_loss"], got["grad_norm"], got["lr"]) == (
            record["train_loss"], record["grad_norm"], record["lr"]), record["step"]
    (final,) = [r for r in expected if "val_loss" in r]
    assert eval_records[-1]["step"] == 8 and eval_records[-1]["val_loss"] == final["val_loss"]


def test_an_old_checkpoint_loads_and_exports(old_run, data_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    ours, _ = sample.load(str(old_run), "cpu")
    folder = export_hf.export(str(old_run), str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokens = torch.randint(0, ours.config.vocab_size, (2, ours.config.block_size),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = ours(tokens, torch.zeros_like(tokens))
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5
