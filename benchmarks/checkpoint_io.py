"""Checkpoint save/restore throughput: hpf.checkpoint vs DCP on an FSDP2 model, 4 ranks, gloo.

Both hold the same GPT (params + AdamW moments, fp32) sharded over 4 ranks and write it with
torch.distributed.checkpoint to a fresh directory on the same disk, interleaved round by round:
  hpf    step.save(state, path) / step.restore(path) (flat shards cut into per-param chunks)
  fsdp2  dcp.save/dcp.load of get_state_dict(model, optimizer) (DTensors), model built by
         benchmarks/step_vs_fsdp2.fsdp2_gpt
  nocrc  hpf's save and restore without the manifest's CRC-32s (none computed at the save, DCP's
         own file reads at the restore): what the checksums cost
Printed: medians of save and restore seconds and GB/s (state bytes / time), RATIO rows
(hpf time / FSDP2 time, target <= 1.0; hpf time / hpf without checksums, target <= 1.10),
and the async save's exposed time (the part of step.save(..., async_save=True) the caller
waits for: the CPU copy).
Usage: python benchmarks/checkpoint_io.py [--config medium] [--rounds 5] [--dir /tmp] [--quick]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import hpf
from hpf import checkpoint
from hpf.launcher import launch
from hpf.models import gpt

from common import print_table, report_ratio
from step_vs_fsdp2 import fsdp2_gpt

WORLD = 4


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def rank_main(rank: int, config_name: str, rounds: int, root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    config = gpt.CONFIGS[config_name]
    params = gpt.init(config)
    step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": WORLD}), optimizer=hpf.optim.adamw())
    state = step.init(params)

    def restore(path):  # restore donates the state it restores into: go on with the one it returns
        nonlocal state
        state = step.restore(path, state)[0]
    model = fsdp2_gpt(params, config, (WORLD,))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():  # materialize AdamW's moments, as hpf's exist from init
        p.grad = torch.zeros_like(p)
    optim.step()
    del params

    def fsdp2_sd():
        m, o = get_state_dict(model, optim)
        return {"model": m, "optim": o}
    times = {k: [] for k in ("hpf save", "fsdp2 save", "hpf restore", "fsdp2 restore", "hpf async exposed",
                             "hpf save, no checksums", "hpf restore, no checksums")}
    plain = {"sums": lambda root, names, metadata=None: {},  # no CRC-32s at the save ...
             "Reader": lambda path, files: dcp.FileSystemReader(path)}  # ... and DCP's own reads
    checked = {k: getattr(checkpoint, k) for k in plain}

    # one untimed save and restore of each first: the process's first DCP save pays one-off costs
    # (thread pools, planner caches, first writes) that would land on whichever contender goes first
    step.save(state, f"{root}/warm_hpf")
    restore(f"{root}/warm_hpf")
    dcp.save(fsdp2_sd(), checkpoint_id=f"{root}/warm_fsdp2")
    dcp.load(fsdp2_sd(), checkpoint_id=f"{root}/warm_fsdp2")
    dist.barrier()
    if rank == 0:
        for p in ("warm_hpf", "warm_fsdp2"):
            shutil.rmtree(f"{root}/{p}", ignore_errors=True)
    for r in range(rounds):
        for name in ("hpf", "nocrc", "fsdp2")[r % 3:] + ("hpf", "nocrc", "fsdp2")[:r % 3]:
            path = f"{root}/{name}_{r}"
            if name == "nocrc":  # the same save and restore without checksums: DCP's plain file reads
                vars(checkpoint).update(plain)
                try:
                    times["hpf save, no checksums"].append(_timed(lambda: step.save(state, path)))
                    times["hpf restore, no checksums"].append(_timed(lambda: restore(path)))
                finally:
                    vars(checkpoint).update(checked)
            elif name == "hpf":
                times["hpf save"].append(_timed(lambda: step.save(state, path)))
                times["hpf restore"].append(_timed(lambda: restore(path)))
                t = time.perf_counter()
                step.save(state, path + "_async", async_save=True)
                times["hpf async exposed"].append(time.perf_counter() - t)
                step.wait_save()
            else:
                times["fsdp2 save"].append(_timed(lambda: dcp.save(fsdp2_sd(), checkpoint_id=path)))
                times["fsdp2 restore"].append(_timed(lambda: dcp.load(fsdp2_sd(), checkpoint_id=path)))
            dist.barrier()
            if rank == 0:
                for p in (path, path + "_async"):
                    shutil.rmtree(p, ignore_errors=True)
    state_bytes = sum(t.numel() * t.element_size() for t in [*state.params, *state.opt_state.exp_avg,
                                                             *state.opt_state.exp_avg_sq])
    total = torch.tensor([float(state_bytes)])
    dist.all_reduce(total)
    return {k: statistics.median(v) for k, v in times.items()}, float(total) / WORLD  # per replica: no HSDP


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="medium", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    ap.add_argument("--quick", action="store_true", help="the tiny config, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.config, args.rounds = "tiny", 1
    root = tempfile.mkdtemp(prefix="hpf-ckpt-bench-", dir=args.dir)
    try:
        med, nbytes = launch(rank_main, WORLD, args.config, args.rounds, root, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes *= WORLD  # every rank's shard: the whole state once
    gb = nbytes / 1e9
    print(f"GPT {args.config!r}, {WORLD} ranks, params + AdamW moments = {gb:.2f} GB, median of {args.rounds}")
    rows = [(k, f"{v:.3f}", f"{gb / v:.2f}" if "exposed" not in k else "-") for k, v in med.items()]
    print_table(("what", "seconds", "GB/s"), rows)
    report_ratio("checkpoint_save_hpf_vs_fsdp2", med["hpf save"] / med["fsdp2 save"], "<=1.0")
    report_ratio("checkpoint_restore_hpf_vs_fsdp2", med["hpf restore"] / med["fsdp2 restore"], "<=1.0")
    report_ratio("checkpoint_save_checksums_vs_none", med["hpf save"] / med["hpf save, no checksums"], "<=1.10")
    report_ratio("checkpoint_restore_checksums_vs_none", med["hpf restore"] / med["hpf restore, no checksums"],
                 "<=1.10")
    print(f"async save: exposed {med['hpf async exposed'] * 1e3:.1f} ms per save "
          f"({med['hpf async exposed'] / med['hpf save']:.0%} of a blocking save)")


if __name__ == "__main__":
    main()
