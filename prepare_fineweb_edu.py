"""Prepare FineWeb-Edu (HuggingFaceFW/fineweb-edu, sample-10BT) as GPT-2 BPE train.bin / val.bin + meta.json.

python prepare_fineweb_edu.py                      # from the Hugging Face hub (sizes: docs/data.md)
python prepare_fineweb_edu.py --data_files a.jsonl # offline, from local files with a 'text' column
"""

import sys
from pathlib import Path

import dataprep


def main(argv=None):
    parser = dataprep.make_parser(__doc__, out_name="fineweb_edu", hub_name="HuggingFaceFW/fineweb-edu",
                                  hub_config="sample-10BT", val_fraction=0.005)
    args = parser.parse_args(argv)
    try:
        meta = dataprep.prepare_hf(args)
    except dataprep.DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    dataprep.report(meta, Path(args.data_dir) / args.out_name)


if __name__ == "__main__":
    main()
