"""Topology-aware FSDP collectives for a two-tier network.

The fast tier (a host or supernode: the mesh's fast axes) and the slow tier (the links
between them) get separate collectives:

- all-gather: the slow tier first moves each rank's shard among the ranks with the same
  fast coordinates, into one contiguous block of the full buffer; the fast tier then
  gathers those blocks. On CPU ranks of one host the fast tier is shared memory, so the
  full buffer is one shared segment that every local rank reads: params are views of it.
- reduce-scatter: the fast tier reduces first, so the slow tier carries 1/n_fast of the
  bytes, in one reduction per bucket, in the reduce dtype (fp32).
- a low-bit slow tier (the plan's ``slow_precision``): the slow stage of a gather sends this
  rank's shard as a block-quantized payload (hpf_kernels.quantize; the scales ride inside, so
  no other collective is needed) and dequantizes every peer's into the gathered buffer; the
  slow stage of a reduction quantizes each row bound for a slow peer (plus its error-feedback
  residual), exchanges them all-to-all, and sums what arrives in fp32, this rank's own row
  exact. An HSDP replica all-reduce gathers every replica's payload and each sums the same
  rows. Master shards are never quantized.

Collectives run on worker threads, one FIFO per tier and direction, each on its own
process groups, so every rank runs them in the order it issued them, a bucket's slow
stage overlaps the next bucket's fast stage, and compute never blocks on a slow-tier
transfer: a unit's reduction is issued in its backward and waited for only when its
optimizer update needs it (the cross-layer backward pipeline).

`Topology` (re-exported as ``hpf.Topology``) is the user's configuration of `TieredComm`, and
`SlowLink` the slow-link emulation for benchmarks on one host; both live here, beside the
code that reads them.
"""
from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hpf_kernels import dequantize, payload_bytes, quantize

from ..planning import Plan, check_bucket_bytes
from ..trace import span
from ..types import SlowPrecision
from . import world
from .cost import bucket_comm_bytes, count_bytes, dtype_bytes, feedback_numel, low_bit
from .shm import ShmGroup
from .transport import DONE, Handle, ProcessGroupTransport, Transport

__all__ = ["Topology", "SlowLink", "TieredComm"]


@dataclass(frozen=True)
class SlowLink:
    """EMULATION for benchmarks on one host: every slow-tier collective also sleeps
    ``latency_s + bytes / bandwidth`` (bytes this rank sends across the slow tier), as a
    slower network would take. Never use it in a real run.

    Args:
        latency_s: seconds added to every slow-tier collective.
        bandwidth: bytes per second per rank (inf: latency only).

    Raises:
        Nothing: any numbers are accepted; the sleep is never negative.
    """

    latency_s: float = 0.0
    bandwidth: float = float("inf")  # bytes per second per rank

    def delay(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Topology:
    """How FSDP collectives use the two tiers (``hpf.shard_step(..., topology=Topology())``).

    Args:
        hierarchical: two-stage collectives (slow-tier traffic / n_fast); False: flat ones,
            still run on the tier workers.
        pipeline: reductions overlap the rest of backward; False waits for each unit's.
        fast_transport: "shm" (shared memory, CPU ranks of one host), "pg" (torch.distributed),
            or "auto" (shm when every rank is a CPU process on one host).
        slow_link: an emulated slow link, for benchmarks only.
        shm_bytes: the shared-memory capacity; 0 sizes it from the plan.
        timeout_s: seconds a collective may take before it raises instead of hanging.
        bucket_bytes: split units into buckets of at most this many bytes, each its own fused
            collective, so one bucket's slow stage overlaps the next one's fast stage (0: a
            bucket per unit).
        slow_weights, slow_grads, slow_block, slow_error_feedback: the low-bit slow tier (None:
            full precision): the formats weights are gathered in and grads exchanged in across
            the slow tier, values per scale, and error feedback for the grads
            (:class:`hpf.types.SlowPrecision` says what each allows).

    Raises:
        ValueError: ``fast_transport`` is not "auto", "shm" or "pg", ``bucket_bytes`` is not an
            int >= 0, a slow-tier option is not allowed (the message lists what is), or a
            low-bit slow tier is asked for with ``hierarchical=False`` (the fast tier would
            carry quantized data too).
    """

    hierarchical: bool = True
    pipeline: bool = True
    fast_transport: str = "auto"
    slow_link: SlowLink | None = None
    shm_bytes: int = 0  # shared-memory capacity; 0 sizes it from the plan
    timeout_s: float = 300.0
    bucket_bytes: int = 0  # cap on one fused collective (hpf.plan's bucket_bytes); 0: one per unit
    slow_weights: str | None = None
    slow_grads: str | None = None
    slow_block: int = 128
    slow_error_feedback: bool | None = None

    def __post_init__(self):
        if self.fast_transport not in ("auto", "shm", "pg"):
            raise ValueError(f"fast_transport={self.fast_transport!r}: use 'auto', 'shm' or 'pg'")
        check_bucket_bytes(self.bucket_bytes)
        slow = self.slow_precision  # validates the slow-tier options
        if slow is not None and not self.hierarchical:
            raise ValueError(f"slow_weights={self.slow_weights!r}, slow_grads={self.slow_grads!r} with "
                             "hierarchical=False: a flat collective has no slow stage of its own to quantize (the "
                             "fast tier stays at full precision); use hierarchical=True")

    @property
    def slow_precision(self) -> SlowPrecision | None:
        """The low-bit slow tier these options ask for, or None (full precision)."""
        if self.slow_weights is None and self.slow_grads is None and not self.slow_error_feedback:
            return None
        return SlowPrecision(self.slow_weights, self.slow_grads, self.slow_block, self.slow_error_feedback)


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


_INSTANCES = itertools.count()


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """out <- rows[0] + rows[1] + ..., in fp32 and in rank order (the same sum on every run)."""
    acc = rows[0].clone() if len(rows) == 1 else torch.add(rows[0], rows[1])
    for r in rows[2:]:
        acc.add_(r)
    out.copy_(acc)


class TieredComm:
    """Per-bucket two-tier collectives behind the engine's comm interface."""

    def __init__(self, plan: Plan, topology: Topology, device: torch.device, compute_dtypes, reduce_dtypes):
        self.plan = plan
        mesh = self._mesh = plan.mesh
        rank = world.rank()
        self.timeout = topology.timeout_s
        self.bytes = Counter()  # (op, tier) -> bytes this rank sent
        self._link = topology.slow_link
        # One worker per tier and direction: a bucket's slow stage overlaps the next one's fast stage.
        self._workers = {(d, t): _Worker(f"hpf-{d}-{t}") for d in ("gather", "reduce") for t in ("slow", "fast")}
        use_shm = self._use_shm(topology, device)
        self._use_shm_fast = use_shm
        fast_axes = set(mesh.fast_axes)
        self._stages = []
        shm_need = 0
        for b in plan.buckets:
            # A size-1 axis has no one to talk to (and, in a 1-process run, no process group).
            order = tuple(a for a in b.shard_order if mesh.axis_size(a) > 1)
            fast = tuple(a for a in order if a in fast_axes)
            slow = tuple(a for a in order if a not in fast_axes)
            if not topology.hierarchical:
                fast, slow = (), order  # one flat collective, counted by tier
            self._stages.append((fast, slow))
            c, r = compute_dtypes[b.index], reduce_dtypes[b.index]
            # a shared full buffer and one grad row per local rank, each row cache-line aligned
            rows = 0 if b.frozen else mesh.axis_size(fast)  # (frozen: no grads)
            shm_need += b.padded_numel * (dtype_bytes(c) + rows * dtype_bytes(r)) + 64 * (mesh.size + 1)
        # Process groups of its own: its worker threads may still be gathering the next
        # step's first units while another step (another engine on the same mesh) runs.
        # Every rank builds its comms in the same order, so the instance numbers agree.
        instance = next(_INSTANCES)
        # Process-group transports are also split by bucket size: two ranks issuing different
        # buckets then wait on different groups (a named error from hpf.comm.schedule) instead of
        # pairing them (gloo aborts the process on a size mismatch).
        self._transports: dict[tuple, Transport] = {}
        self._owned: set[tuple] = set()  # (axes, tag) of the groups this comm made: it destroys them on close

        def own_group(axes, tag: str):
            self._owned.add((axes, tag))
            return mesh.group(axes, tag=tag)
        self._route: dict[tuple[str, int, str], Transport] = {}  # (direction, bucket, tier) -> transport
        self.slow = plan.slow_precision
        self._fmt = [low_bit(mesh, b, self.slow) for b in plan.buckets]  # op -> slow-tier format or None
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
                        group = own_group(axes, f"{tag}{instance}" + ("" if shm else f"/{nbytes}B"))
                        self._transports[key] = (ShmGroup(group, topology.shm_bytes or shm_need,
                                                          timeout=topology.timeout_s) if shm
                                                 else ProcessGroupTransport(group, device))
                    self._route[tag, b.index, tier] = self._transports[key]
        self._replica = [own_group(b.replicate_axes, f"replica{instance}")
                         if mesh.axis_size(b.replicate_axes) > 1 and not b.frozen
                         else None for b in plan.buckets]
        self._rank = rank
        self._device = device
        # low-bit slow tier: this rank's row in each bucket's slow group and fast block
        self._slow_index = [mesh.group_index(st[1], rank) if st[1] else 0 for st in self._stages]
        self._fast_index = [mesh.group_index(st[0], rank) if st[0] else 0 for st in self._stages]
        self.feedback_numel = [feedback_numel(mesh, b, self.slow) for b in plan.buckets]
        self._feedback: list[torch.Tensor] | None = None  # this step's residuals (TrainState.error_feedback)
        self._feedback_scale = 1.0
        self._pending: dict[int, list] = {}  # bucket -> [(residual slice, new value)] until commit_feedback
        #: validation mode sets a dict: (kind, bucket) -> (flat offset, exact, dequantized) of this rank's data
        self.capture: dict | None = None
        # bytes each rank sends per call, by op and tier, from the same model as the plan report
        self._op_bytes = [bucket_comm_bytes(mesh, b, compute_dtypes[b.index], reduce_dtypes[b.index],
                                            topology.hierarchical, self.slow) for b in plan.buckets]

    def low_bit(self, b: int) -> dict[str, str | None]:
        """The format each of bucket b's collectives sends across the slow tier in (hpf.comm.cost.low_bit)."""
        return self._fmt[b]

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
            fast, _ = self._stages[b]
            return self._route["gather", b, "fast"].buffer(("full", b), bucket.padded_numel, dtype)
        return torch.empty(bucket.padded_numel, dtype=dtype, device=self._device)

    def grad_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        bucket = self.plan.buckets[b]
        if self.is_shared(b):
            fast, _ = self._stages[b]
            return self._route["reduce", b, "fast"].buffer(("grad", b), bucket.padded_numel, dtype, per_rank=True)
        return torch.empty(bucket.padded_numel, dtype=dtype, device=self._device)

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

        block = out  # slow stage: this rank's block of the full buffer, among its fast-tier peers
        if fast:
            i = self.plan.mesh.group_index(fast, self._rank)
            n = bucket.padded_numel // self.plan.mesh.axis_size(fast)
            block = out[i * n:(i + 1) * n]

        fmt = self._fmt[b]["all_gather"]

        def gather():
            if fmt:
                self._gather_low_bit(b, block, shard, fmt)
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
                    self._route["gather", b, "fast"].all_gather_into(out, block)

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
                    self._route["reduce", b, "fast"].reduce_scatter(block, flat)

        fmt = self._fmt[b]

        def reduce_scatter():
            if fmt["reduce_scatter"]:
                self._reduce_low_bit(b, shard, block, fmt["reduce_scatter"])
            else:
                self._route["reduce", b, "slow"].reduce_scatter(shard, block)

        def all_reduce():
            if fmt["all_reduce"]:
                self._all_reduce_low_bit(b, shard, group, fmt["all_reduce"])
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

    # -- the low-bit slow tier (on the worker threads) -----------------------------------------------
    def _gather_low_bit(self, b: int, block: torch.Tensor, shard: torch.Tensor, fmt: str) -> None:
        """block <- every slow peer's shard, each sent as a payload and dequantized here."""
        k = self.slow.block
        rows = block.view(-1, shard.numel())
        payload = quantize(shard, fmt, k)
        recv = torch.empty(len(rows), payload.shape[1], dtype=torch.uint8, device=shard.device)
        self._route["gather", b, "slow"].all_gather_into(recv.view(-1), payload.view(-1))
        dequantize(recv, fmt, k, rows)
        if self.capture is not None:  # this rank's shard as every peer now holds it
            bucket = self.plan.buckets[b]
            at = self.plan.shard_index(bucket, self._rank) * bucket.shard_numel
            self.capture["weights", b] = (at, shard.float().clone(), rows[self._slow_index[b]].float().clone())

    def _reduce_low_bit(self, b: int, shard: torch.Tensor, block: torch.Tensor, fmt: str) -> None:
        """shard <- the fp32 sum of row i of every slow peer's block: each row bound for a peer
        is sent as a payload (with this rank's residual added); its own row stays exact."""
        rows = block.view(-1, shard.numel())
        own = self._slow_index[b]
        sent, payload = self._send_rows(b, rows, 0, fmt, own, self._fast_index[b] * rows.numel())
        recv = torch.empty_like(payload)
        self._route["reduce", b, "slow"].all_to_all(recv, payload)
        vals = dequantize(recv, fmt, self.slow.block, torch.empty(sent.shape, dtype=torch.float32, device=sent.device))
        vals[own] = sent[own]
        _sum_rows(vals, shard)

    def _all_reduce_low_bit(self, b: int, shard: torch.Tensor, group, fmt: str) -> None:
        """shard <- the fp32 sum of every replica's shard, each dequantized from its payload, its
        own too: every replica sums the same rows in the same order, so all stay equal."""
        bucket, m = self.plan.buckets[b], dist.get_world_size(group)
        _, payload = self._send_rows(b, shard.view(1, -1), self.feedback_numel[b] - shard.numel(), fmt, None,
                                     self.plan.shard_index(bucket, self._rank) * bucket.shard_numel)
        recv = torch.empty(m, payload.shape[1], dtype=torch.uint8, device=shard.device)
        dist.all_gather_into_tensor(recv.view(-1), payload.view(-1), group=group)
        _sum_rows(dequantize(recv, fmt, self.slow.block,
                             torch.empty(m, shard.numel(), dtype=torch.float32, device=shard.device)), shard)

    def _send_rows(self, b: int, rows: torch.Tensor, at: int, fmt: str, own: int | None, offset: int):
        """(rows + this rank's residual of them, in fp32; their payloads). Row ``own`` never leaves
        the rank: it stays exact and keeps no residual. The residual of the others (at ``at`` in the
        bucket's, unscaled: fp16's loss scale changes between steps) becomes what their payloads
        drop, kept aside until ``commit_feedback``. Validation mode's capture gets the rows as sent
        and as the peers receive them."""
        k, s = self.slow.block, self._feedback_scale
        sent, resid = rows.float(), None
        away = [j for j in range(len(rows)) if j != own]
        if self._feedback is not None and self.feedback_numel[b]:
            resid = self._feedback[b][at:at + len(away) * rows.shape[1]].view(len(away), -1)
            sent = sent.clone()
            sent[away] += resid if s == 1.0 else resid * s
        payload = quantize(sent, fmt, k)
        if resid is not None or self.capture is not None:
            got = dequantize(payload, fmt, k, torch.empty_like(sent))
            if own is not None:
                got[own] = sent[own]
            if resid is not None:
                lost = (sent - got)[away]
                self._pending.setdefault(b, []).append((resid, lost if s == 1.0 else lost / s))
            if self.capture is not None:
                self.capture["grads", b] = (offset, sent.reshape(-1).clone(), got.reshape(-1))
        return sent, payload

    def use_feedback(self, residuals: list[torch.Tensor] | None, scale: float = 1.0) -> None:
        """This step's error-feedback residuals (``TrainState.error_feedback``, None: off), and the
        loss scale its grads carry. New residuals are kept aside until ``commit_feedback``."""
        self._feedback, self._feedback_scale = residuals, scale
        self._pending = {}

    def commit_feedback(self) -> None:
        """The step updates: its residuals become the state's (a skipped step keeps the old ones)."""
        for parts in self._pending.values():
            for resid, new in parts:
                resid.copy_(new)
        self._pending = {}

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        for t in self._transports.values():
            if isinstance(t, ShmGroup):
                t.close()
        for axes, tag in self._owned:
            self._mesh.drop_group(axes, tag=tag)
        self._owned, self._transports, self._route, self._replica = set(), {}, {}, []  # (the groups go with them)

