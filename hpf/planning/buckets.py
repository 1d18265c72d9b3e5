"""The resolved plan: each param's slot in its unit's flat buckets, and the layout facts read from it.

A :class:`Plan` (made once by :func:`hpf.planning.plan`, hpf.planning.placement) holds which unit
each parameter belongs to, its offset in its unit's flat buffer, the padding, each rank's shard
range, which ranks hold which slice of which parameter, and the axes of every collective. Its
methods convert between full params, flat buffers and shards (init, checkpoints, tests), and
:func:`low_bit` says which of a bucket's collectives cross the slow tier in fewer bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import optree
import torch

from .. import tree as tree_util
from ..mesh import Mesh
from ..spec import P, shares
from ..precision import SlowPrecision

__all__ = ["Plan", "Bucket", "ParamSlot", "Piece", "UnitLayout", "low_bit", "OPS"]


# A bucket's collectives in one step: gather params and reduce-scatter grads over its shard
# axes, all-reduce its grad shard over its replicate axes (HSDP).
OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its bucket and element offset in the bucket's flat buffer."""

    path: str
    spec: P
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # the block the loss function sees (non-FSDP axes split dims)
    dtype: torch.dtype
    unit: str
    bucket: int
    offset: int
    # The axes it is computed split over (a subset of its bucket's: a norm weight replicated over
    # tp shares a bucket with the tp-split weights of its block, one gather and reduction for all).
    split_axes: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def piece(self, lo: int, hi: int) -> "Piece":
        """The part of this param that the bucket's elements ``[lo, hi)`` hold."""
        start, stop = max(self.offset, lo), min(self.offset + self.numel, hi)
        stop = max(start, stop)
        return Piece(slice(start - lo, stop - lo), slice(start - self.offset, stop - self.offset))


class Piece(NamedTuple):
    """The part of one param that a range of its bucket holds (a shard, usually): ``held``
    indexes the range, ``param`` the param's flat (local) elements; both empty when none."""

    held: slice
    param: slice

    @property
    def numel(self) -> int:
        return self.held.stop - self.held.start


@dataclass
class Bucket:
    """One flat buffer: the params of one unit that share FSDP shard and replicate axes and dtype
    (computed split over any non-FSDP axes or none: ``split_axes`` is their union).

    The full buffer has ``padded_numel`` elements; the rank at position i of the shard
    group stores elements ``[i * shard_numel, (i + 1) * shard_numel)``.
    """

    index: int
    unit: str
    shard_axes: tuple[str, ...]  # FSDP axes the buffer is split over (reduce-scatter)
    replicate_axes: tuple[str, ...]  # FSDP axes it is replicated over (grads all-reduced)
    dtype: torch.dtype
    shard_size: int  # ranks in the shard group
    split_axes: tuple[str, ...] = ()  # axes some param of it is computed split over: non-FSDP ones, or FSDP ones a P(fsdp=) borrows
    # Axes in the order that numbers shard positions. Mesh order, unless two-tier collectives
    # number fast axes first, so each gather stage writes one contiguous block.
    shard_order: tuple[str, ...] = ()
    slots: list[ParamSlot] = field(default_factory=list)
    numel: int = 0
    frozen: bool = False  # its params are not trained: no grads, no reduction, no optimizer state
    align: int = 1  # shards are whole multiples of this (a low-bit slow tier's block)

    @property
    def shard_numel(self) -> int:
        """At least ``align``: a bucket of 0 elements (a unit whose params are all empty) is all
        padding, and its collectives run as any other's (a 0-element shard broke the transports)."""
        return -(-max(self.numel, 1) // (self.shard_size * self.align)) * self.align

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shard_size

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        return shard_index * self.shard_numel, (shard_index + 1) * self.shard_numel

    def local_piece(self, slot: ParamSlot, shard_index: int) -> Piece:
        """The part of ``slot`` that shard ``shard_index`` holds (``Plan.shard_index`` of a rank)."""
        return slot.piece(*self.shard_range(shard_index))

    def runs(self, shard_index: int, key) -> list[tuple[slice, Any]]:
        """Shard ``shard_index`` tiled by runs of consecutive params with equal ``key(slot)``:
        [(slice of the shard, key)], the padding with the last param's run (a bucket of one key:
        its whole shard, one run)."""
        lo, hi = self.shard_range(shard_index)
        starts: list[tuple[int, Any]] = []  # (element of the full buffer, key) where a run starts
        for s in self.slots:
            k = key(s)
            if not starts or starts[-1][1] != k:
                starts.append((s.offset if starts else 0, k))
        ends = [start for start, _ in starts[1:]] + [self.padded_numel]
        return [(slice(max(a, lo) - lo, min(b, hi) - lo), k) for (a, k), b in zip(starts, ends) if max(a, lo) < min(b, hi)]

    def holders(self, slot: ParamSlot) -> list[int]:
        """Shard-group positions whose shard holds part of ``slot`` (the Muon comm group)."""
        if self.shard_numel == 0:
            return []
        first = slot.offset // self.shard_numel
        last = (slot.offset + slot.numel - 1) // self.shard_numel
        return list(range(first, last + 1))


@dataclass
class UnitLayout:
    """An FSDP unit: gathered together, just before use, and freed together."""

    name: str  # ROOT or the path of a list element, e.g. "blocks/3"
    buckets: list[int]


@dataclass
class Plan:
    """The resolved sharding of one params tree on one mesh, made once by :func:`plan`.

    It holds, per parameter, its spec and slot (bucket and offset); per bucket, its shard
    and replicate axes; and the FSDP units in tree order. Its methods convert between full
    params, flat buffers and shards (init, checkpoints, tests).

    Args (made by :func:`plan`, not by hand):
        mesh: the mesh it was resolved on; fsdp_axes / compute_axes: the gathered axes and
            the stored-and-computed-sharded ones; specs: path -> P; slots: path -> ParamSlot;
            buckets: the flat buffers; units: the FSDP units, root first; treedef: the params'
            structure (to rebuild the tree).

    Raises:
        KeyError: a method given a path that is not a parameter of the plan.
    """

    mesh: Mesh
    fsdp_axes: tuple[str, ...]
    compute_axes: tuple[str, ...]  # non-FSDP axes: stored and computed sharded
    specs: dict[str, P]
    slots: dict[str, ParamSlot]  # in params-tree order
    buckets: list[Bucket]
    units: dict[str, UnitLayout]  # ROOT first, then list elements in tree order
    treedef: optree.PyTreeSpec
    # Tied weights: one tensor at several paths is one parameter. Its slot is the owner's;
    # every other path (an alias) maps to the owner here. All leaf paths, in tree order.
    ties: dict[str, str] = field(default_factory=dict)
    leaf_paths: list[str] = field(default_factory=list)
    slow_precision: SlowPrecision | None = None  # what crosses the slow tier in fewer bytes (hpf.Topology's)

    # -- derived sizes (as torchtitan's ParallelDims names them) -----------------------------
    @property
    def dp_size(self) -> int:
        """Ranks along the FSDP axes: they split the data, and grads are averaged over them."""
        return self.mesh.axis_size(self.fsdp_axes)

    @property
    def compute_size(self) -> int:
        """Ranks along the non-FSDP axes: they compute one replica's loss together (tensor and
        expert parallelism)."""
        return self.mesh.axis_size(self.compute_axes)

    def slot_paths(self, unit: str) -> list[str]:
        """The param paths of ``unit``, in its buckets' order (the order of its flat buffers)."""
        return [s.path for b in self.units[unit].buckets for s in self.buckets[b].slots]

    # -- parameter <-> shard conversions (used at init, checkpointing and in tests) --------
    def block_offsets(self, path: str, rank: int) -> tuple[int, ...]:
        """Where the block ``rank`` computes with starts in the full parameter, per dim."""
        return tuple(sum(sizes[:i]) for sizes, i in self._blocks(path, rank))

    def block_shape(self, path: str, rank: int) -> tuple[int, ...]:
        """The block of the full parameter that ``rank`` computes with: ``local_shape`` but where
        a ``P(granule=)`` splits a dim unevenly, whose last ranks store theirs padded at its end."""
        return tuple(sizes[i] for sizes, i in self._blocks(path, rank))

    def padded_blocks(self, rank: int) -> dict[str, tuple[int, ...]]:
        """{path: ``block_shape``} of the params ``rank`` stores padded (the loss function sees
        a narrowed view of each; the padding stays zero, its grads are zero)."""
        return {p: shape for p, s in self.slots.items() if (shape := self.block_shape(p, rank)) != s.local_shape}

    def block_sizes(self, path: str, dim: int) -> list[int]:
        """Every rank's block size along ``dim`` of ``path``, in the order of its split axes' group."""
        return self._blocks(path, 0)[dim][0]

    def unpadded(self, path: str, rank: int, offsets, sizes) -> tuple[slice, ...] | None:
        """The part of a box (``offsets``, ``sizes``) of ``rank``'s stored block of ``path`` that is
        no padding, as slices of the box; None where it is all padding (an uneven split)."""
        inside = tuple(max(0, min(o + k, n) - o) for o, k, n in zip(offsets, sizes, self.block_shape(path, rank)))
        return tuple(slice(0, k) for k in inside) if all(inside) else None

    def _blocks(self, path: str, rank: int) -> list[tuple[list[int], int]]:
        """Per dim: (every rank's block size along it, in group order; this rank's place)."""
        slot = self.slots[path]
        out = []
        for dim, n in enumerate(slot.global_shape):
            axes = self.split_dim_axes(slot, dim)
            if not axes:
                out.append(([n], 0))
                continue
            out.append((shares(n, self.mesh.axis_size(axes), slot.spec.dim_granule(dim) or 1),
                        self.mesh.group_index(axes, rank)))
        return out

    def local_block(self, path: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """The block of a full parameter that ``rank`` stores (non-FSDP axes only): its compute
        block, zero-padded to ``local_shape`` where a split is uneven."""
        out = full
        for dim, (start, n) in enumerate(zip(self.block_offsets(path, rank), self.block_shape(path, rank))):
            if n != out.shape[dim]:
                out = out.narrow(dim, start, n)
        want = self.slots[path].local_shape
        if tuple(out.shape) != want:
            padded = out.new_zeros(want)
            padded[tuple(slice(0, n) for n in out.shape)] = out
            out = padded
        return out

    def split_dim_axes(self, slot: ParamSlot, dim: int) -> tuple[str, ...]:
        """The axes that split ``slot``'s dim ``dim`` for compute (of its compute axes)."""
        return tuple(a for a in slot.spec.dim_axes(dim) if a in slot.split_axes)

    @property
    def split_axes(self) -> tuple[str, ...]:
        """Every axis some param is computed sharded over (where explicit collectives may run)."""
        used = {a for b in self.buckets for a in b.split_axes} | set(self.compute_axes)
        return tuple(a for a in self.mesh.axis_names if a in used)

    def flat_buffer(self, bucket: Bucket, local: dict[str, torch.Tensor], dtype=None) -> torch.Tensor:
        """Pack a bucket's local params into its padded full flat buffer."""
        parts = [local[s.path].reshape(-1) for s in bucket.slots]
        pad = bucket.padded_numel - bucket.numel
        if pad:
            parts.append(parts[0].new_zeros(pad))
        return torch.cat(parts).to(dtype or bucket.dtype)

    def shard_of(self, bucket: Bucket, flat: torch.Tensor, rank: int) -> torch.Tensor:
        start, stop = bucket.shard_range(self.shard_index(bucket, rank))
        return flat[start:stop]

    def views(self, bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters as views into a full flat buffer: no copies."""
        return {s.path: flat[s.offset:s.offset + s.numel].view(s.local_shape) for s in bucket.slots}

    def replicas(self, slot: ParamSlot) -> int:
        """How many ranks store an identical copy of each shard of ``slot`` (to count it once in norms)."""
        return self.mesh.size // self.buckets[slot.bucket].shard_size // self.mesh.axis_size(slot.split_axes)

    def partial_axes(self, slot: ParamSlot) -> tuple[str, ...]:
        """The non-FSDP axes ``slot`` is replicated over: its grads are partial sums there
        (hpf.comm.collectives), all-reduced once every reduction landed (where their size is > 1)."""
        return tuple(a for a in self.compute_axes if a not in slot.split_axes)

    def partial_numel(self, bucket: Bucket) -> dict[tuple[str, ...], int]:
        """{axes: the most elements of a shard of ``bucket`` whose grads are partial sums over them},
        on the shard position that holds the most: what that all-reduce carries for it."""
        keys = dict.fromkeys(self.partial_axes(s) for s in bucket.slots)
        if bucket.frozen:
            return {}
        if len(keys) == 1:
            return {axes: bucket.shard_numel for axes in keys if axes}
        runs = [bucket.runs(i, self.partial_axes) for i in range(bucket.shard_size)]
        return {axes: max(sum(p.stop - p.start for p, k in r if k == axes) for r in runs) for axes in keys if axes}

    def stage_blocks(self, bucket: Bucket) -> int:
        """In how many blocks a two-stage collective's fast-tier part of ``bucket`` lies: 1 when
        shards are numbered fast axes first (local rank l's part of the full buffer is one
        contiguous block), else (node-major) the number of slow-tier peers: local rank l's part is
        shard (n, l) of every node n, one block each."""
        order = [a for a in bucket.shard_order if self.mesh.axis_size(a) > 1]
        fast = [a for a in order if a in self.mesh.fast_axes]
        if not fast or len(fast) == len(order) or order[0] in self.mesh.fast_axes:
            return 1
        return self.mesh.axis_size(tuple(a for a in order if a not in self.mesh.fast_axes))

    def shard_index(self, bucket: Bucket, rank: int) -> int:
        return self.mesh.group_index(bucket.shard_axes, rank, order=bucket.shard_order) if bucket.shard_axes else 0

    def shard_ranks(self, bucket: Bucket, rank: int) -> list[int]:
        """Global ranks of ``rank``'s shard group; entry i stores shard position i."""
        if not bucket.shard_axes:
            return [rank]
        return self.mesh.group_ranks(bucket.shard_axes, rank, order=bucket.shard_order)

    def shards(self, full_params: Any, rank: int, dtype=None) -> list[torch.Tensor]:
        """This rank's flat shard of every bucket, from the full (unsharded) params."""
        paths, leaves, _ = tree_util.flatten(full_params)
        local = {p: self.local_block(p, x, rank) for p, x in zip(paths, leaves) if p not in self.ties}
        return [self.shard_of(b, self.flat_buffer(b, local, dtype), rank).clone() for b in self.buckets]

    def tree(self, by_path: dict[str, Any]) -> Any:
        """Rebuild the params pytree from ``{path: value}``."""
        return tree_util.unflatten(self.treedef, [by_path[self.ties.get(p, p)] for p in self.leaf_paths or self.slots])

    def __repr__(self) -> str:
        return (f"Plan({self.mesh}, fsdp_axes={self.fsdp_axes}, {len(self.slots)} params, "
                f"{len(self.units)} units, {len(self.buckets)} buckets)")


def low_bit(mesh: Mesh, bucket: "Bucket", slow: SlowPrecision | None) -> dict[str, str | None]:
    """The format each of ``bucket``'s collectives sends across the slow tier in (None: its own dtype).

    The gather and the reduce-scatter are low-bit when their shard group has a slow stage; the
    HSDP all-reduce when every replica axis is a slow one (a fast one would carry it too)."""
    out = dict.fromkeys(OPS)
    if slow is None:
        return out
    crosses = bool(mesh.slow_axes_of(bucket.shard_axes))
    out["all_gather"] = slow.weights if crosses else None
    if not bucket.frozen:
        out["reduce_scatter"] = slow.grads if crosses else None
        replicas = [a for a in bucket.replicate_axes if mesh.axis_size(a) > 1]
        out["all_reduce"] = slow.grads if replicas and set(mesh.slow_axes_of(replicas)) == set(replicas) else None
    return out
