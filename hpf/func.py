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

import re
from typing import Any

import optree
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import batching, losses
from . import tree as tree_util
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
            out = losses.parse(step.loss_fn(tree_util.with_apply(p), batch))
            counted.append(out.count)
            return out.value
        return torch.func.grad(value)(params)
    with sdpa_kernel([SDPBackend.MATH]):  # (the fused attention kernels have no forward-mode derivative)
        try:
            _, local = torch.func.jvp(grad_of_local, (full,), (v,))
        except (RuntimeError, NotImplementedError) as e:
            if not _NO_FORWARD_MODE.search(str(e)):
                raise
            local = _reverse_over_reverse(step.loss_fn, full, batch, v)
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


#: torch's forward-mode derivative of some ops' backward fails (F.mse_loss: "ZeroTensors are immutable")
_NO_FORWARD_MODE = re.compile(r"ZeroTensors are immutable|forward AD|forward-mode|jvp")


def _reverse_over_reverse(loss_fn, full: Any, batch: Any, v: Any) -> Any:
    """``hvp``'s product by double backward, for losses whose backward has no forward-mode
    derivative: the grad of (grad(loss) . v), as JAX's ``grad(vdot(grad(f), v))``."""
    paths, leaves, treedef = tree_util.flatten(full)
    leaves = [p.detach().requires_grad_() for p in leaves]
    with torch.enable_grad():
        out = losses.parse(loss_fn(tree_util.with_apply(tree_util.unflatten(treedef, leaves)), batch))
        grads = torch.autograd.grad(out.value, leaves, create_graph=True, allow_unused=True)
        dot = sum((g * t).sum() for g, t in zip(grads, tree_util.flatten(v)[1]) if g is not None)
        hv = torch.autograd.grad(dot, leaves, allow_unused=True) if torch.is_tensor(dot) else [None] * len(leaves)
    return tree_util.unflatten(treedef, [torch.zeros_like(p) if h is None else h for p, h in zip(leaves, hv)])


def per_example_grads(step, state, batch: Any) -> Any:
    """The grad of ``loss_fn`` on each of this rank's examples alone (each a batch of one along
    the batch dim the step's ``batch_axes`` gives each leaf; leaves it marks None go whole to
    every example), at ``state``'s params: a tree like the params whose leaves have a leading
    dim of this rank's examples (``vmap(grad(...))``).

    Raises:
        ValueError: the per-example leaves hold different numbers of examples (the message names them)."""
    full = _full_params(step, state, "per_example_grads")
    paths, leaves, treedef = tree_util.flatten(batch)
    axes = batching.leaf_axes(batch, step.config.batch_axes)
    sizes = {p or "<root>": x.shape[a] for p, x, a in zip(paths, leaves, axes) if a is not None}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"hpf.per_example_grads: the batch's per-example leaves hold {sizes or 'no'} examples along "
                         "their batch dims (the step's batch_axes); each needs the same number. Mark a leaf that is "
                         "not per-example with batch_axes=... None")

    def one(params, *example):
        example = [x if a is None else x.unsqueeze(a) for x, a in zip(example, axes)]
        out = losses.parse(step.loss_fn(tree_util.with_apply(params), tree_util.unflatten(treedef, example)))
        return out.value if out.count is None else out.value / out.count.to(out.value.dtype)
    return torch.func.vmap(torch.func.grad(one), in_dims=(None, *axes))(full, *leaves)


def _full_params(step, state, what: str) -> Any:
    if step.plan is None:
        raise RuntimeError(f"hpf.{what}: call step.init(full_params) first, and pass the state it returns")
    if step.plan.compute_size > 1:
        raise NotImplementedError(f"hpf.{what}: the loss is computed across ranks (model-parallel axes "
                                  f"{step.plan.compute_axes}); only data-parallel steps are supported")
    return step.full_params(state)
