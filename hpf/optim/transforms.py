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
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import torch

from .. import tree as tree_util
from .lr_schedules import check_rate

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
    """Decoupled weight decay: ``decay *= 1 - lr * weight_decay``, ``decay`` the params its
    ``mask`` picks (``views``): None, every param; ``mask(path, tensor) -> bool``; or a pytree of
    bools shaped like the params. On a plan's flat shards (``for_plan``) the mask becomes, per
    shard, the element ``ranges`` of the params that decay."""

    weight_decay: float
    mask: Any = None
    ranges: tuple | None = field(default=None, repr=False, compare=False)

    def for_plan(self, plan, rank: int) -> "AddDecayedWeights":
        if self.mask is None:
            return self
        decays = self.by_path(plan.tree({p: torch.empty(s.global_shape, dtype=s.dtype, device="meta")
                                         for p, s in plan.slots.items()}))
        shards = []
        for b in plan.buckets:
            pieces = [b.local_piece(s, plan.shard_index(b, rank)) for s in b.slots if decays[s.path]]
            shards.append(tuple(p.held for p in pieces if p.numel))
        return replace(self, ranges=tuple(shards))

    def by_path(self, params: Any) -> dict[str, bool]:
        """Param path -> whether it decays."""
        paths, leaves, treedef = tree_util.flatten(params)
        if callable(self.mask):
            return {p: bool(self.mask(p, x)) for p, x in zip(paths, leaves)}
        if tree_util.structure(self.mask) != treedef:
            raise ValueError(f"weight_decay_mask must be a callable(path, tensor) or a pytree of bools shaped "
                             f"like the params; got {tree_util.structure(self.mask)}, params are {treedef}")
        return dict(zip(paths, (bool(m) for m in tree_util.flatten(self.mask)[1])))

    def views(self, params: Any, leaves: list) -> list[list[torch.Tensor]]:
        """Per leaf of ``params``, the tensors the decay multiplies: all, none, or a shard's ranges."""
        if self.ranges is not None:
            return [[leaf[s] for s in slices] for leaf, slices in zip(leaves, self.ranges)]
        if self.mask is None:
            return [[leaf] for leaf in leaves]
        return [[leaf] if d else [] for leaf, d in zip(leaves, self.by_path(params).values())]

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


def add_decayed_weights(weight_decay: float, mask: Any = None) -> AddDecayedWeights:
    return AddDecayedWeights(weight_decay, mask)


def scale_by_adam(betas: tuple[float, float], eps: float) -> ScaleByAdam:
    return ScaleByAdam(tuple(betas), eps)
