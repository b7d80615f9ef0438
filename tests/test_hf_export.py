"""export_hf.py: the exported folder loads offline in transformers and computes what our model
computes, for every variant, mhclite with n = 8 and sampled permutations, kromhc with n = 6 and mhc
with DeepSeek-V4's epsilons: the logits, greedy
generation (past the block size too), the tokenizer; lm-evaluation-harness's HF model scores the
HellaSwag fixture as analysis/hellaswag.py does; one-line errors."""
import dataclasses
import json
import os

import pytest
import torch

import export_hf
import sample
from analysis import hellaswag
from checkpoint import load_checkpoint, save_checkpoint
from conftest import FIXTURE_RUNS, HELLASWAG_FIXTURE, load_export, one_error_line, run_script
from model import GPTConfig
from sample import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
RUNS = tuple(FIXTURE_RUNS)


@pytest.fixture(scope="module")
def exports(hellaswag_runs, tmp_path_factory):
    """{run name: export folder}."""
    root = tmp_path_factory.mktemp("exports")
    return {name: export_hf.export(str(run), str(root / name)) for name, run in hellaswag_runs.items()}


def test_the_folder_is_self_contained(exports):
    files = set(os.listdir(exports["mhclite"]))
    assert {"config.json", "model.safetensors", "tokenizer.json", "configuration_mhclite_gpt.py",
            "modeling_mhclite_gpt.py", "residuals.py", "authors.py"} <= files
    with open(os.path.join(exports["mhclite"], "residuals.py")) as exported, open("residuals.py") as ours:
        assert exported.read() == ours.read()  # the connections' code is ours, not a rewrite


@pytest.mark.parametrize("name", RUNS)
def test_logits_permutations_and_tokens_equal_ours(hellaswag_runs, exports, name):
    ours, ckpt = load_model(str(hellaswag_runs[name] / "ckpt.pt"))
    exported, tokenizer = load_export(exports[name])
    assert exported.dtype == torch.float32
    tokens = torch.randint(0, ours.config.vocab_size, (2, ours.config.block_size),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = ours(tokens, torch.zeros_like(tokens))
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5
    if ours.config.residual == "mhclite":
        for mine, theirs in zip(ours.connections(), [c for b in exported.transformer.h
                                                     for c in (b.attn_connection, b.mlp_connection)]):
            assert torch.equal(mine.perms, theirs.perms) and torch.equal(mine.perm_matrices, theirs.perm_matrices)
        assert ours.connections()[0].perms.shape == ((12, 8) if name == "mhclite-n8" else (24, 4))
    text = HELLASWAG_FIXTURE.read_text()[:2000]
    meta = sample.read_meta(ckpt)
    known = "".join(ch for ch in text if ch in meta["itos"])
    assert tokenizer.encode(text) == sample.encode(known, meta)  # characters outside the vocabulary dropped
    assert tokenizer.decode(sample.encode(known, meta)) == known


@pytest.mark.parametrize("name", RUNS)
def test_greedy_generate_equals_sample_top_k_1_past_the_block_size(hellaswag_runs, exports, name):
    ours, ckpt = load_model(str(hellaswag_runs[name] / "ckpt.pt"))
    exported, tokenizer = load_export(exports[name])
    meta = sample.read_meta(ckpt)
    prompt = "Fishing: An old man walks to the end of the bridge."
    new_tokens = ours.config.block_size + 10 - len(prompt) + 10  # crops the context for the last 20 tokens
    [text] = sample.sample(ours, meta, prompt, max_new_tokens=new_tokens, top_k=1)
    ids = torch.tensor([tokenizer.encode(prompt)])
    for use_cache in (True, False):
        out = exported.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=use_cache,
                                eos_token_id=None, pad_token_id=0)
        assert tokenizer.decode(out[0]) == text


def test_the_authors_settings_are_exported(hellaswag_runs, exports, tmp_path):
    """Settings that change the computation but not the parameters, set on a trained checkpoint."""
    ckpt = torch.load(hellaswag_runs["mhclite"] / "ckpt.pt", weights_only=True)
    ckpt["model_args"].update(final_norm="per_stream", rms_eps=0.0, mixing_dtype="autocast", h_res_dtype="autocast")
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    folder = export_hf.export(str(tmp_path / "run"), str(tmp_path / "export"))
    ours, _ = load_model(str(tmp_path / "run" / "ckpt.pt"))
    exported, _ = load_export(folder)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = ours(tokens, torch.zeros_like(tokens))
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5
    reference, _ = load_model(str(hellaswag_runs["mhclite"] / "ckpt.pt"))
    with torch.no_grad():
        assert (reference(tokens, torch.zeros_like(tokens))[0] - expected).abs().max() > 1e-4  # they do matter


def test_mhc_with_v4_epsilons_is_exported(hellaswag_runs, tmp_path):
    """mhc_eps changes the computation, not the parameters: set on a trained mhc checkpoint."""
    ckpt = load_checkpoint(str(hellaswag_runs["mhc"] / "ckpt.pt"))
    ckpt["model_args"].update(mhc_eps=1e-6)
    (tmp_path / "run").mkdir()
    save_checkpoint(str(tmp_path / "run" / "ckpt.pt"), ckpt)
    ours, _ = load_model(str(tmp_path / "run" / "ckpt.pt"))
    exported, _ = load_export(export_hf.export(str(tmp_path / "run"), str(tmp_path / "export")))
    assert exported.config.mhc_eps == 1e-6
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, _ = ours(tokens, torch.zeros_like(tokens))
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5


def test_the_permutation_set_travels_with_the_weights(hellaswag_runs, tmp_path):
    """A checkpoint whose perms differ from what its config would draw: the export computes with the saved ones."""
    ckpt = torch.load(hellaswag_runs["mhclite-n8"] / "ckpt.pt", weights_only=True)
    for name in [k for k in ckpt["model"] if k.endswith(".perms")]:
        ckpt["model"][name] = ckpt["model"][name].flip(0)
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    ours, _ = load_model(str(tmp_path / "run" / "ckpt.pt"))
    exported, _ = load_export(export_hf.export(str(tmp_path / "run"), str(tmp_path / "export")))
    original, _ = load_model(str(hellaswag_runs["mhclite-n8"] / "ckpt.pt"))
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, _ = ours(tokens, torch.zeros_like(tokens))
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5
        assert (original(tokens, torch.zeros_like(tokens))[0] - expected).abs().max() > 1e-4


def test_the_export_takes_every_model_setting_but_the_training_only_ones():
    """The export takes the architecture, the vocabulary and the authors' switches that act on the
    forward pass (model.py's groups), so a new architecture setting reaches the export's
    config.json with no list to keep."""
    training_only = {"dropout", "init_stream", "init_stream_seed", "connection_weight_decay"}
    config = GPTConfig(residual="mhclite", mixing_dtype="autocast", rms_eps=0.0, dropout=0.1)
    settings = export_hf.model_settings(config)
    assert set(settings) == {f.name for f in dataclasses.fields(GPTConfig)} - training_only
    assert (settings["mixing_dtype"], settings["rms_eps"], settings["n_layer"]) == ("autocast", 0.0, 12)


def lm_eval_fixture_task(folder):
    """A task folder for lm-evaluation-harness: its own hellaswag task, on the fixture file."""
    import lm_eval

    harness_yaml = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag", "hellaswag.yaml")
    folder.mkdir()
    (folder / "hellaswag_fixture.yaml").write_text(
        f"include: {harness_yaml}\ntask: hellaswag_fixture\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {HELLASWAG_FIXTURE}\ntraining_split: null\n")
    return folder


def test_lm_evaluation_harness_scores_the_export_as_we_score_the_run(hellaswag_runs, exports, tmp_path):
    name = "mhclite-n8"  # the most general model; the logit tests cover the others
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, ckpt = load_model(str(hellaswag_runs[name] / "ckpt.pt"))
    ours = hellaswag.score(model, sample.read_meta(ckpt), hellaswag.read_items(str(HELLASWAG_FIXTURE)),
                           progress=False)
    harness_model = HFLM(pretrained=exports[name], trust_remote_code=True, device="cpu", batch_size=8)
    assert harness_model.max_length == model.config.block_size
    tasks = TaskManager(include_path=str(lm_eval_fixture_task(tmp_path / "tasks")))
    results = simple_evaluate(model=harness_model, tasks=["hellaswag_fixture"], task_manager=tasks, log_samples=True,
                              num_fewshot=0)
    samples = sorted(results["samples"]["hellaswag_fixture"], key=lambda s: s["doc_id"])
    assert len(samples) == ours["items"] == 8
    for mine, theirs in zip(ours["per_item"], samples):
        lls = [float(resp[0][0]) for resp in theirs["resps"]]
        assert lls == pytest.approx(mine["loglikelihoods"], abs=1e-4)
        assert theirs["acc"] == float(mine["choice"] == mine["gold"])
        assert theirs["acc_norm"] == float(mine["choice_norm"] == mine["gold"])
    summary = results["results"]["hellaswag_fixture"]
    for key in ("acc", "acc_norm"):
        assert summary[f"{key},none"] == pytest.approx(ours[key])
        assert summary[f"{key}_stderr,none"] == pytest.approx(ours[f"{key}_stderr"])


def test_an_existing_folder_needs_force_and_bad_input_is_one_error_line(hellaswag_runs, exports, tmp_path, capsys):
    import shutil

    earlier, other = tmp_path / "earlier", tmp_path / "other"
    shutil.copytree(exports["res"], earlier)
    (earlier / "keep.txt").write_text("mine")
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    run = f"--out_dir={hellaswag_runs['hc']}"
    for args, message in (([run, f"--export_dir={earlier}"], "exists and is not empty; pass --force"),
                          ([run, f"--export_dir={other}", "--force"], "holds no earlier export"),
                          ([f"--out_dir={tmp_path / 'missing'}", f"--export_dir={tmp_path / 'new'}"],
                           "no run directory")):
        one_error_line(export_hf.main, args, capsys, message)
    assert "keep.txt" in os.listdir(earlier) and os.listdir(other) == ["notes.txt"]
    result = run_script("export_hf.py", run, f"--export_dir={earlier}", "--force")
    assert result.returncode == 0, result.stderr
    assert "keep.txt" not in os.listdir(earlier)
    assert json.loads((earlier / "config.json").read_text())["residual"] == "hc"


def test_the_gpt2_tokenizer_is_tiktokens_offline(tmp_path):
    from transformers import AutoTokenizer

    export_hf.gpt2_tokenizer().save_pretrained(tmp_path)
    tokenizer, encoding = AutoTokenizer.from_pretrained(tmp_path), sample.dataprep.gpt2_encoding()
    text = "Hello world!  First Citizen:\n\tBefore we proceed any further, hear me speak. 1234 ünïcode 😀"
    assert tokenizer.encode(text) == encoding.encode_ordinary(text)
    assert tokenizer.encode("<|endoftext|>") == [50256] and tokenizer.decode(encoding.encode_ordinary(text)) == text
