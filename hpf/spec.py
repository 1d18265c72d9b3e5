"""PartitionSpecs and the rules that assign them to parameter paths.

A spec says, per tensor dim, which mesh axes that dim is split over (JAX's PartitionSpec).
Specs are resolved once, at the API boundary, into one ``P`` per parameter path; after
that nothing in the step looks at them again.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Sequence

import optree
import torch

from . import tree as tree_util
from .errors import IndivisibleSpecError, SpecError, SpecTreeError

__all__ = ["P", "Rules", "rules", "shares", "SpecError", "SpecTreeError", "IndivisibleSpecError", "resolve_specs"]


class P(tuple):
    """A PartitionSpec: one entry per leading tensor dim, each None, an axis name or a tuple of names.

    Trailing dims that are not listed are replicated. ``P()`` is fully replicated.

    ``fsdp=(axes)``: the FSDP axes this parameter is stored sharded over, overriding the
    step's ``fsdp_axes`` for it; axes the entries name that are not among them are "stored
    and computed sharded" for this parameter. Expert parallelism borrows a data axis this
    way: ``P("ep", fsdp=("dp",))`` for experts, while dense params shard over ``("dp", "ep")``.

    ``granule=(g0, g1, ...)``: per dim, the size of the blocks its non-FSDP axes may not cut (a
    head's columns). A dim they do not divide is then split unevenly, whole blocks per rank, the
    first ranks one block more (``shares``): 5 heads over 2 ranks are 3 and 2. Each rank stores
    its block padded with zeros to the largest and the loss function sees its own block. Without
    it (None), such a dim is an :class:`IndivisibleSpecError`, as a function's own collectives
    may need equal blocks.

    Args:
        entries: per dim, None (replicated), a mesh axis name, or a tuple of names (the dim
            split over their product, outer axis first).
        fsdp: None (the step's ``fsdp_axes``), or the FSDP axes to store this param sharded over.
        granule: None, or per dim a positive int (or None: 1) that an uneven split keeps whole.

    Raises:
        SpecError: an entry that is none of those, ``fsdp`` not a tuple of names, or ``granule``
            not a tuple of positive ints. Axis names are checked against the mesh
            when the plan is made.
    """

    fsdp: tuple[str, ...] | None
    granule: tuple[int, ...] | None

    def __new__(cls, *entries: None | str | Sequence[str], fsdp: str | Sequence[str] | None = None,
                granule: Sequence[int | None] | None = None):
        norm = []
        for e in entries:
            if e is None or isinstance(e, str):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                norm.append(tuple(e) if len(e) != 1 else e[0])
            else:
                raise SpecError(
                    f"P entry {e!r} is not None, an axis name or a tuple of axis names"
                )
        out = super().__new__(cls, norm)
        if isinstance(fsdp, str):
            fsdp = (fsdp,)
        if fsdp is not None and not all(isinstance(a, str) for a in fsdp):
            raise SpecError(f"P(fsdp={fsdp!r}): give a tuple of mesh axis names")
        out.fsdp = None if fsdp is None else tuple(fsdp)
        if granule is not None:
            granule = tuple(1 if g is None else g for g in granule)
            if not all(type(g) is int and g > 0 for g in granule):
                raise SpecError(f"P(granule={granule!r}): give per dim a positive int (or None)")
        out.granule = granule
        return out

    def __repr__(self) -> str:
        extra = ([] if self.fsdp is None else [f"fsdp={self.fsdp!r}"]) + \
            ([] if self.granule is None else [f"granule={self.granule!r}"])
        return "P(" + ", ".join([repr(e) for e in self] + extra) + ")"

    def __eq__(self, other) -> bool:
        return (isinstance(other, tuple) and tuple.__eq__(self, other)
                and getattr(self, "fsdp", None) == getattr(other, "fsdp", None)
                and getattr(self, "granule", None) == getattr(other, "granule", None))

    def __hash__(self) -> int:
        return hash((tuple(self), self.fsdp, self.granule))

    def __reduce__(self):  # pickles (all_gather_object, spawn) keep fsdp and granule
        return (_make_p, (tuple(self), self.fsdp, self.granule))

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis named in the spec, in order of appearance."""
        out: list[str] = []
        for e in self:
            if e is None:
                continue
            out.extend((e,) if isinstance(e, str) else e)
        return tuple(out)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        e = self[dim] if dim < len(self) else None
        return () if e is None else ((e,) if isinstance(e, str) else tuple(e))


    def dim_granule(self, dim: int) -> int | None:
        """The blocks an uneven split of ``dim`` keeps whole; None: the dim must split evenly."""
        if self.granule is None:
            return None
        return self.granule[dim] if dim < len(self.granule) else 1


def _make_p(entries, fsdp, granule=None):
    return P(*entries, fsdp=fsdp, granule=granule)


def shares(size: int, parts: int, granule: int = 1) -> list[int]:
    """``size`` split over ``parts`` ranks in whole blocks of ``granule``, the first ranks one block
    more (numpy's array_split): 5 heads over 2 ranks are 3 and 2. What an uneven ``P(granule=)``
    gives each rank; the models' tensor parallelism reads it to know a rank's heads."""
    blocks, extra = divmod(size // granule, parts)
    return [(blocks + (i < extra)) * granule for i in range(parts)]


class Rules:
    """Regex rules on "/"-joined paths; the first pattern that matches (re.fullmatch) wins."""

    def __init__(self, pairs: Iterable[tuple[str, P]]):
        self.pairs = []
        for pattern, spec in pairs:
            if not isinstance(spec, P):
                raise SpecError(f"rule {pattern!r} maps to {spec!r}; specs must be hpf.P(...)")
            try:
                compiled = re.compile(pattern)
            except (re.error, TypeError) as e:
                raise SpecError(f"rule pattern {pattern!r} is not a regular expression ({e}); fix it, e.g. "
                                r"escape literal brackets and dots: r'blocks/\d+/w_q'") from None
            self.pairs.append((compiled, spec))

    def __call__(self, path: str) -> P:
        for pattern, spec in self.pairs:
            if pattern.fullmatch(path):
                return spec
        listed = ", ".join(repr(p.pattern) for p, _ in self.pairs)
        raise SpecError(
            f"no rule matches parameter {path!r} (patterns, in order: {listed}). "
            f"Add a rule for it, or end the list with a catch-all such as (r'.*', P())."
        )

    def __repr__(self) -> str:
        return "rules([" + ", ".join(f"({p.pattern!r}, {s!r})" for p, s in self.pairs) + "])"


def rules(pairs: Iterable[tuple[str, P]]) -> Rules:
    """``hpf.rules([(regex, P), ...])``: map parameter paths to specs, first match wins.

    Args:
        pairs: (regex, P) pairs; a regex must match the whole "/"-joined path (re.fullmatch).

    Returns:
        A callable ``path -> P`` to pass as ``param_specs``.

    Raises:
        SpecError: a pattern that is not a regular expression or a pair that maps to something
            that is not a ``P`` (here), or, when the plan is made, a path no pattern matches
            (the message lists the patterns).
    """
    return Rules(pairs)


def resolve_specs(
    params: Any, param_specs: Any, mesh_axes: Sequence[str], default: Callable[[torch.Tensor], P]
) -> dict[str, P]:
    """Resolve ``param_specs`` (None, Rules, a callable or a pytree of P) to ``{path: P}`` and check
    each spec against its tensor and the mesh. Errors name the path and the fix."""
    paths, leaves, treedef = tree_util.flatten(params)
    tree_util.check_leaves(params)
    if param_specs is None:
        specs = [default(leaf) for leaf in leaves]
    elif isinstance(param_specs, P):
        specs = [param_specs] * len(paths)
    elif callable(param_specs):
        specs = [param_specs(p) for p in paths]
    else:
        specs = _specs_from_tree(params, param_specs, paths)
    out = {}
    for path, leaf, spec in zip(paths, leaves, specs):
        _check_spec(path, leaf, spec, mesh_axes)
        out[path] = spec
    return out


def _specs_from_tree(params: Any, spec_tree: Any, paths: list[str]) -> list[P]:
    is_spec = lambda x: isinstance(x, P) or x is None  # noqa: E731
    spec_leaves, spec_def = optree.tree_flatten(spec_tree, is_leaf=is_spec, none_is_leaf=True)
    if spec_def != tree_util.structure(params):
        spec_paths = [tree_util.path_str(p) for p in optree.tree_paths(spec_tree, is_leaf=is_spec, none_is_leaf=True)]
        missing = sorted(set(paths) - set(spec_paths))
        extra = sorted(set(spec_paths) - set(paths))
        raise SpecTreeError(
            "param_specs tree does not have the structure of params: "
            f"paths without a spec: {missing[:5]}{'...' if len(missing) > 5 else ''}; "
            f"specs with no parameter: {extra[:5]}{'...' if len(extra) > 5 else ''}. "
            "Give one P per parameter leaf (same dict keys and list lengths), or use hpf.rules."
        )
    return [P() if s is None else s for s in spec_leaves]


def _check_spec(path: str, leaf: torch.Tensor, spec: Any, mesh_axes: Sequence[str]) -> None:
    if not isinstance(spec, P):
        raise SpecError(f"parameter {path!r}: spec {spec!r} is not an hpf.P; write P(...) instead")
    if len(spec) > leaf.dim():
        raise SpecError(
            f"parameter {path!r} has {leaf.dim()} dims (shape {tuple(leaf.shape)}) but its spec "
            f"{spec!r} has {len(spec)} entries; drop entries so there is at most one per dim"
        )
    seen: set[str] = set()
    for axis in spec.axes():
        if axis not in mesh_axes:
            raise SpecError(
                f"parameter {path!r}: spec {spec!r} names axis {axis!r}, which is not a mesh axis "
                f"(mesh axes: {tuple(mesh_axes)}); use one of those or add the axis to the Mesh"
            )
        if axis in seen:
            raise SpecError(
                f"parameter {path!r}: spec {spec!r} uses axis {axis!r} twice; a mesh axis can "
                f"split at most one dim once"
            )
        seen.add(axis)
    for axis in spec.fsdp or ():
        if axis not in mesh_axes:
            raise SpecError(f"parameter {path!r}: spec {spec!r} has fsdp axis {axis!r}, which is not a mesh "
                            f"axis (mesh axes: {tuple(mesh_axes)})")
