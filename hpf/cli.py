"""The ``hpf`` command: ``hpf train`` (the main job), ``hpf plan`` and ``hpf bench``.

Every argument is checked in the driver process before any rank starts, so a mistake costs
one line on stderr, not a traceback from four processes.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import hpf
from hpf.launcher import RankError, init_distributed, is_launched, launch, rank, world_size
from hpf.models import gpt
from hpf.optim.dist_muon import muon_plan_state
from hpf.optim.schedules import constant
from hpf.plots import breakdown, save_plots
from hpf.progress import Progress
from hpf.api import STEPS
from hpf.checks import NonFiniteError, finite_or_none
from hpf.device import default_device
from hpf.step import step_plan
from hpf.types import PRECISIONS, MixedPrecision
from hpf.report import PlanReport

__all__ = ["main", "parse_mesh", "read_metrics", "save_plots", "parse_ratio_line"]

DEFAULT_MESH = {"node": 2, "local": 2}  # 2 "hosts" x 2 local ranks: exercises both tiers
# Per config: AdamW lr (also Muon's AdamW fallback), Muon lr, linear warmup steps. Picked so the
# first 10 steps at the default batch fall steadily (small at a flat 0.01 started above ln V and
# oscillated); tiny and small were measured, medium and 1b are GPT-2/3 practice.
TRAIN_DEFAULTS = {"tiny": (1e-2, 0.02, 0), "small": (3e-3, 0.02, 20), "medium": (6e-4, 0.02, 100),
                  "1b": (3e-4, 0.02, 200)}
STEP_METRICS = ("loss", "grad_norm", "step_s", "comm_wait_s", "optimizer_s")  # from shard_step's metrics
RATIO_LINE = re.compile(r"^RATIO\s+(\S+)\s+(\S+)(?:\s+(\S+))?\s*$")
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


class CliError(Exception):
    """A mistake in the command line or a missing optional part; printed as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage block is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------ argument types

def parse_mesh(text: str) -> dict[str, int]:
    """``"node=2,local=2"`` -> ``{"node": 2, "local": 2}`` (outer to inner, as hpf.Mesh takes)."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not name or not size.isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a mesh; write name=size pairs, outer to inner, e.g. node=2,local=2")
        if int(size) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} gives axis {name!r} size {int(size)}; sizes must be >= 1")
        if name in axes:
            raise argparse.ArgumentTypeError(f"{text!r} names axis {name!r} twice")
        axes[name] = int(size)
    return axes


def _axes_list(text: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in text.split(",") if a.strip())
    if not axes:
        raise argparse.ArgumentTypeError("give mesh axis names separated by commas, e.g. node,local")
    return axes


def _positive(kind, least=None):
    """An argparse type: a number > 0 (or >= ``least``)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value <= 0 if least is None else value < least:
            raise argparse.ArgumentTypeError(f"{text!r} must be " + ("positive" if least is None else f">= {least}"))
        return value
    return check


# ------------------------------------------------------------------ the parser

def build_parser() -> argparse.ArgumentParser:
    job = _Parser(add_help=False)
    job.add_argument("--config", choices=sorted(gpt.CONFIGS), default="tiny",
                     help="GPT config from hpf.models.gpt.CONFIGS (default: tiny)")
    job.add_argument("--world-size", type=_positive(int), metavar="N",
                     help="number of ranks; alone it gives a 1-D mesh dp=N (default: 4 as node=2,local=2)")
    job.add_argument("--mesh", type=parse_mesh, metavar="AXES",
                     help="named mesh axes, outer to inner; the last one is the fast tier (default: "
                          "node=2,local=2; under torchrun node=<machines>,local=<ranks per machine>)")
    job.add_argument("--fsdp-axes", type=_axes_list, metavar="AXES",
                     help="axes params are sharded and gathered over, e.g. local (default: all)")
    job.add_argument("--mixed-precision", choices=sorted(PRECISIONS),
                     help="compute dtype, with fp32 master shards and fp32 grad reduction (default: off)")
    job.add_argument("--topology", choices=("two-tier", "flat"), default="two-tier",
                     help="two-tier: fast-tier collectives first (shared memory between local CPU ranks), "
                          "1/fast-size of the bytes over the slow tier, reductions overlapping backward; "
                          "flat: one collective over all ranks (default: two-tier)")
    job.add_argument("--hsdp", action="store_true",
                     help="shard params within the fast tier only and replicate them across the slow tier")
    optimizer = _Parser(add_help=False)  # train and plan (its state and owners), not simulate
    optimizer.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                           help="muon: Muon for weight matrices (one momentum each; owners balanced by "
                                "Newton-Schulz FLOPs), AdamW for embeddings, head and vectors (default: adamw)")

    parser = _Parser(
        prog="hpf", description="hpf: fully sharded training of pure-function models on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,plan,bench,simulate}")

    train = sub.add_parser(
        "train", parents=[job, optimizer], help="train the GPT on local processes (the main job)",
        description="Train the pure-function GPT on local processes (hpf.launch) with synthetic data "
                    "from a fixed random Markov source. Rank 0 shows progress and writes "
                    "<out>/metrics.jsonl, one JSON object per step. Under torchrun "
                    "(torchrun --nproc-per-node 8 -m hpf train ...) each process is one rank.")
    train.add_argument("--steps", type=_positive(int), default=100, help="(default: 100)")
    train.add_argument("--batch-size", type=_positive(int), default=32, metavar="B",
                       help="global batch in sequences, split over the ranks (default: 32)")
    defaults = "; ".join(f"{c} {a:g}/{m:g}, {w} warmup" for c, (a, m, w) in TRAIN_DEFAULTS.items())
    train.add_argument("--lr", type=_positive(float),
                       help=f"peak learning rate (default per config, adamw/muon lr and warmup steps: {defaults}; "
                            "picked so the first 10 steps fall steadily. Muon's AdamW part keeps the adamw default)")
    train.add_argument("--warmup", type=_positive(int, least=0), metavar="STEPS",
                       help="steps of linear lr warmup from 0 (default: per config, see --lr)")
    train.add_argument("--mode", choices=tuple(STEPS), default="production",
                       help="validate runs the same plan with layout checks on every op (default: production)")
    train.add_argument("--seed", type=_positive(int, least=0), default=0,
                       help="seeds the init and the data (default: 0)")
    train.add_argument("--out", type=Path, metavar="DIR", help="run folder (default: runs/<timestamp>)")
    train.add_argument("--plot", action="store_true",
                       help="save loss.png and step_breakdown.png into the run folder (needs matplotlib; "
                            "without it one line says so and training goes on)")
    train.add_argument("--timeout", type=_positive(float), default=3600.0, metavar="S",
                       help="end the run after this many seconds; also bounds each collective (default: 3600)")
    train.set_defaults(run=cmd_train)

    plan = sub.add_parser(
        "plan", parents=[job, optimizer], help="print per-rank memory and communication for any config and mesh",
        description="Print the plan report of a GPT config on a virtual mesh of any size, from meta "
                    "tensors; starts no process. Example: hpf plan --config 1b --mesh node=96,local=8 "
                    "(also how to size a config too big to train here)")
    plan.add_argument("--check", action="store_true",
                      help="also run validation mode for rank 0's view of the mesh on meta tensors "
                           "(hpf.check_plan): layouts and shapes of the whole step, forward and backward")
    plan.set_defaults(run=cmd_plan)

    bench = sub.add_parser(
        "bench", help="run benchmarks/*.py and print one table of their ratios",
        description="Run each script in benchmarks/ as a subprocess and collect the lines "
                    "'RATIO <name> <value> <target>' they print into one table.")
    bench.add_argument("--quick", action="store_true", help="pass --quick to scripts that accept it")
    bench.add_argument("--only", action="append", metavar="NAME",
                       help="run only scripts whose file name contains NAME (repeatable)")
    bench.add_argument("--dir", type=Path, default=BENCHMARKS_DIR, help="benchmarks folder (default: %(default)s)")
    bench.add_argument("--timeout", type=_positive(float), default=1800.0, metavar="S",
                       help="per-script limit in seconds (default: 1800)")
    bench.set_defaults(run=cmd_bench)
    _add_simulate(sub, job)
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


# ------------------------------------------------------------------ shared: mesh and optional parts

def _mesh(args) -> hpf.Mesh:
    axes = args.mesh or ({"dp": args.world_size} if args.world_size else _default_axes())
    mesh = hpf.Mesh(axes)
    if args.world_size is not None and mesh.size != args.world_size:
        raise CliError(f"--mesh {_mesh_text(axes)} has {mesh.size} ranks but --world-size is "
                       f"{args.world_size}; make them agree or give only one")
    return mesh


def _default_axes() -> dict[str, int]:
    """2 x 2 locally; under torchrun, the machines it started: node x local ranks per machine."""
    if not is_launched():
        return DEFAULT_MESH
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    return {"node": world_size() // local, "local": local} if world_size() > local else {"dp": local}


def _mesh_text(axes) -> str:
    return ",".join(f"{a}={n}" for a, n in axes.items())


# ------------------------------------------------------------------ hpf plan

def _plan(args, mesh: hpf.Mesh) -> hpf.Plan:
    """The plan shard_step makes for these arguments, from meta tensors (shapes only)."""
    return step_plan(gpt.init(gpt.CONFIGS[args.config], device="meta"), mesh, fsdp_axes=args.fsdp_axes,
                     topology=_topology(args.topology), hsdp=args.hsdp)


def _topology(name: str) -> hpf.Topology | None:
    return hpf.Topology() if name == "two-tier" else None


def _report(args, plan: hpf.Plan) -> tuple[PlanReport, str]:
    """The plan report for these arguments, its optimizer state counted for --optimizer, and a
    line that says what that state is."""
    mp = MixedPrecision.parse(args.mixed_precision)
    report = plan.report(compute_dtype=mp.compute_dtype if mp else None, master_dtype=mp.master_dtype if mp else None,
                         reduce_dtype=mp.reduce_dtype if mp else None,
                         hierarchical=args.topology == "two-tier")
    if args.optimizer == "adamw":
        return report, "optimizer state: AdamW, two fp32 moments per element"
    most, load, n_muon = muon_plan_state(hpf.optim.muon(), plan)
    busiest = max(range(plan.mesh.size), key=lambda r: (load[r], -r))
    balance = (f"Newton-Schulz FLOPs per rank max/mean {load[busiest] / (sum(load.values()) / plan.mesh.size):.2f} "
               f"(busiest rank {busiest}: {load[busiest] / 1e9:,.2f} GFLOP per step)" if load else "no matrices")
    return (dataclasses.replace(report, optimizer_bytes=most * 4),
            f"optimizer state: Muon, one fp32 momentum per element of its {n_muon} matrices, AdamW's two "
            f"moments for the other {len(plan.slots) - n_muon} tensors (the busiest rank's count); {balance}")


def cmd_plan(args) -> int:
    config = gpt.CONFIGS[args.config]
    mesh = _mesh(args)
    plan = _plan(args, mesh)
    report, state = _report(args, plan)
    print(f"GPT {args.config!r}: {gpt.num_params(config) / 1e6:,.1f}M params in {len(plan.slots)} tensors, "
          f"{len(plan.units)} FSDP units, {len(plan.buckets)} flat buckets")
    print(f"mesh {_mesh_text(dict(zip(mesh.axis_names, mesh.shape)))} ({mesh.size} ranks); "
          f"FSDP axes {','.join(plan.fsdp_axes) or '-'}; fast tier {','.join(mesh.fast_axes)}; "
          f"{args.topology} collectives{', HSDP' if args.hsdp else ''}; precision {args.mixed_precision or 'fp32'}")
    print(state)
    print(report.format())
    print(f"predicted step time, exposed communication and tokens/s, hpf vs FSDP2 vs Megatron DDP: "
          f"hpf simulate --config {args.config} --mesh {_mesh_text(dict(zip(mesh.axis_names, mesh.shape)))} "
          "--hardware cloudmatrix384 (or h100, or a calibration file)")
    if args.check:
        one_sequence = torch.empty(1, config.seq_len + 1, dtype=torch.int64, device="meta")
        print(hpf.check_plan(gpt.loss_for(config), gpt.init(config, device="meta"), mesh, one_sequence,
                             fsdp_axes=args.fsdp_axes, mixed_precision=args.mixed_precision))
    return 0


# ------------------------------------------------------------------ hpf train

@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs; plain data, so it travels to forked ranks unchanged."""

    config: str
    axes: dict
    fsdp_axes: tuple | None
    optimizer: str
    lr: float
    steps: int
    batch_size: int
    mode: str
    seed: int
    mixed_precision: str | None
    topology: str
    hsdp: bool
    metrics_path: str
    warmup: int = 0


def _make_optimizer(name: str, lr: float, adamw_lr: float, warmup: int):
    """--optimizer at --lr, ramped linearly over ``warmup`` steps, then held (hpf.optim.schedules)."""
    if name == "muon":  # AdamW at the config's AdamW lr for embeddings, head and vectors
        return hpf.optim.muon(lr=constant(lr, warmup), adamw_lr=constant(adamw_lr, warmup))
    return hpf.optim.adamw(lr=constant(lr, warmup))


def _make_step(job: TrainJob, mesh: hpf.Mesh):
    return hpf.shard_step(gpt.loss_for(gpt.CONFIGS[job.config]), mesh=mesh,
                          optimizer=_make_optimizer(job.optimizer, job.lr, TRAIN_DEFAULTS[job.config][0], job.warmup),
                          fsdp_axes=job.fsdp_axes, mode=job.mode, mixed_precision=job.mixed_precision,
                          hsdp=job.hsdp, topology=_topology(job.topology))


def _train_rank(rank: int, job: TrainJob) -> None:
    """One rank of ``hpf train``; rank 0 also shows progress and writes the metrics."""
    config = gpt.CONFIGS[job.config]
    mesh = hpf.Mesh(job.axes)
    progress = Progress(job.steps, label="train") if rank == 0 else None
    if progress:  # a big config's first step can take minutes: say it has begun, and that it runs
        progress.start(f"step 1 of {job.steps}: init, first gathers and warm-up")
    step = _make_step(job, mesh)
    state = step.init(gpt.init(config, torch.Generator().manual_seed(job.seed)))
    batches = gpt.synthetic_batches(config, job.batch_size, job.seed, rank=rank, world_size=mesh.size,
                                    device=default_device())
    tokens_per_step = job.batch_size * config.seq_len
    if rank != 0:
        for _ in range(job.steps):
            state, _ = step(state, next(batches))
        return
    try:
        with open(job.metrics_path, "w") as out:
            for i in range(1, job.steps + 1):
                state, m = step(state, next(batches))
                record = {"step": i, **{k: m[k] for k in STEP_METRICS}, "tokens_per_s": tokens_per_step / m["step_s"]}
                out.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")  # NaN -> null: valid JSON
                out.flush()  # a crashed or interrupted run keeps its metrics so far
                progress.update(i, {"loss": f"{m['loss']:.4f}", "tokens/s": f"{record['tokens_per_s'] / 1e3:.1f}k",
                                    "comm wait": f"{m['comm_wait_s'] / m['step_s']:.0%}"})
    finally:
        progress.close()


def _banner(job: TrainJob, n_units: int) -> str:
    """The first line of a run, the same under hpf.launch and torchrun."""
    config = gpt.CONFIGS[job.config]
    warmup = f" after {job.warmup} warmup steps" if job.warmup else ""
    return (f"hpf train: GPT {job.config!r} ({gpt.num_params(config) / 1e6:.2f}M params, {n_units} FSDP units) "
            f"on {math.prod(job.axes.values())} ranks, mesh {_mesh_text(job.axes)}, "
            f"{job.topology}{' HSDP' if job.hsdp else ''}, {job.optimizer} lr {job.lr:g}{warmup}, "
            f"{job.mixed_precision or 'fp32'} compute, {job.mode} mode")


def _host_memory_available() -> int:
    """Bytes the host can still give: MemAvailable (Linux), else its free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _activation_bytes(config: gpt.GPTConfig, tokens: int, compute_bytes: int) -> int:
    """Saved activations of gpt.loss for ``tokens`` tokens: about L*(13d + 2f) values per token
    in the compute dtype plus 3V fp32 (logits, softmax, their grad), fitted on small configs."""
    per_token = config.n_layers * (13 * config.d_model + 2 * config.d_ff) * compute_bytes + 3 * config.vocab_size * 4
    return tokens * per_token


def _check_memory(job: TrainJob, report: PlanReport, local_ranks: int) -> None:
    """Refuse, before anything is allocated, a run whose ranks on this machine would not fit.

    On the CPU the local ranks share the host's memory. Under torchrun with an accelerator each
    rank checks its own device (the driver of hpf.launch must not touch the device before the
    fork, so there only the host is checked)."""
    config = gpt.CONFIGS[job.config]
    parts = {"params": report.params_bytes, "grads": report.grad_bytes, "optimizer": report.optimizer_bytes,
             "gathered": report.peak_gathered_bytes,
             "activations ~": _activation_bytes(config, job.batch_size // report.world_size * config.seq_len,
                                                2 if job.mixed_precision else 4)}
    init_copy = gpt.num_params(config) * 4  # each rank builds the full params on the host, then shards them
    if is_launched() and torch.accelerator.is_available():
        available, _ = torch.accelerator.get_memory_info(int(os.environ.get("LOCAL_RANK", 0)))
        where, ranks = f"{torch.accelerator.current_accelerator().type} memory free", 1
    else:
        parts["full init copy"] = init_copy
        available, where, ranks = _host_memory_available(), "host memory available", local_ranks
    per_rank = sum(parts.values())
    if per_rank * ranks <= available:
        return
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    raise CliError(
        f"--config {job.config} needs about {gib(per_rank)} GiB per rank ("
        + ", ".join(f"{k} {gib(v)}" for k, v in parts.items()) + f") x {ranks} rank(s) here = "
        f"{gib(per_rank * ranks)} GiB, but {where} is {gib(available)} GiB; hpf plan --config {job.config} "
        "is the tool for sizing it on a bigger mesh (or lower --batch-size or the ranks)")


def _prepare_out(out: Path) -> None:
    """Create the run folder, or say in one line why it cannot be."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file, not a folder; pick a folder for the run")
    if (out / "metrics.jsonl").exists():
        raise CliError(f"--out {out} already holds a run (metrics.jsonl); pick another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as e:
        raise CliError(f"--out {out} cannot be written ({e.strerror}); pick a folder you can write to") from None


def cmd_train(args) -> int:
    """Fork the ranks here with hpf.launch, or, under torchrun, be one of them."""
    torchrun = is_launched()
    mesh = _mesh(args)
    config = gpt.CONFIGS[args.config]
    if torchrun and mesh.size != world_size():
        raise CliError(f"--mesh has {mesh.size} ranks but torchrun started {world_size()}; make them agree")
    if args.batch_size % mesh.size:
        raise CliError(f"--batch-size {args.batch_size} is the global batch and must split evenly over "
                       f"{mesh.size} ranks; use a multiple of {mesh.size}")
    plots = None
    if args.plot:
        try:
            import matplotlib  # noqa: F401 -- only checked here; hpf.plots imports what it draws with
            plots = "loss.png, step_breakdown.png"
        except ImportError:
            plots = "skipped: matplotlib is not installed"
            if rank() == 0:
                print("hpf: warning: --plot skipped: matplotlib is not installed (pip install matplotlib, or "
                      "pip install -e '.[plot]'); training goes on", file=sys.stderr, flush=True)
    out = args.out or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    lead = rank() == 0  # rank 0 under torchrun; the driver otherwise
    adamw_lr, muon_lr, warmup = TRAIN_DEFAULTS[args.config]
    job = TrainJob(args.config, dict(zip(mesh.axis_names, mesh.shape)), args.fsdp_axes, args.optimizer,
                   args.lr or (muon_lr if args.optimizer == "muon" else adamw_lr), args.steps, args.batch_size,
                   args.mode, args.seed, args.mixed_precision, args.topology, args.hsdp,
                   str(out / "metrics.jsonl"), warmup if args.warmup is None else args.warmup)
    _make_step(job, mesh)  # checks optimizer, mode and precision here, before any rank starts
    plan = _plan(args, mesh)  # checks the axes
    _check_memory(job, _report(args, plan)[0],
                  int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size)) if torchrun else mesh.size)
    if lead:
        _prepare_out(out)
        (out / "run.json").write_text(json.dumps(
            {**asdict(job), "plots": plots, "hpf": hpf.__version__, "torch": torch.__version__,
             "started": datetime.datetime.now().isoformat(timespec="seconds")}, indent=1) + "\n")
        print(_banner(job, len(plan.units)))
        print(f"data: {args.batch_size} x {config.seq_len} tokens per step from a fixed random Markov "
              f"source; run folder {out}", flush=True)
    started = time.perf_counter()
    if torchrun:
        init_distributed(timeout=args.timeout)
        _train_rank(rank(), job)
        torch.distributed.destroy_process_group()
    else:
        launch(_train_rank, mesh.size, job, timeout=args.timeout)
    if not lead:
        return 0
    wall = time.perf_counter() - started
    records = read_metrics(out / "metrics.jsonl")
    files = [out / "metrics.jsonl", out / "run.json"]
    if plots and not plots.startswith("skipped"):
        files += save_plots(records, out, f"loss: GPT {args.config!r}, mesh {_mesh_text(job.axes)}, "
                                          f"{args.optimizer}{', ' + args.mixed_precision if args.mixed_precision else ''}")
    print(summary(records, wall, files))
    return 0


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(records: list[dict], wall_s: float, files: list[Path]) -> str:
    median = {k: statistics.median(r[k] for r in records) for k in ("step_s", "tokens_per_s")}
    compute, comm, opt = (statistics.median(x) for x in zip(*map(breakdown, records)))
    total_step = sum(r["step_s"] for r in records)
    tail = records[-min(10, len(records)):]
    return "\n".join([
        f"done: {len(records)} steps in {wall_s:.1f} s",
        f"  loss        {records[0]['loss']:.4f} (step 1) -> {records[-1]['loss']:.4f} (step {len(records)}), "
        f"mean of last {len(tail)}: {statistics.fmean(r['loss'] for r in tail):.4f}",
        f"  step time   {median['step_s'] * 1e3:.1f} ms median: compute {compute * 1e3:.1f}, "
        f"exposed comm {comm * 1e3:.1f}, optimizer {opt * 1e3:.1f} ms",
        f"  throughput  {median['tokens_per_s']:,.0f} tokens/s median; waiting on communication "
        f"{sum(r['comm_wait_s'] for r in records) / total_step:.0%} of step time",
        "  files       " + "\n              ".join(str(f) for f in files),
    ])


# ------------------------------------------------------------------ hpf bench

def parse_ratio_line(line: str) -> tuple[str, float, str] | None:
    """``RATIO <name> <value> [<target>]`` -> (name, value, target); None for other lines."""
    m = RATIO_LINE.match(line.strip())
    if not m:
        return None
    try:
        return m[1], float(m[2]), m[3] or ""
    except ValueError:
        return None


def meets(value: float, target: str) -> str:
    """"ok" or "MISS" against a target like "<=0.70" or ">=3"; "" without one."""
    m = re.fullmatch(r"(<=|>=)(\S+)", target)
    if not m:
        return ""
    bound = float(m[2])
    return "ok" if (value <= bound if m[1] == "<=" else value >= bound) else "MISS"


def _shown(value: float, target: str) -> str:
    """The value one decimal finer than its target (0.9999996 vs >=0.999999), else 4 digits."""
    m = re.fullmatch(r"(<=|>=)\d*\.?(\d*)", target)
    return f"{value:.{len(m[2]) + 1}f}" if m else f"{value:.4g}"


def cmd_bench(args) -> int:
    if not args.dir.is_dir():
        raise CliError(f"--dir {args.dir} is not a folder; point it at the repository's benchmarks/")
    scripts = sorted(p for p in args.dir.glob("*.py") if p.name != "common.py" and not p.name.startswith("_"))
    if args.only:
        scripts = [p for p in scripts if any(s in p.name for s in args.only)]
    if not scripts:
        raise CliError(f"no benchmark scripts in {args.dir}" + (f" matching {args.only}" if args.only else ""))
    rows, failed = [], []
    for script in scripts:
        quick = args.quick and "--quick" in script.read_text()
        print(f"== {script.name}{' --quick' if quick else ''}", flush=True)
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(script)] + (["--quick"] if quick else []), cwd=args.dir,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(args.timeout, proc.kill)
        timer.start()
        for line in proc.stdout:
            print("   " + line, end="", flush=True)
            ratio = parse_ratio_line(line)
            if ratio:
                rows.append((script.name, *ratio))
        rc = proc.wait()
        timer.cancel()
        print(f"   ({time.perf_counter() - started:.0f} s, exit code {rc})")
        if rc:
            failed.append(script.name)
    print(ratio_table(rows))
    if failed:
        print(f"hpf: error: {len(failed)} benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def ratio_table(rows: list[tuple[str, str, float, str]]) -> str:
    head = ("benchmark", "ratio", "value", "target", "")
    body = [(b, n, _shown(v, t), t or "-", meets(v, t)) for b, n, v, t in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "-" * max(map(len, lines)))
    if not body:
        lines.append("(no RATIO lines were printed)")
    return "\n".join(lines)


# ------------------------------------------------------------------ hpf simulate

def _add_simulate(sub, job) -> None:
    simulate = sub.add_parser(
        "simulate", parents=[job], help="predict step time and exposed communication at any scale (no processes)",
        description="Predict step time, exposed communication and tokens/s of hpf, FSDP2 and Megatron DDP from "
                    "the plan alone (hpf.sim: alpha-beta links per tier, the step's schedule as an event "
                    "simulation). Example: hpf simulate --config 1b --mesh node=48,local=16 --hardware "
                    "cloudmatrix384 --mixed-precision bf16")
    simulate.add_argument("--hardware", default="cloudmatrix384", metavar="NAME|FILE",
                          help="a published profile (cloudmatrix384, ascend910c-roce, h100, h200) or a calibration "
                               "JSON from `python -m hpf.sim.calibrate` (default: cloudmatrix384)")
    simulate.add_argument("--local-batch", type=_positive(int), default=4, metavar="B",
                          help="sequences per rank per step (weak scaling; default: 4)")
    simulate.add_argument("--sweep", metavar="N,N,...",
                          help="rank counts for a scaling curve, e.g. 16,32,64,128,256,512,768 (meshes of whole "
                               "fast domains: node=N/fast,local=fast)")
    simulate.add_argument("--plot", type=Path, metavar="DIR",
                          help="with --sweep: write step_time.png, exposed_comm.png, tokens_per_rank.png into DIR "
                               "(needs matplotlib)")
    simulate.add_argument("--no-pipeline", action="store_true", help="hpf waits for each unit's reduction")
    simulate.set_defaults(run=cmd_simulate)


def cmd_simulate(args) -> int:
    from hpf import sim

    hw = sim.hardware(args.hardware)
    kw = dict(local_batch=args.local_batch, mixed_precision=args.mixed_precision, topology=args.topology,
              fsdp_axes=args.fsdp_axes, pipeline=not args.no_pipeline)
    strategies = ("hsdp" if args.hsdp else "hpf", "fsdp2", "ddp")
    if args.plot and not args.sweep:
        raise CliError("--plot draws the scaling curve: give --sweep too")
    if args.sweep:
        try:
            ranks = [int(n) for n in args.sweep.split(",")]
        except ValueError:
            raise CliError(f"--sweep {args.sweep!r}: give rank counts separated by commas, e.g. 16,32,64") from None
        rows = sim.sweep(args.config, ranks, hw, strategies, **kw)
    else:
        mesh = _mesh(args)
        rows = [(mesh.size, sim.compare(args.config, mesh, hw, strategies, **kw))]
    print(f"hpf simulate: GPT {args.config!r}, {args.local_batch} x {gpt.CONFIGS[args.config].seq_len} tokens per "
          f"rank, {args.mixed_precision or 'fp32'}, hardware {hw.name}, hpf {args.topology}"
          f"{' HSDP' if args.hsdp else ''}; FSDP2 and Megatron DDP as modelled in hpf.sim")
    print(f"{'ranks':>6} {'strategy':<8} {'step ms':>9} {'exposed':>8} {'tokens/s':>12} {'tok/s/rank':>11} "
          f"{'vs hpf':>7} {'fast busy ms':>12} {'slow busy ms':>12}")
    for n, res in rows:
        base = res[strategies[0]].step_s
        for name, r in res.items():
            print(f"{n:>6} {name:<8} {r.step_s * 1e3:>9.2f} {r.exposed_share:>8.1%} {r.tokens_per_s:>12,.0f} "
                  f"{r.tokens_per_s / n:>11,.0f} {r.step_s / base - 1:>+7.1%} {r.busy_s['fast'] * 1e3:>12.2f} "
                  f"{r.busy_s['slow'] * 1e3:>12.2f}")
    for note in hw.notes:
        print(f"  note: {note}")
    if args.plot:
        for f in save_simulate_plots(rows, args.plot):
            print(f"  wrote {f}")
    return 0


def save_simulate_plots(rows, out: Path) -> list[Path]:
    """step_time.png, exposed_comm.png, tokens_per_rank.png of a sweep, one line per strategy."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise CliError("--plot needs matplotlib: pip install matplotlib (the plot extra: pip install -e '.[plot]')") from None
    out.mkdir(parents=True, exist_ok=True)
    ranks = [n for n, _ in rows]
    files = []
    for fname, label, value in (("step_time.png", "step time (ms)", lambda r, n: r.step_s * 1e3),
                                ("exposed_comm.png", "exposed communication (% of step)",
                                 lambda r, n: 100 * r.exposed_share),
                                ("tokens_per_rank.png", "tokens/s per rank", lambda r, n: r.tokens_per_s / n)):
        fig = Figure(figsize=(6, 3.5), layout="constrained")
        ax = fig.subplots()
        for name in rows[0][1]:
            ax.plot(ranks, [value(res[name], n) for n, res in rows], marker="o", label=name)
        ax.set(xlabel="ranks", ylabel=label, xscale="log", title=label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(out / fname, dpi=120)
        files.append(out / fname)
    return files
