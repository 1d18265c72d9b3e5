"""Functional AdamW over any pytree of tensors, in a few fused foreach ops.

Same arithmetic as ``torch.optim.AdamW`` (decoupled weight decay, bias correction,
eps added after the square root), so a sharded run can be checked against it. Inside
``hpf.shard_step`` the leaves are flat shards; standalone they are ordinary params.

``weight_decay_mask`` picks the params that decay: None (the default) decays every param, as
``torch.optim.AdamW`` does; ``default_weight_decay_mask`` is the usual choice for transformers
(matrices decay; norms, biases and embeddings do not) and what ``hpf train`` uses; any
``mask(path, tensor) -> bool`` or a pytree of bools shaped like the params works too. Under
``hpf.shard_step`` the mask is resolved once per flat shard (``for_plan``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import torch

from .lr_schedules import check_rate
from .combinators import Chain, InjectHyperparams, chain
from .stage import inject
from .stages import add_decayed_weights, scale_by_adam
from .transform_optimizer import Staged, TransformOptimizer


__all__ = ["adamw", "AdamW", "AdamWState", "schedule_value", "default_weight_decay_mask"]

EMBEDDING_PATH = re.compile(r"(^|/)(embed|pos|wte|wpe|tok_embeddings)($|/)")


def default_weight_decay_mask(path: str, tensor: torch.Tensor) -> bool:
    """Decay matrices only: not norms or biases (ndim < 2), not embeddings (path ``embed``/``pos``).
    A head tied to the embedding, where tied weights are one param (named by its first path,
    ``embed``), does not decay either."""
    return tensor.ndim >= 2 and EMBEDDING_PATH.search(path) is None


class AdamWState(NamedTuple):
    count: torch.Tensor  # steps taken, a 0-dim int64 tensor (checkpointable, same on every rank)
    exp_avg: Any
    exp_avg_sq: Any


def schedule_value(lr: float | Callable[[int], float], step: int, what: str = "lr") -> float:
    """A learning rate that is a constant or a function of the (1-based) step; ValueError
    (naming the step) unless it is finite and >= 0."""
    return inject(lr, step, what).lr


@dataclass(frozen=True)
class AdamW(Staged):
    """AdamW as torch.optim.AdamW computes it, on any pytree of tensors (``init``/``update``):
    ``inject_hyperparams(chain(add_decayed_weights(weight_decay, mask), scale_by_adam(betas,
    eps)), lr)`` (hpf.optim.transforms), run as a :class:`TransformOptimizer` with AdamWState,
    whose capabilities it declares (elementwise: partial updates; set up per plan).

    Build it with :func:`adamw`, which checks the hyper-parameters.

    Args:
        lr: learning rate, or a function of the 1-based step.
        betas: decay rates of the first and second moments.
        eps: added to the square root of the second moment.
        weight_decay: decoupled weight decay (params *= 1 - lr * weight_decay).
        weight_decay_mask: None (all decay), ``mask(path, tensor) -> bool`` or a pytree of bools.

    Raises:
        Nothing at construction (the dataclass does not check its fields; :func:`adamw` does).
        ``update`` raises optree's ValueError when grads, state and params differ in structure.
    """

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    weight_decay_mask: Any = None  # None: all; mask(path, tensor) -> bool; or a pytree of bools
    #: the optimizer on a plan's flat shards (``for_plan``); None: made from the fields
    planned: TransformOptimizer | None = field(default=None, repr=False, compare=False)

    State = AdamWState

    @property
    def stages(self) -> Chain:
        """The math without its lr: decoupled weight decay (with its mask), then Adam's step."""
        return chain(add_decayed_weights(self.weight_decay, self.weight_decay_mask), scale_by_adam(self.betas, self.eps))

    @property
    def transform(self) -> InjectHyperparams:
        """The stages with the lr (or its schedule) injected."""
        return InjectHyperparams(self.stages, self.lr)  # (adamw() checked a constant lr; a bad one raises at a step)

    @property
    def optimizer(self) -> TransformOptimizer:
        """What runs it: the transform as an optimizer with AdamWState (set up per plan once planned)."""
        return self.planned or super().optimizer

    def for_plan(self, plan, rank: int) -> "AdamW":
        """This optimizer on ``plan``'s flat shards (``hpf.shard_step`` calls it): the mask
        becomes, per shard, the element ranges of the params that decay; frozen buckets get no
        state and no update. Still an AdamW, which checkpoints name."""
        return replace(self, planned=self.optimizer.for_plan(plan, rank))

    def partial_update(self, state: AdamWState, params: Any) -> Callable[[list[int], list], None]:
        """Start one step whose update is applied a few leaves at a time, as their grads
        become final (TransformOptimizer.partial_update): any split of the leaves gives exactly
        one ``update``'s result."""
        return self.optimizer.partial_update(state, params)


def adamw(lr: float | Callable[[int], float] = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 0.01, weight_decay_mask: Any = None) -> AdamW:
    """``hpf.optim.adamw``: an optax-style AdamW with ``init``, ``update`` and ``partial_update``.

    Args:
        lr: learning rate, or a function of the 1-based step (see hpf.optim.lr_schedules).
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the square root of the second moment, >= 0.
        weight_decay: decoupled weight decay, >= 0.
        weight_decay_mask: which params decay (None: all, as torch;
            ``default_weight_decay_mask``: matrices but not embeddings).

    Raises:
        ValueError: a negative lr, eps or weight_decay, or a beta outside [0, 1).
    """
    if not callable(lr):
        check_rate(lr, "adamw: lr")
    if eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"adamw: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                         f"weight_decay={weight_decay}; lr, eps, weight_decay >= 0 and 0 <= betas < 1")
    return AdamW(lr, tuple(betas), eps, weight_decay, weight_decay_mask)
