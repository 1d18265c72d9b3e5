"""The plan report: per-rank memory and per-step communication, computed from the plan alone.

Bytes follow hpf/comm/cost.py's model, the one the comms' byte counters use.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from .comm.cost import TIERS, bucket_comm_bytes, codec_bytes, dtype_bytes, feedback_numel
from .engine.replay import ScheduleInputs, in_shared_memory, whole_in
from .engine.residency import RESIDENT_UNITS
from .planning import OPS
from .sharded_init import temporary_bytes
from .tree import ROOT

__all__ = ["PlanReport", "fixed", "size", "millions"]


def fixed(value: float, least: int = 2, sep: str = "") -> str:
    """``value`` with ``least`` decimals, or more where it needs them to show 3 significant digits:
    a tiny model's megabytes are 0.0234, not 0.00. ``sep``: "," groups the thousands."""
    places = max(least, 2 - math.floor(math.log10(abs(value)))) if value else least
    return f"{value:{sep}.{places}f}"


def size(nbytes: float) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB, at a precision that shows them."""
    return f"{fixed(nbytes / 2**30)} GiB" if nbytes >= 2**30 else f"{fixed(nbytes / 2**20, 1)} MiB"


def millions(n: float) -> str:
    """A count of params in millions, at a precision that shows it (a tiny model's 0.0737M)."""
    return f"{fixed(n / 1e6, 1, ',')}M"


@dataclass
class PlanReport:
    world_size: int
    params_bytes: int  # per rank: the stored shards (master dtype)
    grad_bytes: int  # per rank: flat shard grads (reduce dtype)
    optimizer_bytes: int  # per rank
    peak_gathered_bytes: int  # per rank: root + the largest ``resident_units`` block units, full, compute dtype
    padded_total_bytes: int  # stored over all ranks: each bucket's padded buffer once per replica
    comm: dict[str, dict[str, int]] = field(default_factory=dict)  # collective -> tier -> bytes/step
    layouts: dict[str, int] = field(default_factory=dict)  # "FSDP over .. / split over .." -> params (global)
    slow_precision: str = ""  # the low-bit slow tier in words ("" when off)
    codec_bytes: int = 0  # per rank and step: memory the quantize/dequantize passes read and write
    feedback_bytes: int = 0  # per rank: error-feedback residuals (fp32)
    full_params_bytes: int = 0  # every param once, whole (what step.init(full params) takes on every rank)
    init_temporary_bytes: int = 0  # per rank: the born-sharded init's temporaries (hpf.sharded_init)

    @classmethod
    def of(cls, plan, *, compute_dtype: torch.dtype | None = None, master_dtype: torch.dtype | None = None,
           reduce_dtype: torch.dtype | None = None, optimizer_states: int = 2,
           hierarchical: bool = False, shm: bool = False, resident_units: int = RESIDENT_UNITS) -> "PlanReport":
        """``plan``: an hpf.Plan. A loop-style loss function is assumed, and the engine's
        schedule for it (hpf.engine.replay): backward re-gathers every block but the last
        ``resident_units``, which are still gathered when it starts, and the units the engine
        keeps gathered for good; ``shm``: the fast tier of ``hierarchical`` collectives is shared
        memory (CPU ranks of one host, what hpf train runs there), whose units stay gathered."""
        mesh = plan.mesh
        units = list(plan.units)  # each unit's gathers in a step: the engine's schedule (hpf.engine.replay)

        def kept(b: int) -> bool:  # as the engine decides it (hpf.engine.gather's ``kept``)
            bucket = plan.buckets[b]
            return (whole_in(bucket, dtype_bytes(compute_dtype or bucket.dtype))
                    or shm and in_shared_memory(mesh, bucket, hierarchical))
        (step,) = ScheduleInputs.of(plan, kept, resident_units=resident_units).replay()
        gathers_of = Counter(e.unit for e in step.events if e.kind == "gather")
        params = grads = opt = padded_total = full = 0
        unit_bytes: dict[str, int] = {}
        comm = {op: dict.fromkeys(TIERS, 0) for op in OPS}
        layouts: dict[str, int] = {}
        slow = plan.slow_precision
        codec = feedback = 0
        for b in plan.buckets:
            key = (f"FSDP over ({','.join(b.shard_axes) or '-'})"
                   + (f", computed split over ({','.join(b.split_axes)})" if b.split_axes else ""))
            numel = sum(math.prod(s.global_shape) for s in b.slots)
            layouts[key] = layouts.get(key, 0) + numel
            full += numel * dtype_bytes(b.dtype)
            master = dtype_bytes(master_dtype or b.dtype)
            compute = dtype_bytes(compute_dtype or b.dtype)
            reduce_dtype_b = reduce_dtype or master_dtype or b.dtype
            params += b.shard_numel * master
            if not b.frozen:  # frozen params have no grads and no optimizer state
                grads += b.shard_numel * dtype_bytes(reduce_dtype_b)
                opt += b.shard_numel * 4 * optimizer_states
            replicas = mesh.size // b.shard_size
            padded_total += b.padded_numel * master * replicas
            unit_bytes[b.unit] = unit_bytes.get(b.unit, 0) + b.padded_numel * compute
            gathers = gathers_of[b.unit]
            ops = bucket_comm_bytes(mesh, b, compute_dtype or b.dtype, reduce_dtype_b, hierarchical, slow)
            for op, tiers in ops.items():
                for tier, n in tiers.items():
                    comm[op][tier] += (gathers if op == "all_gather" else 1) * n
            for op, n in codec_bytes(mesh, b, compute_dtype or b.dtype, reduce_dtype_b, slow).items():
                codec += (gathers if op == "all_gather" else 1) * n
            feedback += 4 * feedback_numel(mesh, b, slow)
        blocks = sorted((v for k, v in unit_bytes.items() if k != ROOT), reverse=True)
        peak = unit_bytes.get(ROOT, 0) + sum(blocks[:resident_units])  # (the engine's residency bound)
        return cls(mesh.size, params, grads, opt, peak, padded_total, comm, layouts,
                   slow.describe() if slow else "", codec, feedback, full, temporary_bytes(plan))

    @property
    def comm_total(self) -> dict[str, int]:
        return {t: sum(c[t] for c in self.comm.values()) for t in TIERS}

    @property
    def init_peak_bytes(self) -> int:
        """A rank's peak during ``step.init(init_fn, key=...)``: its state, and the temporaries of
        one chunk (hpf.sharded_init)."""
        return (self.params_bytes + self.grad_bytes + self.optimizer_bytes + self.feedback_bytes
                + self.init_temporary_bytes)

    def format(self) -> str:
        def mib(n: int) -> str:
            return f"{fixed(n / 2**20):>12} MiB"

        lines = [f"params {millions(n):>15}  {key}" for key, n in self.layouts.items()] + [
            f"per-rank memory ({self.world_size} ranks)",
            f"  params (shards)      {mib(self.params_bytes)}",
            f"  grads (shards)       {mib(self.grad_bytes)}",
            f"  optimizer state      {mib(self.optimizer_bytes)}",
            f"  peak gathered units  {mib(self.peak_gathered_bytes)}",
            *([f"  error feedback       {mib(self.feedback_bytes)}"] if self.feedback_bytes else []),
            f"  init peak            {mib(self.init_peak_bytes)}   (born sharded: the state and one chunk of "
            f"draws; step.init(full params) adds the full params, {fixed(self.full_params_bytes / 2**20)} MiB)",
            f"  padded total, all ranks {size(self.padded_total_bytes)}",
            "per-rank bytes sent per step         fast tier          slow tier",
        ]
        for name, tiers in self.comm.items():
            lines.append(f"  {name:<16}  {mib(tiers['fast'])}   {mib(tiers['slow'])}")
        tot = self.comm_total
        lines.append(f"  {'total':<16}  {mib(tot['fast'])}   {mib(tot['slow'])}")
        if self.slow_precision:
            lines.append(f"  slow tier low-bit: {self.slow_precision}; quantize and dequantize move "
                         f"{self.codec_bytes / 2**20:.2f} MiB through memory per step")
        return "\n".join(lines)
