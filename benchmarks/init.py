"""Init at scale: each rank's time and peak memory to reach its sharded train state, three ways,
side by side on the same model and ranks:

  generator  the full params built on every rank from one torch.Generator (randn per param, as the
             models drew before hpf.random), then step.init(full params)
  born       step.init(functools.partial(gpt.init, config), key=...): each rank draws its shards alone
  fsdp2      FSDP2's recipe: the nn.Module on the meta device, fully_shard per block and root,
             to_empty, then each rank initializes its local shards (normal_ / ones_)

Each contender runs in fresh processes (one launch per contender and round, in rotated order), so
its peak RSS is its own: the peak growth is the rank's maximum RSS after init minus its RSS just
before, against its sharded state (params, grads and AdamW's two moments) plus the largest param.

    python benchmarks/init.py [--config medium] [--world-size 4] [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import functools
import math
import resource
import statistics
import time

import torch
import torch.distributed as dist

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import print_table, report_ratio

CONTENDERS = ("generator", "born", "fsdp2")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _generator_params(config):
    """The full params as the models drew them from a torch.Generator (std 0.02, ones for norms)."""
    g = torch.Generator().manual_seed(0)
    meta = gpt.init(config, device="meta")
    return hpf.tree.map_with_path(
        lambda path, x: torch.ones(x.shape) if x.dim() == 1 else torch.randn(x.shape, generator=g) * gpt.INIT_STD, meta)


def _fsdp2_init(config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from step_vs_fsdp2 import GPTModule

    with torch.device("meta"):
        model = GPTModule(gpt.init(config, device="meta"), config.n_heads)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():  # reset_parameters on the local shard alone
            local = p.to_local()
            local.fill_(1.0) if p.dim() == 1 else local.normal_(0.0, gpt.INIT_STD)
    opt = torch.optim.AdamW(model.parameters())  # moments made lazily; count the grads' and moments' bytes below
    return model, opt


def _rank(rank: int, name: str, config_name: str):
    torch.set_num_threads(1)
    config = gpt.CONFIGS[config_name]
    mesh = hpf.Mesh({"dp": dist.get_world_size()})
    step = hpf.shard_step(gpt.loss_for(config), mesh=mesh, optimizer=hpf.optim.adamw(lr=1e-3)) \
        if name != "fsdp2" else None
    dist.barrier()
    before, t0, cpu0 = _rss(), time.perf_counter(), time.process_time()
    if name == "generator":
        state = step.init(_generator_params(config))
    elif name == "born":
        state = step.init(functools.partial(gpt.init, config), key=hpf.random.key(0))
    else:
        _fsdp2_init(config)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if step is not None:
        shard_bytes = sum(s.numel() * s.element_size() for s in state.params)
        step.close()
    else:
        shard_bytes = 0
    return {"seconds": seconds, "cpu": cpu, "growth": max(peak - before, 0), "shard_bytes": shard_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="medium", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--quick", action="store_true", help="GPT tiny, one round")
    args = ap.parse_args()
    config_name, rounds = ("tiny", 1) if args.quick else (args.config, args.rounds)
    config, names = gpt.CONFIGS[config_name], list(args.only)
    runs = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(launch(_rank, args.world_size, name, config_name, timeout=1800))
    # the state: params, grads and AdamW's two moments, each a shard; plus the largest param
    shard = max(max(x["shard_bytes"] for x in rnd) for n in runs for rnd in runs[n]) or None
    largest = max(math.prod(x.shape) * 4 for x in hpf.tree.flatten(gpt.init(config, device="meta"))[1])
    rows = []
    for name, rnds in runs.items():
        seconds = statistics.median(max(x["seconds"] for x in rnd) for rnd in rnds)  # the slowest rank, median round
        cpu = statistics.median(max(x["cpu"] for x in rnd) for rnd in rnds)
        growth = statistics.median(max(x["growth"] for x in rnd) for rnd in rnds)
        rows.append((name, seconds, cpu, growth / 2**20, growth / (4 * shard + largest) if shard else float("nan")))
    print(f"GPT {config_name!r} ({gpt.num_params(config) / 1e6:,.1f}M params) on {args.world_size} ranks, "
          f"{rounds} round(s); state per rank {4 * shard / 2**20:,.1f} MiB (params, grads, 2 moments), largest param "
          f"{largest / 2**20:,.1f} MiB")
    print_table(("init", "seconds (slowest rank, median)", "CPU s (rank)", "peak growth MiB", "growth / (state + largest)"),
                rows)
    by = {r[0]: r for r in rows}
    if "born" in by:
        report_ratio(f"init_growth/state_plus_largest[{config_name},{args.world_size}]", by["born"][4], "<=1.2")
        for other in ("generator", "fsdp2"):
            if other in by:
                report_ratio(f"init_time_born/{other}[{config_name},{args.world_size}]",
                             by["born"][1] / by[other][1], "<=1.0")
                report_ratio(f"init_cpu_born/{other}[{config_name},{args.world_size}]",
                             by["born"][2] / by[other][2], "<=1.0")


if __name__ == "__main__":
    main()
