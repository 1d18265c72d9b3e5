"""``hpf.check_plan``: validation mode for one rank's view of a mesh of any size, on meta tensors."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from ..comm.collectives import SPMD, spmd
from ..mesh import Mesh
from ..planning import Plan, step_plan
from ..topology import Topology
from ..precision import MixedPrecision
from .errors import as_layout_errors
from .layout import describe
from .tracker import Tracker

__all__ = ["PlanCheck", "check_plan"]


@dataclass
class PlanCheck:
    """What :func:`check_plan` checked: one rank's view of the whole step, on meta tensors."""

    plan: Plan
    rank: int
    ops: int  # torch ops whose layouts were checked
    loss_layout: str
    unused: list[str]  # params the loss does not depend on (their grads stay zero)
    seconds: float

    def __str__(self) -> str:
        return (f"plan check OK on {self.plan.mesh} (rank {self.rank}'s view): {len(self.plan.slots)} params, "
                f"{self.ops} ops checked, loss {self.loss_layout}"
                + (f", unused params {self.unused[:5]}" if self.unused else "") + f" ({self.seconds:.2f} s)")


def check_plan(loss_fn: Callable, params_meta: Any, mesh: Mesh, batch_meta: Any, *, param_specs: Any = None,
               fsdp_axes: Sequence[str] | None = None, rank: int = 0,
               mixed_precision: MixedPrecision | str | None = None, backward: bool = True,
               topology: Topology | None = None, hsdp: bool = False, frozen=()) -> PlanCheck:
    """Check a plan at any scale in one process, starting nothing: validation mode for ``rank``'s
    view of a (virtual) ``mesh``, on meta tensors.

    Runs ``loss_fn`` on this rank's local param blocks with every layout checked (collectives
    only produce the right shapes), then backward to check the grad shapes.

    Args:
        loss_fn: the pure loss function ``(params, batch) -> scalar``.
        params_meta: the full params (meta tensors are enough).
        mesh: the mesh to check, of any size (no process group is needed).
        batch_meta: one rank's local batch (meta or real; it is moved to meta).
        param_specs, fsdp_axes, mixed_precision, topology, hsdp, frozen: as for
            :func:`hpf.shard_step`: the plan checked is the one the step makes (one recipe).
        rank: whose view of the mesh to check.
        backward: also run backward (lists params the loss does not use).

    Returns:
        A :class:`PlanCheck`.

    Raises:
        LayoutError: the first failed check (a subclass from :mod:`hpf.validate.errors`).
        SpecError: a spec the planner rejects (ParamsTreeError, IndivisibleSpecError are both).
        ValueError: ``rank`` outside the mesh, or an unknown ``mixed_precision`` name.
        TypeError: ``loss_fn`` does not return a scalar tensor.
    """
    t0 = time.perf_counter()
    mixed_precision = MixedPrecision.parse(mixed_precision)
    if not 0 <= rank < mesh.size:
        raise ValueError(f"check_plan: rank={rank} is outside {mesh} ({mesh.size} ranks)")
    with as_layout_errors("check_plan"):
        plan = step_plan(params_meta, mesh, param_specs, fsdp_axes, topology=topology, hsdp=hsdp, frozen=frozen)
    cdt = mixed_precision.compute_dtype if mixed_precision else None
    tracker = Tracker(mesh, plan.fsdp_axes, cdt, check_finite=False)
    local = {p: torch.empty(s.local_shape, dtype=cdt or s.dtype, device="meta", requires_grad=True)
             for p, s in plan.slots.items()}
    for p, t in local.items():
        tracker.set(t, tracker.param_info(plan, p))
    params = plan.tree(local)
    batch = tracker.track_batch(optree.tree_map(
        lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, batch_meta, none_is_leaf=True))
    with spmd(SPMD(mesh, rank, plan.fsdp_axes, virtual=True)):
        with tracker:
            loss = loss_fn(params, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        info = tracker.check_loss(loss)
        unused = []
        if backward and loss.requires_grad:
            loss.backward()
            unused = [p for p, t in local.items() if t.grad is None]
    return PlanCheck(plan, rank, tracker.ops, describe(info, mesh.axis_names), unused, time.perf_counter() - t0)
