"""How an op rule is written: the intercepted call, the rule, the registry and the helpers maps share.

A rule is registered where it is written, by the :func:`rule` decorator (as ``jax.shard_map``
registers its replication rules), or by :func:`register` next to a list of op names.

A map function ``(call, operands) -> one list per operand`` gives, for each operand dim, the
output dim it becomes, or ``WHOLE`` (the op needs the whole dim), ``LOCAL`` (it takes a
local part) or ``SUM - i`` (contracted; operands that contract the same dim share a key).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from .layout import LOCAL

__all__ = ["Call", "Rule", "RULES", "register", "rule", "operands_of", "align", "broadcast_map"]


class Call:
    """One intercepted torch call: the op's name, the function, its arguments and (after it ran) its output."""

    __slots__ = ("op", "func", "args", "kwargs", "out")

    def __init__(self, op, func, args, kwargs):
        self.op, self.func, self.args, self.kwargs, self.out = op, func, args, kwargs, None

    def arg(self, i: int, name: str | None = None, default=None):
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if len(self.args) > i else default


class Rule(NamedTuple):
    """How one op propagates layouts (see the module doc)."""

    name: str
    kind: str  # pass | value | map | like | new | setitem | iter | collective | fallback
    maps: Callable | None = None  # (call, operands) -> one target list per operand
    linear: str | None = None  # None | "product" (one operand partial) | "sum" (all) | "quotient"
    select: Callable | None = None  # (call) -> the operands, when not every tensor argument


RULES: dict[str, Rule] = {}


def register(names, kind: str = "map", maps: Callable | None = None, linear: str | None = None,
             select: Callable | None = None) -> None:
    """Register one rule for each op in ``names`` (a space-separated string or a collection)."""
    for name in names.split() if isinstance(names, str) else names:
        RULES[name] = Rule(name, kind, maps, linear, select)


def rule(names, *, linear: str | None = None, select: Callable | None = None) -> Callable:
    """Decorator: the decorated map function is the layout rule of the ops ``names``."""
    def decorate(maps: Callable) -> Callable:
        register(names, maps=maps, linear=linear, select=select)
        return maps
    return decorate


def _tensors(args, out: list) -> list:
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _tensors(a, out)
        elif isinstance(a, slice):
            _tensors((a.start, a.stop, a.step), out)
    return out


def operands_of(call: Call) -> list:
    out = _tensors(call.args, [])
    return _tensors(call.kwargs.values(), out) if call.kwargs else out


def align(operands: list, pairs: list) -> list:
    """Maps in operand order from (tensor, map) pairs; tensors not listed take local parts."""
    by_id = {id(t): m for t, m in pairs}
    return [by_id.get(id(t), [LOCAL] * t.dim()) for t in operands]


def broadcast_map(t: torch.Tensor, shape: Sequence[int]) -> list:
    off = len(shape) - t.dim()
    return [LOCAL if (s == 1 and shape[off + d] != 1) else off + d for d, s in enumerate(t.shape)]
