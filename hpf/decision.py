"""The step's one global decision: a single all-reduce, and what every rank concludes from it.

After a step's reductions land, each rank sends its loss sum, its count (micro-batches, or the
terms of ``hpf.weighted``), whether its loss was finite, its grads' squared norm, the digest of
its schedule (hpf.comm.schedule) and of its batch shapes, and its aux tensors. The sums are the
same on every rank, so every rank decides alike, before any update: the loss and grad norm,
the clip stage's factor of that norm (read from the stage, hpf.optim.stages.ClipByGlobalNorm),
the factor that turns summed grads into the update's (the normalizer and the loss scale, and
the clip's factor as the stage gives it: one multiply of the grads), whether the step is
finite, and whether the ranks agreed on their reads and batches.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import batching, losses
from .errors import UnevenBatchError
from .comm import schedule, world
from .comm.canonical import exact_parts, exact_square_sum, exact_total, tree_sum
from .comm.schedule import LOG
from .optim.stages import ClipByGlobalNorm, clip_by_global_norm
from .trace import span

__all__ = ["Decision", "Decider"]

# The all-reduced vector: the 4 sums [loss, count, non-finite, squared grad norm], the digest of the
# schedule log, the digest of the batch shapes (schedule.digest_parts each), then the aux tensors.
_LOG = slice(4, 4 + schedule.DIGEST_LEN)
_SHAPES = slice(_LOG.stop, _LOG.stop + schedule.DIGEST_LEN)


@dataclass
class Decision:
    """What the step's all-reduce decided, the same on every rank."""

    loss: float
    grad_norm: float
    grad_scale: float  # multiplies the summed grads: 1 / normalizer (and / loss scale), and the clip's factor
    finite: bool
    aux: dict | None
    waited_s: float = 0.0  # blocked in the all-reduce
    count: float | None = None  # hpf.weighted's global count (None: a plain mean); 0 makes the loss nan
    clip: float = 1.0  # the clip stage's factor of grad_norm (1: no clip stage, or it did not act)


@dataclass(frozen=True)
class Decider:
    """A plan's fixed facts the decision needs (made once, by the step's ``init``).

    Args:
        world: ranks in the mesh; dp_size: ranks of one replica's data parallelism (FSDP axes);
        n_compute: ranks that compute one replica's loss together (non-FSDP axes);
        replicas: per piece, how many ranks hold it (counted once in the norm); pieces: (bucket,
            slice of this rank's grad shard, None: all of it), its runs of params of one replica count;
        clip: clipping by the global grad norm, the stage (hpf.optim.stages.ClipByGlobalNorm) whose
            factor the decision reads and whose ``grad_scale`` it takes (None: no clipping).
        dp_index: the invariant mode (None: off): this rank's index over the FSDP axes, whose
            atoms' losses it places in the canonical sum; the grad norm is summed exactly, each
            bucket's shard counted on one of its replicas (``counted``: whether this rank's is).
    """

    world: int
    dp_size: int
    n_compute: int
    replicas: torch.Tensor
    clip: ClipByGlobalNorm | None
    pieces: tuple[tuple[int, slice | None], ...] = ()
    dp_index: int | None = None
    counted: tuple[bool, ...] = ()

    @classmethod
    def of(cls, plan, world: int, max_grad_norm: float | None, rank: int, invariant: bool = False) -> "Decider":
        """The decider of a step over ``plan`` on ``world`` ranks, on ``rank`` (``max_grad_norm``: the
        clip; ``invariant``: the invariant mode). A bucket mixing params replicated over tp with tp-split
        ones counts each run of its shard with its own replicas."""
        pieces, replicas = [], []
        for b in plan.buckets:
            runs = b.runs(plan.shard_index(b, rank), plan.replicas)
            pieces += [(b.index, part if len(runs) > 1 else None) for part, _ in runs]
            replicas += [float(n) for _, n in runs]
        extra = {}
        if invariant:
            mesh = plan.mesh
            extra = dict(dp_index=mesh.group_index(plan.fsdp_axes, rank),
                         counted=tuple(not b.replicate_axes or mesh.group_index(b.replicate_axes, rank) == 0
                                       for b in plan.buckets))
        return cls(world, plan.dp_size, plan.compute_size, torch.tensor(replicas, dtype=torch.float64),
                   None if max_grad_norm is None else clip_by_global_norm(max_grad_norm), tuple(pieces), **extra)

    def normalizer(self, n_micro: int, count: float | None = None) -> float:
        """What the summed grads are divided by: the global count of an hpf.weighted loss (each
        replica along non-FSDP axes repeats it), else the data-parallel micro-batches."""
        return count / self.n_compute if count is not None else float(self.dp_size * n_micro)

    def unclipped_scale(self, n_micro: int, scale: float, count: float | None = None) -> float:
        """``decide``'s grad_scale when the clip does not fire, known before it (the same code:
        the early optimizer work compares the two floats). ``count``: hpf.weighted's global count."""
        return _grad_scale(self.normalizer(n_micro, count), scale)

    def decide(self, outs: list[losses.LossOut], grads: list[torch.Tensor], batch: Any, scale: float = 1.0,
               clip: bool = True) -> Decision:
        """``scale``: what backward's seed multiplied the losses by (beyond 1 / n_compute)."""
        weighted = outs[0].count is not None
        if any((o.count is not None) != weighted for o in outs):
            raise TypeError("loss_fn returned hpf.weighted(sum, count) for some micro-batches and a plain loss for "
                            "others; return one form every time")
        values = torch.stack([o.value.detach().to(torch.float64).cpu() for o in outs])
        count = sum(float(o.count) for o in outs) if weighted else float(len(outs))
        invariant = self._invariant_parts(values, grads) if self.dp_index is not None else None
        sq = 0.0 if invariant else float(
            (torch.stack(torch._foreach_norm([grads[b] if part is None else grads[b][part] for b, part in self.pieces]))
             .to(torch.float64).cpu().square() / self.replicas).sum())
        aux = _local_aux(outs)
        shape = 0 if weighted else batching.shape_signature(batch)
        bad = not bool(torch.isfinite(values).all()) or bool(invariant and not math.isfinite(invariant[0]))
        local = [float(values.sum()), count, float(bad), sq,
                 *schedule.digest_parts(LOG.digest()), *schedule.digest_parts(shape)]
        summed = {k: v for k, v in (aux or {}).items() if not k.startswith(losses.MAX_AUX)}
        totals = torch.cat([torch.tensor(local, dtype=torch.float64)]
                           + [v.detach().to(torch.float64).cpu().reshape(-1) for v in summed.values()]
                           + ([invariant[1]] if invariant else []))
        waited = 0.0
        if world.is_distributed() and self.world > 1:
            with span("hpf/all-reduce the step's totals"):
                LOG.record("all-reduce", "the step's totals")
                t = time.perf_counter()
                schedule.wait(world.all_reduce_async(totals), "the step's all-reduce")
                waited = time.perf_counter() - t
        tv = totals.tolist()
        if invariant:  # the loss sum in the canonical tree over atoms, the squares' exact sum
            top, tail = invariant[0], tv[len(tv) - len(invariant[1]):]
            tv = tv[:len(tv) - len(tail)]
            n = len(tail) - _EXACT
            tv[0] = tree_sum(dict(((i, 1), v) for i, v in enumerate(tail[_EXACT:])), n, lambda a, b: a + b)
            tv[3] = exact_total(tail[:_EXACT], top) if math.isfinite(top) else math.nan
        schedule.check_digests(schedule.parts_agree(tv[_LOG], self.world))
        if not weighted and not schedule.parts_agree(tv[_SHAPES], self.world):
            raise UnevenBatchError(
                "local batches differ in shape across ranks, and the loss is a plain mean: the step's loss is the "
                "mean of the ranks' means, which is the global mean only for equal local batches. Split the global "
                "batch evenly, or return hpf.weighted(sum, count) from loss_fn (the step then divides by the global "
                "count)")
        normalizer = self.normalizer(len(outs), tv[1] if weighted else None)
        loss = (tv[0] / tv[1] if tv[1] else math.nan) if weighted else tv[0] / (self.world * len(outs))
        grad_norm = math.sqrt(tv[3]) / (normalizer * scale) if normalizer else 0.0
        finite = not tv[2] and math.isfinite(grad_norm) and math.isfinite(loss)
        coef = self.clip.factor(grad_norm) if clip and finite and self.clip is not None else 1.0
        out_aux = None
        if aux is not None:
            flat = torch.tensor(tv[_SHAPES.stop:], dtype=torch.float64)
            out_aux = {k: x.view(v.shape).to(v.dtype) for (k, v), x in
                       zip(summed.items(), torch.split(flat, [v.numel() for v in summed.values()]))}
            out_aux.update(_max_aux({k: v for k, v in aux.items() if k not in summed}, self.world))
        grad_scale = _grad_scale(normalizer, scale) if coef == 1.0 else self.clip.grad_scale(normalizer * scale, coef)
        return Decision(loss, grad_norm, grad_scale, finite, out_aux, waited, tv[1] if weighted else None, coef)


    def _invariant_parts(self, values: torch.Tensor, grads: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
        """The invariant mode's part of the step's all-reduce: the exact sum of squares (over the
        shards this rank counts) and each atom's loss at its place among all ``dp_size * k``, 0
        elsewhere (adding zeros is exact). First the largest square over the ranks, which fixes
        the exact sum's scale: one small all-reduce."""
        counted = [g for g, mine in zip(grads, self.counted) if mine]
        maxima = [g.detach().abs().max().to(torch.float64).cpu() for g in counted if g.numel()]
        top = (torch.stack(maxima).max() if maxima else torch.zeros((), dtype=torch.float64)).square().reshape(1)
        mine = float(top[0])
        if world.is_distributed() and self.world > 1:
            LOG.record("all-reduce", "the largest square of the grads")
            schedule.wait(world.all_reduce_async(top, op="max"), "the grads' largest square")
        top = float(top[0]) if math.isfinite(mine) else math.nan  # (this rank's non-finite grads: counted as such)
        k = len(values)
        losses_at = torch.zeros(self.dp_size * k, dtype=torch.float64)
        losses_at[self.dp_index * k:(self.dp_index + 1) * k] = values
        exact = exact_parts(exact_square_sum(counted, top)) if math.isfinite(top) else [0.0] * _EXACT
        return top, torch.cat([torch.tensor(exact, dtype=torch.float64), losses_at])


#: entries of the exact sum of squares in the all-reduce (hpf.comm.canonical.exact_parts)
_EXACT = 6


def _grad_scale(normalizer: float, scale: float) -> float:
    """The factor that turns summed grads into the update's when nothing clips: one over the
    normalizer and the loss scale (0 when nothing was counted)."""
    return 1.0 / (normalizer * scale) if normalizer else 0.0


def _local_aux(outs: list[losses.LossOut]) -> dict | None:
    """The micro-batches' aux dicts, key by key: summed (e.g. tokens per expert), or for names
    starting with ``max_`` their maximum (e.g. attention logits)."""
    if outs[0].aux is None:
        return None
    return {k: (torch.stack([o.aux[k] for o in outs]).amax(0) if k.startswith(losses.MAX_AUX)
                else sum((o.aux[k] for o in outs[1:]), outs[0].aux[k])) for k in outs[0].aux}


def _max_aux(aux: dict, n_ranks: int) -> dict:
    """The ``max_`` aux over every rank: one all-reduce of their maxima, only when there are any
    (after the step's totals, whose digests say every rank issued the same collectives)."""
    if not aux:
        return {}
    flat = torch.cat([v.detach().to(torch.float64).cpu().reshape(-1) for v in aux.values()])
    if world.is_distributed() and n_ranks > 1:
        LOG.record("all-reduce", "the step's max aux")
        world.all_reduce(flat, op="max")
    return {k: x.view(v.shape).to(v.dtype)
            for (k, v), x in zip(aux.items(), torch.split(flat, [v.numel() for v in aux.values()]))}
