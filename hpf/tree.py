"""Path-aware pytree helpers on optree.

Parameters are pytrees of dicts, lists and tuples whose leaves are tensors. Every leaf is
named by its "/"-joined path (``blocks/3/w_q``); that string is what specs match against
and what every error message names.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

__all__ = ["path_str", "flatten", "unflatten", "map_with_path", "paths", "structure", "check_leaves"]


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
    """Raise a TypeError naming the first leaf that is not a tensor."""
    for path, leaf in zip(*flatten(tree)[:2]):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {path!r} is a {type(leaf).__name__}, not a torch.Tensor. "
                f"Every leaf of {what} must be a tensor: convert it with torch.as_tensor, "
                f"or move non-tensor settings out of the {what} tree (e.g. into a config)."
            )
