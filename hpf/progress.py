"""A tiny progress bar for long loops: one redrawn line on a terminal, periodic plain lines otherwise.

Written here rather than taken from tqdm or rich so that hpf keeps its four runtime
dependencies; a log file or CI output gets about ten readable lines instead of thousands
of carriage returns.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress"]

BAR_WIDTH = 24
LINES_WHEN_NOT_A_TTY = 10
HEARTBEAT_S = 30.0  # while one item runs longer than this, say so again


class Progress:
    """``update(done, {"loss": "1.23", ...})`` after each item; ``close()`` at the end.

    Fields are shown as ``name value`` after the count; pre-format the values as strings.
    ``start(note)`` says at once that item 1 is running (a big model's first step can take
    minutes), and from then on an item that runs past ``heartbeat_s`` is reported again.
    """

    def __init__(self, total: int, *, label: str = "", stream: TextIO | None = None,
                 heartbeat_s: float = HEARTBEAT_S):
        self.total, self.label = total, label
        self.stream = stream or sys.stdout
        self.is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // LINES_WHEN_NOT_A_TTY)
        self.started = self.last = self.beat = time.perf_counter()  # last: the latest update
        self.width = 0
        self.done = self.first = 0  # first: items done before this bar began (a resumed run's)
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def start(self, note: str = "") -> None:
        self._show(f"{self.label}  {note or f'item 1 of {self.total}'} ...".strip(), newline=True)
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="hpf-progress")
        self._thread.start()

    def update(self, done: int, fields: dict[str, str] | None = None) -> None:
        self.done, self.last = done, time.perf_counter()
        if self.is_tty or done == self.first + 1 or done % self.every == 0 or done == self.total:
            self._show(self._line(done, fields or {}))

    def note(self, line: str) -> None:
        """A line of its own between updates (a checkpoint saved, a warning)."""
        self._show(f"{self.label}  {line}", newline=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self.is_tty and self.width:
            self.stream.write("\n")
            self.stream.flush()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            now = time.perf_counter()
            if now - max(self.last, self.beat) >= self.heartbeat_s and self.done < self.total:
                self._show(f"{self.label}  {self.done + 1}/{self.total} still running, "
                           f"{now - self.last:.0f}s so far".strip())
                self.beat = now

    def _show(self, line: str, newline: bool = False) -> None:
        """A terminal redraws one line in place; a log file gets each line on its own."""
        with self._lock:
            if self.is_tty and not newline:
                self.stream.write("\r" + line.ljust(self.width))
                self.width = len(line)
            else:
                self.stream.write(("\n" if self.is_tty and self.width else "") + line + "\n")
                self.width = 0
            self.stream.flush()

    def _line(self, done: int, fields: dict[str, str]) -> str:
        elapsed = time.perf_counter() - self.started
        eta = elapsed / (done - self.first) * (self.total - done) if done > self.first else 0.0
        filled = BAR_WIDTH * done // max(1, self.total)
        bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]" if self.is_tty else ""
        digits = len(str(self.total))
        parts = [self.label, f"{done:>{digits}}/{self.total}", bar]
        parts += [f"{k} {v}" for k, v in fields.items()]
        parts.append(f"{elapsed:.0f}s<{eta:.0f}s")
        return "  ".join(p for p in parts if p)
