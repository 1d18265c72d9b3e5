"""The ``hpf`` command: ``hpf train`` (the main job), ``prepare``, ``plan``, ``simulate``, ``calibrate``, and
``eval``, ``export`` and ``generate`` of a trained checkpoint.

One module per subcommand, each with ``add_parser(sub, help)`` and its ``cmd_*``. Only the
named subcommand's module is imported, so ``hpf --help`` answers without importing torch.
An error is one line on stderr; ``--debug`` shows its traceback.

The parser and the entry point live in hpf.cli.command; this file only re-exports."""
from __future__ import annotations

import importlib

from hpf.cli.command import COMMANDS, Parser, build_parser, main

__all__ = ["main", "build_parser", "COMMANDS", "Parser", "parse_mesh", "read_metrics", "TRAIN_DEFAULTS"]

_LAZY = {"parse_mesh": "common", "read_metrics": "train", "TRAIN_DEFAULTS": "train"}  # name -> hpf.cli module


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hpf.cli' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpf.cli.{_LAZY[name]}"), name)
