"""Gradient equivalence: the sharded step's grads against a single-process autograd reference."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch

from .. import losses
from ..comm import world
from .. import tree as tree_util
from ..comm.collectives import spmd
from ..step import ShardStep
from ..train_state import TrainState
from .errors import GradientMismatchError

__all__ = ["GradReport", "check_grads"]


@dataclass
class GradReport:
    """Per parameter path: max |sharded - reference| and that over max |reference|."""

    errors: dict[str, tuple[float, float]]  # path -> (max_abs, max_rel)
    failures: list[str]
    rtol: float
    atol: float
    sharded: Any = field(repr=False, default=None)  # full grads through the sharded step
    reference: Any = field(repr=False, default=None)  # full grads of the single-process reference

    def __str__(self) -> str:
        width = max(map(len, self.errors), default=4)
        rows = [f"{'path':<{width}}  {'max_abs':>10}  {'max_rel':>10}"]
        rows += [f"{p:<{width}}  {a:10.3e}  {r:10.3e}{'  FAIL' if p in self.failures else ''}"
                 for p, (a, r) in self.errors.items()]
        return "\n".join(rows)


def check_grads(step: ShardStep, state: TrainState, batch: Any, *, rtol: float = 1e-3,
                atol: float = 1e-6) -> GradReport:
    """Gradient equivalence in one call (collective: every rank calls it with its local batch).

    Computes the grads of the global mean loss through the sharded step (no update) and
    through a single-process reference: plain autograd on the gathered full params, run on
    each data-parallel rank's local batch and averaged, with hpf collectives acting as on one
    rank. A path fails when max |sharded - reference| > atol + rtol * max |reference|; then
    raises :class:`GradientMismatchError` naming the paths; otherwise returns the report.
    Under mixed precision the reference computes in the compute dtype too; loosen rtol to match.

    Args:
        step: an initialized step (either mode).
        state: its train state; it is not updated.
        batch: this rank's local batch.
        rtol, atol: the tolerance per path, relative to the reference's largest magnitude.

    Returns:
        A :class:`GradReport` (per path: max abs and relative error).

    Raises:
        RuntimeError: ``step.init`` was not called.
        GradientMismatchError: some path is beyond the tolerance (the message lists them).
    """
    if step.plan is None:
        raise RuntimeError("check_grads: call step.init(full_params) first")
    grads = step.grads(state, batch)
    sharded = step.full_params(TrainState(grads, None))
    full = step.full_params(state)
    batches = _data_parallel_batches(step, batch)
    dtype = step.mp.compute_dtype if step.mp else None
    reference = _reference_grads(step.loss_fn, full, batches, dtype)
    errors, failures = {}, []
    for path, got, want in zip(*tree_util.flatten(sharded)[:2], tree_util.flatten(reference)[1]):
        got, want = got.float(), want.float()
        max_abs = float((got - want).abs().max()) if got.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        errors[path] = (max_abs, max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf))
        if not max_abs <= atol + rtol * scale:
            failures.append(path)
    report = GradReport(errors, failures, rtol, atol, sharded, reference)
    if failures:
        worst = sorted(failures, key=lambda p: -errors[p][1])
        raise GradientMismatchError(
            f"sharded grads differ from the single-process reference beyond atol={atol} + rtol={rtol} * "
            f"max|ref| for {len(failures)} params, worst {worst[:5]}:\n{report}\nThe sharded path (specs, collectives, "
            "custom autograd functions) computes different grads; a missing or extra hpf.psum is the usual cause")
    return report


def _data_parallel_batches(step: ShardStep, batch: Any) -> list:
    """Every data-parallel rank's local batch (this rank's non-FSDP coordinates), in rank order."""
    if world.world_size() == 1:
        return [batch]
    everyone = world.all_gather_object(optree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, batch))
    move = lambda x: x.to(step.device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return [optree.tree_map(move, everyone[r]) for r in step.mesh.group_ranks(step.plan.fsdp_axes, step.rank)]


def _reference_grads(loss_fn: Callable, full: Any, batches: list, dtype: torch.dtype | None) -> Any:
    """Plain autograd on the full params: the mean of the batches' grads (a mean loss), or the
    sum of their grads over the total count (``hpf.weighted``)."""
    paths, leaves, treedef = tree_util.flatten(full)
    params = [x.detach().to(dtype or x.dtype).requires_grad_() for x in leaves]
    tree = tree_util.with_apply(tree_util.unflatten(treedef, params))
    total = [torch.zeros_like(x, dtype=torch.float32) for x in leaves]
    count = 0.0
    with spmd(None):
        for b in batches:
            out = losses.parse(loss_fn(tree, b))
            count += 1.0 if out.count is None else float(out.count)
            grads = torch.autograd.grad(out.value, params, allow_unused=True)
            for t, g in zip(total, grads):
                if g is not None:
                    t += g.float()
    return tree_util.unflatten(treedef, [t / count for t in total])
