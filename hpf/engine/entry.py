"""The autograd entry of a unit read: the loss function gets the unit's params as views of its
gathered buffers, and backward hands their grads to one narrow callback (``done``), never to the
engine as a whole. Three forms: the plain one, one for reads under torch.func transforms, and a
rematerialized block that keeps only its inputs for backward (grad="torch.func")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch

from .gather import Unit

__all__ = ["entry", "Recompute", "rematerialized"]

Done = Callable[[str, tuple, int], None]  # (unit, grads, stamp): the engine's ``entry_done``


class _Entry(torch.autograd.Function):
    """One read of a unit. The plain form: no per-call signature binding (half the cost)."""

    @staticmethod
    def forward(ctx, anchor, unit: Unit, stamp: int, done: Done):  # noqa: ARG004 - anchor only makes backward run
        ctx.name, ctx.stamp, ctx.done = unit.name, stamp, done
        views = tuple(unit.views())
        if unit.frozen:
            ctx.mark_non_differentiable(*(views[i] for i in unit.frozen))
        return views

    @staticmethod
    def backward(ctx, *grads):
        ctx.done(ctx.name, grads, ctx.stamp)
        return None, None, None, None


class _FuncEntry(torch.autograd.Function):
    """The same entry for reads under torch.func transforms (vmap, grad, jvp inside loss_fn),
    which need ``setup_context`` and a vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(anchor, unit: Unit, stamp: int, done: Done):  # noqa: ARG004
        return tuple(unit.views())

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, unit, ctx.stamp, ctx.done = inputs
        ctx.name, ctx.unit = unit.name, unit
        if unit.frozen:
            ctx.mark_non_differentiable(*(output[i] for i in unit.frozen))

    @staticmethod
    def backward(ctx, *grads):
        ctx.done(ctx.name, grads, ctx.stamp)
        return None, None, None, None

    @staticmethod
    def jvp(ctx, *tangents):  # noqa: ARG004 - the params do not depend on the anchor
        return tuple(torch.zeros_like(v) for v in ctx.unit.views())


def entry(anchor: torch.Tensor, unit: Unit, stamp: int, done: Done) -> tuple:
    """A new autograd entry of ``unit`` (gathered): its params as views; ``stamp`` numbers the
    micro-batch, and ``done(unit, grads, stamp)`` receives the grads."""
    fn = _FuncEntry if torch._C._are_functorch_transforms_active() else _Entry
    return fn.apply(anchor, unit, stamp, done)


@dataclass
class Recompute:
    """What a rematerialized block needs of the engine, and nothing more."""

    unit: str
    stamp: int
    params: Callable[[], tuple]  # the unit's views now (gathered)
    regather: Callable[[], tuple]  # its views in backward (gathered again if evicted)
    subtree: Callable[[tuple], Any]  # views -> the unit's params tree
    done: Done


class _Rematerialized(torch.autograd.Function):
    """A block ``fn(unit's params, *args)`` that keeps only ``args`` for backward, which gathers
    the unit again and recomputes ``fn`` under ``torch.func.vjp`` (saved-tensor hooks cannot
    free params under torch.func transforms, so nothing of the unit may be saved). The block's
    float tensor outputs are the Function's; its other outputs ride in ``box``."""

    @staticmethod
    def forward(anchor, rc: Recompute, fn, box, *args):  # noqa: ARG004 - anchor only makes backward run
        leaves, box.treedef = optree.tree_flatten(fn(rc.subtree(rc.params()), *args), none_is_leaf=True)
        box.is_output = [_is_float(x) for x in leaves]
        box.others = [x for x in leaves if not _is_float(x)]
        return tuple(x for x in leaves if _is_float(x))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, rc, fn, _, *args = inputs
        ctx.rc, ctx.fn = rc, fn
        ctx.float_args = [i for i, a in enumerate(args) if _is_float(a)]
        ctx.args = [None if i in ctx.float_args else a for i, a in enumerate(args)]
        ctx.save_for_backward(*(args[i] for i in ctx.float_args))

    @staticmethod
    def backward(ctx, *grads):
        args, rc = list(ctx.args), ctx.rc

        def block(views, float_args):
            for i, a in zip(ctx.float_args, float_args):
                args[i] = a
            out = ctx.fn(rc.subtree(views), *args)
            return tuple(x for x in optree.tree_leaves(out, none_is_leaf=True) if _is_float(x))
        with torch.no_grad():  # (first-order: no tape around the vjp, which would hold the params)
            _, vjp = torch.func.vjp(block, rc.regather(), tuple(ctx.saved_tensors))
            param_grads, arg_grads = vjp(grads)
            del vjp
        rc.done(rc.unit, param_grads, rc.stamp)
        out = [None] * (4 + len(ctx.args))
        for i, g in zip(ctx.float_args, arg_grads):
            out[4 + i] = g
        return tuple(out)


def rematerialized(anchor: torch.Tensor, rc: Recompute, fn, args: tuple):
    """``fn(unit's params, *args)`` as a ``_Rematerialized`` block (the engine recorded the read)."""
    box = _Box()  # (not a dict: torch.func flattens a Function's pytree inputs into copies)
    outs = iter(_Rematerialized.apply(anchor, rc, fn, box, *args))
    others = iter(box.others)
    return optree.tree_unflatten(box.treedef, [next(outs) if t else next(others) for t in box.is_output])


class _Box:
    """What a ``_Rematerialized`` block returned besides its float tensors."""

    treedef: Any
    is_output: list
    others: list


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
