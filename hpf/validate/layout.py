"""Layouts: what validation mode knows about each tensor, and how it says so in errors.

A layout says, per mesh axis, one of:

* ``None``     replicated: the same values on every rank of the axis;
* ``(d, k)``   sharded on dim ``d``: each rank holds a block (``k`` orders axes that split one dim);
* ``"V"``      varying: different data per rank with no block structure (the batch over
  the FSDP axes, the output of ``hpf.axis_index``, a local slice of a sharded dim);
* ``"P"``      a pending partial sum: the true value is the sum over the axis (a contraction
  over a sharded dim); only linear ops may touch it until ``hpf.psum``.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["VARYING", "PARTIAL", "WHOLE", "LOCAL", "SUM", "Info", "make_info", "describe", "describe_src",
           "describe_entry", "lineage"]

VARYING, PARTIAL = "V", "P"
WHOLE, LOCAL, SUM = -1, -2, -10  # map targets: op needs the whole dim / takes a local part / contracted
# (contracted dims get keys SUM - i, so two operands contract "the same" dim when their keys match)


class Info(NamedTuple):
    """One tensor's layout and where it came from (the side table's value)."""

    layout: tuple  # one entry per mesh axis (see module doc)
    why: tuple  # per axis: how a non-replicated entry arose (for messages), else None
    src: tuple  # ("parameter", path) | ("batch", path) | ("op", name, param path or None) | ("const",)
    simple: bool  # no sharded or partial entry: ops need no rule to propagate it


def make_info(layout: tuple, why: tuple, src: tuple) -> Info:
    """An :class:`Info`, with ``simple`` computed from the layout."""
    return Info(layout, why, src, all(e is None or e == VARYING for e in layout))


def describe_src(src: tuple) -> str:
    """Where a tensor came from, in words, for error messages."""
    if src[0] == "parameter":
        return f"parameter {src[1]!r}"
    if src[0] == "batch":
        return f"batch leaf {src[1]!r}" if src[1] else "the batch"
    if src[0] == "op":
        return f"the output of {src[1]}" + (f" (computed from parameter {src[2]!r})" if src[2] else "")
    return "a tensor made outside loss_fn"


def describe_entry(e) -> str:
    """One layout entry in words."""
    if e is None:
        return "replicated"
    if e == VARYING:
        return "varying (different on each rank)"
    if e == PARTIAL:
        return "a pending partial sum"
    return f"sharded on dim {e[0]}"


def describe(info: Info, axes: Sequence[str]) -> str:
    """``info``'s layout in words, e.g. "tp: sharded on dim 1, dp: varying"."""
    return ", ".join(f"{a}: {describe_entry(e)}" for a, e in zip(axes, info.layout))


def lineage(src: tuple) -> str | None:
    """The parameter path a tensor was computed from, if any."""
    return src[1] if src[0] == "parameter" else (src[2] if src[0] == "op" else None)

