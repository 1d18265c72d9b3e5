"""Collective I/O of a step's train state: checkpoints (hpf.checkpoint) and the full params.

``StateIO`` is the part of :class:`hpf.ShardStep` that moves a whole state in or out, a part the
step holds (made by its ``init``) and calls after its own checks; every rank calls each method
(a rank that skips one makes the others raise ScheduleMismatchError).
"""
from __future__ import annotations

from typing import Any

import torch

from . import tree as tree_util
from .comm import schedule, world
from .comm.collectives import gather_dim0
from .planning import Plan
from .train_state import TrainState, populate, zeros

__all__ = ["StateIO"]


class StateIO:
    """Checkpoints and full params of the states of one step (see the module doc).

    Args:
        plan, rank, device: the step's plan, this process's global rank, its device.
        optimizer: the optimizer on the plan's flat shards (the step's ``plan_optimizer``).
        master_dtype: the dtype of the master shards (None: the params' own).
        loss_scale: fp16's hpf.LossScale (None: none).
        feedback_numel: the error-feedback residuals' sizes per bucket (None: none kept).
    """

    def __init__(self, plan: Plan, rank: int, device: torch.device, optimizer: Any, *,
                 master_dtype: torch.dtype | None = None, loss_scale: Any = None, feedback_numel: list | None = None):
        self.plan, self.rank, self.device, self.optimizer = plan, rank, device, optimizer
        self.master_dtype, self.loss_scale = master_dtype, loss_scale
        self.feedback_numel = feedback_numel if feedback_numel and any(feedback_numel) else None
        self.pending = None  # an async save in flight (hpf.checkpoint.SaveHandle)
        self.unused = False  # whether the last new state's pages wait for first_use

    def new_state(self, shards: list[torch.Tensor]) -> TrainState:
        """A train state over ``shards``: fresh optimizer state, loss scale and error-feedback residuals."""
        feedback = self.feedback_numel and [zeros((n,), torch.float32, self.device) for n in self.feedback_numel]
        self.unused = True  # (its zero buffers are fresh pages until the step first uses it: first_use)
        return TrainState(shards, self.optimizer.init(shards), self.loss_scale.init() if self.loss_scale else None,
                          feedback)

    def first_use(self, state: TrainState, grads: list[torch.Tensor]) -> None:
        """Before a step first uses a new state: its optimizer state's and the grads' fresh pages
        (train_state.zeros) faulted in at once (train_state.populate says why)."""
        if self.unused:
            populate([*grads, *tree_util.flatten(state.opt_state)[1], *(state.error_feedback or ())])
            self.unused = False

    def fresh(self) -> TrainState:
        """A zero train state of the plan's layout (what ``restore`` loads into)."""
        return self.new_state([zeros((b.shard_numel,), self.master_dtype or b.dtype, self.device) for b in self.plan.buckets])

    def layout(self):
        """What a checkpoint reads of this step (:class:`hpf.checkpoint.Layout`)."""
        from .checkpoint import Layout

        return Layout(self.plan, self.rank, self.optimizer)

    def save(self, state: TrainState, path, extra: Any = None, **options):
        """Write a DCP checkpoint of ``state`` to ``path`` (options: hpf.checkpoint.save's)."""
        from . import checkpoint

        self.wait_save()
        self.pending = checkpoint.save(self.layout(), state, path, extra, **options)
        return self.pending

    def wait_save(self):
        """Block until an async save is published; re-raises its error. Returns its path or None."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def restore(self, path, state: TrainState | None = None, *, strict: bool = True) -> tuple[TrainState, Any]:
        """``(state, extra)`` from the checkpoint at ``path``, whatever mesh saved it; or, where ``path``
        has ``fill(layout, state)`` (hpf.elastic's state held in the ranks' memory), from that source."""
        from . import checkpoint

        self.wait_save()
        if callable(getattr(path, "fill", None)):
            return path.fill(self.layout(), self.fresh() if state is None else state), None
        return checkpoint.restore(self.layout(), path, self.fresh() if state is None else state, strict=strict)

    def full_params(self, state: TrainState, rank: int | None = None) -> Any:
        """The gathered full params, as a plain pytree of fresh tensors (see ShardStep.full_params)."""
        schedule.rendezvous("step.full_params")
        plan = self.plan
        local = {}
        for b, shard in zip(plan.buckets, state.params):
            ranks = plan.shard_ranks(b, self.rank)  # entry i holds shard position i
            full = shard
            if len(ranks) > 1:
                by_rank = dict(zip(sorted(ranks), world.all_gather_list(shard, plan.mesh.group(b.shard_axes))))
                full = torch.cat([by_rank[r] for r in ranks])
            local.update(plan.views(b, full))
        tree = plan.tree({p: _gather_compute_axes(plan, p, x).clone() for p, x in local.items()})
        return tree if rank is None or rank == self.rank else None


def _gather_compute_axes(plan: Plan, path: str, local: torch.Tensor) -> torch.Tensor:
    """Undo the non-FSDP splits of one param: all-gather along each split dim."""
    slot = plan.slots[path]
    out = local
    for dim in range(len(slot.spec)):
        axes = plan.split_dim_axes(slot, dim)
        if axes and plan.mesh.axis_size(axes) > 1:  # (size 1: nothing to gather, maybe no process group)
            n, stored = plan.mesh.axis_size(axes), out.shape[dim]
            out = gather_dim0(out.movedim(dim, 0), plan.mesh.group(axes), n).movedim(0, dim)
            sizes = plan.block_sizes(path, dim)
            if any(k != stored for k in sizes):  # an uneven split: each block without its padding
                out = torch.cat([b.narrow(dim, 0, k) for b, k in zip(out.split(stored, dim), sizes)], dim)
    return out
