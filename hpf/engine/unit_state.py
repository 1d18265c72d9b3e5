"""The engine's runtime states: its ``Phase`` in a step (one enum, its legal moves in ``_MOVES``),
and each FSDP unit's runtime state, all of it in one object (FSDP2's ``FSDPParamGroup`` holds its
group's unshard and reduce state together the same way):

- gathered side: ``state`` and the gathers in flight (``handles``), moved only along ``MOVES``:

      SHARDED --(prefetch decided, no memory yet)--> QUEUED --> GATHERING --(landed)--> GATHERED
      GATHERING/GATHERED --(evicted)--> RELEASING --(nothing references its memory)--> SHARDED

  A unit with gathers in flight is GATHERING, nothing else: its gathers land before it moves on.
- residency: ``pinned`` (gathered for the whole step), and the current micro-batch's forward
  ``reads`` and backward ``visits`` of it, which the residency policy counts;
- reduction: its ``trained`` buckets, the autograd entries whose backward is ``outstanding``, the
  flat grads summed so far (``sums``) and whether they are ``complete``.

The policies (hpf.engine.residency, hpf.engine.reduce) read and move these objects; the
engine's ``hpf.engine.gather.LiveUnit`` adds the buffers. ``hpf.engine.replay`` drives the same
policies over bare ``UnitState``s, without tensors.
"""
from __future__ import annotations

import enum
from typing import Any

__all__ = ["Phase", "State", "UnitState", "MOVES"]


class State(enum.Enum):
    SHARDED = "sharded"  # this step's values are not gathered (a plain buffer holds no memory)
    QUEUED = "queued"  # a prefetch is decided; it starts when there is memory for it
    GATHERING = "gathering"  # its gathers are in flight
    GATHERED = "gathered"  # its buffers hold this step's values
    RELEASING = "releasing"  # evicted; its memory waits until nothing outside the engine references it


#: the legal moves of ``UnitState.state`` (a RELEASING unit's memory may be gathered into again)
MOVES = {
    State.SHARDED: {State.QUEUED, State.GATHERING, State.GATHERED},
    State.QUEUED: {State.GATHERING, State.GATHERED, State.SHARDED, State.RELEASING},
    State.GATHERING: {State.GATHERED},
    State.GATHERED: {State.RELEASING, State.SHARDED},
    State.RELEASING: {State.SHARDED, State.QUEUED, State.GATHERING, State.GATHERED},
}


class UnitState:
    """One unit's runtime state (see the module doc). ``trained``: its buckets with grads."""

    def __init__(self, name: str, *, pinned: bool = False, trained: list[int] | None = None):
        self.name, self.pinned = name, pinned
        self.state = State.SHARDED
        self.handles: list = []  # gathers in flight
        self.reads = 0  # forward reads of it in this micro-batch (the residency policy's)
        self.visits = 0  # backward visits of it in this micro-batch
        self.trained: list[int] = list(trained or [])
        self.outstanding = 0  # autograd entries of it in this micro-batch whose backward is still to come
        self.sums: Any = None  # its flat grads summed so far this micro-batch (one per trained bucket)
        self.complete = False  # every entry's backward has run (or the micro-batch is over)

    def to(self, state: State) -> None:
        """Move to ``state``; RuntimeError (an hpf bug) for a move ``MOVES`` does not allow, or
        one to any state but GATHERING with gathers in flight."""
        if state is not self.state and state not in MOVES[self.state] or state is not State.GATHERING and self.handles:
            raise RuntimeError(f"hpf engine: unit {self.name!r} cannot move from {self.state.name} to {state.name}"
                               f"{' with gathers in flight' if self.handles else ''} (an hpf bug: please report it)")
        self.state = state


class Phase(enum.Enum):
    """Where the engine is in a step (``UnitEngine.phase``); ``_MOVES`` lists the legal moves."""

    IDLE = "idle"  # between steps: nothing gathered for a step, nothing in flight
    PREFETCHED = "prefetched"  # the next step's first gathers are in flight (``prefetch``)
    STEP = "step"  # a step began: between its micro-batches, or its reductions landing
    FORWARD = "forward"  # a micro-batch's forward: each read is decided by the residency policy
    BACKWARD = "backward"  # its backward: a read is a checkpoint recomputing
    BROKEN = "broken"  # the ranks may be out of step: any use raises (``broken`` names why)

    def to(self, phase: "Phase") -> "Phase":
        """``phase``, if a step may move there from this one (``abort`` moves from any)."""
        if phase not in _MOVES[self]:
            raise RuntimeError(f"hpf engine: {self.name} -> {phase.name} is not a step's order of phases "
                               "(an hpf bug: please report it)")
        return phase


_MOVES = {Phase.IDLE: {Phase.STEP, Phase.PREFETCHED}, Phase.PREFETCHED: {Phase.STEP},
          Phase.STEP: {Phase.FORWARD, Phase.IDLE}, Phase.FORWARD: {Phase.BACKWARD}, Phase.BACKWARD: {Phase.STEP},
          Phase.BROKEN: set()}
