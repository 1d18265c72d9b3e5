"""The one-time resolution of params x specs x mesh into FSDP units and flat buffers.

Everything the step needs at run time is computed here, once (the :class:`~hpf.planning.Plan`
of hpf.planning.buckets): which unit each parameter belongs to, its offset in its unit's flat
buffer, the padding, each rank's shard range, which ranks hold which slice of which parameter,
and the axes of every collective. It needs only shapes and dtypes, so it runs on meta tensors
and virtual meshes of any size.
"""
from __future__ import annotations

import math
from typing import Any, Collection, Sequence

import optree
import torch

from .. import tree as tree_util
from ..mesh import Mesh, as_axes
from ..spec import IndivisibleSpecError, P, SpecError, resolve_specs, shares
from ..tree import ROOT
from ..precision import SlowPrecision
from ..topology import Topology, check_bucket_bytes
from .buckets import Bucket, ParamSlot, Plan, UnitLayout, low_bit

__all__ = ["plan", "step_plan", "unit_names"]


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
