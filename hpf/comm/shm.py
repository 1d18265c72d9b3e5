"""Shared-memory collectives for the CPU ranks of one host (the fast tier).

All ranks map one segment. An all-gather is "write my shard into the shared full buffer,
then barrier"; when the shard already lives there (params kept in the shared buffer and
updated in place by the optimizer) it is only the barrier. A reduce-scatter is "barrier,
sum my slice over every rank's region, barrier". No bytes go through sockets, and the
barrier is a few int64 counters in the same segment, not a gloo round trip.

Why the segment is a file in /dev/shm mapped with `torch.from_file(shared=True)`, not
`multiprocessing.shared_memory`: on Python < 3.13 every SharedMemory attach registers
with the resource tracker, which starts a tracker process per forked child and unlinks
(with warnings) segments it believes leaked. Here rank 0 creates the file, every rank
maps it, and the name is unlinked as soon as all ranks have mapped it. From then on
nothing can leak, even if a rank is SIGKILLed: the kernel frees the memory when the last
mapping goes, and torch frees a mapping when the last tensor viewing it dies. That is
why there is no atexit hook or finalizer; `close()` only drops this object's views. The
one window left (a creator killed between create and unlink) is swept by
`remove_leftovers`, which `hpf.launch` runs for its children.

Memory ordering: each rank writes only its own counter (own cache line) and reads the
others'. x86 is TSO; on weakly ordered CPUs (AArch64) the data copy and the counter store
are separate torch/CPython calls, between which acquire-release atomics (reference
counts) order them.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import trace
from . import liveness
from .cost import ring_bytes
from .transport import BufferCache, CallCounters, by_rank, check_op, check_shards
from .world import COLLECTIVE_TIMEOUT_S

__all__ = ["ShmGroup", "ShmTimeout", "remove_leftovers"]

SHM_DIR = "/dev/shm"
ALIGN = 64  # one cache line: each barrier counter gets its own, buffers start on one
# Waiting: sched_yield between checks first (about 1 us when the core is free, and it hands
# the core to a late peer when ranks share cores), then sleeps doubling up to 1 ms. Measured
# on 2 loaded cores: pure spinning took 130-470 us per barrier, yielding 11 us (2 ranks) and
# 35 us (4 ranks); gloo's barrier took 1-3.5 ms.
_YIELD_CHECKS = 2000
_MAX_SLEEP_S = 1e-3
_CHUNK = 1 << 18  # fp32 elements (1 MiB) per accumulation chunk for non-fp32 reductions


class ShmTimeout(TimeoutError):
    """A shared-memory barrier waited longer than the group's timeout."""


@dataclass(frozen=True)
class _Region:
    offset: int  # bytes from the segment start
    nbytes: int  # per row
    row_bytes: int  # aligned row stride
    per_rank: bool


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def remove_leftovers(pids: list[int], name_prefix: str = "hpf") -> None:
    """Unlink segments named `<name_prefix>_<pid>_*` (created by processes `pids`, now dead)."""
    if not os.path.isdir(SHM_DIR) or not pids:
        return
    prefixes = tuple(f"{name_prefix}_{pid}_" for pid in pids)
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefixes):
            _unlink_quietly(os.path.join(SHM_DIR, name))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _map_segment(group, rank: int, nbytes: int, name_prefix: str) -> torch.Tensor:
    """Collectively create, map and unlink one segment; return it as a uint8 tensor."""
    path = error = None
    if rank == 0:
        path = os.path.join(SHM_DIR, f"{name_prefix}_{os.getpid()}_{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:  # reserve the pages now: a too small /dev/shm fails here, not as SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            _unlink_quietly(path)
            path, error = None, (f"rank 0 could not create a {nbytes}-byte segment in {SHM_DIR}: {e} "
                                 "(in a container, raise its shared-memory size, e.g. docker --shm-size)")
    box = [path]
    dist.broadcast_object_list(box, group=group, group_src=0)
    path = box[0]
    segment = None
    try:
        if path is not None:
            try:  # from_file would create a missing file: check first (another host has none)
                size = os.stat(path).st_size
                if size != nbytes:
                    raise OSError(f"{path} has {size} bytes, expected {nbytes}")
                segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            except OSError as e:
                error = f"{socket.gethostname()}: {e}"
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)  # doubles as "every rank has mapped it"
    finally:
        if path is not None:  # every rank tries, so a dead creator does not leak the name
            _unlink_quietly(path)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        raise RuntimeError(f"ShmGroup: could not share a segment: {failed}. All ranks of a ShmGroup "
                           "must run on one Linux host with /dev/shm; pass a host-local process group.")
    return segment


class ShmGroup(CallCounters):
    """Shared-memory `Transport` for the ranks of a host-local process group.

    Create it collectively on every rank of `group` (None = the default group); the group is
    used only here, to agree on the segment. `nbytes` is the capacity for buffers, reserved
    in /dev/shm at once and handed out by `buffer()` with a bump allocator, so every rank
    must ask for the same buffers in the same order. A barrier that waits longer than `timeout` seconds raises `ShmTimeout`
    naming the ranks that did not arrive.

    Reuse rule: a rank may overwrite a shared buffer only when no peer still reads it.
    reduce_scatter and all_reduce end with a barrier for that; after an all_gather the
    caller owns the question (call `barrier()` before refilling a buffer peers may read).
    """

    def __init__(self, group: dist.ProcessGroup | None, nbytes: int, *, name_prefix: str = "hpf",
                 timeout: float = COLLECTIVE_TIMEOUT_S):
        if nbytes <= 0:
            raise ValueError(f"ShmGroup: nbytes must be positive, got {nbytes}")
        super().__init__()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(
            range(self.world_size))
        self.timeout = timeout
        header = _round_up(self.world_size * ALIGN, ALIGN)
        self.capacity = header + _round_up(nbytes, ALIGN)
        self._segment = _map_segment(group, self.rank, self.capacity, name_prefix)
        # barrier counters: rank r's int64 sits at word r * 8 (its own cache line); a
        # memoryview reads/writes one word in ~50 ns, far cheaper than a torch op
        self._slots = memoryview(self._segment[:header].numpy()).cast("q")
        self._stride = ALIGN // 8
        self._generation = 0
        self._next = header
        self._regions = BufferCache()  # key -> _Region
        self._scratch = None  # fp32 accumulator chunk, made on first use

    # ---- memory -------------------------------------------------------------------------
    def buffer(self, key, numel: int, dtype: torch.dtype, *, per_rank: bool = False) -> torch.Tensor:
        """A 1-D view into the segment; the same bytes on every rank for the same key.

        per_rank=False: one buffer all ranks share (an all_gather output).
        per_rank=True: world_size rows, this rank's row returned (a reduce_scatter or
        all_reduce input; peers read it there without a copy).
        """
        if self._segment is None:
            raise RuntimeError("ShmGroup is closed")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        region = self._regions.get(key, numel, dtype, per_rank,
                                   lambda: self._allocate(key, numel * itemsize, per_rank))
        start = region.offset + (self.rank * region.row_bytes if per_rank else 0)
        return self._segment[start:start + region.nbytes].view(dtype)

    def _allocate(self, key, nbytes: int, per_rank: bool) -> _Region:
        row_bytes = _round_up(max(nbytes, 1), ALIGN)
        size = row_bytes * (self.world_size if per_rank else 1)
        if self._next + size > self.capacity:
            raise ValueError(f"ShmGroup: buffer {key!r} needs {size} bytes but only {self.capacity - self._next} "
                             "of the segment are free; create the ShmGroup with a larger nbytes")
        region = _Region(self._next, nbytes, row_bytes, per_rank)
        self._next += size
        return region

    def _region_of(self, t: torch.Tensor, name: str, per_rank: bool) -> tuple[_Region, int]:
        """The region holding `t`, and t's byte offset inside its row; errors say what to pass."""
        kind = "buffer(..., per_rank=True)" if per_rank else "buffer(..., per_rank=False)"
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a slice of ShmGroup.{kind})")
        if self._segment is None:
            raise RuntimeError("ShmGroup is closed")
        offset = t.data_ptr() - self._segment.data_ptr()
        end = offset + t.numel() * t.element_size()
        for region in self._regions.values():  # a few buffers per group: a scan is fine
            row = (offset - region.offset) // region.row_bytes
            in_row = offset - region.offset - row * region.row_bytes
            if (region.per_rank == per_rank and 0 <= row < (self.world_size if per_rank else 1)
                    and in_row + (end - offset) <= region.nbytes):
                if per_rank and row != self.rank:
                    raise ValueError(f"{name} lies in rank {row}'s row; pass this rank's own row")
                return region, in_row
        raise ValueError(f"{name} must be a slice of this group's ShmGroup.{kind} "
                         "(other memory is not visible to the peers)")

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """(world_size, numel) view of ``t``'s place (this rank's row of a ``per_rank`` buffer) in every
        rank's row: a peer's row, written directly (hpf.elastic's copies to a buddy)."""
        return self._rows(t, "rows(t)")

    def _rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """(world_size, numel) view: the bytes at t's place in every rank's row of its region."""
        region, in_row = self._region_of(t, name, per_rank=True)
        span = self._segment[region.offset:region.offset + region.row_bytes * self.world_size]
        nbytes = t.numel() * t.element_size()
        return span.view(self.world_size, region.row_bytes)[:, in_row:in_row + nbytes].view(t.dtype)

    # ---- synchronization ------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every rank has called barrier() as often as this one.

        Backs off from sched_yield to short sleeps (see _YIELD_CHECKS), so ranks that
        oversubscribe a few cores do not starve the one that is late.
        """
        if self._segment is None:
            raise RuntimeError("ShmGroup is closed")
        self._generation += 1
        target, slots, stride = self._generation, self._slots, self._stride
        slots[self.rank * stride] = target
        with trace.span("hpf/shm barrier"):
            self._wait_for(target)

    def _wait_for(self, target: int) -> None:
        slots, stride = self._slots, self._stride
        late = [r for r in range(self.world_size) if r != self.rank]
        checks, sleep_s, deadline = 0, 1e-5, None
        while True:
            late = [r for r in late if slots[r * stride] < target]
            if not late:
                return
            checks += 1
            if checks <= _YIELD_CHECKS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            elif now > deadline:
                raise ShmTimeout(
                    f"ShmGroup barrier #{target} on group rank {self.rank}: group ranks {late} (global "
                    f"{[self.global_ranks[r] for r in late]}) did not arrive within {self.timeout:g} s; "
                    "they died, hang, or do not call the same collectives in the same order")
            if liveness.WATCH is not None:  # an elastic job: a lost peer raises PeerLostError in seconds
                liveness.WATCH.check()
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)

    # ---- collectives ------------------------------------------------------------------------
    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, blocks: int = 1) -> None:
        """Write `shard` into this rank's part of the shared `full`, then barrier.

        Zero-copy when `shard` already is that part: then only the barrier remains.
        """
        k = check_shards(full, shard, self.world_size, "full", "shard", blocks)
        self._region_of(full, "full", per_rank=False)
        mine = by_rank(full, self.world_size, blocks, k)[self.rank]
        if shard.data_ptr() != mine.data_ptr() or blocks > 1:
            mine.copy_(shard.view(blocks, k))
        self.barrier()
        self._count("all_gather", ring_bytes(full.numel() * full.element_size(), self.world_size))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, op: str = "sum", blocks: int = 1) -> None:
        """out <- this rank's part of the sum/mean over ranks of `full` (this rank's row of a
        per_rank buffer), accumulated in fp32. `out` may be any tensor, even that part."""
        check_op(op)
        k = check_shards(full, out, self.world_size, "full", "out", blocks)
        rows = self._rows(full, "full")
        self.barrier()  # every rank's full is written
        mine = rows.view(self.world_size, blocks, self.world_size, k)[:, :, self.rank]
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        self._reduce_into(target.view(blocks, k), mine, op)
        if target is not out:
            out.copy_(target)
        self.barrier()  # peers are done reading my row before I write it again
        self._count("reduce_scatter", ring_bytes(full.numel() * full.element_size(), self.world_size))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In place over `tensor` (this rank's row of a per_rank buffer; any numel):
        reduce-scatter into each rank's own slice, then gather the slices."""
        check_op(op)
        rows = self._rows(tensor, "tensor")
        bounds = [tensor.numel() * r // self.world_size for r in range(self.world_size + 1)]
        mine = slice(bounds[self.rank], bounds[self.rank + 1])
        self.barrier()
        self._reduce_into(rows[self.rank, mine], rows[:, mine], op)  # peers never read this slice now
        self.barrier()
        for r in range(self.world_size):
            if r != self.rank:
                part = slice(bounds[r], bounds[r + 1])
                rows[self.rank, part].copy_(rows[r, part])
        self.barrier()
        self._count("all_reduce", 2 * ring_bytes(tensor.numel() * tensor.element_size(), self.world_size))

    def _reduce_into(self, out: torch.Tensor, rows: torch.Tensor, op: str) -> None:
        """out <- sum (or mean) over rows (each shaped as ``out``), accumulated in fp32. `out`
        may alias rows[i]."""
        if not out.is_contiguous():
            result = torch.empty(out.shape, dtype=out.dtype)
            self._reduce_into(result, rows, op)
            out.copy_(result)
            return
        if out.dtype == rows.dtype == torch.float32 and len(rows) > 1:
            # straight into out, one elementwise pass per extra row: torch.sum over the
            # strided rows was 1.4x slower, and a fresh accumulator 3x slower (page faults)
            mine, *others = [rows[self.rank]] + [rows[r] for r in range(len(rows)) if r != self.rank]
            torch.add(mine, others[0], out=out)  # out can only alias this rank's own row
            for row in others[1:]:
                out.add_(row)
            if op == "mean":
                out.div_(self.world_size)
            return
        # other dtypes: accumulate in fp32, chunk by chunk in a cache-sized scratch
        if self._scratch is None:
            self._scratch = torch.empty(_CHUNK, dtype=torch.float32)
        flat, rows = out.view(-1), rows.reshape(len(rows), -1)  # (a copy where rows are strided)
        for start in range(0, flat.numel(), _CHUNK):
            part = slice(start, min(flat.numel(), start + _CHUNK))
            acc = self._scratch[:part.stop - start]
            acc.copy_(rows[0, part])
            for row in rows[1:]:
                acc.add_(row[part])
            if op == "mean":
                acc.div_(self.world_size)
            flat[part].copy_(acc)

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop this object's views. The name was unlinked at setup; the memory goes when the
        last tensor viewing it dies."""
        if self._segment is not None:
            self._slots.release()
            self._segment = self._scratch = None
            self._regions.clear()

    def __enter__(self) -> "ShmGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
