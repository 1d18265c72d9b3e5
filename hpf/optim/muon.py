"""Muon over a pytree of full tensors (single device), with an AdamW fallback.

Matrices (ndim >= 2; ndim > 2 is a batch of matrices over the leading dims, e.g. MoE experts
[E, m, n]) step along the orthogonalized momentum; vectors, embeddings and the head use AdamW.
The math is split into batch functions (muon_momentum_, orthogonalize, apply_muon_updates_;
AdamW.apply from hpf.optim.adamw for the rest) so the distributed Muon can run the same code on
the matrices an owner gathers: momentum is elementwise and works on shards, only orthogonalize
needs whole matrices.
The momentum and update rules are torch.optim.Muon's (torch 2.13), so results match it.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence, Union

import optree
import torch

from hpf_kernels import newton_schulz, resolve_coefficients

from ..checks import check_rate
from .adamw import AdamW, adamw, schedule_value

__all__ = [
    "muon", "Muon", "MuonState", "muon_momentum_", "orthogonalize", "muon_direction",
    "update_scale", "apply_muon_updates_", "default_use_adamw",
]

Schedule = Union[float, Callable[[int], float]]
ADAMW_PATH = re.compile(r"(^|/)(embed|pos|head)($|/)")
SCALES = ("keller", "original", "moonlight", "match_rms_adamw")


def default_use_adamw(path: str, tensor: torch.Tensor) -> bool:
    """Embeddings, positions and the output head stay on AdamW, as in Keller's and Moonlight's Muon."""
    return ADAMW_PATH.search(path) is not None


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
                  compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Newton-Schulz of each matrix; same-shape matrices (any leading batch dims) go in one batched call."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(matrices):
        groups[(tuple(m.shape[-2:]), m.dtype, m.device)].append(i)
    out: list[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for (shape, _, _), members in groups.items():
        parts = [matrices[i].reshape(-1, *shape) for i in members]
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        ortho = newton_schulz(stacked, coefficients, ns_steps, compute_dtype=compute_dtype)
        for i, piece in zip(members, ortho.split([p.shape[0] for p in parts])):
            out[i] = piece.view(matrices[i].shape)
    return out


def muon_direction(grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], *, momentum: float,
                   nesterov: bool = True, ns_steps: int = 5, coefficients="keller",
                   compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Momentum (bufs updated in place), then orthogonalization: Muon's unscaled step directions."""
    updates = muon_momentum_(grads, bufs, momentum, nesterov)
    return orthogonalize(updates, ns_steps=ns_steps, coefficients=coefficients,
                         compute_dtype=compute_dtype)


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


@dataclass(frozen=True)
class Muon:
    """Muon for tensors with ndim >= 2, AdamW for the rest and for paths use_adamw(path, t) picks.

    update(grads, state, params) changes params and state in place (donated, as with
    hpf.optim.adamw: no copy of the model, FSDP shards stay views into their buffers) and
    returns them.
    """

    lr: Schedule = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficients: Any = "keller"
    scale: Union[str, float] = "keller"
    weight_decay: float = 0.0
    adamw: AdamW = AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    use_adamw: Callable[[str, torch.Tensor], bool] = default_use_adamw
    ns_compute_dtype: torch.dtype | None = None
    comm_dtype: torch.dtype | None = None  # what matrix pieces travel in under shard_step (None: grads' dtype)

    def for_plan(self, plan, rank: int):
        """This optimizer on the flat shards of ``plan`` (hpf.shard_step calls it): distributed Muon."""
        from .dist_muon import DistMuon

        return DistMuon(self, plan, rank, self.comm_dtype)

    def on_muon(self, path: str, p: torch.Tensor) -> bool:
        return p.ndim >= 2 and not self.use_adamw(path, p)

    def check_rates(self, step: int) -> None:
        """Raise before a step changes anything if its lr or AdamW lr is not finite and >= 0."""
        schedule_value(self.lr, step, "muon: lr")
        schedule_value(self.adamw.lr, step, "muon: adamw_lr")

    def init(self, params: Any) -> MuonState:
        paths, leaves, treedef = _flatten(params, "params")
        exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        exp_avg_sq = [p.new_empty(0) if self.on_muon(path, p) else torch.zeros_like(p)
                      for path, p in zip(paths, leaves)]
        return MuonState(torch.zeros((), dtype=torch.int64), treedef.unflatten(exp_avg),
                         treedef.unflatten(exp_avg_sq))

    def update(self, grads: Any, state: MuonState, params: Any) -> tuple[Any, MuonState]:
        paths, leaves, treedef = _flatten(params, "params")
        grad_leaves = _leaves_like(grads, treedef, paths, leaves, "grads")
        avg = _leaves_like(state.exp_avg, treedef, paths, leaves, "state.exp_avg")
        avg_sq = optree.tree_leaves(state.exp_avg_sq)
        self.check_rates(int(state.count) + 1)
        state.count.add_(1)
        step = int(state.count)
        is_muon = [self.on_muon(path, p) for path, p in zip(paths, leaves)]

        def pick(xs, want):
            return [x for x, m in zip(xs, is_muon) if m == want]

        directions = muon_direction(pick(grad_leaves, True), pick(avg, True), momentum=self.momentum,
                                    nesterov=self.nesterov, ns_steps=self.ns_steps,
                                    coefficients=self.coefficients, compute_dtype=self.ns_compute_dtype)
        apply_muon_updates_(pick(leaves, True), directions, lr=schedule_value(self.lr, step),
                            weight_decay=self.weight_decay, scale=self.scale)
        self.adamw.apply(pick(leaves, False), pick(grad_leaves, False), pick(avg, False),
                         pick(avg_sq, False), step)
        return params, state


def muon(lr: Schedule = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
         coefficients="keller", scale: Union[str, float] = "keller", weight_decay: float = 0.0,
         adamw_lr: Schedule = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95),
         adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0,
         use_adamw: Callable[[str, torch.Tensor], bool] | None = None,
         ns_compute_dtype: torch.dtype | None = None, comm_dtype: torch.dtype | None = None) -> Muon:
    """hpf.optim.muon: an optax-style Muon (see Muon) with an AdamW fallback for non-matrices.

    lr and adamw_lr may be callables of the 1-based step, as in hpf.optim.adamw. scale: "keller"
    (torch's "original"), "moonlight" (torch's "match_rms_adamw") or a number. ns_compute_dtype:
    None = the kernel's choice for the device (fp32 on CPU, bf16 on accelerators). comm_dtype: the
    dtype split matrices travel in under hpf.shard_step, e.g. torch.bfloat16 (None: the grads').
    """
    resolve_coefficients(coefficients, ns_steps)  # bad coefficients fail here, not at step 1
    update_scale(1, 1, scale)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"muon: momentum must be in [0, 1), got {momentum!r}")
    for name, rate in (("lr", lr), ("adamw_lr", adamw_lr)):
        if not callable(rate):
            check_rate(rate, f"muon: {name}")
    if not weight_decay >= 0:
        raise ValueError(f"muon: weight_decay must be >= 0, got {weight_decay}")
    fallback = adamw(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
    return Muon(lr, momentum, nesterov, ns_steps, coefficients, scale, weight_decay, fallback,
                use_adamw or default_use_adamw, ns_compute_dtype, comm_dtype)


def _flatten(tree, what: str):
    raw_paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    paths = ["/".join(str(k) for k in path) for path in raw_paths]
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(f"{what} leaf {path!r} must be a floating-point torch.Tensor, "
                            f"got {type(leaf).__name__}")
    return paths, leaves, treedef


def _leaves_like(tree, treedef, paths, params, what: str) -> list[torch.Tensor]:
    """Leaves of `tree`, checked to have the params' structure and shapes (errors name the path)."""
    if optree.tree_structure(tree) != treedef:
        raise ValueError(f"{what} must have the same tree structure as params: got "
                         f"{optree.tree_structure(tree)}, expected {treedef}")
    leaves = optree.tree_leaves(tree)
    for path, leaf, p in zip(paths, leaves, params):
        if not isinstance(leaf, torch.Tensor) or leaf.shape != p.shape:
            got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(f"{what} at {path!r} has shape {got}, but the param has "
                             f"{tuple(p.shape)}")
    return leaves
