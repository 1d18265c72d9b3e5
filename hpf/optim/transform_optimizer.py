"""A transform as an hpf optimizer (``TransformOptimizer``, ``as_optimizer``): it keeps the step
count, evaluates the schedules, resolves paths and plans, and declares its capabilities as data."""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any, Callable

import optree
import torch

from .base import Capabilities
from .stage import Hyper, Transform, run

__all__ = ["state_type", "TransformOptimizer", "as_optimizer", "Staged"]


@lru_cache(maxsize=None)
def state_type(fields: tuple[str, ...]) -> type:
    """The NamedTuple a transform's optimizer state is: ``count`` and one entry per field (one
    class per field set, so states of equal transforms compare and checkpoint alike)."""
    return namedtuple("TransformState", ("count",) + fields)


@dataclass(frozen=True)
class TransformOptimizer:
    """A transform as an hpf optimizer (``init(params)``, ``update(grads, state, params)``): it
    keeps the step count, checks the step's hyper-parameters before changing anything, resolves
    what depends on the params' paths, and declares its capabilities as data. ``state``: the
    NamedTuple class of its state (count first, then the fields; default ``state_type``)."""

    transform: Transform
    state: Any = None
    frozen: tuple | None = field(default=None, repr=False, compare=False)  # per flat shard: not trained

    @cached_property  # (the step reads them each step; the transform does not change)
    def capabilities(self) -> Capabilities:
        """Partial updates when elementwise; set up per plan; its clip's max norm (the decision
        takes the global norm and reads the clip's factor); the aux its stages read; its stages."""
        t = self.transform
        return Capabilities(partial=t.elementwise, for_plan=True, max_grad_norm=t.max_grad_norm, aux=t.aux,
                            outline=t.outline())

    def for_plan(self, plan, rank: int) -> "TransformOptimizer":
        """On ``plan``'s flat shards: stages resolved for the layout; frozen buckets get no state and no update."""
        frozen = tuple(b.frozen for b in plan.buckets)
        return replace(self, transform=self.transform.for_plan(plan, rank), frozen=frozen if any(frozen) else None)

    def init(self, params: Any):
        leaves, treedef = optree.tree_flatten(params)
        if self.frozen is not None:
            live = [p for p, f in zip(leaves, self.frozen) if not f]
            fields = self.transform.init(live)
            it = {k: iter(v) for k, v in fields.items()}
            fields = {k: [p[:0].clone() if f else next(it[k]) for p, f in zip(leaves, self.frozen)] for k in fields}
        else:
            fields = self.transform.for_params(params).init(leaves)
        cls = self.state or state_type(tuple(fields))
        return cls(torch.zeros((), dtype=torch.int64), *(treedef.unflatten(v) for v in fields.values()))

    def update(self, grads: Any, state, params: Any, aux: dict | None = None) -> tuple[Any, Any]:
        """Returns (params, state), both updated in place (donated, as with
        ``jax.jit(donate_argnums=...)``): do not reuse the inputs. ``aux``: the step's aux, for the
        stages that read it (``capabilities.aux``; hpf.shard_step passes it)."""
        g = optree.tree_leaves(grads)
        self.partial_update(state, params, aux)(range(len(g)), g)
        return params, state

    def partial_update(self, state, params: Any, aux: dict | None = None) -> Callable[[list[int], list], None]:
        """Start one step whose update is applied a few leaves at a time: returns ``apply(indices,
        grads)``, which updates the leaves at ``indices`` from ``grads[i]``. For an elementwise
        transform any split gives exactly one ``update``'s result (the count moves on once, here)."""
        p = optree.tree_leaves(params)
        fields = {k: optree.tree_leaves(v) for k, v in state._asdict().items() if k != "count"}
        transform = self.transform.for_params(params)
        hyper = Hyper(int(state.count) + 1, aux=aux)
        transform.check(hyper)  # a bad lr raises before anything changes
        state.count.add_(1)

        def apply(indices: list[int], grads: list) -> None:
            indices = list(indices)
            if self.frozen is not None:
                indices = [i for i in indices if not self.frozen[i]]
            whole = len(indices) == len(p)
            pick = lambda xs: xs if whole else [xs[i] for i in indices]  # noqa: E731
            run(transform if whole else transform.take(indices), pick(grads), {k: pick(v) for k, v in fields.items()},
                pick(p), hyper)
        return apply


def as_optimizer(transform: Transform) -> TransformOptimizer:
    """``transform`` as an optimizer that ``hpf.shard_step`` (or a plain loop) runs."""
    if not isinstance(transform, Transform):
        raise TypeError(f"as_optimizer: {transform!r} is not a transform (hpf.optim.transforms.Transform)")
    return TransformOptimizer(transform)


class Staged:
    """An optimizer whose math is its stages (``transform``), as AdamW and Muon are: it runs as a
    :class:`TransformOptimizer` with its state class ``State``, on any pytree in one process, and
    declares what that declares. Subclasses give ``transform`` (and their plan form, ``for_plan``)."""

    State: Any = None  # the NamedTuple class of its state (count, then the fields)

    @property
    def transform(self) -> Transform:
        raise NotImplementedError

    @property
    def optimizer(self) -> TransformOptimizer:
        """What runs it: the transform as an optimizer with ``State``."""
        return TransformOptimizer(self.transform, self.State)

    @property
    def capabilities(self) -> Capabilities:
        return self.optimizer.capabilities

    def init(self, params: Any):
        return self.optimizer.init(params)

    def update(self, grads: Any, state, params: Any, aux: dict | None = None) -> tuple[Any, Any]:
        """Returns (new params, new state), updated in place (donated, as with
        ``jax.jit(donate_argnums=...)``): do not reuse the inputs. ``aux``: the step's aux, read
        only by stages that declare it (QK-Clip)."""
        return self.optimizer.update(grads, state, params, aux)
