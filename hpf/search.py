"""Automatic plan search: the ``shard_step`` options that train a model fastest on a mesh under a
memory cap, chosen by hpf.sim's predicted step time (``hpf plan --search``, ``hpf train --plan auto``).

    result = hpf.search.search("gpt", "1b", {"node": 96, "local": 8}, "cloudmatrix384", global_batch=768)
    print(result.format())
    step = hpf.shard_step(result.loss_fn(), optimizer=hpf.optim.adamw(lr=3e-4), **result.step_args())

Every candidate is a point of ``DIMENSIONS``: the tensor-parallel size (gpt, llama: a ``tp`` axis
split off the mesh's last axis, hpf.models.carve_tp; 1 is always a candidate), the layout (flat
or two-tier collectives, HSDP), the expert-parallel axis (MoE), the fused-collective cap, mixed
precision, activation recomputation, the micro-batches of the global batch and the low-bit slow
tier. Each is priced twice:

- **memory** by hpf.memory on the plan (meta tensors; a plan per layout, cached, shared by the
  candidates that differ only in precision, recomputation or micro-batches): over the cap, out;
- **time** by hpf.sim, in order of each candidate's compute floor (the compute thread's own
  work: a lower bound of its step time that costs no event simulation). Once ``top`` candidates
  are simulated, one whose floor is no faster than the ``top``-th best's step cannot enter the
  ranking and is not simulated (branch and bound: the ranking is exact, not sampled).

The global batch is fixed, so ranking by step time is ranking by tokens/s.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import memory, sim
from .mesh import Mesh
from .models import MODELS, SPECS, TP_AXIS, carve_tp, data_axes, has_experts, layout, mesh_for, model_config, spec_of, tp_size, tp_sizes
from .models.recompute import RECOMPUTE
from .sim import Hardware, SimResult
from .precision import SlowPrecision
from .errors import NoFeasiblePlan
from .jobspec import inputs, searched, step_topology

__all__ = ["Candidate", "Ranked", "SearchResult", "search", "candidates", "simulate", "DIMENSIONS",
           "NoFeasiblePlan", "load", "SAME_WITHIN", "prefer_simpler"]

MiB = 2**20


@dataclass(frozen=True)
class Candidate:
    """One point of the search space: ``tp`` and the searched options of the job, each declared (with
    its default, the value that means "as before") in hpf.jobspec. A new dimension is a field here,
    its values in ``DIMENSIONS``, and, where shard_step takes it, what it sets in :meth:`step_args`."""

    tp: int = 1  # tensor-parallel ranks split off the mesh's last axis (hpf.models.carve_tp); 1: none
    topology: str = searched("topology")
    hsdp: bool = searched("hsdp")
    ep_axis: str | None = searched("ep_axis")
    bucket_bytes: int = searched("bucket_bytes")
    mixed_precision: str | None = searched("mixed_precision")
    recompute: str = searched("recompute")
    accumulate: int = searched("accumulate")
    slow_precision: str | None = searched("slow_precision")

    def changes(self) -> int:
        """How many options differ from the defaults, the measure of simpler in a tie; precision
        aside, which is the device's to decide (an accelerator's peak is bf16's; on CPU ranks the
        search tries fp32 only)."""
        return sum(getattr(self, f.name) != f.default for f in dataclasses.fields(self) if f.name != "mixed_precision")

    def label(self) -> str:
        """A short name: what differs from the defaults."""
        parts = [f"tensor parallel over {self.tp}"] if self.tp > 1 else []
        parts.append(self.topology + (" HSDP" if self.hsdp else ""))
        if self.ep_axis:
            parts.append(f"experts over {self.ep_axis}")
        if self.bucket_bytes:
            parts.append(f"buckets {self.bucket_bytes // MiB} MiB")
        parts.append(self.mixed_precision or "fp32")
        if self.recompute != "none":
            parts.append(f"recompute {self.recompute.replace('_', ' ')}")
        if self.accumulate > 1:
            parts.append(f"{self.accumulate} micro-batches")
        if self.slow_precision:
            parts.append(f"slow tier {self.slow_precision}")
        return ", ".join(parts)

    def mesh(self, mesh: Mesh) -> Mesh:
        """The mesh this candidate runs on: ``mesh`` with its tensor-parallel axis split off."""
        return carve_tp(mesh, self.tp)

    def step_args(self, model: str, config, mesh: Mesh) -> dict[str, Any]:
        """The keyword arguments of ``hpf.shard_step`` (all but the loss function and optimizer) on the
        job's ``mesh``."""
        module, mesh = MODELS[model], self.mesh(mesh)
        specs, data = layout(module, config, mesh.axis_names, None, self.ep_axis, tp_size(mesh))
        return {"mesh": mesh, "param_specs": specs, "fsdp_axes": data or tuple(mesh.axis_names),
                "topology": step_topology(self), "batch_axes": spec_of(module).batch_axes,
                **inputs(self, "step")}

    def loss_args(self, model: str, mesh: Mesh | None = None) -> dict[str, Any]:
        """The keyword arguments of the model's ``loss_for`` beside the config (on the job's ``mesh``)."""
        tp = self.tp > 1 or (mesh is not None and TP_AXIS in mesh.axis_names)
        return {"recompute": self.recompute, **({"ep_axis": self.ep_axis} if has_experts(MODELS[model]) else {}),
                **({"tp_axis": TP_AXIS} if tp else {})}

    def sim_args(self) -> dict[str, Any]:
        """The keyword arguments of ``hpf.sim.simulate``."""
        return {"strategy": "hsdp" if self.hsdp else "hpf", **inputs(self, "sim")}


def _layouts(job: "_Job", c: Candidate) -> list[tuple[str, bool]]:
    mesh = c.mesh(job.mesh)
    two_tiers = _slow_tier(mesh)  # HSDP needs a slow tier to replicate over
    out = [("two-tier", False), ("flat", False)] + ([("two-tier", True), ("flat", True)] if two_tiers else [])
    return [(t, h) for t, h in out if t == "two-tier" or not c.slow_precision]  # (a held low-bit tier is two-tier's)


def _slow_tier(mesh: Mesh) -> bool:
    """Whether some data axis of ``mesh`` crosses its slow tier (ranks > 1 outside the fast tier)."""
    return bool(mesh.slow_axes_of(data_axes(mesh.axis_names)))


def _ep_axes(job: "_Job") -> list[str | None]:
    experts = getattr(job.config, "n_experts", 0)
    return [None] + [a for a, n in zip(job.mesh.axis_names, job.mesh.shape) if experts and n > 1 and not experts % n]


def _bucket_caps(job: "_Job", c: Candidate) -> list[int]:
    """0 (a bucket per unit) and the powers-of-4 MiB caps that split the largest unit into 2-16."""
    if c.topology != "two-tier":
        return [0]
    plan = sim.plan_for(job.module, job.config, c.mesh(job.mesh), None, c.ep_axis, c.hsdp)
    largest = max((sum(plan.buckets[b].padded_numel for b in u.buckets) * 4 for u in plan.units.values()), default=0)
    return [0] + [4**k * MiB for k in range(6) if largest / 16 <= 4**k * MiB < largest]


def _slow_precisions(job: "_Job", c: Candidate) -> list[str | None]:
    """With ``low_bit`` (asked for: it rounds weights and grads, which no step-time ranking can
    weigh), two-tier on a mesh with a slow tier: full precision, int8 both ways, and int8 weights
    with int4 grads (ZeRO++'s qwZ and qgZ): slow-tier bytes traded for quantize passes."""
    if not job.low_bit or c.topology != "two-tier" or not _slow_tier(c.mesh(job.mesh)):
        return [None]
    return [None, "int8,int8", "int8,int4"]


def _precisions(job: "_Job") -> list[str | None]:
    """fp32, and bf16 but on CPU ranks (a calibration of this host: ``shared_links``), where bf16 is
    emulated and measured slower (GPT small, 4 ranks here: 32.3 ms a step against fp32's 25.7):
    a setting known slower on the device is never chosen (held with --mixed-precision, it runs)."""
    return [None] if job.hw.shared_links else [None, "bf16"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if not n % k]


#: The searched dimensions in Candidate's field order: name -> the values for a job (and the
#: candidate so far, for dimensions that depend on earlier ones).
DIMENSIONS = {
    "tp": lambda job, c: [dict(tp=k) for k in tp_sizes(job.module, job.config, job.mesh)],
    "layout": lambda job, c: [dict(topology=t, hsdp=h) for t, h in _layouts(job, c)],
    "ep_axis": lambda job, c: [dict(ep_axis=a) for a in _ep_axes(job)],
    "bucket_bytes": lambda job, c: [dict(bucket_bytes=b) for b in _bucket_caps(job, c)],
    "mixed_precision": lambda job, c: [dict(mixed_precision=p) for p in _precisions(job)],
    "recompute": lambda job, c: [dict(recompute=r) for r in RECOMPUTE],
    "accumulate": lambda job, c: [dict(accumulate=k) for k in _divisors(job.local_batch)],
    "slow_precision": lambda job, c: [dict(slow_precision=p) for p in _slow_precisions(job, c)],
}


@dataclass
class Ranked:
    """A candidate with its predicted memory and step time (``sim`` None: not simulated)."""

    candidate: Candidate
    memory: memory.StepMemory
    floor_s: float
    sim: SimResult | None = None

    @property
    def step_s(self) -> float:
        return self.sim.step_s if self.sim else float("inf")


#: Predictions this close to the fastest are a tie: hpf.sim's steps on this machine's calibrated shapes
#: lie within 0.93-1.11 of the measured ones (docs/simulate.md), so a few percent picks nothing real
SAME_WITHIN = 0.05


def prefer_simpler(ranked: list[Ranked]) -> list[Ranked]:
    """``ranked`` (fastest first) with the simplest of those predicted within ``SAME_WITHIN`` of the
    fastest moved to the front: the fewest options changed from the defaults, then the faster."""
    tied = [r for r in ranked if r.step_s <= ranked[0].step_s * (1 + SAME_WITHIN)] if ranked else []
    if not tied:
        return ranked
    first = min(tied, key=lambda r: (r.candidate.changes(), r.step_s, r.memory.total))
    return [first] + [r for r in ranked if r is not first]


@dataclass
class SearchResult:
    """The ranking of a search: the simulated candidates best first, and what fell where."""

    model: str
    config_name: str
    mesh: dict[str, int]
    global_batch: int
    hardware: str
    memory_cap: int | None
    ranked: list[Ranked]  # simulated and under the cap, fastest first
    candidates: int
    over_memory: int
    pruned: int  # under the cap, never simulated: their compute floor was no faster than the top's
    seconds: float
    top: int = 5
    plans: int = 0  # distinct plans built

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    @property
    def config(self):
        return model_config(self.model, self.config_name)[1]

    def step_args(self) -> dict[str, Any]:
        """The best candidate's ``hpf.shard_step`` keyword arguments (add ``optimizer=``)."""
        return self.best.candidate.step_args(self.model, self.config, mesh_for(self.mesh))

    def loss_fn(self, **kw):
        """The model's loss function for the best candidate (``kw``: e.g. ``aux=True`` for MoE)."""
        return SPECS[self.model].loss(self.config, **self.best.candidate.loss_args(self.model, mesh_for(self.mesh)), **kw)

    def tokens_per_s(self, r: Ranked) -> float:
        return r.sim.tokens_per_s if r.sim else 0.0

    def why(self) -> str:
        """Which term dominates the best's predicted step, and what it gains over the runner-up."""
        b = self.best.sim
        terms = {"compute": b.compute_s, "exposed communication": b.exposed_comm_s, "the optimizer": b.optimizer_s}
        top = max(terms, key=terms.get)
        shares = ", ".join(f"{k} {v / b.step_s:.0%}" for k, v in terms.items())
        line = f"{top} dominates its predicted step ({shares})"
        if len(self.ranked) > 1:
            r = self.ranked[1].sim
            gains = {"compute": r.compute_s - b.compute_s, "exposed communication": r.exposed_comm_s - b.exposed_comm_s,
                     "the optimizer": r.optimizer_s - b.optimizer_s}
            term = max(gains, key=gains.get)
            if r.step_s < b.step_s:  # (prefer_simpler: a tie)
                line += (f"; #2 is predicted {(b.step_s - r.step_s) * 1e3:.3g} ms faster, inside hpf.sim's error "
                         f"bars ({SAME_WITHIN:.0%}), and #1 changes fewer options")
            else:
                line += (f"; against #2 it saves {(r.step_s - b.step_s) * 1e3:.3g} ms, most of it in {term} "
                         f"({gains[term] * 1e3:+.3g} ms for #2)" if r.step_s > b.step_s else
                         "; #2 is predicted as fast, and #1 needs no more memory")
        return line

    def format(self) -> str:
        cap = f"{memory.size(self.memory_cap)} per rank" if self.memory_cap else "no memory cap"
        lines = [f"hpf plan --search: {self.model} {self.config_name!r} on mesh "
                 f"{','.join(f'{a}={n}' for a, n in self.mesh.items())}, global batch {self.global_batch} "
                 f"sequences, hardware {self.hardware}, {cap}: {self.candidates} candidates, "
                 f"{self.plans} plans, {self.seconds:.2f} s",
                 f"{'#':>2} {'predicted step':>14} {'tokens/s':>12} {'memory/rank':>12}  plan"]
        for i, r in enumerate(self.ranked[:self.top], 1):
            lines.append(f"{i:>2} {r.step_s * 1e3:>11.2f} ms {self.tokens_per_s(r):>12,.0f} "
                         f"{memory.size(r.memory.total):>12}  {r.candidate.label()}")
        fell_time = self.candidates - self.over_memory - min(len(self.ranked), self.top)
        lines += [f"why #1: {self.why()}",
                  f"memory of #1: {self.best.memory.format()}",
                  f"fell to memory: {self.over_memory} of {self.candidates} candidates need more than the cap",
                  f"fell to time: {fell_time} ranked below the top {self.top} ({self.pruned} of them by their compute "
                  "floor alone, without a full simulation)"]
        return "\n".join(lines)

    def to_json(self) -> dict:
        """What ``hpf train --plan FILE`` replays: the job, the choice, and the ranking."""
        row = lambda r: {"options": dataclasses.asdict(r.candidate), "step_s": r.step_s,  # noqa: E731
                         "tokens_per_s": self.tokens_per_s(r), "memory_bytes": r.memory.total}
        return {"model": self.model, "config": self.config_name, "mesh": self.mesh, "batch_size": self.global_batch,
                "hardware": self.hardware, "memory_per_rank": self.memory_cap, "choice": row(self.best),
                "top": [row(r) for r in self.ranked[:self.top]], "candidates": self.candidates,
                "over_memory": self.over_memory, "pruned": self.pruned, "seconds": self.seconds}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load(path: str | Path) -> dict:
    """A saved search (``SearchResult.save``), checked: its job and its chosen options."""
    try:
        saved = json.loads(Path(path).read_text())
        Candidate(**saved["choice"]["options"])
        for key in ("model", "config", "mesh", "batch_size"):
            saved[key]  # noqa: B018 - present
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a search result written by hpf plan --search --save ({type(e).__name__}: "
                         f"{e}); write one with hpf plan --search --save FILE") from None
    return saved


@dataclass
class _Job:
    model: str
    config: Any
    module: Any
    mesh: Mesh
    hw: Hardware
    local_batch: int
    optimizer: str
    low_bit: bool = False  # search the low-bit slow tier too
    reports: dict = field(default_factory=dict)  # plan key -> (plan, state report)


def search(model: str, config: str, mesh, hw: Hardware | str, *, global_batch: int | None = None,
           memory_per_rank: int | None = None, optimizer: str = "adamw", top: int = 5,
           fixed: dict | None = None, low_bit: bool = False) -> SearchResult:
    """Search the candidates of ``DIMENSIONS`` for ``model``/``config`` on ``mesh`` ({axis: size}
    or an hpf.Mesh), priced on ``hw`` (a profile name, a calibration file or a Hardware), for a
    ``global_batch`` of sequences (default: one per rank) split evenly over the ranks; drop those
    over ``memory_per_rank`` bytes (None: no cap) and rank the rest by predicted step time.
    ``fixed``: Candidate fields to hold (e.g. ``{"mixed_precision": None}``); ``optimizer``:
    whose state the memory counts ("adamw" or "muon"); ``low_bit``: also try a low-bit slow tier
    (int8, int8 weights with int4 grads), which changes the numerics and so is off unless asked.

    Raises:
        ValueError: an unknown model/config, a batch that does not split over the ranks, an
            unknown ``fixed`` field.
        NoFeasiblePlan: no candidate fits ``memory_per_rank``; it names the smallest one's memory.
    """
    started = time.perf_counter()
    mesh = mesh if isinstance(mesh, Mesh) else mesh_for(dict(mesh))
    hw = sim.hardware(hw) if isinstance(hw, str) else hw
    global_batch = mesh.size if global_batch is None else global_batch
    priced, plans = _priced(model, config, mesh, hw, global_batch, optimizer, fixed, low_bit)
    fits = [r for r in priced if memory_per_rank is None or r.memory.total <= memory_per_rank]
    if not fits:
        small = min(priced, key=lambda r: r.memory.total)
        raise NoFeasiblePlan(
            f"--memory-per-rank {memory.size(memory_per_rank)}: none of the {len(priced)} candidates fits; the "
            f"smallest ({small.candidate.label()}) needs {memory.size(small.memory.total)} per rank "
            f"({small.memory.format()}); raise the cap, use more ranks or a smaller batch")
    fits.sort(key=lambda r: r.floor_s)
    ranked: list[Ranked] = []
    pruned = 0
    for r in fits:
        if len(ranked) >= top and r.floor_s >= ranked[top - 1].step_s:
            pruned += 1
            continue
        r.sim = simulate(r.candidate, model, config, mesh, hw, global_batch, optimizer)
        ranked.append(r)
        ranked.sort(key=lambda x: (x.step_s, x.memory.total))
    return SearchResult(model, config, dict(zip(mesh.axis_names, mesh.shape)), global_batch, hw.name, memory_per_rank,
                        prefer_simpler(ranked), len(priced), len(priced) - len(fits), pruned, time.perf_counter() - started, top, plans)


def candidates(model: str, config: str, mesh, hw: Hardware | str, *, global_batch: int | None = None,
               optimizer: str = "adamw", fixed: dict | None = None, low_bit: bool = False) -> list[Ranked]:
    """Every candidate :func:`search` considers, priced (memory, compute floor) but not simulated."""
    mesh = mesh if isinstance(mesh, Mesh) else mesh_for(dict(mesh))
    return _priced(model, config, mesh, sim.hardware(hw) if isinstance(hw, str) else hw,
                   mesh.size if global_batch is None else global_batch, optimizer, fixed, low_bit)[0]


def simulate(c: Candidate, model: str, config: str, mesh, hw: Hardware | str, global_batch: int,
             optimizer: str = "adamw") -> SimResult:
    """hpf.sim's prediction of one candidate's step (with ``optimizer``'s cost: Muon's tax)."""
    mesh = c.mesh(mesh if isinstance(mesh, Mesh) else mesh_for(dict(mesh)))
    return sim.simulate(config, mesh, hw, local_batch=global_batch // readers(mesh), model=model, optimizer=optimizer,
                        **c.sim_args())


def readers(mesh: Mesh) -> int:
    """The ranks that read their own share of the batch (a tensor-parallel group reads one)."""
    return mesh.axis_size(data_axes(mesh.axis_names))


def _priced(model: str, config: str, mesh: Mesh, hw: Hardware, global_batch: int, optimizer: str,
            fixed: dict | None, low_bit: bool = False) -> tuple[list[Ranked], int]:
    """(every candidate priced, how many distinct plans that took)."""
    module, cfg = model_config(model, config)
    if global_batch < 1 or global_batch % mesh.size:
        raise ValueError(f"global batch {global_batch} must split evenly over the {mesh.size} ranks; use a multiple "
                         f"of {mesh.size}")
    fixed = dict(fixed or {})
    unknown = set(fixed) - {f.name for f in dataclasses.fields(Candidate)}
    if unknown:
        raise ValueError(f"fixed: {sorted(unknown)} are not search dimensions; use some of "
                         f"{[f.name for f in dataclasses.fields(Candidate)]}")
    job = _Job(model, cfg, module, mesh, hw, global_batch // readers(mesh), optimizer, low_bit)
    priced, seen = [], set()
    for c in _candidates(job, fixed):
        r = _price(job, config, c)
        plan = job.reports[_plan_key(c)][0]
        same = (c.tp, c.topology, c.mixed_precision, c.recompute, c.accumulate, c.slow_precision,  # what runs: HSDP
                # on a MoE's explicit specs is a no-op
                tuple((b.shard_axes, b.replicate_axes, b.numel) for b in plan.buckets))
        if same not in seen:
            seen.add(same)
            priced.append(r)
    return priced, len({id(p) for p, _ in job.reports.values()})


def _candidates(job: _Job, fixed: dict) -> list[Candidate]:
    """Every point of DIMENSIONS, with ``fixed`` fields held."""
    out = [Candidate(**fixed)]
    for dim in DIMENSIONS.values():
        out = [dataclasses.replace(c, **{k: v for k, v in choice.items() if k not in fixed})
               for c in out for choice in dim(job, c)]
        out = list(dict.fromkeys(out))  # (a held field makes copies)
    return out


def _plan_key(c: Candidate) -> tuple:
    return c.tp, c.topology, c.hsdp, c.ep_axis, c.bucket_bytes, c.mixed_precision, c.slow_precision


def _price(job: _Job, config: str, c: Candidate) -> Ranked:
    """Memory on the candidate's plan (one per layout, cached) and the compute floor of its step."""
    key, mesh = _plan_key(c), c.mesh(job.mesh)
    local_batch = job.local_batch * c.tp  # (a tensor-parallel group reads tp ranks' shares)
    if key not in job.reports:
        plan = sim.plan_for(job.module, job.config, mesh, None, c.ep_axis, c.hsdp,
                            c.bucket_bytes if c.topology == "two-tier" else 0, SlowPrecision.parse(c.slow_precision))
        job.reports[key] = (plan, memory.state_report(plan, c.mixed_precision, job.optimizer,
                                                      hierarchical=c.topology == "two-tier", cpu=job.hw.shared_links)[0])
    plan, report = job.reports[key]
    mem = memory.predict(job.module, job.config, plan, report, local_batch=local_batch, cpu=job.hw.shared_links,
                         **inputs(c, "memory"))
    floor = sim.compute_floor(config, mesh, job.hw, local_batch=local_batch, model=job.model,
                              optimizer=job.optimizer, **c.sim_args())
    return Ranked(c, mem, floor)
