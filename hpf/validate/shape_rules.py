"""Op rules of the ops that keep, reduce or move dims: elementwise ops, reductions, views, indexing, cat."""
from __future__ import annotations

from typing import Sequence

import torch

from .layout import LOCAL, SUM, WHOLE
from .op_rule import Call, align, broadcast_map, register, rule

__all__ = ["CASTS"]


def _self_only(call: Call) -> list:
    return [call.args[0]]


def _nd(d: int, n: int) -> int:
    return d % n if n else 0


def _out_shape(call: Call, operands) -> tuple:
    out = call.out
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    return tuple(torch.broadcast_shapes(*(t.shape for t in operands)))


def _elementwise(call, operands):
    shape = _out_shape(call, operands)
    return [broadcast_map(t, shape) for t in operands]


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
register(_ELEMENTWISE, maps=_elementwise)
register(_LINEAR_SUM, maps=_elementwise, linear="sum")
register(_LINEAR_PRODUCT, maps=_elementwise, linear="product")
register(_LINEAR_QUOTIENT, maps=_elementwise, linear="quotient")



_IDENTITY = """clone contiguous detach detach_ data float double half bfloat16 to type type_as cpu cuda
requires_grad_ conj resolve_conj resolve_neg alias _to_copy int long bool short byte char""".split()
CASTS = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "_to_copy"}

@rule(_IDENTITY, linear="product", select=_self_only)
def _identity(call, operands):
    return [list(range(t.dim())) for t in operands]


@rule("copy_", linear="product", select=lambda call: [call.args[1]])
def _copy_maps(call, operands):  # copy_(self, src): the values are src's, broadcast to self
    return [broadcast_map(operands[0], call.args[0].shape)]


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


register("sum nansum", maps=_reduction(True), linear="product")
register("mean nanmean", maps=_reduction(False), linear="product")  # linear, but over a sharded dim the count is global
register("amax amin prod logsumexp all any argmax argmin count_nonzero median nanmedian var std "
         "var_mean std_mean aminmax", maps=_reduction(False))
register("norm", maps=_reduction(False, dim_pos=2))



@rule("max min")
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


register("softmax log_softmax softmin cummax cummin cumprod logcumsumexp sort argsort glu", maps=_along(1, -1))
register("cumsum", maps=_along(1, None), linear="product")
register("topk kthvalue", maps=_along(2, -1))
register("normalize", maps=_along(2, 1))



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


register("flip", maps=_local_dims(1, "dims"))
register("roll", maps=_local_dims(2, "dims"))



@rule("tril triu")
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


@rule("view reshape view_as reshape_as flatten unflatten squeeze unsqueeze ravel squeeze_ unsqueeze_",
      linear="product", select=_self_only)
def _reshape(call, operands):
    squeeze = call.op in ("squeeze", "unsqueeze", "squeeze_", "unsqueeze_")
    return [_reshape_map(call.args[0].shape, call.out.shape, squeeze)] + [[LOCAL] * t.dim() for t in operands[1:]]


@rule("permute transpose swapaxes swapdims movedim moveaxis t T mT mH H adjoint transpose_ t_",
      linear="product", select=_self_only)
def _permute(call, operands):
    """Any dim permutation (permute, transpose, movedim, t, T, mT, ...): replay it on a meta
    tensor of distinct sizes and read off where each dim went."""
    x = call.args[0]
    probe = torch.empty(tuple(range(2, x.dim() + 2)), device="meta")
    moved = call.func(probe, *call.args[1:], **call.kwargs)
    where = {s: i for i, s in enumerate(moved.shape)}
    return [[where[d + 2] for d in range(x.dim())]] + [[LOCAL] * t.dim() for t in operands[1:]]


@rule("expand expand_as broadcast_to", linear="product", select=_self_only)
def _expand(call, operands):
    return [broadcast_map(call.args[0], call.out.shape)]


@rule("repeat tile", select=_self_only)
def _repeat(call, operands):
    x = call.args[0]
    sizes = call.args[1] if len(call.args) == 2 and not isinstance(call.args[1], int) else call.args[1:]
    sizes = (1,) * (x.dim() - len(sizes)) + tuple(sizes)  # tile pads short sizes with ones
    off = len(sizes) - x.dim()
    return [[LOCAL if sizes[off + d] != 1 else off + d for d in range(x.dim())]]


@rule("narrow", linear="product")
def _narrow(call, operands):
    x, dim, start, length = call.args[0], call.arg(1, "dim"), call.arg(2, "start"), call.arg(3, "length")
    dim = _nd(dim, x.dim())
    m = list(range(x.dim()))
    if not (isinstance(start, int) and start == 0 and length == x.shape[dim]):
        m[dim] = LOCAL
    return align(operands, [(x, m)])


@rule("select", linear="product")
def _select(call, operands):
    x = call.args[0]
    dim = _nd(call.arg(1, "dim"), x.dim())
    return align(operands, [(x, [LOCAL if d == dim else d - (d > dim) for d in range(x.dim())])])


@rule("index_select", linear="product")
def _index_select(call, operands):
    x, index = call.args[0], call.arg(2, "index")
    dim = _nd(call.arg(1, "dim"), x.dim())
    m = list(range(x.dim()))
    m[dim] = LOCAL
    return align(operands, [(x, m), (index, [dim] if index.dim() else [])])


@rule("gather take_along_dim", linear="product")
def _gather(call, operands):  # gather / take_along_dim: the index picks along dim, other dims align
    x, index = call.args[0], call.arg(2, "index", call.arg(1, "indices"))
    dim = call.arg(1, "dim") if call.op == "gather" else call.arg(2, "dim")
    if dim is None:
        return [[LOCAL] * t.dim() for t in operands]
    dim = _nd(dim, x.dim())
    m = list(range(x.dim()))
    m[dim] = LOCAL
    mi = list(range(index.dim()))
    return align(operands, [(x, m), (index, mi)])


def _split(dim_pos: int, removes: bool = False):
    def maps(call, operands):
        x = call.args[0]
        dim = _nd(call.arg(dim_pos, "dim", 0), x.dim())
        pieces = len(call.out) if isinstance(call.out, (tuple, list)) else 2
        if removes:
            return [[LOCAL if d == dim else d - (d > dim) for d in range(x.dim())]]
        return [[LOCAL if d == dim and pieces > 1 else d for d in range(x.dim())]]
    return maps


register("split chunk tensor_split split_with_sizes unsafe_split", maps=_split(2), linear="product",
         select=_self_only)
register("unbind", maps=_split(1, removes=True), linear="product", select=_self_only)
register("iter", kind="iter", maps=_split(1, removes=True), linear="product")



@rule("cat concat concatenate", linear="sum")
def _cat(call, operands):
    tensors = [t for t in call.args[0] if t.dim() > 0 or len(call.args[0]) == 1]
    n = max(t.dim() for t in tensors)
    dim = _nd(call.arg(1, "dim", 0), n)
    pairs = [(t, [LOCAL if d == dim and len(tensors) > 1 else d for d in range(t.dim())]) for t in tensors]
    return align(operands, pairs)


@rule("stack", linear="sum")
def _stack(call, operands):
    tensors = call.args[0]
    dim = _nd(call.arg(1, "dim", 0), tensors[0].dim() + 1)
    return align(operands, [(t, [d + (d >= dim) for d in range(t.dim())]) for t in tensors])


@rule("getitem", linear="product")
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
    return align(operands, [(x, m)] + pairs)
