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

import contextlib
import gc
import time
import warnings
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import optree
import torch

from . import tree as tree_util
from .trace import Ranges, span
from .comm import schedule
from .comm.schedule import LOG
from .comm.transport import DONE, UnitComm, is_done
from .planning import ROOT, Plan, _unit_names

__all__ = ["UnitEngine", "MemoryStats"]


@dataclass
class MemoryStats:
    """Gathered-buffer accounting: what FSDP keeps alive, and what an access pattern costs."""

    live_bytes: int = 0
    peak_bytes: int = 0
    live_blocks: int = 0  # gathered units other than the root
    peak_blocks: int = 0
    gathers: int = 0  # unit gathers, all steps
    # Gathers beyond loop-style use (each unit once in forward and at most once in backward):
    # a unit read again after it was freed, in forward or in backward.
    extra_gathers: int = 0


class _GatherUnit(torch.autograd.Function):
    """Hands out a gathered unit's params as views; backward adds their grads into the unit's
    grad buffers, which are reduced once every entry of the unit this step has reported.
    ``setup_context`` and a generated vmap rule let it run inside torch.func transforms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(anchor, engine, unit):  # noqa: ARG004 - anchor only makes backward run
        return tuple(engine.unit_views(unit))

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ARG004
        ctx.engine, ctx.unit = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.reduce_unit(ctx.unit, grads)
        return None, None, None

    @staticmethod
    def jvp(ctx, *tangents):  # noqa: ARG004 - the params do not depend on the anchor
        return tuple(torch.zeros_like(v) for v in ctx.engine.unit_views(ctx.unit))


class _Lease:
    """Tagged on the param tensors of one entry of a unit. When the loss function has dropped
    all of them, the unit may be freed: CPython drops them at the last reference, the same
    moment on every rank (the step keeps the cyclic collector off while it runs)."""

    __slots__ = ("engine", "unit", "step")

    def __init__(self, engine: "UnitEngine", unit: str, step: int):
        self.engine, self.unit, self.step = engine, unit, step
        engine._holds[unit] += 1

    def __del__(self):
        self.engine._dropped(self.unit, self.step)


class _UnitList(list):
    """A list of FSDP units (a real list of their names) that gathers a unit whenever the loss
    function reads it: by index, negative index, iteration (any number of times), reversed;
    a slice is another such list."""

    def __init__(self, engine: "UnitEngine", names: list[str]):
        super().__init__(names)
        self._engine = engine

    def __getitem__(self, i):
        if isinstance(i, slice):
            return _UnitList(self._engine, list.__getitem__(self, i))
        return self._engine.enter(list.__getitem__(self, i))

    def __iter__(self):
        for name in list.__iter__(self):
            yield self._engine.enter(name)

    def __reversed__(self):
        for name in list.__reversed__(self):
            yield self._engine.enter(name)


class UnitEngine:
    """Runs one training step's forward and backward over a plan's units.

    A unit is gathered when the loss function reads it and stays gathered while the function
    holds any of its param tensors (a lease on them); it is freed once they are dropped and
    the function has moved to another unit, so loop-style use keeps at most two blocks live.
    Read again later, it is gathered again. Each read is one autograd entry; grads of all
    entries of a unit add up in its grad buffers, reduced once per step.
    """

    def __init__(self, plan: Plan, rank: int, comm: UnitComm, compute_dtype: torch.dtype | None,
                 device: torch.device, pipeline: bool = True):
        """Grads are reduced in the dtype of the grad shards the step passes to ``begin``."""
        self.plan, self.rank, self.comm = plan, rank, comm
        self.device = device
        self.compute_dtype = compute_dtype
        self.stats = MemoryStats()
        self.wait_s = 0.0
        # False: units stay gathered from first read to backward, with no saved-tensor hooks
        # (torch.func.grad/vjp inside loss_fn refuse those hooks; the step switches on its own).
        self.leases = True
        self.warn_extra = False  # validation mode: warn, naming the unit and op, at each extra gather
        self.describe_op: Callable[[], str] | None = None
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
        self._step = 0
        self.pipeline = pipeline
        self.units = list(plan.units)
        self.unit_buckets = {u: plan.units[u].buckets for u in self.units}
        # A unit wholly in shared memory stays mapped for the step: no free, no re-gather.
        self.unit_shared = {u: all(self.shared[b] for b in bs) for u, bs in self.unit_buckets.items()}
        # Full buffers of units that are freed in forward, so backward must re-gather them.
        self._freeable = {id(self.full[b]): u for u, bs in self.unit_buckets.items()
                          if u != ROOT and not self.unit_shared[u] for b in bs}
        self._next_unit = dict(zip(self.units, self.units[1:]))
        self._predict: dict[str, str] = {}  # unit -> the unit read after it last step (prefetch)
        # Per unit: the param views in slot order, and how to build its subtree from them.
        self._slices = {u: [(b, s.offset, s.numel, s.local_shape) for b in self.unit_buckets[u]
                            for s in bks[b].slots] for u in self.units}
        self._slot_paths = {u: [s.path for b in self.unit_buckets[u] for s in bks[b].slots] for u in self.units}
        self._slot_at = {p: (u, i) for u, ps in self._slot_paths.items() for i, p in enumerate(ps)}
        self._leaf_paths = plan.leaf_paths or list(plan.slots)
        self._skeleton, self._skeleton_leaves = self._skeleton_of(plan)
        self._subtree = {name: self._subtree_builder(name) for kind, v in self._skeleton_leaves
                         if kind == "units" for name in v}
        self.grad_shards: list[torch.Tensor] = []
        self.reductions: list = []  # handles of this step's grad reductions
        # Gradient accumulation: while ``holding``, a unit's grads are summed here (one full
        # flat buffer per bucket) instead of reduced; the next reduction adds them in, so a
        # step of K micro-batches communicates once, on the last one.
        self.holding = False
        self._held: dict[int, torch.Tensor] = {}
        # Optimizer overlap: the step passes update_buckets(bucket indices) for one step (see
        # overlapping); the engine calls it, in reduction order, as soon as a unit's grads
        # have landed, then starts the next step's gather of the unit if begin() would (_refill).
        self._update_buckets: Callable[[list[int]], None] | None = None
        self._landing: deque = deque()  # (unit, handles) reduced but not yet handed to update_buckets
        self._next: dict[str, list] = {}  # unit -> _snapshot of its master shards, gathered for the next step
        self._refill_later: list[str] = []
        self._early = {u for i, u in enumerate(self.units) if i < 2 or self.unit_shared[u]}
        # Refilling in backward is safe for the collective order only when backward never
        # re-gathers (every unit shared); otherwise refills wait for finish().
        self._refill_in_backward = all(self.unit_shared.values())
        self._phase = Ranges()  # trace: each unit's forward and backward, back to back
        self._reset_step()

    # -- building the params tree the loss function sees ------------------------------------
    def _subtree_builder(self, unit: str) -> Callable[[], Any]:
        """The subtree of list element ``unit``; a tied leaf is read through its owner's unit."""
        node: Any = optree.tree_unflatten(self.plan.treedef, self._leaf_paths)
        for key in unit.split("/"):
            node = node[int(key)] if isinstance(node, list) else node[key]
        _, leaves, treedef = tree_util.flatten(node)
        owners = [self._slot_at[self.plan.ties.get(p, p)] for p in leaves]
        need = sorted(dict.fromkeys(u for u, _ in owners), key=lambda u: u == unit)  # its own unit last
        where = [(need.index(u), i) for u, i in owners]

        def build():
            views = [self._views_of(u) for u in need]
            return optree.tree_unflatten(treedef, [views[k][i] for k, i in where])
        return build

    def _skeleton_of(self, plan: Plan):
        paths_tree = optree.tree_unflatten(plan.treedef, self._leaf_paths)
        leaves, skeleton = optree.tree_flatten(paths_tree, is_leaf=lambda x: isinstance(x, list),
                                               none_is_leaf=True)
        unit_of = dict(zip(self._leaf_paths, _unit_names(paths_tree)))
        out = []
        for leaf in leaves:
            if isinstance(leaf, list):  # a list of units: remember their names
                prefix = unit_of[_first_path(leaf)].rsplit("/", 1)[0]
                out.append(("units", [f"{prefix}/{i}" for i in range(len(leaf))]))
            else:
                out.append(("root", leaf))
        return skeleton, out

    def params_tree(self) -> Any:
        """The loss function's params: root params as views, unit lists gathered when read."""
        self._phase.switch("hpf/forward", ROOT)
        root = self._views_of(ROOT) if ROOT in self.units else ()
        self._root_views = root
        leaves = [root[self._slot_at[self.plan.ties.get(v, v)][1]] if kind == "root" else _UnitList(self, v)
                  for kind, v in self._skeleton_leaves]
        return optree.tree_unflatten(self._skeleton, leaves)

    def gathered_tree(self) -> Any:
        """Every unit gathered at once, as one params tree of plain views (grad="torch.func"):
        tied paths hold one tensor."""
        for u in self.units:
            self._gather(u)
        by_path = {}
        for u in self.units:
            self._wait(u)
            self._entries[u] += 1  # reduce_tree reports its grads
            by_path.update(zip(self._slot_paths[u], self.unit_views(u)))
        return self.plan.tree(by_path)

    def reduce_tree(self, grads: Any) -> None:
        """Reduce grads of ``gathered_tree``'s params; a tied param's grads are summed first."""
        sums: dict[str, torch.Tensor] = {}
        for p, g in zip(self._leaf_paths, optree.tree_leaves(grads, none_is_leaf=True)):
            o = self.plan.ties.get(p, p)
            sums[o] = g if o not in sums else sums[o] + g
        for u in reversed(self.units):  # backward's order: the first units land last
            self.reduce_unit(u, tuple(sums[p] for p in self._slot_paths[u]))

    # -- a step ----------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._step += 1  # leases of earlier steps are stale
        self._order: list[str] = []  # block units in the order the loss function first read them
        self._pos: dict[str, int] = {}
        self._entries: Counter = Counter()  # unit -> autograd entries whose backward has not run
        self._holds: Counter = Counter()  # unit -> live leases
        self._acc: dict[str, list] = {}  # unit -> flat grad buffers, summed over its entries
        self._reduced: set[str] = set()
        self._latest: str | None = None  # the block unit read last
        self._want: str | None = None  # a prefetch waiting for a free slot
        self._root_views = None
        self.in_backward = False
        self._seen: set[str] = set(self._live)  # units gathered in this phase (forward / backward)

    def begin(self, shards: list[torch.Tensor], grad_shards: list[torch.Tensor]) -> None:
        """Start a step: cast shards to the compute dtype and start gathering the first units.

        The step calls this right after the optimizer, so the next step's first gathers
        overlap whatever the caller does between steps; ``ready_for`` tells whether that
        prefetch still matches the shards the next step is given. Units refilled during the
        last backward (optimizer overlap) are kept if their shards are still these."""
        kept = {u for u, snapshot in self._next.items() if _untouched(snapshot, shards)}
        self._abandon(keep=kept)
        buckets = self.plan.buckets
        with span("hpf/cast shards"):
            self.shards = [self.shards[b] if buckets[b].unit in kept else self._cast(s) for b, s in enumerate(shards)]
        self._masters = list(shards)
        self.grad_shards = grad_shards
        self.reductions = []
        self._landing.clear()
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        # Plain buffers: the first two units (memory bound). Units in shared memory cost no
        # memory to keep, so all of them are queued now, to stream in ahead of the compute.
        for u in self.units:
            if u in self._early:
                self._gather(u)
        self._reset_step()
        self._begun = _snapshot(shards, range(len(shards)))

    def start_backward(self) -> None:
        """Backward begins: a unit read from here on is a checkpoint recomputing, and each
        freed unit may be gathered once more without counting as extra."""
        self.in_backward = True
        self._seen = set(self._live)
        self._phase.switch("hpf/backward", self._latest or ROOT)

    @contextlib.contextmanager
    def running(self):
        """Around a step's forward and backward: no cyclic garbage collection, so units are
        freed at the same moments on every rank (their gathers are collectives)."""
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()

    @contextlib.contextmanager
    def overlapping(self, update_buckets: Callable[[list[int]], None] | None) -> Iterator[None]:
        """Within the block (one step's forward, backward and ``finish``), hand each unit's
        buckets to ``update_buckets`` as soon as their reductions land (None: no overlap,
        ``finish`` waits for every reduction)."""
        self._update_buckets = update_buckets
        try:
            yield
        finally:
            self._update_buckets = None

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
        """Called whenever the loss function reads list element ``unit``: its params, gathered."""
        return self._subtree[unit]()

    def _views_of(self, unit: str) -> tuple:
        """A new autograd entry of ``unit`` (gathered if it is not): its params as views."""
        if unit == ROOT and self._root_views is not None:
            return self._root_views
        if self.in_backward:  # a checkpoint recomputing: values only; the forward's entries take the grads
            self._gather(unit)
            self._wait(unit)
            return tuple(self.unit_views(unit))
        if unit != ROOT:
            if unit not in self._pos:
                self._pos[unit] = len(self._order)
                self._order.append(unit)
            latest = self._latest
            if latest not in (None, unit) and self.leases and not self._holds[latest]:
                self._free(latest)
            self._latest = unit
            self._phase.switch("hpf/forward", unit)
            if unit not in self._live and self.stats.live_blocks >= 2:  # drop prefetches the function skipped
                for u in [u for u in self._live if u not in self._pos and u != ROOT]:
                    self._free(u)
        self._gather(unit)
        self._wait(unit)
        if unit != ROOT:
            self._prefetch_after(unit)
        views = _GatherUnit.apply(self.anchor, self, unit)
        self._entries[unit] += 1
        if self.leases and unit != ROOT:
            lease = _Lease(self, unit, self._step)
            for v in views:
                v._hpf_lease = lease
        return views

    def _prefetch_after(self, unit: str) -> None:
        """Start gathering the unit read after ``unit`` last step (first step: tree order),
        within the bound of two gathered blocks; else once a block is freed."""
        nxt = self._predict.get(unit) or self._next_unit.get(unit)
        if nxt is None or nxt in self._pos or nxt in self._live:
            return
        if self.stats.live_blocks < 2:
            self._gather(nxt)
        else:
            self._want = nxt

    def _dropped(self, unit: str, step: int) -> None:
        """A lease died: free the unit if nothing holds it and the function has moved on."""
        if step != self._step:
            return
        self._holds[unit] -= 1
        if self._holds[unit] or unit == self._latest or self.in_backward:
            return
        self._free(unit)
        want = self._want
        if want is not None and self.stats.live_blocks < 2:
            self._want = None
            if want not in self._pos:
                self._gather(want)

    def unit_views(self, unit: str) -> list[torch.Tensor]:
        return [self.full[b][off:off + n].view(shape) for b, off, n, shape in self._slices[unit]]

    # -- gather / free -----------------------------------------------------------------------------
    def _gather(self, unit: str) -> None:
        if unit in self._live:
            return
        if unit in self._seen:
            self._extra(unit)
        self._seen.add(unit)
        handles = []
        LOG.record("all-gather", unit)
        with span("hpf/gather", unit):
            for b in self.unit_buckets[unit]:
                st = self.full[b].untyped_storage()
                if not self.shared[b]:
                    st.resize_(self.nbytes[b])
                handles.append(self.comm.all_gather(b, self.full[b], self.shards[b]))
        self._pending[unit] = handles
        self._live.add(unit)
        self.stats.gathers += 1
        self._account(unit, +1)

    def _extra(self, unit: str) -> None:
        self.stats.extra_gathers += 1
        if self.warn_extra:
            phase = "backward" if self.in_backward else "forward"
            op = f", at op {self.describe_op()}" if self.describe_op and not self.in_backward else ""
            warnings.warn(f"hpf: unit {unit!r} is gathered again in {phase}{op}: loss_fn read it after it was "
                          "freed (its params were dropped and another unit was read). Correct, but it costs one "
                          "more all-gather per step; read each unit's params in one stretch to avoid it",
                          stacklevel=2)

    def take_wait_s(self) -> float:
        """Seconds compute spent waiting on collectives since the last call."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def _wait(self, unit: str) -> None:
        handles = self._pending.pop(unit, ())
        if handles:
            self._timed_wait(handles, "hpf/wait all-gather")

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
        # A detached alias: saving must not hold the param tensor (its lease) alive.
        return t if unit is None else _Saved(unit, t.detach())

    def unpack(self, saved):
        if self._landing:  # backward is running: a good moment to update units whose grads landed
            self._deliver(block=False)
        if type(saved) is not _Saved:
            return saved
        unit = saved.unit
        if unit not in self._live or unit in self._pending:
            self._gather(unit)
            self._wait(unit)
        pos = self._pos.get(unit, 0)
        if pos > 0 and self._entries[self._order[pos - 1]]:
            self._gather(self._order[pos - 1])  # prefetch the unit backward reaches next
        return saved.tensor

    # -- backward: one flat reduce-scatter per bucket --------------------------------------------
    def reduce_unit(self, unit: str, grads: tuple) -> None:
        """One entry's grads: add them to the unit's grad buffers; reduce once all are in."""
        self._entries[unit] -= 1
        flats = self._acc.get(unit)
        first = flats is None
        if first:
            flats = self._acc[unit] = [self._grad_flat(b) for b in self.unit_buckets[unit]]
        i = 0
        with span("hpf/copy grads", unit):
            for b, flat in zip(self.unit_buckets[unit], flats):
                slots = self.plan.buckets[b].slots
                views = [flat[s.offset:s.offset + s.numel].view(s.local_shape) for s in slots]
                (torch._foreach_copy_ if first else torch._foreach_add_)(views, list(grads[i:i + len(slots)]))
                i += len(slots)
        if not self._entries[unit]:
            self._reduce(unit)
            if self.in_backward:  # the autograd entries of the unit read before it come next
                pos = self._pos.get(unit, 0)
                self._phase.switch("hpf/backward", self._order[pos - 1] if pos > 0 else ROOT)

    def _grad_flat(self, b: int) -> torch.Tensor:
        bucket, shard = self.plan.buckets[b], self.grad_shards[b]
        unsharded = bucket.shard_size == 1 and not self.shared[b]
        flat = shard if unsharded else self.comm.grad_buffer(b, shard.dtype)
        if bucket.padded_numel > bucket.numel:
            flat[bucket.numel:].zero_()
        return flat

    def _reduce(self, unit: str) -> None:
        flats = self._acc.pop(unit, None)
        if flats is None:  # never read this step (or its params never reached the loss): zero grads
            flats = [self._grad_flat(b).zero_() for b in self.unit_buckets[unit]]
        self._reduced.add(unit)
        self._free(unit)
        buckets = self.unit_buckets[unit]
        if self.holding:  # an earlier micro-batch: keep the grads here, communicate nothing
            for b, flat in zip(buckets, flats):
                if b in self._held:
                    self._held[b].add_(flat)
                else:
                    self._held[b] = flat.clone()  # (flat may be a comm buffer or the grad shard itself)
            return
        for b, flat in zip(buckets, flats):
            held = self._held.pop(b, None)
            if held is not None:
                flat.add_(held)
        handles = [self._reduce_flat(b, flat) for b, flat in zip(buckets, flats)]
        if self._update_buckets is None:
            self.reductions += handles
        else:  # (wait on each handle once: a second wait of a gloo reduce-scatter copies its result again)
            self._landing.append((unit, handles))
            self._deliver(block=False)

    def drop_held(self) -> None:
        """Forget the grads held from earlier micro-batches (a step that raised or skipped)."""
        self._held.clear()

    def _deliver(self, block: bool) -> None:
        """Hand units whose reductions have landed to ``update_buckets``, in reduction order
        (the same on every rank, whatever each rank's timing)."""
        while self._landing:
            unit, handles = self._landing[0]
            if not block and not all(is_done(h) for h in handles):
                return
            self._timed_wait(handles, "hpf/wait reduce-scatter")
            self._landing.popleft()
            with span("hpf/optimizer", unit):
                self._update_buckets(self.unit_buckets[unit])
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
        self._seen.discard(unit)  # the next step's gather, not an extra one
        self._gather(unit)
        self._next[unit] = _snapshot(self._masters, self.unit_buckets[unit])

    def _reduce_flat(self, b: int, flat: torch.Tensor) -> Any:
        LOG.record("reduce-scatter", self.plan.buckets[b].unit, b)
        with span("hpf/reduce-scatter bucket", b):
            handle = self.comm.reduce(b, self.grad_shards[b], flat)
        if not self.pipeline:
            self._timed_wait([handle], "hpf/wait reduce-scatter")
            return DONE  # waited: no one may wait on it again
        return handle

    def _timed_wait(self, handles, what: str) -> None:
        """Wait for ``handles``; ``what`` names the wait on the trace."""
        t = time.perf_counter()
        with span(what):
            for h in handles:
                schedule.wait(h, what)
        self.wait_s += time.perf_counter() - t

    def finish(self) -> None:
        """Reduce what backward has not (units not read, or read but unused), then wait for
        every reduction (the only place the step waits on them)."""
        self._phase.end()
        for u in self.units:
            if u not in self._reduced:
                self._reduce(u)
        if self._update_buckets is not None:
            self._deliver(block=True)
        self._timed_wait(self.reductions, "hpf/wait reduce-scatter")
        self.reductions = []
        for u in list(self._live):
            if u not in self._next:
                self._release(u)
        for u in self._refill_later:
            self._refill(u)
        self._refill_later = []
        if self._order:  # next step: predict the read order, and start on its first units
            self._predict = dict(zip(self._order, self._order[1:]))
            first = [u for u in self.units if u == ROOT] + self._order
            self._early = set(first[:2]) | {u for u in self.units if self.unit_shared[u]}
        self._reset_step()


def explain_freed(err: RuntimeError) -> Exception:
    """A clear error for reading a freed unit through a view that outlived its param tensors."""
    if "data is not allocated" not in str(err) and "for storage of size 0" not in str(err):
        return err
    return RuntimeError(
        "loss_fn read an FSDP unit's param through a view (a slice, .T, .chunk, ...) after dropping every "
        "reference to the param tensors themselves, so hpf had freed the unit. Keep the param tensor (e.g. "
        "blk['w']) alive while its views are in use, or take the views where they are used")


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
