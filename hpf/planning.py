"""The one-time resolution of params x specs x mesh into FSDP units and flat buffers.

Everything the step needs at run time is computed here, once: which unit each parameter
belongs to, its offset in its unit's flat buffer, the padding, each rank's shard range,
which ranks hold which slice of which parameter, and the axes of every collective. It
needs only shapes and dtypes, so it runs on meta tensors and virtual meshes of any size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Collection, NamedTuple, Sequence

import optree
import torch

from . import tree as tree_util
from .mesh import Mesh, as_axes
from .spec import IndivisibleSpecError, P, SpecError, resolve_specs, shares
from .tree import ROOT
from .precision import SlowPrecision
from .topology import Topology, check_bucket_bytes

__all__ = ["Plan", "Bucket", "ParamSlot", "Piece", "UnitLayout", "plan", "step_plan", "unit_names", "low_bit", "OPS", "ROOT"]

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


def plan(params: Any, mesh: Mesh, param_specs: Any = None, fsdp_axes: Sequence[str] | None = None, *,
         hsdp: bool = False, fast_major: bool = False, bucket_bytes: int = 0, frozen: Collection[str] = (),
         slow_precision: SlowPrecision | None = None, align: int = 1) -> Plan:
    """Resolve the sharding of ``params`` on ``mesh`` once: the plan :func:`hpf.shard_step` makes
    (it passes its ``topology``'s ``fast_major``, ``bucket_bytes`` and ``slow_precision``).

    ``params`` may be meta tensors; ``mesh`` may be virtual. Axes of a spec that are in
    ``fsdp_axes`` (default: all mesh axes) mean "stored sharded, gathered for compute";
    other axes mean "stored and computed sharded". With no ``param_specs`` every parameter
    is sharded over all FSDP axes, or with ``hsdp`` over those in the fast tier and replicated
    across the slow tier. Shards are numbered node-major (slow axes first: a machine holds one
    contiguous region of every bucket, so most matrices lie inside one machine), or with
    ``fast_major`` fast axes first (each two-tier stage then moves one contiguous block).
    ``bucket_bytes`` caps a bucket (one flat buffer, one fused collective): a unit's params
    of one layout and dtype fill buckets in tree order, a new one starting where the next
    param would pass the cap (0: one bucket each; a param bigger than the cap gets its own).
    ``frozen`` params (paths) go to buckets of their own, which are gathered but never reduced.
    ``slow_precision`` (:class:`hpf.precision.SlowPrecision`) pads the shards of buckets with a
    low-bit collective (``low_bit``) to whole quantization blocks, and rides with
    the plan. ``align`` makes every bucket's shards whole multiples of it (the invariant mode's
    vector-aligned shards: an elementwise kernel then treats each element as the whole
    buffer's would).

    Args:
        params: the full params pytree (meta tensors are enough).
        mesh: the mesh, of any size (no process group is needed).
        param_specs: None, a ``P`` for every param, ``hpf.rules([...])`` / any ``path -> P``
            callable, or a pytree of ``P`` (None leaves mean ``P()``) with the params' structure.
        fsdp_axes: the axes params are stored sharded over and gathered for compute.
        hsdp, fast_major, bucket_bytes, frozen, slow_precision, align: as above.

    Raises:
        SpecError: a spec naming a non-axis or an axis twice, more entries than dims, no
            matching rule, ``fsdp_axes`` naming a non-axis; its subclasses
            :class:`~hpf.spec.SpecTreeError` (a spec tree of another structure) and
            :class:`~hpf.spec.IndivisibleSpecError` (a non-FSDP axis that does not divide its dim).
        TypeError: a params leaf that is not a tensor.
        ValueError: a ``bucket_bytes`` that is not an int >= 0; a ``slow_precision`` that no
            collective would use (no slow tier on ``mesh``: a 1-D mesh); ``hsdp`` with no slow
            tier among the FSDP axes (nothing to replicate across).
    """
    check_bucket_bytes(bucket_bytes)
    fsdp = _fsdp_axes(mesh, fsdp_axes, hsdp)
    compute_axes = tuple(a for a in mesh.axis_names if a not in fsdp)
    shard_default = tuple(a for a in fsdp if a in mesh.fast_axes) if hsdp else fsdp
    default = (lambda x: P(shard_default) if x.dim() >= 1 and shard_default else P())
    specs = resolve_specs(params, param_specs, mesh.axis_names, default)
    paths, leaves, treedef = tree_util.flatten(params)
    units_of = unit_names(params)
    ties = _ties(paths, leaves, units_of)
    frozen = set(frozen) | {ties[p] for p in frozen if p in ties}  # a frozen alias freezes its tie

    buckets, units, slots = _place(zip(paths, leaves, units_of), specs, ties, frozen, mesh, fsdp, bucket_bytes,
                                   fast_major, slow_precision, align)
    if not units[ROOT].buckets:
        del units[ROOT]
    _check_slow_used(mesh, buckets, slow_precision)
    return Plan(mesh, fsdp, compute_axes, specs, slots, buckets, units, treedef, ties, list(paths), slow_precision)


def step_plan(params: Any, mesh: Mesh, param_specs: Any = None, fsdp_axes=None, *,
              topology: Topology | None = None, hsdp: bool = False, frozen=(), align: int = 1) -> Plan:
    """The plan :func:`hpf.shard_step` makes for these arguments, the one recipe that the step,
    :func:`hpf.check_plan`, ``hpf plan`` and the simulator use: :func:`plan` with
    ``topology``'s layout options. Raises as :func:`plan`."""
    return plan(params, mesh, param_specs, fsdp_axes, hsdp=hsdp, frozen=frozen, align=align,
                **(topology.plan_options() if topology else {}))


def _place(params, specs: dict, ties: dict, frozen: set, mesh: Mesh, fsdp: tuple[str, ...], bucket_bytes: int,
           fast_major: bool, slow_precision: SlowPrecision | None, align: int = 1):
    """Each (path, leaf, unit) into a bucket and offset: (buckets, units, slots)."""
    buckets: list[Bucket] = []
    units: dict[str, UnitLayout] = {ROOT: UnitLayout(ROOT, [])}
    by_key: dict[tuple, Bucket] = {}
    slots: dict[str, ParamSlot] = {}
    for path, leaf, unit in params:
        spec = specs[path]
        if path in ties:
            if spec != specs[ties[path]]:
                raise SpecError(f"parameters {ties[path]!r} and {path!r} are one tied tensor but have specs "
                                f"{specs[ties[path]]!r} and {spec!r}: give both paths the same spec")
            continue
        shard_axes, split_axes = _param_axes(path, spec, mesh, fsdp)
        local_shape = _local_shape(path, leaf, spec, mesh, split_axes)
        # (split over non-FSDP axes or not, one bucket: those replicated there sum their grads after)
        replicate = tuple(a for a in fsdp if a not in shard_axes + split_axes)
        key = (unit, shard_axes, replicate, leaf.dtype, path in frozen)
        b = by_key.get(key)
        if b is None or (bucket_bytes and b.numel and
                         (b.numel + math.prod(local_shape)) * leaf.element_size() > bucket_bytes):
            b = by_key[key] = _new_bucket(len(buckets), key, mesh, fast_major, slow_precision, align)
            buckets.append(b)
            units.setdefault(unit, UnitLayout(unit, [])).buckets.append(b.index)
        b.split_axes = tuple(a for a in mesh.axis_names if a in b.split_axes + split_axes)
        slot = ParamSlot(path, spec, tuple(leaf.shape), local_shape, leaf.dtype, unit, b.index, b.numel, split_axes)
        b.slots.append(slot)
        b.numel += slot.numel
        slots[path] = slot
    return buckets, units, slots


def _fsdp_axes(mesh: Mesh, fsdp_axes, hsdp: bool) -> tuple[str, ...]:
    fsdp = tuple(mesh.axis_names) if fsdp_axes is None else as_axes(fsdp_axes)  # a str is one axis name
    for a in fsdp:
        if a not in mesh.axis_names:
            raise SpecError(f"fsdp_axes names {a!r}, which is not an axis of {mesh}")
    if hsdp and not mesh.slow_axes_of(fsdp):
        raise ValueError(f"hsdp=True replicates params across the slow tier, but no FSDP axis of {mesh} is outside "
                         f"its fast tier {list(mesh.fast_axes)} (with size > 1): HSDP would be plain FSDP. Give the "
                         "mesh an outer axis (hpf.Mesh({'node': 2, 'local': 2})), or drop hsdp")
    return fsdp


def _new_bucket(index: int, key: tuple, mesh: Mesh, fast_major: bool,
                slow_precision: SlowPrecision | None, align: int = 1) -> Bucket:
    """An empty bucket for ``key`` = (unit, shard axes, replicate axes, dtype, frozen)."""
    unit, shard_axes, replicate, dtype, frozen = key
    order = tuple(sorted(shard_axes, key=lambda a: (a in mesh.fast_axes) != fast_major))  # (stable: mesh order within)
    b = Bucket(index=index, unit=unit, shard_axes=shard_axes, replicate_axes=replicate, dtype=dtype,
               shard_size=mesh.axis_size(shard_axes), shard_order=order, frozen=frozen, align=align)
    if any(low_bit(mesh, b, slow_precision).values()):  # its slow-tier messages are whole blocks
        b.align = math.lcm(align, slow_precision.block)
    return b


def _check_slow_used(mesh: Mesh, buckets: list[Bucket], slow_precision: SlowPrecision | None) -> None:
    if slow_precision is not None and not any(any(low_bit(mesh, b, slow_precision).values()) for b in buckets):
        raise ValueError(
            f"a low-bit slow tier ({slow_precision.text()}) has nothing to act on: no collective of this plan crosses "
            f"a slow tier of {mesh} (an axis outside the fast tier {list(mesh.fast_axes)}, of size > 1), so every "
            "byte would stay full precision. A 1-D mesh is one fast tier: give it an outer axis for the slow one "
            "(hpf.Mesh({'node': 2, 'local': 2}); hpf train --mesh node=2,local=2), or drop the slow precision")


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


def _ties(paths: list[str], leaves: list, units_of: list[str]) -> dict[str, str]:
    """alias path -> owner path, for one tensor at several paths (the same object, or the same
    memory, shape and strides). The owner is its first path in the root unit, else its first
    path. Leaves that overlap in memory any other way are an error: they would train untied."""
    def key(x):
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return (("object", id(x)),)
        storage = x.untyped_storage()  # (meta tensors have no data: a storage is known by its object)
        where = ("meta", storage._cdata) if x.device.type == "meta" else ("data", storage.data_ptr())
        return (where, x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)

    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(key(x), []).append(i)
    ties, spans = {}, []
    for k, idx in groups.items():
        owner = next((i for i in idx if units_of[i] == ROOT), idx[0])
        ties.update({paths[i]: paths[owner] for i in idx if i != owner})
        if k[0][0] != "object":
            x = leaves[owner]
            end = x.storage_offset() + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1
            spans.append((k[0], x.storage_offset() * x.element_size(), end * x.element_size(), paths[owner], x))
    spans.sort(key=lambda s: s[:3])
    active: list[tuple] = []  # earlier spans of the same storage that reach past this one's start
    for ptr, start, end, b, y in spans:
        active = [s for s in active if s[0] == ptr and s[2] > start]
        for _, _, _, a, x in active:
            if _share_bytes(x, y):
                raise SpecError(f"parameters {a!r} and {b!r} overlap in memory but are not the same tensor (a view "
                                "such as a transpose or slice of another param). Tie weights by passing the same "
                                "tensor at both paths, and transpose or slice it inside loss_fn")
        active.append((ptr, start, end, b, y))
    return ties


def _share_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two views of one storage whose address spans overlap share any byte: element by
    element, so interleaved views (two column halves of one matrix) are disjoint."""
    def byte_set(t):
        offsets = torch.zeros((), dtype=torch.int64)
        for n, st in zip(t.shape, t.stride()):
            offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st)
        starts = (offsets.reshape(-1) + t.storage_offset()) * t.element_size()
        return (starts.unsqueeze(-1) + torch.arange(t.element_size())).reshape(-1)
    return bool(torch.isin(byte_set(x), byte_set(y)).any())


def _param_axes(path: str, spec: P, mesh: Mesh, fsdp: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(FSDP axes the param is stored sharded over, axes it is computed sharded over), mesh order.

    By default an FSDP axis named in the spec shards storage and any other named axis splits
    compute. ``P(..., fsdp=axes)`` shards over exactly ``axes`` (a subset of the FSDP axes) and
    splits compute over every other axis it names, FSDP axes included (expert parallelism)."""
    named = spec.axes()
    if spec.fsdp is None:
        return (tuple(a for a in mesh.axis_names if a in fsdp and a in named),
                tuple(a for a in mesh.axis_names if a not in fsdp and a in named))
    for a in spec.fsdp:
        if a not in fsdp:
            raise SpecError(f"parameter {path!r}: spec {spec!r} shards over {a!r}, which is not one of the "
                            f"step's fsdp_axes {fsdp}; add it to fsdp_axes or drop it from fsdp=")
    return (tuple(a for a in mesh.axis_names if a in spec.fsdp),
            tuple(a for a in mesh.axis_names if a in named and a not in spec.fsdp))


def unit_names(params: Any) -> list[str]:
    """Each element of the outermost list on a leaf's path is a unit; other leaves are root."""
    out = []
    for accessor in optree.tree_accessors(params, none_is_leaf=True):
        name = ROOT
        for depth, entry in enumerate(accessor):
            if issubclass(entry.type, list):
                name = tree_util.path_str(tuple(e.entry for e in accessor[:depth + 1]))
                break
        out.append(name)
    return out


def _local_shape(path: str, leaf: torch.Tensor, spec: P, mesh: Mesh, split_axes) -> tuple[int, ...]:
    """The block a rank stores: the dims split over non-FSDP axes divided, evenly or (``P(granule=)``)
    in whole blocks, the largest share (a rank may get none: 3 MLP columns over 4 ranks)."""
    shape = list(leaf.shape)
    for dim in range(len(spec)):
        axes = [a for a in spec.dim_axes(dim) if a in split_axes]
        if not axes:
            continue
        n, g = mesh.axis_size(axes), spec.dim_granule(dim)
        if g is None and shape[dim] % n:
            raise IndivisibleSpecError(
                f"parameter {path!r} dim {dim} has size {shape[dim]}, which the non-FSDP axes "
                f"{tuple(axes)} of its spec {spec!r} ({n} ranks) do not divide; only FSDP axes are "
                f"padded. Pick a size divisible by {n}, shard this dim over FSDP axes instead, or let it split "
                "unevenly with P(..., granule=...)"
            )
        if g is not None and shape[dim] % g:
            raise IndivisibleSpecError(f"parameter {path!r} dim {dim} has size {shape[dim]}, not whole blocks of {g} "
                                       f"(its spec {spec!r}): give a granule that divides it")
        shape[dim] = max(shares(shape[dim], n, g or 1))
    return tuple(shape)
