"""Each unit's one runtime object (hpf.engine.unit_state) and the engine's phases: illegal moves
raise, and the residency and reduction policies count on the same objects. In process, no ranks."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpf.engine import Phase
from hpf.engine.residency import Residency
from hpf.engine.unit_state import State, UnitState

ROOT = Path(__file__).resolve().parent.parent


def test_a_unit_moves_along_its_states_and_never_releases_with_gathers_in_flight():
    u = UnitState("blocks/0")
    u.to(State.QUEUED)
    u.handles.append(object())  # a gather in flight
    u.to(State.GATHERING)
    for idle in (State.RELEASING, State.SHARDED, State.QUEUED):
        with pytest.raises(RuntimeError, match="blocks/0.*gathers in flight"):
            u.to(idle)
    with pytest.raises(RuntimeError, match="GATHERING to GATHERED with gathers in flight"):
        u.to(State.GATHERED)  # (idle only once its gathers landed: handles cleared)
    u.handles.clear()
    u.to(State.GATHERED)
    with pytest.raises(RuntimeError, match="from GATHERED to QUEUED"):
        u.to(State.QUEUED)
    u.to(State.RELEASING)
    u.to(State.SHARDED)


def test_the_engine_moves_through_a_steps_phases_in_order_only():
    phase = Phase.IDLE
    for to in (Phase.STEP, Phase.FORWARD, Phase.BACKWARD, Phase.STEP, Phase.IDLE, Phase.PREFETCHED, Phase.STEP):
        phase = phase.to(to)
    with pytest.raises(RuntimeError, match="STEP -> BACKWARD"):
        phase.to(Phase.BACKWARD)
    with pytest.raises(RuntimeError, match="BROKEN -> STEP"):
        Phase.BROKEN.to(Phase.STEP)


def test_the_residency_policy_counts_on_the_units_own_objects():
    units = [UnitState("<root>", pinned=True)] + [UnitState(f"blocks/{i}") for i in range(3)]
    policy = Residency(units, capacity=2)
    policy.begin()
    policy.read(["blocks/0"])
    policy.read(["blocks/0"])
    assert [u.reads for u in units] == [0, 2, 0, 0] and policy.pinned == {"<root>"}
    policy.start_backward()
    policy.need(["blocks/1"])
    assert units[2].visits == 1
    policy.resume()
    assert [u.reads for u in units] == [0, 0, 0, 0]


def test_nothing_outside_the_step_reaches_into_its_engine():
    """The engine is the step's own part: callers use the step's methods and ``step.comm``."""
    found = [f"{p.relative_to(ROOT)}:{i}" for base in ("hpf", "tests", "benchmarks") for p in sorted((ROOT / base).rglob("*.py"))
             if p.name != "step.py" and "engine" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bstep\.engine\b", line)]
    assert not found, found
