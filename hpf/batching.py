"""A step's local batch: which leaves are per-example (``batch_axes``), the micro-batches of
gradient accumulation, the mixed-precision cast, and the shape signature the ranks compare.

``batch_axes`` works as JAX's ``in_axes``: each batch leaf has a batch dim (an int) or None (not
per-example, e.g. MoE's ``expert_bias`` [layers, E]). Per-example leaves are split into
micro-batches along their batch dim and cast to the compute dtype when floating; the others go
whole to every micro-batch, as they are.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from . import tree as tree_util
from .comm.schedule import DIGEST_MASK

__all__ = ["leaf_axes", "micro_batches", "cast", "shape_signature"]


def leaf_axes(batch: Any, batch_axes: Any = None) -> list[int | None]:
    """The batch dim (or None) of every leaf of ``batch``, in flatten order.

    Raises:
        ValueError: ``batch_axes`` is not a prefix of the batch's structure, or names a dim a
            leaf does not have (the message names the leaf's path).
    """
    paths, leaves, _ = tree_util.flatten(batch)
    if batch_axes is None or isinstance(batch_axes, int):
        axes = [batch_axes or 0] * len(leaves)
    elif callable(batch_axes):
        axes = [batch_axes(p) for p in paths]
    else:
        try:
            axes = optree.tree_leaves(optree.tree_broadcast_prefix(batch_axes, batch, none_is_leaf=True),
                                      none_is_leaf=True)
        except ValueError as e:
            raise ValueError(f"batch_axes={batch_axes!r} is not a prefix of the batch's structure "
                             f"{tree_util.structure(batch)}: give an int or None per leaf or subtree ({e})") from None
    out = []
    for p, x, a in zip(paths, leaves, axes):
        if not isinstance(x, torch.Tensor) or a is None:
            out.append(None)
            continue
        if isinstance(a, bool) or not isinstance(a, int) or not -x.dim() <= a < max(x.dim(), 1) or x.dim() == 0:
            raise ValueError(f"batch_axes gives batch leaf {p or '<root>'!r} (shape {tuple(x.shape)}) the batch dim "
                             f"{a!r}, which it does not have: give one of its dims, or None for a leaf that is not "
                             "per-example")
        out.append(a % x.dim())
    return out


def micro_batches(batch: Any, k: int, axes: list[int | None]) -> list[Any]:
    """``k`` micro-batches: every per-example leaf split into ``k`` equal parts along its batch dim.

    Raises:
        ValueError: a per-example leaf whose batch dim does not split into ``k`` equal parts.
    """
    if k == 1:
        return [batch]
    paths, leaves, treedef = tree_util.flatten(batch)
    sizes = {p or "<root>": x.shape[a] for p, x, a in zip(paths, leaves, axes) if a is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"accumulate={k}: the per-example batch leaves hold different numbers of examples along their "
                         f"batch dims ({sizes}). Mark the leaves that are not per-example with batch_axes=... None (as "
                         "JAX's in_axes), e.g. shard_step(..., batch_axes={'tokens': 0, 'expert_bias': None})")
    parts = []
    for p, x, a in zip(paths, leaves, axes):
        if a is None:
            parts.append([x] * k)
            continue
        if x.shape[a] % k:
            raise ValueError(f"accumulate={k}: batch leaf {p or '<root>'!r} has {x.shape[a]} examples along its batch "
                             f"dim {a} (shape {tuple(x.shape)}), which do not split into {k} equal micro-batches. Use "
                             f"a local batch that is a multiple of {k}, or mark a leaf that is not per-example with "
                             "batch_axes=... None")
        parts.append(x.chunk(k, dim=a))
    return [tree_util.unflatten(treedef, [c[j] for c in parts]) for j in range(k)]


def atoms(batch: Any, atom_size: int, axes: list[int | None]) -> list[Any]:
    """The invariant mode's micro-batches: the local batch cut into atoms of ``atom_size`` examples
    each, contiguous, so every kernel sees the same shapes and strides at any world size.

    Raises:
        ValueError: a per-example leaf whose batch dim is not a whole number of atoms.
    """
    paths, leaves, _ = tree_util.flatten(batch)
    for p, x, a in zip(paths, leaves, axes):
        if a is not None and (x.shape[a] % atom_size or not x.shape[a]):
            raise ValueError(f"invariant=True, atom_size={atom_size}: batch leaf {p or '<root>'!r} has {x.shape[a]} "
                             f"examples along its batch dim {a} (shape {tuple(x.shape)}), not a whole number of atoms. "
                             f"Give each rank a multiple of {atom_size} examples (the global batch / the world size), "
                             "or pick an atom_size that divides every rank's share")
    n = next((x.shape[a] for x, a in zip(leaves, axes) if a is not None), atom_size) // atom_size
    parts = micro_batches(batch, n, axes)
    return [optree.tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, mb) for mb in parts]


def cast(batch: Any, dtype: torch.dtype, axes: list[int | None]) -> Any:
    """Per-example floating leaves in ``dtype`` (as FSDP2's MixedPrecisionPolicy casts inputs)."""
    _, leaves, treedef = tree_util.flatten(batch)
    return tree_util.unflatten(treedef, [x.to(dtype) if a is not None and x.is_floating_point() else x
                                         for x, a in zip(leaves, axes)])


def shape_signature(batch: Any) -> int:
    """A 51-bit hash of every tensor leaf's shape (tuples of ints hash the same in every process)."""
    leaves = tree_util.flatten(batch)[1]
    return hash(tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor))) & DIGEST_MASK
