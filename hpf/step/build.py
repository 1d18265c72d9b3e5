"""What a step's ``init`` builds from its config: the plan, this rank's first shards, the comm and the engine."""
from __future__ import annotations

from typing import Any

import torch

from ..comm import world
from ..comm.flat import BucketComm
from ..comm.tiered import TieredComm
from ..comm.transport import UnitComm
from ..config import StepConfig
from ..engine import UnitEngine
from ..launcher import init_distributed, is_launched
from ..mesh import Mesh, MeshError
from ..planning import Plan, step_plan
from ..train_state import zeros, zeros_like

__all__ = ["join_world", "engine_for", "plan_for", "first_shards", "born_sharded", "INVARIANT_ALIGN"]


def join_world(mesh: Mesh) -> None:
    """Start the process group under torchrun if none runs yet; check the mesh fits the world."""
    if not world.is_distributed() and mesh.size > 1:
        if not is_launched():
            raise MeshError(f"{mesh} has {mesh.size} ranks but no process group is running; start the job with "
                            "hpf.launch(fn, world_size), or call hpf.launch.init_distributed() first under torchrun")
        init_distributed()
    mesh.check_world()


def engine_for(cfg: StepConfig, plan: Plan, shards: list[torch.Tensor], device: torch.device,
            on_extra_gather) -> tuple[list[torch.Tensor], UnitComm, UnitEngine]:
    """The step's grad shards, its comm for ``cfg``'s topology and precision, and its engine over it."""
    mp = cfg.mixed_precision
    grad_shards = [zeros_like(s[:0] if b.frozen else s, dtype=mp.reduce_dtype if mp else s.dtype)
                   for b, s in zip(plan.buckets, shards)]  # (frozen buckets: none)
    cdts = [mp.compute_dtype if mp else b.dtype for b in plan.buckets]
    rdts = [g.dtype for g in grad_shards]
    comm = (BucketComm(plan, device, cdts, rdts) if cfg.topology is None
            else TieredComm(plan, cfg.topology, device, cdts, rdts))
    return grad_shards, comm, UnitEngine(
        plan, comm, mp.compute_dtype if mp else None, device,
        pipeline=cfg.topology is None or cfg.topology.pipeline,
        capacity=cfg.resident_units, compute_sums=_compute_sums(plan, world.rank()),
        on_extra_gather=on_extra_gather, rematerialize=cfg.grad == "torch.func", blocks=plan.padded_blocks(world.rank()))


def _compute_sums(plan: Plan, rank: int) -> list[tuple[int, Any, slice]]:
    """(bucket, group, slice of this rank's shard) of the grads that are partial sums over non-FSDP
    axes (params replicated there: hpf.comm.collectives). Every rank makes the groups, in plan order."""
    sums = []
    for b in plan.buckets:
        if b.frozen:
            continue
        for axes in dict.fromkeys(plan.partial_axes(s) for s in b.slots):
            if plan.mesh.axis_size(axes) > 1:
                plan.mesh.group(axes)
        sums += [(b.index, plan.mesh.group(axes), part) for part, axes in b.runs(plan.shard_index(b, rank),
                                                                                 plan.partial_axes)
                 if plan.mesh.axis_size(axes) > 1]
    return sums


#: the invariant mode's shards are whole multiples of this many elements: wider than any CPU or
#: accelerator vector, so an elementwise kernel (the optimizer's) meets each element in the same
#: lane and loop as on the whole buffer at any world size
INVARIANT_ALIGN = 256


def plan_for(cfg: StepConfig, full_params, frozen) -> Plan:
    """The step's plan. The invariant mode covers data parallelism over the FSDP axes (sharded,
    replicated, or both: HSDP): it refuses, naming the param, what it does not cover yet
    (partial sums over tp or experts axes)."""
    plan = step_plan(full_params, cfg.mesh, cfg.param_specs, cfg.fsdp_axes, topology=cfg.topology, hsdp=cfg.hsdp,
                     frozen=frozen, align=INVARIANT_ALIGN if cfg.invariant else 1)
    for b in plan.buckets if cfg.invariant else ():
        axes = b.split_axes or tuple(a for a in plan.compute_axes if plan.mesh.axis_size(a) > 1)
        if axes:
            raise MeshError(f"invariant=True: parameter {b.slots[0].path!r} is computed over the axes {axes} of "
                            f"{plan.mesh}, whose partial sums follow the mesh; the invariant mode covers data "
                            "parallelism over the FSDP axes (tp and experts over an axis are not covered yet): run "
                            "them without invariant=True")
    return plan


def first_shards(plan: Plan, made_from, rank: int, dtype, device) -> list[torch.Tensor]:
    """This rank's flat shards, from the full params or a traced init (``InitTrace``); meta
    params (shapes only, for a restore to fill) give zeros."""
    shards = made_from.shards(plan, rank, dtype) if hasattr(made_from, "shards") else plan.shards(made_from, rank, dtype)
    return [zeros(s.shape, s.dtype, device) if s.is_meta else s.to(device) for s in shards]


def born_sharded(params: Any, key):
    """The traced ``init_fn`` when ``step.init`` was given one (with its key), else None."""
    if key is None:
        if callable(params) and not isinstance(params, torch.Tensor):
            raise TypeError("step.init(init_fn) needs the key to draw with: step.init(init_fn, key=hpf.random.key(0))")
        return None
    if not callable(params):
        raise TypeError("step.init(params, key=...): a key goes with an init function (key -> params), not a "
                        "params tree; pass step.init(init_fn, key=key), or the params alone")
    from ..sharded_init import trace_init
    return trace_init(params, key)
