"""The canonical summation order of ``shard_step(invariant=True)``: the same bits at any world size.

A step's grads are the sum of its atoms' grads (``atom_size`` examples each, the same shape at
every mesh). Floating-point addition is not associative, so the sum is taken in one fixed order,
a pairwise tree over the global atom index: node ``(start, size)`` covers atoms ``[start,
start + size)`` with ``size`` a power of two and ``start`` a multiple of it, and its value is its
left child plus its right child; a child wholly past the last atom is absent (the node is its
left child as it is). A rank sums its own atoms into the maximal aligned subtrees of its block
(``Partials``), and the ranks' subtrees meet in the same tree (``tree_sum``), so every partial
sum, inside a rank or across ranks, is a node of the one tree and the result does not depend on
how the atoms were spread. Elementwise adds are exact per element, so a tensor's slices sum as
the whole does.

The global grad norm is summed exactly instead (``exact_square_sum``): squares of floats are
exact in float64, and their sum is taken as integers in fixed point below the largest square,
so any order gives the same bits.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["aligned_blocks", "Partials", "tree_sum", "exact_square_sum",
           "exact_parts", "exact_total"]

Node = tuple[int, int]  # (first atom, number of atoms): a node of the canonical tree


def aligned_blocks(start: int, count: int) -> list[Node]:
    """The maximal aligned subtrees that tile atoms ``[start, start + count)``, left to right."""
    out = []
    while count > 0:
        size = start & -start if start else 1 << (count.bit_length() - 1)
        while size > count:
            size //= 2
        out.append((start, size))
        start, count = start + size, count - size
    return out


class Partials:
    """One rank's running sums of its atoms, as nodes of the canonical tree: after each atom, two
    sibling nodes on top merge (left + right), a binary counter, so at most log2(atoms) + 1 are held."""

    def __init__(self):
        self.nodes: list[tuple[Node, torch.Tensor]] = []

    def push(self, atom: int, value: torch.Tensor) -> None:
        """Add atom ``atom``'s value (its index in the global batch; atoms come in order). Kept, not copied."""
        node, v = (atom, 1), value
        while self.nodes:
            (start, size), left = self.nodes[-1]
            if size != node[1] or start + size != node[0] or start % (2 * size):
                break
            self.nodes.pop()
            node, v = (start, 2 * size), left.add_(v)
        self.nodes.append((node, v))

    def clear(self) -> None:
        self.nodes = []


def tree_sum(parts: dict[Node, torch.Tensor], n_atoms: int, add: Callable = torch.add) -> torch.Tensor:
    """The canonical tree's root over ``n_atoms``, from nodes that tile them (any rank's
    ``Partials``, all together)."""
    top = 1 << max(n_atoms - 1, 0).bit_length()

    def node(start: int, size: int):
        if (start, size) in parts:
            return parts[(start, size)]
        if start >= n_atoms:
            return None
        if size == 1:
            raise ValueError(f"tree_sum: atom {start} of {n_atoms} is missing from the parts {sorted(parts)}")
        left, right = node(start, size // 2), node(start + size // 2, size // 2)
        return left if right is None else add(left, right)
    return node(0, top)


# -- the exact sum of squares (the global grad norm) -----------------------------------------------------------
_LIMB = 31  # bits per limb
_LIMBS = 2  # 62 bits of fixed point below the largest square: a square under 2**-62 of it counts as 0
_CHUNK = 1 << 17  # elements summed at once: in cache, and a float64 sum of 2**22 limbs < 2**31 is exact
_PIECE = 21  # an integer is sent as 3 pieces of 21 bits, each summed exactly in float64 over up to 2**32 ranks


def exact_square_sum(tensors: list[torch.Tensor], top: float) -> list[int]:
    """This rank's sum of squares of ``tensors`` as ``_LIMBS`` integers in fixed point below
    2**e, where ``top`` (the largest square over every rank) < 2**e: exact, so the ranks' sums
    add up to the same integers in any order (``exact_parts`` carries them through a float64 sum)."""
    e = math.frexp(top)[1] if top > 0 else 0
    shift = _LIMB - e  # (one power of two, or two where one would leave float64's range: each product exact)
    scales = (2.0 ** shift,) if abs(shift) < 1000 else (2.0 ** (shift // 2), 2.0 ** (shift - shift // 2))
    sums = [0] * _LIMBS
    for x in tensors:
        for chunk in x.detach().reshape(-1).split(_CHUNK):
            t = chunk.to(torch.float64).square_()
            for scale in scales:
                t.mul_(scale)  # < 2**31
            for k in range(_LIMBS):
                limb = t.floor()
                sums[k] += int(limb.sum())  # (integers < 2**31, fewer than 2**22: exact in any order)
                if k + 1 < _LIMBS:
                    t.sub_(limb).mul_(2.0 ** _LIMB)
    return sums


def exact_parts(limbs: list[int]) -> list[float]:
    """The integers of ``exact_square_sum`` as floats whose float64 sum over ranks is exact."""
    mask = (1 << _PIECE) - 1
    return [float((v >> (_PIECE * j)) & mask) for v in limbs for j in range(3)]


def exact_total(parts: list[float], top: float) -> float:
    """The sum of squares from the summed ``exact_parts`` of every rank (and the same ``top``)."""
    e = math.frexp(top)[1] if top > 0 else 0
    limbs = [sum(int(parts[3 * k + j]) << (_PIECE * j) for j in range(3)) for k in range(_LIMBS)]
    total = sum(v << (_LIMB * (_LIMBS - 1 - k)) for k, v in enumerate(limbs))
    return math.ldexp(float(total), e - _LIMB * _LIMBS)
