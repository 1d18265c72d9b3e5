"""The gathered side of FSDP units: each unit is one object (``LiveUnit``, its runtime state an
hpf.engine.unit_state.UnitState) that also owns its full flat buffers and the param tensors
handed out for it. Its state moves only along ``unit_state.MOVES``:

    SHARDED --(prefetch decided, no memory yet)--> QUEUED --> GATHERING --(landed)--> GATHERED
    GATHERING/GATHERED --(evicted)--> RELEASING --(nothing references its memory)--> SHARDED

The residency policy (hpf.engine.residency) decides every transition but the last from the
reads alone; ``Gatherer`` carries its actions out. The last one is a local fact, which only
keeps memory: an evicted unit whose param tensors the loss function still holds (a loop
variable, a view, a compiled region's input) stays RELEASING until they die, and a later
gather of it reuses that memory. Nothing can read freed memory, which compiled kernels would
do without a check.

Buffers, one per bucket, live as long as the engine:
- a bucket sharded over a shared-memory fast tier gets the transport's shared buffer (peers
  write it; it stays mapped);
- a bucket held whole by every rank (no FSDP split, no dtype cast) is the master shard itself:
  nothing to gather;
- any other bucket gets a plain buffer whose storage is allocated for a gather and resized to
  zero when its unit is freed.

Autograd's saved param tensors are held as descriptions (``Saved``: bucket, shape, strides,
offset), not references, so they never keep a unit's memory: the saved-tensor hooks report
each one to the engine, which gathers it again per the residency policy before backward uses
it. The hooks run only while some unit can be freed.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..comm.schedule import LOG, wait
from ..planning import ROOT, Plan
from ..trace import span
from .replay import pinned_units
from .residency import Actions
from .unit_state import State, UnitState

__all__ = ["Gatherer", "LiveUnit", "State", "MemoryStats", "Saved", "Waits"]


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


class Waits:
    """Seconds compute spent blocked on the step's own collectives (a step's ``comm_wait_s``)."""

    def __init__(self):
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds

    def take(self) -> float:
        """The seconds since the last call."""
        out, self.seconds = self.seconds, 0.0
        return out


@dataclass
class Saved:
    """A saved param tensor (or alias) of a unit that may be freed: where it lies in the unit's
    buffer, so that it holds no reference to the memory."""

    unit: str
    bucket: int
    shape: tuple
    stride: tuple
    offset: int


_RESIDENT = (State.GATHERING, State.GATHERED)


class LiveUnit(UnitState):
    """One FSDP unit: its runtime state (``UnitState``) and its gathered side (see the module doc).

    ``buffer[b]`` is bucket ``b``'s full flat buffer (views read it); ``target[b]`` is the same
    memory as a tensor with a version counter of its own, which collectives write: a re-gather
    into memory whose old views the loss function still holds (the same values again) must not
    count as an in-place change of those views. ``plain`` lists the buckets whose memory is
    allocated per gather (the others are master shards or shared memory, always there)."""

    def __init__(self, name: str, buckets: list[int], plain: list[int], layout: list[tuple], frozen: list[int],
                 trained: list[int]):
        super().__init__(name, trained=trained)
        self.buckets, self.plain = buckets, plain
        self.layout, self.frozen = layout, frozen  # each param's (bucket, shape, stride, offset); frozen positions
        self.buffer: dict[int, torch.Tensor] = {}
        self.target: dict[int, torch.Tensor] = {}
        self.landed_at = 0.0  # when its last gather landed (``unreferenced``)
        self.handed: list[weakref.ref] = []  # the param tensors handed out (only their liveness matters)
        self.holds_memory = False  # whether its gathered memory is counted as held (``MemoryStats``)
        self.gathered_in_phase = False  # gathered in this forward or backward (a second gather is an extra one)
        self.queued_phase = ""  # the phase a QUEUED prefetch was decided in

    @property
    def freeable(self) -> bool:
        return bool(self.plain)

    def views(self) -> list[torch.Tensor]:
        """Its params as views of its buffers (as_strided takes the offset in the whole storage:
        shared buffers start inside one)."""
        buf = self.buffer
        return [buf[b].as_strided(shape, stride, buf[b].storage_offset() + off) for b, shape, stride, off in self.layout]

    def hand_out(self, views) -> None:
        if self.freeable:
            self.handed.extend(weakref.ref(v) for v in views)

    def views_alive(self) -> bool:
        return any(ref() is not None for ref in self.handed)

    def start(self, comm, shards: list[torch.Tensor], nbytes: list[int]) -> int:
        """Start its gathers (allocating plain memory first); the bytes it allocated."""
        allocated = 0
        with span("hpf/gather", self.name):
            for b in self.buckets:
                if b not in self.target:  # (a master shard: nothing to gather)
                    continue
                st = self.buffer[b].untyped_storage()
                if b in self.plain and st.nbytes() == 0:
                    st.resize_(nbytes[b])
                    allocated += nbytes[b]
                self.handles.append(comm.all_gather(b, self.target[b], shards[b]))
        self.to(State.GATHERING if self.handles else State.GATHERED)
        return allocated

    def wait_gathers(self) -> float:
        """Wait for its gathers in flight; the seconds spent waiting."""
        if not self.handles:
            return 0.0
        t = time.perf_counter()
        with span("hpf/wait all-gather"):
            for h in self.handles:
                wait(h, f"the all-gather of {self.name}")
        self.handles.clear()
        self.landed_at = time.perf_counter()
        if self.state is State.GATHERING:
            self.to(State.GATHERED)
        return self.landed_at - t

    def evict(self) -> float:
        """Its values are no longer this step's: a plain unit's memory waits to be freed. Its
        gathers in flight land first (every rank issued them), so none writes released memory;
        returns the seconds that took."""
        waited = self.wait_gathers() if self.state is State.GATHERING else 0.0
        if self.state is State.GATHERED:
            self.to(State.RELEASING if self.freeable else State.SHARDED)
        return waited

    def unreferenced(self, own_refs: dict[int, int]) -> bool:
        """Whether nothing outside the engine references its plain memory. A gather that has
        landed may still be referenced by its backend's worker thread for a moment (gloo's,
        measured: up to 0.5 ms at load 5), so a surplus gets until ``_SETTLE_S`` after the landing
        to go; one that lasts longer is the loss function's (a kept view), and keeps the memory."""
        deadline = self.landed_at + _SETTLE_S
        while any(_use_count(self.buffer[b]) > own_refs[b] for b in self.plain):
            if time.perf_counter() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def free(self) -> int:
        """RELEASING -> SHARDED: free its plain memory; the bytes freed."""
        freed = 0
        for b in self.plain:
            st = self.buffer[b].untyped_storage()
            if st.nbytes():
                freed += st.nbytes()
                st.resize_(0)
        self.handed.clear()
        self.to(State.SHARDED)
        return freed


class Gatherer:
    """The units' gathered side: carries out the residency policy's actions on the ``LiveUnit``s, and
    accounts their memory (``stats``). ``capacity``: block units whose plain memory a prefetch
    may allocate while others are held; ``on_wait``: told each wait on a gather, in seconds;
    ``on_extra_gather``: told (unit, phase) of each gather beyond loop-style use."""

    def __init__(self, plan: Plan, comm, compute_dtype: torch.dtype | None, capacity: int,
                 on_wait: Callable[[float], None], on_extra_gather: Callable[[str, str], None] | None = None):
        self.plan, self.comm, self.compute_dtype = plan, comm, compute_dtype
        self.capacity, self.on_wait, self.on_extra_gather = capacity, on_wait, on_extra_gather
        bks = plan.buckets
        self.shared = [comm.is_shared(b.index) for b in bks]
        # buckets every rank holds whole in the compute dtype: the buffer is the master shard
        self._master = [b.shard_size == 1 and (compute_dtype is None or compute_dtype == b.dtype)
                        and not self.shared[b.index] for b in bks]
        self.nbytes = [0] * len(bks)
        self.units: dict[str, LiveUnit] = {}
        for name, u in plan.units.items():
            layout = [(s.bucket, s.local_shape, _strides(s.local_shape), s.offset) for b in u.buckets for s in bks[b].slots]
            self.units[name] = LiveUnit(name, list(u.buckets),
                                    [b for b in u.buckets if not self._master[b] and not self.shared[b]],
                                    layout, [i for i, (b, *_) in enumerate(layout) if bks[b].frozen],
                                    [b for b in u.buckets if not bks[b].frozen])
        for b in bks:  # each plain buffer freed as soon as it is made: never the whole model at once
            if self._master[b.index]:
                continue
            unit = self.units[b.unit]
            buf = unit.buffer[b.index] = _own_base(comm.full_buffer(b.index, compute_dtype or b.dtype))
            unit.target[b.index] = _own_base(buf)
            self.nbytes[b.index] = buf.numel() * buf.element_size()
            if not self.shared[b.index]:
                buf.untyped_storage().resize_(0)
        #: units whose memory an eviction can free (their saved tensors need the hooks)
        self.freeable = {name for name, u in self.units.items() if u.freeable}
        # A saved tensor is recognized by its memory, not by being a view of a buffer: a compiled
        # region saves detached aliases of its param inputs (AOTAutograd detaches saved views).
        self._bucket_of_storage = {u.buffer[b].untyped_storage()._cdata: b for u in self.units.values() for b in u.plain}
        # references the engine itself holds to each plain buffer's memory (``buffer``, ``target``):
        # any more are the loss function's, and keep the memory
        self._own_refs = {b: _use_count(u.buffer[b]) for u in self.units.values() for b in u.plain}
        self.shards: list[torch.Tensor] = []
        self._queue: list[LiveUnit] = []  # QUEUED units, in the order their prefetches were decided
        self.stats = MemoryStats()
        self._plain_held = 0  # block units (not the root) with plain memory held: what ``capacity`` bounds
        for name in pinned_units({u.name: u.buckets for u in self.units.values()}, self.kept):
            self.units[name].pinned = True  # (the residency policy never evicts them)

    def kept(self, b: int) -> bool:
        """Whether bucket ``b``'s memory stays for good (a master shard, or shared memory)."""
        return self._master[b] or self.shared[b]

    # -- shards ---------------------------------------------------------------------------------------
    def set_shards(self, masters: list[torch.Tensor], keep: set[str] = frozenset()) -> None:
        """The step's master shards, cast to the compute dtype (units in ``keep`` keep theirs)."""
        cdt = self.compute_dtype
        old = self.shards
        with span("hpf/cast shards"):
            self.shards = [old[b] if old and self.plan.buckets[b].unit in keep
                           else (m if cdt is None or m.dtype == cdt else m.to(cdt)) for b, m in enumerate(masters)]
        for b, master in enumerate(self._master):
            if master:
                self.units[self.plan.buckets[b].unit].buffer[b] = masters[b]

    # -- the residency policy's actions ---------------------------------------------------------------
    def apply(self, acts: Actions, phase: str) -> None:
        """Carry out the policy's actions. A prefetch waits for memory (an evicted unit whose
        param tensors the loss function still holds, e.g. the previous block in its loop
        variable) until a saved-tensor hook or the next collective finds it free: local facts
        may delay when a gather starts, never what is gathered or in which order. Each gather
        is recorded in the schedule log when decided."""
        if acts.evict:
            self.start_queued()
            for u in acts.evict:
                self.evict(u)
        for u in acts.gather:
            self.start_queued()
            LOG.record("all-gather", u, phase == "backward")
            self._start(self.units[u], phase)
        for u in acts.prefetch:
            LOG.record("all-gather", u, phase == "backward")
            unit = self.units[u]
            unit.to(State.QUEUED)
            unit.queued_phase = phase
            self._queue.append(unit)
        self.start_queued(when_free=True)

    def start_queued(self, when_free: bool = False) -> None:
        """Start the queued prefetches: all of them, or (``when_free``) those there is memory for."""
        if not self._queue:
            return
        if when_free:
            self.free_released()
        while self._queue and (not when_free or self._plain_held < self.capacity):
            unit = self._queue.pop(0)
            self._start(unit, unit.queued_phase)

    def drop_queue(self) -> None:
        """Forget the queued prefetches (after an error)."""
        for unit in self._queue:
            unit.to(State.RELEASING if unit.holds_memory and unit.freeable else State.SHARDED)
        self._queue.clear()

    def new_phase(self) -> None:
        """Forward or backward begins with what is resident now (a second gather of a unit in one
        phase is an extra one: reported, and warned of in validation mode)."""
        for u in self.units.values():
            u.gathered_in_phase = u.state in _RESIDENT

    def _start(self, unit: LiveUnit, phase: str) -> None:
        if unit.gathered_in_phase:
            self.stats.extra_gathers += 1
            if self.on_extra_gather is not None:
                self.on_extra_gather(unit.name, phase)
        unit.gathered_in_phase = True
        allocated = unit.start(self.comm, self.shards, self.nbytes)
        s = self.stats
        s.gathers += 1
        if unit.target:  # (a unit of master shards only holds nothing of its own)
            s.live_bytes += allocated
            s.peak_bytes = max(s.peak_bytes, s.live_bytes)
            self._hold(unit, True)
            s.peak_blocks = max(s.peak_blocks, s.live_blocks)

    def wait(self, name: str) -> None:
        """Wait for unit ``name``'s gathers (started first if still queued)."""
        unit = self.units[name]
        if unit.state is State.QUEUED:
            self.start_queued()
        self.on_wait(unit.wait_gathers())

    def evict(self, name: str) -> None:
        """Evict unit ``name``. Its plain memory is freed now, or, while a param tensor handed out
        for it is alive, the first time ``free_released`` finds them all dead."""
        unit = self.units[name]
        self.on_wait(unit.evict())
        if unit.state is State.RELEASING:
            self.free_released()

    def free_released(self, force: bool = False) -> None:
        """Free the memory of evicted units that nothing holds any more (``force``: the step is
        over, and param tensors kept past it become NaN, ``_poison``). A unit whose memory
        anything outside the engine still references (a view of a param, a kept tensor) keeps it."""
        for unit in self.units.values():
            if unit.state is not State.RELEASING or (not force and unit.views_alive()):
                continue
            if force:
                _poison([ref() for ref in unit.handed])
            if unit.unreferenced(self._own_refs):  # (a RELEASING unit has no gathers in flight: LiveUnit.evict)
                self.stats.live_bytes -= unit.free()
                self._hold(unit, False)

    def wait_gathers(self) -> None:
        """Start every queued gather and wait for every gather in flight."""
        self.start_queued()
        self.on_wait(sum(u.wait_gathers() for u in self.units.values()))

    def settle(self) -> None:
        """The step is over: land every gather, then evict and free every unit, held or not
        (the engine holds nothing)."""
        self.wait_gathers()
        for unit in self.units.values():
            unit.evict()
            if unit.freeable and unit.holds_memory:
                unit.to(State.RELEASING)
        self.free_released(force=True)

    def _hold(self, unit: LiveUnit, held: bool) -> None:
        """Count ``unit``'s memory as held or not (``MemoryStats.live_blocks``, ``capacity``)."""
        if unit.holds_memory == held or unit.name == ROOT:
            unit.holds_memory = held
            return
        unit.holds_memory = held
        self.stats.live_blocks += 1 if held else -1
        if unit.freeable:
            self._plain_held += 1 if held else -1

    # -- saved-tensor hooks -----------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        """A tensor autograd saves: a unit's param as a ``Saved`` description, anything else as it is."""
        if self._queue:  # (between reads: the last unit's param tensors may have died by now)
            self.start_queued(when_free=True)
        try:
            b = self._bucket_of_storage.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # (a tensor with no storage of its own: never a param)
            return t
        if b is None:
            return t
        unit = self.plan.buckets[b].unit
        if t.dtype != self.units[unit].buffer[b].dtype:  # (reinterpreted: held as it is)
            return t
        return Saved(unit, b, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(self, saved: Any, regather: Callable[[str], Any]) -> torch.Tensor:
        """A saved tensor again: a ``Saved`` one over its unit's buffer, once ``regather`` (the
        engine's: per the residency policy) has gathered the unit again."""
        if type(saved) is not Saved:
            return saved
        regather(saved.unit)
        return self.units[saved.unit].buffer[saved.bucket].as_strided(saved.shape, saved.stride, saved.offset)


_SETTLE_S = 0.005  # how long a landed collective's backend may hold a buffer (``LiveUnit.unreferenced``)


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
