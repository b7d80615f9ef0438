"""Zero-shot HellaSwag of a run's checkpoint, as lm-evaluation-harness's `hellaswag` task scores it.

    python analysis/hellaswag.py --out_dir=out/openwebtext-M-mhclite-s1337 --device=cuda
    python analysis/hellaswag.py --out_dir=out/demo/mhclite --data=hellaswag_val.jsonl --limit=500

Items come from Hugging Face datasets (`Rowan/hellaswag`, validation split: 10,042 items) or a
local .json/.jsonl/.parquet file with its fields (activity_label, ctx_a, ctx_b, endings, label).
Each item is the context "<activity_label>: <ctx_a> <Ctx_b>" and four endings, cleaned as the
harness cleans them; an ending's score is the summed log-likelihood of " <ending>" after the
context (tokenised together, the context left-truncated to block_size). acc: the highest sum is
the gold ending; acc_norm: the highest sum per character of the ending. Standard errors are the
sample standard deviation over sqrt(items). The run's tokenizer encodes (GPT-2 BPE or characters;
characters outside a char run's vocabulary are dropped and counted). Runs trained in bf16 score
under bf16 autocast on CUDA. Writes <out_dir>/hellaswag.json; bad input is one `error:` line.
"""
import argparse
import json
import math
import os
import re
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import dataprep
import sample
from checkpoint import CheckpointError, find_checkpoint
from sample import load_model

DEFAULT_SOURCE = "Rowan/hellaswag"
SPLIT = "validation"
FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
RESULTS_FILE = "hellaswag.json"


class HellaSwagError(Exception):
    """Bad input for scoring (run, data source), as one line."""


def clean(text):
    """The harness's cleaning of WikiHow artifacts: [title] starts a sentence, other bracketed
    markers go, double spaces become single."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def prompt_and_endings(item):
    """(context, endings, gold index) of one dataset item."""
    context = item["ctx_a"] + " " + item["ctx_b"].capitalize()
    return clean(item["activity_label"] + ": " + context), [clean(e) for e in item["endings"]], int(item["label"])


def read_file(path):
    """The items (dicts) of a .jsonl file, a .json file (a list of items, or JSON lines) or a .parquet file."""
    if not os.path.isfile(path):
        raise HellaSwagError(f"no data file {path}")
    try:
        if path.lower().endswith(".parquet"):
            import pyarrow.parquet
            return pyarrow.parquet.read_table(path).to_pylist()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.lower().endswith(".json") and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError) as e:  # pyarrow's errors are ValueErrors or OSErrors
        raise HellaSwagError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def read_hub(name):
    """The validation split of a Hugging Face dataset, as a list of dicts."""
    import datasets
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(name, split=SPLIT).to_list()
    except Exception as e:  # datasets raises many types (offline, unknown name, no such split); one line here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HellaSwagError(f"cannot load the {SPLIT} split of {name}: {first}") from None


def read_items(source, limit=None):
    """(context, endings, gold) of each item of a local file (by its extension) or a Hugging Face
    dataset, the first `limit` only when given."""
    local = os.path.splitext(source)[1].lower() in FILE_FORMATS
    items = read_file(source) if local else read_hub(source)
    items = items[:limit] if limit is not None else items
    if not items:
        raise HellaSwagError(f"{source} has no items")
    parsed = []
    for i, item in enumerate(items):
        missing = [field for field in FIELDS if not isinstance(item, dict) or field not in item]
        if missing:
            raise HellaSwagError(f"{source}: item {i} lacks the field(s) {', '.join(missing)}; HellaSwag items "
                                 f"need {', '.join(FIELDS)}")
        try:
            context, endings, gold = prompt_and_endings(item)
            if not endings or not 0 <= gold < len(endings):
                raise ValueError(f"label {gold} for {len(endings)} endings")
        except (TypeError, ValueError, AttributeError) as e:
            raise HellaSwagError(f"{source}: item {i} is not a HellaSwag item ({e})") from None
        parsed.append((context, endings, gold))
    return parsed


class Encoder:
    """The run's tokenizer; a char vocabulary drops the characters it has no token for."""

    def __init__(self, meta):
        self.meta = meta
        if meta["tokenizer"] == "gpt2":
            try:
                self.gpt2 = dataprep.gpt2_encoding()
            except dataprep.DataPrepError as e:
                raise HellaSwagError(str(e)) from None
        else:
            self.stoi = {ch: i for i, ch in enumerate(meta["itos"])}

    def __call__(self, text):
        if self.meta["tokenizer"] == "gpt2":
            return self.gpt2.encode_ordinary(text)
        return [self.stoi[ch] for ch in text if ch in self.stoi]

    def unknown_characters(self, text):
        return 0 if self.meta["tokenizer"] == "gpt2" else sum(ch not in self.stoi for ch in text)


def request_tokens(encode, context, continuation):
    """(context ids, continuation ids) as the harness splits them: trailing spaces of the context
    move to the continuation, the pair is encoded whole, and the continuation is what follows the
    context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_ids = encode(context + continuation), encode(context)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def loglikelihoods(model, requests, batch_size=32, autocast_dtype=None, progress=True):
    """Summed log-probability of each request's continuation ids after its context ids; the
    model sees the last block_size + 1 tokens but one (the harness's truncation)."""
    device = next(model.parameters()).device
    block_size = model.config.block_size
    inputs = [(context + continuation)[-(block_size + 1):][:-1] for context, continuation in requests]
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))  # similar lengths share a batch
    scores = [0.0] * len(requests)
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="hellaswag", unit="batch", disable=not progress):
        width = len(inputs[batch[0]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):  # right padding: causal attention never reads it
            ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits, _ = model(ids, torch.zeros_like(ids))  # targets given: logits at every position
        log_probs = F.log_softmax(logits.float(), dim=-1)
        for row, i in enumerate(batch):
            continuation = requests[i][1]
            end = len(inputs[i])
            targets = torch.tensor(continuation, device=device)
            picked = log_probs[row, end - len(continuation):end].gather(-1, targets[:, None])
            scores[i] = picked.sum().item()
    return scores


def mean_and_stderr(values):
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance) / math.sqrt(len(values))


def first_argmax(values):
    return max(range(len(values)), key=lambda i: (values[i], -i))


def score(model, meta, items, batch_size=32, autocast_dtype=None, progress=True):
    """The results dict: acc, acc_norm, their standard errors, items, and each item's choices."""
    encode = Encoder(meta)
    requests = [request_tokens(encode, context, " " + ending) for context, endings, _ in items for ending in endings]
    lls = loglikelihoods(model, requests, batch_size, autocast_dtype, progress)
    dropped = sum(encode.unknown_characters(context + "".join(endings)) for context, endings, _ in items)
    per_item, start = [], 0
    for context, endings, gold in items:
        item_lls = lls[start:start + len(endings)]
        start += len(endings)
        normalised = [ll / len(ending) for ll, ending in zip(item_lls, endings)]
        per_item.append(dict(gold=gold, choice=first_argmax(item_lls), choice_norm=first_argmax(normalised),
                             loglikelihoods=item_lls))
    acc, acc_stderr = mean_and_stderr([float(p["choice"] == p["gold"]) for p in per_item])
    acc_norm, acc_norm_stderr = mean_and_stderr([float(p["choice_norm"] == p["gold"]) for p in per_item])
    return dict(task="hellaswag", acc=acc, acc_stderr=acc_stderr, acc_norm=acc_norm, acc_norm_stderr=acc_norm_stderr,
                items=len(per_item), dropped_characters=dropped, per_item=per_item)


def summary(results):
    """acc and acc_norm with their standard errors, one line."""
    def with_stderr(key):
        stderr = results[f"{key}_stderr"]
        return f"{key} {results[key]:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")
    return f"{with_stderr('acc')}, {with_stderr('acc_norm')}"


def run_autocast_dtype(ckpt, device):
    """bf16 autocast on CUDA for runs trained in bf16 (--dtype=bfloat16, or auto, which train.py
    resolves to bf16 on CUDA); fp32 otherwise."""
    return torch.bfloat16 if ckpt["config"].get("dtype") in ("bfloat16", "auto") and device.startswith("cuda") else None


def read_results(run_dir):
    """The run's hellaswag.json, or None when it has none."""
    path = os.path.join(run_dir, RESULTS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def downstream_markdown(runs, digits=3):
    """Markdown: acc and acc_norm per variant (rows, as the loss table's) and dataset/size (columns),
    mean ± std over the seeds that have results, and how many items they scored; "" when no run has
    results."""
    from analysis.common import VARIANT_NAMES, group_label, group_runs
    from analysis.loss_table import cell_text, row_key

    cells, rows, items = {}, [], set()
    columns = list(group_runs(runs))
    for group, by_variant in group_runs(runs).items():
        for variant, variant_runs in by_variant.items():
            for run in variant_runs:
                results = read_results(run.path)
                if results is None:
                    continue
                row = row_key(variant, run.settings)
                rows.append(row)
                items.add(results["items"])
                for metric in ("acc", "acc_norm"):
                    cells.setdefault((row, group, metric), []).append(100 * results[metric])
    if not rows:
        return ""
    rows = list(dict.fromkeys(rows))
    columns = [c for c in columns if any((r, c, "acc") in cells for r in rows)]
    header = ["Variant"] + [f"{group_label(c)} {m}" for c in columns for m in ("acc", "acc_norm")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        variant, _, settings = row.partition(" ")
        name = " ".join(filter(None, (VARIANT_NAMES[variant], settings)))
        texts = [cell_text(cells.get((row, c, m), []), digits - 2) for c in columns for m in ("acc", "acc_norm")]
        lines.append("| " + " | ".join([name] + texts) + " |")
    counts = ", ".join(str(n) for n in sorted(items))
    return ("\n".join(lines) + f"\n\nZero-shot HellaSwag accuracy in % (analysis/hellaswag.py, lm-evaluation-harness's "
            f"`acc` and `acc_norm`), mean ± std over seeds; items scored per run: {counts}.\n")


def main(argv=None):
    p = sample.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True, help="run directory holding ckpt.pt; results go there")
    p.add_argument("--data", default=DEFAULT_SOURCE, help="a Hugging Face dataset name, or a local .json, "
                   ".jsonl or .parquet file of HellaSwag items")
    p.add_argument("--limit", type=int, default=None, help="score the first N items only")
    p.add_argument("--batch_size", type=int, default=32, help="sequences (item x ending) per forward")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--data_dir", default=None, help="folder holding <dataset>/meta.json (default: the run's)")
    args = p.parse_args(argv)
    try:
        if args.limit is not None and args.limit < 1:
            raise HellaSwagError(f"--limit must be >= 1, got {args.limit}")
        if args.batch_size < 1:
            raise HellaSwagError(f"--batch_size must be >= 1, got {args.batch_size}")
        if not os.path.isdir(args.out_dir):
            raise HellaSwagError(f"no run directory {args.out_dir}")
        device = sample.resolve_device(args.device)
        model, ckpt = load_model(find_checkpoint(args.out_dir), device)
        meta = sample.read_meta(ckpt, args.data_dir)
        items = read_items(args.data, args.limit)
        results = score(model, meta, items, args.batch_size, run_autocast_dtype(ckpt, device))
    except (HellaSwagError, CheckpointError, sample.SampleError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    results.update(source=args.data, limit=args.limit)
    path = os.path.join(args.out_dir, RESULTS_FILE)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"hellaswag ({results['items']} items): {summary(results)} -> {path}")


if __name__ == "__main__":
    main()
