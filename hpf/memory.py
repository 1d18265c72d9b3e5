"""The per-rank memory model of a training step: the one home for "does it fit".

``hpf plan --search`` drops candidates by it and ``hpf train`` refuses a run that would not fit
by it. It follows the engine through one step, from the plan and the model's ``activations``
hook alone (no process, meta tensors), along the engine's own schedule (hpf.engine.replay: the
residency policy decides what is gathered at each moment), and takes the peak of these moments:

- **the start of backward**: the state, the gathered units (the root and the ``resident_units``
  blocks still gathered), every block's saved activations (a recomputed block's input only:
  the models read a recomputed block inside its checkpoint, so it is gathered again for its
  backward), the root's, and the loss's grads;
- **each block's backward**, top down: the blocks gathered then (that block and the one
  prefetched below it, with the default bound), its saved activations (recomputed first if it
  was checkpointed) and the grads its backward holds, the blocks below it still saved, the param grads autograd holds (the root's through
  all of backward, this block's), and the reductions still holding memory;
- **the end of backward**: the root's reduction issued;
- **init**: the state and the temporaries of one chunk of the born-sharded init
  (``step.init(init_fn, key=...)``, hpf.sharded_init: no rank builds the full params; a
  ``step.init(full_params)`` of your own adds those full params on every rank).

A bucket every rank holds whole (a shard group of one: tensor parallelism with no data axis) is
its own gathered buffer in the params' dtype, and its grads go straight to its grad shard.

Reductions: the engine frees each one's flat grad buffer (and gloo's receive buffer beside it on
CPU ranks: ``reduce_copies`` 2) when it lands, and before it takes a unit's flat grads it waits
for the oldest until fewer than ``IN_FLIGHT`` are in flight (hpf.engine.reduce). So whatever the
link, at most ``IN_FLIGHT`` reductions hold memory at once, the unit summed next included; the
model keeps the same window with the engine's own rule (``to_wait``) over the replayed
reductions, assuming none lands sooner, for the flat and the two-tier collectives alike. The shared-memory fast tier (CPU ranks of one host) keeps every bucket's full
buffer in one segment per host and every rank's grad row for good. Gradient accumulation keeps
every bucket's summed grads between micro-batches.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .comm.cost import dtype_bytes
from .engine.reduce import to_wait
from .engine.replay import ScheduleInputs, whole_in
from .engine.residency import RESIDENT_UNITS
from .models.recompute import Activations, recomputes
from .models.spec import spec_of
from .planning import ROOT, Plan
from .report import PlanReport, size
from .sharded_init import temporary_bytes
from .precision import MixedPrecision

__all__ = ["StepMemory", "COMMS", "step_memory", "predict", "state_report", "machine_memory", "size"]

#: how reductions hold memory: "flat" (BucketComm), "tiered" (TieredComm, process groups),
#: "shm" (TieredComm with a shared-memory fast tier: CPU ranks on one host)
COMMS = ("flat", "tiered", "shm")


@dataclass(frozen=True)
class StepMemory:
    """The predicted peak per rank: its parts at the moment of the peak (``when``)."""

    parts: dict[str, int]
    when: str

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def format(self) -> str:
        return f"{size(self.total)} at {self.when}: " + ", ".join(f"{k} {size(v)}" for k, v in self.parts.items() if v)


def step_memory(report: PlanReport, plan: Plan, acts: Activations | None, *, compute_dtype=None,
                reduce_dtype=None, recompute: str = "none", accumulate: int = 1, comm: str = "flat",
                reduce_copies: int = 2, resident_units: int = RESIDENT_UNITS) -> StepMemory:
    """The peak per rank of a step of ``plan`` (see the module doc). ``report``: its plan report
    (the state: shards, grad shards, optimizer state); ``acts``: the model's activations on one
    micro-batch (None: not counted); ``compute_dtype``/``reduce_dtype``: the mixed precision's
    (None: the params' own); ``reduce_copies``: 2 where a reduce-scatter keeps a receive buffer
    as big as its input (gloo), else 1."""
    if comm not in COMMS:
        raise ValueError(f"comm={comm!r}: use one of {COMMS}")
    units: dict[str, dict[str, int]] = {}
    for b in plan.buckets:
        c = dtype_bytes(compute_dtype or b.dtype)
        u = units.setdefault(b.unit, dict(gathered=0, grads=0, flat=0, shard=0))
        whole = b.shard_size == 1 and comm != "shm"  # held whole (tensor parallel alone): nothing gathered or reduced
        u["gathered"] += 0 if whole and compute_dtype in (None, b.dtype) else b.padded_numel * c
        u["shard"] += b.shard_numel * c if compute_dtype not in (None, b.dtype) else 0
        if not b.frozen:
            u["grads"] += b.numel * c
            u["flat"] += 0 if whole and accumulate == 1 else b.padded_numel * dtype_bytes(reduce_dtype or b.dtype)
    root = units.get(ROOT, dict(gathered=0, grads=0, flat=0, shard=0))
    blocks = [units[u] for u in plan.units if u != ROOT]
    state = {"params": report.params_bytes, "grads": report.grad_bytes, "optimizer": report.optimizer_bytes,
             "compute shards": sum(u["shard"] for u in units.values()), "error feedback": report.feedback_bytes}
    flats = sum(u["flat"] for u in units.values())
    if accumulate > 1:
        state["accumulated grads"] = flats
    if comm == "shm":  # every full buffer mapped for good, one per host; each rank's grad rows too
        fast = plan.mesh.axis_size(plan.mesh.fast_axes)
        state["shared memory"] = sum(u["gathered"] for u in units.values()) // fast + flats
    gathered = (lambda *us: 0) if comm == "shm" else (lambda *us: sum(u["gathered"] for u in us))
    held = (lambda flats: 0) if comm == "shm" else (lambda flats: reduce_copies * sum(flats))  # reductions in flight
    if acts is None:
        acts = Activations(((0, 0, 0),) * len(blocks), 0, 0)
    names = [u for u in plan.units if u != ROOT]
    inputs = ScheduleInputs.of(  # what the engine keeps gathered for good: shared memory, or held whole
        plan, lambda b: comm == "shm" or whole_in(plan.buckets[b], dtype_bytes(compute_dtype or plan.buckets[b].dtype)),
        resident_units=resident_units, recompute={u for k, u in enumerate(names) if recomputes(k, recompute)})
    moments = _moments(plan, root, blocks, acts, gathered, held, inputs, recompute)
    moments.append(("init", {"init temporaries": temporary_bytes(plan)}))
    when, parts = max(moments, key=lambda m: sum(m[1].values()))
    return StepMemory({**state, **parts}, when)


def _moments(plan: Plan, root: dict, blocks: list[dict], acts: Activations, gathered, held, inputs: ScheduleInputs,
             recompute: str) -> list[tuple[str, dict]]:
    """The step's moments (the module doc) along the engine's own schedule of one step
    (hpf.engine.replay): what is gathered and which reductions were issued at each."""
    saved = [s for s, _, _ in acts.blocks]
    kept = [i if recomputes(k, recompute) else s for k, (s, i, _) in enumerate(acts.blocks)]
    names = [u for u in plan.units if u != ROOT]
    index = {u: k for k, u in enumerate(names)}
    units = dict(zip(names, blocks), **({ROOT: root} if ROOT in plan.units else {}))

    def gathered_with(resident):  # the root and the blocks gathered then
        return gathered(root, *(blocks[index[u]] for u in resident))
    (step,) = inputs.replay()
    moments, in_flight = [], []  # the flat grads of the reductions in flight, oldest first
    for e in step.events:
        if e.kind == "loss":
            moments.append(("the start of backward", {
                "gathered": gathered_with(e.resident),
                "activations": acts.root_saved + sum(kept) + acts.root_backward}))
        elif e.kind == "backward":
            k = index[e.unit]
            moments.append((f"the backward of {e.unit}", {
                "gathered": gathered_with(e.resident),
                "activations": sum(kept[:k]) + saved[k] + acts.blocks[k][2],
                "param grads": root["grads"] + blocks[k]["grads"],
                "reductions": held(in_flight)}))
        elif e.kind == "reduce":  # the engine's in-flight bound first, then the issue (hpf.engine.reduce)
            del in_flight[:to_wait([flat > 0 for flat in in_flight])]
            in_flight.append(units[e.unit]["flat"])
    return moments + [("the end of backward", {"gathered": gathered_with(()), "param grads": root["grads"],
                                               "reductions": held(in_flight)})]


def predict(module, config, plan: Plan, report: PlanReport, *, local_batch: int, mixed_precision=None,
            recompute: str = "none", accumulate: int = 1, topology: str = "two-tier", cpu: bool = True,
            resident_units: int = RESIDENT_UNITS) -> StepMemory:
    """The peak per rank of a job: ``module`` (an hpf.models module; its ``activations`` hook, if
    it has one) at ``local_batch`` sequences per rank in ``accumulate`` micro-batches, on
    ``plan`` (its ``report`` from :func:`state_report`), with hpf train's ``topology`` ("flat" or
    "two-tier"). ``cpu``: CPU ranks of one host (gloo's reduce-scatter keeps a receive buffer;
    two-tier collectives use shared memory there). A plan computed split over non-FSDP axes
    (tensor parallel: ``plan.compute_size`` > 1) counts one rank's share of each block's
    activations (the hook's ``tp``); its params are the plan's local blocks already.
    ``local_batch``: the sequences one rank reads (a tensor-parallel group reads the same ones)."""
    mp = MixedPrecision.parse(mixed_precision)
    compute = mp.compute_dtype if mp else None
    tp = {"tp": plan.compute_size} if plan.compute_size > 1 else {}  # a tensor-parallel rank's share
    activations = spec_of(module).activations
    acts = activations(config, local_batch // accumulate, dtype_bytes(compute) if compute else 4, **tp) \
        if activations else None
    comm = "flat" if topology == "flat" else "shm" if cpu else "tiered"
    return step_memory(report, plan, acts, compute_dtype=compute, reduce_dtype=mp.reduce_dtype if mp else None,
                       recompute=recompute, accumulate=accumulate, comm=comm, reduce_copies=2 if cpu else 1,
                       resident_units=resident_units)


def state_report(plan: Plan, mixed_precision=None, optimizer: str = "adamw",
                 hierarchical: bool = False, cpu: bool = False) -> tuple[PlanReport, str]:
    """The plan report with ``optimizer``'s state counted ("adamw" or "muon": the busiest rank's),
    and a line that says what that state is; ``cpu``: CPU ranks of one host, whose two-tier
    collectives run their fast tier in shared memory (as ``predict``'s)."""
    mp = MixedPrecision.parse(mixed_precision)
    report = PlanReport.of(plan, compute_dtype=mp.compute_dtype if mp else None,
                           master_dtype=mp.master_dtype if mp else None, reduce_dtype=mp.reduce_dtype if mp else None,
                           hierarchical=hierarchical, shm=cpu)
    if optimizer == "adamw":
        return report, "optimizer state: AdamW, two fp32 moments per element"
    from .optim import muon
    from .optim.muon_owners import muon_plan_state, muon_traffic

    most, load, n_muon = muon_plan_state(muon(), plan)
    busiest = max(range(plan.mesh.size), key=lambda r: (load[r], -r))
    balance = (f"Newton-Schulz FLOPs per rank max/mean {load[busiest] / (sum(load.values()) / plan.mesh.size):.2f} "
               f"(busiest rank {busiest}: {load[busiest] / 1e9:,.2f} GFLOP per step)" if load else "no matrices")
    moved, slow = muon_traffic(muon(), plan)
    return (dataclasses.replace(report, optimizer_bytes=most * 4),
            f"optimizer state: Muon, one fp32 momentum per element of its {n_muon} matrices, AdamW's two "
            f"moments for the other {len(plan.slots) - n_muon} tensors (the busiest rank's count); {balance}; "
            f"its split matrices move {moved / 2**20:,.2f} MiB per step, all ranks, {slow / 2**20:,.2f} MiB of it "
            f"over the slow tier")


def machine_memory(local_ranks: int) -> tuple[int, str]:
    """(bytes one rank may use, what they are) on this machine: under torchrun with an
    accelerator, its free device memory; else the host's available memory (MemAvailable on
    Linux) over its ``local_ranks``."""
    import torch

    from .launcher import is_launched

    if is_launched() and torch.accelerator.is_available():
        free, _ = torch.accelerator.get_memory_info(int(os.environ.get("LOCAL_RANK", 0)))
        return free, f"{torch.accelerator.current_accelerator().type} memory free"
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // local_ranks, f"host memory available over {local_ranks} rank(s)"
