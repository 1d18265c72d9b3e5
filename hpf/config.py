"""``StepConfig``: every option of :func:`hpf.shard_step`, in one place, validated once.

``shard_step(loss_fn, **options)`` builds one; the step classes read it and nothing else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from .topology import Topology
from .engine.residency import RESIDENT_UNITS
from .losses import LossScale
from .mesh import Mesh, as_axes
from .optim.base import Optimizer, capabilities, undeclared
from .optim.stage import Transform
from .optim.transform_optimizer import as_optimizer
from .precision import MixedPrecision

__all__ = ["StepConfig", "MODES"]

#: ``mode=`` values (hpf.modes maps each to its step class).
MODES = ("production", "validate")


@dataclass(frozen=True)
class StepConfig:
    """The options of a sharded step (the keyword arguments of :func:`hpf.shard_step`).

    Args:
        mesh: the :class:`hpf.Mesh` of the running job (its size is the world size).
        optimizer: a functional optimizer, e.g. ``hpf.optim.adamw(...)`` or ``hpf.optim.muon(...)``,
            or a transform of stages (``hpf.optim.transforms.chain(...)``, run by ``as_optimizer``).
        param_specs: None (shard every param over all FSDP axes), ``hpf.rules([...])`` or a pytree of ``P``.
        fsdp_axes: the data-parallel axes params are sharded and gathered over (default: all mesh
            axes); other axes are stored and computed sharded.
        mode: "production" (plain tensors) or "validate" (every op's layout checked; the same
            losses and grads).
        mixed_precision: None, "bf16", "fp16", a dtype or :class:`hpf.MixedPrecision`. The
            per-example floating batch leaves (``batch_axes``) are cast to the compute dtype.
            "fp16" scales the loss dynamically (``loss_scale``).
        max_grad_norm: clip the global grad norm to this (None: no clipping, unless the optimizer
            has a ``clip_by_global_norm`` stage; both is an error).
        topology: None (flat collectives) or :class:`hpf.Topology` for two-tier collectives.
        hsdp: shard params only over the fast-tier FSDP axes and replicate across the slow tier.
        overlap_optimizer: after the step's one global decision, update the units the next step
            reads first, start their gathers, then update the rest (bitwise the same result);
            False updates everything, then gathers.
        grad: "autograd" (the default, and the faster) or "torch.func" (``grad_and_value`` of
            loss_fn; blocks run through ``UnitList.apply``, as hpf.models' ``each_block`` does, are
            rematerialized: FSDP memory, one more forward per block).
        on_nonfinite: "raise" (:class:`hpf.NonFiniteError`, the state exactly as before the step) or
            "skip" (no update; ``metrics["skipped"]``).
        accumulate: micro-batches per step: every per-example batch leaf is split into this many
            equal parts along its batch dim and forward/backward runs on each in turn.
        batch_axes: which dim of each batch leaf is its batch (example) dim, as JAX's ``in_axes``:
            None (every leaf's dim 0), an int, a pytree prefix of the batch of ints and None, or a
            callable ``(path) -> int | None``. A leaf at None is not per-example (e.g. MoE's
            ``expert_bias``): every micro-batch gets it whole, it is never cast, and its shape may
            not differ across ranks.
        loss_scale: fp16's dynamic loss scaling, :class:`hpf.LossScale` (the default under fp16;
            None turns it off). Other precisions need none.
        frozen: params to keep fixed (no grads, no update, no optimizer state, no reduction): a
            regex on the "/"-joined path or a callable ``(path) -> bool``. None: torch's
            convention, the leaves with ``requires_grad=False`` once some leaf requires grad
            (a tree of plain tensors trains every leaf).
        resident_units: how many FSDP units (besides the root and shared-memory units) may be
            gathered at once: the memory bound of the residency policy (2 keeps a loop-style
            loss function at the current block and the prefetched next one).
        quantization_tolerance: validation mode with a low-bit slow tier (``topology`` with
            ``slow_weights``/``slow_grads``): the largest quantization error allowed on any
            param's weights or grads, relative to the param's largest value; past it the step
            raises :class:`hpf.validate.QuantizationError` before any update (None: report only,
            in ``metrics["quantization"]``).
        invariant: the same bits at any scale (docs/invariant.md): the step's losses, grads and
            params are a function of the params, the global batch and the options alone, not of
            the world size, the mesh's shape, the topology, ``accumulate`` or ``recompute``. Each
            rank's local batch is cut into atoms of ``atom_size`` examples, summed in one
            canonical tree over the global atom index; rank r (its index over the FSDP axes, in
            mesh order) passes atoms ``[r * n, (r + 1) * n)`` of the global batch, contiguous.
        atom_size: with ``invariant``, the examples per atom: the same at every mesh (the global
            batch over the largest world size the job will run on is a good choice).

    Raises:
        ValueError: an unknown ``mode``, ``grad``, ``mixed_precision`` or ``on_nonfinite``; a
            ``max_grad_norm`` or ``quantization_tolerance`` that is not finite and > 0, or a
            ``quantization_tolerance`` with no low-bit slow tier; ``accumulate`` or
            ``resident_units`` < 1.
        TypeError: ``mesh`` is not an hpf.Mesh, ``optimizer`` has no ``init``/``update``, or
            ``topology`` is not an hpf.Topology.
    """

    mesh: Mesh
    optimizer: Optimizer
    param_specs: Any = None
    fsdp_axes: Any = None
    mode: str = "production"
    mixed_precision: Any = None
    max_grad_norm: float | None = None
    topology: Topology | None = None
    hsdp: bool = False
    overlap_optimizer: bool = True
    grad: str = "autograd"
    on_nonfinite: str = "raise"
    accumulate: int = 1
    batch_axes: Any = None
    loss_scale: Any = "auto"
    resident_units: int = RESIDENT_UNITS
    frozen: Any = None
    quantization_tolerance: float | None = None
    invariant: bool = False
    atom_size: int | None = None

    @property
    def grad_clip(self) -> float | None:
        """The max global grad norm the step clips to: ``max_grad_norm``, or the optimizer's clip stage's."""
        return self.max_grad_norm if self.max_grad_norm is not None else capabilities(self.optimizer).max_grad_norm

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh={self.mesh!r}: pass an hpf.Mesh, e.g. hpf.Mesh({{'dp': 4}})")
        if isinstance(self.optimizer, Transform):  # a chain of stages, optax style: the optimizer that runs it
            object.__setattr__(self, "optimizer", as_optimizer(self.optimizer))
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(f"optimizer {self.optimizer!r} is not an hpf.optim.Optimizer (it needs init() and "
                            "update()): pass hpf.optim.adamw(...) or another object with init(params) and "
                            "update(grads, state, params)")
        undeclared(self.optimizer)
        if self.max_grad_norm is not None and capabilities(self.optimizer).max_grad_norm is not None:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} and the optimizer's clip_by_global_norm("
                             f"{capabilities(self.optimizer).max_grad_norm}) both clip: keep one")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: use one of {list(MODES)}")
        if self.grad not in ("autograd", "torch.func"):
            raise ValueError(f"grad={self.grad!r}: use 'autograd' (the default, faster: benchmarks/grad_modes.py) "
                             "or 'torch.func'")
        if self.on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}: use 'raise' (NonFiniteError) or 'skip' "
                             "(no update)")
        for name, off in (("max_grad_norm", "no clipping"), ("quantization_tolerance", "report only")):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r}: must be a finite number > 0, or None for {off}")
        for name in ("accumulate", "resident_units"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: give an int >= 1")
        if self.topology is not None and not isinstance(self.topology, Topology):
            raise TypeError(f"topology={self.topology!r}: pass hpf.Topology(...) or None")
        if self.quantization_tolerance is not None and (self.topology is None or self.topology.slow_precision is None):
            raise ValueError(f"quantization_tolerance={self.quantization_tolerance!r}: nothing is quantized; it bounds a "
                             "low-bit slow tier, hpf.Topology(slow_weights=..., slow_grads=...), in mode='validate'")
        if self.quantization_tolerance is not None and self.mode != "validate":
            raise ValueError(f"quantization_tolerance={self.quantization_tolerance!r} is checked in mode='validate' "
                             f"(mode={self.mode!r} measures no quantization error); use mode='validate'")
        object.__setattr__(self, "fsdp_axes", as_axes(self.fsdp_axes))
        self._check_invariant()
        mp = MixedPrecision.parse(self.mixed_precision)
        object.__setattr__(self, "mixed_precision", mp)
        scale = self.loss_scale
        if isinstance(scale, str) and scale == "auto":
            scale = LossScale() if mp is not None and mp.compute_dtype == torch.float16 else None
        if scale is not None and not isinstance(scale, LossScale):
            raise TypeError(f"loss_scale={scale!r}: pass hpf.LossScale(...), or None for no loss scaling")
        object.__setattr__(self, "loss_scale", scale)
        if self.invariant and scale is not None:
            raise ValueError("invariant=True with fp16 loss scaling: the loss scale's per-term divisor depends on the "
                             "world size; use mixed_precision='bf16' (no loss scale), or fp32")

    def _check_invariant(self) -> None:
        """The options the invariant mode covers (docs/invariant.md); the others are refused by name."""
        if not isinstance(self.invariant, bool):
            raise TypeError(f"invariant={self.invariant!r}: pass True or False")
        if not self.invariant:
            if self.atom_size is not None:
                raise ValueError(f"atom_size={self.atom_size!r} is the invariant mode's: pass invariant=True too")
            return
        a = self.atom_size
        if isinstance(a, bool) or not isinstance(a, int) or a < 1:
            raise ValueError(f"invariant=True needs atom_size=<examples per atom> (an int >= 1, the same at every "
                             f"mesh; e.g. the global batch over the largest world size), not {a!r}")
        if self.topology is not None and self.topology.slow_precision is not None:
            raise ValueError("invariant=True does not cover a low-bit slow tier yet (its quantization blocks and "
                             "sums follow the mesh): drop slow_weights/slow_grads, or run without invariant=True")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
