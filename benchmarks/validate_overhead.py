"""What validation mode costs: its step time over production's, and a 768-rank plan check.

1. The GPT of benchmarks/step_vs_fsdp2.py on 2 ranks (gloo): a production step and a
   validation step (mode="validate", every layout, the batch, the loss and the grads
   checked) from the same params, interleaved in one job; medians. Target: <= 3x.
2. hpf.check_plan of the 1B GPT for one rank of a 768-rank virtual mesh, on meta tensors in
   this process: the cold first call (it pays torch's one-time meta-kernel warm-up) and the
   median of the warm ones.
Usage: python benchmarks/validate_overhead.py [--config small] [--batch 8] [--rounds 6] [--calls 3]
                                              [--mesh node=96,local=8] [--plan-config 1b]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from hpf.validate import check_plan

from common import interleaved, median_ms, print_table, report_ratio

WORLD = 2


def step_times(rank: int, config_name: str, batch: int, rounds: int, calls: int) -> dict:
    config = gpt.CONFIGS[config_name]
    params = gpt.init(config)
    steps = {mode: hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": WORLD}),
                                  optimizer=hpf.optim.adamw(lr=1e-3), mode=mode)
             for mode in ("production", "validate")}
    states = {mode: step.init(params) for mode, step in steps.items()}
    data = gpt.synthetic_batches(config, batch, seed=0, rank=rank, world_size=WORLD)
    local = next(data)
    losses = {}

    def run(mode):
        def call():
            states[mode], metrics = steps[mode](states[mode], local)
            losses.setdefault(mode, metrics["loss"])
        return call

    for mode in steps:  # warm-up
        run(mode)()
    times = interleaved({m: run(m) for m in steps}, rounds=rounds, calls=calls, before_each=dist.barrier)
    return {"ms": {m: median_ms(t) for m, t in times.items()}, "first_loss": losses,
            "ops": steps["validate"].ops_checked}


def plan_check_times(config_name: str, mesh: hpf.Mesh, reps: int) -> tuple[float, float, str]:
    config = gpt.CONFIGS[config_name]
    params = gpt.init(config, device="meta")
    batch = torch.empty(8, config.seq_len + 1, dtype=torch.int64, device="meta")
    seconds, report = [], None
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        report = check_plan(gpt.loss_for(config), params, mesh, batch)
        seconds.append(time.perf_counter() - t0)
    return seconds[0], statistics.median(seconds[1:]), str(report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--mesh", default="node=96,local=8", help="the virtual mesh of the plan check")
    ap.add_argument("--plan-config", default="1b", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--reps", type=int, default=3, help="warm plan checks")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.reps = 2, 2, 1

    out = launch(step_times, WORLD, args.config, args.batch, args.rounds, args.calls, timeout=900)[0]
    prod, val = out["ms"]["production"], out["ms"]["validate"]
    print(f"GPT {args.config!r}, global batch {args.batch}, {WORLD} ranks, medians of "
          f"{args.rounds * args.calls} steps; validation checked {out['ops']} ops per step")
    print_table(["mode", "step ms", "first loss"],
                [["production", prod, out["first_loss"]["production"]],
                 ["validate", val, out["first_loss"]["validate"]]])
    report_ratio("validate/production", val / prod, "<=3")

    mesh = hpf.Mesh({k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    cold, warm, report = plan_check_times(args.plan_config, mesh, args.reps)
    config = gpt.CONFIGS[args.plan_config]
    print(report)
    print(f"check_plan of the {args.plan_config} GPT ({gpt.num_params(config) / 1e9:.2f}B params) on {mesh} "
          f"({mesh.size} ranks), one process, meta tensors: first call {cold:.2f} s (includes torch's one-time "
          f"meta-kernel warm-up), then {warm:.3f} s (median of {args.reps})")


if __name__ == "__main__":
    main()
