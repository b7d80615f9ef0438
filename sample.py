"""Generate text from a trained checkpoint of any residual variant (nanoGPT's sample.py).

    python sample.py --out_dir=out/demo/mhclite --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out/openwebtext-M-mhc-s1337 --start=FILE:prompt.txt --device=cuda

Loads <out_dir>/ckpt.pt (or a sharded run's ckpt.dcp) with load_model, verified against its digests,
and reads the run's own tokenizer from the meta.json of its dataset, <data_dir>/<dataset>/ from the
checkpoint's config (--data_dir points elsewhere): characters (meta.json's itos) or GPT-2 BPE
(offline, through dataprep). Sampling is autoregressive: the context is cropped to the model's block_size, the model gives the logits of
the last position (with a KV cache it computes the new token only; --no_kv_cache recomputes the
whole context), they are divided by --temperature and cut to the --top_k largest (a value at
least the vocabulary size keeps all; 1 is greedy decoding), and the next token is drawn with a
generator seeded by --seed, so the same flags give the same text. Samples are printed one after
the other, each followed by a line of dashes. Bad input is one `error:` line and exit code 2.
"""

import argparse
import json
import math
import os
import re
import sys

import torch
import torch.nn.functional as F

import dataprep
from checkpoint import CheckpointError, find_checkpoint, load_weights, model_args, read_checkpoint
from model import GPT, GPTConfig

SEPARATOR = "-" * 15
FILE_PREFIX = "FILE:"
TOKENIZERS = ("char", "gpt2")


class SampleError(Exception):
    """Bad input for sampling (flags, prompt, tokenizer files), as one line."""


def read_meta(ckpt, data_dir=None):
    """The run's meta.json: <data_dir or the run's data_dir>/<dataset>/meta.json."""
    config = ckpt["config"]
    path = os.path.join(data_dir or config["data_dir"], config["dataset"], "meta.json")
    if not os.path.isfile(path):
        raise SampleError(f"missing {path}, which names the run's tokenizer; pass --data_dir=<folder holding "
                          f"{config['dataset']}/meta.json>")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        tokenizer = meta["tokenizer"]
        if tokenizer == "char" and not isinstance(meta["itos"], list):
            raise TypeError("itos is not a list")
    except (ValueError, KeyError, TypeError) as e:
        raise SampleError(f"{path} is not a valid meta.json ({type(e).__name__}: {e})") from None
    if tokenizer not in TOKENIZERS:
        raise SampleError(f"{path}: unknown tokenizer '{tokenizer}'; valid: {', '.join(TOKENIZERS)}")
    return meta


def default_start(meta):
    """A prompt every run can take: GPT-2's end-of-text (a document starts after it), else a
    newline, or the vocabulary's first character where the corpus has no newline."""
    if meta["tokenizer"] == "gpt2":
        return "<|endoftext|>"
    return "\n" if "\n" in meta["itos"] else meta["itos"][0]


def tokenizer_vocab_size(meta):
    """Ids the tokenizer can decode; GPT-2's model vocabulary is padded past them."""
    return len(meta["itos"]) if meta["tokenizer"] == "char" else dataprep.GPT2_VOCAB_SIZE


def encode(text, meta):
    """Token ids of text under the run's tokenizer; GPT-2 text may contain <|endoftext|>."""
    if not text:
        raise SampleError("the start text is empty; the model needs at least one token to continue")
    if meta["tokenizer"] == "gpt2":
        try:
            return dataprep.gpt2_encoding().encode(text, allowed_special={"<|endoftext|>"})
        except dataprep.DataPrepError as e:
            raise SampleError(str(e)) from None
    stoi = {ch: i for i, ch in enumerate(meta["itos"])}
    unknown = sorted(set(text) - set(stoi))
    if unknown:
        shown = ", ".join(repr(ch) for ch in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        raise SampleError(f"the start text has {len(unknown)} character(s) outside the run's vocabulary: {shown}")
    return [stoi[ch] for ch in text]


def decode(ids, meta):
    try:
        return dataprep.decode(ids, meta)
    except dataprep.DataPrepError as e:
        raise SampleError(str(e)) from None


class KVCache:
    """The attention keys and values of the tokens a model has seen, for sampling token by token.
    Only attention needs one: the connections, the MLP and the norms act on each token alone.
    Positions are absolute, so the cache holds at most block_size tokens; past that the context
    is cropped and the cache rebuilt from it (see generate)."""

    def __init__(self, n_layer):
        self.layers = [LayerKVCache() for _ in range(n_layer)]

    def __len__(self):
        return self.layers[0].length


class LayerKVCache:
    """One attention layer's keys and values, (B, n_head, tokens, head_dim) each."""

    def __init__(self):
        self.keys = self.values = None

    @property
    def length(self):
        return 0 if self.keys is None else self.keys.size(2)

    def append(self, k, v):
        """The keys and values of all tokens so far, k and v (the newest tokens') included."""
        if self.keys is not None:
            k, v = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        self.keys, self.values = k, v
        return k, v


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, vocab_size=None,
             kv_cache=True):
    """Continue the token ids idx (B, T) by max_new_tokens sampled tokens; returns (B, T + new).
    The model sees at most its block_size last tokens and returns the last position's logits.
    Only ids below vocab_size are drawn (GPT-2's padding ids decode to nothing). With kv_cache the
    model computes each new token only, on the keys and values of the earlier ones; once the
    context is cropped every position moves, so the cache is rebuilt from the cropped context,
    which gives the logits of the computation without a cache."""
    block_size = model.config.block_size
    cache = None
    for _ in range(max_new_tokens):
        if not kv_cache:
            logits, _ = model(idx[:, -block_size:])
        elif cache is None or idx.size(1) > block_size:
            cache = KVCache(model.config.n_layer)
            logits, _ = model(idx[:, -block_size:], kv_cache=cache)
        else:
            logits, _ = model(idx[:, -1:], kv_cache=cache)
        logits = logits[:, -1, :vocab_size].float() / temperature
        if top_k is not None:
            kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth_largest, -math.inf)
        next_ids = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, next_ids), dim=1)
    return idx


def check_settings(num_samples, max_new_tokens, temperature, top_k):
    if num_samples < 1:
        raise SampleError(f"--num_samples must be >= 1, got {num_samples}")
    if max_new_tokens < 1:
        raise SampleError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise SampleError(f"--temperature must be a finite number > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise SampleError(f"--top_k must be >= 1, got {top_k}")


def sample(model, meta, start=None, num_samples=1, max_new_tokens=500, temperature=0.8, top_k=200, seed=1337,
           kv_cache=True):
    """num_samples texts (the start text, default_start(meta) if None, then max_new_tokens new
    tokens), drawn one after the other from one generator seeded with seed."""
    check_settings(num_samples, max_new_tokens, temperature, top_k)
    start = default_start(meta) if start is None else start
    device = next(model.parameters()).device
    prompt = torch.tensor([encode(start, meta)], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    texts = []
    for _ in range(num_samples):
        ids = generate(model, prompt, max_new_tokens, temperature, top_k, generator, tokenizer_vocab_size(meta),
                       kv_cache)
        texts.append(decode(ids[0].tolist(), meta))
    return texts


def load_model(path, device="cpu"):
    """(GPT in eval mode with the checkpoint's weights, the checkpoint's items): the one call that
    tools (sampling, export, analysis) load a trained model with. path: a run folder (its newest
    checkpoint), a ckpt.pt or ckpt.<step>.pt file, or a sharded checkpoint folder (ckpt.dcp), read
    in this one process (its items then hold no weights). Every file is verified against its
    digests before the weights are used."""
    path = find_checkpoint(path)
    ckpt = read_checkpoint(path)
    try:
        model = GPT(GPTConfig(**model_args(ckpt)))
        load_weights(path, ckpt, model)
    except (TypeError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: cannot build the model from it ({reason})") from None
    model.to(device)
    model.eval()
    return model, ckpt


def load(out_dir, device="cpu", data_dir=None):
    """(model in eval mode, the run's meta.json) for the run folder's newest checkpoint: ckpt.pt, or
    the sharded ckpt.dcp of a --parallel=fsdp run."""
    model, ckpt = load_model(out_dir, device)
    return model, read_meta(ckpt, data_dir)


def resolve_device(name):
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise SampleError(f"unknown device '{name}'; valid: auto, cpu, cuda, cuda:N")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SampleError(f"device '{name}' asks for CUDA, which is not available here; use --device=cpu")
    return name


def read_start(start):
    """The prompt: the text itself, or FILE:path for a file's contents (None stays None)."""
    if start is None or not start.startswith(FILE_PREFIX):
        return start
    path = start[len(FILE_PREFIX):]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SampleError(f"cannot read the start file {path}: {getattr(e, 'strerror', None) or e}") from None


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error:` line (no usage block) and exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True, help="run directory holding ckpt.pt")
    p.add_argument("--start", default=None, help="prompt text, or FILE:path to read it from a file (default: a "
                   "newline; <|endoftext|> for GPT-2 runs)")
    p.add_argument("--num_samples", type=int, default=10)
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="> 0; below 1 is more conservative")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens (1: greedy)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--data_dir", default=None, help="folder holding <dataset>/meta.json (default: the run's)")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the whole context for every token")
    args = p.parse_args(argv)
    try:
        check_settings(args.num_samples, args.max_new_tokens, args.temperature, args.top_k)
        start = read_start(args.start)
        model, meta = load(args.out_dir, resolve_device(args.device), args.data_dir)
        texts = sample(model, meta, start, args.num_samples, args.max_new_tokens, args.temperature, args.top_k,
                       args.seed, not args.no_kv_cache)
    except (SampleError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for text in texts:
        print(text)
        print(SEPARATOR)


if __name__ == "__main__":
    main()
