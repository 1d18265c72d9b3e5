"""A step's schedule from its reads alone: the engine's own policies, replayed without tensors.

The engine decides every collective from the loss function's reads: gathers and evictions by
the residency policy (hpf.engine.residency), reductions by the reduction order and its
in-flight bound (hpf.engine.reduce). ``replay`` drives those same policies with a sequence of
reads, as the engine does for a loss function that makes them (autograd walks a loop-style
loss function's reads in reverse), and returns each step as events in order. ``hpf.sim`` times
the events and ``hpf.memory`` takes its peak over them, so neither keeps a copy of the
schedule: a change of policy reaches both. tests/test_schedule_replay.py checks the events
against the schedule the engine records (hpf.comm.schedule.LOG) for each model and option set.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..tree import ROOT
from .reduce import issuable, reduction_order
from .residency import RESIDENT_UNITS, Actions, Residency

__all__ = ["Event", "StepEvents", "ScheduleInputs", "replay", "loop_reads", "pinned_units", "whole_in"]


@dataclass(frozen=True)
class Event:
    """One thing the step does, in order. ``kind``:

    - "gather": a gather decided (the engine's "all-gather" record; ``backward``: in backward);
    - "evict": ``unit`` leaves the gathered set;
    - "read": forward reads ``unit`` (the engine's "read" record), "forward": its forward runs
      (the root's: its params are taken, so its gather is waited for);
    - "loss": forward is over (the root's head runs forward and backward), backward starts;
    - "recompute": backward runs ``unit``'s forward again (a checkpointed block);
    - "backward": ``unit``'s backward runs;
    - "grads": ``unit``'s grads are complete: its flat grads are taken (the in-flight bound);
    - "reduce": ``unit``'s reduction is issued (the engine's "reduce-scatter" records, one per
      trained bucket); "hold": an earlier micro-batch keeps its sums instead;
    - "reduced": every reduction of the step is waited for (has landed).

    ``resident``: the non-pinned units gathered at that moment (on "loss" and "backward")."""

    kind: str
    unit: str = ""
    backward: bool = False
    resident: tuple = ()


@dataclass
class StepEvents:
    """One step: ``events`` from its start (the first step: its ``begin``'s gathers) to its
    end (the evictions after the reductions landed); ``next_first``: the gathers of the next
    step's first units, which the step makes during its update (``ShardStep``'s prefetch)."""

    events: list[Event] = field(default_factory=list)
    next_first: list[str] = field(default_factory=list)

    def collectives(self) -> list[tuple[str, str, bool]]:
        """(kind, unit, backward) of the gathers, reads and reductions, in order, and the next
        step's first gathers after them: what the engine records, unit by unit."""
        out = [(e.kind, e.unit, e.backward) for e in self.events if e.kind in ("gather", "read", "reduce")]
        return out + [("gather", u, False) for u in self.next_first]


def loop_reads(units: list[str]) -> list[list[str]]:
    """The reads of a loop-style loss function (hpf.models'): each block once, in tree order
    (the root's params are taken at the start, not read as a unit)."""
    return [[u] for u in units if u != ROOT]


def whole_in(bucket, compute_bytes: int) -> bool:
    """Whether every rank holds ``bucket`` whole in the compute dtype (a bucket no FSDP axis
    splits, tensor parallel alone, kept in the bytes per element compute runs in): its master
    shard is its gathered buffer, so it is gathered for good (hpf.engine.gather's ``kept``)."""
    return bucket.shard_size == 1 and bucket.dtype.itemsize == compute_bytes


def in_shared_memory(mesh, bucket, hierarchical: bool) -> bool:
    """Whether two-tier collectives over a shared-memory fast tier (CPU ranks of one host) keep
    ``bucket``'s full buffer in it: it has a fast stage (hpf.comm.tiered's ``is_shared``). The
    buffer stays mapped, so its unit is gathered once a step, never again in backward."""
    return hierarchical and mesh.axis_size(tuple(a for a in bucket.shard_axes if a in mesh.fast_axes)) > 1


@dataclass(frozen=True)
class ScheduleInputs:
    """What the schedule of a loop-style step depends on, made once from a plan (``of``) and read
    by hpf.sim, hpf.memory and the plan report, so none derives its own: the units in tree
    order, those never evicted, those with grads, and the step's options."""

    units: tuple[str, ...]
    pinned: frozenset
    trained: tuple[str, ...]
    capacity: int = RESIDENT_UNITS
    recompute: frozenset = frozenset()
    accumulate: int = 1

    @classmethod
    def of(cls, plan, kept: Callable[[int], bool], *, resident_units: int = RESIDENT_UNITS, recompute=frozenset(),
           accumulate: int = 1) -> "ScheduleInputs":
        """``plan``'s inputs; ``kept(bucket index)``: whether that bucket stays gathered for good
        (``whole_in``, or in shared memory), as the engine decides it for its pinned units."""
        units = list(plan.units)
        return cls(tuple(units), frozenset(pinned_units({u: plan.units[u].buckets for u in units}, kept)),
                   tuple(u for u in units if any(not plan.buckets[b].frozen for b in plan.units[u].buckets)),
                   resident_units, frozenset(recompute), accumulate)

    def replay(self, steps: int = 1) -> list[StepEvents]:
        """``steps`` steps of the engine on these inputs (``replay``)."""
        units = list(self.units)
        return replay(units, set(self.pinned), loop_reads(units), list(self.trained), capacity=self.capacity,
                      recompute=self.recompute, accumulate=self.accumulate, steps=steps)


def pinned_units(units: dict[str, list[int]], kept: Callable[[int], bool]) -> set[str]:
    """The units the residency policy never evicts: the root, and each unit whose buckets are
    all ``kept`` gathered for good (held whole by every rank in the compute dtype, or in shared
    memory: hpf.engine.gather's units that are not ``freeable``). ``units``: unit -> buckets."""
    return {u for u, bs in units.items() if u == ROOT or all(kept(b) for b in bs)}


def replay(units: list[str], pinned: set[str], reads: list[list[str]], trained: list[str], *, capacity: int = RESIDENT_UNITS,
           recompute=frozenset(), accumulate: int = 1, steps: int = 1) -> list[StepEvents]:
    """``steps`` steps of the engine on a loss function that makes ``reads`` (per read, the
    units it reads: the owners of its tied leaves, then itself) in each of ``accumulate``
    micro-batches; ``trained``: the units with grads, in tree order; ``recompute``: units whose
    forward runs again in backward; ``capacity``: the residency bound (``resident_units``)."""
    policy = Residency.of(units, pinned, capacity)
    order = reduction_order(trained)
    out: list[StepEvents] = []
    acts = policy.begin()
    for _ in range(steps):
        step = StepEvents()
        _take(step.events, acts, False)
        for micro in range(accumulate):
            if micro and trained:  # a later micro-batch: its first reads predicted as the step's were
                _take(step.events, policy.resume(), False)
            _micro_batch(step.events, policy, units, reads, trained, order, recompute, hold=micro < accumulate - 1)
        step.events.append(Event("reduced"))
        step.events += [Event("evict", u) for u in policy.end_step()]
        step.next_first = list(policy.begin().prefetch)  # (begin only prefetches)
        acts = Actions()
        out.append(step)
    return out


def _micro_batch(events: list[Event], policy: Residency, units: list[str], reads: list[list[str]],
                 trained: list[str], order: list[str], recompute, hold: bool) -> None:
    """One forward and backward: the reads, then autograd's walk back over them (a unit's
    grads complete at its earliest read's backward; the root's last), each completed unit's
    reductions in the reduction order, and ``done`` evicting it."""
    train = set(trained)
    if ROOT in units:
        events.append(Event("forward", ROOT))
    for needs in reads:
        events.append(Event("read", needs[-1]))
        _take(events, policy.read(needs), False)
        events.append(Event("forward", needs[-1]))
    events.append(Event("loss", resident=tuple(policy.resident)))
    policy.start_backward()
    outstanding = Counter(u for needs in reads for u in needs if u in train)
    if ROOT in train:
        outstanding[ROOT] = 1
    complete: set[str] = set()
    issued = 0

    def completes(unit: str) -> None:
        nonlocal issued
        if unit in train:
            events.append(Event("grads", unit))
            complete.add(unit)
            end = issuable(order, issued, complete.__contains__)
            events.extend(Event("hold" if hold else "reduce", u) for u in order[issued:end])
            issued = end
        events.extend(Event("evict", u) for u in policy.done(unit))

    for needs in reversed(reads):
        unit = needs[-1]
        if unit in recompute:
            _take(events, policy.need(needs), True)
            events.append(Event("recompute", unit))
        _take(events, policy.need(needs), True)
        events.append(Event("backward", unit, resident=tuple(policy.resident)))
        for u in reversed(needs):
            outstanding[u] -= 1
            if outstanding[u] == 0:
                completes(u)
    if ROOT in units:
        completes(ROOT)
    events.extend(Event("hold" if hold else "reduce", u) for u in order[issued:])  # never read: zero grads


def _take(events: list[Event], acts: Actions, backward: bool) -> None:
    events.extend(Event("evict", u) for u in acts.evict)
    events.extend(Event("gather", u, backward) for u in acts.gather + acts.prefetch)
