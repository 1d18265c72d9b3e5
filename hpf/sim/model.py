"""The cost model and the step's schedule as an event simulation over FSDP units.

Communication is alpha-beta per tier on the plan report's byte model (``hpf.report``): a
stage over p ranks of one tier takes ``latency + (p-1)*alpha + bytes/beta``, where
``bytes`` is what one rank sends on that tier (``(p-1)/p * n`` for a ring over an n-byte
buffer). So the simulator's bytes are the plan report's bytes, by construction.

hpf's schedule is the engine's own (``hpf_schedule``: hpf.engine.replay runs the engine's
residency and reduction policies on the model's reads); this module times it as
``hpf.engine`` and ``hpf.comm.tiered.TieredComm`` run it: one compute thread; collectives on
FIFO workers (one per tier and direction for the two-tier comm, one per process group for
torch.distributed); gathers issued where the policy decides them (a prefetch at the read of
the unit before), re-gathers in backward, reductions that overlap the next unit's backward
(pipeline) within the bound of reductions in flight, one all-reduce that decides, then the
update, and the next step's first gathers issued after theirs: the exposed boundary chain.
FSDP2 and Megatron DDP run through the same machinery with their own schedules.

Calibrated compute is the slowest rank's, so the simulated rank is the slowest and its step
time the job's. Where ranks share cores the others finish the same work ``skew`` earlier and
wait it out in collectives: the exposed share reported is that mean rank's, from a replay
whose CPU work is ``1 - skew`` as long and whose collectives start no earlier than the
slowest rank issued them.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from ..planning import ROOT, Plan
from ..comm.cost import bucket_comm_bytes, codec_bytes, collective_bytes, dtype_bytes
from ..engine.reduce import to_wait
from ..engine.replay import ScheduleInputs, StepEvents, in_shared_memory, whole_in
from ..engine.residency import RESIDENT_UNITS
from .hardware import Hardware, Link

__all__ = ["ring_time", "allreduce_time", "two_tier_time", "Options", "SimResult", "simulate_plan",
           "default_unit_flops", "compute_floor", "hpf_schedule"]

CONTENTION_PASSES = 6  # replays on the earlier passes' compute (averaged: settles in ~5)
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


@dataclass
class SimResult:
    step_s: float
    compute_s: float
    exposed_comm_s: float  # compute waiting on collectives (the engine's comm_wait_s)
    optimizer_s: float
    busy_s: dict[str, float]  # per tier: seconds its links were busy
    bytes: dict[str, dict[str, int]]  # collective -> tier -> bytes one rank sent per step
    tokens: int = 0  # global tokens per step

    @property
    def exposed_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s else 0.0


def default_unit_flops(plan: Plan, tokens: int) -> dict[str, float]:
    """Forward FLOPs per unit when the model gives none: 2 x tokens x its matrix params."""
    out: dict[str, float] = defaultdict(float)
    for s in plan.slots.values():
        if len(s.local_shape) >= 2:
            out[s.unit] += 2.0 * tokens * s.numel
    return {u: out.get(u, 0.0) for u in plan.units}


@dataclass
class _Unit:
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
def _unit_costs(plan: Plan, hw: Hardware, opts: Options, flops: dict, measured: dict | None,
                a2a: dict | None = None, psums: dict | None = None) -> list[_Unit]:
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
                # (transport.reduce_scatter_async): p-1 adds of n/p, 3 accesses each. The calibrated
                # reduce-scatter includes the sum: the worker's stage is the rest.
                s = 3 * (b.shard_size - 1) / b.shard_size * b.padded_numel * opts.reduce_bytes / hw.mem_bw
                land += s
                r = [(r[0][0], max(r[0][1] - s, 0.0)) + r[0][2:]] + r[1:]
            if opts.strategy == "hpf" and b.shard_size > 1:  # calibrated through hpf's comm: shm or gloo
                issue += _fast_link(hw, opts, b.shard_size, world).issue_s
            if ar["fast"] or ar["slow"]:  # HSDP: the replica all-reduce follows the reduce-scatter
                m = mesh.axis_size(b.replicate_axes)
                worker = "reduce-slow" if opts.strategy == "hpf" and opts.topology else "replica"
                t, link = _flat_time(hw, opts, world, m, ar, "all_reduce", emu, steps=2 * (m - 1))
                r.append(_stage(worker, link, t + codec["all_reduce"], "slow" if ar["slow"] else "fast", "all_reduce", ar))
            gathers.append(g)
            reduces.append(r)
        # read + write; FSDP2's copies are in its calibrated collectives where those exist (Link.ops)
        copies = opts.strategy != "fsdp2" or not hw.link("slow", world, world).ops
        copy = lambda nbytes: 2 * nbytes / hw.mem_bw if copies else 0.0  # noqa: E731
        units.append(_Unit(
            name, total / 3, 2 * total / 3, gathers, reduces,
            update_s=numel * ADAMW_BYTES_PER_ELEMENT / hw.mem_bw,
            gather_copy_s=copy(sum(plan.buckets[bi].padded_numel for bi in unit.buckets) * opts.compute_bytes),
            reduce_copy_s=copy(full_grad), full_grad_bytes=full_grad, issue_s=issue, land_s=land,
            a2a_s=(_a2a_time(hw, opts, plan, *a2a[name]) if a2a and name in a2a else 0.0)
            + sum(_psum_time(hw, opts, plan, n, plan.compute_axes) for n in (psums or {}).get(name, ())),
            recompute=name in opts.recompute,
            holds_grads=not all(_shared(plan, opts, b) for b in unit.buckets if not plan.buckets[b].frozen)))
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


def _stage(worker: str, link: Link, seconds: float, tier: str, op: str, nbytes: dict) -> tuple:
    """A stage for the timeline: (worker, seconds alone, tier, op, bytes, link); the link's
    contention figures apply where it overlaps compute (``_Timeline.submit``)."""
    return worker, seconds, tier, op, nbytes, link


def _flat_time(hw: Hardware, opts: Options, world: int, p: int, tiers: dict, op: str, emu: Link | None,
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
        g = [_stage("gather-slow", slow, slow_t(ag, "all_gather"), "slow", "all_gather", {"slow": ag["slow"]}),
             _stage("gather-fast", fast, stage_time(fast, p_fast, ag["fast"], "all_gather"), "fast", "all_gather",
                    {"fast": ag["fast"]})]
        r = [_stage("reduce-fast", fast, stage_time(fast, p_fast, rs["fast"], "reduce_scatter"), "fast",
                    "reduce_scatter", {"fast": rs["fast"]}),
             _stage("reduce-slow", slow, slow_t(rs, "reduce_scatter"), "slow", "reduce_scatter", {"slow": rs["slow"]})]
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
    return ([_stage(gw, *_flat_time(hw, opts, world, p, ag, ag_op, emu)[::-1], tier, "all_gather", ag)],
            [_stage(rw, *_flat_time(hw, opts, world, p, rs, rs_op, emu)[::-1], tier, "reduce_scatter", rs)])


# -- the event simulation -------------------------------------------------------------------------
class _Timeline:
    """One rank's compute thread and FIFO collective workers; times in seconds.

    ``speed`` and ``peers`` make it a rank ahead of the slowest: its CPU work takes ``speed`` x
    the calibrated (slowest rank's) seconds, and no collective starts before the slowest rank
    issued it (``peers``: that rank's issue time of each collective, by ``_key``)."""

    def __init__(self, history: list[tuple[list, float]] = (), speed: float = 1.0, peers: dict | None = None):
        self.speed, self.peers = speed, peers
        self.issued: dict[tuple, float] = {}  # collective -> when this rank issued it
        self._counts: Counter = Counter()
        self.t = self.t0 = 0.0
        self.free = defaultdict(float)
        self.contended: list[tuple[float, float, float]] = []  # (start, end, compute slowdown) of busy links
        self.computing: list[tuple[float, float]] = []  # this step's compute intervals from its start
        # earlier passes' last steps (compute intervals, step time), each repeated as a steady state:
        # where a stage overlaps compute. Averaged over the passes, as one pass's alignment flips the next's.
        self.history = [[(a + k * T, b + k * T) for k in (-1, 0, 1, 2) for a, b in ivs] for ivs, T in history]
        self.reset_counters()

    def begin_step(self):
        self.t0, self.computing = self.t, []

    def _overlap(self, start: float, end: float) -> float:
        """The share of [start, end) the earlier passes' steady steps spent computing."""
        if end <= start:
            return 0.0
        start, end = start - self.t0, end - self.t0
        both = sum(max(0.0, min(end, b) - max(start, a)) for ivs in self.history for a, b in ivs
                   if a < end and b > start)
        return both / (end - start) / len(self.history) if self.history else 0.0

    def reset_counters(self):
        self.busy, self.wait, self.compute_s, self.opt_s = Counter(), 0.0, 0.0, 0.0
        self.bytes = {op: {"fast": 0, "slow": 0} for op in ("all_gather", "reduce_scatter", "all_reduce")}

    def _key(self, what) -> tuple:
        """The n-th issue of a collective (a bucket's stages, or the step's all-reduce): the same
        collective on every rank, whatever order each rank's timing issued the others in."""
        self._counts[what] += 1
        return what, self._counts[what]

    def _start(self, what) -> float:
        """When a collective issued now can start: here, once the slowest rank issued it too."""
        key = self._key(what)
        self.issued[key] = self.t
        return max(self.t, self.peers.get(key, self.t)) if self.peers is not None else self.t

    def sync(self, seconds: float) -> None:
        """The step's closing all-reduce (loss and grad norm): every rank leaves it together; its
        time, and a faster rank's wait for the slowest in it, are not engine waits."""
        self.t = self._start("sync") + seconds

    def submit(self, stages, what=None) -> float:
        """Run ``stages`` (one bucket's, in order) from now; ``what`` names the collective
        (default: the stages list, which a unit keeps for its bucket). Returns when it ends."""
        t = self._start(id(stages) if what is None else what)
        for worker, seconds, tier, op, nbytes, link in stages:
            other = None
            if worker == "pg" and link.overlap < 1.0:  # gloo's two worker threads: the earlier-free one
                worker = min(("pg", "pg#2"), key=lambda w: self.free[w])
                other = "pg" if worker == "pg#2" else "pg#2"
            start = max(t, self.free[worker])
            if seconds > 0 and (link.busy_slowdown > 1.0 or link.busy_latency):  # slower beside compute
                share = self._overlap(start, start + seconds)
                seconds *= 1.0 + share * (link.busy_slowdown - 1.0)
                seconds += share * link.busy_latency
            if other is not None:  # beside one still running: + overlap x the time they share
                seconds += link.overlap * max(0.0, min(seconds, self.free[other] - start))
            t = start + seconds
            self.free[worker] = t
            if link.cpu_slowdown > 1.0 and seconds > 0:
                self.contended.append((start, t, link.cpu_slowdown))
            self.busy[tier] += seconds
            for k, n in nbytes.items():
                self.bytes[op][k] += n
        return t

    def wait_until(self, end: float):
        if end > self.t:
            self.wait += end - self.t
            self.t = end

    def run(self, seconds: float, optimizer: bool = False):
        """``seconds`` of compute-thread work; slower while a contending link is busy. Stages
        are all submitted before the compute that overlaps them (one thread issues both),
        so their busy intervals are known here."""
        start = self.t
        self.contended = [c for c in self.contended if c[1] > start]
        t, left = start, seconds * self.speed
        while left > 0:
            active = [c for c in self.contended if c[0] <= t < c[1]]
            rate = 1.0 / max((c[2] for c in active), default=1.0)
            edges = [c[1] for c in active] + [c[0] for c in self.contended if c[0] > t]
            span = min(edges, default=float("inf")) - t
            if span * rate >= left:
                t += left / rate
                break
            t += span
            left -= span * rate
        self.t = t
        if t > start:
            self.computing.append((start - self.t0, t - self.t0))
        if optimizer:
            self.opt_s += t - start
        else:
            self.compute_s += t - start


def _a2a(tl: _Timeline, u: _Unit) -> None:
    """MoE all-to-alls sit between a unit's matmuls: compute waits for them."""
    if u.a2a_s:
        tl.wait += u.a2a_s
        tl.t += u.a2a_s


def _issue(tl: _Timeline, per_bucket: list) -> float:
    return max((tl.submit(stages) for stages in per_bucket), default=tl.t)


def hpf_schedule(plan: Plan, opts: Options) -> list[StepEvents]:
    """The engine's schedule of ``opts.steps`` steps of ``plan`` for a loop-style loss function:
    hpf.engine's residency and reduction policies replayed on its reads (hpf.engine.replay)."""
    def kept(b: int) -> bool:  # gathered for good: whole in the compute dtype, or the shared-memory fast tier
        return whole_in(plan.buckets[b], opts.compute_bytes) or _shared(plan, opts, b)
    return ScheduleInputs.of(plan, kept, resident_units=opts.resident_units, recompute=opts.recompute,
                             accumulate=opts.accumulate).replay(opts.steps)


def _shared(plan: Plan, opts: Options, b: int) -> bool:
    """Whether bucket ``b``'s full buffer and grad rows are in the shared-memory fast tier."""
    return opts.shm and in_shared_memory(plan.mesh, plan.buckets[b], opts.hierarchical)


class _InFlight:
    """The simulated rank's reductions in flight and the engine's bound on them (hpf.engine.reduce)."""

    def __init__(self, tl: _Timeline, opts: Options):
        self.tl, self.opts = tl, opts
        self.items: list[tuple[bool, float, float]] = []  # per reduction issued: (holds memory, end, landing's sum)

    def make_room(self) -> None:
        """Reducer._make_room: landed ones are polled (and summed), then the oldest waited for."""
        tl = self.tl
        while self.items and self.items[0][1] <= tl.t:
            tl.run(self.items.pop(0)[2])
        for _ in range(to_wait([holds for holds, _, _ in self.items])):
            _, end, land = self.items.pop(0)
            tl.wait_until(end)
            tl.wait_until(tl.t + land)

    def issue(self, u: _Unit) -> None:
        tl = self.tl
        self.make_room()
        tl.run(u.issue_s)
        end = _issue(tl, u.reduce)
        if not self.opts.pipeline:  # waited (and summed) at once
            tl.wait_until(end)
            tl.wait_until(tl.t + u.land_s)
        self.items.append((u.holds_grads, end, u.land_s if self.opts.pipeline else 0.0))

    def wait_all(self) -> None:
        for _, end, land in self.items:
            self.tl.wait_until(end)
            self.tl.wait_until(self.tl.t + land)
        self.items.clear()


def _hpf_steps(units: list[_Unit], tl: _Timeline, opts: Options, norm_s: float, schedule: list[StepEvents],
               partial_s: float = 0.0) -> None:
    """hpf.engine + ShardStep's phases, step after step, timing the engine's own schedule
    (``hpf_schedule``): gathers issued where the residency policy decides them; a unit's
    forward, recompute and backward wait for its gather; its grads packed once fewer than the
    in-flight bound of reductions hold memory (``to_wait``: the compute thread waits for the
    oldest), its reduction issued in the reduction order, overlapping the rest of backward
    (pipeline) or waited at once; after they land (and ``partial_s``: the partial grads' sums over
    non-FSDP axes, blocking), one all-reduce decides; then the units the
    next step reads first are updated and gathered while the rest update (``overlap_optimizer``)."""
    by = {u.name: u for u in units}
    live: dict[str, float] = {}
    reductions = _InFlight(tl, opts)

    def gather(name: str) -> None:
        tl.run(by[name].issue_s)
        live[name] = _issue(tl, by[name].gather)

    for k, step in enumerate(schedule):
        tl.begin_step()
        if k == len(schedule) - 1:
            tl.reset_counters()
            start = tl.t
        for e in step.events:
            u = by.get(e.unit)
            if e.kind == "gather":
                gather(e.unit)
            elif e.kind == "evict":
                live.pop(e.unit, None)
            elif e.kind in ("forward", "recompute", "backward"):
                tl.wait_until(live[e.unit])
                if e.unit != ROOT:
                    _a2a(tl, u)
                    tl.run(u.bwd_s if e.kind == "backward" else u.fwd_s)
            elif e.kind == "loss" and ROOT in by:  # the head's forward and backward (the embedding's is small)
                tl.run(by[ROOT].fwd_s + by[ROOT].bwd_s)
            elif e.kind in ("grads", "hold"):  # packed into the flat buffer; or added into the held sums
                if e.kind == "grads":
                    reductions.make_room()
                tl.run(u.reduce_copy_s)
            elif e.kind == "reduce":
                reductions.issue(u)
            elif e.kind == "reduced":
                reductions.wait_all()
                tl.wait_until(tl.t + partial_s)
        tl.sync(norm_s)  # the decision: one all-reduce
        tl.run(opts.muon_s, optimizer=True)  # Muon: pieces to owners, Newton-Schulz, pieces back
        first = set(step.next_first)
        tl.run(sum(u.update_s for u in units if u.name in first or not opts.overlap_optimizer), optimizer=True)
        for name in step.next_first:  # the next step's first gathers
            gather(name)
        if opts.overlap_optimizer:
            tl.run(sum(u.update_s for u in units if u.name not in first), optimizer=True)
    tl.step_s = tl.t - start


def _fsdp2_steps(units: list[_Unit], tl: _Timeline, opts: Options, norm_s: float, overhead_s: float,
                 run_ahead: bool) -> None:
    """torch FSDP2 (fully_shard per block and on the root): all-gather with copy-out, forward
    prefetch only where the CPU runs ahead of the device, backward prefetch of one unit,
    reduce-scatter with copy-in overlapping backward, the optimizer after backward.
    Without device streams (``run_ahead`` False: CPU ranks) every collective blocks the compute
    thread: FSDP2 unshards with async_op=False by default and calls its reduce-scatter without
    async_op (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); streams make both
    asynchronous only on an accelerator."""
    root = next((u for u in units if u.name == ROOT), None)
    blocks = [u for u in units if u.name != ROOT]
    for step in range(opts.steps):
        tl.begin_step()
        if step == opts.steps - 1:
            tl.reset_counters()
            start = tl.t
        pending: dict[str, float] = {}

        def issue(per_bucket) -> float:
            end = _issue(tl, per_bucket)
            if not run_ahead:  # a synchronous collective: the compute thread is in it until it ends
                tl.wait_until(end)
            return end

        def unshard(u):
            if u.name not in pending:
                pending[u.name] = issue(u.gather)
            tl.wait_until(pending.pop(u.name))
            tl.run(u.gather_copy_s + overhead_s)

        if root:
            unshard(root)
        for i, u in enumerate(blocks):
            unshard(u)
            if run_ahead and i + 1 < len(blocks):  # the CPU issues the next all-gather while the device computes
                pending[blocks[i + 1].name] = _issue(tl, blocks[i + 1].gather)
            _a2a(tl, u)
            tl.run(u.fwd_s)
        if root:
            tl.run(root.fwd_s + root.bwd_s)
        ends = []
        for i in reversed(range(len(blocks))):
            u = blocks[i]
            unshard(u)
            if i:
                pending[blocks[i - 1].name] = issue(blocks[i - 1].gather)
            _a2a(tl, u)
            tl.run(u.bwd_s + overhead_s)
            tl.run(u.reduce_copy_s)
            ends.append(issue(u.reduce))
        if root:
            tl.run(root.reduce_copy_s + overhead_s)
            ends.append(issue(root.reduce))
        for e in ends:
            tl.wait_until(e)
        tl.run(sum(u.update_s for u in units), optimizer=True)
        tl.sync(norm_s)
    tl.step_s = tl.t - start


def _ddp_steps(units: list[_Unit], tl: _Timeline, opts: Options, plan: Plan, hw: Hardware, norm_s: float,
               replicas_numel: int) -> None:
    """Megatron DDP: full replicas; grads fill buckets in backward order and each full bucket's
    all-reduce starts at once, overlapping the rest of backward; the optimizer on full params."""
    mesh, world = plan.mesh, plan.mesh.size
    root = next((u for u in units if u.name == ROOT), None)
    blocks = [u for u in units if u.name != ROOT]
    axes = tuple(mesh.axis_names)

    def allreduce(nbytes: int):
        tiers = {t: 2 * n for t, n in collective_bytes(mesh, axes, -(-nbytes // world)).items()}
        t, link = _flat_time(hw, opts, world, world, tiers, "all_reduce", None, steps=2 * (world - 1))
        return [_stage("ar", link, t, "slow" if tiers["slow"] else "fast", "all_reduce", tiers)]

    for step in range(opts.steps):
        tl.begin_step()
        if step == opts.steps - 1:
            tl.reset_counters()
            start = tl.t
        for u in blocks:
            _a2a(tl, u)
            tl.run(u.fwd_s)
        if root:
            tl.run(root.fwd_s + root.bwd_s)
        ends, filled = [], 0
        last = root or blocks[0]
        for u in list(reversed(blocks)) + ([root] if root else []):
            if u is not root:
                _a2a(tl, u)
                tl.run(u.bwd_s)
            filled += u.full_grad_bytes
            if filled >= opts.ddp_bucket_bytes or u is last:
                ends.append(tl.submit(allreduce(filled), what=("all-reduce", len(ends))))
                filled = 0
        for e in ends:
            tl.wait_until(e)
        tl.run(replicas_numel * ADAMW_BYTES_PER_ELEMENT / hw.mem_bw, optimizer=True)
        tl.sync(norm_s)
    tl.step_s = tl.t - start


def compute_floor(plan: Plan, hw: Hardware, opts: Options, unit_flops: dict[str, float], *, tokens: int = 0,
                  measured: dict | None = None, a2a: dict | None = None, psums: dict | None = None) -> float:
    """A lower bound of ``simulate_plan``'s step time: the work hpf's compute thread does alone
    (each micro-batch's forward, recompute and backward with their all-to-alls, the update),
    none of which a schedule overlaps or contention shortens."""
    units = _unit_costs(plan, hw, opts, unit_flops, measured, a2a, psums)
    passes = sum(u.fwd_s * (1 + u.recompute) + u.bwd_s + u.a2a_s * (2 + u.recompute) for u in units)
    return opts.accumulate * passes + sum(u.update_s for u in units) + opts.muon_s


def simulate_plan(plan: Plan, hw: Hardware, opts: Options, unit_flops: dict[str, float], *, tokens: int = 0,
                  measured: dict | None = None, a2a: dict | None = None, psums: dict | None = None) -> SimResult:
    """Simulate steps of ``plan`` on ``hw``; ``unit_flops`` is the forward FLOPs per unit on one
    rank's local batch; ``measured`` replaces them with calibrated seconds per unit (the slowest
    rank's; its ``skew``: the mean rank's lead on that rank, a fraction of its time); ``a2a``:
    unit -> (bytes one rank sends per all-to-all, mesh axes), for MoE dispatch and combine;
    ``psums``: unit -> the bytes of each psum over the plan's non-FSDP axes in one pass (tensor
    parallelism: forward and backward run them, blocking the compute thread)."""
    world = plan.mesh.size
    units = _unit_costs(plan, hw, opts, unit_flops, measured, a2a, psums)
    norm = hw.link("slow", world, world)
    norm_s = 2 * ring_time(world, 8 * world, norm.alpha, norm.beta) + norm.latency if world > 1 else 0.0
    if opts.strategy not in ("hpf", "fsdp2", "ddp"):
        raise ValueError(f"strategy {opts.strategy!r}: use 'hpf', 'fsdp2' or 'ddp'")

    def replay(history=(), **rank) -> _Timeline:
        tl = _Timeline(history, **rank)
        if opts.strategy == "hpf":
            _hpf_steps(units, tl, opts, norm_s, hpf_schedule(plan, opts), partial_sums_s(plan, hw, opts))
        elif opts.strategy == "fsdp2":
            _fsdp2_steps(units, tl, opts, norm_s, hw.overhead(hw.fsdp2_unit_overhead_s, world),
                         run_ahead=not hw.shared_links)
        else:
            _ddp_steps(units, tl, opts, plan, hw, norm_s, sum(b.numel for b in plan.buckets))
        return tl

    tl, history = replay(), []
    if hw.shared_links:  # collectives slow down where they overlap compute: replay with the passes' compute
        for _ in range(CONTENTION_PASSES):
            history.append((tl.computing, tl.step_s))
            tl = replay(history)
    wait = tl.wait
    skew = measured.get("skew", 0.0) if measured is not None and world > 1 else 0.0
    if skew > 0:  # the exposed share is the mean rank's: it computes faster and waits for the slowest
        wait = replay(history, speed=1.0 - skew, peers=tl.issued).wait
    busy = {"fast": tl.busy["fast"], "slow": tl.busy["slow"]}
    return SimResult(tl.step_s, tl.compute_s, wait, tl.opt_s, busy, tl.bytes, tokens)
