"""MoE training step, 4 ranks (dp=2 x ep=2): hpf vs FSDP2 + expert parallel built the torchtitan way.

  hpf    hpf.shard_step on hpf.models.moe: experts P("ep", fsdp=("dp",)) computed split over ep and
         FSDP over dp, dense params FSDP over (dp, ep); flat buckets, plain tensors; "hpf-2tier"
         adds hpf.Topology() (shared-memory fast tier on ep, backward pipeline).
  fsdp2  the same pure functions in nn.Modules: expert weights are DTensors Shard(0) on the "ep"
         submesh, fully_shard on the "dp" (efsdp) submesh, expert grads divided by the world size
         (torchtitan's dp2ep), every other block param fully_shard over all 4 ranks; the experts
         run on ``to_local()`` blocks.
Both dispatch tokens with the same dist.all_to_all_single calls (counts first, then uneven
splits), so the ratio measures the FSDP engines around the same MoE math. AdamW on both; step 0
losses must agree. Prints ``RATIO moe_step_hpf_vs_fsdp2 <hpf/fsdp2 step time> <=0.75``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hpf  # noqa: E402
from common import median_ms, print_table, report_ratio, step_runner, time_steps  # noqa: E402
from hpf.comm import collectives  # noqa: E402
from hpf.launcher import launch  # noqa: E402
from hpf.models import moe  # noqa: E402

AXES = {"dp": 2, "ep": 2}
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


class Params(nn.Module):
    """A dict of tensors as parameters with the same names."""

    def __init__(self, tensors: dict):
        super().__init__()
        for k, v in tensors.items():
            self.register_parameter(k, v if isinstance(v, nn.Parameter) else nn.Parameter(v.clone()))

    def tree(self) -> dict:
        return dict(self._parameters)


class Experts(Params):
    """Expert weights as DTensors Shard(0) on the ep mesh; the experts run on their local blocks."""

    def __init__(self, tensors: dict, config, ep_mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__({k: nn.Parameter(distribute_tensor(v.clone(), ep_mesh, [Shard(0)])) for k, v in tensors.items()})
        self.config = config

    def forward(self, h, idx, gates):
        local = {k: p.to_local() for k, p in self._parameters.items()}
        return moe.routed_experts(h, idx, gates, local, self.config.n_experts, "ep")


class Block(Params):
    def __init__(self, tensors: dict, config, ep_mesh):
        super().__init__({k: v for k, v in tensors.items() if not isinstance(v, dict)})
        self.dicts = [k for k, v in tensors.items() if isinstance(v, dict) and k != "experts"]
        for k in self.dicts:  # ffn / shared: flattened into this module's params as k__name
            for n, v in tensors[k].items():
                self.register_parameter(f"{k}__{n}", nn.Parameter(v.clone()))
        self.config = config
        self.experts = Experts(tensors["experts"], config, ep_mesh) if "experts" in tensors else None

    def forward(self, x):
        p = dict(self._parameters)
        blk = {k: v for k, v in p.items() if not any(k.startswith(d + "__") for d in self.dicts)}
        for d in self.dicts:
            blk[d] = {n: p[f"{d}__{n}"] for n in ("w1", "w2", "w3")}
        if self.experts is not None:
            blk["router"] = p["router"]
        return moe.block(blk, x, None, self.config, "ep", experts=self.experts)[0]


class MoEModule(Params):
    def __init__(self, params: dict, config, ep_mesh):
        super().__init__({k: v for k, v in params.items() if k != "blocks"})
        self.blocks = nn.ModuleList(Block(b, config, ep_mesh) for b in params["blocks"])

    def forward(self, batch):
        x = torch.nn.functional.embedding(batch[:, :-1], self.embed)
        for b in self.blocks:
            x = b(x)
        return moe.head_loss(self.tree(), x, batch[:, 1:])


def make_fsdp2(params, config, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", tuple(AXES.values()), mesh_dim_names=tuple(AXES))
    model = MoEModule(params, config, mesh["ep"])
    flat = mesh._flatten("dp_ep")
    for b in model.blocks:
        if b.experts is not None:
            fully_shard(b.experts, mesh=mesh["dp"])
        fully_shard(b, mesh=flat)
    fully_shard(model, mesh=flat)
    opt = torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW)
    # Expert grads / the global DP degree: torchtitan sets gradient_divide_factor=world, which
    # reduces with PREMUL_SUM; gloo lacks it, so the efsdp mean is rescaled by efsdp/world.
    expert_grads = [p for b in model.blocks if b.experts is not None for p in b.experts.parameters()]
    scale = AXES["dp"] / world
    spmd = collectives.SPMD(hpf.Mesh(AXES), dist.get_rank(), ())

    def step(batch):
        with collectives.spmd(spmd):
            loss = model(batch)
            loss.backward()
        torch._foreach_mul_([p.grad for p in expert_grads], scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        return float(t) / world
    return step


def make_hpf(params, config, topology=None):
    data = tuple(AXES)
    step = hpf.shard_step(moe.loss_for(config, ep_axis="ep"), mesh=hpf.Mesh(AXES),
                          optimizer=hpf.optim.adamw(**ADAMW), param_specs=moe.param_specs(config, "ep", data),
                          fsdp_axes=data, topology=topology)
    return step_runner(step, params)


def _rank(rank, args):
    world = dist.get_world_size()
    config = moe.CONFIGS[args.config]
    params = moe.init(config)
    rows = args.batch // world
    batches = [moe.global_batch(config, args.batch, 0, s)[rank * rows:(rank + 1) * rows] for s in range(4)]
    impls = {"hpf": make_hpf(params, config), "hpf-2tier": make_hpf(params, config, hpf.Topology()),
             "fsdp2": make_fsdp2(params, config, world)}

    def check(losses):
        b = losses["fsdp2"][0]
        for name in ("hpf", "hpf-2tier"):
            if abs(losses[name][0] - b) > 1e-4 * abs(b):
                raise AssertionError(f"step 0 losses differ: {name} {losses[name][0]} vs fsdp2 {b}")
    times, losses, cpu = time_steps(impls, batches, args, after_warmup=check)
    return {n: (median_ms(t), statistics.median(cpu[n]) * 1e3) for n, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(moe.CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.warmup, args.config = 2, 1, 1, "tiny"
    res = launch(_rank, 4, args, timeout=1800)
    r0 = res[0]
    print_table(["impl", "step ms (median, rank 0)", "CPU ms"], [[n, f"{t:.1f}", f"{c:.1f}"] for n, (t, c) in r0.items()])
    report_ratio("moe_step_hpf_vs_fsdp2", r0["hpf"][0] / r0["fsdp2"][0], "<=0.75")
    report_ratio("moe_step_hpf_two_tier_vs_fsdp2", r0["hpf-2tier"][0] / r0["fsdp2"][0], "<=0.75")


if __name__ == "__main__":
    main()
