"""Gram Newton-Schulz against the standard iteration: time and orthogonality, fp32.

On 256x1024 and 1024x4096 Gaussian matrices (a fresh one per shape, seed 0), both variants of
hpf_kernels.newton_schulz with the same coefficients and steps, run alternately. On a CPU the
figure is process CPU time on one thread (--threads): on a shared machine, wall time mostly
measures the neighbours; wall medians are printed beside it. Printed per shape and schedule:
  time       median ms of each, and gram/standard (target <= 0.6);
  orth       ||U Uᵀ - I||_F on the short side, and gram/standard (target <= 1.1). Keller's quintic
             does not converge to orthogonal (singular values end in ~[0.7, 1.1]), so its error is
             the schedule's own and equal for both; Polar Express converges, and shows the rounding;
  vs fp64    max |U - U_64| against the same variant's fp64 result, and the FLOP model's ratio.
Run: python benchmarks/newton_schulz.py [--rounds 5] [--quick]
"""
import argparse
import statistics
import time

import torch

from hpf_kernels import newton_schulz, newton_schulz_flops

from common import print_table, report_ratio

SHAPES = [(256, 1024), (1024, 4096)]
SCHEDULES = [("keller", 5), ("polar_express", 8)]


def sync():
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def medians(fns: dict, rounds: int, cpu: bool) -> tuple[dict, dict]:
    """Median ms per function, (CPU or wall, wall), calls alternating, order rotated each round."""
    names, used, wall = list(fns), {n: [] for n in fns}, {n: [] for n in fns}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t, w = time.process_time(), time.perf_counter()
            fns[n]()
            used[n].append(time.process_time() - t if cpu else time.perf_counter() - w)
            wall[n].append(time.perf_counter() - w)
    return ({n: 1e3 * statistics.median(v) for n, v in used.items()},
            {n: 1e3 * statistics.median(v) for n, v in wall.items()})


def orth_error(U: torch.Tensor) -> float:
    U = U.double()
    G = U @ U.mT if U.shape[-2] <= U.shape[-1] else U.mT @ U
    return torch.linalg.matrix_norm(G - torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (default 1)")
    ap.add_argument("--quick", action="store_true", help="1 round, the small shape only")
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    rounds = 1 if args.quick else args.rounds
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(args.threads)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} rounds={rounds} "
          f"time={'process CPU' if cpu else 'wall'}")
    rows = []
    for m, n in shapes:
        X = torch.randn(m, n, generator=torch.Generator().manual_seed(0)).to(device)
        for coefficients, steps in SCHEDULES:
            def run(variant, dtype=torch.float32):
                out = newton_schulz(X, coefficients, steps, compute_dtype=dtype, variant=variant)
                sync()
                return out
            out = {v: run(v) for v in ("standard", "gram")}
            exact = {v: run(v, torch.float64) for v in ("standard", "gram")}
            run("standard"), run("gram")  # warm-up
            t, wall = medians({v: (lambda v=v: run(v)) for v in out}, rounds, cpu)
            orth = {v: orth_error(u) for v, u in out.items()}
            drift = {v: (out[v].double() - exact[v]).abs().max().item() for v in out}
            flops = newton_schulz_flops((m, n), steps, "gram") / newton_schulz_flops((m, n), steps, "standard")
            rows.append([f"{m}x{n}", f"{coefficients}/{steps}", t["standard"], t["gram"], t["gram"] / t["standard"],
                         wall["gram"] / wall["standard"], flops, f"{orth['standard']:.3e}", f"{orth['gram']:.3e}",
                         orth["gram"] / orth["standard"],
                         f"{drift['standard']:.1e}", f"{drift['gram']:.1e}"])
            if coefficients == "keller":
                report_ratio(f"ns-gram/standard-time/{m}x{n}", t["gram"] / t["standard"], "<=0.6")
            report_ratio(f"ns-gram/standard-orth/{coefficients}/{m}x{n}", orth["gram"] / orth["standard"], "<=1.1")
    print_table(["shape", "schedule", "std ms", "gram ms", "gram/std", "wall g/s", "flops g/s", "orth std", "orth gram",
                 "orth g/s", "std-fp64", "gram-fp64"], rows)


if __name__ == "__main__":
    main()
