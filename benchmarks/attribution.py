"""Where hpf's step time goes: ms per step and rank, by category, read from hpf.trace's spans.

Each rank runs ``--warmup`` untraced steps (the last ``--steps`` of them timed: the untraced
step time), then traces ``--steps`` steps and reports the median one (after one more, traced and left out: the
profiler's start stalls it) with hpf.trace.tracing (torch's profiler plus hpf's
named ranges). Each traced step's main-thread time is split, at ``RES_US`` resolution, by the
innermost hpf range covering each instant:

  compute          torch ops (the profiler's top-level ops) inside a unit's forward/backward range
  python           the rest of those ranges: the loss function's Python, autograd, the
                   engine's saved-tensor hooks and param views
  engine           hpf's own bookkeeping: issuing gathers and reductions, the step's set-up
  wait all-gather / wait reduce-scatter / wait all-reduce (loss and grad norm)
  barrier          the all-ranks agreement on the loss and batch shapes
  optimizer        per unit during backward (overlap), the grad norm
  copies           grads into the flat reduce buffers, shards cast to the compute dtype
and, on the other threads: the busy time of hpf's comm workers (two-tier), which compete
with compute for the cores (gloo's own threads are not traced).

The profiler slows each step (it records every op): the traced step time is printed beside
the untraced one, and categories are ms of the traced step.

``--read`` attributes traces already written, such as ``hpf train --trace``'s rank<r>.json
files, instead of running steps: one column per file, the median traced step of each.

Usage: python benchmarks/attribution.py [--config small] [--batch 8] [--steps 5] [--contenders flat,shm]
       python benchmarks/attribution.py --read runs/<run>/trace/rank0.json runs/<run>/trace/rank1.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hpf
from hpf import Topology, trace
from hpf.launcher import launch
from hpf.models import gpt

from common import print_table

WORLD = 2
RES_US = 5.0
CATEGORIES = ("compute", "python", "engine", "wait all-gather", "wait reduce-scatter", "wait all-reduce",
              "barrier", "optimizer", "copies")
# hpf range name (its first words) -> category; "hpf/forward"/"hpf/backward" split into compute/python.
KIND = {"hpf/wait all-gather": "wait all-gather", "hpf/wait reduce-scatter": "wait reduce-scatter",
        "hpf/all-reduce the step's totals": "wait all-reduce",
        "hpf/optimizer": "optimizer", "hpf/grad norm": "optimizer", "hpf/copy grads": "copies",
        "hpf/cast shards": "copies"}
CONTENDERS = {"flat": None, "shm": Topology(fast_transport="shm")}
LABEL = {"flat": "hpf flat gloo", "shm": "hpf two-tier (shm)"}


def category(name: str) -> str:
    if name.startswith(("hpf/forward", "hpf/backward")):
        return "unit"
    for prefix, cat in KIND.items():
        if name.startswith(prefix):
            return cat
    return "engine"


def attribute(events: list[dict]) -> list[dict[str, float]]:
    """ms per category for each traced step (each "hpf/step" range on the main thread)."""
    steps = sorted((e for e in events if e.get("name") == "hpf/step"), key=lambda e: e["ts"])
    main = steps[0]["tid"]
    out = []
    for s in steps:
        t0, n = s["ts"], int(s["dur"] / RES_US) + 1
        within = lambda e: e["ts"] >= t0 and e["ts"] + e["dur"] <= t0 + s["dur"]  # noqa: E731
        label = np.zeros(n, dtype=np.int16)  # index into names; 0: the step itself (engine)
        names = ["hpf/step"]
        spans = sorted((e for e in events if e.get("cat") == "hpf" and e["tid"] == main and within(e) and e is not s),
                       key=lambda e: (e["ts"], -e["dur"]))
        for e in spans:  # nested ranges start later: painted last, the innermost wins
            names.append(e["name"])
            label[_bins(e, t0, n)] = len(names) - 1
        op = np.zeros(n, dtype=bool)
        for e in events:
            if e.get("cat") == "cpu_op" and e["tid"] == main and within(e) and "_GatherUnit" not in e["name"]:
                op[_bins(e, t0, n)] = True
        cats = np.array([category(x) for x in names])[label]
        ms = {c: 0.0 for c in CATEGORIES}
        for c in CATEGORIES:
            ms[c] = float((cats == c).sum()) * RES_US / 1e3
        unit = cats == "unit"
        ms["compute"] = float((unit & op).sum()) * RES_US / 1e3
        ms["python"] = float((unit & ~op).sum()) * RES_US / 1e3
        busy = np.zeros(n, dtype=bool)
        for e in events:
            if e.get("cat") == "hpf" and e["tid"] != main and within(e):
                busy[_bins(e, t0, n)] = True
        ms["comm threads busy"] = float(busy.sum()) * RES_US / 1e3
        ms["step"] = s["dur"] / 1e3
        out.append(ms)
    return out


def _bins(e: dict, t0: float, n: int) -> slice:
    a = int((e["ts"] - t0) / RES_US)
    return slice(max(a, 0), min(n, int((e["ts"] + e["dur"] - t0) / RES_US) + 1))


def rank_main(rank: int, args, folder: str) -> dict:
    config = gpt.CONFIGS[args.config]
    params = gpt.init(config, hpf.random.key(0))
    local = args.batch // WORLD
    batch = gpt.global_batch(config, args.batch, 0, 0)[rank * local:(rank + 1) * local]
    result = {}
    for name in args.contenders.split(","):
        step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": WORLD}),
                              optimizer=hpf.optim.adamw(lr=1e-3), topology=CONTENDERS[name])
        state = step.init(params)
        untraced = []
        for _ in range(args.warmup):
            t = time.perf_counter()
            state, _ = step(state, batch)
            untraced.append(time.perf_counter() - t)
        path = Path(folder) / f"{name}-rank{rank}.json"
        with trace.tracing(path, skip_steps=0, steps=args.steps + 1) as advance:
            for _ in range(args.steps + 1):
                state, _ = step(state, batch)
                advance()
        step.close()
        with open(path) as f:  # the first traced step pays for the profiler's start: left out
            per_step = attribute(json.load(f)["traceEvents"])[1:]
        result[name] = {"untraced_ms": statistics.median(untraced[-args.steps:]) * 1e3, "ms": median_step(per_step)}
    return result


def median_step(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The median traced step's ms by category (its parts add up to its step time)."""
    if not per_step:
        raise SystemExit("attribution: no hpf/step range in the trace; write it with hpf train --trace or "
                         "hpf.trace.tracing")
    return sorted(per_step, key=lambda ms: ms["step"])[len(per_step) // 2]


def read(paths: list[Path]) -> None:
    """--read: the median step of each trace file, one column each."""
    columns = []
    for p in paths:
        with open(p) as f:
            columns.append(median_step(attribute(json.load(f)["traceEvents"])))
    print(f"ms in each trace's median traced step ({', '.join(str(p) for p in paths)})")
    print_table(["category"] + [p.stem for p in paths],
                [[c] + [col[c] for col in columns] for c in CATEGORIES + ("step", "comm threads busy")])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--read", type=Path, nargs="+", metavar="TRACE",
                    help="attribute these trace files (e.g. hpf train --trace's rank<r>.json) instead of running")
    ap.add_argument("--config", default="small", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--warmup", type=int, default=8, help="untraced steps (the last --steps of them timed)")
    ap.add_argument("--steps", type=int, default=5, help="traced steps (medians over them)")
    ap.add_argument("--contenders", default="flat,shm", help="comma-separated: flat (gloo), shm (two-tier)")
    ap.add_argument("--keep", type=Path, help="copy the traces into this folder")
    args = ap.parse_args()
    if args.read:
        return read(args.read)
    config = gpt.CONFIGS[args.config]
    print(f"GPT {args.config} ({gpt.num_params(config) / 1e6:.2f}M params), global batch {args.batch}, {WORLD} ranks, "
          f"{torch.get_num_threads()} threads; ms in each rank's median traced step of {args.steps}")
    with tempfile.TemporaryDirectory() as folder:
        out = launch(rank_main, WORLD, args, folder, timeout=1800)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for p in Path(folder).iterdir():
                (args.keep / p.name).write_bytes(p.read_bytes())
    names = args.contenders.split(",")
    headers = ["category"] + [f"{LABEL[n]} r{r}" for n in names for r in range(WORLD)]
    rows = [[c] + [out[r][n]["ms"][c] for n in names for r in range(WORLD)]
            for c in CATEGORIES + ("step", "comm threads busy")]
    rows.append(["untraced step"] + [out[r][n]["untraced_ms"] for n in names for r in range(WORLD)])
    print_table(headers, rows)


if __name__ == "__main__":
    main()
