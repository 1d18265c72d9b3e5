"""The update: the grads divided and clipped, the optimizer's step, and the next step's first gathers.

The optimizer's work may begin while backward runs (``EarlyWork``: hpf.optim.EarlyUpdate), and
with ``overlap_optimizer`` the units the next step reads first are updated first, so their
gathers travel while the rest update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import losses
from ..comm import schedule, world
from ..comm.schedule import LOG
from ..comm.transport import UnitComm
from ..config import StepConfig
from ..decision import Decider, Decision
from ..engine import UnitEngine
from ..optim.base import EarlyUpdate, PartialUpdate, capabilities
from ..train_state import TrainState

__all__ = ["Attempt", "EarlyWork", "update_state"]


@dataclass
class Attempt:
    """What one step attempt's early optimizer work is begun from (``EarlyWork.start``)."""

    opt: EarlyUpdate
    engine: UnitEngine
    decider: Decider
    grads: list
    opt_state: Any
    n_micro: int
    scale: float  # the loss scale backward's seed carries
    counts: list = field(default_factory=list)  # each micro-batch's hpf.weighted count
    count: Any = None  # their global sum: a tensor, or (tensor, its all-reduce in flight)


class EarlyWork:
    """The optimizer's work begun while backward runs (hpf.optim.EarlyUpdate), for one step.

    It assumes the grad scale of a step whose clip does not fire, known once the last
    micro-batch's loss is (``loss_known``); ``take`` hands the work to the update only when the
    decision's scale is that one, else it is dropped (its communication lands; nothing was
    written). ``attempts`` counts the step's attempts, the same on every rank."""

    def __init__(self):
        self.work, self.scale, self.attempts = None, None, 0
        self.attempt: Attempt | None = None

    def start(self, opt, engine: UnitEngine, decider: Decider, grads: list, opt_state, n_micro: int,
              scale: float) -> None:
        """A step attempt begins (its micro-batches next)."""
        self.drop()
        self.attempts += 1
        self.attempt = None
        if capabilities(opt).early and engine.tell_landed(None):  # (False: grads land too late for it)
            self.attempt = Attempt(opt, engine, decider, grads, opt_state, n_micro, scale)

    def loss_known(self, out: losses.LossOut, hold: bool, world_size: int) -> None:
        """A micro-batch's loss is computed (its backward is next). At the last one the scale is
        known, but for hpf.weighted's global count: one all-reduce of it, started here, lands
        while backward runs (every rank issues it at the same point)."""
        a = self.attempt
        if a is None:
            return
        a.counts.append(out.count)
        if hold:
            return
        if out.count is not None:
            count = torch.tensor([sum(float(c) for c in a.counts)], dtype=torch.float64)
            if world.is_distributed() and world_size > 1:
                LOG.record("all-reduce", "the step's count, early")
                count = (count, world.all_reduce_async(count))
            a.count = count
        a.engine.tell_landed(self._landed)

    def _landed(self, buckets: list[int]) -> None:
        """The engine's ``tell_landed``: start these buckets' work (on the first, the work itself)."""
        if self.work is None:
            a = self.attempt
            if isinstance(a.count, tuple):
                schedule.wait(a.count[1], "the step's count all-reduce")
                a.count = a.count[0]
            self.scale = a.decider.unclipped_scale(a.n_micro, a.scale, None if a.count is None else float(a.count[0]))
            self.work = a.opt.early(a.grads, a.opt_state, self.scale, self.attempts)
            if self.work is None:
                a.engine.tell_landed(None)
                return
        self.work.grads_final(buckets)

    def take(self, grad_scale: float):
        """The work, if it assumed the decision's ``grad_scale``; else None (dropped)."""
        work = self.work if self.scale == grad_scale else None
        if work is None:
            self.drop()
        self.forget()
        return work

    def update(self, opt, d: Decision, grads: list, state: TrainState) -> tuple:
        """(params, opt_state) after the update: the work begun in backward, if it assumed the
        decision's grad scale and applies, else ``opt.update`` (with the step's aux if it reads it)."""
        reads_aux = bool(capabilities(opt).aux)
        work = self.take(d.grad_scale)
        if work is not None and work.apply(grads, state.params, d.aux if reads_aux else None):
            return state.params, state.opt_state
        return opt.update(grads, state.opt_state, state.params, **({"aux": d.aux} if reads_aux else {}))

    def drop(self) -> None:
        """Drop the work (a skipped step, or grads only): its communication lands first."""
        work = self.work
        self.forget()
        if work is not None:
            work.finish()

    def forget(self) -> None:
        """Forget the work, in flight or not (after an error: its pieces carry this attempt's tags)."""
        if self.attempt is not None:
            self.attempt.engine.tell_landed(None)
        self.work = self.attempt = None


def update_state(state: TrainState, d: Decision, grads: list, eng: UnitEngine, comm: UnitComm, opt, early: EarlyWork,
            cfg: StepConfig) -> TrainState:
    """Divide and clip the grads, update, and start the next step's first gathers: with the
    overlap, the units it reads first are updated first and gather while the rest update."""
    if state.error_feedback is not None:
        comm.lowbit.commit_feedback()
    torch._foreach_mul_(grads, d.grad_scale)
    if cfg.overlap_optimizer and capabilities(opt).partial:
        params, opt_state = _update_first_units_first(opt, eng, state, grads)
    else:
        params, opt_state = early.update(opt, d, grads, state)
        eng.prefetch(params)
    if state.loss_scale is not None:
        cfg.loss_scale.update(state.loss_scale, finite=True)
    return state._replace(params=params, opt_state=opt_state)


def _update_first_units_first(opt: PartialUpdate, engine: UnitEngine, state: TrainState, grads: list) -> tuple:
    """``overlap_optimizer``: update the buckets of the units the next step reads first, start
    their gathers, then update the rest while they travel."""
    first = engine.first_buckets()
    rest = [b for b in range(len(grads)) if b not in set(first)]
    apply = opt.partial_update(state.opt_state, state.params)
    apply(first, grads)
    engine.prefetch(state.params)
    apply(rest, grads)
    return state.params, state.opt_state
