"""The params tree the loss function sees: the plan's structure, with every list of FSDP units
a ``UnitList`` that reads a unit whenever the function indexes, slices, iterates or reverses it.

Root params are views of the root unit's buffer. A unit's subtree is built at each read from
the views the engine hands out; a tied leaf (one tensor at several paths) is read through its
owner's unit, so its grads reach one parameter.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import optree

from .. import tree as tree_util
from ..planning import ROOT, Plan, unit_names

__all__ = ["ParamsView", "UnitList", "Reads"]


class UnitList(list):
    """A list of FSDP units (a real list of their names) that reads a unit whenever the loss
    function reaches it: by index, negative index, iteration (any number of times), reversed;
    a slice is another such list."""

    def __init__(self, read: Callable[[str], Any], names: list[str], apply: Callable | None = None):
        super().__init__(names)
        self._read, self._apply = read, apply

    def __getitem__(self, i):
        if isinstance(i, slice):
            return UnitList(self._read, list.__getitem__(self, i), self._apply)
        return self._read(list.__getitem__(self, i))

    @property
    def rematerializes(self) -> bool:
        """Whether ``apply`` keeps only a block's inputs for backward (grad="torch.func")."""
        return self._apply is not None

    def apply(self, i: int, fn: Callable, *args) -> Any:
        """``fn(self[i], *args)``. Under ``grad="torch.func"`` the block is rematerialized: only
        ``args`` are kept for backward, which gathers the unit again and recomputes ``fn``
        (hpf.models' ``each_block`` calls this: FSDP memory under torch.func)."""
        name = list.__getitem__(self, i)
        return self._apply(name, fn, args) if self._apply is not None else fn(self._read(name), *args)

    def __iter__(self):
        return Reads(self._read, list.__iter__(self))

    def __reversed__(self):
        return Reads(self._read, list.__reversed__(self))


class Reads:
    """An iteration over a ``UnitList``: each step reads the next unit. An iterator object, not a
    generator, so that under ``torch.compile`` each step is one graph break (hpf.engine.compiled)."""

    def __init__(self, read: Callable[[str], Any], names: Iterator[str]):
        self._read, self._names = read, names

    def __iter__(self) -> "Reads":
        return self

    def __next__(self) -> Any:
        return self._read(next(self._names))


class ParamsView:
    """Builds the params tree for one call of the loss function (see the module doc).

    ``entry(unit)`` makes one autograd entry of a unit and returns its param views in slot
    order; the engine passes it, so every read goes through the engine. ``blocks``: {path: shape}
    of the params stored padded (``Plan.padded_blocks``): the function sees each narrowed to its
    block, and autograd pads its grad back with zeros."""

    def __init__(self, plan: Plan, slot_paths: dict[str, list[str]], entry: Callable[[str], tuple],
                 blocks: dict[str, tuple[int, ...]] | None = None):
        self.plan, self.entry, self._blocks = plan, entry, blocks or {}
        self._slot_at = {p: (u, i) for u, ps in slot_paths.items() for i, p in enumerate(ps)}
        self._leaf_paths = plan.leaf_paths or list(plan.slots)
        paths_tree = optree.tree_unflatten(plan.treedef, self._leaf_paths)
        leaves, self._skeleton = optree.tree_flatten(paths_tree, is_leaf=lambda x: isinstance(x, list),
                                                     none_is_leaf=True)
        unit_of = dict(zip(self._leaf_paths, unit_names(paths_tree)))
        self._leaves = []  # per skeleton leaf: ("units", names) or ("root", path)
        for leaf in leaves:
            if isinstance(leaf, list):
                prefix = unit_of[optree.tree_leaves(leaf, none_is_leaf=True)[0]].rsplit("/", 1)[0]
                self._leaves.append(("units", [f"{prefix}/{i}" for i in range(len(leaf))]))
            else:
                self._leaves.append(("root", leaf))
        self._needs: dict[str, list[str]] = {}
        self._subtree = {name: self._builder(name) for kind, v in self._leaves if kind == "units" for name in v}

    def tree(self, read: Callable[[str], Any], apply: Callable | None = None) -> Any:
        """The params tree; ``read(unit)`` is called at each read of a unit (returns its subtree),
        ``apply(unit, fn, args)`` at each ``UnitList.apply`` (None: a read, then ``fn``)."""
        root = self.entry(ROOT) if ROOT in self.plan.units else ()
        leaves = [self._block(self.plan.ties.get(v, v), root[self._slot_at[self.plan.ties.get(v, v)][1]])
                  if kind == "root" else UnitList(read, v, apply) for kind, v in self._leaves]
        return optree.tree_unflatten(self._skeleton, leaves)

    def subtree(self, unit: str, views: tuple | None = None) -> Any:
        """One read of list element ``unit``: its subtree of param views (``views``: these, in slot
        order, instead of an entry; only for a unit with no tied leaf of another unit's)."""
        return self._subtree[unit](views)

    def needs(self, unit: str) -> list[str]:
        """The units one read of ``unit`` reads: owners of its tied leaves first, itself last."""
        return self._needs[unit]

    def _builder(self, unit: str) -> Callable[[], Any]:
        node: Any = optree.tree_unflatten(self.plan.treedef, self._leaf_paths)
        for key in unit.split("/"):
            node = node[int(key)] if isinstance(node, list) else node[key]
        _, leaves, treedef = tree_util.flatten(node)
        owner_paths = [self.plan.ties.get(p, p) for p in leaves]
        owners = [self._slot_at[p] for p in owner_paths]
        need = sorted(dict.fromkeys(u for u, _ in owners), key=lambda u: u == unit)  # its own unit last
        self._needs[unit] = [u for u in need if u != ROOT]
        where = [(need.index(u), i) for u, i in owners]

        def build(own=None):
            views = [self.entry(u) for u in need] if own is None else [own]
            return optree.tree_unflatten(treedef, [self._block(p, views[k][i]) for p, (k, i) in zip(owner_paths, where)])
        return build

    def _block(self, path: str, x):
        """``x`` narrowed to ``path``'s block where it is stored padded."""
        shape = self._blocks.get(path)
        if shape is None:
            return x
        for dim, n in enumerate(shape):
            if x.shape[dim] != n:
                x = x.narrow(dim, 0, n)
        return x
