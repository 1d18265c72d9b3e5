"""Params born sharded: ``step.init(init_fn, key=...)`` materializes only this rank's shards.

``init_fn(key)`` returns the params tree, written with ``hpf.random`` draws, elementwise
arithmetic on them and constants. Its functionalized form runs once on meta tensors
(``_MetaTrace``, the graph ``make_fx`` records, without the fake tensors whose imports cost a
second a rank; what it cannot follow goes to ``make_fx``): that gives every leaf's shape for the
plan, and the graph of ops that makes it. Then each rank evaluates each leaf at the flat
positions of its own shards alone.
Where an op's semantics are re-derived, they are derived by torch itself, so they cannot drift:

- a draw is a pure function of (key, position) (hpf.random), so it is drawn there directly;
- constants (zeros, ones, full) are made at those positions, the fill value as given (an int
  stays an int);
- views (every op whose schema says it aliases its input: view, reshape, transpose, permute,
  slicing with any start/stop/step, select, expand, diagonal, unfold, split, unbind, ...) are
  applied by torch to a contiguous meta tensor of their base's shape: its strides and storage
  offset map each position to the base's, with torch's own clamping and wrapping;
- cat, stack, flip, roll and repeat map positions by their definition, and copies and casts
  (clone, contiguous, ``_to_copy``) keep them;
- the pointwise ops in ``EXACT`` are correctly rounded (IEEE add, subtract, multiply, divide,
  sqrt; comparisons, where, clamp, rounding, casts) or integer-only, so an element's bits do not
  depend on where it sits in a vector kernel: their inputs are evaluated at the positions read;
- any other op (a transcendental such as sigmoid, silu, exp or ``pow`` by a float, whose vector
  and scalar kernels may differ in the last bit; a QR-orthogonal init, a matmul) is run as in
  eager on its inputs materialized whole, that one param's worth, once.

So the gathered params equal the eager ``init_fn(key)`` bit for bit, at any mesh (on one
machine and thread count: eager's own transcendental bits depend on those). Work goes in chunks
of ``CHUNK`` positions, so the transient memory beside the shards stays small. What cannot be
exact is refused, naming the leaf: torch's global RNG, uninitialized memory (``torch.empty``
reaching a leaf through any op that reads it) and data-dependent ops (``nonzero``, a boolean
mask, ``.item()``). One tensor returned at several paths (itself, ``.detach()``, a same-shape
``.view()``) is one tied param, as ``step.init(full_params)`` ties it.
"""
from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable

import torch
from torch.fx import Node
from torch.utils._python_dispatch import TorchDispatchMode

from . import random as hpf_random
from . import tree as tree_util
from .train_state import zeros

__all__ = ["InitTrace", "trace_init", "CHUNK", "temporary_bytes", "EXACT", "same_bits"]

CHUNK = 1 << 18  # positions evaluated at once
#: a bound on the temporaries beside the shards, per position of a chunk: the draw's int32 words
#: and float32 intermediates, the positions and the cast (benchmarks/init.py measures the peak)
BYTES_PER_POSITION = 64
SMALL = 1 << 12  # a node with at most this many elements is computed whole once (keys, biases)

aten = torch.ops.aten
_CONSTANTS = {aten.zeros.default: 0, aten.ones.default: 1, aten.zeros_like.default: 0, aten.zero.default: 0,
              aten.ones_like.default: 1, aten.new_zeros.default: 0, aten.new_ones.default: 1}
_FILLS = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.fill.Scalar: 1}
# not views, but the same elements in the same (logical, row-major) order, cast to the node's dtype
_COPIES = {aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default, aten._unsafe_view.default,
           aten.reshape.default, aten._to_copy.default, aten.view.default}  # (view: where no view of a root, below)
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                  aten.new_empty.default, aten.new_empty_strided.default}
# ops that take only the shape and dtype of these args, not their values (what they write replaces them)
_WRITE_ONLY = {aten.fill.Scalar: {0}, aten.fill.Tensor: {0}, aten.zero.default: {0}, aten.copy.default: {0},
               **{op: {0} for op in (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                                     aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
                                     aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default)}}
_STORAGE_VIEWS = {aten.as_strided.default}  # a view of the input's memory, not of its logical order
#: pointwise ops whose every element's bits are those of eager's, wherever it sits in a vector
#: kernel (correctly rounded, or exact): evaluated at the positions read. Integer and bool
#: arithmetic is exact in any pointwise op; add and sub with an ``alpha`` other than +-1 are not
#: (the vector kernel fuses the multiply-add), nor ``pow`` but by the exponents in ``EXACT_POW``.
EXACT = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor, aten.rsub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.sqrt.default, aten.reciprocal.default, aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default,
    aten.clamp_max.default, aten.maximum.default, aten.minimum.default, aten.where.self, aten.masked_fill.Scalar,
    aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default, aten.sign.default,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
    *(getattr(getattr(aten, c), overload) for c in ("eq", "ne", "lt", "le", "gt", "ge") for overload in ("Tensor", "Scalar"))})
EXACT_POW = (2, 3, 0.5, -0.5, -1, -2)  # pow.Tensor_Scalar's special cases: products, sqrt and reciprocals


def trace_init(init_fn: Callable, key: torch.Tensor) -> "InitTrace":
    """Trace ``init_fn(key)`` on meta tensors, else on fake ones: no values are computed."""
    if not callable(init_fn):
        raise TypeError(f"step.init(init_fn, key=...) takes a function key -> params, got {type(init_fn).__name__}")
    from torch.fx.experimental.proxy_tensor import make_fx

    key = hpf_random.check_key(key, "key for step.init").cpu()
    box = {}

    def leaves_of(k):
        tree = init_fn(k)
        tree_util.check_leaves(tree)
        box["paths"], leaves, box["treedef"] = tree_util.flatten(tree)
        return leaves
    try:
        graph = _MetaTrace.of(torch.func.functionalize(leaves_of), key)
    except Exception:  # (what it cannot follow: make_fx's trace runs it again, and refuses it by path)
        try:
            graph = make_fx(torch.func.functionalize(leaves_of), tracing_mode="fake")(key)
        except Exception as err:
            raise RuntimeError(f"step.init could not trace init_fn(key) on fake tensors ({type(err).__name__}: "
                               f"{err}). init_fn must be a function of the key alone, made of hpf.random draws, "
                               "tensor ops and constants, with no data-dependent Python control flow") from err
    return InitTrace(graph, box["paths"], box["treedef"], key)


class _MetaTrace(TorchDispatchMode):
    """The graph of aten ops a function of the key runs, as ``make_fx`` records it, on meta
    tensors: each op's meta kernel, and for a pointwise op the shape broadcast and the dtype of
    the op itself on one-element stand-ins. So no fake tensor and no symbolic shape, whose imports
    (dynamo, sympy: about 1 s a process) are most of make_fx's time. What it cannot follow raises:
    data-dependent ops, ``.item()``, a meta tensor made outside it, an in-place op on a tensor
    functionalization does not own. The key's device stands for the meta device in the graph."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # (the default wraps __torch_dispatch__ in torch._disable_dynamo,
        return False                       # whose first call imports dynamo)

    def __init__(self, key: torch.Tensor):
        super().__init__()
        self.graph, self.root, self.device = torch.fx.Graph(), torch.nn.Module(), key.device
        self.nodes: dict[int, tuple[torch.Tensor, Node]] = {}  # id of a traced tensor (kept alive) -> its node
        self.constants = 0
        self.key = key.to("meta")
        self._record(self.key, self.graph.placeholder("key"))

    @classmethod
    def of(cls, fn: Callable, key: torch.Tensor) -> torch.fx.GraphModule:
        tracer = cls(key)
        with tracer:
            leaves = fn(tracer.key)
        tracer.graph.output([tracer._node(x) for x in leaves])
        return torch.fx.GraphModule(tracer.root, tracer.graph)

    def _record(self, value: torch.Tensor, node: Node) -> None:
        self.nodes[id(value)] = value, node
        node.meta["val"] = value

    def _node(self, x):
        """The node of a traced tensor, a new constant's for a tensor from outside (as make_fx's)."""
        if isinstance(x, torch.device):
            return self.device if x.type == "meta" else x
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in self.nodes:
            if x.is_meta:
                raise ValueError("a meta tensor made outside step.init's trace has no values")
            name = f"_tensor_constant{self.constants}"
            setattr(self.root, name, x)
            self.constants += 1
            node = self.graph.get_attr(name)
            self.nodes[id(x)] = x, node
            self._record(x.to("meta"), node)
        return self.nodes[id(x)][1]

    def _meta(self, x):
        if isinstance(x, torch.device):
            return torch.device("meta")
        return self.nodes[id(x)][1].meta["val"] if isinstance(x, torch.Tensor) and not x.is_meta else x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.lift_fresh.default:  # a constant made inside (torch.tensor): make_fx's copy of it
            func = aten.lift_fresh_copy.default
        schema, kwargs = func._schema.arguments, kwargs or {}
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema):
            raise ValueError(f"{func} writes a tensor functionalization does not own")
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        factory = any(a.name == "device" for a in schema) or torch.Tag.nondeterministic_seeded in func.tags
        if not factory and tensors and all(not x.is_meta and x.numel() <= 1 for x in tensors):
            out = func(*args, **kwargs)  # scalars made inside (torch.tensor(x), checks on them): run as is, as
            if not isinstance(out, torch.Tensor) or out.numel() <= 1:  # make_fx's fake tensors keep them
                return out
        node = self.graph.call_function(func, *torch.utils._pytree.tree_map(self._node, (tuple(args), kwargs)))
        args, kwargs = torch.utils._pytree.tree_map(self._meta, (args, kwargs))
        if factory and not tensors and kwargs.get("device") is None:
            kwargs["device"] = torch.device("meta")  # (a factory on the default device)
        out = _pointwise_meta(func, args, kwargs)
        out = func(*args, **kwargs) if out is None else out
        if isinstance(out, torch.Tensor):
            self._record(out, node)
        else:
            node.meta["val"] = out
            for i, x in enumerate(out):
                if isinstance(x, torch.Tensor):
                    self._record(x, self.graph.call_function(operator.getitem, (node, i)))
        return out


def _pointwise_meta(func, args, kwargs) -> torch.Tensor | None:
    """A pointwise op's result on meta tensors: the inputs' shapes broadcast, in the dtype the op
    gives on stand-ins of one or two elements a dim (torch's meta kernels for these are Python refs
    whose first call imports dynamo). None where it is no plain broadcast (the meta kernel decides)."""
    tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if torch.Tag.pointwise not in func.tags or not tensors:
        return None

    def stand_in(x):
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return torch.ones([min(n, 2) for n in x.shape], dtype=x.dtype) if isinstance(x, torch.Tensor) else x
    small_args, small_kwargs = torch.utils._pytree.tree_map(stand_in, (args, kwargs))
    small = func(*small_args, **small_kwargs)
    small_shapes = [x.shape for x in torch.utils._pytree.tree_leaves((small_args, small_kwargs))
                    if isinstance(x, torch.Tensor)]
    if not isinstance(small, torch.Tensor) or small.shape != hpf_random.broadcast_shape(*small_shapes):
        return None
    return torch.empty(hpf_random.broadcast_shape(*(x.shape for x in tensors)), dtype=small.dtype, device="meta")


class InitTrace:
    """The traced ``init_fn``: the params' shapes (``meta_params``) and each rank's shards."""

    def __init__(self, graph: torch.fx.GraphModule, paths: list[str], treedef, key: torch.Tensor):
        self.graph, self.paths, self.treedef, self.key = graph, paths, treedef, key
        (out,) = [n for n in graph.graph.nodes if n.op == "output"]
        self.outputs: list[torch.fx.Node] = list(out.args[0])
        for path, node in zip(paths, self.outputs):
            _check_leaf(node, path)
        # Each leaf is a meta view of one meta tensor per base it views, made by the same view ops:
        # the plan ties the leaves that are one tensor (one node, .detach(), a same-shape .view())
        # and refuses ones that overlap otherwise, as it does for the eager init_fn(key)'s tensors.
        views = _Evaluator(graph, key)
        self.meta_params = tree_util.unflatten(treedef, [views.view_of(n)[1] for n in self.outputs])

    def digest(self) -> str:
        """What makes the values (the graph, its constants and the key): equal on every rank."""
        h = hashlib.sha256(self.graph.code.encode())
        h.update(str(self.key.tolist()).encode())
        for node in self.graph.graph.nodes:
            if node.op == "get_attr":  # a tensor init_fn captured
                value = getattr(self.graph, node.target).detach().cpu().contiguous()
                h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def full_params(self) -> Any:
        """Every leaf whole (for a one-process check; the same bits as ``init_fn(key)``)."""
        ev = _Evaluator(self.graph, self.key)
        return tree_util.unflatten(self.treedef, [ev.full(n) for n in self.outputs])

    def shards(self, plan, rank: int, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """This rank's flat shard of every bucket of ``plan`` (made from ``meta_params``), as
        ``plan.shards(full params, rank, dtype)`` gives from the whole params."""
        ev = _Evaluator(self.graph, self.key)
        node_of = dict(zip(self.paths, self.outputs))
        out = []
        for bucket in plan.buckets:
            start, stop = bucket.shard_range(plan.shard_index(bucket, rank))
            shard = zeros((stop - start,), dtype or bucket.dtype)  # (fresh pages: the values are their first write)
            for slot in bucket.slots:
                piece = slot.piece(start, stop)
                offsets, block = plan.block_offsets(slot.path, rank), plan.block_shape(slot.path, rank)
                for lo in range(piece.param.start, piece.param.stop, CHUNK):
                    hi = min(lo + CHUNK, piece.param.stop)
                    held = piece.held.start + lo - piece.param.start
                    if block != slot.local_shape:  # stored padded (an uneven split): the padding stays zero
                        at, real = _padded_positions(lo, hi, slot.local_shape, block, slot.global_shape, offsets)
                        if real.any():
                            shard[held:held + hi - lo][real] = ev.at(node_of[slot.path], at).to(shard.dtype)
                        continue
                    at = _global_positions(lo, hi, slot.local_shape, slot.global_shape, offsets)
                    shard[held:held + hi - lo] = ev.at(node_of[slot.path], at).to(shard.dtype)
                ev.forget_large()
            out.append(shard)
        self.materialized = ev.materialized
        return out


def temporary_bytes(plan) -> int:
    """The born-sharded init's temporaries beside a rank's shards: one chunk's (a param that
    cannot be sliced, materialized whole, adds itself; the built-in models have none)."""
    return BYTES_PER_POSITION * min(CHUNK, max((b.shard_numel for b in plan.buckets), default=0))


def _check_leaf(node: Node, path: str) -> None:
    """Refuse what would differ across ranks or from eager: torch's global RNG, uninitialized
    memory whose values reach the leaf, and data-dependent ops (their shapes are unknown here)."""
    seen, todo = {}, [node]  # the ops whose values reach the leaf
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen[n] = getattr(n.target, "tags", ())
        skip = _WRITE_ONLY.get(n.target, ())
        for i, a in enumerate(n.args):
            if i not in skip:
                torch.fx.node.map_arg(a, todo.append)
        torch.fx.node.map_arg(n.kwargs, todo.append)
    for n, tags in seen.items():
        if torch.Tag.nondeterministic_seeded in tags:
            raise ValueError(f"init_fn draws params leaf {path!r} with torch's global RNG ({n.target}); its values "
                             "would differ across ranks and from a one-process run. Draw it with hpf.random "
                             "(hpf.random.normal(key, shape), split keys with hpf.random.split)")
        if n.target in _UNINITIALIZED:
            raise ValueError(f"init_fn makes params leaf {path!r} from uninitialized memory ({n.target}, "
                             "torch.empty), through ops that read it; fill it first (torch.zeros, .fill_, .copy_ "
                             "of a whole tensor, or an hpf.random draw)")
    data_dependent = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
    found = ([n for n, tags in seen.items() if data_dependent & set(tags)]  # the op, else what its result reaches
             or [n for n in seen if not _static(n.meta.get("val"))])
    if found:
        op = found[0].target
        raise ValueError(f"init_fn computes params leaf {path!r} with a data-dependent op ({op}: nonzero, a boolean "
                         "mask, .item() ...), whose result is not known when the init is traced. Use shape-static "
                         "ops (torch.where instead of a mask), or build the tree with init_fn(key) and pass it to "
                         "step.init(params)")


def _static(val) -> bool:
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    return not isinstance(val, torch.Tensor) or all(isinstance(d, int) for d in val.shape)


def _global_positions(lo: int, hi: int, local_shape, global_shape, offsets) -> range | torch.Tensor:
    """Flat positions in the whole param of the local block's flat elements [lo, hi)."""
    if tuple(local_shape) == tuple(global_shape):
        return range(lo, hi)
    coords = _unravel(torch.arange(lo, hi), local_shape)
    return _ravel([c + o for c, o in zip(coords, offsets)], global_shape, hi - lo)


def _padded_positions(lo: int, hi: int, local_shape, block, global_shape, offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in the whole param of the real elements among [lo, hi) of a padded local block,
    which of the [lo, hi) are real: inside ``block``)."""
    coords = _unravel(torch.arange(lo, hi), local_shape)
    real = torch.ones(hi - lo, dtype=torch.bool)
    for c, n in zip(coords, block):
        real &= c < n
    return _ravel([(c + o)[real] for c, o in zip(coords, offsets)], global_shape, int(real.sum())), real


def _unravel(flat: torch.Tensor, shape) -> list[torch.Tensor]:
    coords = []
    for n in reversed(shape):
        coords.append(flat % n if n else flat)
        flat = flat // n if n else flat
    return coords[::-1]


def _ravel(coords, shape, n: int) -> torch.Tensor:
    flat = torch.zeros(n, dtype=torch.int64)
    for c, size in zip(coords, shape):
        flat = flat * size + c
    return flat


def _positions(at) -> torch.Tensor:
    return torch.arange(at.start, at.stop) if isinstance(at, range) else at


def _index(at):
    return slice(at.start, at.stop) if isinstance(at, range) else at


def _strided(at, meta: torch.Tensor):
    """Positions in a contiguous base of the elements ``at`` of ``meta``, a view of that base:
    its strides and storage offset, as torch's view ops made them."""
    offset = meta.storage_offset()
    if isinstance(at, range) and meta.is_contiguous():
        return range(at.start + offset, at.stop + offset)
    coords = _unravel(_positions(at), meta.shape)
    flat = torch.full((len(at),), offset, dtype=torch.int64)
    for c, stride in zip(coords, meta.stride()):
        flat += c * stride
    return flat


def _broadcast(at, in_shape, out_shape):
    """Positions in an input of ``in_shape`` broadcast to ``out_shape`` that ``at`` reads."""
    if tuple(in_shape) == tuple(out_shape):
        return at
    return _strided(at, torch.empty(in_shape, device="meta").expand(out_shape))


def _is_view(node: Node) -> bool:
    """Whether ``node`` is a view of its first arg (its schema says its result aliases it), made
    from that arg alone: so torch computes its strides from the arg's shape."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in _STORAGE_VIEWS:
        return False
    returns = target._schema.returns
    alias = returns[0].alias_info if returns else None
    return (alias is not None and not alias.is_write and bool(node.args) and isinstance(node.args[0], Node)
            and node.all_input_nodes == [node.args[0]])


def _exact(node: Node, val: torch.Tensor) -> bool:
    """Whether a pointwise op's elements can be computed apart, with eager's bits (see EXACT)."""
    target = node.target
    if torch.Tag.pointwise not in getattr(target, "tags", ()):
        return False
    dtypes = [val.dtype] + [a.meta["val"].dtype for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if any(d.is_complex for d in dtypes):
        return False
    if not any(d.is_floating_point for d in dtypes):
        return True
    if target == aten.pow.Tensor_Scalar:
        return not isinstance(node.args[1], bool) and node.args[1] in EXACT_POW
    if "alpha" in node.kwargs and node.kwargs["alpha"] not in (1, -1):
        return False
    return target in EXACT


class _Evaluator:
    """Values of graph nodes: whole (``full``, memoized) or at flat positions (``at``)."""

    def __init__(self, graph: torch.fx.GraphModule, key: torch.Tensor):
        self.graph, self.key = graph, key
        self.whole: dict[Node, Any] = {}
        self.flat: dict[Node, torch.Tensor] = {}  # whole values flattened (a copy where not contiguous)
        self.views: dict[Node, tuple[Node, Any]] = {}
        self.materialized: set[Node] = set()  # nodes bigger than SMALL computed whole

    def forget_large(self) -> None:
        """Drop whole values bigger than SMALL (a non-sliceable param's), once its leaf is done."""
        self.whole = {n: v for n, v in self.whole.items() if not isinstance(v, torch.Tensor) or v.numel() <= SMALL}
        self.flat = {n: v for n, v in self.flat.items() if v.numel() <= SMALL}

    def full(self, node) -> Any:
        if not isinstance(node, Node):
            return node
        if node not in self.whole:
            self.whole[node] = self._compute_full(node)
        return self.whole[node]

    def _compute_full(self, node: Node) -> Any:
        if node.op == "placeholder":
            return self.key
        if node.op == "get_attr":
            return getattr(self.graph, node.target)
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), self.full)
        return hpf_random.EAGER.get(node.target, node.target)(*args, **kwargs)

    def view_of(self, node: Node) -> tuple[Node, Any]:
        """(root, meta): ``node`` as a view of ``root``, a node that is no view: ``meta`` is the same
        chain of view ops applied by torch to one contiguous meta tensor of root's shape."""
        if node not in self.views:
            src = node.args[0] if node.op == "call_function" and node.args else None
            view = None
            if _is_view(node):
                root, base = self.view_of(src)
                try:
                    view = root, node.target(base, *node.args[1:], **node.kwargs)
                except RuntimeError:  # a view eager's strides allowed (a reshape of a pointwise op of a transpose):
                    if node.target is not aten.view.default:  # its elements in row-major order, as a root of its own
                        raise
            if view is not None:
                self.views[node] = view
            elif node.target is operator.getitem and isinstance(src, Node) and _is_view(src):
                root, metas = self.view_of(src)  # (split, unbind, chunk: a list of views)
                self.views[node] = root, metas[node.args[1]]
            else:
                val = node.meta.get("val")
                meta = torch.empty(val.shape, dtype=val.dtype, device="meta") if isinstance(val, torch.Tensor) else None
                self.views[node] = node, meta
        return self.views[node]

    def at(self, node: Node, at) -> torch.Tensor:
        """``node``'s whole value, flattened, at the positions ``at`` (a range or an int64 tensor)."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() <= SMALL or node.op != "call_function":
            return self._whole_at(node, at)
        root, meta = self.view_of(node)
        if root is not node:
            if meta.element_size() != root.meta["val"].element_size():  # (a view as a dtype of another size)
                return self._whole_at(node, at)
            out = self.at(root, _strided(at, meta))
            return out.view(meta.dtype) if out.dtype != meta.dtype else out
        target, n = node.target, len(at)
        if target == torch.ops.hpf.draw.default:
            key, shape, dist, a, b, dtype = node.args
            start, stop = (at.start, at.stop) if isinstance(at, range) else (at, None)
            return hpf_random.values_at(self.full(key), shape, dist, a, b, dtype, start, stop)
        if target in _CONSTANTS:
            return torch.full((n,), _CONSTANTS[target], dtype=val.dtype)
        if target in _FILLS:  # the fill value as given: an int of 64 bits stays exact
            return torch.full((n,), node.args[_FILLS[target]], dtype=val.dtype)
        if target in _COPIES:
            return self.at(node.args[0], at).to(val.dtype)
        if target == aten.copy.default:
            src = node.args[1]
            return self.at(src, _broadcast(at, src.meta["val"].shape, val.shape)).to(val.dtype)
        if target in _MOVES:
            return _MOVES[target](self, node, at, val)
        if _exact(node, val):
            return self._pointwise(node, at, val)
        return self._whole_at(node, at)

    def _whole_at(self, node: Node, at) -> torch.Tensor:
        """The node computed whole, as in eager, at ``at``: exact for any op, a param's memory."""
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > SMALL:
            self.materialized.add(node)
        if node not in self.flat:
            self.flat[node] = self.full(node).reshape(-1)
        return self.flat[node][_index(at)]

    def _pointwise(self, node: Node, at, val: torch.Tensor) -> torch.Tensor:
        def arg(a):
            if not isinstance(a, Node):
                return a
            v = a.meta["val"]
            if not isinstance(v, torch.Tensor):
                return self.full(a)
            if v.numel() == 1:  # a 0-d tensor keeps its type promotion, a one-element one stays a broadcast scalar
                whole = self.full(a)
                return whole if whole.dim() == 0 else whole.reshape(1)
            return self.at(a, _broadcast(at, v.shape, val.shape))
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), arg)
        out = node.target(*args, **kwargs)
        if out.dtype != val.dtype or out.shape != (len(at),):  # (an op whose result does not commute)
            return self._whole_at(node, at)
        return out


def _cat(ev: _Evaluator, node: Node, at, val: torch.Tensor) -> torch.Tensor:
    """cat and stack: each position read from the input that holds it (empty inputs hold none)."""
    stack = node.target == aten.stack.default
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % val.dim()
    parts = [t for t in node.args[0] if stack or t.meta["val"].numel()]
    sizes = [1 if stack else t.meta["val"].shape[dim] for t in parts]
    ends = torch.tensor(sizes).cumsum(0)
    coords = _unravel(_positions(at), val.shape)
    which = torch.searchsorted(ends, coords[dim], right=True)
    out = torch.empty(len(at), dtype=val.dtype)
    for i, (part, size) in enumerate(zip(parts, sizes)):
        mask = which == i
        if not bool(mask.any()):
            continue
        c = [x[mask] for x in coords]
        if stack:
            del c[dim]
        else:
            c[dim] = c[dim] - (int(ends[i]) - size)
        out[mask] = ev.at(part, _ravel(c, part.meta["val"].shape, int(mask.sum()))).to(val.dtype)
    return out


def _flip(ev: _Evaluator, node: Node, at, val: torch.Tensor) -> torch.Tensor:
    coords = _unravel(_positions(at), val.shape)
    for d in {d % val.dim() for d in node.args[1]}:
        coords[d] = val.shape[d] - 1 - coords[d]
    return ev.at(node.args[0], _ravel(coords, val.shape, len(at)))


def _roll(ev: _Evaluator, node: Node, at, val: torch.Tensor) -> torch.Tensor:
    shifts = node.args[1]
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    if not dims:  # rolls the flattened tensor
        return ev.at(node.args[0], (_positions(at) - shifts[0]) % val.numel())
    coords = _unravel(_positions(at), val.shape)
    for s, d in zip(shifts, dims):
        d %= val.dim()
        coords[d] = (coords[d] - s) % val.shape[d]
    return ev.at(node.args[0], _ravel(coords, val.shape, len(at)))


def _repeat(ev: _Evaluator, node: Node, at, val: torch.Tensor) -> torch.Tensor:
    in_shape = node.args[0].meta["val"].shape
    coords = _unravel(_positions(at), val.shape)[val.dim() - len(in_shape):]
    return ev.at(node.args[0], _ravel([c % n for c, n in zip(coords, in_shape)], in_shape, len(at)))


_MOVES = {aten.cat.default: _cat, aten.stack.default: _cat, aten.flip.default: _flip, aten.roll.default: _roll,
          aten.repeat.default: _repeat}


def same_bits(a: Any, b: Any) -> bool:
    """Whether two params trees are equal bit for bit (for checks and tests)."""
    pa, la, _ = tree_util.flatten(a)
    pb, lb, _ = tree_util.flatten(b)

    def raw(x):
        return x.reshape(-1).contiguous().view(torch.uint8)
    return pa == pb and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y))
                            for x, y in zip(la, lb))
