"""The combinators that compose stages: ``chain`` (in order), ``inject_hyperparams`` (a step's lr
and a stage's fields from schedules), ``partition`` (each param to its label's transform) and
its form on a plan's flat shards (``PlannedPartition``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .. import tree as tree_util
from ..train_state import zeros_like
from .lr_schedules import check_rate
from .stage import Hyper, Transform, inject, leaves_of, meta_params, run
from .stages import ClipByGlobalNorm


def _at(path: str, part) -> str:
    """The path of a combinator's ``part`` (a chain's index, a partition's label) under ``path``."""
    return f"{path}/{part}" if path else str(part)


__all__ = ["Chain", "InjectHyperparams", "Partition", "PlannedPartition", "chain", "partition", "inject_hyperparams"]


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

    @property
    def aux(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a for s in self.stages for a in s.aux))

    def outline(self, path: str = "") -> tuple:
        return ((path, "chain", {}),) + tuple(r for i, s in enumerate(self.stages) for r in s.outline(_at(path, i)))


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
        return inner, hyper if self.lr is None else hyper._replace(lr=inject(self.lr, hyper.step, self.what).lr)

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

    aux = property(lambda self: self.inner.aux)

    def hyper(self) -> dict:
        """The lr and the injected fields, each a number or "schedule"."""
        return {k: "schedule" if callable(v) else v for k, v in (("lr", self.lr),) + self.others}

    def outline(self, path: str = "") -> tuple:
        return ((path, self.name, self.hyper()),) + self.inner.outline(path)


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
        leaves = leaves_of(params)
        return {f: [zeros_like(p) if f in self.transforms[x].fields else p.new_empty(0)
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

    @property
    def aux(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a for t in self.transforms.values() for a in t.aux))

    def outline(self, path: str = "") -> tuple:
        """Itself (with each leaf's label once resolved: which param goes where is structure), then each label's."""
        name = "partition" if self.leaf_labels is None else f"partition(labels {','.join(map(str, self.leaf_labels))})"
        return ((path, name, {}),) + tuple(r for k, t in self.transforms.items() for r in t.outline(_at(path, k)))


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

    aux = property(lambda self: self.partition.aux)

    def outline(self, path: str = "") -> tuple:
        return self.partition.outline(path)


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
        if k not in names or k in ("mask", "ranges", "step_norm", "stages", "inner", "transforms", "labels"):
            raise ValueError(f"inject_hyperparams: {type(transform).__name__} has no hyper-parameter {k!r}; inject a "
                             f"stage's own field into that stage (e.g. chain(inject_hyperparams(add_decayed_weights(0.1), "
                             f"weight_decay=schedule), ...)), or lr into any transform")
        if isinstance(transform, ClipByGlobalNorm):
            raise ValueError("inject_hyperparams: clip_by_global_norm's max_norm is fixed (under hpf.shard_step the "
                             "step clips to it in its one all-reduce); give it a number")
        if not callable(v):
            check_rate(v, k)
    return InjectHyperparams(transform, lr, what, tuple(others.items()))
