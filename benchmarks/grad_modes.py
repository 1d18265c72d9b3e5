"""hpf.shard_step's two grad modes, side by side on GPT tiny and small, 2 ranks, gloo:

  autograd    plain torch.autograd through the unit engine (units freed after use, re-gathered
              in backward, each unit's reduction overlapping the rest of backward)
  torch.func  torch.func.grad_and_value of loss_fn with respect to the micro-batch's anchor; each
              block (hpf.models' each_block -> UnitList.apply) rematerialized: only its input is
              kept, its unit gathered again and its forward recomputed under torch.func.vjp in
              backward

Prints median step times and ``RATIO torch.func/autograd <config> ...``: the faster mode is
shard_step's default (grad="autograd"). ``--memory``: peak per rank of each mode (GPT small and
medium, 2 and 4 ranks; benchmarks/memory_model.py's measurement) and their ratio.
Run: python benchmarks/grad_modes.py [--rounds N] [--memory]
"""
from __future__ import annotations

import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import median_ms, parse_step_args, print_table, report_ratio, step_bench_parser, time_steps

WORLD = 2
MODES = ("autograd", "torch.func")


def rank_main(rank, args, config_name):
    config = gpt.CONFIGS[config_name]
    params = gpt.init(config, hpf.random.key(0))
    local = args.batch // WORLD
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    impls = {}
    for mode in MODES:
        step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": WORLD}), grad=mode,
                              optimizer=hpf.optim.adamw(lr=1e-3, weight_decay=0.1))
        box = [step.init(params)]

        def run(batch, step=step, box=box):
            box[0], metrics = step(box[0], batch)
            return metrics["loss"]
        impls[mode] = run

    def same_first_loss(losses):
        first = [l[0] for l in losses.values()]
        if max(first) - min(first) > 1e-5:
            raise RuntimeError(f"the modes disagree at step 0: {losses}")
    times, _, _ = time_steps(impls, batches, args, after_warmup=same_first_loss)
    return {m: median_ms(t) for m, t in times.items()}


def memory():
    from memory_model import measured_peak
    for config, local in (("small", 4), ("medium", 1)):
        for ranks in (2, 4):
            peaks = {mode: measured_peak(config, ranks, local, grad=mode) for mode in MODES}
            ratio = peaks["torch.func"] / peaks["autograd"]
            print(f"GPT {config}, {ranks} ranks, {local} sequences per rank: peak per rank autograd "
                  f"{peaks['autograd'] / 2**20:.1f} MiB, torch.func {peaks['torch.func'] / 2**20:.1f} MiB, "
                  f"ratio {ratio:.3f} (target <= 1.15)", flush=True)
            report_ratio(f"grad_memory/{config}-{ranks}r", ratio, "<=1.15")


def main():
    ap = step_bench_parser(__doc__, warmup=2, rounds=5, calls=3)
    ap.add_argument("--memory", action="store_true", help="only the peak memory of each mode")
    args = parse_step_args(ap)
    if args.memory:
        return memory()
    rows = []
    for name in ("tiny", "small"):
        med = launch(rank_main, WORLD, args, name, timeout=1800)[0]
        rows.append([name, med["autograd"], med["torch.func"], med["torch.func"] / med["autograd"]])
    print(f"median step time (ms), {WORLD} ranks, gloo, global batch {args.batch}:")
    print_table(["config", "autograd", "torch.func", "torch.func/autograd"], rows)
    for name, _, _, ratio in rows:
        report_ratio(f"torch.func/autograd-{name}", ratio)


if __name__ == "__main__":
    main()
