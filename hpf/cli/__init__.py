"""The ``hpf`` command: ``hpf train`` (the main job), ``hpf prepare``, ``hpf plan``, ``hpf bench`` and ``hpf simulate``.

One module per subcommand; each has ``add_parser`` and its ``cmd_*``. Errors are one line."""
from __future__ import annotations

import os
import sys

from hpf.checks import NonFiniteError
from hpf.cli import bench, plan, prepare, simulate, train
from hpf.cli.bench import parse_ratio_line
from hpf.cli.common import CliError, Parser, job_parsers, parse_mesh
from hpf.cli.train import TRAIN_DEFAULTS, read_metrics
from hpf.launcher import RankError, rank
from hpf.plots import save_plots

__all__ = ["main", "parse_mesh", "read_metrics", "save_plots", "parse_ratio_line", "TRAIN_DEFAULTS", "build_parser"]


def build_parser() -> Parser:
    job, optimizer = job_parsers()
    parser = Parser(prog="hpf", description="hpf: fully sharded training of pure-function models on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,prepare,plan,bench,simulate}")
    train.add_parser(sub, job, optimizer)
    prepare.add_parser(sub)
    plan.add_parser(sub, job, optimizer)
    bench.add_parser(sub)
    simulate.add_parser(sub, job)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CliError, ValueError) as e:  # hpf's SpecError and MeshError are ValueErrors
        if os.environ.get("HPF_TRACEBACK"):
            raise
        if rank() == 0:  # under torchrun every rank checks the same arguments: one line, not one each
            print(f"hpf: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # under torchrun: this process is the rank that raised
        print(f"hpf: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except RankError as e:  # a rank's traceback (when it sent one), then one line
        diverged = "NonFiniteError" in _last_line(e)  # a diverged run is one line, not a traceback
        if e.child_traceback and not diverged:
            print(e.child_traceback, file=sys.stderr)
        if e.rank is None:  # the launch timed out: no rank to blame
            what = f"{' '.join(str(e).removeprefix('hpf.launch: ').split())} (--timeout)"
        else:
            what = f"rank {e.rank} failed: {_last_line(e)}"
        print(f"hpf: error: {what}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hpf: interrupted", file=sys.stderr)
        return 130


def _last_line(e: RankError) -> str:
    lines = (e.child_traceback or str(e)).strip().splitlines()
    return lines[-1] if lines else "no message"


