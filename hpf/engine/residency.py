"""Which FSDP units are gathered when: a pure function of the loss function's reads.

The engine tells this policy every read of a unit in forward, every unit backward needs (a
saved param unpacked, a checkpoint recomputing), and every unit whose backward is done; the
policy answers which units to gather and which to evict. The answers depend on that sequence
and on the bound alone, never on references, gc or timing, so every rank (whose SPMD loss
function makes the same reads) issues the same gathers at the same points. Local facts may
only decide whether an evicted unit's memory can be freed at once (hpf.engine.gather).

The policy reads and counts on the units' own runtime objects (hpf.engine.unit_state: ``pinned``,
this micro-batch's ``reads`` and ``visits``); which units are resident, least recent first, and
the predictions are its own. The bound is ``capacity`` units gathered at once besides the
``pinned`` ones (the root, and units in shared memory, gathered for the whole step). A unit read is made most recent; a
prefetch of the unit predicted next (from the last micro-batch's reads, the first step from tree
order) comes after it; the least recent units are evicted past the bound. Loop-style code
thus gathers each unit once in forward with at most ``capacity`` of them live, and backward
walks the forward reads in reverse the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .unit_state import UnitState

__all__ = ["Residency", "Actions", "RESIDENT_UNITS"]

#: the default residency bound: block units gathered at once (hpf.StepConfig's ``resident_units``):
#: a loop-style loss function's current block and the prefetched next one
RESIDENT_UNITS = 2


@dataclass
class Actions:
    """What the engine does, in this order: drop ``evict``, gather ``gather`` (needed now), then
    ``prefetch`` (needed next). All three are part of the schedule every rank follows."""

    evict: list[str] = field(default_factory=list)
    gather: list[str] = field(default_factory=list)
    prefetch: list[str] = field(default_factory=list)


class Residency:
    """The residency policy of one step at a time over ``units``, in tree order (see the module doc)."""

    def __init__(self, units: list[UnitState], capacity: int = RESIDENT_UNITS):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: at least one unit must fit (the one being read)")
        self.by_name = {u.name: u for u in units}
        self.units, self.capacity = list(self.by_name), capacity
        self.pinned = {u.name for u in units if u.pinned}
        order = [u for u in self.units if u not in self.pinned]
        self._next = _successors(order)  # the first step's guess: tree order
        self.resident: dict[str, None] = {}  # non-pinned units gathered now, least recent first
        self.reads: list[str] = []  # this micro-batch's forward reads (non-pinned)
        self._back_next: dict = {}
        self._last_need: str | None = None
        self.first = order[:1]  # the first read, as predicted

    @classmethod
    def of(cls, units: list[str], pinned: set[str], capacity: int = RESIDENT_UNITS) -> "Residency":
        """The policy over bare unit states named ``units`` (hpf.engine.replay's, and tests')."""
        return cls([UnitState(u, pinned=u in pinned) for u in units], capacity)

    # -- a step's phases ----------------------------------------------------------------------
    def begin(self) -> Actions:
        """A step starts: gather the pinned units and the first predicted reads (``predicted_first``)."""
        self.resident.clear()
        acts = Actions(prefetch=[u for u in self.units if u in self.pinned])
        for u in self.predicted_first():
            self.resident[u] = None
            acts.prefetch.append(u)
        self._new_micro_batch()
        return acts

    def resume(self) -> Actions:
        """Another micro-batch of the step starts: its reads are predicted as the last micro-batch's were."""
        self._new_micro_batch()
        first = self.predicted_first()
        acts = Actions()
        for u in first:
            self._touch(u, acts.prefetch)
        while len(self.resident) > max(self.capacity, len(first)):
            victim = next(u for u in self.resident if u not in first)
            del self.resident[victim]
            acts.evict.append(victim)
        return acts

    def predicted_first(self) -> list[str]:
        """The first reads predicted for the next step, as many as fit the bound."""
        return list(dict.fromkeys(self._predicted_run(self.first[0] if self.first else None)))

    def read(self, units: list[str]) -> Actions:
        """Forward reads ``units`` together (a unit and the owners of its tied leaves, itself last)."""
        units = [u for u in units if u not in self.pinned]
        if not units:
            return Actions()
        for unit in units:
            self.reads.append(unit)
            u = self.by_name[unit]
            u.reads += 1
            k = u.reads
        return self._use(units, self._next.get((unit, k)) or self._next.get((unit, 1)))

    def start_backward(self) -> None:
        """Forward is over: backward walks its reads in reverse."""
        self._last_need = None
        for u in self.by_name.values():
            u.visits = 0
        back = [u for i, u in enumerate(reversed(self.reads)) if i == 0 or u != self.reads[-i]]
        self._back_next = _successors(back)

    def need(self, units: list[str]) -> Actions:
        """Backward needs ``units`` (a saved param's unit, or a read while recomputing)."""
        units = [u for u in units if u not in self.pinned]
        if not units or (len(units) == 1 and units[0] == self._last_need and units[0] in self.resident):
            return Actions()
        for unit in units:
            u = self.by_name[unit]
            u.visits += 1
            k = u.visits
        self._last_need = unit
        return self._use(units, self._back_next.get((unit, k)) or self._back_next.get((unit, 1)))

    def done(self, unit: str) -> list[str]:
        """``unit``'s grads are complete: backward needs it no more."""
        if unit in self.resident:
            del self.resident[unit]
            if self._last_need == unit:
                self._last_need = None
            return [unit]
        return []

    def end_step(self, learn: bool = True) -> list[str]:
        """The step is over: learn its (last micro-batch's) reads as the next micro-batches'
        prediction (unless the step failed: ``learn=False``); evict what is resident. One
        micro-batch's, not the step's: the last read of a micro-batch predicts nothing, so the
        end of its forward prefetches no unit that backward then has to gather again."""
        if learn and self.reads:
            self._next = _successors(self.reads)
            self.first = self.reads[:1]
        gone = list(self.resident)
        self.resident.clear()
        return gone

    # -- the rule ------------------------------------------------------------------------------
    def _new_micro_batch(self) -> None:
        self.reads, self._last_need = [], None
        for u in self.by_name.values():
            u.reads = 0

    def _use(self, units: list[str], predicted: str | None) -> Actions:
        """Make ``units`` the most recent (gathering those not resident), then prefetch
        ``predicted`` if the bound leaves room beside them; evict the least recent others."""
        acts = Actions()
        for unit in units:
            self._touch(unit, acts.gather)
        if (predicted is not None and predicted not in self.resident
                and len(dict.fromkeys(units)) < self.capacity):
            acts.prefetch.append(predicted)
            self.resident[predicted] = None
        keep = set(units)
        while len(self.resident) > max(self.capacity, len(keep)):
            victim = next(u for u in self.resident if u not in keep)
            del self.resident[victim]
            acts.evict.append(victim)
        return acts

    def _touch(self, unit: str, missing: list[str]) -> None:
        """Make ``unit`` the most recent resident; append it to ``missing`` if it was not resident."""
        if unit in self.resident:
            self.resident.pop(unit)
        else:
            missing.append(unit)
        self.resident[unit] = None

    def _predicted_run(self, unit: str | None) -> list[str]:
        out, k = [], {}
        while unit is not None and len(out) < self.capacity:
            out.append(unit)
            k[unit] = k.get(unit, 0) + 1
            unit = self._next.get((unit, k[unit]))
        return out


def _successors(seq: list[str]) -> dict[tuple[str, int], str]:
    """(unit, its k-th occurrence) -> the unit after it in ``seq``."""
    out, seen = {}, {}
    for a, b in zip(seq, seq[1:]):
        k = seen[a] = seen.get(a, 0) + 1
        out[(a, k)] = b
    return out
