"""What one Newton-Schulz call costs, by variant, and which variant a shape picks.

The standard iteration multiplies on the long side s at every step; the Gram iteration
(backends.reference.gram_iteration) only at the start, at each restart and at the end, and
iterates r x r matrices in between (r <= s, the short side). FLOPs count 2 per multiply-add of
a dense matmul (no symmetric-product savings), the same for every backend.
"""
from __future__ import annotations

import math
from typing import Sequence

VARIANTS = ("standard", "gram", "auto")


def gram_restarts(steps: int) -> tuple[int, ...]:
    """Steps at which Gram Newton-Schulz rebuilds R from the long side: step 2, as Dao et al.'s
    code and DeepSpeed's Muon do (none when there are 2 steps or fewer)."""
    return (2,) if steps > 2 else ()


def newton_schulz_flops(shape: Sequence[int], steps: int, variant: str = "standard") -> int:
    """FLOPs of newton_schulz on a [..., m, n] batch with ``variant`` ("auto": the one it picks)."""
    r, s = sorted(shape[-2:])
    batch = math.prod(shape[:-2])
    variant = pick_variant(shape, steps, variant)
    if variant == "standard":  # per step: Y Yᵀ, A², B Y
        return batch * steps * (4 * r * r * s + 2 * r ** 3)
    restarts = gram_restarts(steps)
    long_side = 2 * r * r * s * (2 + 2 * len(restarts))  # R0, final Q Y, and Q Y + Y Yᵀ per restart
    short = 0
    for i in range(steps):
        short += 2 * r ** 3  # R²
        short += 0 if i == 0 or i in restarts else 2 * r ** 3  # Q q(R)
        short += 4 * r ** 3 if i + 1 < steps and i + 1 not in restarts else 0  # q(R) R q(R)
    return batch * (long_side + short)


def pick_variant(shape: Sequence[int], steps: int, variant: str) -> str:
    """"standard" or "gram": ``variant`` itself, or for "auto" the one with fewer FLOPs on this shape
    (Gram wins from an aspect ratio of about 1.5; square matrices stay standard)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Newton-Schulz variant {variant!r}; use one of {VARIANTS}")
    if variant != "auto":
        return variant
    gram, standard = (newton_schulz_flops(shape, steps, v) for v in ("gram", "standard"))
    return "gram" if gram < standard else "standard"
