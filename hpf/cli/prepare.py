"""``hpf prepare``: tokenize local text into a token folder for ``hpf train --data`` (hpf.data)."""
from __future__ import annotations

import time
from pathlib import Path

from hpf import data as token_data
from hpf.cli.common import CliError
from hpf.jobspec import positive


def cmd_prepare(args) -> int:
    started = time.perf_counter()
    try:
        meta = token_data.prepare(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                                  glob=args.glob, overwrite=args.overwrite)
    except (OSError, ModuleNotFoundError) as e:
        raise CliError(str(e)) from None
    n = meta["tokens"]
    n_files = len(meta["sources"])
    print(f"hpf prepare: {n_files} file{'s' if n_files != 1 else ''} -> {args.out}: {n['train']:,} train + {n['val']:,} val tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']}, tokenizer {meta['tokenizer']}) "
          f"in {time.perf_counter() - started:.1f} s")
    return 0


def add_parser(sub, help_: str):
    prepare = sub.add_parser(
        "prepare", help=help_,
        description="Tokenize text into train.bin / val.bin (uint16 or uint32 token ids, nanoGPT's layout) "
                    "and meta.json. Folders are searched recursively for files matching --glob. Nothing is "
                    "downloaded. Example: hpf prepare \"$(python3 -c 'import sysconfig; "
                    "print(sysconfig.get_path(\"stdlib\"))')\" --glob '*.py' --out data/stdlib")
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="TEXT_FILES", help="text files or folders")
    prepare.add_argument("--out", type=Path, required=True, metavar="DIR", help="the token folder to write")
    prepare.add_argument("--tokenizer", default="bytes", metavar="PATH",
                         help="'bytes' (vocab 257: bytes + end of document) or a local tokenizer.json "
                              "(needs the tokenizers package: pip install -e '.[hf]') (default: bytes)")
    prepare.add_argument("--val-fraction", type=positive(float), default=0.05, metavar="F",
                         help="share of the tokens held out, taken from the end (default: 0.05)")
    prepare.add_argument("--glob", default="*", metavar="PATTERN",
                         help="which files of a folder to take, e.g. '*.py' (default: all)")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace the token files --out already holds (without it, such a folder is an error)")
    prepare.set_defaults(run=cmd_prepare)
    return prepare
