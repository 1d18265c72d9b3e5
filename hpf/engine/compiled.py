"""How ``torch.compile``'d code and the engine share a unit.

A compiled region (a block, or a stretch of a compiled ``loss_fn`` between two unit reads)
takes a unit's params as graph inputs: views of the unit's gathered buffer, handed out by an
eager read. The engine itself stays eager and opaque to the compiler:

- a unit read is a graph break: dynamo never traces the engine's Python, so every gather and
  reduction stays a function of the reads, decided by the engine (the SPMD invariant), and the
  compiler cannot hoist, merge or reorder them;
- AOTAutograd saves what a compiled backward needs through ``ctx.save_for_backward`` with the
  engine's saved-tensor hooks in force. A saved param, or a view of it (which AOTAutograd
  detaches), is recognized by its memory (``Gatherer.pack``), so the unit is freed after
  its forward use and gathered again before the compiled backward unpacks it, as in eager;
- compiled kernels read memory unchecked, so a unit's memory is freed only when nothing
  outside the engine references it (``Gatherer.free_released``).

docs/architecture.md ("How a compiled region and the engine share a unit") says why.

Validation mode runs compiled regions eagerly (``eager_stance``), so its tracker sees every op.
"""
from __future__ import annotations

import contextlib
import sys

__all__ = ["hide_from_compiler", "eager_stance", "compile_seconds", "refused_fullgraph", "ENTRY_POINTS"]

#: why dynamo may not trace a unit read (dynamo puts it in a fullgraph=True error: ``refused_fullgraph``)
REASON = "hpf: a unit read is a graph break"

#: the engine methods that compiled code can reach: a read (from a UnitList), the saved-tensor
#: hooks (from a compiled forward's save_for_backward and backward's unpack) and an entry's backward
ENTRY_POINTS = ("_read", "_pack", "_unpack", "entry_done")


#: the params tree's methods that read a unit (a graph break each: dynamo never inlines them)
READS = (("UnitList", "__getitem__"), ("UnitList", "__iter__"), ("UnitList", "__reversed__"), ("UnitList", "apply"),
         ("Reads", "__next__"))


def hide_from_compiler(engine) -> bool:
    """Make the engine's entry points graph breaks that dynamo never traces, once dynamo is
    loaded (``torch.compile`` loads it; a step that never meets compiled code never pays for the
    import). Returns whether they are hidden."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    for name in ENTRY_POINTS:
        setattr(engine, name, dynamo.disable(getattr(type(engine), name).__get__(engine), reason=REASON))
    from . import views
    for cls, name in READS:
        fn = getattr(getattr(views, cls), name)
        if not hasattr(fn, "_torchdynamo_disable"):  # (once per process)
            setattr(getattr(views, cls), name, dynamo.disable(fn, reason=REASON))
    return True


def refused_fullgraph(err: BaseException) -> bool:
    """Whether ``err`` is dynamo refusing, under ``fullgraph=True``, to trace through a unit read
    (its hint, to remove the disable, is not the user's to act on)."""
    return type(err).__name__ == "Unsupported" and REASON in str(err)


def eager_stance():
    """Compiled functions run their Python eagerly inside this context (validation mode: every op
    is tracked); a no-op when nothing was compiled."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    import torch
    return torch.compiler.set_stance("force_eager")


def compile_seconds() -> float:
    """Seconds ``torch.compile`` has spent compiling in this process (forward frames and their
    compiled backwards); 0 when nothing was compiled. From dynamo's own timers (private: 0 if
    a torch release renames them)."""
    utils = sys.modules.get("torch._dynamo.utils")
    spent = getattr(utils, "cumulative_time_spent_ns", None) or {}
    return (spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)) / 1e9
