"""Sampling speed with and without the KV cache, side by side in one process: tokens/s of
sample.generate on a seeded random model of each size and variant (speed does not depend on the
weights), greedy, one sequence, after one warm-up call.

    OMP_NUM_THREADS=1 python -m benchmarks.kv_cache --sizes tiny S --new_tokens 200
"""
import argparse
import time

import torch

import sample
from model import GPT, GPTConfig, model_shape


def tokens_per_s(model, prompt, new_tokens, kv_cache):
    sample.generate(model, prompt, 4, top_k=1, kv_cache=kv_cache)  # warm-up
    start = time.perf_counter()
    sample.generate(model, prompt, new_tokens, top_k=1, kv_cache=kv_cache)
    return new_tokens / (time.perf_counter() - start)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "S"], help="model sizes (model.SIZES)")
    p.add_argument("--residuals", nargs="+", default=["res", "hc", "mhc", "mhclite"], help="variants to time")
    p.add_argument("--block_size", type=int, default=256, help="the models' context length")
    p.add_argument("--prompt_tokens", type=int, default=16, help="tokens of the random prompt")
    p.add_argument("--new_tokens", type=int, default=200, help="past block_size - prompt_tokens the cache is rebuilt")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), block_size {args.block_size}, "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, fp32 CPU")
    print("| size | variant | tokens/s without cache | tokens/s with cache | speed-up |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        for residual in args.residuals:
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=args.block_size, residual=residual, **model_shape(size))).eval()
            prompt = torch.randint(0, 50257, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
            uncached = tokens_per_s(model, prompt, args.new_tokens, kv_cache=False)
            cached = tokens_per_s(model, prompt, args.new_tokens, kv_cache=True)
            print(f"| {size} | {residual} | {uncached:.1f} | {cached:.1f} | {cached / uncached:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
