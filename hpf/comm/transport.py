"""The two comm interfaces, and the torch.distributed transport.

- `Transport`: one tier's collectives over flat shards (shared memory, a process group).
- `UnitComm`: the FSDP engine's per-bucket collectives, built from transports or process
  groups (`hpf.comm.flat.BucketComm`, `hpf.comm.tiered.TieredComm`).

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

import datetime
import itertools
import threading
import time
from collections import Counter
from typing import Any, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist

from ..precision import SlowPrecision
from .cost import ring_bytes

__all__ = ["OwnedGroups", "Transport", "ProcessGroupTransport", "UnitComm", "Handle", "DONE", "is_done", "wait_for", "StreamWork", "on_device",
           "reduce_scatter_async", "exchange_async"]

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


class _Pollable(Protocol):
    """A collective in flight (hpf's own handles)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (None) or at most ``timeout`` s; True if done (its error re-raised)."""
        ...

    def done(self) -> bool: ...


# What a UnitComm's collectives return: one of hpf's handles, or a torch.distributed Work
# (which says is_completed() instead of done()); `is_done` reads both.
Handle = Union[_Pollable, dist.Work]


class _Done:
    """A finished collective: lets single-rank groups skip communication with one code path."""

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def done(self) -> bool:
        return True


DONE = _Done()


def is_done(handle: Handle) -> bool:
    """Whether a collective handle (ours, or a torch.distributed Work) has finished; never blocks."""
    return handle.done() if hasattr(handle, "done") else work_done(handle)


def work_done(work: dist.Work) -> bool:
    """Whether a torch.distributed Work has finished; never blocks. It reads the Work's future,
    not ``is_completed()``: under torch's profiler, gloo finishes a Work by running a callback
    that needs the GIL while holding the lock that ``is_completed()`` takes with the GIL held,
    a deadlock whenever the collective was issued inside saved-tensor hooks (the engine's are)."""
    try:
        return work.get_future().done()
    except RuntimeError:  # a Work without a future (gloo's point-to-point)
        return work.is_completed()


class StreamWork:
    """A collective on an accelerator (NCCL, HCCL) on its comm stream. ``wait`` puts the compute
    stream after it, as FSDP2 does, so compute waits only for the unit it needs and the CPU runs
    on; ``settled(works)`` is a handle that blocks the CPU until they finished on the device (the
    step's end, where a hang must surface as a named error, not inside a later device sync)."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work):
        self.work = work

    def wait(self, timeout: float | None = None) -> bool:
        self.work.wait()
        return True

    def done(self) -> bool:
        return work_done(self.work)

    @staticmethod
    def settled(works: list["StreamWork"]) -> "_Polled":
        return _Polled([w.work for w in works])


class _Polled:
    """Works whose ``wait(timeout)`` polls their completion on the CPU."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(work_done(w) for w in self.works):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        for w in self.works:
            w.wait()  # re-raises a failure
        return True

    def done(self) -> bool:
        return all(work_done(w) for w in self.works)


def on_device(work: dist.Work, device: torch.device) -> Handle:
    """``work`` as the engine waits on it: a StreamWork on an accelerator, itself on the CPU."""
    return work if device.type == "cpu" else StreamWork(work)


class PointToPoint:
    """Point-to-point requests (``world.exchange``'s) as one handle that a timed wait leaves valid.
    gloo's send and receive complete only inside ``wait``, and a timed wait that times out
    completes them with its error: polled directly, a transfer slower than the poll is lost (seen
    under load). The first timed wait hands the blocking waits to a thread; timed waits poll it."""

    def __init__(self, works: list):
        self.works, self._done, self._error = works, None, None

    def wait(self, timeout: float | None = None) -> bool:
        if self._done is None:
            if timeout is None:
                for w in self.works:
                    w.wait()
                return True
            self._done = threading.Event()
            threading.Thread(target=self._wait_all, name="hpf-p2p-wait", daemon=True).start()
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 -- raised by the wait that sees it
            self._error = e
        finally:
            self._done.set()


def wait_for(handle: Handle, timeout: float | None = None) -> bool:
    """Wait for any handle, at most ``timeout`` s (None: until done); True if it is done, and
    then its error, if it failed, is raised. A torch.distributed collective still running after
    a timed wait stays valid (waiting again picks it up); point-to-point requests only inside a
    ``PointToPoint``."""
    if not isinstance(handle, dist.Work):
        return handle.wait(timeout)
    if timeout is None:
        handle.wait()
        return True
    try:
        handle.wait(datetime.timedelta(seconds=timeout))
        return True
    except RuntimeError:  # c10d's "Operation timed out!", or the work's own error
        if not work_done(handle):
            return False
        handle.wait()  # (done since: a timeout that lost the race to completion is no error; a failure re-raises)
        return True


class _OnArrival:
    """An all-to-all in flight: once it has landed, ``finish(recv)`` runs once (on the thread
    that first sees it done) and the receive buffer is dropped."""

    def __init__(self, work: dist.Work, recv: torch.Tensor, finish):
        self.work, self.recv, self.finish = work, recv, finish

    def wait(self, timeout: float | None = None) -> bool:
        if not wait_for(self.work, timeout):
            return False
        if self.recv is not None:
            recv, self.recv = self.recv, None
            self.finish(recv)
        return True

    def done(self) -> bool:
        if self.recv is None:
            return True
        if not work_done(self.work):
            return False
        return self.wait()


def _sum_in_rank_order(out: torch.Tensor, recv: torch.Tensor) -> None:
    """By elementwise adds (torch.sum over dim 0: 3-5x slower)."""
    slices = recv.view(-1, out.numel())
    if len(slices) == 1:
        out.copy_(slices[0])
    else:
        torch.add(slices[0], slices[1], out=out)
    for s in slices[2:]:
        out.add_(s)


def reduce_scatter_async(out: torch.Tensor, full: torch.Tensor, group=None) -> Handle:
    """out <- this rank's slice of the sum over ``group`` of every rank's ``full``, async.

    On gloo, reduce_scatter is an all-reduce of a copy made on the calling thread (2x the
    bytes of a ring); an all-to-all of the slices plus a local sum of the p that arrive sends
    (p-1)/p of them and measured 2-2.6x faster on 2 and 4 CPU ranks (1-16 MiB). Other
    backends have a native reduce-scatter. The sum runs in rank order: the same on every run."""
    if dist.get_backend(group) != "gloo":
        return dist.reduce_scatter_single(out, full, group=group, async_op=True)
    # freed once summed (a pool of these would keep the peak of in-flight reductions for good)
    recv = torch.empty_like(full, memory_format=torch.contiguous_format)
    work = dist.all_to_all_single(recv, full, group=group, async_op=True)
    return _OnArrival(work, recv, lambda arrived: _sum_in_rank_order(out.view(-1), arrived))


def exchange_async(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, finish) -> Handle:
    """An all-to-all of uneven parts (``send_splits[j]`` elements of ``send`` to group rank j,
    ``recv_splits[i]`` from group rank i); ``finish(recv)`` runs on arrival (the invariant mode's
    reductions sum what arrives in their own order: hpf.comm.ordered)."""
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
    return _OnArrival(work, recv, finish)


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
