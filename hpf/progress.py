"""A tiny progress bar for long loops: one redrawn line on a terminal, periodic plain lines otherwise.

Written here rather than taken from tqdm or rich so that hpf keeps its four runtime
dependencies; a log file or CI output gets about ten readable lines instead of thousands
of carriage returns.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

BAR_WIDTH = 24
LINES_WHEN_NOT_A_TTY = 10


class Progress:
    """``update(done, {"loss": "1.23", ...})`` after each item; ``close()`` at the end.

    Fields are shown as ``name value`` after the count; pre-format the values as strings.
    """

    def __init__(self, total: int, *, label: str = "", stream: TextIO | None = None):
        self.total, self.label = total, label
        self.stream = stream or sys.stdout
        self.is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // LINES_WHEN_NOT_A_TTY)
        self.start = time.perf_counter()
        self.width = 0

    def update(self, done: int, fields: dict[str, str] | None = None) -> None:
        fields = fields or {}
        if self.is_tty:
            line = self._line(done, fields)
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        elif done == 1 or done % self.every == 0 or done == self.total:
            self.stream.write(self._line(done, fields) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.is_tty and self.width:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, done: int, fields: dict[str, str]) -> str:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        filled = BAR_WIDTH * done // max(1, self.total)
        bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]" if self.is_tty else ""
        digits = len(str(self.total))
        parts = [self.label, f"{done:>{digits}}/{self.total}", bar]
        parts += [f"{k} {v}" for k, v in fields.items()]
        parts.append(f"{elapsed:.0f}s<{eta:.0f}s")
        return "  ".join(p for p in parts if p)
