"""Optimizers as composable transforms, as optax composes its ``GradientTransformation`` objects.

Every stage and every combinator has one shape (:class:`Transform`): ``init(params) -> state``
and ``update(grads, state, params, hyper) -> (updates, state)``. ``params`` and ``grads`` are
lists of tensors (a pytree's leaves, or the step's flat shards); ``state`` maps each field the
transform declares (``fields``: "exp_avg", ...) to one tensor per leaf, so a chain's state is
its stages' fields side by side and a checkpoint names them as before. hpf donates its buffers,
so a stage updates its state and, where optax would return an update to add, writes the params
in place (the same fused foreach ops as ``torch.optim.AdamW``, hence bit for bit its result);
``updates`` are what the next stage reads as its grads (a clip scales them).

- ``hyper`` (:class:`Hyper`) is one step's hyper-parameters: the step and the learning rate.
  ``inject_hyperparams(t, lr=schedule)`` sets the lr ``t`` sees from the step (optax's
  ``inject_hyperparams``); an inner one overrides an outer one for its part. A stage's own
  fields are injected the same way (``weight_decay=schedule`` into ``add_decayed_weights``).
- ``chain(*stages)`` applies stages in order; ``partition(transforms, labels)`` gives each
  param to the transform its label names (optax's ``multi_transform``): Muon's matrices to
  ``scale_by_muon``, the rest to AdamW's chain. On a plan's flat shards a partition of
  elementwise transforms runs each on the pieces of its params (``PlannedPartition``).
- :class:`TransformOptimizer` (``as_optimizer``) is a transform as an hpf optimizer: it keeps the
  step count, evaluates the schedules, and declares its capabilities as data. ``hpf.shard_step``
  wraps a transform passed as ``optimizer=`` in it.
- Clipping by the global grad norm (``clip_by_global_norm``) is a stage, but under a plan the
  norm is the step's (one all-reduce, hpf.decision): the stage declares ``max_grad_norm``, the
  step folds its factor into the one scale that turns summed grads into the update's (one
  multiply, not two roundings), and the stage's plan form passes grads through.
- What needs the plan's layout, a stage resolves in ``for_plan(plan, rank)`` (a decay mask
  becomes element ranges per shard); what needs the params' paths, in ``for_params(params)``.
  An ``elementwise`` transform's ``take(indices)`` runs a subset of the leaves alone (the
  step's partial update).
"""
from __future__ import annotations

import math
from collections import namedtuple
import dataclasses
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, NamedTuple

import optree
import torch

from .. import tree as tree_util
from .base import Capabilities
from .lr_schedules import check_rate

__all__ = ["Hyper", "inject", "Transform", "chain", "partition", "inject_hyperparams", "as_optimizer",
           "add_decayed_weights", "scale_by_adam", "clip_by_global_norm", "Chain", "Partition",
           "InjectHyperparams", "PlannedPartition", "TransformOptimizer", "AddDecayedWeights", "ScaleByAdam", "ClipByGlobalNorm",
           "meta_params", "run", "state_type"]


class Hyper(NamedTuple):
    """One step's hyper-parameters, as every stage of a chain sees them (lr None: none injected)."""

    step: int  # 1-based
    lr: float | None = None

    def rate(self, stage: str) -> float:
        """The lr, or an error naming the stage that needs one and the fix."""
        if self.lr is None:
            raise ValueError(f"{stage} needs a learning rate, and none was injected: wrap the transform in "
                             f"hpf.optim.transforms.inject_hyperparams(..., lr=1e-3) (a number or a schedule)")
        return self.lr


def inject(lr: float | Callable[[int], float], step: int, what: str = "lr") -> Hyper:
    """The hyper-parameters of ``step``: ``lr`` a constant or a schedule of the step (ValueError,
    naming the step, unless its value is finite and >= 0)."""
    return Hyper(step, check_rate(lr(step), f"{what} schedule", step) if callable(lr) else check_rate(lr, what))


class Transform:
    """The one shape every stage and combinator shares (see the module doc); the defaults are
    those of an elementwise stage with no state, no plan form and no path-dependent part."""

    fields: tuple[str, ...] = ()
    #: any subset of the leaves updated alone (``take``) gives that subset's part of one update
    elementwise: bool = True

    def init(self, params: Any) -> dict[str, list[torch.Tensor]]:
        """Zeros shaped like each leaf, per field."""
        leaves = _leaves(params)
        return {f: [torch.zeros_like(p) for p in leaves] for f in self.fields}

    def update(self, grads: list, state: dict, params: list, hyper: Hyper) -> tuple[list, dict]:
        """One step: update ``state`` (its ``fields``) and ``params`` in place, and return (the
        updates the next stage reads as its grads, the state)."""
        raise NotImplementedError

    @property
    def max_grad_norm(self) -> float | None:
        """The max global grad norm of a clip stage in it (None: none)."""
        return None

    def check(self, hyper: Hyper) -> None:
        """Raise before a step changes anything if a hyper-parameter of ``hyper``'s step is bad."""

    def for_plan(self, plan, rank: int) -> "Transform":
        """This transform on ``plan``'s flat shards as ``rank`` holds them. One that is not
        elementwise, and has no plan form of its own, is refused: a shard's leaves are flat
        pieces that mix params, each rank's its own part, so a per-param norm would be of pieces."""
        if not self.elementwise:
            raise ValueError(f"{self.structure()} declares elementwise=False (it needs each param whole: a norm, a "
                             "trust ratio, a matrix function), and under hpf.shard_step a rank holds flat pieces that "
                             "mix params; write it elementwise, give it a for_plan of its own that gathers whole "
                             "params (as hpf.optim.muon's DistMuon gives each matrix to its owner), or run it on full "
                             "params outside hpf.shard_step")
        return self

    def for_params(self, params: Any) -> "Transform":
        """What depends on the params' paths (a mask, labels) resolved against the pytree ``params``."""
        return self

    def take(self, indices: list[int]) -> "Transform":
        """This transform on the leaves at ``indices`` alone (an elementwise one's part of an update)."""
        return self

    def structure(self) -> str:
        """What this transform is, stage by stage, without hyper-parameter values (a resumed run
        may change its lr): a checkpoint records it and refuses to restore into another."""
        return type(self).__name__


def meta_params(plan) -> Any:
    """The full params of ``plan`` as meta tensors (shapes, dtypes and paths only), for masks and labels."""
    return plan.tree({p: torch.empty(s.global_shape, dtype=s.dtype, device="meta") for p, s in plan.slots.items()})


def _leaves(params: Any) -> list:
    return params if isinstance(params, list) else optree.tree_leaves(params)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def run(transform: Transform, grads: list, state: dict, params: list, hyper: Hyper) -> list:
    """``transform.update``, or nothing for no leaves (foreach ops want some). Returns the updates."""
    return transform.update(grads, state, params, hyper)[0] if params else []


@dataclass(frozen=True)
class AddDecayedWeights(Transform):
    """Decoupled weight decay: ``params *= 1 - lr * weight_decay`` on the params its ``mask``
    picks: None, every param; ``mask(path, tensor) -> bool``; or a pytree of bools shaped like
    the params. Resolved (``for_params``, ``for_plan``) it is ``ranges``: per leaf, the index
    objects of its elements that decay (``...``: all; per flat shard, the decaying params' ranges)."""

    weight_decay: float
    mask: Any = None
    ranges: tuple | None = field(default=None, repr=False, compare=False)

    def for_plan(self, plan, rank: int) -> "AddDecayedWeights":
        if self.mask is None:
            return self
        decays = self.by_path(meta_params(plan))
        shards = []
        for b in plan.buckets:
            pieces = [b.local_piece(s, plan.shard_index(b, rank)) for s in b.slots if decays[s.path]]
            shards.append(tuple(p.held for p in pieces if p.numel))
        return replace(self, ranges=tuple(shards))

    def for_params(self, params: Any) -> "AddDecayedWeights":
        if self.mask is None or self.ranges is not None:  # (a weight_decay of 0 may be injected as another)
            return self
        return replace(self, ranges=tuple((...,) if d else () for d in self.by_path(params).values()))

    def check(self, hyper: Hyper) -> None:
        if self.weight_decay and self.ranges is None and self.mask is not None:
            raise ValueError("add_decayed_weights(mask=...) needs the params' paths: resolve it with "
                             "for_params(params) (hpf.optim.as_optimizer does) or for_plan(plan, rank)")

    def take(self, indices: list[int]) -> "AddDecayedWeights":
        return self if self.ranges is None else replace(self, ranges=tuple(self.ranges[i] for i in indices))

    def by_path(self, params: Any) -> dict[str, bool]:
        """Param path -> whether it decays."""
        paths, leaves, treedef = tree_util.flatten(params)
        if callable(self.mask):
            return {p: bool(self.mask(p, x)) for p, x in zip(paths, leaves)}
        if tree_util.structure(self.mask) != treedef:
            raise ValueError(f"weight_decay_mask must be a callable(path, tensor) or a pytree of bools shaped "
                             f"like the params; got {tree_util.structure(self.mask)}, params are {treedef}")
        return dict(zip(paths, (bool(m) for m in tree_util.flatten(self.mask)[1])))

    def update(self, grads, state, params, hyper):
        if self.weight_decay:
            self.check(hyper)
            decay = params if self.ranges is None else [p[s] for p, slices in zip(params, self.ranges) for s in slices]
            if decay:
                torch._foreach_mul_(decay, 1.0 - hyper.rate("add_decayed_weights") * self.weight_decay)
        return grads, state


@dataclass(frozen=True)
class ScaleByAdam(Transform):
    """Adam's step with bias correction, eps after the square root, into the params (``lr``)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fields = ("exp_avg", "exp_avg_sq")

    def update(self, grads, state, params, hyper):
        """Complex leaves step as their real views, as torch's AdamW (``g*g`` of a complex ``g`` is not ``|g|^2``)."""
        g, p, m, v = (list(map(_real, x)) for x in (grads, params, state["exp_avg"], state["exp_avg_sq"]))
        b1, b2 = self.betas
        lr = hyper.rate("scale_by_adam")
        torch._foreach_lerp_(m, g, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1.0 - b2)
        bias1 = 1.0 - b1 ** hyper.step
        bias2_sqrt = math.sqrt(1.0 - b2 ** hyper.step)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(p, m, denom, -lr / bias1)
        return grads, state


@dataclass(frozen=True)
class ClipByGlobalNorm(Transform):
    """Scale the grads so that their global norm is at most ``max_norm``. Alone, it takes the
    norm of the grads it is given; on a plan (``folded``) the step folds ``factor`` of the global
    norm into its grad scale and the stage passes grads through (see the module doc)."""

    max_norm: float
    folded: bool = False

    @property
    def elementwise(self) -> bool:  # the norm is of all leaves, unless the step took it
        return self.folded

    @property
    def max_grad_norm(self) -> float:
        return self.max_norm

    def factor(self, grad_norm: float) -> float:
        """What the grads are multiplied by, for a global norm of ``grad_norm``."""
        return min(1.0, self.max_norm / (grad_norm + 1e-6))

    def for_plan(self, plan, rank: int) -> "ClipByGlobalNorm":
        return replace(self, folded=True)

    def update(self, grads, state, params, hyper):
        if self.folded or not grads:
            return grads, state
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()))
        return list(torch._foreach_mul(grads, self.factor(norm))), state


@dataclass(frozen=True)
class Chain(Transform):
    """Stages applied in order to the same params and state; each reads the updates of the last."""

    stages: tuple

    def __post_init__(self):
        seen: dict[str, Any] = {}
        for s in self.stages:
            if not isinstance(s, Transform):
                raise TypeError(f"chain: {s!r} is not a transform (hpf.optim.transforms.Transform)")
            for f in s.fields:
                if f in seen:
                    raise ValueError(f"chain: {type(seen[f]).__name__} and {type(s).__name__} both keep state "
                                     f"{f!r}; a chain holds one of each field")
                seen[f] = s
        if sum(s.max_grad_norm is not None for s in self.stages) > 1:
            raise ValueError("chain: more than one clip_by_global_norm; keep one")

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for s in self.stages for f in s.fields)

    @property
    def elementwise(self) -> bool:
        return all(s.elementwise for s in self.stages)

    @property
    def max_grad_norm(self) -> float | None:
        return next((s.max_grad_norm for s in self.stages if s.max_grad_norm is not None), None)

    def init(self, params):
        return {k: v for s in self.stages for k, v in s.init(params).items()}

    def update(self, grads, state, params, hyper):
        for s in self.stages:
            grads = s.update(grads, {f: state[f] for f in s.fields}, params, hyper)[0]
        return grads, state

    def check(self, hyper):
        for s in self.stages:
            s.check(hyper)

    def for_plan(self, plan, rank):
        return replace(self, stages=tuple(s.for_plan(plan, rank) for s in self.stages))

    def for_params(self, params):
        return replace(self, stages=tuple(s.for_params(params) for s in self.stages))

    def take(self, indices):
        return replace(self, stages=tuple(s.take(indices) for s in self.stages))

    def structure(self):
        return f"chain({', '.join(s.structure() for s in self.stages)})"


@dataclass(frozen=True)
class InjectHyperparams(Transform):
    """``inner`` with hyper-parameters set from the step, each a number or a schedule of the
    1-based step: ``lr``, the learning rate every stage inside reads (None: the outer one's;
    ``what`` names it in errors), and ``others``, (field, value) pairs of ``inner``'s own fields
    (e.g. ``add_decayed_weights``' ``weight_decay``), set on it for each step."""

    inner: Transform
    lr: float | Callable[[int], float] | None = None
    what: str = "lr"
    others: tuple = ()

    fields = property(lambda self: self.inner.fields)
    elementwise = property(lambda self: self.inner.elementwise)
    max_grad_norm = property(lambda self: self.inner.max_grad_norm)

    def at(self, hyper: Hyper) -> tuple[Transform, Hyper]:
        """The inner transform and the hyper-parameters it sees at ``hyper``'s step."""
        inner = self.inner
        if self.others:
            inner = replace(inner, **{k: check_rate(v(hyper.step), f"{k} schedule", hyper.step) if callable(v) else v
                                      for k, v in self.others})
        return inner, hyper if self.lr is None else inject(self.lr, hyper.step, self.what)

    def init(self, params):
        return self.inner.init(params)

    def update(self, grads, state, params, hyper):
        inner, hyper = self.at(hyper)
        return inner.update(grads, state, params, hyper)

    def check(self, hyper):
        inner, hyper = self.at(hyper)
        inner.check(hyper)

    def for_plan(self, plan, rank):
        return replace(self, inner=self.inner.for_plan(plan, rank))

    def for_params(self, params):
        return replace(self, inner=self.inner.for_params(params))

    def take(self, indices):
        return replace(self, inner=self.inner.take(indices))

    def structure(self):
        return f"inject_hyperparams({self.inner.structure()})"


@dataclass(frozen=True)
class Partition(Transform):
    """Each param to the transform its label names (optax's ``multi_transform``): ``labels`` is
    ``labels(path, tensor) -> label`` or a pytree of labels shaped like the params. The state
    holds every field of any transform, per leaf; a leaf's field its transform does not keep is
    an empty tensor. Resolved (``for_params``), ``leaf_labels`` holds each leaf's label."""

    transforms: dict
    labels: Any
    leaf_labels: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        clipped = [k for k, t in self.transforms.items() if t.max_grad_norm is not None]
        if clipped:
            raise ValueError(f"partition: {', '.join(map(repr, clipped))} clips by the global grad norm, which is "
                             "every param's: put clip_by_global_norm before the partition, chain(clip_by_global_norm(...), "
                             "partition(...))")

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for t in self.transforms.values() for f in t.fields))

    @property
    def elementwise(self) -> bool:
        return all(t.elementwise for t in self.transforms.values())

    def resolve(self, params: Any) -> tuple:
        """Each leaf's label; a label with no transform is an error naming the param."""
        paths, leaves, treedef = tree_util.flatten(params)
        if callable(self.labels):
            got = [self.labels(p, x) for p, x in zip(paths, leaves)]
        elif tree_util.structure(self.labels) == treedef:
            got = tree_util.flatten(self.labels)[1]
        else:
            raise ValueError(f"partition: labels must be a callable(path, tensor) or a pytree shaped like the params; "
                             f"got {tree_util.structure(self.labels)}, params are {treedef}")
        for p, label in zip(paths, got):
            if label not in self.transforms:
                raise ValueError(f"partition: param {p!r} is labelled {label!r}, which names no transform; "
                                 f"give one of {sorted(map(str, self.transforms))}")
        return tuple(got)

    def for_params(self, params):
        if self.leaf_labels is not None:
            return self
        return replace(self, leaf_labels=self.resolve(params),
                       transforms={k: t.for_params(params) for k, t in self.transforms.items()})

    def groups(self):
        """(transform restricted to its leaves, their indices) per label, in ``transforms``' order."""
        for label, t in self.transforms.items():
            idx = [i for i, x in enumerate(self.leaf_labels) if x == label]
            yield t.take(idx), idx

    def init(self, params):
        labels = self.leaf_labels or self.resolve(params)
        leaves = _leaves(params)
        return {f: [torch.zeros_like(p) if f in self.transforms[x].fields else p.new_empty(0)
                    for p, x in zip(leaves, labels)] for f in self.fields}

    def update(self, grads, state, params, hyper):
        if self.leaf_labels is None:
            raise ValueError("partition needs its labels resolved: for_params(params) (as_optimizer does it)")
        out = list(grads)
        for t, idx in self.groups():
            if idx:
                pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
                for i, u in zip(idx, t.update(pick(grads), {f: pick(state[f]) for f in t.fields}, pick(params),
                                              hyper)[0]):
                    out[i] = u
        return out, state

    def check(self, hyper):
        for t in self.transforms.values():
            t.check(hyper)

    def for_plan(self, plan, rank) -> "PlannedPartition":
        """On ``plan``'s flat shards: each label's transform runs on the pieces of its params this
        rank holds (every transform elementwise; one that is not needs whole params: refused)."""
        whole = [k for k, t in self.transforms.items() if not t.elementwise]
        if whole:
            raise ValueError(f"partition: {', '.join(map(repr, whole))} needs whole params (e.g. scale_by_muon's "
                             "Newton-Schulz), and on a plan's flat shards a rank holds pieces; for Muon use "
                             "hpf.optim.muon(...), whose plan form (hpf.optim.DistMuon) orthogonalizes each split matrix "
                             "once at its owner")
        meta = meta_params(plan)
        at = {p: i for i, p in enumerate(tree_util.flatten(meta)[0])}
        pieces = []
        for b in plan.buckets:
            for s in b.slots:
                piece = b.local_piece(s, plan.shard_index(b, rank))
                if piece.numel:
                    pieces.append((b.index, piece.held, at[s.path]))
        return PlannedPartition(self.for_params(meta), tuple(pieces))

    def take(self, indices):
        if self.leaf_labels is None:
            return self
        return replace(self, leaf_labels=tuple(self.leaf_labels[i] for i in indices),
                       transforms={k: t.take(indices) for k, t in self.transforms.items()})

    def structure(self):
        labels = "" if self.leaf_labels is None else f"; labels {','.join(map(str, self.leaf_labels))}"
        return f"partition({', '.join(f'{k}={t.structure()}' for k, t in self.transforms.items())}{labels})"


@dataclass(frozen=True)
class PlannedPartition(Transform):
    """A :class:`Partition` on a plan's flat shards (its ``for_plan``): the leaves are the shards,
    and each label's transform runs on the pieces (views) of its params in them. ``pieces``: per
    piece, (its shard's place in the leaves, its elements there, its param's leaf index in the
    partition's params). Every field is kept shard-shaped, so checkpoints place it as the params;
    a field only some labels keep is zeros on the others' elements."""

    partition: Partition  # resolved on the full params (meta tensors): labels and per-param parts
    pieces: tuple

    fields = property(lambda self: self.partition.fields)

    def update(self, grads, state, params, hyper):
        p = self.partition
        for label, t in p.transforms.items():
            mine = [(b, sl, j) for b, sl, j in self.pieces if p.leaf_labels[j] == label]
            if mine:
                pick = lambda xs: [xs[b][sl] for b, sl, _ in mine]  # noqa: E731
                run(t.take([j for _, _, j in mine]), pick(grads), {f: pick(state[f]) for f in t.fields}, pick(params),
                    hyper)
        return grads, state

    def check(self, hyper):
        self.partition.check(hyper)

    def take(self, indices):
        place = {b: k for k, b in enumerate(indices)}
        return replace(self, pieces=tuple((place[b], sl, j) for b, sl, j in self.pieces if b in place))

    def structure(self):
        return self.partition.structure()


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

    @property
    def capabilities(self) -> Capabilities:
        """Partial updates when elementwise; set up per plan; its clip, folded into the step's scale."""
        t = self.transform
        return Capabilities(partial=t.elementwise, for_plan=True,
                            max_grad_norm=t.max_grad_norm)

    @property
    def structure(self) -> str:
        """The transform's structure (:meth:`Transform.structure`), which checkpoints record."""
        return self.transform.structure()

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

    def update(self, grads: Any, state, params: Any) -> tuple[Any, Any]:
        """Returns (params, state), both updated in place (donated, as with
        ``jax.jit(donate_argnums=...)``): do not reuse the inputs."""
        g = optree.tree_leaves(grads)
        self.partial_update(state, params)(range(len(g)), g)
        return params, state

    def partial_update(self, state, params: Any) -> Callable[[list[int], list], None]:
        """Start one step whose update is applied a few leaves at a time: returns ``apply(indices,
        grads)``, which updates the leaves at ``indices`` from ``grads[i]``. For an elementwise
        transform any split gives exactly one ``update``'s result (the count moves on once, here)."""
        p = optree.tree_leaves(params)
        fields = {k: optree.tree_leaves(v) for k, v in state._asdict().items() if k != "count"}
        transform = self.transform.for_params(params)
        hyper = Hyper(int(state.count) + 1)
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


def clip_by_global_norm(max_norm: float) -> ClipByGlobalNorm:
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"clip_by_global_norm: max_norm must be a finite number > 0, got {max_norm!r}")
    return ClipByGlobalNorm(float(max_norm))


def chain(*stages: Transform) -> Chain:
    return Chain(tuple(stages))


def partition(transforms: dict, labels: Any) -> Partition:
    return Partition(dict(transforms), labels)


def inject_hyperparams(transform: Transform, lr: float | Callable[[int], float] | None = None, what: str = "lr",
                       **others) -> InjectHyperparams:
    """``transform`` with its hyper-parameters given per step (optax's ``inject_hyperparams``):
    ``lr`` for every stage inside, and any field of ``transform`` itself by name, e.g.
    ``inject_hyperparams(add_decayed_weights(0.1), weight_decay=schedule)``; each a number or a
    function of the 1-based step, whose values must be finite and >= 0."""
    if lr is not None and not callable(lr):
        check_rate(lr, what)
    names = {f.name for f in dataclasses.fields(transform)} if dataclasses.is_dataclass(transform) else set()
    for k, v in others.items():
        if k not in names or k in ("mask", "ranges", "folded", "stages", "inner", "transforms", "labels"):
            raise ValueError(f"inject_hyperparams: {type(transform).__name__} has no hyper-parameter {k!r}; inject a "
                             f"stage's own field into that stage (e.g. chain(inject_hyperparams(add_decayed_weights(0.1), "
                             f"weight_decay=schedule), ...)), or lr into any transform")
        if isinstance(transform, ClipByGlobalNorm):
            raise ValueError("inject_hyperparams: clip_by_global_norm's max_norm is fixed (under hpf.shard_step the "
                             "step clips to it in its one all-reduce); give it a number")
        if not callable(v):
            check_rate(v, k)
    return InjectHyperparams(transform, lr, what, tuple(others.items()))


def add_decayed_weights(weight_decay: float, mask: Any = None) -> AddDecayedWeights:
    return AddDecayedWeights(weight_decay, mask)


def scale_by_adam(betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> ScaleByAdam:
    return ScaleByAdam(tuple(betas), eps)
