"""``hpf.shard_step``'s production step: one sharded training step of a pure loss function.

Layouts are resolved once, in ``init`` (hpf.step.build). A step then runs plain tensors, in phases:
micro-batches -> forward and backward of each (units gathered as the loss function reads
them, reductions issued as backward completes them) -> the reductions land -> one global
decision (one all-reduce: the loss, the grad norm, finiteness, and that every rank issued the
same collectives) -> the update (hpf.step.update) -> the next step's first gathers.
"""
from __future__ import annotations

import atexit
import gc
import sys
import time
import weakref
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import torch

from .. import batching, losses, misuse
from .. import tree as tree_util
from ..errors import NonFiniteError, UnusedParamsError
from ..comm import world
from ..comm.world import default_device
from ..comm.collectives import SPMD, spmd
from ..comm.transport import UnitComm
from ..config import StepConfig
from ..decision import Decider, Decision
from ..engine import UnitEngine, explain, refuses_hooks
from ..engine.compiled import compile_seconds
from ..optim.base import capabilities
from ..planning import Plan
from ..state_io import StateIO
from ..trace import span
from ..train_state import GATHER_STATS, StepStats, TrainState
from .build import born_sharded, engine_for, first_shards, join_world, plan_for
from .donation import Donation
from .update import EarlyWork, update_state

__all__ = ["ShardStep"]


_TIMED = ("step_s", "optimizer_s", "comm_wait_s", "compile_s")  # metrics StepStats sums over the steps


class ShardStep:
    """The production step: the callable :func:`hpf.shard_step` returns for ``mode="production"``.

    Subclasses (validation mode) extend three documented hooks: :meth:`forward_backward` (one
    micro-batch), :meth:`call_loss` (the one call of ``loss_fn``) and :meth:`after_reductions`;
    :attr:`on_extra_gather` is handed to the engine. They name their mode in :attr:`mode`.

    Args:
        loss_fn: the pure loss function.
        config: the validated options (:class:`hpf.StepConfig`).
    """

    #: The ``mode=`` of :func:`hpf.shard_step` that makes this class.
    mode = "production"
    #: Called by the engine with (unit, phase) at each gather beyond loop-style use.
    on_extra_gather: Callable[[str, str], None] | None = None

    def __init__(self, loss_fn: Callable, config: StepConfig):
        self.loss_fn, self.config = loss_fn, config
        self.mesh, self.optimizer, self.mp = config.mesh, config.optimizer, config.mixed_precision
        self.plan: Plan | None = None
        self.engine: UnitEngine | None = None  # (the step's own: nothing outside it reaches in)
        self.comm: UnitComm | None = None  # the step's collectives, made by init: to measure or instrument them
        self._donation = Donation()
        self._io: StateIO | None = None  # checkpoints and full params (made by init)
        self._terms = 1.0  # fp16: a weighted loss's terms per micro-batch, last seen (losses.terms_divisor)
        self._timed = dict.fromkeys(("steps",) + _TIMED, 0)  # the steps' count and summed timings (for stats())
        self._closed: StepStats | None = None  # the stats at close(); set once the step is closed
        self._early = EarlyWork()  # the optimizer's work begun in backward (hpf.optim.EarlyUpdate)
        self._atom: tuple[int, int] | None = None  # invariant mode: (the micro-batch's atom, atoms per rank)

    def init(self, params: Any, *, key: torch.Tensor | None = None) -> TrainState:
        """This rank's sharded train state, from the full params (the same on every rank), or from
        ``init_fn`` and ``key``: only this rank's shards of ``init_fn(key)``, bit for bit (hpf.sharded_init).
        Under torchrun with no process group yet, this starts one. ``nn.Parameter`` leaves are detached."""
        self._donation.check_open("step.init(params)")
        cfg, born = self.config, born_sharded(params, key)
        full_params = born.meta_params if born else params
        join_world(self.mesh)
        frozen = misuse.frozen_paths(full_params, cfg.frozen)
        full_params = misuse.clean_params(full_params, allow_meta=True)
        self._donation.unloaded = not born and any(x.is_meta for x in tree_util.flatten(full_params)[1])
        self.rank, self.device = world.rank(), default_device()
        self.plan = plan_for(cfg, full_params, frozen)
        misuse.check_same_on_all_ranks(self.plan, full_params, self.device, born.digest() if born else None)
        shards = first_shards(self.plan, born or full_params, self.rank, self.mp.master_dtype if self.mp else None,
                               self.device)
        self.grad_shards, self.comm, self.engine = engine_for(cfg, self.plan, shards, self.device, self.on_extra_gather)
        self._spmd = SPMD(self.mesh, self.rank,  # (collectives: on axes a param computes sharded over, too)
                          tuple(a for a in self.plan.fsdp_axes if a not in self.plan.split_axes))
        self.decider = Decider.of(self.plan, self.mesh.size, cfg.grad_clip, self.rank, cfg.invariant)
        opt = self.optimizer
        self.plan_optimizer = opt.for_plan(self.plan, self.rank) if capabilities(opt).for_plan else opt
        self._io = StateIO(self.plan, self.rank, self.device, self.plan_optimizer, loss_scale=cfg.loss_scale,
                           master_dtype=self.mp and self.mp.master_dtype, feedback_numel=self.comm.lowbit and self.comm.lowbit.feedback_numel)
        _OPEN.add(self)
        return self._donation.donate(self._io.new_state(shards))

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step on this rank's local batch. The state's buffers are updated in place (donated):
        keep using the returned state; passing this one again raises DonatedStateError.

        A non-finite loss or grad norm (on any rank) is found before any update: it raises NonFiniteError with
        the state as before, or (``on_nonfinite="skip"``, fp16 loss scaling) reports ``metrics["skipped"]``."""
        t0, compiled_s = time.perf_counter(), compile_seconds()
        with span("hpf/step"):
            decision = self._compute(state, batch)
            if not decision.finite and self._retune(state, decision):  # a first step's overflow, not the grads'
                decision = self._compute(state, batch)
            t_opt = time.perf_counter()
            if not decision.finite:
                self._early.drop()  # (nothing of it was applied)
            if decision.finite:
                try:
                    with span("hpf/optimizer", "all"):
                        state = update_state(state, decision, self.grad_shards, self.engine, self.comm,
                                        self.plan_optimizer, self._early, self.config)
                except BaseException as err:
                    self._early.forget()
                    self.engine.abort(err)
                    raise
            elif state.loss_scale is not None:
                self.config.loss_scale.update(state.loss_scale, finite=False)
            elif self.config.on_nonfinite == "raise":
                raise _nonfinite_error(decision)
        metrics = _metrics(decision, state, t0, t_opt, self.engine.take_wait_s(), compile_seconds() - compiled_s)
        self._timed = _add_timings(self._timed, metrics)
        return self._donation.donate(state), metrics

    def grads(self, state: TrainState, batch: Any) -> list[torch.Tensor]:
        """The grads of the step's loss on this batch as flat shards (one per bucket, normalized
        as the update sees them, before clipping), without updating ``state``. A collective."""
        d = self._compute(state, batch, clip=False)
        self._early.drop()
        return [g * d.grad_scale for g in self.grad_shards]

    def _compute(self, state: TrainState, batch: Any, clip: bool = True) -> Decision:
        """Every phase but the update: micro-batches, forward and backward, reductions, decision."""
        self._donation.check(state, "step(state, batch)")
        if self.engine is None:
            raise RuntimeError("call step.init(full_params) first, and pass the state it returns")
        self.check_state(state)
        self._io.first_use(state, self.grad_shards)
        micro = _micro_batches(self.config, batch)
        eng = self.engine
        # fp16: backward's seed is the loss scale, per term for hpf.weighted (whose sum has many)
        scale = float(state.loss_scale.scale) / self._terms if state.loss_scale is not None else 1.0
        if state.error_feedback is not None:
            self.comm.lowbit.use_feedback(state.error_feedback, scale)
        mark = eng.grads_mark()
        try:
            self._early.start(self.plan_optimizer, eng, self.decider, self.grad_shards, state.opt_state,
                              len(micro), scale)
            eng.begin(state.params)
            outs = []
            for i, mb in enumerate(micro):
                self._atom = (self.decider.dp_index * len(micro) + i, len(micro)) if self.config.invariant else None
                outs.append(self.forward_backward(state, mb, hold=i < len(micro) - 1, scale=scale))
            eng.wait_reductions()
            self.after_reductions()
            eng.end_step()
            decision = self.decider.decide(outs, self.grad_shards, batch, scale, clip)
            self._spmd = _checked_once(self._spmd)  # (every rank decided: a step's collectives agreed)
            eng.add_wait(decision.waited_s)
            if decision.grad_norm == 0.0 and eng.no_grads_since(mark):
                raise UnusedParamsError(_UNUSED)
            if decision.finite:
                self._retune(state, decision)
            return decision
        except BaseException as err:
            self._early.forget()
            eng.abort(err)
            raise

    def _retune(self, state: TrainState, decision: Decision) -> bool:
        """Whether fp16's per-term divisor changed (an overflowed step ran with a stale one: a first step, a resume)."""
        old = self._terms
        if state.loss_scale is not None and decision.count is not None:
            self._terms = losses.terms_divisor(decision.count / (self.mesh.size * self.config.accumulate))
        return self._terms != old

    def forward_backward(self, state: TrainState, batch: Any, hold: bool = False, scale: float = 1.0) -> losses.LossOut:
        """Forward and backward of ``loss_fn`` on one micro-batch: its grads are summed per unit
        and, unless ``hold`` (a later micro-batch follows), reduced. Returns the parsed loss.
        Updates nothing.

        A hook: subclasses extend it with checks before (validation mode checks the state and
        the batch)."""
        try:
            return self._run(batch, hold, scale)
        except RuntimeError as err:
            if not (refuses_hooks(err) and not self.engine.holds_sums()):
                raise explain(err)
        # torch.func.grad/vjp inside loss_fn refuse saved-tensor hooks: every rank gets here at
        # the same read; keep units gathered from read to backward instead, and run it again.
        self.engine.keep_gathered(state.params)
        return self._run(batch, hold, scale)

    def _run(self, batch: Any, hold: bool, scale) -> losses.LossOut:
        eng, cfg = self.engine, self.config
        if self.mp is not None:
            batch = batching.cast(batch, self.mp.compute_dtype, batching.leaf_axes(batch, cfg.batch_axes))
        seed = scale / self.plan.compute_size
        with spmd(self._spmd), eng.micro_batch(self.grad_shards, hold, self._atom):
            if cfg.grad == "torch.func":
                return _func_grads(eng, self.call_loss, batch, seed)
            with eng.saved_tensor_hooks():
                out = losses.parse(self.call_loss(eng.params_tree(), batch))
                self._early.loss_known(out, hold, self.mesh.size)
                eng.start_backward()
                out.value.backward(None if seed == 1.0 else torch.full_like(out.value, seed))
        return out

    def check_state(self, state: TrainState) -> None:
        """A hook, first thing in a step: the state fits this step's plan (validation mode says
        more: which bucket, which params)."""
        _check_shards(self.plan, state)

    def call_loss(self, params: Any, batch: Any) -> Any:
        """The one call of ``loss_fn`` inside :meth:`forward_backward`.

        A hook: subclasses wrap params and batch here (validation mode tracks their layouts)."""
        return self.loss_fn(params, batch)

    def after_reductions(self) -> None:
        """A hook: the step's grads have landed in ``self.grad_shards`` (summed, not yet divided)."""

    # -- the state in and out (hpf.state_io.StateIO, after this step's checks) ------------------------------
    def save(self, state: TrainState, path, extra: Any = None, *, keep_last: int | None = None,
             async_save: bool = False, meta: dict | None = None):
        """Collective: write a DCP checkpoint of ``state`` to ``path`` (see hpf.checkpoint.save)."""
        self._donation.check(state, "step.save(state, path)")
        return self._io.save(state, path, extra, keep_last=keep_last, async_save=async_save, meta=meta)

    def wait_save(self):
        """Block until an async save is published; re-raises its error. Returns its path or None."""
        return self._io.wait_save() if self._io is not None else None

    def restore(self, path, state: TrainState | None = None, *, strict: bool = True) -> tuple[TrainState, Any]:
        """Collective: ``(state, extra)`` from the checkpoint at ``path``, whatever mesh saved it (hpf.checkpoint.restore)."""
        self._donation.check_open("step.restore(path)")
        if self.plan is None:
            raise RuntimeError("call step.init(params) first (meta params are fine), then step.restore(path)")
        state, extra = self._io.restore(path, state, strict=strict)
        self._donation.unloaded = False
        return self._donation.donate(state), extra

    def full_params(self, state: TrainState, rank: int | None = None) -> Any:
        """The gathered full params, as a plain pytree of fresh tensors. A collective every rank calls;
        ``rank=r``: the tree on rank r only (None elsewhere). One-off (checkpoints, evaluation):
        plain all-gathers, not the step's transports."""
        self._donation.check(state, "full_params(state)")
        return self._io.full_params(state, rank)

    # -- the step's boundary ----------------------------------------------------------------------------------
    def stats(self) -> StepStats:
        """Bytes sent, waits, timings and gathers since ``init``, as a :class:`hpf.StepStats`
        (subtract an earlier snapshot for what happened in between). Local: no collective."""
        return self._closed or _stats(self._timed, self.engine, self.comm, getattr(self, "plan_optimizer", None))

    def close(self) -> None:
        """Release what the step holds: its comm's worker threads, process groups and shared
        memory, and its gathered buffers. Every rank closes its own step (after the same calls,
        so the next step's gathers already in flight land first). Closing twice is a no-op; any
        other use of a closed step raises. ``with hpf.shard_step(...) as step:`` closes on leaving.
        A pending async save is waited for (its error raised, after the release)."""
        if self._closed is not None:
            return
        _OPEN.discard(self)
        self._closed = self.stats()
        try:
            self.wait_save()
        finally:
            engine, comm, self.engine, self.comm = self.engine, self.comm, None, None
            self._donation.close()
            if engine is not None:
                try:
                    engine.release()
                    self._closed = _stats(self._timed, engine, comm, getattr(self, "plan_optimizer", None))  # (what it left held: nothing)
                finally:
                    comm.close()
                del engine, comm
                gc.collect()  # the engine's callbacks make cycles: free its shared memory now, not at some later gc

    def __enter__(self) -> "ShardStep":
        self._donation.check_open("with step")
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checked_once(ctx: SPMD) -> SPMD:
    """After a production step's first decision its explicit collectives stop checking the ranks' shapes
    (hpf.comm.collectives: a rank-dependent shape is there from the first step); validation mode checks all."""
    return replace(ctx, check_shapes=False) if ctx.check_shapes and not ctx.validate else ctx


_OPEN: "weakref.WeakSet[ShardStep]" = weakref.WeakSet()  # steps initialized and not yet closed


@atexit.register
def _close_at_exit() -> None:
    """Close the steps a job left open. A job that ends with ``dist.destroy_process_group()`` and no
    ``step.close()`` left its steps' process groups, with their gloo threads, to the interpreter's
    teardown, where a thread still running aborts the process ("terminate called without an active
    exception") and torchrun reports a finished job as failed. Closing here, while the interpreter is
    whole, ends those threads in order (hpf's own atexit, so it runs after the user's). Async saves
    first: finished, or reported lost with exit status 1 once the group is gone (hpf.checkpoint)."""
    saves = sys.modules.get("hpf.checkpoint.saving")  # (not imported: no save was made)
    if saves is not None:
        saves.finish_saves_at_exit()
    for step in list(_OPEN):
        try:
            step.close()
        except BaseException as e:  # (at exit: say it, and close the others)
            print(f"hpf: closing a step at exit: {type(e).__name__}: {e}", file=sys.stderr)


def _stats(timed: dict, engine: UnitEngine | None, comm: UnitComm | None, optimizer=None) -> StepStats:
    if engine is None:
        return StepStats(**timed)
    sent = Counter(comm.bytes)
    if hasattr(optimizer, "bytes_sent"):  # distributed Muon's point-to-point pieces
        slow = optimizer.slow_bytes_sent
        sent.update({k: n for k, n in ((("muon", "fast"), optimizer.bytes_sent - slow), (("muon", "slow"), slow)) if n})
    return StepStats(**timed, bytes=sent, **{f: getattr(engine.stats, f) for f in GATHER_STATS})


def _metrics(d: Decision, state: TrainState, t0: float, t_opt: float, wait_s: float, compile_s: float) -> dict:
    """A step's metrics (``ShardStep.__call__``'s), from its decision and its clock."""
    t1 = time.perf_counter()
    metrics = {"loss": d.loss, "grad_norm": d.grad_norm, "step_s": t1 - t0, "optimizer_s": t1 - t_opt,
               "comm_wait_s": wait_s, "compile_s": compile_s, "skipped": not d.finite}
    if d.aux is not None:
        metrics["aux"] = d.aux
    if state.loss_scale is not None:
        metrics["loss_scale"] = float(state.loss_scale.scale)
    return metrics


def _add_timings(timed: dict, metrics: dict) -> dict:
    return {"steps": timed["steps"] + 1, **{k: timed[k] + metrics[k] for k in _TIMED}}


def _nonfinite_error(d: Decision) -> NonFiniteError:
    if d.count == 0:
        return NonFiniteError("hpf.weighted(sum, count): the global count is 0 (every rank's batch is all padding), "
                              "so there is no loss to average; nothing was updated, on any rank. Leave such batches "
                              "out, or pass on_nonfinite='skip' to skip them")
    return NonFiniteError(f"the loss ({d.loss}) or the global grad norm ({d.grad_norm}) is non-finite; nothing was "
                          "updated, on any rank. Run the step with mode='validate' to name the op or parameter, "
                          "lower the learning rate, or pass on_nonfinite='skip'")


_UNUSED = ("the loss reached none of the params it was given: no grad flowed to any of them, so nothing would "
           "train. loss_fn must compute with its `params` argument; an nn.Module called inside it uses its own "
           "weights, which hpf neither shards nor trains: build the loss with "
           "`params, loss_fn = hpf.from_module(model, loss)` (or torch.func.functional_call)")


def _check_shards(plan: Plan, state: Any) -> None:
    shards = getattr(state, "params", None)
    if not isinstance(shards, (list, tuple)) or len(shards) != len(plan.buckets):
        raise ValueError(f"step(state, batch): the state does not match this step's plan ({len(plan.buckets)} "
                         "flat shards); pass the state returned by this step's init, or by its previous call")
    for b, shard in zip(plan.buckets, shards):  # before any collective: a foreign state's sizes
        if not isinstance(shard, torch.Tensor) or tuple(shard.shape) != (b.shard_numel,):
            said = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
            raise ValueError(f"step(state, batch): state shard {b.index} (unit {b.unit!r}, first param "
                             f"{b.slots[0].path!r}) is {said}, but this step's plan has ({b.shard_numel},) there: "
                             "the state belongs to another step or plan; pass the state this step's init returned")


def _func_grads(engine: UnitEngine, call_loss: Callable, batch: Any, seed: float) -> losses.LossOut:
    """grad="torch.func": ``grad_and_value`` of loss_fn with respect to the micro-batch's anchor,
    which every unit entry hangs off: each entry's backward hands its unit's grads to the
    reducer, as under autograd. Blocks run through ``UnitList.apply`` (hpf.models'
    ``each_block``) are rematerialized, so a unit is gathered per block, as FSDP does."""
    parsed = []

    def seeded(anchor):  # (torch.func returns only tensors as aux: the rest stays in ``parsed``)
        out = losses.parse(call_loss(engine.params_tree(anchor), batch))
        parsed.append(out)
        engine.start_backward()
        aux = tuple(out.aux.values()) if out.aux else ()
        return (out.value if seed == 1.0 else out.value * seed), (out.value, *aux)
    _, (_, (value, *aux)) = torch.func.grad_and_value(seeded, has_aux=True)(engine.anchor.detach())  # (no tape of its own)
    out = parsed[-1]
    return losses.LossOut(value, out.count, dict(zip(out.aux, aux)) if out.aux else None)


def _micro_batches(cfg: StepConfig, batch) -> list:
    """The step's micro-batches: ``accumulate`` equal parts, or in the invariant mode its atoms."""
    axes = batching.leaf_axes(batch, cfg.batch_axes)
    return (batching.atoms(batch, cfg.atom_size, axes) if cfg.invariant
            else batching.micro_batches(batch, cfg.accumulate, axes))
