"""The two comm interfaces, and the torch.distributed transport.

- `Transport`: one tier's collectives over flat shards (shared memory, a process group).
- `UnitComm`: the FSDP engine's per-bucket collectives, built from transports or process
  groups (`hpf.comm.flat.BucketComm`, `hpf.comm.tiered.TieredComm`). Both return handles
  (hpf.comm.handles: what a collective in flight is, and how it is waited for).

Callers (the FSDP engine) pick a transport per tier: `ShmGroup` inside one host (CPU ranks),
`ProcessGroupTransport` elsewhere (gloo, NCCL, HCCL; a symmetric-memory transport can sit
behind the same protocol later). Buffers come from the transport itself
(`buffer(key, numel, dtype)`), because the fast transports need them in memory they own.

Byte counters: `bytes_sent[op]` counts the bytes this rank puts on the link under the
bandwidth-optimal (ring) schedule, whatever the library really does, so tiers and runs
compare: all-gather and reduce-scatter send (n-1)/n of the full buffer's bytes,
all-reduce twice that. (On gloo hpf reduce-scatters with an all-to-all, which sends exactly
that; shared memory sends nothing on a wire, but a peer reads the same amount.)
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..precision import SlowPrecision
from .cost import ring_bytes
# the handles' names, importable from here too (their home: hpf.comm.handles)
from .handles import DONE, Handle, PointToPoint, StreamWork, exchange_async, is_done, on_device, reduce_scatter_async, wait_for

__all__ = ["OwnedGroups", "Transport", "ProcessGroupTransport", "UnitComm", "Handle", "DONE", "is_done", "wait_for", "StreamWork", "on_device",
           "reduce_scatter_async", "exchange_async", "PointToPoint"]

REDUCE_OPS = ("sum", "mean")


@runtime_checkable
class Transport(Protocol):
    """Collectives over flat shards: rank r owns elements [r*k, (r+1)*k) of a full buffer, or,
    with ``blocks`` b > 1, the r-th k-element piece of each of the full buffer's b equal blocks
    (``full.view(b, world_size, k)[:, r]``: a node-major two-tier stage, hpf.comm.tiered)."""

    rank: int
    world_size: int
    bytes_sent: Counter  # op -> bytes this rank sent (ring convention, see module doc)
    calls: Counter  # op -> number of calls

    def buffer(self, key: object, numel: int, dtype: torch.dtype, *, per_rank: bool = False) -> torch.Tensor:
        """The same tensor for the same key on every call. per_rank: this rank's own
        region (a reduce_scatter/all_reduce input); otherwise one buffer all ranks see
        (an all_gather output)."""
        ...

    def barrier(self) -> None: ...

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, blocks: int = 1) -> None:
        """full <- every rank's shard in its place (full.numel() == world_size * shard.numel())."""
        ...

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, op: str = "sum", blocks: int = 1) -> None:
        """out <- this rank's part of the sum (or mean) of every rank's full."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """tensor <- sum (or mean) of every rank's tensor, in place."""
        ...


@runtime_checkable
class UnitComm(Protocol):
    """The FSDP engine's collectives, per plan bucket b (hpf.engine.UnitEngine calls them).

    Every rank issues them in the same order. Reductions sum; the engine divides by the
    data-parallel size once every sum has landed.
    """

    bytes: Counter  # (op, tier) -> bytes this rank sent, by hpf.comm.cost's model
    #: the low-bit slow tier's format choice (None: full precision, or no slow tier)
    slow: SlowPrecision | None
    #: the slow tier's quantized stages and error-feedback residuals (None: no low-bit slow tier);
    #: named, not imported: hpf.comm.lowbit imports this module
    lowbit: "LowBitTier | None"

    #: the invariant mode's reduction in the canonical order (hpf.comm.ordered.OrderedReduction):
    #: ``reduce_ordered(b, shard, nodes, per_rank) -> Handle``
    reduce_ordered: "OrderedReduction"

    def is_shared(self, b: int) -> bool:
        """Whether bucket b's full buffer is transport-owned shared memory (never freed)."""
        ...

    def full_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Bucket b's gathered (padded) flat buffer, for the engine to keep."""
        ...

    def grad_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer for bucket b's full grads, the input of ``reduce``."""
        ...

    def all_gather(self, b: int, out: torch.Tensor, shard: torch.Tensor) -> Handle:
        """out <- every shard-group rank's ``shard`` of bucket b, in shard order."""
        ...

    def reduce(self, b: int, shard: torch.Tensor, flat: torch.Tensor) -> Handle:
        """shard <- this rank's slice of the sum of every data-parallel rank's flat grad."""
        ...

    def close(self) -> None:
        """Stop workers and release transports (shared memory)."""
        ...

    def capture_low_bit(self) -> None:
        """Validation mode: keep, from now on, what each low-bit slow-tier collective sent and
        what arrived."""
        ...

    def low_bit_captures(self) -> list:
        """What ``capture_low_bit`` kept: ``(kind, bucket, [(flat offset, exact, as received)])`` per
        bucket and kind ("weights", "grads") that crosses the slow tier low-bit, the same entries
        on every rank; ``[]`` when nothing is kept."""
        ...


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def check_shards(full: torch.Tensor, shard: torch.Tensor, world_size: int, full_name: str, shard_name: str,
                 blocks: int = 1) -> int:
    """Validate a full/shard pair; return the numel of one of the shard's ``blocks`` pieces."""
    if full.dtype != shard.dtype:
        raise ValueError(f"{full_name} is {full.dtype} but {shard_name} is {shard.dtype}; they must match")
    if not full.is_contiguous():
        raise ValueError(f"{full_name} must be contiguous")
    if full.numel() != world_size * shard.numel():
        raise ValueError(
            f"{full_name} has {full.numel()} elements, but {shard_name} has {shard.numel()} and "
            f"world_size is {world_size}: {full_name} must hold exactly world_size shards "
            "(pad the flat buffer to a multiple of world_size)")
    if shard.numel() % blocks:
        raise ValueError(f"{shard_name} has {shard.numel()} elements, not {blocks} equal blocks")
    return shard.numel() // blocks


def by_rank(full: torch.Tensor, world_size: int, blocks: int, k: int) -> torch.Tensor:
    """``full`` as [world_size, blocks, k], rank r's part at [r] (a strided view)."""
    return full.view(blocks, world_size, k).transpose(0, 1)


class BufferCache:
    """Buffers by key: `get` makes one on first use, and errors if a key comes back with another spec."""

    def __init__(self):
        self._entries: dict[object, tuple[tuple, object]] = {}

    def get(self, key, numel: int, dtype: torch.dtype, per_rank: bool, make):
        spec = (numel, dtype, per_rank)
        if key not in self._entries:
            self._entries[key] = (spec, make())
        old, value = self._entries[key]
        if old != spec:
            raise ValueError(f"buffer {key!r} exists as (numel, dtype, per_rank)={old}, asked for {spec}; "
                             "use a new key for a different buffer")
        return value

    def values(self) -> list:
        return [value for _, value in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()


class CallCounters:
    """The `Transport` protocol's counters, kept the same way by every transport."""

    def __init__(self):
        self.bytes_sent: Counter = Counter()
        self.calls: Counter = Counter()

    def _count(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes_sent[op] += nbytes


class ProcessGroupTransport(CallCounters):
    """`Transport` over a torch.distributed process group (all_gather_single / reduce_scatter_single)."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            on_accelerator = torch.accelerator.is_available() and dist.get_backend(group) != "gloo"
            device = torch.accelerator.current_accelerator() if on_accelerator else "cpu"
        self.device = torch.device(device)
        self._buffers = BufferCache()

    def buffer(self, key, numel, dtype, *, per_rank=False):
        return self._buffers.get(key, numel, dtype, per_rank,
                                 lambda: torch.empty(numel, dtype=dtype, device=self.device))

    def barrier(self):
        dist.barrier(group=self.group)

    def all_gather_into(self, full, shard, blocks=1):
        """With ``blocks`` > 1 the ranks' shards arrive rank-major in a scratch buffer and are
        copied to their places: one pass over the full buffer (gloo gathers contiguously)."""
        k = check_shards(full, shard, self.world_size, "full", "shard", blocks)
        mine = full.view(-1)[self.rank * k:(self.rank + 1) * k]
        if shard.data_ptr() == mine.data_ptr():
            shard = shard.clone()  # in place: not every backend allows input aliasing output
        into = full.view(-1) if blocks == 1 else torch.empty_like(full).view(-1)
        dist.all_gather_single(into, shard.reshape(-1).contiguous(), group=self.group)
        if blocks > 1:
            by_rank(full, self.world_size, blocks, k).copy_(into.view(self.world_size, blocks, k))
        self._count("all_gather", ring_bytes(full.numel() * full.element_size(), self.world_size))

    def reduce_scatter(self, out, full, op="sum", blocks=1):
        """With ``blocks`` > 1 the input is first copied rank-major (one pass over it)."""
        check_op(op)
        k = check_shards(full, out, self.world_size, "full", "out", blocks)
        if blocks > 1:
            full = by_rank(full, self.world_size, blocks, k).contiguous()
        result = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        reduce_scatter_async(result.view(-1), full.view(-1), self.group).wait()
        if op == "mean":
            result.div_(self.world_size)  # gloo has no AVG; sum then divide on every backend
        if result is not out:
            out.copy_(result)
        self._count("reduce_scatter", ring_bytes(full.numel() * full.element_size(), self.world_size))

    def all_to_all(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """out[j] <- rank j's rows[this rank], for [world_size, k] rows (the low-bit slow tier's
        reduction: each rank sums the rows it receives itself). Not in the Transport protocol:
        only the slow tier, always a process group, needs it."""
        check_shards(rows.view(-1), rows[0], self.world_size, "rows", "rows[0]")
        dist.all_to_all_single(out.view(-1), rows.reshape(-1).contiguous(), group=self.group)
        self._count("all_to_all", ring_bytes(rows.numel() * rows.element_size(), self.world_size))

    def all_reduce(self, tensor, op="sum"):
        check_op(op)
        dist.all_reduce(tensor, group=self.group)
        if op == "mean":
            tensor.div_(self.world_size)
        self._count("all_reduce", 2 * ring_bytes(tensor.numel() * tensor.element_size(), self.world_size))


_INSTANCES = itertools.count()


class OwnedGroups:
    """The tagged process groups one comm makes for itself, destroyed by its ``close``. Each tag
    carries the comm's instance number (every rank builds its comms in the same order, so the
    numbers agree): no other comm shares them, on this mesh or another (a step's workers may
    still gather the next step's first units while another step runs). It holds the mesh too
    (``Mesh.hold``), so a closed step leaves the process's groups, sockets and threads as they
    were, whether its mesh is reused or new."""

    def __init__(self, mesh):
        self.mesh, self.instance, self.owned = mesh, next(_INSTANCES), set()
        mesh.hold()  # (the mesh's shared groups go when the last comm on it closes)

    def __call__(self, axes: tuple[str, ...], tag: str):
        tag = f"{tag}#{self.instance}"
        self.owned.add((axes, tag))
        return self.mesh.group(axes, tag=tag)

    def close(self) -> None:
        if self.mesh is None:
            return
        for axes, tag in self.owned:
            self.mesh.drop_group(axes, tag=tag)
        self.mesh.release()
        self.mesh, self.owned = None, set()
