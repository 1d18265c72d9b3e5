"""Validation mode: the production plan, with every tensor's layout checked through every op.

Why a mode and not a tensor subclass: the layout travels *above* autograd. A
``TorchFunctionMode`` sees each torch call of ``loss_fn``, runs it on the plain tensors
(autograd and kernels see exactly what production sees, so losses and grads are identical),
and keeps a side table, weak and keyed by tensor, from tensor to :class:`Info`: its layout
and where it came from.

A layout says, per mesh axis, one of:

* ``None``     replicated: the same values on every rank of the axis;
* ``(d, k)``   sharded on dim ``d``: each rank holds a block (``k`` orders axes that split one dim);
* ``"V"``      varying: different data per rank with no block structure (the batch over
  the FSDP axes, the output of ``hpf.axis_index``, a local slice of a sharded dim);
* ``"P"``      a pending partial sum: the true value is the sum over the axis (a contraction
  over a sharded dim); only linear ops may touch it until ``hpf.psum``.

Params enter replicated over the FSDP axes (gathered) and sharded over the others per their
spec; the batch enters varying over the FSDP axes and replicated over the others. The loss
must come out replicated over every non-FSDP axis. Ops with a rule propagate layouts
exactly (elementwise, matmul/linear/einsum, reductions, views, indexing, embedding,
softmax, norms, cross-entropy, attention, cat/stack/split, casts, hpf's collectives). An op
without a rule takes the documented conservative rule: on inputs with no sharded or partial
entries the output is replicated where all inputs are, and varying elsewhere; a sharded
input makes it varying; a partial input is an error. Tensors made outside ``loss_fn``
(closure constants) count as replicated; Python numbers carry no layout.

The first inconsistency raises a :class:`LayoutError` naming the op, the tensor (with the
parameter it came from) and a fix.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from . import collectives
from . import tree as tree_util
from .collectives import SPMD, spmd
from .mesh import Mesh
from .plan import Plan, plan as make_plan
from .spec import P, SpecError
from .step import MixedPrecision, ShardStep, TrainState, _PRECISIONS

__all__ = [
    "LayoutError", "PartialSumError", "ShardingMismatchError", "ShardedContractionError",
    "LossNotReplicatedError", "BatchMismatchError", "ParamsTreeError", "PrecisionError",
    "NonFiniteError", "IndivisibleSpecError", "CollectiveError", "GradientMismatchError",
    "ValidateStep", "check_plan", "check_grads", "PlanCheck", "GradReport", "Tracker",
]


# ============================================================================ errors
class LayoutError(ValueError):
    """Validation found a tensor whose layout, dtype or value contradicts the plan."""


class PartialSumError(LayoutError):
    """(1) A pending partial sum is used as a complete value: a ``hpf.psum`` is missing."""


class ShardingMismatchError(LayoutError):
    """Operands of one op are split differently over a non-FSDP axis."""


class ShardedContractionError(ShardingMismatchError):
    """(2) A contraction or reduction runs over a dim sharded on a non-FSDP axis in a way no
    reduction can complete: the other operand is not sharded alike, or the op (mean, max,
    softmax, a norm, cross-entropy, attention) needs the whole dim."""


class LossNotReplicatedError(LayoutError):
    """(3) The loss differs (by layout or by value) across the ranks of a non-FSDP axis."""


class BatchMismatchError(LayoutError):
    """(4) Local batches differ in shape or dtype across ranks, or in content across the ranks
    of a non-FSDP axis (which must see the same batch)."""


class ParamsTreeError(LayoutError, SpecError):
    """(5) A params tree, spec tree or train state does not have the plan's structure."""


class PrecisionError(LayoutError):
    """(6) An op silently leaves the mixed-precision compute dtype."""


class NonFiniteError(LayoutError):
    """(7) A non-finite loss or grad; the message names where it first appeared."""


class IndivisibleSpecError(LayoutError, SpecError):
    """(8) A non-FSDP axis does not divide the dim it splits (only FSDP axes are padded)."""


class CollectiveError(LayoutError):
    """An hpf collective applied to a layout it cannot mean (e.g. psum of a replicated value)."""


class GradientMismatchError(LayoutError):
    """Sharded grads differ from the single-process reference beyond the tolerance."""


# ============================================================================ layouts
VARYING, PARTIAL = "V", "P"
WHOLE, LOCAL, SUM = -1, -2, -10  # map targets: op needs the whole dim / takes a local part / contracted
# (contracted dims get keys SUM - i, so two operands contract "the same" dim when their keys match)


class Info(NamedTuple):
    layout: tuple  # one entry per mesh axis (see module doc)
    why: tuple  # per axis: how a non-replicated entry arose (for messages), else None
    src: tuple  # ("parameter", path) | ("batch", path) | ("op", name, param path or None) | ("const",)
    simple: bool  # no sharded or partial entry: ops need no rule to propagate it


def _info(layout: tuple, why: tuple, src: tuple) -> Info:
    return Info(layout, why, src, all(e is None or e == VARYING for e in layout))


def _describe_src(src: tuple) -> str:
    if src[0] == "parameter":
        return f"parameter {src[1]!r}"
    if src[0] == "batch":
        return f"batch leaf {src[1]!r}" if src[1] else "the batch"
    if src[0] == "op":
        return f"the output of {src[1]}" + (f" (computed from parameter {src[2]!r})" if src[2] else "")
    return "a tensor made outside loss_fn"


def _describe_entry(e) -> str:
    if e is None:
        return "replicated"
    if e == VARYING:
        return "varying (different on each rank)"
    if e == PARTIAL:
        return "a pending partial sum"
    return f"sharded on dim {e[0]}"


def describe(info: Info, axes: Sequence[str]) -> str:
    """``info``'s layout in words, e.g. "tp: sharded on dim 1, dp: varying"."""
    return ", ".join(f"{a}: {_describe_entry(e)}" for a, e in zip(axes, info.layout))


def _lineage(src: tuple) -> str | None:
    return src[1] if src[0] == "parameter" else (src[2] if src[0] == "op" else None)


# ============================================================================ op rules
class _Call:
    __slots__ = ("op", "func", "args", "kwargs", "out")

    def __init__(self, op, func, args, kwargs):
        self.op, self.func, self.args, self.kwargs, self.out = op, func, args, kwargs, None

    def arg(self, i: int, name: str | None = None, default=None):
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if len(self.args) > i else default


class Rule(NamedTuple):
    name: str
    kind: str  # pass | value | map | like | new | setitem | iter | collective | fallback
    maps: Callable | None = None  # (call, operands) -> one target list per operand
    linear: str | None = None  # None | "product" (one operand partial) | "sum" (all) | "quotient"
    select: Callable | None = None  # (call) -> the operands, when not every tensor argument


def _tensors(args, out: list) -> list:
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _tensors(a, out)
        elif isinstance(a, slice):
            _tensors((a.start, a.stop, a.step), out)
    return out


def _operands(call: _Call) -> list:
    out = _tensors(call.args, [])
    return _tensors(call.kwargs.values(), out) if call.kwargs else out


def _self_only(call: _Call) -> list:
    return [call.args[0]]


def _align(operands: list, pairs: list) -> list:
    """Maps in operand order from (tensor, map) pairs; tensors not listed take local parts."""
    by_id = {id(t): m for t, m in pairs}
    return [by_id.get(id(t), [LOCAL] * t.dim()) for t in operands]


def _nd(d: int, n: int) -> int:
    return d % n if n else 0


def _broadcast_map(t: torch.Tensor, shape: Sequence[int]) -> list:
    off = len(shape) - t.dim()
    return [LOCAL if (s == 1 and shape[off + d] != 1) else off + d for d, s in enumerate(t.shape)]


def _out_shape(call: _Call, operands) -> tuple:
    out = call.out
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    return tuple(torch.broadcast_shapes(*(t.shape for t in operands)))


def _elementwise(call, operands):
    shape = _out_shape(call, operands)
    return [_broadcast_map(t, shape) for t in operands]


def _identity(call, operands):
    return [list(range(t.dim())) for t in operands]


def _copy_maps(call, operands):  # copy_(self, src): the values are src's, broadcast to self
    return [_broadcast_map(operands[0], call.args[0].shape)]


def _reduction(sum_like: bool, dim_pos: int = 1):
    def maps(call, operands):
        x = call.args[0]
        n = x.dim()
        dim = call.kwargs.get("dim", call.kwargs.get("axis", call.args[dim_pos] if len(call.args) > dim_pos else None))
        if isinstance(dim, bool) or (isinstance(dim, torch.Tensor)):
            dim = None  # var(x, unbiased) / max(x, other) never reach here with a dim
        dims = set(range(n)) if dim is None else {_nd(d, n) for d in ((dim,) if isinstance(dim, int) else dim)}
        first = call.out[0] if isinstance(call.out, tuple) else call.out
        keep = isinstance(first, torch.Tensor) and first.dim() == n and n > 0
        m, pos = [], 0
        for d in range(n):
            if d in dims:
                m.append(SUM - d if sum_like else WHOLE)
                pos += keep
            else:
                m.append(pos)
                pos += 1
        return [m] + [[LOCAL] * t.dim() for t in operands[1:]]
    return maps


def _maxmin(call, operands):  # max(x) / max(x, dim) reduce; max(x, other) is elementwise
    if len(operands) > 1 or isinstance(call.kwargs.get("other"), torch.Tensor):
        return _elementwise(call, operands)
    return _reduction(False)(call, operands)


def _along(dim_pos: int, default: int | None, target=WHOLE):
    """Shape-preserving ops that act along one dim (softmax, cumsum, sort, ...)."""
    def maps(call, operands):
        x = call.args[0]
        dim = call.arg(dim_pos, "dim", default)
        m = list(range(x.dim()))
        for d in (range(x.dim()) if dim is None else [_nd(dim, x.dim())]):
            m[d] = target
        return [m] + [[LOCAL] * t.dim() for t in operands[1:]]
    return maps


def _local_dims(dims_pos: int, name: str):
    """flip/roll: the listed dims are rearranged locally; None means all dims."""
    def maps(call, operands):
        x = call.args[0]
        dims = call.arg(dims_pos, name, None)
        dims = range(x.dim()) if dims is None else ((dims,) if isinstance(dims, int) else dims)
        m = list(range(x.dim()))
        for d in dims:
            m[_nd(d, x.dim())] = LOCAL
        return [m]
    return maps


def _tri(call, operands):  # tril/triu: the mask depends on global positions of the last two dims
    n = operands[0].dim()
    return [list(range(n - 2)) + [LOCAL, LOCAL]] if n >= 2 else [[LOCAL] * n]


def _reshape_map(src: Sequence[int], dst: Sequence[int], squeeze: bool = False) -> list:
    """Input dim -> output dim of a reshape, by groups of dims with equal products.

    In a group, a block of the major input dim stays a block of the first output dim (a merge
    keeps it when only size-1 dims precede it; a split gives it to the first factor, even one
    of local size 1, as when heads == ranks). ``squeeze``: size-1 dims come and go without
    taking a shard (squeeze / unsqueeze)."""
    m = [LOCAL] * len(src)
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        if len(gi) == 1 and len(gj) == 1:
            m[gi[0]] = gj[0]
            continue
        if squeeze:
            major_in = next((d for d in gi if src[d] != 1), None)
            major_out = next((d for d in gj if dst[d] != 1), None)
            if major_in is not None and major_out is not None:
                m[major_in] = major_out
            continue
        for d in gi:
            m[d] = gj[0]
            if src[d] != 1:
                break  # dims after the first real one are minor: their blocks interleave
    return m


def _reshape(call, operands):
    squeeze = call.op in ("squeeze", "unsqueeze", "squeeze_", "unsqueeze_")
    return [_reshape_map(call.args[0].shape, call.out.shape, squeeze)] + [[LOCAL] * t.dim() for t in operands[1:]]


def _permute(call, operands):
    """Any dim permutation (permute, transpose, movedim, t, T, mT, ...): replay it on a meta
    tensor of distinct sizes and read off where each dim went."""
    x = call.args[0]
    probe = torch.empty(tuple(range(2, x.dim() + 2)), device="meta")
    moved = call.func(probe, *call.args[1:], **call.kwargs)
    where = {s: i for i, s in enumerate(moved.shape)}
    return [[where[d + 2] for d in range(x.dim())]] + [[LOCAL] * t.dim() for t in operands[1:]]


def _expand(call, operands):
    return [_broadcast_map(call.args[0], call.out.shape)]


def _repeat(call, operands):
    x = call.args[0]
    sizes = call.args[1] if len(call.args) == 2 and not isinstance(call.args[1], int) else call.args[1:]
    sizes = (1,) * (x.dim() - len(sizes)) + tuple(sizes)  # tile pads short sizes with ones
    off = len(sizes) - x.dim()
    return [[LOCAL if sizes[off + d] != 1 else off + d for d in range(x.dim())]]


def _narrow(call, operands):
    x, dim, start, length = call.args[0], call.arg(1, "dim"), call.arg(2, "start"), call.arg(3, "length")
    dim = _nd(dim, x.dim())
    m = list(range(x.dim()))
    if not (isinstance(start, int) and start == 0 and length == x.shape[dim]):
        m[dim] = LOCAL
    return _align(operands, [(x, m)])


def _select(call, operands):
    x = call.args[0]
    dim = _nd(call.arg(1, "dim"), x.dim())
    return _align(operands, [(x, [LOCAL if d == dim else d - (d > dim) for d in range(x.dim())])])


def _index_select(call, operands):
    x, index = call.args[0], call.arg(2, "index")
    dim = _nd(call.arg(1, "dim"), x.dim())
    m = list(range(x.dim()))
    m[dim] = LOCAL
    return _align(operands, [(x, m), (index, [dim] if index.dim() else [])])


def _gather(call, operands):  # gather / take_along_dim: the index picks along dim, other dims align
    x, index = call.args[0], call.arg(2, "index", call.arg(1, "indices"))
    dim = call.arg(1, "dim") if call.op == "gather" else call.arg(2, "dim")
    if dim is None:
        return [[LOCAL] * t.dim() for t in operands]
    dim = _nd(dim, x.dim())
    m = list(range(x.dim()))
    m[dim] = LOCAL
    mi = list(range(index.dim()))
    return _align(operands, [(x, m), (index, mi)])


def _split(dim_pos: int, removes: bool = False):
    def maps(call, operands):
        x = call.args[0]
        dim = _nd(call.arg(dim_pos, "dim", 0), x.dim())
        pieces = len(call.out) if isinstance(call.out, (tuple, list)) else 2
        if removes:
            return [[LOCAL if d == dim else d - (d > dim) for d in range(x.dim())]]
        return [[LOCAL if d == dim and pieces > 1 else d for d in range(x.dim())]]
    return maps


def _cat(call, operands):
    tensors = [t for t in call.args[0] if t.dim() > 0 or len(call.args[0]) == 1]
    n = max(t.dim() for t in tensors)
    dim = _nd(call.arg(1, "dim", 0), n)
    pairs = [(t, [LOCAL if d == dim and len(tensors) > 1 else d for d in range(t.dim())]) for t in tensors]
    return _align(operands, pairs)


def _stack(call, operands):
    tensors = call.args[0]
    dim = _nd(call.arg(1, "dim", 0), tensors[0].dim() + 1)
    return _align(operands, [(t, [d + (d >= dim) for d in range(t.dim())]) for t in tensors])


def _getitem(call, operands):
    """Basic and advanced indexing: ints and partial slices take local parts of a dim;
    full slices keep it; index tensors contribute their own dims."""
    x, index = call.args[0], call.args[1]
    items = list(index) if isinstance(index, tuple) else [index]

    def consumes(it):
        if it is None or it is Ellipsis:
            return 0
        if isinstance(it, torch.Tensor) and it.dtype in (torch.bool, torch.uint8):
            return max(it.dim(), 1)
        return 1

    def advanced(it):
        return isinstance(it, (torch.Tensor, list)) and not (isinstance(it, torch.Tensor) and it.dim() == 0
                                                              and it.dtype not in (torch.bool, torch.uint8))

    if Ellipsis in [it for it in items if not isinstance(it, torch.Tensor)]:
        at = next(i for i, it in enumerate(items) if it is Ellipsis and not isinstance(it, torch.Tensor))
        fill = x.dim() - sum(consumes(it) for it in items)
        items = items[:at] + [slice(None)] * fill + items[at + 1:]
    items += [slice(None)] * (x.dim() - sum(consumes(it) for it in items))
    adv = [i for i, it in enumerate(items) if advanced(it)]
    adv_nd = max((1 if not isinstance(items[i], torch.Tensor) or items[i].dtype in (torch.bool, torch.uint8)
                  else items[i].dim() for i in adv), default=0)
    adjacent = bool(adv) and adv == list(range(adv[0], adv[-1] + 1))
    m, pos, adv_at = [LOCAL] * x.dim(), 0, None
    if adv and not adjacent:
        adv_at, pos = 0, adv_nd
    d = 0
    pairs = []
    for i, it in enumerate(items):
        if it is None:
            pos += 1
            continue
        if i in adv:
            if adv_at is None:
                adv_at, pos = pos, pos + adv_nd
            if isinstance(it, torch.Tensor):
                if it.dtype in (torch.bool, torch.uint8):
                    pairs.append((it, [LOCAL] * it.dim()))
                else:
                    pairs.append((it, [adv_at + adv_nd - it.dim() + k for k in range(it.dim())]))
            d += consumes(it)
            continue
        if isinstance(it, slice):
            full = it.step in (None, 1) and it.start in (None, 0) and (
                it.stop is None or (isinstance(it.stop, int) and it.stop >= x.shape[d]))
            m[d] = pos if full else LOCAL
            pos += 1
        # ints and 0-dim index tensors select one element of the dim: a local part
        d += 1
    return _align(operands, [(x, m)] + pairs)


def _matmul(call, operands):
    a, b = call.args[0], call.args[1]
    if call.op == "rmatmul":
        a, b = b, a
    na, nb = a.dim(), b.dim()
    if na == 1 and nb == 1:
        return _align(operands, [(a, [SUM]), (b, [SUM])])
    if nb == 1:
        return _align(operands, [(a, list(range(na - 1)) + [SUM]), (b, [SUM])])
    if na == 1:
        return _align(operands, [(a, [SUM]), (b, list(range(nb - 2)) + [SUM, nb - 2])])
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    ob = len(batch)
    return _align(operands, [(a, _broadcast_map(a[..., 0, 0], batch) + [ob, SUM]),
                             (b, _broadcast_map(b[..., 0, 0], batch) + [SUM, ob + 1])])


def _linear(call, operands):
    x, w, bias = call.args[0], call.arg(1, "weight"), call.arg(2, "bias")
    n = x.dim()
    pairs = [(x, list(range(n - 1)) + [SUM]), (w, [n - 1, SUM] if w.dim() == 2 else [SUM])]
    if isinstance(bias, torch.Tensor):
        pairs.append((bias, [n - 1] if bias.dim() == 1 else [LOCAL] * bias.dim()))
    return _align(operands, pairs)


def _addmm(call, operands):
    """addmm / baddbmm / addmv / addbmm: input + product, the input broadcast to the output."""
    inp, m1, m2 = call.args[0], call.args[1], call.args[2]
    if call.op == "addmm":
        p1, p2 = [0, SUM], [SUM, 1]
    elif call.op == "baddbmm":
        p1, p2 = [0, 1, SUM], [0, SUM, 2]
    elif call.op == "addbmm":
        p1, p2 = [SUM - 1, 0, SUM], [SUM - 1, SUM, 1]
    else:  # addmv
        p1, p2 = [0, SUM], [SUM]
    return _align(operands, [(m1, p1), (m2, p2), (inp, _broadcast_map(inp, call.out.shape) if call.out is not None
                                                  else list(range(inp.dim())))])


def _outer(call, operands):
    return _align(operands, [(call.args[0], [0]), (call.args[1], [1])])


def _einsum(call, operands):
    eq = call.args[0].replace(" ", "")
    packed = len(call.args) == 2 and isinstance(call.args[1], (list, tuple))
    tensors = list(call.args[1]) if packed else list(call.args[1:])
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    ell = max((t.dim() - len(term.replace("...", "")) for term, t in zip(terms, tensors) if "..." in term), default=0)
    ell_tokens = [f"...{i}" for i in range(ell)]

    def tokens(term: str, nd: int) -> list:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        k = nd - len(head) - len(tail)
        return list(head) + ell_tokens[ell - k:] + list(tail)

    ins = [tokens(term, t.dim()) for term, t in zip(terms, tensors)]
    if arrow:
        out = tokens(rhs, ell + len(rhs.replace("...", "")))
    else:
        letters = [c for term in ins for c in term if not c.startswith("...")]
        out = ell_tokens + sorted(c for c in set(letters) if letters.count(c) == 1)
    where = {c: i for i, c in enumerate(out)}
    ids = {c: i for i, c in enumerate(sorted({c for term in ins for c in term}))}
    return _align(operands, [(t, [where.get(c, SUM - ids[c]) for c in term]) for t, term in zip(tensors, ins)])


def _embedding(call, operands):
    a, b = call.args[0], call.args[1]
    ids, weight = (a, b) if not a.is_floating_point() else (b, a)
    n = ids.dim()
    rows = [LOCAL, n] if weight.dim() == 2 else [LOCAL] * weight.dim()  # looked-up rows are local parts
    return _align(operands, [(ids, list(range(n))), (weight, rows)])


def _norm(call, operands):  # layer_norm / rms_norm: the normalized trailing dims must be whole
    x, shape = call.args[0], call.arg(1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    pairs = [(x, list(range(x.dim() - k)) + [WHOLE] * k)]
    pairs += [(t, [WHOLE] * t.dim()) for t in operands if t is not x]
    return _align(operands, pairs)


def _reduction_arg(call: _Call, pos: int) -> str:
    red = call.arg(pos, "reduction", "mean")
    if call.kwargs.get("size_average") is not None or call.kwargs.get("reduce") is not None:
        return "mean"  # legacy arguments: be conservative
    return red


def _reduce_keys(m: list, red: str) -> list:
    if red == "none":
        return m
    return [k if k < 0 else (SUM - k if red == "sum" else WHOLE) for k in m]


def _cross_entropy(call, operands):
    """cross_entropy / nll_loss: the class dim must be whole; 'sum' over a sharded batch dim is
    a partial sum, 'mean' over one is an error (the count is global)."""
    x, target = call.args[0], call.arg(1, "target")
    red = _reduction_arg(call, 6)
    cdim = 1 if x.dim() >= 2 else 0
    batch = [d for d in range(x.dim()) if d != cdim]
    keys = _reduce_keys(list(range(len(batch))), red)
    mx = [WHOLE] * x.dim()
    for j, d in enumerate(batch):
        mx[d] = keys[j]
    if target.is_floating_point() and target.dim() == x.dim():
        mt = mx
    else:
        mt = keys[:target.dim()]
    pairs = [(x, mx), (target, mt)] + [(t, [WHOLE] * t.dim()) for t in operands if t is not x and t is not target]
    return _align(operands, pairs)


def _pointwise_loss(call, operands):  # mse_loss, l1_loss, binary_cross_entropy(_with_logits), ...
    red = call.kwargs.get("reduction", "mean")
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in operands)))
    return [_reduce_keys(_broadcast_map(t, shape), red) for t in operands]


def _sdpa(call, operands):
    """Attention: batch/head dims align (heads may be sharded); the key length and the head dim
    must be whole; queries may be split unless the mask is causal (it assumes aligned positions)."""
    q, k, v = call.args[0], call.arg(1, "key"), call.arg(2, "value")
    mask, causal = call.arg(3, "attn_mask"), call.arg(5, "is_causal", False)
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    nb = len(batch)
    rows = WHOLE if causal else nb

    def lead(t):
        return _broadcast_map(t[..., 0, 0], batch) if t.dim() >= 2 else []

    pairs = [(q, lead(q) + [rows, WHOLE]), (k, lead(k) + [WHOLE, WHOLE]), (v, lead(v) + [WHOLE, nb + 1])]
    if isinstance(mask, torch.Tensor):
        tail = [rows if mask.dim() >= 2 and mask.shape[-2] != 1 else LOCAL, WHOLE][-min(mask.dim(), 2):]
        pairs.append((mask, (lead(mask) if mask.dim() > 2 else []) + tail))
    return _align(operands, pairs)


_ELEMENTWISE = """abs absolute acos acosh add addcdiv addcmul angle asin asinh atan atan2 atanh bitwise_and bitwise_not
bitwise_or bitwise_xor ceil celu clamp clamp_max clamp_min clip cos cosh deg2rad digamma div divide dropout
alpha_dropout feature_alpha_dropout elu eq erf erfc erfinv exp exp2 expm1 fix float_power floor floor_divide fmax fmin
fmod frac ge gelu greater greater_equal gt hardshrink hardsigmoid hardswish hardtanh heaviside hypot i0 isfinite isinf
isnan isneginf isposinf le leaky_relu lerp less less_equal lgamma log log10 log1p log2 logaddexp logaddexp2 logical_and
logical_not logical_or logical_xor logit logsigmoid lt masked_fill maximum minimum mish mul multiply mvlgamma nan_to_num
ne neg negative nextafter not_equal polygamma positive pow prelu rad2deg reciprocal relu relu6 remainder round rrelu
rsqrt rsub selu sgn sigmoid sign signbit silu sin sinc sinh softplus softshrink sqrt square sub subtract tan tanh
tanhshrink threshold true_divide trunc where xlogy and or xor invert lshift rshift mod rdiv rpow bernoulli""".split()
_LINEAR_SUM = {"add", "sub", "subtract", "rsub"}
_LINEAR_PRODUCT = {"mul", "multiply", "neg", "negative", "positive"}
_LINEAR_QUOTIENT = {"div", "divide", "true_divide"}
_IDENTITY = """clone contiguous detach detach_ data float double half bfloat16 to type type_as cpu cuda
requires_grad_ conj resolve_conj resolve_neg alias _to_copy int long bool short byte char""".split()
_CASTS = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "_to_copy"}
_PASS = """shape dtype device requires_grad is_leaf grad_fn ndim layout names is_cuda is_meta is_cpu is_sparse
is_quantized is_mkldnn is_nested itemsize nbytes size dim ndimension numel nelement stride is_contiguous
element_size data_ptr storage_offset is_floating_point is_complex is_signed get_device untyped_storage len repr
format hash _version output_nr is_inference has_names retain_grad register_hook reduce_ex setstate deepcopy
dim_order is_pinned is_shared storage grad retains_grad""".split()
_VALUE = {"item", "tolist", "int_", "float_", "bool_", "index", "complex", "numpy", "equal", "allclose", "array"}
_LIKE = """zeros_like ones_like empty_like full_like rand_like randn_like randint_like zero_ fill_ normal_ uniform_
random_ exponential_ geometric_ log_normal_ cauchy_""".split()
_NEW = "new_zeros new_ones new_empty new_full new_tensor".split()

_RULES: dict[str, Rule] = {}


def _add(names, kind="map", maps=None, linear=None, select=None):
    for name in names if isinstance(names, (list, tuple, set)) else names.split():
        _RULES[name] = Rule(name, kind, maps, linear, select)


_add(_ELEMENTWISE, maps=_elementwise)
_add(_LINEAR_SUM, maps=_elementwise, linear="sum")
_add(_LINEAR_PRODUCT, maps=_elementwise, linear="product")
_add(_LINEAR_QUOTIENT, maps=_elementwise, linear="quotient")
_add(_IDENTITY, maps=_identity, linear="product", select=_self_only)
_add("copy_", maps=_copy_maps, linear="product", select=lambda call: [call.args[1]])
_add(_PASS, kind="pass")
_add(_VALUE, kind="value")
_add(_LIKE, kind="like")
_add(_NEW, kind="new")
_add("setitem", kind="setitem")
_add("iter", kind="iter", maps=_split(1, removes=True), linear="product")
_add("sum nansum", maps=_reduction(True), linear="product")
_add("mean nanmean", maps=_reduction(False), linear="product")  # linear, but over a sharded dim the count is global
_add("amax amin prod logsumexp all any argmax argmin count_nonzero median nanmedian var std "
     "var_mean std_mean aminmax", maps=_reduction(False))
_add("norm", maps=_reduction(False, dim_pos=2))
_add("max min", maps=_maxmin)
_add("softmax log_softmax softmin cummax cummin cumprod logcumsumexp sort argsort glu", maps=_along(1, -1))
_add("cumsum", maps=_along(1, None), linear="product")
_add("topk kthvalue", maps=_along(2, -1))
_add("normalize", maps=_along(2, 1))
_add("flip", maps=_local_dims(1, "dims"))
_add("roll", maps=_local_dims(2, "dims"))
_add("tril triu", maps=_tri)
_add("view reshape view_as reshape_as flatten unflatten squeeze unsqueeze ravel squeeze_ unsqueeze_",
     maps=_reshape, linear="product", select=_self_only)
_add("permute transpose swapaxes swapdims movedim moveaxis t T mT mH H adjoint transpose_ t_",
     maps=_permute, linear="product", select=_self_only)
_add("expand expand_as broadcast_to", maps=_expand, linear="product", select=_self_only)
_add("repeat tile", maps=_repeat, select=_self_only)
_add("narrow", maps=_narrow, linear="product")
_add("select", maps=_select, linear="product")
_add("index_select", maps=_index_select, linear="product")
_add("gather take_along_dim", maps=_gather, linear="product")
_add("split chunk tensor_split split_with_sizes unsafe_split", maps=_split(2), linear="product", select=_self_only)
_add("unbind", maps=_split(1, removes=True), linear="product", select=_self_only)
_add("cat concat concatenate", maps=_cat, linear="sum")
_add("stack", maps=_stack, linear="sum")
_add("getitem", maps=_getitem, linear="product")
_add("matmul mm bmm mv dot vdot rmatmul", maps=_matmul, linear="product")
_add("linear", maps=_linear, linear="product")
_add("addmm baddbmm addmv addbmm", maps=_addmm)
_add("outer ger", maps=_outer, linear="product")
_add("einsum", maps=_einsum, linear="product")
_add("embedding", maps=_embedding, linear="product")
_add("layer_norm rms_norm", maps=_norm)
_add("cross_entropy nll_loss", maps=_cross_entropy)
_add("mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div "
     "soft_margin_loss", maps=_pointwise_loss)
_add("scaled_dot_product_attention", maps=_sdpa)
_COLLECTIVES = {collectives.psum: "psum", collectives.all_gather: "all_gather",
                collectives.all_to_all: "all_to_all", collectives.axis_index: "axis_index"}
_REFLECTED = {"radd": "add", "rmul": "mul", "rsub": "rsub", "rtruediv": "rdiv", "rdiv": "rdiv", "rpow": "rpow",
              "rmatmul": "rmatmul", "rand": "and", "ror": "or", "rxor": "xor", "rfloordiv": "floor_divide",
              "rmod": "mod", "rlshift": "lshift", "rrshift": "rshift", "truediv": "true_divide",
              "floordiv": "floor_divide", "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "true_divide",
              "idiv": "div", "ipow": "pow", "imatmul": "matmul", "float": "float_", "bool": "bool_", "int": "int_",
              "pos": "positive"}


def _rule_for(func) -> Rule:
    if func in _COLLECTIVES:
        return Rule(_COLLECTIVES[func], "collective")
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property (x.shape, x.T, ...)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    dunder = name.startswith("__") and name.endswith("__")
    base = name[2:-2] if dunder else name
    if dunder:
        base = _REFLECTED.get(base, base)
    if base in _RULES:
        return _RULES[base]._replace(name=name if not dunder else base)
    if base.endswith("_") and base[:-1] in _RULES and _RULES[base[:-1]].kind == "map":  # in-place x.add_(y)
        return _RULES[base[:-1]]._replace(name=base)
    return Rule(base, "fallback")


# ============================================================================ the tracker
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
        self._replicated = _info((None,) * len(self.axes), (None,) * len(self.axes), ("const",))

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
        return _info(tuple(layout), tuple(why), ("parameter", path))

    def track_params(self, params: Any, plan: Plan) -> Any:
        """Register the params tree handed to loss_fn; lists of FSDP units are wrapped so each
        unit is registered when loss_fn reaches it (the engine gathers it then)."""
        from .fsdp import _UnitList

        def visit(path, leaf):
            path = tree_util.path_str(path)
            if isinstance(leaf, _UnitList):
                return _TrackedUnits(leaf, self, plan)
            if isinstance(leaf, torch.Tensor):
                self.set(leaf, self.param_info(plan, path))
            return leaf

        return optree.tree_map_with_path(visit, params, is_leaf=lambda x: isinstance(x, _UnitList),
                                         none_is_leaf=True)

    def track_batch(self, batch: Any) -> Any:
        """The local batch: varying over the FSDP axes, replicated over the others."""
        layout = tuple(VARYING if a in self.fsdp_axes else None for a in self.axes)
        why = tuple("the batch is split over the FSDP axes" if e else None for e in layout)
        for path, leaf in zip(*tree_util.flatten(batch)[:2]):
            if isinstance(leaf, torch.Tensor):
                self.set(leaf, _info(layout, why, ("batch", path)))
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
                    f"the loss ({_describe_src(info.src)}) is a pending partial sum over the non-FSDP axis "
                    f"{axis!r} ({why}); the step needs the complete loss. A psum is missing: return "
                    f"hpf.psum(loss, {axis!r}) or psum the partial tensor where it was made")
            raise LossNotReplicatedError(
                f"the loss ({_describe_src(info.src)}) is {_describe_entry(e)} over the non-FSDP axis {axis!r} "
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
                return f"{op} (inputs finite; output: {_describe_src(src)})"
        if first is not None:
            return f"{first[0]} (output: {_describe_src(first[1])})"
        return None

    # -- the mode ----------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = self._cache.get(func)
        if rule is None:
            rule = self._cache[func] = _rule_for(func)
        if rule.kind == "pass":
            return func(*args, **kwargs)
        self.ops += 1
        self.last_op = rule.name  # the engine names it when a read forces an extra gather
        call = _Call(rule.name, func, args, kwargs)
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
        info, operands = self._layout(rule, call)
        if self.compute_dtype is not None:
            self._check_precision(rule, call, operands, outs)
        self._register(call, outs, info, operands)
        return iter(out) if rule.kind == "iter" else out

    def _register(self, call: _Call, outs: list, info: Info, operands: list) -> None:
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

    # -- layout propagation --------------------------------------------------------------------------
    def _layout(self, rule: Rule, call: _Call) -> tuple[Info, list]:
        operands = rule.select(call) if rule.select else _operands(call)
        infos = [self.info(t) for t in operands]
        src = ("op", call.op, next((_lineage(i.src) for i in infos if i.src[0] == "parameter"), None)
               or next((_lineage(i.src) for i in infos if _lineage(i.src)), None))
        if rule.kind in ("like", "new"):
            return self._like(rule, infos, src), operands
        if rule.kind == "fallback":
            return self._fallback(call, operands, infos, src), operands
        if all(i.simple for i in infos):
            if len(infos) == 1:
                return _info(infos[0].layout, infos[0].why, src), operands
            layout, why = [], []
            for a in range(len(self.axes)):
                v = next((i for i in infos if i.layout[a] == VARYING), None)
                layout.append(VARYING if v else None)
                why.append(v.why[a] if v else None)
            return _info(tuple(layout), tuple(why), src), operands
        maps = rule.maps(call, operands)
        layout, why = [], []
        for a, axis in enumerate(self.axes):
            e, w = self._combine(rule, call, a, axis, operands, infos, maps)
            layout.append(e)
            why.append(w)
        return _info(tuple(layout), tuple(why), src), operands

    def _like(self, rule: Rule, infos: list, src: tuple) -> Info:
        """zeros_like & co. keep the local shape (so sharded entries) but hold no data."""
        if rule.kind == "new" or not infos:
            return _info(self._replicated.layout, self._replicated.why, src)
        base = infos[0]
        layout = tuple(e if isinstance(e, tuple) else None for e in base.layout)
        return _info(layout, tuple(w if isinstance(e, tuple) else None for e, w in zip(base.layout, base.why)), src)

    def _fallback(self, call: _Call, operands: list, infos: list, src: tuple) -> Info:
        layout, why = [], []
        for a, axis in enumerate(self.axes):
            for t, i in zip(operands, infos):
                if i.layout[a] == PARTIAL:
                    raise PartialSumError(self._partial_msg(call, axis, t, i, a, f" ({call.op} has no layout rule, "
                                                            "and only ops with a rule may carry partial sums)"))
            bad = next((i for i in infos if i.layout[a] is not None), None)
            layout.append(None if bad is None else VARYING)
            why.append(None if bad is None else (
                bad.why[a] if bad.layout[a] == VARYING else
                f"{call.op} has no layout rule, so its output on a tensor {_describe_entry(bad.layout[a])} over "
                f"{axis!r} is taken as varying"))
        return _info(tuple(layout), tuple(why), src)

    def _combine(self, rule, call, a, axis, operands, infos, maps):
        entries = [i.layout[a] for i in infos]
        if all(e is None for e in entries):
            return None, None
        partial = [j for j, e in enumerate(entries) if e == PARTIAL]
        if partial:
            self._check_linear(rule, call, a, axis, operands, infos, entries, partial)
            return PARTIAL, infos[partial[0]].why[a]
        keys: dict[int, tuple] = {}
        varying = next((j for j, e in enumerate(entries) if e == VARYING), None)
        local_why = None
        for j, e in enumerate(entries):
            if not isinstance(e, tuple):
                continue
            d, k = e
            key = maps[j][d]
            if key == WHOLE:
                raise ShardedContractionError(self._whole_msg(call, axis, operands[j], infos[j], d, a))
            if key == LOCAL:
                local_why = local_why or (f"{call.op} took a local part of dim {d} of "
                                          f"{_describe_src(infos[j].src)}, which is sharded over {axis!r}")
                continue
            if key in keys and keys[key][0] != k:
                raise ShardingMismatchError(self._mismatch_msg(call, axis, a, infos, maps, keys[key][1], j, key))
            keys.setdefault(key, (k, j, d))
        for key, (k, j, d) in keys.items():
            for j2, m in enumerate(maps):
                for d2, key2 in enumerate(m):
                    if key2 != key or j2 == j:
                        continue
                    e2 = entries[j2]
                    if e2 == VARYING or e2 == (d2, k) or (e2 is None and operands[j2].shape[d2] == 1):
                        continue
                    raise (ShardedContractionError if key <= SUM else ShardingMismatchError)(
                        self._mismatch_msg(call, axis, a, infos, maps, j, j2, key))
        if len(keys) > 1:
            (_, j1, _), (_, j2, _) = list(keys.values())[:2]
            raise ShardingMismatchError(
                f"{call.op}: {_describe_src(infos[j1].src)} and {_describe_src(infos[j2].src)} are both sharded "
                f"over {axis!r} but on dims that meet in different output dims, so each rank would hold only a "
                f"diagonal block of the result. Shard only one of them over {axis!r}, or hpf.all_gather the other")
        if varying is not None:
            return VARYING, infos[varying].why[a]
        if local_why:
            return VARYING, local_why
        if keys:
            key, (k, j, d) = next(iter(keys.items()))
            if key >= 0:
                return (key, k), infos[j].why[a]
            return PARTIAL, (f"{call.op} contracted dim {d} of {_describe_src(infos[j].src)}, which is sharded "
                             f"over {axis!r}")
        return None, None

    def _check_linear(self, rule, call, a, axis, operands, infos, entries, partial) -> None:
        p = partial[0]
        if rule.linear is None:
            raise PartialSumError(self._partial_msg(call, axis, operands[p], infos[p], a, ""))
        if rule.linear == "sum":
            complete = next((j for j, e in enumerate(entries) if e != PARTIAL), None)
            scalar = next((x for x in call.args[:2] if isinstance(x, (int, float)) and not isinstance(x, bool)
                           and x != 0), None)
            if complete is not None or scalar is not None:
                other = (_describe_src(infos[complete].src) if complete is not None else f"the number {scalar}")
                raise PartialSumError(self._partial_msg(
                    call, axis, operands[p], infos[p], a,
                    f"; {call.op} adds it to {other}, which is complete, so that term would count once per rank"))
            return
        if len(partial) > 1:
            raise PartialSumError(self._partial_msg(
                call, axis, operands[partial[1]], infos[partial[1]], a,
                f"; {call.op} multiplies two partial sums, which a psum of the product does not undo"))
        if rule.linear == "quotient" and p != 0:
            raise PartialSumError(self._partial_msg(call, axis, operands[p], infos[p], a, " (it is a divisor)"))
        other = next((j for j, e in enumerate(entries) if e is not None and j != p), None)
        if other is not None:
            raise PartialSumError(self._partial_msg(
                call, axis, operands[p], infos[p], a,
                f"; {call.op} combines it with {_describe_src(infos[other].src)}, which is "
                f"{_describe_entry(entries[other])} over {axis!r}, so the per-rank results no longer sum to the "
                f"answer"))

    # -- messages ---------------------------------------------------------------------------------------
    def _partial_msg(self, call, axis, t, info, a, reason) -> str:
        return (f"{call.op}: {_describe_src(info.src)} is a pending partial sum over the non-FSDP axis {axis!r} "
                f"({info.why[a]}), used as a complete value{reason}. A psum is missing: apply "
                f"hpf.psum(x, {axis!r}) to it before {call.op}")

    def _whole_msg(self, call, axis, t, info, d, a) -> str:
        hint = (f"reduce with .sum() then hpf.psum(..., {axis!r}), dividing by the global size for a mean"
                if call.op in ("mean", "nanmean") else
                f"hpf.all_gather(x, {axis!r}, dim={d}) first, or shard a different dim (e.g. the heads)")
        return (f"{call.op} needs the whole of dim {d} of {_describe_src(info.src)}, but that dim is sharded over "
                f"the non-FSDP axis {axis!r} ({info.why[a]}); each rank holds only a block and no later reduction "
                f"can complete {call.op}. Fix: {hint}")

    def _mismatch_msg(self, call, axis, a, infos, maps, j, j2, key) -> str:
        e, e2 = infos[j].layout[a], infos[j2].layout[a]
        d = e[0]
        d2 = next((i for i, k in enumerate(maps[j2]) if k == key), "?")
        what = "contracts" if key <= SUM else "aligns"
        fix = (f"shard dim {d2} of {_describe_src(infos[j2].src)} over {axis!r} too (then hpf.psum the partial "
               f"result), or hpf.all_gather {_describe_src(infos[j].src)} first" if key <= SUM else
               f"shard both alike over {axis!r}, or hpf.all_gather the sharded one first")
        return (f"{call.op} {what} dim {d} of {_describe_src(infos[j].src)}, sharded over the non-FSDP axis "
                f"{axis!r} ({infos[j].why[a]}), with dim {d2} of {_describe_src(infos[j2].src)}, which is "
                f"{_describe_entry(e2)}{' there' if isinstance(e2, tuple) else ''} over {axis!r}: the local "
                f"blocks do not line up. Fix: {fix}")

    def _explain(self, rule: Rule, call: _Call, err: Exception) -> None:
        """The op failed (e.g. local shapes that do not line up): raise the layout error that
        explains it, if there is one."""
        if rule.kind not in ("map",):
            return
        try:
            self._layout(rule, call)
        except LayoutError as layout_err:
            raise layout_err from err
        except Exception:  # noqa: BLE001 - the op's own error is the better one
            return

    # -- other checks --------------------------------------------------------------------------------
    def _check_value(self, call: _Call) -> None:
        for t in _operands(call):
            info = self.info(t)
            for a, axis in enumerate(self.axes):
                if info.layout[a] == PARTIAL:
                    raise PartialSumError(self._partial_msg(call, axis, t, info, a, " (converted to a Python value)"))

    def _setitem(self, call: _Call) -> None:
        """x[i] = v: x keeps its layout where x, v and i agree; otherwise it becomes varying."""
        x = call.args[0]
        infos = [self.info(t) for t in _operands(call)]
        if all(i.simple for i in infos) and all(i.layout == infos[0].layout for i in infos):
            return
        layout, why = [], []
        for a, axis in enumerate(self.axes):
            entries = {i.layout[a] for i in infos}
            if PARTIAL in entries and entries != {PARTIAL}:
                p = next(i for i in infos if i.layout[a] == PARTIAL)
                raise PartialSumError(self._partial_msg(call, axis, x, p, a, " (written into a complete tensor)"))
            layout.append(entries.pop() if len(entries) == 1 else VARYING)
            why.append(next((i.why[a] for i in infos if i.why[a]), None))
        self.set(x, _info(tuple(layout), tuple(why), ("op", "setitem", _lineage(infos[0].src))))

    def _check_precision(self, rule: Rule, call: _Call, operands: list, outs: list) -> None:
        c = self.compute_dtype
        if rule.name in _CASTS or call.kwargs.get("dtype") is not None:
            return
        for t in outs:
            if not t.is_floating_point() or t.dtype == c:
                continue
            low = next((x for x in operands if x.dtype == c), None)
            high = next((x for x in operands if x.is_floating_point() and x.dtype != c and x.dim() > 0), None)
            if low is None or high is None:
                continue
            raise PrecisionError(
                f"{call.op}: mixed precision computes in {c}, but {_describe_src(self.info(high).src)} is "
                f"{high.dtype}, so {call.op} on it and {_describe_src(self.info(low).src)} ({c}) silently computes "
                f"in {t.dtype}. Cast it with .to({c}), or cast explicitly (e.g. x.float()) where {t.dtype} is "
                f"intended")

    # -- hpf's collectives -------------------------------------------------------------------------------
    def _collective(self, call: _Call, func):
        ctx = collectives.current()
        if call.op == "axis_index":
            out = func(*call.args, **call.kwargs)
            axes = ctx.axes(call.args[0], "axis_index") if ctx else ()
            layout = tuple(VARYING if a in axes else None for a in self.axes)
            self.set(out, _info(layout, tuple(f"hpf.axis_index({a!r})" if a in axes else None for a in self.axes),
                                ("op", "axis_index", None)))
            return out
        x = call.args[0]
        info = self.info(x)
        axes = ctx.axes(call.args[1], call.op) if ctx else ()
        layout, why = list(info.layout), list(info.why)
        for axis in axes:
            a = self.axes.index(axis)
            e = info.layout[a]
            if e == PARTIAL and call.op != "psum":
                raise PartialSumError(self._partial_msg(call, axis, x, info, a, f" (hpf.{call.op} moves blocks, it "
                                                                                 f"does not sum)"))
            if e is None:
                raise CollectiveError(
                    f"hpf.{call.op} over {axis!r} of {_describe_src(info.src)}, which is already replicated over "
                    f"{axis!r}: " + ("a psum would multiply it by the axis size (a second psum?). Drop it, or "
                                     "multiply by the axis size if that is meant" if call.op == "psum" else
                                     "every rank holds the same copy. Drop it, or shard the tensor first"))
            layout[a], why[a] = self._collective_entry(call, x, e, a, axis)
        if call.op == "all_to_all":  # other axes that split the moved dims lose their block structure
            moved = {collectives._dim(x, call.args[2], "all_to_all", "split_dim"),
                     collectives._dim(x, call.args[3], "all_to_all", "concat_dim")}
            for a, e in enumerate(layout):
                if self.axes[a] not in axes and isinstance(e, tuple) and e[0] in moved:
                    layout[a], why[a] = VARYING, f"hpf.all_to_all resized dim {e[0]}"
        out = func(*call.args, **call.kwargs)
        self._register(call, [out], _info(tuple(layout), tuple(why), ("op", f"hpf.{call.op}", _lineage(info.src))),
                       [x])
        return out

    def _collective_entry(self, call, x, e, a, axis):
        if call.op == "psum":
            return None, None
        if call.op == "all_gather":
            dim = collectives._dim(x, call.kwargs.get("dim", call.args[2] if len(call.args) > 2 else 0),
                                   "all_gather", "dim")
            if e == VARYING or (isinstance(e, tuple) and e[0] == dim):
                return None, None
            return VARYING, f"hpf.all_gather over {axis!r} along dim {dim}, but the tensor is sharded on dim {e[0]}"
        split = collectives._dim(x, call.args[2], "all_to_all", "split_dim")
        concat = collectives._dim(x, call.args[3], "all_to_all", "concat_dim")
        if isinstance(e, tuple) and e[0] == concat:
            return (split, 0), f"hpf.all_to_all moved the split over {axis!r} from dim {concat} to dim {split}"
        return VARYING, f"hpf.all_to_all over {axis!r}"


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


# ============================================================================ up-front checks
def _precheck(params: Any, param_specs: Any, mesh: Mesh, fsdp_axes, op: str) -> None:
    """(5) a spec tree of another structure and (8) a non-FSDP axis that does not divide its dim."""
    tree_util.check_leaves(params)
    paths, leaves, _ = tree_util.flatten(params)
    is_spec = lambda x: isinstance(x, P) or x is None  # noqa: E731
    if param_specs is not None and not isinstance(param_specs, P) and not callable(param_specs):
        spec_paths = [tree_util.path_str(p) for p in optree.tree_paths(param_specs, is_leaf=is_spec, none_is_leaf=True)]
        if spec_paths != paths:
            missing = [p for p in paths if p not in set(spec_paths)]
            extra = [p for p in spec_paths if p not in set(paths)]
            raise ParamsTreeError(
                f"{op}: the param_specs tree does not have the params' structure: parameters without a spec: "
                f"{missing[:5]}, specs for no parameter: {extra[:5]}" + (" (same paths, another order)" if not
                                                                          missing and not extra else "") +
                ". Give one P per parameter leaf with the same keys and list lengths, or use hpf.rules([...])")
        specs = [s or P() for s in optree.tree_leaves(param_specs, is_leaf=is_spec, none_is_leaf=True)]
    elif param_specs is None:
        return
    else:
        specs = [param_specs if isinstance(param_specs, P) else param_specs(p) for p in paths]
    fsdp = mesh.axis_names if fsdp_axes is None else tuple(fsdp_axes)
    for path, leaf, spec in zip(paths, leaves, specs):
        if not isinstance(spec, P):
            continue  # resolve_specs names it
        for d in range(min(len(spec), leaf.dim())):
            axes = [a for a in spec.dim_axes(d) if a in mesh.axis_names and a not in fsdp]
            n = mesh.axis_size(axes) if axes else 1
            if leaf.shape[d] % n:
                raise IndivisibleSpecError(
                    f"{op}: parameter {path!r} dim {d} has size {leaf.shape[d]}, which the non-FSDP axes "
                    f"{tuple(axes)} of its spec {spec!r} ({n} ranks) do not divide; only FSDP axes are padded. "
                    f"Pick a size divisible by {n}, or shard this dim over FSDP axes instead")


# ============================================================================ the validating step
class ValidateStep(ShardStep):
    """``hpf.shard_step(..., mode="validate")``: the production step with every check on.

    Per step, beyond production: the state must match the plan (5); the local batch must have
    the same shapes and dtypes on every rank and the same content across non-FSDP ranks (4);
    every op's layouts must agree (1, 2, 6 and more); the loss must be complete and
    replicated (1, 3); no loss or grad may be non-finite (7). Losses and grads are
    bit-identical to production's: the same ops run on the same plain tensors.
    """

    def __init__(self, loss_fn: Callable, **kwargs):
        kwargs.pop("mode", None)
        super().__init__(loss_fn, mode="validate", **kwargs)
        self.ops_checked = 0

    def init(self, full_params: Any) -> TrainState:
        _precheck(full_params, self.param_specs, self.mesh, self.fsdp_axes, "shard_step(mode='validate').init")
        state = super().init(full_params)
        self._state_sig = [(tuple(s.shape), s.dtype) for s in state.params]
        return state

    def _forward_backward(self, state: TrainState, batch: Any) -> torch.Tensor:
        if self.engine is None:
            raise RuntimeError("call step.init(full_params) first, and pass the state it returns")
        self._check_state(state)
        self._check_batch(batch)
        loss = super()._forward_backward(state, batch)
        self._check_grads_finite()
        return loss

    def _run_loss(self, params: Any, batch: Any) -> torch.Tensor:
        tracker = Tracker(self.mesh, self.plan.fsdp_axes, self.mp.compute_dtype if self.mp else None)
        params = tracker.track_params(params, self.plan)
        batch = tracker.track_batch(batch)
        self.engine.warn_extra, self.engine.describe_op = True, lambda: getattr(tracker, "last_op", "(none yet)")
        with tracker:
            loss = self.loss_fn(params, batch)
        tracker.check_loss(loss)
        self.ops_checked = tracker.ops
        self._check_loss_values(loss, tracker)
        return loss

    def check_grads(self, state: TrainState, batch: Any, *, rtol: float = 1e-3, atol: float = 1e-6) -> "GradReport":
        """Sharded grads vs a single-process reference, without updating ``state``; see :func:`check_grads`."""
        return check_grads(self, state, batch, rtol=rtol, atol=atol)

    # -- checks -------------------------------------------------------------------------------------
    def _check_state(self, state: Any) -> None:
        shards = getattr(state, "params", None)
        sig = None if not isinstance(shards, (list, tuple)) else [
            (tuple(s.shape), s.dtype) if isinstance(s, torch.Tensor) else None for s in shards]
        if sig == self._state_sig:
            return
        where = "it is not a TrainState" if sig is None else next(
            (f"bucket {i} (params {[s.path for s in self.plan.buckets[i].slots][:3]}) is {got}, the plan "
             f"expects {want}" for i, (got, want) in enumerate(zip(sig, self._state_sig)) if got != want),
            f"it has {len(sig)} shards, the plan has {len(self._state_sig)} buckets")
        raise ParamsTreeError(f"step(state, batch): the state does not match this step's plan: {where}. "
                              "Pass the state returned by this step's init (or by its previous call)")

    def _check_batch(self, batch: Any) -> None:
        paths, leaves, _ = tree_util.flatten(batch)
        sig = [(p, tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else (p, type(x).__name__, None)
               for p, x in zip(paths, leaves)]
        sums = [_checksum(x) for x in leaves if isinstance(x, torch.Tensor)]
        if not dist.is_initialized() or self.mesh.size == 1:
            return
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (sig, sums))
        for r, (theirs, _) in enumerate(everyone):
            if theirs != sig:
                diff = next(((a, b) for a, b in zip(sig, theirs) if a != b),
                            (sig[len(theirs)] if len(sig) > len(theirs) else None,
                             theirs[len(sig)] if len(theirs) > len(sig) else None))
                raise BatchMismatchError(
                    f"step(state, batch): the local batch of rank {r} differs from rank {self.rank}'s: "
                    f"{_fmt_leaf(diff[1])} vs {_fmt_leaf(diff[0])} (leaf, shape, dtype). Every rank must pass a "
                    "local batch of the same shapes and dtypes (split the global batch evenly)")
        group = self.mesh.group_ranks(self.plan.compute_axes, self.rank) if self.plan.compute_axes else [self.rank]
        for r in group:
            if everyone[r][1] != sums:
                leaf = next(p for p, a, b in zip([p for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)],
                                                  sums, everyone[r][1]) if a != b)
                raise BatchMismatchError(
                    f"step(state, batch): {_fmt_leaf((leaf, '', ''))} holds different values on ranks {self.rank} "
                    f"and {r}, "
                    f"which differ only along the non-FSDP axes {self.plan.compute_axes}; those ranks compute one "
                    "model replica together and must get the same local batch. Pick the batch by the "
                    f"data-parallel position (mesh.group_index({self.plan.fsdp_axes!r}, rank)), not the global rank")

    def _check_loss_values(self, loss: torch.Tensor, tracker: Tracker) -> None:
        """(3) the same loss across non-FSDP ranks, (7) a finite loss, decided together by all ranks."""
        value = loss.detach().float().reshape(1)
        if dist.is_initialized() and self.mesh.size > 1:
            values = value.new_empty(dist.get_world_size())
            dist.all_gather_single(values, value)
        else:
            values = value
        values = values.cpu()
        bad = [r for r, v in enumerate(values.tolist()) if not math.isfinite(v)]
        if bad:
            origin = tracker.first_nonfinite() if self.rank in bad else None
            origins = [origin]
            if dist.is_initialized() and self.mesh.size > 1:
                origins = [None] * dist.get_world_size()
                dist.all_gather_object(origins, origin)
            r = bad[0]
            raise NonFiniteError(
                f"the loss is non-finite on rank(s) {bad}; on rank {r} the first non-finite value in the "
                f"forward appeared at {origins[r if len(origins) > 1 else 0] or 'an op with no recorded output'}"
                ". Check that op's inputs (log/sqrt of non-positive values, division by zero, overflow in low "
                "precision)")
        for group in self.mesh.all_groups(self.plan.compute_axes) if self.plan.compute_axes else []:
            vals = values[group]
            if not torch.allclose(vals, vals[:1].expand_as(vals), rtol=1e-5, atol=0.0):
                raise LossNotReplicatedError(
                    f"the loss differs across ranks {group}, which differ only along the non-FSDP axes "
                    f"{self.plan.compute_axes}: {vals.tolist()}. Those ranks must compute the same loss: check "
                    "for random ops (dropout) with per-rank seeds, or a per-rank input that layouts cannot see")

    def _check_grads_finite(self) -> None:
        """(7) names the parameters whose grads are non-finite, decided together by all ranks."""
        plan, flags, paths = self.plan, [], []
        for bucket, shard in zip(plan.buckets, self.grad_shards):
            start, _ = bucket.shard_range(plan.shard_index(bucket, self.rank))
            bad = ~torch.isfinite(shard)
            for slot in bucket.slots:
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, start + shard.numel())
                flags.append(bad[lo - start:hi - start].any() if lo < hi else bad.new_zeros(()))
                paths.append(slot.path)
        if not flags:
            return
        flags = torch.stack(flags).float()
        if dist.is_initialized() and self.mesh.size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_paths = [p for p, f in zip(paths, flags.tolist()) if f]
        if bad_paths:
            raise NonFiniteError(
                f"the loss is finite but the grads of {bad_paths[:8]} are not (first in parameter order: "
                f"{bad_paths[0]!r}). The backward of an op on that parameter's path produced inf/nan, e.g. sqrt or "
                "pow at 0, or log near 0; clamp its input away from the singular point")


def _checksum(x: torch.Tensor) -> str:
    """A position-weighted sum: equal batches give equal sums, swapped rows almost surely do not."""
    flat = x.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(1009).add_(1)
    return float((flat * weights).sum()).hex()  # hex: NaN compares equal to NaN


def _fmt_leaf(leaf) -> str:
    if leaf is None:
        return "nothing"
    return f"{f'batch leaf {leaf[0]!r}' if leaf[0] else 'the batch'} {leaf[1]} {leaf[2] or ''}".strip()


# ============================================================================ plan check at any scale
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
               mixed_precision: MixedPrecision | str | None = None, backward: bool = True) -> PlanCheck:
    """Check a plan at any scale in one process, starting nothing: validation mode for ``rank``'s
    view of a (virtual) ``mesh``, on meta tensors.

    ``params_meta``: the full params (meta tensors are enough); ``batch_meta``: one rank's local
    batch (meta or real; it is moved to meta). Runs ``loss_fn`` on this rank's local param blocks with every layout
    checked (collectives only produce the right shapes), then backward to check the grad
    shapes. Raises the first :class:`LayoutError`; returns a :class:`PlanCheck`.
    """
    t0 = time.perf_counter()
    if isinstance(mixed_precision, str):
        mixed_precision = _PRECISIONS[mixed_precision]
    if not 0 <= rank < mesh.size:
        raise ValueError(f"check_plan: rank={rank} is outside {mesh} ({mesh.size} ranks)")
    _precheck(params_meta, param_specs, mesh, fsdp_axes, "check_plan")
    plan = make_plan(params_meta, mesh, param_specs, fsdp_axes)
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


# ============================================================================ gradient equivalence
@dataclass
class GradReport:
    """Per parameter path: max |sharded - reference| and that over max |reference|."""

    errors: dict[str, tuple[float, float]]  # path -> (max_abs, max_rel)
    failures: list[str]
    rtol: float
    atol: float
    sharded: Any = field(repr=False, default=None)  # full grads through the sharded step
    reference: Any = field(repr=False, default=None)  # full grads of the single-process reference

    def __str__(self) -> str:
        width = max(map(len, self.errors), default=4)
        rows = [f"{'path':<{width}}  {'max_abs':>10}  {'max_rel':>10}"]
        rows += [f"{p:<{width}}  {a:10.3e}  {r:10.3e}{'  FAIL' if p in self.failures else ''}"
                 for p, (a, r) in self.errors.items()]
        return "\n".join(rows)


def check_grads(step: ShardStep, state: TrainState, batch: Any, *, rtol: float = 1e-3,
                atol: float = 1e-6) -> GradReport:
    """Gradient equivalence in one call (collective: every rank calls it with its local batch).

    Computes the grads of the global mean loss through the sharded step (no update) and
    through a single-process reference: plain autograd on the gathered full params, run on
    each data-parallel rank's local batch and averaged, with hpf collectives acting as on one
    rank. A path fails when max |sharded - reference| > atol + rtol * max |reference|; then
    raises :class:`GradientMismatchError` naming the paths; otherwise returns the report.
    Under mixed precision the reference computes in the compute dtype too; loosen rtol to match.
    """
    if step.engine is None:
        raise RuntimeError("check_grads: call step.init(full_params) first")
    step._forward_backward(state, batch)
    grads = [g / step.dp_size for g in step.grad_shards]
    sharded = step.full_params(TrainState(grads, None))
    full = step.full_params(state)
    batches = _data_parallel_batches(step, batch)
    dtype = step.mp.compute_dtype if step.mp else None
    reference = _reference_grads(step.loss_fn, full, batches, dtype)
    errors, failures = {}, []
    for path, got, want in zip(*tree_util.flatten(sharded)[:2], tree_util.flatten(reference)[1]):
        got, want = got.float(), want.float()
        max_abs = float((got - want).abs().max()) if got.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        errors[path] = (max_abs, max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf))
        if not max_abs <= atol + rtol * scale:
            failures.append(path)
    report = GradReport(errors, failures, rtol, atol, sharded, reference)
    if failures:
        worst = sorted(failures, key=lambda p: -errors[p][1])
        raise GradientMismatchError(
            f"sharded grads differ from the single-process reference beyond atol={atol} + rtol={rtol} * "
            f"max|ref| for {len(failures)} params, worst {worst[:5]}:\n{report}\nThe sharded path (specs, collectives, "
            "custom autograd functions) computes different grads; a missing or extra hpf.psum is the usual cause")
    return report


def _data_parallel_batches(step: ShardStep, batch: Any) -> list:
    """Every data-parallel rank's local batch (this rank's non-FSDP coordinates), in rank order."""
    if not dist.is_initialized() or step.mesh.size == 1:
        return [batch]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, optree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, batch))
    move = lambda x: x.to(step.device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return [optree.tree_map(move, everyone[r]) for r in step.mesh.group_ranks(step.plan.fsdp_axes, step.rank)]


def _reference_grads(loss_fn: Callable, full: Any, batches: list, dtype: torch.dtype | None) -> Any:
    paths, leaves, treedef = tree_util.flatten(full)
    params = [x.detach().to(dtype or x.dtype).requires_grad_() for x in leaves]
    tree = tree_util.unflatten(treedef, params)
    total = [torch.zeros_like(x, dtype=torch.float32) for x in leaves]
    with spmd(None):
        for b in batches:
            grads = torch.autograd.grad(loss_fn(tree, b), params, allow_unused=True)
            for t, g in zip(total, grads):
                if g is not None:
                    t += g.float()
    return tree_util.unflatten(treedef, [t / len(batches) for t in total])
