"""The step's schedule as an event simulation over FSDP units (what each piece costs: hpf.sim.costs).

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

from dataclasses import dataclass

from ..planning import ROOT, Plan
from ..comm.cost import collective_bytes
from ..engine.replay import ScheduleInputs, StepEvents, whole_in
from .costs import (ADAMW_BYTES_PER_ELEMENT, Options, Unit, flat_time, partial_sums_s, ring_time, shared, stage,
                    unit_costs)
from .hardware import Hardware
from .timeline import InFlight, Timeline, issue_buckets

__all__ = ["SimResult", "simulate_plan", "compute_floor", "hpf_schedule"]

CONTENTION_PASSES = 6  # replays on the earlier passes' compute (averaged: settles in ~5)


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


def _a2a(tl: Timeline, u: Unit) -> None:
    """MoE all-to-alls sit between a unit's matmuls: compute waits for them."""
    if u.a2a_s:
        tl.wait += u.a2a_s
        tl.t += u.a2a_s


def hpf_schedule(plan: Plan, opts: Options) -> list[StepEvents]:
    """The engine's schedule of ``opts.steps`` steps of ``plan`` for a loop-style loss function:
    hpf.engine's residency and reduction policies replayed on its reads (hpf.engine.replay)."""
    def kept(b: int) -> bool:  # gathered for good: whole in the compute dtype, or the shared-memory fast tier
        return whole_in(plan.buckets[b], opts.compute_bytes) or shared(plan, opts, b)
    return ScheduleInputs.of(plan, kept, resident_units=opts.resident_units, recompute=opts.recompute,
                             accumulate=opts.accumulate).replay(opts.steps)


def _hpf_steps(units: list[Unit], tl: Timeline, opts: Options, norm_s: float, schedule: list[StepEvents],
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
    reductions = InFlight(tl, opts)

    def gather(name: str) -> None:
        tl.run(by[name].issue_s)
        live[name] = issue_buckets(tl, by[name].gather)

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


def _fsdp2_steps(units: list[Unit], tl: Timeline, opts: Options, norm_s: float, overhead_s: float,
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
            end = issue_buckets(tl, per_bucket)
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
                pending[blocks[i + 1].name] = issue_buckets(tl, blocks[i + 1].gather)
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


def _ddp_steps(units: list[Unit], tl: Timeline, opts: Options, plan: Plan, hw: Hardware, norm_s: float,
               replicas_numel: int) -> None:
    """Megatron DDP: full replicas; grads fill buckets in backward order and each full bucket's
    all-reduce starts at once, overlapping the rest of backward; the optimizer on full params."""
    mesh, world = plan.mesh, plan.mesh.size
    root = next((u for u in units if u.name == ROOT), None)
    blocks = [u for u in units if u.name != ROOT]
    axes = tuple(mesh.axis_names)

    def allreduce(nbytes: int):
        tiers = {t: 2 * n for t, n in collective_bytes(mesh, axes, -(-nbytes // world)).items()}
        t, link = flat_time(hw, opts, world, world, tiers, "all_reduce", None, steps=2 * (world - 1))
        return [stage("ar", link, t, "slow" if tiers["slow"] else "fast", "all_reduce", tiers)]

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
    units = unit_costs(plan, hw, opts, unit_flops, measured, a2a, psums)
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
    units = unit_costs(plan, hw, opts, unit_flops, measured, a2a, psums)
    norm = hw.link("slow", world, world)
    norm_s = 2 * ring_time(world, 8 * world, norm.alpha, norm.beta) + norm.latency if world > 1 else 0.0
    if opts.strategy not in ("hpf", "fsdp2", "ddp"):
        raise ValueError(f"strategy {opts.strategy!r}: use 'hpf', 'fsdp2' or 'ddp'")

    def replay(history=(), **rank) -> Timeline:
        tl = Timeline(history, **rank)
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
