"""Collective I/O of a step's train state: checkpoints (hpf.checkpoint) and the full params.

``StateIO`` is the part of :class:`hpf.ShardStep` that moves a whole state in or out; every
rank calls each method (a rank that skips one makes the others raise ScheduleMismatchError).
"""
from __future__ import annotations

from typing import Any

import torch

from .comm import schedule, world
from .comm.collectives import gather_dim0
from .planning import Plan
from .types import TrainState

__all__ = ["StateIO"]


class StateIO:
    """Checkpoints and full params of a :class:`hpf.ShardStep`'s state (its base class)."""

    def fresh_state(self) -> TrainState:
        """A zero train state of this plan's layout (what ``restore`` loads into)."""
        master = self.mp.master_dtype if self.mp else None
        shards = [torch.zeros(b.shard_numel, dtype=master or b.dtype, device=self.device) for b in self.plan.buckets]
        scale = self.config.loss_scale
        return TrainState(shards, self.plan_optimizer.init(shards), scale.init() if scale else None,
                          self.fresh_feedback())

    def fresh_feedback(self) -> list[torch.Tensor] | None:
        """Zero error-feedback residuals, one per bucket (empty where none crosses the slow tier);
        None when the step's slow tier keeps none."""
        lowbit = self.engine.comm.lowbit if self.engine else None
        numel = lowbit.feedback_numel if lowbit else None
        if not numel or not any(numel):
            return None
        return [torch.zeros(n, dtype=torch.float32, device=self.device) for n in numel]

    def layout(self):
        """What a checkpoint reads of this step (:class:`hpf.checkpoint.Layout`)."""
        from .checkpoint import Layout

        return Layout(self.plan, self.rank, self.plan_optimizer)

    def save(self, state: TrainState, path, extra: Any = None, *, keep_last: int | None = None,
             async_save: bool = False, meta: dict | None = None):
        """Collective: write a DCP checkpoint of ``state`` to ``path`` (see hpf.checkpoint.save)."""
        from . import checkpoint

        self._check_live(state, "step.save(state, path)")
        self.wait_save()
        self._pending_save = checkpoint.save(self.layout(), state, path, extra, keep_last=keep_last,
                                             async_save=async_save, meta=meta)
        return self._pending_save

    def wait_save(self):
        """Block until an async save is published; re-raises its error. Returns its path or None."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def restore(self, path, state: TrainState | None = None, *, strict: bool = True) -> tuple[TrainState, Any]:
        """Collective: ``(state, extra)`` from the checkpoint at ``path``, whatever mesh saved it
        (``strict``: see hpf.checkpoint.restore)."""
        from . import checkpoint

        self._check_open("step.restore(path)")
        if self.plan is None:
            raise RuntimeError("call step.init(params) first (meta params are fine), then step.restore(path)")
        self.wait_save()
        state, extra = checkpoint.restore(self.layout(), path, self.fresh_state() if state is None else state,
                                          strict=strict)
        self._donation.unloaded = False
        return self._donation.donate(state), extra

    def full_params(self, state: TrainState, rank: int | None = None) -> Any:
        """The gathered full params, as a plain pytree of fresh tensors.

        A collective: every rank must call it (a rank that skips it makes the others raise
        ScheduleMismatchError). ``rank=None`` returns the tree on every rank; ``rank=r`` returns it
        on rank r and None elsewhere (every rank still calls). One-off (checkpoints,
        evaluation): it uses plain all-gathers, not the step's transports."""
        self._check_live(state, "full_params(state)")
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
            out = gather_dim0(out.movedim(dim, 0), plan.mesh.group(axes), plan.mesh.axis_size(axes)).movedim(0, dim)
    return out
