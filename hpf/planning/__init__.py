"""The one-time resolution of params x specs x mesh into FSDP units and flat buffers, once, on
shapes alone (meta tensors, virtual meshes of any size). Modules:

- placement.py: :func:`plan` and :func:`step_plan` (the plan :func:`hpf.shard_step` makes),
  how each param gets its unit, bucket and offset (axes, local shapes, ties);
- buckets.py: what a :class:`Plan` is (its buckets, slots and units) and the layout facts the
  step, the comm, checkpoints and the tools read of it (``low_bit``, ``OPS``).
"""
from ..tree import ROOT
from .buckets import OPS, Bucket, ParamSlot, Piece, Plan, UnitLayout, low_bit
from .placement import plan, step_plan, unit_names

__all__ = ["Plan", "Bucket", "ParamSlot", "Piece", "UnitLayout", "plan", "step_plan", "unit_names", "low_bit", "OPS", "ROOT"]
