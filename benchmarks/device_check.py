"""One-shot accelerator check (at most ~8 minutes on one CUDA GPU); never part of CI.

What it checks, each printed as RATIO rows for ``benchmarks/run.py``:
  1. world size 1 on NCCL (``cpu:gloo,cuda:nccl``) comes up and an all-reduce is exact;
  2. hpf's step on the GPU vs the same step on the CPU, fp32 and bf16 (equivalence);
  3. the Triton Newton-Schulz kernel vs the torch reference (accuracy and speed);
  4. batched vs looped Newton-Schulz on the GPU (the batched-NS target missed on CPU);
  5. GPT ``medium`` step time, hpf vs FSDP2 at world size 1 (medians of interleaved steps).
Run on the GPU machine: python benchmarks/device_check.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import hpf
from hpf.models import gpt
from hpf_kernels import newton_schulz

from common import interleaved, report_ratio
from ns_batched import median_ms  # alternating, synced, after one warm-up each


def sync() -> None:
    torch.accelerator.synchronize()


def train_losses(config, device: str, steps: int, mixed_precision=None) -> list[float]:
    """Losses of ``steps`` hpf steps at world size 1 on ``device`` from fixed params and data."""
    step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-3),
                          mixed_precision=mixed_precision)
    state = step.init(gpt.init(config, hpf.random.key(0), device=device))
    batches = gpt.synthetic_batches(config, 8, seed=0, device=device)
    out = []
    for _ in range(steps):
        state, metrics = step(state, next(batches))
        out.append(metrics["loss"])
    return out


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_nccl() -> None:
    t = torch.arange(4.0, device="cuda")
    dist.all_reduce(t)
    report_ratio("nccl/world1-allreduce-exact", float(torch.equal(t.cpu(), torch.arange(4.0))), ">=1")


def check_step_equivalence(steps: int) -> None:
    config = gpt.CONFIGS["small"]
    # The CPU reference runs on a CPU-only step: hpf picks the device from the process group,
    # so it runs first in a separate, group-less phase (see main).
    for name, mp, target in (("fp32", None, "<=0.0001"), ("bf16", "bf16", "<=0.02")):
        cpu = CPU_REFERENCE[name]
        gpu = train_losses(config, "cuda", steps, mp)
        print(f"step losses {name}: cpu {cpu[-1]:.6f}  gpu {gpu[-1]:.6f}")
        report_ratio(f"gpu-vs-cpu/{name}/loss-max-rel-diff", max_rel(gpu, cpu), target)


def check_newton_schulz(reps: int) -> None:
    torch.manual_seed(0)
    for count, m, n in ((16, 1024, 1024), (64, 512, 2048)):
        X = torch.randn(count, m, n, device="cuda")
        ref = newton_schulz(X, backend="reference", compute_dtype=torch.bfloat16).float()
        tri = newton_schulz(X, backend="cuda", compute_dtype=torch.bfloat16).float()
        err = ((tri - ref).norm() / ref.norm()).item()
        report_ratio(f"ns-triton-vs-reference/rel-err/{count}x{m}x{n}", err, "<=0.02")
        t = median_ms({"ref": lambda: newton_schulz(X, backend="reference", compute_dtype=torch.bfloat16),
                       "triton": lambda: newton_schulz(X, backend="cuda", compute_dtype=torch.bfloat16)}, reps)
        report_ratio(f"ns-reference/triton/{count}x{m}x{n}", t["ref"] / t["triton"], ">=1")
    for count, m, n in ((256, 64, 64), (64, 128, 128), (32, 512, 512)):
        X = torch.randn(count, m, n, device="cuda")
        t = median_ms({"batched": lambda: newton_schulz(X), "looped": lambda: [newton_schulz(x) for x in X]}, reps)
        report_ratio(f"gpu/ns-looped/batched/{count}x{m}x{n}", t["looped"] / t["batched"], ">=3")


def check_medium_vs_fsdp2(rounds: int) -> None:
    from step_vs_fsdp2 import GPTModule  # the same GPT math as an nn.Module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = gpt.CONFIGS["medium"]
    params = gpt.init(config, hpf.random.key(0), device="cuda")
    adamw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batch = gpt.global_batch(config, 4, 0, 0).cuda()

    step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(**adamw),
                          mixed_precision="bf16")
    box = [step.init(params)]

    def run_hpf():
        box[0], _ = step(box[0], batch)

    model = GPTModule(params, config.n_heads)
    mesh = init_device_mesh("cuda", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), foreach=True, **adamw)

    def run_fsdp2():
        model(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def synced(fn):
        def call():
            fn()
            sync()
        return call
    contenders = {"hpf": synced(run_hpf), "fsdp2": synced(run_fsdp2)}
    for c in contenders.values():
        c()
        c()
    times = interleaved(contenders, rounds=rounds, calls=3)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(f"GPT medium bf16, batch 4 x {config.seq_len}: hpf {med['hpf']:.1f} ms, FSDP2 {med['fsdp2']:.1f} ms")
    report_ratio("gpu/medium/hpf/fsdp2", med["hpf"] / med["fsdp2"], "<=1.0")


CPU_REFERENCE: dict[str, list[float]] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("device_check.py: no CUDA GPU here, nothing to check (the other benchmarks cover the CPU)")
        return
    steps, reps, rounds = (3, 3, 2) if args.quick else (8, 7, 5)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    # Phase 1, no process group: the CPU reference of the step-equivalence check.
    config = gpt.CONFIGS["small"]
    CPU_REFERENCE["fp32"] = train_losses(config, "cpu", steps)
    CPU_REFERENCE["bf16"] = train_losses(config, "cpu", steps, "bf16")
    # Phase 2: world size 1 on NCCL (gloo kept for CPU tensors), as hpf.launch.init_distributed sets it up.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    hpf.launch.init_distributed(timeout=120)
    try:
        check_nccl()
        check_step_equivalence(steps)
        check_newton_schulz(reps)
        check_medium_vs_fsdp2(rounds)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
