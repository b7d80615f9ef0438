"""analysis/depth_study.py on small fake runs (conftest's fake_run): checkpoints of real (perturbed)
models with metrics.jsonl files written by the tests, so that every number the study prints can be
recomputed: spikes planted at known steps, val losses chosen per seed, a run stopped by a NaN, one
that ends above the unigram entropy, and H_res sums measured again through capture_connections."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis import depth_study
from conftest import (FAKE_DATASET, FAKE_STEPS, FAKE_WARMUP, SPIKE_STEPS, fake_run, grad_norms, with_settings,
                      write_fake_dataset)
from dataprep import unigram_entropy
from residuals import capture_connections

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("res", "hc", "mhc", "mhclite")
DEPTHS, SEEDS = (1, 3), (0, 1)
LR, HIGH_LR = 1e-3, 1e-2
NUM_SEQS = 4


def final_val_loss(variant, depth, lr, seed):
    """A distinct, known final val loss per run."""
    return 2.0 + 0.1 * VARIANTS.index(variant) + 0.01 * depth + 0.001 * seed + (0.5 if lr == HIGH_LR else 0)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """{root, data_dir, paths: {(variant, depth, lr, seed): run folder}, out}."""
    root = tmp_path_factory.mktemp("depth_study")
    data_dir = root / "data"
    write_fake_dataset(data_dir)
    runs = root / "runs"
    paths = {}
    for variant in VARIANTS:
        for depth in DEPTHS:
            for seed in SEEDS:
                paths[variant, depth, LR, seed] = fake_run(runs, data_dir, variant, depth, LR, seed,
                                                           val_loss=final_val_loss(variant, depth, LR, seed))
    # at the high learning rate: mhc seed 0 stops on a NaN at step 30, hc seed 0 ends above the entropy
    paths["mhc", 3, HIGH_LR, 0] = fake_run(runs, data_dir, "mhc", 3, HIGH_LR, 0, nan_at=30)
    paths["mhc", 3, HIGH_LR, 1] = fake_run(runs, data_dir, "mhc", 3, HIGH_LR, 1,
                                           val_loss=final_val_loss("mhc", 3, HIGH_LR, 1))
    paths["hc", 3, HIGH_LR, 0] = fake_run(runs, data_dir, "hc", 3, HIGH_LR, 0, val_loss=9.0)
    return dict(root=root, data_dir=data_dir, paths=paths, out=root / "out")


@pytest.fixture(scope="module")
def written(study):
    """Runs the analysis once over all the runs; returns its depth_study.json."""
    depth_study.main(["--runs", str(study["root"] / "runs" / "*"), "--out", str(study["out"]),
                      "--num_seqs", str(NUM_SEQS), "--seq_len", "16",
                      "--study_command", "bash scripts/depth_study.sh --jobs 2", "--wall_s", "600"])
    return json.loads((study["out"] / "depth_study.json").read_text())


def row_of(result, variant, depth, lr, seed):
    return next(r for r in result["rows"] if (r["variant"], r["depth"], r["lr"], r["seed"]) == (variant, depth, lr, seed))


def entry_of(result, variant, depth, lr):
    return next(e for e in result["summary"] if (e["variant"], e["depth"], e["lr"]) == (variant, depth, lr))


def test_count_spikes_against_a_running_median():
    norms = [1.0] * 30
    norms[10], norms[20], norms[25] = 2.9, 3.1, 10.0
    assert depth_study.count_spikes(norms, factor=3.0, window=5) == 2
    assert depth_study.count_spikes(norms, factor=2.0, window=5) == 3
    assert depth_study.count_spikes(norms[:5], factor=3.0, window=5) == 0  # no full window yet
    norms[3] = 50.0  # before the first full window: never counted
    assert depth_study.count_spikes(norms, factor=3.0, window=5) == 2


def test_rows_come_from_the_runs(study, written):
    for seed in SEEDS:
        row = row_of(written, "mhclite", 3, LR, seed)
        assert row["val_loss"] == pytest.approx(final_val_loss("mhclite", 3, LR, seed))
        assert not row["diverged"]
        assert row["spikes"] == len(SPIKE_STEPS)  # the 2x bump is below the factor 3
        after = grad_norms(seed)[FAKE_WARMUP:]
        assert row["grad_norm_max"] == pytest.approx(max(after))
        assert row["grad_norm_median"] == pytest.approx(np.median(after))
        assert row["wall_s"] == 7
    mean = np.mean([final_val_loss("mhc", 1, LR, s) for s in SEEDS])
    std = np.std([final_val_loss("mhc", 1, LR, s) for s in SEEDS])
    entry = entry_of(written, "mhc", 1, LR)
    assert entry["val_loss"] == pytest.approx(mean) and entry["val_loss_std"] == pytest.approx(std)


def test_divergence_is_a_nan_or_a_loss_above_the_unigram_entropy(study, written):
    nan_run = row_of(written, "mhc", 3, HIGH_LR, 0)
    assert nan_run["diverged"] and nan_run["diverged_reason"] == "non-finite loss" and math.isnan(nan_run["val_loss"])
    entropy = unigram_entropy(np.fromfile(study["data_dir"] / FAKE_DATASET / "val.bin", dtype=np.uint16))
    high = row_of(written, "hc", 3, HIGH_LR, 0)
    assert high["diverged"] and high["diverged_reason"] == f"val loss 9.000 > unigram entropy {entropy:.3f}"
    entry = entry_of(written, "mhc", 3, HIGH_LR)
    assert entry["diverged"] == 1 and entry["val_loss_n"] == 1  # the mean is over the finite run only
    assert entry["val_loss"] == pytest.approx(final_val_loss("mhc", 3, HIGH_LR, 1))
    assert row_of(written, "mhc", 3, HIGH_LR, 0)["spikes"] == 1  # spikes counted before the NaN


def test_sums_are_measured_on_held_out_text(study, written):
    val = np.fromfile(study["data_dir"] / FAKE_DATASET / "val.bin", dtype=np.uint16)[:NUM_SEQS * 16]
    for variant in ("hc", "mhc", "mhclite"):
        path = study["paths"][variant, 3, LR, 1]
        model = depth_study.load_model(str(path / "ckpt.pt"))[0]
        with torch.no_grad(), capture_connections(model) as records:
            model(torch.from_numpy(val.astype(np.int64)).view(NUM_SEQS, 16))
        h = [r["h_res"].double().reshape(-1, 4, 4) for r in records]
        product = h[0]
        for m in h[1:]:
            product = m @ product
        row = row_of(written, variant, 3, LR, 1)
        col = (product.sum(-2) - 1).abs()
        assert row["product_col_dev"] == pytest.approx(col.max().item(), rel=1e-4, abs=1e-9)
        assert row["product_col_dev_median"] == pytest.approx(np.median(col.numpy()), rel=1e-6, abs=1e-12)
        assert row["matrix_col_dev"] == pytest.approx(max((m.sum(-2) - 1).abs().max().item() for m in h),
                                                      rel=1e-4, abs=1e-9)
        if variant == "mhc":
            logits = torch.cat([r["logits"].reshape(-1, 16) for r in records]).double()
            spread = (logits.max(-1).values - logits.min(-1).values).numpy()
            assert row["log_inv_nu_max"] == pytest.approx(spread.max(), rel=1e-5)
            assert row["log_inv_nu_median"] == pytest.approx(np.median(spread), rel=1e-5)
    lite, mhc, hc = (row_of(written, v, 3, LR, 1) for v in ("mhclite", "mhc", "hc"))
    for key in ("matrix_col_dev", "matrix_row_dev", "product_col_dev", "product_row_dev"):
        assert lite[key] < 1e-5
    assert mhc["matrix_row_dev"] < 1e-5 < mhc["matrix_col_dev"]  # Sinkhorn ends on rows
    assert hc["product_col_dev"] > 1e-2
    assert math.isnan(row_of(written, "res", 3, LR, 1)["product_col_dev"])


def test_page_embeds_figures_tables_command_and_time(study, written):
    page = (study["out"] / "depth_study.md").read_text()
    for name in ("colsum", "grad_norm", "val_loss"):
        figure = study["out"] / f"depth_study_{name}.png"
        assert figure.stat().st_size > 10_000 and f"({figure.name})" in page
    assert "bash scripts/depth_study.sh --jobs 2\npython analysis/depth_study.py --runs" in page
    assert "the trainings took 10.0 min of wall time" in page
    # the CPU's vector instructions pick the floating-point path, so the page names them
    assert f"CPU ({torch.backends.cpu.get_cpu_capability()} kernels)" in page
    assert "## Where the result depends on the machine" in page
    assert "- Diverged: mHC, 3 layers, lr 0.01, seed 0 (non-finite loss)." in page
    assert "### lr 0.001" in page and "### lr 0.01" in page
    mhc = entry_of(written, "mhc", 3, LR)
    assert (f"| mHC | 3 | 0/2 | {mhc['val_loss']:.3f} ± {mhc['val_loss_std']:.3f} | 2.0 ± 0.0 |") in page
    lite = entry_of(written, "mhclite", 3, LR)
    diff = lite["val_loss"] - entry_of(written, "res", 3, LR)["val_loss"]
    assert "Val loss against res, 3 layers, lr 0.001: " in page and f"mHC-lite {diff:+.3f}" in page


def test_unfinished_and_mixed_length_runs_are_one_line_errors(study, tmp_path, capsys):
    unfinished = fake_run(tmp_path / "a", study["data_dir"], "res", 1, LR, 0, val_loss=final_val_loss("res", 1, LR, 0))
    (unfinished / "done").unlink()
    with pytest.raises(SystemExit) as excinfo:
        depth_study.main(["--runs", str(unfinished), "--out", str(tmp_path / "o")])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is unfinished" in err and "\n" not in err
    longer = fake_run(tmp_path / "b", study["data_dir"], "res", 3, LR, 0, val_loss=final_val_loss("res", 3, LR, 0))
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_iters": FAKE_STEPS * 2}))
    with pytest.raises(SystemExit):
        depth_study.main(["--runs", str(study["paths"]["res", 1, LR, 0]), str(longer), "--out", str(tmp_path / "o")])
    assert "different lengths" in capsys.readouterr().err


def row_val(out_root, row):
    """The last val loss in the run's metrics.jsonl."""
    records = [json.loads(line) for line in (out_root / os.path.basename(row["run"]) / "metrics.jsonl").open()]
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


@pytest.mark.slow
def test_the_script_trains_skips_finished_runs_and_keeps_diverged_ones(tmp_path):
    """scripts/depth_study.sh end to end at 4 steps: depth 1 trains normally; a second call for
    depths 1 and 2 with a weight decay so large that the weights overflow (a non-finite loss at
    step 2) skips depth 1's finished runs, keeps depth 2's as diverged and writes the page over all 8."""
    script = REPO / "scripts" / "depth_study.sh"
    out_root, doc_dir = tmp_path / "runs", tmp_path / "doc"
    # the Python running these tests has the requirements: no pip install in each call
    env = dict(os.environ, SETUP_ENV_PYTHON=sys.executable)

    def study(depths, *overrides):
        args = ["bash", str(script), "--depths", depths, "--lrs", "1e-3", "--seeds", "0", "--steps", "4",
                "--jobs", "2", "--out_root", str(out_root), "--doc_dir", str(doc_dir)]
        proc = subprocess.run(args + (["--", *overrides] if overrides else []), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    study("1")
    printed = study("1 2", "--weight_decay=1e30")
    lines = printed.splitlines()
    assert sum(line.startswith("skip ") for line in lines) == 4
    assert sum(line.startswith("diverged ") for line in lines) == 4
    runs = sorted(p.name for p in out_root.iterdir())
    assert len(runs) == 8
    for name in runs:
        marker = "diverged" if "-L2-" in name else "done"
        assert (out_root / name / marker).exists() and (out_root / name / "wall_s").exists(), name
    result = json.loads((doc_dir / "depth_study.json").read_text())
    for row in result["rows"]:  # 4 steps leave depth 1 above the unigram entropy (3.319 nats), also "diverged"
        if row["depth"] == 2:
            assert row["diverged_reason"] == "non-finite loss"
        else:
            assert row["diverged_reason"] == f"val loss {row_val(out_root, row):.3f} > unigram entropy 3.319"
    page = (doc_dir / "depth_study.md").read_text()
    assert page.count("- Diverged: ") == 8 and "| mHC-lite | 2 | 1/1 |" in page
    assert '--depths "1 2" --lrs "1e-3" --seeds "0" --steps 4 --jobs 2 -- --weight_decay=1e30\npython analysis/depth_study.py' in page


def test_the_variants_after_mhclite_are_measured_too(tmp_path):
    """kromhc's product stays doubly stochastic at every depth, and the reading says so; ihc's H_res
    is I, so it has no column sums to measure; mhc with DeepSeek-V4's epsilons is a variant of its own,
    with its Sinkhorn logits measured."""
    data_dir = tmp_path / "data"
    write_fake_dataset(data_dir)
    for depth in DEPTHS:
        fake_run(tmp_path / "runs" / "kromhc", data_dir, "kromhc", depth, LR, 0, val_loss=2.2)
        fake_run(tmp_path / "runs" / "ihc", data_dir, "ihc", depth, LR, 0, val_loss=2.3)
        with_settings(fake_run(tmp_path / "runs" / "v4", data_dir, "mhc", depth, LR, 0, val_loss=2.4),
                      dict(mhc_eps=1e-6))
    path, rows, _ = depth_study.write_study([str(tmp_path / "runs" / "*" / "*")], str(tmp_path / "out"),
                                            "python analysis/depth_study.py", num_seqs=NUM_SEQS, seq_len=16)
    assert sorted({r["variant"] for r in rows}) == ["ihc", "kromhc", "mhc-v4eps"]
    assert all(r["product_col_dev"] < 1e-5 for r in rows if r["variant"] == "kromhc")
    for r in rows:
        assert math.isnan(r["product_col_dev"]) == (r["variant"] == "ihc")
        assert (r["log_inv_nu_max"] > 0) == (r["variant"] == "mhc-v4eps")
    page = open(path).read()
    assert "- KromHC: the product's column-sum error grows from 1 to 3 layers" in page
    assert "at the level of fp32 rounding" in page
    assert "| iHC | 1 | 0/1 | 2.300 |" in page and "| mHC (V4 eps) | 3 | 0/1 | 2.400 |" in page
