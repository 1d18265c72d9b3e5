"""What a job asks of the network: `Topology` (``hpf.shard_step(..., topology=...)``), how FSDP
collectives use the fast and slow tiers, the slow tier's precision among its options, and
`SlowLink`, the slow-link emulation for benchmarks on one host. Plain configuration that the
plan, the comm, the step and the CLI all read, so it sits below them (``hpf.comm.tiered.TieredComm``
carries it out)."""
from __future__ import annotations

from dataclasses import dataclass

from .precision import SlowPrecision

__all__ = ["COLLECTIVE_TIMEOUT_S", "SlowLink", "Topology", "check_bucket_bytes"]

# A collective that waits this long for a peer raises: how a hung or dead rank is found. It
# bounds a wait, never a healthy run, which may take as long as it needs. (hpf.launch's process
# groups, the two-tier workers and shared memory all default to it; hpf.comm.world re-exports it.)
COLLECTIVE_TIMEOUT_S = 300.0


def check_bucket_bytes(bucket_bytes: int) -> None:
    """The cap on one fused collective (``Topology.bucket_bytes``, ``hpf.plan``'s ``bucket_bytes``)."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: use a byte count > 0, or 0 for one bucket per unit")


@dataclass(frozen=True)
class SlowLink:
    """EMULATION for benchmarks on one host: every slow-tier collective also sleeps
    ``latency_s + bytes / bandwidth`` (bytes this rank sends across the slow tier), as a
    slower network would take. Never use it in a real run.

    Args:
        latency_s: seconds added to every slow-tier collective.
        bandwidth: bytes per second per rank (inf: latency only).

    Raises:
        Nothing: any numbers are accepted; the sleep is never negative.
    """

    latency_s: float = 0.0
    bandwidth: float = float("inf")  # bytes per second per rank

    def delay(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Topology:
    """How FSDP collectives use the two tiers (``hpf.shard_step(..., topology=Topology())``).

    Args:
        hierarchical: two-stage collectives (slow-tier traffic / n_fast); False: flat ones,
            still run on the tier workers.
        fast_major: number shards fast axes first, so each stage moves one contiguous block;
            False (the default): node-major, a machine holds one contiguous region of every
            bucket, so most matrices lie inside one machine and Muon's owner sits there, while
            the collectives stay two-stage with the same bytes per tier (docs/topology.md).
        pipeline: reductions overlap the rest of backward; False waits for each unit's.
        fast_transport: "shm" (shared memory, CPU ranks of one host), "pg" (torch.distributed),
            or "auto" (shm when every rank is a CPU process on one host).
        slow_link: an emulated slow link, for benchmarks only.
        shm_bytes: the shared-memory capacity; 0 sizes it from the plan.
        timeout_s: seconds a collective may take before it raises instead of hanging.
        bucket_bytes: split units into buckets of at most this many bytes, each its own fused
            collective, so one bucket's slow stage overlaps the next one's fast stage (0: a
            bucket per unit).
        slow_weights, slow_grads, slow_block, slow_error_feedback: the low-bit slow tier (None:
            full precision): the formats weights are gathered in and grads exchanged in across
            the slow tier, values per scale, and error feedback for the grads
            (:class:`hpf.precision.SlowPrecision` says what each allows).

    Raises:
        ValueError: ``fast_transport`` is not "auto", "shm" or "pg", ``bucket_bytes`` is not an
            int >= 0, a slow-tier option is not allowed (the message lists what is), or a
            low-bit slow tier is asked for with ``hierarchical=False`` (the fast tier would
            carry quantized data too).
    """

    hierarchical: bool = True
    fast_major: bool = False
    pipeline: bool = True
    fast_transport: str = "auto"
    slow_link: SlowLink | None = None
    shm_bytes: int = 0  # shared-memory capacity; 0 sizes it from the plan
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    bucket_bytes: int = 0  # cap on one fused collective (hpf.plan's bucket_bytes); 0: one per unit
    slow_weights: str | None = None
    slow_grads: str | None = None
    slow_block: int = 128
    slow_error_feedback: bool = False

    def __post_init__(self):
        if self.fast_transport not in ("auto", "shm", "pg"):
            raise ValueError(f"fast_transport={self.fast_transport!r}: use 'auto', 'shm' or 'pg'")
        check_bucket_bytes(self.bucket_bytes)
        slow = self.slow_precision  # validates the slow-tier options
        if slow is not None and not self.hierarchical:
            raise ValueError(f"slow_weights={self.slow_weights!r}, slow_grads={self.slow_grads!r} with "
                             "hierarchical=False: a flat collective has no slow stage of its own to quantize (the "
                             "fast tier stays at full precision); use hierarchical=True")

    @classmethod
    def with_slow(cls, slow: SlowPrecision | None, **options) -> "Topology":
        """A topology whose slow tier is ``slow`` (None: full precision), with these other options."""
        if slow is None:
            return cls(**options)
        return cls(**options, slow_weights=slow.weights, slow_grads=slow.grads, slow_block=slow.block,
                   slow_error_feedback=slow.error_feedback)

    def plan_options(self) -> dict:
        """What of this topology shapes the plan (``hpf.plan``'s keyword arguments)."""
        return {"fast_major": self.hierarchical and self.fast_major, "bucket_bytes": self.bucket_bytes,
                "slow_precision": self.slow_precision}

    @property
    def slow_precision(self) -> SlowPrecision | None:
        """The low-bit slow tier these options ask for, or None (full precision)."""
        if self.slow_weights is None and self.slow_grads is None and not self.slow_error_feedback:
            return None
        return SlowPrecision(self.slow_weights, self.slow_grads, self.slow_block, self.slow_error_feedback)
