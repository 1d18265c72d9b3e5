"""The elementwise stages AdamW is made of, and the clip: ``add_decayed_weights`` (with its
mask), ``scale_by_adam`` and ``clip_by_global_norm``, each with its factory."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import tree as tree_util
from .stage import Hyper, Transform, meta_params

__all__ = ["AddDecayedWeights", "ScaleByAdam", "ClipByGlobalNorm", "add_decayed_weights", "scale_by_adam",
           "clip_by_global_norm"]


@dataclass(frozen=True)
class AddDecayedWeights(Transform):
    """Decoupled weight decay: ``params *= 1 - lr * weight_decay`` on the params its ``mask``
    picks: None, every param; ``mask(path, tensor) -> bool``; or a pytree of bools shaped like
    the params. Resolved (``for_params``, ``for_plan``) it is ``ranges``: per leaf, the index
    objects of its elements that decay (``...``: all; per flat shard, the decaying params' ranges)."""

    weight_decay: float
    mask: Any = None
    ranges: tuple | None = field(default=None, repr=False, compare=False)

    def for_plan(self, plan, rank: int) -> "AddDecayedWeights":
        if self.mask is None:
            return self
        decays = self.by_path(meta_params(plan))
        shards = []
        for b in plan.buckets:
            pieces = [b.local_piece(s, plan.shard_index(b, rank)) for s in b.slots if decays[s.path]]
            shards.append(tuple(p.held for p in pieces if p.numel))
        return replace(self, ranges=tuple(shards))

    def for_params(self, params: Any) -> "AddDecayedWeights":
        if self.mask is None or self.ranges is not None:  # (a weight_decay of 0 may be injected as another)
            return self
        return replace(self, ranges=tuple((...,) if d else () for d in self.by_path(params).values()))

    def check(self, hyper: Hyper) -> None:
        if self.weight_decay and self.ranges is None and self.mask is not None:
            raise ValueError("add_decayed_weights(mask=...) needs the params' paths: resolve it with "
                             "for_params(params) (hpf.optim.as_optimizer does) or for_plan(plan, rank)")

    def take(self, indices: list[int]) -> "AddDecayedWeights":
        return self if self.ranges is None else replace(self, ranges=tuple(self.ranges[i] for i in indices))

    def by_path(self, params: Any) -> dict[str, bool]:
        """Param path -> whether it decays."""
        paths, leaves, treedef = tree_util.flatten(params)
        if callable(self.mask):
            return {p: bool(self.mask(p, x)) for p, x in zip(paths, leaves)}
        if tree_util.structure(self.mask) != treedef:
            raise ValueError(f"weight_decay_mask must be a callable(path, tensor) or a pytree of bools shaped "
                             f"like the params; got {tree_util.structure(self.mask)}, params are {treedef}")
        return dict(zip(paths, (bool(m) for m in tree_util.flatten(self.mask)[1])))

    def update(self, grads, state, params, hyper):
        if self.weight_decay:
            self.check(hyper)
            decay = params if self.ranges is None else [p[s] for p, slices in zip(params, self.ranges) for s in slices]
            if decay:
                torch._foreach_mul_(decay, 1.0 - hyper.rate("add_decayed_weights") * self.weight_decay)
        return grads, state


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


@dataclass(frozen=True)
class ScaleByAdam(Transform):
    """Adam's step with bias correction, eps after the square root, into the params (``lr``)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fields = ("exp_avg", "exp_avg_sq")

    def update(self, grads, state, params, hyper):
        """Complex leaves step as their real views, as torch's AdamW (``g*g`` of a complex ``g`` is not ``|g|^2``)."""
        g, p, m, v = (list(map(_real, x)) for x in (grads, params, state["exp_avg"], state["exp_avg_sq"]))
        b1, b2 = self.betas
        lr = hyper.rate("scale_by_adam")
        torch._foreach_lerp_(m, g, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1.0 - b2)
        bias1 = 1.0 - b1 ** hyper.step
        bias2_sqrt = math.sqrt(1.0 - b2 ** hyper.step)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(p, m, denom, -lr / bias1)
        return grads, state


@dataclass(frozen=True)
class ClipByGlobalNorm(Transform):
    """Scale the grads so that their global norm is at most ``max_norm``. Alone, it takes the
    norm of the grads it is given. On a plan (``step_norm``) the norm is the step's, of every rank's
    grads in its one all-reduce: the decision reads this stage's ``factor`` of it (its
    ``Decision.clip``) and the multiplier the stage gives (``grad_scale``), and the stage passes
    the grads it is then given through."""

    max_norm: float
    step_norm: bool = False

    @property
    def elementwise(self) -> bool:  # the norm is of all leaves, unless the step took it
        return self.step_norm

    @property
    def max_grad_norm(self) -> float:
        return self.max_norm

    def factor(self, grad_norm: float) -> float:
        """What the grads are multiplied by, for a global norm of ``grad_norm``."""
        return min(1.0, self.max_norm / (grad_norm + 1e-6))

    def grad_scale(self, denominator: float, factor: float) -> float:
        """The one multiplier of summed grads that the step divides by ``denominator`` (the
        normalizer and the loss scale) and this stage clips by ``factor``: one division, so a
        clipped grad rounds once, as ``clip_grad_norm_`` after a mean would (0: nothing counted)."""
        return factor / denominator if denominator else 0.0

    def for_plan(self, plan, rank: int) -> "ClipByGlobalNorm":
        return replace(self, step_norm=True)

    def update(self, grads, state, params, hyper):
        if self.step_norm or not grads:
            return grads, state
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()))
        return list(torch._foreach_mul(grads, self.factor(norm))), state


def clip_by_global_norm(max_norm: float) -> ClipByGlobalNorm:
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"clip_by_global_norm: max_norm must be a finite number > 0, got {max_norm!r}")
    return ClipByGlobalNorm(float(max_norm))


def add_decayed_weights(weight_decay: float, mask: Any = None) -> AddDecayedWeights:
    return AddDecayedWeights(weight_decay, mask)


def scale_by_adam(betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> ScaleByAdam:
    return ScaleByAdam(tuple(betas), eps)
