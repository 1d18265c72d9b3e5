"""Mesh: named axes over ranks, outer to inner, and the process groups along them.

A mesh is plain data (axis names, sizes, which axes form the fast tier) until a real run
asks for a process group, so the same object plans a 768-rank job on a laptop and runs a
4-rank job under ``hpf.launch``.
"""
from __future__ import annotations

import itertools
import math
from datetime import timedelta
from typing import Mapping, Sequence

# The mesh makes its process groups itself, so it talks to torch.distributed directly: it sits
# below hpf/comm/ (whose collectives and byte model read the mesh), and hpf.comm.world's
# helpers would make the two import each other.
import torch.distributed as dist

from .errors import MeshError

__all__ = ["Mesh", "MeshError", "as_axes"]


class Mesh:
    """Named axes of a rank grid, row-major: the last axis varies fastest.

    ``fast_axes`` are the axes whose ranks share a fast tier (a host, a supernode); by
    default the innermost axis. Every other axis crosses the slow tier.

    Args:
        axes: axis name -> size, outer to inner (a dict, or (name, size) pairs); the product is
            the world size.
        fast_axes: the axes whose ranks share the fast tier (default: the last axis).

    Raises:
        MeshError: no axes, an empty or non-string name, a size that is not a positive int,
            or a fast axis that is not a mesh axis.
    """

    def __init__(self, axes: Mapping[str, int], *, fast_axes: Sequence[str] | None = None):
        if not isinstance(axes, Mapping):  # (name, size) pairs, outer to inner, are a mapping too
            if not (isinstance(axes, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                            for p in axes)):
                raise MeshError(f"hpf.Mesh({axes!r}): pass a dict of axis name -> size, outer to inner, "
                                "e.g. hpf.Mesh({'node': 2, 'local': 4})")
            if len({p[0] for p in axes}) != len(axes):
                raise MeshError(f"hpf.Mesh({axes!r}) names an axis twice; every axis needs its own name")
            axes = dict(axes)
        if not axes:
            raise MeshError("a Mesh needs at least one axis, e.g. hpf.Mesh({'dp': 4})")
        for name, n in axes.items():
            if not isinstance(name, str) or not name:
                raise MeshError(f"mesh axis name {name!r} must be a non-empty string")
            if not isinstance(n, int) or n < 1:
                raise MeshError(f"mesh axis {name!r} has size {n!r}; sizes must be positive ints")
        self.axis_names: tuple[str, ...] = tuple(axes)
        self.shape: tuple[int, ...] = tuple(axes.values())
        self.size: int = math.prod(self.shape)
        fast = as_axes(fast_axes) if fast_axes is not None else self.axis_names[-1:]  # a str is one axis
        for a in fast:
            self._check_axis(a)
        self.fast_axes = tuple(a for a in self.axis_names if a in fast)
        self.slow_axes = tuple(a for a in self.axis_names if a not in fast)
        self._groups: dict[tuple, object] = {}
        self._users = 0  # comms of live steps (``hold``, ``release``)

    # -- pure geometry -------------------------------------------------------------------
    def axis_size(self, axes: str | Sequence[str]) -> int:
        """The number of ranks along ``axes`` (one name or several: the product of their sizes)."""
        return math.prod(self.shape[self._index(a)] for a in as_axes(axes))

    def slow_axes_of(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        """Those of ``axes`` whose ranks talk across the slow tier (not fast, size > 1)."""
        return tuple(a for a in as_axes(axes) if a not in self.fast_axes and self.axis_size(a) > 1)

    def coords(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate on each axis, outer to inner (row-major: the last axis varies fastest).

        Raises:
            MeshError: ``rank`` is outside the mesh."""
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside a mesh of {self.size} ranks")
        out = []
        for n in reversed(self.shape):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def rank_of(self, coords: Sequence[int]) -> int:
        """The rank at ``coords`` (one per axis, outer to inner): the inverse of :meth:`coords`."""
        rank = 0
        for c, n in zip(coords, self.shape, strict=True):
            rank = rank * n + c
        return rank

    def group_index(self, axes: str | Sequence[str], rank: int, *, order: Sequence[str] | None = None) -> int:
        """Position of ``rank`` inside its group along ``axes``: row-major over the axes in
        mesh order, or in ``order`` (e.g. fast axes first, for two-tier collectives)."""
        c = self.coords(rank)
        idx = 0
        for a in (self._ordered(axes) if order is None else tuple(order)):
            i = self._index(a)
            idx = idx * self.shape[i] + c[i]
        return idx

    def group_ranks(self, axes: str | Sequence[str], rank: int, *, order: Sequence[str] | None = None) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axes``, by group position
        (sorted, unless ``order`` linearizes the axes differently)."""
        ordered = self._ordered(axes) if order is None else tuple(order)
        base = list(self.coords(rank))
        out = []
        for combo in itertools.product(*(range(self.shape[self._index(a)]) for a in ordered)):
            for a, v in zip(ordered, combo):
                base[self._index(a)] = v
            out.append(self.rank_of(base))
        return out

    def all_groups(self, axes: str | Sequence[str]) -> list[list[int]]:
        """Every group along ``axes``: a partition of all ranks, in a fixed order."""
        seen, groups = set(), []
        for r in range(self.size):
            if r not in seen:
                g = self.group_ranks(axes, r)
                seen.update(g)
                groups.append(g)
        return groups

    # -- real runs ------------------------------------------------------------------------
    def check_world(self) -> None:
        """Fail fast when the running world does not have this mesh's size."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.size:
            raise MeshError(
                f"mesh {self} has {self.size} ranks but the process group has "
                f"{dist.get_world_size()}; make the product of the axis sizes equal the world size "
                f"(or launch with world_size={self.size})"
            )

    def group(self, axes: str | Sequence[str], timeout: timedelta | None = None, *, tag: str = ""):
        """This rank's process group along ``axes``, created once (collectively) on first use.

        Returns None for an empty axis set. ``tag`` asks for a separate group over the same
        ranks (collectives issued from different threads each need their own). Every rank
        must ask for the same groups in the same order, as with any torch.distributed group.
        """
        ordered = self._ordered(axes)
        if not ordered:
            return None
        key = (ordered, tag)
        if key not in self._groups:
            self.check_world()
            if not dist.is_initialized():
                raise MeshError(
                    "process groups need a running job: start it with hpf.launch(fn, world_size) "
                    "or torchrun (a virtual mesh can only plan)"
                )
            if len(ordered) == len(self.axis_names) and not tag:
                self._groups[key] = dist.group.WORLD
            else:
                kwargs = {"timeout": timeout} if timeout is not None else {}
                mine, _ = dist.new_subgroups_by_enumeration(self.all_groups(ordered), **kwargs)
                self._groups[key] = mine
        return self._groups[key]

    def drop_group(self, axes: str | Sequence[str], *, tag: str) -> None:
        """Destroy the tagged group ``group(axes, tag=tag)`` made, freeing its threads and sockets
        (a tagged group belongs to one owner, which drops it when it closes)."""
        group = self._groups.pop((self._ordered(axes), tag), None)
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def hold(self) -> None:
        """A step's comm starts using this mesh's groups; it calls ``release`` when it closes."""
        self._users += 1

    def release(self) -> None:
        """A step's comm closed. The last one destroys every group ``group`` made (the next user makes
        them again), so a closed step leaves the process's groups, sockets and threads as they were,
        whether each step had a new mesh or all shared one."""
        self._users -= 1
        if self._users == 0:
            for key in list(self._groups):
                group = self._groups.pop(key)
                if group is not dist.group.WORLD and dist.is_initialized():
                    dist.destroy_process_group(group)

    # -- helpers ---------------------------------------------------------------------------
    def _index(self, axis: str) -> int:
        self._check_axis(axis)
        return self.axis_names.index(axis)

    def _check_axis(self, axis: str) -> None:
        if axis not in self.axis_names:
            raise MeshError(f"{axis!r} is not an axis of {self}; axes are {self.axis_names}")

    def _ordered(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        """Axes sorted into mesh order, so ('local', 'node') and ('node', 'local') are one group."""
        want = as_axes(axes)
        for a in want:
            self._check_axis(a)
        return tuple(a for a in self.axis_names if a in want)

    def __repr__(self) -> str:
        inner = ", ".join(f"{a!r}: {n}" for a, n in zip(self.axis_names, self.shape))
        return f"Mesh({{{inner}}})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and (self.axis_names, self.shape, self.fast_axes) == (
            other.axis_names, other.shape, other.fast_axes)

    def __hash__(self) -> int:
        return hash((self.axis_names, self.shape, self.fast_axes))

    def __getstate__(self):
        # Process groups are per-process handles; a pickled mesh (sent to launched ranks) is data only.
        state = dict(self.__dict__)
        state["_groups"], state["_users"] = {}, 0
        return state


def as_axes(axes: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """Axis names as a tuple; a string is one axis name (not its characters); None stays None."""
    if axes is None:
        return None
    return (axes,) if isinstance(axes, str) else tuple(axes)
