"""``hpf.shard_step``: the one entry point; it validates the options once and picks a step class by mode.

It lives apart from both step classes so that it can import both: the production step
(hpf.step) knows nothing of validation mode (hpf.validate), which extends it.
"""
from __future__ import annotations

from typing import Callable

from .config import StepConfig
from .step import ShardStep
from .validate import ValidateStep

__all__ = ["shard_step", "STEPS"]

#: mode name -> step class; each class names its own mode.
STEPS: dict[str, type[ShardStep]] = {cls.mode: cls for cls in (ShardStep, ValidateStep)}


def shard_step(loss_fn: Callable, **options) -> ShardStep:
    """Make a sharded training step for ``loss_fn(params, batch)``.

    ``state = step.init(params)``, then ``state, metrics = step(state, batch)``.

    Args:
        loss_fn: a pure function ``(params, batch) ->`` a scalar mean, ``hpf.weighted(sum, count)``,
            or either with a dict of aux tensors (hpf.losses says what each means).
        **options: the fields of :class:`hpf.StepConfig`, each with its default and meaning
            there (``mesh`` and ``optimizer`` are required).

    Returns:
        A :class:`ShardStep` (a :class:`hpf.validate.ValidateStep` for ``mode="validate"``).

    Raises:
        TypeError: an unknown option, or a missing ``mesh``/``optimizer``; those of :class:`hpf.StepConfig`.
        ValueError: as :class:`hpf.StepConfig`.
    """
    unknown = sorted(set(options) - set(StepConfig.names()))
    if unknown:
        raise TypeError(f"shard_step got unknown options {unknown}; the options are {list(StepConfig.names())}")
    for required in ("mesh", "optimizer"):
        if required not in options:
            raise TypeError(f"shard_step needs {required}=...")
    config = StepConfig(**options)
    return STEPS[config.mode](loss_fn, config)
