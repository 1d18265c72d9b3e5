"""The reduction side of FSDP units: grads summed over a unit's reads, then reduced in a fixed order.

Each read of a unit is one autograd entry; backward hands each entry's grads here, and they
add up in one flat buffer per bucket. A unit is complete when every entry's backward has run.
Reductions are issued strictly in one fixed order, the reverse of the plan's tree order
(``reduction_order``), the head of the queue as soon as it is complete, so every rank
issues the same reductions in the same order whatever backward's timing, and a unit whose
entry never runs backward (a read the loss does not use) only delays the queue to the end.
For loop-style code that order is backward's own, so reductions overlap the rest of backward.

Reductions in flight are bounded, as FSDP2 recycles its reduce-scatter inputs: before a unit's
flat grads are taken, and again before its reduction is issued, the engine waits for the oldest
reductions until fewer than ``IN_FLIGHT`` are in flight. So for loop-style code at most
``IN_FLIGHT`` units hold flat grads at once, the one summed next included (and on gloo a receive
buffer beside each one issued). The wait is on this rank's own collectives, issued in the same
order on every rank, so it is local; it uses the step's timeout and names a hang as the step's
end does. Two let each reduction overlap the next unit's backward, and keep the two-tier
pipeline full (one unit's slow stage beside the next one's fast stage). Reductions out of a
shared-memory grad buffer (CPU ranks of one host) do not count: that memory is mapped for good,
so backward never waits on them, however slow the slow tier.

With gradient accumulation, every micro-batch but the last keeps its sums here (``hold``) and
communicates nothing; the last adds them in and reduces once. In the invariant mode each
micro-batch is one atom of the global batch, and the sums are kept as nodes of the canonical
tree over the atoms (hpf.comm.canonical.Partials), which the reduction meets with the other
ranks' in the same tree (``UnitComm.reduce_ordered``).

``on_landed(unit)``, when set, is called once a unit's reductions have landed, in reduction
order (the reductions are waited for oldest first), so an optimizer can start on that unit's
final grads while backward goes on (hpf.optim.EarlyUpdate): at the end of the entry's backward
that found it landed, after any reduction that entry issues. Never for units whose grads wait
for the partial-sum all-reduce of ``compute_sums``: those are final only after ``wait``.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from ..comm import schedule, world
from ..comm.canonical import Partials
from ..comm.schedule import LOG
from ..comm.handles import DONE, StreamWork, is_done, wait_for
from ..planning import Plan
from ..trace import span
from .unit_state import UnitState

__all__ = ["Reducer", "IN_FLIGHT", "issuable", "reduction_order", "to_wait"]

#: reductions holding memory at once, the unit summed next included (the module doc; hpf.memory counts it)
IN_FLIGHT = 2


# -- the policy, as pure functions (hpf.engine.replay replays them for hpf.sim and hpf.memory) ----------------
def reduction_order(trained: list[str]) -> list[str]:
    """The order reductions are issued in, every step: the units with grads (``trained``, in tree
    order) reversed, which is backward's own order for loop-style code."""
    return list(reversed(trained))


def issuable(order: list[str], start: int, complete: Callable[[str], bool]) -> int:
    """Reductions are issued strictly in ``order``, the head as soon as it is ``complete``: the
    position after the last one issuable now, the ones from ``start`` issued already."""
    while start < len(order) and complete(order[start]):
        start += 1
    return start


def to_wait(holding: list[bool], bound: int = IN_FLIGHT) -> int:
    """The in-flight bound: how many of the oldest reductions in flight (``holding``, oldest
    first: whether each holds flat grads of its own) to wait for before a unit takes its flat
    grads or issues its reduction, so that fewer than ``bound`` hold memory."""
    n, held = 0, sum(holding)
    while held >= bound:
        held -= holding[n]
        n += 1
    return n


class Reducer:
    """One step's grad sums and reductions over ``units``, in tree order (see the module doc): the
    policy, reading and counting on each unit's runtime object (hpf.engine.unit_state: its
    ``trained`` buckets, ``outstanding`` entries, ``sums`` and whether ``complete``)."""

    def __init__(self, plan: Plan, comm, units: list[UnitState], shared: list[bool], pipeline: bool,
                 compute_sums: list, before_issue=lambda: None, on_wait=lambda seconds: None):
        self.plan, self.comm, self.shared, self.pipeline = plan, comm, shared, pipeline
        self.by_name = {u.name: u for u in units}
        self._segments = {u.name: _segments(plan, u.name) for u in units}
        self._own_memory = {u.name: not all(shared[b] for b in u.trained) for u in units}  # (``_in_flight``)
        self.units = [u.name for u in units if u.trained]  # units with no trained buckets are never reduced
        self.compute_sums = compute_sums  # (bucket, group, slice): partial grads summed over non-FSDP axes
        self.grad_shards: list[torch.Tensor] = []
        self.order = reduction_order(self.units)
        self._complete = lambda unit: self.by_name[unit].complete
        self._next = 0
        # per unit reduced, oldest first: whether its flat grads are its own memory (not shared memory's),
        # its buckets' handles not yet landed, and the unit
        self._in_flight: deque[tuple[bool, list, str]] = deque()
        self._held: dict[int, torch.Tensor | Partials] = {}
        self.hold = False
        self.atom: tuple[int, int] | None = None  # invariant mode: (this micro-batch's atom, atoms per rank)
        self.added = 0  # entries whose grads arrived, ever (the step checks that a loss reached some param)
        self._before_issue = before_issue  # the engine's deferred gathers go first: one schedule
        self._on_wait = on_wait  # seconds blocked on a reduction in backward (the engine's comm wait)
        self.on_landed = None  # (unit) -> None: the module doc; the step sets it per step
        self.landed_s = 0.0  # seconds spent in on_landed, ever (not counted as waiting)
        self._to_tell: list[str] = []  # units landed, on_landed not yet run

    def start(self, grad_shards: list[torch.Tensor], hold: bool, atom: tuple[int, int] | None = None) -> None:
        """A micro-batch starts; ``hold``: keep its sums for the next one instead of reducing;
        ``atom``: (its atom's index in the global batch, atoms per rank) in the invariant mode."""
        self.grad_shards, self.hold, self.atom = grad_shards, hold, atom
        for u in self.by_name.values():
            u.outstanding, u.sums, u.complete = 0, None, False
        self._next = 0
        self._to_tell.clear()

    def entry(self, unit: str) -> None:
        """A read of ``unit`` created an autograd entry whose backward is to come (none for a
        unit whose params are all frozen)."""
        u = self.by_name[unit]
        if u.trained:
            u.outstanding += 1

    def add(self, unit: str, grads: tuple) -> bool:
        """One entry's grads (in slot order); True if that completed the unit."""
        self.added += 1
        u = self.by_name[unit]
        flats = u.sums
        first = flats is None
        if first:
            flats = u.sums = self._take(unit)
        with span("hpf/copy grads", unit):
            for flat, (start, end, numel) in zip(flats, self._segments[unit]):
                packed = flat[:numel]
                parts = [g.reshape(-1) for g in grads[start:end]]  # one cat: 3x cheaper than a view per param
                if first and parts[0].dtype == flat.dtype:
                    torch.cat(parts, out=packed)
                elif first:
                    packed.copy_(torch.cat(parts))
                else:
                    packed.add_(torch.cat(parts))
        u.outstanding -= 1
        if u.outstanding:
            self._tell()
            return False
        u.complete = True
        self._issue_ready()
        self._tell()
        return True

    def _issue_ready(self) -> None:
        end = issuable(self.order, self._next, self._complete)
        while self._next < end:
            self._reduce(self.order[self._next])
            self._next += 1

    def finish(self) -> None:
        """Backward is over: reduce every unit not yet reduced (zero grads if never read), in order."""
        for unit in self.order:
            self.by_name[unit].complete = True
        self._issue_ready()

    def wait(self) -> None:
        """Wait for every reduction of the step (then partial sums over non-FSDP axes)."""
        handles = [h for _, unit, _ in self._in_flight for h in unit]
        busy = self.landed_s
        with span("hpf/wait reduce-scatter"):
            while self._in_flight:
                _, oldest, unit = self._in_flight[0]
                for h in oldest:
                    schedule.wait(h, "a gradient reduction")
                self._in_flight.popleft()
                self._landed(unit)
                self._tell()
            on_device = [h for h in handles if isinstance(h, StreamWork)]
            if on_device:  # (an accelerator: the waits above ordered streams; now the CPU, so a hang is named here)
                schedule.wait(StreamWork.settled(on_device), "the step's gradient reductions")
        self._on_wait(busy - self.landed_s)  # (the caller times this wait: on_landed's work is not waiting)
        sum_partials(self.grad_shards, self.compute_sums)

    def holds_sums(self) -> bool:
        """Whether earlier micro-batches' sums are held for this step."""
        return bool(self._held)

    def grads_mark(self) -> int:
        """A mark for ``no_grads_since``: the autograd entries whose grads have arrived, ever."""
        return self.added

    def no_grads_since(self, mark: int) -> bool:
        """Whether some unit trains but no entry's grads arrived since ``mark`` (``grads_mark``)."""
        return bool(self.units) and self.added == mark

    def tell_landed(self, fn) -> bool:
        """Call ``fn(buckets)`` with each unit's trained buckets once its reductions land (the
        module doc's ``on_landed``); None stops. False, setting nothing, when grads are final
        only after the partial-sum all-reduce of ``compute_sums`` (then nobody is ever told)."""
        if self.compute_sums:
            return False
        self.on_landed = None if fn is None else (lambda unit: fn(self.by_name[unit].trained))
        return True

    def drop_held(self) -> None:
        """Forget sums held from earlier micro-batches (a step that raised or was skipped)."""
        self._held.clear()

    # -- internals ---------------------------------------------------------------------------------------
    def _take(self, unit: str) -> list[torch.Tensor]:
        """``unit``'s flat grad buffers, once fewer than IN_FLIGHT reductions hold theirs (module doc)."""
        self._make_room()
        return [self._grad_flat(b) for b in self.by_name[unit].trained]

    def _make_room(self) -> None:
        """Wait for the oldest reductions in flight until fewer than IN_FLIGHT hold memory (a
        shared-memory grad buffer is mapped for good: waiting on it would free nothing)."""
        self._pop_landed()
        n = to_wait([holds for holds, _, _ in self._in_flight])
        if n:
            self._before_issue()  # (the gathers decided so far start first: they overlap this wait)
            t = time.perf_counter()
            with span("hpf/wait reduce-scatter"):
                for _ in range(n):
                    _, oldest, unit = self._in_flight.popleft()
                    while oldest:  # (popped as waited: no handle, nor its buffers, outlives its wait)
                        schedule.wait(oldest.pop(0), "a gradient reduction")
                    self._landed(unit)
            self._on_wait(time.perf_counter() - t)

    def _pop_landed(self) -> None:
        """Forget the reductions that have landed, oldest first, which frees their buffers; in order
        only: a poll may start an HSDP replica all-reduce, which every rank must start in one order."""
        while self._in_flight:
            _, oldest, unit = self._in_flight[0]
            while oldest and _landed(oldest[0]):
                oldest.pop(0)
            if oldest:
                return
            self._in_flight.popleft()
            self._landed(unit)

    def _landed(self, unit: str) -> None:
        """``unit``'s reductions have landed: ``on_landed`` is told at the next ``_tell``."""
        if self.on_landed is not None and not self.compute_sums:
            self._to_tell.append(unit)

    def _tell(self) -> None:
        """Run ``on_landed`` for the units landed so far (module doc), timing it: after this
        rank's next reduction is issued, so the optimizer's work never delays one."""
        while self._to_tell and self.on_landed is not None:
            unit = self._to_tell.pop(0)
            t = time.perf_counter()
            with span("hpf/optimizer", unit):
                self.on_landed(unit)
            self.landed_s += time.perf_counter() - t
        self._to_tell.clear()  # (on_landed was unset: nobody to tell)

    def _grad_flat(self, b: int) -> torch.Tensor:
        bucket, shard = self.plan.buckets[b], self.grad_shards[b]
        unsharded = bucket.shard_size == 1 and not self.shared[b]
        flat = shard if unsharded and not self.hold else self.comm.grad_buffer(b, shard.dtype)
        if bucket.padded_numel > bucket.numel:
            flat[bucket.numel:].zero_()
        return flat

    def _reduce(self, unit: str) -> None:
        u = self.by_name[unit]
        flats, u.sums = u.sums, None
        if flats is None:  # never read this step (or its params never reached the loss): zero grads
            flats = [flat.zero_() for flat in self._take(unit)]
        buckets = u.trained
        if self.hold:  # an earlier micro-batch: keep the sums here, communicate nothing
            for b, flat in zip(buckets, flats):
                if self.atom is not None:
                    self._held.setdefault(b, Partials()).push(self.atom[0], flat.clone())
                elif b in self._held:
                    self._held[b].add_(flat)
                else:
                    self._held[b] = flat.clone()  # (flat may be a comm buffer)
            return
        self._before_issue()
        self._make_room()  # (a unit read more than once took its flat grads earlier, at its first backward)
        handles = []
        for b, flat in zip(buckets, flats):
            held = self._held.pop(b, None)
            if self.atom is not None:
                held = held or Partials()
                held.push(self.atom[0], flat)
            elif held is not None:
                flat.add_(held)
            LOG.record("reduce-scatter", unit, b)
            with span("hpf/reduce-scatter bucket", b):
                handle = (self.comm.reduce(b, self.grad_shards[b], flat) if self.atom is None
                          else self.comm.reduce_ordered(b, self.grad_shards[b], held.nodes, self.atom[1]))
            if not self.pipeline:
                schedule.wait(handle, "a gradient reduction")
                handle = DONE
            handles.append(handle)
        self._in_flight.append((self._own_memory[unit], handles, unit))


def _segments(plan: Plan, unit: str) -> list[tuple[int, int, int]]:
    """Per trained bucket of ``unit``, in order: where its grads lie among one entry's (slot
    order over the unit's buckets, frozen ones included) and the bucket's numel."""
    out, i = [], 0
    for b in plan.units[unit].buckets:
        bucket = plan.buckets[b]
        if not bucket.frozen:
            out.append((i, i + len(bucket.slots), bucket.numel))
        i += len(bucket.slots)
    return out


def _landed(handle) -> bool:
    """Whether a reduction has landed; then it is finished (waited), never twice."""
    if not is_done(handle):
        return False
    wait_for(handle)
    return True


def sum_partials(grad_shards: list[torch.Tensor], compute_sums: list) -> None:
    """All-reduce the partial grads of ``compute_sums`` ((bucket, group, slice of its shard)) over
    their groups: one fused all-reduce per group and dtype (tensor parallelism: the root's and every
    block's replicated params in one collective, not one each). A group whose ranks' shards hold
    none (the same on all of them: they share a shard position) has nothing to sum."""
    fused: dict[tuple, list[tuple[int, slice]]] = {}
    for b, group, part in compute_sums:
        fused.setdefault((group, grad_shards[b].dtype), []).append((b, part))
    for (group, _), parts in fused.items():
        shards = [grad_shards[b][part] for b, part in parts]
        LOG.record("all-reduce", "partial grads")
        if not sum(x.numel() for x in shards):
            continue
        flat = shards[0] if len(shards) == 1 else torch.cat(shards)
        schedule.wait(world.all_reduce_async(flat, group), "a partial-grad all-reduce")
        for shard, part in zip(shards if len(shards) > 1 else (), flat.split([x.numel() for x in shards])):
            shard.copy_(part)
