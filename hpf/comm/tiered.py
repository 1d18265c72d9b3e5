"""Topology-aware FSDP collectives for a two-tier network.

The fast tier (a host or supernode: the mesh's fast axes) and the slow tier (the links
between them) get separate collectives:

- all-gather: the slow tier first moves each rank's shard among the ranks with the same
  fast coordinates, into one contiguous block of the full buffer; the fast tier then
  gathers those blocks. On CPU ranks of one host the fast tier is shared memory, so the
  full buffer is one shared segment that every local rank reads: params are views of it.
- reduce-scatter: the fast tier reduces first, so the slow tier carries 1/n_fast of the
  bytes, in one reduction per bucket, in the reduce dtype (fp32).
- a low-bit slow tier (the plan's ``slow_precision``): the slow stages send block-quantized
  payloads and sum in fp32 (hpf.comm.lowbit). Master shards are never quantized.

Collectives run on worker threads, one FIFO per tier and direction, each on its own
process groups, so every rank runs them in the order it issued them, a bucket's slow
stage overlaps the next bucket's fast stage, and compute never blocks on a slow-tier
transfer: a unit's reduction is issued in its backward and waited for only when its
optimizer update needs it (the cross-layer backward pipeline).

`Topology`, the user's configuration of `TieredComm`, and `SlowLink`, the slow-link emulation,
live in hpf.topology (below the plan); they are re-exported here for old imports.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Callable

import torch
import torch.distributed as dist

from hpf_kernels import payload_bytes

from ..planning import Plan
from ..topology import SlowLink, Topology  # noqa: F401  (SlowLink: re-exported for old imports)
from ..trace import span
from . import liveness, world
from .cost import bucket_comm_bytes, count_bytes, dtype_bytes
from .lowbit import LowBitTier
from .shm import ALIGN, ShmGroup
from .ordered import OrderedReduction
from .handles import DONE, Handle
from .transport import OwnedGroups, ProcessGroupTransport, Transport

__all__ = ["Topology", "SlowLink", "TieredComm"]


class _Handle:
    """A collective in flight on a worker thread."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self, timeout: float | None = None) -> bool:
        done, _ = futures_wait([self.future], timeout=timeout)
        if not done:
            return False
        self.future.result()  # re-raises the collective's own error
        return True

    def done(self) -> bool:
        return self.future.done()


def _pipeline(*stages: tuple["_Worker", Callable[[], None]]) -> Future:
    """Run ``fn`` of each (worker, fn) stage in turn, each on its worker; the future ends with
    the last. Every job passes through the same workers in the same order, so each worker
    (one tier's process group) runs its collectives in the order the main thread issued them."""
    fut: Future = Future()
    stages[0][0].jobs.put((stages, fut))
    return fut


class _Worker:
    """One thread running pipeline stages in the order they reach it."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        failed = None
        while True:
            job = self.jobs.get()
            if job is None:
                return
            stages, fut = job
            if failed is None:
                try:
                    stages[0][1]()
                except BaseException as e:  # handed to whoever waits on this or any later future
                    failed = e
            # the stages hold the collective's buffers: dropped here before it is done, so none outlives it
            job, rest, stages = None, stages[1:], None
            if failed is not None:  # the ranks are out of step: every later collective would hang
                fut.set_exception(failed)
            elif rest:
                rest[0][0].jobs.put((rest, fut))
            else:
                fut.set_result(None)
            rest = None

    def close(self) -> None:
        self.jobs.put(None)

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (one stuck in a collective that never lands stays, a daemon)."""
        self.thread.join(timeout)


def _tier_axes(mesh, b, hierarchical: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(fast axes, slow axes) of bucket ``b``'s collectives, each stage's shard order."""
    order = tuple(a for a in b.shard_order if mesh.axis_size(a) > 1)  # a size-1 axis has no one to talk to
    if not hierarchical:
        return (), order  # one flat collective, counted by tier
    return tuple(a for a in order if a in mesh.fast_axes), tuple(a for a in order if a not in mesh.fast_axes)


def _shm_bytes(plan: Plan, stages: list, compute_dtypes, reduce_dtypes) -> int:
    """Shared memory for every bucket: a full buffer and one grad row per local rank, each row
    cache-line aligned."""
    mesh, need = plan.mesh, 0
    for b, (fast, _) in zip(plan.buckets, stages):
        rows = 0 if b.frozen else mesh.axis_size(fast)  # (frozen: no grads)
        need += (b.padded_numel * (dtype_bytes(compute_dtypes[b.index]) + rows * dtype_bytes(reduce_dtypes[b.index]))
                 + ALIGN * (mesh.size + 1))
    return need


class TieredComm:
    """Per-bucket two-tier collectives behind the engine's comm interface."""

    def __init__(self, plan: Plan, topology: Topology, device: torch.device, compute_dtypes, reduce_dtypes):
        self.plan = plan
        mesh = plan.mesh
        rank = world.rank()
        self.timeout = topology.timeout_s
        self.bytes = Counter()  # (op, tier) -> bytes this rank sent
        self._link = topology.slow_link
        use_shm = self._use_shm(topology, device)
        self._use_shm_fast = use_shm
        self._stages = [_tier_axes(mesh, b, topology.hierarchical) for b in plan.buckets]
        self._blocks = [plan.stage_blocks(b) if topology.hierarchical else 1 for b in plan.buckets]
        shm_need = _shm_bytes(plan, self._stages, compute_dtypes, reduce_dtypes)
        # Process-group transports are split by bucket size: two ranks issuing different
        # buckets then wait on different groups (a named error from hpf.comm.schedule) instead of
        # pairing them (gloo aborts the process on a size mismatch).
        self._transports: dict[tuple, Transport] = {}
        own_group = self._owned = OwnedGroups(mesh)  # process groups of its own, destroyed on close
        # the invariant mode's reduction (hpf.comm.ordered): a machine's ranks first, then across machines
        self.reduce_ordered = OrderedReduction(plan, own_group, True, self.bytes, device)
        self._route: dict[tuple[str, int, str], Transport] = {}  # (direction, bucket, tier) -> transport
        self.slow = plan.slow_precision
        self.lowbit = LowBitTier(plan, self._stages, rank)  # what crosses the slow tier low-bit, and the residuals
        self._fmt = self.lowbit.formats  # op -> slow-tier format or None
        for tag in ("gather", "reduce"):
            for b, (fast, slow) in zip(plan.buckets, self._stages):
                if tag == "reduce" and b.frozen:
                    continue
                dtype = (compute_dtypes if tag == "gather" else reduce_dtypes)[b.index]
                for axes, tier in ((fast, "fast"), (slow, "slow")):
                    if not axes:
                        continue
                    nbytes = b.shard_size * self._row_bytes(b, "all_gather" if tag == "gather" else "reduce_scatter",
                                                            dtype, tier)
                    shm = tier == "fast" and use_shm
                    key = (tag, axes) if shm else (tag, axes, nbytes)
                    if key not in self._transports:
                        group = own_group(axes, tag + ("" if shm else f"/{nbytes}B"))
                        self._transports[key] = (ShmGroup(group, topology.shm_bytes or shm_need,
                                                          timeout=topology.timeout_s) if shm
                                                 else ProcessGroupTransport(group, device))
                    self._route[tag, b.index, tier] = self._transports[key]
        self._replica = [own_group(b.replicate_axes, "replica")
                         if mesh.axis_size(b.replicate_axes) > 1 and not b.frozen
                         else None for b in plan.buckets]
        self._rank = rank
        self._device = device
        # bytes each rank sends per call, by op and tier, from the same model as the plan report
        self._op_bytes = [bucket_comm_bytes(mesh, b, compute_dtypes[b.index], reduce_dtypes[b.index],
                                            topology.hierarchical, self.slow) for b in plan.buckets]
        # One worker per tier and direction: a bucket's slow stage overlaps the next one's fast stage.
        # Started last: a comm whose set-up raised leaves no thread behind.
        self._workers = {(d, t): _Worker(f"hpf-{d}-{t}") for d in ("gather", "reduce") for t in ("slow", "fast")}

    def _row_bytes(self, b, op: str, dtype: torch.dtype, tier: str) -> int:
        """Bytes of one shard-sized row of ``op`` on ``tier``: a payload where it is low-bit."""
        fmt = self._fmt[b.index][op] if tier == "slow" else None
        return payload_bytes(b.shard_numel, fmt, self.slow.block) if fmt else b.shard_numel * dtype_bytes(dtype)

    @staticmethod
    def _use_shm(topology: Topology, device: torch.device) -> bool:
        if topology.fast_transport == "pg" or device.type != "cpu":
            return False
        if topology.fast_transport == "shm":
            return True
        return len(set(world.all_gather_object(socket.gethostname()))) == 1

    # -- buffers -------------------------------------------------------------------------------
    def is_shared(self, b: int) -> bool:
        """Bucket b's fast tier is shared memory: its full buffer is one segment per host."""
        return self._use_shm_fast and bool(self._stages[b][0])

    def full_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        bucket = self.plan.buckets[b]
        if self.is_shared(b):
            return self._route["gather", b, "fast"].buffer(("full", b), bucket.padded_numel, dtype)
        return torch.empty(bucket.padded_numel, dtype=dtype, device=self._device)

    def grad_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        bucket = self.plan.buckets[b]
        if self.is_shared(b):
            return self._route["reduce", b, "fast"].buffer(("grad", b), bucket.padded_numel, dtype, per_rank=True)
        return torch.empty(bucket.padded_numel, dtype=dtype, device=self._device)

    # -- validation mode -------------------------------------------------------------------------
    def capture_low_bit(self) -> None:
        """Keep, from now on, what each low-bit slow-tier collective sent and what arrived
        (validation mode's quantization check; nothing to keep at full precision)."""
        if self.slow is not None:
            self.lowbit.capture = {}

    def low_bit_captures(self) -> list:
        """What :meth:`capture_low_bit` kept, per bucket and kind (``LowBitTier.captured``)."""
        return self.lowbit.captured()

    # -- collectives -----------------------------------------------------------------------------
    def _over_slow_link(self, collective: Callable[[], object], nbytes: int) -> None:
        """Run a slow-tier collective; with an emulated link, stretch it to the link's time.

        The real transfer (loopback on one host) is part of the emulated link's time, not
        extra to it: only what is left of ``latency + bytes / bandwidth`` is slept."""
        start = time.perf_counter()
        collective()
        if self._link is not None and nbytes:
            time.sleep(max(0.0, self._link.delay(nbytes) - (time.perf_counter() - start)))

    def all_gather(self, b: int, out: torch.Tensor, shard: torch.Tensor) -> Handle:
        fast, slow = self._stages[b]
        if not fast and not slow:  # nothing to send (one rank holds it all): no worker round trip
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return DONE
        bucket = self.plan.buckets[b]
        tiers = self._op_bytes[b]["all_gather"]

        block, blocks = out, self._blocks[b]  # slow stage: this rank's part of the full buffer
        if fast:  # fast-major: its contiguous block, gathered in place; node-major: strided, so a scratch
            n = bucket.padded_numel // self.plan.mesh.axis_size(fast)
            i = self.plan.mesh.group_index(fast, self._rank)
            block = out[i * n:(i + 1) * n] if blocks == 1 else torch.empty(n, dtype=out.dtype, device=out.device)

        fmt = self._fmt[b]["all_gather"]

        def gather():
            if fmt:
                self.lowbit.gather(b, block, shard, self._route["gather", b, "slow"])
            else:
                self._route["gather", b, "slow"].all_gather_into(block, shard)

        def slow_stage():
            if slow:
                with span("hpf/all-gather slow tier, bucket", b):
                    self._over_slow_link(gather, tiers["slow"])
            elif block.data_ptr() != shard.data_ptr():
                with span("hpf/copy shard, bucket", b):
                    block.copy_(shard)

        def fast_stage():
            if fast:
                with span("hpf/all-gather fast tier, bucket", b):
                    self._route["gather", b, "fast"].all_gather_into(out, block, blocks)

        count_bytes(self.bytes, "all_gather", tiers)  # as issued, on the caller's thread
        w = self._workers
        return _Handle(_pipeline((w["gather", "slow"], slow_stage), (w["gather", "fast"], fast_stage)))

    def reduce(self, b: int, shard: torch.Tensor, flat: torch.Tensor) -> Handle:
        """shard <- this rank's slice of the sum of every data-parallel rank's flat grad."""
        fast, slow = self._stages[b]
        group = self._replica[b]
        if not fast and not slow and group is None:
            if shard.data_ptr() != flat.data_ptr():
                shard.copy_(flat)
            return DONE
        tiers, replica = self._op_bytes[b]["reduce_scatter"], self._op_bytes[b]["all_reduce"]

        block = flat  # fast stage: the sum over this rank's fast-tier peers of its block
        if fast and slow:
            block = torch.empty(flat.numel() // self.plan.mesh.axis_size(fast), dtype=flat.dtype, device=flat.device)
        elif fast:
            block = shard

        def fast_stage():
            if fast:
                with span("hpf/reduce-scatter fast tier, bucket", b):
                    self._route["reduce", b, "fast"].reduce_scatter(block, flat, blocks=self._blocks[b])

        fmt = self._fmt[b]

        def reduce_scatter():
            if fmt["reduce_scatter"]:
                self.lowbit.reduce_scatter(b, shard, block, self._route["reduce", b, "slow"])
            else:
                self._route["reduce", b, "slow"].reduce_scatter(shard, block)

        def all_reduce():
            if fmt["all_reduce"]:
                self.lowbit.all_reduce(b, shard, group)
            else:
                dist.all_reduce(shard, group=group)

        def slow_stage():
            if slow:
                with span("hpf/reduce-scatter slow tier, bucket", b):
                    self._over_slow_link(reduce_scatter, tiers["slow"])
            elif not fast and shard.data_ptr() != flat.data_ptr():
                shard.copy_(flat)
            if group is not None:
                with span("hpf/all-reduce replicas, bucket", b):
                    self._over_slow_link(all_reduce, replica["slow"])

        count_bytes(self.bytes, "reduce_scatter", tiers)
        count_bytes(self.bytes, "all_reduce", replica)
        w = self._workers
        return _Handle(_pipeline((w["reduce", "fast"], fast_stage), (w["reduce", "slow"], slow_stage)))

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        for worker in self._workers.values():  # (elastic: one stuck on a lost peer is left, a daemon)
            worker.join(self.timeout if liveness.WATCH is None else liveness.DEAD_S)
        for t in self._transports.values():
            if isinstance(t, ShmGroup):
                t.close()
        self._owned.close()
        self._transports, self._route, self._replica = {}, {}, []  # (the groups go with them)

