"""How a layout goes through one op (hpf.validate.tracker applies it to every op of
``loss_fn``): the rules' exact propagation, the conservative fallback, hpf's collectives, and
the errors, each naming the op, the tensor and a fix, when a layout cannot go through."""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import collectives
from .errors import PartialSumError, PrecisionError, ShardedContractionError, ShardingMismatchError
from .layout import LOCAL, PARTIAL, SUM, VARYING, WHOLE, Info, describe_entry, describe_src, lineage, make_info
from .op_rule import Call, Rule, operands_of
from .shape_rules import CASTS

__all__ = ["Propagator", "check_precision", "partial_msg"]


class Propagator:
    """Layouts through ops over a mesh's ``axes``; ``info`` gives a tensor's layout (the
    tracker's side table), ``replicated`` the layout of a tensor made from nothing."""

    def __init__(self, axes: tuple, info: Callable[[torch.Tensor], Info], replicated: Info):
        self.axes, self.info, self._replicated = axes, info, replicated

    def layout(self, rule: Rule, call: Call) -> tuple[Info, list]:
        operands = rule.select(call) if rule.select else operands_of(call)
        infos = [self.info(t) for t in operands]
        src = ("op", call.op, next((lineage(i.src) for i in infos if i.src[0] == "parameter"), None)
               or next((lineage(i.src) for i in infos if lineage(i.src)), None))
        if rule.kind in ("like", "new"):
            return self._like(rule, infos, src), operands
        if rule.kind == "fallback":
            return self._fallback(call, operands, infos, src), operands
        if all(i.simple for i in infos):
            if len(infos) == 1:
                return make_info(infos[0].layout, infos[0].why, src), operands
            layout, why = [], []
            for a in range(len(self.axes)):
                v = next((i for i in infos if i.layout[a] == VARYING), None)
                layout.append(VARYING if v else None)
                why.append(v.why[a] if v else None)
            return make_info(tuple(layout), tuple(why), src), operands
        maps = rule.maps(call, operands)
        layout, why = [], []
        for a, axis in enumerate(self.axes):
            e, w = self._combine(rule, call, a, axis, operands, infos, maps)
            layout.append(e)
            why.append(w)
        return make_info(tuple(layout), tuple(why), src), operands

    def _like(self, rule: Rule, infos: list, src: tuple) -> Info:
        """zeros_like & co. keep the local shape (so sharded entries) but hold no data."""
        if rule.kind == "new" or not infos:
            return make_info(self._replicated.layout, self._replicated.why, src)
        base = infos[0]
        layout = tuple(e if isinstance(e, tuple) else None for e in base.layout)
        return make_info(layout, tuple(w if isinstance(e, tuple) else None for e, w in zip(base.layout, base.why)), src)

    def _fallback(self, call: Call, operands: list, infos: list, src: tuple) -> Info:
        layout, why = [], []
        for a, axis in enumerate(self.axes):
            for t, i in zip(operands, infos):
                if i.layout[a] == PARTIAL:
                    raise PartialSumError(partial_msg(call, axis, i, a, f" ({call.op} has no layout rule, "
                                                            "and only ops with a rule may carry partial sums)"))
            bad = next((i for i in infos if i.layout[a] is not None), None)
            layout.append(None if bad is None else VARYING)
            why.append(None if bad is None else (
                bad.why[a] if bad.layout[a] == VARYING else
                f"{call.op} has no layout rule, so its output on a tensor {describe_entry(bad.layout[a])} over "
                f"{axis!r} is taken as varying"))
        return make_info(tuple(layout), tuple(why), src)

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
                raise ShardedContractionError(whole_msg(call, axis, infos[j], d, a))
            if key == LOCAL:
                local_why = local_why or (f"{call.op} took a local part of dim {d} of "
                                          f"{describe_src(infos[j].src)}, which is sharded over {axis!r}")
                continue
            if key in keys and keys[key][0] != k:
                raise ShardingMismatchError(mismatch_msg(call, axis, a, infos, maps, keys[key][1], j, key))
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
                        mismatch_msg(call, axis, a, infos, maps, j, j2, key))
        if len(keys) > 1:
            (_, j1, _), (_, j2, _) = list(keys.values())[:2]
            raise ShardingMismatchError(
                f"{call.op}: {describe_src(infos[j1].src)} and {describe_src(infos[j2].src)} are both sharded "
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
            return PARTIAL, (f"{call.op} contracted dim {d} of {describe_src(infos[j].src)}, which is sharded "
                             f"over {axis!r}")
        return None, None

    def _check_linear(self, rule, call, a, axis, operands, infos, entries, partial) -> None:
        p = partial[0]
        if rule.linear is None:
            raise PartialSumError(partial_msg(call, axis, infos[p], a, ""))
        if rule.linear == "sum":
            complete = next((j for j, e in enumerate(entries) if e != PARTIAL), None)
            scalar = next((x for x in call.args[:2] if isinstance(x, (int, float)) and not isinstance(x, bool)
                           and x != 0), None)
            if complete is not None or scalar is not None:
                other = (describe_src(infos[complete].src) if complete is not None else f"the number {scalar}")
                raise PartialSumError(partial_msg(call, axis, infos[p], a,
                    f"; {call.op} adds it to {other}, which is complete, so that term would count once per rank"))
            return
        if len(partial) > 1:
            raise PartialSumError(partial_msg(call, axis, infos[partial[1]], a,
                f"; {call.op} multiplies two partial sums, which a psum of the product does not undo"))
        if rule.linear == "quotient" and p != 0:
            raise PartialSumError(partial_msg(call, axis, infos[p], a, " (it is a divisor)"))
        other = next((j for j, e in enumerate(entries) if e is not None and j != p), None)
        if other is not None:
            raise PartialSumError(partial_msg(call, axis, infos[p], a,
                f"; {call.op} combines it with {describe_src(infos[other].src)}, which is "
                f"{describe_entry(entries[other])} over {axis!r}, so the per-rank results no longer sum to the "
                f"answer"))

    def collective_entry(self, call, x, e, a, axis):
        """The layout entry over ``axis`` of hpf.{all_gather, all_to_all, psum}'s output, from its input's ``e``."""
        if call.op == "psum":
            return None, None
        if call.op == "psum_scatter":  # summed, then split along dim: this rank's block
            dim = collectives.normalize_dim(x, call.kwargs.get("dim", call.args[2] if len(call.args) > 2 else 0),
                                            "psum_scatter", "dim")
            return (dim, 0), f"hpf.psum_scatter over {axis!r} along dim {dim}"
        if call.op == "all_gather":
            dim = collectives.normalize_dim(x, call.kwargs.get("dim", call.args[2] if len(call.args) > 2 else 0),
                                            "all_gather", "dim")
            if e == VARYING or (isinstance(e, tuple) and e[0] == dim):
                return None, None
            return VARYING, f"hpf.all_gather over {axis!r} along dim {dim}, but the tensor is sharded on dim {e[0]}"
        split = collectives.normalize_dim(x, call.args[2], "all_to_all", "split_dim")
        concat = collectives.normalize_dim(x, call.args[3], "all_to_all", "concat_dim")
        if isinstance(e, tuple) and e[0] == concat:
            return (split, 0), f"hpf.all_to_all moved the split over {axis!r} from dim {concat} to dim {split}"
        return VARYING, f"hpf.all_to_all over {axis!r}"


def check_precision(c: torch.dtype, info: Callable[[torch.Tensor], Info], rule: Rule, call: Call, operands: list,
                    outs: list) -> None:
    """An op that silently computes in a wider dtype than mixed precision's compute dtype ``c``."""
    if rule.name in CASTS or call.kwargs.get("dtype") is not None:
        return
    for t in outs:
        if not t.is_floating_point() or t.dtype == c:
            continue
        low = next((x for x in operands if x.dtype == c), None)
        high = next((x for x in operands if x.is_floating_point() and x.dtype != c and x.dim() > 0), None)
        if low is None or high is None:
            continue
        raise PrecisionError(
            f"{call.op}: mixed precision computes in {c}, but {describe_src(info(high).src)} is "
            f"{high.dtype}, so {call.op} on it and {describe_src(info(low).src)} ({c}) silently computes "
            f"in {t.dtype}. Cast it with .to({c}), or cast explicitly (e.g. x.float()) where {t.dtype} is "
            f"intended")


def partial_msg(call, axis, info, a, reason) -> str:
    """A partial sum used as a complete value: the psum that is missing."""
    return (f"{call.op}: {describe_src(info.src)} is a pending partial sum over the non-FSDP axis {axis!r} "
            f"({info.why[a]}), used as a complete value{reason}. A psum is missing: apply "
            f"hpf.psum(x, {axis!r}) to it before {call.op}")

def whole_msg(call, axis, info, d, a) -> str:
    """An op that needs the whole of a dim sharded over a non-FSDP axis."""
    hint = (f"reduce with .sum() then hpf.psum(..., {axis!r}), dividing by the global size for a mean"
            if call.op in ("mean", "nanmean") else
            f"hpf.all_gather(x, {axis!r}, dim={d}) first, or shard a different dim (e.g. the heads)")
    return (f"{call.op} needs the whole of dim {d} of {describe_src(info.src)}, but that dim is sharded over "
            f"the non-FSDP axis {axis!r} ({info.why[a]}); each rank holds only a block and no later reduction "
            f"can complete {call.op}. Fix: {hint}")

def mismatch_msg(call, axis, a, infos, maps, j, j2, key) -> str:
    """Two operands whose local blocks do not line up over ``axis``."""
    e, e2 = infos[j].layout[a], infos[j2].layout[a]
    d = e[0]
    d2 = next((i for i, k in enumerate(maps[j2]) if k == key), "?")
    what = "contracts" if key <= SUM else "aligns"
    fix = (f"shard dim {d2} of {describe_src(infos[j2].src)} over {axis!r} too (then hpf.psum the partial "
           f"result), or hpf.all_gather {describe_src(infos[j].src)} first" if key <= SUM else
           f"shard both alike over {axis!r}, or hpf.all_gather the sharded one first")
    return (f"{call.op} {what} dim {d} of {describe_src(infos[j].src)}, sharded over the non-FSDP axis "
            f"{axis!r} ({infos[j].why[a]}), with dim {d2} of {describe_src(infos[j2].src)}, which is "
            f"{describe_entry(e2)}{' there' if isinstance(e2, tuple) else ''} over {axis!r}: the local "
            f"blocks do not line up. Fix: {fix}")
