"""The plan report: per-rank memory and per-step communication, computed from the plan alone.

Byte model (also what the engine's counters use): a collective over a group of n ranks in
which each rank contributes c bytes makes every rank send c bytes to each of its n - 1
peers (direct exchange). A peer is across the slow tier when it differs from the rank in a
slow (non-fast) mesh axis. Hierarchical collectives exchange along the slow axes only the
1/n_fast part of the data that the fast tier has already gathered or reduced.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .mesh import Mesh

__all__ = ["PlanReport", "collective_bytes", "bucket_gather_bytes", "bucket_allreduce_bytes", "dtype_bytes"]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def collective_bytes(mesh: Mesh, axes: tuple[str, ...], contribution: int,
                     hierarchical: bool = False) -> dict[str, int]:
    """Bytes one rank sends per tier for an all-gather or reduce-scatter over ``axes``.

    ``contribution`` is one rank's shard, in bytes. Returns {"fast": b, "slow": b}.
    """
    n = mesh.axis_size(axes)
    n_fast = mesh.axis_size(tuple(a for a in axes if a in mesh.fast_axes))
    n_slow = n // n_fast
    if hierarchical and n_fast > 1 and n_slow > 1:
        return {"fast": contribution * n_slow * (n_fast - 1), "slow": contribution * (n_slow - 1)}
    return {"fast": contribution * (n_fast - 1), "slow": contribution * (n - n_fast)}


def bucket_gather_bytes(mesh: Mesh, bucket, dtype: torch.dtype, hierarchical: bool = False) -> dict[str, int]:
    """Bytes one rank sends per tier to all-gather (or reduce-scatter) one bucket in ``dtype``."""
    if not bucket.shard_axes:
        return {"fast": 0, "slow": 0}
    return collective_bytes(mesh, bucket.shard_axes, bucket.shard_numel * dtype_bytes(dtype), hierarchical)


def bucket_allreduce_bytes(mesh: Mesh, bucket, dtype: torch.dtype, hierarchical: bool = False) -> dict[str, int]:
    """Bytes one rank sends per tier to all-reduce its grad shard over the bucket's replicas
    (HSDP): a reduce-scatter plus an all-gather over the replicate axes."""
    m = mesh.axis_size(bucket.replicate_axes)
    if m == 1:
        return {"fast": 0, "slow": 0}
    part = -(-bucket.shard_numel // m) * dtype_bytes(dtype)
    return {t: 2 * n for t, n in collective_bytes(mesh, bucket.replicate_axes, part, hierarchical).items()}


def count_bytes(counter, op: str, tiers: dict[str, int]) -> None:
    """Add one collective's bytes per tier to ``counter[op, tier]`` (the comms' byte counters)."""
    for tier, n in tiers.items():
        counter[op, tier] += n


@dataclass
class PlanReport:
    world_size: int
    params_bytes: int  # per rank: the stored shards (master dtype)
    grad_bytes: int  # per rank: flat shard grads (reduce dtype)
    optimizer_bytes: int  # per rank
    peak_gathered_bytes: int  # per rank: root + the two largest block units, full, compute dtype
    padded_total_bytes: int  # stored over all ranks: each bucket's padded buffer once per replica
    comm: dict[str, dict[str, int]] = field(default_factory=dict)  # collective -> tier -> bytes/step

    @classmethod
    def of(cls, plan, *, compute_dtype: torch.dtype | None = None, master_dtype: torch.dtype | None = None,
           reduce_dtype: torch.dtype | None = None, optimizer_states: int = 2,
           hierarchical: bool = False, regather: bool = True) -> "PlanReport":
        """``regather=False``: blocks stay gathered through backward (a shared-memory fast tier)."""
        from .planning import ROOT

        mesh = plan.mesh
        last_unit = list(plan.units)[-1]
        params = grads = opt = padded_total = 0
        unit_bytes: dict[str, int] = {}
        comm = {c: {"fast": 0, "slow": 0} for c in ("all_gather", "reduce_scatter", "all_reduce")}
        for b in plan.buckets:
            master = dtype_bytes(master_dtype or b.dtype)
            compute = dtype_bytes(compute_dtype or b.dtype)
            reduce = dtype_bytes(reduce_dtype or master_dtype or b.dtype)
            params += b.shard_numel * master
            grads += b.shard_numel * reduce
            opt += b.shard_numel * 4 * optimizer_states
            replicas = mesh.size // b.shard_size
            padded_total += b.padded_numel * master * replicas
            unit_bytes[b.unit] = unit_bytes.get(b.unit, 0) + b.padded_numel * compute
            # backward re-gathers every block but the last, which is still gathered
            gathers = 2 if regather and b.unit not in (ROOT, last_unit) else 1
            if b.shard_axes:
                for tier, n in bucket_gather_bytes(mesh, b, compute_dtype or b.dtype, hierarchical).items():
                    comm["all_gather"][tier] += gathers * n
                for tier, n in bucket_gather_bytes(mesh, b, reduce_dtype or master_dtype or b.dtype,
                                                   hierarchical).items():
                    comm["reduce_scatter"][tier] += n
            for tier, n in bucket_allreduce_bytes(mesh, b, reduce_dtype or master_dtype or b.dtype,
                                                  hierarchical).items():
                comm["all_reduce"][tier] += n
        blocks = sorted((v for k, v in unit_bytes.items() if k != ROOT), reverse=True)
        peak = unit_bytes.get(ROOT, 0) + sum(blocks[:2])
        return cls(mesh.size, params, grads, opt, peak, padded_total, comm)

    @property
    def comm_total(self) -> dict[str, int]:
        return {t: sum(c[t] for c in self.comm.values()) for t in ("fast", "slow")}

    def format(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:12.2f} MiB"

        lines = [
            f"per-rank memory ({self.world_size} ranks)",
            f"  params (shards)      {mib(self.params_bytes)}",
            f"  grads (shards)       {mib(self.grad_bytes)}",
            f"  optimizer state      {mib(self.optimizer_bytes)}",
            f"  peak gathered units  {mib(self.peak_gathered_bytes)}",
            f"  padded total, all ranks {self.padded_total_bytes / 2**30:.3f} GiB",
            "per-rank bytes sent per step         fast tier          slow tier",
        ]
        for name, tiers in self.comm.items():
            lines.append(f"  {name:<16}  {mib(tiers['fast'])}   {mib(tiers['slow'])}")
        tot = self.comm_total
        lines.append(f"  {'total':<16}  {mib(tot['fast'])}   {mib(tot['slow'])}")
        return "\n".join(lines)
