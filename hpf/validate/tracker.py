"""The tracker: a ``TorchFunctionMode`` that carries a layout for every tensor ``loss_fn`` touches.

Why a mode and not a tensor subclass: the layout travels *above* autograd. The mode sees
each torch call of ``loss_fn``, runs it on the plain tensors (autograd and kernels see
exactly what production sees, so losses and grads are identical), and keeps a side table,
weak and keyed by tensor, from tensor to :class:`~hpf.validate.layout.Info`.

Params enter replicated over the FSDP axes (gathered) and sharded over the others per their
spec; the batch enters varying over the FSDP axes and replicated over the others. The loss
must come out replicated over every non-FSDP axis. Ops with a rule (hpf.validate.rules)
propagate layouts exactly. An op without a rule takes the conservative fallback: on inputs
with no sharded or partial entries the output is replicated where all inputs are, and
varying elsewhere; a sharded input makes it varying; a partial input is an error. Tensors
made outside ``loss_fn`` (closure constants) count as replicated; Python numbers carry no
layout. The first inconsistency raises a :class:`~hpf.validate.errors.LayoutError` naming
the op, the tensor (with the parameter it came from) and a fix.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..comm import collectives
from .. import tree as tree_util
from ..engine.views import UnitList
from ..mesh import Mesh
from ..planning import Plan
from .errors import CollectiveError, LayoutError, LossNotReplicatedError, PartialSumError
from .layout import PARTIAL, VARYING, Info, describe_entry, describe_src, lineage, make_info
from .propagate import Propagator, check_precision, partial_msg
from .op_rule import Call, Rule, operands_of
from .rules import rule_for

__all__ = ["Tracker"]


class Tracker(TorchFunctionMode):
    """Carries a layout for every tensor ``loss_fn`` touches; raises on the first inconsistency."""

    def __init__(self, mesh: Mesh, fsdp_axes: Sequence[str], compute_dtype: torch.dtype | None = None,
                 check_finite: bool = True):
        super().__init__()
        self.axes = mesh.axis_names
        self.mesh = mesh
        self.fsdp_axes = tuple(fsdp_axes)
        self.compute_dtype = compute_dtype
        self.check_finite = check_finite
        self.ops = 0
        self._table: dict[int, tuple] = {}
        self._cache: dict[Any, Rule] = {}
        self._records: list[tuple] = []  # (op, src, finite flag of output, flags of inputs)
        self._replicated = make_info((None,) * len(self.axes), (None,) * len(self.axes), ("const",))
        self.propagate = Propagator(self.axes, self.info, self._replicated)

    # -- the side table --------------------------------------------------------------------------
    def set(self, t: torch.Tensor, info: Info, flag=None) -> None:
        key, table = id(t), self._table

        def drop(ref, key=key):
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), info, flag)

    def _entry(self, t: torch.Tensor):
        e = self._table.get(id(t))
        return e if e is not None and e[0]() is t else None

    def info(self, t: torch.Tensor) -> Info:
        e = self._entry(t)
        return e[1] if e is not None else self._replicated

    # -- entry points ----------------------------------------------------------------------------
    def param_info(self, plan: Plan, path: str) -> Info:
        """Replicated over FSDP axes (gathered), sharded over the others as the spec says."""
        spec, layout, why = plan.slots[plan.ties.get(path, path)].spec, [None] * len(self.axes), [None] * len(self.axes)
        for d in range(len(spec)):
            split = [a for a in spec.dim_axes(d) if a not in self.fsdp_axes]
            for k, a in enumerate(split):
                i = self.axes.index(a)
                layout[i], why[i] = (d, k), f"spec {spec!r} of parameter {path!r}"
        return make_info(tuple(layout), tuple(why), ("parameter", path))

    def track_params(self, params: Any, plan: Plan) -> Any:
        """Register the params tree handed to loss_fn; lists of FSDP units are wrapped so each
        unit is registered when loss_fn reaches it (the engine gathers it then)."""
        def visit(path, leaf):
            path = tree_util.path_str(path)
            if isinstance(leaf, UnitList):
                return _TrackedUnits(leaf, self, plan)
            if isinstance(leaf, torch.Tensor):
                self.set(leaf, self.param_info(plan, path))
            return leaf

        return optree.tree_map_with_path(visit, params, is_leaf=lambda x: isinstance(x, UnitList),
                                         none_is_leaf=True)

    def track_batch(self, batch: Any) -> Any:
        """The local batch: varying over the FSDP axes, replicated over the others."""
        layout = tuple(VARYING if a in self.fsdp_axes else None for a in self.axes)
        why = tuple("the batch is split over the FSDP axes" if e else None for e in layout)
        for path, leaf in zip(*tree_util.flatten(batch)[:2]):
            if isinstance(leaf, torch.Tensor):
                self.set(leaf, make_info(layout, why, ("batch", path)))
        return batch

    def check_loss(self, loss: Any) -> Info:
        """The loss must be complete and replicated over every non-FSDP axis."""
        if not isinstance(loss, torch.Tensor):
            return self._replicated
        info = self.info(loss)
        for axis, e, why in zip(self.axes, info.layout, info.why):
            if axis in self.fsdp_axes or e is None:
                continue
            if e == PARTIAL:
                raise PartialSumError(
                    f"the loss ({describe_src(info.src)}) is a pending partial sum over the non-FSDP axis "
                    f"{axis!r} ({why}); the step needs the complete loss. A psum is missing: return "
                    f"hpf.psum(loss, {axis!r}) or psum the partial tensor where it was made")
            raise LossNotReplicatedError(
                f"the loss ({describe_src(info.src)}) is {describe_entry(e)} over the non-FSDP axis {axis!r} "
                f"({why}); it must be the same on every rank of {axis!r}. Combine the per-rank parts with "
                f"hpf.psum (or hpf.all_gather) before the loss, and feed every rank of {axis!r} the same batch")
        return info

    def first_nonfinite(self) -> str | None:
        """The first op whose output was non-finite while its inputs were finite."""
        if not self._records:
            return None
        flags = torch.stack([r[2] for r in self._records] +
                            [f for r in self._records for f in r[3]]).cpu().tolist()
        n = len(self._records)
        outs, ins, j = flags[:n], flags[n:], 0
        first = None
        for (op, src, _, in_flags), ok in zip(self._records, outs):
            inputs_ok = all(ins[j:j + len(in_flags)])
            j += len(in_flags)
            if not ok and first is None:
                first = (op, src, inputs_ok)
            if not ok and inputs_ok:
                return f"{op} (inputs finite; output: {describe_src(src)})"
        if first is not None:
            return f"{first[0]} (output: {describe_src(first[1])})"
        return None

    # -- the mode ----------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = self._cache.get(func)
        if rule is None:
            rule = self._cache[func] = rule_for(func)
        if rule.kind == "pass":
            return func(*args, **kwargs)
        self.ops += 1
        self.last_op = rule.name  # the engine names it when a read forces an extra gather
        call = Call(rule.name, func, args, kwargs)
        if rule.kind == "collective":
            return self._collective(call, func)
        try:
            out = func(*args, **kwargs)
        except LayoutError:
            raise
        except Exception as err:
            self._explain(rule, call, err)
            raise
        if rule.kind == "iter":
            out = tuple(out)
        call.out = out
        outs = [out] if isinstance(out, torch.Tensor) else (
            [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (tuple, list)) else [])
        if not outs:
            if rule.kind == "value":
                self._check_value(call)
            elif rule.kind == "setitem":
                self._setitem(call)
            return out
        info, operands = self.propagate.layout(rule, call)
        if self.compute_dtype is not None:
            check_precision(self.compute_dtype, self.info, rule, call, operands, outs)
        self._register(call, outs, info, operands)
        return iter(out) if rule.kind == "iter" else out

    def _register(self, call: Call, outs: list, info: Info, operands: list) -> None:
        if not call.op.endswith("_"):  # an op that returned its input unchanged (x.float() of a float): keep its name
            outs = [t for t in outs if not any(t is x for x in operands) or self.info(t).layout != info.layout]
        if not outs:
            return
        if not self.check_finite or outs[0].device.type == "meta":
            for t in outs:
                self.set(t, info)
            return
        in_flags = [e[2] for e in map(self._entry, operands) if e is not None and e[2] is not None]
        for t in outs:
            # (on a detached alias: isfinite's composite abs() would save t for backward, and a
            # checkpoint's recomputation, which runs untracked, would then save fewer tensors)
            flag = torch.isfinite(t.detach()).all() if t.is_floating_point() else None
            self.set(t, info, flag)
            if flag is not None:
                self._records.append((call.op, info.src, flag, in_flags))

    def _explain(self, rule: Rule, call: Call, err: Exception) -> None:
        """The op failed (e.g. local shapes that do not line up): raise the layout error that
        explains it, if there is one."""
        if rule.kind not in ("map",):
            return
        try:
            self.propagate.layout(rule, call)
        except LayoutError as layout_err:
            raise layout_err from err
        except Exception:  # noqa: BLE001 - the op's own error is the better one
            return

    # -- other checks --------------------------------------------------------------------------------
    def _check_value(self, call: Call) -> None:
        for t in operands_of(call):
            info = self.info(t)
            for a, axis in enumerate(self.axes):
                if info.layout[a] == PARTIAL:
                    raise PartialSumError(partial_msg(call, axis, info, a, " (converted to a Python value)"))

    def _setitem(self, call: Call) -> None:
        """x[i] = v: x keeps its layout where x, v and i agree; otherwise it becomes varying."""
        x = call.args[0]
        infos = [self.info(t) for t in operands_of(call)]
        if all(i.simple for i in infos) and all(i.layout == infos[0].layout for i in infos):
            return
        layout, why = [], []
        for a, axis in enumerate(self.axes):
            entries = {i.layout[a] for i in infos}
            if PARTIAL in entries and entries != {PARTIAL}:
                p = next(i for i in infos if i.layout[a] == PARTIAL)
                raise PartialSumError(partial_msg(call, axis, p, a, " (written into a complete tensor)"))
            layout.append(entries.pop() if len(entries) == 1 else VARYING)
            why.append(next((i.why[a] for i in infos if i.why[a]), None))
        self.set(x, make_info(tuple(layout), tuple(why), ("op", "setitem", lineage(infos[0].src))))

    # -- hpf's collectives -------------------------------------------------------------------------------
    def _collective(self, call: Call, func):
        ctx = collectives.current()
        if call.op == "axis_index":
            out = func(*call.args, **call.kwargs)
            axes = ctx.axes(call.args[0], "axis_index") if ctx else ()
            layout = tuple(VARYING if a in axes else None for a in self.axes)
            self.set(out, make_info(layout, tuple(f"hpf.axis_index({a!r})" if a in axes else None for a in self.axes),
                                ("op", "axis_index", None)))
            return out
        x = call.args[0]
        info = self.info(x)
        axes = ctx.axes(call.args[1], call.op) if ctx else ()
        layout, why = list(info.layout), list(info.why)
        for axis in axes:
            a = self.axes.index(axis)
            e = info.layout[a]
            if e == PARTIAL and call.op not in ("psum", "psum_scatter"):
                raise PartialSumError(partial_msg(call, axis, info, a, f" (hpf.{call.op} moves blocks, it "
                                                                                 f"does not sum)"))
            if e is None:
                raise CollectiveError(
                    f"hpf.{call.op} over {axis!r} of {describe_src(info.src)}, which is already replicated over "
                    f"{axis!r}: " + ("a psum would multiply it by the axis size (a second psum?). Drop it, or "
                                     "multiply by the axis size if that is meant" if call.op == "psum" else
                                     "every rank holds the same copy. Drop it, or shard the tensor first"))
            layout[a], why[a] = self.propagate.collective_entry(call, x, e, a, axis)
        if call.op == "all_to_all":  # other axes that split the moved dims lose their block structure
            moved = {collectives.normalize_dim(x, call.args[2], "all_to_all", "split_dim"),
                     collectives.normalize_dim(x, call.args[3], "all_to_all", "concat_dim")}
            for a, e in enumerate(layout):
                if self.axes[a] not in axes and isinstance(e, tuple) and e[0] in moved:
                    layout[a], why[a] = VARYING, f"hpf.all_to_all resized dim {e[0]}"
        out = func(*call.args, **call.kwargs)
        self._register(call, [out], make_info(tuple(layout), tuple(why), ("op", f"hpf.{call.op}", lineage(info.src))),
                       [x])
        return out

class _TrackedUnits(list):
    """A list of FSDP units whose params are registered when loss_fn reaches each one."""

    def __init__(self, units, tracker: Tracker, plan: Plan):
        super().__init__(list.__iter__(units))
        self._units, self._tracker, self._plan = units, tracker, plan

    def _track(self, name: str, subtree: Any) -> Any:
        paths, leaves, _ = tree_util.flatten(subtree)
        for p, leaf in zip(paths, leaves):
            if isinstance(leaf, torch.Tensor):
                self._tracker.set(leaf, self._tracker.param_info(self._plan, f"{name}/{p}" if p else name))
        return subtree

    def __getitem__(self, i):
        with torch._C.DisableTorchFunction():  # the engine's gathers are not the model's ops
            out = self._units[i]
        if isinstance(i, slice):
            return _TrackedUnits(out, self._tracker, self._plan)
        return self._track(list.__getitem__(self, i), out)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __reversed__(self):
        for i in reversed(range(len(self))):
            yield self[i]
