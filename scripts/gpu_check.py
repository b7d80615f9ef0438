"""Helpers of scripts/gpu_check.sh: random-token data for the training runs, and the final table.

    python scripts/gpu_check.py data OUT_DIR/data            # data/random/{train,val}.bin + meta.json
    python scripts/gpu_check.py table OUT_DIR                # the summary table, as Markdown
"""

import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_common import fmt, markdown_table  # noqa: E402
from checkpoint import load_model  # noqa: E402
from residuals import capture_connections  # noqa: E402

GPT2_TOKENS = 50257
SPLIT_TOKENS = {"train": 4_000_000, "val": 400_000}
VARIANTS = ("res", "hc", "mhc", "mhclite")
COLSUM_SEQUENCES = 4  # of the model's block_size, for the row/column-sum check


def write_random_data(data_dir):
    """Uniform random GPT-2 token ids (seeded) in nanoGPT's format, as dataset 'random'."""
    folder = os.path.join(data_dir, "random")
    os.makedirs(folder, exist_ok=True)
    generator = np.random.default_rng(0)
    for split, count in SPLIT_TOKENS.items():
        generator.integers(0, GPT2_TOKENS, count, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    meta = dict(tokenizer="gpt2", vocab_size=GPT2_TOKENS, source="uniform random ids (scripts/gpu_check.py)",
                train_tokens=SPLIT_TOKENS["train"], val_tokens=SPLIT_TOKENS["val"])
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {folder}")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def training_throughput(run_dir):
    """Median tokens/s and MFU over the logged windows after the first (which compiles), and the
    first step's seconds (torch.compile included)."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    windows = [r for r in records if r.get("tokens_per_s") is not None]
    later = windows[1:] or windows
    tokens = statistics.median(r["tokens_per_s"] for r in later) if later else None
    mfus = [r["mfu"] for r in later if r.get("mfu") is not None]
    first_step = next((r["first_step_s"] for r in records if "first_step_s" in r), None)
    return tokens, statistics.median(mfus) if mfus else None, first_step


def read_json(path):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@torch.no_grad()
def stochasticity_errors(run_dir, device):
    """max |row sum - 1| and max |column sum - 1| of every H_res the trained model makes on a
    random batch, under bf16 autocast as in training (None for res)."""
    model, ckpt = load_model(os.path.join(run_dir, "ckpt.pt"), device)
    if model.config.residual == "res":
        return None, None
    shape = (COLSUM_SEQUENCES, model.config.block_size)
    idx = torch.randint(0, GPT2_TOKENS, shape, generator=torch.Generator().manual_seed(0)).to(device)
    with capture_connections(model) as records, torch.autocast(device.type, dtype=torch.bfloat16):
        model(idx)
    h = torch.cat([r["h_res"].flatten(0, -3) for r in records])
    return (h.sum(-1) - 1).abs().max().item(), (h.sum(-2) - 1).abs().max().item()


def table(out_dir):
    """The results of whichever stages left them in out_dir: training and bench.json per variant,
    then mhclite against res for each speed option."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench = read_json(os.path.join(out_dir, "bench.json")) or {"variants": {}}
    rows = []
    for variant in VARIANTS:
        run_dir = os.path.join(out_dir, f"train-{variant}")
        trained = os.path.isfile(os.path.join(run_dir, "done"))
        tokens, mfu, first_step = training_throughput(run_dir) if trained else (None, None, None)
        row_error, col_error = stochasticity_errors(run_dir, device) if trained else (None, None)
        b = bench["variants"].get(variant, {})
        if not trained and not b:
            continue
        peak = b.get("cuda_peak_bytes")
        rows.append([variant, fmt(first_step, ".1f"), fmt(tokens, ",.0f"), fmt(mfu, ".1%"), fmt(b.get("median_ms"), ".1f"),
                     fmt(b.get("time_ratio"), ".2f"), fmt(peak / 2**30 if peak else None, ".1f"),
                     fmt(b.get("cuda_peak_ratio"), ".2f"), fmt(row_error, ".1e"), fmt(col_error, ".1e")])
    header = ["variant", "train first step s", "train tok/s", "train MFU", "bench ms", "x res", "peak GiB",
              "peak x res", "max|rowsum-1|", "max|colsum-1|"]
    print(f"{bench.get('device_name', device.type)}, torch {torch.__version__}; training: compiled steps on random "
          f"tokens (the first step compiles); bench: {bench.get('command', 'not run')}\n")
    print(markdown_table(header, rows))
    options = []
    for name in sorted(os.listdir(out_dir)):
        result = read_json(os.path.join(out_dir, name)) if name.startswith("bench-") and name.endswith(".json") else None
        if result:
            res, lite = result["variants"].get("res", {}), result["variants"].get("mhclite", {})
            peak = lite.get("cuda_peak_bytes")
            options.append([name[len("bench-"):-len(".json")], fmt(res.get("median_ms"), ".1f"),
                            fmt(lite.get("median_ms"), ".1f"), fmt(lite.get("time_ratio"), ".2f"),
                            fmt(peak / 2**30 if peak else None, ".1f")])
    if options:
        print(f"\n{markdown_table(['option', 'res ms', 'mhclite ms', 'mhclite x res', 'mhclite peak GiB'], options)}")


def main(argv):
    if len(argv) != 2 or argv[0] not in ("data", "table"):
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    write_random_data(argv[1]) if argv[0] == "data" else table(argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
