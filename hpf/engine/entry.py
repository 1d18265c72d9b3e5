"""The autograd entry of a unit read: the loss function gets the unit's params as views of its
gathered buffers, and backward hands their grads to one narrow callback (``done``), never to the
engine as a whole. Three forms: the plain one, one for reads under torch.func transforms, and a
rematerialized block that keeps only its inputs for backward (grad="torch.func")."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import get_device_states, set_device_states

from ..errors import CapturedTensorError
from .gather import LiveUnit

__all__ = ["entry", "Recompute", "rematerialized"]

Done = Callable[[str, tuple, int], None]  # (unit, grads, stamp): the engine's ``entry_done``


class _Entry(torch.autograd.Function):
    """One read of a unit. The plain form: no per-call signature binding (half the cost)."""

    @staticmethod
    def forward(ctx, anchor, unit: LiveUnit, stamp: int, done: Done):  # noqa: ARG004 - anchor only makes backward run
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
    def forward(anchor, unit: LiveUnit, stamp: int, done: Done):  # noqa: ARG004
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


def entry(anchor: torch.Tensor, unit: LiveUnit, stamp: int, done: Done) -> tuple:
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
    free params under torch.func transforms, so nothing of the unit may be saved).

    ``args`` come in flattened (``leaves``, ``box.args``), so a tensor inside a tuple or dict
    gets its grad; a tensor reached otherwise is refused (:class:`_RefuseCaptured`). The
    recompute replays the torch RNG states of the forward, as ``torch.utils.checkpoint`` does.
    The block's float tensor outputs are the Function's; its other outputs ride in ``box``."""

    @staticmethod
    def forward(anchor, rc: Recompute, fn, box, *leaves):  # noqa: ARG004 - anchor only makes backward run
        box.rng = _rng_states(leaves)
        with _captures_refused(fn, rc.unit):
            out = fn(rc.subtree(rc.params()), *optree.tree_unflatten(box.args, leaves))
        outs, box.treedef = optree.tree_flatten(out, none_is_leaf=True)
        box.is_output = [_is_float(x) for x in outs]
        box.others = [x for x in outs if not _is_float(x)]
        # an input returned as is must leave as a view (autograd.Function's rule with setup_context)
        return tuple(x.view_as(x) if any(x is a for a in leaves) else x for x in outs if _is_float(x))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, rc, fn, box, *leaves = inputs
        ctx.rc, ctx.fn, ctx.box = rc, fn, box
        ctx.float_args = [i for i, a in enumerate(leaves) if _is_float(a)]
        ctx.args = [None if i in ctx.float_args else a for i, a in enumerate(leaves)]
        ctx.save_for_backward(*(leaves[i] for i in ctx.float_args))

    @staticmethod
    def backward(ctx, *grads):
        leaves, rc = list(ctx.args), ctx.rc

        def block(views, float_args):
            for i, a in zip(ctx.float_args, float_args):
                leaves[i] = a
            out = ctx.fn(rc.subtree(views), *optree.tree_unflatten(ctx.box.args, leaves))
            return tuple(x for x in optree.tree_leaves(out, none_is_leaf=True) if _is_float(x))
        with torch.no_grad(), _replayed(ctx.box.rng):  # (no tape around the vjp, which would hold the params)
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
    leaves, box.args = optree.tree_flatten(args, none_is_leaf=True)
    outs = iter(_Rematerialized.apply(anchor, rc, fn, box, *leaves))
    others = iter(box.others)
    return optree.tree_unflatten(box.treedef, [next(outs) if t else next(others) for t in box.is_output])


class _RefuseCaptured(TorchFunctionMode):
    """While a rematerialized block runs forward: a tensor the step's torch.func transform tracks
    that is not among the block's inputs (which arrive unwrapped) reached it through a closure or
    a global; its grad would be lost, so it is refused (CapturedTensorError) before any update.
    Inside a transform the block itself runs (torch.func.grad within it), nothing is checked."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._functorch.peek_interpreter_stack() is None and any(
                isinstance(t, torch.Tensor) and t.requires_grad and torch._C._functorch.is_gradtrackingtensor(t)
                for t in optree.tree_leaves((args, kwargs))):
            raise CapturedTensorError(
                f"the block of unit {self.unit!r} run by apply(i, fn, *args) under grad=\"torch.func\" computes "
                f"({getattr(func, '__name__', func)}) with a tensor that needs grad but is not in args: a closure "
                "or a global (a root param, an earlier activation); its grad would be lost. Pass it in args (any "
                "pytree of tensors reaches fn), or use grad=\"autograd\"")
        return func(*args, **kwargs)


_COMPILED_CHECKED: set = set()  # the code of compiled blocks whose captures were checked


def _captures_refused(fn: Callable, unit: str) -> contextlib.AbstractContextManager:
    """:class:`_RefuseCaptured` around a block's forward. A compiled block is checked once per
    code, run eagerly then: under the mode, dynamo would trace it into the graph (seen: wrong grads)."""
    original = getattr(fn, "_torchdynamo_orig_callable", None)
    if original is None:
        return _RefuseCaptured(unit)
    code = getattr(original, "__code__", original)
    if code in _COMPILED_CHECKED:
        return contextlib.nullcontext()
    _COMPILED_CHECKED.add(code)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.compiler.set_stance("force_eager"))
    stack.enter_context(_RefuseCaptured(unit))
    return stack


def _rng_states(tensors) -> tuple:
    """The torch RNG states a block's forward starts from: the CPU's, and its devices' (as
    ``torch.utils.checkpoint(preserve_rng_state=True)`` keeps them)."""
    device_type = next((t.device.type for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"),
                       None)
    devices = get_device_states(*tensors) if device_type else ([], [])
    return torch.get_rng_state(), device_type, devices


@contextlib.contextmanager
def _replayed(states: tuple):
    """Draw the recompute's random numbers from the forward's RNG states (a dropout mask is the
    same); the process's RNGs are as they were afterwards."""
    cpu, device_type, (ids, device_states) = states
    with torch.random.fork_rng(devices=ids, device_type=device_type or "cuda"):
        torch.set_rng_state(cpu)
        if device_type:
            set_device_states(ids, device_states, device_type=device_type)
        yield


class _Box:
    """What a ``_Rematerialized`` block takes and returns besides float tensors: the structure of
    its args, its outputs' structure and non-float outputs, the RNG states of its forward."""

    args: Any
    treedef: Any
    is_output: list
    others: list
    rng: tuple


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
