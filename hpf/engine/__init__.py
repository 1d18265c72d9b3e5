"""The FSDP unit engine: a step's forward and backward over a plan's units (unit_engine.py),
its units' runtime state (unit_state.py), the gathered side (gather.py), the residency and
reduction policies (residency.py, reduce.py) and their replay without tensors (replay.py).
This file only re-exports."""
from .gather import MemoryStats
from .unit_engine import UnitEngine, explain, refuses_hooks
from .unit_state import Phase

__all__ = ["UnitEngine", "MemoryStats", "Phase", "explain", "refuses_hooks"]
