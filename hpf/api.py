"""``hpf.shard_step``: the one entry point that picks a step class by its mode.

It lives apart from both step classes so that it can import both: the production step
(hpf.step) knows nothing of validation mode (hpf.validate), which extends it.
"""
from __future__ import annotations

from typing import Callable

from .mesh import Mesh
from .step import ShardStep
from .comm.tiered import Topology
from .types import MixedPrecision
from .validate import ValidateStep

__all__ = ["shard_step", "STEPS"]

#: mode name -> step class; each class names its own mode.
STEPS: dict[str, type[ShardStep]] = {cls.mode: cls for cls in (ShardStep, ValidateStep)}


def shard_step(loss_fn: Callable, *, mesh: Mesh, optimizer, param_specs=None, fsdp_axes=None,
               mode: str = "production", mixed_precision: MixedPrecision | str | None = None,
               max_grad_norm: float | None = None, topology: Topology | None = None,
               hsdp: bool = False, overlap_optimizer: bool = True, grad: str = "autograd",
               on_nonfinite: str = "raise", accumulate: int = 1) -> ShardStep:
    """Make a sharded training step for ``loss_fn(params, batch) -> scalar``.

    ``state = step.init(params)``, then ``state, metrics = step(state, batch)``.

    Args:
        loss_fn: a pure function ``(params, batch) -> scalar tensor``, or ``-> (loss, aux)``
            with aux a dict of tensors (e.g. MoE tokens per expert): ``metrics["aux"]`` then
            holds each one summed over every rank (in the loss's all-reduce).
        mesh: the :class:`hpf.Mesh` of the running job (its size is the world size).
        optimizer: a functional optimizer, e.g. ``hpf.optim.adamw(...)`` or ``hpf.optim.muon(...)``.
        param_specs: None (shard every param over all FSDP axes), ``hpf.rules([...])`` or a
            pytree of ``P``.
        fsdp_axes: the data-parallel axes params are sharded and gathered over (default: all
            mesh axes); other axes are stored and computed sharded.
        mode: "production" (plain tensors) or "validate" (every op's layout checked; the same
            losses and grads).
        mixed_precision: None, "bf16", "fp16", a dtype (``torch.bfloat16``) or
            ``hpf.MixedPrecision``. Floating batch leaves are cast to the compute dtype.
        max_grad_norm: clip the global grad norm to this (None: no clipping).
        topology: None (flat collectives) or ``hpf.Topology(...)`` for two-tier collectives and
            the backward pipeline.
        hsdp: by default shard params only over the fast-tier FSDP axes and replicate them
            across the slow tier.
        overlap_optimizer: update each unit as soon as its grads have landed, during backward
            (an optimizer with ``partial_update``, such as AdamW, with no ``max_grad_norm``;
            bitwise the same result); False updates after backward. Validation mode always
            updates after backward.
        grad: "autograd" (the default, and the faster: benchmarks/grad_modes.py) or
            "torch.func", which takes ``torch.func.grad_and_value`` of loss_fn over every unit
            gathered at once.
        on_nonfinite: "raise" (default): a NaN/inf loss (on any rank) or
            global grad norm raises :class:`hpf.NonFiniteError` before the update; "skip": such a
            step leaves params and optimizer state unchanged and reports ``metrics["skipped"]``
            (it also turns the optimizer overlap off, so the step is all or nothing).
            Validation mode always raises, naming the op or parameter.
        accumulate: gradient accumulation: each ``step(state, batch)`` splits every batch leaf
            into this many equal micro-batches along dim 0 and runs forward and backward on
            each in turn, so activations are those of one micro-batch. Grads are summed locally
            (one unsharded flat buffer per bucket) and reduced once, on the last micro-batch;
            the update equals one step on the whole batch, to fp32 rounding.

    Returns:
        A :class:`ShardStep` (a :class:`hpf.validate.ValidateStep` for ``mode="validate"``).

    Raises:
        ValueError: an unknown ``mode``, ``grad``, ``mixed_precision`` or ``on_nonfinite``, or a
            ``max_grad_norm`` that is not finite and > 0.
        TypeError: ``optimizer`` has no ``init``/``update``.
    """
    if mode not in STEPS:
        raise ValueError(f"mode={mode!r}: use one of {list(STEPS)}")
    return STEPS[mode](loss_fn, mesh=mesh, optimizer=optimizer, param_specs=param_specs, fsdp_axes=fsdp_axes,
                       mixed_precision=mixed_precision, max_grad_norm=max_grad_norm, topology=topology,
                       hsdp=hsdp, overlap_optimizer=overlap_optimizer, grad=grad, on_nonfinite=on_nonfinite,
                       accumulate=accumulate)
