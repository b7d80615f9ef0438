"""analysis/hellaswag.py: the harness's cleaning of items, its context/continuation split, the
scores against an independent per-sequence computation, results in the run directory, errors."""
import json
import math
import subprocess

import pytest
import torch

from analysis import hellaswag
from conftest import HELLASWAG_FIXTURE, one_error_line, run_script
import sample
from sample import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_items_are_cleaned_as_the_harness_cleans_them():
    item = dict(activity_label="Home and garden", ctx_a="[header] How to plant a tree [title] Dig a hole.",
                ctx_b="[step] make  it", endings=[" wide. ", "deep [substeps] enough."], label="1")
    context, endings, gold = hellaswag.prompt_and_endings(item)
    assert context == "Home and garden: How to plant a tree. Dig a hole. make it"
    assert endings == ["wide.", "deep enough."] and gold == 1


def test_trailing_spaces_of_the_context_move_to_the_continuation():
    encode = list  # a character "tokenizer"
    assert hellaswag.request_tokens(encode, "A drum. ", " he hits it") == (list("A drum."), list("  he hits it"))
    assert hellaswag.request_tokens(encode, "ab", " c") == (list("ab"), list(" c"))


def test_standard_errors_are_the_sample_deviation_over_the_root_of_the_count():
    mean, stderr = hellaswag.mean_and_stderr([1.0, 0.0, 0.0, 1.0])
    assert mean == 0.5 and stderr == pytest.approx(math.sqrt(1 / 3) / 2)
    assert hellaswag.mean_and_stderr([1.0]) == (1.0, None)


def test_scores_equal_each_sequence_scored_alone(hellaswag_runs):
    model, ckpt = load_model(str(hellaswag_runs["mhclite"] / "ckpt.pt"))
    meta = sample.read_meta(ckpt)
    items = hellaswag.read_items(str(HELLASWAG_FIXTURE))
    results = hellaswag.score(model, meta, items, batch_size=5, progress=False)
    assert results["items"] == 8 and results["dropped_characters"] == 0
    context, endings, gold = items[3]
    stoi = {ch: i for i, ch in enumerate(meta["itos"])}
    for ending, ll in zip(endings, results["per_item"][3]["loglikelihoods"]):
        ids = [stoi[ch] for ch in context + " " + ending]
        block = model.config.block_size
        inputs, targets = torch.tensor([ids[-(block + 1):-1]]), torch.tensor(ids[-(block + 1):][1:])
        with torch.no_grad():
            logits, _ = model(inputs, torch.zeros_like(inputs))
        expected = torch.log_softmax(logits[0], -1)[torch.arange(len(targets)), targets][-(len(ending) + 1):].sum()
        assert ll == pytest.approx(expected.item(), abs=1e-4)
    choices = [p["choice"] == p["gold"] for p in results["per_item"]]
    assert results["acc"] == sum(choices) / 8
    norm_choices = [p["choice_norm"] == p["gold"] for p in results["per_item"]]
    assert results["acc_norm"] == sum(norm_choices) / 8


def test_characters_outside_a_char_vocabulary_are_dropped_and_counted(hellaswag_runs):
    model, ckpt = load_model(str(hellaswag_runs["res"] / "ckpt.pt"))
    meta = sample.read_meta(ckpt)
    items = [("Fishing: 3 men fish.", ["They eat #fish.", "They sleep."], 0)]
    results = hellaswag.score(model, meta, items, progress=False)
    assert results["dropped_characters"] == 2  # "3" and "#"


def test_the_command_writes_the_results_into_the_run_directory(hellaswag_runs):
    result = run_script("analysis/hellaswag.py", f"--out_dir={hellaswag_runs['hc']}", f"--data={HELLASWAG_FIXTURE}",
                        "--device=cpu", "--limit=6")
    assert result.returncode == 0, result.stderr
    results = json.loads((hellaswag_runs["hc"] / "hellaswag.json").read_text())
    assert results["items"] == 6 and len(results["per_item"]) == 6 and results["limit"] == 6
    assert "acc_norm" in result.stdout and str(hellaswag_runs["hc"]) in result.stdout


def test_bad_input_is_one_error_line(hellaswag_runs, tmp_path, capsys):
    no_label = tmp_path / "items.jsonl"
    no_label.write_text(json.dumps(dict(activity_label="a", ctx_a="b", ctx_b="c", endings=["d"])) + "\n")
    cases = [(["--out_dir=" + str(tmp_path / "missing"), f"--data={HELLASWAG_FIXTURE}"], "no run directory"),
             ([f"--out_dir={hellaswag_runs['res']}", f"--data={no_label}"], "lacks the field(s) label"),
             ([f"--out_dir={hellaswag_runs['res']}", f"--data={tmp_path / 'none.jsonl'}"], "no data file"),
             ([f"--out_dir={hellaswag_runs['res']}", "--limit=0"], "--limit must be >= 1")]
    for args, message in cases:
        one_error_line(hellaswag.main, args, capsys, message)


def test_json_and_parquet_files_give_the_items_of_the_jsonl(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [json.loads(line) for line in HELLASWAG_FIXTURE.read_text().splitlines()]
    (tmp_path / "items.json").write_text(json.dumps(rows))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "items.parquet")
    expected = hellaswag.read_items(str(HELLASWAG_FIXTURE))
    assert len(expected) == 8
    assert hellaswag.read_items(str(tmp_path / "items.json")) == expected
    assert hellaswag.read_items(str(tmp_path / "items.parquet"), limit=3) == expected[:3]


def test_the_downstream_table_shows_mean_and_std_over_the_runs_with_results(hellaswag_runs, tmp_path):
    import shutil

    from analysis.common import find_runs

    copies = {}
    for name, run in hellaswag_runs.items():  # the runs' logs without their checkpoints
        copies[name] = tmp_path / name
        shutil.copytree(run, copies[name], ignore=shutil.ignore_patterns("*.pt", "hellaswag.json"))
    config = json.loads((copies["mhclite-n8"] / "config.json").read_text())
    (copies["mhclite-n8"] / "config.json").write_text(json.dumps({**config, "seed": 7}))  # a second mhclite seed
    assert hellaswag.downstream_markdown(find_runs([str(p) for p in copies.values()])) == ""
    for name, acc, acc_norm in (("res", 0.25, 0.5), ("mhclite", 0.3, 0.4), ("mhclite-n8", 0.4, 0.6)):
        (copies[name] / "hellaswag.json").write_text(json.dumps(dict(acc=acc, acc_norm=acc_norm, items=8)))
    table = hellaswag.downstream_markdown(find_runs([str(p) for p in copies.values()]))
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| Variant")}
    assert set(rows) == {"Residual", "mHC-lite"}  # runs without results have no row
    assert rows["Residual"] == ["25.0", "50.0"]
    assert rows["mHC-lite"] == ["35.0 ± 7.1", "50.0 ± 14.1"]
    assert "items scored per run: 8" in table and "acc_norm" in table.splitlines()[0]


def test_the_sweep_scores_each_finished_run_once(tmp_path):
    def sweep(*args):
        return subprocess.run(["bash", "scripts/sweep_table1.sh", "--out_root", str(tmp_path), "--dry_run",
                               "--datasets", "openwebtext", "--sizes", "S", "--residuals", "hc mhclite", *args],
                              capture_output=True, text=True, timeout=60)

    assert "hellaswag" not in sweep().stdout
    (tmp_path / "openwebtext-S-hc-s1337").mkdir()
    (tmp_path / "openwebtext-S-hc-s1337" / "done").write_text("1\n")
    (tmp_path / "openwebtext-S-hc-s1337" / "hellaswag.json").write_text("{}")
    proc = sweep("--hellaswag", "--hellaswag_data", str(HELLASWAG_FIXTURE))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == f"skip (finished): {tmp_path}/openwebtext-S-hc-s1337"  # already scored: nothing more
    assert "train.py" in lines[1] and len(lines) == 3
    assert lines[2].split() == [lines[2].split()[0], "analysis/hellaswag.py",
                                f"--out_dir={tmp_path}/openwebtext-S-mhclite-s1337", f"--data={HELLASWAG_FIXTURE}"]
