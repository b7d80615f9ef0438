"""Analysis scripts on tiny real training runs: the numbers they print and plot are recomputed
here from metrics.jsonl, the collected npz files and the checkpoints."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
from analysis import collect, colsum_box, grad_norm, larger_n, loss_table, nu_hist, progress, report, throughput
from analysis.common import authors_settings, find_runs, read_metrics
from checkpoint import load_checkpoint, save_checkpoint
from conftest import one_error_line
from residuals import capture_connections
from sample import load_model

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("res", "hc", "mhc", "mhclite")
DATASET, VOCAB = "toy_char", 32
N_LAYER, N_STREAMS, STEPS, BLOCK = 3, 4, 30, 32
NUM_SEQS, SEQ_LEN = 5, 32


def write_random_char_dataset(data_dir):
    """data_dir/DATASET in nanoGPT format: seeded uniform random ids below VOCAB as a char-level corpus
    (no end-of-text tokens); conftest's write_char_dataset writes a given text instead."""
    folder = data_dir / DATASET
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {"train": rng.integers(0, VOCAB, 20000), "val": rng.integers(0, VOCAB, 4000)}
    for split, ids in splits.items():
        ids.astype(np.uint16).tofile(folder / f"{split}.bin")
    meta = dict(dataset=DATASET, tokenizer="char", vocab_size=VOCAB, train_tokens=20000, val_tokens=4000,
                dtype="uint16", source="test", split_seed=0, val_fraction=0.2,
                itos=[chr(ord("a") + i) for i in range(VOCAB)])
    (folder / "meta.json").write_text(json.dumps(meta))


def train_run(data_dir, out_dir, residual, seed=1, extra=()):
    cmd = [sys.executable, "train.py", "configs/tiny.py", f"--dataset={DATASET}", f"--data_dir={data_dir}",
           f"--residual={residual}", f"--out_dir={out_dir}", f"--seed={seed}", "--device=cpu", "--dtype=float32",
           "--compile=False", f"--block_size={BLOCK}", "--batch_size=4", "--gradient_accumulation_steps=1",
           f"--max_iters={STEPS}", "--warmup_iters=5", "--eval_interval=10", "--eval_iters=2", "--log_interval=1",
           f"--n_layer={N_LAYER}", "--n_head=2", "--n_embd=64", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no thread oversubscription on busy cores
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """{variant: run directory} of four 30-step tiny runs on the same data."""
    root = tmp_path_factory.mktemp("analysis_runs")
    write_random_char_dataset(root / "data")
    dirs = {v: root / "runs" / f"{DATASET}-tiny-{v}-s1" for v in VARIANTS}
    for variant, out_dir in dirs.items():
        train_run(root / "data", out_dir, variant)
    return dirs


@pytest.fixture(scope="session")
def collected(runs, tmp_path_factory):
    """{variant: npz path} for the HC family; batch size 2 does not divide 5 sequences."""
    out = tmp_path_factory.mktemp("collected")
    paths = {}
    for variant in ("hc", "mhc", "mhclite"):
        paths[variant] = out / f"{variant}.npz"
        collect.main(["--ckpt", str(runs[variant] / "ckpt.pt"), "--out", str(paths[variant]),
                      "--num_seqs", str(NUM_SEQS), "--seq_len", str(SEQ_LEN), "--batch_size", "2"])
    return paths


def logged(run_dir):
    """Train losses, grad norms, tokens/s and val losses straight from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    return {"train_loss": [r["train_loss"] for r in train], "grad_norm": [r["grad_norm"] for r in train],
            "tokens_per_s": [r["tokens_per_s"] for r in train],
            "val_loss": [r["val_loss"] for r in records if "val_loss" in r]}


def markdown_rows(text):
    """{row name: [cells]} of the first Markdown table in text."""
    rows, seen_header = {}, False
    for line in text.splitlines():
        if line.startswith("|---"):
            seen_header = True
        elif line.startswith("| ") and seen_header:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif rows:
            break
    return rows


# ---------------------------------------------------------------------------------------------
# Loss table


def test_loss_table_values_are_recomputed_from_metrics(runs, tmp_path, capsys):
    out = tmp_path / "table"
    loss_table.main(["--runs", *map(str, runs.values()), "--out", str(out), "--last", "10"])
    markdown = (out / "loss_table.md").read_text()
    rows = markdown_rows(markdown)
    expected = {}
    for variant, name in zip(VARIANTS, ("Residual", "HC", "mHC", "mHC-lite")):
        log = logged(runs[variant])
        assert len(log["train_loss"]) == STEPS
        expected[name] = (np.mean(log["train_loss"][-10:]), log["val_loss"][-1])
        assert [c.strip("*") for c in rows[name]] == [f"{expected[name][0]:.3f}", f"{expected[name][1]:.3f}"]
    for column in range(2):
        best = min(round(v[column], 3) for v in expected.values())
        for name, cells in rows.items():
            assert cells[column].startswith("**") == (round(expected[name][column], 3) == best)
    tex = (out / "loss_table.tex").read_text()
    assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex
    assert f"{expected['mHC-lite'][0]:.3f}" in tex.split("mHC-lite &")[1]
    assert "loss_table.md" in capsys.readouterr().out


def test_loss_table_default_averages_last_200_and_blanks_missing(runs, tmp_path):
    # A 250-step mhc log: the default mean covers exactly the last 200 steps.
    synthetic = tmp_path / "long-mhc"
    synthetic.mkdir()
    config = json.loads((runs["mhc"] / "config.json").read_text())
    (synthetic / "config.json").write_text(json.dumps({**config, "seed": 7}))
    losses = np.linspace(5.0, 2.0, 250)
    lines = [json.dumps(dict(step=s + 1, train_loss=float(x), lr=1e-3, grad_norm=1.0, tokens_per_s=1.0,
                             step_ms=1.0, mfu=None)) for s, x in enumerate(losses)]
    (synthetic / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    table = loss_table.build_table(find_runs([str(runs["mhc"]), str(synthetic), str(runs["res"])]))
    group = (DATASET, "tiny")
    real = np.mean(logged(runs["mhc"])["train_loss"])
    assert table["cells"][("mhc", *group, "train")] == pytest.approx([real, np.mean(losses[-200:])])
    assert table["cells"][("mhc", *group, "val")] == pytest.approx([logged(runs["mhc"])["val_loss"][-1]])
    rows = markdown_rows(loss_table.to_markdown(table))
    mean, std = np.mean([real, losses[-200:].mean()]), np.std([real, losses[-200:].mean()], ddof=1)
    assert rows["mHC"][0].strip("*") == f"{mean:.3f} ± {std:.3f}"
    assert rows["HC"] == ["", ""] and rows["mHC-lite"] == ["", ""]
    # The paper's fixed layout: columns in the given order, blank where no run exists.
    fixed = loss_table.build_table(find_runs([str(runs["res"])]), datasets=["openwebtext", DATASET], sizes=["S", "tiny"])
    assert fixed["columns"] == [("openwebtext", "S"), ("openwebtext", "tiny"), (DATASET, "S"), (DATASET, "tiny")]
    residual = markdown_rows(loss_table.to_markdown(fixed))["Residual"]
    assert residual[:6] == [""] * 6 and residual[6] == f"**{np.mean(logged(runs['res'])['train_loss']):.3f}**"
    assert loss_table.to_latex(fixed).count(r"\multicolumn{4}{c}") == 2


def test_metrics_after_resume_keep_the_latest_trajectory(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = [1, 2, 3, 4, 3, 4, 5]  # resumed from a step-2 checkpoint after logging 3 and 4
    lines = [json.dumps(dict(step=s, train_loss=float(i), grad_norm=1.0)) for i, s in enumerate(steps)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "train_lo')  # cut short by a crash
    train, _, _ = read_metrics(str(path))
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["train_loss"] for r in train] == [0.0, 1.0, 4.0, 5.0, 6.0]


def test_missing_or_duplicate_runs_give_one_line(runs, tmp_path, capsys):
    argv = ["--runs", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]
    assert "does not exist" in one_error_line(loss_table.main, argv, capsys)
    copy = tmp_path / "copy"
    shutil.copytree(runs["hc"], copy)
    argv = ["--runs", str(runs["hc"]), str(copy), "--out", str(tmp_path / "o")]
    assert "pass only one" in one_error_line(loss_table.main, argv, capsys)
    (copy / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    argv = ["--runs", str(copy), "--out", str(tmp_path / "o")]
    assert "metrics.jsonl:2" in one_error_line(loss_table.main, argv, capsys)


# ---------------------------------------------------------------------------------------------
# Gradient norm and throughput


def test_grad_norm_curves_use_a_shortened_window(runs, tmp_path, capsys):
    out = tmp_path / "grad"
    grad_norm.main(["--runs", *map(str, runs.values()), "--out", str(out)])
    png = out / f"grad_norm_{DATASET}-tiny.png"
    assert png.stat().st_size > 10_000
    window = STEPS // 4
    assert f"window 200 -> {window}" in capsys.readouterr().out
    curves = grad_norm.smoothed_curves({"mhclite": find_runs([str(runs["mhclite"])])}, window)
    (_, steps, mean, std), = curves["mhclite"]
    norms = np.array(logged(runs["mhclite"])["grad_norm"])
    assert len(mean) == STEPS - window + 1 and steps[0] == window
    assert mean[3] == pytest.approx(norms[3:3 + window].mean())
    assert std[-1] == pytest.approx(norms[-window:].std())


def test_throughput_is_the_mean_after_warmup(runs, tmp_path, capsys):
    out = tmp_path / "tp"
    throughput.main(["--runs", *map(str, runs.values()), "--out", str(out), "--skip", "5"])
    assert (out / f"throughput_{DATASET}-tiny.png").stat().st_size > 5_000
    [(_, _, stats, _)] = throughput.plot_throughputs(find_runs([str(p) for p in runs.values()]), str(out), skip=5)
    for variant in VARIANTS:
        assert stats[variant]["mean"] == pytest.approx(np.mean(logged(runs[variant])["tokens_per_s"][5:]))
        assert stats[variant]["steps"] == STEPS - 5
    assert stats["res"]["ratio_to_res"] == 1.0
    assert stats["mhc"]["ratio_to_res"] == pytest.approx(stats["mhc"]["mean"] / stats["res"]["mean"])
    assert "of res" in capsys.readouterr().out


def test_throughput_never_averages_a_first_step(runs, tmp_path, capsys):
    """Logged every step, as train.py writes it: the first step of the start (1) and of a resume (6)
    have first_step_s records of their own and null timings; even with --skip 0 neither counts."""
    dirs = []
    for variant, base in (("res", 1000.0), ("mhc", 400.0)):
        run_dir = tmp_path / f"{variant}-run"
        run_dir.mkdir()
        (run_dir / "config.json").write_text(json.dumps(dict(dataset=DATASET, size="tiny", residual=variant, seed=1)))
        lines = []
        for step in range(1, 11):
            first = step in (1, 6)
            if first:
                lines.append(dict(step=step, first_step_s=70.0 if step == 1 else 50.0, compiled=True))
            tokens = None if first else base + step
            lines.append(dict(step=step, train_loss=2.0, lr=1e-3, grad_norm=1.0, tokens_per_s=tokens,
                              step_ms=None if first else 1000 / tokens, mfu=None))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        dirs.append(str(run_dir))
    throughput.main(["--runs", *dirs, "--out", str(tmp_path / "tp"), "--skip", "0"])
    [(_, _, stats, text)] = throughput.plot_throughputs(find_runs(dirs), str(tmp_path / "tp"), skip=0)
    timed = [s for s in range(1, 11) if s not in (1, 6)]
    assert stats["res"]["mean"] == pytest.approx(np.mean([1000.0 + s for s in timed]))
    assert stats["mhc"]["mean"] == pytest.approx(np.mean([400.0 + s for s in timed]))
    assert stats["res"]["steps"] == 8 and stats["res"]["first_step_s"] == 70.0
    assert "first step 70.00 s" in text and "first step 70.00 s" in capsys.readouterr().out
    # the real runs: logged with log_interval 1, their first step is a record of its own
    run = find_runs([str(runs["hc"])])[0]
    record = next(json.loads(line) for line in (runs["hc"] / "metrics.jsonl").read_text().splitlines()
                  if "first_step_s" in line)
    assert record["step"] == 1 and record["compiled"] is False
    assert throughput.start_first_step_s(run) == record["first_step_s"]
    assert np.isnan(run.train["tokens_per_s"][0]) and throughput.run_throughput(run, skip=0)[1] == STEPS - 1


def test_progress_line_shows_only_the_runs_in_progress(tmp_path, capsys):
    def run_dir(name, max_iters=None, records=(), done=False):
        path = tmp_path / name
        path.mkdir()
        if max_iters is not None:
            (path / "config.json").write_text(json.dumps(dict(max_iters=max_iters)))
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 12')
        if done:
            (path / "done").write_text(f"{max_iters}\n")
        return str(path)

    def step(n, loss, step_ms):
        return dict(step=n, train_loss=loss, lr=1e-3, grad_norm=1.0, step_ms=step_ms,
                    tokens_per_s=None if step_ms is None else 1.0, mfu=None)

    running = run_dir("mhc", 500, [dict(step=0, eval_train_loss=4.0, val_loss=4.1),
                                   dict(step=1, first_step_s=9.0, compiled=False), step(1, 4.2, None),
                                   step(120, 2.53149, 250.0)])
    first_window = run_dir("res", 5000, [step(1, 4.0, None)])
    long_left = run_dir("hc", 20000, [step(10, 3.0, 400.0), step(11, 2.9, None)])
    finishing = run_dir("last_eval", 500, [step(500, 2.0, 250.0)])
    assert progress.progress_line([running, run_dir("done", 500, [step(500, 2.0, 250.0)], done=True),
                                   run_dir("not_started"), run_dir("mhclite", 500), first_window, long_left,
                                   finishing]) == (
        "mhc 120/500, loss 2.531, ~1:35 left | mhclite starting | res 1/5000, loss 4.000 | "
        "hc 11/20000, loss 2.900, ~2:13:16 left | last_eval 500/500, loss 2.000, finishing")
    progress.main([str(tmp_path / "done"), str(tmp_path / "not_started")])
    assert capsys.readouterr().out == ""
    progress.main([running])
    assert capsys.readouterr().out == "mhc 120/500, loss 2.531, ~1:35 left\n"


# ---------------------------------------------------------------------------------------------
# Collecting connection matrices


def test_collect_shapes_and_token_order(runs, collected):
    wrappers, tokens = 2 * N_LAYER, NUM_SEQS * SEQ_LEN
    for variant, path in collected.items():
        data = np.load(path)
        assert data["h_res"].shape == (wrappers, tokens, N_STREAMS, N_STREAMS)
        assert data["h_pre"].shape == data["h_post"].shape == (wrappers, tokens, N_STREAMS)
        assert ("logits" in data.files) == (variant == "mhc")
        assert data["h_res"].dtype == np.float32
        assert str(data["residual"]) == variant and int(data["n_layer"]) == N_LAYER
        assert int(data["step"]) == STEPS and list(data["wrapper"]) == list(range(wrappers))
        assert list(data["token_index"]) == list(range(tokens))
    # Sequence 3 through the model directly: the same matrices at tokens 3*T .. 4*T.
    model, _ = load_model(str(runs["mhc"] / "ckpt.pt"))
    train = np.fromfile(runs["mhc"].parent.parent / "data" / DATASET / "train.bin", dtype=np.uint16)
    sequence = torch.from_numpy(train[3 * SEQ_LEN: 4 * SEQ_LEN].astype(np.int64))[None]
    with torch.no_grad(), capture_connections(model) as records:
        model(sequence)
    data = np.load(collected["mhc"])
    for w, record in enumerate(records):
        np.testing.assert_allclose(data["h_res"][w, 3 * SEQ_LEN: 4 * SEQ_LEN], record["h_res"][0].numpy(), atol=1e-6)
        np.testing.assert_allclose(data["logits"][w, 3 * SEQ_LEN: 4 * SEQ_LEN], record["logits"][0].numpy(),
                                   atol=1e-5)


def test_collect_max_tokens_is_a_seeded_subsample(runs, collected, tmp_path):
    paths = [tmp_path / f"sub{i}.npz" for i in range(2)]
    for path in paths:
        collect.collect(str(runs["hc"] / "ckpt.pt"), str(path), NUM_SEQS, SEQ_LEN, batch_size=3, max_tokens=50, seed=4)
    first, second, full = np.load(paths[0]), np.load(paths[1]), np.load(collected["hc"])
    index = first["token_index"]
    assert len(index) == 50 and np.all(np.diff(index) > 0)
    np.testing.assert_array_equal(index, second["token_index"])
    np.testing.assert_allclose(first["h_res"], full["h_res"][:, index], atol=1e-6)


def test_collect_errors_are_one_line(runs, tmp_path, capsys):
    base = ["--out", str(tmp_path / "x.npz"), "--num_seqs", "2", "--seq_len", str(SEQ_LEN)]
    cases = [
        (["--ckpt", str(runs["res"] / "ckpt.pt")], "res has no H_res"),
        (["--ckpt", str(tmp_path / "missing.pt")], "not found"),
        (["--ckpt", str(runs["hc"] / "ckpt.pt"), "--seq_len", "999"], "block_size"),
        (["--ckpt", str(runs["hc"] / "ckpt.pt"), "--num_seqs", "100000"], "fewer than"),
    ]
    for args, message in cases:
        assert message in one_error_line(collect.main, base + args, capsys)  # later flags win
    assert not (tmp_path / "x.npz").exists()


# ---------------------------------------------------------------------------------------------
# log(1/nu) and column sums


def test_nu_hist_is_max_minus_min_of_the_logits(collected, tmp_path, capsys):
    out = tmp_path / "nu"
    nu_hist.main(["--npz", str(collected["mhc"]), "--out", str(out)])
    assert (out / "nu_hist.png").stat().st_size > 10_000
    logits = np.load(collected["mhc"])["logits"].astype(np.float64)
    expected = (logits.max(axis=(-2, -1)) - logits.min(axis=(-2, -1))).ravel()
    stats = nu_hist.nu_stats(str(collected["mhc"]), threshold=12.0)
    np.testing.assert_allclose(stats["values"], expected, rtol=0, atol=1e-12)
    assert stats["fraction_above"] == pytest.approx(np.mean(expected > 12.0))
    printed = capsys.readouterr().out
    assert f"{100 * np.mean(expected > 30):.2f}% of {expected.size} Sinkhorn inputs" in printed
    assert "only mhc" in one_error_line(nu_hist.main, ["--npz", str(collected["mhclite"]), "--out", str(out)], capsys)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(collected["mhc"].read_bytes()[:1000])
    argv = ["--npz", str(truncated), "--out", str(out)]
    assert "not a readable npz" in one_error_line(colsum_box.main, argv, capsys)


def test_colsums_per_matrix_and_product(collected, tmp_path, capsys):
    out = tmp_path / "cs"
    colsum_box.main(["--npz", *map(str, collected.values()), "--out", str(out)])
    assert (out / f"colsum_{DATASET}-tiny.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    stats = {v: colsum_box.sum_stats(str(p)) for v, p in collected.items()}
    lite = stats["mhclite"]
    for panel in ("per_matrix", "product"):
        assert np.abs(lite["colsums"][panel] - 1).max() < 1e-5
        assert lite["max_dev"][panel]["col"] < 1e-5 and lite["max_dev"][panel]["row"] < 1e-5
    assert stats["mhc"]["max_dev"]["per_matrix"]["row"] < 1e-5  # Sinkhorn ends on rows
    for variant, path in collected.items():
        h_res = np.load(path)["h_res"].astype(np.float64)
        product = h_res[0]
        for h in h_res[1:]:
            product = h @ product  # x_out = H_{W-1} ... H_0 x_in
        np.testing.assert_allclose(stats[variant]["colsums"]["product"], product.sum(axis=-2).ravel(), atol=1e-12)
        assert stats[variant]["max_dev"]["product"]["col"] == pytest.approx(np.abs(product.sum(axis=-2) - 1).max())
        assert stats[variant]["max_dev"]["per_matrix"]["row"] == pytest.approx(np.abs(h_res.sum(axis=-1) - 1).max())
        assert f"{stats[variant]['max_dev']['product']['col']:.3e}" in printed


# ---------------------------------------------------------------------------------------------
# The larger-n study


@pytest.mark.slow
def test_larger_n_study_numbers_come_from_the_runs(runs, tmp_path, capsys):
    sampled = tmp_path / "runs" / "mhclite-K6-cover"
    train_run(runs["res"].parents[1] / "data", sampled, "mhclite",
              extra=["--mhclite_perms=6", "--mhclite_perm_sampling=cover"])
    run_dirs = [runs["res"], runs["mhc"], sampled, runs["mhclite"]]  # the page's order: n, variant, K
    out = tmp_path / "study"
    larger_n.main(["--runs", *map(str, run_dirs), "--out", str(out), "--num_seqs", "3", "--seq_len", "16",
                   "--study_command", "bash scripts/larger_n_study.sh"])
    printed = capsys.readouterr().out
    page = (out / "larger_n.md").read_text()
    assert (out / "larger_n.png").stat().st_size > 10_000 and "(larger_n.png)" in page
    assert "bash scripts/larger_n_study.sh\npython analysis/larger_n.py --runs" in page
    assert list(markdown_rows(page)) == ["Residual", f"mHC n={N_STREAMS}", f"mHC-lite n={N_STREAMS} K=6 cover",
                                         f"mHC-lite n={N_STREAMS} K=24"]
    summary = json.loads((out / "larger_n.json").read_text())["summary"]
    for entry, run_dir in zip(summary, run_dirs):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        val = [r["val_loss"] for r in records if "val_loss" in r]
        step_ms = [r["step_ms"] for r in records if "step_ms" in r]
        assert entry["val_loss"] == pytest.approx(val[-1])
        assert entry["step_ms"] == pytest.approx(np.median(step_ms[len(step_ms) // 10:]))
        model, _ = load_model(str(run_dir / "ckpt.pt"))
        assert entry["connection_params"] == sum(p.numel() for m in model.connections() for p in m.parameters())
        assert f"{entry['val_loss']:.4f}" in printed
    res, mhc, cover, full = summary
    assert np.isnan(res["matrix_col_dev"])
    assert mhc["matrix_row_dev"] < 1e-5 < mhc["matrix_col_dev"]  # Sinkhorn ends on rows
    for lite in (full, cover):
        for key in ("matrix_col_dev", "matrix_row_dev", "product_col_dev", "product_row_dev"):
            assert lite[key] < 1e-5
    # W_res (nC x K) and b_res (K): the K=6 model has 18 fewer of each per wrapper than the K=24 one
    assert full["connection_params"] - cover["connection_params"] == 2 * N_LAYER * (N_STREAMS * 64 + 1) * 18


def test_larger_n_rejects_other_variants_and_mixed_lengths(runs, tmp_path, capsys):
    argv = ["--runs", str(runs["hc"]), "--out", str(tmp_path)]
    assert "the larger-n study compares res, mhc, mhclite" in one_error_line(larger_n.main, argv, capsys)
    short = tmp_path / "short"
    train_run(runs["res"].parents[1] / "data", short, "mhc", extra=["--max_iters=10"])
    argv = ["--runs", str(runs["res"]), str(short), "--out", str(tmp_path / "o"), "--num_seqs", "1"]
    assert "stopped at different steps" in one_error_line(larger_n.main, argv, capsys)


# ---------------------------------------------------------------------------------------------
# The report and the two ways of running a script


@pytest.mark.slow
def test_report_embeds_every_figure_and_the_table(runs, tmp_path, capsys):
    out, other = tmp_path / "report", tmp_path / "notes"
    out.mkdir()  # the report folder among the runs (out/demo/* on a second call) is ignored
    other.mkdir()  # any other folder that is not a run is skipped with a note
    report.main(["--runs", *map(str, runs.values()), str(out), str(other), "--out", str(out), "--num_seqs", "2",
                 "--batch_size", "2", "--sample_tokens", "60"])
    printed = capsys.readouterr().out
    assert f"skipping '{other}'" in printed and f"skipping '{out}'" not in printed
    text = (out / "report.md").read_text()
    figures = sorted(p.name for p in out.glob("*.png"))
    assert len(figures) == 4  # grad norm, throughput, nu_hist, colsum of the one group
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(linked) == figures
    table = (out / "loss_table.md").read_text().split("\n\n")[0]
    assert table in text
    assert sorted(p.name for p in (out / "collect").glob("*.npz")) == [f"{DATASET}-tiny-{v}-s1.npz"
                                                                        for v in ("hc", "mhc", "mhclite")]
    assert "Sinkhorn inputs have log(1/nu)" in text and "max|colsum-1|" in text
    assert f"wrote {out / 'report.md'}" in printed
    # next to the loss table: 60 tokens from each checkpoint, as sample.py draws them with the seed
    samples = text.split("## Samples\n")[1].split("## Gradient norm")[0]
    assert text.index(table) < text.index("## Samples") < text.index("## Gradient norm")
    for variant, name in zip(VARIANTS, ("Residual", "HC", "mHC", "mHC-lite")):
        model, meta = sample.load(str(runs[variant]))
        assert "\n" not in meta["itos"] and sample.default_start(meta) == "a"  # no newline: the first character
        [expected] = sample.sample(model, meta, "a", max_new_tokens=60, temperature=0.8, top_k=200, seed=0)
        assert len(expected) == 61
        assert f"**{name}**, toy_char tiny ({runs[variant].name}):\n\n```text\n{expected[1:]}\n```" in samples


@pytest.mark.slow
@pytest.mark.parametrize("form", [["analysis/loss_table.py"], ["-m", "analysis.loss_table"]])
def test_scripts_run_as_file_and_as_module(runs, tmp_path, form):
    result = subprocess.run([sys.executable, *form, "--runs", str(runs["res"]), "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "loss_table.tex").exists()
    result = subprocess.run([sys.executable, *form, "--runs", str(tmp_path / "nope")], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_loss_table_shows_the_authors_settings_beside_the_paper(runs, tmp_path):
    """A run with configs/authors.py's settings gets its own row and its settings listed; the run
    whose config.json predates the settings counts as the paper's."""
    authors = tmp_path / "mhclite-authors"
    shutil.copytree(runs["mhclite"], authors)
    config = json.loads((authors / "config.json").read_text())
    settings = authors_settings()
    assert set(settings) >= {"final_norm", "rms_eps", "sinkhorn_order", "init_stream", "connection_weight_decay",
                             "h_res_dtype", "mixing_dtype"}
    (authors / "config.json").write_text(json.dumps({**config, **settings}))
    mixed = tmp_path / "mhc-mixed"
    shutil.copytree(runs["mhc"], mixed)
    (mixed / "config.json").write_text(json.dumps({**json.loads((mixed / "config.json").read_text()),
                                                   "final_norm": settings["final_norm"]}))
    old = tmp_path / "mhclite-old"
    shutil.copytree(runs["mhclite"], old)
    (old / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in settings}))
    out = tmp_path / "table"
    loss_table.main(["--runs", str(old), str(authors), str(mixed), "--out", str(out), "--last", "10"])
    markdown = (out / "loss_table.md").read_text()
    rows = markdown_rows(markdown)
    assert list(rows) == ["Residual", "HC", "mHC", "mHC (mixed)", "mHC-lite", "mHC-lite (authors)"]
    assert rows["mHC"] == ["", ""]
    val = f"{logged(runs['mhclite'])['val_loss'][-1]:.3f}"
    assert rows["mHC-lite"][1].strip("*") == rows["mHC-lite (authors)"][1].strip("*") == val
    listed = markdown.split("| run | settings |")[1]
    assert f"| mhclite-authors | authors | {repr(settings['final_norm'])} |" in listed
    assert "| mhclite-old | paper | (paper's, not recorded) |" in listed
    assert "| mhc-mixed | mixed |" in listed


@pytest.mark.slow
def test_the_report_covers_kromhc_ihc_and_mhc_with_v4_epsilons(hellaswag_runs, tmp_path, capsys):
    """The variants after mHC-lite through the report: rows of their own in the loss table (mhc with
    mhc_eps > 0 apart from the paper's mhc), kromhc's factor weights collected, the column sums of
    every variant that learns an H_res (iHC's is I), log(1/nu) for both mHCs."""
    v4 = tmp_path / "runs" / "mhc-v4eps"
    shutil.copytree(hellaswag_runs["mhc"], v4)
    config = json.loads((v4 / "config.json").read_text())
    (v4 / "config.json").write_text(json.dumps({**config, "mhc_eps": 1e-6}))
    ckpt = load_checkpoint(str(v4 / "ckpt.pt"))
    ckpt["model_args"]["mhc_eps"] = 1e-6
    save_checkpoint(str(v4 / "ckpt.pt"), ckpt)
    runs = [hellaswag_runs["mhc"], v4, hellaswag_runs["kromhc-n6"], hellaswag_runs["ihc"]]
    out = tmp_path / "report"
    report.main(["--runs", *map(str, runs), "--out", str(out), "--num_seqs", "2", "--seq_len", "32",
                 "--sample_tokens", "0", "--window", "2"])
    text = (out / "report.md").read_text()
    rows = markdown_rows((out / "loss_table.md").read_text())
    assert list(rows) == ["Residual", "HC", "mHC", "mHC (V4 eps)", "mHC-lite", "KromHC", "iHC"]
    for name, run in zip(("mHC", "mHC (V4 eps)", "KromHC", "iHC"), runs):
        assert rows[name][1].strip("*") == f"{logged(run)['val_loss'][-1]:.3f}"
    kromhc = np.load(out / "collect" / "kromhc-n6.npz")
    assert kromhc["variant"].item() == "kromhc" and kromhc["factors"].tolist() == [2, 3]
    assert kromhc["factor_weights"].shape == (4, 64, 2 + 6)
    weights = kromhc["factor_weights"]
    assert np.allclose(weights[..., :2].sum(-1), 1) and np.allclose(weights[..., 2:].sum(-1), 1)
    ihc = np.load(out / "collect" / "ihc.npz")
    assert (ihc["h_res"] == np.eye(4)).all()
    stats = {s["variant"]: s for s in map(colsum_box.sum_stats, sorted((out / "collect").glob("*.npz")))}
    assert stats["kromhc"]["max_dev"]["product"]["col"] < 1e-5 and stats["ihc"]["max_dev"]["product"]["col"] == 0
    for s in stats.values():
        assert colsum_box.format_stats(s) in text
    nu_lines = text.split("### log(1/nu)")[1].split("###")[0]
    assert "mHC fixture tiny" in nu_lines and "mHC (V4 eps) fixture tiny" in nu_lines


def test_larger_n_study_takes_kromhc(hellaswag_runs, tmp_path):
    """KromHC in the larger-n study, labelled by its factors, exact like mHC-lite."""
    runs = [hellaswag_runs["kromhc-n6"], hellaswag_runs["mhc"]]
    _, summary = larger_n.write_study(list(map(str, runs)), str(tmp_path), "python analysis/larger_n.py",
                                      num_seqs=2, seq_len=32)
    assert [e["label"] for e in summary] == ["mHC n=4", "KromHC n=6 = 2 x 3"]
    kromhc = summary[1]
    assert kromhc["matrix_col_dev"] < 1e-5 and kromhc["product_col_dev"] < 1e-5
    model, _ = load_model(str(runs[0] / "ckpt.pt"))
    assert kromhc["connection_params"] == model.parameter_counts()["connections"]
    assert kromhc["val_loss"] == pytest.approx(logged(runs[0])["val_loss"][-1])
