"""Export a checkpoint as a Hugging Face transformers model folder.

    python export_hf.py --out_dir=out/openwebtext-M-mhclite-s1337 --export_dir=exports/openwebtext-M-mhclite
    python export_hf.py --out_dir=out/demo/mhclite --export_dir=exports/demo-mhclite --force

The folder holds config.json, model.safetensors (fp32 weights; mhclite's permutation sets are the
`perms` buffers; kromhc's are derived from n), the run's tokenizer (GPT-2 BPE from the offline files,
or the run's characters) and our modeling code: hf/*.py with residuals.py and authors.py beside it, so
it is self-contained. It loads with
AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) and
AutoTokenizer.from_pretrained(folder); lm-evaluation-harness runs it as `--model hf`. A folder
that exists and is not empty is an error, unless it holds an earlier export and --force is given
(then it is replaced). Bad input is one `error:` line, exit 2.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys

import authors
import dataprep
import sample
from checkpoint import CheckpointError
from model import Architecture, AuthorsSwitches

REPO_DIR = os.path.dirname(os.path.abspath(__file__))
MODELING_FILES = ("hf/configuration_mhclite_gpt.py", "hf/modeling_mhclite_gpt.py", "residuals.py", "authors.py")
AUTO_MAP = {"AutoConfig": "configuration_mhclite_gpt.MHCLiteGPTConfig",
            "AutoModelForCausalLM": "modeling_mhclite_gpt.MHCLiteGPTForCausalLM"}


class ExportError(Exception):
    """Bad input for the export, as one line."""


def model_settings(config):
    """The settings of a GPTConfig the exported model computes with (hf/configuration_mhclite_gpt.py):
    its architecture, its vocabulary and the authors' switches that act on the forward pass; not
    the execution and training settings (kernels, memory, dropout, init, optimizer)."""
    names = [f.name for f in dataclasses.fields(Architecture)] + ["vocab_size"] + [
        f.name for f in dataclasses.fields(AuthorsSwitches) if f.name not in authors.TRAINING_ONLY]
    return {name: getattr(config, name) for name in names}


def char_tokenizer(itos):
    """A transformers tokenizer with one token per character of the run's vocabulary; characters
    outside it are dropped (as analysis/hellaswag.py does). A newline, where the corpus has one, is
    the end-of-text token that lm-evaluation-harness conditions an empty context on."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(itos)}, unk_token=None))
    known = "".join(f"\\x{{{ord(ch):x}}}" for ch in itos)
    tokenizer.normalizer = normalizers.Replace(Regex(f"[^{known}]"), "")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="\n" if "\n" in itos else None,
                                   model_max_length=None)


def gpt2_tokenizer():
    """GPT-2's BPE from the offline files dataprep puts into tiktoken's cache."""
    from transformers import GPT2Tokenizer

    try:
        dataprep.seed_tiktoken_cache()
    except dataprep.DataPrepError as e:
        raise ExportError(str(e)) from None
    paths = {name: dataprep._cache_path(dataprep.tiktoken_cache_dir(), url)
             for url, (name, _) in dataprep.GPT2_FILES.items()}
    vocab = json.loads(paths["encoder.json"].read_text(encoding="utf-8"))
    merge_lines = paths["vocab.bpe"].read_text(encoding="utf-8").splitlines()[1:]  # after the #version line
    return GPT2Tokenizer(vocab=vocab, merges=[tuple(line.split(" ")) for line in merge_lines if line])


def export(out_dir, export_dir, force=False, data_dir=None):
    """Write the export folder of the checkpoint <out_dir>/ckpt.pt (or ckpt.dcp); returns the folder."""
    from safetensors.torch import save_file

    from hf.configuration_mhclite_gpt import MHCLiteGPTConfig

    if os.path.isdir(export_dir) and os.listdir(export_dir):
        if not force:
            raise ExportError(f"{export_dir} exists and is not empty; pass --force to overwrite it")
        if not os.path.isfile(os.path.join(export_dir, "config.json")):  # --force never deletes other folders
            raise ExportError(f"{export_dir} is not empty and holds no earlier export (no config.json); "
                              "not replacing it even with --force")
    if os.path.exists(export_dir) and not os.path.isdir(export_dir):
        raise ExportError(f"{export_dir} exists and is not a folder")
    if not os.path.isdir(out_dir):
        raise ExportError(f"no run directory {out_dir}")
    model, meta = sample.load(out_dir, "cpu", data_dir)
    settings = model_settings(model.config)
    tokens = dict(bos_token_id=dataprep.EOT, eos_token_id=dataprep.EOT) if meta["tokenizer"] == "gpt2" else {}
    config = MHCLiteGPTConfig(**settings, **tokens, auto_map=AUTO_MAP, architectures=["MHCLiteGPTForCausalLM"])
    tokenizer = gpt2_tokenizer() if meta["tokenizer"] == "gpt2" else char_tokenizer(meta["itos"])
    tokenizer.model_max_length = model.config.block_size

    if force and os.path.isdir(export_dir):
        shutil.rmtree(export_dir)
    os.makedirs(export_dir, exist_ok=True)
    config.save_pretrained(export_dir)
    # lm_head.weight is the token embedding (tied); transformers ties it again on load
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    save_file(state, os.path.join(export_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(export_dir)
    for path in MODELING_FILES:
        with open(os.path.join(REPO_DIR, path), encoding="utf-8") as f:
            code = f.read()
        # transformers loads remote code as a package: files in the folder import each other relatively
        code = code.replace("\nfrom residuals import", "\nfrom .residuals import")
        with open(os.path.join(export_dir, os.path.basename(path)), "w", encoding="utf-8") as f:
            f.write(code)
    return export_dir


def main(argv=None):
    p = sample.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True, help="run directory holding ckpt.pt")
    p.add_argument("--export_dir", required=True, help="folder to write (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --export_dir")
    p.add_argument("--data_dir", default=None, help="folder holding <dataset>/meta.json (default: the run's)")
    args = p.parse_args(argv)
    try:
        folder = export(args.out_dir, args.export_dir, args.force, args.data_dir)
    except (ExportError, CheckpointError, sample.SampleError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {args.out_dir} to {folder}")


if __name__ == "__main__":
    main()
