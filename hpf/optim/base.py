"""The optimizer interface hpf.shard_step relies on, as optax's base.py declares its own.

An optimizer is functional: ``init(params) -> state`` and ``update(grads, state, params) ->
(new params, new state)``; hpf's optimizers update params and state in place (donated) and
return them. What else the step may do with one, it declares as data, ``capabilities`` (a
:class:`Capabilities`; none for a plain ``init``/``update`` object), and the step reads that
instead of probing for methods. Each capability promises the methods of its protocol below:

- ``partial`` (`PartialUpdate`): an elementwise optimizer can update a few leaves at a time, so
  the step updates the next step's first units first (optimizer overlap).
- ``for_plan`` (`ForPlan`): one that needs the plan's layout (Muon, AdamW's decay mask) returns
  the form that runs on the step's flat shards.
- ``early`` (`EarlyUpdate`): one on flat shards that starts computing during backward, bucket by
  bucket as grads land (distributed Muon's Newton-Schulz), and writes only after the decision.
- ``aux``: the step's aux names ``update(..., aux=...)`` reads (Muon's QK-Clip reads the max
  attention logits); () and the step calls ``update`` without aux.
- ``max_grad_norm``: a clip stage's max global grad norm (hpf.optim.transforms.clip_by_global_norm):
  the step takes the global norm in its one all-reduce, and the decision reads the clip stage's
  factor of it, as for ``shard_step(max_grad_norm=...)`` (None: no clip stage).
- ``state_layout``: the per-bucket state fields that do not lie as the param shard does, each
  with the params it packs, so checkpoints can place them (distributed Muon's AdamW moment).
- ``outline``: its stages, (path, name, hyper-parameters) each (hpf.optim.stage.Transform.outline):
  a checkpoint records them and refuses to restore into an optimizer whose stages differ (): an
  optimizer not made of stages, which checkpoints tell apart by its type's name only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

__all__ = ["Capabilities", "capabilities", "undeclared", "Optimizer", "PartialUpdate", "ForPlan", "EarlyUpdate"]


@dataclass(frozen=True)
class Capabilities:
    """What an optimizer declares the step may do with it (see the module doc)."""

    partial: bool = False
    for_plan: bool = False
    early: bool = False
    aux: tuple[str, ...] = ()
    max_grad_norm: float | None = None
    #: field -> the params it packs: such a field's tensor for a bucket holds this rank's elements
    #: of those params only, back to back in the bucket's param order (every other per-bucket
    #: field is laid out as the param shard, as AdamW's moments are)
    state_layout: Mapping[str, frozenset[str]] = field(default_factory=dict)
    outline: tuple[tuple[str, str, dict], ...] = ()


def capabilities(optimizer: Any) -> Capabilities:
    """``optimizer``'s declared capabilities (its ``capabilities``); none when it declares none."""
    caps = getattr(optimizer, "capabilities", None)
    return caps if isinstance(caps, Capabilities) else Capabilities()


#: the methods a capability promises: an optimizer with one of them declares its capabilities
_PROMISED = ("partial_update", "for_plan", "early", "state_layout", "aux_names")


def undeclared(optimizer: Any) -> None:
    """TypeError for an optimizer with a capability's method but no ``capabilities``: the step
    would never call it (for_plan unset: it would run on the flat shards as they are)."""
    has = [m for m in _PROMISED if callable(getattr(optimizer, m, None))]
    if has and getattr(optimizer, "capabilities", None) is None:
        raise TypeError(f"optimizer {type(optimizer).__name__} has {', '.join(has)} but declares no capabilities, so "
                        "the step would not use them; declare what it supports, e.g. `capabilities = "
                        "hpf.optim.Capabilities(partial=True, for_plan=True)` (hpf.optim.Capabilities)")


@runtime_checkable
class Optimizer(Protocol):
    def init(self, params: Any) -> Any:
        """The optimizer state for ``params`` (a pytree of tensors, or the step's flat shards)."""
        ...

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """One step: returns (new params, new state)."""
        ...


class PartialUpdate(Protocol):
    def partial_update(self, state: Any, params: Any) -> Callable[[list[int], list], None]:
        """Start one step; returns ``apply(indices, grads)``, which updates the leaves at
        ``indices`` (of the flattened params) from ``grads[i]``. Any split of the leaves over
        calls gives exactly one ``update``'s result."""
        ...


class ForPlan(Protocol):
    def for_plan(self, plan: Any, rank: int) -> Optimizer:
        """This optimizer on the flat shards of ``plan`` (an hpf.Plan) as ``rank`` holds them."""
        ...


class EarlyUpdate(Protocol):
    def early(self, grads: list, state: Any, scale: float, attempt: int) -> Any:
        """This step's work, or None: an object with ``landed(buckets)`` (those buckets' grads in
        ``grads`` are final, still to be multiplied by ``scale``), ``finish()`` (wait for its
        communication; changes nothing of the caller's) and ``apply(grads, params, aux) -> bool``
        (after the decision, with grads scaled by exactly ``scale``: the update's result, in
        place; False when it could not, having changed nothing). ``attempt`` counts the step's
        calls, the same on every rank. Every rank sees the same buckets land in the same order."""
        ...
