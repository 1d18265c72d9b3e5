"""An elastic job's reshard in memory: each element of the new plan's state from the one member that holds it."""
from __future__ import annotations

from typing import Any

import optree
import torch

from .. import checkpoint
from ..comm import schedule, world
from ..comm.transport import PointToPoint
from ..errors import UnrecoverableLossError
from .copies import aligned, padded_bytes


def meta_of(init: Any, key) -> Any:
    """The params tree as meta tensors (tied leaves stay one): a rebuilt step is initialized from it,
    and its state filled by the reshard."""
    if key is not None:
        from ..sharded_init import trace_init

        return trace_init(init, key).meta_params
    return optree.tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, init)


def _boxes(layout, state) -> dict[str, dict[tuple, torch.Tensor]]:
    """key -> {global offsets: view} of ``state`` under ``layout`` (a scalar is one box at ``()``)."""
    out = {}
    for k, v in checkpoint.state_dict(layout, state).items():
        if isinstance(v, torch.Tensor):
            out[k] = {(): v}
        elif hasattr(v, "views"):
            out[k] = {o: t for o, t in v.views.items() if t.numel()}
    return out


def _overlap(a: tuple, a_shape, b: tuple, b_shape):
    """(lo, hi) of two boxes' overlap, or None."""
    lo = tuple(max(x, y) for x, y in zip(a, b))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a, a_shape, b, b_shape))
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


def _part(view: torch.Tensor, offset: tuple, lo: tuple, hi: tuple) -> torch.Tensor:
    return view[tuple(slice(l - o, h - o) for o, l, h in zip(offset, lo, hi))]


class InMemory:
    """A restore's source (``step.restore(source)``): the state the members hold, resharded onto the step's plan."""

    def __init__(self, held: dict):
        self.held, self.received = held, 0

    def fill(self, layout, state):
        self.received = _reshard(self.held, layout, state)
        return state


def _reshard(held: dict, layout, state) -> int:
    """Fill ``state`` (this rank's, under ``layout``: the new plan) from the boxes every member holds
    (``held``: old rank -> (layout, state)); each element comes from one holder. Returns the bytes received."""
    me = world.rank()
    offers: dict[str, dict[tuple, torch.Tensor]] = {}
    for _, (old, st) in sorted(held.items()):
        for k, boxes in _boxes(old, st).items():
            for o, v in boxes.items():
                offers.setdefault(k, {}).setdefault(o, v)
    wants = _boxes(layout, state)
    said = world.all_gather_object(({k: [[list(o), list(v.shape)] for o, v in b.items()] for k, b in offers.items()},
                                    {k: [[list(o), list(v.shape)] for o, v in b.items()] for k, b in wants.items()}))
    moves = _moves(said)
    sends, recvs, local = {}, {}, []
    for (src, dst), items in moves.items():
        if src == me:
            parts = [_part(offers[k][so], so, lo, hi) for k, so, _, lo, hi in items]
            if dst == me:
                local = [(p, _part(wants[k][do], do, lo, hi)) for p, (k, _, do, lo, hi) in zip(parts, items)]
            else:
                sends[dst] = torch.cat([padded_bytes(p) for p in parts]) if parts else None
        elif dst == me:
            into = [_part(wants[k][do], do, lo, hi) for k, _, do, lo, hi in items]
            recvs[src] = (into, torch.empty(sum(aligned(t) for t in into), dtype=torch.uint8))
    schedule.wait(PointToPoint(world.exchange([(d, b, 4) for d, b in sends.items() if b is not None and b.numel()],
                                              [(s, buf, 4) for s, (_, buf) in recvs.items() if buf.numel()])),
                  "the elastic reshard")
    for into, buf in recvs.values():
        at = 0
        for t in into:
            t.copy_(buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            at += aligned(t)
    for src_part, t in local:
        t.copy_(src_part)
    return sum(buf.numel() for _, buf in recvs.values())



def _moves(said: list) -> dict[tuple[int, int], list]:
    """(src, dst) -> [(key, src box offset, dst box offset, lo, hi)], the same on every rank: each wanted
    box is cut from the lowest rank offering each of its elements; a wanted element nobody offers raises."""
    first: dict[str, dict[tuple, tuple]] = {}  # key -> offset -> (src, shape): each offered box once, lowest src
    for src, (offers, _) in enumerate(said):
        for k, boxes in offers.items():
            for o, shape in boxes:
                first.setdefault(k, {}).setdefault(tuple(o), (src, tuple(shape)))
    moves: dict[tuple[int, int], list] = {}
    for dst, (_, wants) in enumerate(said):
        for k, boxes in wants.items():
            for o, shape in boxes:
                o, shape, got = tuple(o), tuple(shape), 0
                for so, (src, s_shape) in first.get(k, {}).items():
                    cut = _overlap(o, shape, so, s_shape)
                    if cut is not None:
                        moves.setdefault((src, dst), []).append((k, so, o, *cut))
                        got += int(torch.Size([h - l for l, h in zip(*cut)]).numel())
                if got != int(torch.Size(shape).numel()):
                    raise UnrecoverableLossError(f"hpf.elastic: {got} of the {torch.Size(shape).numel()} elements of "
                                                 f"{k!r} at {list(o)} are held by a member (a rank was lost with every rank holding a "
                                                 "copy of its shards); resume from the last checkpoint")
    return moves
