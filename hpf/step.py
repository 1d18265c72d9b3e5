"""``hpf.shard_step``: one sharded training step of a pure loss function.

Layouts are resolved once, in ``init``. The steady-state step then runs plain tensors:
gather units as the loss function reaches them, plain ``torch.autograd`` backward, one
reduce-scatter per unit bucket, one scalar all-reduce for the loss and grad norm, and the
optimizer on flat shards.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .collectives import SPMD, gather_dim0, spmd
from .device import default_device
from .fsdp import BucketComm, UnitEngine
from .mesh import Mesh, MeshError
from .planning import Plan, plan as make_plan
from .topology import TieredComm, Topology
from .types import MixedPrecision, TrainState

__all__ = ["ShardStep", "step_plan"]


class ShardStep:
    """The production step: the callable :func:`hpf.shard_step` returns for ``mode="production"``.

    Subclasses (validation mode) extend two documented hooks, :meth:`forward_backward` and
    :meth:`call_loss`, and name their mode in the class attribute :attr:`mode`.

    Args:
        loss_fn, mesh, optimizer, param_specs, fsdp_axes, mixed_precision, max_grad_norm,
        topology, hsdp, overlap_optimizer: as for :func:`hpf.shard_step`.

    Raises:
        ValueError: an unknown ``mixed_precision`` name, or ``max_grad_norm <= 0``.
        TypeError: ``optimizer`` has no ``init``/``update``.
    """

    #: The ``mode=`` of :func:`hpf.shard_step` that makes this class.
    mode = "production"

    def __init__(self, loss_fn: Callable, *, mesh: Mesh, optimizer, param_specs=None, fsdp_axes=None,
                 mixed_precision: MixedPrecision | str | None = None,
                 max_grad_norm: float | None = None, topology: Topology | None = None, hsdp: bool = False,
                 overlap_optimizer: bool = True):
        mixed_precision = MixedPrecision.parse(mixed_precision)
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={max_grad_norm}: must be positive, or None for no clipping")
        for name in ("init", "update"):
            if not callable(getattr(optimizer, name, None)):
                raise TypeError(f"optimizer {optimizer!r} has no {name}(); pass hpf.optim.adamw(...) "
                                "or another object with init(params) and update(grads, state, params)")
        self.loss_fn, self.mesh, self.optimizer = loss_fn, mesh, optimizer
        self.param_specs, self.fsdp_axes = param_specs, fsdp_axes
        self.mp, self.max_grad_norm = mixed_precision, max_grad_norm
        self.topology, self.hsdp = topology, hsdp
        self._want_overlap = overlap_optimizer
        self.plan: Plan | None = None
        self.engine: UnitEngine | None = None

    # -- set-up, once ---------------------------------------------------------------------------
    def init(self, full_params: Any) -> TrainState:
        """Full params (the same on every rank) -> this rank's sharded train state."""
        self.mesh.check_world()
        if not dist.is_initialized() and self.mesh.size > 1:
            raise MeshError(f"{self.mesh} has {self.mesh.size} ranks but no process group is running; "
                            "start the job with hpf.launch(fn, world_size) or torchrun")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = default_device()
        self.plan = step_plan(full_params, self.mesh, self.param_specs, self.fsdp_axes, topology=self.topology,
                              hsdp=self.hsdp)
        _check_same_on_all_ranks(self.plan)
        master = self.mp.master_dtype if self.mp else None
        shards = [s.to(self.device) for s in self.plan.shards(full_params, self.rank, master)]
        reduce = self.mp.reduce_dtype if self.mp else None
        compute = self.mp.compute_dtype if self.mp else None
        self.grad_shards = [torch.zeros_like(s, dtype=reduce or s.dtype) for s in shards]
        cdts = [compute or b.dtype for b in self.plan.buckets]
        rdts = [g.dtype for g in self.grad_shards]
        if self.topology is None:
            comm = BucketComm(self.plan, self.device, cdts, rdts)
        else:
            comm = TieredComm(self.plan, self.topology, self.device, cdts, rdts)
        self.engine = UnitEngine(self.plan, self.rank, comm, compute, self.device,
                                 pipeline=self.topology is None or self.topology.pipeline)
        self.dp_size = self.mesh.axis_size(self.plan.fsdp_axes)
        self._spmd = SPMD(self.mesh, self.rank, self.plan.fsdp_axes)
        n_compute = self.mesh.axis_size(self.plan.compute_axes)
        self._loss_seed = None if n_compute == 1 else 1.0 / n_compute
        # Buckets replicated over non-FSDP axes hold partial grads there (see hpf.collectives).
        partial = [(b.index, tuple(a for a in self.plan.compute_axes if a not in b.compute_axes))
                   for b in self.plan.buckets]
        self._compute_sums = [(b, self.mesh.group(axes)) for b, axes in partial if self.mesh.axis_size(axes) > 1]
        self._replica_counts = torch.tensor([float(self.plan.replicas(b)) for b in self.plan.buckets])
        opt = self.optimizer
        self._opt = opt.for_plan(self.plan, self.rank) if hasattr(opt, "for_plan") else opt
        # Optimizer overlap: an elementwise optimizer updates each unit as soon as its grads
        # land, while backward and the other reductions go on, and the next step's first
        # gathers start right after. Global clipping and partial-sum all-reduces need every
        # grad first (and validation, which checks grads before any update, passes
        # overlap_optimizer=False): those keep the update after backward.
        self.overlap_optimizer = (self._want_overlap and self.max_grad_norm is None
                                  and not self._compute_sums and hasattr(self._opt, "partial_update"))
        return TrainState(shards, self._opt.init(shards))

    # -- the step --------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, float]]:
        """One step on this rank's local batch. The state's buffers are updated in place
        (donated): keep using the returned state."""
        if self.engine is None:
            raise RuntimeError("call step.init(full_params) first, and pass the state it returns")
        t0 = time.perf_counter()
        eng = self.engine
        grads = self.grad_shards
        opt_s = [0.0]
        if self.overlap_optimizer:
            update = self._opt.partial_update(state.opt_state, state.params)

            def update_buckets(buckets: list[int]) -> None:
                t = time.perf_counter()
                torch._foreach_div_([grads[b] for b in buckets], float(self.dp_size))
                update(buckets, grads)
                opt_s[0] += time.perf_counter() - t
            eng.update_buckets = update_buckets
        try:
            loss = self.forward_backward(state, batch)
        finally:
            eng.update_buckets = None
        if not self.overlap_optimizer:
            torch._foreach_div_(grads, float(self.dp_size))
        norms = torch.stack(torch._foreach_norm(grads)).float()
        sq = (norms.square() / self._replica_counts).sum()
        totals = torch.stack([loss.detach().float(), sq])
        if dist.is_initialized() and self.mesh.size > 1:
            dist.all_reduce(totals)
            totals[0] /= self.mesh.size
        grad_norm = float(totals[1].sqrt())
        if self.max_grad_norm is not None:
            torch._foreach_mul_(grads, min(1.0, self.max_grad_norm / (grad_norm + 1e-6)))
        t_opt = time.perf_counter()
        if self.overlap_optimizer:  # already applied, unit by unit, during backward
            params, opt_state = state.params, state.opt_state
        else:
            params, opt_state = self._opt.update(grads, state.opt_state, state.params)
        eng.begin(params, self.grad_shards)  # the next step's first gathers overlap the caller's work
        t1 = time.perf_counter()
        metrics = {"loss": float(totals[0]), "grad_norm": grad_norm, "step_s": t1 - t0,
                   "optimizer_s": t1 - t_opt + opt_s[0], "comm_wait_s": eng.take_wait_s()}
        return TrainState(params, opt_state), metrics

    def forward_backward(self, state: TrainState, batch: Any) -> torch.Tensor:
        """Run loss_fn and backward; leaves the grads of the local losses, summed over the FSDP
        axes, in ``self.grad_shards``. Returns this rank's loss. Updates nothing.

        A hook: subclasses extend it with checks before and after (validation mode checks the
        state and batch first and the grads after); :func:`hpf.validate.check_grads` calls it
        to get grads without an update."""
        eng = self.engine
        if not eng.ready_for(state.params):
            eng.begin(state.params, self.grad_shards)
        with torch.autograd.graph.saved_tensors_hooks(eng.pack, eng.unpack), spmd(self._spmd):
            loss = self.call_loss(eng.params_tree(), batch)
            _check_loss(loss)
            if self._loss_seed is None:
                loss.backward()
            else:  # the loss is replicated over non-FSDP axes: each copy carries 1/n (see hpf.collectives)
                loss.backward(torch.full_like(loss, self._loss_seed))
        eng.finish()
        for b, group in self._compute_sums:
            dist.all_reduce(self.grad_shards[b], group=group)
        return loss

    def call_loss(self, params: Any, batch: Any) -> torch.Tensor:
        """The one call of ``loss_fn`` inside :meth:`forward_backward`.

        A hook: subclasses wrap params and batch here (validation mode tracks their layouts)."""
        return self.loss_fn(params, batch)

    def full_params(self, state: TrainState) -> Any:
        """The gathered full params, as a plain pytree of fresh tensors (the same on every rank).

        A one-off, collective call (checkpoints, evaluation): it uses plain all-gathers,
        not the step's transports."""
        plan = self.plan
        local = {}
        for b, shard in zip(plan.buckets, state.params):
            ranks = plan.shard_ranks(b, self.rank)  # entry i holds shard position i
            if len(ranks) == 1:
                full = shard
            else:
                parts = [torch.empty_like(shard) for _ in ranks]
                dist.all_gather(parts, shard, group=plan.mesh.group(b.shard_axes))  # in rank order
                by_rank = dict(zip(sorted(ranks), parts))
                full = torch.cat([by_rank[r] for r in ranks])
            local.update(plan.views(b, full))
        return plan.tree({p: _gather_compute_axes(plan, p, x).clone() for p, x in local.items()})


def step_plan(params: Any, mesh: Mesh, param_specs: Any = None, fsdp_axes=None, *,
              topology: Topology | None = None, hsdp: bool = False) -> Plan:
    """The plan :func:`hpf.shard_step` makes for these arguments (the CLI's ``hpf plan`` prints it).

    Args:
        params: the full params (meta tensors are enough).
        mesh, param_specs, fsdp_axes, topology, hsdp: as for :func:`hpf.shard_step`.

    Raises:
        SpecError: as :func:`hpf.plan`.
    """
    fsdp = mesh.axis_names if fsdp_axes is None else tuple(fsdp_axes)
    return make_plan(params, mesh, param_specs, fsdp_axes,
                     hierarchical=topology is not None and topology.hierarchical,
                     default_shard_axes=[a for a in fsdp if a in mesh.fast_axes] if hsdp else None,
                     bucket_bytes=topology.bucket_bytes if topology else 0)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    if not loss.requires_grad:
        raise ValueError("the loss does not depend on the params (it has no grad_fn): make loss_fn "
                         "compute with the params it receives")


def _check_same_on_all_ranks(plan: Plan) -> None:
    """Fail at init, not in a hung collective, when ranks were given different params."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [(p, s.global_shape, str(s.dtype)) for p, s in plan.slots.items()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            diff = next((a, b) for a, b in zip(mine + [None] * len(theirs), theirs + [None] * len(mine)) if a != b)
            raise ValueError(f"rank {r} has different params than rank {dist.get_rank()}: "
                             f"{diff[1]} vs {diff[0]} (path, shape, dtype). Every rank must call "
                             "step.init with the same full params tree")


def _gather_compute_axes(plan: Plan, path: str, local: torch.Tensor) -> torch.Tensor:
    """Undo the non-FSDP splits of one param: all-gather along each split dim."""
    slot = plan.slots[path]
    out = local
    for dim in range(len(slot.spec)):
        axes = tuple(a for a in slot.spec.dim_axes(dim) if a in plan.compute_axes)
        if axes:
            out = gather_dim0(out.movedim(dim, 0), plan.mesh.group(axes), plan.mesh.axis_size(axes)).movedim(0, dim)
    return out
