"""The FSDP unit engine (``UnitEngine``): a step's forward and backward over a plan's units.

The loss function reads units through the params tree (hpf.engine.views); each read is one
autograd entry whose params are views of the unit's gathered buffers (hpf.engine.gather).
Which units are gathered and evicted, in forward and backward, is decided by
hpf.engine.residency from the sequence of reads alone; grads are summed per unit and reduced
in a fixed order by hpf.engine.reduce. The invariant all of it keeps (docs/architecture.md):
every collective a rank issues is a function of that sequence of reads, which is the same on
every rank; references, gc and timing may only decide when memory is freed.

A step drives the engine in phases: ``begin`` (no-op when the last step's ``prefetch`` still
holds) -> per micro-batch ``micro_batch`` (read, backward) -> ``wait_reductions`` -> ``end_step`` ->
``prefetch`` of the next step's first units; ``abort`` puts it back in order after an error.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

import torch

from ..comm import schedule
from ..errors import StaleParamError
from ..comm.schedule import LOG
from ..planning import ROOT, Plan
from ..trace import Ranges
from .compiled import hide_from_compiler, refused_fullgraph
from .entry import Recompute, entry, rematerialized
from .gather import MemoryStats, Gatherer, Waits
from .reduce import Reducer
from .residency import RESIDENT_UNITS, Residency
from .unit_state import Phase
from .views import ParamsView

__all__ = ["UnitEngine", "explain", "refuses_hooks"]


def _outside_transforms(method: Callable) -> Callable:
    """The engine's own buffers are not the loss function's: gathers and grad copies write them in
    place, which torch.func transforms would refuse as mutating captured tensors."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if not torch._C._are_functorch_transforms_active():  # (then there is nothing to disable)
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)
    return run


class UnitEngine:
    """Runs one step's forward and backward over a plan's units (see the module doc).

    Args:
        plan, comm: the plan and its collectives (hpf.comm.flat.BucketComm, hpf.comm.tiered.TieredComm).
        compute_dtype: dtype of the gathered params (None: the params' own).
        pipeline: reductions overlap the rest of backward; capacity: block units gathered at once (+ root).
        compute_sums: (bucket, group, slice of its shard) whose grads are partial sums over non-FSDP axes.
        blocks: the blocks the function sees of params stored padded (Plan.padded_blocks).
        on_extra_gather: told (unit, phase) of each gather beyond loop-style use (validation warns).
    """

    def __init__(self, plan: Plan, comm, compute_dtype: torch.dtype | None, device: torch.device, *,
                 pipeline: bool = True, capacity: int = RESIDENT_UNITS, compute_sums=(),
                 on_extra_gather: Callable[[str, str], None] | None = None, rematerialize: bool = False, blocks=None):
        self.plan, self.comm, self.device = plan, comm, device
        self.units = list(plan.units)
        self._before = dict(zip(self.units, [ROOT, *self.units[:-1]]))  # the unit before each, in tree order (trace)
        waits = Waits()  # seconds compute spent blocked on the step's collectives: add_wait(s), take_wait_s()
        self.add_wait, self.take_wait_s = waits.add, waits.take
        self.buffers = Gatherer(plan, comm, compute_dtype, capacity, self.add_wait, on_extra_gather)
        units = list(self.buffers.units.values())  # each unit's one runtime object, which the policies share
        self.residency = Residency(units, capacity)
        self.reducer = Reducer(plan, comm, units, self.buffers.shared, pipeline, list(compute_sums),
                               before_issue=self.buffers.start_queued, on_wait=self.add_wait)
        r = self.reducer  # what the step asks of the reductions (hpf.engine.reduce), and nothing more:
        self.holds_sums, self.grads_mark, self.no_grads_since, self.tell_landed = (
            r.holds_sums, r.grads_mark, r.no_grads_since, r.tell_landed)
        self.view = ParamsView(plan, {u: plan.slot_paths(u) for u in self.units}, self._entry, blocks)
        self.stats: MemoryStats = self.buffers.stats
        self.phase = Phase.IDLE
        self.broken: BaseException | None = None  # the error that left the ranks out of step (Phase.BROKEN)
        self._prefetched: list | None = None  # (bucket, master, version) the next step's gathers were made from
        self._root = None
        self.anchor = None  # the micro-batch's: every entry hangs off it (grad="torch.func" differentiates by it)
        self._trace = Ranges()  # trace: each unit's forward and backward
        self.micro_batches = 0
        self.rematerialize = rematerialize  # UnitList.apply keeps only a block's inputs (grad="torch.func")
        self._hidden = False  # whether compiled code sees the entry points as graph breaks (hpf.engine.compiled)

    # -- phases of a step -------------------------------------------------------------------------------
    def begin(self, masters: list[torch.Tensor]) -> None:
        """A step starts on ``masters``; the gathers ``prefetch`` started are kept if these are
        still the shards they were made from."""
        _refuse_if_broken(self.broken)
        LOG.failed = None
        snap = self._prefetched
        self._prefetched = None
        self.phase = self.phase.to(Phase.STEP)
        if snap is not None and _untouched(snap, masters):
            self.buffers.set_shards(masters, keep={self.plan.buckets[b].unit for b, _, _ in snap})
            return
        self._settle()
        self.buffers.set_shards(masters)
        self._first_gathers()

    def prefetch(self, masters: list[torch.Tensor]) -> None:
        """Start the next step's first gathers (``first_units``) from ``masters``, already updated."""
        first = self.first_units()
        self.buffers.set_shards(masters, keep=set(self.units) - set(first))
        self._first_gathers()
        self._prefetched = [(b, masters[b], masters[b]._version) for b in self.first_buckets()]
        self.phase = self.phase.to(Phase.PREFETCHED)

    def _first_gathers(self) -> None:
        self.buffers.new_phase()
        self.buffers.apply(self.residency.begin(), "forward")

    def first_units(self) -> list[str]:
        """The units a step gathers before its first read: pinned ones, then the predicted first reads."""
        return list(dict.fromkeys([u for u in self.units if u in self.residency.pinned] + self.residency.predicted_first()))

    def first_buckets(self) -> list[int]:
        """The buckets of ``first_units``, in plan order."""
        return sorted({b for u in self.first_units() for b in self.plan.units[u].buckets})

    @contextlib.contextmanager
    def micro_batch(self, grad_shards: list[torch.Tensor], hold: bool, atom=None) -> Iterator[None]:
        """One forward and backward (``params_tree``, ``start_backward``, autograd); on leaving, every unit
        not yet reduced is (``hold``: kept for the next one instead; ``atom``: Reducer.start's)."""
        if not self._hidden:
            self._hidden = hide_from_compiler(self)
        if self.reducer.holds_sums():  # a later micro-batch: prefetch its first units
            self.buffers.new_phase()
            self.buffers.apply(self.residency.resume(), "forward")
        self.reducer.start(grad_shards, hold, atom)
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        self.micro_batches += 1  # stamps this micro-batch's entries (``entry_done`` refuses older ones)
        self._root, self._reads = None, 0  # (``_reads``: the schedule log numbers this micro-batch's reads)
        self.phase = self.phase.to(Phase.FORWARD)
        self.buffers.new_phase()
        try:
            yield
        finally:
            self._trace.end()
            self._root = self.anchor = None
        self.reducer.finish()
        self.phase = self.phase.to(Phase.STEP)

    def params_tree(self, anchor: torch.Tensor | None = None) -> Any:
        """The loss function's params: root params as views, unit lists read when reached.
        ``anchor``: the tensor this call's entries hang off (a torch.func transform's input)."""
        if anchor is not None:
            self.anchor = anchor
        self._trace.switch("hpf/forward", ROOT)
        return self.view.tree(self._read, self._apply if self.rematerialize else None)

    def start_backward(self) -> None:
        """The loss is computed: from here a read is a checkpoint recomputing."""
        self.phase = self.phase.to(Phase.BACKWARD)
        self.buffers.new_phase()
        self.residency.start_backward()
        self._trace.switch("hpf/backward", ROOT)

    def wait_reductions(self) -> None:
        """Wait for every reduction of the step (then the grad shards are final)."""
        self.buffers.start_queued()
        t = time.perf_counter()
        self.reducer.wait()
        self.add_wait(time.perf_counter() - t)
        self.buffers.wait_gathers()

    def end_step(self) -> None:
        """The step's reads are over: the residency policy learns them for the next step; free
        what is gathered."""
        self.residency.end_step()
        self.buffers.settle()
        self.phase = self.phase.to(Phase.IDLE)

    def abort(self, err: BaseException | None = None) -> None:
        """After an error anywhere in a step: wait for what is in flight, free, forget the step.

        After ranks fell out of step (ScheduleMismatchError), or when what was in flight cannot
        land, the engine is broken: its next use raises, naming the first error."""
        self._trace.end()
        self._root = self.anchor = None
        self._prefetched = None
        self.buffers.drop_queue()
        self.reducer.drop_held()
        if err is not None and not isinstance(err, (schedule.ScheduleMismatchError, TimeoutError)):
            LOG.failed = _one_line(err)  # (a waiting peer names it)
        if isinstance(err, schedule.ScheduleMismatchError):
            self.broken = err
        if self.broken is None:
            try:
                self._settle()
            except Exception as e:  # noqa: BLE001 - the step's own error is the one raised
                self.broken = e
        self.phase = Phase.IDLE if self.broken is None else Phase.BROKEN  # (from any phase)

    def _read(self, unit: str) -> Any:
        """The loss function reads list element ``unit``."""
        self._reach(unit)
        return self.view.subtree(unit)

    def _apply(self, unit: str, fn: Callable, args: tuple) -> Any:
        """``UnitList.apply`` with ``rematerialize``: ``fn`` on the unit, keeping only ``args`` for
        backward (``rematerialized``). A unit with tied leaves of another unit's is read plainly."""
        if self.phase is Phase.BACKWARD or self.view.needs(unit) != [unit]:
            return fn(self._read(unit), *args)
        self._reach(unit)
        self.reducer.entry(unit)
        rc = Recompute(unit, self.micro_batches, functools.partial(self._gathered_views, unit),
                       functools.partial(self.regather, unit), functools.partial(self.view.subtree, unit),
                       self.entry_done)
        return rematerialized(self.anchor, rc, fn, args)

    def _gathered_views(self, unit: str) -> tuple:
        self.buffers.wait(unit)
        return tuple(self.buffers.units[unit].views())

    @_outside_transforms
    def regather(self, unit: str) -> tuple:
        """``unit``'s param views for a backward that needs them (gathered again if evicted)."""
        acts = self.residency.need([unit])
        if acts.gather or acts.evict or acts.prefetch:
            self.buffers.apply(acts, "backward")
        return self._gathered_views(unit)

    @_outside_transforms
    def _reach(self, unit: str) -> None:
        """The residency policy's actions for one read of ``unit``, recorded in forward."""
        needs, backward = self.view.needs(unit), self.phase is Phase.BACKWARD
        if not backward:
            self._reads += 1
            LOG.record("read", unit, self._reads)
        acts = self.residency.need(needs) if backward else self.residency.read(needs)
        self.buffers.apply(acts, "backward" if backward else "forward")
        if not backward:
            self._trace.switch("hpf/forward", unit)

    def _entry(self, unit: str) -> tuple:
        """The param views of one read of ``unit`` (an autograd entry, except while recomputing)."""
        if unit == ROOT and self._root is not None:
            return self._root
        self.buffers.wait(unit)
        u = self.buffers.units[unit]
        if self.phase is Phase.BACKWARD and unit != ROOT:  # a checkpoint recomputing: the forward's entries take the grads,
            return tuple(v if i in u.frozen else v.detach().requires_grad_()  # these only need to save what
                         for i, v in enumerate(u.views()))  # forward saved (requires_grad)
        views = entry(self.anchor, u, self.micro_batches, self.entry_done)
        self.reducer.entry(unit)
        if unit == ROOT:
            self._root = views
        else:
            u.hand_out(views)
        return views

    @_outside_transforms
    def entry_done(self, unit: str, grads: tuple, stamp: int) -> None:
        """Backward of one entry: its grads; a unit whose grads are complete is evicted.

        An entry of an earlier micro-batch (a param tensor kept across steps: in a global, a
        closure, a compiled function's constants) would add grads of stale values to this one's."""
        if stamp != self.micro_batches or self.anchor is None:
            raise StaleParamError(_STALE.format(unit=unit))
        if self.reducer.add(unit, [g.detach() for g in grads]):  # (a torch.func transform's grads track)
            for u in self.residency.done(unit):
                self.buffers.evict(u)
            self.buffers.start_queued(when_free=True)
            self._trace.switch("hpf/backward", self._before[unit])

    def saved_tensor_hooks(self):
        """Autograd's saved params as descriptions (``Saved``), only while some unit's memory can be freed."""
        needed = self.buffers.freeable and self.buffers.capacity < len(self.units)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if needed else contextlib.nullcontext()

    def _pack(self, t: torch.Tensor) -> Any:
        return self.buffers.pack(t)

    def _unpack(self, saved: Any) -> Any:
        return self.buffers.unpack(saved, self.regather)

    def keep_gathered(self, masters: list[torch.Tensor]) -> None:
        """Start the step again on ``masters``, from now on keeping each unit gathered from read to backward,
        with no saved-tensor hooks: torch.func.grad/vjp inside loss_fn refuse them (``refuses_hooks``)."""
        self.abort()
        self.buffers.capacity = len(self.units)
        self.residency = Residency(list(self.residency.by_name.values()), len(self.units))
        self.begin(masters)

    def release(self) -> None:
        """The step closes: free what is held (in flight lands first; not when broken: it may never land)."""
        if self.broken is None:
            self.abort()

    def _settle(self) -> None:
        """Wait for every gather in flight and free every buffer: the engine holds nothing."""
        self.residency.end_step(learn=False)
        self.buffers.settle()



_STALE = ("loss_fn used a param of unit {unit!r} that it kept from an earlier step or micro-batch (in a global, a "
          "closure, a cache, or a torch.compile'd function that captured it as a constant); its values are stale and "
          "its grads would be wrong. Read params only from the `params` argument of the current call, and pass them "
          "to compiled functions as arguments")


def _refuse_if_broken(broken: BaseException | None) -> None:
    if broken is not None:
        raise RuntimeError(f"this step cannot run again: an earlier call failed with {type(broken).__name__} "
                           f"({broken}), and the ranks may be out of step. End the job and restart it "
                           "(from a checkpoint)") from broken


def refuses_hooks(err: BaseException) -> bool:
    """Whether ``err`` is a torch.func transform (grad, vjp, ...) inside the loss function
    refusing the engine's saved-tensor hooks: it comes from
    ``torch.autograd.graph.disable_saved_tensors_hooks``, which those transforms enter."""
    code = torch.autograd.graph.disable_saved_tensors_hooks.__wrapped__.__code__
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def explain(err: RuntimeError) -> Exception:
    """A clear error, caused by ``err``, for what loss_fn did: a freed unit read through a view that
    outlived its param tensors, or ``fullgraph=True`` over unit reads; else ``err`` itself (raise
    the result as is: ``from err`` would make ``err`` its own cause, a loop that hung ``hpf.launch``)."""
    if refused_fullgraph(err):
        explained = RuntimeError(
            "torch.compile(loss_fn, fullgraph=True) cannot trace hpf's unit reads: each read of a list "
            "element of the params (a block) is a graph break, where hpf gathers and frees the unit. Put "
            "fullgraph=True on the block's function instead (torch.compile(block, fullgraph=True), called on "
            "the block's params), or compile loss_fn without fullgraph")
    elif "data is not allocated" in str(err) or "for storage of size 0" in str(err):
        explained = RuntimeError(
            "loss_fn read an FSDP unit's param after hpf had freed the unit: either a param tensor kept from an "
            "earlier step or micro-batch (a global, a closure, a cache, a torch.compile'd function's constant: "
            "read params only from the current call's `params`), or a view (a slice, .T, .chunk, ...) used after "
            "dropping every reference to the param tensor itself (keep blk['w'] alive while its views are in use)")
    else:
        return err
    explained.__cause__ = err
    return explained


def _one_line(err: BaseException) -> str:
    """``err`` in one line, through to its root cause (a compile failure wraps the backend's error)."""
    *_, root = schedule.causes(err, implicit=False)  # (dynamo's compile errors keep the backend's as ``inner_exception``)
    text = lambda e: f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"  # noqa: E731
    return text(err) + (f" (from {text(root)})" if root is not err else "")


def _untouched(snapshot: list[tuple], masters: list[torch.Tensor]) -> bool:
    return all(b < len(masters) and masters[b] is t and t._version == v for b, t, v in snapshot)
