"""Two ways of running a step train alike: 20 steps of each model, flat (2 ranks) and two-tier
(2x2), fp32, from the same params on the same batches.

  --compare compile   eager blocks vs ``loss_for(config, compile=True)`` (targets: loss 1e-5, params 1e-4)
  --compare grad      grad="autograd" vs grad="torch.func" (targets: 1e-5 both)

Prints per case the largest relative loss difference over the steps and the largest relative
difference of any param leaf after the last step (||b - a|| / ||a||). Not a timing: the machine
need not be quiet.

    python benchmarks/mode_exactness.py --compare compile|grad [--steps 20] [--models gpt,llama,moe] [--quick]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hpf  # noqa: E402
from common import report_ratio  # noqa: E402
from hpf.models import gpt, llama, moe  # noqa: E402

MODELS = {"gpt": (gpt, "small"), "llama": (llama, "small"), "moe": (moe, "tiny")}
MESHES = {"flat": ({"dp": 2}, None), "two-tier": ({"node": 2, "local": 2}, hpf.Topology())}
#: --compare: (the two ways as shard_step/loss_for options, the targets for losses and params)
COMPARE = {"compile": (({"compile": False}, {"compile": True}), (1e-5, 1e-4)),
           "grad": (({"grad": "autograd"}, {"grad": "torch.func"}), (1e-5, 1e-5))}


def train(rank, model: str, mesh: str, steps: int, way: dict):
    module, name = MODELS[model]
    config = module.CONFIGS[name]
    axes, topology = MESHES[mesh]
    mesh_ = hpf.Mesh(axes)
    step = hpf.shard_step(module.loss_for(config, compile=way.get("compile", False)), mesh=mesh_, topology=topology,
                          optimizer=hpf.optim.adamw(lr=1e-3, weight_decay=0.1), grad=way.get("grad", "autograd"))
    state = step.init(module.init(config, hpf.random.key(0)))
    batches = module.synthetic_batches(config, 8, 0, rank=rank, world_size=mesh_.size)
    losses = []
    for _ in range(steps):
        state, m = step(state, next(batches))
        losses.append(m["loss"])
    return losses, [p.numpy() for p in hpf.tree.flatten(step.full_params(state))[1]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=sorted(COMPARE), required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="GPT flat only, 5 steps")
    args = ap.parse_args()
    (way_a, way_b), (loss_tol, param_tol) = COMPARE[args.compare]
    models = args.models.split(",")
    cases = [("gpt", "flat")] if args.quick else [(m, t) for m in models for t in MESHES]
    steps = 5 if args.quick else args.steps
    for model, mesh in cases:
        world = 4 if mesh == "two-tier" else 2
        a = hpf.launch(train, world, model, mesh, steps, way_a, timeout=1800)[0]
        b = hpf.launch(train, world, model, mesh, steps, way_b, timeout=1800)[0]
        loss_rel = max(abs(x - y) / abs(y) for x, y in zip(b[0], a[0]))
        param_rel = max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(b[1], a[1]))
        case = f"{model}-{MODELS[model][1]}/{mesh}"
        print(f"{case:<20} {steps} steps, {way_b} vs {way_a}: loss rel diff max {loss_rel:.2e} (target <= {loss_tol:g}), "
              f"param rel diff max {param_rel:.2e} (target <= {param_tol:g}); final loss {a[0][-1]:.5f}", flush=True)
        report_ratio(f"{args.compare}_exact/{case}/loss", loss_rel, f"<={loss_tol:f}".rstrip("0"))
        report_ratio(f"{args.compare}_exact/{case}/params", param_rel, f"<={param_tol:f}".rstrip("0"))


if __name__ == "__main__":
    main()
