"""scripts/bf16_streams_study.sh and analysis/bf16_streams.py: the study's smallest form end to end
(one variant, one seed, a one-layer model for a few dozen steps on the built-in corpus), and the
comparison's statistics on rows whose answer is known."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis import bf16_streams
from analysis.common import load_run

REPO = Path(__file__).resolve().parents[1]


def row(variant, dtype, seed, val_loss):
    return dict(variant=variant, stream_dtype=dtype, seed=seed, val_loss=val_loss)


def test_compare_gives_the_difference_of_means_its_noise_and_the_paired_differences():
    fp32, bf16 = [2.50, 2.52, 2.54], [2.51, 2.50, 2.57]
    rows = ([row("mhc", "float32", s, v) for s, v in enumerate(fp32)] +
            [row("mhc", "bfloat16", s, v) for s, v in enumerate(bf16)] +
            [row("hc", "float32", 0, 2.6)])  # no bf16 run: no comparison
    (c,) = bf16_streams.compare(rows)
    assert c["variant"] == "mhc"
    assert c["diff"] == pytest.approx(np.mean(bf16) - np.mean(fp32))
    assert c["noise"] == pytest.approx(2 * math.sqrt(np.var(bf16) / 3 + np.var(fp32) / 3))
    assert c["paired"] == pytest.approx({0: 0.01, 1: -0.02, 2: 0.03})
    assert c["paired_noise"] == pytest.approx(2 * np.std([0.01, -0.02, 0.03], ddof=1) / math.sqrt(3))
    assert c["seed_spread"] == pytest.approx(max(np.std(fp32, ddof=1), np.std(bf16, ddof=1)))
    assert c["within"] is True
    far = [row("mhc", "float32", s, v) for s, v in enumerate(fp32)] + \
          [row("mhc", "bfloat16", s, v + 0.2) for s, v in enumerate(fp32)]
    assert bf16_streams.compare(far)[0]["within"] is False
    (one,) = bf16_streams.compare([row("mhc", "float32", 0, 2.5), row("mhc", "bfloat16", 0, 2.6)])
    assert one["diff"] == pytest.approx(0.1) and one["within"] is None and math.isnan(one["noise"])
    assert math.isnan(one["paired_noise"])  # no spread


@pytest.mark.slow
@pytest.mark.bf16_streams
def test_smallest_study_trains_both_stream_dtypes_and_writes_its_page(tmp_path):
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    env = dict(os.environ, SETUP_ENV_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["bash", "scripts/bf16_streams_study.sh", "--residuals", "mhclite", "--seeds", "0", "--depth", "1",
         "--steps", "60", "--out_root", str(runs), "--doc_dir", str(docs), "--data_dir", str(tmp_path / "data"),
         "--", "--learning_rate=1e-2", "--min_lr=1e-3"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[2/2" in result.stdout  # progress per run

    val = {}
    for dtype in ("float32", "bfloat16"):
        run = load_run(str(runs / f"mhclite-{dtype}-s0"))
        assert run.config["stream_dtype"] == dtype and (runs / f"mhclite-{dtype}-s0" / "done").exists()
        assert len(run.train["grad_norm"]) == 60  # every step logged
        val[dtype] = run.evals["val_loss"][-1]

    study = json.loads((docs / "bf16_streams.json").read_text())
    (c,) = study["comparisons"]
    assert c["within"] is None  # one seed
    assert c["diff"] == pytest.approx(val["bfloat16"] - val["float32"])
    assert c["paired"] == pytest.approx({"0": val["bfloat16"] - val["float32"]})
    for r in study["rows"]:
        assert not r["diverged"]
        assert r["product_col_dev"] < 1e-5  # mHC-lite stays doubly stochastic with either stream dtype

    page = (docs / "bf16_streams.md").read_text()
    assert "| mHC-lite | fp32 | 0/1 |" in page and "| mHC-lite | bf16 | 0/1 |" in page
    assert f"{c['diff']:+.4f}" in page
    assert ('bash scripts/bf16_streams_study.sh --residuals "mhclite" --seeds "0" --depth 1 --steps 60 -- '
            "--learning_rate=1e-2 --min_lr=1e-3\npython analysis/bf16_streams.py --runs") in page
    for name in ("grad_norm", "colsum"):
        assert (docs / f"bf16_streams_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
