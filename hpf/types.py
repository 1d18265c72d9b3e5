"""The plain data types that cross the public API: the train state and the precision policy.

They live apart from the step so that every module that takes or returns them (the
production step, validation mode, the CLI, checkpoints) imports them from here, and none
of those modules has to import another to name them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["MixedPrecision", "TrainState"]


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``compute_dtype``, reduce grads in ``reduce_dtype``, keep master shards in
    ``master_dtype``. ``MixedPrecision(torch.bfloat16)`` is the usual choice.

    Args:
        compute_dtype: dtype of the gathered params the loss function computes with.
        reduce_dtype: dtype of the gradient reduction and of the grad shards.
        master_dtype: dtype of the stored flat param shards the optimizer updates.

    Raises:
        Nothing at construction; :meth:`parse` raises ``ValueError`` on unknown names.
    """

    compute_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    @staticmethod
    def parse(value: "MixedPrecision | torch.dtype | str | None") -> "MixedPrecision | None":
        """None, a short name from :data:`PRECISIONS` ("bf16", "fp16"), a compute dtype
        (``torch.bfloat16``) or a policy -> a policy or None.

        Raises:
            ValueError: a string that names no policy, or a value of another type.
        """
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return MixedPrecision(value)
        if value is None or isinstance(value, MixedPrecision):
            return value
        if not isinstance(value, str):
            raise ValueError(f"mixed_precision={value!r}: use None, one of {list(PRECISIONS)}, a floating dtype "
                             "such as torch.bfloat16, or hpf.MixedPrecision(...)")
        if value not in PRECISIONS:
            raise ValueError(f"mixed_precision={value!r}: use one of {list(PRECISIONS)} or hpf.MixedPrecision(...)")
        return PRECISIONS[value]


#: The policies the short names stand for (``mixed_precision="bf16"``, ``hpf plan --mixed-precision``).
PRECISIONS = {"bf16": MixedPrecision(torch.bfloat16), "fp16": MixedPrecision(torch.float16)}


class TrainState(NamedTuple):
    """The sharded train state: one flat master shard per plan bucket, and optimizer state.

    Args:
        params: this rank's flat master shard of every plan bucket, in bucket order.
        opt_state: the optimizer's state for those shards (its ``init`` made it).
        loss_scale: fp16's loss-scaling state (:class:`hpf.losses.LossScaleState`), else None.

    Raises:
        Nothing itself; a step given a state of another plan raises (validation mode names
        the bucket).
    """

    params: list[torch.Tensor]
    opt_state: Any
    loss_scale: Any = None
