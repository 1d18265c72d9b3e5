"""Donation, as in JAX: a step updates its state's buffers in place, so the state passed in is spent."""
from __future__ import annotations

from typing import Any

from ..errors import DonatedStateError
from ..train_state import TrainState

__all__ = ["Donation"]


class Donation:
    """Donation, as in JAX: a step updates its state's buffers in place, so the state passed in
    is spent; using it again raises instead of training on updated values. A closed step's
    states are all spent."""

    def __init__(self):
        self.params: list | None = None  # the params list of the state the step last returned
        self.unloaded = False  # init had meta params and no restore has filled them yet
        self.closed = False

    def close(self) -> None:
        self.params, self.closed = None, True

    def check_open(self, op: str) -> None:
        if self.closed:
            raise RuntimeError(f"{op}: this step was closed (step.close(), or the end of its `with` block), which "
                               "released its threads, process groups and memory; make a new one with hpf.shard_step")

    def donate(self, state: TrainState) -> TrainState:
        """Make ``state`` the live one: a fresh params list over the same buffers, so the state
        passed in (same buffers, old list) is recognizably donated."""
        state = state._replace(params=list(state.params))
        self.params = state.params
        return state

    def check(self, state: Any, op: str) -> None:
        self.check_open(op)
        if self.unloaded:
            raise RuntimeError(f"{op}: step.init was given meta params (shapes only), so the state holds no values "
                               "yet; call state, extra = step.restore(path) first")
        live, params = self.params, getattr(state, "params", None)
        if live is None or params is live or not isinstance(params, (list, tuple)):
            return
        if any(a is b for a, b in zip(params, live)):
            raise DonatedStateError(
                f"{op}: this state was already passed to step, which updated its buffers in place (donated, as "
                "in JAX). Use the state the step returned: state, metrics = step(state, batch)")
