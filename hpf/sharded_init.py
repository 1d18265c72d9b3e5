"""Params born sharded: ``step.init(init_fn, key=...)`` materializes only this rank's shards.

``init_fn(key)`` returns the params tree, written with ``hpf.random`` draws, elementwise
arithmetic on them and constants. It runs once on fake tensors (``make_fx`` of its
functionalized form): that gives every leaf's shape for the plan, and the graph of ops that
makes it. Then each rank evaluates each leaf at the flat positions of its own shards alone:

- a draw is a pure function of (key, position) (hpf.random), so it is drawn there directly;
- constants (zeros, ones, full) are made at those positions;
- elementwise ops, casts and views (reshape, transpose, slicing, broadcasting) commute with
  taking positions: their inputs are evaluated at the positions the op reads;
- any other op (a QR-orthogonal init, a matmul) cannot be sliced: its input is materialized
  whole, that one param's worth, and the op runs once on it.

Each value is computed by the same ops as the eager ``init_fn(key)``, element by element, so
the gathered params equal it bit for bit, at any mesh. Work goes in chunks of
``CHUNK`` positions, so the transient memory beside the shards stays small.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from . import random as hpf_random
from . import tree as tree_util

__all__ = ["InitTrace", "trace_init", "CHUNK", "temporary_bytes"]

CHUNK = 1 << 18  # positions evaluated at once
#: a bound on the temporaries beside the shards, per position of a chunk: the draw's int32 words
#: and float32 intermediates, the positions and the cast (benchmarks/init.py measures the peak)
BYTES_PER_POSITION = 64
SMALL = 1 << 12  # a node with at most this many elements is computed whole once (keys, biases)

aten = torch.ops.aten
_CONSTANTS = {aten.zeros.default: 0.0, aten.ones.default: 1.0, aten.zeros_like.default: 0.0,
              aten.ones_like.default: 1.0, aten.new_zeros.default: 0.0, aten.new_ones.default: 1.0}
_FILLS = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.fill.Scalar: 1}
_SAME_ORDER = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.default,
               aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.flatten.using_ints,
               aten.alias.default, aten.clone.default, aten.detach.default, aten.lift_fresh_copy.default,
               aten.view_as.default, aten.contiguous.default}
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                  aten.new_empty.default, aten.new_empty_strided.default}


def trace_init(init_fn: Callable, key: torch.Tensor) -> "InitTrace":
    """Trace ``init_fn(key)`` on fake tensors: no values are computed."""
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
        graph = make_fx(torch.func.functionalize(leaves_of), tracing_mode="fake")(key)
    except Exception as err:
        raise RuntimeError(f"step.init could not trace init_fn(key) on fake tensors ({type(err).__name__}: {err}). "
                           "init_fn must be a function of the key alone, made of hpf.random draws, tensor ops "
                           "and constants, with no data-dependent Python control flow") from err
    return InitTrace(graph, box["paths"], box["treedef"], key)


class InitTrace:
    """The traced ``init_fn``: the params' shapes (``meta_params``) and each rank's shards."""

    def __init__(self, graph: torch.fx.GraphModule, paths: list[str], treedef, key: torch.Tensor):
        self.graph, self.paths, self.treedef, self.key = graph, paths, treedef, key
        (out,) = [n for n in graph.graph.nodes if n.op == "output"]
        self.outputs: list[torch.fx.Node] = list(out.args[0])
        metas: dict[torch.fx.Node, torch.Tensor] = {}  # one meta tensor per node: a tensor at two paths is tied
        for node in self.outputs:
            if node not in metas:
                val = node.meta["val"]
                metas[node] = torch.empty(val.shape, dtype=val.dtype, device="meta")
        self.meta_params = tree_util.unflatten(treedef, [metas[n] for n in self.outputs])
        for path, node in zip(paths, self.outputs):
            _check_seeded(node, path)

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
            shard = torch.zeros(stop - start, dtype=dtype or bucket.dtype)
            for slot in bucket.slots:
                piece = slot.piece(start, stop)
                offsets = plan.block_offsets(slot.path, rank)
                for lo in range(piece.param.start, piece.param.stop, CHUNK):
                    hi = min(lo + CHUNK, piece.param.stop)
                    at = _global_positions(lo, hi, slot.local_shape, slot.global_shape, offsets)
                    held = piece.held.start + lo - piece.param.start
                    shard[held:held + hi - lo] = ev.at(node_of[slot.path], at).to(shard.dtype)
                ev.forget_large()
            out.append(shard)
        return out


def temporary_bytes(plan) -> int:
    """The born-sharded init's temporaries beside a rank's shards: one chunk's (a param that
    cannot be sliced, materialized whole, adds itself; the built-in models have none)."""
    return BYTES_PER_POSITION * min(CHUNK, max((b.shard_numel for b in plan.buckets), default=0))


def _check_seeded(node: torch.fx.Node, path: str) -> None:
    """Refuse torch's global RNG (each rank's draws would differ) and uninitialized memory."""
    source = node
    while source.op == "call_function" and source.target in _SAME_ORDER:
        source = source.args[0]
    if source.op == "call_function" and source.target in _UNINITIALIZED:
        raise ValueError(f"init_fn returns uninitialized memory (torch.empty) as params leaf {path!r}; fill it "
                         "(torch.zeros, or an hpf.random draw)")
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            raise ValueError(f"init_fn draws params leaf {path!r} with torch's global RNG ({n.target}); its values "
                             "would differ across ranks and from a one-process run. Draw it with hpf.random "
                             "(hpf.random.normal(key, shape), split keys with hpf.random.split)")
        todo.extend(n.all_input_nodes)


def _global_positions(lo: int, hi: int, local_shape, global_shape, offsets) -> range | torch.Tensor:
    """Flat positions in the whole param of the local block's flat elements [lo, hi)."""
    if tuple(local_shape) == tuple(global_shape):
        return range(lo, hi)
    coords = _unravel(torch.arange(lo, hi), local_shape)
    return _ravel([c + o for c, o in zip(coords, offsets)], global_shape)


def _unravel(flat: torch.Tensor, shape) -> list[torch.Tensor]:
    coords = []
    for n in reversed(shape):
        coords.append(flat % n if n else flat)
        flat = flat // n if n else flat
    return coords[::-1]


def _ravel(coords, shape) -> torch.Tensor:
    flat = torch.zeros_like(coords[0]) if coords else torch.zeros((), dtype=torch.int64)
    for c, n in zip(coords, shape):
        flat = flat * n + c
    return flat


def _positions(at) -> torch.Tensor:
    return torch.arange(at.start, at.stop) if isinstance(at, range) else at


class _Evaluator:
    """Values of graph nodes: whole (``full``, memoized) or at flat positions (``at``)."""

    def __init__(self, graph: torch.fx.GraphModule, key: torch.Tensor):
        self.graph, self.key = graph, key
        self.whole: dict[torch.fx.Node, Any] = {}

    def forget_large(self) -> None:
        """Drop whole values bigger than SMALL (a non-sliceable param's), once its leaf is done."""
        self.whole = {n: v for n, v in self.whole.items() if not isinstance(v, torch.Tensor) or v.numel() <= SMALL}

    def full(self, node) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        if node not in self.whole:
            self.whole[node] = self._compute_full(node)
        return self.whole[node]

    def _compute_full(self, node: torch.fx.Node) -> Any:
        if node.op == "placeholder":
            return self.key
        if node.op == "get_attr":
            return getattr(self.graph, node.target)
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), self.full)
        return node.target(*args, **kwargs)

    def at(self, node: torch.fx.Node, at) -> torch.Tensor:
        """``node``'s whole value, flattened, at the positions ``at`` (a range or an int64 tensor)."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() <= SMALL or node.op != "call_function":
            return self.full(node).reshape(-1)[_index(at)]
        target = node.target
        if target == torch.ops.hpf.draw.default:
            key, shape, dist, a, b, dtype = node.args
            start, stop = (at.start, at.stop) if isinstance(at, range) else (at, None)
            return hpf_random.values_at(self.full(key), shape, dist, a, b, dtype, start, stop)
        n = len(at)
        if target in _CONSTANTS:
            return torch.full((n,), _CONSTANTS[target], dtype=val.dtype)
        if target in _FILLS:
            return torch.full((n,), float(node.args[_FILLS[target]]), dtype=val.dtype)
        if target in _SAME_ORDER:
            return self.at(node.args[0], at)
        if target == aten._to_copy.default:
            return self.at(node.args[0], at).to(val.dtype)
        if target in (aten.expand.default, aten.copy.default):
            src = node.args[0] if target == aten.expand.default else node.args[1]
            return self.at(src, _broadcast_positions(at, val.shape, src.meta["val"].shape)).to(val.dtype)
        remap = _view_positions(node, at, val.shape)
        if remap is not None:
            return self.at(node.args[0], remap)
        if torch.Tag.pointwise in getattr(target, "tags", ()):
            return self._pointwise(node, at, val)
        return self.full(node).reshape(-1)[_index(at)]

    def _pointwise(self, node: torch.fx.Node, at, val: torch.Tensor) -> torch.Tensor:
        def arg(a):
            if not isinstance(a, torch.fx.Node):
                return a
            v = a.meta["val"]
            if v.dim() == 0:  # keeps its 0-dim type promotion, as in the eager op
                return self.full(a)
            return self.at(a, _broadcast_positions(at, val.shape, v.shape))
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), arg)
        out = node.target(*args, **kwargs)
        if out.dtype != val.dtype or out.shape != (len(at),):  # (an op whose result does not commute)
            return self.full(node).reshape(-1)[_index(at)]
        return out


def _index(at):
    return slice(at.start, at.stop) if isinstance(at, range) else at


def _broadcast_positions(at, out_shape, in_shape):
    """Positions in an input of ``in_shape`` broadcast to ``out_shape`` that ``at`` reads."""
    if tuple(in_shape) == tuple(out_shape):
        return at
    coords = _unravel(_positions(at), out_shape)
    lead = len(out_shape) - len(in_shape)
    return _ravel([c if n != 1 else torch.zeros_like(c) for c, n in zip(coords[lead:], in_shape)], in_shape)


def _view_positions(node: torch.fx.Node, at, out_shape):
    """Positions in a transposed, permuted, sliced or selected op's input, or None for other ops."""
    target, args = node.target, node.args
    if target not in (aten.t.default, aten.transpose.int, aten.permute.default, aten.slice.Tensor, aten.select.int):
        return None
    src_shape = tuple(args[0].meta["val"].shape)
    if target == aten.t.default:
        target, args = aten.transpose.int, (args[0], 0, 1) if len(src_shape) == 2 else (args[0], 0, 0)
    if target == aten.transpose.int:
        perm = list(range(len(src_shape)))
        d0, d1 = (d % len(src_shape) for d in args[1:3])
        perm[d0], perm[d1] = perm[d1], perm[d0]
        target, args = aten.permute.default, (args[0], perm)
    coords = None
    if target == aten.permute.default:
        perm = [d % len(src_shape) for d in args[1]]
        out = _unravel(_positions(at), out_shape)
        coords = [None] * len(src_shape)
        for i, d in enumerate(perm):
            coords[d] = out[i]
    elif target == aten.slice.Tensor:
        dim = (args[1] if len(args) > 1 else 0) % len(src_shape)
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        start = start + src_shape[dim] if start < 0 else min(start, src_shape[dim])
        step = args[4] if len(args) > 4 else 1
        coords = _unravel(_positions(at), out_shape)
        coords[dim] = coords[dim] * step + start
    elif target == aten.select.int:
        dim = args[1] % len(src_shape)
        coords = _unravel(_positions(at), out_shape)
        coords.insert(dim, torch.full_like(coords[0] if coords else torch.zeros(len(at), dtype=torch.int64),
                                           args[2] % src_shape[dim]))
    if coords is None:
        return None
    return _ravel(coords, src_shape)


def same_bits(a: Any, b: Any) -> bool:
    """Whether two params trees are equal bit for bit (for checks and tests)."""
    pa, la, _ = tree_util.flatten(a)
    pb, lb, _ = tree_util.flatten(b)

    def raw(x):
        return x.reshape(-1).contiguous().view(torch.uint8)
    return pa == pb and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y))
                            for x, y in zip(la, lb))
