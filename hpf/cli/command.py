"""The ``hpf`` parser and entry point: builds only the named subcommand's parser (so ``hpf --help``
imports no torch), runs it, and turns any error into one line on stderr (``--debug``: the traceback)."""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

# name -> the one-line help ``hpf --help`` shows (the module hpf.cli.<name> builds the rest)
COMMANDS = {
    "train": "train a model on local processes or under torchrun (the main job)",
    "prepare": "tokenize local text files into a token folder for hpf train --data",
    "plan": "print per-rank memory and communication for any config and mesh",
    "simulate": "predict step time and exposed communication at any scale (no processes)",
    "calibrate": "measure this machine for hpf simulate --hardware FILE (about 3 minutes)",
    "eval": "the held-out loss of a checkpoint on a token folder",
    "export": "write a checkpoint as a transformers model (llama)",
    "generate": "greedy text from a checkpoint (gpt, llama)",
    "store": "host the store of an elastic job whose members run under torchrun",
}
SHARED_MODULES = {"eval": "use", "export": "use", "generate": "use", "store": "elastic_run"}  # commands that share a module: add_<name>_parser


class CliError(Exception):
    """A mistake in the command line or a missing optional part; printed as one line."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage block is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> Parser:
    """The ``hpf`` parser; only ``command``'s subparser is built in full (the others are names)."""
    from hpf import __version__

    parser = Parser(prog="hpf", description="hpf: fully sharded training of pure-function models on PyTorch. "
                                            "Run `hpf COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"hpf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}",
                                parser_class=Parser)
    for name, help_ in COMMANDS.items():
        if name == command:
            module = importlib.import_module(f"hpf.cli.{SHARED_MODULES.get(name, name)}")
            full = getattr(module, f"add_{name}_parser", getattr(module, "add_parser", None))(sub, help_)
            full.add_argument("--debug", action="store_true",
                              help="on an error, print its full traceback (hpf train also keeps it in <out>/error.log)")
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    from hpf.errors import NonFiniteError
    from hpf.launcher import RankError, Terminated, rank

    args.log_dir = None  # a command that has a run folder sets it: tracebacks go to <log_dir>/error.log
    kept = False  # whether a traceback was kept for this error
    try:
        return args.run(args)
    except KeyboardInterrupt:  # on its own line, not after a progress line redrawn in place
        print(("\n" if sys.stdout.isatty() else "") + "hpf: interrupted" + _resume_hint(args.log_dir), file=sys.stderr)
        return 130
    except Terminated:  # SIGTERM to hpf.launch's process: the ranks were stopped and cleaned up
        print("hpf: terminated (SIGTERM): the ranks were stopped", file=sys.stderr)
        return 143
    except RankError as e:  # the rank's traceback goes to the log, its last line to the user (first: a
        code, line = 1, (f"rank {e.rank} failed: {_last_line(e.child_traceback or str(e))}" if e.rank is not None
                         else str(e).removeprefix("hpf.launch: "))  # rank's ValueError is a RankError too)
        kept = bool(e.child_traceback) and _keep(args, e.child_traceback)
    except (CliError, ValueError) as e:  # a wrong argument; hpf's SpecError and MeshError are ValueErrors
        if args.debug:
            raise
        code, line = 2, str(e)
    except NonFiniteError as e:  # a diverged run: the message says what to do
        code, line = 1, str(e)
    except Exception as e:  # noqa: BLE001 -- anything else: one line, the traceback kept
        code, line = 1, f"{type(e).__name__}: {e}"
        kept = _keep(args, traceback.format_exc())
    if rank() == 0 or code == 1:  # torchrun: every rank checks the same arguments, so one line, not one each
        where = ""
        if kept and not args.debug:
            where = (f" (traceback: {Path(args.log_dir) / 'error.log'})" if args.log_dir
                     else " (--debug shows the traceback)")
        print(f"hpf: error: {' '.join(line.split())}{where}", file=sys.stderr)
    return code


def _resume_hint(run: Path | None) -> str:
    """How an interrupted hpf train goes on (``run``: its run folder, None for other commands)."""
    if run is None:
        return ""
    from hpf import checkpoint

    newest = checkpoint.latest(Path(run) / "checkpoints")
    if newest is None:
        return "; it saved no checkpoint (--save-every N saves them), so a rerun starts again"
    return f"; go on from {newest.name} with: hpf train --out {run} --resume"


def _keep(args, text: str) -> bool:
    """The traceback of a failure: shown with --debug, written to the run folder's error.log."""
    if args.debug:
        print(text, file=sys.stderr)
    if args.log_dir:
        try:
            (Path(args.log_dir) / "error.log").write_text(text)
        except OSError:
            args.log_dir = None
    return True


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no message"
