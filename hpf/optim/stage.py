"""The one shape every optimizer stage and combinator shares (optax's ``GradientTransformation``):
``Transform``, one step's hyper-parameters (``Hyper``), and ``run``, which applies a transform.

A stage's ``init(params)`` gives its fields (one tensor per leaf each); its ``update(grads,
state, params, hyper)`` updates them and the params in place and returns the updates the next
stage reads. hpf.optim.transforms has the whole story; stages.py, combinators.py and
transform_optimizer.py build on this.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..train_state import zeros_like
from .lr_schedules import check_rate

__all__ = ["Hyper", "inject", "Transform", "meta_params", "run"]


class Hyper(NamedTuple):
    """One step's hyper-parameters, as every stage of a chain sees them (lr None: none injected)."""

    step: int  # 1-based
    lr: float | None = None
    aux: dict | None = None  # the step's aux (hpf.losses), for the stages that read it (``Transform.aux``)

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


def _plain(v: Any) -> bool:
    """A value a checkpoint's header records as it is (JSON): a number, a string, a flag, None, or a tuple of them."""
    return v is None or isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(map(_plain, v)))


class Transform:
    """The one shape every stage and combinator shares (see the module doc); the defaults are
    those of an elementwise stage with no state, no plan form and no path-dependent part."""

    fields: tuple[str, ...] = ()
    #: any subset of the leaves updated alone (``take``) gives that subset's part of one update
    elementwise: bool = True
    #: the step's aux this transform reads from ``hyper.aux`` (QK-Clip: the max attention logits)
    aux: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The stage's name, as its factory's: ``ScaleByAdam`` is "scale_by_adam"."""
        return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(self).__name__).lower()

    def init(self, params: Any) -> dict[str, list[torch.Tensor]]:
        """Zeros shaped like each leaf, per field."""
        leaves = leaves_of(params)
        return {f: [zeros_like(p) for p in leaves] for f in self.fields}

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
            raise ValueError(f"{type(self).__name__} declares elementwise=False (it needs each param whole: a norm, a "
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

    def hyper(self) -> dict:
        """Its hyper-parameters as a checkpoint records them: the fields with plain values (dtypes as names)."""
        out = {}
        for f in dataclasses.fields(self) if dataclasses.is_dataclass(self) else ():
            v = getattr(self, f.name)
            if isinstance(v, torch.dtype) or _plain(v):
                out[f.name] = str(v) if isinstance(v, torch.dtype) else v
        return out

    def outline(self, path: str = "") -> tuple[tuple[str, str, dict], ...]:
        """What this transform is, stage by stage: (its path in the chain, its name, its
        hyper-parameters) each. A checkpoint records them and refuses to restore into a chain whose
        paths or names differ; hyper-parameters may change on resume (a new lr), so they are only
        recorded. A combinator lists itself, then its parts under their paths."""
        return ((path, self.name, self.hyper()),)


def meta_params(plan) -> Any:
    """The full params of ``plan`` as meta tensors (shapes, dtypes and paths only), for masks and labels."""
    return plan.tree({p: torch.empty(s.global_shape, dtype=s.dtype, device="meta") for p, s in plan.slots.items()})


def leaves_of(params: Any) -> list:
    return params if isinstance(params, list) else optree.tree_leaves(params)



def run(transform: Transform, grads: list, state: dict, params: list, hyper: Hyper) -> list:
    """``transform.update``, or nothing for no leaves (foreach ops want some). Returns the updates."""
    return transform.update(grads, state, params, hyper)[0] if params else []
