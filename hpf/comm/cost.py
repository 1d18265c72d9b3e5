"""The byte model of hpf's collectives: the bytes one rank sends, per op and per tier.

The comms' byte counters, the plan report (hpf/report.py) and any simulator read this one
model. Tiers: "fast" (peers that differ only in the mesh's fast axes: a host, a supernode)
and "slow" (the links between them). A peer is across the slow tier when it differs from
the rank in a slow mesh axis.

Model: a collective over a group of n ranks in which each rank contributes c bytes makes
every rank send c bytes to each of its n - 1 peers (a direct exchange; a ring sends the same
total). Hierarchical collectives exchange along the slow axes only the 1/n_fast part of the
data that the fast tier has already gathered or reduced. An all-reduce is a reduce-scatter
plus an all-gather: twice the bytes.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..mesh import Mesh

__all__ = ["OPS", "TIERS", "BucketLayout", "bucket_comm_bytes", "collective_bytes", "count_bytes",
           "dtype_bytes", "ring_bytes"]

TIERS = ("fast", "slow")
# A bucket's collectives in one step: gather params and reduce-scatter grads over its shard
# axes, all-reduce its grad shard over its replicate axes (HSDP).
OPS = ("all_gather", "reduce_scatter", "all_reduce")


class BucketLayout(Protocol):
    """What the model reads of a bucket (``hpf.plan.Bucket`` has it)."""

    shard_axes: tuple[str, ...]  # the FSDP axes it is split over
    replicate_axes: tuple[str, ...]  # the FSDP axes it is replicated over

    @property
    def shard_numel(self) -> int: ...  # elements of one rank's shard


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def ring_bytes(full_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of a ``full_bytes`` buffer
    (the transports' counters; ``collective_bytes`` splits the same total by tier)."""
    return full_bytes * (world_size - 1) // world_size


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


def bucket_comm_bytes(mesh: Mesh, bucket: BucketLayout, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                      hierarchical: bool = False) -> dict[str, dict[str, int]]:
    """Bytes one rank sends per op and tier for one call of each of ``bucket``'s collectives:
    {op: {tier: bytes}} for the ops in OPS. Params travel in ``compute_dtype``, grads in
    ``reduce_dtype``; ``hierarchical``: two-stage (fast tier first) collectives."""
    out = {op: dict.fromkeys(TIERS, 0) for op in OPS}
    frozen = getattr(bucket, "frozen", False)  # no grads: nothing to reduce
    if bucket.shard_axes:
        for op, dtype in (("all_gather", compute_dtype), ("reduce_scatter", reduce_dtype)):
            if op == "all_gather" or not frozen:
                out[op] = collective_bytes(mesh, bucket.shard_axes, bucket.shard_numel * dtype_bytes(dtype), hierarchical)
    m = mesh.axis_size(bucket.replicate_axes)
    if m > 1 and not frozen:
        part = -(-bucket.shard_numel // m) * dtype_bytes(reduce_dtype)
        out["all_reduce"] = {t: 2 * n for t, n in
                             collective_bytes(mesh, bucket.replicate_axes, part, hierarchical).items()}
    return out


def count_bytes(counter, op: str, tiers: dict[str, int]) -> None:
    """Add one collective's bytes per tier to ``counter[op, tier]`` (the comms' byte counters)."""
    for tier, n in tiers.items():
        counter[op, tier] += n
