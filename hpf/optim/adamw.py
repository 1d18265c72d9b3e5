"""Functional AdamW over any pytree of tensors, in a few fused foreach ops.

Same arithmetic as ``torch.optim.AdamW`` (decoupled weight decay, bias correction,
eps added after the square root), so a sharded run can be checked against it. Inside
``hpf.shard_step`` the leaves are flat shards; standalone they are ordinary params.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..checks import check_rate

__all__ = ["adamw", "AdamW", "AdamWState", "schedule_value"]


class AdamWState(NamedTuple):
    count: torch.Tensor  # steps taken, a 0-dim int64 tensor (checkpointable, same on every rank)
    exp_avg: Any
    exp_avg_sq: Any


def schedule_value(lr: float | Callable[[int], float], step: int, what: str = "lr") -> float:
    """A learning rate that is a constant or a function of the (1-based) step; ValueError
    (naming the step) unless it is finite and >= 0."""
    return check_rate(lr(step), f"{what} schedule", step) if callable(lr) else check_rate(lr, what)


@dataclass(frozen=True)
class AdamW:
    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def init(self, params: Any) -> AdamWState:
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
        schedule_value(self.lr, int(state.count) + 1)  # a bad lr raises before anything changes
        state.count.add_(1)
        step = int(state.count)

        def apply(indices: list[int], grads: list) -> None:
            self.apply(*([x[i] for i in indices] for x in (p, grads, m, v)), step)
        return apply

    def apply(self, p: list, g: list, m: list, v: list, step: int, lr_scale: float = 1.0) -> None:
        """The AdamW math on flat lists of tensors (shared with Muon's AdamW fallback)."""
        if not p:
            return
        lr = schedule_value(self.lr, step) * lr_scale
        b1, b2 = self.betas
        if self.weight_decay:
            torch._foreach_mul_(p, 1.0 - lr * self.weight_decay)
        torch._foreach_lerp_(m, g, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1.0 - b2)
        bias1 = 1.0 - b1 ** step
        bias2_sqrt = math.sqrt(1.0 - b2 ** step)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(p, m, denom, -lr / bias1)


def adamw(lr: float | Callable[[int], float] = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 0.01) -> AdamW:
    """``hpf.optim.adamw``: an optax-style AdamW with ``init`` and ``update``."""
    if not callable(lr):
        check_rate(lr, "adamw: lr")
    if eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"adamw: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                         f"weight_decay={weight_decay}; lr, eps, weight_decay >= 0 and 0 <= betas < 1")
    return AdamW(lr, tuple(betas), eps, weight_decay)
