"""Memory per GPU before booking GPUs: for each size and variant, the parameters, the bytes of
weights + gradients + AdamW state per GPU under DDP and under FSDP2, and the activations autograd
keeps for one sequence, with and without activation checkpointing (--activation_checkpointing).

    python -m benchmarks.memory                  # the table in docs/scaling.md
    python -m benchmarks.memory --check S,M      # and the formula against full-depth counts

Activations are counted on CPU (saved-tensor bytes, step.saved_activation_bytes) and are exactly
affine in the depth L and in the sequence length T (every layer is the same, nothing saved is T x T),
so they are counted on 1- and 2-layer models of the size's width at two short lengths and
extrapolated; --check counts the full-depth model at full length and prints both.
"""

import argparse
import contextlib
import gc
import math
import sys

import torch
from tqdm import tqdm

from benchmarks.step import saved_activation_bytes
from model import GPT, GPT2_PADDED_VOCAB, SIZES, GPTConfig, model_shape
from parallelize import apply_ac
from residuals import RESIDUALS

STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients and AdamW's two moments
SHORT_LENGTHS = (64, 128)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(size, residual, n_layer, block_size, vocab_size):
    shape = dict(model_shape(size), n_layer=n_layer)
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, residual=residual, **shape))


def counted(size, residual, n_layer, length, vocab_size, dtype, checkpointed):
    """Bytes autograd keeps after the forward of one sequence of `length` tokens."""
    model = build(size, residual, n_layer, length, vocab_size)
    if checkpointed:
        apply_ac(model)
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext())
    tokens = torch.randint(vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(0))
    saved = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:], ctx)
    del model
    gc.collect()  # the model sits in reference cycles; free it before the next one is built
    return saved


def activation_formula(size, residual, vocab_size, dtype, checkpointed):
    """bytes(n_layer, length), affine in each, fitted to counts at 1 and 2 layers and two lengths."""
    (t0, t1) = SHORT_LENGTHS
    c = {(n, t): counted(size, residual, n, t, vocab_size, dtype, checkpointed) for n in (1, 2) for t in (t0, t1)}
    per_layer = {t: c[2, t] - c[1, t] for t in (t0, t1)}
    rest = {t: c[1, t] - per_layer[t] for t in (t0, t1)}

    def affine(values, length):
        slope = (values[t1] - values[t0]) / (t1 - t0)
        return values[t0] + slope * (length - t0)

    return lambda n_layer, length: affine(rest, length) + n_layer * affine(per_layer, length)


def parameters(size, residual, vocab_size, block_size):
    with torch.device("meta"):
        return build(size, residual, SIZES[size].n_layer, block_size, vocab_size).get_num_params(
            non_embedding=False)


def one_block_bytes(formula, length):
    """What backward recomputes at a time under activation checkpointing: one layer's saves."""
    return formula(2, length) - formula(1, length)


def gib(value):
    return f"{value / 2**30:.2f}"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", default="S,M,L,XL,7B", help="comma-separated sizes")
    parser.add_argument("--residuals", default="res,hc,mhc,mhclite", help="comma-separated variants")
    parser.add_argument("--block_size", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--vocab_size", type=int, default=GPT2_PADDED_VOCAB, help="the tokenizer's (GPT-2's, padded)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs that FSDP2 shards over")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                        help="autocast dtype of the activations (train.py's on GPU: bfloat16)")
    parser.add_argument("--check", default="", help="sizes whose full-depth, full-length count is printed "
                                                     "next to the formula (float32 and --dtype)")
    args = parser.parse_args(argv)
    args.sizes, args.residuals = args.sizes.split(","), args.residuals.split(",")
    args.check = [s for s in args.check.split(",") if s]
    unknown = [s for s in args.sizes + args.check if s not in SIZES] + [
        r for r in args.residuals if r not in RESIDUALS]
    if unknown:
        parser.error(f"unknown size or residual '{unknown[0]}'")
    if args.block_size < 1 or args.gpus < 1:
        parser.error("--block_size and --gpus must be >= 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_grad_enabled(True)
    rows = []
    jobs = [(s, r) for s in args.sizes for r in args.residuals]
    for size, residual in tqdm(jobs, desc="counting", file=sys.stderr):
        n_layer = SIZES[size].n_layer
        params = parameters(size, residual, args.vocab_size, args.block_size)
        kept = activation_formula(size, residual, args.vocab_size, args.dtype, False)
        checkpointed = activation_formula(size, residual, args.vocab_size, args.dtype, True)
        rows.append([size, residual, f"{params / 1e6:,.0f}M", gib(STATE_BYTES_PER_PARAM * params),
                     gib(STATE_BYTES_PER_PARAM * params / args.gpus), gib(kept(n_layer, args.block_size)),
                     gib(checkpointed(n_layer, args.block_size)),
                     gib(checkpointed(n_layer, args.block_size) + one_block_bytes(kept, args.block_size))])
    header = ["size", "variant", "parameters", "weights+grads+AdamW per GPU, DDP (GiB)",
              f"same, FSDP2 on {args.gpus} GPUs (GiB)", f"activations per sequence, {args.dtype} (GiB)",
              "with activation checkpointing (GiB)", "+ one block recomputed in backward (GiB)"]
    print(f"Sequence of {args.block_size} tokens, vocabulary {args.vocab_size}, activations under "
          f"{args.dtype} autocast, counted on CPU.\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for size in args.check:
        print(f"\nCheck at {size} (full depth, {args.block_size} tokens; counted / formula):\n")
        print("| variant | dtype | checkpointing | counted (MiB) | formula (MiB) |\n|---|---|---|---|---|")
        for residual in args.residuals:
            for dtype in dict.fromkeys(("float32", args.dtype)):
                for ac in (False, True):
                    full = counted(size, residual, SIZES[size].n_layer, args.block_size, args.vocab_size,
                                   dtype, ac)
                    formula = activation_formula(size, residual, args.vocab_size, dtype, ac)
                    predicted = formula(SIZES[size].n_layer, args.block_size)
                    print(f"| {residual} | {dtype} | {'on' if ac else 'off'} | {full / 2**20:.1f} | "
                          f"{predicted / 2**20:.1f} |")
                    if not math.isclose(full, predicted, rel_tol=1e-3):
                        print(f"error: the formula misses the count by more than 0.1% ({size} {residual} "
                              f"{dtype})", file=sys.stderr)
                        sys.exit(1)


if __name__ == "__main__":
    main()
