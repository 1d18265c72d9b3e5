"""Batched vs per-matrix Newton-Schulz, and fp32 vs bf16 compute, on this machine's device.

Prints median wall times and the ratio looped/batched per set; the batched call is what Muon
uses for same-shape matrices (MoE experts, equal layers). Run: python benchmarks/ns_batched.py
"""
import argparse
import statistics
import time

import torch

from hpf_kernels import newton_schulz


def median_seconds(fn, reps):
    fn()  # warm-up
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--large", type=int, default=1024, help="side of the large matrices")
    args = parser.parse_args()
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    sets = [(256, 64, 64), (64, 128, 128), (4, args.large, args.large)]
    print(f"{'set':>18} {'batched ms':>11} {'looped ms':>10} {'looped/batched':>15}")
    for count, m, n in sets:
        X = torch.randn(count, m, n, device=device)
        reps = args.reps if m < 512 else max(1, args.reps // 2)
        batched = median_seconds(lambda: newton_schulz(X), reps)
        looped = median_seconds(lambda: [newton_schulz(x) for x in X], reps)
        print(f"{count:>5} x ({m}x{n}) {batched * 1e3:>11.1f} {looped * 1e3:>10.1f} {looped / batched:>14.1f}x")

    print("\ncompute dtype, batched (fp32 error vs fp64 ~1e-6; bf16 ~1e-2)")
    print(f"{'set':>18} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16/fp32':>10}")
    for count, m, n in sets[:2]:
        X = torch.randn(count, m, n, device=device)
        fp32 = median_seconds(lambda: newton_schulz(X, compute_dtype=torch.float32), 3)
        bf16 = median_seconds(lambda: newton_schulz(X, compute_dtype=torch.bfloat16), 3)
        print(f"{count:>5} x ({m}x{n}) {fp32 * 1e3:>9.1f} {bf16 * 1e3:>9.1f} {bf16 / fp32:>9.1f}x")


if __name__ == "__main__":
    main()
