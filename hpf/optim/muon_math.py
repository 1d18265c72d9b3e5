"""The Muon math shared by Muon (full tensors) and DistMuon (flat shards), as batch functions and stages.

Momentum is elementwise and runs on shards; only ``orthogonalize`` needs whole matrices.
The momentum and update rules are torch.optim.Muon's (torch 2.13), so results match it.
``scale_by_muon`` is the same math as a stage (hpf.optim.transforms), which ``hpf.optim.muon``
chains and partitions with AdamW's. It imports neither optimizer.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Sequence, Union

import torch

from hpf_kernels import newton_schulz

from .. import tree as tree_util
from .stage import Transform

__all__ = ["MuonState", "ScaleByMuon", "scale_by_muon", "QKClip", "SCALES", "apply_muon_updates_", "check_qk_heads", "max_attn_logits", "muon_direction",
           "muon_momentum_", "orthogonalize", "qk_clip_", "qk_clip_factors", "update_scale"]

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


def qk_clip_factors(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """QK-Clip's gamma per head (flattened, fp64): tau / S_max for heads whose max logit S_max
    exceeded tau this step, 1 for the rest (Kimi K2, arXiv 2507.20534, MuonClip)."""
    s = max_logits.detach().reshape(-1).to(torch.float64).cpu()
    return torch.where(s > tau, tau / s, torch.ones_like(s))


def qk_clip_(pieces, gamma: torch.Tensor) -> None:
    """Scale q/k weights in place by gamma ** power of their head. ``pieces``: (flat piece of a
    param, the param's full shape, the piece's first index in the param's flat, (dim, head of each
    index along dim or -1, power)), so a shard's piece of a matrix scales as the whole would."""
    if bool((gamma == 1).all()):
        return
    for piece, shape, start, (dim, heads, power) in pieces:
        if piece.numel() == 0:
            continue
        index = torch.arange(start, start + piece.numel())
        head = heads[(index // math.prod(shape[dim + 1:])) % shape[dim]]
        factor = torch.where(head >= 0, gamma[head.clamp(min=0)] ** power, torch.ones((), dtype=torch.float64))
        piece.mul_(factor.to(device=piece.device, dtype=piece.dtype).view(piece.shape))


def check_qk_heads(qk_heads: dict, shapes: dict, heads: int | None = None) -> None:
    """Each QK-Clip entry names a param (path -> shape in ``shapes``) and one head per index of its dim."""
    for path, (dim, along, _) in qk_heads.items():
        if path not in shapes:
            raise ValueError(f"muon(qk_clip=...): qk_heads names {path!r}, which is not a param; pass the model's "
                             f"qk_heads(config) (e.g. hpf.models.gpt.qk_heads) for the params being trained")
        shape = shapes[path]
        if not -len(shape) <= dim < len(shape) or len(along) != shape[dim]:
            raise ValueError(f"muon(qk_clip=...): qk_heads[{path!r}] gives {len(along)} heads along dim {dim}, "
                             f"but the param has shape {tuple(shape)}")
        if heads is not None and int(along.max()) >= heads:
            raise ValueError(f"muon(qk_clip=...): qk_heads[{path!r}] names head {int(along.max())}, but the aux "
                             f"'max_attn_logit' has {heads} heads")


def max_attn_logits(aux: dict | None) -> torch.Tensor:
    """The step's 'max_attn_logit' aux, or an error that says how to get one."""
    if not aux or "max_attn_logit" not in aux:
        raise ValueError("muon(qk_clip=...) needs each step's max attention logits: make the loss return the aux "
                         "'max_attn_logit' (e.g. hpf.models.gpt.loss_for(config, max_logits=True)) and, outside "
                         "hpf.shard_step, pass update(..., aux=metrics_aux)")
    return aux["max_attn_logit"]


class MuonState(NamedTuple):
    count: torch.Tensor  # steps taken, a 0-dim int64 tensor (checkpointable, same on every rank)
    exp_avg: Any  # Muon params: momentum buffer; AdamW params: first moment
    exp_avg_sq: Any  # AdamW params: second moment; Muon params: an empty tensor (same tree everywhere)


@dataclass(frozen=True)
class ScaleByMuon(Transform):
    """Muon's step as a stage: momentum (torch.optim.Muon's lerp form, Nesterov or not), then
    Newton-Schulz of each matrix (same shapes batched), then ``params -= lr * scale(m, n) *
    direction``. Not elementwise: Newton-Schulz needs whole matrices, so on a plan's flat shards
    it runs as hpf.optim.DistMuon (``Muon.for_plan``), which calls this stage's ``momentum_``,
    ``orthogonalize`` and ``apply_`` on the pieces each rank holds or owns."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficients: Any = "keller"
    scale: Union[str, float] = "keller"
    compute_dtype: torch.dtype | None = None
    variant: str = "standard"
    fields = ("exp_avg",)  # the momentum buffer
    elementwise = False

    def momentum_(self, grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return muon_momentum_(grads, bufs, self.momentum, self.nesterov)

    def orthogonalize(self, matrices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return orthogonalize(matrices, ns_steps=self.ns_steps, coefficients=self.coefficients,
                             compute_dtype=self.compute_dtype, variant=self.variant)

    def apply_(self, params: Sequence[torch.Tensor], directions: Sequence[torch.Tensor], lr: float,
               weight_decay: float = 0.0, scale: Union[str, float, None] = None) -> None:
        apply_muon_updates_(params, directions, lr=lr, weight_decay=weight_decay,
                            scale=self.scale if scale is None else scale)

    def for_plan(self, plan, rank: int):
        raise ValueError("scale_by_muon on a plan's flat shards: Newton-Schulz needs whole matrices, and a shard "
                         "holds pieces; use hpf.optim.muon(...), whose plan form (hpf.optim.DistMuon) orthogonalizes "
                         "each split matrix once at its owner")

    def update(self, grads, state, params, hyper):
        directions = self.orthogonalize(self.momentum_(grads, state["exp_avg"]))
        self.apply_(params, directions, hyper.rate("scale_by_muon"))
        return grads, state


def scale_by_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, coefficients="keller",
                  scale: Union[str, float] = "keller", compute_dtype: torch.dtype | None = None,
                  variant: str = "standard") -> ScaleByMuon:
    return ScaleByMuon(momentum, nesterov, ns_steps, coefficients, scale, compute_dtype, variant)


@dataclass(frozen=True)
class QKClip(Transform):
    """QK-Clip as the stage after Muon's update (Kimi K2's MuonClip): each head whose max attention
    logit this step (the aux "max_attn_logit", ``hyper.aux``) exceeded ``tau`` has its query and
    key weights scaled by gamma ** power. ``heads``: the model's qk_heads(config), path -> (dim,
    head per index, power); resolved against the params (``for_params``), ``leaf_heads`` per leaf.
    Not elementwise (a head's index is of the whole param): on a plan's flat shards DistMuon
    clips each rank's pieces (its ``gamma``, hpf.optim.DistMuon)."""

    tau: float
    heads: dict = field(repr=False, compare=False)
    leaf_heads: tuple | None = field(default=None, repr=False, compare=False)
    name = "qk_clip"
    aux = ("max_attn_logit",)
    elementwise = False

    def gamma(self, aux: dict | None) -> torch.Tensor:
        """This step's per-head factors; raises (before any update) when the aux is missing or too short."""
        gamma = qk_clip_factors(max_attn_logits(aux), self.tau)
        for path, (_, along, _) in self.heads.items():
            if int(along.max()) >= gamma.numel():
                raise ValueError(f"muon(qk_clip=...): qk_heads[{path!r}] names head {int(along.max())}, but the "
                                 f"aux 'max_attn_logit' has {gamma.numel()} heads; pass the same model's qk_heads")
        return gamma

    def for_params(self, params: Any) -> "QKClip":
        paths, leaves, _ = tree_util.flatten(params)
        check_qk_heads(self.heads, dict(zip(paths, (p.shape for p in leaves))))
        return replace(self, leaf_heads=tuple(self.heads.get(p) for p in paths))

    def check(self, hyper) -> None:
        self.gamma(hyper.aux)

    def update(self, grads, state, params, hyper):
        qk_clip_([(p.view(-1), p.shape, 0, h) for p, h in zip(params, self.leaf_heads) if h is not None],
                 self.gamma(hyper.aux))
        return grads, state
