"""The KV cache (sample.KVCache, GPT.forward(kv_cache=...)): cached sampling computes the same
logits and the same greedy tokens as recomputing the cropped context for every token, for every
variant, also past the block size."""
import pytest
import torch

import sample
from benchmarks import kv_cache
from conftest import random_model
from sample import KVCache

VARIANTS = ("res", "hc", "mhc", "mhclite")
BLOCK = 16  # random_model's block_size

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_greedy_sampling_equals_uncached_past_the_block_size(variant):
    model = random_model(variant)
    prompt = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    new_tokens = 2 * BLOCK  # prefill, token-by-token steps, then crops with rebuilt caches
    cached = sample.generate(model, prompt, new_tokens, top_k=1, kv_cache=True)
    uncached = sample.generate(model, prompt, new_tokens, top_k=1, kv_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 5:].tolist())) > 3  # a real sequence, not one repeated token


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_cached_step_gives_the_logits_of_the_full_forward(variant):
    model = random_model(variant)
    tokens = torch.randint(0, 48, (2, BLOCK), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(tokens, torch.zeros_like(tokens))  # targets given: logits at every position
        cache = KVCache(model.config.n_layer)
        steps = [model(tokens[:, :4], kv_cache=cache)[0]]  # a prompt of 4, then chunks of 1, 3 and 1
        for start, stop in ((4, 5), (5, 8), (8, 9)):
            steps.append(model(tokens[:, start:stop], kv_cache=cache)[0])
            assert len(cache) == stop
    for logits, position in zip(steps, (3, 4, 7, 8)):
        torch.testing.assert_close(logits[:, -1], full[:, position], rtol=0, atol=1e-5)


def test_mhclite_with_sampled_permutations_and_the_authors_settings():
    model = random_model("mhclite", n_streams=8, mhclite_perms=12, final_norm="per_stream", rms_eps=0.0)
    prompt = torch.randint(0, 48, (1, 3), generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample.generate(model, prompt, BLOCK + 4, top_k=1, kv_cache=True),
                       sample.generate(model, prompt, BLOCK + 4, top_k=1, kv_cache=False))


def test_the_cache_holds_at_most_block_size_tokens():
    model = random_model("res")
    cache = KVCache(model.config.n_layer)
    with torch.no_grad():
        model(torch.zeros(1, BLOCK - 1, dtype=torch.long), kv_cache=cache)
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="exceeds block_size"):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


def test_seeded_sampling_with_the_cache_draws_what_it_draws_without():
    model = random_model("mhc")
    prompt = torch.randint(0, 48, (1, 3), generator=torch.Generator().manual_seed(4))
    draws = [sample.generate(model, prompt, BLOCK + 6, temperature=1.0, top_k=None, kv_cache=kv_cache,
                             generator=torch.Generator().manual_seed(5)) for kv_cache in (True, False)]
    assert torch.equal(*draws)


def test_sample_py_prints_the_same_text_with_and_without_the_cache(hellaswag_runs, capsys):
    run = f"--out_dir={hellaswag_runs['mhc']}"
    texts = []
    for extra in ([], ["--no_kv_cache"]):
        sample.main([run, "--start=Fishing: An", "--num_samples=2", "--max_new_tokens=120", "--temperature=1.0",
                     "--device=cpu", *extra])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 2 * 120


def test_kv_cache_speed_table_has_a_row_per_size_and_variant(capsys):
    """python -m benchmarks.kv_cache: tokens/s with and without the cache, side by side (not checked:
    nothing here is timed)."""
    kv_cache.main(["--sizes", "tiny", "--residuals", "res", "mhclite", "--block_size", "16", "--prompt_tokens", "4",
                   "--new_tokens", "3"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [(size.strip(), variant.strip()) for size, variant, *_ in rows] == [("tiny", "res"), ("tiny", "mhclite")]
    assert all(float(uncached) > 0 and float(cached) > 0 for _, _, uncached, cached, _ in rows)
