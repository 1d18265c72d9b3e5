"""What the invariant mode costs: its step against the default step on the same mesh, side by side.

GPT (small by default) on 4 ranks, the same params and batches, interleaved timed steps:
  default        hpf.shard_step on the mesh dp=4 (flat collectives);
  invariant      the same with invariant=True, atom_size = the local batch (one atom per rank:
                 the default's shapes; the tree's adds, the all-to-all of nodes, one more all-reduce);
  invariant/a2   atoms of half the local batch (two per rank: the mode on a smaller world);
  default-2tier  the mesh node=2,local=2 with hpf.Topology() (the two-tier collectives);
  invariant-2tier  the same, invariant (its reductions in two ordered stages: a machine's ranks, then machines).
Prints the ratios of median step times, and the bytes each sends per step on each tier.
Usage: python benchmarks/invariant_cost.py [--config small] [--batch 8] [--rounds 5]
"""
from __future__ import annotations

from collections import Counter

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import (config_of, median_ms, mib, parse_step_args, print_table, report_ratio, step_bench_parser,
                    step_runner, time_steps)

WORLD = 4
FLAT, TWO_TIER = {"dp": 4}, {"node": 2, "local": 2}


def contenders(params, config, local: int) -> dict:
    """name -> (mesh axes, shard_step options)."""
    return {"default": (FLAT, {}), "invariant": (FLAT, {"invariant": True, "atom_size": local}),
            "invariant/a2": (FLAT, {"invariant": True, "atom_size": max(local // 2, 1)}),
            "default-2tier": (TWO_TIER, {"topology": hpf.Topology()}),
            "invariant-2tier": (TWO_TIER, {"topology": hpf.Topology(), "invariant": True, "atom_size": local})}


def rank_main(rank, args):
    config = config_of(args)
    params = gpt.init(config, hpf.random.key(0))
    local = args.batch // WORLD
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    steps = {n: hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh(axes), max_grad_norm=1.0,
                               optimizer=hpf.optim.adamw(lr=1e-3, weight_decay=0.1), **options)
             for n, (axes, options) in contenders(params, config, local).items()}
    impls = {n: step_runner(s, params) for n, s in steps.items()}
    warm = {}
    times, losses, _ = time_steps(impls, batches, args, after_warmup=lambda _: warm.update(
        {n: s.stats() for n, s in steps.items()}))
    timed = args.rounds * args.calls
    sent = {n: {f"{op}/{tier}": b / timed for (op, tier), b in (s.stats() - warm[n]).bytes.items() if b}
            for n, s in steps.items()}
    for s in steps.values():
        s.close()
    return {"times": times, "losses": losses, "sent": sent}


def main():
    ap = step_bench_parser(__doc__, warmup=2, rounds=5, calls=2)
    args = parse_step_args(ap)
    config = config_of(args)
    print(f"GPT {args.config} ({gpt.num_params(config) / 1e6:.2f}M params), global batch {args.batch}, {WORLD} ranks, "
          "gloo")
    out = launch(rank_main, WORLD, args, timeout=3600)[0]
    med = {n: median_ms(t) for n, t in out["times"].items()}
    print(f"median step time over {len(out['times']['default'])} interleaved steps each (rank 0):")
    print_table(["contender", "ms/step", "bytes sent per step (rank 0)"],
                [[n, med[n], ", ".join(f"{k} {mib(v)}" for k, v in sorted(out["sent"][n].items()))] for n in med])
    report_ratio("invariant/default", med["invariant"] / med["default"], "<=1.15")
    report_ratio("invariant_a2/default", med["invariant/a2"] / med["default"])
    report_ratio("invariant-2tier/default-2tier", med["invariant-2tier"] / med["default-2tier"])
    for mine, base in (("invariant", "default"), ("invariant-2tier", "default-2tier")):
        slow = [sum(v for k, v in out["sent"][n].items() if k.endswith("/slow")) for n in (mine, base)]
        total = [sum(out["sent"][n].values()) for n in (mine, base)]
        report_ratio(f"{mine}/{base}_bytes", total[0] / total[1], "<=1.01" if mine == "invariant" else "")
        if slow[1]:
            report_ratio(f"{mine}/{base}_slow_bytes", slow[0] / slow[1], "")


if __name__ == "__main__":
    main()
