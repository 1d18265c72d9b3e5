"""What the cross-rank agreement check costs a step (issue 27's target: at most 1% of step time).

The check is three things the step does anyway, plus a little: every read and collective is
recorded in hpf.comm.schedule.LOG (a tuple and a cached hash), the step's one all-reduce
carries 12 more float64 (the schedule digest and the batch-shape digest, as (x, x^2) parts),
and every rank compares the sums. This script measures, on GPT configs on 2 ranks:
  events     records per step (reads, gathers, reductions, the all-reduce), counted in LOG;
  cost       events x the measured cost of one record, plus the digests, hashed and checked;
  A/B        the same steps with LOG.record a no-op and the digests constant, interleaved with
             the real ones (a direct measurement, as noisy as the machine);
and prints cost / median step time.
Usage: python benchmarks/agreement_cost.py [--configs tiny,small] [--rounds 4] [--calls 5]
"""
from __future__ import annotations

import argparse
import time

import torch

import hpf
from hpf import batching
from hpf.comm import schedule
from hpf.launcher import launch
from hpf.models import gpt

from common import interleaved, median_ms, print_table, report_ratio, step_runner

WORLD, BATCH = 2, 8


def per_call_s(fn, n: int = 20000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def rank_main(rank, name, args):
    torch.set_num_threads(1)
    config = gpt.CONFIGS[name]
    params = gpt.init(config, hpf.random.key(0))
    batches = [gpt.global_batch(config, BATCH, 0, s)[rank * BATCH // WORLD:(rank + 1) * BATCH // WORLD]
               for s in range(4)]
    make = lambda: hpf.shard_step(gpt.loss_for(config, weighted=True), mesh=hpf.Mesh({"dp": WORLD}),  # noqa: E731
                                  optimizer=hpf.optim.adamw(lr=1e-3))
    runs = {"with check": step_runner(make(), params), "without": step_runner(make(), params)}
    real_record, real_parts = schedule.LOG.record, schedule.digest_parts

    def without():  # the check off: nothing recorded, constant digests (every rank agrees)
        schedule.LOG.record = lambda *a, **k: None
        schedule.digest_parts = lambda h: real_parts(0)
        try:
            return runs["without"](batches[0])
        finally:
            schedule.LOG.record, schedule.digest_parts = real_record, real_parts
    for _ in range(2):
        runs["with check"](batches[0])
        without()
    seq = schedule.LOG.seq
    runs["with check"](batches[0])
    events = schedule.LOG.seq - seq
    times = interleaved({"with check": lambda: runs["with check"](batches[0]), "without": without},
                        rounds=args.rounds, calls=args.calls, before_each=torch.distributed.barrier)
    log = schedule.ScheduleLog()
    record = per_call_s(lambda: log.record("all-gather", "blocks/3", 1))
    digests = per_call_s(lambda: schedule.parts_agree(schedule.digest_parts(log.digest()) * 2, WORLD), 5000)
    shapes = per_call_s(lambda: batching.shape_signature(batches[0]), 5000)
    return {"events": events, "record_s": record, "digest_s": digests + shapes,
            "step_ms": {n: median_ms(t) for n, t in times.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for name in args.configs.split(","):
        out = launch(rank_main, WORLD, name, args, timeout=1800)[0]
        step = out["step_ms"]["with check"]
        cost_ms = (out["events"] * out["record_s"] + out["digest_s"]) * 1e3
        ab = (step - out["step_ms"]["without"]) / out["step_ms"]["without"]
        rows.append([name, out["events"], out["record_s"] * 1e6, cost_ms * 1e3, step, cost_ms / step * 100, ab * 100])
        report_ratio(f"agreement/{name}_step", cost_ms / step, "<=0.01")
    print(f"GPT on {WORLD} ranks, global batch {BATCH}; medians of interleaved steps")
    print_table(["config", "events/step", "us/record", "check us/step", "step ms", "cost %", "A/B %"], rows)


if __name__ == "__main__":
    main()
