"""Prepare OpenWebText (Skylion007/openwebtext) as GPT-2 BPE train.bin / val.bin + meta.json.

python prepare_openwebtext.py                      # from the Hugging Face hub (sizes: docs/data.md)
python prepare_openwebtext.py --data_files a.jsonl # offline, from local files with a 'text' column
"""

import sys
from pathlib import Path

import dataprep


def main(argv=None):
    parser = dataprep.make_parser(__doc__, out_name="openwebtext", hub_name="Skylion007/openwebtext",
                                  hub_config=None, val_fraction=0.0005)
    args = parser.parse_args(argv)
    try:
        meta = dataprep.prepare_hf(args)
    except dataprep.DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    dataprep.report(meta, Path(args.data_dir) / args.out_name)


if __name__ == "__main__":
    main()
