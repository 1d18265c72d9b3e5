"""Path-aware pytree helpers on optree.

Parameters are pytrees of dicts, lists and tuples whose leaves are tensors. Every leaf is
named by its "/"-joined path (``blocks/3/w_q``); that string is what specs match against
and what every error message names.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

__all__ = ["ROOT", "path_str", "flatten", "unflatten", "map_with_path", "paths", "structure", "check_leaves", "Blocks",
           "with_apply"]

# The FSDP unit of the leaves outside every list of the params tree (the rest of the tree);
# here, not in plan.py, so that the plan and its report (which plan.py imports) both read it.
ROOT = "<root>"


def path_str(path: tuple) -> str:
    """Join an optree path tuple into the "/"-separated name used everywhere in hpf."""
    return "/".join(str(k) for k in path)


def flatten(tree: Any, none_is_leaf: bool = True) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into (paths, leaves, treedef).

    By default None is a leaf, so a params tree's structure is never lost (and a None leaf
    gets a named error). ``none_is_leaf=False`` drops None subtrees, as optax does for
    optimizer inputs (hpf.optim's flattening)."""
    raw_paths, leaves, treedef = optree.tree_flatten_with_path(tree, none_is_leaf=none_is_leaf)
    return [path_str(p) for p in raw_paths], leaves, treedef


def unflatten(treedef: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    return optree.tree_unflatten(treedef, leaves)


def paths(tree: Any) -> list[str]:
    return flatten(tree)[0]


def structure(tree: Any) -> optree.PyTreeSpec:
    return optree.tree_structure(tree, none_is_leaf=True)


def map_with_path(fn: Callable[[str, Any], Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn(path, leaf, *other_leaves)`` over one or more trees of the same structure."""
    return optree.tree_map_with_path(
        lambda p, *xs: fn(path_str(p), *xs), tree, *rest, none_is_leaf=True
    )


def check_leaves(tree: Any, what: str = "params") -> None:
    """Raise a TypeError naming the first leaf that is not a tensor, or a ValueError naming two
    leaves whose paths read the same (``{"a/b": x, "a": {"b": y}}``, keys ``0`` and ``"0"``):
    every spec, plan slot and error names a leaf by its path, so they would be one param."""
    raw_paths = optree.tree_paths(tree, none_is_leaf=True)
    seen: dict[str, tuple] = {}
    for raw in raw_paths:
        other = seen.setdefault(path_str(raw), raw)
        if other is not raw:
            raise ValueError(f"{what} leaves at keys {other!r} and {raw!r} both have the path {path_str(raw)!r}; "
                             "hpf names each leaf by its \"/\"-joined path, so they would be one param. Rename a "
                             "key (no \"/\" inside a key, no int and str keys that print alike)")
    for path, leaf in zip(*flatten(tree)[:2]):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {path!r} is a {type(leaf).__name__}, not a torch.Tensor. "
                f"Every leaf of {what} must be a tensor: convert it with torch.as_tensor, "
                f"or move non-tensor settings out of the {what} tree (e.g. into a config)."
            )


class Blocks(list):
    """A list of blocks as a loss function sees it outside a step: ``apply(i, fn, *args)`` is
    ``fn(self[i], *args)``, what a step's ``UnitList.apply`` computes."""

    def apply(self, i: int, fn: Callable, *args) -> Any:
        return fn(self[i], *args)


def with_apply(tree: Any) -> Any:
    """``tree`` with every list a :class:`Blocks`: a loss function that runs its blocks through
    ``params[...].apply`` then runs on full params too (hvp, per_example_grads, check_grads)."""
    if isinstance(tree, list):
        return Blocks(with_apply(x) for x in tree)
    if isinstance(tree, dict):
        return type(tree)((k, with_apply(v)) for k, v in tree.items())
    if isinstance(tree, tuple):
        items = [with_apply(x) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree
