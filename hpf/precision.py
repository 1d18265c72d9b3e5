"""The precision policies: what a step computes, reduces and keeps its masters in
(``MixedPrecision``, with the short names of ``PRECISIONS``), and what crosses the slow tier in
fewer bytes (``SlowPrecision``). Plain data that every layer names (the planner, the
transports, the step, the CLI), so it sits below all of them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecision", "SlowPrecision", "PRECISIONS"]


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


@dataclass(frozen=True)
class SlowPrecision:
    """What crosses the slow tier in fewer bytes: ``hpf.Topology(slow_weights=..., slow_grads=...)``
    makes one, and the plan carries it (so the plan report, ``hpf.sim``, the comm and Muon read
    one choice). The fast tier and the fp32 master shards stay at full precision.

    Args:
        weights: None (the compute dtype), "bf16", "fp8" or "int8": the format weight shards are
            all-gathered in across the slow tier (quantized per block, dequantized into the
            gathered buffer).
        grads: None (the reduce dtype), "bf16", "fp8", "int8" or "int4": the format of the slow
            stage of grad reductions (after a full-precision fast-tier reduce; summed in fp32).
        block: values per scale (hpf_kernels.formats). Shards that cross the slow tier are padded
            to whole blocks.
        error_feedback: carry each rank's grad quantization error into its next step (a residual
            kept in ``TrainState.error_feedback`` and checkpoints; hpf.comm.lowbit). Off unless
            asked: with AdamW it trains worse than plain rounding (docs/topology.md has the runs).

    Raises:
        ValueError: an unknown format (the message lists the allowed ones), int4 for weights,
            a block that is not an int >= 1 (or odd with int4), error feedback without grads.
    """

    weights: str | None = None
    grads: str | None = None
    block: int = 128
    error_feedback: bool | None = None

    def __post_init__(self):
        from hpf_kernels.formats import GRAD_FORMATS, WEIGHT_FORMATS, check_block, check_format

        if self.weights is not None:
            check_format(self.weights, WEIGHT_FORMATS, "slow_weights")
        if self.grads is not None:
            check_format(self.grads, GRAD_FORMATS, "slow_grads")
        check_block(self.block, self.grads or "", "slow_block")
        ef = bool(self.error_feedback)
        if ef and self.grads is None:
            raise ValueError("slow_error_feedback=True carries the error of quantized grads: set slow_grads too")
        object.__setattr__(self, "error_feedback", ef)

    @classmethod
    def parse(cls, value: "SlowPrecision | str | None") -> "SlowPrecision | None":
        """``"W"`` (both sides), ``"W,G"`` (``none``: full precision), ``"W,G,ef"`` or ``"W,G,no-ef"``
        (error feedback on or off; default: off), a policy or None -> a policy or None."""
        if value is None or isinstance(value, SlowPrecision):
            return value
        parts = [p.strip().lower() for p in str(value).split(",")]
        feedback = {"ef": True, "no-ef": False}.get(parts[-1]) if len(parts) == 3 else None
        if len(parts) not in (1, 2, 3) or not all(parts) or (len(parts) == 3 and feedback is None):
            raise ValueError(f"slow precision {value!r}: write W, W,G or W,G,ef (or no-ef), e.g. int8 or int8,int4 "
                             "(none: full precision)")
        if parts == ["int4"]:
            raise ValueError("slow precision 'int4': int4 is for grads only; write none,int4 or int8,int4 (W,G)")
        weights, grads = (None if p == "none" else p for p in (parts * 2)[:2])
        return cls(weights, grads, error_feedback=feedback) if weights or grads or feedback else None

    def text(self) -> str:
        """The ``W,G[,ef]`` form ``parse`` reads back (``hpf train --slow-precision``, run.json)."""
        return ",".join([self.weights or "none", self.grads or "none"] + (["ef"] if self.error_feedback else []))

    def describe(self) -> str:
        """``int8 weights, int4 grads (block 256, error feedback)``, as reports say it."""
        parts = [f"{f} {side}" for side, f in (("weights", self.weights), ("grads", self.grads)) if f]
        return ", ".join(parts) + f" (block {self.block}{', error feedback' if self.error_feedback else ''})"
