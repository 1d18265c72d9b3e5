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

import optree
import torch

from .base import Capabilities
from .lr_schedules import check_rate
from .transforms import AddDecayedWeights, Chain, add_decayed_weights, chain, inject, scale_by_adam


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
class AdamW:
    """AdamW as torch.optim.AdamW computes it, on any pytree of tensors (``init``/``update``).

    Build it with :func:`adamw`, which checks the hyper-parameters.

    Args:
        lr: learning rate, or a function of the 1-based step.
        betas: decay rates of the first and second moments.
        eps: added to the square root of the second moment.
        weight_decay: decoupled weight decay (params *= 1 - lr * weight_decay).

    Raises:
        Nothing at construction (the dataclass does not check its fields; :func:`adamw` does).
        ``update`` raises optree's ValueError when grads, state and params differ in structure.
    """

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    weight_decay_mask: Any = None  # None: all; mask(path, tensor) -> bool; or a pytree of bools
    #: the decay stage with its mask resolved per flat shard (``for_plan``); None: made from the fields
    decay: AddDecayedWeights | None = field(default=None, repr=False, compare=False)
    _frozen: Any = field(default=None, repr=False, compare=False)  # per flat shard: not trained (for_plan)

    #: elementwise, so updated a few shards at a time; set up per plan (the decay mask, frozen buckets)
    capabilities = Capabilities(partial=True, for_plan=True)

    @property
    def transform(self) -> Chain:
        """The math as stages (hpf.optim.transforms): decoupled weight decay (with its mask),
        then Adam's step."""
        return chain(self.decay_stage, scale_by_adam(self.betas, self.eps))

    @property
    def decay_stage(self) -> AddDecayedWeights:
        return self.decay or add_decayed_weights(self.weight_decay, self.weight_decay_mask)

    def for_plan(self, plan, rank: int) -> "AdamW":
        """This optimizer on ``plan``'s flat shards (``hpf.shard_step`` calls it): the mask
        becomes, per shard, the element ranges of the params that decay; frozen buckets get no
        state and no update."""
        frozen = tuple(b.frozen for b in plan.buckets)
        if any(frozen):
            return replace(self, _frozen=frozen).for_plan_mask(plan, rank)
        return self.for_plan_mask(plan, rank)

    def for_plan_mask(self, plan, rank: int) -> "AdamW":
        return self if self.weight_decay_mask is None else replace(self, decay=self.decay_stage.for_plan(plan, rank))

    def init(self, params: Any) -> AdamWState:
        if self._frozen is not None:  # flat shards of a plan: frozen ones keep no moments
            moments = lambda: [p[:0].clone() if f else torch.zeros_like(p) for p, f in zip(params, self._frozen)]  # noqa: E731
            return AdamWState(torch.zeros((), dtype=torch.int64), moments(), moments())
        zeros = optree.tree_map(torch.zeros_like, params)
        return AdamWState(torch.zeros((), dtype=torch.int64), zeros,
                          optree.tree_map(torch.zeros_like, params))

    def update(self, grads: Any, state: AdamWState, params: Any) -> tuple[Any, AdamWState]:
        """Returns (new params, new state). Params and state buffers are updated in place
        (donated, as with ``jax.jit(donate_argnums=...)``): do not reuse the inputs."""
        g = optree.tree_leaves(grads)
        self.partial_update(state, params)(range(len(g)), g)
        return params, state

    def partial_update(self, state: AdamWState, params: Any) -> Callable[[list[int], list], None]:
        """Start one step whose update is applied a few leaves at a time, as their grads
        become final: returns ``apply(indices, grads)``, which updates the leaves at
        ``indices`` (of the flattened params) from ``grads[i]``. The math is elementwise, so
        any split of the leaves gives exactly one ``update``'s result (the step count moves
        on once, here)."""
        p = optree.tree_leaves(params)
        m = optree.tree_leaves(state.exp_avg)
        v = optree.tree_leaves(state.exp_avg_sq)
        decay = self.decay_stage.views(params, p) if self.weight_decay else None
        schedule_value(self.lr, int(state.count) + 1)  # a bad lr raises before anything changes
        state.count.add_(1)
        step = int(state.count)

        def apply(indices: list[int], grads: list) -> None:
            if self._frozen is not None:
                indices = [i for i in indices if not self._frozen[i]]
            self.apply(*([x[i] for i in indices] for x in (p, grads, m, v)), step,
                       decay=None if decay is None else [t for i in indices for t in decay[i]])
        return apply

    def apply(self, p: list, g: list, m: list, v: list, step: int, lr_scale: float = 1.0,
              decay: list | None = None) -> None:
        """The AdamW math on flat lists of tensors (shared with Muon's AdamW fallback);
        weight decay multiplies ``decay`` (views into ``p``; None: all of ``p``). Complex tensors
        are updated as their ``torch.view_as_real`` views, as torch's AdamW does (``g*g`` of a
        complex ``g`` is not ``|g|^2``)."""
        if not p:
            return
        p, g, m, v = (list(map(_real, x)) for x in (p, g, m, v))
        h = inject(self.lr, step)
        h = h._replace(lr=h.lr * lr_scale)
        self.transform.apply(h, p, g, {"exp_avg": m, "exp_avg_sq": v}, p if decay is None else list(map(_real, decay)))


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


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
