"""Flat FSDP collectives: one async torch.distributed collective per bucket and op.

`BucketComm` is the engine's `UnitComm` when no `hpf.Topology` is given: all-gather and
reduce-scatter over each bucket's shard group, and for HSDP an all-reduce over its replicas,
chained after the reduce-scatter.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..planning import Plan
from .cost import bucket_comm_bytes, count_bytes, dtype_bytes
from .ordered import OrderedReduction
from .handles import DONE, Handle, is_done, on_device, reduce_scatter_async, wait_for
from .transport import OwnedGroups

__all__ = ["BucketComm"]


class _Chain:
    """A reduce-scatter whose replica all-reduce starts once it has landed."""

    def __init__(self, first: Handle, then: Callable[[], Any]):
        self.first, self.then, self.second = first, then, None

    def _start_second(self) -> None:
        if self.second is None:
            wait_for(self.first)
            self.second = self.then()

    def wait(self, timeout: float | None = None) -> bool:
        if self.second is None and not wait_for(self.first, timeout):
            return False
        self._start_second()
        return wait_for(self.second, timeout)

    def done(self) -> bool:
        if self.second is None and not is_done(self.first):
            return False
        self._start_second()
        return is_done(self.second)


class BucketComm:
    """Flat FSDP collectives for each bucket on torch.distributed process groups (async ops).

    Reduce-scatter and all-reduce sum; the engine divides once, by the data-parallel
    size, after every sum has landed, so the mean is exact in the reduce dtype.
    """

    slow = None  # no slow tier of its own: every collective runs at full precision
    lowbit = None

    def is_shared(self, b: int) -> bool:
        """Whether bucket b's full buffer is transport-owned shared memory (never freed)."""
        return False

    def capture_low_bit(self) -> None:
        """Nothing crosses a slow tier low-bit here, so there is nothing to keep."""

    def low_bit_captures(self) -> list:
        return []

    def __init__(self, plan: Plan, device: torch.device, compute_dtypes, reduce_dtypes):
        self.plan, self.device = plan, device
        mesh = plan.mesh
        # A group per kind of collective and byte size: ranks that issue different buckets then
        # wait on different groups (a named error from hpf.comm.schedule) instead of pairing them
        # (gloo aborts the process on a size mismatch). Replica all-reduces start when a poll finds
        # their reduce-scatter landed, a moment that differs across ranks: on groups of their own,
        # no other collective can interleave.
        self._owned = OwnedGroups(mesh)  # its own (a new mesh per step once left them all behind), closed with it

        def group(b, axes, kind, dtype):
            return self._owned(axes, f"{kind}/{b.padded_numel * dtype_bytes(dtype)}B") if mesh.axis_size(axes) > 1 \
                else None
        self.gather_groups = [group(b, b.shard_axes, "gather", compute_dtypes[b.index]) for b in plan.buckets]
        self.reduce_groups = [None if b.frozen else group(b, b.shard_axes, "reduce", reduce_dtypes[b.index])
                              for b in plan.buckets]
        self.replica_groups = [None if b.frozen else group(b, b.replicate_axes, "replica", reduce_dtypes[b.index])
                               for b in plan.buckets]
        self.bytes: Counter = Counter()  # (op, tier) -> bytes this rank sent (hpf.comm.cost's model)
        self.reduce_ordered = OrderedReduction(plan, self._owned, False, self.bytes, device)  # (the invariant mode's)
        self._op_bytes = [bucket_comm_bytes(mesh, b, compute_dtypes[b.index], reduce_dtypes[b.index])
                          for b in plan.buckets]

    def full_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.plan.buckets[b].padded_numel, dtype=dtype, device=self.device)

    grad_buffer = full_buffer

    def all_gather(self, b: int, out: torch.Tensor, shard: torch.Tensor) -> Handle:
        g = self.gather_groups[b]
        if g is None:
            out.copy_(shard)
            return DONE
        count_bytes(self.bytes, "all_gather", self._op_bytes[b]["all_gather"])
        return on_device(dist.all_gather_single(out, shard, group=g, async_op=True), self.device)

    def reduce(self, b: int, shard: torch.Tensor, flat: torch.Tensor) -> Handle:
        """shard <- this rank's slice of the sum of every data-parallel rank's flat grad."""
        g = self.reduce_groups[b]
        if g is None:
            if shard.data_ptr() != flat.data_ptr():
                shard.copy_(flat)
            handle = DONE
        else:
            count_bytes(self.bytes, "reduce_scatter", self._op_bytes[b]["reduce_scatter"])
            handle = on_device(reduce_scatter_async(shard, flat, g), self.device)
        rg = self.replica_groups[b]
        if rg is None:
            return handle
        count_bytes(self.bytes, "all_reduce", self._op_bytes[b]["all_reduce"])
        return _Chain(handle, lambda: on_device(dist.all_reduce(shard, group=rg, async_op=True), self.device))

    def close(self) -> None:
        self._owned.close()
        self.gather_groups = self.reduce_groups = self.replica_groups = []
