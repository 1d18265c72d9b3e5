"""The optimizer protocols hpf.shard_step relies on, as optax's base.py declares its own.

An optimizer is functional: ``init(params) -> state`` and ``update(grads, state, params) ->
(new params, new state)``; hpf's optimizers update params and state in place (donated) and
return them. Two optional capabilities, each its own protocol that the step checks with
``isinstance``:

- `PartialUpdate`: an elementwise optimizer can update a few leaves at a time, so the step
  updates each FSDP unit as soon as its grads have landed (optimizer overlap).
- `ForPlan`: an optimizer that needs the plan's layout (distributed Muon) returns the form
  that runs on the step's flat shards.
- `StateLayout`: an optimizer on flat shards whose state has a per-bucket field that is not
  laid out as the param shard says which params it covers, so checkpoints can place it.
- `ReadsAux`: an optimizer whose update reads the step's aux (Muon's QK-Clip reads the max
  attention logits); the step passes ``update(..., aux=metrics["aux"])``.
- `EarlyUpdate`: an optimizer on flat shards that starts computing during backward, bucket by
  bucket as grads land (distributed Muon's Newton-Schulz), and writes only after the decision.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["Optimizer", "PartialUpdate", "ForPlan", "StateLayout", "ReadsAux", "EarlyUpdate"]


@runtime_checkable
class Optimizer(Protocol):
    def init(self, params: Any) -> Any:
        """The optimizer state for ``params`` (a pytree of tensors, or the step's flat shards)."""
        ...

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """One step: returns (new params, new state)."""
        ...


@runtime_checkable
class PartialUpdate(Protocol):
    def partial_update(self, state: Any, params: Any) -> Callable[[list[int], list], None]:
        """Start one step; returns ``apply(indices, grads)``, which updates the leaves at
        ``indices`` (of the flattened params) from ``grads[i]``. Any split of the leaves over
        calls gives exactly one ``update``'s result."""
        ...


@runtime_checkable
class ForPlan(Protocol):
    def for_plan(self, plan: Any, rank: int) -> Optimizer:
        """This optimizer on the flat shards of ``plan`` (an hpf.Plan) as ``rank`` holds them."""
        ...


@runtime_checkable
class StateLayout(Protocol):
    def state_layout(self) -> dict[str, frozenset[str]]:
        """The per-bucket state fields that pack only some params: field -> their paths.

        Such a field's tensor for a bucket holds this rank's elements of those params only,
        back to back in the bucket's param order. Every per-bucket field not named here is laid
        out as the param shard (AdamW's moments: no method needed). hpf.checkpoint reads this
        to save and restore the state on any mesh."""
        ...


@runtime_checkable
class ReadsAux(Protocol):
    def aux_names(self) -> tuple[str, ...]:
        """The aux names (hpf.losses) ``update(grads, state, params, aux=...)`` reads; () when none,
        and then the step calls ``update`` without aux."""
        ...


@runtime_checkable
class EarlyUpdate(Protocol):
    def early(self, grads: list, state: Any, scale: float, attempt: int) -> Any:
        """This step's work, or None: an object with ``landed(buckets)`` (those buckets' grads in
        ``grads`` are final, still to be multiplied by ``scale``), ``finish()`` (wait for its
        communication; changes nothing of the caller's) and ``apply(grads, params, aux) -> bool``
        (after the decision, with grads scaled by exactly ``scale``: the update's result, in
        place; False when it could not, having changed nothing). ``attempt`` counts the step's
        calls, the same on every rank. Every rank sees the same buckets land in the same order."""
        ...
