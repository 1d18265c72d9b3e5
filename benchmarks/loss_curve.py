"""A long loss curve: hpf on a 2x2 mesh (4 ranks) vs a single-process reference, same data.

The reference is plain torch autograd and torch.optim.AdamW on the full, unsharded GPT;
both see global batch ``step`` of the same synthetic Markov source (hpf's ranks each take
their rows of it). Prints the Pearson correlation of the two curves (target >= 0.999999),
their largest relative difference, and the first and last losses.
Usage: python benchmarks/loss_curve.py [--steps 1000] [--config tiny] [--batch 16] [--lr 3e-3]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import report_ratio

MESH = {"node": 2, "local": 2}


def adamw_args(args) -> dict:
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def hpf_curve(rank: int, args) -> list[float]:
    config = gpt.CONFIGS[args.config]
    mesh = hpf.Mesh(MESH)
    step = hpf.shard_step(gpt.loss_for(config), mesh=mesh, optimizer=hpf.optim.adamw(**adamw_args(args)))
    state = step.init(gpt.init(config, hpf.random.key(args.seed)))
    batches = gpt.synthetic_batches(config, args.batch, args.seed, rank=rank, world_size=mesh.size)
    losses = []
    for _ in range(args.steps):
        state, metrics = step(state, next(batches))
        losses.append(metrics["loss"])
    return losses  # a list: hpf.launch's result collection cannot take numpy arrays yet


def reference_curve(args) -> np.ndarray:
    config = gpt.CONFIGS[args.config]
    params = gpt.init(config, hpf.random.key(args.seed))
    leaves = [p.requires_grad_() for p in hpf.tree.flatten(params)[1]]
    opt = torch.optim.AdamW(leaves, **adamw_args(args))
    loss_fn = gpt.loss_for(config)
    losses = []
    for s in range(args.steps):
        loss = loss_fn(params, gpt.global_batch(config, args.batch, args.seed, s))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--config", default="tiny", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--batch", type=int, default=16, help="global batch size, a multiple of 4")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    sharded = np.array(launch(hpf_curve, hpf.Mesh(MESH).size, args, timeout=7200)[0])
    t1 = time.perf_counter()
    torch.set_num_threads(1)  # as each rank: small models only lose from intra-op threads here
    reference = reference_curve(args)
    t2 = time.perf_counter()
    pearson = float(np.corrcoef(sharded, reference)[0, 1])
    rel = np.abs(sharded - reference) / np.abs(reference)
    print(f"GPT {args.config}, {args.steps} steps, global batch {args.batch}, AdamW {adamw_args(args)}")
    print(f"hpf on mesh {MESH} ({t1 - t0:.0f} s) vs single-process torch autograd + torch.optim.AdamW "
          f"({t2 - t1:.0f} s)")
    print(f"loss first/last: hpf {sharded[0]:.6f} -> {sharded[-1]:.6f}, "
          f"reference {reference[0]:.6f} -> {reference[-1]:.6f}")
    print(f"Pearson correlation: {pearson:.9f} (1 - r = {1 - pearson:.1e})   (target >= 0.999999)")
    print(f"max relative loss difference: {rel.max():.3e} (step {int(rel.argmax())}), "
          f"median {np.median(rel):.3e}")
    report_ratio("loss-curve/pearson", pearson, ">=0.999999")
    report_ratio("loss-curve/max-rel-diff", float(rel.max()))


if __name__ == "__main__":
    main()
