"""The Muon tax: a GPT training step with hpf's distributed Muon minus the same step with AdamW.

GPT small, 4 ranks, gloo, on a flat mesh (dp=4), a two-tier one (node=2,local=2,
hpf.Topology()) and the same with an EMULATED slow link (2 ms + bytes / 100 MB/s per slow-tier
collective, as benchmarks/topology.py; Muon's own pieces are not delayed), the contenders
interleaved in one job per mesh: hpf.shard_step with AdamW, with Muon (the default: the update
after the decision), with Muon whose Newton-Schulz starts during backward (overlap=True), and
with Muon on Gram Newton-Schulz (ns_variant="auto"). The tax is the median step (slowest rank) with Muon
minus the median with AdamW. The ideal is the busiest rank's Newton-Schulz FLOPs at perfect
balance (all ranks' FLOPs / 4) over this machine's matmul rate, measured on every rank at once
(the ranks share the cores, as their Newton-Schulz does) with the shapes Newton-Schulz multiplies;
hpf.sim.muon_tax's prediction for the plan at that rate is printed beside it. Target: tax <= 1.25x
the ideal.
Usage: python benchmarks/muon_tax.py [--rounds 5] [--calls 2] [--quick]
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

import hpf
from hpf import sim
from hpf.launcher import launch
from hpf.models import gpt
from hpf.optim.muon_owners import muon_plan_state

from common import median_ms, parse_step_args, print_table, report_ratio, step_bench_parser, time_steps

WORLD = 4
MESHES = {"flat dp=4": ({"dp": 4}, None), "2x2 two-tier": ({"node": 2, "local": 2}, hpf.Topology()),
          "2x2 slow link": ({"node": 2, "local": 2}, hpf.Topology(slow_link=hpf.SlowLink(2e-3, 100e6)))}


def matmul_rate(config) -> float:
    """FLOP/s of one rank while every rank multiplies: Newton-Schulz's products of a block's shapes."""
    d, f = config.d_model, config.d_ff
    a, b = torch.randn(d, f), torch.randn(f, d)
    a @ b
    dist.barrier()
    reps, t = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    elapsed = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return reps * 2 * d * f * d / float(elapsed)


def rank_main(rank, args, axes, topology):
    config = gpt.CONFIGS[args.config]
    params = gpt.init(config, hpf.random.key(0))
    local = args.batch // WORLD
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    optimizers = {"adamw": hpf.optim.adamw(lr=1e-3), "muon": hpf.optim.muon(adamw_lr=1e-3, overlap=False),
                  "muon-overlap": hpf.optim.muon(adamw_lr=1e-3, overlap=True),
                  "muon-gram": hpf.optim.muon(adamw_lr=1e-3, ns_variant="auto")}
    impls = {}
    for name, opt in optimizers.items():
        step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh(axes), optimizer=opt, topology=topology)
        box = [step.init(params)]

        def run(batch, step=step, box=box):
            box[0], metrics = step(box[0], batch)
            return metrics["loss"]
        impls[name] = run
    rate = matmul_rate(config)
    times, _, _ = time_steps(impls, batches, args)
    return {"times": times, "rate": rate}


def main():
    ap = step_bench_parser(__doc__)
    args = parse_step_args(ap)
    config = gpt.CONFIGS[args.config]
    print(f"GPT {args.config} ({gpt.num_params(config) / 1e6:.2f}M params), global batch {args.batch}, "
          f"{WORLD} ranks, gloo; NS fp32, 5 keller steps")
    rows = []
    for label, (axes, topology) in MESHES.items():
        out = launch(rank_main, WORLD, args, axes, topology, timeout=1800)
        names = list(out[0]["times"])
        med = {n: median_ms([max(r["times"][n][i] for r in out) for i in range(len(out[0]["times"][n]))])
               for n in names}
        rate, plan = min(r["rate"] for r in out), sim.plan_for(gpt, config, hpf.Mesh(axes))
        flops = {v: muon_plan_state(hpf.optim.muon(ns_variant=v), plan)[1] for v in ("standard", "auto")}
        ideal = {v: sum(f.values()) / WORLD / rate * 1e3 for v, f in flops.items()}
        local_hw = dataclasses.replace(sim.PROFILES["h100"], peak_flops=rate, efficiency=1.0,
                                       fast=sim.Link(0.0, math.inf), slow=sim.Link(0.0, math.inf), scale_out=None)
        predicted = sim.muon_tax(plan, local_hw) * 1e3  # NS alone at this rate (links ideal)
        for name, variant in (("muon", "standard"), ("muon-overlap", "standard"), ("muon-gram", "auto")):
            tax = med[name] - med["adamw"]
            rows.append([label, name, med["adamw"], med[name], tax, ideal[variant], tax / ideal[variant],
                         predicted if variant == "standard" else float("nan")])
            report_ratio(f"muon-tax/ideal/{label.replace(' ', '-')}/{name}", tax / ideal[variant], "<=1.25")
        print(f"{label}: matmul rate per rank {rate / 1e9:.1f} GFLOP/s")
    print_table(["mesh", "optimizer", "adamw ms", "muon ms", "tax ms", "ideal ms", "tax/ideal",
                 "sim busiest-rank NS ms"], rows)


if __name__ == "__main__":
    main()
