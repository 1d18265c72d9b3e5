"""Batched vs per-matrix Newton-Schulz, and fp32 vs bf16 compute, on this machine's device.

Prints median wall times and the ratio looped/batched per set; the batched call is what Muon
uses for same-shape matrices (MoE experts, equal layers). The variants being compared run
alternately, so load from other processes falls on both alike.
Run: python benchmarks/ns_batched.py [--reps 7] [--threads 1]
"""
import argparse
import statistics
import time

import torch

from hpf_kernels import newton_schulz

from common import report_ratio


def sync():
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def median_ms(fns: dict, reps: int) -> dict:
    """Median wall time (ms) of each zero-arg function, run alternately after one warm-up each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--large", type=int, default=1024, help="side of the large matrices")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    sets = [(256, 64, 64), (64, 128, 128), (4, args.large, args.large)]
    print(f"{'set':>18} {'batched ms':>11} {'looped ms':>10} {'looped/batched':>15}")
    for count, m, n in sets:
        X = torch.randn(count, m, n, device=device)
        reps = args.reps if m < 512 else max(1, args.reps // 2)
        t = median_ms({"batched": lambda: newton_schulz(X),
                       "looped": lambda: [newton_schulz(x) for x in X]}, reps)
        print(f"{count:>5} x ({m}x{n}) {t['batched']:>11.1f} {t['looped']:>10.1f} "
              f"{t['looped'] / t['batched']:>14.1f}x")
        report_ratio(f"ns-looped/batched/{count}x{m}x{n}", t["looped"] / t["batched"], ">=3" if m < 512 else "")

    print("\ncompute dtype, batched (error vs fp64: fp32 ~1e-6, bf16 ~1e-2)")
    print(f"{'set':>18} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16/fp32':>10}")
    for count, m, n in sets[:2]:
        X = torch.randn(count, m, n, device=device)
        t = median_ms({"fp32": lambda: newton_schulz(X, compute_dtype=torch.float32),
                       "bf16": lambda: newton_schulz(X, compute_dtype=torch.bfloat16)}, 3)
        print(f"{count:>5} x ({m}x{n}) {t['fp32']:>9.1f} {t['bf16']:>9.1f} "
              f"{t['bf16'] / t['fp32']:>9.1f}x")


if __name__ == "__main__":
    main()
