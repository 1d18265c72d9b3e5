"""Learning-rate schedules: plain functions of the 1-based step, which every hpf optimizer takes
as ``lr`` (``hpf.optim.adamw(lr=cosine(3e-3, total_steps=1000, warmup=100))``).

Warmup is linear from ``lr/warmup`` at step 1 to ``lr`` at step ``warmup``; the decay then runs
from ``lr`` just after warmup to ``min_lr`` at ``total_steps`` and stays there. A schedule is
picklable (a small frozen dataclass), so it travels to forked or spawned ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Schedule", "constant", "cosine", "linear", "check_rate", "NAMES"]

NAMES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class Schedule:
    """``schedule(step) -> lr`` for step = 1, 2, ...; ``kind`` is one of NAMES (by name for
    ``hpf train --schedule``); see the module docstring."""

    kind: str
    lr: float
    total_steps: int = 0
    warmup: int = 0
    min_lr: float = 0.0

    def __post_init__(self):
        if self.kind not in NAMES:
            raise ValueError(f"schedule must be one of {NAMES}, got {self.kind!r}")
        if self.lr < 0 or self.min_lr < 0 or self.warmup < 0:
            raise ValueError(f"schedule: lr, min_lr and warmup must be >= 0, got lr={self.lr}, "
                             f"min_lr={self.min_lr}, warmup={self.warmup}")
        if self.kind != "constant" and self.total_steps <= self.warmup:
            raise ValueError(f"{self.kind} schedule: total_steps={self.total_steps} must exceed warmup={self.warmup}")

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"schedules count steps from 1, got step={step}")
        if step <= self.warmup:
            return self.lr * step / self.warmup
        if self.kind == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / (self.total_steps - self.warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_lr + (self.lr - self.min_lr) * shape


def constant(lr: float, warmup: int = 0) -> Schedule:
    return Schedule("constant", lr, warmup=warmup)


def cosine(lr: float, total_steps: int, warmup: int = 0, min_lr: float = 0.0) -> Schedule:
    return Schedule("cosine", lr, total_steps, warmup, min_lr)


def linear(lr: float, total_steps: int, warmup: int = 0, min_lr: float = 0.0) -> Schedule:
    return Schedule("linear", lr, total_steps, warmup, min_lr)


def check_rate(value: float, what: str, step: int | None = None) -> float:
    """A learning rate (or a schedule's value at ``step``): finite and >= 0, else ValueError."""
    value = float(value)
    if not math.isfinite(value) or value < 0:
        at = f" returned {value} at step {step}" if step is not None else f"={value}"
        raise ValueError(f"{what}{at}: learning rates must be finite and >= 0; fix the value or the schedule")
    return value
