"""Choice quality of the plan search on this machine: every feasible candidate measured.

For GPT small and the MoE tiny config on 4 CPU ranks (node=2,local=2), ``hpf.search`` ranks
its candidates on a calibration of this machine (made first, or ``--hardware FILE``), under
this machine's memory. Then every candidate under the cap runs: in each round every candidate
is built, warmed up and timed for a few steps (order rotated every round), and its step time is
the median over rounds of each round's median. Printed per job: the candidate count, how long
the exhaustive measurement took, the best measured candidate, the searched one, and

    RATIO search/<job>-picked/best <measured step of the searched plan / of the best> <=1.10

Results: ``--json docs/results/search_choice.json`` (the docs page reads it). A timing: run it
on a quiet machine (about an hour with the defaults). ``--quick``: one round of two steps on
the searched plan and four others, to check the script.

    python benchmarks/search_choice.py [--quick] [--hardware calib.json] [--json FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hpf
from hpf import memory, search
from hpf.models import MODELS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report_ratio, write_results  # noqa: E402

MESH = {"node": 2, "local": 2}
JOBS = {"gpt-small": ("gpt", "small", 16), "moe-tiny": ("moe", "tiny", 16)}  # model, config, global batch


def _batch(model: str, config, rank: int, ranks: int, batch: int, step: int):
    module = MODELS[model]
    tokens = module.global_batch(config, batch, 0, step)[rank * (batch // ranks):(rank + 1) * (batch // ranks)]
    if hasattr(module, "Balancer"):
        return module.batch_with_bias(tokens, torch.zeros(config.n_moe_layers, config.n_experts))
    return tokens


def _measure(rank: int, model: str, config_name: str, batch: int, candidates: list[dict], rounds: int, warmup: int,
             steps: int) -> list[float]:
    """Median step seconds of each candidate (hpf train's options), rounds rotated, after one
    untimed run of the first (a process's first steps pay its one-time costs)."""
    from hpf.models import model_config

    module, config = model_config(model, config_name)
    mesh = hpf.Mesh(MESH)

    def run(c: search.Candidate, steps: int) -> list[float]:
        loss = module.loss_for(config, **c.loss_args(model), **({"aux": True} if hasattr(module, "Balancer") else {}))
        step = hpf.shard_step(loss, optimizer=hpf.optim.adamw(lr=1e-3), **c.step_args(model, config, mesh))
        state = step.init(module.init(config))
        times = []
        for s in range(warmup + steps):
            torch.distributed.barrier()
            state, m = step(state, _batch(model, config, rank, mesh.size, batch, s))
            times.append(m["step_s"])
        step.close()
        return times[warmup:]

    run(search.Candidate(**candidates[0]), 1)
    per: list[list[float]] = [[] for _ in candidates]
    for r in range(rounds):
        order = list(range(len(candidates)))
        for i in order[r % len(order):] + order[:r % len(order)]:
            per[i].append(statistics.median(run(search.Candidate(**candidates[i]), steps)))
    return [statistics.median(t) for t in per]  # rank 0's: every rank times the same steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", help="a calibration of this machine (default: run hpf calibrate first)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per candidate per round")
    ap.add_argument("--quick", action="store_true", help="1 round of 2 steps, the searched plan and 4 others")
    ap.add_argument("--json", type=Path, help="write the results here (docs/results/search_choice.json)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 2
    hardware = args.hardware
    tmp = tempfile.TemporaryDirectory()
    if hardware is None:
        hardware = str(Path(tmp.name) / "calib.json")
        ranks = hpf.Mesh(MESH).size  # every micro-batch size of each job's sequences per rank, fp32 and bf16
        shapes = [f"{model}:{config}/{batch // ranks // k}" for model, config, batch in JOBS.values() for k in (1, 2, 4)]
        quick = ["--reps", "2", "--launches", "1"] if args.quick else []
        subprocess.run([sys.executable, "-m", "hpf", "calibrate", "--out", hardware, "--world-sizes", "4",
                        "--shapes", *shapes, *quick], check=True)
    rows = []
    for name, (model, config, batch) in JOBS.items():
        started = time.perf_counter()
        result = search.search(model, config, MESH, hardware, global_batch=batch,
                               memory_per_rank=memory.machine_memory(4)[0])
        search_s = time.perf_counter() - started
        every = search.candidates(model, config, MESH, hardware, global_batch=batch)
        feasible = [r.candidate for r in every if r.memory.total <= result.memory_cap]
        picked = result.best.candidate
        if args.quick:  # the pick and 4 others, spread over the space
            feasible = [picked] + [c for c in feasible if c != picked][::max(1, len(feasible) // 4)][:4]
        started = time.perf_counter()
        measured = hpf.launch(_measure, 4, model, config, batch, [dataclasses.asdict(c) for c in feasible],
                              args.rounds, 2, args.steps, timeout=14400)[0]
        exhaustive_s = time.perf_counter() - started
        best = min(range(len(feasible)), key=lambda i: measured[i])
        mine = measured[feasible.index(picked)]
        predicted = [search.simulate(c, model, config, MESH, hardware, batch).step_s for c in feasible]
        print(f"{name}: {result.candidates} candidates, {len(feasible)} measured under the cap "
              f"({memory.size(result.memory_cap)}), search {search_s:.2f} s, exhaustive measurement "
              f"{exhaustive_s / 60:.1f} min")
        print(f"  searched: {picked.label()}: measured {mine * 1e3:.1f} ms, predicted {result.best.step_s * 1e3:.1f} ms")
        print(f"  best measured: {feasible[best].label()}: {measured[best] * 1e3:.1f} ms")
        report_ratio(f"search/{name}-picked/best", mine / measured[best], "<=1.10")
        rows.append({"job": name, "model": model, "config": config, "global_batch": batch, "mesh": MESH,
                     "candidates": result.candidates, "measured": len(feasible), "search_s": search_s,
                     "exhaustive_s": exhaustive_s, "picked": picked.label(), "picked_s": mine,
                     "best": feasible[best].label(), "best_s": measured[best],
                     "runs": [{"plan": c.label(), "measured_s": t, "predicted_s": p}
                              for c, t, p in zip(feasible, measured, predicted)]})
    if args.json:
        write_results(args.json, {"rounds": args.rounds, "steps": args.steps, "jobs": rows}, quick=args.quick)


if __name__ == "__main__":
    main()
