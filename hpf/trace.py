"""Named ranges on a step's timeline, for ``hpf train --trace``; free when tracing is off.

The engine and the comm workers mark what a step spends its time on (unit gathers, each
unit's forward and backward, each bucket's reduction, the slow-tier stage, the optimizer per
unit, and every wait) with ``span("hpf/...")``. With tracing off, ``span`` is one global
check that returns a shared no-op context manager. With tracing on, each span is a
``torch.profiler.record_function`` range, so hpf's ranges sit in the same Chrome/Perfetto
trace as torch's own ops, on the thread that ran them.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

__all__ = ["span", "Ranges", "tracing", "merge_traces"]

_on = False
_NULL = contextlib.nullcontext()
_events: list[tuple[str, int, int, int]] = []  # (name, native thread id, start ns, end ns), wall clock


class _Span:
    """Records one range on the calling thread (torch's profiler only sees the thread that
    started it, and hpf's comm workers run on their own threads)."""

    __slots__ = ("name", "t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0 = time.time_ns()

    def __exit__(self, *exc) -> None:
        _events.append((self.name, threading.get_native_id(), self.t0, time.time_ns()))


def span(name: str, detail: object = None):
    """A context manager marking ``name`` (then `` detail``, if given) on the timeline while
    tracing; a no-op otherwise. Pass the detail apart (``span("hpf/gather", unit)``), not in
    an f-string: it is formatted only when tracing is on."""
    if not _on:
        return _NULL
    return _Span(name if detail is None else f"{name} {detail}")


class Ranges:
    """Back-to-back ranges on one thread, for phases with no single enclosing call (a unit's
    forward runs from its read to the next unit's read): ``switch`` ends the open range and
    opens the next, ``end`` closes it. Off, each call is one global check."""

    __slots__ = ("name", "t0")

    def __init__(self):
        self.name: str | None = None
        self.t0 = 0

    def switch(self, name: str | None, detail: object = None) -> None:
        if not _on:
            self.name = None
            return
        t = time.time_ns()
        if self.name is not None:
            _events.append((self.name, threading.get_native_id(), self.t0, t))
        self.name = name if name is None or detail is None else f"{name} {detail}"
        self.t0 = t

    def end(self) -> None:
        self.switch(None)


@contextlib.contextmanager
def tracing(path: str | Path, *, skip_steps: int = 2, steps: int = 3) -> Iterator[Callable[[], None]]:
    """Trace ``steps`` steps after ``skip_steps`` warm-up steps into a Chrome trace at ``path``.

    Yields ``advance()``, to be called once after every training step. torch's profiler
    records the ops; hpf's spans from every thread are added to the same file. The trace is
    written when the traced steps end, or when the context exits, whichever comes first.

    Args:
      path: the JSON file to write (its folder must exist).
      skip_steps: steps left out at the start (first-step set-up and allocations).
      steps: steps recorded.
    Raises:
      ValueError: when ``steps`` < 1 or ``skip_steps`` < 0.
    """
    if steps < 1 or skip_steps < 0:
        raise ValueError(f"tracing(steps={steps}, skip_steps={skip_steps}): need steps >= 1 and skip_steps >= 0")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    done = [0]

    def start() -> None:
        global _on
        _events.clear()
        with _without_profiler_log():
            prof.start()
        _on = True

    def stop() -> None:
        global _on
        _on = False
        with _without_profiler_log():
            prof.stop()
        _write(prof, Path(path))

    def advance() -> None:
        done[0] += 1
        if done[0] == skip_steps:
            start()
        elif done[0] == skip_steps + steps:
            stop()

    if skip_steps == 0:
        start()
    try:
        yield advance
    finally:
        if _on:
            stop()


@contextlib.contextmanager
def _without_profiler_log() -> Iterator[None]:
    """Drop the "USDT:... profiler_start/stop" lines torch's profiler (kineto) writes to stderr on
    each start and stop (no setting turns them off); any other line written meanwhile is kept."""
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not (line.startswith(b"USDT:") and b"profiler_st" in line)]
            if kept:
                os.write(2, b"".join(kept))


def _write(prof, path: Path) -> None:
    """torch's trace of the ops, plus hpf's spans as complete events on their threads."""
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        data = json.load(f)
    base_ns = int(data.get("baseTimeNanoseconds", 0))  # torch's ts are wall-clock us minus this
    pid = os.getpid()
    data.setdefault("traceEvents", []).extend(  # (integer ns first: float us of the epoch lose ~0.2 us)
        {"ph": "X", "cat": "hpf", "name": name, "pid": pid, "tid": tid, "ts": (t0 - base_ns) / 1e3,
         "dur": (t1 - t0) / 1e3} for name, tid, t0, t1 in list(_events))
    _events.clear()
    with open(path, "w") as f:
        json.dump(data, f)


def merge_traces(paths: list[str | Path], out: str | Path) -> Path:
    """One Chrome trace from one file per rank: rank r's events get process id r and the
    process name "rank r", so the ranks stack as rows in Perfetto or chrome://tracing.
    Timestamps are wall clock on every rank, so local ranks line up."""
    events = []
    for rank, p in enumerate(paths):
        with open(p) as f:
            data = json.load(f)
        shift = data.get("baseTimeNanoseconds", 0) / 1e3
        for e in data.get("traceEvents", []):
            if isinstance(e, dict) and e.get("ph") not in (None, "M"):
                events.append({**e, "pid": rank, **({"ts": e["ts"] + shift} if "ts" in e else {})})
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
    out = Path(out)
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out
