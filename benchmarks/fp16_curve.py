"""fp16 with dynamic loss scaling against fp32: GPT small, the same params, data and AdamW, 2 ranks.

fp16 compute overflows where bf16 does not (its range ends at 65504), so ``mixed_precision="fp16"``
scales the loss (hpf.LossScale, torch.amp.GradScaler's rules): a step whose grads overflow is
skipped and the scale halves; 2000 clean steps double it (here: ``--growth-interval``). Prints
the two curves' largest gap over the last 50 steps, how many fp16 steps were skipped, and
writes docs/results/fp16_curve.json and a PNG of both curves.
Usage: python benchmarks/fp16_curve.py [--steps 200] [--batch 8] [--png docs/fp16_curve.png]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import report_ratio, write_results

WORLD = 2


def curves(rank, args):
    torch.set_num_threads(1)
    config = gpt.CONFIGS["small"]
    mesh = hpf.Mesh({"dp": WORLD})
    runs = {}
    for name, mp in (("fp32", None), ("fp16", "fp16")):
        step = hpf.shard_step(gpt.loss_for(config, weighted=True), mesh=mesh, optimizer=hpf.optim.adamw(lr=args.lr),
                              mixed_precision=mp,
                              **({"loss_scale": hpf.LossScale(growth_interval=args.growth_interval)} if mp else {}))
        runs[name] = [step, step.init(gpt.init(config, hpf.random.key(0))), [], []]
    batches = gpt.synthetic_batches(config, args.batch, 0, rank=rank, world_size=WORLD)
    for _ in range(args.steps):
        batch = next(batches)
        for run in runs.values():  # interleaved: the same batch, step by step
            run[1], m = run[0](run[1], batch)
            run[2].append(m["loss"])
            run[3].append(bool(m["skipped"]))
    return {name: {"loss": run[2], "skipped": run[3]} for name, run in runs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--growth-interval", type=int, default=50)
    ap.add_argument("--png", default=os.path.join(os.path.dirname(__file__), "..", "docs", "fp16_curve.png"))
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "..", "docs", "results",
                                                   "fp16_curve.json"))
    args = ap.parse_args()
    out = launch(curves, WORLD, args, timeout=7200)[0]
    fp32, fp16 = out["fp32"]["loss"], out["fp16"]["loss"]
    skipped = sum(out["fp16"]["skipped"])
    tail = range(max(0, args.steps - 50), args.steps)
    gap = max((abs(fp16[i] - fp32[i]) / fp32[i] for i in tail if not out["fp16"]["skipped"][i]), default=float("nan"))
    print(f"GPT small, {WORLD} ranks, global batch {args.batch}, {args.steps} steps, AdamW lr {args.lr}")
    print(f"fp32 loss {fp32[0]:.4f} -> {fp32[-1]:.4f}; fp16 {fp16[0]:.4f} -> {fp16[-1]:.4f}; "
          f"fp16 skipped {skipped} of {args.steps} steps (first skipped: "
          f"{[i + 1 for i, s in enumerate(out['fp16']['skipped']) if s][:8]})")
    print(f"largest relative gap over the last 50 steps: {gap:.4f}; median of the last 10: fp32 "
          f"{statistics.median(fp32[-10:]):.4f}, fp16 {statistics.median(fp16[-10:]):.4f}")
    report_ratio("fp16/fp32/last50_gap", gap)
    report_ratio("fp16/skipped_steps", float(skipped))
    write_results(args.json, {"steps": args.steps, "batch": args.batch, "lr": args.lr, "world": WORLD, **out})
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, args.steps + 1), fp32, label="fp32")
    ax.plot(range(1, args.steps + 1), fp16, label=f"fp16, loss scaling ({skipped} steps skipped)", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("GPT small, 2 ranks: fp16 with dynamic loss scaling vs fp32")
    ax.legend()
    fig.savefig(args.png, dpi=100, bbox_inches="tight")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
