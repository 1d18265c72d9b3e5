"""Helpers shared by the benchmark scripts: interleaved timing, medians, tables, and the one
results schema.

Timings interleave the contenders and rotate their order every round, so slow drift
(thermal, a neighbour process on the shared cores) hits all of them equally; medians
ignore the odd outlier.

Every benchmark's results file has one schema (``results``; ``benchmarks/run.py --json DIR``
writes one per benchmark, and docs/gen.py builds the docs' tables from them): the
``environment`` it ran in, the ``command`` that reproduces it, its ``figures`` (whatever the
benchmark measured) and its ``ratios``, each with its ``target`` (what ``report_ratio`` printed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

SCHEMA = "hpf-benchmark/1"
REPO = Path(__file__).resolve().parent.parent
_RATIOS: list[dict] = []  # what report_ratio printed in this process, in order
_LOAD_AT_START = os.getloadavg()


def interleaved(contenders: dict[str, Callable[[], object]], *, rounds: int, calls: int,
                before_each: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each contender: ``calls`` calls per round, order rotated each round.

    ``before_each`` runs untimed before every call (e.g. a barrier that lines up ranks).
    """
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(calls):
                if before_each is not None:
                    before_each()
                t0 = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - t0)
    return times


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain, aligned text table (floats with 3 significant decimals)."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def report_ratio(name: str, value: float, target: str = "") -> None:
    """Print ``RATIO <name> <value> <target>``, the line ``benchmarks/run.py`` collects into its table and results file.

    ``name`` has no spaces (e.g. ``hpf/fsdp2``); ``target`` is ``"<=0.70"``, ``">=0.999999"``
    or empty for a figure with no target. The table shows the value one decimal finer
    than the target.
    """
    import re

    if not name or any(c.isspace() for c in name):
        raise ValueError(f"report_ratio: name {name!r} must be non-empty with no spaces")
    if target and not re.fullmatch(r"(<=|>=)\d+(\.\d*)?", target):
        raise ValueError(f"report_ratio: target {target!r} must look like '<=0.70' or '>=3'")
    print(f"RATIO {name} {float(value)!r} {target}".rstrip(), flush=True)
    _RATIOS.append({"name": name, "value": float(value), "target": target})


def cpu() -> str:
    """This CPU's model and widest vector extension (/proc/cpuinfo): which kernels torch and MKL run, so
    whose bits a deterministic run's figures are (another CPU sums in other orders)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    widest = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no AVX")
    return f"{model or platform.machine()}, {widest}"


def environment(quick: bool, load_at_start: Sequence[float] | None = None) -> dict:
    """Where and how a benchmark ran: the machine, the software, the commit, the load (``load_at_start``:
    when it started, if not when this process did)."""
    import torch

    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"quick": quick, "cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpu": cpu(), "python": platform.python_version(),
            "torch": torch.__version__, "commit": commit, "uncommitted_changes": dirty,
            "load_average_at_start": list(load_at_start or _LOAD_AT_START), "load_average_at_end": list(os.getloadavg()),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def results(figures: dict, *, quick: bool = False, argv: list[str] | None = None, ratios: list | None = None,
            load_at_start: Sequence[float] | None = None) -> dict:
    """A benchmark's results in the one schema (the module doc): ``figures`` as it measured them,
    the ratios ``report_ratio`` printed (or ``ratios``), and the command: this process's (or ``argv``:
    a script and its arguments)."""
    script, *args = argv or sys.argv
    args = [a.replace(f"{REPO}{os.sep}", "") for a in args]  # paths in the repository, relative to it
    script = Path(script).name
    return {"schema": SCHEMA, "benchmark": script, "command": " ".join(["python", f"benchmarks/{script}", *args]),
            "environment": environment(quick, load_at_start), "figures": figures,
            "ratios": list(_RATIOS if ratios is None else ratios)}


def write_results(path: Path | str, figures: dict, *, quick: bool = False) -> None:
    """Write ``results(figures)`` to ``path`` (a benchmark's ``--json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results(figures, quick=quick), indent=1) + "\n")
    print(f"wrote {path}")


def step_bench_parser(doc: str, *, config: str = "small", batch: int = 8, warmup: int = 2, rounds: int = 5,
                      calls: int = 2) -> argparse.ArgumentParser:
    """The options every interleaved step benchmark takes; a script adds its own after."""
    from hpf.models import gpt

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--config", default=config, choices=sorted(gpt.CONFIGS))
    ap.add_argument("--batch", type=int, default=batch, help="global batch size (sequences)")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--calls", type=int, default=calls, help="timed steps per contender per round")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 step, for a smoke run")
    ap.add_argument("--layers", type=int, default=0, help="override the config's n_layers (0: keep)")
    ap.add_argument("--d-model", type=int, default=0, help="override the config's d_model (0: keep; d_ff follows)")
    return ap


def config_of(args):
    """The GPT config the options name, with --layers / --d-model applied (e.g. small at d 128: ~1M params)."""
    import dataclasses

    from hpf.models import gpt

    config = gpt.CONFIGS[args.config]
    changes = {"n_layers": args.layers} if args.layers else {}
    if args.d_model:
        changes.update(d_model=args.d_model, d_ff=4 * args.d_model)
    return dataclasses.replace(config, **changes)


def parse_step_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.warmup = 2, 1, 1
    return args


def time_steps(impls: dict[str, Callable], batches: Sequence, args, *,
               after_warmup: Callable[[dict], None] | None = None):
    """Run every impl (``impl(batch) -> loss``) on the same list of batches: ``args.warmup``
    untimed steps each (step 0 doubles as the sanity check), then ``interleaved`` timed steps,
    lined up across ranks by a barrier. Returns (wall seconds, losses, process CPU seconds)
    per impl. ``after_warmup(losses)`` runs between the two, e.g. to check step 0 agrees."""
    import torch.distributed as dist

    losses = {n: [] for n in impls}
    cpu = {n: [] for n in impls}  # all threads' CPU time: the work, without waiting for a core

    def contender(name):
        def call():
            t = time.process_time()
            losses[name].append(impls[name](batches[len(losses[name]) % len(batches)]))
            cpu[name].append(time.process_time() - t)
        return call
    contenders = {n: contender(n) for n in impls}
    for call in contenders.values():
        for _ in range(args.warmup):
            call()
    for c in cpu.values():
        c.clear()
    if after_warmup is not None:
        after_warmup(losses)
    times = interleaved(contenders, rounds=args.rounds, calls=args.calls, before_each=dist.barrier)
    return times, losses, cpu


def step_runner(step, params) -> Callable:
    """``run(batch) -> loss`` of an hpf.shard_step, carrying its donated state between calls."""
    box = [step.init(params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]
    return run
