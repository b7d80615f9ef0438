"""analysis/variants_study.py on fake runs of every variant (conftest's fake_run: checkpoints of real,
perturbed models and metrics.jsonl files written here with planted val losses and gradient spikes), so
that every number of the page can be recomputed: mhc with DeepSeek-V4's epsilons counted apart from the
paper's mhc, the ratios to res, the comparisons the study was made for."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis import variants_study
from analysis.common import load_run
from benchmarks.step import saved_activation_bytes
from conftest import SPIKE_STEPS, fake_run, with_settings, write_fake_dataset
from sample import load_model

REPO = Path(__file__).resolve().parents[1]
# study variant: (residual, settings beyond the residual)
RUNS = {"res": ("res", {}), "hc": ("hc", {}), "mhc": ("mhc", {}), "mhc-v4eps": ("mhc", dict(mhc_eps=1e-6)),
        "mhclite": ("mhclite", {}), "kromhc": ("kromhc", {}), "ihc": ("ihc", {})}
SEEDS, DEPTH, LR = (0, 1), 2, 1e-3


def planted_val_loss(variant, seed):
    return 2.0 + 0.05 * list(RUNS).index(variant) + 0.02 * seed


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{root, out, paths: {(variant, seed): run folder}, json: variants_study.json, page}."""
    root = tmp_path_factory.mktemp("variants_study")
    write_fake_dataset(root / "data")
    paths = {}
    for variant, (residual, settings) in RUNS.items():
        for seed in SEEDS:
            path = fake_run(root / "runs" / variant, root / "data", residual, DEPTH, LR, seed,
                            val_loss=planted_val_loss(variant, seed))
            if settings:
                with_settings(path, settings)
            paths[variant, seed] = path
    out = root / "out"
    variants_study.main(["--runs", str(root / "runs" / "*" / "*"), "--out", str(out), "--num_seqs", "4",
                         "--seq_len", "16", "--study_command", "bash scripts/variants_study.sh --jobs 2",
                         "--wall_s", "600"])
    return dict(root=root, out=out, paths=paths, json=json.loads((out / "variants_study.json").read_text()),
                page=(out / "variants_study.md").read_text())


def entry(written, variant):
    return next(e for e in written["json"]["summary"] if e["variant"] == variant)


def test_every_variant_is_its_own_entry_with_its_seeds(written):
    assert [e["variant"] for e in written["json"]["summary"]] == list(RUNS)
    for variant in RUNS:
        e = entry(written, variant)
        losses = [planted_val_loss(variant, seed) for seed in SEEDS]
        assert e["seeds"] == list(SEEDS) and e["diverged"] == 0
        assert e["val_loss"] == pytest.approx(np.mean(losses)) and e["val_loss_std"] == pytest.approx(np.std(losses))
        assert e["val_loss_range"] == pytest.approx(max(losses) - min(losses))
        assert e["spikes"] == len(SPIKE_STEPS)


def test_column_sums_for_the_variants_that_learn_an_h_res(written):
    for variant in ("mhclite", "kromhc"):
        assert entry(written, variant)["product_col_dev"] < 1e-5
    assert entry(written, "hc")["product_col_dev"] > 1e-3 and entry(written, "mhc")["product_col_dev"] > 1e-5
    for variant in ("res", "ihc"):  # no H_res, and H_res = I: nothing to measure
        assert math.isnan(entry(written, variant)["product_col_dev"])
    for variant in ("mhc", "mhc-v4eps"):
        assert entry(written, variant)["log_inv_nu_max"] > 0
    assert math.isnan(entry(written, "kromhc")["log_inv_nu_max"])


def test_step_time_and_activation_memory_are_ratios_to_res(written):
    res_ms = entry(written, "res")["timed_step_ms"]
    for variant in RUNS:
        e = entry(written, variant)
        assert e["step_ms"] == pytest.approx(10.0)  # every fake run logged 10 ms: the training's own timing
        assert e["timed_step_ms"] > 0 and e["step_time_x_res"] == pytest.approx(e["timed_step_ms"] / res_ms)
    counted = {}
    for variant in ("res", "mhc"):
        model, _ = load_model(str(written["paths"][variant, 0]))
        tokens = torch.randint(model.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
        counted[variant] = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:].contiguous(),
                                                  torch.autocast("cpu", enabled=False))
    assert entry(written, "mhc")["activation_bytes"] == counted["mhc"]
    assert entry(written, "mhc")["activation_x_res"] == pytest.approx(counted["mhc"] / counted["res"])
    assert entry(written, "ihc")["activation_x_res"] < entry(written, "mhc")["activation_x_res"]


def test_the_page_states_the_comparisons_and_the_table(written):
    page = written["page"]
    v4 = [planted_val_loss("mhc-v4eps", s) - planted_val_loss("mhc", s) for s in SEEDS]
    assert (f"Does DeepSeek-V4's epsilon change mHC's training: mHC (V4 eps) minus mHC {np.mean(v4):+.4f}"
            in page)
    for variant, name in (("kromhc", "KromHC"), ("ihc", "iHC"), ("mhc-v4eps", "mHC (V4 eps)")):
        assert f"| {name} | 2 | 0 | {entry(written, variant)['val_loss']:.4f} ± " in page
    assert "bash scripts/variants_study.sh --jobs 2\npython analysis/variants_study.py --runs" in page
    for figure in ("val_loss", "colsum", "grad_norm"):
        assert (written["out"] / f"variants_study_{figure}.png").stat().st_size > 0
        assert f"(variants_study_{figure}.png)" in page


@pytest.mark.slow
def test_the_smallest_study_trains_its_variants_and_writes_its_page(tmp_path):
    """scripts/variants_study.sh end to end: two variants, one seed, a one-layer model for a few dozen
    steps on the built-in corpus, two runs at a time; an unknown variant is refused before any training."""
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    env = dict(os.environ, SETUP_ENV_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", "scripts/variants_study.sh", "--seeds", "0", "--steps", "60", "--jobs", "2",
               "--out_root", str(runs), "--doc_dir", str(docs), "--data_dir", str(tmp_path / "data")]
    overrides = ["--", "--n_layer=1", "--n_embd=32", "--n_head=2", "--batch_size=8", "--block_size=32",
                 "--eval_iters=2", "--learning_rate=1e-2", "--min_lr=1e-3"]
    refused = subprocess.run(command + ["--variants", "res kromhc-n3"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert refused.returncode == 2 and "unknown variant 'kromhc-n3'" in refused.stderr and not runs.exists()
    result = subprocess.run(command + ["--variants", "res kromhc"] + overrides, cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[2/2" in result.stdout and "finished" in result.stdout  # progress per run
    for variant in ("res", "kromhc"):
        run = load_run(str(runs / f"{variant}-s0"))
        assert run.residual == variant and len(run.train["grad_norm"]) == 60  # every step logged
        assert (runs / f"{variant}-s0" / "done").exists() and (runs / f"{variant}-s0" / "wall_s").exists()
    study = json.loads((docs / "variants_study.json").read_text())
    assert [e["variant"] for e in study["summary"]] == ["res", "kromhc"]
    kromhc = study["summary"][1]
    assert kromhc["product_col_dev"] < 1e-5 and kromhc["val_loss"] == pytest.approx(
        load_run(str(runs / "kromhc-s0")).evals["val_loss"][-1])
    page = (docs / "variants_study.md").read_text()
    assert ('bash scripts/variants_study.sh --variants "res kromhc" --seeds "0" --steps 60 --jobs 2 -- '
            "--n_layer=1") in page
