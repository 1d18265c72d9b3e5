"""What a step carries and what it reports: ``TrainState`` (the sharded params and optimizer
state the step takes and returns) and ``StepStats`` (its counters since the last read). Plain
data, apart from the step, so checkpoints and validation mode name them without importing it."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["StepStats", "TrainState", "GATHER_STATS"]


class TrainState(NamedTuple):
    """The sharded train state: one flat master shard per plan bucket, and optimizer state.

    Args:
        params: this rank's flat master shard of every plan bucket, in bucket order.
        opt_state: the optimizer's state for those shards (its ``init`` made it).
        loss_scale: fp16's loss-scaling state (:class:`hpf.losses.LossScaleState`), else None.
        error_feedback: with slow-tier error feedback (:class:`hpf.precision.SlowPrecision`), this rank's
            residual of each bucket's quantized grad exchange (an empty tensor where none
            crosses the slow tier), carried to the next step and saved in checkpoints; else None.

    Raises:
        Nothing itself; a step given a state of another plan raises (validation mode names
        the bucket).
    """

    params: list[torch.Tensor]
    opt_state: Any
    loss_scale: Any = None
    error_feedback: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class StepStats:
    """What a step moved, waited for and gathered since its ``init`` (``step.stats()``).

    ``later - earlier`` of two snapshots is what happened between them (the peaks and the
    memory held are the later snapshot's).

    Args:
        steps: calls of the step.
        bytes: ``(op, tier) -> bytes`` this rank sent, by hpf.comm.cost's ring model
            (``op``: all_gather, reduce_scatter, all_reduce; ``tier``: fast or slow), and under
            distributed Muon ``("muon", tier)``: the payload of its point-to-point pieces.
        step_s, optimizer_s, comm_wait_s, compile_s: seconds summed over the steps, as each
            step's metrics report them (``comm_wait_s``: compute blocked on a collective).
        gathers: unit gathers; ``extra_gathers`` those beyond loop-style use (each unit once in
            forward and at most once in backward).
        peak_blocks, peak_bytes: the most block units gathered at once, and their bytes.
        live_blocks, live_bytes: the block units, and the bytes, gathered now (a closed step's:
            what its close left held, nothing unless a param tensor outlived it).

    Raises:
        Nothing.
    """

    steps: int = 0
    bytes: Counter = field(default_factory=Counter)
    step_s: float = 0.0
    optimizer_s: float = 0.0
    comm_wait_s: float = 0.0
    compile_s: float = 0.0
    gathers: int = 0
    extra_gathers: int = 0
    peak_blocks: int = 0
    peak_bytes: int = 0
    live_blocks: int = 0
    live_bytes: int = 0

    def __sub__(self, earlier: "StepStats") -> "StepStats":
        delta = {f: getattr(self, f) - getattr(earlier, f) for f in _SUMMED}
        return StepStats(bytes=Counter({k: n - earlier.bytes.get(k, 0) for k, n in self.bytes.items()}), **delta,
                         peak_blocks=self.peak_blocks, peak_bytes=self.peak_bytes, live_blocks=self.live_blocks,
                         live_bytes=self.live_bytes)

    def slow_bytes(self) -> dict[str, int]:
        """op -> bytes this rank sent across the slow tier."""
        return {op: n for (op, tier), n in self.bytes.items() if tier == "slow"}


#: the fields of StepStats that are the engine's own gather counts (hpf.engine.gather.MemoryStats has
#: each, by the same name: ``step.stats()`` takes them from there)
GATHER_STATS = ("gathers", "extra_gathers", "peak_blocks", "peak_bytes", "live_blocks", "live_bytes")
_SUMMED = ("steps", "step_s", "optimizer_s", "comm_wait_s", "compile_s", "gathers", "extra_gathers")
