"""The FSDP unit engine: gather just before use, prefetch the next unit, free after use,
re-gather in backward, and reduce each unit's grads with one reduce-scatter per bucket.

The loss function only ever sees plain tensors. Parameters are views into each unit's
gathered flat buffer, handed out by one autograd Function per unit, whose backward writes
the unit's grads into one flat buffer and launches its reduce-scatter. A block unit's
buffer is freed (its storage resized to zero) once the forward moves two units on;
autograd's saved-tensor hooks tell the engine when backward needs a freed unit again, so
it is re-gathered exactly then, with the unit before it prefetched.

With an elementwise optimizer the step hands each unit to the optimizer as soon as its
reductions have landed (polled while backward runs, in reduction order), and the units the
next step needs first start gathering right after their update: only the last unit's
reduction, update and gather stay between one step's backward and the next forward.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist

from . import tree as tree_util
from .planning import ROOT, Bucket, Plan
from .report import bucket_allreduce_bytes, bucket_gather_bytes, count_bytes

__all__ = ["UnitEngine", "BucketComm", "MemoryStats"]


class _Done:
    """A finished collective: lets single-rank groups skip communication with one code path."""

    def wait(self) -> bool:
        return True

    def done(self) -> bool:
        return True


DONE = _Done()


def is_done(handle) -> bool:
    """Whether a collective handle (ours, or a torch.distributed Work) has finished; never blocks."""
    return handle.done() if hasattr(handle, "done") else handle.is_completed()


class _Chain:
    """A reduce-scatter whose replica all-reduce starts once it has landed."""

    def __init__(self, first, then: Callable[[], Any]):
        self.first, self.then, self.second = first, then, None

    def _start_second(self) -> None:
        if self.second is None:
            self.first.wait()
            self.second = self.then()

    def wait(self) -> bool:
        self._start_second()
        self.second.wait()
        return True

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

    def is_shared(self, b: int) -> bool:
        """Whether bucket b's full buffer is transport-owned shared memory (never freed)."""
        return False

    def __init__(self, plan: Plan, device: torch.device, compute_dtypes, reduce_dtypes):
        self.plan, self.device = plan, device
        mesh = plan.mesh
        self.shard_groups = [mesh.group(b.shard_axes) if b.shard_size > 1 else None for b in plan.buckets]
        # Replica all-reduces start when a poll finds their reduce-scatter landed, a moment that
        # differs across ranks: on groups of their own, no other collective can interleave.
        self.replica_groups = [mesh.group(b.replicate_axes, tag="replica")
                               if mesh.axis_size(b.replicate_axes) > 1 else None for b in plan.buckets]
        self.bytes: Counter = Counter()  # (op, tier) -> bytes this rank sent (report.py's model)
        self._ag_bytes = [bucket_gather_bytes(mesh, b, compute_dtypes[b.index]) for b in plan.buckets]
        self._rs_bytes = [bucket_gather_bytes(mesh, b, reduce_dtypes[b.index]) for b in plan.buckets]
        self._ar_bytes = [bucket_allreduce_bytes(mesh, b, reduce_dtypes[b.index]) for b in plan.buckets]

    def full_buffer(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.plan.buckets[b].padded_numel, dtype=dtype, device=self.device)

    grad_buffer = full_buffer

    def all_gather(self, b: int, out: torch.Tensor, shard: torch.Tensor):
        g = self.shard_groups[b]
        if g is None:
            out.copy_(shard)
            return DONE
        count_bytes(self.bytes, "all_gather", self._ag_bytes[b])
        return dist.all_gather_single(out, shard, group=g, async_op=True)

    def reduce(self, b: int, shard: torch.Tensor, flat: torch.Tensor):
        """shard <- this rank's slice of the sum of every data-parallel rank's flat grad."""
        g = self.shard_groups[b]
        if g is None:
            if shard.data_ptr() != flat.data_ptr():
                shard.copy_(flat)
            handle = DONE
        else:
            count_bytes(self.bytes, "reduce_scatter", self._rs_bytes[b])
            handle = dist.reduce_scatter_single(shard, flat, group=g, async_op=True)
        rg = self.replica_groups[b]
        if rg is None:
            return handle
        count_bytes(self.bytes, "all_reduce", self._ar_bytes[b])
        return _Chain(handle, lambda: dist.all_reduce(shard, group=rg, async_op=True))

    def close(self) -> None:
        pass


@dataclass
class MemoryStats:
    """Gathered-buffer accounting, to show what FSDP keeps alive."""

    live_bytes: int = 0
    peak_bytes: int = 0
    live_blocks: int = 0  # gathered units other than the root
    peak_blocks: int = 0


class _GatherUnit(torch.autograd.Function):
    """Hands out a gathered unit's params as views; backward reduces their grads."""

    @staticmethod
    def forward(ctx, anchor, engine, unit):  # noqa: ARG004 - anchor only makes backward run
        ctx.engine, ctx.unit = engine, unit
        return tuple(engine.unit_views(unit))

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.reduce_unit(ctx.unit, grads)
        return None, None, None


class _UnitList(list):
    """A list of FSDP units that gathers each one when the loss function reaches it."""

    def __init__(self, engine: "UnitEngine", names: list[str]):
        super().__init__(names)
        self._engine = engine

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._engine.enter(n) for n in list.__getitem__(self, i)]
        return self._engine.enter(list.__getitem__(self, i))

    def __iter__(self):
        for name in list.__iter__(self):
            yield self._engine.enter(name)


class UnitEngine:
    """Runs one training step's forward and backward over a plan's units."""

    def __init__(self, plan: Plan, rank: int, comm, compute_dtype: torch.dtype | None,
                 device: torch.device, pipeline: bool = True):
        """Grads are reduced in the dtype of the grad shards the step passes to ``begin``."""
        self.plan, self.rank, self.comm = plan, rank, comm
        self.device = device
        self.compute_dtype = compute_dtype
        self.stats = MemoryStats()
        self.wait_s = 0.0
        bks = plan.buckets
        # Full buffers live as long as the engine. Plain ones are freed between uses by
        # resizing their storage to 0, which keeps every view of them (params, saved
        # tensors) valid to refill; a shared-memory transport owns shared ones instead.
        self.full = [_own_base(comm.full_buffer(b.index, compute_dtype or b.dtype)) for b in bks]
        self.nbytes = [f.numel() * f.element_size() for f in self.full]
        self.shared = [comm.is_shared(b.index) for b in bks]
        for f, shared in zip(self.full, self.shared):
            if not shared:
                f.untyped_storage().resize_(0)
        self._live: set[str] = set()
        self._pending: dict[str, list] = {}  # unit -> in-flight gather handles
        self._begun = None
        self.pipeline = pipeline
        self.units = list(plan.units)
        self.unit_buckets = {u: plan.units[u].buckets for u in self.units}
        # A unit wholly in shared memory stays mapped for the step: no free, no re-gather.
        self.unit_shared = {u: all(self.shared[b] for b in bs) for u, bs in self.unit_buckets.items()}
        # Full buffers of units that are freed in forward, so backward must re-gather them.
        self._freeable = {id(self.full[b]): u for u, bs in self.unit_buckets.items()
                          if u != ROOT and not self.unit_shared[u] for b in bs}
        self._next_unit = dict(zip(self.units, self.units[1:]))
        # Per unit: the param views in slot order, and how to build its subtree from them.
        self._slices = {u: [(b, s.offset, s.numel, s.local_shape) for b in self.unit_buckets[u]
                            for s in bks[b].slots] for u in self.units}
        self._subtree = {u: self._subtree_builder(u) for u in self.units if u != ROOT}
        self._skeleton, self._skeleton_leaves = self._skeleton_of(plan)
        self.grad_shards: list[torch.Tensor] = []
        self.reductions: list = []  # handles of this step's grad reductions
        # Optimizer overlap: the step sets update_buckets(bucket indices) for one step; the
        # engine calls it, in reduction order, as soon as a unit's grads have landed, then
        # starts the next step's gather of the unit if begin() would (see _refill).
        self.update_buckets: Callable[[list[int]], None] | None = None
        self._landing: deque = deque()  # (unit, handles) reduced but not yet handed to update_buckets
        self._next: dict[str, list] = {}  # unit -> _snapshot of its master shards, gathered for the next step
        self._refill_later: list[str] = []
        self._early = {u for i, u in enumerate(self.units) if i < 2 or self.unit_shared[u]}
        # Refilling in backward is safe for the collective order only when backward never
        # re-gathers (every unit shared); otherwise refills wait for finish().
        self._refill_in_backward = all(self.unit_shared.values())

    # -- building the params tree the loss function sees ------------------------------------
    def _subtree_builder(self, unit: str) -> Callable[[list[torch.Tensor]], Any]:
        parts = unit.split("/")
        node: Any = optree.tree_unflatten(self.plan.treedef, list(self.plan.slots))
        for key in parts:
            node = node[int(key)] if isinstance(node, list) else node[key]
        _, leaves, treedef = tree_util.flatten(node)
        order = [p for b in self.unit_buckets[unit] for p in (s.path for s in self.plan.buckets[b].slots)]
        index = [order.index(p) for p in leaves]
        return lambda views: optree.tree_unflatten(treedef, [views[i] for i in index])

    def _skeleton_of(self, plan: Plan):
        paths_tree = optree.tree_unflatten(plan.treedef, list(plan.slots))
        leaves, skeleton = optree.tree_flatten(paths_tree, is_leaf=lambda x: isinstance(x, list),
                                               none_is_leaf=True)
        out = []
        for leaf in leaves:
            if isinstance(leaf, list):  # a list of units: remember their names
                first = _first_path(leaf)
                prefix = plan.slots[first].unit.rsplit("/", 1)[0]
                out.append(("units", [f"{prefix}/{i}" for i in range(len(leaf))]))
            else:
                out.append(("root", leaf))
        return skeleton, out

    def params_tree(self) -> Any:
        """The loss function's params: root params as views, unit lists gathered lazily."""
        root = dict(zip((s.path for b in self.unit_buckets.get(ROOT, []) for s in self.plan.buckets[b].slots),
                        self.enter(ROOT))) if ROOT in self.units else {}
        leaves = [root[v] if kind == "root" else _UnitList(self, v) for kind, v in self._skeleton_leaves]
        return optree.tree_unflatten(self._skeleton, leaves)

    # -- a step ----------------------------------------------------------------------------------
    def begin(self, shards: list[torch.Tensor], grad_shards: list[torch.Tensor]) -> None:
        """Start a step: cast shards to the compute dtype and start gathering the first units.

        The step calls this right after the optimizer, so the next step's first gathers
        overlap whatever the caller does between steps; ``ready_for`` tells whether that
        prefetch still matches the shards the next step is given. Units refilled during the
        last backward (optimizer overlap) are kept if their shards are still these."""
        kept = {u for u, snapshot in self._next.items() if _untouched(snapshot, shards)}
        self._abandon(keep=kept)
        buckets = self.plan.buckets
        self.shards = [self.shards[b] if buckets[b].unit in kept else self._cast(s) for b, s in enumerate(shards)]
        self._masters = list(shards)
        self.grad_shards = grad_shards
        self.reductions = []
        self._order: list[str] = []  # units in the order the loss function reached them
        self._pos: dict[str, int] = {}
        self._views: dict[str, tuple] = {}
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        # Plain buffers: the first two units (memory bound). Units in shared memory cost no
        # memory to keep, so all of them are queued now, to stream in ahead of the compute.
        for u in self.units:
            if u in self._early:
                self._gather(u)
        self._begun = _snapshot(shards, range(len(shards)))

    def _cast(self, shard: torch.Tensor) -> torch.Tensor:
        cdt = self.compute_dtype
        return shard if cdt is None or shard.dtype == cdt else shard.to(cdt)

    def ready_for(self, shards: list[torch.Tensor]) -> bool:
        """True if ``begin`` ran for exactly these shards and nothing has written to them since."""
        begun = self._begun
        return begun is not None and len(begun) == len(shards) and _untouched(begun, shards)

    def _abandon(self, keep=frozenset()) -> None:
        """Drop gathers started for shards that are no longer current."""
        for u in list(self._live):
            if u not in keep:
                self._release(u)
        self._next = {}
        self._begun = None

    def enter(self, unit: str):
        """Called when the loss function reaches ``unit``: its params, gathered."""
        if unit in self._views:
            self._wait(unit)
            return self._views[unit] if unit == ROOT else self._subtree[unit](self._views[unit])
        prev = self._order[-1] if self._order else ROOT
        self._pos[unit] = len(self._order)
        self._order.append(unit)
        if unit != ROOT and prev != ROOT:
            self._free(prev)  # the loss function has moved past it
        self._gather(unit)
        self._wait(unit)
        nxt = self._next_unit.get(unit)
        if nxt is not None:
            self._gather(nxt)  # prefetch the next unit in tree order
        views = _GatherUnit.apply(self.anchor, self, unit)
        self._views[unit] = views
        return views if unit == ROOT else self._subtree[unit](views)

    def unit_views(self, unit: str) -> list[torch.Tensor]:
        return [self.full[b][off:off + n].view(shape) for b, off, n, shape in self._slices[unit]]

    # -- gather / free -----------------------------------------------------------------------------
    def _gather(self, unit: str) -> None:
        if unit in self._live:
            return
        handles = []
        for b in self.unit_buckets[unit]:
            st = self.full[b].untyped_storage()
            if not self.shared[b]:
                st.resize_(self.nbytes[b])
            handles.append(self.comm.all_gather(b, self.full[b], self.shards[b]))
        self._pending[unit] = handles
        self._live.add(unit)
        self._account(unit, +1)

    def _wait(self, unit: str) -> None:
        handles = self._pending.pop(unit, ())
        if handles:
            self._timed_wait(handles)

    def take_wait_s(self) -> float:
        """Seconds compute spent waiting on collectives since the last call."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def _free(self, unit: str) -> None:
        """Free a unit the loss function is done with (shared-memory units stay until the step ends)."""
        if not self.unit_shared[unit]:
            self._release(unit)

    def _release(self, unit: str) -> None:
        """Release a unit's gathered buffers: plain storage goes back to size 0."""
        if unit not in self._live:
            return
        self._wait(unit)
        for b in self.unit_buckets[unit]:
            if not self.shared[b]:
                self.full[b].untyped_storage().resize_(0)
        self._live.discard(unit)
        self._account(unit, -1)

    def _account(self, unit: str, sign: int) -> None:
        s = self.stats
        s.live_bytes += sign * sum(self.nbytes[b] for b in self.unit_buckets[unit])
        s.live_blocks += sign * (unit != ROOT)
        s.peak_bytes = max(s.peak_bytes, s.live_bytes)
        s.peak_blocks = max(s.peak_blocks, s.live_blocks)

    # -- saved-tensor hooks: re-gather freed units when backward needs them ---------------------
    def pack(self, t: torch.Tensor):
        base = t._base  # params are views of a unit's full buffer; most saved tensors are not views
        unit = None if base is None else self._freeable.get(id(base))
        return t if unit is None else _Saved(unit, t)

    def unpack(self, saved):
        if self._landing:  # backward is running: a good moment to update units whose grads landed
            self._deliver(block=False)
        if type(saved) is not _Saved:
            return saved
        unit = saved.unit
        if unit not in self._live or unit in self._pending:
            self._gather(unit)
            self._wait(unit)
        pos = self._pos[unit]
        if pos > 0 and self._order[pos - 1] != ROOT:
            self._gather(self._order[pos - 1])  # prefetch the unit backward reaches next
        return saved.tensor

    # -- backward: one flat reduce-scatter per bucket --------------------------------------------
    def reduce_unit(self, unit: str, grads: tuple) -> None:
        self._free(unit)
        i, handles = 0, []
        for b in self.unit_buckets[unit]:
            bucket = self.plan.buckets[b]
            n = len(bucket.slots)
            handles.append(self._reduce_bucket(b, bucket, grads[i:i + n]))
            i += n
        if self.update_buckets is None:
            self.reductions += handles
        else:  # (wait on each handle once: a second wait of a gloo reduce-scatter copies its result again)
            self._landing.append((unit, handles))
            self._deliver(block=False)

    def _deliver(self, block: bool) -> None:
        """Hand units whose reductions have landed to ``update_buckets``, in reduction order
        (the same on every rank, whatever each rank's timing)."""
        while self._landing:
            unit, handles = self._landing[0]
            if not block and not all(is_done(h) for h in handles):
                return
            self._timed_wait(handles)
            self._landing.popleft()
            self.update_buckets(self.unit_buckets[unit])
            if unit in self._early:
                if self._refill_in_backward:
                    self._refill(unit)
                else:
                    self._refill_later.append(unit)

    def _refill(self, unit: str) -> None:
        """The unit's shards were just updated: start the next step's gather of it now."""
        # This step is done with it: its reduction has landed here, so the peers that share
        # its buffer have passed its fast-tier reduction, hence its backward.
        self._release(unit)
        for b in self.unit_buckets[unit]:
            self.shards[b] = self._cast(self._masters[b])
        self._gather(unit)
        self._next[unit] = _snapshot(self._masters, self.unit_buckets[unit])

    def _reduce_bucket(self, b: int, bucket: Bucket, grads) -> Any:
        shard = self.grad_shards[b]
        unsharded = bucket.shard_size == 1 and not self.shared[b]
        flat = shard if unsharded else self.comm.grad_buffer(b, shard.dtype)
        views = [flat[s.offset:s.offset + s.numel].view(s.local_shape) for s in bucket.slots]
        torch._foreach_copy_(views, list(grads))
        if bucket.padded_numel > bucket.numel:
            flat[bucket.numel:].zero_()
        handle = self.comm.reduce(b, shard, flat)
        if not self.pipeline:
            self._timed_wait([handle])
            return DONE  # waited: no one may wait on it again
        return handle

    def _timed_wait(self, handles) -> None:
        t = time.perf_counter()
        for h in handles:
            h.wait()
        self.wait_s += time.perf_counter() - t

    def finish(self) -> None:
        """Wait for every reduction (the only place the step waits on them)."""
        if self.update_buckets is not None:
            self._deliver(block=True)
        self._timed_wait(self.reductions)
        self.reductions = []
        for u in list(self._live):
            if u not in self._next:
                self._release(u)
        for u in self._refill_later:
            self._refill(u)
        self._refill_later = []
        self._views = {}


@dataclass
class _Saved:
    unit: str
    tensor: torch.Tensor


def _snapshot(shards: list[torch.Tensor], indices) -> list[tuple]:
    """(index, tensor, version) of shards[i]: enough to tell later that nothing replaced or wrote them."""
    return [(i, shards[i], shards[i]._version) for i in indices]


def _untouched(snapshot: list[tuple], shards: list[torch.Tensor]) -> bool:
    return all(i < len(shards) and shards[i] is t and t._version == v for i, t, v in snapshot)


def _own_base(buf: torch.Tensor) -> torch.Tensor:
    """A tensor over ``buf``'s memory with a version counter of its own.

    Transports carve many buffers out of one segment, whose slices share one version
    counter: filling one unit's buffer would then count as an in-place change to every
    other unit's params, and autograd would reject them."""
    return torch.empty(0, dtype=buf.dtype, device=buf.device).set_(
        buf.untyped_storage(), buf.storage_offset(), buf.shape, buf.stride())


def _first_path(node: Any) -> str:
    return optree.tree_leaves(node, none_is_leaf=True)[0]
