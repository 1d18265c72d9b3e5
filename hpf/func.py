"""Transforms of the grad of a ``shard_step``'s loss: Hessian-vector products and per-example
grads, at the step's current params.

Both run ``torch.func`` on the full params (``step.full_params``: every rank holds the whole
model while they run, so they suit models that fit one device: a notebook's curvature probe,
a privacy audit on a small model) and on this rank's batch, then combine the ranks as the step
combines its loss: the mean of per-rank means, or, for ``hpf.weighted`` losses, the global sum
over the global count. Each is a collective. Checked against plain torch on the full model
(tests/test_func_transforms.py).
"""
from __future__ import annotations

from typing import Any

import optree
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import losses
from .comm import schedule, world

__all__ = ["hvp", "per_example_grads"]


def hvp(step, state, batch: Any, v: Any) -> Any:
    """The Hessian of the step's global loss at ``state``'s params times ``v`` (a tree like the
    params), as a tree like the params, the same on every rank: ``jvp(grad(loss), v)``."""
    full = _full_params(step, state, "hvp")
    v = optree.tree_map(lambda t, p: t.to(p.dtype), v, full)
    counted = []

    def grad_of_local(params):
        def value(p):
            out = losses.parse(step.loss_fn(p, batch))
            counted.append(out.count)
            return out.value
        return torch.func.grad(value)(params)
    with sdpa_kernel([SDPBackend.MATH]):  # (the fused attention kernels have no forward-mode derivative)
        _, local = torch.func.jvp(grad_of_local, (full,), (v,))
    leaves, treedef = optree.tree_flatten(local)
    # one all-reduce: every rank's product, then the global count (weighted) or the rank count
    count = counted[0]
    flat = torch.cat([*(t.reshape(-1).double() for t in leaves),
                      torch.ones(1, dtype=torch.float64, device=leaves[0].device) * (1.0 if count is None else count)])
    schedule.rendezvous("hpf.hvp")
    world.all_reduce(flat)
    flat = (flat[:-1] / flat[-1]).to(leaves[0].dtype)
    return optree.tree_unflatten(treedef, [x.view(t.shape) for x, t in zip(flat.split([t.numel() for t in leaves]),
                                                                          leaves)])


def per_example_grads(step, state, batch: Any) -> Any:
    """The grad of ``loss_fn`` on each of this rank's examples alone (each a batch of one along
    dim 0 of every batch leaf), at ``state``'s params: a tree like the params whose leaves have
    a leading dim of this rank's examples (``vmap(grad(...))``)."""
    full = _full_params(step, state, "per_example_grads")

    def one(params, example):
        out = losses.parse(step.loss_fn(params, optree.tree_map(lambda x: x.unsqueeze(0), example)))
        return out.value if out.count is None else out.value / out.count.to(out.value.dtype)
    return torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(full, batch)


def _full_params(step, state, what: str) -> Any:
    if step.plan is None:
        raise RuntimeError(f"hpf.{what}: call step.init(full_params) first, and pass the state it returns")
    if step.plan.compute_size > 1:
        raise NotImplementedError(f"hpf.{what}: the loss is computed across ranks (model-parallel axes "
                                  f"{step.plan.compute_axes}); only data-parallel steps are supported")
    return step.full_params(state)
