"""The Muon math shared by Muon (full tensors) and DistMuon (flat shards), as batch functions.

Momentum is elementwise and runs on shards; only ``orthogonalize`` needs whole matrices.
The momentum and update rules are torch.optim.Muon's (torch 2.13), so results match it.
A leaf module: it imports neither optimizer.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple, Sequence, Union

import torch

from hpf_kernels import newton_schulz

__all__ = ["MuonState", "SCALES", "apply_muon_updates_", "muon_direction", "muon_momentum_", "orthogonalize",
           "update_scale"]

SCALES = ("keller", "original", "moonlight", "match_rms_adamw")


def update_scale(rows: int, cols: int, scale: Union[str, float]) -> float:
    """Multiplier on lr for one [rows, cols] matrix, so updates have a shape-independent RMS.

    "keller" / "original": sqrt(max(1, rows/cols)) (torch's "original");
    "moonlight" / "match_rms_adamw": 0.2 * sqrt(max(rows, cols)), RMS of AdamW's update; a number: itself.
    """
    if scale in ("keller", "original"):
        return math.sqrt(max(1, rows / cols))  # math.sqrt, as torch, so lr * scale rounds the same
    if scale in ("moonlight", "match_rms_adamw"):
        return 0.2 * math.sqrt(max(rows, cols))
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    raise ValueError(f"scale must be one of {SCALES} or a number, got {scale!r}")


def muon_momentum_(grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], momentum: float,
                   nesterov: bool) -> list[torch.Tensor]:
    """buf <- mu*buf + (1-mu)*g in place (torch.optim.Muon's lerp form); return what to orthogonalize.

    Elementwise, so it runs on shards as well as on full matrices.
    """
    if not grads:  # no matrix on Muon (a model of vectors only): AdamW does it all
        return []
    torch._foreach_lerp_(list(bufs), list(grads), 1 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(list(grads), list(bufs), momentum))
    return list(bufs)


def orthogonalize(matrices: Sequence[torch.Tensor], *, ns_steps: int = 5, coefficients="keller",
                  compute_dtype: torch.dtype | None = None, variant: str = "standard") -> list[torch.Tensor]:
    """Newton-Schulz of each matrix; same-shape matrices (any leading batch dims) go in one batched call."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(matrices):
        groups[(tuple(m.shape[-2:]), m.dtype, m.device)].append(i)
    out: list[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for (shape, _, _), members in groups.items():
        parts = [matrices[i].reshape(-1, *shape) for i in members]
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        ortho = newton_schulz(stacked, coefficients, ns_steps, compute_dtype=compute_dtype, variant=variant)
        for i, piece in zip(members, ortho.split([p.shape[0] for p in parts])):
            out[i] = piece.view(matrices[i].shape)
    return out


def muon_direction(grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], *, momentum: float,
                   nesterov: bool = True, ns_steps: int = 5, coefficients="keller",
                   compute_dtype: torch.dtype | None = None, variant: str = "standard") -> list[torch.Tensor]:
    """Momentum (bufs updated in place), then orthogonalization: Muon's unscaled step directions."""
    updates = muon_momentum_(grads, bufs, momentum, nesterov)
    return orthogonalize(updates, ns_steps=ns_steps, coefficients=coefficients,
                         compute_dtype=compute_dtype, variant=variant)


def apply_muon_updates_(params: Sequence[torch.Tensor], directions: Sequence[torch.Tensor], *,
                        lr: float, weight_decay: float, scale: Union[str, float]) -> None:
    """p *= 1 - lr*wd (decoupled), then p -= lr * scale(m, n) * direction, in place."""
    if weight_decay:
        torch._foreach_mul_(list(params), 1 - lr * weight_decay)
    by_step: dict[float, tuple[list, list]] = defaultdict(lambda: ([], []))
    for p, d in zip(params, directions):
        step = lr * update_scale(p.shape[-2], p.shape[-1], scale)
        by_step[step][0].append(p)
        by_step[step][1].append(d)
    for step, (ps, ds) in by_step.items():
        torch._foreach_add_(ps, ds, alpha=-step)


class MuonState(NamedTuple):
    count: torch.Tensor  # steps taken, a 0-dim int64 tensor (checkpointable, same on every rank)
    exp_avg: Any  # Muon params: momentum buffer; AdamW params: first moment
    exp_avg_sq: Any  # AdamW params: second moment; Muon params: an empty tensor (same tree everywhere)
