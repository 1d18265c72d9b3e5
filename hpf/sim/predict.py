"""The simulator's entry points (hpf.sim re-exports them): a model and a mesh to a plan
(``plan_for``, the step's own recipe), and that plan to predicted times (``simulate``,
``compare``, ``sweep``), schedules and Muon's tax; hpf.sim.model times the events."""
from __future__ import annotations

import functools
import math
from types import ModuleType

from ..models import layout, mesh_for, spec_of, tp_size
from ..models.recompute import recomputes
from ..planning import ROOT, step_plan
from ..topology import Topology
from ..mesh import Mesh
from ..precision import SlowPrecision
from .hardware import (PROFILES, Hardware, Link, compute_key, hardware, load_calibration, model_prefix,
                       parse_compute_key)
from ..engine.replay import StepEvents
from ..engine.residency import RESIDENT_UNITS
from .costs import Options, allreduce_time, default_unit_flops, ring_time, two_tier_time
from .model import SimResult, compute_floor as model_floor, hpf_schedule, simulate_plan

__all__ = ["simulate", "compare", "sweep", "sweep_mesh", "Hardware", "Link", "Options", "SimResult", "PROFILES",
           "hardware", "load_calibration", "ring_time", "allreduce_time", "two_tier_time", "STRATEGIES",
           "extrapolation", "calibrated_compute", "plan_for", "compute_floor", "muon_tax", "schedule"]

STRATEGIES = ("hpf", "hsdp", "fsdp2", "ddp")
_BYTES = {None: 4, "bf16": 2, "fp16": 2}


def _model_name(model) -> str:
    """``model``'s name in hpf.models (a name, or the module itself)."""
    return _model(model).__name__.rsplit(".", 1)[-1]


def _model(model):
    if isinstance(model, ModuleType):
        return model
    if model == "gpt":
        from ..models import gpt
        return gpt
    import importlib
    return importlib.import_module(f"hpf.models.{model}")


def simulate(config, mesh, hw: Hardware | str, strategy: str = "hpf", **kw) -> SimResult:
    """One strategy on one mesh. ``config``: a name in the model's CONFIGS or a config object;
    ``mesh``: an hpf.Mesh or {axis: size}; ``hw``: a Hardware, a profile name or a calibration
    file. ``strategy``: "hpf", "hsdp" (hpf sharding over the fast tier only), "fsdp2", "ddp".
    Keywords: ``local_batch`` (sequences per rank), ``model``, ``mixed_precision``, ``topology``
    ("two-tier": hpf.Topology(); "flat": topology=None, as ``hpf train``), ``fsdp_axes``,
    ``pipeline``, ``overlap_optimizer``, ``emulated_slow``, ``shm``, ``steps``, ``ep_axis`` (a MoE
    model's expert-parallel axis: experts split over it, tokens exchanged); hpf only:
    ``bucket_bytes`` (two-tier: hpf.Topology's cap on one fused collective), ``slow_precision``
    (two-tier: the low-bit slow tier, "W[,G]" as ``hpf simulate --slow-precision`` or an
    hpf.precision.SlowPrecision: fewer slow-tier bytes plus the quantize cost), ``accumulate``
    micro-batches of ``local_batch / accumulate`` sequences, ``recompute`` ("none", "all",
    "every_other": the blocks whose forward runs again in backward), ``resident_units`` (the residency
    bound, as hpf.shard_step's), ``optimizer`` ("adamw"; "muon":
    hpf's distributed Muon, whose tax ``muon_tax`` runs after the decision; the baselines are
    modelled with AdamW)."""
    plan, hw, opts, flops, extra = _inputs(config, mesh, hw, strategy, **kw)
    return simulate_plan(plan, hw, opts, flops, **extra)


def schedule(config, mesh, hw: Hardware | str, **kw) -> list[StepEvents]:
    """The schedule ``simulate(config, mesh, hw, "hpf", **kw)`` times: per step, the engine's
    gathers, reads and reductions in order (hpf.engine.replay's events), from the engine's own
    residency and reduction policies on a loop-style loss function's reads."""
    plan, _, opts, _, _ = _inputs(config, mesh, hw, "hpf", **kw)
    return hpf_schedule(plan, opts)


def compute_floor(config, mesh, hw: Hardware | str, strategy: str = "hpf", **kw) -> float:
    """A lower bound of ``simulate(...)``'s step time (the same arguments), without the event
    simulation: the compute thread's own work, which no schedule shortens."""
    plan, hw, opts, flops, extra = _inputs(config, mesh, hw, strategy, **kw)
    return model_floor(plan, hw, opts, flops, **extra)


def muon_tax(plan, hw: Hardware, muon=None) -> float:
    """Seconds distributed Muon adds to a step of ``plan`` after the decision: the busiest rank's
    Newton-Schulz FLOPs at ``hw``'s matmul rate (peak x efficiency) plus the time its pieces take
    to send over each tier's link (hpf.optim.muon_owners.muon_sends). ``muon``: an
    hpf.optim.muon(...) (default: its defaults)."""
    load, sends = _muon_work(plan) if muon is None else _muon_work_of(plan, muon)
    mesh = plan.mesh
    links = {"fast": hw.link("fast", mesh.axis_size(mesh.fast_axes), mesh.size),
             "slow": hw.link("slow", mesh.size, mesh.size)}
    rate = hw.peak_flops * hw.efficiency
    return max((load[r] / rate + sum(n / links[t].beta + (links[t].latency if n else 0.0) for t, n in sends[r].items())
                for r in range(mesh.size)), default=0.0)


_WORK: dict[int, tuple] = {}  # id(plan) -> (plan, its default Muon's work): a search prices a plan many times


def _muon_work(plan) -> tuple:
    """``_muon_work_of`` the default Muon, kept for the last 64 plans (each entry holds its plan,
    so an id is never reused while it is kept)."""
    hit = _WORK.get(id(plan))
    if hit is None or hit[0] is not plan:
        if len(_WORK) >= 64:
            _WORK.pop(next(iter(_WORK)))
        from ..optim import muon
        _WORK[id(plan)] = hit = (plan, *_muon_work_of(plan, muon()))
    return hit[1:]


def _muon_work_of(plan, muon) -> tuple:
    """(NS FLOPs per rank, bytes each rank sends per tier) of ``muon`` distributed on ``plan``."""
    from ..optim.muon_owners import assign_owners, muon_paths, muon_sends

    owners, load = assign_owners(plan, muon_paths(muon, plan), muon.ns_steps, muon.ns_variant)
    return load, muon_sends(muon, plan, owners)


def _inputs(config, mesh, hw, strategy, *, local_batch=1, model="gpt", mixed_precision=None, topology="two-tier",
            fsdp_axes=None, pipeline=True, overlap_optimizer=True, emulated_slow=None, shm=None, steps=3,
            ep_axis=None, bucket_bytes=0, slow_precision=None, accumulate=1, recompute="none", optimizer="adamw",
            resident_units=RESIDENT_UNITS):
    """simulate_plan's arguments for simulate's (see there)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: use one of {STRATEGIES}")
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer {optimizer!r}: use 'adamw' or 'muon'")
    if mixed_precision not in _BYTES:
        raise ValueError(f"mixed_precision {mixed_precision!r}: use None, 'bf16' or 'fp16'")
    if local_batch % accumulate:
        raise ValueError(f"accumulate={accumulate} does not divide local_batch={local_batch}")
    mod = _model(model)
    cfg_name = config if isinstance(config, str) else None
    cfg = spec_of(mod).configs[config] if isinstance(config, str) else config
    mesh = mesh if isinstance(mesh, Mesh) else mesh_for(dict(mesh))
    hw = hardware(hw) if isinstance(hw, str) else hw
    is_hpf = strategy in ("hpf", "hsdp")
    tiered = is_hpf and topology == "two-tier"
    slow = SlowPrecision.parse(slow_precision) if is_hpf else None  # the baselines have no low-bit tier
    if slow is not None and not tiered:
        raise ValueError(f"slow_precision={slow_precision!r} with topology={topology!r}: a low-bit slow tier is a "
                         "stage of hpf's two-tier collectives; use topology='two-tier'")
    plan = plan_for(mod, cfg, mesh, fsdp_axes, ep_axis, strategy == "hsdp", bucket_bytes if tiered else 0,
                    slow)
    micro = local_batch // accumulate  # compute, all-to-alls and a calibrated shape are a micro-batch's
    tp = plan.compute_size  # > 1: tensor parallel, each rank computes 1/tp of a block (local_batch: per tp group)
    spec = spec_of(mod)
    flops = (spec.unit_flops(cfg, micro, **({"tp": tp} if tp > 1 else {})) if spec.unit_flops
             else default_unit_flops(plan, micro * getattr(cfg, "seq_len", 1)))
    a2a = spec.unit_a2a(cfg, micro, mesh, ep_axis, _BYTES[mixed_precision]) if spec.unit_a2a else None
    psums = spec.need("unit_psums", "a tensor-parallel step's costs need")(cfg, micro, _BYTES[mixed_precision]) \
        if tp > 1 else None
    blocks = [u for u in plan.units if u != ROOT]
    opts = Options(strategy="hpf" if is_hpf else strategy, topology=tiered, hierarchical=tiered,
                   pipeline=pipeline, overlap_optimizer=overlap_optimizer,
                   shm=(hw.shared_links and tiered) if shm is None else shm,
                   compute_bytes=_BYTES[mixed_precision], reduce_bytes=4, emulated_slow=emulated_slow, steps=steps,
                   accumulate=accumulate if is_hpf else 1,
                   recompute=frozenset(u for i, u in enumerate(blocks) if is_hpf and recomputes(i, recompute)),
                   muon_s=muon_tax(plan, hw) if is_hpf and optimizer == "muon" else 0.0, resident_units=resident_units)
    measured = calibrated_compute(hw, mod, cfg_name, micro, mesh.size, mixed_precision) if cfg_name else None
    if measured is not None and tp > 1:  # a calibrated block, its tp share by FLOPs (no calibration runs split)
        whole = spec.unit_flops(cfg, micro) if spec.unit_flops else None
        share = sum(flops.values()) / sum(whole.values()) if whole else 1 / tp
        measured = {**measured, "block_s": measured["block_s"] * share}
    tokens = local_batch * getattr(cfg, "seq_len", 1) * mesh.size // tp
    return plan, hw, opts, flops, dict(tokens=tokens, measured=measured, a2a=a2a, psums=psums)


@functools.lru_cache(maxsize=256)
def _plan(mod: ModuleType, cfg, axes: tuple, fast: tuple, fsdp_axes, ep_axis, hsdp: bool, bucket_bytes: int,
          slow: SlowPrecision | None):
    mesh = Mesh(dict(axes), fast_axes=fast)
    specs, fsdp_axes = layout(mod, cfg, mesh.axis_names, fsdp_axes, ep_axis, tp_size(mesh))
    return step_plan(spec_of(mod).init(cfg, device="meta"), mesh, specs, fsdp_axes, hsdp=hsdp,
                     topology=Topology.with_slow(slow, bucket_bytes=bucket_bytes))  # (node-major: the default)


def plan_for(mod: ModuleType, cfg, mesh: Mesh, fsdp_axes=None, ep_axis: str | None = None,
             hsdp: bool = False, bucket_bytes: int = 0, slow: SlowPrecision | None = None):
    """The plan hpf.shard_step makes for this model on ``mesh`` (the experts over ``ep_axis``; a
    ``tp`` axis: tensor parallel over it, hpf.models.layout), cached:
    a search simulates many candidates on few plans. Read it, do not change it."""
    return _plan(mod, cfg, tuple(zip(mesh.axis_names, mesh.shape)), mesh.fast_axes,
                 None if fsdp_axes is None else tuple(fsdp_axes),
                 ep_axis, hsdp, bucket_bytes, slow)


def compare(config, mesh, hw, strategies=("hpf", "fsdp2", "ddp"), **kw) -> dict[str, SimResult]:
    """The same job under several strategies (hpf, FSDP2, Megatron DDP by default)."""
    return {s: simulate(config, mesh, hw, s, **kw) for s in strategies}


def sweep_mesh(ranks: int, hw: Hardware) -> dict[str, int]:
    """The mesh of ``ranks`` ranks on ``hw``: fast domains ("local") of hw.fast_domain ranks."""
    fast = hw.fast_domain or ranks
    if ranks <= fast:
        return {"local": ranks}
    if ranks % fast:
        raise ValueError(f"{ranks} ranks do not fill whole fast domains of {fast} ranks on {hw.name}; "
                         f"use a multiple of {fast}")
    return {"node": ranks // fast, "local": fast}


def sweep(config, ranks_list, hw, strategies=("hpf", "fsdp2", "ddp"), **kw) -> list[tuple[int, dict]]:
    """(ranks, {strategy: SimResult}) along a scaling curve (weak scaling: fixed local batch)."""
    hw = hardware(hw) if isinstance(hw, str) else hw
    return [(n, compare(config, sweep_mesh(n, hw), hw, strategies, **kw)) for n in ranks_list]


def calibrated_compute(hw: Hardware, model, config: str, local_batch: int, ranks: int,
                       mixed_precision: str | None = None) -> dict | None:
    """The calibrated seconds of ``model``'s blocks and root at this shape and compute precision;
    the fp32 ones where only those were measured (older calibrations: extrapolation() says so)."""
    name = _model_name(model)
    return (hw.compute.get(compute_key(name, config, local_batch, ranks, mixed_precision))
            or hw.compute.get(compute_key(name, config, local_batch, ranks)))


def uncalibrated_shape(config: str, local_batch: int, hw: Hardware, model="gpt") -> str | None:
    """The shape (``[model:]config/local_batch``, as hpf calibrate --shapes names it) whose compute a
    calibrated profile never measured at any world size, or None (measured, or a published profile).
    A prediction of it would take another shape's efficiency: 18x off on a CPU (issue 60)."""
    name = _model_name(model)
    measured = {parse_compute_key(k)[:3] for k in hw.compute}
    if not hw.compute or (name, config, local_batch) in measured:
        return None
    return f"{model_prefix(name)}{config}/{local_batch}"


def extrapolation(config: str, local_batch: int, ranks: int, hw: Hardware, model="gpt",
                  mixed_precision: str | None = None) -> list[str]:
    """What a prediction on a calibrated profile takes from outside its calibration, and how far
    outside: a shape whose compute was not measured (estimated from FLOPs at the calibrated
    efficiency, which can be off by 2-3x on a CPU), or measured in fp32 only for a bf16 run, or a
    world size whose links were not. Empty for a published profile (its figures are the inputs)
    and for a calibrated shape."""
    if not hw.compute:
        return []
    out = []
    spec, name = spec_of(_model(model)), _model_name(model)
    prefix = model_prefix(name)
    if mixed_precision and compute_key(name, config, local_batch, ranks) in hw.compute and \
            compute_key(name, config, local_batch, ranks, mixed_precision) not in hw.compute:
        out.append(f"compute of {prefix}{config}/{local_batch} on {ranks} ranks was calibrated in fp32 only, and "
                   f"{mixed_precision} runs at another speed (on a CPU, faster or slower by up to 2x); measure it "
                   f"again with hpf calibrate --shapes {prefix}{config}/{local_batch} --world-sizes {ranks}")
    if compute_key(name, config, local_batch, ranks) not in hw.compute:
        shapes = {parse_compute_key(k)[1:4] for k in hw.compute if parse_compute_key(k)[0] == name}
        listed = ", ".join(sorted({f"{prefix}{n}/{b}" for n, b, _ in shapes})) or "none of this model"
        same = sorted(int(w) for n, b, w in shapes if (n, int(b)) == (config, local_batch))
        if same:
            near = f"; {config}/{local_batch} was measured on {', '.join(map(str, same))} ranks only"
        elif shapes and spec.unit_flops and config in spec.configs:
            flops = lambda name, batch: sum(spec.unit_flops(spec.configs[name], int(batch)).values())  # noqa: E731
            ratio, n, b = min(((flops(config, local_batch) / flops(n, b), n, b) for n, b, _ in shapes
                               if n in spec.configs), key=lambda k: abs(math.log(k[0])))
            near = (f"; its FLOPs per rank are {ratio:.1f}x those of the nearest calibrated shape ({n}/{b})"
                    if ratio >= 1 else f"; its FLOPs per rank are 1/{1 / ratio:.1f} of the nearest calibrated "
                                       f"shape's ({n}/{b})")
        else:
            near = ""
        out.append(f"compute of {prefix}{config} at {local_batch} sequences per rank on {ranks} ranks is not calibrated "
                   f"(calibrated config/local batch: {listed}), so it is estimated from FLOPs at the calibrated "
                   f"efficiency, which can be off by 2-3x{near}; measure it with hpf calibrate --shapes "
                   f"{prefix}{config}/{local_batch} --world-sizes {ranks}")
    worlds = sorted({w for links in (hw.fast, hw.slow) if isinstance(links, dict)
                     for w in (k[1] if isinstance(k, tuple) else k for k in links)})
    if worlds and ranks not in worlds and ranks > 1:
        far = f"{ranks / max(worlds):.1f}x the largest" if ranks > max(worlds) else "between the calibrated ones"
        out.append(f"links were calibrated on {', '.join(map(str, worlds))} ranks; {ranks} ranks ({far}) use the "
                   "nearest, slowed by ranks per core")
    return out
