"""``hpf.shard_step``: one sharded training step of a pure loss function.

Layouts are resolved once, in ``init``. The steady-state step then runs plain tensors:
gather units as the loss function reaches them, plain ``torch.autograd`` backward, one
reduce-scatter per unit bucket, one scalar all-reduce for the loss and grad norm, and the
optimizer on flat shards.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist

from . import checks
from . import tree as tree_util
from .checks import DonatedStateError, NonFiniteError
from .comm import schedule
from .comm.collectives import SPMD, gather_dim0, spmd
from .comm.schedule import LOG
from .comm.flat import BucketComm
from .comm.tiered import TieredComm, Topology
from .device import default_device
from .fsdp import UnitEngine, explain_freed
from .launcher import init_distributed, is_launched
from .mesh import Mesh, MeshError
from .optim.base import ForPlan, Optimizer, PartialUpdate
from .planning import Plan, plan as make_plan
from .trace import span
from .types import MixedPrecision, TrainState

__all__ = ["ShardStep", "step_plan"]


class ShardStep:
    """The production step: the callable :func:`hpf.shard_step` returns for ``mode="production"``.

    Subclasses (validation mode) extend two documented hooks, :meth:`forward_backward` and
    :meth:`call_loss`, and name their mode in the class attribute :attr:`mode`.

    Args:
        loss_fn, mesh, optimizer, param_specs, fsdp_axes, mixed_precision, max_grad_norm,
        topology, hsdp, overlap_optimizer, on_nonfinite, accumulate: as for :func:`hpf.shard_step`.

    Raises:
        ValueError: an unknown ``mixed_precision`` name or ``on_nonfinite``, or a ``max_grad_norm``
            that is not finite and > 0.
        TypeError: ``optimizer`` has no ``init``/``update``.
    """

    #: The ``mode=`` of :func:`hpf.shard_step` that makes this class.
    mode = "production"

    def __init__(self, loss_fn: Callable, *, mesh: Mesh, optimizer, param_specs=None, fsdp_axes=None,
                 mixed_precision: MixedPrecision | str | None = None,
                 max_grad_norm: float | None = None, topology: Topology | None = None, hsdp: bool = False,
                 overlap_optimizer: bool = True, grad: str = "autograd", on_nonfinite: str = "raise",
                 accumulate: int = 1):
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate={accumulate!r}: give the number of micro-batches per step, an int >= 1")
        self.accumulate = accumulate
        if grad not in ("autograd", "torch.func"):
            raise ValueError(f"grad={grad!r}: use 'autograd' (the default, faster: benchmarks/grad_modes.py) "
                             "or 'torch.func'")
        self.grad = grad
        mixed_precision = MixedPrecision.parse(mixed_precision)
        checks.check_max_grad_norm(max_grad_norm)
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use 'raise' (NonFiniteError) or 'skip' (no update)")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer {optimizer!r} is not an hpf.optim.Optimizer (it needs init() and update()): pass hpf.optim.adamw(...) "
                            "or another object with init(params) and update(grads, state, params)")
        self.loss_fn, self.mesh, self.optimizer = loss_fn, mesh, optimizer
        self.param_specs, self.fsdp_axes = param_specs, checks.as_axes(fsdp_axes)
        self.on_nonfinite = on_nonfinite
        self.mp, self.max_grad_norm = mixed_precision, max_grad_norm
        self.topology, self.hsdp = topology, hsdp
        self._want_overlap = overlap_optimizer
        self.plan: Plan | None = None
        self.engine: UnitEngine | None = None
        self._live: list | None = None  # the params list of the state this step last returned
        self._unloaded = False  # init had meta params and no restore has filled them yet
        self._micro_scale = 1.0  # 1/accumulate during a step's micro-batches (scales the loss seed)
        self._pending_save = None  # an async save in flight (hpf.checkpoint.SaveHandle)
        self._aux: dict | None = None  # loss_fn's aux dict of the current step, if it returns one

    # -- set-up, once ---------------------------------------------------------------------------
    def init(self, full_params: Any) -> TrainState:
        """Full params (the same on every rank) -> this rank's sharded train state.

        Under torchrun (its environment set) with no process group yet, this starts one
        (``hpf.launch.init_distributed()``). ``nn.Parameter`` leaves are detached."""
        if not dist.is_initialized() and self.mesh.size > 1:
            if not is_launched():
                raise MeshError(f"{self.mesh} has {self.mesh.size} ranks but no process group is running; start "
                                "the job with hpf.launch(fn, world_size), or call hpf.launch.init_distributed() "
                                "first under torchrun")
            init_distributed()
        self.mesh.check_world()
        full_params = checks.clean_params(full_params, allow_meta=True)
        # Meta params give zero shards that must be filled by step.restore before any use.
        self._unloaded = any(x.is_meta for x in optree.tree_leaves(full_params))
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = default_device()
        self.plan = step_plan(full_params, self.mesh, self.param_specs, self.fsdp_axes, topology=self.topology,
                              hsdp=self.hsdp)
        checks.check_same_on_all_ranks(self.plan, full_params, self.device)
        master = self.mp.master_dtype if self.mp else None
        # Meta params (shapes only, e.g. before step.restore): zero shards of the right layout.
        shards = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) if s.is_meta else s.to(self.device)
                  for s in self.plan.shards(full_params, self.rank, master)]
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
        # Axes a param computes sharded over (experts on a borrowed data axis) allow collectives.
        self._spmd = SPMD(self.mesh, self.rank, tuple(a for a in self.plan.fsdp_axes if a not in self.plan.split_axes))
        n_compute = self.mesh.axis_size(self.plan.compute_axes)
        self._loss_seed = None if n_compute == 1 else 1.0 / n_compute
        # Buckets replicated over non-FSDP axes hold partial grads there (see hpf.comm.collectives).
        partial = [(b.index, tuple(a for a in self.plan.compute_axes if a not in b.split_axes))
                   for b in self.plan.buckets]
        self._compute_sums = [(b, self.mesh.group(axes)) for b, axes in partial if self.mesh.axis_size(axes) > 1]
        self._replica_counts = torch.tensor([float(self.plan.replicas(b)) for b in self.plan.buckets])
        opt = self.optimizer
        self._opt = opt.for_plan(self.plan, self.rank) if isinstance(opt, ForPlan) else opt
        # Optimizer overlap: an elementwise optimizer updates each unit as soon as its grads
        # land, while backward and the other reductions go on, and the next step's first
        # gathers start right after. Global clipping and partial-sum all-reduces need every
        # grad first (and validation, which checks grads before any update, passes
        # overlap_optimizer=False), and on_nonfinite="skip" (all or nothing): those keep the update
        # after backward.
        self.overlap_optimizer = (self._want_overlap and self.max_grad_norm is None and self.on_nonfinite == "raise"
                                  and not self._compute_sums and isinstance(self._opt, PartialUpdate))
        state = TrainState(shards, self._opt.init(shards))
        self._live = state.params
        return state

    # -- the step --------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, float]]:
        """One step on this rank's local batch. The state's buffers are updated in place
        (donated): keep using the returned state; passing this one again raises DonatedStateError.

        A non-finite loss (on any rank) or a non-finite grad norm is found
        before any update; either raises NonFiniteError, or with ``on_nonfinite="skip"`` leaves
        params and optimizer state unchanged and reports ``metrics["skipped"] = True``."""
        if self.engine is None:
            raise RuntimeError("call step.init(full_params) first, and pass the state it returns")
        self._check_live(state, "step(state, batch)")
        micro = self._micro_batches(batch)
        with span("hpf/step"):
            return self._step(state, micro)

    def _step(self, state: TrainState, micro: list) -> tuple[TrainState, dict[str, float]]:
        t0 = time.perf_counter()
        eng = self.engine
        grads = self.grad_shards
        opt_s = [0.0]
        norms: list = [None] * len(grads)
        applied = [0, False]  # buckets updated during backward; whether a non-finite unit halted updates
        if self.overlap_optimizer:
            update = []  # made at the first landed unit, after the loss passed its check

            def update_buckets(buckets: list[int]) -> None:
                t = time.perf_counter()
                unit = [grads[b] for b in buckets]
                torch._foreach_div_(unit, float(self.dp_size))
                unit_norms = torch._foreach_norm(unit)  # reused for the grad norm below
                for b, n in zip(buckets, unit_norms):
                    norms[b] = n
                # Non-finite grads stop this rank's updates for the step (the state stays finite);
                # the global grad norm then makes every rank raise.
                applied[1] = applied[1] or not self._agreed() or not math.isfinite(float(sum(unit_norms)))
                if not applied[1]:
                    if not update:
                        update.append(self._opt.partial_update(state.opt_state, state.params))
                    update[0](buckets, grads)
                    applied[0] += len(buckets)
                opt_s[0] += time.perf_counter() - t
        else:
            update_buckets = None
        eng.drop_held()
        losses, auxes = [], []
        self._micro_scale = 1.0 / len(micro)
        try:
            for mb in micro[:-1]:  # all but the last: grads are summed locally, not reduced
                eng.holding = True
                try:
                    losses.append(self.forward_backward(state, mb).detach())
                finally:
                    eng.holding = False
                auxes.append(self._aux)
                if not self._agreement.ok():
                    return self._refuse(state, t0, losses[-1])
                eng.begin(state.params, self.grad_shards)  # the next micro-batch's first gathers
            with eng.overlapping(update_buckets):
                loss = self.forward_backward(state, micro[-1])
        finally:
            self._micro_scale = 1.0
        if auxes and self._aux is not None:  # aux (e.g. tokens per expert) sums over the micro-batches
            self._aux = {k: sum((a[k] for a in auxes), v) for k, v in self._aux.items()}
        with span("hpf/wait agreement"):
            agreed = self._agreement.ok()
        if not agreed:  # (or UnevenBatchError) decided by all ranks; nothing was updated
            return self._refuse(state, t0, loss)
        with span("hpf/grad norm"):
            if losses:  # the step's loss: the mean over its micro-batches, as one big batch would give
                loss = torch.stack([*losses, loss.detach()]).mean()
            if not self.overlap_optimizer:
                torch._foreach_div_(grads, float(self.dp_size))
            missing = [b for b, n in enumerate(norms) if n is None]
            for b, n in zip(missing, torch._foreach_norm([grads[b] for b in missing]) if missing else ()):
                norms[b] = n
            sq = (torch.stack(norms).float().square() / self._replica_counts).sum()
            aux = self._aux or {}  # loss_fn's aux tensors ride along in the all-reduce: summed over every rank
            totals = torch.cat([torch.stack([loss.detach().float(), sq, sq.new_tensor(float(applied[0]))])]
                               + [v.detach().float().reshape(-1).to(sq.device) for v in aux.values()])
        if dist.is_initialized() and self.mesh.size > 1:
            with span("hpf/all-reduce loss and grad norm"):
                LOG.record("all-reduce", "the step's loss and grad norm")
                schedule.wait(dist.all_reduce(totals, async_op=True), "the step's all-reduce")
            totals[0] /= self.mesh.size
        mean_loss, grad_norm = float(totals[0]), float(totals[1].sqrt())
        if not math.isfinite(grad_norm):
            if self.on_nonfinite == "skip":  # (overlap is off: nothing was updated)
                return self._skip(state, t0, mean_loss, grad_norm)
            eng.begin(state.params, self.grad_shards)  # ready for the state as it is
            partly = (f" {int(totals[2])} bucket update(s) with finite grads were applied during backward "
                      "(optimizer overlap), so the state is finite but part-way into this step; "
                      "overlap_optimizer=False or on_nonfinite='skip' makes the step all or nothing."
                      if totals[2] else " Nothing was updated.")
            raise NonFiniteError(f"the global grad norm is {grad_norm} (loss {mean_loss}).{partly} Run the step "
                                 "with mode='validate' to name the parameter, or lower the learning rate")
        if self.max_grad_norm is not None:
            torch._foreach_mul_(grads, min(1.0, self.max_grad_norm / (grad_norm + 1e-6)))
        t_opt = time.perf_counter()
        if self.overlap_optimizer:  # already applied, unit by unit, during backward
            params, opt_state = state.params, state.opt_state
        else:
            with span("hpf/optimizer", "all"):
                params, opt_state = self._opt.update(grads, state.opt_state, state.params)
        eng.begin(params, self.grad_shards)  # the next step's first gathers overlap the caller's work
        t1 = time.perf_counter()
        metrics = {"loss": mean_loss, "grad_norm": grad_norm, "step_s": t1 - t0,
                   "optimizer_s": t1 - t_opt + opt_s[0], "comm_wait_s": eng.take_wait_s(), "skipped": False}
        if self._aux is not None:
            flat = torch.split(totals[3:], [v.numel() for v in aux.values()])
            metrics["aux"] = {k: x.view(v.shape) for (k, v), x in zip(aux.items(), flat)}
        return self._donate(TrainState(params, opt_state)), metrics

    def _refuse(self, state: TrainState, t0: float, loss: torch.Tensor):
        """A non-finite loss (or uneven batch) on some rank: skip the step or raise; nothing was updated."""
        self.engine.drop_held()
        if self.on_nonfinite == "skip":
            return self._skip(state, t0, float("nan"), float("nan"))
        self.engine.begin(state.params, self.grad_shards)  # ready for the state as it is
        raise NonFiniteError(f"the loss is non-finite on some rank (this rank: {float(loss.detach())}); nothing "
                             "was updated. Run the step with mode='validate' to name the op where it first "
                             "appeared, lower the learning rate, or pass on_nonfinite='skip'")

    def _micro_batches(self, batch: Any) -> list:
        """``accumulate`` equal slices of every batch leaf along dim 0 (the local batch)."""
        k = self.accumulate
        if k == 1:
            return [batch]
        paths, leaves, treedef = tree_util.flatten(batch)
        for p, x in zip(paths, leaves):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % k:
                got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"accumulate={k}: batch leaf {p or '<root>'!r} is {got}; every batch leaf must be a "
                                 f"tensor whose first dim (this rank's batch) splits into {k} equal micro-batches. "
                                 f"Use a local batch that is a multiple of {k}")
        chunks = [x.chunk(k) for x in leaves]
        return [tree_util.unflatten(treedef, [c[j] for c in chunks]) for j in range(k)]

    def _skip(self, state: TrainState, t0: float, loss: float, grad_norm: float):
        """on_nonfinite="skip": no update; the same buffers come back as the live state."""
        self.engine.begin(state.params, self.grad_shards)
        metrics = {"loss": loss, "grad_norm": grad_norm, "step_s": time.perf_counter() - t0, "optimizer_s": 0.0,
                   "comm_wait_s": self.engine.take_wait_s(), "skipped": True}
        return self._donate(TrainState(state.params, state.opt_state)), metrics

    def _agreed(self) -> bool:
        """Whether the batch agreement allows updates (an UnevenBatchError waits for after backward)."""
        try:
            return self._agreement.ok()
        except checks.UnevenBatchError:
            return False

    def _donate(self, state: TrainState) -> TrainState:
        """Make ``state`` the live one: a fresh params list over the same buffers, so the state
        passed in (same buffers, old list) is recognizably donated."""
        state = TrainState(list(state.params), state.opt_state)
        self._live = state.params
        return state

    def _check_live(self, state: Any, op: str) -> None:
        if self._unloaded:
            raise RuntimeError(f"{op}: step.init was given meta params (shapes only), so the state holds no values "
                               "yet; call state, extra = step.restore(path) first")
        live, params = self._live, getattr(state, "params", None)
        if live is None or params is live or not isinstance(params, (list, tuple)):
            return
        if any(a is b for a, b in zip(params, live)):
            raise DonatedStateError(
                f"{op}: this state was already passed to step, which updated its buffers in place (donated, as "
                "in JAX). Use the state the step returned: state, metrics = step(state, batch)")

    def forward_backward(self, state: TrainState, batch: Any) -> torch.Tensor | None:
        """Run loss_fn and backward; leaves the grads of the local losses, summed over the FSDP
        axes, in ``self.grad_shards``. Returns this rank's loss, and starts ``self._agreement``
        (all ranks' losses finite, batches even), which the caller awaits before any update.
        Updates nothing, except through the optimizer overlap's ``update_buckets``.

        A hook: subclasses extend it with checks before and after (validation mode checks the
        state and batch first and the grads after); :func:`hpf.validate.check_grads` calls it
        to get grads without an update."""
        eng = self.engine
        if not eng.ready_for(state.params):
            eng.begin(state.params, self.grad_shards)
        if self.mp is not None:
            batch = checks.cast_batch(batch, self.mp.compute_dtype)
        with spmd(self._spmd), eng.running():
            try:
                loss = self._grads(batch)
            except RuntimeError as err:
                if not (eng.leases and "saved tensor hooks" in str(err)):
                    raise explain_freed(err) from err
                # torch.func.grad/vjp inside loss_fn refuse saved-tensor hooks: from now on keep
                # each unit gathered from its first read to its backward, and run the step again.
                eng.leases = False
                eng.begin(state.params, self.grad_shards)
                loss = self._grads(batch)
        eng.finish()
        if eng.holding:  # (grads held for a later micro-batch: nothing to sum yet)
            return loss
        for b, group in self._compute_sums:
            dist.all_reduce(self.grad_shards[b], group=group)
        return loss

    def _grads(self, batch: Any) -> torch.Tensor:
        """Forward and backward of loss_fn (grads go to the engine); returns this rank's loss."""
        eng, seed = self.engine, self._loss_seed  # seed: the loss is replicated over non-FSDP axes,
        if self._micro_scale != 1.0:  # each micro-batch's loss is 1/K of the step's
            seed = (1.0 if seed is None else seed) * self._micro_scale
        if self.grad == "torch.func":               # so each copy carries 1/n (see hpf.comm.collectives)
            def scaled(params):
                loss = self._split_aux(self.call_loss(params, batch))
                _check_loss(loss)
                loss = loss.reshape(())  # a one-element loss of shape (1,) is a scalar too
                return (loss if seed is None else loss * seed), loss
            grads, (_, loss) = torch.func.grad_and_value(scaled, has_aux=True)(eng.gathered_tree())
            self._agreement = checks.BatchAgreement(batch, loss, dist.is_initialized() and self.mesh.size > 1)
            eng.reduce_tree(grads)
            return loss
        hooks = torch.autograd.graph.saved_tensors_hooks(eng.pack, eng.unpack) if eng.leases else contextlib.nullcontext()
        with hooks:
            loss = self._split_aux(self.call_loss(eng.params_tree(), batch))
            _check_loss(loss)
            loss = loss.reshape(())  # a one-element loss of shape (1,) is a scalar too
            # starts the all-ranks check of batch shapes and loss finiteness; it overlaps backward
            self._agreement = checks.BatchAgreement(batch, loss, dist.is_initialized() and self.mesh.size > 1)
            eng.start_backward()
            loss.backward(None if seed is None else torch.full_like(loss, seed))
        return loss

    def _split_aux(self, out: Any) -> Any:
        """Keeps loss_fn's aux dict, if any, for ``metrics["aux"]``; returns the loss."""
        loss, aux = split_aux(out)
        self._aux = None if aux is None else {k: v.detach() for k, v in aux.items()}
        return loss

    def call_loss(self, params: Any, batch: Any) -> torch.Tensor:
        """The one call of ``loss_fn`` inside :meth:`forward_backward`.

        A hook: subclasses wrap params and batch here (validation mode tracks their layouts)."""
        return self.loss_fn(params, batch)

    # -- checkpoints (hpf/checkpoint.py) ------------------------------------------------------
    @property
    def plan_optimizer(self) -> Optimizer:
        """The optimizer as it runs on this plan's flat shards (``for_plan``'s result, if it has one)."""
        return self._opt

    def fresh_state(self) -> TrainState:
        """A zero train state of this plan's layout (what ``restore`` loads into)."""
        master = self.mp.master_dtype if self.mp else None
        shards = [torch.zeros(b.shard_numel, dtype=master or b.dtype, device=self.device) for b in self.plan.buckets]
        return TrainState(shards, self._opt.init(shards))

    def save(self, state: TrainState, path, extra: Any = None, *, keep_last: int | None = None,
             async_save: bool = False):
        """Collective: write a DCP checkpoint of ``state`` to ``path`` (see hpf.checkpoint.save)."""
        from . import checkpoint

        self._check_live(state, "step.save(state, path)")
        self.wait_save()
        self._pending_save = checkpoint.save(self, state, path, extra, keep_last=keep_last, async_save=async_save)
        return self._pending_save

    def wait_save(self):
        """Block until an async save is published; re-raises its error. Returns its path or None."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def restore(self, path, state: TrainState | None = None, *, strict: bool = True) -> tuple[TrainState, Any]:
        """Collective: ``(state, extra)`` from the checkpoint at ``path``, whatever mesh saved it
        (``strict``: see hpf.checkpoint.restore)."""
        from . import checkpoint

        self.wait_save()
        state, extra = checkpoint.restore(self, path, state, strict=strict)
        self._unloaded, self._live = False, state.params
        return state, extra

    def full_params(self, state: TrainState, rank: int | None = None) -> Any:
        """The gathered full params, as a plain pytree of fresh tensors.

        A collective: every rank must call it (a rank that skips it leaves the others waiting
        until the timeout). ``rank=None`` returns the tree on every rank; ``rank=r`` returns it
        on rank r and None elsewhere (every rank still calls). One-off (checkpoints,
        evaluation): it uses plain all-gathers, not the step's transports."""
        self._check_live(state, "full_params(state)")
        try:
            tree = self._gather_full(state)
        except RuntimeError as e:
            raise RuntimeError(f"full_params is a collective: every rank must call it, with the same state "
                               f"(use full_params(state, rank=0) to keep the result on rank 0 only). {e}") from e
        return tree if rank is None or rank == self.rank else None

    def _gather_full(self, state: TrainState) -> Any:
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
    fsdp_axes = checks.as_axes(fsdp_axes)
    fsdp = mesh.axis_names if fsdp_axes is None else fsdp_axes
    return make_plan(params, mesh, param_specs, fsdp_axes,
                     hierarchical=topology is not None and topology.hierarchical,
                     default_shard_axes=[a for a in fsdp if a in mesh.fast_axes] if hsdp else None,
                     bucket_bytes=topology.bucket_bytes if topology else 0)


def split_aux(out: Any) -> tuple[Any, dict | None]:
    """(loss, aux) of what loss_fn returned: it may return ``(loss, aux)``, aux a dict of tensors
    (e.g. MoE tokens per expert) that the step sums over every rank into ``metrics["aux"]``."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out
    return out, None


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn returned a {loss.dtype} loss, which has no gradient: return a real floating-point "
                        "tensor (an integer cast such as .long() or a comparison cuts the loss off from the params)")
    if not loss.requires_grad:
        raise ValueError("the loss does not depend on the params (it has no grad_fn): make loss_fn "
                         "compute with the params it receives")


def _gather_compute_axes(plan: Plan, path: str, local: torch.Tensor) -> torch.Tensor:
    """Undo the non-FSDP splits of one param: all-gather along each split dim."""
    slot = plan.slots[path]
    out = local
    for dim in range(len(slot.spec)):
        axes = plan.split_dim_axes(slot, dim)
        if axes and plan.mesh.axis_size(axes) > 1:  # (size 1: nothing to gather, maybe no process group)
            out = gather_dim0(out.movedim(dim, 0), plan.mesh.group(axes), plan.mesh.axis_size(axes)).movedim(0, dim)
    return out
