"""sample.py on tiny checkpoints of every variant: determinism, greedy decoding against an
independent argmax loop, context cropping, causality of the model, tokenizers, one-line errors."""
import os
import subprocess
import sys
import types

import pytest
import torch

import sample
import train
from config import REPO_DIR
from conftest import assert_one_error_line, tiny_args

VARIANTS = ("res", "hc", "mhc", "mhclite")
BLOCK = 32  # tiny_args' block_size
LONG_PROMPT = "the king rode to the old castle and the queen kept watch over the river\n"  # > BLOCK chars


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dirs(data_dir, tmp_path_factory):
    """{variant: run directory} of a few training steps each."""
    root = tmp_path_factory.mktemp("sample_runs")
    dirs = {}
    for variant in VARIANTS:
        dirs[variant] = root / variant
        train.main(tiny_args(data_dir, dirs[variant], residual=variant, max_iters=4, eval_interval=4,
                             warmup_iters=1))
    return dirs


def greedy(model, ids, max_new_tokens):
    """Argmax decoding through the model's full-sequence (training) path, cropped to block_size."""
    ids = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            context = ids[:, -model.config.block_size:]
            logits, _ = model(context, torch.zeros_like(context))  # targets given: logits at every position
            ids = torch.cat((ids, logits[:, -1].argmax(dim=-1, keepdim=True)), dim=1)
    return ids[0].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_samples_are_seeded_and_decoded_with_the_runs_characters(run_dirs, variant):
    model, meta = sample.load(str(run_dirs[variant]))
    assert model.config.residual == variant and not model.training
    texts = sample.sample(model, meta, "the ", num_samples=2, max_new_tokens=40, temperature=1.0, top_k=None, seed=3)
    again = sample.sample(model, meta, "the ", num_samples=2, max_new_tokens=40, temperature=1.0, top_k=None, seed=3)
    other = sample.sample(model, meta, "the ", num_samples=2, max_new_tokens=40, temperature=1.0, top_k=None, seed=4)
    assert texts == again and texts != other
    assert texts[0] != texts[1]  # the second sample continues the generator, it does not restart it
    for text in texts:
        assert len(text) == 4 + 40 and text.startswith("the ") and set(text) <= set(meta["itos"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_top_k_1_is_greedy_decoding_also_past_the_block_size(run_dirs, variant):
    model, meta = sample.load(str(run_dirs[variant]))
    prompt_ids = sample.encode(LONG_PROMPT, meta)
    assert len(prompt_ids) > BLOCK
    [text] = sample.sample(model, meta, LONG_PROMPT, max_new_tokens=BLOCK + 5, top_k=1, seed=0)
    expected = greedy(model, prompt_ids, BLOCK + 5)
    assert text == "".join(meta["itos"][i] for i in expected)
    for temperature in (0.1, 5.0):  # top_k=1 ignores the temperature and the seed
        assert sample.sample(model, meta, LONG_PROMPT, max_new_tokens=BLOCK + 5, temperature=temperature, top_k=1,
                             seed=9) == [text]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_model_sees_only_the_tokens_so_far(run_dirs, variant):
    model, _ = sample.load_model(str(run_dirs[variant] / "ckpt.pt"))
    tokens = torch.randint(0, model.config.vocab_size, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(tokens, torch.zeros_like(tokens))
        changed = tokens.clone()
        changed[:, BLOCK // 2:] = (changed[:, BLOCK // 2:] + 1) % model.config.vocab_size
        changed_logits, _ = model(changed, torch.zeros_like(changed))
        for t in (1, 5, BLOCK // 2, BLOCK):
            last, _ = model(tokens[:, :t])  # the sampling path: last position only
            assert last.shape == (2, 1, model.config.vocab_size)
            torch.testing.assert_close(last[:, 0], full[:, t - 1], atol=1e-5, rtol=1e-5)
    # later tokens changed: earlier positions' logits are the same, later ones are not
    torch.testing.assert_close(changed_logits[:, :BLOCK // 2], full[:, :BLOCK // 2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed_logits[:, BLOCK // 2:], full[:, BLOCK // 2:])


class PaddedVocabModel(torch.nn.Module):
    """Stands in for a GPT-2 model: favours the padding ids past the tokenizer's 50257; records
    the context of every call."""
    config = types.SimpleNamespace(block_size=4, vocab_size=50304)

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def forward(self, idx, targets=None):
        self.seen.append(idx[0].tolist())
        logits = torch.zeros(idx.size(0), 1, self.config.vocab_size)
        logits[..., 50000:] = 10.0
        return logits, None


def test_gpt2_runs_never_draw_padding_ids_and_contexts_are_cropped():
    model = PaddedVocabModel()
    ids = sample.generate(model, torch.tensor([[1, 2]]), 6, top_k=50, generator=torch.Generator().manual_seed(0),
                          vocab_size=50257, kv_cache=False)
    assert ids.shape == (1, 8) and ((ids[0, 2:] >= 50000) & (ids[0, 2:] < 50257)).all()
    ids = ids[0].tolist()
    assert model.seen == [ids[:2], ids[:3], ids[:4], ids[1:5], ids[2:6], ids[3:7]]  # the last block_size


def test_gpt2_prompts_encode_and_decode_offline():
    meta = {"tokenizer": "gpt2", "vocab_size": 50257}
    text = "Hello world! First Citizen: Before we proceed any further, hear me speak."
    ids = sample.encode(text, meta)
    assert ids == [15496, 995, 0, 3274, 22307, 25, 7413, 356, 5120, 597, 2252, 11, 3285, 502, 2740, 13]
    assert sample.encode("<|endoftext|>Hi", meta)[0] == 50256
    assert sample.decode(ids, meta) == text
    assert sample.tokenizer_vocab_size(meta) == 50257


def test_the_default_start_is_a_token_every_run_has(run_dirs):
    model, meta = sample.load(str(run_dirs["res"]))
    assert sample.default_start(meta) == "\n"
    assert sample.default_start({"tokenizer": "gpt2"}) == "<|endoftext|>"
    assert sample.default_start({"tokenizer": "char", "itos": ["a", "b"]}) == "a"
    [text] = sample.sample(model, meta, max_new_tokens=5, seed=1)
    assert text == sample.sample(model, meta, "\n", max_new_tokens=5, seed=1)[0] and text.startswith("\n")


def test_cli_prints_the_samples_and_reads_the_prompt_from_a_file(run_dirs, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(LONG_PROMPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outputs = []
    for start in (f"FILE:{prompt}", LONG_PROMPT):
        proc = subprocess.run([sys.executable, os.path.join(REPO_DIR, "sample.py"), f"--out_dir={run_dirs['hc']}",
                               f"--start={start}", "--num_samples=2", "--max_new_tokens=10", "--seed=5",
                               "--device=cpu"], cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    model, meta = sample.load(str(run_dirs["hc"]))
    expected = sample.sample(model, meta, LONG_PROMPT, num_samples=2, max_new_tokens=10, seed=5)
    assert outputs[0] == "".join(f"{text}\n{sample.SEPARATOR}\n" for text in expected)


@pytest.mark.parametrize("flags, words", [
    (["--temperature=0"], ["--temperature must be a finite number > 0, got 0.0"]),
    (["--temperature=-1"], ["--temperature must be a finite number > 0"]),
    (["--temperature=nan"], ["--temperature must be a finite number > 0"]),
    (["--top_k=0"], ["--top_k must be >= 1, got 0"]),
    (["--num_samples=0"], ["--num_samples must be >= 1"]),
    (["--max_new_tokens=0"], ["--max_new_tokens must be >= 1"]),
    (["--top_k=many"], ["argument --top_k: invalid int value: 'many'"]),
    (["--bogus=1"], ["unrecognized arguments: --bogus=1"]),
    (["--device=tpu"], ["unknown device 'tpu'"]),
    (["--start=the king ü€"], ["2 character(s) outside the run's vocabulary", "'ü'", "'€'"]),
    (["--start="], ["the start text is empty"]),
    (["--start=FILE:/nonexistent/prompt.txt"], ["cannot read the start file /nonexistent/prompt.txt"]),
])
def test_bad_flags_and_prompts_are_one_line(run_dirs, flags, words, capsys):
    with pytest.raises(SystemExit) as info:
        sample.main([f"--out_dir={run_dirs['mhc']}", "--device=cpu", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == assert_one_error_line(err, *words, alone=True) + "\n" and err.startswith("error: "), err


def test_missing_checkpoint_or_meta_is_one_line(run_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        sample.main([f"--out_dir={tmp_path / 'nothing'}", "--device=cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == assert_one_error_line(err, alone=True) + "\n", err
    assert err.startswith(f"error: checkpoint not found: {tmp_path / 'nothing'}")

    with pytest.raises(SystemExit) as info:
        sample.main([f"--out_dir={run_dirs['res']}", "--device=cpu", f"--data_dir={tmp_path}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == assert_one_error_line(err, "--data_dir", alone=True) + "\n", err
    assert err.startswith(f"error: missing {tmp_path / 'toy' / 'meta.json'}")
