"""Op rules: how each torch op maps the layouts of its inputs to the layout of its output.

A rule is registered where it is written, by the :func:`rule` decorator (as ``jax.shard_map``
registers its replication rules); ops whose rule is a kind rather than a map (metadata
reads, conversions to Python values, ``*_like`` constructors) are registered by
:func:`register` next to their name lists. :func:`rule_for` finds the rule of a torch
function, reflected and in-place dunders included; an op without one gets the
conservative "fallback" the tracker documents.

A map function ``(call, operands) -> one list per operand`` gives, for each operand dim, the
output dim it becomes, or ``WHOLE`` (the op needs the whole dim), ``LOCAL`` (it takes a
local part) or ``SUM - i`` (contracted; operands that contract the same dim share a key).

To add a rule: write the map function here and decorate it with
``@rule("op names", linear=...)``; add a case to ``LAYOUT_CASES`` in tests/test_validate_rules.py.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ..comm import collectives
from .layout import LOCAL, SUM, WHOLE

__all__ = ["Call", "Rule", "RULES", "rule", "register", "rule_for", "operands_of", "CASTS"]


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


# ops that only read metadata, produce Python values, or make tensors of the same local shape
_PASS = """shape dtype device requires_grad is_leaf grad_fn ndim layout names is_cuda is_meta is_cpu is_sparse
is_quantized is_mkldnn is_nested itemsize nbytes size dim ndimension numel nelement stride is_contiguous
element_size data_ptr storage_offset is_floating_point is_complex is_signed get_device untyped_storage len repr
format hash _version output_nr is_inference has_names retain_grad register_hook reduce_ex setstate deepcopy
dim_order is_pinned is_shared storage grad retains_grad""".split()
_VALUE = {"item", "tolist", "int_", "float_", "bool_", "index", "complex", "numpy", "equal", "allclose", "array"}
_LIKE = """zeros_like ones_like empty_like full_like rand_like randn_like randint_like zero_ fill_ normal_ uniform_
random_ exponential_ geometric_ log_normal_ cauchy_""".split()
_NEW = "new_zeros new_ones new_empty new_full new_tensor".split()

register(_PASS, kind="pass")
register(_VALUE, kind="value")
register(_LIKE, kind="like")
register(_NEW, kind="new")
register("setitem", kind="setitem")


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


def _self_only(call: Call) -> list:
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


def _out_shape(call: Call, operands) -> tuple:
    out = call.out
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    return tuple(torch.broadcast_shapes(*(t.shape for t in operands)))


def _elementwise(call, operands):
    shape = _out_shape(call, operands)
    return [_broadcast_map(t, shape) for t in operands]


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
    return [_broadcast_map(call.args[0], call.out.shape)]


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
    return _align(operands, [(x, m)])


@rule("select", linear="product")
def _select(call, operands):
    x = call.args[0]
    dim = _nd(call.arg(1, "dim"), x.dim())
    return _align(operands, [(x, [LOCAL if d == dim else d - (d > dim) for d in range(x.dim())])])


@rule("index_select", linear="product")
def _index_select(call, operands):
    x, index = call.args[0], call.arg(2, "index")
    dim = _nd(call.arg(1, "dim"), x.dim())
    m = list(range(x.dim()))
    m[dim] = LOCAL
    return _align(operands, [(x, m), (index, [dim] if index.dim() else [])])


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
    return _align(operands, pairs)


@rule("stack", linear="sum")
def _stack(call, operands):
    tensors = call.args[0]
    dim = _nd(call.arg(1, "dim", 0), tensors[0].dim() + 1)
    return _align(operands, [(t, [d + (d >= dim) for d in range(t.dim())]) for t in tensors])


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
    return _align(operands, [(x, m)] + pairs)


@rule("matmul mm bmm mv dot vdot rmatmul", linear="product")
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


@rule("linear", linear="product")
def _linear(call, operands):
    x, w, bias = call.args[0], call.arg(1, "weight"), call.arg(2, "bias")
    n = x.dim()
    pairs = [(x, list(range(n - 1)) + [SUM]), (w, [n - 1, SUM] if w.dim() == 2 else [SUM])]
    if isinstance(bias, torch.Tensor):
        pairs.append((bias, [n - 1] if bias.dim() == 1 else [LOCAL] * bias.dim()))
    return _align(operands, pairs)


@rule("addmm baddbmm addmv addbmm")
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


@rule("outer ger", linear="product")
def _outer(call, operands):
    return _align(operands, [(call.args[0], [0]), (call.args[1], [1])])


@rule("einsum", linear="product")
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


@rule("embedding", linear="product")
def _embedding(call, operands):
    a, b = call.args[0], call.args[1]
    ids, weight = (a, b) if not a.is_floating_point() else (b, a)
    n = ids.dim()
    rows = [LOCAL, n] if weight.dim() == 2 else [LOCAL] * weight.dim()  # looked-up rows are local parts
    return _align(operands, [(ids, list(range(n))), (weight, rows)])


@rule("layer_norm rms_norm")
def _norm(call, operands):  # layer_norm / rms_norm: the normalized trailing dims must be whole
    x, shape = call.args[0], call.arg(1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    pairs = [(x, list(range(x.dim() - k)) + [WHOLE] * k)]
    pairs += [(t, [WHOLE] * t.dim()) for t in operands if t is not x]
    return _align(operands, pairs)


def _reduction_arg(call: Call, pos: int) -> str:
    red = call.arg(pos, "reduction", "mean")
    if call.kwargs.get("size_average") is not None or call.kwargs.get("reduce") is not None:
        return "mean"  # legacy arguments: be conservative
    return red


def _reduce_keys(m: list, red: str) -> list:
    if red == "none":
        return m
    return [k if k < 0 else (SUM - k if red == "sum" else WHOLE) for k in m]


@rule("cross_entropy nll_loss")
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


@rule("mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div "
      "soft_margin_loss")
def _pointwise_loss(call, operands):  # mse_loss, l1_loss, binary_cross_entropy(_with_logits), ...
    red = call.kwargs.get("reduction", "mean")
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in operands)))
    return [_reduce_keys(_broadcast_map(t, shape), red) for t in operands]


@rule("scaled_dot_product_attention")
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


_COLLECTIVES = {collectives.psum: "psum", collectives.psum_scatter: "psum_scatter",
                collectives.all_gather: "all_gather", collectives.all_to_all: "all_to_all",
                collectives.axis_index: "axis_index"}
_REFLECTED = {"radd": "add", "rmul": "mul", "rsub": "rsub", "rtruediv": "rdiv", "rdiv": "rdiv", "rpow": "rpow",
              "rmatmul": "rmatmul", "rand": "and", "ror": "or", "rxor": "xor", "rfloordiv": "floor_divide",
              "rmod": "mod", "rlshift": "lshift", "rrshift": "rshift", "truediv": "true_divide",
              "floordiv": "floor_divide", "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "true_divide",
              "idiv": "div", "ipow": "pow", "imatmul": "matmul", "float": "float_", "bool": "bool_", "int": "int_",
              "pos": "positive"}


def rule_for(func) -> Rule:
    """The rule of a torch function (or hpf collective); "fallback" when none is registered."""
    if func in _COLLECTIVES:
        return Rule(_COLLECTIVES[func], "collective")
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property (x.shape, x.T, ...)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    dunder = name.startswith("__") and name.endswith("__")
    base = name[2:-2] if dunder else name
    if dunder:
        base = _REFLECTED.get(base, base)
    if base in RULES:
        return RULES[base]._replace(name=name if not dunder else base)
    if base.endswith("_") and base[:-1] in RULES and RULES[base[:-1]].kind == "map":  # in-place x.add_(y)
        return RULES[base[:-1]]._replace(name=base)
    return Rule(base, "fallback")
