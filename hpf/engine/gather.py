"""The gathered side of FSDP units: each unit's full flat buffers, their gathers, and the
autograd entry that hands a unit's params to the loss function as views of them.

One buffer per bucket lives as long as the engine:
- a bucket sharded over a shared-memory fast tier gets the transport's shared buffer (peers
  write it; it stays mapped);
- a bucket held whole by every rank (no FSDP split, no dtype cast) is the master shard itself:
  nothing to gather;
- any other bucket gets a plain buffer whose storage is allocated for a gather and resized to
  zero when its unit is evicted, unless anything outside the engine still references that
  memory: a param tensor handed out, a view of one, a compiled region's input (a local fact
  that only keeps memory; the unit still counts as evicted, so its next read gathers again:
  hpf.engine.residency decides every gather). Nothing can read freed memory, which compiled
  kernels would do without a check.

Autograd's saved param tensors are held as descriptions (``Saved``: bucket, shape, strides,
offset), not references, so they never keep a unit's memory: the saved-tensor hooks report
each one to the engine (``need``), which gathers it again per the residency policy before
backward uses it. The hooks run only while some unit can be freed.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch

from ..comm.schedule import LOG, wait
from ..planning import ROOT, Plan
from ..trace import span
from .residency import Actions

__all__ = ["UnitBuffers", "MemoryStats", "Saved", "entry"]


@dataclass
class MemoryStats:
    """Gathered-buffer accounting: what FSDP keeps alive, and what an access pattern costs."""

    live_bytes: int = 0
    peak_bytes: int = 0
    live_blocks: int = 0  # block units (not the root) whose gathered memory is held now
    peak_blocks: int = 0
    gathers: int = 0  # unit gathers, all steps
    # Gathers beyond loop-style use (each unit once in forward and at most once in backward).
    extra_gathers: int = 0


@dataclass
class Saved:
    """A saved param tensor (or alias) of a unit that may be freed: where it lies in the unit's
    buffer, so that it holds no reference to the memory."""

    unit: str
    bucket: int
    shape: tuple
    stride: tuple
    offset: int


class UnitBuffers:
    """Per unit: the gathered buffers, the gathers in flight, and the param views."""

    def __init__(self, plan: Plan, comm, compute_dtype: torch.dtype | None, device: torch.device, capacity: int,
                 on_extra_gather: Callable[[str, str], None] | None = None):
        self.plan, self.comm, self.compute_dtype, self.device = plan, comm, compute_dtype, device
        self.capacity, self.on_extra_gather = capacity, on_extra_gather
        bks = plan.buckets
        self.unit_buckets = {u: plan.units[u].buckets for u in plan.units}
        # Buckets every rank holds whole in the compute dtype: the buffer is the master shard.
        self.whole = [b.shard_size == 1 and (compute_dtype is None or compute_dtype == b.dtype)
                      and not comm.is_shared(b.index) for b in bks]
        self.shared = [comm.is_shared(b.index) for b in bks]
        self.full: list[torch.Tensor | None] = []
        self.nbytes: list[int] = []
        for b in bks:  # each plain buffer freed as soon as it is made: never the whole model at once
            f = None if self.whole[b.index] else _own_base(comm.full_buffer(b.index, compute_dtype or b.dtype))
            self.full.append(f)
            self.nbytes.append(0 if f is None else f.numel() * f.element_size())
            if f is not None and not self.shared[b.index]:
                f.untyped_storage().resize_(0)
        # Collectives write through a second tensor over the same memory, whose version counter
        # is its own: a re-gather into a buffer whose old views the loss function still holds
        # (the same values again) must not count as an in-place change of those views.
        self.fill = [None if f is None else _own_base(f) for f in self.full]
        #: units whose memory an eviction can free (their saved tensors need the hooks)
        self.freeable = {u for u, bs in self.unit_buckets.items() if any(
            not self.whole[b] and not self.shared[b] for b in bs)}
        # A saved tensor is recognized by its memory, not by being a view of a buffer: a compiled
        # region saves detached aliases of its param inputs (AOTAutograd detaches saved views).
        self._bucket_of_storage = {self.full[b].untyped_storage()._cdata: b for u in self.freeable
                                   for b in self.unit_buckets[u] if not self.whole[b] and not self.shared[b]}
        # references the engine itself holds to each plain buffer's memory (``full``, ``fill``):
        # any more are the loss function's, and keep the memory
        self._own_refs = {b: _use_count(self.full[b]) for b in self._bucket_of_storage.values()}
        # per unit: each param's (bucket, shape, stride, offset) in its buffer, slot order
        self.layout = {u: [(s.bucket, s.local_shape, _strides(s.local_shape), s.offset)
                           for b in self.unit_buckets[u] for s in bks[b].slots] for u in plan.units}
        # per unit: the positions of its frozen params among its views (handed out without grad)
        self.frozen_views = {u: [i for i, (b, *_) in enumerate(lay) if bks[b].frozen] for u, lay in self.layout.items()}
        self.shards: list[torch.Tensor] = []
        self.pending: dict[str, list] = {}  # unit -> gathers in flight
        self._landed: dict[str, float] = {}  # unit -> when its last gather landed (``_unreferenced``)
        self.live: set[str] = set()  # units whose buffers hold this step's values
        self.allocated: set[str] = set()  # freeable units whose plain storage is allocated
        self.lingering: dict[str, None] = {}  # evicted units whose storage waits for their views to die
        self.handed: dict[str, list] = {}  # unit -> weak references to the param views handed out
        self.stats = MemoryStats()
        self._held: set[str] = set()  # units whose gathered memory is held now
        self.deferred: list[tuple[str, str]] = []  # prefetches decided, waiting for memory (in order)
        self._gathered: set[str] = set()  # units gathered in this phase (forward, then backward)
        self.wait_s = 0.0  # seconds compute spent blocked on collectives (the engine takes it)

    # -- shards ---------------------------------------------------------------------------------------
    def set_shards(self, masters: list[torch.Tensor], keep: set[str] = frozenset()) -> None:
        """The step's master shards, cast to the compute dtype (units in ``keep`` keep theirs)."""
        cdt = self.compute_dtype
        old = self.shards
        with span("hpf/cast shards"):
            self.shards = [old[b] if old and self.plan.buckets[b].unit in keep
                           else (m if cdt is None or m.dtype == cdt else m.to(cdt)) for b, m in enumerate(masters)]
        for b, whole in enumerate(self.whole):
            if whole:
                self.full[b] = masters[b]

    # -- gather, wait, release --------------------------------------------------------------------------
    # -- the residency policy's actions ---------------------------------------------------------------
    def apply(self, acts: Actions, phase: str) -> None:
        """Carry out the policy's actions. A prefetch waits for memory (an evicted unit whose
        param tensors the loss function still holds, e.g. the previous block in its loop
        variable) until a saved-tensor hook or the next collective finds it free: local facts
        may delay when a gather starts, never what is gathered or in which order. Each gather
        is recorded in the schedule log when decided."""
        if acts.evict:
            self.flush(force=True)
            for u in acts.evict:
                self.release(u)
        for u in acts.gather:
            self.flush(force=True)
            LOG.record("all-gather", u, phase == "backward")
            self._start(u, phase)
        for u in acts.prefetch:
            LOG.record("all-gather", u, phase == "backward")
            self.deferred.append((u, phase))
        self.flush(force=False)

    def flush(self, force: bool) -> None:
        """Start the deferred prefetches: all of them (``force``), or those there is memory for."""
        if not self.deferred:
            return
        if not force:
            self.free_lingering()
        while self.deferred and (force or len(self.allocated - {ROOT}) < self.capacity):
            self._start(*self.deferred.pop(0))

    def new_phase(self, gathered: set[str]) -> None:
        """Forward or backward begins with ``gathered`` in place (a second gather of a unit in one
        phase is an extra one: reported, and warned of in validation mode)."""
        self._gathered = gathered

    def _start(self, unit: str, phase: str) -> None:
        if unit in self._gathered:
            self.stats.extra_gathers += 1
            if self.on_extra_gather is not None:
                self.on_extra_gather(unit, phase)
        self._gathered.add(unit)
        self.gather(unit)

    def gather(self, unit: str) -> None:
        """Start gathering ``unit`` into its buffers (``apply`` recorded it in the schedule log)."""
        self.lingering.pop(unit, None)  # (evicted, still held, not yet freed: gathered into the same memory)
        handles = self.pending.setdefault(unit, [])
        with span("hpf/gather", unit):
            for b in self.unit_buckets[unit]:
                if self.whole[b]:
                    continue
                full = self.full[b]
                if not self.shared[b] and full.untyped_storage().nbytes() == 0:
                    full.untyped_storage().resize_(self.nbytes[b])
                    self._account(unit, self.nbytes[b])
                    self.allocated.add(unit)
                elif self.shared[b]:
                    self._account(unit, 0)
                handles.append(self.comm.all_gather(b, self.fill[b], self.shards[b]))
        self.live.add(unit)
        self.stats.gathers += 1

    def wait(self, unit: str) -> None:
        """Wait for ``unit``'s gathers in flight (started first if still deferred)."""
        if any(u == unit for u, _ in self.deferred):
            self.flush(force=True)
        handles = self.pending.pop(unit, None)
        if handles:
            t = time.perf_counter()
            with span("hpf/wait all-gather"):
                for h in handles:
                    wait(h, f"the all-gather of {unit}")
            self._landed[unit] = time.perf_counter()
            self.wait_s += time.perf_counter() - t

    def wait_all(self) -> None:
        for unit in list(self.pending):
            self.wait(unit)

    def release(self, unit: str) -> None:
        """Evict ``unit``. Its plain storage is freed now, or, while a param tensor handed out for
        it is alive, the first time ``free_lingering`` finds them all dead."""
        self.live.discard(unit)
        if unit in self.freeable:
            self.lingering[unit] = None
            self.free_lingering()

    def free_lingering(self, force: bool = False) -> None:
        """Free the storage of evicted units that nothing holds any more (``force``: the step is
        over, and param tensors kept past it become NaN, ``_poison``). A unit whose next gather
        is already decided (a deferred prefetch) keeps its memory, and so does one whose memory
        anything outside the engine still references (a view of a param, a kept tensor)."""
        deferred = {u for u, _ in self.deferred}
        for unit in list(self.lingering):
            if unit in deferred or (not force and any(ref() is not None for ref in self.handed.get(unit, ()))):
                continue
            if force:
                _poison([ref() for ref in self.handed.get(unit, ())])
            if unit in self.pending:  # a gather still writing into it (every rank issued it: it lands)
                self.wait(unit)
            plain = [b for b in self.unit_buckets[unit] if not self.whole[b] and not self.shared[b]]
            if not self._unreferenced(unit, plain):
                continue
            del self.lingering[unit]
            self.handed.pop(unit, None)
            for b in plain:
                st = self.full[b].untyped_storage()
                if st.nbytes():
                    st.resize_(0)
                    self._account(unit, -self.nbytes[b])
            self.allocated.discard(unit)
            self._held.discard(unit)
            self.stats.live_blocks = len(self._held - {ROOT})

    def _unreferenced(self, unit: str, buckets: list[int]) -> bool:
        """Whether nothing outside the engine references these buffers' memory. A gather that has
        landed may still be referenced by its backend's worker thread for a moment (gloo's,
        measured: up to 0.5 ms at load 5), so a surplus gets until ``_SETTLE_S`` after the landing
        to go; one that lasts longer is the loss function's (a kept view), and keeps the memory."""
        deadline = self._landed.get(unit, 0.0) + _SETTLE_S
        while any(_use_count(self.full[b]) > self._own_refs[b] for b in buckets):
            if time.perf_counter() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def free_all(self) -> None:
        """Free every plain buffer, held or not (the step is over)."""
        for unit in self.allocated:
            self.lingering[unit] = None
        self.free_lingering(force=True)

    def _account(self, unit: str, nbytes: int) -> None:
        s = self.stats
        s.live_bytes += nbytes
        s.peak_bytes = max(s.peak_bytes, s.live_bytes)
        self._held.add(unit)
        s.live_blocks = len(self._held - {ROOT})
        s.peak_blocks = max(s.peak_blocks, s.live_blocks)

    # -- the params the loss function sees ------------------------------------------------------------
    def views(self, unit: str) -> list[torch.Tensor]:
        full = self.full  # (as_strided takes the offset in the whole storage: shared buffers start inside one)
        return [full[b].as_strided(shape, stride, full[b].storage_offset() + off)
                for b, shape, stride, off in self.layout[unit]]

    def hand_out(self, unit: str, views) -> None:
        """Remember the views given to the loss function (only their liveness matters)."""
        if unit in self.freeable:
            refs = self.handed.setdefault(unit, [])
            refs.extend(weakref.ref(v) for v in views)

    # -- saved-tensor hooks -----------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        try:
            b = self._bucket_of_storage.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # (a tensor with no storage of its own: never a param)
            return t
        if b is None or t.dtype != self.full[b].dtype:  # (not a unit's, or reinterpreted: held as it is)
            return t
        return Saved(self.plan.buckets[b].unit, b, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(self, saved: Saved) -> torch.Tensor:
        """A saved tensor again, over its unit's buffer (gathered: the engine waited for it)."""
        return self.full[saved.bucket].as_strided(saved.shape, saved.stride, saved.offset)


class _Entry(torch.autograd.Function):
    """One read of a unit: its params as views of its buffers; backward hands the grads to the
    engine's reducer. The plain form: no per-call signature binding (half the cost)."""

    @staticmethod
    def forward(ctx, anchor, engine, unit):  # noqa: ARG004 - anchor only makes backward run
        ctx.engine, ctx.unit, ctx.stamp = engine, unit, engine.micro_batches
        views = tuple(engine.buffers.views(unit))
        frozen = engine.buffers.frozen_views[unit]
        if frozen:
            ctx.mark_non_differentiable(*(views[i] for i in frozen))
        return views

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.entry_done(ctx.unit, grads, ctx.stamp)
        return None, None, None


class _FuncEntry(torch.autograd.Function):
    """The same entry for reads under torch.func transforms (vmap, grad, jvp inside loss_fn),
    which need ``setup_context`` and a vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(anchor, engine, unit):  # noqa: ARG004
        return tuple(engine.buffers.views(unit))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.engine, ctx.unit = inputs[1], inputs[2]
        ctx.stamp = ctx.engine.micro_batches
        frozen = ctx.engine.buffers.frozen_views[ctx.unit]
        if frozen:
            ctx.mark_non_differentiable(*(output[i] for i in frozen))

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.entry_done(ctx.unit, grads, ctx.stamp)
        return None, None, None

    @staticmethod
    def jvp(ctx, *tangents):  # noqa: ARG004 - the params do not depend on the anchor
        return tuple(torch.zeros_like(v) for v in ctx.engine.buffers.views(ctx.unit))


class _Rematerialized(torch.autograd.Function):
    """A block ``fn(unit's params, *args)`` that keeps only ``args`` for backward, which gathers
    the unit again and recomputes ``fn`` under ``torch.func.vjp`` (saved-tensor hooks cannot
    free params under torch.func transforms, so nothing of the unit may be saved). The block's
    float tensor outputs are the Function's; its other outputs ride in ``box``."""

    @staticmethod
    def forward(anchor, engine, unit, fn, box, *args):  # noqa: ARG004 - anchor only makes backward run
        engine.buffers.wait(unit)
        leaves, box.treedef = optree.tree_flatten(fn(engine.view.subtree(unit, tuple(engine.buffers.views(unit))),
                                                      *args), none_is_leaf=True)
        box.is_output = [_is_float(x) for x in leaves]
        box.others = [x for x in leaves if not _is_float(x)]
        return tuple(x for x in leaves if _is_float(x))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, engine, unit, fn, _, *args = inputs
        ctx.engine, ctx.unit, ctx.fn, ctx.stamp = engine, unit, fn, engine.micro_batches
        ctx.float_args = [i for i, a in enumerate(args) if _is_float(a)]
        ctx.args = [None if i in ctx.float_args else a for i, a in enumerate(args)]
        ctx.save_for_backward(*(args[i] for i in ctx.float_args))

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.args)

        def block(views, float_args):
            for i, a in zip(ctx.float_args, float_args):
                args[i] = a
            out = ctx.fn(ctx.engine.view.subtree(ctx.unit, views), *args)
            return tuple(x for x in optree.tree_leaves(out, none_is_leaf=True) if _is_float(x))
        with torch.no_grad():  # (first-order: no tape around the vjp, which would hold the params)
            _, vjp = torch.func.vjp(block, ctx.engine.regather(ctx.unit), tuple(ctx.saved_tensors))
            param_grads, arg_grads = vjp(grads)
            del vjp
        ctx.engine.entry_done(ctx.unit, param_grads, ctx.stamp)
        out = [None] * (5 + len(ctx.args))
        for i, g in zip(ctx.float_args, arg_grads):
            out[5 + i] = g
        return tuple(out)


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def rematerialized(engine, unit: str, fn, args: tuple):
    """``fn(unit's params, *args)`` as a ``_Rematerialized`` block (the engine recorded the read)."""
    box = _Box()  # (not a dict: torch.func flattens a Function's pytree inputs into copies)
    outs = iter(_Rematerialized.apply(engine._anchor, engine, unit, fn, box, *args))
    others = iter(box.others)
    return optree.tree_unflatten(box.treedef, [next(outs) if t else next(others) for t in box.is_output])


class _Box:
    """What a ``_Rematerialized`` block returned besides its float tensors."""

    treedef: Any
    is_output: list
    others: list


def entry(anchor: torch.Tensor, engine, unit: str) -> tuple:
    """A new autograd entry of ``unit``: its params as views."""
    fn = _FuncEntry if torch._C._are_functorch_transforms_active() else _Entry
    return fn.apply(anchor, engine, unit)


_SETTLE_S = 0.005  # how long a landed collective's backend may hold a buffer (``_unreferenced``)


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _poison(kept: list) -> None:
    """Point param tensors that outlive their unit's memory (kept past the step: a global, a
    cache, a compiled function's constant) at NaN instead of freed memory: a compiled kernel
    would read freed memory (a crash), eager ops raise; NaN is loud everywhere, and their
    backward raises StaleParamError (``UnitEngine.entry_done``). One element each."""
    with torch.no_grad():
        for t in kept:
            if t is not None:
                t.data = torch.full((), float("nan"), dtype=t.dtype, device=t.device).expand(t.shape)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return tuple(reversed(out))


def _own_base(buf: torch.Tensor) -> torch.Tensor:
    """A tensor over ``buf``'s memory with a version counter of its own.

    Transports carve many buffers out of one segment, whose slices share one version
    counter: filling one unit's buffer would then count as an in-place change to every
    other unit's params, and autograd would reject them."""
    return torch.empty(0, dtype=buf.dtype, device=buf.device).set_(
        buf.untyped_storage(), buf.storage_offset(), buf.shape, buf.stride())

