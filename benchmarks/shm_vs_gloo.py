"""All-gather and reduce-scatter on one host: ShmGroup vs gloo, fp32, median over reps.

    python benchmarks/shm_vs_gloo.py [--mib 1 4 16 64] [--world-sizes 2 4] [--reps 7]

Sizes are the full (gathered) buffer. Each rep starts after a gloo barrier; a rep's time is
the slowest rank's. Columns:
  gloo          dist.all_gather_single / dist.reduce_scatter_single
  shm           ShmGroup: all-gather copies the shard in; reduce-scatter includes copying
                the grad into this rank's shared row (as a drop-in replacement would)
  shm in place  all-gather of a shard that already lives in the shared buffer (barrier
                only); reduce-scatter of a grad already written into the shared row
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hpf.comm import ShmGroup
from hpf.launcher import launch


def _time(fn, reps: int) -> list[float]:
    fn()  # warm-up: first touch of pages, gloo's connections
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _bench(rank, sizes_mib, reps):
    n = dist.get_world_size()
    largest = (max(sizes_mib) << 20) // 4 // n * n
    group = ShmGroup(None, nbytes=(n + 1) * largest * 4 + (1 << 20))
    shm_full_all = group.buffer("full", largest, torch.float32)
    shm_grad_all = group.buffer("grad", largest, torch.float32, per_rank=True)
    rows = []
    for mib in sizes_mib:
        numel = (mib << 20) // 4 // n * n
        k = numel // n
        full = torch.randn(numel)
        shard = torch.randn(k)
        out = torch.empty(k)
        shm_full, shm_grad = shm_full_all[:numel], shm_grad_all[:numel]
        own_slice = shm_full[rank * k:(rank + 1) * k]

        def shm_rs_with_copy():
            shm_grad.copy_(full)
            group.reduce_scatter(out, shm_grad)

        measured = {
            ("all-gather", "gloo"): _time(lambda: dist.all_gather_single(full, shard), reps),
            ("all-gather", "shm"): _time(lambda: group.all_gather_into(shm_full, shard), reps),
            ("all-gather", "shm in place"): _time(lambda: group.all_gather_into(shm_full, own_slice), reps),
            ("reduce-scatter", "gloo"): _time(lambda: dist.reduce_scatter_single(out, full), reps),
            ("reduce-scatter", "shm"): _time(shm_rs_with_copy, reps),
            ("reduce-scatter", "shm in place"): _time(lambda: group.reduce_scatter(out, shm_grad), reps),
        }
        rows.append((mib, measured))
    everyone = [None] * n
    dist.all_gather_object(everyone, rows)
    if rank != 0:
        return None
    table = []
    for i, (mib, measured) in enumerate(rows):  # per rep, the slowest rank; then the median
        for (op, kind), _ in measured.items():
            per_rep = zip(*(r[i][1][(op, kind)] for r in everyone))
            table.append((n, mib, op, kind, statistics.median(max(t) for t in per_rep)))
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, fp32, median of {args.reps} reps (slowest rank per rep)")
    print(f"{'ranks':>5} {'MiB':>4} {'op':<15} {'gloo ms':>9} {'shm ms':>8} {'ratio':>6} "
          f"{'in place ms':>11} {'ratio':>6}")
    for n in args.world_sizes:
        table = launch(_bench, n, args.mib, args.reps, timeout=1800)[0]
        times = {(mib, op, kind): t for _, mib, op, kind, t in table}
        for mib in args.mib:
            for op in ("all-gather", "reduce-scatter"):
                gloo, shm, in_place = (times[(mib, op, kind)] for kind in ("gloo", "shm", "shm in place"))
                print(f"{n:>5} {mib:>4} {op:<15} {gloo * 1e3:>9.2f} {shm * 1e3:>8.2f} {gloo / shm:>5.1f}x "
                      f"{in_place * 1e3:>11.3f} {gloo / in_place:>5.0f}x")


if __name__ == "__main__":
    main()
