"""Slow-tier bytes of distributed Muon on a two-tier mesh: the plan's figure and the engine's counters.

GPT small, 4 ranks (node=2, local=2), gloo, one training step per layout:
  hierarchical  hpf's two-tier plan (shards numbered fast axes first, two-stage collectives):
                today's layout; neighbouring shards sit on different nodes, so every matrix that
                straddles a shard boundary straddles the nodes.
  flat          Topology(hierarchical=False): shards numbered node-major (neighbours share a
                node) and flat collectives: what renumbering the shards would give Muon.
Per layout: Muon's bytes (hpf.optim.dist_muon.muon_traffic, and DistMuon.bytes_sent /
slow_bytes_sent summed over ranks for one step), and the FSDP collectives' slow-tier bytes
per step (the comm's counters), since the layout moves those too. The baseline is the
pre-topology-aware owner rule's 8.50 MiB (issue 40). Target: Muon's slow bytes <= 0.5x that.
Usage: python benchmarks/muon_slow_bytes.py [--config small]
"""
from __future__ import annotations

import argparse

import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from hpf.optim.dist_muon import muon_traffic

from common import print_table, report_ratio

MIB = 2 ** 20
BEFORE_MIB = 8.50  # issue 40's figure for the owner rule before topology-aware owners


def rank_main(rank, config_name, hierarchical):
    config = gpt.CONFIGS[config_name]
    step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"node": 2, "local": 2}),
                          optimizer=hpf.optim.muon(adamw_lr=1e-3), topology=hpf.Topology(hierarchical=hierarchical))
    state = step.init(gpt.init(config, hpf.random.key(0)))
    batch = gpt.global_batch(config, 8, 0, 0)[rank * 2:(rank + 1) * 2]
    state, _ = step(state, batch)  # (the first step: the counters start at 0)
    opt, before = step.plan_optimizer, step.stats().bytes
    sent = (opt.bytes_sent, opt.slow_bytes_sent)
    state, _ = step(state, batch)
    fsdp = step.stats().bytes - before
    out = {"muon": (opt.bytes_sent - sent[0], opt.slow_bytes_sent - sent[1]),
           "fsdp_slow": sum(v for (op, tier), v in fsdp.items() if tier == "slow"),
           "plan": muon_traffic(hpf.optim.muon(), step.plan)}
    step.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small")
    args = ap.parse_args()
    rows = []
    for label, hierarchical in (("hierarchical (today)", True), ("node-major (flat collectives)", False)):
        out = launch(rank_main, 4, args.config, hierarchical, timeout=900)
        plan_total, plan_slow = out[0]["plan"]
        sent = sum(r["muon"][0] for r in out)
        slow = sum(r["muon"][1] for r in out)
        fsdp_slow = sum(r["fsdp_slow"] for r in out)
        rows.append([label, plan_slow / MIB, slow / MIB, plan_total / MIB, sent / MIB, fsdp_slow / MIB])
        report_ratio(f"muon-slow-bytes/before/{label.split()[0]}", slow / MIB / BEFORE_MIB, "<=0.5")
    print(f"GPT {args.config}, 4 ranks (node=2, local=2); Muon bytes sent per step, all ranks (pieces to owners and "
          f"results back); before topology-aware owners: {BEFORE_MIB} MiB slow")
    print_table(["layout", "muon slow MiB (plan)", "muon slow MiB (engine)", "muon total MiB (plan)",
                 "muon total MiB (engine)", "FSDP slow MiB/step, all ranks"], rows)


if __name__ == "__main__":
    main()
