"""The framework's own CPU time per FSDP unit per step, on a deep, narrow GPT in one process.

Each contender trains the same 32-block GPT (33 FSDP units with the root) on one rank, where
there is nothing to communicate, so what a step costs beyond the plain model is the
framework's bookkeeping per unit: building views, gathering (copying) and freeing, hooks,
reductions (copies), the optimizer on flat shards. The figure is
``(step - replica step) / units`` for:
  replica     the same pure loss function with plain autograd and torch.optim.AdamW(foreach)
              on the unsharded params: no framework at all;
  hpf-flat    hpf.shard_step on a 1-rank mesh;
  hpf-2tier   the same with hpf.Topology() (two-tier collectives);
  fsdp2       fully_shard on every block and the root of the same model as an nn.Module.
On an accelerator this CPU time is what bounds small units (MoE experts, narrow layers).
Usage: python benchmarks/unit_overhead.py [--layers 32] [--rounds 5] [--calls 20]
"""
from __future__ import annotations

import argparse

import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import interleaved, median_ms, print_table, report_ratio, step_runner
from step_vs_fsdp2 import adamw_step, fsdp2_gpt

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def replica(params, config):
    """Plain torch on the full params: the no-framework step the others are measured against."""
    leaves = [p.clone().requires_grad_() for p in hpf.tree.flatten(params)[1]]
    tree = hpf.tree.unflatten(hpf.tree.flatten(params)[2], leaves)
    loss_fn = gpt.loss_for(config)
    return adamw_step(lambda batch: loss_fn(tree, batch), ADAMW, lambda loss: float(loss.detach()), leaves)


def hpf_step(params, config, **kwargs):
    return step_runner(hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": 1}),
                                      optimizer=hpf.optim.adamw(**ADAMW), **kwargs), params)


def rank_main(rank, args):
    torch.set_num_threads(1)
    config = gpt.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=args.layers, n_heads=2)
    params = gpt.init(config, hpf.random.key(0))
    batch = gpt.global_batch(config, 2, 0, 0)
    contenders = {"replica": replica(params, config), "hpf-flat": hpf_step(params, config),
                  "hpf-2tier": hpf_step(params, config, topology=hpf.Topology()),
                  "fsdp2": adamw_step(fsdp2_gpt(params, config, (1,)), ADAMW, loss_value=lambda loss: float(loss))}
    for run in contenders.values():
        for _ in range(3):
            run(batch)
    times = interleaved({n: (lambda run=run: run(batch)) for n, run in contenders.items()},
                        rounds=args.rounds, calls=args.calls)
    return {n: median_ms(t) for n, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    med = launch(rank_main, 1, args, timeout=1800)[0]
    units = args.layers + 1
    per_unit = {n: (ms - med["replica"]) * 1e3 / units for n, ms in med.items() if n != "replica"}
    print(f"GPT, {args.layers} blocks of d_model 16 ({units} FSDP units), 1 rank, 1 thread; median of "
          f"{args.rounds * args.calls} interleaved steps each")
    print_table(["contender", "ms/step", "framework us/unit/step"],
                [[n, ms, per_unit.get(n, 0.0)] for n, ms in med.items()])
    for n in ("hpf-flat", "hpf-2tier"):
        report_ratio(f"{n}_us_per_unit", per_unit[n], "<=100")
        report_ratio(f"{n}/fsdp2_per_unit", per_unit[n] / per_unit["fsdp2"], "<=0.10")


if __name__ == "__main__":
    main()
