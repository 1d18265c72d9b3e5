"""hpf.elastic.train: one rank's training loop, whose faults are survived and whose boundaries admit new ranks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import launcher
from ..comm import world
from .job import Job, is_fault


@dataclass
class Run:
    """What ``train`` returns on each rank that finished: the step of the last generation, its state,
    every step's metrics (``losses``), and the losses and joins survived (``events``: the step the
    job went back to, the seconds from the fault to the state rebuilt, the bytes this rank received,
    and ``time``, the wall clock once rebuilt)."""

    step: Any
    state: Any
    losses: list[float] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    copy_bytes: int = 0  # the most the copies held on this rank (three shard states at most, two in shared memory: ``Job.protect``)


def train(make_step: Callable[[int], Any], init: Any, batches: Callable[[int, int, int], Any], steps: int, *,
          key: torch.Tensor | None = None, every: int = 1, shift: int | None = None, rejoin_wait: float = 0.0,
          on_step: Callable[[int, dict], None] | None = None,
          at_boundary: Callable[[Any, Any, int], None] | None = None,
          first: Callable[[Any], tuple[Any, int]] | None = None) -> Run:
    """Run ``steps`` steps of an elastic job on this rank (see the module doc); every rank calls it.

    Args:
        make_step: ``world_size -> hpf.shard_step(...)``, not yet initialized: the step on a mesh of that size
            (it is called again each time the world shrinks or grows).
        init: the params (the same on every rank), or an init function (with ``key``: born sharded).
        batches: ``(step, rank, world_size) -> local batch`` of step ``step`` (0-based), a pure function:
            redone steps read the same global batch.
        steps: how many steps the job runs.
        every: protect every this many steps (1: a fault redoes only the step in flight).
        shift: how many members along a rank's buddy is (default: a machine's ranks on a multi-axis mesh, else 1).
        rejoin_wait: after a loss, the first boundary waits up to this many seconds for a new rank to register
            (a replacement, a worker torchrun restarted), so the world grows back before it steps on; 0: at once.
        on_step: called with (step, metrics) after each step that finished (redone steps again); the metrics
            add ``copy_s``, the seconds the boundary before the step took to protect.
        at_boundary: called with (step, state, t) on every member at each protected boundary (redone ones
            again): a checkpoint there (``step.save``, not async) is survived like a step.
        first: ``step -> (state, steps done)``, where the members start (a checkpoint restored: ``--resume``);
            by default ``step.init(init, key=key)`` at 0.

    Returns:
        Run: the last generation's step (close it) and state, the losses, the faults and joins survived
        (``step`` None on a rank that was to join a job that ended first).

    Raises:
        UnrecoverableLossError: a rank lost with its buddy; ValueError: a mesh that cannot shrink."""
    job = Job(make_step, init, key, every, shift, first, rejoin_wait)
    run = Run(None, None)
    begun = _begin(job, run.events)
    if begun is None:
        return run
    step, state, t = begun
    losses: dict[int, float] = {}
    due = True  # the boundary at t is to be protected (and joiners admitted) before the next step
    copy_s = 0.0  # the last boundary's protection: what the redundancy costs a step
    while t < steps:
        try:
            if due:
                step, state, due, copy_s = _at_boundary(job, step, state, t, run.events, at_boundary)
                continue
            state, metrics = step(state, batches(t, world.rank(), world.world_size()))
            losses[t] = metrics["loss"]
            t += 1
            if on_step is not None:
                on_step(t, {**metrics, "copy_s": copy_s})
            due = t % every == 0
        except BaseException as error:  # noqa: BLE001 -- a fault is survived; anything else is raised as it is
            if not is_fault(error):
                raise
            step, state, t, event = job.recover(error, step, state, t)
            run.events.append(event)
            due = True
    job.finish(t)
    run.step, run.state, run.losses, run.copy_bytes = step, state, [losses[i] for i in sorted(losses)], job.copy_bytes
    return run


def _begin(job: Job, events: list):
    """Start as a member, or join a running job as a new rank: (step, state, the step it starts at),
    or None for a new rank the job ended without."""
    if not launcher.elastic_member()[2]:
        return job.start()
    joined = job.join()
    if joined is None:
        return None
    step, state, t, event = joined
    events.append(event)
    return step, state, t


def _at_boundary(job: Job, step, state, t: int, events: list, then: Callable | None) -> tuple[Any, Any, bool, float]:
    """Protect boundary ``t``, admit the ranks waiting to join, and call ``then`` where none joined:
    (step, state, whether the boundary is due again (a join changed the world), the seconds the
    protection took)."""
    started = time.perf_counter()
    job.protect(step, state, t)
    copy_s = time.perf_counter() - started
    joined = job.admit(step, state, t)
    if joined is None:
        if then is not None:
            then(step, state, t)
        return step, state, False, copy_s
    step, state, event = joined
    events.append(event)
    return step, state, True, copy_s
