"""Optimizer math as composable stages over flat lists of tensors, as optax composes its
``GradientTransformation``s with ``chain``.

A stage reads one step's hyper-parameters (``Hyper``: the step and the learning rate a
schedule gives it, ``inject``) and the grads, and updates its state and the params in place:
hpf's optimizers donate their buffers, so a stage writes where optax's would return new
updates. AdamW is ``chain(add_decayed_weights(wd), scale_by_adam(betas, eps))``: the weight
decay multiplies the params it is handed (a mask picks them: ``decay``, views into the params)
before the Adam step, the same foreach ops in the same order as ``torch.optim.AdamW``.

Clipping by the global grad norm is a stage too (``clip_by_global_norm``), but the norm is the
step's (one all-reduce, hpf.decision), so the step asks it for its ``factor`` and folds that into
the one scale that turns summed grads into the update's: one multiply, not two roundings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .schedules import check_rate

__all__ = ["Hyper", "inject", "chain", "add_decayed_weights", "scale_by_adam", "clip_by_global_norm", "Chain",
           "AddDecayedWeights", "ScaleByAdam", "ClipByGlobalNorm"]


class Hyper(NamedTuple):
    """One step's hyper-parameters, as every stage of a chain sees them."""

    step: int  # 1-based
    lr: float


def inject(lr: float | Callable[[int], float], step: int, what: str = "lr") -> Hyper:
    """The hyper-parameters of ``step``: ``lr`` a constant or a schedule of the step (ValueError,
    naming the step, unless its value is finite and >= 0)."""
    return Hyper(step, check_rate(lr(step), f"{what} schedule", step) if callable(lr) else check_rate(lr, what))


@dataclass(frozen=True)
class AddDecayedWeights:
    """Decoupled weight decay: ``decay *= 1 - lr * weight_decay`` (``decay``: the params it picks)."""

    weight_decay: float

    def apply(self, h: Hyper, p: list, g: list, moments: dict, decay: list) -> None:  # noqa: ARG002
        if self.weight_decay and decay:
            torch._foreach_mul_(decay, 1.0 - h.lr * self.weight_decay)


@dataclass(frozen=True)
class ScaleByAdam:
    """Adam's step with bias correction, eps after the square root, into the params (``lr``)."""

    betas: tuple[float, float]
    eps: float

    def apply(self, h: Hyper, p: list, g: list, moments: dict, decay: list) -> None:  # noqa: ARG002
        m, v = moments["exp_avg"], moments["exp_avg_sq"]
        b1, b2 = self.betas
        torch._foreach_lerp_(m, g, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1.0 - b2)
        bias1 = 1.0 - b1 ** h.step
        bias2_sqrt = math.sqrt(1.0 - b2 ** h.step)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(p, m, denom, -h.lr / bias1)


@dataclass(frozen=True)
class Chain:
    """Stages applied in order to the same params, grads and moments."""

    stages: tuple

    def apply(self, h: Hyper, p: list, g: list, moments: dict, decay: list) -> None:
        for stage in self.stages:
            stage.apply(h, p, g, moments, decay)


@dataclass(frozen=True)
class ClipByGlobalNorm:
    """Scale the grads so that their global norm is at most ``max_norm`` (see the module doc)."""

    max_norm: float

    def factor(self, grad_norm: float) -> float:
        """What the grads are multiplied by, for a global norm of ``grad_norm``."""
        return min(1.0, self.max_norm / (grad_norm + 1e-6))


def clip_by_global_norm(max_norm: float) -> ClipByGlobalNorm:
    return ClipByGlobalNorm(max_norm)


def chain(*stages) -> Chain:
    return Chain(tuple(stages))


def add_decayed_weights(weight_decay: float) -> AddDecayedWeights:
    return AddDecayedWeights(weight_decay)


def scale_by_adam(betas: tuple[float, float], eps: float) -> ScaleByAdam:
    return ScaleByAdam(tuple(betas), eps)
