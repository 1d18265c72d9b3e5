"""Single-process references the tests compare hpf against: plain torch autograd on the full,
unsharded model, computed independently of the code under test."""
from __future__ import annotations

import math
from typing import Any, Callable

import optree
import torch

import hpf


def autograd_grads(loss_fn: Callable, params: Any, batch: Any) -> dict[str, torch.Tensor]:
    """{path: grad} of ``loss_fn(params, batch)`` by plain autograd on fresh copies of the params."""
    paths, leaves, treedef = hpf.tree.flatten(params)
    leaves = [p.detach().clone().requires_grad_() for p in leaves]
    loss_fn(hpf.tree.unflatten(treedef, leaves), batch).backward()
    return {p: x.grad for p, x in zip(paths, leaves)}


def adamw_training(loss_fn: Callable, params: Any, batches: Callable[[int], Any], steps: int, *,
                   max_grad_norm: float | None = None, compute_dtype: torch.dtype = torch.float32,
                   trainable: Callable[[str], bool] | None = None, zero_unused: bool = False,
                   **adamw) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(losses, pre-clip global grad norms, final params by path) of plain autograd and
    torch.optim.AdamW(**adamw) on ``batches(step)``. ``compute_dtype`` other than fp32: the
    loss runs on casts of the fp32 master params. ``trainable(path)``: only those params get
    grads and updates (torch leaves the others alone). Tied params (one tensor at several
    paths) stay one param. ``zero_unused``: a param the loss does not use gets a zero grad, as
    in JAX and hpf (AdamW still decays it); torch.optim skips a param whose .grad is None."""
    paths, leaves, treedef = hpf.tree.flatten(params)
    copies = {id(p): p.detach().clone() for p in leaves}
    leaves = [copies[id(p)] for p in leaves]
    trained = list({id(x): x.requires_grad_() for path, x in zip(paths, leaves)
                    if trainable is None or trainable(path)}.values())
    params = hpf.tree.unflatten(treedef, leaves)
    opt = torch.optim.AdamW(trained, **adamw)
    losses, norms = [], []
    for s in range(steps):
        compute = optree.tree_map(lambda p: p.to(compute_dtype), params) if compute_dtype != torch.float32 else params
        loss = loss_fn(compute, batches(s))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for x in trained if zero_unused else ():
            if x.grad is None:
                x.grad = torch.zeros_like(x)
        norms.append(float(torch.nn.utils.clip_grad_norm_(trained, math.inf if max_grad_norm is None
                                                          else max_grad_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {p: x.detach() for p, x in zip(paths, leaves)}


def functional_training(loss_fn: Callable, params: Any, batches: Callable[[int], Any], optimizer,
                        steps: int) -> tuple[list[float], Any]:
    """(losses, final params) of plain autograd grads fed to a functional (optax-style) optimizer,
    e.g. hpf's single-device ``hpf.optim.muon`` on full tensors."""
    treedef = hpf.tree.structure(params)
    state = optimizer.init(params)
    losses = []
    for s in range(steps):
        leaves = [p.detach().requires_grad_() for p in hpf.tree.flatten(params)[1]]
        loss = loss_fn(hpf.tree.unflatten(treedef, leaves), batches(s))
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            params, state = optimizer.update(hpf.tree.unflatten(treedef, list(grads)), state,
                                             hpf.tree.unflatten(treedef, [p.detach() for p in leaves]))
        losses.append(loss.item())
    return losses, params


def pairwise_sum(values: list, add=lambda a, b: a + b):
    """The canonical tree over atoms, written here independently of hpf.comm.canonical: pad the
    atoms to a power of two, add neighbours level by level (a node whose right half is all padding
    is its left half)."""
    level = list(values)
    while len(level) > 1:
        level = [add(level[i], level[i + 1]) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def atom_training(loss_fn: Callable, params: Any, batches: Callable[[int], Any], steps: int, atom_size: int,
                  **adamw) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(losses, final params by path) of the invariant mode's arithmetic in plain torch: each
    step's global batch (dim 0 of every leaf) cut into atoms, each atom's grads by autograd on the
    full params, summed by ``pairwise_sum`` and divided by the atom count, then
    ``torch.optim.AdamW(foreach=False)``; the loss is the pairwise sum of the atoms' losses over
    their count."""
    paths, leaves, treedef = hpf.tree.flatten(params)
    leaves = [p.detach().clone().requires_grad_() for p in leaves]
    tree = hpf.tree.unflatten(treedef, leaves)
    opt = torch.optim.AdamW(leaves, foreach=False, **adamw)
    losses = []
    for s in range(steps):
        batch = batches(s)
        n = len(optree.tree_leaves(batch)[0]) // atom_size
        atoms = [optree.tree_map(lambda x: x[i * atom_size:(i + 1) * atom_size].contiguous(), batch) for i in range(n)]
        per_atom = []
        for atom in atoms:
            loss = loss_fn(tree, atom)
            per_atom.append((float(loss.detach()), torch.autograd.grad(loss, leaves)))
        for i, x in enumerate(leaves):
            x.grad = pairwise_sum([g[i] for _, g in per_atom]).mul_(1.0 / n)
        opt.step()
        losses.append(pairwise_sum([v for v, _ in per_atom]) / n)
    return losses, {p: x.detach() for p, x in zip(paths, leaves)}


def _raw_bits(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1).contiguous()
    return x.view(torch.uint8) if x.dtype != torch.bool else x


def born_mismatch(init_fn: Callable, key: torch.Tensor, mesh, **plan_options) -> str | None:
    """How each rank's born-sharded shards of ``init_fn`` (``step.init(init_fn, key=)``, on a
    virtual ``mesh``: every rank evaluated here) differ from the ones cut from the eager
    ``init_fn(key)``, bit for bit, ties included; None when they are the same."""
    from hpf.sharded_init import trace_init
    from hpf.planning import step_plan
    whole, traced = init_fn(key), trace_init(init_fn, key)
    plan, eager = step_plan(traced.meta_params, mesh, **plan_options), step_plan(whole, mesh, **plan_options)
    if plan.ties != eager.ties:
        return f"ties {plan.ties} != eager's {eager.ties}"
    for rank in range(mesh.size):
        born, cut = traced.shards(plan, rank), eager.shards(whole, rank)
        for i, (a, b) in enumerate(zip(born, cut, strict=True)):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_raw_bits(a), _raw_bits(b)):
                paths = [s.path for s in plan.buckets[i].slots]
                return f"rank {rank} bucket {i} ({paths}): {int((_raw_bits(a) != _raw_bits(b)).sum())} bytes differ"
    return None
