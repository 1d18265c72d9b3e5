"""What each piece of a step costs, from the plan alone: collectives per tier, a unit's compute and update.

``Options`` says what runs; a unit's costs are its compute, its copies, its update and its
buckets' collective stages in order.

Communication is alpha-beta per tier on the plan report's byte model (``hpf.report``): a
stage over p ranks of one tier takes ``latency + (p-1)*alpha + bytes/beta``, where
``bytes`` is what one rank sends on that tier (``(p-1)/p * n`` for a ring over an n-byte
buffer). So the simulator's bytes are the plan report's bytes, by construction.

hpf.sim.model times ``unit_costs`` on a ``hpf.sim.timeline.Timeline``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..planning import ROOT, Plan
from ..comm.cost import bucket_comm_bytes, codec_bytes
from ..engine.replay import in_shared_memory
from ..engine.residency import RESIDENT_UNITS
from .hardware import Hardware, Link

__all__ = ["ring_time", "allreduce_time", "two_tier_time", "stage_time", "Options", "default_unit_flops", "Unit",
           "unit_costs", "partial_sums_s", "stage", "flat_time", "shared", "ADAMW_BYTES_PER_ELEMENT"]

ADAMW_BYTES_PER_ELEMENT = 28  # read param, grad, m, v; write param, m, v (fp32)


# -- alpha-beta formulas ---------------------------------------------------------------------
def ring_time(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring all-gather or reduce-scatter of an ``nbytes`` buffer over p ranks."""
    return (p - 1) * alpha + (p - 1) / p * nbytes / beta if p > 1 else 0.0


def allreduce_time(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather."""
    return 2 * ring_time(p, nbytes, alpha, beta)


def two_tier_time(p_fast: int, p_slow: int, nbytes: float, fast: Link, slow: Link) -> float:
    """Hierarchical all-gather or reduce-scatter: a fast-tier stage on the whole buffer and a
    slow-tier stage on 1/p_fast of it (serial for one buffer; the schedule pipelines buckets)."""
    return ring_time(p_fast, nbytes, fast.alpha, fast.beta) + ring_time(p_slow, nbytes / p_fast, slow.alpha, slow.beta)


def stage_time(link: Link, p: int, nbytes_sent: float, op: str = "all_gather") -> float:
    """One tier's stage: ``nbytes_sent`` is what one rank sends (the report's per-tier bytes)."""
    if p <= 1:
        return 0.0
    alpha, beta = link.figures(op)
    return link.latency + (p - 1) * alpha + nbytes_sent / beta


# -- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """What runs: ``strategy`` "hpf" (also HSDP: an hsdp plan), "fsdp2" or "ddp"; for hpf,
    ``topology`` (TieredComm on worker threads; False: torch.distributed ops on one process
    group), ``hierarchical``, ``pipeline``, ``overlap_optimizer``, and ``shm`` (the fast tier is
    shared memory: units stay mapped, no re-gather). ``emulated_slow``: an hpf.SlowLink's
    (latency, bandwidth) stretching slow-tier stages. Dtype sizes in bytes."""

    strategy: str = "hpf"
    topology: bool = True
    hierarchical: bool = True
    pipeline: bool = True
    overlap_optimizer: bool = True
    shm: bool = False
    compute_bytes: int = 4
    reduce_bytes: int = 4
    emulated_slow: tuple[float, float] | None = None
    ddp_bucket_bytes: int = 40_000_000 * 4  # Megatron's default bucket: 40M params, fp32 grads
    steps: int = 3  # simulated; the last is reported (steady state)
    accumulate: int = 1  # hpf: micro-batches per step (each gathers again; one reduction, after the last)
    recompute: frozenset = frozenset()  # hpf: units that recompute their forward in backward (checkpointed)
    muon_s: float = 0.0  # hpf: distributed Muon's tax after the decision (hpf.sim.muon_tax); 0: AdamW
    resident_units: int = RESIDENT_UNITS  # hpf: the residency bound (hpf.StepConfig's)



def default_unit_flops(plan: Plan, tokens: int) -> dict[str, float]:
    """Forward FLOPs per unit when the model gives none: 2 x tokens x its matrix params."""
    out: dict[str, float] = defaultdict(float)
    for s in plan.slots.values():
        if len(s.local_shape) >= 2:
            out[s.unit] += 2.0 * tokens * s.numel
    return {u: out.get(u, 0.0) for u in plan.units}


@dataclass
class Unit:
    name: str
    fwd_s: float
    bwd_s: float
    gather: list  # per bucket: [(worker, seconds, tier, op, bytes)] stages in order
    reduce: list
    update_s: float
    gather_copy_s: float = 0.0  # FSDP2's copy-out of the gathered buffer into params
    reduce_copy_s: float = 0.0  # packing grads into the flat reduce buffer (both)
    full_grad_bytes: int = 0
    a2a_s: float = 0.0  # per pass (forward, backward): blocking collectives (MoE dispatch + combine, TP psums)
    recompute: bool = False  # its forward runs again in backward (compute_floor counts it)
    issue_s: float = 0.0  # compute-thread seconds to issue one of its gathers or reductions (all buckets)
    land_s: float = 0.0  # compute-thread seconds when its reductions land (the gloo reduce-scatter's local sum)
    holds_grads: bool = True  # its reductions hold flat grads of their own (not the shared-memory tier's)


# -- per-unit costs from the plan ----------------------------------------------------------------
def unit_costs(plan: Plan, hw: Hardware, opts: Options, flops: dict, measured: dict | None,
                a2a: dict | None = None, psums: dict | None = None) -> list[Unit]:
    mesh = plan.mesh
    world = mesh.size
    emu = Link(alpha=0.0, beta=opts.emulated_slow[1], latency=opts.emulated_slow[0]) if opts.emulated_slow else None
    units = []
    for name, unit in plan.units.items():
        overhead = 2 * hw.overhead(hw.kernel_overhead_s, world) if opts.strategy == "hpf" else 0.0
        if measured is not None:  # calibrated seconds of forward + backward on this machine
            total = (measured["root_s"] if name == ROOT else measured["block_s"]) + overhead
        else:
            total = 3 * flops.get(name, 0.0) / (hw.peak_flops * hw.efficiency) + overhead
        gathers, reduces, numel, full_grad, issue, land = [], [], 0, 0, 0.0, 0.0
        for bi in unit.buckets:
            b = plan.buckets[bi]
            numel += b.shard_numel
            full_grad += b.padded_numel * opts.reduce_bytes
            if opts.strategy == "ddp":
                continue
            hier = opts.strategy == "hpf" and opts.topology and opts.hierarchical
            slow = plan.slow_precision if hier else None  # a low-bit slow tier: fewer bytes, plus its quantize passes
            per_op = bucket_comm_bytes(mesh, b, _dtype(opts.compute_bytes), _dtype(opts.reduce_bytes), hier, slow)
            codec = {op: n / hw.mem_bw for op, n in codec_bytes(mesh, b, _dtype(opts.compute_bytes),
                                                                 _dtype(opts.reduce_bytes), slow).items()}
            ag, rs, ar = per_op["all_gather"], per_op["reduce_scatter"], per_op["all_reduce"]
            fast_axes = tuple(a for a in b.shard_axes if a in mesh.fast_axes)
            p_fast = mesh.axis_size(fast_axes)
            p_slow = b.shard_size // p_fast
            g, r = _stages(hw, opts, world, b.shard_size, p_fast, p_slow, ag, rs, hier, emu)
            g, r = _on_slow(g, codec["all_gather"]), _on_slow(r, codec["reduce_scatter"])
            if opts.strategy == "hpf" and not opts.topology and hw.shared_links and b.shard_size > 1:
                # BucketComm on gloo: an all-to-all, then the waiting (compute) thread sums the p slices
                # (handles.reduce_scatter_async): p-1 adds of n/p, 3 accesses each. The calibrated
                # reduce-scatter includes the sum: the worker's stage is the rest.
                s = 3 * (b.shard_size - 1) / b.shard_size * b.padded_numel * opts.reduce_bytes / hw.mem_bw
                land += s
                r = [(r[0][0], max(r[0][1] - s, 0.0)) + r[0][2:]] + r[1:]
            if opts.strategy == "hpf" and b.shard_size > 1:  # calibrated through hpf's comm: shm or gloo
                issue += _fast_link(hw, opts, b.shard_size, world).issue_s
            if ar["fast"] or ar["slow"]:  # HSDP: the replica all-reduce follows the reduce-scatter
                m = mesh.axis_size(b.replicate_axes)
                worker = "reduce-slow" if opts.strategy == "hpf" and opts.topology else "replica"
                t, link = flat_time(hw, opts, world, m, ar, "all_reduce", emu, steps=2 * (m - 1))
                r.append(stage(worker, link, t + codec["all_reduce"], "slow" if ar["slow"] else "fast", "all_reduce", ar))
            gathers.append(g)
            reduces.append(r)
        # read + write; FSDP2's copies are in its calibrated collectives where those exist (Link.ops)
        copies = opts.strategy != "fsdp2" or not hw.link("slow", world, world).ops
        copy = lambda nbytes: 2 * nbytes / hw.mem_bw if copies else 0.0  # noqa: E731
        units.append(Unit(
            name, total / 3, 2 * total / 3, gathers, reduces,
            update_s=numel * ADAMW_BYTES_PER_ELEMENT / hw.mem_bw,
            gather_copy_s=copy(sum(plan.buckets[bi].padded_numel for bi in unit.buckets) * opts.compute_bytes),
            reduce_copy_s=copy(full_grad), full_grad_bytes=full_grad, issue_s=issue, land_s=land,
            a2a_s=(_a2a_time(hw, opts, plan, *a2a[name]) if a2a and name in a2a else 0.0)
            + sum(_psum_time(hw, opts, plan, n, plan.compute_axes) for n in (psums or {}).get(name, ())),
            recompute=name in opts.recompute,
            holds_grads=not all(shared(plan, opts, b) for b in unit.buckets if not plan.buckets[b].frozen)))
    return units


def _on_slow(stages: list, seconds: float) -> list:
    """``stages`` with ``seconds`` more on the slow-tier one (the quantize passes run on its worker)."""
    return [(w, t + seconds, tier, *rest) if tier == "slow" else (w, t, tier, *rest) for w, t, tier, *rest in stages]


def _a2a_time(hw: Hardware, opts: Options, plan: Plan, nbytes: int, axes: tuple[str, ...]) -> float:
    """Dispatch + combine of ``nbytes`` (one rank's tokens) over ``axes``: each rank keeps 1/p."""
    mesh = plan.mesh
    p = mesh.axis_size(axes)
    tier = "fast" if all(a in mesh.fast_axes for a in axes) else "slow"
    link = _fast_link(hw, opts, p, mesh.size) if tier == "fast" else hw.link("slow", p, mesh.size)
    return 2 * stage_time(link, p, (p - 1) / p * nbytes, "all_to_all")


def _psum_time(hw: Hardware, opts: Options, plan: Plan, nbytes: int, axes: tuple[str, ...]) -> float:
    """One blocking all-reduce of ``nbytes`` over ``axes`` (a tensor-parallel psum): a ring, 2(p-1)
    steps, each rank sending 2(p-1)/p of the buffer."""
    mesh = plan.mesh
    p = mesh.axis_size(axes)
    if p <= 1:
        return 0.0
    fast = all(a in mesh.fast_axes for a in axes)
    link = _fast_link(hw, opts, p, mesh.size) if fast else hw.link("slow", p, mesh.size)
    alpha, beta = link.figures("all_reduce")
    return link.latency + 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta


def partial_sums_s(plan: Plan, hw: Hardware, opts: Options) -> float:
    """The all-reduces, after every reduction landed, of the grad shards of params replicated over
    non-FSDP axes (their grads are partial sums there: hpf.comm.collectives): one fused all-reduce
    per group of axes (hpf.engine.reduce.sum_partials)."""
    fused: dict[tuple, int] = {}
    for b in plan.buckets:
        for axes, n in plan.partial_numel(b).items():
            fused[axes] = fused.get(axes, 0) + n * opts.reduce_bytes
    return sum(_psum_time(hw, opts, plan, n, axes) for axes, n in fused.items())


def _dtype(nbytes: int):
    import torch

    return {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[nbytes]


def stage(worker: str, link: Link, seconds: float, tier: str, op: str, nbytes: dict) -> tuple:
    """A stage for the timeline: (worker, seconds alone, tier, op, bytes, link); the link's
    contention figures apply where it overlaps compute (``Timeline.submit``)."""
    return worker, seconds, tier, op, nbytes, link


def flat_time(hw: Hardware, opts: Options, world: int, p: int, tiers: dict, op: str, emu: Link | None,
               steps: int | None = None) -> tuple[float, Link]:
    """One collective over p ranks that spans both tiers in one stage (a flat ring): (seconds, its link)."""
    if p <= 1:
        return 0.0, Link(alpha=0.0, beta=1.0)
    slow, fast = hw.link("slow", p, world), _fast_link(hw, opts, p, world)
    alpha, beta = slow.figures(op)
    steps = p - 1 if steps is None else steps
    if hw.shared_links:  # one host: both tiers' bytes go through the same transport
        t = slow.latency + steps * alpha + (tiers["fast"] + tiers["slow"]) / beta
    else:  # separate networks: the slowest tier bounds the ring
        t = slow.latency + steps * alpha + max(tiers["fast"] / fast.figures(op)[1], tiers["slow"] / beta)
    if emu is not None and tiers["slow"]:
        t = max(t, emu.latency + tiers["slow"] / emu.beta)
    return t, slow


def _fast_link(hw: Hardware, opts: Options, p: int, world: int) -> Link:
    if hw.shared_links and not opts.shm:  # a local run's fast tier on torch.distributed is gloo too
        return hw.link("slow", p, world)
    return hw.link("fast", p, world)


def _stages(hw, opts, world, p, p_fast, p_slow, ag, rs, hier, emu):
    """(gather stages, reduce stages) of one bucket: (worker, seconds, tier, op, bytes) each."""
    if opts.strategy == "hpf" and opts.topology and hier and p_fast > 1:
        fast = _fast_link(hw, opts, p_fast, world)
        slow = hw.link("slow", p_slow, world)

        def slow_t(tiers, op):
            t = stage_time(slow, p_slow, tiers["slow"], op)
            return max(t, emu.latency + tiers["slow"] / emu.beta) if emu is not None and tiers["slow"] else t
        g = [stage("gather-slow", slow, slow_t(ag, "all_gather"), "slow", "all_gather", {"slow": ag["slow"]}),
             stage("gather-fast", fast, stage_time(fast, p_fast, ag["fast"], "all_gather"), "fast", "all_gather",
                    {"fast": ag["fast"]})]
        r = [stage("reduce-fast", fast, stage_time(fast, p_fast, rs["fast"], "reduce_scatter"), "fast",
                    "reduce_scatter", {"fast": rs["fast"]}),
             stage("reduce-slow", slow, slow_t(rs, "reduce_scatter"), "slow", "reduce_scatter", {"slow": rs["slow"]})]
        return g, r  # a bucket with no slow part still passes the slow worker, in order, as in TieredComm
    tier = "slow" if ag["slow"] else "fast"
    ag_op, rs_op = ("all_gather", "reduce_scatter") if opts.strategy == "hpf" else ("fsdp2_all_gather",
                                                                                   "fsdp2_reduce_scatter")
    if opts.strategy == "hpf" and opts.topology:  # TieredComm, one flat stage on the slow worker
        gw, rw = "gather-slow", "reduce-slow"
    elif hw.shared_links:  # torch.distributed on one process group: one gloo thread runs them in order
        gw = rw = "pg"
    else:  # accelerator streams: all-gather and reduce-scatter on their own streams
        gw, rw = "ag", "rs"
    return ([stage(gw, *flat_time(hw, opts, world, p, ag, ag_op, emu)[::-1], tier, "all_gather", ag)],
            [stage(rw, *flat_time(hw, opts, world, p, rs, rs_op, emu)[::-1], tier, "reduce_scatter", rs)])


def shared(plan: Plan, opts: Options, b: int) -> bool:
    """Whether bucket ``b``'s full buffer and grad rows are in the shared-memory fast tier."""
    return opts.shm and in_shared_memory(plan.mesh, plan.buckets[b], opts.hierarchical)
