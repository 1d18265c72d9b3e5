"""A whole GPT training step with Muon: hpf vs FSDP2 + a Muon that gathers full matrices.

Same params, batches and hyper-parameters, run interleaved in one job (order rotated every round):
  hpf    hpf.shard_step(..., optimizer=hpf.optim.muon(...)): layout-driven distributed Muon on
         the flat shards (each matrix orthogonalized once, by one owner).
  fsdp2  fully_shard on each block and the root of benchmarks/step_vs_fsdp2.py's GPTModule; per
         step, the common pattern: for each DTensor matrix, grad.full_tensor() on every rank,
         Muon momentum and Newton-Schulz on the full matrix, then the local rows of the update
         written into the local shard; torch.optim.AdamW(foreach=True) for the other params.
The Muon math of both is hpf.optim.muon's (the same arithmetic as torch.optim.Muon, see
tests/test_muon.py), with fp32 Newton-Schulz batched over same-shape matrices on both sides:
torch.optim.Muon's own NS runs in bf16, ~20x slower on this CPU, which would flatter hpf.
Step time is the slowest rank's; figures are medians.
Usage: python benchmarks/muon_step.py [--config small] [--world 2] [--batch 8] [--rounds 5] [--calls 2] [--quick]
"""
from __future__ import annotations


import numpy as np
import torch
import torch.distributed as dist

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from hpf.optim.adamw_optimizer import schedule_value
from hpf.optim.muon_math import apply_muon_updates_, muon_direction, update_scale
from hpf.optim.muon_optimizer import muon

from common import median_ms, parse_step_args, print_table, report_ratio, step_bench_parser, time_steps
from step_vs_fsdp2 import fsdp2_gpt, global_mean

MUON = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-3, adamw_weight_decay=0.1)


class GatherAllMuon:
    """Muon for FSDP2's DTensor params: full matrices on every rank, local rows written back."""

    def __init__(self, model: torch.nn.Module, opt):
        self.opt, self.model, self.count = opt, model, 0
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        named = [(name.replace(".", "/"), p) for name, p in model.named_parameters()]
        self.matrices = [p for name, p in named if opt.on_muon(name, p)]
        self.bufs = [torch.zeros(p.shape) for p in self.matrices]  # full momentum, as the full update needs
        self.scales = [update_scale(p.shape[-2], p.shape[-1], opt.scale) for p in self.matrices]
        a = opt.adamw
        self.adamw = torch.optim.AdamW([p for name, p in named if not opt.on_muon(name, p)], lr=a.lr,
                                       betas=a.betas, eps=a.eps, weight_decay=a.weight_decay, foreach=True)

    @torch.no_grad()
    def step(self):
        o = self.opt
        self.count += 1
        lr = schedule_value(o.lr, self.count)
        full_grads = [p.grad.full_tensor() for p in self.matrices]
        directions = muon_direction(full_grads, self.bufs, momentum=o.momentum, nesterov=o.nesterov,
                                    ns_steps=o.ns_steps, coefficients=o.coefficients, compute_dtype=o.ns_compute_dtype)
        for p, d, scale in zip(self.matrices, directions, self.scales):
            local = p.to_local()
            rows = -(-p.shape[0] // self.world)  # FSDP2 shards dim 0 as torch.chunk does
            start = min(self.rank * rows, p.shape[0])
            apply_muon_updates_([local], [d[start:start + local.shape[0]]], lr=lr, weight_decay=o.weight_decay,
                                scale=scale)
        self.adamw.step()
        self.model.zero_grad(set_to_none=True)


def make_fsdp2(params, config, world):
    model = fsdp2_gpt(params, config, (world,))
    opt = GatherAllMuon(model, muon(**MUON))

    def step(batch):
        loss = model(batch)
        loss.backward()
        opt.step()
        return global_mean(loss)
    return step


def make_hpf(params, config, world):
    step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": world}), optimizer=muon(**MUON))
    box = [step.init(params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]
    return run


def rank_main(rank, args):
    config = gpt.CONFIGS[args.config]
    params = gpt.init(config, hpf.random.key(0))
    local = args.batch // args.world
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    impls = {"hpf": make_hpf(params, config, args.world), "fsdp2": make_fsdp2(params, config, args.world)}
    times, losses, _cpu = time_steps(impls, batches, args)
    return {"times": times, "losses": losses}


def main():
    ap = step_bench_parser(__doc__)
    ap.add_argument("--world", type=int, default=2, help="ranks")
    args = parse_step_args(ap)
    config = gpt.CONFIGS[args.config]
    print(f"GPT {args.config} ({gpt.num_params(config) / 1e6:.2f}M params) training step with Muon, "
          f"global batch {args.batch}, {args.world} ranks, gloo")
    out = launch(rank_main, args.world, args, timeout=1800)
    losses = out[0]["losses"]
    steps = min(len(v) for v in losses.values())
    drift = np.max(np.abs(np.array(losses["hpf"][:steps]) - np.array(losses["fsdp2"][:steps])))
    print(f"losses, step 0: hpf {losses['hpf'][0]:.7f}, fsdp2 {losses['fsdp2'][0]:.7f}; "
          f"max difference over {steps} steps: {drift:.2e}")
    if abs(losses["hpf"][0] - losses["fsdp2"][0]) > 1e-5 or drift > 1e-3:
        raise SystemExit("hpf and FSDP2 disagree: they do not train the same model, the comparison is meaningless")
    names = list(out[0]["times"])
    slowest = {n: [max(r["times"][n][i] for r in out) for i in range(len(out[0]["times"][n]))] for n in names}
    med = {n: median_ms(t) for n, t in slowest.items()}
    print_table(["impl", "ms/step (slowest rank, median)", "min ms", "max ms"],
                [[n, med[n], min(t) * 1e3, max(t) * 1e3] for n, t in slowest.items()])
    report_ratio("muon-step-fsdp2/hpf", med["fsdp2"] / med["hpf"], ">=1.2")


if __name__ == "__main__":
    main()
